"""The engine's step time end to end, through the public API, at real model shapes with random weights:
config-only folders (target and a z-lab-shaped DFlash drafter) loaded with load_format="dummy", then
`LLM.generate` at each concurrency, plain and with the drafter. A step's time is the difference between two
runs of the same prompts, n + N and n new tokens, over the difference in engine steps, so prefill and
start-up drop out (n outlasts the prefill chunks, beside which early prompts decode); beside it, the median
pace of the longer run's middle steps (`ms_per_step_median`), which a one-off stall does not move. The random drafter's
drafts are never accepted (tau = 1): its arm gives the DFlash step's cost, and DFlash step / plain step is
the tau at which speculation breaks even. Beside each plain step: the memory roofline of the bytes it reads
(every weight but the embedding table, the context's K/V, a hybrid target's recurrent state read and
written; of a mixture of experts, only the experts one decode step of the batch routes to, counted in an
eager step) over the bandwidth of a device copy measured in the same run, and the same step's GPU time: its
CUDA graph replayed (the captured decode or whole-DFlash-step graph) plus the head and greedy choice that
follow it eagerly. End to end minus GPU time is the time the GPU waits on the host. Arms: plain (async
scheduling: the next decode step queued before the last one is read), plain-sync (without), dflash (every
step verifies: the acceptance gate off; the next verify queued before the last one is read), dflash-sync (the
same, without overlap), dflash-auto (the engine's default: the step gate stops
drafts below the break-even tau of the step costs, on CUDA measured at start, elsewhere timed while
serving, speculative/costs.py). For each
DFlash arm, `speedup`: its tokens per second over the plain arm's at each concurrency, and `verified_blocks`:
the blocks the shorter and the longer timed run verified (a gated arm's probes; its pauses reach hundreds of
steps, so time it over as many with --new-tokens).

With --tensor-parallel-size N the target is split over N GPUs (engine/parallel.py) and the roofline is one
GPU's: the bytes rank 0 reads (its share of every layer and of the LM head) over its bandwidth.

    python benchmarks/e2e_step.py --target qwen3.5-0.8b --out e2e.json        # a GPU
    python benchmarks/e2e_step.py --target qwen3-8b -tp 2 --out e2e-tp2.json  # two GPUs
    python benchmarks/e2e_step.py --target tiny-hybrid --device cpu            # smoke test, anywhere
    FLASHDRAFT_FP8_GEMM=1 python benchmarks/e2e_step.py --target qwen3-8b --quantized fp8-block --arms plain
    FLASHDRAFT_INT4_GEMM=1 python benchmarks/e2e_step.py --target qwen3-8b --quantized awq --arms plain
    python benchmarks/e2e_step.py --target qwen3-8b --kv-cache-dtype fp8      # FP8 KV pages

Prints a table of every arm's steps and one JSON line (also written to --out)."""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import copy_bandwidth, cuda_ms, kernel_table, log, middle_median, report  # noqa: E402

from flashdraft import LLM, SamplingParams, settings  # noqa: E402
from flashdraft.engine.memory import kv_bytes_per_token, state_bytes_per_seq  # noqa: E402
from flashdraft.models.moe import MoE  # noqa: E402
from flashdraft.speculative.formats import default_target_layer_ids  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
try:  # the MoE shapes live with the in-graph roofline benchmark, which needs Triton
    from gpu_roofline import GPT_OSS_20B, QWEN3_30B_A3B  # noqa: E402
except ImportError:  # a CPU machine without Triton: the dense and hybrid shapes only
    GPT_OSS_20B = QWEN3_30B_A3B = None

