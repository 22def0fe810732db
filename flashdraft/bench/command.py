"""`flashdraft bench`: arguments, validation, and the run from prompts to report."""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from flashdraft.bench.datasets import DATASETS, Prompt, load_prompts
from flashdraft.bench.runner import ARMS, Workload, run_sweep
from flashdraft.config import add_engine_args, engine_kwargs

if TYPE_CHECKING:
    from flashdraft.engine.engine import LLMEngine

DEFAULT_CONCURRENCY = "1,2,4,8,16,32"
EMBEDDED_MODEL = "SmolLM2-135M-Instruct"


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--dataset", default="mt-bench",
                   help=f"{' | '.join(DATASETS)} | a .jsonl file with 'prompt' or 'messages' per line")
    p.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of the set (default: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY,
                   help="comma-separated requests in flight, one sweep point each")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--chat", dest="chat", action="store_true", default=True,
                      help="send prompts through the chat template (default)")
    form.add_argument("--raw", dest="chat", action="store_false", help="send prompt text as is")
    p.add_argument("--arms", default=None,
                   help="plain,dflash (default: both when a drafter is loaded, else plain)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--unconstrained", action="store_true",
                   help="drop the prompt file's structured_outputs (the same prompts without their grammars)")
    p.add_argument("--seed", type=int, default=0, help="request i uses seed + i (matters at T > 0)")
    p.add_argument("--out", default=None, help="folder for bench.json and the PNG plots")
    p.add_argument("--url", default=None,
                   help="benchmark a running OpenAI-compatible server at this URL instead of in process; "
                        "--model then names the served model (default: the first one listed)")
    p.add_argument("--api-key", default=None, help="API key for --url")


def parse_concurrency(text: str) -> list[int]:
    parts = [s.strip() for s in str(text).split(",")]
    try:
        values = [int(s) for s in parts]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated positive integers like {DEFAULT_CONCURRENCY!r}, "
                         f"got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency values must be >= 1, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"--concurrency lists a value twice: {text!r}")
    return values


def parse_arms(text: str | None, has_drafter: bool | None) -> list[str]:
    """has_drafter None: unknown (a remote server), both arms by default."""
    if text is None:
        return list(ARMS) if has_drafter is not False else ["plain"]
    arms = [s.strip() for s in text.split(",") if s.strip()]
    bad = [a for a in arms if a not in ARMS]
    if not arms or bad or len(set(arms)) != len(arms):
        raise ValueError(f"--arms must list plain and/or dflash once each, got {text!r}")
    if "dflash" in arms and has_drafter is False:
        raise ValueError("--arms dflash needs a drafter, and this engine has none (--no-spec, or no drafter "
                         "shipped for this model): pass --draft FOLDER or use --arms plain")
    return [a for a in ARMS if a in arms]  # plain first: arms always run in the same order


def validate(args: argparse.Namespace) -> tuple[list[int], list[Prompt]]:
    concurrencies = parse_concurrency(args.concurrency)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.arms is not None:
        parse_arms(args.arms, None)
    prompts = load_prompts(args.dataset, args.num_prompts)
    if not args.chat and any(p.text is None for p in prompts):
        raise ValueError(f"--raw needs text prompts, but {args.dataset} holds conversations ('messages'); "
                         "use --chat")
    return concurrencies, prompts


def tokenize(engine: LLMEngine, prompts: list[Prompt], chat: bool, max_tokens: int) -> tuple[list, list, list]:
    """Token ids of the prompts that leave room for max_tokens; the others are skipped (and named)."""
    kept, ids, skipped = [], [], []
    for p in prompts:
        toks = (_with_tools(engine, p) if p.tools else engine.apply_chat_template(p.messages)) if chat else \
            engine.tokenize(p.text)
        if len(toks) + max_tokens > engine.max_model_len:
            skipped.append(p.id)
            continue
        kept.append(p)
        ids.append(toks)
    if not ids:
        raise ValueError(f"no prompt fits the context window ({engine.max_model_len} tokens) with "
                         f"--max-tokens {max_tokens}")
    return kept, ids, skipped


def _with_tools(engine: LLMEngine, p: Prompt) -> list[int]:
    """A prompt whose request must call one of its tools, as the server renders it (the model's template, or
    the ChatML one with tools); its constraint becomes the forced call's grammar."""
    from flashdraft.engine.prompts import encode_chat
    from flashdraft.sampling_params import SamplingParams
    from flashdraft.server.chat import ChatOptions, plan_chat
    from flashdraft.server.messages import ChatTools

    plan = plan_chat(ChatOptions(), engine.tokenizer.chat_template, ChatTools(p.tools, "required", False), p.messages)
    p.constraint = {"structural_tag": plan.sampling_params(SamplingParams(), "").structured_outputs.structural_tag}
    return encode_chat(engine.tokenizer, p.messages, engine.model_dir, tools=p.tools, chat_template=plan.template)


