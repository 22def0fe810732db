"""The drafter trainer on CPU: a few steps on a tiny random target lower the loss, and the written
checkpoint (z-lab layout) loads back into the engine and drafts what the trained weights draft."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from flashdraft import LLM, SamplingParams
from flashdraft.train.loss import block_attention_mask, head_cross_entropy
from flashdraft.train.trainer import TrainConfig, train


def test_block_mask_strictly_before_anchor_and_own_block_only():
    anchors = torch.tensor([[2, 5]])
    valid = torch.tensor([[True, True]])
    m = block_attention_mask(anchors, valid, ctx_len=8, block=3)[0]
    ctx, blocks = m[:, :8], m[:, 8:]
    assert ctx[:3].sum(1).tolist() == [2, 2, 2] and ctx[3:].sum(1).tolist() == [5, 5, 5]  # keys < anchor
    assert blocks[:3, :3].all() and not blocks[:3, 3:].any() and blocks[3:, 3:].all() and not blocks[3:, :3].any()


def test_block_mask_local_window_keeps_recent_context_and_position_zero():
    anchors, valid = torch.tensor([[6]]), torch.tensor([[True]])
    m = block_attention_mask(anchors, valid, ctx_len=8, block=2, window=2)[0]
    assert m[:, :8].nonzero()[:, 1].unique().tolist() == [0, 4, 5]  # sink + the 2 positions before the anchor
    assert m[:, 8:].all()


def test_chunked_head_cross_entropy_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 20, (11,), generator=g)
    ce, pred = head_cross_entropy(h, w, y, chunk=4)  # 3 chunks, gradients computed with the loss
    (ce * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    gh = h.grad.clone()
    h.grad = None
    logits = h @ w.T
    ref = F.cross_entropy(logits, y, reduction="none")
    (ref * torch.arange(11.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(ce, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(gh, h.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # evaluation: the same values, no gradient work kept
        ce2, pred2 = head_cross_entropy(h, w, y, chunk=4)
    assert torch.equal(ce2, ce.detach()) and torch.equal(pred2, pred)


def test_head_cross_entropy_bf16_autocast_close_to_float64():
    """The training dtype: bf16 logits under autocast, float32 softmax; loss and gradient within
    bf16 rounding of a float64 computation on the same (bf16-rounded) inputs."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g).to(torch.bfloat16).float().requires_grad_()
    w = (torch.randn(300, 16, generator=g) * 0.5).to(torch.bfloat16)
    y = torch.randint(0, 300, (37,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = head_cross_entropy(h, w, y, chunk=10)
    assert ce.dtype == torch.float32
    ce.sum().backward()
    h64 = h.detach().double().requires_grad_()
    ref = F.cross_entropy(h64 @ w.double().T, y, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(ce.double(), ref.detach(), rtol=0.02, atol=0.05)
    rel = (h.grad.double() - h64.grad).norm() / h64.grad.norm()
    assert rel < 0.02, rel


def test_train_few_steps_and_roundtrip(tiny_llama, tmp_path):
    out = tmp_path / "drafter"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["the quick brown fox", "def add(a, b):", "Paris is", "1 + 1 =", "speculative"]))
    cfg = TrainConfig(model=str(tiny_llama), out=str(out), prompts=str(prompts), max_new_tokens=48,
                      num_layers=1, block_size=4, target_layer_ids=[0, 2], mask_token_id=3, max_steps=40,
                      batch_size=5, num_anchors=16, lr=3e-3, device="cpu", dtype="float32", save_every=20,
                      gen_batch=8, local_context=4, local_context_frac=0.25)  # the curriculum for 10 steps
    train(cfg)
    losses = [r["loss"] for r in cfg.log]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["DFlashDraftModel"]
    assert cfg_json["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2], "block_size": 4}
    keys = set(load_file(str(out / "model.safetensors")))
    assert "layers.0.self_attn.q_proj.weight" in keys and "layers.0.mlp.gate_proj.weight" in keys
    assert not any(k.startswith(("embed_tokens", "lm_head")) or "qkv_proj" in k for k in keys)
    _assert_lossless_and_trained(tiny_llama, out)


def _assert_lossless_and_trained(tiny_llama, out) -> None:
    """The engine loads the trained drafter, gives plain decoding's tokens on its training prompts, and
    accepts its drafts far more often than a random drafter's (an untrained drafter over this 320-token
    vocabulary accepts ~1/320 of them: tau ~1.00)."""
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    spec = LLM(str(tiny_llama), draft=str(out), device="cpu", dtype="float32")
    ids = [json.loads(line)["prompt_ids"] for line in (out / "data.jsonl").read_text().splitlines()]
    params = SamplingParams(max_tokens=48)
    assert [o.token_ids for o in spec.generate(ids, params)] == [o.token_ids for o in plain.generate(ids, params)]
    assert spec.engine.spec_totals()["acceptance_length"] > 1.1


def test_tap_preconditioner_folds_into_saved_fc(tiny_llama, tmp_path):
    """Training feeds fc taps * scale; the saved checkpoint must give the same drafts from raw taps."""
    from flashdraft.models.loader import load_config
    from flashdraft.speculative.loader import load_drafter
    from flashdraft.train.drafter import drafter_spec, init_drafter, save_checkpoint
    from flashdraft.train.loss import draft_hidden

    target_cfg = load_config(tiny_llama)
    spec = drafter_spec(target_cfg, TrainConfig(num_layers=1, block_size=4, target_layer_ids=[0, 2]), 3)
    trained = init_drafter(spec, "cpu", 0)
    trained.setup(64)
    n_in = trained.fc.weight.shape[1]
    scale = torch.rand(n_in, generator=torch.Generator().manual_seed(0)) * 20 + 0.05
    save_checkpoint(trained, target_cfg, tmp_path, dtype=torch.float32, fc_scale=scale)
    loaded = load_drafter(tmp_path, target_cfg, torch.device("cpu"), torch.float32)
    loaded.setup(64)
    taps = torch.randn(2, 12, n_in) * 30
    embed = torch.randn(2, 8, target_cfg.hidden_size)
    anchors, valid = torch.tensor([[3, 7], [2, 5]]), torch.ones(2, 2, dtype=torch.bool)
    mask = block_attention_mask(anchors, valid, 12, 4)
    with torch.no_grad():
        want = draft_hidden(trained, taps * scale, embed, anchors, mask)
        got = draft_hidden(loaded, taps, embed, anchors, mask)
        ctx_want = trained.hidden_norm(trained.fc(taps * scale))
        ctx_got = loaded.hidden_norm(loaded.fc(taps))
        ctx_unfolded = trained.hidden_norm(trained.fc(taps))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ctx_got, ctx_want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ctx_unfolded, ctx_want, atol=1e-1)  # the fold is what makes them agree


def test_sharegpt_all_turns_adds_later_turns_and_keeps_heldout_out():
    from flashdraft.bench.datasets import first_human_turn, sharegpt_split
    from flashdraft.train.data import sharegpt_conversations

    first, every = sharegpt_conversations("first"), sharegpt_conversations("all")
    assert len(every) > 2 * len(first)
    assert {c[0]["content"] for c in first} <= {c[0]["content"] for c in every if len(c) == 1}
    held = {p.strip() for p in map(first_human_turn, sharegpt_split()[1]) if p}
    for conv in every:
        assert [m["role"] for m in conv] == ["user", "assistant"] * (len(conv) // 2) + ["user"]
        assert conv[0]["content"] not in held
    assert len({tuple(m["content"] for m in c) for c in every}) == len(every)


def test_generate_responses_several_seeded_samples_per_prompt(tiny_llama, tmp_path):
    from flashdraft.train.data import generate_responses, read_samples

    llm = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    convs = [[{"role": "user", "content": "the quick brown fox"}], [{"role": "user", "content": "1 + 1 ="}]]
    out = tmp_path / "data.jsonl"
    assert generate_responses(llm, convs, out, 12, 512, samples_per_prompt=3, temperature=1.0, seed=5) == 6
    got = sorted((tuple(s[:p]), tuple(s[p:])) for s, p in read_samples(out))
    # the reference: each draw generated on its own with the seed generate_responses gives it
    ids = [llm.engine.apply_chat_template(c) for c in convs]
    ref = sorted((tuple(ids[i]), tuple(llm.generate([ids[i]], SamplingParams(temperature=1.0, max_tokens=12,
                                                                            seed=5 + 3 * i + j))[0].token_ids))
                 for i in range(2) for j in range(3))
    assert got == ref
    assert len({r for _, r in got}) > 2  # the draws differ
    with pytest.raises(ValueError, match="temperature above 0"):
        generate_responses(llm, convs, out, 12, 512, samples_per_prompt=2)


def test_generate_responses_sampled_prefix_then_greedy(tiny_llama, tmp_path):
    """sampled_prefix: each sample's prompt is the chat prompt plus the first L tokens its seeded
    draw samples (L <= N), and its response is the greedy continuation of that, checked against
    plain sampled and greedy generation of each piece on its own."""
    from flashdraft.train.data import generate_responses, read_samples

    llm = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    convs = [[{"role": "user", "content": "the quick brown fox"}], [{"role": "user", "content": "1 + 1 ="}]]
    ids = [llm.engine.apply_chat_template(c) for c in convs]
    out = tmp_path / "data.jsonl"
    n = generate_responses(llm, convs, out, 10, 512, samples_per_prompt=8, temperature=1.0, seed=11,
                           sampled_prefix=4)
    got = read_samples(out)
    assert n == len(got) > 8
    sampled = {(i, j): llm.generate([ids[i]], SamplingParams(temperature=1.0, max_tokens=10, seed=11 + 8 * i + j))[0]
               for i in range(2) for j in range(8)}
    lengths = set()
    for seq, p in got:
        i = next(k for k in range(2) if seq[:len(ids[k])] == ids[k])
        prefix = seq[len(ids[i]):p]
        assert len(prefix) <= 4
        # the prefix is how one of the prompt's draws begins
        assert any(list(o.token_ids[:len(prefix)]) == prefix and len(o.token_ids) > len(prefix)
                   for (k, _), o in sampled.items() if k == i)
        greedy = llm.generate([seq[:p]], SamplingParams(temperature=0.0, max_tokens=10 - len(prefix)))[0]
        assert seq[p:] == list(greedy.token_ids)
        lengths.add(len(prefix))
    assert 0 in lengths and len(lengths) > 2
    for bad, msg in (({"sampled_prefix": 3}, "temperature above 0"),
                     ({"sampled_prefix": -1, "temperature": 1.0}, "0 or more")):
        with pytest.raises(ValueError, match=msg):
            generate_responses(llm, convs, out, 10, 512, **bad)


def test_train_drafter_refuses_a_sampled_prefix_without_temperature(tiny_llama, tmp_path, capsys):
    from flashdraft.cli import main

    out = tmp_path / "d"
    assert main(["train-drafter", "--model", str(tiny_llama), "--out", str(out), "--device", "cpu",
                 "--sampled-prefix", "8"]) == 2
    assert "sampled_prefix 8: needs 0, or N > 0 with gen_temperature above 0" in capsys.readouterr().err
    assert not (out / "data.jsonl").exists()  # refused before any answers were generated


def test_trim_loop_cuts_answers_k_tokens_into_their_closing_loop(tmp_path):
    import lzma
    import random

    from flashdraft.train.data import read_samples, trim_loop

    def brute(ids, keep, n):  # the first position from which every token repeats an earlier n-gram
        grams = [tuple(ids[i - n + 1: i + 1]) for i in range(len(ids))]
        rep = [i >= n - 1 and grams[i] in grams[n - 1: i] for i in range(len(ids))]
        start = min([s for s in range(len(ids) + 1) if all(rep[s:])])
        return ids[:start + keep]

    head, loop = list(range(100, 120)), [7, 8, 9, 10, 11]
    looping = head + loop * 12  # every 3-gram repeats from index 20 + 5 + (3 - 1) on
    assert trim_loop(looping, 0, n=3) == looping[:27]
    assert trim_loop(looping, 4, n=3) == looping[:31]
    assert trim_loop(looping, 1000, n=3) == looping
    ends_fresh = looping + [500, 501, 502]  # a loop in the middle, then new text: nothing to cut
    assert trim_loop(ends_fresh, 0, n=3) == ends_fresh
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(3) for _ in range(rng.randrange(1, 40))] + [rng.randrange(4)] * rng.randrange(12)
        for keep in (0, 3):
            assert trim_loop(ids, keep, n=3) == brute(ids, keep, 3), ids
    path = tmp_path / "d.jsonl.xz"  # read_samples: prompts kept whole, .xz read, whole answers without K
    path.write_bytes(lzma.compress("\n".join(json.dumps({"prompt_ids": p, "response_ids": r}) for p, r in
                                              [([1, 2], looping), ([3], ends_fresh)]).encode()))
    assert read_samples(path) == [([1, 2] + looping, 2), ([3] + ends_fresh, 1)]
    short = trim_loop(looping, 2)  # default 9-grams: recognised 9 - 1 tokens into the second period
    assert short == looping[:20 + 5 + 8 + 2]
    assert read_samples(path, trim_loops=2) == [([1, 2] + short, 2), ([3] + ends_fresh, 1)]
    with pytest.raises(ValueError, match="trim_loops must be 0 or more"):
        read_samples(path, trim_loops=-1)


def test_train_drafter_refuses_a_negative_trim_before_generating(tiny_llama, tmp_path, capsys):
    from flashdraft.cli import main

    out = tmp_path / "d"
    assert main(["train-drafter", "--model", str(tiny_llama), "--out", str(out), "--device", "cpu",
                 "--trim-loops", "-3"]) == 2
    assert "trim_loops must be 0 or more tokens, not -3" in capsys.readouterr().err
    assert not (out / "data.jsonl").exists()


def test_generate_responses_under_a_time_budget_answers_a_seeded_random_part(tiny_llama, tmp_path, monkeypatch):
    """A budget that cannot answer the whole list: runs with different seeds answer different
    conversations (in list order each would answer the same head), and each answer equals the one
    the same seed gives without a budget (the draw's seed follows its conversation)."""
    import flashdraft.train.data as data
    from flashdraft.train.data import generate_responses, read_samples

    class Clock:  # one tick per look at the clock: the budget counts engine steps, not seconds
        t = 0.0

        def monotonic(self) -> float:
            self.t += 1.0
            return self.t

    llm = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", max_num_seqs=1)
    convs = [[{"role": "user", "content": f"question number {k}"}] for k in range(12)]
    ids = [tuple(llm.engine.apply_chat_template(c)) for c in convs]
    full = {}
    for seed in (3, 4):
        generate_responses(llm, convs, tmp_path / f"full{seed}.jsonl", 6, 512, temperature=1.0, seed=seed)
        full[seed] = {tuple(s[:p]): tuple(s[p:]) for s, p in read_samples(tmp_path / f"full{seed}.jsonl")}
        assert len(full[seed]) == 12
    answered = {}
    for seed in (3, 4):
        monkeypatch.setattr(data, "time", Clock())
        n = generate_responses(llm, convs, tmp_path / f"part{seed}.jsonl", 6, 512, time_budget_s=30,
                               temperature=1.0, seed=seed)
        got = {tuple(s[:p]): tuple(s[p:]) for s, p in read_samples(tmp_path / f"part{seed}.jsonl")}
        assert 0 < n == len(got) < 12
        assert all(full[seed][k] == v for k, v in got.items())
        answered[seed] = {ids.index(k) for k in got}
    assert answered[3] != answered[4]
    assert any(a != set(range(len(a))) for a in answered.values())  # not the list's head


def test_read_prompt_file_plain_and_gzipped_and_bad_lines(tmp_path):
    import gzip

    from flashdraft.train.data import read_prompt_file

    lines = [json.dumps({"prompt": "hi"}), "",
             json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                      {"role": "user", "content": "c"}]})]
    plain, packed = tmp_path / "p.jsonl", tmp_path / "p.jsonl.gz"
    plain.write_text("\n".join(lines))
    packed.write_bytes(gzip.compress("\n".join(lines).encode()))
    want = [[{"role": "user", "content": "hi"}],
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]]
    assert read_prompt_file(plain) == want and read_prompt_file(packed) == want
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": "x"}))
    with pytest.raises(ValueError, match="bad.jsonl:1: expected a non-empty 'prompt'"):
        read_prompt_file(tmp_path / "bad.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")


