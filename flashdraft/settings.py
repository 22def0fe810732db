"""Process-wide switches: the defaults behind "auto" and the FLASHDRAFT_* environment variables, read in
this one module so an A/B run, a sweep or a test changes them in one place (`settings.NAME = value`, or
the variable before start). Engine options are EngineConfig fields (flashdraft/config.py), not these:
a switch here changes how a result is computed or timed, never which result a request gets."""

from __future__ import annotations

import os

# speculative_tree_size="auto" on a CPU: a token tree of as many drafts as the drafter's chain (B - 1), so a
# verify checks the chain's rows and commits more (the shipped drafter, 2-core CPU, fp32: HumanEval tau 3.86
# against 3.43, MT-Bench 2.37 against 2.06; docs/performance.md section 4). On CUDA the chain: a tree of 15
# serves the shipped pair within a few percent of it (its larger verify costs about what its extra tokens
# save), and bf16 trees part from plain decoding's outputs far more often than the chain.
CPU_TREE = True
# speculative_min_acceptance_length="auto", on every device: whole steps decode without drafts while the
# batch's tau is below the break-even tau of what the steps cost (speculative/costs.py, policy.py StepGate
# via gate.py): on CUDA with captured graphs measured at start and refined while serving, elsewhere timed
# while serving; so drafts that miss (a drafter out of its domain, a large batch) stop costing steps.
STEP_GATE = True
# sampled requests draw their drafts from the drafter's distribution at their temperature (speculative/
# drafts.py); off: they draft the argmax too (FLASHDRAFT_DRAW_SAMPLED=0, for A/B runs)
DRAW_SAMPLED = os.environ.get("FLASHDRAFT_DRAW_SAMPLED", "1") != "0"


def env_int(name: str, default: int) -> int:
    """An integer FLASHDRAFT_* variable, with the variable named when it is not one."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """A FLASHDRAFT_* variable that takes one of `choices`, with the variable named when it does not."""
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return raw
