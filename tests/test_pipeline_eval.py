"""The drafter pipeline's evaluation (benchmarks/device/drafter_pipeline.py, a GPU script) run on this
CPU with the embedded SmolLM2 + shipped drafter: its per-prompt rows must add up to the engine's own
totals, and the distinct-prompt tau must count a repeated prompt once. Its train phase must hand --seed to
the trainer."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pipeline():
    spec = importlib.util.spec_from_file_location("drafter_pipeline", ROOT / "benchmarks/device/drafter_pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_per_prompt_rows_and_distinct_tau(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from flashdraft import LLM, SamplingParams

    dp = _pipeline()
    # the embedded pair on the CPU instead of a GGUF on CUDA; 24 tokens per answer instead of 256
    monkeypatch.setattr(dp, "LLM", lambda gguf, draft=None, **kw: LLM(draft=draft, device="cpu", dtype="float32"))
    monkeypatch.setattr(dp, "SamplingParams", lambda **kw: SamplingParams(**{**kw, "max_tokens": 24}))
    prompts = tmp_path / "prompts"
    prompts.mkdir()
    files = {"humaneval": ["def add(a, b):\n    \"\"\"Return a + b.\"\"\""], "mt_bench": ["Name three colors."],
             "sharegpt_heldout": ["Say hi.", "Explain rain in one sentence.", "Say hi."]}
    for name, texts in files.items():
        (prompts / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    drafter = ROOT / "flashdraft/drafters/smollm2-135m-dflash"
    args = dict(gguf=None, data_dir=str(prompts), tree_size=None)
    res = dp.evaluate(SimpleNamespace(eval_temps=[0.0, 1.0], **args), drafter, {}, tmp_path)

    def pooled(rows):  # rows: PER_PROMPT columns
        drafts = sum(r[dp.PER_PROMPT.index("num_drafts")] for r in rows)
        return (sum(r[dp.PER_PROMPT.index("num_accepted_tokens")] for r in rows) + drafts) / drafts

    for key, r in res.items():
        n = len(files[key.split("@")[0]])
        assert r["prompts"] == n and len(r["per_prompt"]) == n
        assert abs(pooled(r["per_prompt"]) - r["tau"]) < 1e-9, key  # against the engine's totals
        assert sum(row[dp.PER_PROMPT.index("num_output_tokens")] for row in r["per_prompt"]) == r["output_tokens"]
    for temp in ("0", "1"):
        r = res[f"sharegpt_heldout@T{temp}"]
        assert r["distinct_prompts"] == 2
        assert abs(r["tau_distinct_prompts"] - pooled(r["per_prompt"][:2])) < 1e-9
    assert json.loads((tmp_path / "eval.json").read_text())["eval"].keys() == res.keys()
    # --eval-temps 0: the same greedy figures, no T=1 pass
    (tmp_path / "t0").mkdir()
    only = dp.evaluate(SimpleNamespace(eval_temps=[0.0], **args), drafter, {}, tmp_path / "t0")
    assert sorted(only) == sorted(k for k in res if k.endswith("@T0"))
    assert all(only[k]["per_prompt"] == res[k]["per_prompt"] for k in only)


def test_train_phase_hands_its_seed_and_taps_to_the_trainer(tmp_path, monkeypatch, capsys):
    """--seed orders the training batches too: a run continuing another on the same data with a new seed
    must not start over the batches the run before saw first (the pipeline once kept the trainer at 0).
    The taps: 1,14,27 for a new drafter, the saved drafter's with --init-drafter, --target-layer-ids if given."""
    dp = _pipeline()
    seen = []

    class Stop(Exception):
        pass

    def fake_train(cfg):
        seen.append((cfg.seed, cfg.target_layer_ids) if cfg.arch == "dflash" else (cfg.arch, cfg.selector_rank))
        raise Stop

    monkeypatch.setattr(dp, "train", fake_train)
    monkeypatch.setattr(dp.torch.cuda, "get_device_name", lambda *a: "no GPU")
    data = tmp_path / "data.jsonl"
    data.write_text("")
    base = ["drafter_pipeline.py", "--phase", "train", "--gguf", "target.gguf", "--data-dir", str(tmp_path),
            "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--data", str(data)]
    init = ["--init-drafter", "saved"]
    for extra in ([], ["--seed", "13"], init, init + ["--target-layer-ids", "1,8,14,20,27"],
                  init + ["--target-layer-ids", "1", "8", "14,20", "27", "29", "--seed", "2"],
                  init + ["--arch", "dflash2", "--selector-rank", "32"]):
        monkeypatch.setattr(sys, "argv", base + extra)
        with pytest.raises(Stop):
            dp.main()
    assert seen == [(0, [1, 14, 27]), (13, [1, 14, 27]), (0, None), (0, [1, 8, 14, 20, 27]),
                    (2, [1, 8, 14, 20, 27, 29]), ("dflash2", 32)]  # spaces too; DFlash2's options reach the trainer
    # bad --eval-temps and --keep-every are refused by the parser, before any answers or training
    for extra, msg in ((["--eval-temps", "0,hot"], "is not a comma-separated list of temperatures"),
                       (["--eval-temps", "0,-1"], "temperatures must be 0 or more"),
                       (["--keep-every", "0"], "--keep-every must be a positive number of steps, not 0"),
                       (["--target-layer-ids", "1,eight"], "is not a list of target layer numbers")):
        monkeypatch.setattr(sys, "argv", base + extra)
        with pytest.raises(SystemExit) as e:
            dp.main()
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert len(seen) == 6  # the trainer was not reached


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / f"benchmarks/{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_compare_pooled_tau_and_paired_intervals():
    """Pooled tau is committed tokens over verify steps across prompts; a drafter against itself gives
    a zero-width interval, and one that accepts one more token on every prompt an interval above zero
    that contains the exact pooled difference."""
    import numpy as np

    ec = _script("eval_compare")
    rows = [[50 + i, 256, 60 + 7 * i, 120 + 11 * i] for i in range(30)]  # prompt tokens, out, drafts, accepted
    more = [[p, o, d, a + d // 10] for p, o, d, a in rows]
    base = {"s@T0": {"per_prompt": rows}}
    arr = np.asarray(rows, float)
    assert ec.pooled_tau(arr) == (arr[:, 3].sum() + arr[:, 2].sum()) / arr[:, 2].sum()
    same = ec.compare([base, base], draws=200)["s@T0"]
    assert same["diff"] == [[0.0, 0.0]]
    res = ec.compare([base, {"s@T0": {"per_prompt": more}}], draws=500)["s@T0"]
    exact = res["tau"][1] - res["tau"][0]
    lo, hi = res["diff"][0]
    assert 0 < lo <= exact <= hi
    with pytest.raises(ValueError, match="different prompt counts"):
        ec.compare([base, {"s@T0": {"per_prompt": rows[:-1]}}])
