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

Arguments are checked once, before the loop: the config when it is built, the model and the
batch functions (and the first batch of each) when :func:`train` starts. The loop itself reads
no tensor values beyond the loss it records, so on a GPU it waits for the device once a step.
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ._validate import (
    WrongTypeError,
    require_bool,
    require_callable,
    require_generator,
    require_int,
    require_integer_tensor,
    require_ndim,
    require_non_negative_int,
    require_non_negative_number,
    require_positive_int,
    require_positive_number,
    require_probability,
    shape_of,
)
from .corpus import get_batch
from .models import DecoderLM, EncoderDecoder

Batch = Mapping[str, torch.Tensor]
BatchFn = Callable[[], Batch]


# --------------------------------------------------------------------------------------------
# Configuration and learning-rate schedule


def _require_betas(betas: object) -> tuple[float, float]:
    """Adam's (beta1, beta2), each in [0, 1), as a tuple."""
    if isinstance(betas, str) or not isinstance(betas, Sequence):
        raise WrongTypeError(
            f"betas must be a pair of numbers (beta1, beta2) in [0, 1) such as (0.9, 0.99), got "
            f"{betas!r} ({type(betas).__name__})"
        )
    if len(betas) != 2:
        raise ValueError(
            f"betas must be two numbers (beta1, beta2) in [0, 1) such as (0.9, 0.99), got "
            f"{len(betas)} value(s): {betas!r}"
        )
    return require_probability("betas[0]", betas[0]), require_probability("betas[1]", betas[1])


