#!/usr/bin/env bash
# The H200 runs of issues 5 and 6, after the gpu-kit install (see README "GPU runs").
#   bash benchmarks/h200_issue6.sh check   # CUDA unit tests + greedy equality vs no-spec (~6 min)
#   bash benchmarks/h200_issue6.sh bench   # ddtree bench: bundled pair, then Qwen3-8B shapes (~8 min)
#   bash benchmarks/h200_issue6.sh profile # DDTree's step-time split at Qwen3-8B shapes (~3 min)
#   bash benchmarks/h200_issue6.sh costmodel # Qwen3-8B shapes: the chain under each engine setting
#                                          # (V1/V2, graphs, async), DDTree + start-up cost model (~5 min)
#   bash benchmarks/h200_issue6.sh costmodel-pair  # the same on the bundled pair (~3.5 min)
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
case "$1" in
check)
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_flash_tree.py \
    tests/test_gpu_graphs.py > "$OUT/gpu_tests.txt" 2>&1
  timeout 480 python3 benchmarks/vllm_gpu_equality.py --out /tmp/eq > "$OUT/equality.txt" 2>&1
  cp /tmp/eq/summary.json "$OUT/equality_summary.json"
  tar czf "$OUT/equality.tgz" -C /tmp/eq --exclude=random_target --exclude=random_drafter .
  ;;
bench)
  timeout 240 python3 -m ddtree.cli bench --methods ar,dflash,dflash-v1,ddtree \
    --budgets 16,64,255,511 --concurrency 1,4,16 --temperatures 0,1 --max-tokens 128 \
    --title "bundled pair, H200" --out /tmp/bench_pair > "$OUT/bench_pair.txt" 2>&1
  tar czf "$OUT/bench_pair.tgz" -C /tmp/bench_pair --exclude=models .
  timeout 330 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b --methods ar,dflash,dflash-v1,ddtree \
    --budgets 64,255,511 --concurrency 1,8,32 --temperatures 0 --max-tokens 64 --kv-cache-gib 2 \
    --title "Qwen3-8B shapes (dummy weights), H200" --out /tmp/bench_8b > "$OUT/bench_8b.txt" 2>&1
  tar czf "$OUT/bench_8b.tgz" -C /tmp/bench_8b --exclude=models .
  ;;
profile)  # the step-time split (DDTREE_PROFILE) of DDTree at 8B shapes, the V1 chain beside it
  DDTREE_PROFILE=20 DDTREE_PROFILE_OPS=1 timeout 300 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b \
    --methods dflash-v1,ddtree --budgets 64,255 --concurrency 1,8 --temperatures 0 --max-tokens 64 \
    --kv-cache-gib 2 --title "profile" --out /tmp/prof_8b > "$OUT/prof_8b.txt" 2>&1
  tar czf "$OUT/prof_8b.tgz" -C /tmp/prof_8b --exclude=models .
  grep -h "ddtree-profile" /tmp/prof_8b/*.log | tail -12
  ;;
costmodel)
  timeout 330 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b \
    --methods dflash,dflash-v1-sync,dflash-v1-full,dflash-v2-sync,ddtree \
    --budgets 255,511 --concurrency 1,8,32 --temperatures 0 --max-tokens 64 --kv-cache-gib 2 \
    --ddtree-options '{"ddtree_max_verify_cost": 1.1}' \
    --title "Qwen3-8B shapes (dummy weights), H200: chain settings, DDTree + cost model" \
    --out /tmp/cm_8b > "$OUT/cm_8b.txt" 2>&1
  tar czf "$OUT/cm_8b.tgz" -C /tmp/cm_8b --exclude=models .
  ;;&
costmodel-pair)
  timeout 210 python3 -m ddtree.cli bench --methods dflash,dflash-v1-sync,ddtree \
    --budgets 64,255,511 --concurrency 1,16 --temperatures 0,1 --max-tokens 128 \
    --ddtree-options '{"ddtree_max_verify_cost": 1.1}' \
    --title "bundled pair, H200: DDTree + cost model" --out /tmp/cm_pair > "$OUT/cm_pair.txt" 2>&1
  tar czf "$OUT/cm_pair.tgz" -C /tmp/cm_pair --exclude=models .
  ;;&
costmodel*)
  grep -h "ddtree step budgets" /tmp/cm_*/*.log | cut -c1-600
  ;;
esac
ls -la "$OUT"

