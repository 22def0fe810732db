"""What the drafter's slots are scored against: the data's tokens, the target's greedy choices
("argmax") or the target's whole distribution ("kl"); and a training run stopped and resumed."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from flashdraft.train.drafter import drafter_spec, init_drafter
from flashdraft.train.loss import dflash_loss, head_cross_entropy, sample_anchors
from flashdraft.train.trainer import LOG_EVERY, TrainConfig, train


def test_chunked_kl_matches_dense_float64():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 6, generator=g, dtype=torch.float64)
    soft = torch.randn(7, 20, generator=g, dtype=torch.float64) * 3
    rows = torch.randint(0, 7, (11,), generator=g)
    kl, pred = head_cross_entropy(h, w, torch.zeros(11, dtype=torch.long), chunk=4, soft=soft, rows=rows)
    weights = torch.arange(11.0, dtype=torch.float64)
    (kl * weights).sum().backward()
    gh = h.grad.clone()
    h.grad = None
    logits = h @ w.T
    ref = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(soft[rows], -1), log_target=True,
                   reduction="none").sum(-1)
    (ref * weights).sum().backward()
    torch.testing.assert_close(kl, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, logits.argmax(-1)) and (ref > 0).all()
    torch.testing.assert_close(gh, h.grad, rtol=1e-10, atol=1e-12)


@pytest.fixture
def setup(tiny_llama):
    """A 1-layer drafter of the tiny target's shape, random taps and target logits, two sequences."""
    from flashdraft.models.loader import load_config

    cfg = load_config(tiny_llama)
    drafter = init_drafter(drafter_spec(cfg, TrainConfig(num_layers=1, block_size=4, target_layer_ids=[0, 2]), 3),
                           "cpu", 0).double()
    drafter.setup(64)
    g = torch.Generator().manual_seed(2)
    b, s, vocab, hidden = 2, 20, cfg.vocab_size, cfg.hidden_size
    embed = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    lm_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.2
    taps = torch.randn(b, s, drafter.fc.weight.shape[1], generator=g, dtype=torch.float64)
    logits = torch.randn(b, s, vocab, generator=g, dtype=torch.float64) * 2
    lengths = torch.tensor([20, 15])
    loss_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask[:, 5:] = True
    anchors, valid = sample_anchors(loss_mask, lengths, 6, torch.Generator().manual_seed(3))
    greedy = torch.cat([torch.tensor([[7], [9]]), logits[:, :-1].argmax(-1)], 1)  # x[t] = argmax of logits[t - 1]

    def loss(ids, labels, target_logits=logits):
        return dflash_loss(drafter, lm_head, embed, taps, ids, lengths, anchors, valid, 3, 4.0, None, labels,
                           target_logits)
    loss.anchors = [anchors[i][valid[i]].tolist() for i in range(b)]
    return loss, greedy, logits, vocab


def test_argmax_labels_are_the_targets_greedy_tokens(setup):
    loss, greedy, logits, _ = setup
    # on a sequence the target itself wrote greedily, its choices are the data's tokens
    (l_data, st_data), (l_arg, st_arg) = loss(greedy, "data"), loss(greedy, "argmax")
    torch.testing.assert_close(l_arg, l_data, rtol=0, atol=0)
    assert all(torch.equal(st_arg[k], st_data[k]) for k in st_data)
    # other tokens at response positions that are no anchor (a sampled response): "data" scores
    # them, "argmax" still scores the target's greedy choices, which the logits alone decide
    anchors = loss.anchors
    sampled = greedy.clone()
    for i in range(2):
        for t in range(5, 20):
            if t not in anchors[i]:
                sampled[i, t] = (sampled[i, t] + 1) % logits.shape[-1]
    assert not torch.allclose(loss(sampled, "data")[0], l_data)
    torch.testing.assert_close(loss(sampled, "argmax")[0], l_arg, rtol=0, atol=0)


