"""Where a drafter's tau is lost: every anchor of greedy answers scored at once by the training
forward (flashdraft.train.loss.draft_hidden, the trainer's view: HF transformers target, taps,
the block mask), against the tau the engine realises on the same answers.

For each answer, run(p) = 1 + the drafts of the block anchored at p that a greedy verify accepts
(leading slots equal to the answer's tokens). Three figures per set:
- engine: the engine's own tau on these requests (flashdraft, speculation on);
- walk: the anchors a verify actually meets, p0 = the first answer token, p <- p + run(p), scored
  by the training forward (should equal engine's up to float rounding: a check that training and
  serving see the same drafter);
- uniform: the mean run over every anchor with a whole block inside the answer (what the
  trainer's logged tau measures).
- walk_by_target_confidence: the drafts a verify checks on the walk (its accepted ones and its first
  miss), binned by the target's own top-1 probability at that position: each bin's share of them, its
  acceptance, and its share of the misses (where the target itself is unsure, a drafter must match a
  near-tie).
`--samples F` scores saved {prompt_ids, response_ids} lines (e.g. training data) instead of
generating; the engine and walk columns then come from the walk alone.

    python benchmarks/anchor_tau_cpu.py --dataset mt-bench --num-prompts 16 --max-tokens 256
    python benchmarks/anchor_tau_cpu.py --samples data.jsonl.xz --num-prompts 16 --max-tokens 256
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from per_prompt_tau import pooled  # benchmarks/ is on the path when this script runs

from flashdraft.models.loader import load_config, load_weights, resolve_model_dir
from flashdraft.spec.dflash import load_drafter
from flashdraft.train.loss import block_attention_mask, draft_hidden
from flashdraft.train.trainer import target_features

BINS = (0.3, 0.5, 0.7, 0.9, 1.0)  # upper edges of the bins of the target's top-1 probability


def runs(drafter, target, lm_head, embed, ids: list[int], start: int, block: int) -> tuple[list[int], list[float]]:
    """run(p) for every anchor p in [start, len(ids) - 1): leading correct drafts + 1, capped at the answer's end;
    and conf[q], the target's own probability of its top choice for token q (from its logits at q - 1)."""
    x = torch.tensor([ids])
    taps, logits = target_features(target, x, torch.tensor([len(ids)]),
                                   [i + 1 for i in drafter.spec.target_layer_ids], None, True)
    conf = [0.0] + logits[0, :-1].float().softmax(-1).amax(-1).tolist()
    with torch.no_grad():
        anchors = torch.arange(start, len(ids) - 1)[None]
        valid = torch.ones_like(anchors, dtype=torch.bool)
        blocks = torch.full((1, anchors.shape[1], block), drafter.spec.mask_token_id)
        blocks[:, :, 0] = x[0, anchors]
        mask = block_attention_mask(anchors, valid, len(ids), block)
        h = draft_hidden(drafter, taps, F.embedding(blocks.flatten(1), embed), anchors, mask, groups=0)
        pred = (h.view(-1, block, h.shape[-1])[:, 1:] @ lm_head.T).argmax(-1)  # [N, B-1]
    out = []
    for n, p in enumerate(anchors[0].tolist()):
        r = 1
        for k in range(1, block):
            if p + k >= len(ids) or pred[n, k - 1].item() != ids[p + k]:
                break
            r += 1
        out.append(r)
    return out, conf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--samples", default=None, help="score these saved answers instead of generating")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    folder = resolve_model_dir(None)
    seqs, engine_tau = [], None
    if args.samples:
        from flashdraft.train.data import read_samples

        for full, plen in read_samples(args.samples)[: args.num_prompts]:
            seqs.append((full[: plen + args.max_tokens], plen))
        draft_dir = args.draft
    else:
        from flashdraft import LLM, SamplingParams
        from flashdraft.bench.datasets import load_prompts

        convs = [p.messages for p in load_prompts(args.dataset, args.num_prompts)]
        # no acceptance gate: the engine verifies at every step, as the walk does
        llm = LLM(draft=args.draft, device="cpu", dtype="float32", speculative_min_acceptance_length=None)
        outs = llm.chat(convs, [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * len(convs))
        engine_tau = pooled([o.metrics for o in outs if o.metrics.get("num_drafts")])
        seqs = [(o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)) for o in outs]
        draft_dir = args.draft
        del llm
    if draft_dir == "auto":
        from flashdraft.engine.engine import shipped_drafter

        draft_dir = shipped_drafter(None)
    cfg = load_config(folder)
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    w = load_weights(folder)
    embed = w["model.embed_tokens.weight"].float()
    lm_head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    drafter = load_drafter(draft_dir, cfg, torch.device("cpu"), torch.float32)
    drafter.setup(max(len(s) for s, _ in seqs) + drafter.spec.block_size + 1)
    block = drafter.spec.block_size
    walk_tok = walk_steps = uni_sum = uni_n = 0
    per_slot_hits = [0] * block
    tested = [[0, 0] for _ in BINS]  # per bin of the target's confidence: drafts a verify checks, drafts accepted
    for ids, plen in seqs:
        r, conf = runs(drafter, target, lm_head, embed, ids, plen, block)
        p = 0
        while p < len(r):
            walk_steps += 1
            walk_tok += r[p]
            # the drafts this verify checks: the accepted ones and the first miss (none past the answer's end)
            for q in range(plen + p + 1, min(plen + p + r[p] + 1, plen + p + block, len(ids))):
                b = next(i for i, hi in enumerate(BINS) if conf[q] <= hi)
                tested[b][0] += 1
                tested[b][1] += q < plen + p + r[p]
            p += r[p]
        whole = r[: max(0, len(r) - (block - 1))]
        uni_sum += sum(whole)
        uni_n += len(whole)
        for v in whole:
            for k in range(1, v):
                per_slot_hits[k] += 1
    res = {"set": args.samples or args.dataset, "answers": len(seqs), "engine_tau": engine_tau,
           "walk_tau": walk_tok / walk_steps, "walk_steps": walk_steps, "uniform_tau": uni_sum / max(1, uni_n),
           "uniform_anchors": uni_n, "uniform_accept_per_slot": [h / max(1, uni_n) for h in per_slot_hits[1:]],
           # the drafts a verify checks, by the target's own top-1 probability there: share of them, acceptance
           "walk_by_target_confidence": [
               {"upto": hi, "share": n / max(1, sum(t[0] for t in tested)), "drafts": n,
                "accepted": a / max(1, n), "share_of_misses": (n - a) / max(1, sum(t[0] - t[1] for t in tested))}
               for hi, (n, a) in zip(BINS, tested)]}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
