"""Training data for a drafter: prompts in, the target's own responses out (self-distillation in
the serving mode: chat template, the engine's own decoding)."""

from __future__ import annotations

import ast
import gzip
import json
import lzma
import random
import sysconfig
import time
from pathlib import Path

from tqdm import tqdm

from flashdraft.bench.datasets import HUMANEVAL_TEMPLATE, first_human_turn, sharegpt_split
from flashdraft.sampling_params import SamplingParams


def sharegpt_prompts(split: str) -> list[str]:
    """First human turns. split "train": every conversation but the last 1,000 of the packaged file,
    each distinct first turn once and none that also opens a held-out conversation (ShareGPT has
    verbatim duplicates);
    "heldout": those last 1,000 (the evaluation set of `flashdraft bench --dataset sharegpt`)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown ShareGPT split {split!r}; use train or heldout")
    rest, heldout = sharegpt_split()
    held = _first_turns(heldout)
    if split == "heldout":
        return held
    seen = set(held)
    return [p for p in dict.fromkeys(_first_turns(rest)) if p not in seen]  # repeated turns once each


def _first_turns(records: list[dict]) -> list[str]:
    return [p.strip() for p in map(first_human_turn, records) if p and p.strip()]


ROLES = {"human": "user", "gpt": "assistant"}


def sharegpt_conversations(turns: str = "first") -> list[list[dict]]:
    """Training prompts as chat conversations. turns "first": the first human turn of each training
    conversation (`sharegpt_prompts("train")`). turns "all": one prompt per human turn, ending at
    that turn with ShareGPT's own earlier turns as history (several times the prompts of "first");
    the first turns plus every later human turn of conversations that alternate human/gpt from the
    start (up to the first turn that does not) and do not open with a held-out first turn; each
    distinct prompt once."""
    if turns == "first":
        return [[{"role": "user", "content": p}] for p in sharegpt_prompts("train")]
    if turns != "all":
        raise ValueError(f"unknown turns {turns!r}; use first or all")
    out = {(p,): [{"role": "user", "content": p}] for p in sharegpt_prompts("train")}
    rest, heldout = sharegpt_split()
    held = set(_first_turns(heldout))
    for rec in rest:
        msgs = []
        for k, turn in enumerate(rec.get("conversations") or []):
            role, text = ROLES.get(turn.get("from")), turn.get("value")
            if role != ("user" if k % 2 == 0 else "assistant") or not isinstance(text, str) or not text.strip():
                break  # keep the well-formed prefix only
            msgs.append({"role": role, "content": text.strip()})
        if not msgs or msgs[0]["content"] in held:
            continue
        for n in range(3, len(msgs) + 1, 2):  # later turns; the first turns came from "first"
            out.setdefault(tuple(m["content"] for m in msgs[:n]), msgs[:n])
    return list(out.values())


CODE_TEMPLATES = (
    HUMANEVAL_TEMPLATE,  # the wording HumanEval is served with
    "Implement the following Python function.\n```python\n{prompt}\n```",
    "Write a Python function `{name}{signature}`. {doc}",
)
SKIP_STDLIB = ("test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages")


def python_function_prompts(root: str | Path | None = None, min_doc: int = 40, max_doc: int = 1500) -> list[str]:
    """Code prompts from the public functions and methods of Python's own standard library (read
    with `ast`, nothing imported): each documented function's signature and docstring, as a problem
    to solve, in the three wordings of CODE_TEMPLATES, one per function in turn. The target writes
    the responses (self-distillation), so no library code enters the data; the evaluation's
    HumanEval problems are not standard-library functions."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        if any(part in SKIP_STDLIB for part in f.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not min_doc <= len(doc) <= max_doc:
                continue
            signature = f"({ast.unparse(node.args)})" + (f" -> {ast.unparse(node.returns)}" if node.returns else "")
            body = "\n".join("    " + line if line else "" for line in doc.splitlines())
            stub = f"def {node.name}{signature}:\n    \"\"\"\n{body}\n    \"\"\"\n"
            template = CODE_TEMPLATES[len(out) % len(CODE_TEMPLATES)]
            out.append(template.format(prompt=stub, name=node.name, signature=signature, doc=doc))
    return list(dict.fromkeys(out))


