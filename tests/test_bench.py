"""`flashdraft bench`: prompt sets, timing conventions, bad input, and the whole harness end to end on
CPU (SmolLM2-135M + a random DFlash drafter, one engine for both arms), in process and over HTTP."""

from __future__ import annotations

import argparse
import json
import math
import socket

import pytest
from fixtures import Served, build_random_drafter

from flashdraft.bench import add_bench_args, cmd_bench
from flashdraft.bench.command import parse_arms, parse_concurrency
from flashdraft.bench.datasets import first_human_turn, load_prompts, sharegpt_split
from flashdraft.bench.remote import parse_prometheus
from flashdraft.bench.stats import per_token_intervals, spec_delta, sum_spec


def bench_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    return p.parse_args(list(argv))


# ---- prompt sets -----------------------------------------------------------------------------
def test_humaneval_has_164_problems_in_reference_wording():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and len({p.id for p in prompts}) == 164
    p = prompts[0]
    assert p.id == "HumanEval/0" and p.text.startswith("from typing import List")
    content = p.messages[0]["content"]
    assert p.messages[0]["role"] == "user" and f"```python\n{p.text}\n```" in content
    assert load_prompts("humaneval", 4) == prompts[:4]


def test_mt_bench_has_80_first_turns():
    prompts = load_prompts("mt-bench")
    assert len(prompts) == 80 and len({p.id for p in prompts}) == 80
    assert prompts[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert all(p.messages == [{"role": "user", "content": p.text}] for p in prompts)


def test_sharegpt_heldout_is_the_last_1000_and_disjoint():
    rest, heldout = sharegpt_split()
    assert len(heldout) == 1000 and len(rest) > 10000
    assert heldout[-1]["id"] == "hlWUIwT_0"  # the last complete record: the file is cut off inside the next
    assert {r["id"] for r in rest}.isdisjoint({r["id"] for r in heldout})
    prompts = load_prompts("sharegpt")
    usable = [r for r in heldout if first_human_turn(r) is not None]
    assert len(prompts) == len(usable) > 950
    assert [(p.id, p.text) for p in prompts] == [(r["id"], first_human_turn(r)) for r in usable]
    assert {p.id for p in prompts}.isdisjoint({r["id"] for r in rest})


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "Say hi."}\n\n{"id": "x", "messages": [{"role": "user", "content": "Hello"}]}\n')
    a, b = load_prompts(str(f))
    assert (a.text, a.messages) == ("Say hi.", [{"role": "user", "content": "Say hi."}])
    assert (b.id, b.text, b.messages) == ("x", None, [{"role": "user", "content": "Hello"}])


@pytest.mark.parametrize("content, match", [
    ("", "has no prompts"),
    ("\n  \n", "has no prompts"),
    ('{"prompt": 3}\n', r"p\.jsonl:1: needs a non-empty 'prompt'"),
    ('{"prompt": "ok"}\nnot json\n', r"p\.jsonl:2: not valid JSON"),
    ('["a"]\n', "expected an object"),
])
def test_bad_jsonl(tmp_path, content, match):
    f = tmp_path / "p.jsonl"
    f.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_prompts(str(f))