def _require_positive_or_none(name: str, value: object, unit: str) -> None:
    """A number > 0 (in ``unit``), for settings that also accept None (checked by the caller)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WrongTypeError(
            f"{name} must be a number > 0{unit} or None, got {value!r} ({type(value).__name__})"
        )
    if not value > 0:  # also rejects NaN
        raise ValueError(f"{name} must be > 0{unit} or None, got {value}")


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of :func:`train`.

    Attributes:
        max_iters: number of optimizer updates (an upper bound when ``time_budget`` is set).
        lr: peak learning rate, reached at the end of the warm-up.
        min_lr: learning rate at the end of the cosine decay.
        warmup_iters: updates over which the learning rate rises linearly from lr/warmup_iters
            to lr (at most max_iters). Adam's early moment estimates are noisy, so big first
            steps can wreck the initialisation.
        lr_decay_iters: the update by which the cosine decay reaches min_lr (None: max_iters;
            at least warmup_iters).
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
        require_non_negative_int("warmup_iters", self.warmup_iters)
        if self.lr_decay_iters is not None:
            require_positive_int("lr_decay_iters", self.lr_decay_iters)
        require_positive_number("lr", self.lr)
        require_non_negative_number("min_lr", self.min_lr)
        if not self.min_lr <= self.lr:
            raise ValueError(f"min_lr must be between 0 and lr={self.lr}, got {self.min_lr}")
        require_non_negative_number("weight_decay", self.weight_decay)
        object.__setattr__(self, "betas", _require_betas(self.betas))  # a list becomes a tuple
        if self.grad_clip is not None:
            _require_positive_or_none("grad_clip", self.grad_clip, "")
        if self.seed is not None:
            require_int("seed", self.seed)
        if self.time_budget is not None:
            _require_positive_or_none("time_budget", self.time_budget, " seconds")
        self._check_schedule()

    def _check_schedule(self) -> None:
        """The warm-up must end within the run, and the decay after the warm-up."""
        if self.warmup_iters > self.max_iters:
            default = " (its default)" if self.warmup_iters == TrainConfig.warmup_iters else ""
            raise ValueError(
                f"warmup_iters={self.warmup_iters}{default} is larger than max_iters="
                f"{self.max_iters}: the learning rate would never reach lr; pass "
                f"warmup_iters <= max_iters, e.g. warmup_iters={max(self.max_iters // 10, 1)}"
            )
        if self.lr_decay_iters is not None and self.lr_decay_iters < self.warmup_iters:
            raise ValueError(
                f"lr_decay_iters={self.lr_decay_iters} is smaller than warmup_iters="
                f"{self.warmup_iters}: the cosine decay would end before the warm-up does; "
                "use lr_decay_iters >= warmup_iters (or None for max_iters)"
            )

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
    require_non_negative_int("step", step)
    require_positive_number("lr", lr)
    require_non_negative_number("min_lr", min_lr)
    require_non_negative_int("warmup_iters", warmup_iters)
    require_positive_int("decay_iters", decay_iters)
    if min_lr > lr:
        raise ValueError(f"min_lr={min_lr} is larger than lr={lr}: the cosine decays from lr "
                         "down to min_lr")
    if decay_iters < warmup_iters:
        raise ValueError(f"decay_iters={decay_iters} is smaller than warmup_iters={warmup_iters}: "
                         "the cosine decay would end before the warm-up does")
    return _lr_at(step, lr, min_lr, warmup_iters, decay_iters)


def _lr_at(step: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """:func:`lr_schedule` without the checks (the training loop calls it every update)."""
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
    _require_module(model)
    require_non_negative_number("weight_decay", weight_decay)
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


def make_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """The AdamW optimizer :func:`train` uses: :func:`param_groups`, ``config.lr`` and
    ``config.betas``.

    On a CPU or a CUDA GPU it is PyTorch's fused AdamW, which updates every parameter in one
    kernel call instead of about ten small operations per parameter tensor; it computes the
    same update (a test checks it against the default implementation).
    """
    fused = _model_device(model).type in ("cpu", "cuda")
    return torch.optim.AdamW(
        param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas,
        fused=fused or None,
    )


# --------------------------------------------------------------------------------------------
# Batch functions


def _require_generator(generator: object) -> None:
    """None, or a CPU torch.Generator (the batch functions draw their indices on the CPU)."""
    if require_generator("generator", generator) is not None and generator.device.type != "cpu":
        raise ValueError(
            f"generator must be a CPU torch.Generator, got one on {generator.device}: batches "
            "are drawn on the CPU and moved to the model's device by train()"
        )


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
        :func:`course_lib.corpus.get_batch`.
    """
    require_ndim("data", data, (1,), "(N,) (one long token stream)")
    require_integer_tensor("data", data, "token ids")
    require_positive_int("batch_size", batch_size)
    require_positive_int("block_size", block_size)
    _require_generator(generator)
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
    if not isinstance(tensors, Mapping):
        raise WrongTypeError(
            "tensors must be a dict of name -> (N, ...) tensor, e.g. "
            f"{{'ids': inputs, 'targets': targets}}; got {type(tensors).__name__}"
        )
    if not tensors:
        raise ValueError("tensors is an empty dict: give at least one name -> (N, ...) tensor")
    require_positive_int("batch_size", batch_size)
    _require_generator(generator)
    sizes = {}
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise WrongTypeError(
                f"tensors[{name!r}] must be a torch.Tensor of shape (N, ...), got "
                f"{type(value).__name__}; convert it with torch.as_tensor(...)"
            )
        require_ndim(f"tensors[{name!r}]", value, range(1, 100), "(N, ...), one row per example")
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
# Checks, done once before the loop


def _require_module(model: object) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise WrongTypeError(
            f"model must be a torch.nn.Module (a course_lib model such as DecoderLM, or any module "
            f"whose model(**batch).loss is a scalar loss), got {type(model).__name__}"
        )
    return model


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    raise ValueError(f"model ({type(model).__name__}) has no parameters to train")


def _require_batch_fn(name: str, fn: object) -> None:
    """A function that can be called with no arguments."""
    require_callable(
        name, fn, "a function that returns a batch (a dict)",
        "wrap data with lm_batches(...) or random_batches(...)",
    )
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise WrongTypeError(
            f"{name} must be a function taking no arguments that returns a batch, but it takes "
            f"{inspect.signature(fn)}; use lm_batches(...) or random_batches(...), or a lambda"
        ) from None
    except ValueError:  # no signature to read (some built-ins): find out when it is called
        pass


