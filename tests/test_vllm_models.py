"""DDTree in vLLM on random-weight and known-acceptance models (no tokenizer: token ids in)."""

import pytest

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