def test_data_parallel_training_with_torchrun(tiny_llama, tmp_path):
    """`torchrun --nproc-per-node 2 -m flashdraft train-drafter` on CPU (gloo): the ranks share the
    prompts, their samples equal a one-process run's, the trained weights stay identical across
    ranks (checked by the trainer at every save), the loss falls and the checkpoint loads."""
    import os
    import subprocess
    import sys

    from flashdraft.train.data import generate_responses, read_prompt_file, read_samples

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["the quick brown fox", "def add(a, b):", "Paris is", "1 + 1 =", "speculative"]))
    out = tmp_path / "drafter"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29533",
           "-m", "flashdraft", "train-drafter", "--model", str(tiny_llama), "--out", str(out),
           "--prompts", str(prompts), "--samples-per-prompt", "2", "--gen-temperature", "0.3", "--seed", "7",
           "--max-new-tokens", "32", "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,2",
           "--mask-token-id", "3", "--max-steps", "40", "--batch-size", "3", "--num-anchors", "16",
           "--lr", "3e-3", "--device", "cpu", "--dtype", "float32", "--save-every", "10", "--gen-batch", "8"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the joined data = what one process generates with the same seed
    llm = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    generate_responses(llm, read_prompt_file(prompts), tmp_path / "one.jsonl", 32, 512, samples_per_prompt=2,
                       temperature=0.3, seed=7)
    got = read_samples(out / "data.jsonl")
    assert sorted(got) == sorted(read_samples(tmp_path / "one.jsonl"))
    assert len({tuple(s) for s, _ in got}) > 5  # the two draws of a prompt differ (seeds matter)
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 41))  # rank 0 alone writes the log
    losses = [r["loss"] for r in log]
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    spec = LLM(str(tiny_llama), draft=str(out), device="cpu", dtype="float32")
    ids = [s[:p] for s, p in read_samples(out / "data.jsonl")][:4]
    params = SamplingParams(max_tokens=24)
    assert [o.token_ids for o in spec.generate(ids, params)] == [o.token_ids for o in llm.generate(ids, params)]


