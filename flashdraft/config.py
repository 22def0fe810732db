"""Engine configuration. The fields are the flags: the CLI, the server and `LLM(**kwargs)` all
build this one dataclass."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

log = logging.getLogger("flashdraft")

# speculative_tree_size="auto" on a CPU: a token tree of as many drafts as the drafter's chain (B - 1), so a
# verify checks the chain's rows and commits more (the shipped drafter, 2-core CPU, fp32, 6 prompts x 96 tokens:
# HumanEval tau 3.82 against 3.40, 39.5-39.9 against 32.7-37.0 tok/s one at a time; MT-Bench 2.48 against 2.14,
# 28.1-29.7 against 19.5-26.5 tok/s; docs/performance.md section 4). On CUDA the chain: a tree step there
# still costs ~0.8 ms more than the chain's, more than its extra tokens save.
CPU_TREE = True
# speculative_min_acceptance_length="auto", on every device: whole steps decode without drafts while the
# batch's tau is below the break-even tau of what the steps cost (speculative/costs.py, gate.py StepGate):
# on CUDA with captured graphs measured at start and refined while serving, elsewhere (a CPU, eager
# CUDA, token trees) timed while serving; so that drafts that miss (a drafter out of its domain, a
# batch large enough for verify rows to cost real work) stop costing steps.
STEP_GATE = True


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2 default
    draft: str | None = "auto"  # DFlash drafter folder, "auto" (shipped drafter if any) or None
    device: str | None = None  # None: cuda if available else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens per forward; longer prompts are chunked
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # explicit KV budget in blocks (overrides kv_cache_memory_gb)
    kv_cache_memory_gb: float | None = None  # None: 2 GiB on cpu, 85% of free memory on cuda
    num_speculative_tokens: int | None = None  # None: block_size - 1 of the drafter
    # verify a token tree of this many drafts per step instead of the drafter's chain (speculative/tree.py):
    # the drafter's most likely continuations of its block, best first; None: the chain; "auto": CPU_TREE
    speculative_tree_size: int | str | None = "auto"
    # pause speculation for a step when at least this many requests are running (plain decode
    # steps, drafter context kept current); None: always speculate
    speculative_disable_batch_size: int | None = None
    # per request: decode without drafts for a while when its recent tau (tokens per verify) falls
    # below this (speculative/gate.py); "auto": whole steps without drafts while the batch's tau is
    # below the break-even tau of the step costs (STEP_GATE); a number: that threshold for every
    # request; None: never
    speculative_min_acceptance_length: float | str | None = "auto"
    seed: int = 0
    attention_backend: str = "auto"  # "auto": triton on CUDA when it imports, else torch
    cuda_graphs: bool = True  # replay captured steps (decode, verify, draft) on CUDA with the triton backend
    max_graph_batch: int = 256  # larger batches run eagerly
    # plain decoding: launch the next decode step before reading the last one's tokens (the host's
    # scheduling overlaps the GPU; engine.step); None: on CUDA
    async_scheduling: bool | None = None
    # "auto": the folder's weights; "dummy" (vLLM's name): random weights at the shapes of config.json,
    # target and drafter, for timing models whose weights are not at hand (outputs are meaningless)
    load_format: str = "auto"

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose auto, torch or triton")
        if self.load_format not in ("auto", "dummy"):
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

    def min_acceptance_length(self, device: torch.device) -> Callable[[int, float], float | None] | None:
        """The per-request acceptance gate's threshold as a function of (running requests, the
        request's temperature), None for a request it does not gate; or None for no per-request gate.
        "auto": none (the step gate decides for whole steps instead, speculative/gate.py StepGate)."""
        m = self.speculative_min_acceptance_length
        return None if m is None or m == "auto" else lambda num_running, temperature, m=float(m): m

    def tree_size(self, device: torch.device, block_size: int, chain_only: str | None = None) -> int | None:
        """Drafts of the token tree a verify checks, or None for the drafter's chain: "auto" is a tree of
        block_size - 1 on a CPU (CPU_TREE) unless num_speculative_tokens shortens the chain, else the chain.
        chain_only: why this pair verifies chains (a DFlash2 drafter's selector picks each slot given the
        one before; a sliding-window target's rows attend by position, which tree rows do not follow),
        logged when a tree size was asked for."""
        t = self.speculative_tree_size
        if chain_only is not None:
            if t not in ("auto", None):
                log.warning("speculative_tree_size %s: %s", t, chain_only)
            return None
        if t == "auto":
            cpu = device.type == "cpu" and CPU_TREE and self.num_speculative_tokens is None
            return block_size - 1 if cpu and block_size > 1 else None
        return t

    def resolved_attention_backend(self, device: torch.device) -> str:
        if self.attention_backend not in ("auto", "torch", "triton"):
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

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in table:
            raise ValueError(f"dtype must be one of {sorted(table)}, got {self.dtype!r}")
        return table[self.dtype]


# ---- the same fields as command-line flags (flashdraft generate | serve | bench) --------------------
def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default="auto", help="DFlash drafter folder (default: the shipped one, if any)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on CUDA when it imports, else torch")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly on CUDA")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plain decoding: queue the next decode step before reading the last one's tokens, so the "
                        "GPU never waits on the host (default: on for CUDA)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights at config.json's shapes, target and drafter (timing only)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts verified per step, 1 to the drafter's block size - 1 (default: all of them)")
    p.add_argument("--speculative-tree-size", type=_tree_size, default="auto", metavar="N",
                   help="verify a token tree of N drafts per step, the drafter's N most likely continuations of "
                        "its block, instead of its chain (1-63; off: the chain; default auto: on a CPU a tree of "
                        "as many drafts as the chain, on CUDA the chain)")
    p.add_argument("--speculative-disable-batch-size", type=int, default=None, metavar="N",
                   help="decode without drafts in steps where at least N requests are running")
    p.add_argument("--speculative-min-acceptance-length", type=_min_tau, default="auto", metavar="TAU",
                   help="a request whose recent tokens per verify fall below TAU decodes without drafts for a "
                        "while, then tries again (default auto: whole steps, while the batch's tau is below the "
                        "break-even tau of the step costs, on CUDA measured at start, elsewhere timed while "
                        "serving; 0 or off: never)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, draft=None if args.no_spec else args.draft, device=args.device,
                dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_gb=args.kv_cache_memory_gb, attention_backend=args.attention_backend,
                cuda_graphs=not args.no_cuda_graphs, async_scheduling=args.async_scheduling,
                load_format=args.load_format,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_tree_size=args.speculative_tree_size,
                speculative_disable_batch_size=args.speculative_disable_batch_size,
                speculative_min_acceptance_length=args.speculative_min_acceptance_length)


def _tree_size(text: str) -> int | str | None:
    if text == "auto":
        return text
    if text in ("0", "off", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of drafts, auto or off, got {text!r}") from None


def _min_tau(text: str) -> float | str | None:
    if text in ("auto",):
        return text
    if text in ("0", "off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number >= 1, got {text!r}") from None
    if not 1.0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number >= 1, got {text!r}")
    return value
