"""DDTree in vLLM on random-weight and known-acceptance models (no tokenizer: token ids in)."""

import pytest
import torch

vllm = pytest.importorskip("vllm")

from engines import assert_same_distribution, ddtree_spec, engine, token_counts  # noqa: E402

from models import known_pair, make_drafter, make_target  # noqa: E402

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter


def _engine(target_dir, spec):
    return engine(
        target_dir,
        spec=spec,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_batched_tokens=1024,
        max_num_seqs=16,  # the 600 samples 16 at a time
    )


def _run(target_dir, spec, prompts, max_tokens):
    params = [
        vllm.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in max_tokens
    ]
    with _engine(target_dir, spec) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_random_models_greedy_equals_no_spec(tmp_path):
    target = make_target(seed=7, vocab=200, hidden=128, layers=4)
    target.save_pretrained(tmp_path / "target")
    make_drafter(target, tmp_path / "drafter", seed=8, layers=2, block_size=8)
    prompts = [[5, 6, 7], [100] * 20, [1, 150, 3, 9, 44, 12, 13]]
    lengths = [48, 33, 20]
    want = _run(tmp_path / "target", None, prompts, lengths)
    spec = ddtree_spec(48, tmp_path / "drafter")
    assert _run(tmp_path / "target", spec, prompts, lengths) == want


def test_known_acceptance_all_accepted(tmp_path):
    # The target says 7 after anything; the drafter proposes 7 at all 15 depths.
    target, _ = known_pair(tmp_path / "drafter", lambda x: 7, 7, vocab=128)
    target.save_pretrained(tmp_path / "target")
    outs = _run(tmp_path / "target", ddtree_spec(32, tmp_path / "drafter"), [[1, 2], [3]], [50, 33])
    assert outs == [[7] * 50, [7] * 33]


def test_sampling_matches_no_spec_distribution(tmp_path):
    """T=1: the distribution of generated token 2 (sampled at a depth-1 tree node when the
    root's child was accepted) is the same with DDTree as without (chi-square homogeneity)."""
    vocab = 24
    target = make_target(seed=9, vocab=vocab, hidden=128, layers=2)
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # soft logits: many likely tokens
    target.save_pretrained(tmp_path / "target")
    make_drafter(target, tmp_path / "drafter", seed=10, block_size=4)
    prompt = {"prompt_token_ids": [1, 2, 3]}
    counts = []
    for spec in (None, ddtree_spec(32, tmp_path / "drafter")):
        with _engine(tmp_path / "target", spec) as llm:
            counts.append(token_counts(llm, prompt, 2, 600, vocab, temperature=1.0))
    assert_same_distribution(*counts)
