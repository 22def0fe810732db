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
- trees (with `--trees`): the walk a verify of a token tree would make with the same drafter. A tree of
  widths c1,c2,... holds every sequence whose slot k is one of the drafter's c_k most likely tokens
  there (one forward of the drafter as now; the block's slots are scored independently, so the tree is
  their product). It commits the leading slots whose answer token is among the slot's candidates, plus
  one; it verifies sum over depths d of c1 x ... x c_d draft rows instead of B - 1. A simulation on the
  greedy answers (their tokens are what any lossless verify commits), not an engine feature.
  `--tree-budgets N,...`: best-first trees of N draft rows instead, the N sequences of the block with the
  highest product of the drafter's slot probabilities (over its 16 most likely tokens a slot), as
  EAGLE-2 builds its trees: every prefix of a chosen sequence is chosen too.
`--samples F` scores saved {prompt_ids, response_ids} lines (e.g. training data) instead of
generating; the engine and walk columns then come from the walk alone.

    python benchmarks/anchor_tau_cpu.py --dataset mt-bench --num-prompts 16 --max-tokens 256
    python benchmarks/anchor_tau_cpu.py --samples data.jsonl.xz --num-prompts 16 --max-tokens 256
    python benchmarks/anchor_tau_cpu.py --dataset mt-bench --trees "2;4;2,2;4,2,2"
"""

from __future__ import annotations

import argparse
import heapq
import json

import torch
import torch.nn.functional as F
from per_prompt_tau import pooled  # benchmarks/ is on the path when this script runs

from flashdraft.models.loader import load_config, load_weights, resolve_model_dir
from flashdraft.speculative.loader import load_drafter
from flashdraft.train.features import target_features
from flashdraft.train.loss import block_attention_mask, draft_hidden

BINS = (0.3, 0.5, 0.7, 0.9, 1.0)  # upper edges of the bins of the target's top-1 probability
BEST_FIRST_WIDTH = 16  # a best-first tree picks among the drafter's most likely tokens of each slot


def parse_trees(text: str, block: int | None = None) -> list[tuple[int, ...]]:
    """'2;4,2' -> [(2, 1, ...), (4, 2, 1, ...)], one width per draft slot (B - 1 of them, 1 where not
    given; without a block size, the widths as given)."""
    trees = []
    for part in filter(None, (t.strip() for t in text.split(";"))):
        try:
            widths = tuple(int(w) for w in part.split(","))
        except ValueError:
            raise ValueError(f"a tree is widths separated by commas, got {part!r}") from None
        if min(widths) < 1:
            raise ValueError(f"a tree's widths are 1 or more, got {part!r}")
        if block is not None:
            if len(widths) > block - 1:
                raise ValueError(f"a tree has at most one width per draft slot ({block - 1}), got {part!r}")
            widths += (1,) * (block - 1 - len(widths))
        trees.append(widths)
    return trees


def tree_rows(widths: tuple[int, ...]) -> int:
    """Draft rows a verify of the product tree checks: sum over depths of the widths' running product."""
    rows, paths = 0, 1
    for w in widths:
        paths *= w
        rows += paths
    return rows


def tree_runs(top: torch.Tensor, widths: tuple[int, ...], ids: list[int], start: int) -> list[int]:
    """run(p) under the product tree: leading slots whose answer token is among that slot's candidates
    (top[n, k - 1, :width_k], the drafter's most likely tokens first), + 1, capped at the answer's end."""
    out = []
    for n, p in enumerate(range(start, start + top.shape[0])):
        r = 1
        for k, w in enumerate(widths, start=1):
            if p + k >= len(ids) or ids[p + k] not in top[n, k - 1, :w].tolist():
                break
            r += 1
        out.append(r)
    return out


