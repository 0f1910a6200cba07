"""The V2-runner glue on the CPU, with Triton's interpreter (the V2 runner itself needs CUDA):
which rows verify a tree and their depth positions; the tree sampler's walk, output layout,
counts and KV commit (torch ops and ``ddtree.kernels``); the accepted path moved to the front
for the drafter; the speculator's tree build. A batch of a full tree, a prefill request, a tree
clipped by the scheduler, and a padded row."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

import ddtree

from helpers import run_interpreted

BUDGET, DEPTH, VOCAB, BLOCK = 15, 4, 11, 16


pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def test_v2_glue():
    """Runs this file's checks under Triton's interpreter (``helpers.run_interpreted``)."""
    pytest.importorskip("vllm")
    run_interpreted(__file__)


def _engine(trees, state_rows, kernels: str):
    from ddtree.vllm_plugin.config import DDTreeOptions, Settings
    from ddtree.vllm_plugin.v2.engine import TreeEngine, TreeTables

    tables = TreeTables(8, BUDGET, DEPTH, torch.device("cpu"))
    tables.store(state_rows, trees)
    settings = Settings(cuda_graphs=False, tree_kernels=kernels)
    return TreeEngine(DDTreeOptions(BUDGET), DEPTH, settings, tables)


def check_trees() -> None:
    """The speculator's tree build: ddtree.kernels equals the torch ops."""
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    cls = make_speculator_class(object)
    logits = torch.randn(3, DEPTH, 50, generator=torch.Generator().manual_seed(4)) * 3
    built = {}
    for kernels in ("torch", "fused"):
        engine = _engine(ddtree.build_tree(logits, BUDGET), torch.tensor([0, 1, 2]), kernels)
        speculator = SimpleNamespace(
            engine=engine, _fused_buffers={}, tree_budget=lambda num_reqs: BUDGET
        )
        built[kernels] = cls._build_trees(speculator, logits)
    for name in ("tokens", "parents", "depths", "ancestors"):
        assert torch.equal(getattr(built["torch"], name), getattr(built["fused"], name)), name


