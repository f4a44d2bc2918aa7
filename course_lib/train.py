"""A small training loop for course_lib's models: AdamW, a warm-up then cosine learning rate,
gradient clipping, periodic evaluation and a progress bar.

One loop serves every model whose forward returns an output with a ``loss``. A batch is a dict
of keyword arguments for the model, always including ``targets``, so the loop only ever calls
``model(**batch).loss``:

    TransformerDecoder:  {"ids": x (B, T), "targets": y (B, T)}
    EncoderDecoder:      {"src": src (B, S), "tgt": tgt_in (B, T), "targets": tgt_out (B, T)}

The loop asks a *batch function* (no arguments, returns one such dict) for every batch:
:func:`lm_batches` makes one from a token stream, :func:`random_batches` from tensors of
examples. The loop never chooses a device: it moves each batch to wherever the model is.
"""

from __future__ import annotations

import inspect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ._validate import require_ndim, require_positive_int, shape_of
from .data import get_batch

Batch = Mapping[str, torch.Tensor]
BatchFn = Callable[[], Batch]


# --------------------------------------------------------------------------------------------
# Configuration and learning-rate schedule


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of :func:`train`.

    Attributes:
        max_iters: number of optimizer updates (an upper bound when ``time_budget`` is set).
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: learning rate at the end of the cosine decay.
        warmup_iters: updates over which the learning rate rises linearly from lr/warmup_iters
            to lr. Adam's early moment estimates are noisy, so big first steps can wreck the
            initialisation.
        lr_decay_iters: the update by which the cosine decay reaches min_lr (None: max_iters).
        weight_decay: AdamW's decoupled weight decay, applied to weight matrices only (see
            :func:`param_groups`).
        betas: Adam's moment decay rates. 0.99 rather than the usual 0.999 for the second
            moment averages the squared gradients over about 100 updates instead of 1,000,
            so the step size follows the gradient's scale more closely in a short run.
        grad_clip: rescale the gradient whenever its global L2 norm exceeds this (None: never).
        eval_interval: evaluate every this many updates (also before the first and after the
            last).
        eval_iters: batches averaged per evaluation.
        seed: seeds torch's global generator at the start (dropout); None leaves it alone.
            Batch functions bring their own generator.
        time_budget: seconds of wall-clock time (evaluations included). When set, training
            stops when the budget runs out, and the cosine decay is stretched over the number
            of updates the budget is estimated to allow (re-estimated after every update from
            the speed of the last 50), so runs are not repeatable step for step.
    """

    max_iters: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int | None = None
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float | None = 1.0
    eval_interval: int = 250
    eval_iters: int = 20
    seed: int | None = 0
    time_budget: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_iters", "eval_interval", "eval_iters"):
            require_positive_int(name, getattr(self, name))
        if isinstance(self.warmup_iters, bool) or not isinstance(self.warmup_iters, int) or (
            self.warmup_iters < 0
        ):
            raise ValueError(f"warmup_iters must be an integer >= 0, got {self.warmup_iters!r}")
        if self.lr_decay_iters is not None:
            require_positive_int("lr_decay_iters", self.lr_decay_iters)
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr={self.lr}, got {self.min_lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {self.grad_clip}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"time_budget must be > 0 seconds or None, got {self.time_budget}")

    def lr_at(self, step: int, decay_iters: int | None = None) -> float:
        """The learning rate of update ``step`` (0-based) under this config's schedule."""
        return lr_schedule(
            step, lr=self.lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
            decay_iters=decay_iters or self.lr_decay_iters or self.max_iters,
        )


