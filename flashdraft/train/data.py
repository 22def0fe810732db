"""Training data for a drafter: prompts in, the target's own responses out (self-distillation in
the serving mode: chat template, the engine's own decoding)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from flashdraft.bench.datasets import first_human_turn, sharegpt_split
from flashdraft.sampling_params import SamplingParams


def sharegpt_prompts(split: str) -> list[str]:
    """First human turns. split "train": every conversation but the last 1,000 of the packaged file;
    "heldout": those last 1,000 (the evaluation set of `flashdraft bench --dataset sharegpt`)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown ShareGPT split {split!r}; use train or heldout")
    rest, heldout = sharegpt_split()
    convs = rest if split == "train" else heldout
    return [p.strip() for p in map(first_human_turn, convs) if p and p.strip()]


def read_prompt_file(path: str | Path) -> list[list[dict]]:
    """jsonl lines of {"prompt": str} or {"messages": [{"role", "content"}, ...]} -> conversations."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON: {e}") from None
        if isinstance(rec.get("messages"), list):
            out.append(rec["messages"])
        elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
            out.append([{"role": "user", "content": rec["prompt"]}])
        else:
            raise ValueError(f"{path}:{n}: expected a non-empty 'prompt' string or a 'messages' list")
    if not out:
        raise ValueError(f"prompt file {str(path)!r} holds no prompts")
    return out


def generate_responses(llm, conversations: list[list[dict]], out_path: Path, max_new_tokens: int,
                       max_prompt_tokens: int, batch: int = 512) -> int:
    """Regenerate responses with the target (greedy, chat template) and append
    {"prompt_ids", "response_ids"} lines to out_path. Returns the number of samples written."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_new_tokens)
    prompts = []
    for conv in conversations:
        ids = eng.apply_chat_template(conv)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
    written = 0
    with open(out_path, "w") as f, tqdm(total=len(prompts), desc="self-distillation", unit="seq") as bar:
        for chunk in _chunks(prompts, batch):
            for ids, out in zip(chunk, llm.generate(chunk, params)):
                if out.token_ids:
                    f.write(json.dumps({"prompt_ids": ids, "response_ids": out.token_ids}) + "\n")
                    written += 1
            bar.update(len(chunk))
    return written


def _chunks(xs: list, n: int) -> Iterator[list]:
    for i in range(0, len(xs), n):
        yield xs[i: i + n]


def read_samples(path: str | Path) -> list[tuple[list[int], int]]:
    """-> [(prompt + response ids, prompt length)]"""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            out.append((r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])))
    if not out:
        raise ValueError(f"no training samples in {path}")
    return out
