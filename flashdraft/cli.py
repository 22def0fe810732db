"""`flashdraft generate | serve | bench | train-drafter`."""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import time
from pathlib import Path

from flashdraft.config import add_engine_args, engine_kwargs
from flashdraft.sampling_params import SamplingParams


def cmd_generate(args: argparse.Namespace) -> int:
    from flashdraft import LLM

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None,
                            ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    if args.raw:
        ids = eng.tokenize(args.prompt)
    else:
        ids = eng.apply_chat_template([{"role": "user", "content": args.prompt}])
    eng.check_prompt(ids)
    seq = eng.add_request(args.prompt, params, prompt_token_ids=ids)
    shown = ""
    t0 = time.perf_counter()
    while not seq.is_finished:
        eng.step()
        text = seq.text if seq.is_finished else eng.detokenize(seq)
        if text.endswith("\ufffd") and not seq.is_finished:
            continue  # an incomplete UTF-8 sequence; wait for the next token
        if text.startswith(shown):
            sys.stdout.write(text[len(shown):])
            sys.stdout.flush()
            shown = text
    dt = time.perf_counter() - t0
    out = eng.output(seq)
    m = out.metrics
    sys.stdout.write("\n")
    line = (f"[{m['num_output_tokens']} tokens in {dt:.2f}s, {m['num_output_tokens'] / dt:.1f} tok/s, "
            f"finish={out.finish_reason}")
    if "acceptance_length" in m:
        line += (f", tau={m['acceptance_length']:.2f}, drafts={m['num_drafts']}, "
                 f"draft_tokens={m['num_draft_tokens']}, accepted={m['num_accepted_tokens']}")
        if m.get("gated_steps"):
            line += f", gated_steps={m['gated_steps']}"
    print(line + "]", file=sys.stderr)
    return 0


