#!/usr/bin/env bash
# Issue 7 on the H200, after the gpu-kit install: `ddtree soak` against the bundled pair, a
# DDTree server and a no-spec server side by side on the one GPU (40% of its memory each).
#   bash benchmarks/h200_soak.sh SECONDS    # results (soak.json, soak.png, server logs) -> $OUT
set -uo pipefail
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
timeout $(( ${1:-600} + 200 )) python3 -m ddtree.cli soak --duration "${1:-600}" --clients 32 \
  --max-tokens 512 --max-num-seqs 32 --compare --out /tmp/soak -- --gpu-memory-utilization 0.4 \
  > "$OUT/soak.txt" 2>&1
echo "soak exit: $?" >> "$OUT/soak.txt"
tar czf "$OUT/soak.tgz" -C /tmp/soak .
tail -5 "$OUT/soak.txt"
