#!/usr/bin/env bash
# The GPU kit for this project: ../shared/gpu-kit's vLLM 0.26.0 bundle with what our runs never
# load trimmed out, split into parts that fit one device call beside this working tree.
#   usage: bash benchmarks/gpukit.sh [OUT_DIR]     (default .gpukit, git-ignored)
# Result: OUT_DIR/p1..pN and OUT_DIR/s (install.sh + SHA256), used as in the README's "GPU runs".
#
# Why: a call carries the working tree and one part, 64 MiB in all. The tree is ~28 MiB (the
# bundled pair, results) and grows with every run committed; the shared kit's 36 MiB parts left
# 0.3 MiB (2026-12-06). Trimmed here (KIT_TRIM=0 keeps everything):
# - vllm/_moe_C_stable_libtorch.abi3.so: fused-MoE kernels (39 MiB of the 140 MiB bundle,
#   xz-compressed), imported under contextlib.suppress(ImportError) by vLLM's CUDA platform and
#   called only by MoE layers; our targets and drafters are dense (Qwen3, Qwen3.5/3.6 27B).
# - vllm/third_party/fmha_sm100/cutlass: Blackwell attention JIT headers (MiniMax-M3 only).
# The part size is 64 MiB less this tree, less KIT_MARGIN_MIB (default 2) for what a session
# commits before its last kit call; rebuild after the tree grows.
set -euo pipefail
OUT=$(mkdir -p "${1:-.gpukit}" && cd "${1:-.gpukit}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
TRIM=(vllm/_moe_C_stable_libtorch.abi3.so vllm/third_party/fmha_sm100/cutlass)

# What travels with every call: tracked files and untracked ones git does not ignore.
# (A tracked file deleted in the tree does not travel: stat skips it, its failure is no error.)
tree_bytes=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}') || true
tree_mib=$(( (tree_bytes + 1048575) / 1048576 ))
part_mib=$(( 64 - tree_mib - ${KIT_MARGIN_MIB:-2} ))
if [ "$part_mib" -lt 8 ]; then
  echo "gpukit: the working tree is $tree_mib MiB: no room for a kit part in a 64 MiB call" >&2
  exit 1
fi

echo "gpukit: the shared bundle (a few minutes) ..."
PART_MB=1024 bash "$ROOT/../shared/gpu-kit/build.sh" "$W/shared" > "$W/build.log" 2>&1 \
  || { cat "$W/build.log" >&2; exit 1; }
cat "$W"/shared/p*/* > "$W/bundle.tar"
mkdir -p "$W/b" && tar -C "$W/b" -xf "$W/bundle.tar" && rm "$W/bundle.tar"
if [ "${KIT_TRIM:-1}" = 1 ]; then
  echo "gpukit: trimming ${TRIM[*]} ..."
  mkdir -p "$W/vllm" && xz -dc "$W/b/vllm.tar.xz" | tar -C "$W/vllm" -xf -
  for p in "${TRIM[@]}"; do
    [ -e "$W/vllm/$p" ] || { echo "gpukit: $p is not in the bundle (vLLM changed?)" >&2; exit 1; }
    rm -rf "${W:?}/vllm/$p"
  done
  tar -C "$W/vllm" -cf - . | xz -T2 -6 > "$W/b/vllm.tar.xz"
  rm -rf "$W/vllm"
fi
tar -C "$W/b" -cf "$W/bundle.tar" vllm.tar.xz deps.tar.xz
rm -rf "$OUT"/p* "$OUT/s"; mkdir -p "$OUT/s"
( cd "$W" && split -b "${part_mib}M" -d bundle.tar bundle.tar.part- )
i=1; for part in "$W"/bundle.tar.part-*; do mkdir -p "$OUT/p$i"; mv "$part" "$OUT/p$i/"; i=$((i+1)); done
sha256sum "$W/bundle.tar" | cut -c1-64 > "$OUT/s/SHA256"
cp "$W/shared/s/install.sh" "$OUT/s/"
echo "gpukit: $((i - 1)) parts of <= $part_mib MiB (working tree $tree_mib MiB); sha256 $(cat "$OUT/s/SHA256")"
du -sh "$OUT"/p*