PROMPT_SOURCES = ("sharegpt", "python")


def training_conversations(sources: str | None, turns: str = "first") -> list[list[dict]]:
    """Comma-separated prompt sources -> conversations, in order: "sharegpt" (the training split,
    `turns` as in sharegpt_conversations), "python" (python_function_prompts) or a prompt file
    (read_prompt_file). None: ShareGPT."""
    out = []
    for src in (sources or "sharegpt").split(","):
        src = src.strip()
        if src == "sharegpt":
            out += sharegpt_conversations(turns)
        elif src == "python":
            out += [[{"role": "user", "content": p}] for p in python_function_prompts()]
        elif src:
            if not Path(src).exists():
                raise FileNotFoundError(f"prompt source {src!r} is neither a file nor one of "
                                        f"{', '.join(PROMPT_SOURCES)}")
            out += read_prompt_file(src)
    if not out:
        raise ValueError(f"no prompts in {sources!r}")
    return out


def read_text(path: str | Path) -> str:
    """A text file, gunzipped (.gz) or unxz-ed (.xz) by its suffix."""
    path = Path(path)
    raw = path.read_bytes()
    return (gzip.decompress(raw) if path.suffix == ".gz" else lzma.decompress(raw) if path.suffix == ".xz"
            else raw).decode()


def read_prompt_file(path: str | Path) -> list[list[dict]]:
    """jsonl (.gz, .xz) lines of {"prompt": str} or {"messages": [{"role", "content"}, ...]}
    -> conversations."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    text = read_text(path)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
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
                       max_prompt_tokens: int, time_budget_s: float | None = None, samples_per_prompt: int = 1,
                       temperature: float = 0.0, seed: int = 0, seed_stride: int = 1,
                       sampled_prefix: int = 0) -> int:
    """Regenerate responses with the target (chat template; greedy, or samples_per_prompt draws at
    `temperature`, draw j of conversation i seeded seed + i * seed_stride * samples_per_prompt + j;
    a shard of every n-th conversation passes seed_stride n) and write {"prompt_ids",
    "response_ids"} lines to out_path as requests finish. Every request is queued at once so
    continuous batching keeps the engine full to the end; when time_budget_s runs out the
    unfinished requests are dropped. Under a time budget the requests are queued in an order
    shuffled by `seed`, so runs with different seeds answer different parts of a list they cannot
    finish (in list order every run would answer its head); a draw's seed follows its conversation,
    not its place in the queue, so the order changes which samples are made, never their tokens.

    sampled_prefix N > 0 (with a temperature above 0): each draw samples only its first L tokens
    at `temperature` (L uniform in 0..N, drawn from the draw's seed; the same tokens the draw
    would start with without this option) and continues greedily from there, and the sample is
    written with those L tokens as part of its prompt, so a trainer's anchors fall on greedy tokens
    only. A draw whose answer ends inside its prefix is dropped. This gives many distinct greedy
    continuations per prompt: the text a greedy (T=0) verify meets, which plain greedy answers give
    only once per prompt. Returns the number of samples written."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError("samples_per_prompt > 1 needs a temperature above 0 (greedy draws are identical)")
    if sampled_prefix < 0:
        raise ValueError(f"sampled_prefix must be 0 or more, got {sampled_prefix}")
    if sampled_prefix and temperature == 0:
        raise ValueError("sampled_prefix needs a temperature above 0 to sample the prefix with")
    eng = llm.engine
    prompts = list(enumerate(map(eng.apply_chat_template, conversations)))  # long ones skipped, not renumbered
    step = seed_stride * samples_per_prompt
    draws = [(i, j, ids) for i, ids in prompts if len(ids) <= max_prompt_tokens for j in range(samples_per_prompt)]
    if time_budget_s:
        random.Random(seed).shuffle(draws)

    def greedy(ids: list[int], max_tokens: int):
        return eng.add_request(None, SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt_token_ids=ids)

    def request(ids: list[int], draw_seed: int):
        if not sampled_prefix:
            return eng.add_request(None, SamplingParams(temperature=temperature, max_tokens=max_new_tokens,
                                                        seed=draw_seed), prompt_token_ids=ids)
        n = random.Random(draw_seed).randint(0, min(sampled_prefix, max_new_tokens - 1))
        if n == 0:
            return greedy(ids, max_new_tokens)
        prefix = eng.add_request(None, SamplingParams(temperature=temperature, max_tokens=n, seed=draw_seed),
                                 prompt_token_ids=ids)
        prefixes.add(prefix)
        return prefix

    prefixes = set()  # sampled-prefix requests whose greedy continuation is still to come
    pending = {request(ids, seed + i * step + j) for i, j, ids in draws}
    written = 0
    deadline = time.monotonic() + time_budget_s if time_budget_s else float("inf")
    with open(out_path, "w") as f, tqdm(total=len(draws), desc="self-distillation", unit="seq") as bar:
        try:
            while pending and time.monotonic() < deadline:
                for seq in eng.step():
                    if not (seq.is_finished and seq in pending):
                        continue
                    pending.discard(seq)
                    out = eng.output(seq)
                    if seq in prefixes:
                        prefixes.discard(seq)
                        if out.finish_reason == "length" and len(out.token_ids) == seq.params.max_tokens:
                            # the prefix is whole (no stop token, no context limit): go on greedily
                            pending.add(greedy(out.prompt_token_ids + out.token_ids,
                                               max_new_tokens - len(out.token_ids)))
                            continue
                        bar.update(1)  # the answer ended inside its prefix: no greedy tokens to keep
                        continue
                    bar.update(1)
                    if out.token_ids:
                        f.write(json.dumps({"prompt_ids": out.prompt_token_ids, "response_ids": out.token_ids})
                                + "\n")
                        written += 1
        finally:
            for seq in pending:
                eng.abort(seq)
    return written