def lr_schedule(
    step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int
) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``, then constant ``min_lr``.

    Update ``step`` (0-based) uses ``lr * (step + 1) / warmup_iters`` during the warm-up, so
    update ``warmup_iters - 1`` is the first at the peak ``lr``. The cosine then falls from
    ``lr`` and reaches ``min_lr`` exactly at update ``decay_iters - 1``, the last one when
    ``decay_iters`` is the number of updates.

    Returns:
        The learning rate, a float.
    """
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if step >= decay_iters - 1:
        return min_lr
    progress = (step + 1 - warmup_iters) / (decay_iters - warmup_iters)  # in (0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split the parameters into AdamW groups with and without weight decay.

    Decay (shrinking weights towards zero) regularises the matrices that multiply
    activations: every parameter with two or more dimensions. Left alone are biases and
    LayerNorm gains (1-D: decaying a gain towards 0 would fight the normalisation) and
    embedding tables (a rarely seen token's row would shrink every step it is not used).
    A tied output layer shares the token embedding's matrix, so it is not decayed either.

    Returns:
        ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest,
        "weight_decay": 0.0}]``, each parameter once.
    """
    embedding_ids = {
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)
    }
    decay, no_decay, seen = [], [], set()
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------------------------
# Batch functions


def lm_batches(
    data: torch.Tensor,
    batch_size: int,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
) -> BatchFn:
    """A batch function for a language model on one token stream.

    Args:
        data: (N,) token ids.
        batch_size, block_size: B and T of each batch.
        generator: a CPU torch.Generator, for repeatable batches.

    Returns:
        A function returning ``{"ids": x, "targets": y}`` with x, y (B, T) from
        :func:`course_lib.data.get_batch`.
    """
    require_ndim("data", data, (1,), "(N,) (one long token stream)")
    get_batch(data[: block_size + 1], 1, block_size)  # fail now, not at the first step

    def batch() -> dict[str, torch.Tensor]:
        x, y = get_batch(data, batch_size, block_size, generator=generator)
        return {"ids": x, "targets": y}

    return batch


def random_batches(
    tensors: Mapping[str, torch.Tensor],
    batch_size: int,
    *,
    generator: torch.Generator | None = None,
) -> BatchFn:
    """A batch function drawing random examples (rows) from tensors of examples.

    Args:
        tensors: the model's keyword arguments, each (N, ...) with the same N, e.g.
            ``{"src": task.src, "tgt": task.tgt_in, "targets": task.tgt_out}``.
        batch_size: B, distinct examples per batch (B <= N).
        generator: a CPU torch.Generator, for repeatable batches.

    Returns:
        A function returning a dict with the same keys, each value (B, ...).
    """
    if not isinstance(tensors, Mapping) or not tensors:
        raise ValueError(
            "tensors must be a non-empty dict of name -> (N, ...) tensor, e.g. "
            f"{{'ids': inputs, 'targets': targets}}; got {type(tensors).__name__}"
        )
    require_positive_int("batch_size", batch_size)
    sizes = {}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"tensors[{name!r}] must be a tensor of shape (N, ...)")
        sizes[name] = value.shape[0]
    if len(set(sizes.values())) != 1:
        shapes = {name: shape_of(value) for name, value in tensors.items()}
        raise ValueError(f"every tensor needs the same number of examples N, got {shapes}")
    n = next(iter(sizes.values()))
    if batch_size > n:
        raise ValueError(f"batch_size={batch_size} is larger than the {n} examples available")

    def batch() -> dict[str, torch.Tensor]:
        rows = torch.randperm(n, generator=generator)[:batch_size]  # (B,) distinct examples
        return {name: value[rows.to(value.device)] for name, value in tensors.items()}

    return batch


# --------------------------------------------------------------------------------------------
# History


@dataclass
class TrainHistory:
    """What :func:`train` measured, as plain lists, ready to plot.

    Attributes:
        steps: 1, 2, ... for every update done.
        train_losses: the loss of the batch each update used (noisy).
        lrs: the learning rate of each update.
        grad_norms: the global gradient norm of each update, before clipping.
        step_times: seconds each update took (batch, forward, backward, optimizer step).
        eval_steps: how many updates were done at each evaluation (0 = before training).
        eval_train_losses: mean loss over ``eval_iters`` training batches, model in eval mode.
        val_losses: the same on validation batches (empty without ``val_batches``).
        elapsed_s: wall-clock seconds of the whole run, evaluations included.
        train_time_s: seconds spent in updates only, ``sum(step_times)``.
        stopped_by: ``"max_iters"`` or ``"time_budget"`` (fewer updates than max_iters
            because of the clock).
    """

    steps: list[int] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_train_losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    train_time_s: float = 0.0
    stopped_by: str = "max_iters"

    @property
    def ms_per_iter(self) -> float:
        """Mean milliseconds per update, evaluations excluded."""
        return 1000.0 * self.train_time_s / max(len(self.steps), 1)

    @property
    def final_train_loss(self) -> float | None:
        """The last evaluation's training loss."""
        return self.eval_train_losses[-1] if self.eval_train_losses else None

    @property
    def final_val_loss(self) -> float | None:
        """The last evaluation's validation loss."""
        return self.val_losses[-1] if self.val_losses else None


