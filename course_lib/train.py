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
Arguments are checked before any work, each batch's keys and types where it is used; no check
draws a random number or a batch, and the loop reads no value but the loss it records (on a
GPU, one wait a step).

A run can be saved and continued (:func:`save_checkpoint`, :func:`load_checkpoint`, or
``train(..., checkpoint="run.pt", resume=True)``): a checkpoint holds the weights, the
optimizer's moments, the number of updates done, the history, and every random state the run
draws from (torch's global generator, which dropout uses, the device's, and the batch
functions' generators), so the continued run takes the same steps as one that never stopped.
A refused file (checked whole before anything is restored) leaves everything as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_callable,
    require_generator,
    require_instance,
    require_int,
    require_non_negative_int,
    require_non_negative_number,
    require_positive_int,
    require_positive_number,
    require_probability,
    require_writable_file,
    shape_of,
)
from .corpus import check_batch, get_batch

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
    check_model(model)
    require_instance("config", config, TrainConfig, "a TrainConfig(...)")
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
        :func:`course_lib.corpus.get_batch`. Its ``generator`` attribute is ``generator``:
        :func:`train`'s checkpoints save and restore where it is.
    """
    check_batch(data, batch_size, block_size)  # get_batch's checks, now: no draw, no batch
    require_generator("generator", generator)

    def batch() -> dict[str, torch.Tensor]:
        x, y = get_batch(data, batch_size, block_size, generator=generator)  # (B, T), (B, T)
        return {"ids": x, "targets": y}

    batch.generator = generator
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
        A function returning a dict with the same keys, each value (B, ...). Its ``generator``
        attribute is ``generator`` (as for :func:`lm_batches`).
    """
    n = require_examples(tensors, batch_size)
    require_generator("generator", generator)

    def batch() -> dict[str, torch.Tensor]:
        rows = torch.randperm(n, generator=generator)[:batch_size]  # (B,) distinct examples
        return {name: value[rows.to(value.device)] for name, value in tensors.items()}

    batch.generator = generator
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


def _next_batch(batches: BatchFn, name: str, device: torch.device) -> dict[str, torch.Tensor]:
    """The next batch of ``batches`` (called ``name`` in errors), its form checked from keys
    and types alone (no values read, so no wait for a GPU), moved to ``device``."""
    batch = batches()
    check_batch_form(name, batch)
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}


