"""The drafter trainer's attention on CPU: `draft_hidden` forward + backward with every block query
over all keys (groups=0) against per-anchor-group attention over only the keys a group can see
(the default), SmolLM2-width 3-layer drafter, fp32, two runs each.

    python benchmarks/train_attention_cpu.py [--seqs 2] [--tokens 700] [--anchors 256]
"""

from __future__ import annotations

import argparse
import time

import torch

from flashdraft.models.loader import load_config, resolve_model_dir
from flashdraft.train.drafter import drafter_spec, init_drafter
from flashdraft.train.loss import block_attention_mask, draft_hidden, sample_anchors
from flashdraft.train.trainer import TrainConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--anchors", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=8)
    args = ap.parse_args()
    cfg = load_config(resolve_model_dir(None))
    spec = drafter_spec(cfg, TrainConfig(num_layers=3, block_size=args.block_size, target_layer_ids=[1, 14, 27]), 16)
    drafter = init_drafter(spec, "cpu", 0)
    drafter.setup(args.tokens + args.block_size + 1)
    g = torch.Generator().manual_seed(0)
    b, s, n, B = args.seqs, args.tokens, args.anchors, args.block_size
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, s // 5:] = True  # the response part
    anchors, valid = sample_anchors(loss_mask, torch.full((b,), s), n, g)
    n = anchors.shape[1]
    taps = torch.randn(b, s, drafter.fc.weight.shape[1], generator=g)
    embed = torch.randn(b, n * B, cfg.hidden_size, generator=g)
    mask = block_attention_mask(anchors, valid, s, B)
    for groups in (0, 8, 0, 8):
        drafter.zero_grad()
        t = time.perf_counter()
        draft_hidden(drafter, taps, embed, anchors, mask, groups=groups).square().mean().backward()
        print(f"{'all keys' if groups == 0 else f'{groups} groups':>9}: {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
