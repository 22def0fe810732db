#!/usr/bin/env bash
# Which self-distillation text trains the better drafter for greedy (T=0) serving, side by side on
# one GPU: the same start (a saved drafter), the same prompt files and generation seconds, the same
# training seconds, seed and schedule; two arms that differ only in their answers:
#   sampled: whole answers sampled at T (the recipe of runs 10-16)
#   prefix:  the first 0..N tokens sampled at the same T, the rest greedy (--sampled-prefix N), so
#            every trained token is one a greedy verify would meet
# Generation: three processes per arm (ShareGPT conversations, long conversations, Python problems
# x3) at once; training: both arms at once; evaluation: the start and both arms at once (tau at T=0
# and T=1 on HumanEval, MT-Bench, held-out ShareGPT). Everything lands in OUT (logs, eval.json per
# drafter, summary.json, trained drafters split in 15 MB parts).
#
#   GEN_SECONDS=300 TRAIN_SECONDS=840 bash benchmarks/device/data_ablation.sh GGUF DATA_DIR START WORK OUT
set -euo pipefail
# several processes share the GPU: without expandable segments each one's allocator keeps the freed blocks
# of its ragged steps (a generator reserved 79 GB for 17 GB in use) and a neighbour runs out of memory
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 start=$3 work=$4 out=$5
gen_s=${GEN_SECONDS:-300} train_s=${TRAIN_SECONDS:-840} prefix=${PREFIX:-32} lr=${LR:-1e-3} seed=${SEED:-40000}
here=$(cd "$(dirname "$0")" && pwd)
pipe="python $here/drafter_pipeline.py --gguf $gguf --data-dir $data_dir"
arms="sampled prefix"
mkdir -p "$work" "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }

log "generation: ${gen_s}s, six processes"
for arm in $arms; do
  k=0  # the same seeds in both arms: a prefix arm's draw starts with the tokens its sampled twin starts with
  extra=""; [ "$arm" = prefix ] && extra="--sampled-prefix $prefix"
  for set in "S train_conversations.jsonl.gz 0.8 1 512" "L train_conversations_long.jsonl.gz 0.7 1 2048" \
             "P python_functions.jsonl.gz 0.6 3 512"; do
    read -r name file temp n maxp <<< "$set"
    secs=$gen_s; [ "$name" = P ] && secs=$((gen_s * 4 / 5))  # the code problems run out sooner
    $pipe --phase gen --prompt-file "$file" --max-prompt-tokens "$maxp" --samples-per-prompt "$n" \
      --gen-temperature "$temp" $extra --max-new-tokens 512 --gen-batch 768 --gen-kv-gb 16 \
      --gen-seconds "$secs" --seed $((seed + 1000 * k)) --work "$work/gen-$arm-$name" --out "$work/gen-$arm-$name" \
      > "$out/gen-$arm-$name.txt" 2>&1 &
    k=$((k + 1))
  done
done
wait
for arm in $arms; do
  cat "$work"/gen-"$arm"-?/data.jsonl > "$work/$arm.jsonl"
  log "$arm: $(wc -l < "$work/$arm.jsonl") samples"
  grep -h "self-distillation:" "$out"/gen-"$arm"-?.txt || true
done

log "training: ${train_s}s, both arms at once"
for arm in $arms; do
  $pipe --phase train --data "$work/$arm.jsonl" --init-drafter "$start" --labels data --lr "$lr" \
    --batch-size 16 --num-anchors 512 --seed 17 --train-seconds "$train_s" --no-eval \
    --work "$work/train-$arm" --out "$work/train-$arm-out" > "$out/train-$arm.txt" 2>&1 &
done
wait
for arm in $arms; do tail -n 2 "$out/train-$arm.txt"; cp "$work/train-$arm/drafter/train_log.jsonl" "$out/train_log-$arm.jsonl"; done

log "evaluation: the start and both arms at once"
$pipe --phase eval --drafter "$start" --out "$work/eval-start" > "$out/eval-start.txt" 2>&1 &
for arm in $arms; do
  $pipe --phase eval --drafter "$work/train-$arm/drafter" --out "$work/eval-$arm" > "$out/eval-$arm.txt" 2>&1 &
done
wait
for d in start $arms; do cp "$work/eval-$d/eval.json" "$out/eval-$d.json"; done
python - "$out" start $arms <<'EOF'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
rows = {n: {k: round(v["tau"], 3) for k, v in json.load(open(f"{out}/eval-{n}.json"))["eval"].items()} for n in names}
for n, r in rows.items():
    print(n, r)
json.dump(rows, open(f"{out}/summary.json", "w"), indent=1)
EOF
log "done"