def test_kl_to_a_one_hot_target_is_cross_entropy_on_its_argmax(setup):
    loss, greedy, logits, vocab = setup
    sharp = F.one_hot(logits.argmax(-1), vocab).double() * 60.0  # softmax = one-hot to 1e-24
    l_kl, st_kl = loss(greedy, "kl", sharp)
    l_arg, st_arg = loss(greedy, "argmax", sharp)
    torch.testing.assert_close(l_kl, l_arg, rtol=1e-9, atol=1e-9)
    assert all(torch.equal(st_kl[k], st_arg[k]) for k in st_arg)
    # a soft target is not the same objective
    l_soft, _ = loss(greedy, "kl", logits)
    assert not torch.allclose(l_soft, l_arg)


def test_bad_labels_are_refused(setup):
    loss, greedy, _, _ = setup
    with pytest.raises(ValueError, match="unknown labels 'tokens'"):
        loss(greedy, "tokens")
    with pytest.raises(ValueError, match="needs the target's logits"):
        loss(greedy, "kl", None)


def test_train_with_kl_labels_stops_and_resumes(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["the quick brown fox", "def add(a, b):", "Paris is", "1 + 1 =", "speculative"]))
    common = dict(model=str(tiny_llama), out=str(tmp_path / "d"), prompts=str(prompts), max_new_tokens=48,
                  num_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=3, max_steps=30,
                  batch_size=5, num_anchors=16, lr=3e-3, device="cpu", dtype="float32", gen_batch=8,
                  labels="kl")
    first = TrainConfig(stop_after_s=0.0, **common)  # stops (and saves) at its first look at the clock
    train(first)
    assert [r["step"] for r in first.log] == list(range(1, LOG_EVERY + 1)) and first.log[0]["total_steps"] == 30
    state = torch.load(tmp_path / "d" / "trainer_state.pt", weights_only=False)
    assert state["step"] == LOG_EVERY and state["plan"]["total"] == 30
    rest = TrainConfig(resume=True, **common)
    train(rest)
    assert [r["step"] for r in rest.log] == list(range(LOG_EVERY + 1, 31))
    losses = [r["loss"] for r in first.log + rest.log]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    log = [json.loads(x) for x in (tmp_path / "d" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 31))
    # resuming a run that has finished trains nothing and leaves the saved drafter as it was
    before = load_file(tmp_path / "d" / "model.safetensors")
    again = TrainConfig(resume=True, **common)
    train(again)
    assert again.log == []
    after = load_file(tmp_path / "d" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert len((tmp_path / "d" / "train_log.jsonl").read_text().splitlines()) == 30


def test_stop_after_counts_the_setup_and_a_fresh_start_begins_a_new_log(tiny_llama, tmp_path, monkeypatch):
    """--stop-after bounds the whole command: a job whose setup (reading the data, loading the target)
    already used its seconds saves at its first look at the clock, before a time limit can kill it
    unsaved. A start with no trainer state (also under --resume) writes a new log, not after a lost
    attempt's records."""
    import time

    import flashdraft.train.data as data_mod

    g = torch.Generator().manual_seed(0)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_ids": torch.randint(3, 300, (8,), generator=g).tolist(),
                                          "response_ids": torch.randint(3, 300, (40,), generator=g).tolist()})
                              for _ in range(5)))
    out = tmp_path / "d"
    out.mkdir()
    (out / "train_log.jsonl").write_text(json.dumps({"step": 999, "loss": 9.9}) + "\n")  # an attempt that left no state
    read = data_mod.read_samples

    def slow_read(path, *args):  # setup that takes longer than the run may last
        time.sleep(2.5)
        return read(path, *args)

    monkeypatch.setattr(data_mod, "read_samples", slow_read)
    cfg = TrainConfig(model=str(tiny_llama), out=str(out), data=str(data), num_layers=1, block_size=4,
                      target_layer_ids=[0, 2], mask_token_id=3, max_steps=400, batch_size=5, num_anchors=16,
                      device="cpu", dtype="float32", stop_after_s=2.0, resume=True)
    train(cfg)
    assert [r["step"] for r in cfg.log] == list(range(1, LOG_EVERY + 1))
    assert torch.load(out / "trainer_state.pt", weights_only=False)["step"] == LOG_EVERY
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, LOG_EVERY + 1))
