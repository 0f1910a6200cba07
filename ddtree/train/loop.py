"""A small training loop shared by the target and drafter recipes: AdamW, warmup + cosine,
bf16 autocast on CUDA, tqdm progress, resumable checkpoints, a seed."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def lr_at(step: int, steps: int, peak: float, warmup: int, time_used: float = 0.0) -> float:
    """Linear warmup, then cosine to 10% of ``peak``; ``time_used`` (share of a time limit
    spent) moves the cosine on when it is further along than the step count."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = max((step - warmup) / max(steps - warmup, 1), min(time_used, 1.0))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[int], torch.Tensor],
    *,
    steps: int,
    lr: float,
    warmup: int,
    checkpoint: Path,
    save_every: int = 500,
    desc: str = "train",
    weight_decay: float = 0.01,
    time_limit: float | None = None,
) -> list[tuple[int, float]]:
    """Run ``steps`` optimizer steps of ``loss_fn(step)``; resume from ``checkpoint`` if there.

    ``time_limit`` (seconds): the cosine schedule runs to whichever end comes first, and
    training stops, after a checkpoint, once the limit has passed (the last history entry
    then says how many steps ran). Returns the loss history as (step, mean loss
    over the last ``save_every`` steps or fewer).
    """
    started = time.monotonic()
    deadline = None if time_limit is None else started + time_limit
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    start, history = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
        torch.set_rng_state(state["rng"])
    running, count = torch.zeros(()), 0  # summed on the device: no sync per step
    bar = tqdm(range(start, steps), desc=desc, initial=start, total=steps, mininterval=5)
    for step in bar:
        used = 0.0 if time_limit is None else (time.monotonic() - started) / time_limit
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup, used)
        loss = loss_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        running, count = running.to(loss.device) + loss.detach().float(), count + 1
        out_of_time = deadline is not None and time.monotonic() > deadline
        if (step + 1) % save_every == 0 or step + 1 == steps or out_of_time:
            history.append((step + 1, float(running) / count))
            running, count = torch.zeros(()), 0
            bar.set_postfix(loss=f"{history[-1][1]:.3f}")
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step + 1,
                    "history": history,
                    "rng": torch.get_rng_state(),
                },
                checkpoint,
            )
        if out_of_time:
            tqdm.write(f"{desc}: time limit reached after {step + 1} of {steps} steps")
            break
    return history


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
