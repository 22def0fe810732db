#!/usr/bin/env bash
# What the drafter's slots are scored against, side by side on one GPU: the same start (a saved
# drafter), the same data, the same seconds, three training processes at once, one per label mode
# (data tokens / the target's argmax / KL to the target's distribution); then every drafter and
# the start evaluated (tau at T=0 and T=1 on HumanEval, MT-Bench, held-out ShareGPT), four at once.
#
#   bash benchmarks/device/label_ablation.sh train GGUF DATA_DIR DATA START WORK OUT SECONDS [LR]
#   bash benchmarks/device/label_ablation.sh eval  GGUF DATA_DIR START WORK OUT
# WORK keeps each arm's trainer state and drafter (WORK/<labels>/drafter); OUT gets the logs,
# eval.json files and a summary.
set -euo pipefail
# several processes share the GPU: without expandable segments each one's allocator keeps the freed blocks
# of its ragged steps (a generator reserved 79 GB for 17 GB in use) and a neighbour runs out of memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
phase=$1 gguf=$2 data_dir=$3
here=$(cd "$(dirname "$0")" && pwd)
arms="data argmax kl"
if [ "$phase" = train ]; then
  data=$4 start=$5 work=$6 out=$7 seconds=$8 lr=${9:-1e-3}
  for labels in $arms; do
    mkdir -p "$out/$labels"
    python "$here/drafter_pipeline.py" --phase train --gguf "$gguf" --data-dir "$data_dir" --data "$data" \
      --init-drafter "$start" --labels "$labels" --lr "$lr" --batch-size 16 --num-anchors 512 \
      --train-seconds "$seconds" --stop-after "$((seconds + 60))" --no-eval \
      --work "$work/$labels" --out "$out/$labels" > "$out/$labels/train.txt" 2>&1 &
  done
  wait
  for labels in $arms; do
    tail -n 3 "$out/$labels/train.txt"
    rm -f "$out/$labels"/model.safetensors.*  # the drafters stay in WORK; only logs come back
  done
elif [ "$phase" = eval ]; then
  start=$4 work=$5 out=$6
  mkdir -p "$out/start"
  python "$here/drafter_pipeline.py" --phase eval --gguf "$gguf" --data-dir "$data_dir" --drafter "$start" \
    --out "$out/start" > "$out/start/eval.txt" 2>&1 &
  for labels in $arms; do
    mkdir -p "$out/$labels"
    python "$here/drafter_pipeline.py" --phase eval --gguf "$gguf" --data-dir "$data_dir" \
      --drafter "$work/$labels/drafter" --out "$out/$labels" > "$out/$labels/eval.txt" 2>&1 &
  done
  wait
  python - "$out" start $arms <<'EOF'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
rows = []
for n in names:
    ev = json.load(open(f"{out}/{n}/eval.json"))["eval"]
    rows.append((n, {k: round(v["tau"], 3) for k, v in ev.items()}))
for n, r in rows:
    print(n, r)
json.dump(dict(rows), open(f"{out}/summary.json", "w"), indent=1)
EOF
else
  echo "unknown phase $phase (train or eval)" >&2; exit 2
fi