def _check_train_args(
    model: object,
    train_batches: object,
    config: object,
    val_batches: object,
    progress: object,
    desc: object,
) -> TrainConfig:
    """Everything :func:`train` can check before it draws a batch; returns the config."""
    config = TrainConfig() if config is None else config
    if not isinstance(config, TrainConfig):
        raise TypeError(
            f"config must be a TrainConfig, got {type(config).__name__}; build one with "
            "TrainConfig(max_iters=..., lr=...)"
        )
    _require_module(model)
    _model_device(model)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) has no trainable parameters: every one has "
            "requires_grad=False"
        )
    _require_batch_fn("train_batches", train_batches)
    if val_batches is not None:
        _require_batch_fn("val_batches", val_batches)
    require_bool("progress", progress)
    if not isinstance(desc, str):
        raise WrongTypeError(f"desc must be a string (the progress bar's label), got {desc!r}")
    return config


def _check_batch(batch: object, where: str, model: nn.Module) -> None:
    """Turn a batch function's mistake into a message naming it."""
    if not isinstance(batch, Mapping):
        what = type(batch).__name__
        if isinstance(batch, tuple | list):
            what = f"a {what} of {len(batch)} items"
        raise WrongTypeError(
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
    _check_batch_values(batch, where, model)


# The inputs of course_lib's language models that hold token ids (class indices for targets)
_TOKEN_ID_KEYS = ("ids", "src", "tgt", "targets")


def _check_batch_values(batch: Batch, where: str, model: nn.Module) -> None:
    """course_lib's language models take token ids as integer tensors.

    Only types and dtypes are read, never values, so this costs no device sync. A model of
    one's own may take anything (float targets for a regression, ...), so it is left alone.
    """
    if not isinstance(model, DecoderLM | EncoderDecoder):
        return
    for name in _TOKEN_ID_KEYS:
        if name not in batch:
            continue
        value = batch[name]
        if not isinstance(value, torch.Tensor):
            raise WrongTypeError(
                f"{where} returned {name!r} as a {type(value).__name__}, but "
                f"{type(model).__name__} needs a torch.Tensor of token ids; convert it with "
                "torch.as_tensor(...)"
            )
        what = "class indices (the next token ids)" if name == "targets" else "token ids"
        require_integer_tensor(f"{where}[{name!r}]", value, what)


def _first_batch(model: nn.Module, train_batches: BatchFn, val_batches: BatchFn | None) -> Batch:
    """Draw the first training batch and check it (and one validation batch) once, so the
    loop itself never has to check anything."""
    first = train_batches()
    _check_batch(first, "train_batches()", model)
    if val_batches is not None:
        _check_batch(val_batches(), "val_batches()", model)
    return first


# --------------------------------------------------------------------------------------------
# The loop


def _to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for name, value in batch.items()
    }


def _loss_of(model: nn.Module, batch: Batch) -> torch.Tensor:
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:  # type and shape only: no sync
        raise _bad_loss(model, out, loss)
    return loss


def _bad_loss(model: nn.Module, out: object, loss: object) -> Exception:
    """The error for a model whose output has no scalar ``.loss``."""
    expected = "model(**batch) must return an output whose .loss is a scalar (0-D) tensor"
    name = type(model).__name__
    if isinstance(loss, torch.Tensor):
        return ValueError(
            f"{expected}, but {name}'s .loss has shape {shape_of(loss)}; average it with .mean()"
        )
    what = "has no .loss" if not hasattr(out, "loss") else f"has .loss = {loss!r:.60}"
    return WrongTypeError(
        f"{expected}, but {name} returned a {type(out).__name__} that {what}; return e.g. "
        "SimpleNamespace(logits=logits, loss=loss)"
    )


