"""Where a drafter-training step spends its time, on random weights of a target's shape (no model
files needed): SmolLM2-135M's shape and the shipped drafter's (3 layers, B=8, taps [1, 14, 27]),
synthetic sequences of 120-300 prompt + 250-500 response tokens, the trainer's own pieces
(make_batch, target_features, dflash_loss, AdamW; like the trainer, nothing in a step waits for the
GPU). Prints seconds per step at several batch sizes
(CUDA-synchronised, after three warm-up steps, which also compile the trainer's fused functions when
FLASHDRAFT_TRAIN_COMPILE allows) and torch.profiler tables of three steps at one batch size
(their footer gives the GPU time of the three steps).

    python benchmarks/device/train_speed.py [--batch 4,16,32] [--profile-batch 16] [--labels data]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flashdraft.train.drafter import drafter_spec, init_drafter
from flashdraft.train.features import target_features
from flashdraft.train.loss import dflash_loss, gamma_for
from flashdraft.train.trainer import TrainConfig, make_batch

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
               rope_theta=100000.0, tie_word_embeddings=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="4,16,32")
    ap.add_argument("--profile-batch", type=int, default=16, help="0: no profile")
    ap.add_argument("--labels", default="data")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the timings here as json")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    tcfg = LlamaConfig(**SMOLLM2)
    target = LlamaForCausalLM(tcfg).to(dev, torch.bfloat16).eval().requires_grad_(False)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    spec = drafter_spec(tcfg, TrainConfig(num_layers=3, block_size=8, target_layer_ids=[1, 14, 27]), 16)
    drafter = init_drafter(spec, dev, 0)
    drafter.setup(2048)
    drafter.rope.cos, drafter.rope.sin = drafter.rope.cos.float(), drafter.rope.sin.float()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    rng = random.Random(0)
    samples = []
    for _ in range(256):
        p, r = rng.randint(120, 300), rng.randint(250, 500)
        samples.append(([rng.randrange(100, 49000) for _ in range(p + r)], p))
    gen = torch.Generator().manual_seed(0)
    tap_idx = [i + 1 for i in spec.target_layer_ids]
    gamma = gamma_for(8)

    def step(b: int) -> None:
        ids, lengths, anchors, valid = make_batch(rng.sample(samples, b), 512, gen, dev)
        taps, logits = target_features(target, ids, lengths, tap_idx, None, args.labels != "data")
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss, stats = dflash_loss(drafter, lm_head, embed, taps, ids, lengths, anchors, valid, 16, gamma, None,
                                      args.labels, logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    from flashdraft.train import loss as loss_mod

    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "labels": args.labels, "compile": loss_mod.COMPILE}
    print(f"FLASHDRAFT_TRAIN_COMPILE={loss_mod.COMPILE}", flush=True)
    for b in map(int, args.batch.split(",")):
        for _ in range(3):
            step(b)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(b)
        sync()
        dt = (time.perf_counter() - t0) / args.steps
        res[f"b{b}_s_per_step"] = dt
        print(f"batch {b}: {dt * 1000:.1f} ms/step, {b / dt:.1f} sequences/s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30 if dev.type == 'cuda' else 0:.1f} GiB", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if not args.profile_batch:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step(args.profile_batch)
        sync()
    ka = prof.key_averages()
    print(ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
    print(ka.table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
