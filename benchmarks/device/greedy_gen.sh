#!/usr/bin/env bash
# Fresh sampled-prefix + greedy answers on one GPU (--sampled-prefix): five generators at once
# (ShareGPT conversations at two temperatures, long conversations at two, Python problems x3), their
# data joined with answers brought along (OLD_DATA, optional) into WORK/data.jsonl. GEN_SECONDS=0
# makes nothing new. Logs land in OUT.
#
#   GEN_SECONDS=240 SEED=60000 OLD_DATA=old.jsonl bash benchmarks/device/greedy_gen.sh GGUF DATA_DIR WORK OUT
# SETS (lines of NAME PROMPT_FILE TEMPERATURE SAMPLES_PER_PROMPT MAX_PROMPT_TOKENS) replaces the five.
set -euo pipefail
# several processes share the GPU: without expandable segments each one's allocator keeps the freed blocks
# of its ragged steps (a generator reserved 79 GB for 17 GB in use) and a neighbour runs out of memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 work=$3 out=$4
gen_s=${GEN_SECONDS:-240} prefix=${PREFIX:-32} seed=${SEED:-60000}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work" "$out"
k=0
# one generator per set: "NAME PROMPT_FILE TEMPERATURE SAMPLES_PER_PROMPT MAX_PROMPT_TOKENS", a line each
sets=${SETS:-"S1 train_conversations.jsonl.gz 0.7 1 512
S2 train_conversations.jsonl.gz 0.9 1 512
L1 train_conversations_long.jsonl.gz 0.8 1 2048
L2 train_conversations_long.jsonl.gz 0.6 1 2048
P python_functions.jsonl.gz 0.7 3 512"}
echo "[$(date +%H:%M:%S)] generation: ${gen_s}s, $(grep -c . <<< "$sets") processes (none when 0)"
[ "$gen_s" = 0 ] || while read -r name file temp n maxp; do
  python "$here/drafter_pipeline.py" --gguf "$gguf" --data-dir "$data_dir" --phase gen --prompt-file "$file" \
    --max-prompt-tokens "$maxp" --samples-per-prompt "$n" \
    --gen-temperature "$temp" --sampled-prefix "$prefix" --max-new-tokens 512 --gen-batch 768 --gen-kv-gb 16 \
    --gen-seconds "$gen_s" --seed $((seed + 1000 * k)) --work "$work/gen-$name" --out "$work/gen-$name" \
    > "$out/gen-$name.txt" 2>&1 < /dev/null &  # not the sets read below
  k=$((k + 1))
done <<< "$sets"
wait
grep -h "self-distillation:" "$out"/gen-*.txt | grep samples || true
cat $(ls "$work"/gen-*/data.jsonl 2>/dev/null) ${OLD_DATA:-} > "$work/data.jsonl"
echo "[$(date +%H:%M:%S)] data: $(wc -l < "$work/data.jsonl") samples"