def check(kernels: str) -> None:
    from ddtree.vllm_plugin.v2 import kernels
    from ddtree.vllm_plugin.v2.sampler import TreeSampler
    from ddtree.vllm_plugin.v2.speculator import make_speculator_class

    gen = torch.Generator().manual_seed(0)
    trees = ddtree.build_tree(torch.randn(2, DEPTH, VOCAB, generator=gen) * 2, BUDGET)
    state_rows = torch.tensor([5, 2])  # request-state rows of the two tree requests
    engine = _engine(trees, state_rows, kernels)
    q = BUDGET + 1
    # Batch: tree (state 5, all slots), prefill (state 0, 6 tokens), tree clipped to 7 slots
    # (state 2), and one padded row (full-graph padding).
    counts, contexts = [q, 6, 7], [40, 0, 21]
    num_reqs, padded = 3, 4
    qsl = torch.tensor([0, q, q + 6, q + 13, q + 13], dtype=torch.int32)
    idx_mapping = torch.tensor([5, 0, 2], dtype=torch.int32)
    cu_logits = torch.tensor([0, q, q + 1, q + 8], dtype=torch.int32)  # drafts + bonus
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(contexts, counts, strict=True)])
    positions = torch.cat([positions, torch.full((3,), 99)])  # padded token rows
    sequential = positions.clone()
    tree_rows = engine.tables.tree_rows
    kernels.mark_trees_and_depth_positions(
        tree_rows[:padded], positions, qsl, cu_logits, idx_mapping, engine.tables.depths, num_reqs
    )
    assert tree_rows[:padded].tolist() == [5, -1, 2, -1]
    want = sequential.clone()
    want[:q] = contexts[0] + trees.depths[0]
    want[q + 6 : q + 13] = contexts[2] + trees.depths[1, :7]
    assert positions.tolist() == want.tolist()
    # M-RoPE: every section of a tree row gets its own root + depth (sections differ by the
    # request's M-RoPE delta in real engines; here by 0, 1000, 2000).
    sections = torch.stack([sequential + 1000 * k for k in range(3)])
    kernels.depth_positions(tree_rows[:padded], sections, qsl, engine.tables.depths)
    assert sections.tolist() == [(want + 1000 * k).tolist() for k in range(3)]

    # The target's tokens: agree with one random path of each tree.
    from helpers import agreeing_targets

    targets = agreeing_targets(trees, VOCAB, seed=3)
    logit_target = torch.cat([targets[0], torch.tensor([7]), targets[1, :7]])
    logits = torch.nn.functional.one_hot(logit_target, VOCAB).float()
    fake_sampler = SimpleNamespace(
        sample=lambda logits, *args, **kwargs: (logits.argmax(-1), logits),
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.tensor([6] * 8))),
        returns_logprobs=lambda idx_mapping_np: False,  # path_rows is checked below
    )
    seq_lens = torch.tensor(
        [c + n for c, n in zip(contexts, counts, strict=True)], dtype=torch.int32
    )
    # KV: one layer, FlashAttention's logical view; slot of token row t = 1000 + t.
    num_blocks = 200
    memory = torch.randn(num_blocks, BLOCK, 2, 8, generator=gen)
    kv_cache = memory.permute(0, 2, 1, 3)
    before = kv_cache.clone()
    engine.layers = [(0, kv_cache, SimpleNamespace())]
    slots = (1000 + torch.arange(64)).view(1, 64)
    engine.slot_mappings = slots
    batch = SimpleNamespace(
        logits_indices=torch.arange(int(cu_logits[-1])),
        expanded_idx_mapping=None,
        idx_mapping_np=None,
        positions=positions,
        input_ids=torch.zeros(64, dtype=torch.long),
        expanded_local_pos=None,
        num_reqs=num_reqs,
        cu_num_logits=cu_logits,
        cu_num_logits_np=cu_logits.numpy(),
        seq_lens=seq_lens,
        idx_mapping=idx_mapping,
        query_start_loc=qsl,
    )
    from ddtree.vllm_plugin.tuner import BudgetTuner

    engine.tuner = BudgetTuner(engine.options, torch.device("cpu"), every=1)  # "auto" budgets
    sampler = TreeSampler(engine, fake_sampler, BUDGET)
    out = sampler(logits, batch)

    from ddtree.vllm_plugin.state import gather_tree

    clipped = gather_tree(trees, torch.tensor([1]))
    clipped.tokens = torch.where(torch.arange(q) < 7, clipped.tokens, -1)
    walks = [ddtree.walk(trees, targets)]
    walks.append(ddtree.walk(clipped, torch.where(torch.arange(q) < 7, targets[1:], 0)))
    accepted = [int(walks[0].num_accepted[0]), int(walks[1].num_accepted[0])]
    assert out.num_sampled.tolist() == [accepted[0] + 1, 1, accepted[1] + 1]
    assert out.num_rejected.tolist() == [q - accepted[0] - 1, 0, 7 - accepted[1] - 1]
    assert out.sampled_token_ids.shape == (3, BUDGET + 1)
    assert out.sampled_token_ids[1, 0] == 7  # the prefill's own sample
    for row, acc, start in ((0, walks[0], 0), (2, walks[1], q + 6)):
        n = int(acc.num_accepted[0]) + 1
        emitted = acc.emitted[0 if row == 0 else 0, :n]
        assert out.sampled_token_ids[row, :n].tolist() == emitted.tolist()
        # KV commit: slot 1000 + start + path[k] -> 1000 + start + k.
        path = acc.path[0, :n].tolist()
        for k, node in enumerate(path):
            dst, src = 1000 + start + k, 1000 + start + node
            got = kv_cache[dst // BLOCK, :, dst % BLOCK]
            assert torch.equal(got, before[src // BLOCK, :, src % BLOCK]), (row, k)
    assert accepted[0] >= 1 and engine.walked
    # The tuner's sums of this step (copied by its step() once per sampler call): request 0
    # verified 15 nodes, request 2 six (its clipped tree), the prefill none.
    rows, got = engine.tuner.reader.host.view(4, -1)[:2]
    assert rows.tolist() == [2] * 6 + [1] * 9
    from ddtree.budget import accepted_within

    budgets = torch.arange(1, BUDGET + 1)
    want = accepted_within(walks[0].path, budgets)[0] + accepted_within(walks[1].path, budgets)[0]
    want[6:] -= accepted_within(walks[1].path, budgets)[0, 6:]
    assert got.tolist() == want.tolist()

    # Logprobs as vLLM's rejection sampler lays them out: request r's j-th output at row
    # cu[r] + j, read at its accepted path's j-th node (one-hot logits: the sampled token is
    # the row's argmax there).
    rows, tokens, cu = sampler.path_rows(batch, out.sampled_token_ids)
    assert cu == cu_logits.tolist() and rows.shape == tokens.shape == (int(cu_logits[-1]),)
    for r, n in enumerate(out.num_sampled.tolist()):
        for j in range(n):
            i = int(cu_logits[r]) + j
            assert tokens[i] == out.sampled_token_ids[r, j], (r, j)
            assert logits[rows[i]].argmax() == tokens[i], (r, j)
    path_rows = [int(p) for p in walks[0].path[0, : accepted[0] + 1]]
    assert rows[: accepted[0] + 1].tolist() == path_rows

    # The drafter's view: accepted path first, sequential positions again.
    hidden = torch.arange(64, dtype=torch.float32)[:, None].repeat(1, 3)
    cls = make_speculator_class(object)
    cls._accepted_path_first(SimpleNamespace(engine=engine), batch, [hidden])
    assert positions.tolist() == sequential.tolist()
    for start, acc in ((0, walks[0]), (q + 6, walks[1])):
        n = int(acc.num_accepted[0]) + 1
        assert hidden[start : start + n, 0].tolist() == [start + p for p in acc.path[0, :n]]
    assert hidden[q : q + 6, 0].tolist() == list(range(q, q + 6))  # the prefill untouched


def _penalty_state(states: int, vocab: int, gen) -> SimpleNamespace:
    """A stand-in for vLLM's V2 ``PenaltiesState`` (the fields its kernel reads)."""
    import numpy as np

    def per_request(values):
        return SimpleNamespace(gpu=torch.tensor(values, dtype=torch.float32))

    words = -(-vocab // 32)
    return SimpleNamespace(
        use_penalty=np.ones(states, dtype=bool),
        repetition_penalty=per_request([1.3, 1.0, 0.8] + [1.0] * (states - 3)),
        frequency_penalty=per_request([0.5, 0.0, 0.25] + [0.0] * (states - 3)),
        presence_penalty=per_request([0.0, 0.7, 0.4] + [0.0] * (states - 3)),
        prompt_bin_mask=torch.randint(-(2**31), 2**31 - 1, (states, words), generator=gen).int(),
        output_bin_counts=torch.randint(0, 3, (states, vocab), generator=gen).int()
        * (torch.rand(states, vocab, generator=gen) < 0.2),
    )


def _penalised(state, req: int, logit: torch.Tensor, history: list[int]) -> torch.Tensor:
    """One row with the penalties of request-state ``req`` and its node's ``history``."""
    vocab = logit.shape[0]
    counts = state.output_bin_counts[req].clone()
    for token in history:
        counts[token] += 1
    bits = state.prompt_bin_mask[req].long() & 0xFFFFFFFF
    in_prompt = ((bits[:, None] >> torch.arange(32)) & 1).flatten()[:vocab] != 0
    rep = state.repetition_penalty.gpu[req]
    out = logit.clone()
    if rep != 1.0:
        scale = torch.where(in_prompt | (counts > 0), rep, torch.tensor(1.0))
        out = out * torch.where(out > 0, 1.0 / scale, scale)
    out = out - state.frequency_penalty.gpu[req] * counts
    return out - state.presence_penalty.gpu[req] * (counts > 0)


def check_penalties() -> None:
    """Penalties per tree node: its history is its root path (tokens of the node and its
    ancestors below the root), whichever slots came before it; on a chain that is vLLM's own
    kernel's result (rows: the bonus row and each draft)."""
    from ddtree.vllm_plugin.v2.penalties import apply_tree_penalties

    gen = torch.Generator().manual_seed(7)
    vocab, states = 40, 8
    state = _penalty_state(states, vocab, gen)
    trees = ddtree.build_tree(torch.randn(3, DEPTH, vocab, generator=gen) * 2, BUDGET)
    state_rows = torch.tensor([0, 1, 2])
    engine = _engine(trees, state_rows, "torch")
    q = BUDGET + 1
    idx = torch.arange(3).repeat_interleave(q)  # every slot of every tree, request by request
    slots = torch.arange(q).repeat(3)
    logits = torch.randn(3 * q, vocab, generator=gen) * 3
    got = logits.clone()
    apply_tree_penalties(state, engine.tables, got, idx, np.arange(3), None, slots)
    for row in range(3 * q):
        r, s = int(idx[row]), int(slots[row])
        history, node = [], s
        while node > 0:  # the node, then its ancestors up to (not including) the root
            history.append(int(trees.tokens[r, node]))
            node = int(trees.parents[r, node])
        want = _penalised(state, r, logits[row], history)
        assert torch.allclose(got[row], want, rtol=0, atol=1e-6), (row, got[row] - want)

    # A chain (slot i's parent is slot i - 1): each row's history is the drafts of the rows
    # before it and its own, as vLLM's kernel counts them (that kernel itself, bit for bit:
    # tests/test_gpu_penalties.py, CUDA only: vLLM disables its Triton kernels without a GPU).
    chain_engine = _engine(chain_tree(3, vocab, gen), state_rows, "torch")
    tokens = chain_engine.tables.tokens
    idx, slots = torch.arange(3).repeat_interleave(DEPTH + 1), torch.arange(DEPTH + 1).repeat(3)
    logits = torch.randn(3 * (DEPTH + 1), vocab, generator=gen) * 3
    got = logits.clone()
    apply_tree_penalties(state, chain_engine.tables, got, idx, np.arange(3), None, slots)
    for row in range(3 * (DEPTH + 1)):
        r, s = int(idx[row]), int(slots[row])
        want = _penalised(state, r, logits[row], tokens[r, 1 : s + 1].tolist())
        assert torch.allclose(got[row], want, rtol=0, atol=1e-6), row


def check_bad_words() -> None:
    """Bad words per tree node: a word's prefix is matched against the request's output
    followed by the node's root path below the root (words inside a path, across the output
    and a path, single tokens, and ones that match nothing)."""
    from ddtree.vllm_plugin.v2.bad_words import apply_tree_bad_words

    gen = torch.Generator().manual_seed(11)
    vocab, states, q = 60, 8, BUDGET + 1
    trees = ddtree.build_tree(torch.randn(3, DEPTH, vocab, generator=gen) * 2, BUDGET)
    engine = _engine(trees, torch.tensor([0, 1, 2]), "torch")
    prompt_len, total_len = torch.tensor([5, 3, 7] + [0] * 5), torch.tensor([9, 3, 12] + [0] * 5)
    all_tokens = torch.randint(0, vocab, (states, 32), generator=gen)

    def path(r: int, s: int) -> list[int]:
        tokens = []
        while s > 0:
            tokens.append(int(trees.tokens[r, s]))
            s = int(trees.parents[r, s])
        return tokens[::-1]

    deep = [int((trees.depths[r] >= 2).nonzero()[0]) for r in range(3)]
    words = [
        [path(0, deep[0])[-2:] + [7], [int(all_tokens[0, 8]), path(0, deep[0])[0], 9], [3]],
        [path(1, deep[1]) + [11], [59, 58, 57]],  # no output: a word from the path's start
        [[int(all_tokens[2, 11]), 13], path(2, deep[2])[-1:] + [14]],
    ]
    most = max(len(w) for w in words)
    flat = torch.zeros(states, 64, dtype=torch.int32)
    offsets = torch.zeros(states, most + 1, dtype=torch.int32)
    for r, request_words in enumerate(words):
        tokens = [t for w in request_words for t in w]
        flat[r, : len(tokens)] = torch.tensor(tokens)
        lengths = torch.tensor([len(w) for w in request_words])
        offsets[r, 1 : len(request_words) + 1] = lengths.cumsum(0)
    counts = np.array([len(w) for w in words] + [0] * 5, dtype=np.int32)
    state = SimpleNamespace(
        num_bad_words=SimpleNamespace(np=counts, gpu=torch.from_numpy(counts)),
        bad_word_token_ids=SimpleNamespace(gpu=flat),
        bad_word_offsets=SimpleNamespace(gpu=offsets),
        req_states=SimpleNamespace(
            all_token_ids=SimpleNamespace(gpu=all_tokens.int()),
            prompt_len=SimpleNamespace(gpu=prompt_len.int()),
            total_len=SimpleNamespace(gpu=total_len.int()),
        ),
    )
    idx, slots = torch.arange(3).repeat_interleave(q), torch.arange(q).repeat(3)
    logits = torch.randn(3 * q, vocab, generator=gen)
    got = logits.clone()
    apply_tree_bad_words(state, engine.tables, got, idx, np.arange(3), None, slots)
    for row in range(3 * q):
        r, s = int(idx[row]), int(slots[row])
        sequence = all_tokens[r, prompt_len[r] : total_len[r]].tolist() + path(r, s)
        want = logits[row].clone()
        for word in words[r]:
            prefix = word[:-1]
            if len(prefix) <= len(sequence) and sequence[len(sequence) - len(prefix) :] == prefix:
                want[word[-1]] = float("-inf")
        assert torch.equal(got[row], want), (row, r, s)
    # Each kind of word did ban where it should (so the comparison above is not vacuous).
    first_on_path = int(trees.parents[0, deep[0]]) if trees.depths[0, deep[0]] == 2 else None
    banned = {(0, deep[0], 7), (0, 0, 3), (1, deep[1], 11), (2, 0, 13), (2, deep[2], 14)}
    if first_on_path is not None:
        banned.add((0, first_on_path, 9))
    for r, s, token in banned:
        assert torch.isinf(got[r * q + s, token]), (r, s, token)


def chain_tree(batch: int, vocab: int, gen) -> ddtree.DraftTree:
    """A chain of D random tokens as a DraftTree (slot i's parent is slot i - 1)."""
    slot = torch.arange(DEPTH + 1)
    return ddtree.DraftTree(
        tokens=torch.randint(0, vocab, (batch, BUDGET + 1), generator=gen),
        parents=(torch.arange(BUDGET + 1) - 1).expand(batch, -1).clone(),
        depths=torch.arange(BUDGET + 1).clamp(max=DEPTH).expand(batch, -1).clone(),
        mask=None,
        scores=None,
        ancestors=(torch.arange(BUDGET + 1)[:, None] - slot)
        .clamp(min=0)
        .expand(batch, -1, -1)
        .clone(),
        num_nodes=None,
    )


def _gdn_layer(gen, slots: int, heads=2, group=2, dim_k=8, dim_v=4, width=4):
    """A stand-in of vLLM's QwenGatedDeltaNetAttention: what ``v2/gdn.py`` reads of one."""
    heads_v = heads * group
    channels = 2 * heads * dim_k + heads_v * dim_v

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return SimpleNamespace(
        prefix="model.layers.0.linear_attn",
        conv1d=SimpleNamespace(weight=rand(channels, 1, width, scale=0.5), bias=rand(channels)),
        activation="silu",
        A_log=rand(heads_v, scale=0.3),
        dt_bias=rand(heads_v, scale=0.3),
        num_v_heads=heads_v,
        tp_size=1,
        key_dim=heads * dim_k,
        value_dim=heads_v * dim_v,
        head_k_dim=dim_k,
        head_v_dim=dim_v,
        # vLLM's CPU-side layout: conv [S, W-1, C] (not dim-first), ssm [S, HV, V, K]
        kv_cache=[rand(slots, width - 1, channels), rand(slots, heads_v, dim_v, dim_k, scale=0.3)],
    )


def check_gdn(device: str = "cpu") -> None:
    """``v2/gdn.py`` on a batch of a full tree, a prefill, a clipped tree and a padded row:
    tree rows equal the reference (conv over ancestors, recurrence along the root path),
    other rows go through vLLM's path with the spec part taken out, nothing is written during
    the verify; the commit leaves each tree request's block as a chain over its accepted path
    would, and every other block as it was (a stale block-table row included). On CUDA
    (``tests/test_gpu_gdn.py``) the verify and the commit run again as CUDA graph replays."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    from ddtree.gdn import chain_gdn, gdn_gating, tree_conv1d, tree_gdn
    from ddtree.vllm_plugin.v2.gdn import TreeGDN, caches, split_qkv

    gen = torch.Generator().manual_seed(7)
    trees = ddtree.build_tree(torch.randn(2, DEPTH, VOCAB, generator=gen) * 2, BUDGET)
    engine = _engine(trees, torch.tensor([5, 2]), "fused")
    tables = engine.tables
    for name in ("tokens", "parents", "depths", "ancestors", "tree_rows", "path"):
        setattr(tables, name, getattr(tables, name).to(device))
    q = BUDGET + 1
    num_reqs, num_tokens = 4, q + 16  # rows: tree q, prefill 6, clipped tree 7, 3 padded
    qsl = torch.tensor([0, q, q + 6, q + 13, q + 13], dtype=torch.int32)
    tables.tree_rows[:num_reqs] = torch.tensor([5, -1, 2, -1], dtype=torch.int32)
    layer = _gdn_layer(gen, slots=6)
    cpu_layer = SimpleNamespace(**vars(layer))  # the references' copy
    for name in ("A_log", "dt_bias"):
        setattr(layer, name, getattr(layer, name).to(device))
    layer.conv1d = SimpleNamespace(**{k: v.to(device) for k, v in vars(layer.conv1d).items()})
    layer.kv_cache = [t.to(device) for t in layer.kv_cache]
    # A second layer with the same weights and caches: it reads the step's tree layout from
    # the first layer's forward.
    twin = SimpleNamespace(**vars(layer))
    twin.prefix = "model.layers.1.linear_attn"
    twin.kv_cache = [t.clone() for t in layer.kv_cache]
    trees_gdn = TreeGDN(tables, [layer, twin])
    trees_gdn.query_start_loc = qsl.to(device)
    entry = trees_gdn.layers[layer.prefix]
    # State blocks: 3 (tree), 1 (prefill), 4 (clipped tree); the padded row is stale: it
    # still names block 3, which the commit must not race on.
    entry.block_table = torch.tensor(
        [[3, 9], [1, 9], [4, 9], [3, 9], [0, 0]], dtype=torch.int32, device=device
    )
    trees_gdn.layers[twin.prefix].block_table = entry.block_table
    channels, heads_v = layer.conv1d.weight.shape[0], layer.num_v_heads
    mixed_qkv = torch.randn(num_tokens, channels, generator=gen)
    a, b = torch.randn(num_tokens, heads_v, generator=gen), torch.randn(num_tokens, heads_v)
    core_attn_out = torch.full((num_tokens, heads_v, layer.head_v_dim), 7.0, device=device)
    conv_cpu, ssm_cpu = caches(cpu_layer)
    conv, ssm = caches(layer)
    conv_before, ssm_before = conv.clone(), ssm.clone()
    inputs = [t.to(device) for t in (mixed_qkv, b, a)]

    # vLLM's path for the prefill's rows, with the tree rows taken out of its metadata.
    prefill_rows = torch.arange(q, q + 6, dtype=torch.int32, device=device)
    md = GDNAttentionMetadata(
        num_prefills=1, num_prefill_tokens=6, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=2, num_spec_decode_tokens=q + 7, num_actual_tokens=num_tokens,
        spec_sequence_masks=torch.tensor([True, False, True], device=device),
        non_spec_token_indx=prefill_rows, spec_token_indx=torch.arange(q + 7, device=device),
    )  # fmt: skip
    context = SimpleNamespace(attn_metadata={layer.prefix: md})

    def vllm_path(x, b_rows, a_rows, out):
        seen = context.attn_metadata[layer.prefix]
        assert seen.spec_sequence_masks is None and seen.num_actual_tokens == 6
        assert torch.equal(x.cpu(), mixed_qkv[q : q + 6])
        out.copy_(x[:, : out[0].numel()].view(out.shape))

    trees_gdn._other_rows(context, layer, vllm_path, md, *inputs, core_attn_out)
    assert context.attn_metadata[layer.prefix] is md

    def verify():
        trees_gdn._tree_rows(layer, num_tokens, num_reqs, *inputs, core_attn_out)

    twin_out = core_attn_out.clone()
    with pytest.raises(RuntimeError, match="ran before the first GDN layer"):
        trees_gdn._tree_rows(twin, num_tokens, num_reqs, *inputs, twin_out)
    verify()
    trees_gdn._tree_rows(twin, num_tokens, num_reqs, *inputs, twin_out)
    torch.testing.assert_close(twin_out, core_attn_out, atol=0, rtol=0)
    assert torch.equal(conv, conv_before) and torch.equal(ssm, ssm_before)  # verify: no writes
    got = core_attn_out.cpu()
    prefill_out = mixed_qkv[q : q + 6, : heads_v * layer.head_v_dim].view(6, heads_v, -1)
    assert torch.equal(got[q : q + 6], prefill_out)
    assert (got[q + 13 :] == 7.0).all()  # padded token rows untouched

    weight = cpu_layer.conv1d.weight[:, 0]
    tol = dict(atol=1e-4, rtol=1e-4) if device == "cpu" else dict(atol=2e-3, rtol=2e-3)
    expected_blocks = {}
    for member, (row, block, count) in enumerate([(0, 3, q), (2, 4, 7)]):
        parents = trees.parents[member : member + 1, :count]
        rows = torch.arange(int(qsl[row]), int(qsl[row]) + count)
        x_conv = tree_conv1d(
            mixed_qkv[rows][None], conv_cpu[block : block + 1].clone(), parents, weight,
            cpu_layer.conv1d.bias, "silu",
        )  # fmt: skip
        q_, k_, v_ = split_qkv(cpu_layer, x_conv)
        g, beta = gdn_gating(cpu_layer.A_log, a[rows][None], b[rows][None], cpu_layer.dt_bias)
        want, _ = tree_gdn(q_, k_, v_, g, beta, ssm_cpu[block : block + 1].clone(), parents)
        torch.testing.assert_close(got[rows], want[0], **tol)
        # Its accepted path: a deepest scheduled node's root path.
        node = int(trees.depths[member, :count].argmax())
        path = [node]
        while path[-1] > 0:
            path.append(int(trees.parents[member, path[-1]]))
        path = path[::-1]
        _, states = chain_gdn(q_[:, path], k_[:, path], v_[:, path], g[:, path], beta[:, path],
                              ssm_cpu[block : block + 1].clone())  # fmt: skip
        history = torch.cat([conv_cpu[block], mixed_qkv[rows][path].T], 1)
        expected_blocks[block] = (path, states[0, -1], history[:, -(weight.shape[1] - 1) :])

    # The sampler's rows: the batch padded to 8 (more than the block table's 5 rows).
    path = torch.full((8, DEPTH + 1), -1, dtype=torch.long)
    path[1:, 0] = 0  # rows without a tree walk their root only
    for row, block in ((0, 3), (2, 4)):
        accepted = expected_blocks[block][0]
        path[row, : len(accepted)] = torch.tensor(accepted)
    path = path.to(device)
    active = torch.arange(8, device=device) < 0
    active[:num_reqs] = tables.tree_rows[:num_reqs] >= 0
    trees_gdn.commit(path, active)

    def check_blocks():
        for block, (_, state, conv_state) in expected_blocks.items():
            torch.testing.assert_close(ssm[block].cpu(), state, **tol)
            torch.testing.assert_close(conv[block].cpu(), conv_state, atol=0, rtol=0)
        for block in (0, 1, 2, 5):
            assert torch.equal(ssm[block], ssm_before[block]), block
            assert torch.equal(conv[block], conv_before[block]), block

    check_blocks()

    # forward(): the dispatch vLLM's op calls (forward context patched): mixed step -> both
    # halves, as above; no tree in the step -> vLLM's body over every row.
    import vllm.forward_context as fc

    conv.copy_(conv_before)
    ssm.copy_(ssm_before)
    saved = fc.get_forward_context
    fc.get_forward_context = lambda: context
    try:
        trees_gdn.num_reqs = num_reqs
        dispatched = torch.full_like(core_attn_out, 7.0)
        trees_gdn.forward(layer, vllm_path, *inputs, dispatched)
        torch.testing.assert_close(dispatched.cpu(), got, atol=0, rtol=0)
        seen = []
        context.attn_metadata = {layer.prefix: SimpleNamespace(spec_sequence_masks=None)}
        trees_gdn.forward(layer, lambda *args: seen.append(args[0].shape[0]), *inputs, dispatched)
        assert seen == [num_tokens]
    finally:
        fc.get_forward_context = saved
    if device != "cuda":
        return
    # The same steps as graph replays (fixed shapes, no host read): equal outputs and blocks.
    eager_out = core_attn_out.clone()
    conv.copy_(conv_before)
    ssm.copy_(ssm_before)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture (kernels compiled)
        verify()
        trees_gdn.commit(path, active)
    torch.cuda.current_stream().wait_stream(stream)
    conv.copy_(conv_before)
    ssm.copy_(ssm_before)
    with torch.cuda.graph(graph):
        verify()
        trees_gdn.commit(path, active)
    core_attn_out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    rows = torch.cat([torch.arange(q), torch.arange(q + 6, q + 13)])
    torch.testing.assert_close(core_attn_out[rows], eager_out[rows], atol=0, rtol=0)
    check_blocks()


if __name__ == "__main__":
    import numpy as np

    sys.path.insert(0, os.path.dirname(__file__))
    check_gdn()
    check_penalties()
    check_bad_words()
    check("torch")
    check("fused")  # ddtree.kernels' walk and KV compaction in the sampler
    check_trees()
    from test_v2_chain_step import check_chain_acceptance

    check_chain_acceptance(interpret=True)  # the Triton kernel of chain-sized steps
