"""Make the shipped SmolLM2 drafter on one GPU, within a time budget: self-distillation data with
flashdraft, the DFlash training recipe, then acceptance on the evaluation sets. Every output
lands in --out (config, weights split in parts, logs, eval.json).

    python benchmarks/device/make_prompt_files.py prompts          # on a machine with the prompt packages
    python benchmarks/device/drafter_pipeline.py --gguf smollm2.gguf --data-dir prompts --out results
    # or in two calls: --phase gen --out data-out, then --phase train --data data-out/data.jsonl.gz
    # on several GPUs: one --phase gen --shard K/N process per GPU, then
    # torchrun --nproc-per-node N drafter_pipeline.py --phase train ... (rank 0 evaluates)
    # training longer than one command may run: --stop-after S, then the same command with --resume
    # evaluation alone: --phase eval --drafter DIR

Prints a table of what the run made (the evaluation's tau per set and temperature, or the data and the
training) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.train.data import generate_responses, read_prompt_file, read_samples  # noqa: E402
from flashdraft.train.loss import LABELS  # noqa: E402
from flashdraft.train.trainer import TrainConfig, train  # noqa: E402


def gen_data(args, out: Path, summary: dict) -> Path:
    data = out / "data.jsonl"
    convs = read_prompt_file(Path(args.data_dir) / args.prompt_file)[: args.num_prompts]
    llm = LLM(args.gguf, draft=None, device="cuda", dtype="bfloat16", max_num_seqs=args.gen_batch,
              max_num_batched_tokens=16384, kv_cache_memory_gb=args.gen_kv_gb,
              max_model_len=args.max_prompt_tokens + args.max_new_tokens)
    if args.skip_data:  # only the prompts an earlier data file lacks
        done = {tuple(s[:p]) for s, p in read_samples(args.skip_data)}
        convs = [c for c in convs if tuple(llm.engine.apply_chat_template(c)) not in done]
        log(f"{len(done)} prompts already in {args.skip_data}; generating {len(convs)}")
    k, n = map(int, args.shard.split("/"))  # this process answers conversations k, k + n, ...
    convs = convs[k::n]
    t0 = time.time()
    n_seq = generate_responses(llm, convs, data, args.max_new_tokens, args.max_prompt_tokens,
                               time_budget_s=args.gen_seconds,
                               samples_per_prompt=args.samples_per_prompt, temperature=args.gen_temperature,
                               seed=args.seed + k * args.samples_per_prompt, seed_stride=n,
                               sampled_prefix=args.sampled_prefix)
    dt = time.time() - t0
    n_tok = sum(len(json.loads(x)["response_ids"]) for x in data.read_text().splitlines())
    summary["gen"] = {"samples": n_seq, "prompts": len(convs), "response_tokens": n_tok, "seconds": dt,
                      "tok_s": n_tok / dt, "max_num_seqs": args.gen_batch}
    log(f"self-distillation: {n_seq} samples ({args.samples_per_prompt} per prompt) for {len(convs)} prompts, "
        f"{n_tok} response tokens in {dt:.0f}s "
        f"({n_tok / dt:.0f} tok/s), max_num_seqs {args.gen_batch}")
    del llm
    torch.cuda.empty_cache()
    return data


# the columns of eval.json's per_prompt rows
PER_PROMPT = ("num_prompt_tokens", "num_output_tokens", "num_drafts", "num_accepted_tokens")


def evaluate(args, drafter: Path, summary: dict, out: Path) -> dict:
    llm = LLM(args.gguf, draft=str(drafter), device="cuda", dtype="bfloat16", max_num_seqs=256,
              kv_cache_memory_gb=12, max_model_len=4096, speculative_tree_size=args.tree_size)
    eng = llm.engine
    res = {}
    for temp in args.eval_temps:
        for name in ("humaneval", "mt_bench", "sharegpt_heldout"):
            convs = read_prompt_file(Path(args.data_dir) / f"{name}.jsonl")
            convs = [c for c in convs if len(eng.apply_chat_template(c)) + 256 <= eng.max_model_len]
            before = eng.spec_totals()
            params = [SamplingParams(temperature=temp, max_tokens=256, seed=i) for i in range(len(convs))]
            t0 = time.time()
            outs = llm.chat(convs, params)
            after = eng.spec_totals()
            drafts = after["num_drafts"] - before["num_drafts"]
            acc = after["num_accepted_tokens"] - before["num_accepted_tokens"]
            per_pos = [(a - b) / drafts
                       for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
            # each distinct prompt once (ShareGPT's held-out set repeats some), and every prompt's counts
            first = {}
            for c, o in zip(convs, outs):
                first.setdefault(json.dumps(c), o.metrics)
            first = list(first.values())
            d1 = sum(m["num_drafts"] for m in first)
            tau1 = (sum(m["num_accepted_tokens"] for m in first) + d1) / d1
            res[f"{name}@T{temp:g}"] = {"prompts": len(convs), "tau": (acc + drafts) / drafts, "drafts": drafts,
                                        "output_tokens": sum(len(o.token_ids) for o in outs),
                                        "accept_rate_per_position": per_pos, "wall_s": time.time() - t0,
                                        "distinct_prompts": len(first), "tau_distinct_prompts": tau1,
                                        "per_prompt": [[o.metrics[k] for k in PER_PROMPT] for o in outs]}
            log(f"{name} T={temp:g}: tau {(acc + drafts) / drafts:.2f} over {drafts} verify steps "
                f"({len(first)} distinct prompts: {tau1:.2f})")
            summary["eval"] = res
            (out / "eval.json").write_text(json.dumps(summary, indent=1))
    return res


def report_run(summary: dict) -> None:
    """The table and JSON line: the evaluation's tau per set and temperature, else the data and training."""
    if summary.get("eval"):
        rows = [{"set": k, "prompts": r["prompts"], "tau": r["tau"], "verify steps": r["drafts"],
                 "tau, distinct prompts": r["tau_distinct_prompts"]} for k, r in summary["eval"].items()]
        title = f"acceptance of {summary.get('drafter', 'the trained drafter')}: committed tokens per verify step"
    else:
        rows = [{"part": part, **{k: v for k, v in vals.items() if not isinstance(v, (dict, list))}}
                for part, vals in summary.items() if part in ("gen", "train")]
        title = "drafter pipeline"
    record = {k: v for k, v in summary.items() if k != "eval"}
    record["eval"] = {k: {f: v for f, v in r.items() if f != "per_prompt"} for k, r in summary.get("eval", {}).items()}
    report(title, rows, {"bench": "drafter_pipeline", **record})


