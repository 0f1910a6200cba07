#!/usr/bin/env bash
# Issue 7 on the H200, after the gpu-kit install: `ddtree soak` against the bundled pair, a
# DDTree server and a no-spec server side by side on the one GPU (40% of its memory each).
#   bash benchmarks/h200_soak.sh SECONDS          # in this call; results -> $OUT
#   bash benchmarks/h200_soak.sh start SECONDS    # detached (setsid): outlives this call while
#   bash benchmarks/h200_soak.sh wait [LIMIT]     # the machine stays warm; the next call waits
#                                                 # (at most LIMIT s) and copies the results -> $OUT
# Results: soak.txt (the tool's output), soak.tgz (soak.json, soak.png, server logs), gpu.txt.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=/root/soak_run
mkdir -p "$OUT" "$WORK"
soak() {  # SECONDS: the soak itself, then its files into $WORK
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt"
  timeout $(( $1 + 240 )) python3 -m ddtree.cli soak --duration "$1" --clients 32 \
    --max-tokens 512 --max-num-seqs 32 --compare --out /tmp/soak -- --gpu-memory-utilization 0.4 \
    > "$WORK/soak.txt" 2>&1
  echo "soak exit: $?" >> "$WORK/soak.txt"
  tar czf "$WORK/soak.tgz" -C /tmp/soak .
  touch "$WORK/done"
}
collect() { cp "$WORK"/gpu.txt "$WORK"/soak.txt "$WORK"/soak.tgz "$OUT"/ 2>/dev/null; tail -8 "$WORK/soak.txt"; }
case "$1" in
start)
  rm -f "$WORK/done"
  setsid nohup bash "$0" run "${2:-600}" > "$WORK/driver.log" 2>&1 < /dev/null &
  echo "soak started (pid $!)"
  ;;
run) soak "${2:-600}" ;;
wait)
  for _ in $(seq "${2:-560}"); do [ -e "$WORK/done" ] && break; sleep 1; done
  [ -e "$WORK/done" ] || echo "soak not done yet"
  collect
  ;;
*) soak "${1:-600}"; collect ;;
esac
