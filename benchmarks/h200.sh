#!/usr/bin/env bash
# Every GPU run of the project on one H200, after the gpu-kit install (README "GPU runs").
#   bash benchmarks/h200.sh check    # all GPU tests beside the greedy equality suite (9-17.5
#                                    # min in turn on H100s, 2026-12-06: detach it)
#   bash benchmarks/h200.sh accuracy # the V2 soak (DDTree, chain vs no-spec), check and numerics
#                                    # side by side (~14 min: detach it; ACCURACY_CHECK=0: no check,
#                                    # ACCURACY_NUMERICS=0: no numerics)
#   bash benchmarks/h200.sh soak     # the soak alone (SOAK_RUNS, default "soak dflash soakfixed soakflash tritonattn";
#                                    # SOAK_SECONDS, 600; ~12 min: detach it)
#   bash benchmarks/h200.sh numerics # bf16 error: attention kernels; the whole model per token
#                                    # (DDTree at NUM_BUDGETS, default 15,63,255),
#                                    # no-spec vs chain vs DDTree vs float32 (~9 min: detach)
#   bash benchmarks/h200.sh smoke    # a few equality engines, no GPU tests (~4 min)
#   bash benchmarks/h200.sh quick    # every GPU test beside 12 equality cases (incl. flash; ~8 min)
#   bash benchmarks/h200.sh bench    # ddtree bench: bundled pair, then Qwen3-8B shapes (~20 min:
#                                    # 3 repeats per point since a171101; detach it)
#   bash benchmarks/h200.sh profile  # kernels per step, DDTree and the chain (~4 min;
#                                    # PROFILE_RUNS="15:16 0:16" budget:concurrency pairs,
#                                    # PROFILE_HOST=1 adds a cProfile of the host per run;
#                                    # PROFILE_WAVES=4: 4 x c requests of mixed lengths, so
#                                    # that prefills land among decodes, as in the bench;
#                                    # PROFILE_PLAIN=1: no profilers, ms per step by kind;
#                                    # PROFILE_8B=1: Qwen3-8B shapes, dummy weights)
#   bash benchmarks/h200.sh longctx  # 8B shapes, 4000-token prompts: chain vs DDTree B=63 (its
#                                    # default shares), then DDTree per LONGCTX_RUNS (~4 min
#                                    # a run; default "splits1": one share; "flash": the
#                                    # flash context; "splits4": 4 shares)
#   bash benchmarks/h200.sh attntime # the paged tree attention kernel per launch shape, 8B
#                                    # shapes, CUDA graphs (~3 min): its fastest settings
#   bash benchmarks/h200.sh gdn      # tree GDN kernel and whole layer vs the chain, 27B (~4 min)
#   bash benchmarks/h200.sh tree     # fused tree kernels: GPU tests + timings vs torch (~5-8 min:
#                                    # the tests compile ~100 kernel variants on a cold cache)
#   bash benchmarks/h200.sh chain15  # chain vs DDTree B=15 acceptance, bf16 + float32 (~3 min)
#   TREE_RUNS="default/default/1 32/8/0" bash benchmarks/h200.sh treetime  # tree timings only
#                                    # (~1 min per run; tree kernel warps / top-k kernel warps /
#                                    # PDL; default: PDL on, off; TREE_AB=x.patch: each run
#                                    # also with that patch applied, an A/B in turns)
#   bash benchmarks/h200.sh bench27b # Qwen3.6-27B shapes: ar, mtp, dflash, ddtree-15, ddtree-63, one
#                                    # engine per run (BENCH27B_METHODS)
#                                    # (~56 GB weights per engine; ~15 min: detach it)
#   bash benchmarks/h200.sh newtests # GPU tests of the V2 GDN glue and V2 penalties (~1 min)
#   bash benchmarks/h200.sh pair     # ddtree bench: bundled pair only, chain vs DDTree (~8 min)
#   bash benchmarks/h200.sh sched    # fixed budgets vs schedules + "auto", with step periods by
#                                    # kind (--step-log) (~12 min: detach;
#                                    # SCHED_TEMPS=0 SCHED_REPEATS=2: ~7 min; SCHED_BUDGETS,
#                                    # SCHED_SCHEDULES: fewer engines; SCHED_CAPTURE=2048: every
#                                    # engine's CUDA graphs up to 2048 tokens, not vLLM's 512;
#                                    # SCHED_METHODS=dflash: no fixed budgets, only the chain,
#                                    # the schedules and "auto")
#   bash benchmarks/h200.sh json     # structured output (JSON schema): chain vs DDTree (~5 min)
#   bash benchmarks/h200.sh trainhybrid # train a hybrid pair into HYBRID_PAIR (/tmp/hyb8; ~10 min?)
#   bash benchmarks/h200.sh hybridpair # a hybrid pair (HYBRID_PAIR; models/hybrid, else /tmp/hyb8): chain
#                                    # vs DDTree B=15, 63 and "auto" (~6 min)
#   bash benchmarks/h200.sh bench8b  # Qwen3-8B shapes: chain vs DDTree B=15, 63, "auto", c=1 and 8,
#                                    # step periods by kind (~8 min?: 3 engines of 16 GB)
#   bash benchmarks/h200.sh b15      # ddtree bench: chain vs DDTree B=15, 63 at c=1, 16, T=0, with
#                                    # each engine's step period by kind (--step-log) (~4 min)
#   EQ_CASES=a,b bash benchmarks/h200.sh eq  # those equality cases only (~2-4 min)
#   bash benchmarks/h200.sh detach check gdn sched  # run modes one after another in a new
#                                    # process session (outlives the call), results in /tmp/res
#   bash benchmarks/h200.sh collect 580  # wait up to 580 s for them; one <mode>.tgz each to $OUT
# Results go to $OUT (the device tool brings them back).
set -uo pipefail
export PYTHONPATH=/root/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed "s/^NVIDIA //")  # titles: the card it ran on

