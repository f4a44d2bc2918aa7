"""A small training loop for course_lib's models: AdamW, a warm-up then cosine learning rate,
gradient clipping, periodic evaluation and a progress bar.

One loop serves every model whose forward returns an output with a ``loss``. A batch is a dict
of keyword arguments for the model, always including ``targets``, so the loop only ever calls
``model(**batch).loss``:

    DecoderLM:       {"ids": x (B, T), "targets": y (B, T)}
    EncoderDecoder:  {"src": src (B, S), "tgt": tgt_in (B, T), "targets": tgt_out (B, T)}

The loop asks a *batch function* (no arguments, returns one such dict) for every batch:
:func:`lm_batches` makes one from a token stream, :func:`random_batches` from tensors of
examples. The loop never chooses a device: it moves each batch to wherever the model is.
Arguments are checked once, before the loop; the loop reads no tensor values beyond the loss
it records, so on a GPU it waits for the device once a step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_callable,
    require_generator,
    require_int,
    require_non_negative_int,
    require_non_negative_number,
    require_positive_int,
    require_positive_number,
    require_probability,
    shape_of,
)
from .corpus import get_batch

Batch = Mapping[str, torch.Tensor]
BatchFn = Callable[[], Batch]


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of :func:`train`.

    Attributes:
        max_iters: number of optimizer updates.
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: learning rate at the end of the cosine decay.
        warmup_iters: updates over which the learning rate rises linearly to lr (Adam's early
            moment estimates are noisy, so big first steps can wreck the initialisation).
        lr_decay_iters: the update by which the cosine reaches min_lr (None: max_iters).
        weight_decay: AdamW's decoupled weight decay, on weight matrices only
            (:func:`param_groups`).
        betas: Adam's moment decay rates; 0.99 for the second moment averages the squared
            gradients over about 100 updates, which suits a short run.
        grad_clip: rescale the gradient whenever its global L2 norm exceeds this (None: never).
        eval_interval: evaluate every this many updates (also before the first and after the
            last).
        eval_iters: batches averaged per evaluation.
        seed: seeds torch's global generator at the start (dropout); None leaves it alone.
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

    def __post_init__(self) -> None:
        check_train_config(self)
        object.__setattr__(self, "betas", tuple(self.betas))  # a list becomes a tuple

    def lr_at(self, step: int) -> float:
        """The learning rate of update ``step`` (0-based) under this config's schedule."""
        return lr_schedule(step, lr=self.lr, min_lr=self.min_lr, warmup_iters=self.warmup_iters,
                           decay_iters=self.lr_decay_iters or self.max_iters)


