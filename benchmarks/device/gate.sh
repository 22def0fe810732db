#!/usr/bin/env bash
# The per-request acceptance gate on one GPU: benchmarks/acceptance_gate.py with the shipped drafter on
# MT-Bench and HumanEval, T=1 and T=0, one request at a time (16 prompts) and all at once (80), the
# gate off and at 1.5, 2 and 3, each arm beside plain decoding in one process. Everything lands in OUT.
#
#   bash benchmarks/device/gate.sh GGUF DATA_DIR OUT
set -euo pipefail
gguf=$1 data_dir=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
drafter=$root/flashdraft/drafters/smollm2-135m-dflash
mkdir -p "$out"
log() { echo "[$(date +%H:%M:%S)] $*"; }
for set in mt_bench humaneval; do
  for level in all 1; do
    n=80; [ "$level" = 1 ] && n=16
    log "$set, concurrency $level"
    python "$root/benchmarks/acceptance_gate.py" --device cuda --model "$gguf" --draft "$drafter" \
      --dataset "$data_dir/$set.jsonl" --num-prompts $n --max-tokens 256 --temperatures 1,0 \
      --min-tau off,1.5,2,3 --concurrency $level --reps 2 --json "$out/gate_${set}_c$level.json" \
      2>&1 | grep -v Loading | tee "$out/gate_${set}_c$level.txt"
  done
done
log "all measurements done"