gpu_tests() {
  timeout "$1" python3 -m pytest -q -p no:cacheprovider -m gpu tests > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
}
equality() {  # $1: seconds, $2: cases (default: all)
  rm -f /tmp/eq/summary.json
  timeout "$1" python3 benchmarks/vllm_gpu_equality.py --out /tmp/eq ${2:+--cases "$2"} \
    > "$OUT/equality.txt" 2>&1
  [ -f /tmp/eq/summary.json ] || {  # cut off: compare the cases that finished
    echo "equality: cut off after $1 s; the finished cases:" | tee -a "$OUT/equality.txt"
    python3 benchmarks/vllm_gpu_equality.py --out /tmp/eq --summarize >> "$OUT/equality.txt" 2>&1
  }
  cp /tmp/eq/summary.json "$OUT/equality_summary.json" 2>/dev/null
  tar czf "$OUT/equality.tgz" -C /tmp/eq --exclude=random_target --exclude=random_drafter --exclude=hybrid .
  cut -c1-400 "$OUT/equality.txt" | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -20
}
copy_tree() {  # $1: a fresh copy of the working tree there (no kit, no .git)
  rm -rf "$1" && mkdir -p "$1" && tar c --exclude=./.gpukit --exclude=./.git . | tar x -C "$1"
}
numerics() {  # bf16 error of the tree kernel vs FlashAttention (decode, chain verify)
  timeout 150 python3 benchmarks/attention_numerics.py --out "$OUT/attention_numerics.json" \
    > "$OUT/attention_numerics.txt" 2>&1
  tail -8 "$OUT/attention_numerics.txt"
}
case "$1" in
smoke)
  equality 400 pair_nospec,pair_dflash,pair_ddtree_64,pair_ddtree_1023,pair_ddtreetorch_64,pair_ddtreesched_255,pair_ddtreeauto_255,pair_ddtreedefault_255,pairopts_nospec,pairopts_ddtree_64,pairpen_nospec,pairpen_ddtree_64,pairjson_nospec,pairjson_ddtree_64,random_nospec,random_ddtree_15,hybrid_nospec,hybrid_dflash,hybrid_ddtree_15,hybrid_ddtreesched_30,hybrid_ddtreeauto_30
  ;;
