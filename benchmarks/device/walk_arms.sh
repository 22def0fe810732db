#!/usr/bin/env bash
# The loss weighted toward the anchors a greedy verify meets, side by side on one GPU: three arms
# trained at once from START on the same data (train_arms.sh: same seed and seconds, then START and
# the arms evaluated at once), each on the answers cut 32 tokens into their closing loops:
#   ctl    every block weighted alike (the recipe of run 18)
#   walk0  --anchor-walk 0: only the blocks on the walk a verify would take with this step's drafts
#   walk3  --anchor-walk 0.3: those blocks weight 1, the others 0.3
#
#   TRAIN_SECONDS=780 SEED=22 bash benchmarks/device/walk_arms.sh GGUF DATA_DIR DATA START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 data=$3 start=$4 work=$5 out=$6
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/train_arms.sh" "$gguf" "$data_dir" "$data" "$start" "$work" "$out" "ctl=$start,--trim-loops,32" \
  "walk0=$start,--trim-loops,32,--anchor-walk,0" "walk3=$start,--trim-loops,32,--anchor-walk,0.3"
