"""Training data for a drafter: prompts in, the target's own responses out (self-distillation in
the serving mode: chat template, the engine's own decoding)."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

from tqdm import tqdm

from flashdraft.bench.datasets import first_human_turn, sharegpt_split
from flashdraft.sampling_params import SamplingParams


def sharegpt_prompts(split: str) -> list[str]:
    """First human turns. split "train": every conversation but the last 1,000 of the packaged file,
    each distinct first turn once and none that also opens a held-out conversation (ShareGPT has
    verbatim duplicates);
    "heldout": those last 1,000 (the evaluation set of `flashdraft bench --dataset sharegpt`)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown ShareGPT split {split!r}; use train or heldout")
    rest, heldout = sharegpt_split()
    held = [p.strip() for p in map(first_human_turn, heldout) if p and p.strip()]
    if split == "heldout":
        return held
    seen = set(held)
    train = (p.strip() for p in map(first_human_turn, rest) if p and p.strip())
    return [p for p in dict.fromkeys(train) if p not in seen]  # repeated turns once each


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
                       max_prompt_tokens: int, time_budget_s: float | None = None) -> int:
    """Regenerate responses with the target (greedy, chat template) and write
    {"prompt_ids", "response_ids"} lines to out_path as requests finish. Every prompt is queued at
    once so continuous batching keeps the engine full to the end; when time_budget_s runs out the
    unfinished requests are dropped. Returns the number of samples written."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_new_tokens)
    prompts = [ids for ids in map(eng.apply_chat_template, conversations) if len(ids) <= max_prompt_tokens]
    seqs = [eng.add_request(None, params, prompt_token_ids=ids) for ids in prompts]
    pending, written = set(seqs), 0
    deadline = time.monotonic() + time_budget_s if time_budget_s else float("inf")
    with open(out_path, "w") as f, tqdm(total=len(seqs), desc="self-distillation", unit="seq") as bar:
        try:
            while pending and time.monotonic() < deadline:
                for seq in eng.step():
                    if seq.is_finished and seq in pending:
                        pending.discard(seq)
                        bar.update(1)
                        out = eng.output(seq)
                        if out.token_ids:
                            f.write(json.dumps({"prompt_ids": out.prompt_token_ids, "response_ids": out.token_ids})
                                    + "\n")
                            written += 1
        finally:
            for seq in pending:
                eng.abort(seq)
    return written


def read_samples(path: str | Path) -> list[tuple[list[int], int]]:
    """jsonl (or .jsonl.gz) of {prompt_ids, response_ids} -> [(prompt + response ids, prompt length)]"""
    path = Path(path)
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    out = []
    for line in text.splitlines():
        if line.strip():
            r = json.loads(line)
            out.append((r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"])))
    if not out:
        raise ValueError(f"no training samples in {path}")
    return out
