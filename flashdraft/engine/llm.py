"""The offline API, with vLLM's names: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm

from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.engine.sequence import Output
from flashdraft.sampling_params import SamplingParams


class LLM:
    """model: HF folder, .gguf file, or None for the embedded SmolLM2 default.
    draft: DFlash drafter folder, "auto" (the drafter shipped for the model, if any) or None."""

    def __init__(self, model: str | None = None, draft: str | None = "auto", device: str | None = None,
                 dtype: str | None = None, **config: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, draft=draft, device=device,
                                                         dtype=dtype, **config))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[Output]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.tokenize(p) for p in prompts]
        return self._run(list(prompts), ids, params, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False) -> list[Output]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.engine.apply_chat_template(c) for c in conversations]
        return self._run([None] * len(ids), ids, params, use_tqdm)

    def _run(self, prompts: list, ids: list[list[int]], params, use_tqdm: bool) -> list[Output]:
        params = params if params is not None else SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(ids)
        if len(plist) != len(ids):
            raise ValueError(f"got {len(plist)} SamplingParams for {len(ids)} prompts")
        for p, toks in zip(plist, ids):  # validate everything before anything is queued
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params must be SamplingParams, got {type(p).__name__}")
            p.validate()
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
