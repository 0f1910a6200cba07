"""The DDTree step in a few fused Triton kernels (GPU): vocabulary top-k, tree build, ancestry,
walk and KV compaction. The torch code (:mod:`ddtree.tree`, :mod:`ddtree.verify`) stays the CPU
path and the reference these kernels are tested against; :class:`FusedUnavailable` is raised
for tensors the kernels cannot take, so that the engine falls back to it."""

from ddtree.kernels.ancestry import pack_ancestor_bits
from ddtree.kernels.build import (
    MAX_FUSED_BUDGET,
    FusedUnavailable,
    TreeBuffers,
    acceptance_buffers,
    build_tree_fused,
    tree_buffers,
    tree_from_ranked_fused,
    walk_fused,
)
from ddtree.kernels.kv_compact import KVLayers, compact_kv
from ddtree.kernels.vocab_topk import VocabWorkspace, draft_topk_fused, vocab_workspace

__all__ = [
    "MAX_FUSED_BUDGET",
    "FusedUnavailable",
    "KVLayers",
    "TreeBuffers",
    "VocabWorkspace",
    "acceptance_buffers",
    "build_tree_fused",
    "compact_kv",
    "draft_topk_fused",
    "pack_ancestor_bits",
    "tree_buffers",
    "tree_from_ranked_fused",
    "vocab_workspace",
    "walk_fused",
]
