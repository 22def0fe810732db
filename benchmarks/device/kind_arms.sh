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
# several processes share the GPU: without expandable segments each one's allocator keeps the freed blocks
# of its ragged steps (a generator reserved 79 GB for 17 GB in use) and a neighbour runs out of memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
gen_s=${GEN_SECONDS:-240} old=${OLD_DATA:?OLD_DATA: the answers both arms train on}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work" "$out"
python "$here/kind_prompts.py" "$data_dir/kinds.jsonl.gz" "$data_dir/train_conversations.jsonl.gz" \
  "$data_dir/train_conversations_long.jsonl.gz" | tee "$out/kinds.txt"
echo "[$(date +%H:%M:%S)] generation: ${gen_s}s, four processes"
k=0
for temp in 0.6 0.7 0.8 0.9; do
  python "$here/drafter_pipeline.py" --gguf "$gguf" --data-dir "$data_dir" --phase gen --prompt-file kinds.jsonl.gz \
    --max-prompt-tokens 2048 --gen-temperature "$temp" --sampled-prefix 32 --max-new-tokens 512 --gen-batch 768 \
    --gen-kv-gb 16 --gen-seconds "$gen_s" --seed $((70000 + 1000 * k)) --work "$work/gen-$k" --out "$work/gen-$k" \
    > "$out/gen-$k.txt" 2>&1 &
  k=$((k + 1))
done
wait
grep -h "self-distillation:" "$out"/gen-*.txt || true
cat "$work"/gen-*/data.jsonl "$old" > "$work/data.jsonl"
echo "[$(date +%H:%M:%S)] data: $(wc -l < "$work/data.jsonl") samples ($(wc -l < "$old") old)"
bash "$here/train_arms.sh" "$gguf" "$data_dir" "$old" "$start" "$work" "$out" "ctl=$start,--trim-loops,32" \
  "kinds=$start,--trim-loops,32,--data,$work/data.jsonl"
