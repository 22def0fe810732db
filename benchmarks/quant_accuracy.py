"""What each quantized format costs in accuracy, on the real SmolLM2-135M-Instruct: its weights quantized by
round-to-nearest into each layout flashdraft loads (models/quant.py), then against the unquantized model on
MT-Bench first turns: greedy token match (the share of generated tokens equal to the unquantized model's at
the same position, and the share of whole outputs equal), the mean KL divergence KL(unquantized || quantized)
of next-token distributions over the unquantized model's own outputs (teacher-forced, float64 from float32
logits, HF transformers over each format's dequantized weights: what flashdraft serves, tests/test_quantized.py),
and DFlash's tau with the shipped (unquantized) drafter beside each target.

Formats: fp8-block (HF fine-grained FP8, 128 x 128), fp8-channel (compressed-tensors float-quantized), w4a16-g64
(compressed-tensors pack-quantized, symmetric), awq-g64 and gptq-g64 (their layouts, asymmetric, fp16 scales;
GPTQ's v1 zero points, which cannot hold 0: clamped to 1-15); kv-fp8: the weights as they are, the KV pages
(target and drafter) in FP8 e4m3 at scale 1, its KL over HF's cache holding the same FP8 values. Groups of
64, not the usual 128: SmolLM2's 576-wide inputs are 4.5 groups of 128.
Round-to-nearest only: AWQ's activation-aware scales and GPTQ's error feedback are calibration recipes not run
here, so the int4 rows are those layouts' round-to-nearest accuracy, a lower bound on what the recipes give.

    python benchmarks/quant_accuracy.py [--prompts 64] [--tokens 32] [--out results.json]   # CPU, ~20 minutes"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, run_info  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.models.loader import resolve_model_dir  # noqa: E402

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
GROUP = 64  # int4 group size
DRAFT = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")


def _blocks(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = w.shape
    return torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).view(-(-n // bn), bn, -(-k // bk), bk)


def _expand(s: torch.Tensor, bn: int, bk: int, n: int, k: int) -> torch.Tensor:
    return s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _words(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    v = vals.to(torch.int64).view(vals.shape[0], -1, 8)
    word = sum(v[:, :, order[i]] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()


def quantize(kind: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear weight [N, K] (float32) -> (its tensors in the format's layout, named by suffix; the float32
    weight they dequantize to)."""
    n, k = w.shape
    w64 = w.double()
    if kind == "fp8-block":
        s = _blocks(w64, 128, 128).abs().amax(dim=(1, 3)) / 448
        q = (w64 / _expand(s, 128, 128, n, k)).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": s.float()}, (q.double() * _expand(s.float().double(), 128, 128, n, k))
    if kind == "fp8-channel":
        s = (w64.abs().amax(1, keepdim=True) / 448).float()
        q = (w64 / s.double()).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale": s}, q.double() * s.double()
    if kind == "w4a16-g64":
        from compressed_tensors.compressors import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP))
        scale = (w.view(n, -1, GROUP).abs().amax(-1) / 7.0).to(torch.bfloat16)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        return packed, PackedQuantizationCompressor.decompress(packed, scheme)["weight"].double()
    # awq / gptq: asymmetric 4-bit over groups of GROUP inputs, fp16 scales
    wt = w64.t()
    g = wt.reshape(k // GROUP, GROUP, n)
    lo, hi = g.amin(1), g.amax(1)
    scale = ((hi - lo).clamp_min(1e-8) / 15).half()
    z = torch.round(-lo / scale.double()).clamp(0 if kind == "awq-g64" else 1, 15)
    idx = torch.arange(k) // GROUP
    q = (torch.round(wt / scale.double()[idx]) + z[idx]).clamp(0, 15)
    deq = ((q - z[idx]) * scale.double()[idx]).t()
    if kind == "awq-g64":
        return {"qweight": _words(q, AWQ_ORDER), "qzeros": _words(z, AWQ_ORDER), "scales": scale}, deq
    return {"qweight": _words(q.t().contiguous()).t().contiguous(), "qzeros": _words(z - 1), "scales": scale,
            "g_idx": idx.to(torch.int32)}, deq


CONFIGS = {
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
    "w4a16-g64": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                           "group_size": 64}}}},
    "awq-g64": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
    "gptq-g64": {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False, "sym": False,
                  "checkpoint_format": "gptq"},
}


