"""Prompts to token ids: one implementation for the engine's `tokenize` / `apply_chat_template` and for the
server, which tokenizes off the engine thread on its own copy of the tokenizer."""

from __future__ import annotations

from typing import Any

# apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "messages",
})


def encode_text(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    if not prompt:
        raise ValueError("prompt is empty")
    return tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids


def encode_chat(tokenizer: Any, messages: list[dict], source: object = "the model", *,
                add_generation_prompt: bool = True, add_special_tokens: bool = False,
                template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
                chat_template: str | None = None) -> list[int]:
    """The conversation rendered by the tokenizer's chat template (or `chat_template`), then tokenized.
    template_kwargs go to the template as variables (e.g. Qwen3's enable_thinking); a template ignores the
    ones it does not use. tools: OpenAI function tools, for the template to write."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError("a conversation must be a non-empty list of {'role', 'content'} messages")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"the tokenizer of {source} has no chat template; pass raw prompts")
    extra = dict(template_kwargs or {})
    clash = sorted(TEMPLATE_ARGUMENTS & set(extra))
    if clash:
        raise ValueError(f"chat template argument {clash[0]!r} cannot be set through chat_template_kwargs")
    if tools:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)
    return tokenizer(text, add_special_tokens=add_special_tokens).input_ids