def lr_schedule(
    step: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int
) -> float:
    """Linear warm-up, then cosine decay to ``min_lr``, then constant ``min_lr``.

    Update ``step`` (0-based) uses ``lr * (step + 1) / warmup_iters`` during the warm-up, so
    update ``warmup_iters - 1`` is the first at the peak; the cosine then reaches ``min_lr``
    exactly at update ``decay_iters - 1``.

    Returns:
        The learning rate, a float.
    """
    check_schedule(lr, min_lr, warmup_iters, decay_iters, "decay_iters")
    require_int("step", step, minimum=0)
    if step < warmup_iters:
        return lr * (step + 1) / warmup_iters
    if step >= decay_iters - 1:
        return min_lr
    # lr_t = min_lr + (lr - min_lr) (1 + cos(pi p)) / 2, p = progress through the decay
    progress = (step + 1 - warmup_iters) / (decay_iters - warmup_iters)  # in (0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split the parameters into AdamW groups with and without weight decay.

    Decay regularises the matrices that multiply activations (two or more dimensions). Left
    alone are biases and norm gains (1-D: decaying a gain would fight the normalisation) and
    embedding tables, including a tied output layer (a rare token's row would shrink every
    step it is not used).

    Returns:
        ``[{"params": decayed, "weight_decay": weight_decay}, {"params": rest,
        "weight_decay": 0.0}]``, each parameter once.
    """
    check_model(model)
    require_non_negative_number("weight_decay", weight_decay)
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) tensor once
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """The AdamW optimizer :func:`train` uses: :func:`param_groups`, ``config.lr`` and
    ``config.betas``. On a CPU or CUDA it is PyTorch's fused AdamW (one kernel for every
    parameter; the same update, a test checks it)."""
    fused = _model_device(model).type in ("cpu", "cuda")
    return torch.optim.AdamW(param_groups(model, config.weight_decay), lr=config.lr,
                             betas=config.betas, fused=fused or None)


def lm_batches(
    data: torch.Tensor, batch_size: int, block_size: int, *,
    generator: torch.Generator | None = None,
) -> BatchFn:
    """A batch function for a language model on one token stream.

    Args:
        data: (N,) token ids.
        batch_size, block_size: B and T of each batch.
        generator: a CPU torch.Generator, for repeatable batches.

    Returns:
        A function returning ``{"ids": x, "targets": y}`` with x, y (B, T) from
        :func:`course_lib.corpus.get_batch`.
    """
    check_positive_ints(batch_size=batch_size, block_size=block_size)
    require_generator("generator", generator)
    get_batch(data[: block_size + 1], 1, block_size)  # checks data now, not at the first step

    def batch() -> dict[str, torch.Tensor]:
        x, y = get_batch(data, batch_size, block_size, generator=generator)  # (B, T), (B, T)
        return {"ids": x, "targets": y}

    return batch


def random_batches(
    tensors: Mapping[str, torch.Tensor], batch_size: int, *,
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
    n = check_random_batches(tensors, batch_size)
    require_generator("generator", generator)

    def batch() -> dict[str, torch.Tensor]:
        rows = torch.randperm(n, generator=generator)[:batch_size]  # (B,) distinct examples
        return {name: value[rows.to(value.device)] for name, value in tensors.items()}

    return batch


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


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor)
            else value for name, value in batch.items()}


def _loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(**batch).loss``; its type and shape are checked (no device sync)."""
    loss = getattr(model(**batch), "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"model(**batch).loss must be a 0-D tensor, got {loss!r:.60}")
    if loss.dim() != 0:
        raise ValueError(f"model(**batch).loss must be 0-D (a mean), got shape {shape_of(loss)}")
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
    check_training(model, iters=iters, batches=batches)
    device, was_training = _model_device(model), model.training
    model.eval()
    try:
        total = sum(_loss_of(model, _to_device(batches(), device)).item() for _ in range(iters))
    finally:
        model.train(was_training)
    return total / iters


def _evaluate(model: nn.Module, history: TrainHistory, done: int, batches: dict,
              iters: int, callback: Callable | None) -> None:
    """Record the mean train (and validation) loss after ``done`` updates, then call back."""
    history.eval_steps.append(done)  # the model checks every evaluation batch
    history.eval_train_losses.append(estimate_loss(model, batches["train"], iters))
    if batches["val"] is not None:
        history.val_losses.append(estimate_loss(model, batches["val"], iters))
    if callback is not None:
        was_training = model.training
        model.eval()
        try:
            callback(done, history)
        finally:
            model.train(was_training)


def train(
    model: nn.Module,
    train_batches: BatchFn,
    config: TrainConfig | None = None,
    *,
    val_batches: BatchFn | None = None,
    progress: bool = True,
    desc: str = "training",
    callback: Callable[[int, TrainHistory], object] | None = None,
) -> TrainHistory:
    """Train ``model`` with AdamW, warm-up + cosine learning rate and gradient clipping.

    Args:
        model: a course_lib model (or any module whose ``model(**batch).loss`` is a scalar
            loss), already on the device to train on.
        train_batches: a function returning a training batch: a dict of keyword arguments
            for the model including ``targets`` (:func:`lm_batches`, :func:`random_batches`).
        config: a :class:`TrainConfig` (defaults to ``TrainConfig()``).
        val_batches: the same for validation batches, evaluated every ``eval_interval``.
        progress: show a progress bar with the live loss (tqdm).
        desc: the progress bar's label.
        callback: called as ``callback(step, history)`` after every evaluation (step 0, every
            ``eval_interval`` updates and after the last), model in eval mode: e.g. to redraw
            a live plot. Its return value is ignored.

    Returns:
        A :class:`TrainHistory`. The model is left in the mode (train/eval) it came in.
    """
    config = TrainConfig() if config is None else config
    check_training(model, config, progress=progress, train_batches=train_batches,
                   val_batches=val_batches, callback=callback)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device, was_training, started_run = _model_device(model), model.training, time.perf_counter()
    optimizer = make_optimizer(model, config)
    max_norm = config.grad_clip or math.inf  # inf: clip_grad_norm_ only measures the norm
    first = check_first_batches(train_batches=train_batches, val_batches=val_batches)
    history, batches = TrainHistory(), {"train": train_batches, "val": val_batches}
    bar = tqdm(total=config.max_iters, desc=desc, disable=not progress, leave=True)
    try:
        model.train()
        _evaluate(model, history, 0, batches, config.eval_iters, callback)
        for step in range(config.max_iters):
            started = time.perf_counter()
            batch = first if step == 0 else train_batches()
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = _loss_of(model, _to_device(batch, device))  # forward pass and loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # before clipping
            optimizer.step()
            _record(history, step + 1, loss.item(), lr, grad_norm, started)  # waits for the GPU
            bar.set_postfix(loss=f"{history.train_losses[-1]:.3f}", refresh=False)
            bar.update(1)
            if (step + 1) % config.eval_interval == 0 or step + 1 == config.max_iters:
                _evaluate(model, history, step + 1, batches, config.eval_iters, callback)
    finally:
        bar.close()
        history.elapsed_s = time.perf_counter() - started_run
        model.train(was_training)
    return history


def _record(history: TrainHistory, step: int, loss: float, lr: float,
            grad_norm: torch.Tensor, started: float) -> None:
    """Log update ``step`` (1-based): its loss, learning rate, gradient norm and time."""
    history.step_times.append(time.perf_counter() - started)
    history.train_time_s += history.step_times[-1]
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss became {loss} at update {step}: try a lower lr")
    history.steps.append(step)
    history.train_losses.append(loss)
    history.lrs.append(lr)
    history.grad_norms.append(float(grad_norm))


# --- argument checks


def check_schedule(lr: object, min_lr: object, warmup_iters: object, decay_iters: object,
                   decay_name: str) -> None:
    """A schedule that warms up to ``lr`` and then decays to ``min_lr`` by ``decay_iters``."""
    if not checks_wanted():
        return
    require_positive_number("lr", lr)
    require_non_negative_number("min_lr", min_lr)
    require_non_negative_int("warmup_iters", warmup_iters)
    require_positive_int(decay_name, decay_iters)
    problem = (f"min_lr must be between 0 and lr={lr}, got {min_lr}" if min_lr > lr else
               f"warmup_iters={warmup_iters} is larger than {decay_name}={decay_iters}: the "
               "learning rate would never reach lr" if warmup_iters > decay_iters else "")
    if problem:
        raise ValueError(problem)


def check_train_config(c: TrainConfig) -> None:
    check_positive_ints(**{k: getattr(c, k) for k in ("max_iters", "eval_interval", "eval_iters")})
    decay = ("max_iters", c.max_iters) if c.lr_decay_iters is None else \
        ("lr_decay_iters", c.lr_decay_iters)
    check_schedule(c.lr, c.min_lr, c.warmup_iters, decay[1], decay[0])
    require_non_negative_number("weight_decay", c.weight_decay)
    if not isinstance(c.betas, Sequence) or isinstance(c.betas, str):
        raise TypeError(f"betas must be a pair (beta1, beta2) such as (0.9, 0.99), got {c.betas!r}")
    if len(c.betas) != 2:
        raise ValueError(f"betas must have two entries (beta1, beta2), got {c.betas!r}")
    for i, beta in enumerate(c.betas):
        require_probability(f"betas[{i}]", beta)
    if c.grad_clip is not None:
        require_positive_number("grad_clip", c.grad_clip, "or None for no clipping")
    if c.seed is not None:
        require_int("seed", c.seed)


def check_model(model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module with trainable parameters, got {model!r:.40}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters (requires_grad=True) to train")


def check_training(model: object, config: object = None, *, iters: object = 1,
                   progress: object = True, **functions: object) -> None:
    """train's and estimate_loss's arguments: the model, the config, the batch functions."""
    if not checks_wanted():
        return
    check_model(model)
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig(...), got {type(config).__name__}")
    check_positive_ints(iters=iters)
    check_bools(progress=progress)
    for name, fn in functions.items():
        if fn is not None and name == "callback":
            require_callable(name, fn, "a function callback(step, history)", n_args=2)
        elif fn is not None:
            require_callable(name, fn, "a function")


def check_random_batches(tensors: object, batch_size: object) -> int:
    """``tensors`` a dict of (N, ...) tensors with one N >= batch_size; returns N."""
    require_positive_int("batch_size", batch_size)
    if not (isinstance(tensors, Mapping) and all(isinstance(t, torch.Tensor)
                                                 for t in tensors.values())):
        raise TypeError(f"tensors must be a dict of name -> (N, ...) tensor, got {tensors!r:.50}")
    sizes = {len(t) if t.dim() else 0 for t in tensors.values()}
    if len(sizes) != 1 or not 1 <= batch_size <= min(sizes):
        shapes = {name: shape_of(t) for name, t in tensors.items()}
        raise ValueError(f"tensors need one number of rows N >= batch_size, got {shapes}")
    return sizes.pop()


def check_first_batches(**functions: BatchFn | None) -> Batch:
    """Draw one batch of each function, in order, and check it; return the first one."""
    batches = [(name, fn()) for name, fn in functions.items() if fn is not None]
    for name, batch in batches:
        if not (isinstance(batch, Mapping) and "targets" in batch):
            raise TypeError(f"{name}() must return a dict with 'targets', got {batch!r:.40}")
    return batches[0][1]