check)
  # The GPU tests (kernels: mostly GPU work, 2.5-4.5 min) run beside the equality suite's
  # engine start-ups (mostly host work): the check took 9-17.5 min with them in turn.
  gpu_tests 720 > "$OUT/gpu_tests_tail.txt" &
  numerics
  equality 900  # 36 engines, at most 12 starting at once
  wait
  cat "$OUT/gpu_tests_tail.txt"
  ;;
quick)  # what fits a short lease: every GPU test beside the smoke cases and the flash context's
  # equality cases (not the whole suite: `check` is still due before resolving CUDA changes)
  gpu_tests 600 > "$OUT/gpu_tests_tail.txt" &
  equality 560 pair_nospec,pair_dflash,pair_ddtree_15,pair_ddtree_64,pair_ddtree_255,pair_ddtreeflash_64,pair_ddtreeflash_255,pair_ddtreesplit_255,pair_ddtreedefault_255,pair_ddtreesync_64,pairpen_nospec,pairpen_ddtree_64
  wait
  cat "$OUT/gpu_tests_tail.txt"
  ;;
accuracy)  # issue 19's correctness runs side by side (no timings among them, ~14 min): the
  # soak on the V2 runner (the `soak` mode's runs, SOAK_RUNS; SOAK_SECONDS, 600), started first
  # so that its servers claim their memory before the check's engines start, then the check
  # and the per-token logit numerics (on an 80 GB card: 10 soak servers of 1 GiB KV each — 32
  # requests of <= ~600 tokens need ~70 MiB — the check's <= 12 engines of 1 GiB, the
  # numerics' engines)
  mkdir -p "$OUT/soak" "$OUT/check" "$OUT/numerics"
  OUT=$OUT/soak SOAK_KV=${SOAK_KV:-1G} bash benchmarks/h200.sh soak > "$OUT/soak.log" 2>&1 &
  sleep 90
  # ACCURACY_NUMERICS=0: no numerics (measured already at the same CUDA path)
  [ "${ACCURACY_NUMERICS:-1}" = 1 ] && { OUT=$OUT/numerics bash benchmarks/h200.sh numerics > "$OUT/numerics.log" 2>&1 & }
  # ACCURACY_CHECK=0: no check beside them (when the tree under test was checked already)
  # ACCURACY_CHECK=quick: the `quick` mode in its place
  case "${ACCURACY_CHECK:-1}" in
  1) OUT=$OUT/check bash benchmarks/h200.sh check > "$OUT/check.log" 2>&1 ;;
  quick) OUT=$OUT/check bash benchmarks/h200.sh quick > "$OUT/check.log" 2>&1 ;;
  esac
  wait
  tail -n 8 "$OUT/check.log" "$OUT/numerics.log" "$OUT/soak.log"
  ;;
soak)  # the soak alone: DDTree's default ("auto" up to B=64), vLLM's chain, DDTree B=64 fixed,
  # the same with DDTREE_TREE_ATTENTION=flash and a no-spec server on TRITON_ATTN, each against
  # a no-spec server on the default backend, side by side (2 GiB KV each)
  SOAK_RUNS="${SOAK_RUNS:-soak dflash soakfixed soakflash tritonattn}" SOAK_KV=${SOAK_KV:-2G} bash benchmarks/h200_soak.sh \
    "${SOAK_SECONDS:-600}"
  ;;
numerics)  # + the whole model's bf16 logprob error per token, teacher-forced (~8 min)
  numerics
  timeout 700 python3 benchmarks/logit_numerics.py --budgets "${NUM_BUDGETS:-15,63,255}" \
    --out "$OUT/logit_numerics.json" --plot "$OUT/logit_numerics.png" > "$OUT/logit_numerics.txt" 2>&1
  tail -8 "$OUT/logit_numerics.txt"
  ;;
