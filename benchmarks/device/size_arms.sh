#!/usr/bin/env bash
# What size buys, side by side on one GPU: three arms trained at once from START on the same data
# (train_arms.sh: same seed and seconds, then START and the arms evaluated at once), each on the
# answers cut 32 tokens into their closing loops (--trim-loops 32):
#   cont   START as it is (three layers, B=8): the control, and what more steps alone buy
#   b16    START on 16-position blocks (--block-size 16: the same weights, 15 drafts per verify)
#   deep5  START grown to five layers (--add-layers 2: copies of its last layer whose output
#          projections start at zero, so it begins with START's drafts; ~39 MB, over the 25 MB cap)
#
#   TRAIN_SECONDS=780 SEED=20 bash benchmarks/device/size_arms.sh GGUF DATA_DIR DATA START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 data=$3 start=$4 work=$5 out=$6
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/train_arms.sh" "$gguf" "$data_dir" "$data" "$start" "$work" "$out" "cont=$start,--trim-loops,32" \
  "b16=$start,--trim-loops,32,--block-size,16" "deep5=$start,--trim-loops,32,--add-layers,2"
