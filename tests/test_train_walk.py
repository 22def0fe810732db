"""Weighting the training loss toward the anchors a greedy verify meets (--anchor-walk): the walk
against a plain Python walk, and the weighted loss against the loss over those anchors alone."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flashdraft.train.drafter import drafter_spec, init_drafter
from flashdraft.train.loss import block_attention_mask, dflash_loss, draft_hidden, sample_anchors, walk_anchors
from flashdraft.train.trainer import TrainConfig


def python_walk(anchors: list[int], runs: list[int]) -> set[int]:
    """Indices a verify meets: from the first anchor, the next block at the first anchor >= p + run(p)."""
    seen, i = set(), 0
    while i < len(anchors):
        seen.add(i)
        nxt = anchors[i] + runs[i]
        i = next((j for j in range(i + 1, len(anchors)) if anchors[j] >= nxt), len(anchors))
    return seen


def test_walk_anchors_matches_a_python_walk():
    rng = random.Random(0)
    b, n = 12, 40
    anchors = torch.zeros(b, n, dtype=torch.long)
    valid = torch.zeros(b, n, dtype=torch.bool)
    run = torch.randint(1, 9, (b, n), generator=torch.Generator().manual_seed(1))
    for i in range(b):
        k = rng.randint(1, n)  # some rows padded, some anchors a subset of the positions (gaps)
        pick = sorted(rng.sample(range(200), k)) if i % 2 else list(range(10, 10 + k))
        anchors[i, :k] = torch.tensor(pick)
        valid[i, :k] = True
    got = walk_anchors(anchors, valid, run)
    lengths = []
    for i in range(b):
        k = int(valid[i].sum())
        want = python_walk(anchors[i, :k].tolist(), run[i, :k].tolist())
        assert set(got[i].nonzero().flatten().tolist()) == want, i
        lengths.append(len(want))
    assert max(lengths) > 8 and min(lengths) < max(lengths)  # long chains: several doubling rounds matter


@pytest.fixture
def walk_case(tiny_llama):
    """A 1-layer float64 drafter, random taps, and one sequence whose tokens follow the drafter's own
    drafts for a random number of slots after each anchor, so blocks accept runs of 1 to 4."""
    from flashdraft.models.loader import load_config

    cfg = load_config(tiny_llama)
    drafter = init_drafter(drafter_spec(cfg, TrainConfig(num_layers=1, block_size=4, target_layer_ids=[0, 2]), 3),
                           "cpu", 0).double()
    drafter.setup(64)
    g = torch.Generator().manual_seed(4)
    s, vocab, hidden = 40, cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    lm_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.5
    taps = torch.randn(1, s, drafter.fc.weight.shape[1], generator=g, dtype=torch.float64)
    ids = torch.randint(4, vocab, (1, s), generator=g)

    def drafts(p: int) -> list[int]:  # the drafter's slots 1..3 for a block anchored at p: depend on ids[p] alone
        a = torch.tensor([[p]])
        block = torch.tensor([[ids[0, p].item(), 3, 3, 3]])
        h = draft_hidden(drafter, taps, F.embedding(block, embed), a,
                         block_attention_mask(a, torch.ones(1, 1, dtype=torch.bool), s, 4), groups=0)
        return (h[0, 1:] @ lm_head.T).argmax(-1).tolist()

    rng = random.Random(5)
    with torch.no_grad():
        for p in range(5, s - 1):
            k = rng.randint(0, 3)
            ids[0, p + 1: p + 1 + k] = torch.tensor(drafts(p)[: min(k, s - 1 - p)])
        runs = {}
        for p in range(5, s - 1):
            r = 1
            for k, t in enumerate(drafts(p), 1):
                if p + k >= s or t != ids[0, p + k].item():
                    break
                r += 1
            runs[p] = r
    loss_mask = torch.zeros(1, s, dtype=torch.bool)
    loss_mask[:, 5:] = True
    lengths = torch.tensor([s])
    anchors, valid = sample_anchors(loss_mask, lengths, 64, torch.Generator().manual_seed(6))
    assert anchors[0].tolist() == list(range(5, s - 1))  # every position is an anchor

    def loss(walk_floor=None, valid=valid):
        return dflash_loss(drafter, lm_head, embed, taps, ids, lengths, anchors, valid, 3, 4.0,
                           walk_floor=walk_floor)
    return loss, anchors, valid, runs


def test_walk_weighted_loss_is_the_loss_over_the_walk(walk_case):
    loss, anchors, valid, runs = walk_case
    order = anchors[0].tolist()
    assert max(runs.values()) >= 3 and min(runs.values()) == 1
    walk = python_walk(order, [runs[p] for p in order])
    assert 3 < len(walk) < len(order)
    on = torch.zeros_like(valid)
    on[0, sorted(walk)] = True
    l_walk, st_walk = loss(0.0)
    l_ref, _ = loss(None, valid & on)  # only the walk's blocks
    torch.testing.assert_close(l_walk, l_ref, rtol=1e-12, atol=1e-12)
    # the logged walk tau is what a verify would commit per step on this sequence
    torch.testing.assert_close(st_walk["walk_tau"].double(), torch.tensor(sum(runs[order[i]] for i in walk) / len(walk),
                                                                          dtype=torch.float64))
    l_all, st_all = loss(None)
    l_one, _ = loss(1.0)
    torch.testing.assert_close(l_one, l_all, rtol=1e-12, atol=1e-12)
    l_mix, _ = loss(0.25)
    assert min(l_walk, l_all) - 1e-9 <= l_mix <= max(l_walk, l_all) + 1e-9 and l_walk != l_all
    with pytest.raises(ValueError, match="walk_floor must lie in"):
        loss(1.5)
