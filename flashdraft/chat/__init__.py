"""Chat beyond plain text: tool calls in what a model writes (tool_calls.py), its reasoning apart from
its answer (reasoning.py), and the grammars that force a tool call or constrain the answer after the
reasoning (grammars.py)."""
