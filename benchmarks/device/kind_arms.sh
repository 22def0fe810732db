#!/usr/bin/env bash
# More answers of MT-Bench's weakest kinds (kind_prompts.py: open writing, explanations, math from the
# training conversations), side by side with none: four sampled-prefix + greedy generators over that file,
# then two arms trained at once from START (train_arms.sh: same seed and seconds, then START and the arms
# evaluated at once), each with the answers cut 32 tokens into their closing loops:
#   ctl    OLD_DATA alone (the recipe of run 18)
#   kinds  OLD_DATA and the new answers
#
#   GEN_SECONDS=240 TRAIN_SECONDS=720 SEED=23 OLD_DATA=data.jsonl \
#     bash benchmarks/device/kind_arms.sh GGUF DATA_DIR START WORK OUT
set -euo pipefail
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
gen_s=${GEN_SECONDS:-240} old=${OLD_DATA:?OLD_DATA: the answers both arms train on}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work" "$out"
python "$here/kind_prompts.py" "$data_dir/kinds.jsonl.gz" "$data_dir/train_conversations.jsonl.gz" \
  "$data_dir/train_conversations_long.jsonl.gz" | tee "$out/kinds.txt"
SETS="K0 kinds.jsonl.gz 0.6 1 2048
K1 kinds.jsonl.gz 0.7 1 2048
K2 kinds.jsonl.gz 0.8 1 2048
K3 kinds.jsonl.gz 0.9 1 2048" GEN_SECONDS=$gen_s PREFIX=32 SEED=70000 OLD_DATA=$old \
  bash "$here/greedy_gen.sh" "$gguf" "$data_dir" "$work" "$out"
bash "$here/train_arms.sh" "$gguf" "$data_dir" "$old" "$start" "$work" "$out" "ctl=$start,--trim-loops,32" \
  "kinds=$start,--trim-loops,32,--data,$work/data.jsonl"
