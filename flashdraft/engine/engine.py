"""LLMEngine: requests in, tokens out, one `step()` at a time. The offline `LLM`, the CLI and the
server all drive this class."""

from __future__ import annotations

import logging
import time

import torch

from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.graphs import collect_before_capture, to_device
from flashdraft.engine.logits import StepLogprobs, choose, prompt_logprobs
from flashdraft.engine.model_runner import ModelRunner, plan_num_blocks, plan_state_slots, state_bytes_per_seq
from flashdraft.engine.prompts import encode_chat, encode_text
from flashdraft.engine.scheduler import Scheduler, kept_rows
from flashdraft.engine.sequence import Output, Sequence
from flashdraft.engine.startup import check_drafter, log_ready
from flashdraft.models.loader import load_config, load_model, resolve_model_dir
from flashdraft.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class InFlight:
    """A launched step's samples, one per sequence, not yet read by the host: on the device, and
    being copied to pinned host memory behind the step (an event marks the copy's end)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: StepLogprobs | None = None):
        self.seqs, self.tokens, self.logprobs = seqs, tokens, logprobs
        self.joining: InFlight | None = None  # requests admitted behind this step: their prefill's samples
        self.done = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:  # a snapshot: a static buffer's next step must not change what this one read
            self.host = tokens.clone()

    def next_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        """The device ids of the step after this one over `seqs` (a subsequence of this step's, then of
        the requests admitted behind it): each sequence's sample."""
        own, tokens = self.seqs, self.tokens
        if self.joining is not None:
            own, tokens = own + self.joining.seqs, torch.cat([tokens, self.joining.tokens])
        if len(seqs) == len(own):
            return tokens
        index = {id(s): i for i, s in enumerate(own)}
        return tokens[to_device([index[id(s)] for s in seqs], torch.long, tokens.device)]

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def shipped_drafter(model: str | None) -> str | None:
    """The drafter this project trained and ships for `model`: only the embedded default has one,
    whether named by None or given as its GGUF file (any path or name of the same file)."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-dflash"
    if not (path / "config.json").exists():
        return None
    return str(path) if model is None or _is_default_model(Path(model).expanduser()) else None


def _fingerprint(path) -> tuple[int, bytes]:
    """Size and the first and last MiB: tells the embedded GGUF from others without reading it all."""
    import hashlib

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        return size, hashlib.sha256(head + f.read()).digest()


def _is_default_model(path) -> bool:
    from flashdraft.models.loader import default_model_path

    if not path.is_file() or path.suffix != ".gguf":
        return False
    try:
        default = default_model_path()
    except FileNotFoundError:
        return False
    return path.stat().st_size == default.stat().st_size and _fingerprint(path) == _fingerprint(default)


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
                                self.ranks.tp if self.ranks is not None else None)
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
        self.spec = None
        if draft is not None:
            from flashdraft.speculative.loader import load_speculator

            self.spec = load_speculator(draft, self)
        else:  # ragged steps (prefill chunks beside decodes) replay graphs too
            self.runner.capture_ragged_graphs(("target", ()), self.runner.target_step(()), config.max_num_seqs,
                                              config.max_num_batched_tokens)
        self._seed = config.seed
        # plain decode steps overlap the host's work for the next one (step()); default: on CUDA
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self._inflight: InFlight | None = None
        self.stats = {"num_steps": 0, "num_preemptions": 0, "num_generated_tokens": 0, "num_overlapped_steps": 0}
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
        self._seed += 1
        seq = Sequence(ids, params, prompt if isinstance(prompt, str) else None, request_id,
                       seed=hash((self.config.seed, self._seed)) & 0x7FFFFFFFFFFFFFFF)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        if not seq.is_finished:
            seq.finish_reason = "abort"
            seq.finish_time = time.perf_counter()
            seq.text = self.detokenize(seq)
            self.scheduler.finish(seq)
            if self.spec is not None:
                self.spec.release(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (vLLM's name): later requests prefill their prompts whole."""
        self.block_manager.reset_prefix_cache()

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward over a scheduled batch; return the sequences that advanced (_step). Under
        tensor parallelism a step that fails because another rank exited says which."""
        if self.ranks is None:
            return self._step()
        try:
            return self._step()
        except RuntimeError as e:  # (torch.distributed's errors are RuntimeErrors)
            named = self.ranks.named(e)
            if named is e:
                raise
            raise named from e

    def _step(self) -> list[Sequence]:
        """Run one forward over a scheduled batch; return the sequences that advanced.

        With async scheduling (plain decoding), a step whose every row samples a token is left in
        flight: the next call launches the step after it first, its input ids the in-flight step's
        samples on the device (nothing waits for them), and only then reads those samples and
        commits them. The GPU thus always has the next step queued while the host schedules,
        fills buffers, checks stops and streams. A request that finishes at step N had a row in
        step N+1 too: that row's token is dropped (it was never committed), so stops stay exact."""
        if self.spec is not None:
            return self.spec.step()
        prev, self._inflight = self._inflight, None
        advanced: list[Sequence] = []
        if prev is not None:
            nxt = self._next_decode(prev, join=True)
            if nxt is not None:  # launched before prev is read: the GPU never waits on the host
                self._inflight = self._launch(nxt, [[0]] * len(nxt), prev.next_ids(nxt))
                self.stats["num_overlapped_steps"] += 1
                self._inflight.joining = self._launch_joining()  # waiting requests' prefill behind it
            advanced = self._complete_joining(prev) + self._complete(prev)
            if self._inflight is not None:
                return advanced
        batch = self.scheduler.schedule()
        self.stats["num_preemptions"] += len(batch.preempted)
        if not batch.seqs:
            return advanced
        tokens = [s.token_ids[s.num_computed_tokens: s.num_computed_tokens + n]
                  for s, n in zip(batch.seqs, batch.num_new_tokens)]
        launched = self._launch(batch.seqs, tokens)
        if launched is None:
            return advanced
        if self.async_scheduling and len(launched.seqs) == len(batch.seqs):
            self._inflight = launched
            return advanced
        return advanced + self._complete(launched)

    @torch.inference_mode()
    def _launch(self, seqs: list[Sequence], tokens: list[list[int]], ids: torch.Tensor | None = None
                ) -> InFlight | None:
        """Queue the target over `tokens` (each sequence's rows from num_computed_tokens on; `ids`:
        their values already on the device) and the sampling of every sequence whose rows reach its
        end; None when none does. Nothing here waits for the GPU. In inference mode, as the target's
        forward is: the head and the greedy choice take the fused kernels (with autograd on, the
        head ran through cuBLAS and the choice through torch's argmax, 25 us more a step at the
        Qwen3.5-4B shape on an H200)."""
        hidden, _, qsl = self.runner.forward(seqs, tokens, self.block_manager, input_ids=ids)
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            if s.prompt_logprobs is not None:
                prompt_logprobs(self.runner.model, hidden[qsl[i]: qsl[i + 1]], s, s.num_computed_tokens)
            s.num_computed_tokens += len(t)
        self.stats["num_steps"] += 1
        ready = [i for i, s in enumerate(seqs) if s.num_computed_tokens >= s.num_tokens]
        if not ready:
            return None
        rows = [qsl[i + 1] - 1 for i in ready]
        if rows != list(range(len(rows))):  # a decode batch samples rows 0..n-1: no gather
            hidden = hidden[to_device(rows, torch.long, self.device)]
        seqs = [seqs[i] for i in ready]
        # the position of the token drawn: one past the rows computed (the in-flight token included)
        positions = [s.num_computed_tokens for s in seqs]
        sb = self.runner.sampling_batch(seqs, positions)
        return InFlight(seqs, *choose(self.runner.model, hidden[: len(rows)], seqs, positions, sb, self.eos_token_ids))

    def _complete(self, step: InFlight) -> list[Sequence]:
        """Wait for a launched step's samples and commit them (a request finished or aborted since
        the launch takes none)."""
        advanced, toks = [], step.read()
        lps = step.logprobs.read(toks, step.seqs) if step.logprobs is not None else [None] * len(toks)
        for seq, tok, lp in zip(step.seqs, toks, lps):
            if not seq.is_finished:
                self.append_tokens(seq, [tok], [lp])
                advanced.append(seq)
        return advanced

    def _complete_joining(self, prev) -> list[Sequence]:
        """Commit the first tokens of the requests admitted behind the in-flight step `prev`, if any."""
        return self._complete(prev.joining) if prev.joining is not None else []

    def _next_decode(self, prev: InFlight, join: bool = False) -> list[Sequence] | None:
        """The sequences of the decode step after `prev`, when it can be scheduled before prev's
        samples are read: the running sequences are prev's, in order, less any that finished or were
        aborted since, then those admitted behind it (none still prefilling), no waiting request could
        be admitted (join: none whose whole prompt could not be prefilled behind the next step), and
        each has a page for its next token. A request that its last sample surely ends (max_tokens,
        the context window) gets no row; None when this is not such a step or no request is left."""
        sched, running = self.scheduler, self.scheduler.running
        if not self.follows(prev) or any(s.params.needs_logits for s in running):
            return None  # (processors and log-probabilities read the last step's tokens: it is read first)
        if sched.waiting and len(running) < sched.max_num_seqs and not (join and self._may_join(sched.waiting[0])):
            return None
        seqs = [s for s in running if not (
            (s.params.max_tokens is not None and s.num_output_tokens + 1 >= s.params.max_tokens)
            or s.num_tokens + 1 >= self.max_model_len)]
        if not seqs or len(seqs) > sched.max_num_batched_tokens:
            return None
        for s in seqs:
            if not self.block_manager.can_fit(s.seq_id, s.num_computed_tokens + 1):
                return None  # the scheduler decides whom to preempt, once prev is read
            self.block_manager.allocate(s.seq_id, s.num_computed_tokens + 1)
        return seqs

    def follows(self, prev) -> bool:
        """Whether the running requests are those of the in-flight step `prev` (an InFlight, or the
        speculator's VerifyInFlight) in order, less any that finished or were aborted since its launch,
        then those admitted behind it."""
        running, joining = self.scheduler.running, prev.joining.seqs if prev.joining is not None else []
        if joining and [id(s) for s in running[len(running) - len(joining):]] != [id(s) for s in joining]:
            return False  # (a request admitted behind prev was aborted)
        return kept_rows(prev.seqs, running[: len(running) - len(joining)]) is not None

    def _may_join(self, seq: Sequence) -> bool:
        """Whether a waiting request's whole prompt can be prefilled in one step of its own, launched
        behind a step in flight (with a drafter: by the speculator's rule, overlap.py)."""
        if self.spec is not None:
            return self.spec._may_join(seq)
        return not seq.params.needs_logits and \
            seq.num_tokens - seq.num_computed_tokens <= self.scheduler.max_num_batched_tokens

    def _launch_joining(self) -> InFlight | None:
        """Admit the waiting requests whose whole prompt fits now and queue their prefill as a step of
        its own, behind the step just launched (each request's first token sampled on the device);
        None when none is admitted."""
        sched = self.scheduler
        if not sched.waiting or not self._may_join(sched.waiting[0]):
            return None
        batch = sched.admit(reserve=1)
        if not batch.seqs:
            return None
        return self._launch(batch.seqs, [s.token_ids[s.num_computed_tokens: s.num_computed_tokens + n]
                                         for s, n in zip(batch.seqs, batch.num_new_tokens)])

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
            seq.token_times.append(now)
            if seq.logprobs is not None:
                seq.logprobs.append(logprobs[n - 1])
            self.stats["num_generated_tokens"] += 1
            reason, text = None, None
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                reason = "stop"
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
        if self.spec is not None:
            self.spec.release(seq)

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
