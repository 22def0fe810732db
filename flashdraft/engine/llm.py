"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from flashdraft.chat.template import load_chat_template
from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.engine.prompts import encode_chat
from flashdraft.engine.sequence import Output
from flashdraft.sampling_params import SamplingParams

# vLLM's prompt forms: text, token ids, or a TextPrompt / TokensPrompt dict of either
Prompt = str | list[int] | dict[str, Any]
PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _plain(prompt: Prompt) -> str | list[int]:
    """A prompt dict as the text or token ids it holds; other forms as they are (tokenize checks them)."""
    if not isinstance(prompt, dict):
        return prompt
    other = sorted(k for k in prompt if k not in PROMPT_KEYS)
    if other:
        raise ValueError(f"prompt key {other[0]!r} is not supported by flashdraft; a prompt dict holds 'prompt' "
                         "(text) or 'prompt_token_ids' (token ids)")
    if len(prompt) != 1:
        raise ValueError(f"a prompt dict holds one of 'prompt' (text) and 'prompt_token_ids' (token ids), "
                         f"got {'both' if prompt else 'neither'}")
    if "prompt" in prompt and not isinstance(prompt["prompt"], str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
    ids = prompt.get("prompt_token_ids", [])
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise ValueError("'prompt_token_ids' must be a list of token ids")
    return prompt["prompt"] if "prompt" in prompt else ids


class LLM:
    """model: HF folder, .gguf file, or None for the embedded SmolLM2 default.
    draft: DFlash drafter folder, "auto" (the drafter shipped for the model, if any) or None."""

    def __init__(self, model: str | None = None, draft: str | None = "auto", device: str | None = None,
                 dtype: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, draft=draft, device=device,
                                                         dtype=dtype, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Output]:
        """prompts: one or a list of vLLM's forms: a string, a list of token ids, {"prompt": str} or
        {"prompt_token_ids": [int, ...]}."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                       and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, a prompt dict or a list of these, "
                            f"got {type(prompts).__name__}")
        plain = [_plain(p) for p in prompts]  # a dict iterated would be its keys
        ids = [self.engine.tokenize(p) for p in plain]
        return self._run(plain, ids, params, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None,
             chat_template: str | None = None) -> list[Output]:
        """vLLM's names: chat_template_kwargs, variables for the chat template (e.g. enable_thinking); tools,
        OpenAI function tools for the template to write; chat_template, a template (its text, a file, or
        "chatml_tools", flashdraft's ChatML with tools) in place of the tokenizer's. The text comes back as
        the model wrote it (the server's --tool-call-parser reads the calls out of it)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        template = load_chat_template(chat_template) if chat_template is not None else None
        eng = self.engine
        ids = [encode_chat(eng.tokenizer, c, eng.model_dir, template_kwargs=chat_template_kwargs, tools=tools,
                           chat_template=template) for c in conversations]
        return self._run([None] * len(ids), ids, params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without params (vLLM's name): the model's generation_config.json
        defaults over SamplingParams' own (greedy), unless the engine's generation_config is "vllm"."""
        return self.engine.default_params()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache: later requests prefill their prompts whole."""
        self.engine.reset_prefix_cache()

    def _run(self, prompts: list, ids: list[list[int]], params, use_tqdm: bool) -> list[Output]:
        params = params if params is not None else self.get_default_sampling_params()
        plist = params if isinstance(params, list) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(ids)} prompts")
        for p, toks in zip(plist, ids):  # validate everything before anything is queued
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
            p.validate()
            self.engine.check_params(p)
            self.engine.check_prompt(toks)
        seqs = [self.engine.add_request(p if isinstance(p, str) else None, sp, prompt_token_ids=t)
                for p, sp, t in zip(prompts, plist, ids)]
        bar = tqdm(total=len(seqs), desc="generating", disable=not use_tqdm)
        try:
            while any(not s.is_finished for s in seqs):
                advanced = self.engine.step()
                bar.update(sum(1 for s in advanced if s.is_finished))
        except BaseException:
            for s in seqs:  # leave the engine usable
                self.engine.abort(s)
            raise
        finally:
            bar.close()
        return [self.engine.output(s) for s in seqs]
