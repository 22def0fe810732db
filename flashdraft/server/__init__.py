"""OpenAI-compatible HTTP server: `flashdraft serve`, or `build_app(engine)` for an ASGI app.

Imports stay lazy so that `import flashdraft` does not pull in FastAPI."""