def test_data_parallel_narrowing_keeps_the_same_channels_on_every_rank(tiny_llama, tmp_path):
    """A narrower --intermediate-size under torchrun: rank 0 measures the channels' activation energy and
    sends it, so every rank keeps the same channels (the trainer checks the ranks' weights agree at
    every save) and the narrowed drafter loads."""
    import os
    import subprocess
    import sys

    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2])
    inter = load_file(str(tmp_path / "start" / "model.safetensors"))["layers.0.mlp.down_proj.weight"].shape[1]
    out = tmp_path / "narrow"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29534",
           "-m", "flashdraft", "train-drafter", "--model", str(tiny_llama), "--out", str(out),
           "--prompts", common["prompts"], "--max-new-tokens", "24", "--init-drafter", common["init_drafter"],
           "--intermediate-size", str(inter - 8), "--max-steps", "4", "--save-every", "2", "--batch-size", "1",
           "--num-anchors", "8", "--device", "cpu", "--dtype", "float32", "--gen-batch", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["intermediate_size"] == inter - 8
    LLM(str(tiny_llama), draft=str(out), device="cpu", dtype="float32")


@pytest.mark.parametrize("window", [None, 3])
def test_grouped_draft_attention_equals_dense(tiny_llama, window):
    """Attention per anchor group over only the keys the group can see gives the values and
    gradients of every query over every key (float64), padded blocks and the curriculum window
    included."""
    from flashdraft.models.loader import load_config
    from flashdraft.train.drafter import drafter_spec, init_drafter
    from flashdraft.train.loss import draft_hidden, key_groups

    cfg = load_config(tiny_llama)
    drafter = init_drafter(drafter_spec(cfg, TrainConfig(num_layers=2, block_size=4, target_layer_ids=[0, 2]), 3),
                           "cpu", 0).double()
    drafter.setup(64)
    g = torch.Generator().manual_seed(1)
    b, s, n, block = 3, 30, 10, 4
    anchors = torch.stack([torch.randperm(s - 1, generator=g)[:n].sort().values for _ in range(b)])
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[2, 7:] = False  # a sequence with fewer anchors: padded blocks
    anchors[2, 7:] = 0
    taps = torch.randn(b, s, drafter.fc.weight.shape[1], generator=g, dtype=torch.float64)
    embed = torch.randn(b, n * block, cfg.hidden_size, generator=g, dtype=torch.float64)
    mask = block_attention_mask(anchors, valid, s, block, window)
    assert len(key_groups(anchors, 3)) == 3 and max(c for *_, c in key_groups(anchors, 3)) <= s
    results = []
    for groups in (0, 3, 8):
        drafter.zero_grad()
        out = draft_hidden(drafter, taps, embed, anchors, mask, groups=groups)
        (out * torch.linspace(-1, 1, out.shape[-1], dtype=torch.float64)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in drafter.parameters()]))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-10, atol=1e-10)
        for got, want in zip(grads, results[0][1]):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_data_parallel_refuses_too_little_data(tiny_llama, tmp_path):
    import os
    import subprocess
    import sys

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]}) + "\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29534",
           "-m", "flashdraft", "train-drafter", "--model", str(tiny_llama), "--out", str(tmp_path / "d"),
           "--data", str(data), "--num-layers", "1", "--block-size", "4", "--target-layer-ids", "0,2",
           "--mask-token-id", "3", "--batch-size", "8", "--device", "cpu", "--dtype", "float32"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode != 0
    assert "1 samples make 1 batches of 8; 2 data-parallel processes need at least one batch each" in r.stderr



