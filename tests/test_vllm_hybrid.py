"""DDTree on a hybrid Gated DeltaNet target (Qwen3.5 / 3.6 layout) in vLLM's CPU build.

The target is a random tiny ``Qwen3_5ForConditionalGeneration`` (2 x (3 GDN + 1 attention)
layers, M-RoPE) with a drafter distilled from it (``models.make_hybrid_pair``), so accepted
paths run deep and leave the first branch. Greedy DDTree must equal no-spec token for token
(float32, both through ``ddtree.vllm_plugin.gdn``), and no-spec must equal transformers.
"""

import pytest

vllm = pytest.importorskip("vllm")
pytest.importorskip("torchvision")  # vLLM's Qwen3.5 module imports Qwen2-VL's image processor

from engines import (  # noqa: E402
    assert_same_distribution,
    counter,
    ddtree_spec,
    engine,
    greedy,
    token_counts,
)

from models import make_hybrid_pair  # noqa: E402

pytestmark = pytest.mark.slow  # engines, servers, subprocesses or Triton's interpreter

# Mixed requests over the pair's 32 words: loops, an early and a late EOS (id 1).
PROMPTS = ["w3 w21 w9", "w6 w13 w18", "w6 w7 w18", "w14 w15 w13"]
SAMPLED_PROMPT, SAMPLED_INDEX, SAMPLES, VOCAB = "w6 w7 w18", 2, 240, 32


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_hybrid_pair(tmp_path_factory.mktemp("hybrid"))


MAX_MODEL_LEN = 384


def _engine(pair, spec=None, **kwargs):
    target, _ = pair
    return engine(target, spec, language_model_only=True, max_model_len=MAX_MODEL_LEN, **kwargs)


def _to_context_end(llm):
    """Every request runs into max_model_len: the last trees are cut where the context ends."""
    params = vllm.SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def _acceptance(llm) -> list[int]:
    """Accepted drafts per position, over the engine's life."""
    (metric,) = [m for m in llm.get_metrics() if m.name.endswith("accepted_tokens_per_pos")]
    return list(metric.values)


def _counts(llm):
    return token_counts(llm, SAMPLED_PROMPT, SAMPLED_INDEX, SAMPLES, VOCAB, temperature=1.0)


@pytest.fixture(scope="module")
def no_spec(pair):
    with _engine(pair, max_num_seqs=16) as llm:  # the samples 16 at a time
        return greedy(llm, PROMPTS), _counts(llm), _to_context_end(llm)


def test_no_spec_float32_equals_transformers(pair, no_spec):
    """vLLM refuses float32 GDN on the CPU; the plugin's chain path serves it: its greedy
    tokens equal transformers' own Qwen3.5 (an implementation independent of both)."""
    import torch
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    target, _ = pair
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    want, _, _ = no_spec
    for prompt, (tokens, _reason) in zip(PROMPTS[:2], want, strict=False):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=len(tokens), do_sample=False, eos_token_id=1)
        assert out[0, ids.shape[1] :].tolist() == tokens, prompt


def test_vllm_dflash_chain_equals_no_spec(pair, no_spec):
    """The control: vLLM's own DFlash chain on the hybrid pair (its float32 chain verify served
    by the plugin the way vLLM's bf16 CPU kernels do it: a state block per draft)."""
    want, _, _ = no_spec
    _, drafter = pair
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 15}
    with _engine(pair, spec, disable_log_stats=False) as llm:
        got = greedy(llm, PROMPTS)
        accepted = _acceptance(llm)
    assert got == want
    assert accepted[4] > 0, accepted


@pytest.mark.parametrize(
    "budget, options, blocks",
    [
        (63, {"ddtree_chain_seed": False}, None),
        (15, {}, 8),
        (30, {"ddtree_budget_per_batch_size": [[1, 1, 30], [2, 2, 20], [3, 16, 7]]}, None),
    ],
    ids=["B63-no-forced-chain", "B15-preempted", "B30-schedule"],
)
def test_greedy_ddtree_equals_no_spec(pair, no_spec, budget, options, blocks):
    """Trees verified through the GDN layers (each node continues its parent's state and conv
    window), accepted paths replayed into the request's state: outputs equal no-spec's, EOS
    inside paths included, and up to the end of the context. Without the forced argmax chain
    the accepted path runs through siblings, so a commit that assumed slots 0, 1, 2, ... fails
    here. Budgets per batch size (a schedule) change the tree's width between steps
    of one request, its stash and replay with it. With 8 cache blocks for 4 requests (one
    state block each: DDTree does not take vLLM's 1 + B) requests are preempted and
    recomputed, and run to the end of the context (the last trees cut there)."""
    want, _, want_to_end = no_spec
    assert sum(reason == "stop" for _, reason in want) >= 2  # EOS mid-answer
    assert all(len(t) > MAX_MODEL_LEN - 16 for t in want_to_end)
    _, drafter = pair
    spec = ddtree_spec(budget, drafter, **options)
    to_end = blocks is not None  # the long run once, where it also meets preemption
    with _engine(pair, spec, disable_log_stats=False, num_gpu_blocks_override=blocks) as llm:
        got = greedy(llm, PROMPTS)
        got_to_end = _to_context_end(llm) if to_end else want_to_end
        accepted = _acceptance(llm)
        preempted = counter(llm, "vllm:num_preemptions")
        drafts = counter(llm, "vllm:spec_decode_num_draft_tokens")
        per_step = drafts / counter(llm, "vllm:spec_decode_num_drafts")
    assert got == want
    assert got_to_end == want_to_end
    assert accepted[4] > 0, accepted  # paths at least 5 nodes deep were committed
    assert (preempted > 0) == (blocks is not None), preempted
    if isinstance(options.get("ddtree_budget_per_batch_size"), list):
        # 4 requests verify 7 drafts, the last one 30: trees of several widths were verified
        assert 7 < per_step < 30, per_step


def test_sampling_ddtree_matches_no_spec(pair, no_spec):
    """T=1: the generated token at a tree node has no-spec's distribution (chi-square)."""
    _, want, _ = no_spec
    _, drafter = pair
    with _engine(pair, ddtree_spec(64, drafter, ddtree_chain_seed=False), max_num_seqs=16) as llm:
        got = _counts(llm)
    assert_same_distribution(got, want)


def test_prefix_caching_on_a_hybrid_target_is_refused(pair):
    _, drafter = pair
    with pytest.raises(ValueError, match="prefix caching off"):
        with _engine(pair, ddtree_spec(15, drafter), enable_prefix_caching=True):
            pass


def test_trained_tiny_hybrid_pair_is_served(tmp_path):
    """``ddtree train all --tiny --arch qwen3_5`` writes a pair vLLM loads and DDTree serves
    (greedy equal to no-spec)."""
    from ddtree.cli import main

    out = tmp_path / "m"
    assert main(["train", "all", "--out", str(out), "--tiny", "--arch", "qwen3_5"]) == 0
    prompts = ["def f(x):\n    return", "import os\n"]
    params = vllm.SamplingParams(temperature=0, max_tokens=24)
    outs = []
    for spec in (None, ddtree_spec(32, out / "drafter")):
        with engine(out / "target", spec, language_model_only=True) as llm:
            outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
