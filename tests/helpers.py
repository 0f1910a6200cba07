"""Shared test helpers: random draft logits of several kinds and tree -> path sets."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ddtree.tree import DraftTree

KINDS = ("normal", "ties", "peaked")


def make_logits(kind: str, batch: int, depth: int, vocab: int, seed: int) -> torch.Tensor:
    """``normal``: no ties; ``ties``: few distinct values; ``peaked``: log-probs of exactly 0."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(batch, depth, vocab, generator=gen) * 3
    if kind == "ties":
        return torch.randint(0, 3, (batch, depth, vocab), generator=gen).float()
    if kind == "peaked":
        return torch.randn(batch, depth, vocab, generator=gen) * 80
    raise ValueError(kind)


def tree_paths(tree: DraftTree, row: int) -> dict[tuple[int, ...], float]:
    """Root-to-node token path -> score for every real node of one request."""
    tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
    scores = tree.scores[row].tolist()
    out = {}
    for slot in range(1, len(tokens)):
        if tokens[slot] < 0:
            continue
        path, node = [], slot
        while node > 0:
            path.append(tokens[node])
            node = parents[node]
        out[tuple(reversed(path))] = scores[slot]
    return out


def agreeing_targets(tree: DraftTree, vocab: int, seed: int) -> torch.Tensor:
    """Random target tokens that agree with the tree along one random path per request."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randint(0, vocab, tree.tokens.shape, generator=gen)
    for row in range(tree.tokens.shape[0]):
        real = int(tree.num_nodes[row])
        if real == 0:
            continue
        node = int(torch.randint(1, real + 1, (), generator=gen))
        while node > 0:  # make the target predict this node's token at its parent
            parent = int(tree.parents[row, node])
            target[row, parent] = tree.tokens[row, node]
            node = parent
    return target


def run_side_by_side(commands: list[list[str]], env: dict) -> list[str]:
    """Run ``commands`` as processes side by side; each must exit 0 (else fail with its
    output). Returns their outputs (stdout and stderr together), in order."""
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for cmd in commands
    ]
    outputs = [proc.communicate()[0] for proc in procs]
    for proc, output in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, output[-10000:]
    return outputs


def run_interpreted(script: str, parts: int = 1) -> None:
    """Run ``script`` (a test file whose ``__main__`` does the checks) in a fresh interpreter
    with TRITON_INTERPRET=1: Triton reads it when it is first imported, so it cannot be set
    inside this process. ``parts > 1``: that many processes side by side, each given its part
    (``1 .. parts``) as its argument, ``__main__`` running that share of the checks. Fails with
    the script's output."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    commands = [[sys.executable, script]] if parts == 1 else [
        [sys.executable, script, str(part)] for part in range(1, parts + 1)
    ]  # fmt: skip
    run_side_by_side(commands, env)