eq)
  equality 400 "${EQ_CASES:?EQ_CASES: comma-separated cases of benchmarks/vllm_gpu_equality.py}"
  ;;
bench)
  timeout 700 python3 -m ddtree.cli bench --methods ar,dflash,ddtree --budgets 15,63,255 \
    --concurrency 1,4,16,32 --temperatures 0,1 --max-tokens 128 \
    --title "bundled pair, $GPU" --out /tmp/bench_pair > "$OUT/bench_pair.txt" 2>&1
  tar czf "$OUT/bench_pair.tgz" -C /tmp/bench_pair --exclude=models .
  tail -30 "$OUT/bench_pair.txt"
  timeout 700 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b --methods ar,dflash,ddtree \
    --budgets 15,63,255 --concurrency 1,8 --temperatures 0 --max-tokens 64 --kv-cache-gib 2 \
    --title "Qwen3-8B shapes (dummy weights), $GPU" --out /tmp/bench_8b > "$OUT/bench_8b.txt" 2>&1
  tar czf "$OUT/bench_8b.tgz" -C /tmp/bench_8b --exclude=models .
  tail -20 "$OUT/bench_8b.txt"
  ;;
profile)  # torch.profiler over in-process engines (kernels per step): DDTree beside the chain
  mkdir -p "$OUT/profile"
  for run in ${PROFILE_RUNS:-63:16 0:16 255:1 0:1}; do  # budget:concurrency, budget 0: chain
    timeout 150 python3 benchmarks/profile_step.py --budget "${run%:*}" --concurrency "${run#*:}" \
      ${PROFILE_HOST:+--host} ${PROFILE_PLAIN:+--plain-only} ${PROFILE_8B:+--dummy-shapes} \
      --waves "${PROFILE_WAVES:-1}" \
      --out "$OUT/profile" 2>&1 | grep -A12 "steps,\|step split"
  done
  ;;
attntime)  # the paged tree attention kernel per launch shape (rows per program, key block,
  # warps, stages, context splits) at Qwen3-8B shapes, from CUDA graphs (~3 min; ATTN_FLAGS:
  # other grids, e.g. "--num-stages 1,2,3 --context-splits 1")
  timeout 480 python3 benchmarks/paged_tree_time.py --out "$OUT/paged_tree_time.json" \
    ${ATTN_FLAGS:-} > "$OUT/paged_tree_time.txt" 2>&1
  tail -18 "$OUT/paged_tree_time.txt"
  ;;
gdn)  # tree GDN kernel vs vLLM's chain kernel, Qwen3.6-27B GDN shapes (issue 21)
  timeout 420 python3 benchmarks/gdn_tree.py --out "$OUT/gdn_tree.json" > "$OUT/gdn_tree.txt" 2>&1
  tail -16 "$OUT/gdn_tree.txt"
  ;;
tree)
  timeout 420 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=300 \
    tests/test_gpu_kernels.py > "$OUT/kernels.txt" 2>&1  # a hang dumps its stack
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/kernels.txt" | tail -12
  timeout 200 python3 benchmarks/tree.py --device cuda --impl "${TREE_IMPL:-both}" --vocabs 151936 \
    --batches 1,32 --budgets 255,1024 --out "$OUT/tree_h200.json" > "$OUT/tree.txt" 2>&1
  tail -30 "$OUT/tree.txt"
  ;;
chain15)  # vLLM's chain vs DDTree B=15 (the same chain as a tree): acceptance, bf16 and float32
  for dtype in ${CHAIN15_DTYPES:-bfloat16 float32}; do
    timeout 300 python3 benchmarks/chain_vs_tree15.py --dtype $dtype --prompts 8 \
      --out "$OUT/chain15_$dtype.json" > "$OUT/chain15_$dtype.txt" 2>&1
    echo "$dtype"; grep -E "^dflash|^ddtree15|same outputs" "$OUT/chain15_$dtype.txt" | cut -c1-400
  done
  ;;
