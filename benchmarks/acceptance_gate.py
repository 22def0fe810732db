"""The acceptance gates (speculative_min_acceptance_length), side by side in one process: the same
prompts, seeds and temperature through a plain engine and through one engine with the drafter whose
gate is switched between arms, interleaved over --reps rounds. Arms: "off" (draft at every step),
"auto" (the default: the step gate, speculative/gate.py StepGate, at the break-even tau of the step
costs, which on a CPU it times while serving; each run starts it afresh, as a new engine would) or a
fixed per-request threshold. Per arm: output tok/s, tau, gated steps, and how many outputs equal
plain decoding's (in float32 all of them must).

    python benchmarks/acceptance_gate.py [--dataset mt-bench] [--num-prompts 12] [--max-tokens 128]
        [--temperatures 0,1] [--min-tau off,auto,1.5,2] [--concurrency 1,all] [--reps 2]
        [--device cpu] [--dtype float32] [--model M] [--draft D] [--json out.json]
"""

from __future__ import annotations

import json

import torch
from sampled_drafts import arm_parser, arm_row, arm_setup, run  # benchmarks/ is on the path when this script runs

from flashdraft import LLM, SamplingParams
from flashdraft.config import EngineConfig
from flashdraft.speculative import costs as step_costs
from flashdraft.speculative.gate import StepGate


def main() -> None:
    ap = arm_parser()
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--min-tau", default="off,auto,1.5,2",
                    help="gate thresholds, one arm each; off: no gate, auto: the device's default")
    args = ap.parse_args()
    temps = [float(t) for t in args.temperatures.split(",")]
    gates = [g.strip() for g in args.min_tau.split(",")]
    try:
        rules = {g: EngineConfig(speculative_min_acceptance_length=g if g == "auto" else None if g == "off"
                                 else float(g)).min_acceptance_length(torch.device(args.device)) for g in gates}
    except ValueError:
        ap.error(f"--min-tau takes off, auto or numbers >= 1, got {args.min_tau!r}")
    levels, kw, convs = arm_setup(ap, args)
    spec = LLM(draft=args.draft, speculative_min_acceptance_length=None, **kw)
    plain = LLM(draft=None, **kw)
    if spec.engine.spec is None:
        raise SystemExit("no drafter loaded: pass --draft DIR")
    results = []
    for temp in temps:
        params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=args.seed + i)
                  for i in range(len(convs))]
        for level in levels:
            one = level == "1"
            ref, _, _ = run(plain, convs, params, one)  # warm-up and the reference tokens
            for rep in range(args.reps):
                for arm in ["plain"] + gates:
                    if arm != "plain":
                        set_arm(spec, arm, rules[arm])
                    toks, dt, d = run(plain if arm == "plain" else spec, convs, params, one)
                    label = arm if arm == "plain" else f"min_tau {arm}"
                    row = arm_row(label, toks, dt, d, ref, temperature=temp, concurrency=level, rep=rep)
                    results.append(row)
                    extra = f", tau {row['tau']:.3f}, {row['num_drafts']} verifies, {row['gated_steps']} gated" \
                        if "tau" in row else ""
                    print(f"T={temp:g} c={level} rep {rep} {label:12s}: {row['tokens']} tokens in {dt:.2f} s, "
                          f"{row['tok_s']:.1f} tok/s, same as plain {row['same_as_plain']}/{len(convs)}{extra}",
                          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def set_arm(llm: LLM, arm: str, rule) -> None:
    """The drafting engine's gates for an arm: the per-request rule, and a fresh step gate for "auto"."""
    sp = llm.engine.spec
    sp.min_tau_rule = rule
    sp.costs = sp.step_gate = None
    sp.seen = step_costs.Observed()
    if arm == "auto":
        sp.costs = step_costs.measure(sp) or step_costs.StepCosts.unmeasured(llm.engine.config.max_num_seqs)
        sp.step_gate = StepGate()


if __name__ == "__main__":
    main()
