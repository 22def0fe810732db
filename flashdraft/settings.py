"""Process-wide switches: the defaults behind "auto" and the FLASHDRAFT_* environment variables, read in
this one module so an A/B run, a sweep or a test changes them in one place (`settings.NAME = value`, or
the variable before start). Engine options are EngineConfig fields (flashdraft/config.py), not these:
a switch here changes how a result is computed or timed, never which result a request gets."""

from __future__ import annotations

import os
from pathlib import Path


def env_int(name: str, default: int | None) -> int | None:
    """An integer FLASHDRAFT_* variable, with the variable named when it is not one."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """A FLASHDRAFT_* variable that takes one of `choices`, with the variable named when it does not."""
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def env_ints(name: str) -> tuple[int, ...] | None:
    """A comma-separated list of integers (FLASHDRAFT_* tile triples), None when unset or empty."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return tuple(int(v) for v in raw.split(","))
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {raw!r}") from None


def interpreted() -> bool:
    """Whether Triton runs its kernels on CPU tensors (TRITON_INTERPRET=1, Triton's own switch: tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def cache_root() -> Path:
    """Where converted checkpoints are kept: FLASHDRAFT_CACHE, else $XDG_CACHE_HOME/flashdraft (read when
    asked: a test points it at a temporary folder)."""
    base = os.environ.get("FLASHDRAFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "flashdraft")
    return Path(base)


# speculative_tree_size="auto" on a CPU: a token tree of as many drafts as the drafter's chain (B - 1), so a
# verify checks the chain's rows and commits more (the shipped drafter, 2-core CPU, fp32: HumanEval tau 3.86
# against 3.43, MT-Bench 2.37 against 2.06; docs/performance.md section 4). On CUDA the chain: a tree of 15
# serves the shipped pair within a few percent of it (its larger verify costs about what its extra tokens
# save), and bf16 trees part from plain decoding's outputs far more often than the chain.
CPU_TREE = True
# speculative_min_acceptance_length="auto", on every device: whole steps decode without drafts while the
# batch's tau is below the break-even tau of what the steps cost (speculative/costs.py, policy.py StepGate
# via gate.py): on CUDA with captured graphs measured at start and refined while serving, elsewhere timed
# while serving; so drafts that miss (a drafter out of its domain, a large batch) stop costing steps.
STEP_GATE = True
# sampled requests draw their drafts from the drafter's distribution at their temperature (speculative/
# drafts.py); off: they draft the argmax too (FLASHDRAFT_DRAW_SAMPLED=0, for A/B runs)
DRAW_SAMPLED = os.environ.get("FLASHDRAFT_DRAW_SAMPLED", "1") != "0"
# a constrained request's chain drafts are walked through its grammar (speculative/grammar_drafts.py): each
# slot's best candidate the grammar allows; off: drafted as if unconstrained (FLASHDRAFT_GRAMMAR_DRAFTS=0,
# A/B runs). Read at every step.
GRAMMAR_DRAFTS = os.environ.get("FLASHDRAFT_GRAMMAR_DRAFTS", "1") != "0"
# a greedy constrained request with no other processor verifies unmasked in the step graphs, its committed
# tokens checked through its grammar after the verify (structured/check.py); off: its verify rows are masked
# on the host and its drafts walked (FLASHDRAFT_GRAMMAR_CHECK=0, A/B runs). Read at every step.
GRAMMAR_CHECK = os.environ.get("FLASHDRAFT_GRAMMAR_CHECK", "1") != "0"

# FLASHDRAFT_FP8_GEMM=1: an FP8 checkpoint's dense layers (block-scaled, compressed-tensors per channel or
# tensor) keep their FP8 weights (half the weight memory), multiplied by kernels/fp8_gemm.py on CUDA
# (models/quant_serve.py). Off by default: that kernel still runs at 2-5x its weight bytes' roofline, slower
# than the bf16 GEMMs of the dequantized weights (H200, Qwen3-8B shapes, benchmarks/device/fp8_gemm.py;
# docs/performance.md section 6). FLASHDRAFT_INT4_GEMM=1: the same for 4-bit checkpoints (AWQ, GPTQ,
# compressed-tensors pack-quantized; a quarter of the memory) through kernels/int4_gemm.py, which has not been
# timed on a GPU yet. Read when a model loads.
FP8_GEMM = os.environ.get("FLASHDRAFT_FP8_GEMM", "0") == "1"
INT4_GEMM = os.environ.get("FLASHDRAFT_INT4_GEMM", "0") == "1"

# The kernels (flashdraft/kernels/): each switch is read when a launch or a dispatch asks for it, so a test
# or a sweep sets `settings.NAME` between calls. CUDA graphs keep what they were captured with.

# The fused Triton kernels of kernels/layer_ops.py (add+RMSNorm, q/k norm + RoPE + K/V store, silu*mul)
# replace the elementwise torch ops: "auto" for CUDA activations when triton imports, "on" also for CPU
# tensors under TRITON_INTERPRET=1 (tests), "off" never. No backward: never with grad (kernels/dispatch.py).
FUSED = os.environ.get("FLASHDRAFT_FUSED", "auto")
# Few-row GEMMs (decode batches, verify and draft blocks: <= SKINNY_ROWS rows) on the Triton kernels of
# kernels/skinny_gemm.py, which read the weights closer to the memory bandwidth than cuBLAS does at these
# shapes: "auto" for CUDA activations in bf16/fp16 when triton imports, "triton" also for CPU tensors under
# TRITON_INTERPRET=1 (tests), "cublas" never. No backward: never with grad.
GEMM = os.environ.get("FLASHDRAFT_GEMM", "auto")
# the most rows the few-row tiles take: 32; 64-256 (FLASHDRAFT_SKINNY_ROWS) only for sweeps and A/B runs:
# with those tiles the shipped pair's 64-row verify blocks ran 9% slower than on cuBLAS (H200), which the
# mid-row tiles below beat instead
SKINNY_ROWS = env_int("FLASHDRAFT_SKINNY_ROWS", 32)
if SKINNY_ROWS not in (32, 64, 128, 256):
    raise ValueError(f"FLASHDRAFT_SKINNY_ROWS must be 32, 64, 128 or 256, got {SKINNY_ROWS}")
# Blocks of SKINNY_ROWS + 1 to MID_ROWS rows (a small target's verify and draft blocks at concurrency 5-8:
# SmolLM2's 64 rows of 8) take the Triton GEMMs too where skinny_gemm.mid_tiles has tiles for the weight's
# shape (widths up to 1,024), cuBLAS elsewhere. FLASHDRAFT_MID_ROWS=32: never; 128: up to 128 (A/B runs: the
# shipped pair's 128-row step graph at concurrency 16 took 1.318 ms against 1.145 on cuBLAS, H200).
MID_ROWS = env_int("FLASHDRAFT_MID_ROWS", 64)
if MID_ROWS not in (32, 64, 128):
    raise ValueError(f"FLASHDRAFT_MID_ROWS must be 32, 64 or 128, got {MID_ROWS}")
# mid_tiles: the widest input (FLASHDRAFT_MID_MAX_K=2048 also takes inputs of 1,025-2,048 in halves of K, for
# A/B runs)
MID_MAX_K = env_int("FLASHDRAFT_MID_MAX_K", 1024)
# split-K (skinny_gemm._dot_split): GEMMs of fewer output rows than this split K over 2 programs a strip
# (FLASHDRAFT_SPLIT_BELOW=0: never; for A/B runs)
SPLIT_BELOW = env_int("FLASHDRAFT_SPLIT_BELOW", 3200)
# routers whose parts go to the top-k kernel (parts=True): K cut into parts of about ROUTER_PART_K, each a
# program a 16-row strip (skinny_gemm._router_tiles); FLASHDRAFT_ROUTER_PART_K=0: the general rules instead
# (A/B runs)
ROUTER_PART_K = env_int("FLASHDRAFT_ROUTER_PART_K", 256)
# attention grids of at most this many partitions merge in the kernel, more through the merge kernel: the
# merging program reads the partials one partition after another (H200, Qwen3-8B decode at 1k keys, 17
# partitions: 9.6 us a layer against 6.3 us with the merge kernel; SmolLM2's verify at c = 32, 3: faster;
# FLASHDRAFT_MERGE_SPLITS=1: never, for A/B runs)
MERGE_SPLITS = env_int("FLASHDRAFT_MERGE_SPLITS", 4)
# programs an SM the attention's split count aims for (kernels/attention_splits.py): a program's key walk is
# a chain of dependent loads, so an SM runs several at once before the walk's latency stops bounding the kernel
SPLIT_WAVES = env_int("FLASHDRAFT_SPLIT_WAVES", 3)
# value columns of the GDN state per program (the state block is [d_k, GDN_BLOCK_V] in registers; sweeps)
GDN_BLOCK_V = env_int("FLASHDRAFT_GDN_BLOCK_V", 32)
# programmatic dependent launch (kernels/launch.py): "auto" on for CUDA devices of compute capability >= 9
# when this Triton has grid dependency control, "off" never
PDL = os.environ.get("FLASHDRAFT_PDL", "auto")
# add_rmsnorm lets the next kernel launch at its start ("early") or before its stores ("late"; A/B runs).
# Early measured faster (H200, in graph, Qwen3.5-4B batch 1 / 8: 2.532 / 2.996 -> 2.498 / 2.966 ms;
# -0.8B 0.918 / 1.086 -> 0.897 / 1.076 ms): the GEMM after it is scheduled while it runs.
NORM_TRIGGER = os.environ.get("FLASHDRAFT_NORM_TRIGGER", "early")
# the post-attention add_rmsnorm and the router GEMM as one kernel, the top-k in the gate_up kernel
# (MoE.norm_forward_fused); FLASHDRAFT_ROUTE_IN_NORM=0: the separate kernels (A/B runs)
ROUTE_IN_NORM = os.environ.get("FLASHDRAFT_ROUTE_IN_NORM", "1") != "0"
# FLASHDRAFT_MOE_TILES="n,k,stages": one (BLOCK_N, BLOCK_K, stages) of the sorted expert GEMMs for every row
# count (tile sweeps; None: kernels/moe_experts.py's two sets)
MOE_TILES = env_ints("FLASHDRAFT_MOE_TILES")
# the direct (unsorted) expert path up to this many tokens (FLASHDRAFT_MOE_DIRECT=N); None: while the routed
# rows are at most half the experts (kernels/moe_experts.py)
MOE_DIRECT = env_int("FLASHDRAFT_MOE_DIRECT", None)
# (BLOCK_N, BLOCK_K, stages) of the direct path's gate_up and down GEMMs (the sweep's best were within 3% of
# these); FLASHDRAFT_MOE_DIRECT_TILES="n,k,stages,n,k,stages" sets them (sweeps)
_direct = env_ints("FLASHDRAFT_MOE_DIRECT_TILES")
MOE_DIRECT_TILES = (_direct[:3], _direct[3:]) if _direct else ((32, 128, 4), (32, 128, 4))
# FLASHDRAFT_TREE_KERNELS=auto (default): on the fused GPU path, trees are built, accepted and their K/V
# moved by the Triton kernels of kernels/tree_ops.py; off: by the torch ops of speculative/tree.py everywhere.
TREE_KERNELS = os.environ.get("FLASHDRAFT_TREE_KERNELS", "auto")

# seconds a tensor-parallel group waits on a rank (engine/parallel.py: its start, collectives, its close)
# before it ends with an error: a rank that hangs without exiting
TP_TIMEOUT_S = env_int("FLASHDRAFT_TP_TIMEOUT_S", 300)
# The drafter's norms and RoPE run in float32 (as at inference) between bf16 matmuls: eagerly that is
# a dozen float32 passes over every q/k row and their backward, most of a training step's GPU time
# after the matmuls (a profile of the step, docs/performance.md section 7). Compiled, each norm
# (+ RoPE) is one kernel forward and one backward with the same float32 arithmetic. "auto": compiled
# for CUDA tensors (train/loss.py).
TRAIN_COMPILE = os.environ.get("FLASHDRAFT_TRAIN_COMPILE", "auto")
