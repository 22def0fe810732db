"""`flashdraft generate | serve | bench | train-drafter`."""

from __future__ import annotations

import argparse
import sys
import time

from flashdraft.sampling_params import SamplingParams


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: embedded SmolLM2-135M)")
    p.add_argument("--draft", default="auto", help="DFlash drafter folder (default: the shipped one, if any)")
    p.add_argument("--no-spec", action="store_true", help="plain decoding, no drafter")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--attention-backend", default="torch", choices=["torch", "triton"])


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, draft=None if args.no_spec else args.draft, device=args.device,
                dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                kv_cache_memory_gb=args.kv_cache_memory_gb, attention_backend=args.attention_backend)


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
    print(line + "]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashdraft", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt, streamed to the terminal")
    g.add_argument("prompt")
    add_engine_args(g)
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"flashdraft: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
