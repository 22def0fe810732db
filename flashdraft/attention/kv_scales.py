"""Per-tensor FP8 KV-cache scales (vLLM's `k_scale` / `v_scale`, one pair an attention layer): with FP8 pages
a layer stores k / k_scale and v / v_scale (saturated at +-448), so its pages use e4m3's range where its keys
and values lie. Reading them back costs no pass over the pages: the scores q . k = k_scale (q . page) take
k_scale in the softmax scale, and the output sum p v = v_scale (sum p page) is scaled once. Every backend and
attention path (decode, verify, tree masks, prefill chunks, prefix-cached pages) reads the same pages, so
each takes the scales alike. Pages in the model's dtype have scales of 1 (a checkpoint's are then skipped).

The checkpoint's names: `...self_attn.k_scale` / `v_scale`, or compressed-tensors' older
`...self_attn.k_proj.output_scale` / `v_proj.output_scale`; each a positive finite scalar (per-head scales
are refused). A `q_scale` (an FP8 attention's query scale, also `q_proj.output_scale`) changes nothing here:
queries stay in the model's dtype; it is skipped and logged."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator

import torch

log = logging.getLogger(__name__)

# a checkpoint tensor name -> (attention module, "k" | "v" | "q")
_NAME = re.compile(r"(?:model\.)?(?:language_model\.)?(?P<module>.*\.self_attn)\."
                   r"(?:(?P<kind>[kvq])_scale|(?P<proj>[kvq])_proj\.output_scale)")


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """(attention module, 'k' / 'v' / 'q') for a checkpoint's KV-cache scale tensor, else None."""
    m = _NAME.fullmatch(name)
    return None if m is None else (m["module"], m["kind"] or m["proj"])


def read_kv_scales(pairs: Iterable[tuple[str, torch.Tensor]], fp8_pages: bool,
                   found: dict[str, dict[str, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors less its KV-cache scales, which go to `found` ({module: {'k': s, 'v': s}})
    with FP8 pages, and are skipped (logged once) with pages in the model's dtype, as vLLM skips them."""
    logged = set()
    for name, w in pairs:
        hit = kv_scale_name(name)
        if hit is None:
            yield name, w
            continue
        module, kind = hit
        if kind == "q" or not fp8_pages:
            why = ("queries stay in the model's dtype" if kind == "q" else "the KV pages are in the model's dtype")
            if why not in logged:
                log.info("%s and the others like it are ignored: %s", name, why)
                logged.add(why)
            continue
        if w.numel() != 1:
            raise ValueError(f"{name} has {w.numel()} values: only one scale a layer (per tensor) is supported")
        value = float(w.float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} is {value}: a KV-cache scale must be positive and finite")
        found.setdefault(module, {})[kind] = value


def apply_kv_scales(net: torch.nn.Module, found: dict[str, dict[str, float]]) -> None:
    """Give each attention module named in `found` its (k_scale, v_scale) as `kv_scale` (a missing one: 1).
    A name that is not an attention layer of net is an error naming it."""
    modules = dict(net.named_modules())
    for module, got in found.items():
        attn = modules.get(module)
        if attn is None or not hasattr(attn, "kv_scale"):
            raise ValueError(f"{module}.k_scale / v_scale: the model has no attention layer {module!r}")
        attn.kv_scale = (got.get("k", 1.0), got.get("v", 1.0))


def store_and_attend(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, batch, scale: float, kv_scale: tuple[float, float],
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """attn.store_kv then attn.forward, the pages holding k / k_scale and v / v_scale (see above)."""
    ks, vs = kv_scale
    if ks != 1.0:  # (times the inverse, as the fused store kernel takes it: layer_ops.qk_norm_rope_store)
        k = k.float() * (1.0 / ks)
    if vs != 1.0:
        v = v.float() * (1.0 / vs)
    attn.store_kv(k_cache, v_cache, k, v, batch)
    return scaled_output(attn.forward(q, k_cache, v_cache, batch, scale * ks, sinks), kv_scale)


def scaled_output(o: torch.Tensor, kv_scale: tuple[float, float]) -> torch.Tensor:
    """An attention output over FP8 pages that hold v / v_scale, times v_scale."""
    return o if kv_scale[1] == 1.0 else (o.float() * kv_scale[1]).to(o.dtype)