def best_first_runs(top: torch.Tensor, prob: torch.Tensor, budget: int, ids: list[int], start: int) -> list[int]:
    """run(p) under the best-first tree of `budget` nodes at each anchor: nodes are rank paths (r1, .., rd),
    the slot-d token top[n, d - 1, r_d], in decreasing order of the product of their slot probabilities
    prob[n, d - 1, r_d] (each slot's ranks sorted, so a node's children and later siblings never come first)."""
    out = []
    width = top.shape[-1]
    for n, p in enumerate(range(start, start + top.shape[0])):
        pr = prob[n].tolist()
        heap, tree = [(-pr[0][0], (0,))], set()
        while heap and len(tree) < budget:
            neg, path = heapq.heappop(heap)
            tree.add(path)
            if path[-1] + 1 < width:  # the next sibling
                heapq.heappush(heap, (neg / pr[len(path) - 1][path[-1]] * pr[len(path) - 1][path[-1] + 1],
                                      path[:-1] + (path[-1] + 1,)))
            if len(path) < len(pr):  # the first child
                heapq.heappush(heap, (neg * pr[len(path)][0], path + (0,)))
        r, path = 1, ()
        for k in range(1, len(pr) + 1):
            row = top[n, k - 1].tolist()
            if p + k >= len(ids) or ids[p + k] not in row or path + (row.index(ids[p + k]),) not in tree:
                break
            path += (row.index(ids[p + k]),)
            r += 1
        out.append(r)
    return out


def walk(r: list[int]) -> tuple[int, int]:
    """Tokens committed and verify steps of the walk from the first answer token: p <- p + run(p)."""
    p = steps = 0
    while p < len(r):
        steps += 1
        p += r[p]
    return p, steps


def runs(drafter, target, lm_head, embed, ids: list[int], start: int, block: int,
         width: int = 1) -> tuple[list[int], list[float], torch.Tensor, torch.Tensor]:
    """run(p) for every anchor p in [start, len(ids) - 1): leading correct drafts + 1, capped at the answer's end;
    conf[q], the target's own probability of its top choice for token q (from its logits at q - 1); and the
    drafter's `width` most likely tokens at every anchor's slots [N, B - 1, width] with their probabilities."""
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
        prob, top = (h.view(-1, block, h.shape[-1])[:, 1:] @ lm_head.T).softmax(-1).topk(width, -1)  # [N, B-1, width]
    return tree_runs(top, (1,) * (block - 1), ids, start), conf, top, prob


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--samples", default=None, help="score these saved answers instead of generating")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--trees", default="", help="token trees to simulate, ';'-separated widths per slot: '2;4,2'")
    ap.add_argument("--tree-budgets", default="", help="best-first trees of these many draft rows: '16,32,64'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        parse_trees(args.trees)  # widths checked before minutes of generation; their count once B is known
        budgets = [int(b) for b in args.tree_budgets.split(",") if b.strip()]
    except ValueError as e:
        ap.error(f"--trees / --tree-budgets: {e}")
    if any(b < 1 for b in budgets):
        ap.error(f"--tree-budgets are 1 or more rows, got {args.tree_budgets!r}")
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
    try:
        trees = parse_trees(args.trees, block)
    except ValueError as e:
        ap.error(f"--trees: {e}")
    tree_walks = [[0, 0] for _ in trees + budgets]  # per tree: tokens committed, verify steps
    walk_tok = walk_steps = uni_sum = uni_n = 0
    per_slot_hits = [0] * block
    tested = [[0, 0] for _ in BINS]  # per bin of the target's confidence: drafts a verify checks, drafts accepted
    for ids, plen in seqs:
        r, conf, top, prob = runs(drafter, target, lm_head, embed, ids, plen, block,
                                  max([max(t) for t in trees] + [BEST_FIRST_WIDTH] * bool(budgets), default=1))
        for t, acc in zip(trees + budgets, tree_walks):
            tr = tree_runs(top, t, ids, plen) if isinstance(t, tuple) else best_first_runs(
                top[..., :BEST_FIRST_WIDTH], prob[..., :BEST_FIRST_WIDTH], t, ids, plen)
            tok, steps = walk(tr)
            acc[0] += tok
            acc[1] += steps
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
               for hi, (n, a) in zip(BINS, tested)],
           # token trees: the walk's tau and the draft rows each verify checks (linear: B - 1)
           "trees": [{"widths": list(t), "draft_rows": tree_rows(t), "walk_tau": tok / steps}
                     for t, (tok, steps) in zip(trees, tree_walks)]
           + [{"best_first": b, "draft_rows": b, "walk_tau": tok / steps}
              for b, (tok, steps) in zip(budgets, tree_walks[len(trees):])]}
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
