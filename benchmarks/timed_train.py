"""Training under a wall-clock budget, for the benchmarks (not a lesson).

:func:`train_for` is ``course_lib.train.train``'s loop (AdamW, warm-up + cosine, clipping,
evaluation) that stops when ``time_budget`` seconds are spent, evaluations included. The cosine
is stretched over the number of updates the budget is estimated to allow, re-estimated after
every update from the speed of the last 50, so a run is not repeatable step for step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from course_lib._validate import require_positive_number
from course_lib.train import (
    BatchFn,
    TrainConfig,
    TrainHistory,
    estimate_loss,
    lr_schedule,
    make_optimizer,
)


def planned_updates(done: int, now: float, deadline: float, step_s: float, eval_s: float,
                    config: TrainConfig) -> int:
    """How many updates in total fit in the time left: each further update costs ``step_s``,
    every ``eval_interval``-th also an evaluation, and the final evaluation must fit too."""
    left = deadline - now - eval_s
    per_update = step_s + eval_s / config.eval_interval
    more = max(int(left / per_update), 0) if per_update > 0 else config.max_iters
    return min(done + more, config.max_iters)


@dataclass
class _Clock:
    deadline: float
    eval_s: float = 0.0  # how long the last evaluation took


def _evaluate(model: nn.Module, history: TrainHistory, done: int, batches: dict,
              iters: int, clock: _Clock) -> None:
    started = time.perf_counter()
    history.eval_steps.append(done)
    history.eval_train_losses.append(estimate_loss(model, batches["train"], iters))
    if batches["val"] is not None:
        history.val_losses.append(estimate_loss(model, batches["val"], iters))
    clock.eval_s = time.perf_counter() - started


def train_for(
    model: nn.Module, train_batches: BatchFn, config: TrainConfig, *, time_budget: float,
    val_batches: BatchFn | None = None, progress: bool = True, desc: str = "training",
) -> tuple[TrainHistory, str]:
    """Train like ``course_lib.train.train`` for at most ``time_budget`` seconds.

    Returns:
        ``(history, stopped_by)``: stopped_by is ``"time_budget"`` when the clock, not
        ``config.max_iters``, set the number of updates.
    """
    require_positive_number("time_budget", time_budget)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, config)
    max_norm = config.grad_clip or math.inf
    run_start = time.perf_counter()
    clock, history = _Clock(run_start + time_budget), TrainHistory()
    batches = {"train": train_batches, "val": val_batches}
    planned = decay_iters = config.max_iters
    bar = tqdm(total=planned, desc=desc, disable=not progress, leave=True)
    was_training, step, out_of_time = model.training, 0, False
    try:
        model.train()
        _evaluate(model, history, 0, batches, config.eval_iters, clock)
        while step < planned and not out_of_time:
            started = time.perf_counter()
            # decay_iters may fall below warmup_iters: then the warm-up ends at min_lr
            lr = lr_schedule(step, lr=config.lr, min_lr=config.min_lr,
                             warmup_iters=config.warmup_iters,
                             decay_iters=max(decay_iters, config.warmup_iters))
            for group in optimizer.param_groups:
                group["lr"] = lr
            batch = {k: v.to(device) for k, v in train_batches().items()}
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            step += 1
            history.steps.append(step)
            history.train_losses.append(loss.item())
            history.lrs.append(lr)
            history.grad_norms.append(float(grad_norm))
            history.step_times.append(time.perf_counter() - started)
            history.train_time_s += history.step_times[-1]
            bar.update(1)
            out_of_time = time.perf_counter() + clock.eval_s > clock.deadline
            if step % config.eval_interval == 0 or step >= planned or out_of_time:
                _evaluate(model, history, step, batches, config.eval_iters, clock)
            if step >= min(20, config.eval_interval):  # re-plan once the speed is measured
                recent = history.step_times[-50:]
                planned = decay_iters = max(step, planned_updates(
                    step, time.perf_counter(), clock.deadline, sum(recent) / len(recent),
                    clock.eval_s, config))
                bar.total = planned
        if history.eval_steps[-1] != step:
            _evaluate(model, history, step, batches, config.eval_iters, clock)
    finally:
        bar.close()
        history.elapsed_s = time.perf_counter() - run_start
        model.train(was_training)
    return history, "time_budget" if step < config.max_iters else "max_iters"
