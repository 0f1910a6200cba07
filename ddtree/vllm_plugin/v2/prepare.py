"""Before the target's forward on the V2 runner: which requests verify a tree this step, and
their depth positions (after vLLM computed the KV slots from sequential positions)."""

from __future__ import annotations

from ddtree.vllm_plugin import config, graphs, tuner
from ddtree.vllm_plugin.debug import sync_checked
from ddtree.vllm_plugin.v2 import kernels
from ddtree.vllm_plugin.v2.engine import TreeEngine


def check_settings(vllm_config) -> None:
    """Refuse engine settings the V2 tree path is not built for, naming the setting."""
    from vllm.config.compilation import CUDAGraphMode

    parallel = vllm_config.parallel_config
    refused = {
        "pipeline_parallel_size": parallel.pipeline_parallel_size > 1,
        "data_parallel_size": parallel.data_parallel_size > 1,
        "decode_context_parallel_size": parallel.decode_context_parallel_size > 1,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size > 1,
        "kv_cache_dtype": vllm_config.cache_config.cache_dtype != "auto",
        "XD-RoPE targets": vllm_config.model_config.uses_xdrope_dim > 0,
    }
    for name, bad in refused.items():
        if bad:
            raise NotImplementedError(f"ddtree on the V2 model runner does not support {name}")
    if vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.FULL:
        raise ValueError(
            "ddtree needs cudagraph_mode FULL_AND_PIECEWISE (the default), FULL_DECODE_ONLY, "
            "PIECEWISE or NONE, not FULL: a full graph of a mixed batch would replay the tree "
            "attention for prefill rows"
        )
    options = config.options_of(vllm_config.speculative_config)
    if options.max_verify_cost is not None or options.max_verify_tokens_given:
        raise ValueError(
            "ddtree_max_verify_tokens and ddtree_max_verify_cost shape the V1 model runner's "
            "trees only; on the V2 model runner (vLLM's default on CUDA) set "
            'ddtree_budget_per_batch_size ("auto", or [[first, last, budget], ...]) instead, '
            "or VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner"
        )
    budget = options.budget
    max_model_len = vllm_config.model_config.max_model_len
    if 2 * budget + 3 > max_model_len:
        raise ValueError(
            f"ddtree_budget {budget} needs max_model_len >= {2 * budget + 3} on the V2 model "
            f"runner (got {max_model_len}): vLLM's start-up warm-up runs requests of 2 x budget "
            "+ 3 tokens, and past max_model_len they write K/V outside their block table (the "
            "wrong tokens once seen at B=511); lower ddtree_budget or raise max_model_len"
        )
    vocab = vllm_config.model_config.get_vocab_size()
    if budget + 2 > vocab:
        raise ValueError(
            f"ddtree_budget {budget} needs a vocabulary of >= {budget + 2} tokens on the V2 "
            f"model runner (the target has {vocab}): vLLM's start-up warm-up prompts are token "
            "ids 0 .. budget + 1 (an embedding index out of bounds at B=63 on a 32-token "
            "target); lower ddtree_budget"
        )
    if config.SETTINGS.tree_attention == "merge":
        raise ValueError("DDTREE_TREE_ATTENTION=merge runs on the V1 model runner only")


@sync_checked
def begin_step(engine: TreeEngine, scheduler_output, dummy_run: bool) -> None:
    """Clear the step's flags; note whether every request verifies a tree (only then may a
    uniform batch replay a verify graph) and whether every tree is its forced chain."""
    engine.tree_step = engine.all_tree = engine.chain_trees = False
    engine.live_step = not dummy_run
    if dummy_run:
        engine.uniform_trees = True
        return
    engine.mark("prepare")
    num_reqs, engine.uniform_trees, longest = tuner.scheduled_drafts(scheduler_output)
    if engine.tuner is not None:  # "auto": the served period of the last step
        engine.tuner.observe(num_reqs, engine.uniform_trees, longest)
    # K <= D drafts of a chain-seeded tree are slots 1..K at depths 1..K: the walk's path is
    # slots 0..a in order and the drafter's rows are already in place (no reorder).
    engine.chain_trees = engine.options.chain_seed and longest <= engine.depth


@sync_checked
def prepare_step(engine: TreeEngine, input_batch) -> None:
    """``tree_rows`` and depth positions of this step's tree requests, on the device."""
    counts = input_batch.num_draft_tokens_per_req  # host: drafts scheduled per request
    engine.tree_step = counts is not None and bool((counts > 0).any())
    engine.all_tree = engine.tree_step and bool((counts > 0).all())
    if not engine.tree_step or engine.chain_step():  # vLLM's chain verify: nothing to mark
        return
    tables = engine.tables
    # Every row the sampler's graph reads (requests padded to a bucket) gets a value.
    rows = max(graphs.bucket(input_batch.num_reqs), input_batch.num_reqs_after_padding)
    engine.marked_rows = rows
    if engine.gdn is not None:
        engine.gdn.num_reqs = input_batch.num_reqs
    kernels.mark_trees_and_depth_positions(
        tables.tree_rows[:rows],
        input_batch.positions,
        input_batch.query_start_loc,
        input_batch.cu_num_logits,
        input_batch.idx_mapping,
        tables.depths,
        input_batch.num_reqs,
    )
