"""DFlash: checkpoint formats and validation, the acceptance rule, losslessness against plain
decoding, oracle drafts, rollback hygiene."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from fixtures import build_random_drafter, poison_rejected

from flashdraft import LLM, SamplingParams
from flashdraft.speculative.formats import default_target_layer_ids
from flashdraft.speculative.verify import accepted_lengths

MIXED = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12], [9], [250, 251] * 9,
         list(range(3, 60, 2)), [42, 43, 44], [12, 99, 12, 99, 12], [300, 1, 301], list(range(100, 140)),
         [66] * 3, [5, 6], [17, 18, 19, 20, 21, 22, 23], [88, 77, 66, 55], [123, 45, 67, 89, 10, 11]]


def install_oracle(llm, futures: dict[tuple, list[int]], corrupt=None):
    """Replace the drafter's proposals with the target's own future tokens (optionally corrupted)."""
    sp = llm.engine.spec

    def propose(seqs):
        out = []
        for s in seqs:
            fut = futures[tuple(s.token_ids[: s.num_prompt_tokens])]
            k = s.num_output_tokens
            d = (fut[k: k + sp.block_size - 1] + [0] * sp.block_size)[: sp.block_size - 1]
            out.append(corrupt(s, d) if corrupt else d)
        return out

    sp.propose = propose


# ---- the acceptance rule ---------------------------------------------------------------------
@pytest.mark.parametrize("drafts, target, a", [
    ([5, 6, 7], [5, 6, 7, 8], 3),  # full accept: 3 drafts + bonus 8
    ([5, 6, 9], [5, 6, 7, 8], 2),  # partial: the third draft is wrong, bonus is 7
    ([1, 6, 7], [5, 6, 7, 8], 0),  # immediate reject: later matches do not count
    ([5, 1, 7], [5, 6, 7, 8], 1),
])
def test_acceptance_truth_table(drafts, target, a):
    assert accepted_lengths(torch.tensor([drafts]), torch.tensor([target])).item() == a


def test_acceptance_rows_are_independent():
    d = torch.tensor([[5, 6, 7], [1, 2, 3], [5, 6, 0]])
    t = torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9], [5, 6, 7, 8]])
    assert accepted_lengths(d, t).tolist() == [3, 0, 2]


def test_oracle_full_accept_equals_plain_with_tau_b(plain, spec):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = plain.generate(MIXED, SamplingParams(max_tokens=60, ignore_eos=True))
    install_oracle(spec, {tuple(p): o.token_ids for p, o in zip(MIXED, ref)})
    outs = spec.generate(MIXED, params)
    assert [o.token_ids for o in outs] == [o.token_ids[:30] for o in ref]
    B = spec.engine.spec.block_size
    for o in outs:
        m = o.metrics
        assert m["acceptance_length"] == B and m["num_accepted_tokens"] == m["num_draft_tokens"]
        assert m["acceptance_histogram"][-1] == m["num_drafts"]
    del spec.engine.spec.propose


def test_oracle_partial_accepts_per_request(plain, spec):
    """Requests accept different lengths in one batch; request r's drafts go wrong at slot r % B."""
    ref = plain.generate(MIXED, SamplingParams(max_tokens=60, ignore_eos=True))
    B = spec.engine.spec.block_size
    wrong_at = {tuple(p): i % B for i, p in enumerate(MIXED)}

    def corrupt(s, d):
        j = wrong_at[tuple(s.token_ids[: s.num_prompt_tokens])]
        return [t if i < j else (t + 1) % 300 + 3 for i, t in enumerate(d)]

    install_oracle(spec, {tuple(p): o.token_ids for p, o in zip(MIXED, ref)}, corrupt)
    outs = spec.generate(MIXED, SamplingParams(max_tokens=30, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids[:30] for o in ref]
    for p, o in zip(MIXED, outs):
        j = wrong_at[tuple(p)]
        h = o.metrics["acceptance_histogram"]
        assert h[j] == o.metrics["num_drafts"] and sum(h) == h[j], (j, h)
    del spec.engine.spec.propose


def test_stop_and_max_tokens_inside_accepted_run(plain, spec):
    ref = plain.generate(MIXED, SamplingParams(max_tokens=60, ignore_eos=True))
    futures = {tuple(p): o.token_ids for p, o in zip(MIXED, ref)}
    install_oracle(spec, futures)
    # max_tokens lands inside a fully accepted block for most lengths
    for n in (1, 2, 5, 7, 13):
        outs = spec.generate(MIXED[:4], SamplingParams(max_tokens=n, ignore_eos=True))
        assert [o.token_ids for o in outs] == [o.token_ids[:n] for o in ref[:4]]
        assert all(o.finish_reason == "length" for o in outs)
    # a stop token in the middle of an accepted run ends the request right there
    for p, r in zip(MIXED[:6], ref[:6]):
        stop = r.token_ids[9]
        want = plain.generate([p], SamplingParams(max_tokens=40, stop_token_ids=[stop], ignore_eos=True))[0]
        got = spec.generate([p], SamplingParams(max_tokens=40, stop_token_ids=[stop], ignore_eos=True))[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    # EOS inside an accepted run: stops there unless ignore_eos, exactly as plain decoding does
    for llm in (plain, spec):
        llm.engine.eos_token_ids.append(ref[2].token_ids[6])
    try:
        for ignore in (False, True):
            p = SamplingParams(max_tokens=20, ignore_eos=ignore)
            want = plain.generate(MIXED[:4], p)
            got = spec.generate(MIXED[:4], p)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
            if not ignore:
                assert want[2].finish_reason == "stop" and len(want[2].token_ids) <= 7
        assert want[2].finish_reason == "length" and len(want[2].token_ids) == 20
    finally:
        for llm in (plain, spec):
            llm.engine.eos_token_ids.pop()
    del spec.engine.spec.propose


def test_greedy_lossless_tiny_random_drafter(plain, spec):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [plain.generate([p], params)[0].token_ids for p in MIXED]
    single = [spec.generate([p], params)[0].token_ids for p in MIXED]
    batched = [o.token_ids for o in spec.generate(MIXED, params)]
    total = sum(len(r) for r in ref)
    match_single = sum(a == b for r, s in zip(ref, single) for a, b in zip(r, s))
    match_batched = sum(a == b for r, s in zip(ref, batched) for a, b in zip(r, s))
    print(f"tiny random drafter: token match single {match_single}/{total}, batched {match_batched}/{total}")
    assert match_single == total and match_batched == total


def test_greedy_lossless_smollm2_random_drafter(smollm2, tmp_path):
    from flashdraft.models.loader import resolve_model_dir

    target = resolve_model_dir(None)
    draft = build_random_drafter(tmp_path / "d", target, block_size=8, num_layers=1, target_layer_ids=[1, 14, 27],
                                 head_dim=64, num_attention_heads=9, num_key_value_heads=3, mask_token_id=0)
    spec = LLM(draft=str(draft), device="cpu", dtype="float32")
    qs = ["Name a fruit.", "What is 2+2?", "Say hi.", "Who wrote Hamlet?", "Define gravity.", "Count to five.",
          "What color is the sky?", "Give me a synonym for happy.", "What is Python?", "Name a planet.",
          "Translate 'cat' to French.", "What is the opposite of hot?", "Write one word.", "Spell 'dog'.",
          "What day comes after Monday?", "How many legs does a spider have?"]
    prompts = [spec.engine.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = [o.token_ids for o in smollm2.generate(prompts, params)]
    batched = [o.token_ids for o in spec.generate(prompts, params)]
    # one at a time, four of them: each verify of a random drafter's block commits about one token, so a
    # request alone costs as many 8-row steps as it has tokens
    single = [spec.generate([p], params)[0].token_ids for p in prompts[:4]]
    total = sum(len(r) for r in ref)
    match_b = sum(a == b for r, g in zip(ref, batched) for a, b in zip(r, g))
    match_s = sum(a == b for r, g in zip(ref, single) for a, b in zip(r, g))
    total_s = sum(len(r) for r in ref[:4])
    print(f"SmolLM2 + random drafter: token match batched {match_b}/{total}, single {match_s}/{total_s}")
    assert match_b == total and match_s == total_s
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_per_request_speculative_switch(plain, spec):
    params_on = SamplingParams(max_tokens=20, ignore_eos=True)
    params_off = SamplingParams(max_tokens=20, ignore_eos=True, speculative=False)
    ref = [o.token_ids for o in plain.generate(MIXED[:4], params_on)]
    outs = spec.generate(MIXED[:4], [params_on, params_off, params_on, params_off])
    assert [o.token_ids for o in outs] == ref
    assert outs[0].metrics["num_drafts"] > 0 and "num_drafts" not in outs[1].metrics


def test_fewer_speculative_tokens_than_block_slots(tiny_llama, drafter, plain):
    """num_speculative_tokens < B-1: the block still spans B positions, only k are verified."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(MIXED, params)]
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", num_speculative_tokens=2,
              kv_block_size=4)
    assert [o.token_ids for o in llm.generate(MIXED, params)] == ref
    tot = llm.engine.spec_totals()
    assert tot["num_draft_tokens"] == 2 * tot["num_drafts"] > 0


def test_rejected_state_is_never_read(plain, spec):
    """NaN into every K/V slot a rejected draft or a draft block wrote, target and drafter caches:
    any read of them would turn logits into NaN and change the tokens."""
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(MIXED, params)]
    with poison_rejected(spec):
        outs = spec.generate(MIXED, params)
    assert [o.token_ids for o in outs] == ref
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_preemption_with_speculation(tiny_llama, drafter, plain):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(MIXED[:6], params)]
    tight = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", num_kv_blocks=16,
                kv_block_size=8)
    outs = tight.generate(MIXED[:6], params)
    assert tight.engine.stats["num_preemptions"] > 0
    assert [o.token_ids for o in outs] == ref


# ---- checkpoint formats ----------------------------------------------------------------------
def test_default_tap_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(24, 5) == [1, 6, 11, 16, 21]


def _drafts(llm):
    return [o.token_ids for o in llm.generate(MIXED[:4], SamplingParams(max_tokens=8, ignore_eos=True))], \
        llm.engine.spec_totals()


def test_formats_load_and_agree(tiny_llama, tmp_path):
    """The same weights in every layout give the same drafter, hence the same acceptance."""
    a = build_random_drafter(tmp_path / "zlab", tiny_llama, block_size=4, seed=3)
    b = build_random_drafter(tmp_path / "zlab-nested", tiny_llama, block_size=4, seed=3, block_in_dflash_config=True)
    c = build_random_drafter(tmp_path / "spec", tiny_llama, fmt="speculators", block_size=4, seed=3)
    d = build_random_drafter(tmp_path / "spec-head", tiny_llama, fmt="speculators", block_size=4, seed=3,
                             own_head=True)
    runs = [_drafts(LLM(str(tiny_llama), draft=str(x), device="cpu", dtype="float32")) for x in (a, b, c, d)]
    assert all(r == runs[0] for r in runs[1:])
    llm = LLM(str(tiny_llama), draft=str(c), device="cpu", dtype="float32")
    assert llm.engine.spec.tap_layers == (0, 1) and llm.engine.spec.block_size == 4


def test_default_taps_when_missing(tiny_llama, tmp_path):
    d = build_random_drafter(tmp_path / "d", tiny_llama, num_layers=1)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg["fc_taps"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    # one draft layer and no ids: [L // 2] of the 3-layer target; fc expects one tap
    from safetensors.torch import load_file, save_file

    w = load_file(str(d / "model.safetensors"))
    w["fc.weight"] = w["fc.weight"][:, :64].contiguous()
    save_file(w, str(d / "model.safetensors"))
    llm = LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")
    assert llm.engine.spec.tap_layers == (1,)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(hidden_size=32), "hidden_size 32 does not match"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[0, 3]), r"tap layer id\(s\) \[3\] outside"),
    (lambda c: c["dflash_config"].update(mask_token_id=10**6), "mask_token_id 1000000 is outside"),
    (lambda c: c.update(architectures=["EagleModel"], dflash_config=None), "unknown drafter architecture"),
])
def test_validation_errors(tiny_llama, tmp_path, change, message):
    d = build_random_drafter(tmp_path / "d", tiny_llama)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    if cfg.get("dflash_config") is None:
        cfg.pop("dflash_config")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")


@pytest.mark.parametrize("fmt, change, message", [
    ("z-lab", lambda c, w: c["dflash_config"].update(sample_from_anchor=True), "sample_from_anchor=True changes the"),
    ("z-lab", lambda c, w: c.update(use_swa=True), "use_swa=True changes the drafts"),
    ("z-lab", lambda c, w: c["dflash_config"].update(projector_type="domino"), "projector_type='domino'"),
    ("z-lab", lambda c, w: c.update(mlp_bias=True), "mlp_bias=True"),
    ("z-lab", lambda c, w: c.update(layer_types=["chunked_attention", "full_attention"]), "layer_types"),
    ("z-lab", lambda c, w: c.update(hidden_act="swishglu9"), "hidden_act 'swishglu9'"),
    ("z-lab", lambda c, w: c["dflash_config"].update(output_multiplier=0), "output_multiplier must be > 0"),
    ("z-lab", lambda c, w: c.update(architectures=["DFlash2DraftModel"]), "conv_kernel_size must be an integer"),
    ("z-lab", lambda c, w: w.update({"prefix_gru.weight_ih_l0": torch.zeros(3, 3)}), "Domino drafter"),
    ("speculators", lambda c, w: c.update(sample_from_anchor=True), "sample_from_anchor=True"),
    ("speculators", lambda c, w: c.update(draft_vocab_size=100), "ships no lm_head"),
    ("speculators", lambda c, w: c.update(aux_hidden_state_layer_ids=[1, 3]), "aux_hidden_state_layer_ids 3"),
    ("speculators", lambda c, w: c.update(target_hidden_size=32), "target_hidden_size 32"),
    ("speculators", lambda c, w: c.update(speculators_model_type="eagle3"), "unknown speculators_model_type"),
])
def test_unsupported_fields_are_refused_by_name(tiny_llama, tmp_path, fmt, change, message):
    """A field that would change the drafts and is not implemented is refused, never ignored."""
    from safetensors.torch import load_file, save_file

    d = build_random_drafter(tmp_path / "d", tiny_llama, fmt=fmt)
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(str(d / "model.safetensors"))
    change(cfg, w)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")


def test_reduced_vocabulary_needs_its_map(tiny_llama, tmp_path):
    """A speculators drafter with its own head over a reduced vocabulary and no d2t map is refused (an
    identity map would draft the wrong tokens); with the map it drafts through it."""
    from safetensors.torch import load_file, save_file

    d = build_random_drafter(tmp_path / "d", tiny_llama, fmt="speculators", own_head=True)
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(str(d / "model.safetensors"))
    keep = torch.arange(0, cfg["transformer_layer_config"]["vocab_size"], 2)
    w["lm_head.weight"] = w["lm_head.weight"][keep].contiguous()
    cfg["draft_vocab_size"] = len(keep)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="ships no d2t map"):
        LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")
    w["d2t"] = keep - torch.arange(len(keep))
    save_file(w, str(d / "model.safetensors"))
    llm = LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")
    fed = []
    drafts = llm.engine.spec.drafts
    real = drafts.tokens
    drafts.tokens = lambda *a, **k: fed.append(real(*a, **k)) or fed[-1]
    llm.generate(MIXED[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    assert fed and all(bool((f % 2 == 0).all()) for f in fed)  # only kept (even) target ids are drafted


def test_extension_fields_are_logged(tiny_llama, tmp_path, caplog):
    d = build_random_drafter(tmp_path / "d", tiny_llama)
    cfg = json.loads((d / "config.json").read_text())
    cfg["my_training_note"] = "run 7"
    (d / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("INFO", logger="flashdraft"):
        LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32")
    assert "ignoring fields that do not change the drafts: my_training_note" in caplog.text


def test_missing_drafter_path(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter path"):
        LLM(str(tiny_llama), draft=str(tmp_path / "none"), device="cpu")


def test_shipped_drafter_is_the_default_and_lossless(smollm2):
    """LLM() with no arguments runs SmolLM2 with the trained drafter shipped in the package: the
    greedy tokens equal plain decoding's and its drafts are accepted (tau well above a random
    drafter's 1.0)."""
    default = LLM(device="cpu", dtype="float32")
    assert default.engine.spec is not None and default.engine.spec.block_size == 8
    qs = ["Write a Python function that returns the sum of a list.", "What is the capital of France?",
          "Explain what a hash table is in two sentences.", "List three prime numbers."]
    prompts = [default.engine.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    assert [o.token_ids for o in default.generate(prompts, params)] == want
    assert default.engine.spec_totals()["acceptance_length"] > 1.5
    assert LLM(draft=None, device="cpu", dtype="float32").engine.spec is None


def test_shipped_drafter_follows_the_embedded_gguf_under_any_name(tmp_path):
    import shutil

    from flashdraft.engine.startup import shipped_drafter
    from flashdraft.models.loader import default_model_path

    shipped = shipped_drafter(None)
    assert shipped is not None
    copy = tmp_path / "smollm2.gguf"
    shutil.copy(default_model_path(), copy)
    assert shipped_drafter(str(default_model_path())) == shipped_drafter(str(copy)) == shipped
    other = tmp_path / "other.gguf"
    data = bytearray(copy.read_bytes())
    data[-10] ^= 0xFF  # same size, different weights
    other.write_bytes(bytes(data))
    assert shipped_drafter(str(other)) is None
    assert shipped_drafter(str(tmp_path)) is None  # an HF folder that is not the default


def test_shipped_drafter_is_under_25_mb_in_the_published_files():
    """The issue's cap on the shipped drafter (decimal megabytes, as the README and docs give sizes):
    config.json and model.safetensors, nothing else in the package folder."""
    from pathlib import Path

    from flashdraft.engine.startup import shipped_drafter

    files = {p.name: p.stat().st_size for p in Path(shipped_drafter(None)).iterdir()}
    assert set(files) == {"config.json", "model.safetensors"}
    assert sum(files.values()) < 25_000_000


def test_speculation_pauses_at_large_batches(tiny_llama, drafter, plain):
    """speculative_disable_batch_size N: steps with N or more running requests decode without
    drafts, the drafter's context stays current, and drafting resumes (losslessly) once fewer run.
    Off CUDA the context writes wait until a draft needs them: the drafts are those of an engine that
    writes every step's context at once."""
    prompts = MIXED[:3]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (4, 10, 40)]  # they finish one by one
    want = [o.token_ids for o in plain.generate(prompts, params)]
    runs, written = {}, {}
    for limit in (None, 2, 1, "2 at once"):
        # without prefix caching: with it, rows still waiting at the end are written (a cached page may be read)
        llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", enable_prefix_caching=False,
                  speculative_disable_batch_size=2 if limit == "2 at once" else limit)
        sp = llm.engine.spec
        sp.context.defer = limit != "2 at once"
        positions = Counter()
        write = sp.drafter.write_context

        def counting(taps, pos, *args, write=write, positions=positions):
            positions.update(pos.tolist())
            return write(taps, pos, *args)

        sp.drafter.write_context = counting
        with poison_rejected(llm):  # a draft K/V read that should not happen turns to NaN
            assert [o.token_ids for o in llm.generate(prompts, params)] == want
        runs[limit], written[limit] = llm.engine.spec_totals(), positions
    # every committed position of every request enters the drafter's context before a draft reads
    # it, paused or not; a verify also writes its rejected rows (overwritten before any read: the
    # poison would show it). A run that never drafts writes none: nothing read them.
    committed = Counter(i for p, n in zip(prompts, (4, 10, 40)) for i in range(len(p) + n - 1))
    assert not committed - written[2] and not committed - written[None]
    # the same drafts as writing at once, from fewer writes (the last rows, which no draft read, dropped)
    assert runs[2] == runs["2 at once"] and written[2].total() < written["2 at once"].total()
    assert not written[2] - written["2 at once"]
    assert written[1].total() == 0
    assert runs[1]["num_drafts"] == 0 and runs[1]["paused_steps"] > 0  # never speculates
    assert runs[None]["paused_steps"] == 0
    # paused while 2-3 run; once only the 40-token request is left it drafts again
    assert 0 < runs[2]["num_drafts"] < runs[None]["num_drafts"] and runs[2]["paused_steps"] > 0
    with pytest.raises(ValueError, match="speculative_disable_batch_size must be >= 1"):
        LLM(str(tiny_llama), draft=None, device="cpu", speculative_disable_batch_size=0)


@pytest.mark.parametrize("coupled", [True, False])
def test_sampled_drafts_are_drawn_with_the_targets_noise(tiny_llama, drafter, plain, monkeypatch, coupled):
    """A sampled request's drafts are drawn with the noise the target's sampler uses at the slot's
    position. Give the drafter's head the target's own logits for slot 1 (HF transformers, float64,
    on the request's committed tokens): then every first draft is the token the target samples
    there. With argmax drafts (the engine before, coupled=False) the same oracle logits are accepted
    only as often as the target's sample is its top token. Tokens equal plain decoding's either way."""
    from fixtures import hf_model

    from flashdraft.engine import sampler
    from flashdraft.speculative.dflash import DFlashSpeculator
    from flashdraft.speculative.drafts import DraftTokens

    ref = hf_model(tiny_llama).double()
    spec = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32")
    current: list = []
    real_propose, real_draft = DFlashSpeculator.propose, DraftTokens.tokens

    def propose(self, seqs):
        current[:] = seqs
        return real_propose(self, seqs)

    def draft_tokens(self, hidden, num_seqs, draw=None, blocks=None):
        model = self.runner.model
        real_logits = model.compute_logits

        def oracle_logits(rows, float32=True):
            out = real_logits(rows, float32)  # slot 1 of request i is row i * (B-1) of the flat rows
            flat = out.view(-1, out.shape[-1])
            for i, s in enumerate(current):
                with torch.no_grad():
                    flat[i * (self.block_size - 1)] = ref(torch.tensor([s.token_ids])).logits[0, -1].to(out.dtype)
            return out

        model.compute_logits = oracle_logits
        try:
            return real_draft(self, hidden, num_seqs, draw if coupled else None, blocks)
        finally:
            del model.compute_logits

    monkeypatch.setattr(DFlashSpeculator, "propose", propose)
    monkeypatch.setattr(DraftTokens, "tokens", draft_tokens)
    # the random target's near-uniform distribution puts a sample outside any few candidates often:
    # draw among the whole vocabulary here (the candidate cut is checked in test_engine.py)
    monkeypatch.setattr(sampler, "DRAW_CANDIDATES", 1 << 20)
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=70 + i) for i in range(4)]
    outs = spec.generate(MIXED[:4], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(MIXED[:4], params)]
    tot = spec.engine.spec_totals()
    first = tot["accepted_per_position"][0] / tot["num_drafts"]
    print(f"coupled={coupled}: slot-1 acceptance {first:.3f} over {tot['num_drafts']} verifies")
    assert tot["num_drafts"] >= 20
    assert first == 1.0 if coupled else first < 0.6


def test_dflash2_verifies_its_chain_even_when_trees_are_asked(tiny_llama, tmp_path, caplog):
    """A DFlash2 drafter's selector picks each slot given the one before it, so token trees (independent
    per-slot candidates) are not built from it: an explicit tree size falls back to the chain, said in
    the log; the tokens are plain decoding's."""
    d2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
    d = build_random_drafter(tmp_path / "d", tiny_llama, dflash2=d2)
    with caplog.at_level("WARNING", logger="flashdraft"):
        llm = LLM(str(tiny_llama), draft=str(d), device="cpu", dtype="float32", speculative_tree_size=5)
    assert llm.engine.spec.tree_size is None and "a DFlash2 drafter verifies its chain" in caplog.text
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    assert [o.token_ids for o in llm.generate(MIXED[:3], params)] == \
        [o.token_ids for o in plain.generate(MIXED[:3], params)]