treetime)  # fused tree kernels' timings only, one run per TREE_RUNS entry
  # WARPS/SELECT/PDL: the tree kernel's warps and the top-k kernel's ("default" or a count),
  # programmatic dependent launch between the kernels (1, 0). TREE_AB=a.patch: each run
  # also on a copy of the tree with that patch applied (tree_<run>_ab.*), in turns.
  trees=.
  if [ -n "${TREE_AB:-}" ]; then
    copy_tree /tmp/ab
    patch -d /tmp/ab -p1 < "$TREE_AB" > "$OUT/tree_ab_patch.txt" 2>&1 || { cat "$OUT/tree_ab_patch.txt"; exit 1; }
    cp "$TREE_AB" "$OUT/"
    trees=". /tmp/ab"
  fi
  for run in ${TREE_RUNS:-default/default/1 default/default/0}; do
    IFS=/ read -r warps select pdl <<< "$run"
    flags=
    [ "$select" != default ] && flags="--select-warps $select"
    [ "$warps" != default ] && flags="$flags --tree-warps $warps"
    for tree in $trees; do
      name=w${warps}_s$select$([ "$pdl" = 1 ] && echo _pdl)$([ "$tree" != . ] && echo _ab)
      (cd "$tree" && PYTHONPATH=/root/site:$PWD DDTREE_PDL=$pdl timeout 200 python3 \
        benchmarks/tree.py --device cuda --impl fused --vocabs 151936 --batches 1,32 \
        --budgets 255,1024 --no-reference $flags --out "$OUT/tree_$name.json") \
        > "$OUT/tree_$name.txt" 2>&1
      echo "tree warps $warps, select warps $select, pdl $pdl, tree $tree"; tail -6 "$OUT/tree_$name.txt"
    done
  done
  ;;
bench27b)  # Qwen3.6-27B shapes, dummy weights: no-spec, its MTP layer, the DFlash chain, DDTree
  # (issue 21). ~56 GB of weights per engine, and a bench starts its engines together: one
  # engine per bench run (ddtree-B: one budget), one run after another.
  for run in ${BENCH27B_METHODS:-ar mtp dflash ddtree-15 ddtree-63}; do
    case $run in
    ddtree-*) method=ddtree; budget=${run#ddtree-} ;;
    ddtree) echo "BENCH27B_METHODS: name DDTree's budget, e.g. ddtree-63" >&2; continue ;;
    *) method=$run; budget=15 ;;  # --budgets is DDTree's only
    esac
    timeout 900 python3 -m ddtree.cli bench --dummy-shapes qwen3.6-27b --methods "$method" \
      --budgets "$budget" --concurrency 1,8 --temperatures 0 --max-tokens 64 --kv-cache-gib 8 \
      --repeats 1 --title "Qwen3.6-27B shapes (dummy weights), $run, $GPU" \
      --out "/tmp/bench_27b/$run" > "$OUT/bench_27b_$run.txt" 2>&1
    tail -12 "$OUT/bench_27b_$run.txt"
  done
  tar czf "$OUT/bench_27b.tgz" -C /tmp/bench_27b --exclude=models .
  ;;
newtests)  # the GPU tests of this session's pieces: V2 GDN glue + graph, penalties vs vLLM
  timeout 400 python3 -m pytest -v -p no:cacheprovider -o faulthandler_timeout=300 \
    tests/test_gpu_gdn.py tests/test_gpu_penalties.py > "$OUT/newtests.txt" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/newtests.txt" | tail -12
  ;;
