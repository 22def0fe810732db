"""How much of a set of answers is loops: the fraction of answer tokens whose n-gram (the token and the
n-1 before it, all inside the answer) already occurred earlier in the same answer, and the share of
answers of at least --long tokens. Reads training data (jsonl, .gz or .xz, of {prompt_ids,
response_ids}) or `per_prompt_tau.py --json` output (texts, tokenized with the embedded target's
tokenizer).

    python benchmarks/repeat_fraction.py FILE [--n 9] [--long 480]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashdraft.train.data import read_text, repeat_flags


def repeated_tokens(ids: list[int], n: int = 9) -> int:
    """Tokens whose n-gram ending there occurred earlier in `ids`."""
    return sum(repeat_flags(ids, n))


def read_answers(path: Path) -> list[list[int]]:
    text = read_text(path)
    if text.lstrip().startswith("["):  # per_prompt_tau.py --json
        from flashdraft import LLM

        tok = LLM(draft=None, device="cpu").engine.tokenizer
        return [tok(r["text"], add_special_tokens=False).input_ids for r in json.loads(text)]
    return [json.loads(line)["response_ids"] for line in text.splitlines() if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--n", type=int, default=9)
    ap.add_argument("--long", type=int, default=480)
    args = ap.parse_args()
    answers = read_answers(Path(args.file))
    total = sum(map(len, answers))
    rep = sum(repeated_tokens(a, args.n) for a in answers)
    print(f"{len(answers)} answers, {total} tokens: {rep / total:.3f} of the tokens repeat an earlier "
          f"{args.n}-gram of the same answer; {sum(len(a) >= args.long for a in answers) / len(answers):.2f} "
          f"of the answers have {args.long} tokens or more")


if __name__ == "__main__":
    main()