@torch.no_grad()
def _mean_loss(model: nn.Module, batches: BatchFn, iters: int) -> float:
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


def estimate_loss(model: nn.Module, batches: BatchFn, iters: int) -> float:
    """Mean loss over ``iters`` batches with the model in eval mode (no dropout) and no
    gradients; the model's mode is restored afterwards.

    Args:
        model: any model whose ``model(**batch).loss`` is the mean loss of a batch.
        batches: a batch function.
        iters: number of batches to average.
    """
    _model_device(_require_module(model))
    _require_batch_fn("batches", batches)
    require_positive_int("iters", iters)
    return _mean_loss(model, batches, iters)


def _planned_updates(
    done: int, now: float, deadline: float, step_s: float, eval_s: float, config: TrainConfig
) -> int:
    """How many updates in total fit in the time left: each further update costs ``step_s``,
    every ``eval_interval``-th also an evaluation, and the final evaluation must fit too."""
    left = deadline - now - eval_s
    per_update = step_s + eval_s / config.eval_interval
    more = max(int(left / per_update), 0) if per_update > 0 else config.max_iters
    return min(done + more, config.max_iters)


class _Run:
    """The bookkeeping of one :func:`train` call, kept out of the loop: the history, the
    progress bar, evaluations, and the time budget (how many updates fit, and so over how
    many updates the cosine decays)."""

    def __init__(
        self, model: nn.Module, train_batches: BatchFn, val_batches: BatchFn | None,
        config: TrainConfig, progress: bool, desc: str, clock_start: float,
    ) -> None:
        self.model, self.config = model, config
        self.batches = {"train": train_batches, "val": val_batches}
        self.history = TrainHistory()
        self.clock_start = clock_start
        budget = config.time_budget
        self.deadline = None if budget is None else clock_start + budget
        self.planned = config.max_iters  # updates to do; with a time budget, re-estimated
        self.decay_iters = config.lr_decay_iters or config.max_iters
        self.eval_s = 0.0  # how long the last evaluation took
        self.bar = tqdm(total=self.planned, desc=desc, disable=not progress, leave=True)
        self.postfix: dict[str, str] = {}
        self.callback: Callable[[int, TrainHistory], object] | None = None

    def evaluate(self, done: int) -> None:
        """Mean train (and validation) loss over eval_iters batches, after ``done`` updates."""
        started, history, iters = time.perf_counter(), self.history, self.config.eval_iters
        history.eval_steps.append(done)
        history.eval_train_losses.append(_mean_loss(self.model, self.batches["train"], iters))
        if self.batches["val"] is not None:
            history.val_losses.append(_mean_loss(self.model, self.batches["val"], iters))
            self.postfix["val"] = f"{history.val_losses[-1]:.3f}"
        if self.callback is not None:
            was_training = self.model.training
            self.model.eval()
            try:
                self.callback(done, history)
            finally:
                self.model.train(was_training)
        self.eval_s = time.perf_counter() - started

    def record(
        self, step: int, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, started: float
    ) -> None:
        """Log update ``step`` (1-based): its loss, learning rate, gradient norm and time."""
        loss_value = loss.item()  # waits for the device: the step's time is now complete
        history = self.history
        history.step_times.append(time.perf_counter() - started)
        history.train_time_s += history.step_times[-1]
        if not math.isfinite(loss_value):
            raise FloatingPointError(
                f"the loss became {loss_value} at update {step}: training diverged. Try a "
                f"lower lr (this update used {lr:.2e}) or a smaller grad_clip"
            )
        history.steps.append(step)
        history.train_losses.append(loss_value)
        history.lrs.append(lr)
        history.grad_norms.append(float(grad_norm))
        self.postfix["loss"] = f"{loss_value:.3f}"
        self.bar.set_postfix(self.postfix, refresh=False)
        self.bar.update(1)

    def out_of_time(self) -> bool:
        """Whether one more evaluation would overrun the time budget."""
        return self.deadline is not None and time.perf_counter() + self.eval_s > self.deadline

    def evaluate_if_due(self, step: int) -> bool:
        """Evaluate every eval_interval updates, after the last one, and when time is up.

        Returns:
            True when training must stop because the time budget is spent.
        """
        out_of_time = self.out_of_time()
        if step % self.config.eval_interval == 0 or step >= self.planned or out_of_time:
            self.evaluate(step)
            self.bar.set_postfix(self.postfix)
        return out_of_time

    def replan(self, step: int) -> None:
        """With a time budget, re-estimate how many updates fit, once the speed is measured,
        and stretch the cosine over them."""
        if self.deadline is None or step < min(20, self.config.eval_interval):
            return
        # The speed of the last 50 updates, so a machine that slows down (or speeds up) on
        # the way still ends its cosine when the budget runs out.
        recent = self.history.step_times[-50:]
        step_s = sum(recent) / len(recent)
        now = time.perf_counter()
        planned = _planned_updates(step, now, self.deadline, step_s, self.eval_s, self.config)
        self.planned = self.decay_iters = max(planned, step)
        self.bar.total = self.planned

    def finish(self, step: int) -> None:
        """The final evaluation (unless the last update just had one), and why training stopped."""
        if self.history.eval_steps[-1] != step:
            self.evaluate(step)
        if self.deadline is not None and step < self.config.max_iters:
            self.history.stopped_by = "time_budget"  # the clock, not max_iters, set the length

    def close(self) -> None:
        self.bar.close()
        self.history.elapsed_s = time.perf_counter() - self.clock_start


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
            for the model including ``targets`` (see :func:`lm_batches`,
            :func:`random_batches`).
        config: a :class:`TrainConfig` (defaults to ``TrainConfig()``).
        val_batches: the same for validation batches; evaluated every ``eval_interval``
            updates if given.
        progress: show a progress bar with the live loss (tqdm; False for none).
        desc: the progress bar's label.
        callback: called as ``callback(step, history)`` after every evaluation (before the
            first update with step 0, every ``eval_interval`` updates and after the last),
            once the evaluation's losses are in ``history``: e.g. to redraw a live plot or
            keep the best weights. The model is in eval mode during the call (no dropout);
            its return value is ignored.

    Returns:
        A :class:`TrainHistory`. The model is left in the mode (train/eval) it came in.
    """
    config = _check_train_args(model, train_batches, config, val_batches, progress, desc)
    if callback is not None:
        require_callable("callback", callback, "a function callback(step, history)",
                         "pass e.g. lambda step, history: print(step, history.val_losses[-1])")
    if config.seed is not None:
        torch.manual_seed(config.seed)
    device = _model_device(model)
    optimizer = make_optimizer(model, config)
    # clip_grad_norm_ returns the norm *before* clipping: with inf it only measures it
    max_norm = config.grad_clip if config.grad_clip is not None else math.inf
    was_training = model.training
    clock_start = time.perf_counter()  # a time budget counts from here
    first = _first_batch(model, train_batches, val_batches)  # drawn and checked once
    run = _Run(model, train_batches, val_batches, config, progress, desc, clock_start)
    run.callback = callback
    try:
        model.train()
        run.evaluate(0)
        step = 0
        while step < run.planned:
            started = time.perf_counter()
            batch = first if step == 0 else train_batches()
            lr = _lr_at(step, config.lr, config.min_lr, config.warmup_iters, run.decay_iters)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = _loss_of(model, _to_device(batch, device))  # forward pass and loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            step += 1
            run.record(step, loss, lr, grad_norm, started)
            if run.evaluate_if_due(step):
                break  # the time budget is spent
            run.replan(step)  # with a time budget: how many updates still fit
        run.finish(step)
    finally:
        run.close()
        model.train(was_training)
    return run.history
