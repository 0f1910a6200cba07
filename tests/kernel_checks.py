"""Checks of ddtree.kernels against the torch path and ddtree.reference, shared by the CPU
interpreter tests and the GPU tests. Outputs are poisoned before the kernels run and every
element is compared."""

from __future__ import annotations

from unittest import mock

import torch

import ddtree
from ddtree import kernels, reference
from ddtree.tree import LOGPROB_FLOOR, draft_topk, tree_from_ranked

from helpers import tree_paths

TREE_FIELDS = ("tokens", "parents", "depths", "mask", "scores", "ancestors", "num_nodes")
WALK_FIELDS = ("path", "num_accepted", "bonus", "emitted", "accepted")


def clustered_logits(kind: str, batch: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits whose best tokens sit together in id space (the vocabulary stage's hard case):
    ``sorted``: descending by id; ``block``: a hot block of ids over a cold rest."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, depth, vocab, generator=gen)
    if kind == "sorted":
        return noise.sort(-1, descending=True).values * 3
    hot = torch.arange(vocab) < max(1, vocab // 50)
    return noise + 5 * hot


def lse_tolerance(lse: torch.Tensor) -> torch.Tensor:
    """What the fused lse may differ from torch.logsumexp by (float rounding of the sum)."""
    return 1e-5 * lse.abs().clamp(min=1.0)


def poison_(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.fill_(-12345)


def check_vocab(logits: torch.Tensor, k: int) -> None:
    """draft_topk_fused: ids and order exact, log-probs = logit - lse exactly for the kernel's
    lse, which is within ``lse_tolerance`` of torch's."""
    batch, depth, vocab = logits.shape
    ws = kernels.vocab_workspace(batch, depth, vocab, k, logits.device)
    out = (
        torch.empty(batch, depth, k, dtype=torch.float32, device=logits.device),
        torch.empty(batch, depth, k, dtype=torch.long, device=logits.device),
    )
    poison_(*out, ws.lse, ws.buf)
    logprobs, ids = kernels.draft_topk_fused(logits, k, out=out, workspace=ws)
    ref_logprobs, ref_ids = draft_topk(logits, k)
    assert torch.equal(ids, ref_ids)
    ref_lse = torch.logsumexp(logits.float(), -1)
    assert ((ws.lse - ref_lse).abs() <= lse_tolerance(ref_lse)).all()
    values = (logits.float() + 0.0).gather(-1, ids)
    expected = (values - ws.lse[..., None]).clamp(min=LOGPROB_FLOOR)
    assert torch.equal(logprobs, expected)
    assert ((logprobs - ref_logprobs).abs() <= 2 * lse_tolerance(ref_lse)[..., None]).all()


def check_tree(logprobs: torch.Tensor, ids: torch.Tensor, budget: int, chain_seed: bool) -> None:
    """tree_from_ranked_fused equals tree_from_ranked on the same ranked inputs, bit for bit."""
    batch, depth, k = logprobs.shape
    buffers = kernels.tree_buffers(batch, depth, k, budget, logprobs.device, with_vocab_stage=False)
    tree = buffers.tree
    poison_(*(getattr(tree, name) for name in TREE_FIELDS), tree.ancestor_bits)
    poison_(buffers.list_score, buffers.list_parent, buffers.list_rank, buffers.list_slot)
    got = kernels.tree_from_ranked_fused(
        logprobs, ids, budget, chain_seed=chain_seed, buffers=buffers
    )
    ref = tree_from_ranked(logprobs, ids, budget, chain_seed=chain_seed)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(got.ancestor_bits, kernels.pack_ancestor_bits(ref.mask))
    # Without the bool mask (as the V2 engine builds): the same ancestors and bits.
    bare = kernels.tree_buffers(
        batch, depth, k, budget, logprobs.device, with_vocab_stage=False, with_mask=False
    )
    poison_(bare.tree.ancestors, bare.tree.ancestor_bits)
    kernels.tree_from_ranked_fused(logprobs, ids, budget, chain_seed=chain_seed, buffers=bare)
    assert bare.tree.mask is None
    assert torch.equal(bare.tree.ancestors, ref.ancestors)
    assert torch.equal(bare.tree.ancestor_bits, got.ancestor_bits)


def check_build_vs_reference(logits: torch.Tensor, budget: int, chain_seed: bool):
    """build_tree_fused equals the paper's heap (ddtree.reference) fed the kernel's own ranked
    log-probs (whose ids must equal the reference's ranking), and equals the torch tree stage
    on them; returns the tree."""
    batch, depth, vocab = logits.shape
    buffers = kernels.tree_buffers(batch, depth, vocab, budget, logits.device)
    poison_(*(getattr(buffers.tree, name) for name in TREE_FIELDS), buffers.tree.ancestor_bits)
    tree = kernels.build_tree_fused(logits, budget, chain_seed=chain_seed, buffers=buffers)
    ranked = (buffers.logprobs, buffers.token_ids)
    torch_tree = tree_from_ranked(*ranked, budget, chain_seed=chain_seed)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(tree, name), getattr(torch_tree, name)), name
    cpu_logits, lp, ids = logits.cpu(), buffers.logprobs.cpu(), buffers.token_ids.cpu()
    for row in range(batch):
        ref_lp, ref_ids = reference.ranked_logprobs(cpu_logits[row], ids.shape[2])
        assert ref_ids == ids[row].tolist()
        fused_rows = ([[v for v in lp[row, d].numpy()] for d in range(depth)], ref_ids)
        with mock.patch.object(reference, "ranked_logprobs", return_value=fused_rows):
            ref = reference.build_tree_reference(cpu_logits[row], budget, chain_seed=chain_seed)
        n = len(ref.tokens)
        assert tree.tokens[row, :n].tolist() == ref.tokens
        assert tree.parents[row, :n].tolist() == ref.parents
        assert tree.depths[row, :n].tolist() == ref.depths
        assert tree.scores[row, :n].tolist() == ref.scores
        assert tree_paths(tree, row) == ref.paths()
    return tree


def check_walk(tree: ddtree.DraftTree, target: torch.Tensor) -> None:
    """walk_fused equals ddtree.walk and the reference walk."""
    batch, n_slots = tree.tokens.shape
    out = kernels.acceptance_buffers(batch, tree.max_depth, n_slots, target.device)
    poison_(*(getattr(out, name) for name in WALK_FIELDS))
    got = kernels.walk_fused(tree, target, out=out)
    ref = ddtree.walk(tree, target)
    for name in WALK_FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    for row in range(batch):
        path, bonus = reference.walk_reference(
            tree.tokens[row].tolist(), tree.parents[row].tolist(), target[row].tolist()
        )
        assert got.path[row, : len(path)].tolist() == path
        assert int(got.bonus[row]) == bonus


def check_compact_kv(
    layout: str, num_layers: int, num_reqs: int, moves: int, device, gen: torch.Generator
) -> None:
    """compact_kv equals copy_slots applied per layer (moves that overlap within a request)."""
    from ddtree.vllm_plugin.attention.flash import copy_slots

    block, heads, width, blocks = 16, 2, 8, 4 * num_reqs + 2
    caches = []
    for _ in range(num_layers):  # separate allocations, as vLLM's layers may be
        if layout == "flash":  # vLLM 0.26: logical [blocks, heads, block, 2*hd] over NHD memory
            memory = torch.randn(blocks, block, heads, 2 * width, generator=gen)
            caches.append(memory.to(device).permute(0, 2, 1, 3))
        else:  # [2, blocks, block, heads, hd]
            caches.append(torch.randn(2, blocks, block, heads, width, generator=gen).to(device))
    # Per request: the first `moves` slots after a context; the accepted path's slots move down.
    src, dst = [], []
    for r in range(num_reqs):
        context = 64 * r + int(torch.randint(0, 20, (), generator=gen))
        path = sorted(torch.randperm(2 * moves, generator=gen)[:moves].tolist())
        dst.append([context + 1 + j for j in range(moves)])
        src.append([context + 1 + max(p, j) for j, p in enumerate(path)])
    src = torch.tensor(src, device=device)
    dst = torch.tensor(dst, device=device)
    originals = [c.clone() for c in caches]
    expected = [c.clone() for c in caches]
    for c in expected:
        views = [c] if layout == "flash" else [c[part].permute(0, 2, 1, 3) for part in (0, 1)]
        for view in views:
            copy_slots(view, src.flatten(), dst.flatten())
    kernels.compact_kv(kernels.KVLayers(caches), src, dst)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(got, want)
    stacked = torch.stack(originals)  # the layers as one [L, ...] tensor
    kernels.compact_kv(kernels.KVLayers(stacked), src, dst)
    assert torch.equal(stacked, torch.stack(expected))