def repeat_flags(ids: list[int], n: int = 9) -> list[bool]:
    """Per token: does the n-gram ending there (the token and the n-1 before it) occur earlier in `ids`?"""
    seen, flags = set(), [False] * len(ids)
    for i in range(n - 1, len(ids)):
        gram = tuple(ids[i - n + 1: i + 1])
        flags[i] = gram in seen
        seen.add(gram)
    return flags


def trim_loop(ids: list[int], keep: int, n: int = 9) -> list[int]:
    """`ids` cut `keep` tokens into the loop it ends in: the longest run of tokens at its end that each
    repeat an earlier n-gram of `ids` (a small target's greedy answer often circles to its length
    limit). Answers that do not end in a loop come back whole."""
    flags = repeat_flags(ids, n)
    start = len(ids)
    while start and flags[start - 1]:
        start -= 1
    return ids[:start + keep]


def read_samples(path: str | Path, trim_loops: int | None = None) -> list[tuple[list[int], int]]:
    """jsonl (.gz, .xz) of {prompt_ids, response_ids} -> [(prompt + response ids, prompt length)].
    trim_loops=K: each response is cut K tokens into the loop it ends in (`trim_loop`), so training
    spends its anchors on text the loops would otherwise crowd out."""
    path = Path(path)
    if trim_loops is not None and trim_loops < 0:
        raise ValueError(f"trim_loops must be 0 or more tokens, not {trim_loops}")
    text = read_text(path)
    out = []
    for line in text.splitlines():
        if line.strip():
            r = json.loads(line)
            resp = r["response_ids"] if trim_loops is None else trim_loop(r["response_ids"], trim_loops)
            out.append((r["prompt_ids"] + resp, len(r["prompt_ids"])))
    if not out:
        raise ValueError(f"no training samples in {path}")
    return out
