"""DDTree in vLLM on random-weight and known-acceptance models (no tokenizer: token ids in)."""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from models import known_pair, make_drafter, make_target  # noqa: E402


def _engine(target_dir, spec):
    return vllm.LLM(
        model=str(target_dir), skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
        max_model_len=512, max_num_seqs=4, max_num_batched_tokens=1024,
        speculative_config=spec, seed=0, gpu_memory_utilization=0.2,
    )  # fmt: skip


def _run(llm, prompts, max_tokens):
    params = [vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                  detokenize=False) for n in max_tokens]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.llm_engine.engine_core.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_random_models_greedy_equals_no_spec(tmp_path):
    target = make_target(seed=7, vocab=200, hidden=128, layers=4)
    target.save_pretrained(tmp_path / "target")
    make_drafter(target, tmp_path / "drafter", seed=8, layers=2, block_size=8)
    prompts = [[5, 6, 7], [100] * 20, [1, 150, 3, 9, 44, 12, 13]]
    lengths = [48, 33, 20]
    want = _run(_engine(tmp_path / "target", None), prompts, lengths)
    spec = {"method": "ddtree", "model": str(tmp_path / "drafter"), "ddtree_budget": 48}
    assert _run(_engine(tmp_path / "target", spec), prompts, lengths) == want


def test_known_acceptance_all_accepted(tmp_path):
    # The target says 7 after anything; the drafter proposes 7 at all 15 depths.
    target, _ = known_pair(tmp_path / "drafter", lambda x: 7, 7, vocab=128)
    target.save_pretrained(tmp_path / "target")
    spec = {"method": "ddtree", "model": str(tmp_path / "drafter"), "ddtree_budget": 32}
    llm = _engine(tmp_path / "target", spec)
    outs = _run(llm, [[1, 2], [3]], [50, 33])
    assert outs == [[7] * 50, [7] * 33]


def _token_counts(llm, vocab, n, index):
    params = [vllm.SamplingParams(temperature=1.0, max_tokens=index + 1, ignore_eos=True,
                                  seed=seed, detokenize=False) for seed in range(n)]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}] * n, params)
    llm.llm_engine.engine_core.shutdown()
    counts = [0] * vocab
    for o in outs:
        counts[o.outputs[0].token_ids[index]] += 1
    return counts


def test_sampling_matches_no_spec_distribution(tmp_path):
    """T=1: the distribution of generated token 2 (sampled at a depth-1 tree node when the
    root's child was accepted) is the same with DDTree as without (chi-square homogeneity)."""
    import math

    vocab = 24
    target = make_target(seed=9, vocab=vocab, hidden=128, layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # soft logits: many likely tokens
    target.save_pretrained(tmp_path / "target")
    make_drafter(target, tmp_path / "drafter", seed=10, block_size=4)
    n = 600
    plain = _token_counts(_engine(tmp_path / "target", None), vocab, n, 2)
    spec = {"method": "ddtree", "model": str(tmp_path / "drafter"), "ddtree_budget": 32}
    tree = _token_counts(_engine(tmp_path / "target", spec), vocab, n, 2)
    cells = [(a, b) for a, b in zip(plain, tree, strict=True) if a + b >= 10]
    rare = (sum(plain) - sum(a for a, _ in cells), sum(tree) - sum(b for _, b in cells))
    if sum(rare) > 0:
        cells.append(rare)
    chi2 = sum((a - (a + b) / 2) ** 2 / ((a + b) / 2) * 2 for a, b in cells)
    dof = len(cells) - 1
    w = 2.0 / (9.0 * dof)
    critical = dof * (1 - w + 3.29 * math.sqrt(w)) ** 3  # p = 0.0005
    assert dof >= 3, cells
    assert chi2 < critical, (chi2, critical, plain, tree)
