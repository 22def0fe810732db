#!/usr/bin/env bash
# One drafter run on one GPU with sampled-prefix + greedy answers (--sampled-prefix): fresh answers
# (greedy_gen.sh: five generators at once), joined with answers brought along (OLD_DATA, optional), then training
# from START, then START and the new drafter evaluated at once, then `flashdraft bench` of the new
# drafter against plain decoding. The trained drafter is written every 1,000 steps, so a run cut
# short still leaves one. Everything lands in OUT.
#
#   GEN_SECONDS=240 TRAIN_SECONDS=660 OLD_DATA=old.jsonl [TRIM=32] \
#     bash benchmarks/device/prefix_run.sh GGUF DATA_DIR START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
gen_s=${GEN_SECONDS:-240} train_s=${TRAIN_SECONDS:-660} prefix=${PREFIX:-32} lr=${LR:-6e-4} seed=${SEED:-60000}
here=$(cd "$(dirname "$0")" && pwd)
pipe="python $here/drafter_pipeline.py --gguf $gguf --data-dir $data_dir"
mkdir -p "$work" "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }

GEN_SECONDS=$gen_s PREFIX=$prefix SEED=$seed bash "$here/greedy_gen.sh" "$gguf" "$data_dir" "$work" "$out"

log "training: ${train_s}s"
$pipe --phase train --data "$work/data.jsonl" --init-drafter "$start" --labels data --lr "$lr" \
  --batch-size 16 --num-anchors 512 --seed 17 --train-seconds "$train_s" --save-every 1000 --no-eval ${TRIM:+--trim-loops $TRIM} \
  --work "$work/train" --out "$work/train-out" > "$out/train.txt" 2>&1 || true
tail -n 2 "$out/train.txt"
cp "$work/train/drafter/train_log.jsonl" "$out/train_log.jsonl"

log "evaluation: the start and the new drafter at once"
$pipe --phase eval --drafter "$start" --out "$work/eval-start" > "$out/eval-start.txt" 2>&1 &
$pipe --phase eval --drafter "$work/train/drafter" --out "$work/eval-new" > "$out/eval-new.txt" 2>&1 &
wait
cp "$work/eval-start/eval.json" "$out/eval-start.json"
cp "$work/eval-new/eval.json" "$out/eval-new.json"
grep -h "tau" "$out/eval-start.txt" "$out/eval-new.txt" || true

log "bench: the new drafter against plain decoding"
python -m flashdraft bench --model "$gguf" --dataset "$data_dir/humaneval.jsonl" --num-prompts 32 --max-tokens 256 \
  --concurrency 1,8,32 --device cuda --dtype bfloat16 --draft "$work/train/drafter" --out "$work/bench" \
  > "$out/bench.txt" 2>&1 || true
python -m flashdraft bench --model "$gguf" --dataset "$data_dir/humaneval.jsonl" --num-prompts 164 --max-tokens 256 \
  --concurrency 32 --device cuda --dtype bfloat16 --draft "$work/train/drafter" --out "$work/bench164" \
  > "$out/bench164.txt" 2>&1 || true
cp "$work/bench/bench.json" "$out/bench.json" 2>/dev/null || true
cp "$work/bench164/bench.json" "$out/bench164.json" 2>/dev/null || true
log "done"
