"""The plugin's tree helpers (pure torch): padding a proposal keeps every walk the same."""

import torch
from hypothesis import given
from hypothesis import strategies as st

import ddtree
from ddtree.vllm_plugin.state import pad_tree, padding_tree


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


def test_buckets_are_powers_of_two():
    from ddtree.vllm_plugin.graphs import bucket, buckets

    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 33)] == [1, 2, 4, 4, 8, 8, 16, 64]
    # Start-up (graph capture, cost model) covers every bucket up to max_num_seqs.
    assert buckets(1) == [1] and buckets(3) == [1, 2, 4] and buckets(32) == [1, 2, 4, 8, 16, 32]


def test_proposal_is_the_tree_plus_a_padding_row():
    """The proposer's tree stage (graphed on the GPU, eager here) from padded ranked tokens:
    the rows of the real requests equal build_tree, one padding row follows."""
    from ddtree.tree import draft_topk
    from ddtree.vllm_plugin.v1.propose import proposal as make_proposal

    logits = torch.randn(3, 15, 300, generator=torch.Generator().manual_seed(0)) * 3
    logprobs, token_ids = draft_topk(logits, 40)
    pad = (0, 0, 0, 0, 0, 1)  # 3 requests -> bucket 4
    proposal, drafts = make_proposal(
        torch.nn.functional.pad(logprobs, pad),
        torch.nn.functional.pad(token_ids, pad),
        budget=40,
        chain_seed=True,
    )
    want = ddtree.build_tree(logits, 40, chain_seed=True)
    assert proposal.tokens.shape == (5, 41) and drafts.shape == (4, 40)
    for name in ("tokens", "parents", "depths", "mask", "ancestors"):
        assert torch.equal(getattr(proposal, name)[:3], getattr(want, name)), name
    assert torch.equal(drafts[:3], want.tokens[:, 1:].clamp(min=0))
    assert (proposal.tokens[4] == -1).all() and proposal.mask[4].equal(torch.eye(41, dtype=bool))
