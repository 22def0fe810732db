"""Chat templates beside the tokenizer's: --chat-template's file or text, or one flashdraft ships."""

from __future__ import annotations

from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
CHATML_TOOLS = "chatml_tools"


def load_chat_template(value: str) -> str:
    """A chat template given as a shipped template's name, a file, or the template's text."""
    if value == CHATML_TOOLS:
        return (TEMPLATES / f"{CHATML_TOOLS}.jinja").read_text()
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat template {value!r} is neither a file, a template nor {CHATML_TOOLS!r}")
