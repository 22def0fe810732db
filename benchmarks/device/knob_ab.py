"""One command under several settings of the import-time knobs (FLASHDRAFT_* environment variables,
read once per process: FLASHDRAFT_SKINNY_ROWS, FLASHDRAFT_MERGE_SPLITS, FLASHDRAFT_SPLIT_BELOW, ...),
each setting a process of its own, the settings alternating over `--rounds` rounds on one machine.
Prints the lines of each run that start with `--keep` (default "==", pair_kernels.py's summary lines)
under the setting's name, and writes every run's whole output to --out when given.

    python benchmarks/device/knob_ab.py --out DIR "FLASHDRAFT_SKINNY_ROWS=32" "FLASHDRAFT_SKINNY_ROWS=64" \\
        -- python benchmarks/device/pair_kernels.py smollm2.gguf humaneval.jsonl 1,8,32

A setting is a space-separated list of NAME=VALUE pairs ("" for the defaults)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def parse_setting(text: str) -> dict[str, str]:
    """'A=1 B=2' -> {'A': '1', 'B': '2'}; only FLASHDRAFT_* names (the knobs), each NAME=VALUE."""
    env = {}
    for pair in text.split():
        name, sep, value = pair.partition("=")
        if not sep or not name.startswith("FLASHDRAFT_"):
            raise ValueError(f"a setting is FLASHDRAFT_NAME=VALUE pairs, got {pair!r}")
        env[name] = value
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("usage: knob_ab.py [--rounds N] [--keep PREFIX] [--out DIR] SETTING ... -- COMMAND ...")
    cut = argv.index("--")
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep", default="==")
    ap.add_argument("--out", default=None)
    ap.add_argument("settings", nargs="+")
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    settings = [(s or "defaults", parse_setting(s)) for s in args.settings]
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for r in range(args.rounds):
        for i, (name, env) in enumerate(settings):
            run = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
            text = run.stdout + run.stderr
            if out is not None:
                (out / f"round{r}-setting{i}.txt").write_text(f"# {name}\n# {' '.join(command)}\n{text}")
            print(f"## round {r}, {name} (rc {run.returncode})")
            for line in text.splitlines():
                if line.startswith(args.keep):
                    print(line)
            failed += run.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
