"""Pick the training conversations whose last user turn asks for MT-Bench's weakest kinds of answer
(open writing, explanations of science and the humanities, math: tau 2.4-2.9 there at T=0, against
3.0-4.0 for reasoning, roleplay, coding and extraction) and write them to one prompt file. Turns that
mention code are left out. Keyword rules, not a classifier: the counts printed say what they caught.

    python benchmarks/device/kind_prompts.py OUT.jsonl.gz prompts/train_conversations.jsonl.gz ...
"""

from __future__ import annotations

import gzip
import json
import re
import sys
from pathlib import Path

from flashdraft.train.data import read_prompt_file

KINDS = {
    "math": r"\b(solve|equations?|calculate|probability|integral|derivative|triangle|prove|algebra|geometry"
            r"|percent(age)?|how many|math\w*|sum of|area of)\b",
    "writing": r"\b(write|compose|draft|story|poem|blog|essay|article|letter|e-?mail|speech|paragraph|describe"
               r"|imagine|pretend|persuasive|character|narrative)\b",
    "explain": r"\b(explain|what is|what are|how does|how do|why does|why do|summari[sz]e|difference between)\b",
}
CODE = re.compile(r"```|\b(code|python|javascript|java|sql|function|html|css|react|api|c\+\+|json|script|regex"
                  r"|class|program)\b", re.I)


def kind_of(text: str) -> str | None:
    """The first kind whose keywords the turn has (math before writing before explain), or None."""
    if CODE.search(text):
        return None
    return next((k for k, rule in KINDS.items() if re.search(rule, text, re.I)), None)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out, sources = Path(sys.argv[1]), sys.argv[2:]
    kept, counts = [], dict.fromkeys(KINDS, 0)
    for src in sources:
        for conv in read_prompt_file(src):
            kind = kind_of(conv[-1]["content"])
            if kind:
                counts[kind] += 1
                kept.append(conv)
    if not kept:
        sys.exit(f"no conversation of {', '.join(KINDS)} in {', '.join(sources)}")
    lines = "".join(json.dumps({"messages": c}) + "\n" for c in kept)
    out.write_bytes(gzip.compress(lines.encode()))
    print(f"{out}: {len(kept)} conversations ({', '.join(f'{k} {n}' for k, n in counts.items())})")


if __name__ == "__main__":
    main()
