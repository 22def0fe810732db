#!/usr/bin/env bash
# Several drafters trained at once on one GPU, each from its own start on the same data with the same
# seed and seconds, then BASE and every arm evaluated at once (tau at T=0 and T=1 on HumanEval,
# MT-Bench, held-out ShareGPT). An arm is NAME=START_DIR[,extra pipeline flags with commas for spaces].
# Each drafter stays in WORK/<name>/drafter; logs and eval.json files land in OUT.
#
#   TRAIN_SECONDS=780 LR=6e-4 SEED=18 bash benchmarks/device/train_arms.sh GGUF DATA_DIR DATA BASE WORK OUT \
#     trim=run17,--trim-loops,32 deep=run17,--trim-loops,32,--add-layers,1,--intermediate-size,1024 \
#     taps=run18,--target-layer-ids,1,8,14,20,27,29,--intermediate-size,1472
set -euo pipefail
# several processes share the GPU: without expandable segments each one's allocator keeps the freed blocks
# of its ragged steps (a generator reserved 79 GB for 17 GB in use) and a neighbour runs out of memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 data=$3 base=$4 work=$5 out=$6
shift 6
train_s=${TRAIN_SECONDS:-780} lr=${LR:-6e-4} seed=${SEED:-18}
here=$(cd "$(dirname "$0")" && pwd)
pipe="python $here/drafter_pipeline.py --gguf $gguf --data-dir $data_dir"
mkdir -p "$work" "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }
names=()
log "training: $# arms at once, ${train_s}s each"
for arm in "$@"; do
  name=${arm%%=*} spec=${arm#*=}
  start=${spec%%,*} extra=""
  [ "$start" = "$spec" ] || extra=${spec#*,}
  names+=("$name")
  mkdir -p "$out/$name"
  $pipe --phase train --data "$data" --init-drafter "$start" --labels data --lr "$lr" \
    --batch-size 16 --num-anchors 512 --seed "$seed" --train-seconds "$train_s" --stop-after "$((train_s + 90))" \
    --save-every 1000 --no-eval ${extra//,/ } --work "$work/$name" --out "$work/$name-out" > "$out/$name/train.txt" 2>&1 &
done
wait
for name in "${names[@]}"; do
  tail -n 2 "$out/$name/train.txt"
  cp "$work/$name/drafter/train_log.jsonl" "$out/$name/train_log.jsonl"
  cp "$work/$name/drafter/config.json" "$out/$name/config.json"
done

log "evaluation: BASE and the arms at once"
$pipe --phase eval --drafter "$base" --out "$work/eval-base" > "$out/eval-base.txt" 2>&1 &
for name in "${names[@]}"; do
  $pipe --phase eval --drafter "$work/$name/drafter" --out "$work/eval-$name" > "$out/$name/eval.txt" 2>&1 &
done
wait
cp "$work/eval-base/eval.json" "$out/eval-base.json"
for name in "${names[@]}"; do cp "$work/eval-$name/eval.json" "$out/$name/eval.json"; done
grep -h "tau" "$out/eval-base.txt" "$out"/*/eval.txt || true
log "all arms trained and evaluated"  # the end to wait for: each arm's "] done" is copied in above
