#!/usr/bin/env bash
# Issue 7 on the H200, after the gpu-kit install: `ddtree soak` against the bundled pair, a
# DDTree server and a no-spec server side by side on the one GPU, and at the same time the
# control: the same soak with two no-spec servers (`--budget 0`), which shows how often bf16
# greedy answers differ between two no-spec servers that batch requests differently. Each of the
# four servers gets an 8 GiB KV cache (a share of the memory via --gpu-memory-utilization fails when
# four engines profile at once: each counts the others' memory as used), and
# --gpu-memory-utilization 0.15 (vLLM still checks at start-up that this share of the GPU is free).
# SOAK_SLACK (default 240) s beyond SECONDS is what each soak gets for start-up and draining.
# SOAK_RUNS (default "soak control"; "soak" is DDTree's default, on one GPU "auto" up to B=64):
# also "soakfixed", B=64 at every batch size; "dflash", vLLM's own DFlash chain against no-spec;
# "tritonattn", a no-spec server on TRITON_ATTN against one on vLLM's default (FlashAttention):
# how often a different attention kernel alone parts greedy answers from no-spec; "soakflash",
# DDTree B=64 (fixed) with DDTREE_TREE_ATTENTION=flash (the tree rows' context part by
# FlashAttention).
# SOAK_VLLM_ARGS: more vLLM arguments for every server. SOAK_KV: each server's KV cache (8G;
# the bundled pair needs ~9 MiB per 2,048-token request, so 2G holds ~220 of them).
#   bash benchmarks/h200_soak.sh SECONDS          # in this call; results -> $OUT
#   bash benchmarks/h200_soak.sh start SECONDS    # detached (setsid): outlives this call while
#   bash benchmarks/h200_soak.sh wait [LIMIT]     # the machine stays warm; the next call waits
#                                                 # (at most LIMIT s) and copies the results -> $OUT
# Results per run (soak, control, dflash): RUN.txt (the tool's output), RUN.tgz (soak.json,
# soak.png, server logs); gpu.txt.
set -uo pipefail
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=/root/soak_run
mkdir -p "$OUT" "$WORK"
soak() {  # SECONDS: the SOAK_RUNS soaks side by side, then their files into $WORK
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.txt"
  for run in ${SOAK_RUNS:-soak control}; do
    budget=64; method=ddtree; backend=; mode=
    [ $run = control ] && budget=0
    # soak: the default (on one GPU "auto", budgets up to 64 chosen by throughput); soakfixed
    # and soakflash verify B=64 at every batch size, with the Triton kernel / the flash context
    [ $run = soakfixed ] || [ $run = soakflash ] && mode="--budget-per-batch-size fixed"
    [ $run = dflash ] && method=dflash
    [ $run = tritonattn ] && budget=0 && backend="--attention-backend TRITON_ATTN"
    tree_attention=auto
    [ $run = soakflash ] && tree_attention=flash  # DDTree with the context part by FlashAttention
    ( DDTREE_TREE_ATTENTION=$tree_attention timeout $(( $1 + ${SOAK_SLACK:-240} )) python3 -m ddtree.cli soak --budget $budget \
        --method $method --duration "$1" \
        --clients 32 --max-tokens 512 --max-num-seqs 32 --compare --out /tmp/$run $backend $mode \
        -- --kv-cache-memory-bytes ${SOAK_KV:-8G} --gpu-memory-utilization 0.15 ${SOAK_VLLM_ARGS:-} > "$WORK/$run.txt" 2>&1
      echo "soak exit: $?" >> "$WORK/$run.txt"
      tar czf "$WORK/$run.tgz" -C /tmp/$run . ) &
  done
  wait
  touch "$WORK/done"
}
collect() {
  cp "$WORK"/gpu.txt "$WORK"/*.txt "$WORK"/*.tgz "$OUT"/ 2>/dev/null
  for f in "$WORK"/*.txt; do tail -n 2 "$f"; done
}
case "$1" in
start)
  rm -rf "$WORK/done" /root/soak_src
  cp -r "$PWD" /root/soak_src  # the next call's copy of the tree may replace this one
  cd /root/soak_src
  setsid nohup bash benchmarks/h200_soak.sh run "${2:-600}" > "$WORK/driver.log" 2>&1 < /dev/null &
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