def _loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(**batch).loss``; its type and shape are checked (no device sync)."""
    loss = getattr(model(**batch), "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"model(**batch).loss must be a 0-D tensor, got {loss!r:.60}")
    if loss.dim() != 0:
        raise ValueError(f"model(**batch).loss must be 0-D (a mean), got shape {shape_of(loss)}")
    return loss


@torch.no_grad()
def estimate_loss(model: nn.Module, batches: BatchFn, iters: int, *,
                  name: str = "batches") -> float:
    """Mean loss over ``iters`` batches with the model in eval mode (no dropout) and no
    gradients; the model's mode is restored afterwards.

    Args:
        model: any model whose ``model(**batch).loss`` is the mean loss of a batch.
        batches: a batch function.
        iters: number of batches to average.
        name: how messages name the batch function (``train`` says ``val_batches``).
    """
    check_training(model, iters=iters, batches=batches)
    device, was_training = _model_device(model), model.training
    model.eval()
    try:
        total = sum(_loss_of(model, _next_batch(batches, name, device)).item()
                    for _ in range(iters))
    finally:
        model.train(was_training)
    return total / iters


def _evaluate(model: nn.Module, history: TrainHistory, done: int, batches: dict,
              iters: int, callback: Callable | None) -> None:
    """Record the mean train (and validation) loss after ``done`` updates, then call back."""
    history.eval_steps.append(done)
    for name, losses in (("train", history.eval_train_losses), ("val", history.val_losses)):
        if batches[name] is not None:
            losses.append(estimate_loss(model, batches[name], iters, name=f"{name}_batches"))
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
    checkpoint: str | os.PathLike | None = None,
    resume: bool = False,
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
        checkpoint: a file to save the run to (:func:`save_checkpoint`) after every
            evaluation but the first, replacing the previous one. Its folder must exist.
        resume: if the ``checkpoint`` file exists, continue the run it holds instead of
            starting afresh: the model, optimizer, history and random states are restored and
            training goes on from the update after the saved one. Build the model and the
            batch functions as before (the same generators, seeded or not: their states are
            restored); the config must be the one the file was written with.

    Returns:
        A :class:`TrainHistory` (of the whole run, when resumed). The model is left in the
        mode (train/eval) it came in.
    """
    check_training(model, config, progress=progress, desc=desc, train_batches=train_batches,
                   val_batches=val_batches, callback=callback)
    check_checkpointing(checkpoint, resume)
    config = TrainConfig() if config is None else config
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device, was_training, started_run = _model_device(model), model.training, time.perf_counter()
    optimizer = make_optimizer(model, config)
    max_norm = config.grad_clip or math.inf  # inf: clip_grad_norm_ only measures the norm
    history, batches = TrainHistory(), {"train": train_batches, "val": val_batches}
    generators = batch_generators(train_batches, val_batches)
    start = 0  # updates done
    if resume and Path(checkpoint).exists():  # every random state as the saved run left it
        saved = load_checkpoint(checkpoint, model, optimizer, generators=generators, config=config)
        start, history = saved.step, saved.history or history
    before = history.elapsed_s  # seconds spent before a restart
    bar = tqdm(total=config.max_iters, initial=start, desc=desc, disable=not progress, leave=True)
    try:
        model.train()
        if start == 0:
            _evaluate(model, history, 0, batches, config.eval_iters, callback)
        for step in range(start, config.max_iters):
            started = time.perf_counter()
            batch = _next_batch(train_batches, "train_batches", device)
            lr = config.lr_at(step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = _loss_of(model, batch)  # forward pass and loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # before clipping
            optimizer.step()
            _record(history, step + 1, loss.item(), lr, grad_norm, started)  # waits for the GPU
            bar.set_postfix(loss=f"{history.train_losses[-1]:.3f}", refresh=False)
            bar.update(1)
            if (step + 1) % config.eval_interval == 0 or step + 1 == config.max_iters:
                _evaluate(model, history, step + 1, batches, config.eval_iters, callback)
                if checkpoint is not None:
                    history.elapsed_s = before + time.perf_counter() - started_run
                    save_checkpoint(checkpoint, model, optimizer, step=step + 1,
                                    history=history, generators=generators, config=config)
    finally:
        bar.close()
        history.elapsed_s = before + time.perf_counter() - started_run
        model.train(was_training)
    return history


# --- checkpoints


@dataclass(frozen=True)
class Checkpoint:
    """What :func:`load_checkpoint` read besides the states it restored in place.

    Attributes:
        step: updates done when it was saved.
        history: the run's :class:`TrainHistory` so far (None if none was saved).
        config: the :class:`TrainConfig` as a dict (None if none was saved).
    """

    step: int
    history: TrainHistory | None
    config: dict | None


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Activation checkpointing (chapter 14), in place: each of ``model.blocks`` keeps only its
    input for the backward pass and runs its forward pass again there
    (``torch.utils.checkpoint``). The same outputs and gradients; fewer activations kept, more
    FLOPs. Returns ``model``."""
    require_instance("model", model, nn.Module, "a course_lib model")
    require_instance("model.blocks", getattr(model, "blocks", None), nn.ModuleList,
                     "the model's blocks (an nn.ModuleList)")
    for block in model.blocks:  # forward(x, **kw) = checkpoint(block's forward, x, **kw)
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def batch_generators(*batch_functions: BatchFn | None) -> list[torch.Generator]:
    """The distinct generators the batch functions draw from (their ``generator`` attribute,
    set by :func:`lm_batches` and :func:`random_batches`), in order."""
    found = [getattr(fn, "generator", None) for fn in batch_functions]
    return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer, *,
    step: int, history: TrainHistory | None = None,
    generators: Sequence[torch.Generator] = (), config: TrainConfig | None = None,
) -> None:
    """Save everything a run needs to continue exactly: the weights (and the model's config,
    if it has one), the optimizer's state (AdamW's moments and step counts), ``step`` (the
    updates done), the history, torch's global random state (dropout, and batches drawn
    without a generator), the model device's random state (CUDA or MPS), the ``generators``
    the batches are drawn with, and the config.
    The file is written next to ``path``, flushed to the disk and then renamed, so a run
    stopped while saving leaves the previous checkpoint whole.
    """
    check_checkpoint(path, model, optimizer, generators, config, saving=True)
    require_non_negative_int("step", step)
    require_instance("history", history, (TrainHistory, type(None)),
                     "a TrainHistory or None", "pass the history train() returned")
    state = {
        "model": model.state_dict(), "model_config": _plain(getattr(model, "config", None)),
        "optimizer": optimizer.state_dict(), "optimizer_class": type(optimizer).__name__,
        "step": int(step), "history": _plain(history), "config": _plain(config),
        "rng": torch.get_rng_state(), "device_rng": _device_rng(_model_device(model)),
        "generators": [g.get_state() for g in generators],
    }
    _write_atomically(state, Path(path))


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    *, generators: Sequence[torch.Generator] | None = None, config: TrainConfig | None = None,
) -> Checkpoint:
    """Restore a :func:`save_checkpoint` file into ``model`` (and ``optimizer``), and set
    torch's, the device's and the ``generators``' random states to the saved ones. Build
    the model and the optimizer as for the saved run first. ``generators`` must be as many
    as were saved, in the same order (None: leave them alone, e.g. to inspect the weights).
    With ``config``, refuse a file written by a run with another config: the continued run
    would not be the same run. The whole file is checked against the model, the optimizer
    and the generators before any of them is touched: a refused file changes nothing.

    Returns:
        A :class:`Checkpoint` with the number of updates done, the history and the config.
    """
    check_checkpoint(path, model, optimizer, generators, config, saving=False)
    state = require_checkpoint(path, model, optimizer, generators, config)
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    _set_device_rng(_model_device(model), state["device_rng"])
    if generators is not None:  # None: the batch generators are left as they are
        for generator, saved in zip(generators, state["generators"], strict=True):
            generator.set_state(saved)
    history = TrainHistory(**state["history"]) if state["history"] is not None else None
    return Checkpoint(state["step"], history, state["config"])


def _write_atomically(state: dict, path: Path) -> None:
    """``torch.save(state)`` to ``path``'s ``.partial`` twin, on the disk (fsync) before it is
    renamed over ``path``: a save stopped at any moment leaves the old file or the new one."""
    partial = path.with_name(path.name + ".partial")
    try:
        with open(partial, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # the bytes are on the disk before the name points at them
        os.replace(partial, path)  # one step: the old file or the new one, never half of one
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)  # and the rename itself survives a power cut


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries to the disk, where the OS and the file system allow it."""
    with contextlib.suppress(OSError):  # Windows cannot open a folder; some file systems refuse
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _plain(value: object) -> object:
    """``value`` in the plain types a ``weights_only`` load reads back: a dataclass becomes
    a dict, a numpy number a Python one, a tuple a list; another object its type's name."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value) if isinstance(value, (torch.dtype, torch.device)) else type(value).__name__


def _device_rng(device: torch.device) -> torch.Tensor | None:
    """The random state of the model's accelerator (dropout draws from it), if any."""
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.mps.get_rng_state() if device.type == "mps" else None


