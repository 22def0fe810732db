"""LLMEngine: requests in, tokens out, one `step()` at a time. The offline `LLM`, the CLI and the
server all drive this class."""

from __future__ import annotations

import logging
import time

from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.decode import PlainSteps
from flashdraft.engine.graphs import collect_before_capture
from flashdraft.engine.memory import plan_num_blocks, plan_state_slots, state_bytes_per_seq
from flashdraft.engine.model_runner import ModelRunner
from flashdraft.engine.pipeline import Pipeline, StepContext
from flashdraft.engine.prompts import encode_chat, encode_text
from flashdraft.engine.scheduler import Scheduler
from flashdraft.engine.sequence import Output, Sequence
from flashdraft.engine.startup import check_drafter, log_ready, shipped_drafter
from flashdraft.models.loader import load_config, load_model, resolve_model_dir
from flashdraft.sampling_params import SamplingParams
from flashdraft.speculative.loader import load_speculator
from flashdraft.structured.grammar import Grammars

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        draft = shipped_drafter(config.model) if config.draft == "auto" else config.draft
        if draft is not None:  # before the target's weights: a bad drafter fails in seconds, not after them
            check_drafter(draft, config)
        self.ranks = None
        if config.tensor_parallel_size > 1:  # the other ranks start, load their share too (engine/parallel.py)
            from flashdraft.engine.parallel import Ranks
            from flashdraft.models.parallel import check_shardable

            folder = resolve_model_dir(config.model, config.revision, weights=config.load_format != "dummy")
            check_shardable(load_config(folder), config.tensor_parallel_size)  # before any rank starts
            self.ranks = Ranks(config, self.device)
        try:
            loaded = load_model(config.model, self.device, self.dtype, config.load_format, config.revision,
                                self.ranks.tp if self.ranks is not None else None, config.quantization,
                                config.kv_cache_dtype)
        except BaseException:
            self.shutdown()
            raise
        if self.ranks is not None:
            from flashdraft.engine.parallel import TPModel

            loaded.model = TPModel(loaded.model, self.ranks)
        self.model_dir = loaded.folder
        self.sampling_defaults = self._sampling_defaults(config.generation_config, loaded.folder)
        self.model_config = loaded.model.config  # the language model's (a composite config's text_config)
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.vocab_size = self.model_config.vocab_size
        self._grammars: Grammars | None = None
        model_max = int(getattr(self.model_config, "max_position_embeddings", 0) or 4096)
        if config.max_model_len is not None and config.max_model_len > model_max:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's context window {model_max}")
        max_len = config.max_model_len or model_max
        config.max_num_seqs = plan_state_slots(config, loaded.model, self.device, self.dtype)
        num_blocks = plan_num_blocks(config, loaded.model, self.device, self.dtype, max_len)
        # one sequence can never hold more tokens than the whole cache
        self.max_model_len = min(max_len, num_blocks * config.kv_block_size)
        state = state_bytes_per_seq(loaded.model, self.dtype)
        if state:  # hybrid targets: one recurrent-state slot per running sequence
            log.info("recurrent state: %d slots (max_num_seqs) x %.1f MiB = %.2f GiB beside %d KV pages of %d tokens",
                     config.max_num_seqs, state / 2**20, config.max_num_seqs * state / 2**30, num_blocks,
                     config.kv_block_size)
        caching = config.enable_prefix_caching is not False
        if state and config.enable_prefix_caching:
            log.warning("enable_prefix_caching: off for this hybrid target (its recurrent state is not in pages)")
        self.block_manager = BlockManager(num_blocks, config.kv_block_size, config.max_num_seqs if state else 0,
                                          prefix_caching=caching)
        self.scheduler = Scheduler(config, self.block_manager)
        if self.ranks is not None:  # the other ranks' KV pages: as many, of their KV heads
            self.ranks.send("setup", num_blocks, self.max_model_len, config.max_num_seqs)  # (and state slots)
        self.runner = ModelRunner(loaded.model, config, self.device, self.dtype, num_blocks, self.max_model_len)
        collect_before_capture(self.device)
        self.runner.capture_graphs(("target", ()), 1, True, self.runner.attn, self.runner.target_step(()),
                                   config.max_num_seqs)
        self.ctx = StepContext(config, self.runner, self.scheduler, self.block_manager, self.max_model_len,
                               self.eos_token_ids, self.append_tokens,
                               # launch the next step before reading the last (engine/pipeline.py); default: on CUDA
                               config.async_scheduling if config.async_scheduling is not None
                               else self.device.type == "cuda")
        self.stats = self.ctx.stats
        self.spec = load_speculator(draft, self.ctx) if draft is not None else None
        if self.spec is None:  # ragged steps (prefill chunks beside decodes) replay graphs too
            self.runner.capture_ragged_graphs(("target", ()), self.runner.target_step(()), config.max_num_seqs,
                                              config.max_num_batched_tokens)
        self.pipeline = Pipeline(self.ctx, self.spec if self.spec is not None else PlainSteps(self.ctx))
        self._seed = config.seed
        log_ready(self, draft)

    @staticmethod
    def _sampling_defaults(source: str, folder) -> dict:
        """SamplingParams fields a request that leaves them unset takes (generation_config, as vLLM)."""
        from pathlib import Path

        from flashdraft.models.loader import generation_defaults

        if source == "vllm":
            return {}
        if source != "auto" and not (Path(source) / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be auto, vllm or a folder with a generation_config.json, "
                             f"got {source!r}")
        defaults = generation_defaults(folder if source == "auto" else Path(source))
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the model's generation_config.json: {e}") from None
        if defaults:
            log.info("default sampling settings from generation_config.json: %s (generation_config='vllm' "
                     "turns them off)", defaults)
        return defaults

    def default_params(self, **fields) -> SamplingParams:
        """SamplingParams of `fields`, each field left out taken from the model's defaults (sampling_defaults)."""
        return SamplingParams(**{**self.sampling_defaults, **fields})

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (also done at exit); nothing to do on one device."""
        if self.ranks is not None:
            self.ranks.close()

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return encode_text(self.tokenizer, prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids")
        return list(prompt)

    def grammars(self) -> Grammars:
        """The grammar compiler of structured_outputs over this tokenizer, made when a request first asks."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size)
        return self._grammars

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against this model's vocabulary."""
        bad = sorted(t for t in params.logit_bias or {} if t >= self.vocab_size)
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")

    def apply_chat_template(self, messages: list[dict], **template_kwargs) -> list[int]:
        return encode_chat(self.tokenizer, messages, self.model_dir, template_kwargs=template_kwargs)

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_token_ids: list[int] | None = None) -> Sequence:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        self.check_params(params)
        ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        self.check_prompt(ids)
        grammar = self.grammars().request(params.structured_outputs) if params.constrained else None
        self._seed += 1
        seq = Sequence(ids, params, prompt if isinstance(prompt, str) else None, request_id,
                       seed=hash((self.config.seed, self._seed)) & 0x7FFFFFFFFFFFFFFF)
        seq.grammar = grammar
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
            seq.text = self.detokenize(seq)
            self.scheduler.finish(seq)

    @property
    def async_scheduling(self) -> bool:
        return self.ctx.async_scheduling

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (vLLM's name): later requests prefill their prompts whole."""
        self.block_manager.reset_prefix_cache()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one step (engine/pipeline.py); return the sequences that advanced. Under tensor
        parallelism a step that fails because another rank exited says which."""
        if self.ranks is None:
            return self.pipeline.step()
        try:
            return self.pipeline.step()
        except RuntimeError as e:  # (torch.distributed's errors are RuntimeErrors)
            named = self.ranks.named(e)
            if named is e:
                raise
            raise named from e

    def append_tokens(self, seq: Sequence, tokens: list[int], logprobs: list | None = None) -> int:
        """Commit tokens one by one, stopping exactly where plain decoding would. Returns how many
        were committed (fewer than given when the request finishes inside the run). logprobs: the
        tokens' TokenLogprob entries, for a request that asked for them."""
        if seq.logprobs is not None and (logprobs is None or len(logprobs) < len(tokens)):
            raise RuntimeError(f"request {seq.request_id}: tokens committed without their log-probabilities")
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        for n, tok in enumerate(tokens, 1):
            seq.token_ids.append(tok)
            if seq.grammar is not None:
                seq.grammar.commit(tok)
            seq.token_times.append(now)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[n - 1])
            self.stats["num_generated_tokens"] += 1
            reason, text = None, None
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                reason = "stop"
            elif seq.grammar is not None and seq.grammar.done:  # (its stop token taken, ignore_eos or not)
                reason = "stop" if seq.grammar.error is None else "error"
            elif p.stops and (text := self._text_before_stop(seq)) is not None:
                reason = "stop"
            elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or \
                    seq.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                self._finish(seq, reason, text)
                return n
        return len(tokens)

    def _text_before_stop(self, seq: Sequence) -> str | None:
        text = self.detokenize(seq)
        hits = [i for i in (text.find(s) for s in seq.params.stops) if i >= 0]
        return text[: min(hits)] if hits else None

    def detokenize(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _finish(self, seq: Sequence, reason: str, text: str | None = None) -> None:
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.text = text if text is not None else self.detokenize(seq)
        self.scheduler.finish(seq)

    def spec_totals(self) -> dict:
        """Engine-wide speculative counters (vLLM's meanings); all zero without a drafter."""
        if self.spec is None:
            return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                    "accepted_per_position": []}
        return self.spec.totals()

    def output(self, seq: Sequence) -> Output:
        out = seq.to_output()
        if not seq.is_finished:
            out.text = self.detokenize(seq)
        if self.spec is not None:
            out.metrics.update(self.spec.request_metrics(seq))
        return out