pair)
  timeout 700 python3 -m ddtree.cli bench --methods dflash,ddtree --budgets 15,63,255 \
    --concurrency 1,16,32 --temperatures 0,1 --max-tokens 128 \
    --title "bundled pair, $GPU" --out /tmp/bench_pair > "$OUT/bench_pair.txt" 2>&1
  tar czf "$OUT/bench_pair.tgz" -C /tmp/bench_pair --exclude=models .
  tail -30 "$OUT/bench_pair.txt"
  ;;
b15)  # the chain vs DDTree at the chain's size (B=15) and B=63, c=1 and 16, T=0 (issue 19)
  timeout 500 python3 -m ddtree.cli bench --methods dflash,ddtree --budgets 15,63 \
    --concurrency 1,16 --temperatures 0 --max-tokens 128 --step-log 20 \
    --title "bundled pair, $GPU" --out /tmp/bench_b15 > "$OUT/bench_b15.txt" 2>&1
  tar czf "$OUT/bench_b15.tgz" -C /tmp/bench_b15 --exclude=models .
  tail -24 "$OUT/bench_b15.txt"
  ;;
bench8b)  # Qwen3-8B shapes (dummy weights): the chain vs DDTree B=15, 63 and "auto", c=1 and 8,
  # with step periods by kind: issue 19's step targets (B=63 at c=1 <= 1.10x the chain's step)
  timeout 900 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b --methods dflash,ddtree \
    --budgets "${BENCH8B_BUDGETS:-15,63}" --ddtree-auto 255 --concurrency 1,8 --temperatures 0 \
    --max-tokens 64 --kv-cache-gib 2 --repeats "${BENCH8B_REPEATS:-2}" --step-log 20 \
    --title "Qwen3-8B shapes (dummy weights), $GPU" --out /tmp/bench_8b > "$OUT/bench_8b.txt" 2>&1
  tar czf "$OUT/bench_8b.tgz" -C /tmp/bench_8b --exclude=models .
  tail -30 "$OUT/bench_8b.txt"
  ;;
longctx)  # Qwen3-8B shapes (dummy weights), prompts of LONGCTX_LEN (4000) tokens, c=1 and 8: the
  # chain vs DDTree B=63 on its defaults, then DDTree B=63 once per LONGCTX_RUNS entry (a bench
  # each: the settings are per process; ~4 min a bench: detach it)
  for run in default ${LONGCTX_RUNS-splits1}; do
    methods=ddtree; env=()
    case $run in
      default) methods=dflash,ddtree ;;
      splits*) env=(DDTREE_CONTEXT_SPLITS=${run#splits}) ;;
      flash) env=(DDTREE_TREE_ATTENTION=flash DDTREE_CONTEXT_SPLITS=1) ;;
      *) echo "LONGCTX_RUNS: default, splitsN or flash, not $run" >&2; continue ;;
    esac
    env "${env[@]}" timeout 600 python3 -m ddtree.cli bench --dummy-shapes qwen3-8b \
      --methods $methods --budgets 63 --concurrency 1,8 --temperatures 0 \
      --input-len "${LONGCTX_LEN:-4000}" --max-model-len 8192 --max-tokens 64 --kv-cache-gib 8 \
      --repeats 1 --step-log 20 --title "Qwen3-8B shapes, ${LONGCTX_LEN:-4000}-token prompts, $GPU, $run" \
      --out /tmp/bench_long_$run > "$OUT/bench_long_$run.txt" 2>&1
    tar czf "$OUT/bench_long_$run.tgz" -C /tmp/bench_long_$run --exclude=models .
    tail -12 "$OUT/bench_long_$run.txt"
  done
  ;;
hybrid)  # the tests' tiny hybrid pair (Qwen3.5 layout, 32 words, distilled drafter): the chain
  # vs DDTree through vLLM (issue 21; B <= 30: vLLM's warm-up ids must fit the vocabulary)
  timeout 300 python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \
from models import make_hybrid_pair; make_hybrid_pair(Path('/tmp/hybrid'))" > "$OUT/hybrid_pair.txt" 2>&1
  timeout 600 python3 -m ddtree.cli bench --target /tmp/hybrid/target --draft /tmp/hybrid/drafter \
    --random-prompts --methods dflash,ddtree --budgets 15,30 --concurrency 1,16 --temperatures "${HYBRID_TEMPS:-0,1}" \
    --max-tokens 128 --max-model-len 512 --step-log 20 --title "tests' hybrid pair, $GPU" --out /tmp/bench_hybrid \
    > "$OUT/bench_hybrid.txt" 2>&1
  tar czf "$OUT/bench_hybrid.tgz" -C /tmp/bench_hybrid --exclude=models .
  tail -20 "$OUT/bench_hybrid.txt"
  ;;
trainhybrid)  # a hybrid pair (Qwen3.5 layout, 8 layers: 6 GDN + 2 attention) trained here, into
  # HYBRID_PAIR (default /tmp/hyb8), the bundled tokenizer; then `hybridpair` benches it
  P=${HYBRID_PAIR:-/tmp/hyb8}; mkdir -p "$P/tokenizer" "$OUT/trainhybrid"
  cp models/target/tokenizer.json models/target/tokenizer_config.json models/target/chat_template.jinja "$P/tokenizer/"
  timeout 1500 python3 -m ddtree.cli train target --arch qwen3_5 --target-layers 8 --out "$P" \
    ${TRAIN_FLAGS:-} > "$OUT/trainhybrid/target.txt" 2>&1
  timeout 1500 python3 -m ddtree.cli train drafter --arch qwen3_5 --distill-tokens 3000000 \
    --greedy-fraction 0.75 --drafter-steps 20000 --time-limit "${DRAFTER_SECONDS:-330}" --out "$P" \
    ${TRAIN_FLAGS:-} > "$OUT/trainhybrid/drafter.txt" 2>&1
  cp "$P/target/training_log.json" "$OUT/trainhybrid/target_training_log.json"
  cp "$P/drafter/training_log.json" "$OUT/trainhybrid/drafter_training_log.json"
  # The pair itself comes back too, in parts under the device tool's 16 MiB per file (`collect`
  # copies /tmp/res/*.part-* to $OUT): cat hybrid_pair.tar.part-* | tar x -C models/hybrid
  tar cf /tmp/hybrid_pair.tar -C "$P" target drafter && \
    split -b 15M -d /tmp/hybrid_pair.tar /tmp/res/hybrid_pair.tar.part-
  tail -c 300 "$OUT/trainhybrid/drafter.txt"; ls -la "$P/target" "$P/drafter"
  ;;
hybridpair)  # a trained hybrid pair (HYBRID_PAIR; default models/hybrid when bundled, else
  # trainhybrid's /tmp/hyb8): chain vs DDTree
  P=${HYBRID_PAIR:-$([ -d models/hybrid ] && echo models/hybrid || echo /tmp/hyb8)}
  timeout 600 python3 -m ddtree.cli bench --target "$P/target" --draft "$P/drafter" \
    --methods dflash,ddtree --budgets 15,63 --ddtree-auto 63 --concurrency 1,16 \
    --temperatures "${HYBRID_TEMPS:-0,1}" --max-tokens 128 --step-log 20 \
    --title "hybrid pair $P, $GPU" --out /tmp/bench_hybridpair \
    > "$OUT/bench_hybridpair.txt" 2>&1
  tar czf "$OUT/bench_hybridpair.tgz" -C /tmp/bench_hybridpair --exclude=models .
  tail -30 "$OUT/bench_hybridpair.txt"
  ;;
json)  # structured output (a JSON schema per request): the chain vs DDTree (issue 22)
  timeout 600 python3 -m ddtree.cli bench --methods dflash,ddtree --budgets 15,63 \
    --structured-output json --concurrency 1,16 --temperatures 0 --repeats 2 --max-tokens 128 \
    --title "bundled pair, JSON schema requests, $GPU" --out /tmp/bench_json > "$OUT/bench_json.txt" 2>&1
  tar czf "$OUT/bench_json.tgz" -C /tmp/bench_json --exclude=models .
  tail -20 "$OUT/bench_json.txt"
  ;;