def _set_device_rng(device: torch.device, state: torch.Tensor | None) -> None:
    if state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    elif state is not None and device.type == "mps":
        torch.mps.set_rng_state(state)


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
    require_instance("model", model, nn.Module, "an nn.Module with trainable parameters")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no trainable parameters (requires_grad=True) to train")


def check_training(model: object, config: object = None, *, iters: object = 1,
                   progress: object = True, desc: object = "", **functions: object) -> None:
    """train's and estimate_loss's arguments: the model, the config, the options, the batch
    functions."""
    if not checks_wanted():
        return
    check_model(model)
    if config is not None:
        require_instance("config", config, TrainConfig, "a TrainConfig(...)")
    check_positive_ints(iters=iters)
    check_bools(progress=progress)
    require_instance("desc", desc, str, "a label (str) for the progress bar")
    for name, fn in functions.items():
        if fn is not None and name == "callback":
            require_callable(name, fn, "a function callback(step, history)", n_args=2)
        elif fn is not None:
            require_callable(name, fn, "a function")


def check_batch_form(name: str, batch: object) -> None:
    """What the batch function ``name`` returned: a dict of tensors (the model's keyword
    arguments) with a batch of ``targets``. Only keys, types and shapes are read."""
    if not (isinstance(batch, Mapping) and "targets" in batch):
        raise TypeError(f"{name}() must return a dict of the model's keyword arguments with "
                        f"'targets', got {batch!r:.40}")
    for key, value in batch.items():
        require_instance(f"{name}()[{key!r}]", value, torch.Tensor, "a torch.Tensor",
                         "convert it with torch.as_tensor")
    if batch["targets"].dim() == 0:
        raise ValueError(f"{name}()['targets'] must hold a batch (B, ...), got a 0-D tensor")