def _temps(text: str) -> list[float]:
    """--eval-temps: comma-separated temperatures, each 0 or more."""
    try:
        temps = [float(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of temperatures") from None
    if any(t < 0 for t in temps):
        raise argparse.ArgumentTypeError(f"temperatures must be 0 or more, not {text!r}")
    return temps


def _layers(text: str) -> list[int]:
    """--target-layer-ids: target layer numbers, comma- or space-separated (the device scripts turn an arm's
    commas into spaces)."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of target layer numbers") from None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", choices=["gen", "train", "all", "eval"], default="all",
                    help="gen: data only; train: train (+ eval) on --data; all: both; eval: --drafter only")
    ap.add_argument("--drafter", default=None, help="eval: the drafter folder to evaluate")
    ap.add_argument("--labels", default="data", choices=LABELS)
    ap.add_argument("--anchor-walk", type=float, default=None, help="see flashdraft train-drafter --anchor-walk")
    ap.add_argument("--stop-after", type=float, default=None,
                    help="train: save the state and stop S seconds after training began, its setup "
                         "included (no eval); --resume goes on")
    ap.add_argument("--resume", action="store_true", help="train: go on from the state in --work")
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "flashdraft-drafter-work"))
    ap.add_argument("--num-prompts", type=int, default=100000)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="gen: longer prompts are skipped")
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--gen-seconds", type=float, default=180)
    ap.add_argument("--gen-kv-gb", type=float, default=40, help="gen: KV cache size (several processes share a GPU)")
    ap.add_argument("--train-seconds", type=float, default=240)
    ap.add_argument("--num-layers", type=int, default=3)
    ap.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash", help="see train-drafter --arch")
    ap.add_argument("--selector-rank", type=int, default=256)
    ap.add_argument("--selector-top-k", type=int, default=16)
    ap.add_argument("--conv-kernel-size", type=int, default=2)
    ap.add_argument("--conv-group-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=None,
                    help="default 8; with --init-drafter the saved drafter's unless given")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--num-anchors", type=int, default=512)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--init-layers-from", type=int, default=None)
    ap.add_argument("--add-layers", type=int, default=0, help="train: with --init-drafter, layers appended "
                    "(outputs start at zero)")
    ap.add_argument("--intermediate-size", type=int, default=None, help="train: MLP width (with --init-drafter: "
                    "narrow the saved MLPs to this many channels)")
    ap.add_argument("--init-drafter", default=None, help="continue from a saved drafter, e.g. the shipped one")
    ap.add_argument("--target-layer-ids", type=_layers, nargs="+", default=None,
                    help="target layers to tap, comma- or space-separated (default 1,14,27; with --init-drafter "
                         "the saved drafter's, or a list that adds taps to them: fc widens, the new taps start at 0)")
    ap.add_argument("--local-context", type=int, default=None)
    ap.add_argument("--local-context-frac", type=float, default=0.1)
    ap.add_argument("--save-every", type=int, default=100000,
                    help="also write the drafter every N steps (to --work/drafter)")
    ap.add_argument("--keep-every", type=int, default=None,
                    help="train: also keep the drafter of every N-th step (in --work/drafter/steps/<step>)")
    ap.add_argument("--eval-temps", type=_temps, default="0,1", help="eval: comma-separated temperatures")
    ap.add_argument("--tree-size", type=int, default=None,
                    help="eval: verify token trees of this many drafts (flashdraft --speculative-tree-size)")
    ap.add_argument("--no-eval", action="store_true")
    ap.add_argument("--data", default=None, help="reuse an existing data.jsonl[.gz]")
    ap.add_argument("--prompt-file", default="train_prompts.jsonl",
                    help="in --data-dir; train_conversations.jsonl.gz has every human turn with its history")
    ap.add_argument("--samples-per-prompt", type=int, default=1)
    ap.add_argument("--gen-temperature", type=float, default=0.0)
    ap.add_argument("--trim-loops", type=int, default=None, help="see flashdraft train-drafter --trim-loops")
    ap.add_argument("--sampled-prefix", type=int, default=0,
                    help="gen: sample the first 0..N tokens at --gen-temperature, then continue greedily")
    ap.add_argument("--skip-data", default=None, help="gen: leave out the prompts this data file already has")
    ap.add_argument("--shard", default="0/1", help="gen: K/N answers every N-th conversation from the K-th "
                                                   "(one process per GPU)")
    ap.add_argument("--seed", type=int, default=0,
                    help="gen: sampling seeds start here; train: the batch order and anchors (a run that "
                         "continues another on the same data needs a new one, or it starts over its batches)")
    args = ap.parse_args()
    if args.phase == "eval" and not args.drafter:
        ap.error("--phase eval needs --drafter DIR")
    if args.keep_every is not None and args.keep_every < 1:  # refused before any answers are generated
        ap.error(f"--keep-every must be a positive number of steps, not {args.keep_every}")
    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    if args.phase == "eval":
        summary = {"drafter": args.drafter, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
        evaluate(args, Path(args.drafter), summary, out)
        report_run(summary)
        return
    made: dict = {}
    data = Path(args.data) if args.data else gen_data(args, work, made)
    if args.phase in ("gen", "all") and not args.data:
        with open(out / "data.jsonl.gz", "wb") as gz:
            subprocess.run(["gzip", "-c", str(data)], stdout=gz, check=True)
        if os.path.getsize(out / "data.jsonl.gz") > 15 * 2**20:  # returned files are size-limited
            subprocess.run(["split", "-b", "15M", "-d", str(out / "data.jsonl.gz"), str(out / "data.jsonl.gz.")],
                           check=True)
            os.remove(out / "data.jsonl.gz")
    if args.phase == "gen":
        report_run(made)
        return
    taps = [i for part in args.target_layer_ids for i in part] if args.target_layer_ids else \
        (None if args.init_drafter else [1, 14, 27])
    cfg = TrainConfig(model=args.gguf, out=str(work / "drafter"), data=str(data), trim_loops=args.trim_loops,
                      num_layers=args.num_layers,
                      intermediate_size=args.intermediate_size, add_layers=args.add_layers,
                      block_size=args.block_size or (None if args.init_drafter else 8),
                      target_layer_ids=taps, mask_token_id=16,
                      epochs=args.epochs, batch_size=args.batch_size, num_anchors=args.num_anchors, lr=args.lr,
                      device="cuda", dtype="bfloat16", save_every=args.save_every, keep_every=args.keep_every,
                      time_budget_s=args.train_seconds,
                      init_layers_from=args.init_layers_from, init_drafter=args.init_drafter,
                      local_context=args.local_context,
                      local_context_frac=args.local_context_frac, labels=args.labels, walk_floor=args.anchor_walk,
                      stop_after_s=args.stop_after, resume=args.resume, seed=args.seed, arch=args.arch,
                      selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                      conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size)
    t0 = time.time()
    drafter = train(cfg)  # data parallel over the GPUs when started by torchrun
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if cfg.log:
        last = cfg.log[-1]
    else:  # a --resume of a run that had already finished trains nothing: its last record is on disk
        lines = (work / "drafter" / "train_log.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])
    log(f"training: {last['step']} of {last['total_steps']} steps, {last['epoch'] + 1} epochs, "
        f"{time.time() - t0:.0f}s, final loss {last['loss']:.3f}, train tau {last['tau']:.2f}")
    made["train"] = {"steps": last["step"], "of": last["total_steps"], "epochs": last["epoch"] + 1,
                     "seconds": time.time() - t0, "loss": last["loss"], "train_tau": last["tau"]}
    if last["step"] < last["total_steps"]:
        log("stopped early (--stop-after); the same command with --resume goes on")
        report_run(made)
        return
    # results leave the machine before the evaluation, in case the run hits its time limit
    (out / "config.json").write_text((drafter / "config.json").read_text())
    (out / "train_log.jsonl").write_text((drafter / "train_log.jsonl").read_text())
    subprocess.run(["split", "-b", "15M", "-d", str(drafter / "model.safetensors"), str(out / "model.safetensors.")],
                   check=True)
    summary = {"train_steps": last["step"], "train_s": time.time() - t0, "samples": len(read_samples(data)),
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args)}
    (out / "eval.json").write_text(json.dumps(summary, indent=1))
    if not args.no_eval:
        evaluate(args, drafter, summary, out)
    report_run({**made, **summary})


if __name__ == "__main__":
    main()