sched)  # fixed budgets and budgets per batch size, in turns, 3 repeats per point
  timeout 900 python3 -m ddtree.cli bench --methods "${SCHED_METHODS:-dflash,ddtree}" --budgets "${SCHED_BUDGETS:-15,63,255}" \
    --ddtree-acceptance 50 --ddtree-auto 255 \
    --ddtree-schedules "${SCHED_SCHEDULES:-[[[1, 4, 255], [5, 512, 15]], [[1, 2, 255], [3, 8, 63], [9, 512, 15]]]}" \
    --concurrency 1,4,16,32 --temperatures "${SCHED_TEMPS:-0,1}" --repeats "${SCHED_REPEATS:-3}" \
    --max-tokens 128 --step-log 20 ${SCHED_CAPTURE:+--max-cudagraph-capture-size $SCHED_CAPTURE} \
    --title "bundled pair, $GPU: budgets per batch size" --out /tmp/bench_sched \
    > "$OUT/bench_sched.txt" 2>&1
  tar czf "$OUT/bench_sched.tgz" -C /tmp/bench_sched --exclude=models .
  tail -30 "$OUT/bench_sched.txt"
  ;;
detach)
  shift
  mkdir -p /tmp/res && rm -f /tmp/res/done
  # From a copy of the tree: the device tool re-copies the working tree at every call, and
  # a process importing ddtree at that moment fails (seen: pair_ddtree_1023, 2026-12-05).
  copy_tree /tmp/wt
  cd /tmp/wt
  setsid nohup bash -c 'for m; do echo "$(date +%T) start $m" >> /tmp/res/times;
    OUT=/tmp/res/$m bash benchmarks/h200.sh $m > /tmp/res/$m.log 2>&1;
    echo "$(date +%T) end $m" >> /tmp/res/times; touch /tmp/res/$m.done; done;
    touch /tmp/res/done' _ "$@" > /dev/null 2>&1 < /dev/null &
  echo "detached: $*"
  ;;
collect)
  end=$((SECONDS + ${2:-580}))
  while [ ! -f /tmp/res/done ] && [ $SECONDS -lt $end ]; do sleep 5; done
  for d in /tmp/res/*/; do
    m=$(basename "$d")
    if [ ! -f "/tmp/res/$m.done" ]; then  # what it wrote so far comes back too
      tar czf "$OUT/$m.partial.tgz" -C /tmp/res "$m" "$m.log"
      # a bench writes its tables at its end: its engine logs as they stand (rows of a cut
      # run: python benchmarks/bench_partial.py DIR)
      latest=$(ls -dt /tmp/bench_* 2>/dev/null | head -1)
      [ -n "$latest" ] && tar czf "$OUT/$m.bench_partial.tgz" -C /tmp --exclude=models \
        "$(basename "$latest")"
      echo "== $m: running"; tail -5 "/tmp/res/$m.log"; continue
    fi
    tar czf "$OUT/$m.tgz" -C /tmp/res "$m" "$m.log"
    echo "== $m"; tail -25 "/tmp/res/$m.log"
  done
  cp /tmp/res/*.part-* "$OUT/" 2>/dev/null  # trainhybrid's pair
  cp /tmp/res/times "$OUT/times.txt" 2>/dev/null; cat /tmp/res/times 2>/dev/null
  [ -f /tmp/res/done ] && echo "all done" || echo "still running: $(ls /tmp/res)"
  ;;
*)
  echo "usage: bash benchmarks/h200.sh check|accuracy|smoke|numerics|bench|bench8b|pair|b15|hybrid|trainhybrid|hybridpair|sched|json|profile|tree|treetime|chain15|gdn|bench27b|newtests|eq|detach MODES|collect S" >&2
  exit 2
  ;;
esac
ls -la "$OUT"