def write(src: Path, root: Path, kind: str) -> tuple[Path, Path]:
    """src in the format's layout (root / kind) and its dequantized weights as a plain checkpoint (root /
    kind-dequantized)."""
    model, ref = root / kind, root / f"{kind}-dequantized"
    for f in (model, ref):
        shutil.copytree(src, f, ignore=shutil.ignore_patterns("*.safetensors"))
    quant, plain = {}, {}
    for path in sorted(src.glob("*.safetensors")):
        for name, w in load_file(path).items():
            if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
                quant[name] = plain[name] = w
                continue
            tensors, deq = quantize(kind, w.float())
            module = name.removesuffix(".weight")
            quant.update({f"{module}.{k}": v.contiguous() for k, v in tensors.items()})
            plain[name] = deq.float().contiguous()
    save_file(quant, model / "model.safetensors")
    save_file(plain, ref / "model.safetensors")
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | {"quantization_config": CONFIGS[kind]}))
    return model, ref


def fp8_cache():
    """An HF cache holding its keys and values as FP8 pages (scale 1) hold them: saturated e4m3, widened."""
    from transformers import DynamicCache

    from flashdraft.attention.torch_ref import to_pages

    class Cache(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            return super().update(to_pages(k, torch.float8_e4m3fn).to(k.dtype),
                                  to_pages(v, torch.float8_e4m3fn).to(v.dtype), layer_idx, *args, **kwargs)
    return Cache()


def distributions(folder: Path, seqs: list[list[int]], starts: list[int], fp8_kv: bool = False
                  ) -> list[torch.Tensor]:
    """log-softmax of next-token logits (float64) at each generated position of each sequence, HF transformers
    (fp8_kv: its keys and values through FP8 pages)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s, start in zip(seqs, starts):
            kw = {"past_key_values": fp8_cache()} if fp8_kv else {}
            logits = model(torch.tensor([s]), **kw).logits[0, start - 1: len(s) - 1]
            out.append(logits.double().log_softmax(-1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--formats", default=",".join(CONFIGS), help="of " + ", ".join(CONFIGS) + ", and kv-fp8 (the "
                    "weights unquantized, the target's and drafter's KV pages in FP8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    info = run_info("cpu")  # (the commit the run starts at)
    base = resolve_model_dir(None, four_bit=False)  # the embedded SmolLM2 (its GGUF dequantized to float32 once)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    ref_llm = LLM(str(base), draft=DRAFT, device="cpu", dtype="float32")
    _, ids, _ = tokenize(ref_llm.engine, load_prompts("mt-bench", args.prompts), True, args.tokens)
    ref_out = [o.token_ids for o in ref_llm.generate(ids, params)]
    ref_tau = ref_llm.engine.spec_totals().get("acceptance_length")
    seqs, starts = [i + o for i, o in zip(ids, ref_out)], [len(i) for i in ids]
    ref_logp = distributions(base, seqs, starts)
    rows = [{"format": "unquantized", "tau": ref_tau}]
    log(json.dumps(rows[0]))
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.formats.split(","):
            kv = {"kv_cache_dtype": "fp8"} if kind == "kv-fp8" else {}  # (the weights as they are, FP8 pages)
            model, deq = (base, base) if kv else write(base, Path(tmp), kind)
            plain = LLM(str(model), draft=None, device="cpu", dtype="float32", **kv)
            got = [o.token_ids for o in plain.generate(ids, params)]
            del plain
            spec = LLM(str(model), draft=DRAFT, device="cpu", dtype="float32", **kv)
            spec_out = [o.token_ids for o in spec.generate(ids, params)]
            tau = spec.engine.spec_totals().get("acceptance_length")
            del spec
            kl = [(p.exp() * (p - q)).sum(-1) for p, q in zip(ref_logp, distributions(deq, seqs, starts, bool(kv)))]
            same = sum(a == b for g, r in zip(got, ref_out) for a, b in zip(g, r))
            row = {"format": kind, "token_match": round(same / sum(len(r) for r in ref_out), 4),
                   "outputs_equal": sum(g == r for g, r in zip(got, ref_out)), "prompts": len(ids),
                   "mean_kl": float(torch.cat(kl).mean()), "tau": tau,
                   "dflash_equals_plain": sum(a == b for a, b in zip(spec_out, got))}
            rows.append(row)
            log(json.dumps(row))
    record = {"run": info, "prompts": len(ids), "tokens": args.tokens, "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