def serve_engine_kwargs(args: argparse.Namespace) -> dict:
    """engine_kwargs with the model named as `vllm serve MODEL` names it, or by --model (both: the same one)."""
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice, as {args.model_tag!r} and as --model {args.model!r}: "
                             "give it once")
        args.model = args.model_tag
    return engine_kwargs(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from flashdraft.server.app import run_server
    from flashdraft.server.chat import ChatOptions, load_chat_template

    chat = ChatOptions(load_chat_template(args.chat_template) if args.chat_template else None,
                       args.tool_call_parser, args.reasoning_parser)  # (checked before the model loads)
    run_server(serve_engine_kwargs(args), host=args.host, port=args.port, api_key=args.api_key,
               served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
               max_prompt_tokens=args.max_prompt_tokens, log_level=args.log_level, chat_options=chat,
               allowed_hosts=args.allowed_hosts, allowed_origins=args.allowed_origins,
               body_timeout_s=args.body_timeout, header_timeout_s=args.header_timeout,
               max_connections=args.max_connections)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from flashdraft.train.trainer import TrainConfig, train

    ids = [int(x) for x in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    cfg = TrainConfig(model=args.model, out=args.out, data=args.data, prompts=args.prompts,
                      num_prompts=args.num_prompts, prompt_turns=args.prompt_turns,
                      samples_per_prompt=args.samples_per_prompt, gen_temperature=args.gen_temperature,
                      sampled_prefix=args.sampled_prefix, trim_loops=args.trim_loops,
                      max_new_tokens=args.max_new_tokens,
                      max_prompt_tokens=args.max_prompt_tokens, num_layers=args.num_layers,
                      intermediate_size=args.intermediate_size, block_size=args.block_size, target_layer_ids=ids,
                      mask_token_id=args.mask_token_id, epochs=args.epochs, max_steps=args.max_steps,
                      batch_size=args.batch_size, num_anchors=args.num_anchors, lr=args.lr, seed=args.seed,
                      device=args.device, dtype=args.dtype, save_every=args.save_every, keep_every=args.keep_every,
                      resume=args.resume,
                      gen_batch=args.gen_batch, precondition_taps=not args.no_precondition_taps,
                      init_layers_from=args.init_layers_from, init_drafter=args.init_drafter,
                      add_layers=args.add_layers, time_budget_s=args.time_budget,
                      local_context=args.local_context, local_context_frac=args.local_context_frac,
                      labels=args.labels, walk_floor=args.anchor_walk, stop_after_s=args.stop_after,
                      arch=args.arch, conv_kernel_size=args.conv_kernel_size, conv_group_size=args.conv_group_size,
                      selector_rank=args.selector_rank, selector_top_k=args.selector_top_k,
                      selector_loss_weight=args.selector_loss_weight)
    out = train(cfg)
    print(f"drafter written to {out}")
    return 0


def package_version() -> str:
    """The installed package's version; in a source tree that is not installed, pyproject.toml's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flashdraft")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M) if pyproject.exists() else None
        return found.group(1) if found else "unknown"


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help shows every option's default, as vLLM's does: argparse's value, unless the help already says
    in words what the default is ("default: the embedded SmolLM2"); flags (off unless given) show none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        flag = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction,
                                   argparse._VersionAction))
        if "default" in text or flag or action.required or not action.option_strings or \
                action.default is argparse.SUPPRESS:
            return text
        shown = "none" if action.default in (None, []) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and self._get_help_string(action):  # argparse shows no help line at all
            action = copy.copy(action)
            action.help = self._get_help_string(action)
        return super()._format_action(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashdraft", description=__doc__, formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"flashdraft {package_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal",
                       formatter_class=DefaultsHelpFormatter)
    g.add_argument("prompt", help="the prompt text, sent through the chat template unless --raw")
    add_engine_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of this probability mass")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k most likely tokens; -1: all")
    g.add_argument("--seed", type=int, default=None,
                   help="this request's sampling seed (default: none, one derived from the engine's seed 0)")
    g.add_argument("--stop", action="append", default=[], help="stop at this text; repeat for several")
    g.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       formatter_class=DefaultsHelpFormatter)
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="as in `vllm serve MODEL`: the same as --model (default: --model's)")
    add_engine_args(s, seed=True)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--api-key", default=os.environ.get("FLASHDRAFT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health; an empty key is refused "
                        "(default: $FLASHDRAFT_API_KEY)")
    s.add_argument("--allowed-hosts", default=None, type=lambda v: [h.strip() for h in v.split(",") if h.strip()],
                   help="comma-separated Host header names answered, any port; * = any (default: localhost, "
                        "127.0.0.1 and [::1] when --host is a loopback address, else any)")
    s.add_argument("--allowed-origins", default=[], type=lambda v: [o.strip() for o in v.split(",") if o.strip()],
                   help="comma-separated web origins CORS lets read answers, e.g. http://localhost:3000; * = any "
                        "(default: none, no CORS headers)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive before a 408 (default: 30)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a request's line and headers may take to arrive before the connection is closed "
                        "(default: 10)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections or running requests at which new ones get 503 (default: no limit)")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: MODEL as given)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the context window")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or text), or chatml_tools (default: the tokenizer's)")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="the format of the model's tool calls (default: the one its chat template writes)")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's flag: accepted; tool_choice auto is on whenever a tool-call parser is known")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return the model's <think> block apart, as reasoning_content")
    s.set_defaults(func=cmd_serve)

    from flashdraft.bench import add_bench_args, cmd_bench

    b = sub.add_parser("bench", help="plain vs DFlash throughput, latency and acceptance over a concurrency sweep",
                       formatter_class=DefaultsHelpFormatter)
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("train-drafter", help="self-distil data from a target and train a DFlash drafter for it",
                       formatter_class=DefaultsHelpFormatter)
    t.add_argument("--model", default=None, help="target: HF folder or .gguf (default: embedded SmolLM2-135M)")
    t.add_argument("--out", required=True, help="output folder (z-lab checkpoint, data, logs, trainer state)")
    t.add_argument("--data", default=None, help="existing jsonl of {prompt_ids, response_ids}; skips generation")
    t.add_argument("--prompts", default=None,
                   help="comma-separated prompt sources: jsonl files of {prompt} or {messages}, 'sharegpt' (the "
                        "training split) and 'python' (problems from the standard library's documented "
                        "functions); default: sharegpt")
    t.add_argument("--num-prompts", type=int, default=None, help="the first N prompts (default: all)")
    t.add_argument("--prompt-turns", choices=["first", "all"], default="first",
                   help="ShareGPT prompts: first human turns only, or every human turn with its history")
    t.add_argument("--samples-per-prompt", type=int, default=1,
                   help="responses generated per prompt (more than 1 needs --gen-temperature above 0)")
    t.add_argument("--gen-temperature", type=float, default=0.0,
                   help="sampling temperature of the self-distillation responses (default greedy)")
    t.add_argument("--sampled-prefix", type=int, default=0, metavar="N",
                   help="sample only the first 0..N tokens of each response at --gen-temperature, then continue "
                        "greedily; the prefix joins the prompt, so training sees greedy text only (what a T=0 "
                        "verify meets), many distinct continuations per prompt")
    t.add_argument("--max-new-tokens", type=int, default=256, help="tokens per generated response at most")
    t.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are skipped")
    t.add_argument("--trim-loops", type=int, default=None, metavar="K",
                   help="train on each response only up to K tokens into the loop it ends in (the run of tokens "
                        "at its end that each repeat an earlier 9-gram of the response); small targets' greedy "
                        "answers often circle to the length limit, and the loops would take most of the anchors")
    t.add_argument("--num-layers", type=int, default=3, help="drafter layers")
    t.add_argument("--arch", choices=["dflash", "dflash2"], default="dflash",
                   help="dflash2: grouped dynamic causal convolutions around each sublayer and a candidate selector "
                        "(with --init-drafter a DFlash drafter grows into one, starting from its drafts)")
    t.add_argument("--conv-kernel-size", type=int, default=2, help="dflash2: taps of each convolution")
    t.add_argument("--conv-group-size", type=int, default=16, help="dflash2: channels sharing a dynamic coefficient")
    t.add_argument("--selector-rank", type=int, default=256, help="dflash2: the candidate selector's rank")
    t.add_argument("--selector-top-k", type=int, default=16, help="dflash2: candidates the selector re-scores")
    t.add_argument("--selector-loss-weight", type=float, default=1.0,
                   help="dflash2: the selector's loss weight beside the drafter's")
    t.add_argument("--intermediate-size", type=int, default=None,
                   help="MLP width of the drafter layers (default: the target's); with --init-drafter a smaller "
                        "width narrows the saved MLPs to their strongest channels")
    t.add_argument("--block-size", type=int, default=None,
                   help="positions per draft block: the last token and block-size - 1 drafts (default 16; with "
                        "--init-drafter the saved drafter's, and a number trains it on another block size: the "
                        "weights do not depend on it)")
    t.add_argument("--target-layer-ids", default=None,
                   help="comma-separated 0-based target layers to tap (default: spread over the target); with "
                        "--init-drafter a list that keeps the saved drafter's taps and adds more (fc widens, the "
                        "added taps start at zero)")
    t.add_argument("--mask-token-id", type=int, default=None,
                   help="an id that never occurs in text (default: the tokenizer's mask token)")
    t.add_argument("--epochs", type=int, default=6)
    t.add_argument("--max-steps", type=int, default=None, help="stop after N steps (default: none, all epochs)")
    t.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    t.add_argument("--num-anchors", type=int, default=512, help="draft blocks (anchors) trained per sequence, at most")
    t.add_argument("--lr", type=float, default=6e-4, help="AdamW learning rate")
    t.add_argument("--seed", type=int, default=0,
                   help="response sampling, batch order and anchors; a run continuing another (--init-drafter) "
                        "on the same data with the same seed sees the same batches first")
    t.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    t.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    t.add_argument("--save-every", type=int, default=200, help="steps between saved checkpoints")
    t.add_argument("--keep-every", type=int, default=None, metavar="N",
                   help="also keep the drafter of every N-th step in OUT/steps/<step> (a loadable checkpoint each: "
                        "the learning curve, or an earlier drafter if a later one does worse)")
    t.add_argument("--gen-batch", type=int, default=256, help="responses generated at once (the engine's max_num_seqs)")
    t.add_argument("--resume", action="store_true", help="go on from the trainer state in --out")
    t.add_argument("--no-precondition-taps", action="store_true",
                   help="feed raw taps to fc while training (default: per-dimension 1/RMS, folded into fc on save)")
    t.add_argument("--init-drafter", default=None, metavar="DIR",
                   help="continue training a saved drafter (its block size, layers and taps unless told otherwise) "
                        "with a new schedule")
    t.add_argument("--add-layers", type=int, default=0,
                   help="with --init-drafter: layers appended after the saved ones, copies of the last whose "
                        "output projections start at zero (same drafts until trained)")
    t.add_argument("--init-layers-from", type=int, default=None,
                   help="start the drafter layers from target layers N, N+1, ... (default: random)")
    t.add_argument("--time-budget", type=float, default=None,
                   help="seconds of training: the schedule is shortened to fit, measured after 30 steps")
    t.add_argument("--local-context", type=int, default=None,
                   help="curriculum: for the first --local-context-frac of the steps, blocks see only the last "
                        "N context positions")
    t.add_argument("--local-context-frac", type=float, default=0.1, help="the share of steps --local-context holds")
    t.add_argument("--anchor-walk", type=float, default=None, metavar="W",
                   help="weight 1 for the blocks a greedy verify would meet in each sequence with the current "
                        "drafts (from the first answer token, each block anchored where the last one's accepted "
                        "run ends: right after a missed draft) and W (0 to 1) for the others; default: all alike")
    t.add_argument("--labels", choices=["data", "argmax", "kl"], default="data",
                   help="what slot k is scored against: the data's token (the published recipe), the target's "
                        "greedy choice there, or KL to the target's whole distribution")
    t.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                   help="save the trainer state and stop once the command has run this many seconds "
                        "(setup and data generation count); --resume goes on")
    t.set_defaults(func=cmd_train_drafter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, TypeError) as e:  # (OSError: a file missing, unreadable, a folder, ...)
        print(f"flashdraft: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
