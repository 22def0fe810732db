#!/usr/bin/env bash
# Loops in the training text, and depth at the same size, side by side on one GPU: fresh greedy
# answers (greedy_gen.sh) joined with OLD_DATA, then three training processes at once from START
# with the same seed, data and seconds:
#   whole  every answer whole (the recipe of run 17)
#   trim   --trim-loops 32: each answer cut 32 tokens into the loop it ends in
#   deep   trim, and START grown to one more layer with every MLP narrowed to 1,024 channels
#          (--add-layers 1 --intermediate-size 1024: the same bytes as START's three layers)
# then START and the three drafters evaluated at once (tau at T=0 and T=1 on HumanEval, MT-Bench,
# held-out ShareGPT). Each drafter stays in WORK/<arm>/drafter; logs and eval.json files land in OUT.
#
#   GEN_SECONDS=240 TRAIN_SECONDS=780 OLD_DATA=old.jsonl \
#     bash benchmarks/device/loop_ablation.sh GGUF DATA_DIR START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
train_s=${TRAIN_SECONDS:-780} lr=${LR:-6e-4}
here=$(cd "$(dirname "$0")" && pwd)
pipe="python $here/drafter_pipeline.py --gguf $gguf --data-dir $data_dir"
mkdir -p "$work" "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }

bash "$here/greedy_gen.sh" "$gguf" "$data_dir" "$work" "$out"
log "training: three arms at once, ${train_s}s each"
for arm in whole trim deep; do
  case $arm in
    whole) extra="" ;;
    trim) extra="--trim-loops 32" ;;
    deep) extra="--trim-loops 32 --add-layers 1 --intermediate-size 1024" ;;
  esac
  mkdir -p "$out/$arm"
  $pipe --phase train --data "$work/data.jsonl" --init-drafter "$start" --labels data --lr "$lr" \
    --batch-size 16 --num-anchors 512 --seed 18 --train-seconds "$train_s" --stop-after "$((train_s + 90))" \
    --save-every 1000 --no-eval $extra --work "$work/$arm" --out "$work/$arm-out" > "$out/$arm/train.txt" 2>&1 &
done
wait
for arm in whole trim deep; do
  tail -n 2 "$out/$arm/train.txt"
  cp "$work/$arm/drafter/train_log.jsonl" "$out/$arm/train_log.jsonl"
done

log "evaluation: START and the three arms at once"
$pipe --phase eval --drafter "$start" --out "$work/eval-start" > "$out/eval-start.txt" 2>&1 &
for arm in whole trim deep; do
  $pipe --phase eval --drafter "$work/$arm/drafter" --out "$work/eval-$arm" > "$out/$arm/eval.txt" 2>&1 &
done
wait
cp "$work/eval-start/eval.json" "$out/eval-start.json"
for arm in whole trim deep; do cp "$work/eval-$arm/eval.json" "$out/$arm/eval.json"; done
grep -h "tau" "$out/eval-start.txt" "$out"/*/eval.txt || true
log "done"