def test_bad_dataset_names_and_paths(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'humaneva'.*humaneval, mt-bench, sharegpt"):
        load_prompts("humaneva")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
        load_prompts("mt-bench", 0)


@pytest.mark.parametrize("text", ["", "1,,2", "1,x", "0,1", "-2", "1,2,1", "1.5"])
def test_bad_concurrency_lists(text):
    with pytest.raises(ValueError, match="--concurrency"):
        parse_concurrency(text)


def test_concurrency_and_arms_parsing():
    assert parse_concurrency(" 1, 2,4 ") == [1, 2, 4]
    assert parse_arms(None, True) == ["plain", "dflash"] and parse_arms(None, False) == ["plain"]
    assert parse_arms("dflash,plain", True) == ["plain", "dflash"]
    with pytest.raises(ValueError, match="needs a drafter"):
        parse_arms("dflash", False)
    with pytest.raises(ValueError, match="--arms"):
        parse_arms("plain,eagle", True)


def test_bad_input_fails_before_any_model_loads(tmp_path):
    for argv, err, match in [
        (["--dataset", "nope"], ValueError, "unknown dataset"),
        (["--dataset", str(tmp_path / "none.jsonl")], FileNotFoundError, "does not exist"),
        (["--concurrency", "1,two"], ValueError, "--concurrency"),
        (["--max-tokens", "0"], ValueError, "--max-tokens"),
        (["--arms", "plain,plain"], ValueError, "--arms"),
    ]:
        with pytest.raises(err, match=match):
            cmd_bench(bench_args(*argv))
    f = tmp_path / "chat.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="--raw needs text prompts"):
        cmd_bench(bench_args("--dataset", str(f), "--raw"))


# ---- timing conventions ----------------------------------------------------------------------
def test_per_token_itl_splits_bursts_evenly():
    # first token at 1.0, then a burst of 3 at 1.6, then 1 at 1.7
    itl = per_token_intervals([1.0, 1.6, 1.7], [1, 3, 1])
    assert itl == pytest.approx([0.2, 0.2, 0.2, 0.1])
    assert per_token_intervals([1.0, 2.0], [2, 1]) == pytest.approx([0.0, 1.0])
    assert per_token_intervals([], []) == []


def test_spec_counters_delta_and_sum():
    before = {"num_drafts": 2, "num_draft_tokens": 14, "num_accepted_tokens": 3,
              "accepted_per_position": [2, 1, 0], "acceptance_histogram": [0, 1, 1, 0], "gated_steps": 1}
    after = {"num_drafts": 6, "num_draft_tokens": 42, "num_accepted_tokens": 9,
             "accepted_per_position": [6, 2, 1], "acceptance_histogram": [1, 1, 3, 1], "gated_steps": 5}
    d = spec_delta(before, after)
    assert d["num_drafts"] == 4 and d["acceptance_length"] == pytest.approx((6 + 4) / 4) and d["gated_steps"] == 4
    assert d["acceptance_rate_per_position"] == [1.0, 0.25, 0.25] and d["acceptance_histogram"] == [1, 0, 2, 1]
    s = sum_spec([before, d])
    assert s["num_accepted_tokens"] == 9 and s["accepted_per_position"] == [6, 2, 1] and s["gated_steps"] == 5
    remote = {"num_drafts": 1, "num_draft_tokens": 7, "num_accepted_tokens": 0, "gated_steps": None}  # no gate there
    assert sum_spec([d, remote])["gated_steps"] == 4
    assert spec_delta({}, {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})[
        "acceptance_length"] is None


def test_prometheus_spec_counters():
    text = "\n".join([
        "# TYPE vllm:spec_decode_num_drafts counter",
        'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{model_name="m"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 70.0',
        'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 25.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 7.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 9.0',
    ])
    assert parse_prometheus(text) == {"num_drafts": 10, "num_draft_tokens": 70, "num_accepted_tokens": 25,
                                      "accepted_per_position": [9, 7]}
    assert parse_prometheus("# nothing\nfoo_total 3\n") is None


# ---- end to end ------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Small CPU machines run several test processes at once; two processes with one OpenMP thread
    per core each slow each other down several-fold, one thread here degrades gracefully instead."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def spec_engine(tmp_path_factory):
    from flashdraft import LLM
    from flashdraft.models.loader import resolve_model_dir

    draft = build_random_drafter(tmp_path_factory.mktemp("bench-draft"), resolve_model_dir(None), block_size=8,
                                 num_layers=1, target_layer_ids=[1, 14, 27], head_dim=64, num_attention_heads=9,
                                 num_key_value_heads=3, mask_token_id=0)
    return LLM(draft=str(draft), device="cpu", dtype="float32", num_kv_blocks=256).engine


def test_end_to_end_in_process(spec_engine, tmp_path, capsys):
    out = tmp_path / "out"
    args = bench_args("--dataset", "humaneval", "--num-prompts", "4", "--max-tokens", "8", "--concurrency", "1,2",
                      "--out", str(out))
    assert cmd_bench(args, engine=spec_engine) == 0
    printed = capsys.readouterr().out
    print(printed)
    assert "| conc | plain tok/s | DFlash tok/s | speedup |  tau |" in printed
    assert "DFlash per-position acceptance rate" in printed and "pos 7" in printed

    result = json.loads((out / "bench.json").read_text())
    cfg = result["config"]
    assert cfg["dataset"] == "humaneval" and cfg["num_prompts"] == 4 and cfg["concurrency"] == [1, 2]
    assert cfg["arms"] == ["plain", "dflash"] and cfg["block_size"] == 8 and cfg["dtype"] == "float32"
    for key in ("model", "draft", "device", "torch_version", "date", "git_commit"):
        assert key in cfg
    assert [r["concurrency"] for r in result["results"]] == [1, 2]
    for row in result["results"]:
        plain, dflash = row["arms"]["plain"], row["arms"]["dflash"]
        for arm in (plain, dflash):
            assert arm["num_requests"] == 4 and arm["completion_tokens"] > 0 and arm["output_tok_s"] > 0
            assert arm["ttft_ms"]["p50"] > 0 and arm["itl_convention"] == "per-token"
            reqs = arm["requests"]
            assert [r["index"] for r in reqs] == [0, 1, 2, 3]
            assert all(sum(r["chunk_tokens"]) == r["output_tokens"] == len(r["output"]) for r in reqs)
        assert row["speedup"] == pytest.approx(dflash["output_tok_s"] / plain["output_tok_s"])
        # T=0 on the same engine and prompts: speculation must not change a single token
        assert row["same_output"] == {"matched": 4, "total": 4, "fraction": 1.0, "differing_prompts": []}
        assert [r["output"] for r in plain["requests"]] == [r["output"] for r in dflash["requests"]]
        assert plain["spec"] is None
        spec = dflash["spec"]
        assert spec["num_drafts"] > 0 and len(spec["acceptance_rate_per_position"]) == 7
        assert sum(spec["acceptance_histogram"]) == spec["num_drafts"]
        assert spec["num_drafts"] == sum(r["spec"]["num_drafts"] for r in dflash["requests"])  # no warm-up
        assert spec["gated_steps"] == sum(r["spec"]["gated_steps"] for r in dflash["requests"])
        assert spec["acceptance_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_drafts"])
    for name in ("bench.json", "throughput.png", "speedup.png", "tau.png", "acceptance.png"):
        assert (out / name).stat().st_size > 1000, name
    assert (out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_arm_only(spec_engine, tmp_path, capsys):
    prompts = tmp_path / "short.jsonl"
    prompts.write_text('{"prompt": "Name a fruit."}\n{"prompt": "Say hi."}\n')
    args = bench_args("--dataset", str(prompts), "--raw", "--max-tokens", "4", "--concurrency", "2", "--arms", "plain",
                      "--out", str(tmp_path / "plain"))
    assert cmd_bench(args, engine=spec_engine) == 0
    assert "|    2 |" in capsys.readouterr().out
    (row,) = json.loads((tmp_path / "plain" / "bench.json").read_text())["results"]
    assert list(row["arms"]) == ["plain"] and row["speedup"] is None and row["same_output"] is None
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["bench.json", "throughput.png"]


def test_end_to_end_over_http(spec_engine, tmp_path, capsys):
    from flashdraft.server.app import build_app

    prompts = tmp_path / "short.jsonl"
    prompts.write_text('{"prompt": "Name a fruit."}\n{"prompt": "What is 2+2?"}\n')
    served = Served(build_app(spec_engine))
    try:
        args = bench_args("--url", served.url, "--dataset", str(prompts), "--max-tokens", "6", "--ignore-eos",
                          "--concurrency", "2", "--out", str(tmp_path / "http"))
        assert cmd_bench(args) == 0
    finally:
        served.close()
    print(capsys.readouterr().out)
    result = json.loads((tmp_path / "http" / "bench.json").read_text())
    assert result["config"]["mode"] == "http" and result["config"]["model"] == "smollm2-135m-instruct"
    (row,) = result["results"]
    assert row["same_output"]["fraction"] == 1.0
    for arm in row["arms"].values():
        assert arm["completion_tokens"] == 12 and arm["itl_convention"] == "chunk"
        assert all(r["output"] and r["ttft_s"] > 0 for r in arm["requests"])
    assert row["arms"]["dflash"]["spec"]["num_drafts"] > 0 and row["arms"]["plain"]["spec"] is None


def test_unreachable_server_is_a_clear_error(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert cmd_bench(bench_args("--url", f"http://127.0.0.1:{port}", "--dataset", "mt-bench")) == 1
    assert "cannot list models" in capsys.readouterr().err


def load_benchmark(name: str):
    """benchmarks/NAME.py as a module (benchmarks/ is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_e2e_step():
    return load_benchmark("e2e_step")


def test_e2e_step_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/e2e_step.py (the device step benchmark) end to end on a tiny hybrid shape: the arms,
    each step counted, the two-run difference and the median pace both present (finite: their values are
    the machine's, and on a loaded one the two-run difference can come out negative), the blocks each
    DFlash run verified."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_step.py"
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, str(script), "--target", "tiny-hybrid", "--device", "cpu", "--arms",
                    "plain,dflash,dflash-auto", "--concurrency", "2", "--new-tokens", "8", "--prompt-len", "16",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    result = json.loads(out.read_text())
    for arm in ("plain", "dflash", "dflash-auto"):
        (row,) = result["arms"][arm]
        assert row["steps"] == 8 and math.isfinite(row["ms_per_step"]) and math.isfinite(row["ms_per_step_median"])
        assert row["overlapped_steps"] == 0  # a CPU schedules one step at a time
    assert "verified_blocks" not in result["arms"]["plain"][0]
    short, long = result["arms"]["dflash"][0]["verified_blocks"]  # the gate off: both requests verify each step
    assert long - short == 2 * 8
    assert math.isfinite(result["break_even_tau"]["2"])
    for arm in ("dflash", "dflash-auto"):  # tokens per second against plain's
        (r,), (d,) = result["arms"]["plain"], result["arms"][arm]
        want = d["tokens_per_step"] / d["ms_per_step"] / (r["tokens_per_step"] / r["ms_per_step"])
        assert result["speedup"][arm]["2"] == pytest.approx(want, abs=1e-3)


def test_e2e_step_counts_the_experts_a_moe_step_reads(tmp_path):
    """On a tiny Qwen3-MoE shape (2 layers, 2 of 8 experts a token): one sequence's decode step reads
    its 2 experts in each layer; four sampled sequences read between 2 and 8 a layer."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_step.py"
    out = tmp_path / "e2e.json"
    subprocess.run([sys.executable, str(script), "--target", "tiny-moe", "--device", "cpu", "--arms", "plain",
                    "--concurrency", "1,4", "--new-tokens", "4", "--prompt-len", "16", "--sample",
                    "--out", str(out)], check=True, capture_output=True, timeout=600)
    one, four = json.loads(out.read_text())["arms"]["plain"]
    assert one["experts_read"] == 2 * 2 and 2 * 2 <= four["experts_read"] <= 2 * 8


def test_experts_read_counts_distinct_experts(tmp_path):
    """experts_read counts each layer's distinct experts, not its routed rows: four copies of one
    prompt decode alike (greedy), so they read one token's 2 experts a layer between them."""
    from flashdraft import LLM

    e2e = load_e2e_step()
    target, _ = e2e.write_folders(tmp_path, e2e.TARGETS["tiny-moe"], 1, 4)
    llm = LLM(str(target), draft=None, device="cpu", load_format="dummy", max_num_seqs=4)
    e2e.spread_routers(llm, 1.0)
    prompt = list(range(3, 19))
    assert e2e.experts_read(llm, [prompt] * 4, 0.0) == [2, 2]
    assert all(2 <= n <= 8 for n in e2e.experts_read(llm, [[i + 3] * 16 for i in range(4)], 1.0))


def test_critical_path_counts_what_each_kernel_adds():
    """Overlapping kernels (PDL) add only what they run past their predecessor; a kernel after a long
    gap (the next graph replay) adds its own duration; host events are not kernels."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    critical_path = load_benchmark("timing").critical_path

    def ev(start, end, key, dev=DeviceType.CUDA):
        return SimpleNamespace(time_range=SimpleNamespace(start=start, end=end), key=key, device_type=dev)

    events = [ev(0, 10, "gemm"), ev(8, 12, "norm"), ev(11, 30, "gemm"), ev(5, 40, "host", DeviceType.CPU),
              ev(100, 110, "gemm"), ev(111, 113, "norm")]
    assert critical_path(events) == {"gemm": 10 + 18 + 10, "norm": 2 + 3}


def test_best_bandwidth_keeps_the_fastest_copy(monkeypatch):
    """The roofline's bandwidth: the fastest of the copies measured; the last one kept when there is
    no room for another copy; none on a CPU."""
    import torch

    e2e = load_e2e_step()
    cpu = torch.device("cpu")
    assert e2e.best_bandwidth(cpu, None) is None
    monkeypatch.setattr(e2e, "copy_bandwidth", lambda device: 4.1e12)
    assert e2e.best_bandwidth(cpu, 3.9e12) == 4.1e12 and e2e.best_bandwidth(cpu, 4.2e12) == 4.2e12
    assert e2e.best_bandwidth(cpu, None) == 4.1e12

    def full(device):
        raise torch.cuda.OutOfMemoryError("no room")

    monkeypatch.setattr(e2e, "copy_bandwidth", full)
    assert e2e.best_bandwidth(cpu, 3.9e12) == 3.9e12


def test_benchmark_report_is_one_table_and_one_json_line(tmp_path, capsys):
    """benchmarks/timing.py's report, the end of every benchmark script: a title, a Markdown table of the
    rows (every key as a column unless named, numbers right-aligned, missing cells '-'), then the record
    with the run's commit, device and date as exactly one JSON line; the same record written to `out`."""
    timing = load_benchmark("timing")
    rows = [{"arm": "plain", "tok_s": 1234.5, "tau": None}, {"arm": "dflash", "tok_s": 2469.0, "tau": 3.25}]
    out = tmp_path / "r.json"
    record = timing.report("two arms", rows, {"bench": "t", "rows": rows}, out, device="cpu")
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == ["two arms", "| arm | tok_s | tau |", "| --- | ---: | ---: |", "| plain | 1,234 | - |",
                         "| dflash | 2,469 | 3.25 |"]
    assert len(lines) == 6 and json.loads(lines[5]) == json.loads(out.read_text()) == record
    assert {"commit", "device", "date", "torch"} <= record.keys() and record["rows"] == rows
    assert timing.middle_median([9.0, 1.0, 2.0, 3.0, 4.0, 9.0, 9.0, 0.0]) == 3.5  # the middle half: 2, 3, 4, 9
    assert timing.percentile([3.0, 1.0, 2.0], 50) == 2.0 and timing.percentile([], 99) != timing.percentile([], 99)


def test_structured_requests_and_their_masks(spec_engine, tmp_path, capsys):
    """--dataset structured: JSON-schema and forced tool-call requests, each with its grammar, both arms
    the same tokens (T=0), the masks' host time per step reported; --unconstrained drops the grammars
    (other tokens, no masks); over --url the grammars are refused, not dropped."""
    from flashdraft.chat.tool_calls import FORMATS, parse_tool_calls

    prompts = load_prompts("structured")
    assert len(prompts) == 32 and sum(p.tools is not None for p in prompts) == 16
    runs = {}
    for extra in ((), ("--unconstrained",)):
        out = tmp_path / ("u" if extra else "c")
        args = bench_args("--dataset", "structured", "--num-prompts", "4", "--max-tokens", "40", "--concurrency",
                          "2", "--out", str(out), *extra)
        assert cmd_bench(args, engine=spec_engine) == 0
        printed = capsys.readouterr().out
        (row,) = json.loads((out / "bench.json").read_text())["results"]
        assert row["same_output"]["matched"] == 4
        runs[bool(extra)] = row
        assert ("grammar masks (4 constrained prompts)" in printed) != bool(extra)
    constrained = runs[False]["arms"]
    assert all(constrained[a]["grammar_mask_ms_per_step"] > 0 for a in ("plain", "dflash"))
    assert runs[True]["arms"]["plain"]["grammar_mask_ms_per_step"] is None
    texts = [spec_engine.tokenizer.decode(r["output"]) for r in constrained["plain"]["requests"]]
    for p, text in zip(load_prompts("structured", 4), texts):
        if p.tools:  # a forced call of one of the tools, whole when it finished
            assert text.startswith('<tool_call>\n{"name": "')
            assert any(text[len('<tool_call>\n{"name": "'):].startswith(t["function"]["name"]) for t in p.tools)
            if text.endswith("</tool_call>"):
                assert parse_tool_calls(text, FORMATS["hermes"])[1]
        else:
            assert text.lstrip().startswith("{")
    assert texts != [spec_engine.tokenizer.decode(r["output"]) for r in runs[True]["arms"]["plain"]["requests"]]
    with pytest.raises(ValueError, match="run in process only"):
        cmd_bench(bench_args("--dataset", "structured", "--url", "http://127.0.0.1:9"))