QWEN35 = dict(model_type="qwen3_5_text", linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              full_attention_interval=4, vocab_size=248320, head_dim=256, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TARGETS = {
    # Qwen3.5-27B: 64 layers, 48 Gated DeltaNet (16 key / 48 value heads of 128) and 16 gated attention
    "qwen3.5-27b": dict(QWEN35, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48, tie_word_embeddings=False),
    "qwen3.5-4b": dict(QWEN35, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
                       linear_num_value_heads=32, tie_word_embeddings=True),
    "qwen3.5-0.8b": dict(QWEN35, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=16,
                         linear_num_value_heads=16, tie_word_embeddings=True),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                        rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    # the shipped pair's target (its GGUF is 4-bit Q4_1, dequantized at load): does a 4-bit step pay here?
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rope_theta=100000.0, tie_word_embeddings=True),
    # mixtures of experts: the roofline counts the experts one eager decode step of the batch reads
    # (experts_read); batches route apart with --sample and the redrawn routers (spread_routers). The
    # random drafter proposes one token in every slot, so a verify's rows route alike and read too few
    # experts: its DFlash figures understate.
    **({"gpt-oss-20b": dict(GPT_OSS_20B, model_type="gpt_oss", max_position_embeddings=131072,
                            tie_word_embeddings=False),
        "qwen3-30b-a3b": dict(QWEN3_30B_A3B, model_type="qwen3_moe", tie_word_embeddings=False)}
       if GPT_OSS_20B is not None else {}),
    "tiny-moe": dict(model_type="qwen3_moe", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1000, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], tie_word_embeddings=False),
    "tiny-hybrid": dict(QWEN35, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
                        linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=1000,
                        tie_word_embeddings=True),
}


# the target's quantization_config (its weights random: load_format dummy); with FLASHDRAFT_FP8_GEMM=1 /
# FLASHDRAFT_INT4_GEMM=1 its dense projections keep the format's bytes (models/quant_serve.py), else bf16
QUANTIZED = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["lm_head"]},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "awq-g32": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},  # (Q4_1's)
}


