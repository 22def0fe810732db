"""kv_cache_dtype fp8 through the fused kernels on a GPU: the fused q/k norm + RoPE + store (plain and gated
attention) writes the FP8 pages the unfused path writes, the checkpoint's k_scale / v_scale included. CUDA only:
the Triton interpreter's float8 cast does not round to nearest (0.49 -> 0.25), and tests/gpu/test_triton_attention.py
checks the attention kernel over FP8 pages there with values on e4m3's grid."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from fixtures import tiny_config  # noqa: E402

from flashdraft.attention.base import AttentionBatch  # noqa: E402
from flashdraft.attention.torch_ref import TorchAttention  # noqa: E402
from flashdraft.kernels.dispatch import fused_mode  # noqa: E402
from flashdraft.models.rope import RotaryTable  # noqa: E402

DEVICE = torch.device("cuda")


def randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(DEVICE, dtype)


def close(got, want, what=""):
    err = (got.float() - want.float()).abs().max().item()
    bound = 6e-2 * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"{what}: max abs diff {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("gated", [False, True], ids=["attention", "gated"])
@pytest.mark.parametrize("kv_scale", [(1.0, 1.0), (0.37, 2.9)])
def test_fused_store_into_fp8_pages(gated, kv_scale):
    """kv_cache_dtype fp8: the fused q/k norm + RoPE + store writes the pages the unfused path writes (k / k_scale
    and v / v_scale, saturated), byte for byte, and the layer's output over them is the unfused one."""
    from flashdraft.attention.torch_ref import FP8
    from flashdraft.models.hybrid import GatedAttention
    from flashdraft.models.transformer import Attention

    cfg = tiny_config("qwen3_5_text" if gated else "qwen3", 64)
    torch.manual_seed(3)
    layer = GatedAttention(cfg, rotary_dim=cfg.head_dim // 4) if gated else Attention(cfg, True, False)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    layer = layer.to(DEVICE, torch.bfloat16)
    layer.kv_scale = kv_scale
    rope = RotaryTable(cfg, cfg.head_dim // 4 if gated else cfg.head_dim, 300, DEVICE, torch.bfloat16)
    page, n_blocks, T = 8, 4, 7
    rnd = random.Random(5)
    slot_mapping = torch.tensor(rnd.sample(range(page * n_blocks), T), device=DEVICE)
    positions = torch.tensor([rnd.randrange(300) for _ in range(T)], device=DEVICE)
    x = randn(T, cfg.hidden_size, dtype=torch.bfloat16, scale=300.0)  # (some V values past 448 v_scale)
    batch = AttentionBatch(slot_mapping, [0, T], [T], [list(range(n_blocks))], page)
    outs, caches = [], []
    attn = TorchAttention()
    attn.prepare(batch, DEVICE)
    for mode in ("off", "on"):
        kc = torch.zeros(n_blocks, page, cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=FP8)
        vc = torch.zeros_like(kc)
        with fused_mode(mode), torch.inference_mode():
            if gated:
                outs.append(layer(x, positions, rope, kc, vc, attn, batch))
            elif mode == "on":
                outs.append(layer.forward_fused(x, positions, rope, kc, vc, attn, batch))
            else:
                cos, sin = rope.lookup(positions)
                outs.append(layer(x, cos, sin, kc, vc, attn, batch))
        caches.append((kc.view(torch.uint8), vc.view(torch.uint8)))
    assert any(((c & 0x7F) == 0x7E).any() for c in caches[0])  # (+-448: saturated values)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    close(outs[1], outs[0], "output")