def _saved_drafter_run(tiny_llama, tmp_path, taps: list[int]) -> dict:
    """A random 1-layer drafter with these taps saved to tmp_path/start (bf16, as the trainer writes),
    and the TrainConfig options that continue it on two prompts."""
    from flashdraft.models.loader import load_config
    from flashdraft.train.drafter import drafter_spec, init_drafter, save_checkpoint

    cfg = load_config(tiny_llama)
    saved = init_drafter(drafter_spec(cfg, TrainConfig(num_layers=1, block_size=4, target_layer_ids=taps), 3),
                         "cpu", 5)
    save_checkpoint(saved, cfg, tmp_path / "start")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the quick brown fox", "def add(a, b):"]))
    return dict(model=str(tiny_llama), prompts=str(prompts), max_new_tokens=24, batch_size=2, num_anchors=8,
                device="cpu", dtype="float32", gen_batch=4, init_drafter=str(tmp_path / "start"))


def test_init_drafter_continues_a_saved_checkpoint(tiny_llama, tmp_path):
    """--init-drafter starts from a saved drafter (its fc takes raw taps; training unfolds the tap
    preconditioner): zero steps write the same weights back, and training goes on from it."""
    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2]) | dict(
        num_layers=3)  # shape options are taken from the saved drafter instead
    again = TrainConfig(out=str(tmp_path / "zero"), epochs=0, **common)
    train(again)
    assert (again.block_size, again.num_layers, again.target_layer_ids) == (4, 1, [0, 2])
    want, got = load_file(str(tmp_path / "start" / "model.safetensors")), load_file(
        str(tmp_path / "zero" / "model.safetensors"))
    assert want.keys() == got.keys()
    for k in want:  # fc went through fc / scale (unfold) and * scale (fold): one bf16 rounding at most
        if k == "fc.weight":
            torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(got[k], want[k]), k
    more = TrainConfig(out=str(tmp_path / "more"), max_steps=5, lr=1e-3, **common)
    train(more)
    assert len(more.log) == 5 and all(math.isfinite(r["loss"]) for r in more.log)
    scale = torch.load(tmp_path / "more" / "trainer_state.pt", weights_only=False)["tap_scale"]
    assert scale.max() / scale.min() > 2  # the preconditioner is far from 1: the round trip above means something
    moved = load_file(str(tmp_path / "more" / "model.safetensors"))
    assert not torch.allclose(moved["fc.weight"], want["fc.weight"])