def write_folders(root: Path, target: dict, draft_layers: int, block: int, quantization: dict | None = None
                  ) -> tuple[Path, Path]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    t, d = root / "target", root / "draft"
    for f in (t, d):
        f.mkdir(parents=True, exist_ok=True)
    kw = dict(target)
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(t)
    if quantization is not None:  # (a quantized checkpoint's config: its layers hold the format's tensors)
        cfg = json.loads((t / "config.json").read_text())
        (t / "config.json").write_text(json.dumps(cfg | {"quantization_config": quantization}))
    words = {f"w{i}": i for i in range(255)} | {"<eos>": 255}
    tok = Tokenizer(models.WordLevel(words, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>").save_pretrained(t)
    h, n = target["hidden_size"], target["num_hidden_layers"]
    heads = max(4, h // 128)
    layer = dict(model_type="qwen3", hidden_size=h, intermediate_size=target["intermediate_size"],
                 num_hidden_layers=draft_layers, num_attention_heads=heads, num_key_value_heads=min(8, heads),
                 head_dim=min(128, h // heads), rms_norm_eps=1e-6, rope_theta=1e7, attention_bias=False,
                 vocab_size=target["vocab_size"], max_position_embeddings=40960)
    cfg = {**layer, "architectures": ["DFlashDraftModel"], "num_target_layers": n, "block_size": block,
           "dflash_config": {"mask_token_id": 0, "target_layer_ids": default_target_layer_ids(n, draft_layers)}}
    (d / "config.json").write_text(json.dumps(cfg))
    return t, d


def best_bandwidth(device: torch.device, previous: float | None) -> float | None:
    """The copy bandwidth measured again (the GPU warm, the model loaded) and the best of it and
    `previous`: the roofline at the fastest copy this process saw, not at a slow first one (runs on
    one H200 measured 3.88-4.16 TB/s at start). Without room for the 2 GiB copy: `previous`."""
    try:
        now = copy_bandwidth(device)
    except torch.cuda.OutOfMemoryError:
        return previous
    return max((b for b in (previous, now) if b), default=None)


def step_bytes(llm: LLM, batch: int, context: int, experts: list[int] | None = None) -> int | None:
    """What one plain decode step reads: every weight but the embedding table (unless it is also the
    head), the K/V of `context` tokens per sequence, and each sequence's recurrent state, read and
    written; of a mixture of experts only the experts each MoE layer's routing picked (`experts`, one
    count per layer, from experts_read; None: no figure)."""
    model, dtype, kv_dtype = llm.engine.runner.model, llm.engine.dtype, llm.engine.runner.kv_dtype
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if moes and experts is None:
        return None
    skip = {id(p) for m in moes for p in m.experts.parameters()}
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n != "embed_tokens.weight" and id(p) not in skip)
    if getattr(model, "tied", False):
        weights += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    for n, m in zip(experts or [], moes):  # an expert's share of each stacked tensor (dim 0: experts)
        weights += n * sum(p[0].numel() * p.element_size() for p in m.experts.parameters())
    return weights + batch * (context * kv_bytes_per_token(model, kv_dtype) + 2 * state_bytes_per_seq(model, dtype))


def _keeping(route, rows: int, keep):
    """route (a bound routing method) that also hands the expert ids of every call of `rows` rows to keep."""
    def wrapped(x):
        w, idx = route(x)
        if x.shape[0] == rows:
            keep(idx)
        return w, idx
    return wrapped


def experts_read(llm: LLM, prompts: list[list[int]], temperature: float) -> list[int] | None:
    """How many experts each MoE layer reads in a decode step of these prompts (None without MoE
    layers): the engine steps them eagerly (graphs off meanwhile) until all decode in one step, as
    fill_graph does, keeping every layer's routing of the last step of that many rows."""
    runner = llm.engine.runner
    moes = [m for m in runner.model.modules() if isinstance(m, MoE)]
    if not moes:
        return None
    rows, seen = len(prompts), {}
    for m in moes:  # the torch path routes by route(), the fused path by route_fused()
        for name in ("route", "route_fused"):
            m.__dict__[name] = _keeping(getattr(m, name), rows, lambda idx, m=m: seen.__setitem__(id(m), idx))
    graphs, runner.use_graphs = runner.use_graphs, False
    in_norm, settings.ROUTE_IN_NORM = settings.ROUTE_IN_NORM, False  # route through route_fused, to be seen
    try:
        fill_graph(llm, prompts, temperature)
    finally:
        runner.use_graphs, settings.ROUTE_IN_NORM = graphs, in_norm
        for m in moes:
            m.__dict__.pop("route", None)
            m.__dict__.pop("route_fused", None)
    return [len(torch.unique(seen[id(m)])) for m in moes] if len(seen) == len(moes) else None


def spread_routers(llm: LLM, std: float) -> None:
    """Redraw every router's weights N(0, std), and zero the biases outside the experts. Dummy weights
    (uniform in +-1e-3) give every token nearly the same router logits, and dummy attention biases add
    one shared vector to every token's stream, so a batch routes to a few experts; this spreads it, as
    a trained router does (the in-graph roofline tables draw whole models N(0, 0.02) instead)."""
    model = llm.engine.runner.model
    gen = torch.Generator(device=llm.engine.device).manual_seed(1)
    with torch.no_grad():
        experts = {id(p) for m in model.modules() if isinstance(m, MoE) for p in m.experts.parameters()}
        for name, p in model.named_parameters():
            if name.endswith(".bias") and id(p) not in experts:
                p.zero_()
        for m in model.modules():
            if isinstance(m, MoE):
                (m.gate if hasattr(m, "gate") else m.router).weight.normal_(0, std, generator=gen)


def step_graph(llm: LLM, arm: str, batch: int):
    """The captured decode graph (plain) or whole-DFlash-step graph of this batch's bucket, or None."""
    eng = llm.engine
    runner = eng.runner
    bucket = 1 << (batch - 1).bit_length()
    key = (("target", ()), bucket, 1) if eng.spec is None else (eng.spec.graphs.key("dflash"), bucket,
                                                                  eng.spec.block_size)
    g = runner.graphs.get(key)
    return g if g is not None and g.captured else None


def fill_graph(llm: LLM, prompts: list[list[int]], temperature: float = 0.0) -> None:
    """Run the engine until every prompt decodes in the same step, then abort them: the graphs of that
    batch's bucket hold a full step's inputs (a timed run's last step of a bucket can be a shrinking
    batch's: its requests end one after another, as they were admitted)."""
    eng = llm.engine
    seqs = [eng.add_request(None, SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=temperature),
                            prompt_token_ids=p) for p in prompts]
    while not all(s.num_output_tokens >= 2 for s in seqs):
        eng.step()
    for _ in range(2):
        eng.step()
    for s in seqs:
        eng.abort(s)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()


def in_graph_ms(llm: LLM, arm: str, batch: int, replays: int = 20) -> float | None:
    """The step timed inside its CUDA graph, replayed over the inputs of the last step it ran (it
    rewrites the same K/V slots and states: run fill_graph first); None without graphs."""
    g = step_graph(llm, arm, batch)
    return None if g is None else cuda_ms(g.replay, replays)


def head_ms(llm: LLM, rows: int, replays: int = 20) -> float | None:
    """The head and greedy choice over `rows` rows, as a step runs them after its graph (eagerly)."""
    eng = llm.engine
    if eng.device.type != "cuda":
        return None
    from flashdraft.engine.sampler import greedy_tokens

    model = eng.runner.model
    hidden = torch.randn(rows, model.config.hidden_size, device=eng.device, dtype=eng.dtype)
    with torch.inference_mode():
        return cuda_ms(lambda: greedy_tokens(model.compute_logits(hidden, float32=False)), replays)


def kernel_split(llm: LLM, arm: str, batch: int, top: int, replays: int = 10) -> list[dict] | None:
    """The `top` kernels of the in-graph step by what they add to its span (torch profiler over replays)."""
    g = step_graph(llm, arm, batch)
    return None if g is None else kernel_table(g.replay, replays)[0][:top]


def timed(llm: LLM, prompts: list[list[int]], tokens: int, temperature: float = 0.0
          ) -> tuple[float, int, list[float], int]:
    """Seconds and engine steps of one generate call, the seconds between one `step()` call's return and
    the next's (a step's pace, host and GPU together: with async scheduling each call waits for the step
    before), and the drafted blocks it verified (a gated arm's probes among them)."""
    eng = llm.engine
    steps, blocks = eng.stats["num_steps"], eng.spec_totals()["num_drafts"]
    returns = []
    real = eng.step

    def step():
        out = real()
        returns.append(time.perf_counter())
        return out

    eng.step = step
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=temperature))
    finally:
        del eng.step  # the class's method again
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0, eng.stats["num_steps"] - steps, [b - a for a, b in zip(returns, returns[1:])],
            eng.spec_totals()["num_drafts"] - blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen3.5-0.8b", choices=sorted(TARGETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None)
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="split the target over this many GPUs; figures are rank 0's (its share's roofline)")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="tensor parallel: every all-reduce through NCCL (not the one-shot one for small messages)")
    ap.add_argument("--arms", default="plain,dflash",
                    help="plain (async scheduling, the CUDA default), plain-sync (each step read before the "
                         "next is scheduled), dflash (every step verifies), dflash-sync (the same, each step read "
                         "before the next is launched), dflash-auto (the engine's default gate)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="also list the N costliest kernels of each in-graph step (torch profiler): their "
                         "time and what they add to the step's span (under PDL a kernel's time includes its wait)")
    ap.add_argument("--sample", action="store_true",
                    help="sample at temperature 1 instead of greedy: with dummy weights every sequence "
                         "then decodes its own tokens (greedy ones coincide, and so would their experts)")
    ap.add_argument("--router-std", type=float, default=1.0,
                    help="mixtures of experts: router weights redrawn N(0, std) (spread_routers); 0 keeps them")
    ap.add_argument("--settle-s", type=float, default=0.0, metavar="S",
                    help="seconds idle after an engine is built (its dummy weights written), before any timing: "
                         "a GPU's graph replays have run ~10%% slower for seconds after heavy work "
                         "(docs/performance.md section 12)")
    ap.add_argument("--quantized", choices=sorted(QUANTIZED), default=None,
                    help="the target as a quantized checkpoint of this format: with FLASHDRAFT_FP8_GEMM=1 (FP8) or "
                         "FLASHDRAFT_INT4_GEMM=1 (awq) its dense projections keep the format's bytes, else bf16")
    ap.add_argument("--fp8-block", action="store_const", const="fp8-block", dest="quantized",
                    help="--quantized fp8-block")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the KV pages' dtype (auto, fp8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    conc = [int(c) for c in args.concurrency.split(",")]
    result = {"target": args.target, "shape": TARGETS[args.target], "quantized": args.quantized,
              "kv_cache_dtype": args.kv_cache_dtype, "fp8_gemm": settings.FP8_GEMM, "int4_gemm": settings.INT4_GEMM,
              "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "tensor_parallel_size": args.tensor_parallel_size,
              "disable_custom_all_reduce": args.disable_custom_all_reduce,
              "copy_bytes_per_s": copy_bandwidth(device), "arms": {}}
    bw = result["copy_bytes_per_s"]
    arms = args.arms.split(",")
    if device.type == "cuda" and len(arms) > 1:  # one process per arm: each gets the whole GPU
        with tempfile.TemporaryDirectory() as tmp:
            for arm in arms:
                out = Path(tmp) / f"{arm}.json"
                subprocess.run([sys.executable, __file__, *sys.argv[1:], "--arms", arm, "--out", str(out)], check=True,
                               stdout=subprocess.DEVNULL)  # its progress on stderr; its report read back here
                one = json.loads(out.read_text())
                result["arms"][arm] = one["arms"][arm]
                result.update({k: v for k, v in one.items() if k in ("state_bytes_per_seq", "graphs", "step_costs")})
        arms = []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = write_folders(Path(tmp), TARGETS[args.target], args.draft_layers, args.block,
                                      QUANTIZED.get(args.quantized))
        for arm in arms:
            gate = {"speculative_min_acceptance_length": None} if arm in ("dflash", "dflash-sync") else {}
            llm = LLM(str(target), draft=str(draft) if arm.startswith("dflash") else None, device=args.device,
                      load_format="dummy", max_num_seqs=max(conc), kv_cache_memory_gb=args.kv_cache_memory_gb,
                      max_model_len=args.prompt_len + args.new_tokens + 64,
                      async_scheduling=False if arm.endswith("-sync") else None,
                      enable_prefix_caching=False, tensor_parallel_size=args.tensor_parallel_size,
                      disable_custom_all_reduce=args.disable_custom_all_reduce, kv_cache_dtype=args.kv_cache_dtype,
                      **gate)  # each timed run prefills its prompts alike
            if args.router_std > 0:
                spread_routers(llm, args.router_std)
            if args.settle_s > 0:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                time.sleep(args.settle_s)
            gc.collect()
            gc.freeze()  # as the server does: no collection pass over start-up's objects stalls a timed run
            gen = torch.Generator().manual_seed(0)
            vocab = TARGETS[args.target]["vocab_size"]
            rows = []
            for c in conc:
                prompts = torch.randint(0, vocab, (c, args.prompt_len), generator=gen).tolist()
                # the short run outlasts the prefill: prompts are prefilled in chunks of max_num_batched_tokens,
                # and early ones decode beside later chunks (ragged steps); both runs hold those steps alike
                short = 2 + -(-c * args.prompt_len // llm.engine.config.max_num_batched_tokens)
                temp = 1.0 if args.sample else 0.0
                timed(llm, prompts, short + 4, temp)  # warm-up: every step shape both runs meet (eager ones compile)
                # the faster of two runs each: a one-off stall in either would skew the difference
                t1, s1, _, b1 = min(timed(llm, prompts, short, temp) for _ in range(2))
                ov = llm.engine.stats["num_overlapped_steps"]
                tn, sn, gaps, bn = min(timed(llm, prompts, short + args.new_tokens, temp) for _ in range(2))
                ov = (llm.engine.stats["num_overlapped_steps"] - ov) // 2  # a long run's steps launched ahead
                ms = 1e3 * (tn - t1) / max(sn - s1, 1)
                pace = middle_median(gaps)
                row = {"concurrency": c, "ms_per_step": round(ms, 3), "steps": sn - s1, "overlapped_steps": ov,
                       "tokens_per_step": round(c * args.new_tokens / max(sn - s1, 1), 3),
                       "ms_per_step_median": round(1e3 * pace, 3) if pace is not None else None}
                if arm.startswith("dflash"):  # blocks verified by the two runs (a gated arm: how many probes)
                    row["verified_blocks"] = [b1, bn]
                experts = experts_read(llm, prompts, temp) if arm.startswith("plain") else None
                nbytes = step_bytes(llm, c, args.prompt_len + args.new_tokens // 2, experts)
                if experts is not None:
                    row["experts_read"] = sum(experts)
                bw = best_bandwidth(device, bw)
                if bw and nbytes:
                    floor = 1e3 * nbytes / bw
                    row |= {"roofline_ms": round(floor, 3), "x_roofline": round(ms / floor, 3),
                            "copy_bytes_per_s": round(bw)}
                fill_graph(llm, prompts, temp)
                graph = in_graph_ms(llm, arm, c)
                if graph is not None:
                    # the head and the greedy choice run after the graph: the GPU's whole step is both
                    head = head_ms(llm, c if llm.engine.spec is None else c * args.block)
                    row |= {"in_graph_ms": round(graph, 3), "head_ms": round(head, 3),
                            "gpu_ms": round(graph + head, 3), "host_gap_ms": round(ms - graph - head, 3)}
                    if "roofline_ms" in row:
                        row["gpu_x_roofline"] = round((graph + head) / row["roofline_ms"], 3)
                split = kernel_split(llm, arm, c, args.profile) if args.profile and graph is not None else None
                log(f"{arm} c={c}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "concurrency"))
                if split:
                    row["kernels"] = split
                    for k in split:
                        log(f"  {k['us']:8.1f} us ({k['added_us']:8.1f} added) x{k['calls']:5.0f}  {k['kernel']}")
                rows.append(row)
            result["arms"][arm] = rows
            costs = llm.engine.spec.policy.costs if llm.engine.spec is not None else None
            if costs is not None:  # what the gate of dflash-auto decides by
                result["step_costs"] = costs.as_dict()
            if arm.startswith("plain"):
                result["state_bytes_per_seq"] = state_bytes_per_seq(llm.engine.runner.model, llm.engine.dtype)
                result["graphs"] = llm.engine.runner.use_graphs
            gc.unfreeze()
            llm.engine.shutdown()
            del llm
            gc.collect()  # the engine and its speculator refer to each other
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "plain" in result["arms"] and "dflash" in result["arms"]:
        result["break_even_tau"] = {r["concurrency"]: round(d["ms_per_step"] / r["ms_per_step"], 3)
                                    for r, d in zip(result["arms"]["plain"], result["arms"]["dflash"])}
    for arm in ("dflash", "dflash-sync", "dflash-auto"):
        if "plain" in result["arms"] and arm in result["arms"]:
            rate = lambda r: r["tokens_per_step"] / r["ms_per_step"]  # noqa: E731
            result.setdefault("speedup", {})[arm] = {r["concurrency"]: round(rate(d) / rate(r), 3)
                                                     for r, d in zip(result["arms"]["plain"], result["arms"][arm])}
    columns = ["arm", "concurrency", "ms_per_step", "ms_per_step_median", "gpu_ms", "roofline_ms", "x_roofline",
               "tokens_per_step", "overlapped_steps", "verified_blocks"]
    rows = [{"arm": arm, **r} for arm, rs in result["arms"].items() for r in rs]
    report(f"{args.target}: ms per step (two-run difference; median pace), GPU step (graph + head), roofline",
           rows, result, args.out, columns, device)


if __name__ == "__main__":
    main()
