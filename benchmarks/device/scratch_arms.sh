#!/usr/bin/env bash
# Learning curves: drafters trained at once on one GPU on shares of one data file, with the same seed,
# seconds and recipe, each keeping the drafter of every KEEP-th step; then every kept drafter is
# evaluated at T=0 and each arm's last one at T=0 and T=1 (EVALS evaluations at a time).
# An arm is NAME=K[,START[,extra pipeline flags with commas for spaces]]: every K-th sample of DATA
# (1 = all of it), from START (a saved drafter, continued with a new schedule) or, when START is left
# out or "scratch", from nothing with the recipe below (3 layers from target layers 27-29, five taps,
# B=8, the local-context curriculum for the first tenth, loops trimmed 32 tokens in).
# Drafters stay in WORK/<name>/drafter (kept ones in its steps/); logs and eval json files land in OUT.
#
#   TRAIN_SECONDS=960 KEEP=1000 LR=2e-3 SEED=24 bash benchmarks/device/scratch_arms.sh GGUF DATA_DIR DATA WORK OUT \
#     all=1 eighth=8
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 data=$3 work=$4 out=$5
shift 5
train_s=${TRAIN_SECONDS:-960} keep=${KEEP:-1000} lr=${LR:-2e-3} seed=${SEED:-24} evals=${EVALS:-4}
here=$(cd "$(dirname "$0")" && pwd)
pipe="python $here/drafter_pipeline.py --gguf $gguf --data-dir $data_dir"
scratch="--num-layers 3 --block-size 8 --target-layer-ids 1,8,14,20,27 --init-layers-from 27 --local-context 64 \
--local-context-frac 0.1"
mkdir -p "$work" "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }
names=()
log "training: $# arms at once, ${train_s}s each, a drafter kept every $keep steps"
for arm in "$@"; do
  name=${arm%%=*} spec=${arm#*=}
  k=${spec%%,*} rest="" start="scratch" extra=""
  [ "$k" = "$spec" ] || rest=${spec#*,}
  if [ -n "$rest" ]; then
    start=${rest%%,*}
    [ "$start" = "$rest" ] || extra=${rest#*,}
  fi
  case $k in ''|*[!0-9]*|0) echo "arm $arm: the share K must be a whole number of 1 or more" >&2; exit 2;; esac
  names+=("$name")
  mkdir -p "$out/$name" "$work/$name"
  awk -v k="$k" '(NR - 1) % k == 0' "$data" > "$work/$name/data.jsonl"
  log "$name: 1 in $k samples, $(wc -l < "$work/$name/data.jsonl") of $(wc -l < "$data"), from $start"
  if [ "$start" = scratch ]; then from=$scratch; else from="--init-drafter $start"; fi
  $pipe --phase train --data "$work/$name/data.jsonl" $from --trim-loops 32 --labels data --lr "$lr" \
    --batch-size 16 --num-anchors 512 --seed "$seed" --train-seconds "$train_s" --stop-after "$((train_s + 120))" \
    --keep-every "$keep" --no-eval ${extra//,/ } --work "$work/$name" --out "$work/$name-out" \
    > "$out/$name/train.txt" 2>&1 &
done
wait
trained=()
for name in "${names[@]}"; do  # an arm that failed is named and left out; the others go on
  if [ -f "$work/$name/drafter/model.safetensors" ]; then
    trained+=("$name")
    grep -a "training:" "$out/$name/train.txt" | tail -n 1 || true
    cp "$work/$name/drafter/train_log.jsonl" "$work/$name/drafter/config.json" "$out/$name/"
  else
    echo "$name: no drafter written; the end of $out/$name/train.txt:"; tail -c 600 "$out/$name/train.txt"; echo
  fi
done
names=("${trained[@]}")

log "evaluation: every kept drafter at T=0, each arm's last at T=0 and T=1, $evals at a time"
jobs_=()
for name in "${names[@]}"; do
  for d in "$work/$name"/drafter/steps/*; do
    [ -d "$d" ] && jobs_+=("$name $(basename "$d") $d 0")
  done
  jobs_+=("$name last $work/$name/drafter 0,1")
done
running=0
for j in "${jobs_[@]}"; do
  read -r name step dir temps <<< "$j"
  $pipe --phase eval --drafter "$dir" --eval-temps "$temps" --out "$work/eval-$name-$step" \
    > "$out/$name/eval-$step.txt" 2>&1 && cp "$work/eval-$name-$step/eval.json" "$out/$name/eval-$step.json" &
  running=$((running + 1))
  if [ "$running" -ge "$evals" ]; then wait -n || true; running=$((running - 1)); fi
done
wait
for name in "${names[@]}"; do
  for f in "$out/$name"/eval-*.txt; do echo "$name $(basename "$f" .txt): $(grep -ah "T=0: tau" "$f" | \
    sed 's/.*\] //; s/ over.*//' | tr '\n' ' ')"; done
done
log "all arms trained and evaluated"  # the end to wait for: each arm's "] done" is copied in above