def test_init_drafter_with_more_taps_keeps_the_saved_function(tiny_llama, tmp_path):
    """--init-drafter with --target-layer-ids that add taps: fc widens, each saved tap's columns move to
    its place in the new order and the added ones start at zero, so the context features equal the saved
    drafter's on the same taps; a list that drops a saved tap is refused by name."""
    from flashdraft.models.loader import load_config
    from flashdraft.speculative.loader import load_drafter

    cfg = load_config(tiny_llama)
    common = _saved_drafter_run(tiny_llama, tmp_path, [2, 0]) | dict(epochs=0)
    wide = TrainConfig(out=str(tmp_path / "wide"), target_layer_ids=[0, 1, 2], **common)
    train(wide)
    new_cfg = json.loads((tmp_path / "wide" / "config.json").read_text())
    assert new_cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    old = load_drafter(tmp_path / "start", cfg, torch.device("cpu"), torch.float32)
    new = load_drafter(tmp_path / "wide", cfg, torch.device("cpu"), torch.float32)
    h = cfg.hidden_size
    assert new.fc.weight.shape == (h, 3 * h)
    assert torch.count_nonzero(new.fc.weight[:, h:2 * h]) == 0  # layer 1 is the added tap
    # fc went through the tap preconditioner's unfold and fold: one bf16 rounding at most
    torch.testing.assert_close(new.fc.weight[:, :h], old.fc.weight[:, h:], rtol=2 ** -7, atol=0)
    torch.testing.assert_close(new.fc.weight[:, 2 * h:], old.fc.weight[:, :h], rtol=2 ** -7, atol=0)
    layer = {i: torch.randn(2, 5, h, generator=torch.Generator().manual_seed(i)) * 10 for i in range(3)}
    with torch.no_grad():
        want = old.hidden_norm(old.fc(torch.cat([layer[2], layer[0]], -1)))  # the saved order: 2, then 0
        got = new.hidden_norm(new.fc(torch.cat([layer[0], layer[1], layer[2]], -1)))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().max() < 0.1 * (want - want.flip(0)).abs().max()  # far closer than unrelated rows
    with pytest.raises(ValueError, match=r"drop tap\(s\) \[2\]"):
        train(TrainConfig(out=str(tmp_path / "narrow"), target_layer_ids=[0, 1], **common))