def git_commit() -> dict:
    root = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"git_commit": None, "git_dirty": None}
    if head.returncode != 0:
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip()) if dirty.returncode == 0
            else None}


def engine_config(engine: LLMEngine) -> dict:
    import torch

    from flashdraft.engine.engine import shipped_drafter

    cfg = engine.config
    draft = shipped_drafter(cfg.model) if cfg.draft == "auto" else cfg.draft
    dev = engine.device
    d = {"model": cfg.model or EMBEDDED_MODEL, "model_dir": str(engine.model_dir),
         "draft": str(draft) if engine.spec is not None else None, "device": str(dev),
         "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu"),
         "dtype": str(engine.dtype).removeprefix("torch."), "max_model_len": engine.max_model_len,
         "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
         "attention_backend": engine.runner.backend_name, "cuda_graphs": engine.runner.use_graphs}
    if engine.spec is not None:
        d["block_size"] = engine.spec.block_size
        d["num_speculative_tokens"] = engine.spec.num_draft
        d["speculative_tree_size"] = engine.spec.tree_size  # None: the chain
    return d


def run_config(args: argparse.Namespace, prompts: list[Prompt], concurrencies: list[int], arms: list[str]) -> dict:
    import torch

    import flashdraft

    return {"mode": "http" if args.url else "in-process", "url": args.url, "dataset": args.dataset,
            "num_prompts": len(prompts), "prompt_ids": [p.id for p in prompts], "max_tokens": args.max_tokens,
            "temperature": args.temperature, "ignore_eos": args.ignore_eos, "seed": args.seed, "chat": args.chat,
            "constrained": sum(p.constraint is not None for p in prompts) if not args.unconstrained else 0,
            "concurrency": concurrencies, "arms": arms,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "flashdraft_version": flashdraft.__version__, "torch_version": torch.__version__,
            "python_version": platform.python_version(), "platform": platform.platform(), **git_commit()}


def warn(msg: str) -> None:
    print(f"flashdraft bench: {msg}", file=sys.stderr)


def cmd_bench(args: argparse.Namespace, engine: LLMEngine | None = None) -> int:
    """Run the sweep and print the tables; with --out also write bench.json and the plots. Bad input
    raises ValueError / FileNotFoundError before any model is loaded. `engine` reuses a loaded engine."""
    from tqdm import tqdm

    from flashdraft.bench.report import format_report, write_json, write_plots
    from flashdraft.bench.runner import BenchError, EngineBackend

    concurrencies, prompts = validate(args)
    out_dir = Path(args.out).expanduser() if args.out else None
    if out_dir is not None:
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"--out {str(out_dir)!r} exists and is not a folder")
        out_dir.mkdir(parents=True, exist_ok=True)
    workload = Workload(args.max_tokens, args.temperature, args.seed, args.ignore_eos)
    try:
        if args.url:
            from flashdraft.bench.remote import RemoteBackend  # needs the openai client

            if not args.unconstrained and any(p.constraint for p in prompts):
                raise ValueError("structured_outputs in the prompt file are run in process only; drop --url, "
                                 "or pass --unconstrained")

            backend = RemoteBackend(args.url, prompts, args.chat, workload, model=args.model, api_key=args.api_key)
            arms = parse_arms(args.arms, None)
            setup = {"model": backend.model, "draft": None, "device": "remote", "dtype": None}
        else:
            if engine is None:
                from flashdraft import LLM
                engine = LLM(**engine_kwargs(args)).engine
            arms = parse_arms(args.arms, engine.spec is not None)
            prompts, ids, skipped = tokenize(engine, prompts, args.chat, args.max_tokens)
            if skipped:
                warn(f"skipped {len(skipped)} prompt(s) longer than the context window allows with --max-tokens "
                     f"{args.max_tokens}: {', '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}")
            if max(concurrencies) > engine.config.max_num_seqs:
                warn(f"concurrency {max(concurrencies)} exceeds --max-num-seqs {engine.config.max_num_seqs}: "
                     "the extra requests wait in the queue")
            if not args.unconstrained:
                workload.constraints = [p.constraint for p in prompts]
            backend = EngineBackend(engine, ids, workload)
            setup = engine_config(engine)
        if max(concurrencies) > len(prompts):
            warn(f"{len(prompts)} prompt(s) cannot keep {max(concurrencies)} requests in flight; "
                 "raise --num-prompts")
        config = {**setup, **run_config(args, prompts, concurrencies, arms)}
        with tqdm(total=len(prompts) * len(arms) * len(concurrencies), unit="req", file=sys.stderr,
                  dynamic_ncols=True) as bar:
            rows = run_sweep(backend, arms, concurrencies, bar)
    except BenchError as e:
        warn(f"error: {e}")
        return 1
    result = {"config": config, "results": rows}
    print(format_report(result))
    if out_dir is not None:
        paths = [write_json(result, out_dir / "bench.json"), *write_plots(result, out_dir)]
        print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0
