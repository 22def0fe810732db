#!/usr/bin/env bash
# Drafts of sampled requests drawn with the target's noise against argmax drafts, on one GPU: the shipped
# drafter evaluated twice at once (drafter_pipeline --phase eval: drawn drafts at T=0 and T=1, argmax
# drafts at T=1; 164 / 80 / 200 prompts x 256 tokens), then both ways interleaved in one process for
# tok/s beside plain decoding (benchmarks/sampled_drafts.py, HumanEval and MT-Bench, c=1 and all at once),
# then the GPU tests. Everything lands in OUT.
#
#   bash benchmarks/device/sampled_drafts.sh GGUF DATA_DIR OUT
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
gguf=$1 data_dir=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
drafter=$root/flashdraft/drafters/smollm2-135m-dflash
pipe="python $here/drafter_pipeline.py --phase eval --gguf $gguf --data-dir $data_dir --drafter $drafter"
mkdir -p "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }
log "evaluation: drawn and argmax drafts at once"
$pipe --eval-temps 0,1 --out "$out/drawn" > "$out/eval_drawn.txt" 2>&1 &
$pipe --eval-temps 1 --argmax-drafts --out "$out/argmax" > "$out/eval_argmax.txt" 2>&1 &
wait
grep -h 'tau' "$out/eval_drawn.txt" "$out/eval_argmax.txt" || true
for set in humaneval mt_bench; do
  log "tok/s: $set"
  python "$root/benchmarks/sampled_drafts.py" --device cuda --model "$gguf" --draft "$drafter" --dataset "$data_dir/$set.jsonl" \
    --num-prompts 32 --max-tokens 256 --concurrency 1,all --reps 2 --json "$out/speed_$set.json" \
    2>&1 | grep -v Loading | tee "$out/speed_$set.txt"
done
log "GPU tests"
(cd "$root" && python -m pytest -q tests/gpu 2>&1 | tail -n 15) | tee "$out/pytest_gpu.txt"
log "all measurements done"