def check_checkpointing(checkpoint: object, resume: object) -> None:
    """train's ``checkpoint`` (None or a writable file path) and ``resume`` (a bool that
    needs a path)."""
    check_bools(resume=resume)
    if checkpoint is not None:
        require_instance("checkpoint", checkpoint, (str, os.PathLike), "a file path (str or Path)")
        require_writable_file("checkpoint", checkpoint)
    if resume and checkpoint is None:
        raise ValueError("resume=True needs the file to resume from: checkpoint='run.pt'")


def check_checkpoint(path: object, model: object, optimizer: object, generators: object,
                     config: object, *, saving: bool) -> None:
    """save_checkpoint's and load_checkpoint's arguments: saving needs an optimizer and a
    path whose folder exists, loading an existing file; ``optimizer`` may be None when
    loading, as may ``generators``."""
    require_instance("path", path, (str, os.PathLike), "a file path (str or Path)")
    check_model(model)
    if optimizer is not None or saving:
        require_instance("optimizer", optimizer, torch.optim.Optimizer,
                         "a torch.optim.Optimizer", "e.g. make_optimizer(model, config)")
    if isinstance(generators, torch.Generator) or \
            not isinstance(generators, (Sequence, type(None))):
        raise TypeError(f"generators must be a list of torch.Generator, got {generators!r:.40}")
    for i, generator in enumerate(generators or ()):
        require_instance(f"generators[{i}]", generator, torch.Generator, "a torch.Generator")
    require_instance("config", config, (TrainConfig, type(None)), "a TrainConfig or None")
    if saving:
        require_writable_file("path", path)
    elif not Path(path).is_file():
        raise FileNotFoundError(f"path {str(path)!r} is not a file: no checkpoint to load")


_SAVED = ("model", "optimizer", "step", "history", "config", "rng", "device_rng", "generators")


