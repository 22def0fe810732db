"""Engine configuration. The fields are the flags: the CLI, the server and `LLM(**kwargs)` all
build this one dataclass."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from flashdraft import settings

log = logging.getLogger("flashdraft")


@dataclass
class EngineConfig:
    model: str | None = None  # HF folder, .gguf file, or None for the embedded SmolLM2 default
    draft: str | None = "auto"  # DFlash drafter folder, "auto" (shipped drafter if any) or None
    revision: str | None = None  # branch, tag or commit of `model` when it is a hub id (None: main)
    draft_revision: str | None = None  # the same for `draft`
    device: str | None = None  # None: cuda if available else cpu
    dtype: str | None = None  # None: bfloat16 on cuda, float32 on cpu
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64  # running sequences per step
    max_num_batched_tokens: int = 2048  # tokens per forward; longer prompts are chunked
    kv_block_size: int = 16
    num_kv_blocks: int | None = None  # explicit KV budget in blocks (overrides kv_cache_memory_gb)
    kv_cache_memory_gb: float | None = None  # None: 2 GiB on cpu, 85% of free memory on cuda
    # vLLM's: the share of the GPU's whole memory the engine may take; the KV cache gets what the weights
    # leave of it, less the default's reserve (engine/memory.py memory_budget); None: kv_cache_memory_gb's default
    gpu_memory_utilization: float | None = None
    num_speculative_tokens: int | None = None  # None: block_size - 1 of the drafter
    # vLLM's {"method": "dflash", "model": ..., "num_speculative_tokens": ..., "revision": ...}: sets draft,
    # num_speculative_tokens and draft_revision (speculative_fields)
    speculative_config: dict | None = None
    # verify a token tree of this many drafts per step instead of the drafter's chain (speculative/tree.py):
    # the drafter's most likely continuations of its block, best first; None: the chain; "auto": settings.CPU_TREE
    speculative_tree_size: int | str | None = "auto"
    # pause speculation for a step when at least this many requests are running (plain decode
    # steps, drafter context kept current); None: always speculate
    speculative_disable_batch_size: int | None = None
    # per request: decode without drafts for a while when its recent tau (tokens per verify) falls
    # below this (speculative/gate.py); "auto": whole steps without drafts while the batch's tau is
    # below the break-even tau of the step costs (settings.STEP_GATE); a number: that threshold for every
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
    # share full KV pages between requests with the same prefix, the drafter's context with them
    # (engine/block_manager.py); None: on, except for hybrid targets, whose recurrent state pages cannot restore
    enable_prefix_caching: bool | None = None
    # split the target over this many devices (one process each; engine/parallel.py); vLLM's name
    tensor_parallel_size: int = 1
    # vLLM's: sum every tensor-parallel message through NCCL; else (on GPUs) small messages go through torch's
    # one-shot all-reduce over symmetric memory (models/parallel.py ONE_SHOT_MAX_BYTES)
    disable_custom_all_reduce: bool = False
    # vLLM's: where requests that leave sampling fields unset take them from: "auto", the model folder's
    # generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); "vllm",
    # nowhere (flashdraft's own defaults); or a folder holding a generation_config.json
    generation_config: str = "auto"

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
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.kv_block_size < 1:
            raise ValueError(f"kv_block_size must be >= 1, got {self.kv_block_size}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
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


# ---- the same fields as command-line flags (flashdraft generate | serve | bench) --------------------
def add_engine_args(p: argparse.ArgumentParser, seed: bool = False) -> None:
    """seed: add --seed, the engine's seed (vLLM's); generate and bench have a --seed of their own, for
    their requests' sampling."""
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default="auto", help="DFlash drafter folder (default: the shipped one, if any)")
    p.add_argument("--revision", default=None, help="branch, tag or commit of a hub id --model (default: main)")
    p.add_argument("--draft-revision", default=None, help="branch, tag or commit of a hub id --draft (default: main)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context window in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens per forward; longer prompts are prefilled in chunks")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache pages of 16 tokens (default: as many as the memory budget holds)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="GiB for the KV cache (default: 85%% of the GPU memory free after the weights; 2 on a CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="share of the GPU's whole memory the engine may take (vLLM's); the KV cache gets 85%% of "
                        "what the weights leave of it (default: unset, --kv-cache-memory-gb's default; ignored on "
                        "a CPU)")
    if seed:
        p.add_argument("--seed", dest="engine_seed", type=int, default=0, metavar="N",
                       help="engine seed: sampled requests without a seed of their own draw from it")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="default sampling settings of requests that leave them unset: auto, the model's "
                        "generation_config.json; vllm, none (flashdraft's); or a folder's generation_config.json")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the target over N GPUs of this host, one process each (vLLM's; on a CPU N processes)")
    p.add_argument("--disable-custom-all-reduce", action="store_true",
                   help="tensor parallel: sum through NCCL alone, not the one-shot all-reduce for small messages")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: triton on CUDA when it imports, else torch")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly on CUDA")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's name for --no-cuda-graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plain decoding: queue the next decode step before reading the last one's tokens, so the "
                        "GPU never waits on the host (default: on for CUDA)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights at config.json's shapes, target and drafter (timing only)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV pages (and the drafter's context) of prompt prefixes between requests "
                        "(default: on, except for hybrid targets)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="drafts verified per step, 1 to the drafter's block size - 1 (default: all of them)")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='vLLM\'s JSON object, e.g. \'{"method": "dflash", "model": DRAFTER, "num_speculative_tokens": '
                        'K}\': model sets --draft, num_speculative_tokens --num-speculative-tokens, revision '
                        '--draft-revision (default: unset)')
    p.add_argument("--speculative-tree-size", type=_tree_size, default="auto", metavar="N",
                   help="verify a token tree of N drafts per step, the drafter's N most likely continuations of "
                        "its block, instead of its chain (1-63; off: the chain; default auto: on a CPU a tree of "
                        "as many drafts as the chain, on CUDA the chain)")
    p.add_argument("--speculative-disable-batch-size", type=int, default=None, metavar="N",
                   help="decode without drafts in steps where at least N requests are running (default: "
                        "always draft)")
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
                gpu_memory_utilization=args.gpu_memory_utilization,
                cuda_graphs=not (args.no_cuda_graphs or args.enforce_eager), async_scheduling=args.async_scheduling,
                load_format=args.load_format, enable_prefix_caching=args.enable_prefix_caching,
                revision=args.revision, draft_revision=args.draft_revision,
                num_speculative_tokens=args.num_speculative_tokens,
                speculative_tree_size=args.speculative_tree_size,
                speculative_disable_batch_size=args.speculative_disable_batch_size,
                speculative_min_acceptance_length=args.speculative_min_acceptance_length,
                speculative_config=args.speculative_config, tensor_parallel_size=args.tensor_parallel_size,
                disable_custom_all_reduce=args.disable_custom_all_reduce,
                generation_config=args.generation_config,
                **({"seed": args.engine_seed} if hasattr(args, "engine_seed") else {}))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object {{...}}, got {text!r}")
    return value


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
