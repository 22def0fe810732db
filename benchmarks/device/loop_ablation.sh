#!/usr/bin/env bash
# Loops in the training text, and depth at the same size, side by side on one GPU: fresh greedy
# answers (greedy_gen.sh) joined with OLD_DATA, then three arms trained at once from START
# (train_arms.sh: same seed, data and seconds, then START and the arms evaluated at once):
#   whole  every answer whole (the recipe of run 17)
#   trim   --trim-loops 32: each answer cut 32 tokens into the loop it ends in
#   deep   trim, and START grown to one more layer with every MLP narrowed to 1,024 channels
#          (--add-layers 1 --intermediate-size 1024: the same bytes as START's three layers)
#
#   GEN_SECONDS=240 TRAIN_SECONDS=780 OLD_DATA=old.jsonl \
#     bash benchmarks/device/loop_ablation.sh GGUF DATA_DIR START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/greedy_gen.sh" "$gguf" "$data_dir" "$work" "$out"
bash "$here/train_arms.sh" "$gguf" "$data_dir" "$work/data.jsonl" "$start" "$work" "$out" "whole=$start" \
  "trim=$start,--trim-loops,32" "deep=$start,--trim-loops,32,--add-layers,1,--intermediate-size,1024"