def require_checkpoint(path: str | os.PathLike, model: nn.Module,
                       optimizer: torch.optim.Optimizer | None,
                       generators: Sequence[torch.Generator] | None,
                       config: TrainConfig | None) -> dict:
    """The state saved in ``path``, if it is a :func:`save_checkpoint` file that fits
    ``model``, ``optimizer``, ``generators`` and ``config`` in every part (keys, shapes,
    dtypes, tied weights, parameter groups, random states). It only reads."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # whatever torch met: the bytes are not a checkpoint
        reason = (str(error).strip().splitlines() or [""])[0][:80]
        raise ValueError(f"{path} cannot be read as a checkpoint ({type(error).__name__}: "
                         f"{reason}): it is truncated (a save stopped before it finished) or "
                         "another kind of file. save_checkpoint writes what this reads") from None
    if isinstance(state, Mapping) and state and "model" not in state and \
            all(isinstance(value, torch.Tensor) for value in state.values()):
        raise ValueError(f"{path} holds a bare state_dict (torch.save(model.state_dict())), not "
                         "a save_checkpoint file: load it with "
                         "model.load_state_dict(torch.load(path))")
    if not (isinstance(state, Mapping) and all(key in state for key in _SAVED)):
        raise ValueError(f"{path} is not a save_checkpoint file: it holds {type(state).__name__}"
                         f" {sorted(state) if isinstance(state, Mapping) else ''}, not {_SAVED}")
    _require_model_fits(path, state, model)
    if optimizer is not None:
        _require_optimizer_fits(path, state, optimizer)
    _require_run_fits(path, state, model, generators, config)
    return state


def _differences(saved: Mapping, wanted: Mapping, prefix: str = "") -> list[str]:
    """``key=saved (now wanted)`` for every entry of two (nested) dicts that differs."""
    found = []
    for key in list(wanted) + [k for k in saved if k not in wanted]:
        a, b = saved.get(key), wanted.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}={a!r} (now {b!r})")
    return found


def _tied(state_dict: Mapping) -> set[frozenset[str]]:
    """The groups of entries that are one tensor (a tied output layer and embedding)."""
    groups: dict[int, set[str]] = {}
    for key, value in state_dict.items():
        if isinstance(value, torch.Tensor) and value.numel():
            groups.setdefault(value.data_ptr(), set()).add(key)
    return {frozenset(keys) for keys in groups.values() if len(keys) > 1}


def _require_model_fits(path: object, state: Mapping, model: nn.Module) -> None:
    """The saved weights fit ``model``: its config (if both have one), the same entries,
    each of the same shape and dtype, and the same tied weights."""
    saved_config, own_config = state.get("model_config"), _plain(getattr(model, "config", None))
    if isinstance(saved_config, Mapping) and isinstance(own_config, Mapping) and \
            saved_config != own_config:
        raise ValueError(f"{path} holds a model with another config: "
                         f"{', '.join(_differences(saved_config, own_config))}. Build the model "
                         "with the saved config")
    saved, own = state["model"], model.state_dict()
    missing, unexpected = sorted(own.keys() - saved.keys()), sorted(saved.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(f"{path} does not fit model: the model's {missing[:4]} are not in the "
                         f"file and the file's {unexpected[:4]} are not in the model "
                         f"({len(missing)} and {len(unexpected)}). Build the model as saved")
    tensors = [(key, saved[key], value) for key, value in own.items()
               if isinstance(value, torch.Tensor)]
    shapes = [f"{key} {shape_of(a)} (model: {shape_of(b)})" for key, a, b in tensors
              if a.shape != b.shape]
    if shapes:
        raise ValueError(f"{path} does not fit model: {'; '.join(shapes[:3])}"
                         f"{' ...' if len(shapes) > 3 else ''}. Build the model as saved")
    dtypes = [(key, a.dtype, b.dtype) for key, a, b in tensors if a.dtype != b.dtype]
    if dtypes:
        key, saved_dtype, dtype = dtypes[0]
        raise ValueError(f"{path} holds {saved_dtype} weights where model has {dtype} ({key}, "
                         f"{len(dtypes)} in all): convert the model first, "
                         f"model.to({saved_dtype})")
    if _tied(saved) != _tied(own):
        raise ValueError(f"{path} ties weights {sorted(map(sorted, _tied(saved)))}, model ties "
                         f"{sorted(map(sorted, _tied(own)))}: build the model as saved")


# the per-parameter buffers of torch's optimizers that have their parameter's shape
_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "momentum_buffer",
            "square_avg", "grad_avg", "acc_delta", "sum")


def _require_optimizer_fits(path: object, state: Mapping,
                            optimizer: torch.optim.Optimizer) -> None:
    """The saved optimizer state fits ``optimizer``: the same class, the same parameter
    groups (count and sizes) and moments of its parameters' shapes."""
    saved, kind = state["optimizer"], type(optimizer).__name__
    if state.get("optimizer_class", kind) != kind:
        raise ValueError(f"{path} holds the state of optimizer class "
                         f"{state['optimizer_class']}, but optimizer is {kind}: build the "
                         "optimizer as for the saved run")
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    own = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != own:
        raise ValueError(f"{path} holds an optimizer over parameter groups of {sizes} tensors, "
                         f"but optimizer has {own}: build it over the same parameters "
                         "(make_optimizer(model, config) for train's runs)")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wrong = [f"state[{i}][{name!r}] {shape_of(value)}" + (
             f" (parameter {shape_of(params[i])})" if i in range(len(params)) else
             f" (optimizer has {len(params)} parameters)")
             for i, moments in saved["state"].items() for name, value in moments.items()
             if name in _MOMENTS and (i not in range(len(params))
                                      or value.shape != params[i].shape)]
    if wrong:
        raise ValueError(f"{path} holds optimizer moments of other shapes: "
                         f"{'; '.join(wrong[:3])}: build it over the model's parameters")


