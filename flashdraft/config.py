"""Engine configuration. The fields are the flags: the CLI, the server and `LLM(**kwargs)` all
build this one dataclass."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashdraft import settings
from flashdraft.config_flags import add_flags, flag, flag_kwargs, json_object, min_tau, no_flag, tree_size

log = logging.getLogger("flashdraft")

ATTENTION_BACKENDS = ("auto", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM's names (fp8: e4m3)
# max_num_batched_tokens' defaults. A CPU step's time grows with its tokens (SmolLM2 on 2 cores: one forward of
# 512 / 2048 / 4000 prompt tokens takes 0.7 / 6.3 / 22 s; the last 512-token chunk of a 4000-token prompt 4.2 s),
# and the engine reads stops and aborts between steps, so on a CPU a long prompt is cut finer.
GPU_BATCHED_TOKENS = 2048
CPU_BATCHED_TOKENS = 512


@dataclass
class EngineConfig:
    """Each field is a flag of `flashdraft generate | serve | bench` (config_flags.flag: its help and parse
    rules) or marked no_flag; the help text says what a user sets, the comments what the code does with it."""

    model: str | None = flag(None, "HF folder or .gguf file (default: embedded SmolLM2-135M)")
    draft: str | None = flag("auto", "DFlash drafter folder (default: the shipped one, if any)",
                             off={"--no-spec": "plain decoding, no drafter"})
    revision: str | None = flag(None, "branch, tag or commit of a hub id --model (default: main)")
    draft_revision: str | None = flag(None, "branch, tag or commit of a hub id --draft (default: main)")
    device: str | None = flag(None, "cpu, cuda, cuda:1 (default: cuda if available)")
    dtype: str | None = flag(None, "float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    max_model_len: int | None = flag(None, "context window in tokens (default: the model's max_position_embeddings)")
    max_num_seqs: int = flag(64, "requests running at once")
    # None: resolved in __post_init__ (CPU_BATCHED_TOKENS on a CPU, GPU_BATCHED_TOKENS elsewhere)
    max_num_batched_tokens: int | None = flag(
        None, "tokens per forward; longer prompts are prefilled in chunks (default: 2048 on a GPU, 512 on a CPU, "
              "where a step's time grows with it and stops and aborts wait for the step)")
    kv_block_size: int = no_flag(16)
    # overrides kv_cache_memory_gb
    num_kv_blocks: int | None = flag(None, "KV cache pages of 16 tokens (default: as many as the memory budget "
                                     "holds)")
    kv_cache_memory_gb: float | None = flag(None, "GiB for the KV cache (default: 85%% of the GPU memory free after "
                                                  "the weights; 2 on a CPU)")
    # the KV cache gets what the weights leave of the share, less the default's reserve (engine/memory.py
    # memory_budget)
    gpu_memory_utilization: float | None = flag(
        None, "share of the GPU's whole memory the engine may take (vLLM's); the KV cache gets 85%% of what the "
              "weights leave of it (default: unset, --kv-cache-memory-gb's default; ignored on a CPU)", metavar="F")
    num_speculative_tokens: int | None = flag(
        None, "drafts verified per step, 1 to the drafter's block size - 1 (default: all of them)", metavar="K")
    # sets draft, num_speculative_tokens, draft_revision and speculative_disable_batch_size (speculative_fields)
    speculative_config: dict | None = flag(
        None, 'vLLM\'s JSON object, e.g. \'{"method": "dflash", "model": DRAFTER, "num_speculative_tokens": K}\': '
              "model sets --draft, num_speculative_tokens --num-speculative-tokens, revision --draft-revision "
              "(default: unset)", type=json_object, metavar="JSON")
    # a token tree (speculative/tree.py) instead of the drafter's chain; "auto": settings.CPU_TREE
    speculative_tree_size: int | str | None = flag(
        "auto", "verify a token tree of N drafts per step, the drafter's N most likely continuations of its block, "
                "instead of its chain (1-63; off: the chain; default auto: on a CPU a tree of as many drafts as the "
                "chain, on CUDA the chain)", type=tree_size, metavar="N")
    # the paused steps are plain decode steps that keep the drafter's context current
    speculative_disable_batch_size: int | None = flag(
        None, "decode without drafts in steps where at least N requests are running (default: always draft)",
        metavar="N")
    # a number: the per-request gate (speculative/gate.py); "auto": the step gate instead (settings.STEP_GATE)
    speculative_min_acceptance_length: float | str | None = flag(
        "auto", "a request whose recent tokens per verify fall below TAU decodes without drafts for a while, then "
                "tries again (default auto: whole steps, while the batch's tau is below the break-even tau of the "
                "step costs, on CUDA measured at start, elsewhere timed while serving; 0 or off: never)",
        type=min_tau, metavar="TAU")
    # serve's --seed; generate and bench have a --seed of their own, for their requests' sampling
    seed: int = flag(0, "engine seed: sampled requests without a seed of their own draw from it",
                     names=("--seed",), dest="engine_seed", metavar="N", opt_in=True)
    attention_backend: str = flag("auto", "auto: triton on CUDA when it imports, else torch",
                                  choices=ATTENTION_BACKENDS)
    # replays captured steps (decode, verify, draft) on CUDA with the triton backend
    cuda_graphs: bool = flag(True, names=(), off={"--no-cuda-graphs": "run every step eagerly on CUDA",
                                                  "--enforce-eager": "vLLM's name for --no-cuda-graphs"})
    max_graph_batch: int = no_flag(256)  # larger batches run eagerly
    # launches the next decode step before reading the last one's tokens (engine.step)
    async_scheduling: bool | None = flag(
        None, "plain decoding: queue the next decode step before reading the last one's tokens, so the GPU never "
              "waits on the host (default: on for CUDA)")
    # "dummy" (vLLM's name): for timing models whose weights are not at hand; outputs are meaningless
    load_format: str = flag("auto", "dummy: random weights at config.json's shapes, target and drafter (timing only)",
                            choices=LOAD_FORMATS)
    # models/quant.py reads the checkpoint's quantization_config; vLLM's --quantization names it
    quantization: str | None = flag(
        None, "the checkpoint's quantization method, as vLLM names it (fp8, compressed-tensors, awq, gptq, mxfp4; "
              "default: what its config.json says); one that differs from the checkpoint's is refused")
    # the KV pages' dtype (memory.py, attention/torch_ref.py): fp8 pages hold twice the tokens
    kv_cache_dtype: str = flag(
        "auto", "the KV pages' dtype, vLLM's: auto (the model's), fp8 / fp8_e4m3 (float8 e4m3, values saturated at "
                "+-448, scaled by the checkpoint's k_scale / v_scale where it has them; target and drafter)",
        choices=KV_CACHE_DTYPES)
    # engine/block_manager.py; off for hybrid targets, whose recurrent state pages cannot restore
    enable_prefix_caching: bool | None = flag(
        None, "share the KV pages (and the drafter's context) of prompt prefixes between requests (default: on, "
              "except for hybrid targets)")
    # one process per device (engine/parallel.py)
    tensor_parallel_size: int = flag(
        1, "split the target over N GPUs of this host, one process each (vLLM's; on a CPU N processes)",
        names=("--tensor-parallel-size", "-tp"), metavar="N")
    # else (on GPUs) small messages go through torch's one-shot all-reduce over symmetric memory
    # (models/parallel.py ONE_SHOT_MAX_BYTES)
    disable_custom_all_reduce: bool = flag(
        False, "tensor parallel: sum through NCCL alone, not the one-shot all-reduce for small messages")
    # vLLM's; the fields read are temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens
    generation_config: str = flag(
        "auto", "default sampling settings of requests that leave them unset: auto, the model's "
                "generation_config.json; vllm, none (flashdraft's); or a folder's generation_config.json",
        metavar="auto|vllm|FOLDER")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names - {"enforce_eager"})
        if "enforce_eager" in kwargs:  # vLLM's LLM(enforce_eager=True): no CUDA graphs
            eager = kwargs.pop("enforce_eager")
            if not isinstance(eager, bool):
                raise ValueError(f"enforce_eager must be True or False, got {eager!r}")
            if kwargs.get("cuda_graphs", not eager) == eager:
                raise ValueError(f"enforce_eager={eager} and cuda_graphs={kwargs['cuda_graphs']} disagree: give one")
            kwargs["cuda_graphs"] = not eager
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            self._apply_speculative_config()
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is None:
            on_cpu = (self.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cpu")
            self.max_num_batched_tokens = CPU_BATCHED_TOKENS if on_cpu else GPU_BATCHED_TOKENS
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose auto, torch or triton")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported; choose "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose auto or dummy")
        if self.max_graph_batch < 1:
            raise ValueError(f"max_graph_batch must be >= 1, got {self.max_graph_batch}")
        if self.speculative_disable_batch_size is not None and self.speculative_disable_batch_size < 1:
            raise ValueError(f"speculative_disable_batch_size must be >= 1, got {self.speculative_disable_batch_size}")
        m = self.speculative_min_acceptance_length
        if m is not None and m != "auto" and (isinstance(m, (bool, str)) or not isinstance(m, (int, float))
                                             or not 1.0 <= m <= 1e6):
            raise ValueError(f"speculative_min_acceptance_length must be 'auto', None or a number >= 1 "
                             f"(tokens per verify step), got {m!r}")
        t = self.speculative_tree_size
        if t is not None and t != "auto":
            from flashdraft.speculative.tree import MAX_TREE_SIZE

            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_TREE_SIZE:
                raise ValueError(f"speculative_tree_size must be 'auto', None or an integer in [1, {MAX_TREE_SIZE}] "
                                 f"(drafts a verify checks), got {t!r}")
            if self.num_speculative_tokens is not None:
                raise ValueError("num_speculative_tokens (a chain's length) and speculative_tree_size (a tree's "
                                 "size) both set: choose one")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True, False or None (on for CUDA), "
                             f"got {self.async_scheduling!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        u = self.gpu_memory_utilization
        if u is not None:
            if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
                raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {u!r}")
            # one mechanism sizes the KV cache: a share of the device, or an explicit size, not both
            if self.kv_cache_memory_gb is not None or self.num_kv_blocks is not None:
                raise ValueError("gpu_memory_utilization and kv_cache_memory_gb / num_kv_blocks both size the KV "
                                 "cache: give one")

    def _apply_speculative_config(self) -> None:
        """Set the fields vLLM's speculative_config names; one given here too with another value is an
        error (draft=None: no drafter, so no speculative_config either)."""
        if self.draft is None:
            raise ValueError("speculative_config given with draft=None (--no-spec): choose one")
        defaults = {f.name: f.default for f in fields(self)}
        for name, value in speculative_fields(self.speculative_config).items():
            given = getattr(self, name)
            if given != defaults[name] and given != value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"speculative_config sets {name} to {value!r}, but {name} ({flag}) is {given!r}: "
                                 "give it in one place")
            setattr(self, name, value)

    def min_acceptance_length(self, device: torch.device) -> Callable[[int, float], float | None] | None:
        """The per-request acceptance gate's threshold as a function of (running requests, the
        request's temperature), None for a request it does not gate; or None for no per-request gate.
        "auto": none (the step gate decides for whole steps instead, speculative/gate.py StepGate)."""
        m = self.speculative_min_acceptance_length
        return None if m is None or m == "auto" else lambda num_running, temperature, m=float(m): m

    def tree_size(self, device: torch.device, block_size: int, chain_only: str | None = None) -> int | None:
        """Drafts of the token tree a verify checks, or None for the drafter's chain: "auto" is a tree of
        block_size - 1 on a CPU (settings.CPU_TREE) unless num_speculative_tokens shortens the chain, else the chain.
        chain_only: why this pair verifies chains (a DFlash2 drafter's selector picks each slot given the
        one before; a sliding-window target's rows attend by position, which tree rows do not follow),
        logged when a tree size was asked for."""
        t = self.speculative_tree_size
        if chain_only is not None:
            if t not in ("auto", None):
                log.warning("speculative_tree_size %s: %s", t, chain_only)
            return None
        if t == "auto":
            cpu = device.type == "cpu" and settings.CPU_TREE and self.num_speculative_tokens is None
            return block_size - 1 if cpu and block_size > 1 else None
        return t

    def resolved_attention_backend(self, device: torch.device) -> str:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose auto, torch or triton")
        if self.attention_backend != "auto":
            return self.attention_backend
        if device.type != "cuda":
            return "torch"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch"
        return "triton"

    def resolved_device(self) -> torch.device:
        if self.device is None:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"invalid device {self.device!r}: {e}") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} requested but CUDA is not available")
        return dev

    def resolved_kv_dtype(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The KV pages' dtype: the model's, or float8 e4m3."""
        return dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in table:
            raise ValueError(f"dtype must be one of {sorted(table)}, got {self.dtype!r}")
        return table[self.dtype]


# vLLM's speculative_config keys and the fields they set
SPECULATIVE_KEYS = {"model": "draft", "num_speculative_tokens": "num_speculative_tokens",
                    "revision": "draft_revision", "disable_by_batch_size": "speculative_disable_batch_size"}
# keys whose vLLM meaning changes nothing here at these values (None: at any value): accepted and logged
SPECULATIVE_NO_OPS: dict[str, tuple | None] = {"disable_padded_drafter_batch": None,
                                               "draft_tensor_parallel_size": (1, None), "quantization": (None,),
                                               "code_revision": (None,)}


def speculative_fields(spec: Any) -> dict[str, Any]:
    """The EngineConfig fields a vLLM speculative_config sets. Method "dflash" covers DFlash and DFlash2
    drafters alike (the drafter's config.json tells them apart); a key that would change what is run
    and is not implemented is refused by name."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
    method = spec.get("method", "dflash")
    if method != "dflash":
        hint = " (a DFlash2 drafter loads as method 'dflash': its config.json tells)" if method == "dflash2" else ""
        raise ValueError(f"speculative_config method {method!r} is not supported; flashdraft runs 'dflash'{hint}")
    out: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "method":
            continue
        if key in SPECULATIVE_KEYS:
            out[SPECULATIVE_KEYS[key]] = value
        elif key in SPECULATIVE_NO_OPS and (SPECULATIVE_NO_OPS[key] is None or value in SPECULATIVE_NO_OPS[key]):
            log.info("speculative_config %s=%r changes nothing in flashdraft; ignored", key, value)
        else:
            raise ValueError(f"speculative_config key {key!r} (= {value!r}) is not supported by flashdraft; "
                             f"supported: method, {', '.join(SPECULATIVE_KEYS)}")
    if not isinstance(out.get("draft", ""), str) or not isinstance(out.get("draft_revision", ""), (str, type(None))):
        raise ValueError("speculative_config model and revision must be strings")
    k = out.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"speculative_config num_speculative_tokens must be an integer >= 1, got {k!r}")
    return out


# ---- the fields as command-line flags (flashdraft generate | serve | bench) ----------------------
def add_engine_args(p: argparse.ArgumentParser, seed: bool = False) -> None:
    """seed: add --seed, the engine's seed (vLLM's); generate and bench have a --seed of their own, for
    their requests' sampling."""
    add_flags(p, EngineConfig, opt_in=("seed",) if seed else ())


def engine_kwargs(args: argparse.Namespace) -> dict:
    return flag_kwargs(args, EngineConfig)