def _assert_same_drafts(old, new, hidden: int) -> None:
    """Two drafters over two taps give the same hidden states for random taps and blocks, up to the one
    bf16 rounding of fc's unfold and fold through the tap preconditioner."""
    from flashdraft.train.loss import draft_hidden

    taps, embed = torch.randn(2, 12, 2 * hidden) * 3, torch.randn(2, 8, hidden)
    anchors = torch.tensor([[3, 7], [2, 5]])
    mask = block_attention_mask(anchors, torch.ones(2, 2, dtype=torch.bool), 12, 4)
    for m in (old, new):
        m.setup(64)
    with torch.no_grad():
        want, got = draft_hidden(old, taps, embed, anchors, mask), draft_hidden(new, taps, embed, anchors, mask)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    assert (got - want).abs().max() < 0.1 * (want - want.flip(0)).abs().max()  # far closer than unrelated rows


def test_init_drafter_adds_layers_and_narrows_mlps(tiny_llama, tmp_path):
    """--init-drafter with --add-layers and a smaller --intermediate-size: each saved MLP keeps its
    strongest channels and the added layers start with zero output projections. With the dropped
    channels carrying nothing (their down_proj columns zeroed here), the grown drafter drafts as the
    saved one; a wider MLP, or --add-layers without --init-drafter, is refused."""
    from flashdraft.models.loader import load_config
    from flashdraft.speculative.loader import load_drafter

    cfg = load_config(tiny_llama)
    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2]) | dict(epochs=0)
    path = tmp_path / "start" / "model.safetensors"
    w = load_file(str(path))
    inter = w["layers.0.mlp.down_proj.weight"].shape[1]
    live = [j for j in range(inter) if j % 3]  # every third channel is made dead
    w["layers.0.mlp.down_proj.weight"][:, [j for j in range(inter) if j % 3 == 0]] = 0
    save_file(w, str(path))
    train(TrainConfig(out=str(tmp_path / "grown"), add_layers=2, intermediate_size=len(live), **common))
    new_cfg = json.loads((tmp_path / "grown" / "config.json").read_text())
    assert (new_cfg["num_hidden_layers"], new_cfg["intermediate_size"]) == (3, len(live))
    old = load_drafter(tmp_path / "start", cfg, torch.device("cpu"), torch.float32)
    new = load_drafter(tmp_path / "grown", cfg, torch.device("cpu"), torch.float32)
    assert torch.equal(new.layers[0].mlp.down_proj.weight, old.layers[0].mlp.down_proj.weight[:, live])
    gate, up = old.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(new.layers[0].mlp.gate_up_proj.weight, torch.cat([gate[live], up[live]]))
    for layer in new.layers[1:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert torch.equal(layer.self_attn.qkv_proj.weight, new.layers[0].self_attn.qkv_proj.weight)
    _assert_same_drafts(old, new, cfg.hidden_size)
    with pytest.raises(ValueError, match=f"narrow its MLPs \\(the saved drafter's is {inter}\\)"):
        train(TrainConfig(out=str(tmp_path / "wider"), intermediate_size=inter + 1, **common))
    assert not (tmp_path / "wider" / "data.jsonl").exists()  # refused before any answers were generated
    with pytest.raises(ValueError, match="add_layers grows a saved drafter"):
        train(TrainConfig(model=str(tiny_llama), out=str(tmp_path / "new"), add_layers=1, device="cpu"))


def test_narrowing_keeps_the_channels_the_text_reaches(tiny_llama, tmp_path):
    """A smaller --intermediate-size keeps the MLP channels that carry the drafter's inputs on the
    training answers, not those with the heaviest weights: here a third of the channels read only
    hidden dimensions that the layer's norm zeroes, with ten times the weight; they never fire, they
    are the ones dropped (weight norms alone would keep them), and the narrowed drafter drafts as the
    saved one."""
    from flashdraft.models.loader import load_config
    from flashdraft.speculative.loader import load_drafter
    from flashdraft.train.drafter import grow_layers

    cfg = load_config(tiny_llama)
    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2]) | dict(epochs=0)
    path = tmp_path / "start" / "model.safetensors"
    w = load_file(str(path))
    h, inter = w["layers.0.mlp.down_proj.weight"].shape
    silent, live = [j for j in range(inter) if j % 3 == 0], [j for j in range(inter) if j % 3]
    w["layers.0.post_attention_layernorm.weight"][: h // 2] = 0  # the MLP's input is 0 on dims < h/2
    for name in ("gate_proj", "up_proj"):
        t = w[f"layers.0.mlp.{name}.weight"]
        t[silent, h // 2:] = 0
        t[silent, : h // 2] *= 10
        t[live, : h // 2] = 0
    save_file(w, str(path))
    old = load_drafter(tmp_path / "start", cfg, torch.device("cpu"), torch.float32)
    by_weights = grow_layers(old.state_dict(), 1, 0, len(live))["layers.0.mlp.down_proj.weight"]
    assert not torch.equal(by_weights, old.layers[0].mlp.down_proj.weight[:, live])  # the test can tell
    train(TrainConfig(out=str(tmp_path / "narrow"), intermediate_size=len(live), **common))
    new = load_drafter(tmp_path / "narrow", cfg, torch.device("cpu"), torch.float32)
    assert torch.equal(new.layers[0].mlp.down_proj.weight, old.layers[0].mlp.down_proj.weight[:, live])
    gate, up = old.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(new.layers[0].mlp.gate_up_proj.weight, torch.cat([gate[live], up[live]]))
    _assert_same_drafts(old, new, cfg.hidden_size)


def test_python_function_prompts_and_prompt_sources(tmp_path):
    from flashdraft.bench.datasets import load_prompts
    from flashdraft.train.data import python_function_prompts, training_conversations

    src = tmp_path / "lib"
    (src / "test").mkdir(parents=True)
    (src / "mod.py").write_text('def clamp(x: int, lo: int, hi: int) -> int:\n'
                                '    """Return x limited to the closed range [lo, hi], for integers."""\n'
                                '    return max(lo, min(x, hi))\n\n'
                                'def _private(x):\n    """A private helper that is never a problem to solve."""\n\n'
                                'def bare(x):\n    return x\n')
    (src / "test" / "test_mod.py").write_text('def test_it():\n    """A test function that is left out."""\n')
    got = python_function_prompts(src, min_doc=10)
    assert len(got) == 1 and "def clamp(x: int, lo: int, hi: int) -> int:" in got[0]
    assert "Return x limited to the closed range [lo, hi], for integers." in got[0]
    stdlib = python_function_prompts()
    assert len(stdlib) > 2000 and len(set(stdlib)) == len(stdlib)
    heval = {p.messages[0]["content"] for p in load_prompts("humaneval")}
    assert not heval & set(stdlib)  # the evaluation's problems are not among them
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": "hello"}) + "\n")
    both = training_conversations(f"{f},python")
    assert both[0] == [{"role": "user", "content": "hello"}] and len(both) == 1 + len(stdlib)
    with pytest.raises(FileNotFoundError, match="neither a file nor one of sharegpt, python"):
        training_conversations("pyhton")


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_target_features_taps_without_the_head_equal_the_full_forward(arch, request):
    """The trainer's target forward (its own additive causal + padding mask; the head skipped when no
    logits are needed) gives the taps and logits of transformers' forward with a 2-D padding mask,
    padded positions included. The last layer's tap is transformers' last hidden state, the
    final-normed one, as the engine and the z-lab reference read it."""
    from transformers import AutoModelForCausalLM

    from flashdraft.train.features import target_features

    folder = request.getfixturevalue(arch)
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    n = target.config.num_hidden_layers
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, target.config.vocab_size, (2, 9), generator=g)
    lengths = torch.tensor([9, 6])
    taps, none = target_features(target, ids, lengths, [1, n], None, want_logits=False)
    taps2, logits = target_features(target, ids, lengths, [1, n], None, want_logits=True)
    with torch.no_grad():
        mask = (torch.arange(9) < lengths[:, None]).long()
        ref = target(ids, attention_mask=mask, output_hidden_states=True)
        last = target.model.layers[n - 1]
        captured = {}
        hook = last.register_forward_hook(lambda m, a, out: captured.setdefault("x", out[0] if isinstance(out, tuple)
                                                                                  else out))
        target(ids, attention_mask=mask)
        hook.remove()
    assert none is None and torch.equal(logits, ref.logits)
    want = torch.cat([ref.hidden_states[1], ref.hidden_states[n]], -1)
    torch.testing.assert_close(taps, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(taps2, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ref.hidden_states[n], target.model.norm(captured["x"]), rtol=0, atol=1e-5)


def test_init_drafter_with_another_block_size(tiny_llama, tmp_path):
    """--init-drafter with --block-size: the saved weights unchanged under the new block size, a few
    steps train at it (the loss scores its slots), and a block of fewer than 2 is refused before any
    answers are generated."""
    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2])
    same = TrainConfig(out=str(tmp_path / "b8"), epochs=0, block_size=8, **common)
    train(same)
    assert json.loads((tmp_path / "b8" / "config.json").read_text())["dflash_config"]["block_size"] == 8
    want, got = load_file(str(tmp_path / "start" / "model.safetensors")), load_file(
        str(tmp_path / "b8" / "model.safetensors"))
    for k in want:  # fc through the tap preconditioner's unfold and fold: one bf16 rounding at most
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=2 ** -7, atol=0)
    more = TrainConfig(out=str(tmp_path / "b8more"), max_steps=3, block_size=8, **common)
    train(more)
    assert more.block_size == 8 and len(more.log) == 3 and all(math.isfinite(r["loss"]) for r in more.log)
    with pytest.raises(ValueError, match="block_size 1"):
        train(TrainConfig(out=str(tmp_path / "b1"), block_size=1, **common))
    assert not (tmp_path / "b1" / "data.jsonl").exists()


def test_anchor_walk_trains_and_logs_the_walk_tau(tiny_llama, tmp_path):
    """--anchor-walk W reaches the trainer: each logged step has the walk's tau; W outside [0, 1] is
    refused before any answers are generated."""
    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2])
    cfg = TrainConfig(out=str(tmp_path / "walk"), max_steps=3, walk_floor=0.5, **common)
    train(cfg)
    assert len(cfg.log) == 3 and all(math.isfinite(r["loss"]) and r["walk_tau"] >= 1 for r in cfg.log)
    with pytest.raises(ValueError, match="walk_floor must lie in"):
        train(TrainConfig(out=str(tmp_path / "bad"), walk_floor=2.0, **common))
    assert not (tmp_path / "bad" / "data.jsonl").exists()


