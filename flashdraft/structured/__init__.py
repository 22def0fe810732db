"""Structured outputs: a request's grammar (structured_outputs) compiled against the tokenizer
(grammar.py), and the masks it puts on every row that chooses a target token, a verify row's drafts
walked through the grammar first (masks.py)."""