def _require_run_fits(path: object, state: Mapping, model: nn.Module,
                      generators: Sequence | None, config: TrainConfig | None) -> None:
    """The random states fit torch's, the device's and ``generators``, the history is a
    TrainHistory's, and the config (if one is given to compare with) is ``config``."""
    saved = state["generators"]
    if generators is not None and len(saved) != len(generators):
        raise ValueError(f"{path} holds the states of {len(saved)} batch generator(s), but "
                         f"{len(generators)} were given: build the batch functions as for the "
                         "saved run (each with its generator, or none)")
    pairs = [("rng", state["rng"], torch.get_rng_state())]
    pairs += [(f"generators[{i}]", s, g.get_state()) for i, (s, g) in
              enumerate(zip(saved, generators or (), strict=False))]
    if state["device_rng"] is not None:
        pairs.append(("device_rng", state["device_rng"], _device_rng(_model_device(model))))
    for name, kept, own in pairs:
        if own is not None and not (isinstance(kept, torch.Tensor)
                                    and (kept.shape, kept.dtype) == (own.shape, own.dtype)):
            raise ValueError(f"{path} holds in {name} no random state that this torch "
                             f"can restore (it expects {own.dtype} {shape_of(own)})")
    if not (isinstance(state["step"], int) and state["step"] >= 0):
        raise ValueError(f"{path} holds step={state['step']!r}, not a number of updates")
    fields = {f.name for f in dataclasses.fields(TrainHistory)}
    if state["history"] is not None and set(state["history"]) != fields:
        raise ValueError(f"{path} holds a history with {sorted(state['history'])}, not a "
                         f"TrainHistory's {sorted(fields)}")
    saved_config, wanted = _plain(state["config"]), _plain(config)  # a tuple reads as a list
    if saved_config is not None and wanted is not None and saved_config != wanted:
        raise ValueError(f"{path} was written by a run with another config: "
                         f"{', '.join(_differences(saved_config, wanted))}. "
                         "Resume with the saved config, or pass resume=False to start afresh")


def require_examples(tensors: object, batch_size: object) -> int:
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