def test_keep_every_keeps_a_loadable_drafter_per_step(tiny_llama, tmp_path):
    """--keep-every N writes the drafter of steps N, 2N, ... to OUT/steps/<step>: each a z-lab checkpoint
    the engine loads, the last one the final drafter, the earlier ones different weights; N < 1 is
    refused before any answers are generated."""
    from flashdraft.models.loader import load_config
    from flashdraft.speculative.loader import load_drafter

    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 2])
    out = tmp_path / "kept"
    train(TrainConfig(out=str(out), max_steps=4, keep_every=2, lr=1e-2, **common))
    assert sorted(p.name for p in (out / "steps").iterdir()) == ["000002", "000004"]
    final = load_file(str(out / "model.safetensors"))
    mid = load_file(str(out / "steps" / "000002" / "model.safetensors"))
    last = load_file(str(out / "steps" / "000004" / "model.safetensors"))
    assert all(torch.equal(last[k], final[k]) for k in final)
    assert any(not torch.equal(mid[k], final[k]) for k in final)
    assert (out / "steps" / "000002" / "config.json").read_text() == (out / "config.json").read_text()
    drafter = load_drafter(str(out / "steps" / "000002"), load_config(tiny_llama), torch.device("cpu"), torch.float32)
    assert drafter.spec.block_size == 4
    with pytest.raises(ValueError, match="keep_every must be a positive number of steps, not 0"):
        train(TrainConfig(out=str(tmp_path / "bad"), keep_every=0, **common))
    assert not (tmp_path / "bad" / "data.jsonl").exists()


