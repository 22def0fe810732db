#!/usr/bin/env bash
# Token trees against the drafter's chain on one GPU, in three phases (each fits one command):
#   eval:  the shipped drafter evaluated as a chain and with trees of 7, 15 and 31 drafts, four
#          drafter_pipeline --phase eval processes at once (T=0 and T=1; 164 / 80 / 200 prompts x 256 tokens)
#   speed: tok/s of plain decoding, the chain and trees side by side in one process (benchmarks/tree_arms.py;
#          HumanEval and MT-Bench, 32 prompts x 256 tokens, one at a time and all at once)
#   divergence: where bf16 outputs of the chain and of trees of 7 and 15 part from plain decoding's, one request
#          at a time, and the fp32 logit gap there (bf16_divergence.py; HumanEval and MT-Bench, 16 prompts x 256)
#   tests: pytest tests/gpu
# Everything lands in OUT.
#
#   bash benchmarks/device/tree_eval.sh GGUF DATA_DIR OUT eval|speed|divergence|tests [...]
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 out=$3
shift 3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
drafter=$root/flashdraft/drafters/smollm2-135m-dflash
mkdir -p "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }
for phase in "$@"; do
  case $phase in
    eval)
      log "evaluation: chain, trees of 7, 15 and 31 at once"
      for size in chain 7 15 31; do
        opt=(); [ "$size" = chain ] || opt=(--tree-size "$size")
        python "$here/drafter_pipeline.py" --phase eval --gguf "$gguf" --data-dir "$data_dir" --drafter "$drafter" \
          --eval-temps 0,1 "${opt[@]}" --out "$out/eval_$size" > "$out/eval_$size.txt" 2>&1 &
      done
      wait
      grep -H 'tau' "$out"/eval_*.txt || true ;;
    speed)
      for set in humaneval mt_bench; do
        log "tok/s: $set"
        python "$root/benchmarks/tree_arms.py" --device cuda --model "$gguf" --draft "$drafter" \
          --dataset "$data_dir/$set.jsonl" --num-prompts 32 --max-tokens 256 --tree-sizes 7,15,31 \
          --concurrency 1,all --reps 2 --json "$out/speed_$set.json" 2>&1 | grep -v Loading | tee "$out/speed_$set.txt"
      done ;;
    divergence)
      for set in humaneval mt_bench; do
        log "bf16 divergence: $set"
        python "$here/bf16_divergence.py" --gguf "$gguf" --draft "$drafter" --prompts "$data_dir/$set.jsonl" \
          --num-prompts 16 --tree-sizes 7,15 --out "$out/divergence_$set" 2>&1 | grep -v Loading | tee "$out/divergence_$set.txt"
      done ;;
    tests)
      log "GPU tests"
      (cd "$root" && python -m pytest -q tests/gpu 2>&1 | tail -n 15) | tee "$out/pytest_gpu.txt" ;;
    *) echo "unknown phase $phase (eval, speed, divergence, tests)"; exit 2 ;;
  esac
done
log "phases done: $*"
