"""The trainer's compiled norms, RoPE and head cross-entropy (used on CUDA) against the eager
functions they replace: the same loss, statistics and gradients on CPU, where torch.compile
generates C++ instead of Triton from the same graphs."""

from __future__ import annotations

import pytest
import torch

import flashdraft.train.loss as L
from flashdraft import settings
from flashdraft.train.drafter import drafter_spec, init_drafter
from flashdraft.train.trainer import TrainConfig


def _case(tiny_llama, dtype):
    from flashdraft.models.loader import load_config

    cfg = load_config(tiny_llama)
    drafter = init_drafter(drafter_spec(cfg, TrainConfig(num_layers=2, block_size=4, target_layer_ids=[0, 2]), 3),
                           "cpu", 0)
    drafter.setup(64)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # norm weights away from 1, so a dropped weight would show
        for p in drafter.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    b, s, vocab, hidden = 3, 24, cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(vocab, hidden, generator=g).to(dtype)
    lm_head = (torch.randn(vocab, hidden, generator=g) * 0.3).to(dtype)
    taps = torch.randn(b, s, drafter.fc.weight.shape[1], generator=g).to(dtype)
    ids = torch.randint(0, vocab, (b, s), generator=g)
    lengths = torch.tensor([24, 17, 20])
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, 4:] = True
    anchors, valid = L.sample_anchors(loss_mask, lengths, 7, torch.Generator().manual_seed(3))
    return drafter, (lm_head, embed, taps, ids, lengths, anchors, valid, 3, 2.0)


def _run(drafter, args, compile_mode, autocast):
    drafter.zero_grad(set_to_none=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "TRAIN_COMPILE", compile_mode)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, stats = L.dflash_loss(drafter, *args)
        loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in drafter.named_parameters()}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_compiled_training_step_matches_eager(tiny_llama, autocast):
    drafter, args = _case(tiny_llama, torch.bfloat16 if autocast else torch.float32)
    eager = _run(drafter, args, "0", autocast)
    compiled = _run(drafter, args, "1", autocast)
    assert L._compiled, "the compiled functions were not used"
    # float32: only the order of float32 operations differs; bf16: also where values are rounded to bf16
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(compiled[0], eager[0], **tol)
    torch.testing.assert_close(compiled[1]["acc_per_slot"], eager[1]["acc_per_slot"], rtol=0, atol=0.05)
    for name, g in eager[2].items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(compiled[2][name], g, **tol, msg=lambda m, name=name: f"{name}: {m}")


def test_compile_setting_is_checked(tiny_llama):
    drafter, args = _case(tiny_llama, torch.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "TRAIN_COMPILE", "yes")
        with pytest.raises(ValueError, match="FLASHDRAFT_TRAIN_COMPILE"):
            L.dflash_loss(drafter, *args)


@pytest.mark.parametrize("compile_mode", ["0", "1"], ids=["eager", "compiled"])
def test_training_forward_equals_the_serving_drafter(tiny_llama, compile_mode):
    """draft_hidden (what training optimises) against the drafter as flashdraft serves it: context
    K/V written into a paged cache, then each block drafted on its own, non-causal (float64)."""
    from flashdraft.attention.base import AttentionBatch
    from flashdraft.attention.torch_ref import TorchAttention

    drafter, (lm_head, embed, taps, ids, lengths, _, _, mask_id, _) = _case(tiny_llama, torch.float64)
    drafter.double()
    drafter.setup(64)
    B, page = drafter.spec.block_size, 16
    anchors = torch.tensor([[3, 9, 12, 19]])
    blocks = torch.full((1, anchors.shape[1], B), mask_id)
    blocks[:, :, 0] = ids[:1].gather(1, anchors)
    emb = torch.nn.functional.embedding(blocks.flatten(1), embed.double())
    mask = L.block_attention_mask(anchors, torch.ones_like(anchors, dtype=torch.bool), ids.shape[1], B)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(settings, "TRAIN_COMPILE", compile_mode)
        trained = L.draft_hidden(drafter, taps[:1].double(), emb, anchors, mask)[0].view(-1, B, embed.shape[1])

    c, attn = drafter.config, TorchAttention()
    shape = (4, page, c.num_key_value_heads, c.head_dim)
    kv = [(torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64))
          for _ in range(c.num_hidden_layers)]
    with torch.no_grad():
        for j, p in enumerate(anchors[0].tolist()):
            pos = torch.arange(p)
            drafter.write_context(taps[0, :p].double(), pos, kv, attn, AttentionBatch(pos, [], [], [], page))
            slots = torch.arange(p, p + B)
            batch = AttentionBatch(slots, [0, B], [p + B], [[0, 1, 2, 3]], page, causal=False)
            attn.prepare(batch, torch.device("cpu"))
            served = drafter(emb[0, j * B: (j + 1) * B], slots, kv, attn, batch)
            torch.testing.assert_close(trained[j], served, rtol=1e-9, atol=1e-9)