D2_ARCH = dict(arch="dflash2", conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=8)


def test_train_dflash2_few_steps_drafts_as_the_reference(tiny_llama, tmp_path, monkeypatch):
    """--arch dflash2: the convolutions and the candidate selector train beside the drafter (both losses fall),
    the checkpoint is z-lab's DFlash2 layout, the engine is lossless with it, and z-lab's reference loads it
    and drafts exactly what flashdraft drafts at every verify step."""
    out = tmp_path / "d2"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in
                                 ["the quick brown fox", "def add(a, b):", "Paris is", "1 + 1 =", "speculative"]))
    cfg = TrainConfig(model=str(tiny_llama), out=str(out), prompts=str(prompts), max_new_tokens=48, num_layers=1,
                      block_size=4, target_layer_ids=[0, 2], mask_token_id=3, max_steps=40, batch_size=5,
                      num_anchors=16, lr=3e-3, device="cpu", dtype="float32", gen_batch=8, **D2_ARCH)
    train(cfg)
    first, last = cfg.log[:5], cfg.log[-5:]
    for key in ("loss", "selector_loss"):
        assert sum(r[key] for r in last) < 0.8 * sum(r[key] for r in first), [r[key] for r in cfg.log]
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["architectures"] == ["DFlash2DraftModel"]
    assert cfg_json["dflash_config"]["selector_top_k"] == 8 and cfg_json["dflash_config"]["conv_kernel_size"] == 2
    keys = set(load_file(str(out / "model.safetensors")))
    assert {"candidate_selector.predecessor_codebook", "layers.0.mlp_conv.base_kernel"} <= keys
    _assert_lossless_and_trained(tiny_llama, out)
    pytest.importorskip("dflash.model")
    from test_reference_drafters import compare

    compare(tiny_llama, out, monkeypatch, dflash2=True)


def test_dflash_drafter_grows_into_dflash2_with_the_same_drafts(tiny_llama, tmp_path, monkeypatch):
    """--init-drafter a DFlash drafter with --arch dflash2: identity convolutions and a selector whose
    successor codebook starts at zero, so before any step it drafts exactly as the drafter it grew from."""
    from fixtures import record_fed_drafts

    common = _saved_drafter_run(tiny_llama, tmp_path, [0, 1])
    train(TrainConfig(out=str(tmp_path / "grown"), epochs=0, **common, **D2_ARCH))
    assert json.loads((tmp_path / "grown" / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    fed = record_fed_drafts(monkeypatch)
    prompts, params = [[5, 17, 33, 80], [7] * 12], SamplingParams(max_tokens=16, ignore_eos=True)
    runs = []
    for d in ("start", "grown"):
        fed[:] = []
        LLM(str(tiny_llama), draft=str(tmp_path / d), device="cpu", dtype="float32").generate(prompts, params)
        runs.append(list(fed))
    assert runs[0] == runs[1] and runs[0]
    with pytest.raises(ValueError, match="pass arch dflash2 to continue it"):
        train(TrainConfig(out=str(tmp_path / "back"), epochs=0, **(common | {"init_drafter": str(tmp_path / "grown")})))
