"""The transformers reference loop: AR, DFlash chain and DDTree on one request.

An engine-independent oracle: plain Hugging Face target, our DFlash drafter, ``build_tree`` /
``walk`` from the core. Every method runs the same step: draft (not for AR) -> a tree (root only
for AR, the argmax chain for DFlash, the best-``budget`` tree for DDTree) -> one target forward
over the tree with the ancestor mask and depth positions -> the target's token at every node
(argmax, or a sample after temperature / top-k / top-p) -> walk -> keep the accepted path's KV
and hand its hidden states to the drafter. Sampling every node and walking is lossless: each
emitted token is a sample of the target's distribution given the tokens before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import DynamicCache

from ddtree.dflash import DFlashDraftModel, check_pair
from ddtree.sampling import process_logits
from ddtree.tree import DraftTree, build_tree, chain_tree
from ddtree.verify import walk

Method = Literal["ar", "dflash", "ddtree"]
METHODS = ("ar", "dflash", "ddtree")


@dataclass
class GenerationResult:
    tokens: list[int]  # generated tokens (the prompt excluded)
    finish_reason: Literal["stop", "length"]
    taus: list[int] = field(default_factory=list)  # tokens emitted per target verify step
    accepted_per_depth: list[int] = field(default_factory=list)  # accepted nodes at depth d+1
    seconds: dict[str, float] = field(default_factory=dict)  # per stage, summed over steps

    @property
    def tau(self) -> float:
        """Mean tokens per verify step (accepted + bonus)."""
        return sum(self.taus) / max(len(self.taus), 1)


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """One token per row of ``logits [n, V]``: argmax at T=0, else a processed sample."""
        if self.temperature == 0:
            return logits.argmax(-1)
        processed = process_logits(logits, self.temperature, self.top_k, self.top_p)
        return torch.multinomial(processed.softmax(-1), 1, generator=generator).squeeze(-1)


def _target_forward(target, tokens, positions, cache, tree_mask, feature_layers):
    """Logits ``[1, n, V]`` and drafter features ``[1, n, len * H]`` of ``tokens [1, n]``.

    ``tree_mask [1, n, n]`` (or None for causal) is how the new tokens see each other; every
    new token sees the whole cache.
    """
    mask = None
    if tree_mask is not None:
        past = cache.get_seq_length()
        seen = torch.ones(1, tokens.shape[1], past, dtype=torch.bool, device=tokens.device)
        mask = {"full_attention": torch.cat([seen, tree_mask], -1).unsqueeze(1)}
    out = target(
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    features = None
    if feature_layers:
        features = torch.cat([out.hidden_states[i + 1] for i in feature_layers], -1)
    return out.logits, features


def _keep_in_cache(cache: DynamicCache, start: int, slots: torch.Tensor) -> None:
    """Keep cache rows ``[0, start)`` and ``start + slots``, in that order; drop the rest."""
    keep = torch.cat([torch.arange(start, device=slots.device), start + slots])
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def _check_target(target) -> None:
    cfg = target.config
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or []):
        raise ValueError(
            "ddtree.generate supports targets with full attention only "
            f"(layer_types={sorted(set(cfg.layer_types))})"
        )


@torch.inference_mode()
def generate(
    target,
    drafter: DFlashDraftModel | None,
    input_ids: torch.Tensor | list[int],
    method: Method = "ddtree",
    *,
    budget: int = 64,
    chain_seed: bool = True,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: list[int] | tuple[int, ...] = (),
    seed: int | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` with one request.

    ``method``: "ar" (target only), "dflash" (the drafter's argmax chain) or "ddtree" (the
    ``budget`` best prefixes; ``chain_seed`` forces the chain in). A stop token inside an
    accepted path ends the output there (it is kept, finish_reason "stop").
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "ar" and drafter is None:
        raise ValueError(f"method {method!r} needs a drafter")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an int >= 0, got {budget!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    sampling = Sampling(temperature, top_k, top_p)
    _check_target(target)
    if drafter is not None and method != "ar":
        check_pair(drafter.config, target.config)
    device = target.device
    prompt = torch.as_tensor(input_ids, dtype=torch.long, device=device).reshape(1, -1)
    if prompt.shape[1] == 0:
        raise ValueError("input_ids must hold at least one token")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    stops = set(stop_token_ids)
    layers = drafter.settings.target_layer_ids if method != "ar" else []
    seconds = dict.fromkeys(("prefill", "draft", "tree", "verify", "walk_commit"), 0.0)
    result = GenerationResult([], "length", seconds=seconds)

    t0 = time.perf_counter()
    cache = DynamicCache()
    length = prompt.shape[1]
    positions = torch.arange(length, device=device).unsqueeze(0)
    logits, features = _target_forward(target, prompt, positions, cache, None, layers)
    root = sampling.pick(logits[0, -1:], generator)  # [1]
    draft_ctx = None
    if method != "ar":
        draft_ctx = drafter.new_context()
        drafter.extend_context(draft_ctx, features, positions)
    seconds["prefill"] += time.perf_counter() - t0
    if _emit(result, [int(root)], stops, max_new_tokens):
        return result

    embed = target.get_input_embeddings()
    pos = length  # position of the root (the last emitted token, not yet in the cache)
    while True:
        t0 = time.perf_counter()
        draft_logits = None
        if method != "ar":
            draft_logits = _draft(target, drafter, embed, root, pos, draft_ctx)  # [1, D, V]
        t_draft = time.perf_counter()
        tree = _tree(method, draft_logits, budget, chain_seed, device)
        t1 = time.perf_counter()
        seconds["draft"] += t_draft - t0
        seconds["tree"] += t1 - t_draft
        tokens = torch.where(tree.tokens >= 0, tree.tokens, 0)  # padding slots: any id
        tokens[:, 0] = root
        logits, features = _target_forward(
            target, tokens, pos + tree.depths, cache, tree.mask, layers
        )
        target_tokens = sampling.pick(logits[0], generator).unsqueeze(0)  # [1, 1+B]
        t2 = time.perf_counter()
        seconds["verify"] += t2 - t1
        acc = walk(tree, target_tokens)
        accepted = int(acc.num_accepted[0])
        path = acc.path[0, : accepted + 1]
        _keep_in_cache(cache, pos, path)
        if draft_ctx is not None:
            new_positions = pos + torch.arange(accepted + 1, device=device).unsqueeze(0)
            drafter.extend_context(draft_ctx, features[:, path], new_positions)
        new_tokens = acc.emitted[0, : accepted + 1].tolist()
        seconds["walk_commit"] += time.perf_counter() - t2
        result.taus.append(accepted + 1)
        while len(result.accepted_per_depth) < tree.max_depth:
            result.accepted_per_depth.append(0)
        for d in range(accepted):
            result.accepted_per_depth[d] += 1
        if _emit(result, new_tokens, stops, max_new_tokens):
            return result
        root = acc.bonus
        pos += accepted + 1


def _draft(target, drafter, embed, root, pos, draft_ctx) -> torch.Tensor:
    """Drafter logits ``[1, D, V]`` for depths 1..D after ``root`` at position ``pos``."""
    device = root.device
    block = torch.full((1, drafter.block_size), drafter.settings.mask_token_id, device=device)
    block[0, 0] = root[0]
    positions = pos + torch.arange(drafter.block_size, device=device).unsqueeze(0)
    hidden = drafter(embed(block), positions, draft_ctx)
    return target.get_output_embeddings()(hidden[:, 1:])


def _tree(method, draft_logits, budget, chain_seed, device) -> DraftTree:
    """The tree to verify this step (root slot 0, token filled in by the caller)."""
    if method == "ar":
        return build_tree(torch.zeros(1, 1, 1, device=device), 0)
    if method == "dflash":
        return chain_tree(draft_logits.argmax(-1))
    return build_tree(draft_logits.float(), budget, chain_seed=chain_seed, check_values=False)


def _emit(result: GenerationResult, tokens: list[int], stops: set[int], limit: int) -> bool:
    """Append ``tokens`` up to a stop token or the limit; True when generation is over."""
    for token in tokens:
        result.tokens.append(token)
        if token in stops:
            result.finish_reason = "stop"
            return True
        if len(result.tokens) >= limit:
            result.finish_reason = "length"
            return True
    return False
