"""Tensor parallel: every rank builds the same tree by construction.

In vLLM's TP the drafter's logits are gathered from vocabulary shards, so every rank holds the
same full logits; ``build_tree`` breaks ties by token id (exactly, no float order), so the trees
and the walk agree on every rank without a broadcast. Two gloo processes, logits with many exact
ties, each rank holding half the vocabulary before the gather.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ddtree

WORLD, BATCH, DEPTH, VOCAB, BUDGET = 2, 3, 6, 64, 40


pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def _rank(rank: int, port: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        gen = torch.Generator().manual_seed(0)
        full = torch.randint(0, 4, (BATCH, DEPTH, VOCAB), generator=gen).float()  # many ties
        shard = full.chunk(WORLD, dim=-1)[rank].contiguous()  # this rank's vocabulary slice
        parts = [torch.empty_like(shard) for _ in range(WORLD)]
        dist.all_gather(parts, shard)
        logits = torch.cat(parts, -1)
        tree = ddtree.build_tree(logits, BUDGET, chain_seed=True)
        target = torch.randint(0, VOCAB, tree.tokens.shape, generator=gen)
        acc = ddtree.walk(tree, target)
        mine = torch.cat([tree.tokens.flatten(), tree.parents.flatten(), acc.emitted.flatten()])
        gathered = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(gathered, mine)
        results[rank] = all(torch.equal(g, gathered[0]) for g in gathered)
    finally:
        dist.destroy_process_group()


def test_ranks_build_identical_trees():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=WORLD, join=True)
    assert dict(results) == {0: True, 1: True}