# --------------------------------------------------------------------------------------------
# The loop


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    raise ValueError("model has no parameters to train")


def _check_batch(batch: object, where: str, model: nn.Module) -> None:
    """Turn a batch function's mistake into a message naming it."""
    if not isinstance(batch, Mapping):
        what = type(batch).__name__
        if isinstance(batch, tuple | list):
            what = f"a {what} of {len(batch)} items"
        raise ValueError(
            f"{where} must return a dict of keyword arguments for the model, such as "
            f"{{'ids': x, 'targets': y}}, but returned {what}. For (x, y) pairs from get_batch "
            f"use lm_batches(...) or return dict(ids=x, targets=y)"
        )
    if "targets" not in batch:
        raise ValueError(
            f"{where} returned a dict with keys {sorted(batch)} but no 'targets': the model "
            f"only computes a loss when it is given targets"
        )
    try:
        inspect.signature(model.forward).bind(**batch)
    except TypeError as err:
        raise ValueError(
            f"{where} returned keys {sorted(batch)}, which do not match "
            f"{type(model).__name__}.forward{inspect.signature(model.forward)}: {err}"
        ) from None


def _to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for name, value in batch.items()
    }


def _loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    loss = getattr(model(**batch), "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            f"model(**batch) must return an output whose .loss is a scalar tensor, got "
            f"{type(loss).__name__}{'' if loss is None else ' ' + shape_of(loss)}"
        )
    return loss


@torch.no_grad()
def estimate_loss(model: nn.Module, batches: BatchFn, iters: int) -> float:
    """Mean loss over ``iters`` batches with the model in eval mode (no dropout) and no
    gradients; the model's mode is restored afterwards.

    Args:
        model: any model whose ``model(**batch).loss`` is the mean loss of a batch.
        batches: a batch function.
        iters: number of batches to average.
    """
    require_positive_int("iters", iters)
    device = _model_device(model)
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for _ in range(iters):
            total += _loss_of(model, _to_device(batches(), device)).item()
    finally:
        model.train(was_training)
    return total / iters


def _planned_updates(
    done: int, now: float, deadline: float, step_s: float, eval_s: float, config: TrainConfig
) -> int:
    """How many updates in total fit in the time left: each further update costs ``step_s``,
    every ``eval_interval``-th also an evaluation, and the final evaluation must fit too."""
    left = deadline - now - eval_s
    per_update = step_s + eval_s / config.eval_interval
    more = max(int(left / per_update), 0) if per_update > 0 else config.max_iters
    return min(done + more, config.max_iters)


