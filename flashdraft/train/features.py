"""The frozen target's features for training: the tapped layers' hidden states as the engine taps
them (HF's hidden_states), their per-dimension scale (the taps' preconditioner), and which MLP
channels of a drafter carry the text it meets (for narrowing a saved drafter)."""

from __future__ import annotations

import torch
from torch.nn.attention import sdpa_kernel

from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.train.loss import TRAIN_SDPA


@torch.no_grad()
def hidden_states(model, ids: torch.Tensor, idx: list[int], **kwargs) -> tuple[object, list[torch.Tensor]]:
    """A transformers forward of `model` (a causal LM or its base model) and its hidden states at HF
    indices `idx` (l + 1 for the output of layer l; the last layer's entry is the final-normed state),
    the features the engine taps and the z-lab reference trains and drafts on."""
    out = model(ids, output_hidden_states=True, **kwargs)
    return out, [out.hidden_states[i] for i in idx]


@torch.no_grad()
def tap_scale(target, samples, tap_idx: list[int], device, max_samples: int = 64) -> torch.Tensor:
    """1 / RMS of every tap dimension over real tokens (position 0, the attention sink, left out).
    Targets carry a few "massive" dimensions (SmolLM2: RMS ~500 against a median of ~13, and
    ~25,000 at the sink); fed raw, they dominate fc's random start and Adam's equal-sized steps
    move the outputs of those columns 40x more than the rest. Training sees taps * scale; the
    saved fc is fc * scale, so the checkpoint takes raw taps like every other z-lab drafter."""
    acc, count = None, 0
    for ids, _ in samples[:max_samples]:
        _, hs = hidden_states(target, torch.tensor([ids], device=device), tap_idx)
        taps = torch.cat([h[0, 1:] for h in hs], -1).float()
        acc = taps.pow(2).sum(0) if acc is None else acc + taps.pow(2).sum(0)
        count += taps.shape[0]
    return (acc / max(count, 1)).sqrt().clamp_min(1e-3).reciprocal()


@torch.no_grad()
def target_features(target, ids: torch.Tensor, lengths: torch.Tensor, tap_idx: list[int],
                    scale: torch.Tensor | None, want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen target over ids: taps [b, S, n*H] (`hidden_states`, times the preconditioner
    scale) and, when asked, its logits [b, S, vocab] (otherwise the head is not run). Its attention
    takes the drafter's kernel list: cuDNN would plan a graph on the host for every new length. The
    causal + padding mask is built here, additive [b, 1, S, S]: given a padding mask, transformers
    first asks the GPU whether it could skip the mask, a wait for the GPU in every step."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    keep = (pos[None, :] <= pos[:, None])[None, None] & (pos < lengths[:, None])[:, None, None, :]
    dtype = target.get_input_embeddings().weight.dtype
    mask = torch.zeros(keep.shape, dtype=dtype, device=ids.device).masked_fill_(~keep, torch.finfo(dtype).min)
    with sdpa_kernel(TRAIN_SDPA):
        out, hs = hidden_states(target if want_logits else target.base_model, ids, tap_idx, attention_mask=mask)
    taps = torch.cat(hs, -1)
    if scale is not None:
        taps = (taps.float() * scale).to(taps.dtype)
    return taps, out.logits if want_logits else None


@torch.no_grad()
def mlp_channel_energy(drafter: DFlashDraftModel, target, embed: torch.Tensor, samples, device, dtype,
                       max_samples: int = 16, max_response: int = 256) -> torch.Tensor:
    """[layers, inter]: each MLP channel's summed squared activation (the input of its down_proj) over
    the blocks anchored at the first `max_response` response positions of the first `max_samples`
    training answers, run as training runs the drafter: which channels carry the text a drafter
    meets. A channel can have large weights and still see no input along them; weight norms alone
    cannot tell (on SmolLM2, run 18 narrowed from 1,536 to 1,512 channels by weight norms fell from
    2.22 to 2.11 on 12 MT-Bench prompts on CPU, by this energy to 2.21)."""
    from flashdraft.train.loss import block_attention_mask, draft_hidden

    spec, block = drafter.spec, drafter.spec.block_size
    energy = torch.zeros(len(drafter.layers), drafter.layers[0].mlp.down_proj.in_features, device=device)

    def record(i: int):
        return lambda module, args: energy[i].add_(args[0].float().pow(2).flatten(0, -2).sum(0))

    hooks = [layer.mlp.down_proj.register_forward_pre_hook(record(i)) for i, layer in enumerate(drafter.layers)]
    try:
        for full, plen in samples[:max_samples]:
            ids = torch.tensor([full[: plen + max_response]], device=device)
            anchors = torch.arange(plen, ids.shape[1] - 1)[None]
            if not anchors.numel():
                continue
            taps, _ = target_features(target, ids, torch.tensor([ids.shape[1]], device=device),
                                      [i + 1 for i in spec.target_layer_ids], None, False)
            blocks = torch.full((1, anchors.shape[1], block), spec.mask_token_id, device=device)
            blocks[:, :, 0] = ids[0, anchors[0].to(device)]
            mask = block_attention_mask(anchors.to(device), torch.ones(anchors.shape, dtype=torch.bool, device=device),
                                        ids.shape[1], block)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                draft_hidden(drafter, taps, torch.nn.functional.embedding(blocks.flatten(1), embed), anchors, mask)
    finally:
        for h in hooks:
            h.remove()
    return energy
