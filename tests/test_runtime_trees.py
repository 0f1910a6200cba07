"""The plugin's tree helpers (pure torch): padding a proposal keeps every walk the same."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import ddtree
from ddtree.vllm_plugin.runtime import pad_tree, padding_tree


@given(seed=st.integers(0, 2**16), budget=st.integers(1, 40), extra=st.integers(1, 20))
def test_padded_tree_walks_like_the_tree(seed, budget, extra):
    gen = torch.Generator().manual_seed(seed)
    vocab = 6
    tree = ddtree.build_tree(torch.randn(3, 4, vocab, generator=gen) * 3, budget)
    wide = pad_tree(tree, budget + 1 + extra)
    target = torch.randint(0, vocab, (3, budget + 1 + extra), generator=gen)
    want = ddtree.walk(tree, target[:, : budget + 1])
    got = ddtree.walk(wide, target)
    for name in ("path", "num_accepted", "bonus", "emitted"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(wide.mask[:, : budget + 1, : budget + 1], tree.mask)
    assert wide.mask[:, budget + 1 :].sum() == 3 * extra  # padding sees only itself


def test_padding_tree_accepts_nothing():
    tree = padding_tree(2, 9, 4, torch.device("cpu"))
    acc = ddtree.walk(tree, torch.zeros(2, 9, dtype=torch.long))
    assert acc.num_accepted.tolist() == [0, 0]
    assert acc.emitted[:, 0].tolist() == [0, 0]  # the bonus: the target's token at the root
