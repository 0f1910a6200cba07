#!/usr/bin/env bash
# Issue 4: retrain the bundled pair's drafter on one H200 with two recipes side by side (the
# bundled target stays), then tau at T=0 (chain, DDTree B=255) on held-out prompts for each.
# Needs only torch + transformers there. Run from the repo root; writes under $OUT:
#   a.tgz / b.tgz (drafter + training_log.json), tau_a.json / tau_b.json, log.txt
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
for v in a b; do mkdir -p /tmp/$v && ln -sfn "$PWD/models/target" /tmp/$v/target \
  && ln -sfn "$PWD/models/target" /tmp/$v/tokenizer; done
common="--distill-tokens 3000000 --distill-cache /tmp/distill.pt --greedy-fraction 0.75"
python3 -m ddtree.cli train drafter --out /tmp/a $common --drafter-layers 3 \
  --drafter-steps 20000 --time-limit 330 > "$OUT/train_a.txt" 2>&1 &
while [ ! -f /tmp/distill.pt ] && kill -0 $! 2>/dev/null; do sleep 2; done
echo "distilled after $(( $(date +%s) - T0 )) s"
python3 -m ddtree.cli train drafter --out /tmp/b $common --drafter-layers 5 \
  --drafter-intermediate-size 1024 --drafter-steps 20000 --time-limit 330 > "$OUT/train_b.txt" 2>&1
wait
echo "trained after $(( $(date +%s) - T0 )) s"
for v in a b; do
  python3 -m ddtree.cli tau --target models/target --draft /tmp/$v/drafter --budgets 255 \
    --temperatures 0 --prompts 10 --out "$OUT/tau_$v.json" 2>&1 | grep -v "it/s\]" &
done
wait
for v in a b; do tar -C /tmp/$v -czf "$OUT/$v.tgz" drafter; done
echo "done after $(( $(date +%s) - T0 )) s"
