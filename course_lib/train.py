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

A run can be saved and continued (:func:`save_checkpoint`, :func:`load_checkpoint`, or
``train(..., checkpoint="run.pt", resume=True)``): a checkpoint holds the weights, the
optimizer's moments, the number of updates done, the history, and every random state the run
draws from (torch's global generator, which dropout uses, the device's, and the batch
functions' generators), so the continued run takes the same steps as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
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
        :func:`course_lib.corpus.get_batch`. Its ``generator`` attribute is ``generator``:
        :func:`train`'s checkpoints save and restore where it is.
    """
    check_positive_ints(batch_size=batch_size, block_size=block_size)
    require_generator("generator", generator)
    get_batch(data[: block_size + 1], 1, block_size)  # checks data now, not at the first step

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
    n = check_random_batches(tensors, batch_size)
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
            evaluation but the first, replacing the previous one.
        resume: if the ``checkpoint`` file exists, continue the run it holds instead of
            starting afresh: the model, optimizer, history and random states are restored and
            training goes on from the update after the saved one. Build the model and the
            batch functions as before (the same generators, seeded or not: their states are
            restored); the config must be the one the file was written with.

    Returns:
        A :class:`TrainHistory` (of the whole run, when resumed). The model is left in the
        mode (train/eval) it came in.
    """
    config = TrainConfig() if config is None else config
    check_training(model, config, progress=progress, train_batches=train_batches,
                   val_batches=val_batches, callback=callback)
    check_checkpointing(checkpoint, resume)
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device, was_training, started_run = _model_device(model), model.training, time.perf_counter()
    optimizer = make_optimizer(model, config)
    max_norm = config.grad_clip or math.inf  # inf: clip_grad_norm_ only measures the norm
    first = check_first_batches(train_batches=train_batches, val_batches=val_batches)
    history, batches = TrainHistory(), {"train": train_batches, "val": val_batches}
    generators = batch_generators(train_batches, val_batches)
    start = 0  # updates done
    if resume and Path(checkpoint).exists():  # its random states undo check_first_batches' draws
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
    """Save everything a run needs to continue exactly: the weights, the optimizer's state
    (AdamW's moments and step counts), ``step`` (the updates done), the history, torch's
    global random state (dropout, and batches drawn without a generator), the model device's
    random state (CUDA or MPS), the ``generators`` the batches are drawn with, and the config.
    The file is written next to ``path`` and then renamed, so a run stopped while saving
    leaves the previous checkpoint whole.
    """
    check_checkpoint(path, model, optimizer, generators)
    require_non_negative_int("step", step)
    device = _model_device(model)
    state = {
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
        "history": dataclasses.asdict(history) if history is not None else None,
        "config": dataclasses.asdict(config) if config is not None else None,
        "rng": torch.get_rng_state(), "device_rng": _device_rng(device),
        "generators": [g.get_state() for g in generators],
    }
    partial = Path(path).with_name(Path(path).name + ".partial")
    torch.save(state, partial)
    os.replace(partial, path)  # one step: the old file or the new one, never half of one


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
    *, generators: Sequence[torch.Generator] | None = None, config: TrainConfig | None = None,
) -> Checkpoint:
    """Restore a :func:`save_checkpoint` file into ``model`` (and ``optimizer``), and set
    torch's, the device's and the ``generators``' random states to the saved ones. Build
    the model and the optimizer as for the saved run first. ``generators`` must be as many
    as were saved, in the same order (None: leave them alone, e.g. to inspect the weights).
    With ``config``, refuse a file written by a run with another config: the continued run
    would not be the same run.

    Returns:
        A :class:`Checkpoint` with the number of updates done, the history and the config.
    """
    check_checkpoint(path, model, optimizer, generators or ())
    state = torch.load(path, map_location="cpu", weights_only=True)
    check_resumable(path, state, generators, config)
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
                   progress: object = True, **functions: object) -> None:
    """train's and estimate_loss's arguments: the model, the config, the batch functions."""
    if not checks_wanted():
        return
    check_model(model)
    if config is not None:
        require_instance("config", config, TrainConfig, "a TrainConfig(...)")
    check_positive_ints(iters=iters)
    check_bools(progress=progress)
    for name, fn in functions.items():
        if fn is not None and name == "callback":
            require_callable(name, fn, "a function callback(step, history)", n_args=2)
        elif fn is not None:
            require_callable(name, fn, "a function")


def check_checkpointing(checkpoint: object, resume: object) -> None:
    """train's ``checkpoint`` (None or a path) and ``resume`` (a bool that needs a path)."""
    check_bools(resume=resume)
    if checkpoint is not None:
        require_instance("checkpoint", checkpoint, (str, os.PathLike), "a file path (str or Path)")
    if resume and checkpoint is None:
        raise ValueError("resume=True needs the file to resume from: checkpoint='run.pt'")


def check_checkpoint(path: object, model: object, optimizer: object,
                     generators: object) -> None:
    """save_checkpoint's and load_checkpoint's arguments."""
    require_instance("path", path, (str, os.PathLike), "a file path (str or Path)")
    check_model(model)
    if optimizer is not None:
        require_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer")
    if isinstance(generators, torch.Generator) or not isinstance(generators, Sequence):
        raise TypeError(f"generators must be a list of torch.Generator, got {generators!r:.40}")
    for i, generator in enumerate(generators):
        require_instance(f"generators[{i}]", generator, torch.Generator, "a torch.Generator")


def check_resumable(path: object, state: Mapping, generators: Sequence | None,
                    config: TrainConfig | None) -> None:
    """The file holds as many generator states as there are generators, and its config (if
    one is given to compare with) is ``config``."""
    if generators is not None and len(state["generators"]) != len(generators):
        raise ValueError(f"{path} holds the states of {len(state['generators'])} batch "
                         f"generator(s), but {len(generators)} were given: build the batch "
                         "functions as for the saved run (each with its generator, or none)")
    saved, wanted = state["config"], dataclasses.asdict(config) if config is not None else None
    if saved is not None and wanted is not None and saved != wanted:
        changed = ", ".join(f"{k}={saved[k]!r} (now {wanted[k]!r})" for k in wanted
                            if saved.get(k) != wanted[k])
        raise ValueError(f"{path} was written by a run with another config: {changed}. "
                         "Resume with the saved config, or pass resume=False to start afresh")


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