def train(
    model: nn.Module,
    train_batches: BatchFn,
    config: TrainConfig | None = None,
    *,
    val_batches: BatchFn | None = None,
    progress: bool = True,
    desc: str = "training",
) -> TrainHistory:
    """Train ``model`` with AdamW, warm-up + cosine learning rate and gradient clipping.

    Args:
        model: a course_lib model (or any module whose ``model(**batch).loss`` is a scalar
            loss), already on the device to train on.
        train_batches: a function returning a training batch: a dict of keyword arguments
            for the model including ``targets`` (see :func:`lm_batches`,
            :func:`random_batches`).
        config: a :class:`TrainConfig` (defaults to ``TrainConfig()``).
        val_batches: the same for validation batches; evaluated every ``eval_interval``
            updates if given.
        progress: show a progress bar with the live loss (tqdm; False for none).
        desc: the progress bar's label.

    Returns:
        A :class:`TrainHistory`. The model is left in the mode (train/eval) it came in.
    """
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    for name, fn in (("train_batches", train_batches), ("val_batches", val_batches)):
        if fn is not None and not callable(fn):
            raise ValueError(
                f"{name} must be a function that returns a batch (a dict), got "
                f"{type(fn).__name__}; wrap data with lm_batches(...) or random_batches(...)"
            )
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device = _model_device(model)
    fused = {"fused": True} if device.type == "cuda" else {}  # one kernel for all parameters
    optimizer = torch.optim.AdamW(
        param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas, **fused
    )
    history = TrainHistory()
    was_training = model.training
    clock_start = time.perf_counter()
    deadline = None if config.time_budget is None else clock_start + config.time_budget
    planned = config.max_iters  # updates to do; with a time budget, re-estimated on the way
    decay_iters = config.lr_decay_iters or config.max_iters
    eval_s = 0.0

    def evaluate(done: int) -> None:
        nonlocal eval_s
        started = time.perf_counter()
        history.eval_steps.append(done)
        history.eval_train_losses.append(estimate_loss(model, train_batches, config.eval_iters))
        if val_batches is not None:
            history.val_losses.append(estimate_loss(model, val_batches, config.eval_iters))
        eval_s = time.perf_counter() - started

    def replan(done: int) -> None:
        nonlocal planned, decay_iters
        # The speed of the last 50 updates, so a machine that slows down (or speeds up) on
        # the way still ends its cosine when the budget runs out.
        recent = history.step_times[-50:]
        step_s = sum(recent) / len(recent)
        planned = max(
            _planned_updates(done, time.perf_counter(), deadline, step_s, eval_s, config), done
        )
        decay_iters = planned  # stretch the cosine over the updates that fit
        bar.total = planned

    first = train_batches()
    _check_batch(first, "train_batches()", model)
    if val_batches is not None:
        _check_batch(val_batches(), "val_batches()", model)

    bar = tqdm(total=planned, desc=desc, disable=not progress, leave=True)
    try:
        model.train()
        evaluate(0)
        postfix = {}
        if val_batches is not None:
            postfix["val"] = f"{history.val_losses[-1]:.3f}"
        step = 0
        while step < planned:
            started = time.perf_counter()
            batch = first if step == 0 else train_batches()
            lr = lr_schedule(
                step, lr=config.lr, min_lr=config.min_lr, warmup_iters=config.warmup_iters,
                decay_iters=decay_iters,
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = _loss_of(model, _to_device(batch, device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # clip_grad_norm_ returns the norm *before* clipping: record it either way
            max_norm = config.grad_clip if config.grad_clip is not None else math.inf
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            loss_value = loss.item()  # waits for the device: the step's time is now complete
            history.step_times.append(time.perf_counter() - started)
            history.train_time_s += history.step_times[-1]
            step += 1
            if not math.isfinite(loss_value):
                raise FloatingPointError(
                    f"the loss became {loss_value} at update {step}: training diverged. Try a "
                    f"lower lr (this update used {lr:.2e}) or a smaller grad_clip"
                )
            history.steps.append(step)
            history.train_losses.append(loss_value)
            history.lrs.append(lr)
            history.grad_norms.append(float(grad_norm))
            postfix["loss"] = f"{loss_value:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)

            out_of_time = deadline is not None and time.perf_counter() + eval_s > deadline
            if step % config.eval_interval == 0 or step >= planned or out_of_time:
                evaluate(step)
                if val_batches is not None:
                    postfix["val"] = f"{history.val_losses[-1]:.3f}"
                bar.set_postfix(postfix)
                if out_of_time:
                    break
            if deadline is not None and step >= min(20, config.eval_interval):
                replan(step)  # re-estimate after every update, once the speed is measured
        if history.eval_steps[-1] != step:
            evaluate(step)
        if deadline is not None and step < config.max_iters:
            history.stopped_by = "time_budget"  # the clock, not max_iters, set the length
    finally:
        bar.close()
        model.train(was_training)
        history.elapsed_s = time.perf_counter() - clock_start
    return history
