"""Black-box probes: measure which inputs a model's outputs depend on.

The question that matters for a language model is whether the output at position i depends
on an input at a later position j > i: a *future leak*. During training every position is
computed at once and the target of position i is the input at i + 1, so a model that can see
the future only has to copy it. The probes here do not read a model's code or its masks; they
change one input position at a time and watch which outputs move, so they catch a leak
wherever it comes from (a wrong mask, an unmasked layer, a layer that mixes positions).

Shape legend: B batch, T sequence length, D feature size (d_model).

Functions:
    influence        (B, T, T): how much output i moves when input j is replaced
    who_sees_whom    (T, T) bool (or (B, T, T)): output i changes when input j changes
    future_leaks     a :class:`LeakReport` summarising who_sees_whom for a causal check
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._validate import (
    require_bool,
    require_callable,
    require_finite,
    require_int,
    require_non_negative_number,
    require_positive_int,
    require_tensor,
    shape_of,
)

Probed = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["LeakReport", "future_leaks", "influence", "who_sees_whom"]


def _check_inputs(fn: object, x: object, vocab_size: int | None, n_trials: int,
                  seed: int) -> bool:
    """Validate the probe's arguments; return True when x holds token ids."""
    require_callable("fn", fn, "a function of x returning per-position outputs",
                     "e.g. lambda ids: model(ids).logits")
    x = require_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(
            f"x should have shape (B, T) of token ids or (B, T, D) of vectors, but got a "
            f"{x.dim()}-D tensor of shape {shape_of(x)}; for one sequence use x[None]"
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x has shape {shape_of(x)}: it needs at least one example and one "
                         "position")
    require_positive_int("n_trials", n_trials)
    require_int("seed", seed)
    if x.dtype == torch.bool:
        raise ValueError("x has dtype torch.bool; pass token ids (integers) or float vectors")
    is_ids = not torch.is_floating_point(x) and not torch.is_complex(x)
    if is_ids:
        _check_ids(x, vocab_size)
    else:
        require_finite("x", x, "the probe compares outputs before and after a change, and "
                       "NaN compares unequal to everything, so it could conclude nothing")
    return is_ids


def _check_ids(x: torch.Tensor, vocab_size: int | None) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"x holds integers, so it should be (B, T) token ids, but has shape {shape_of(x)}"
        )
    if vocab_size is None:
        raise ValueError(
            "x holds token ids, so vocab_size is needed to pick replacement tokens "
            "(e.g. vocab_size=model.config.vocab_size)"
        )
    require_positive_int("vocab_size", vocab_size)
    if vocab_size < 2:
        raise ValueError(
            f"vocab_size must be >= 2 so that a token can be replaced by a different one, "
            f"got {vocab_size}"
        )
    if int(x.min()) < 0 or int(x.max()) >= vocab_size:
        raise ValueError(
            f"x holds ids from {int(x.min())} to {int(x.max())}, outside 0..{vocab_size - 1} "
            f"(vocab_size={vocab_size})"
        )


def _check_tolerances(atol: float, rtol: float) -> None:
    require_non_negative_number("atol", atol)
    require_non_negative_number("rtol", rtol)


def _run(fn: Probed, x: torch.Tensor) -> torch.Tensor:
    """fn(x) as (B, T, F) float64 on the CPU (MPS has no float64), after checking that fn
    returned a (B, T, ...) tensor for a (B, T, ...) input."""
    out = fn(x)
    if not isinstance(out, torch.Tensor):
        kind = type(out).__name__
        hint = ""
        if isinstance(out, tuple):
            hint = " (for MultiHeadAttention use lambda x: attention(x)[0])"
        elif hasattr(out, "logits"):
            hint = " (for a language model such as DecoderLM use lambda ids: model(ids).logits)"
        elif hasattr(out, "last_hidden_state"):
            hint = " (for an Encoder use lambda ids: model(ids).last_hidden_state)"
        raise ValueError(f"fn must return a tensor of shape (B, T, ...), got a {kind}{hint}")
    if out.dim() < 2 or tuple(out.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(
            f"fn returned shape {shape_of(out)} for an input of shape {shape_of(x)}; it must "
            f"return one output per position, shape (B, T, ...) = {tuple(x.shape[:2])} + (...)"
        )
    return out.detach().reshape(x.shape[0], x.shape[1], -1).cpu().double()  # (B, T, F)


def _require_finite_output(base: torch.Tensor) -> None:
    """Refuse to probe a model whose output for the unchanged input holds NaN or inf."""
    bad = ~torch.isfinite(base).all(-1)  # (B, T)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        positions = torch.nonzero(bad[b]).flatten().tolist()
        raise ValueError(
            f"fn's output contains NaN or inf for the unperturbed input x (example {b}, "
            f"positions {positions}); the probe compares outputs before and after a change "
            "and cannot conclude anything from NaN: find where it comes from first (a fully "
            "masked row? an overflow?)"
        )


def _largest_change(out: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(B, T): the largest |out - base| over the features; a NaN or inf in out counts as an
    infinite change (the output did move, and NaN compares unequal to everything)."""
    diff = (out - base).abs()  # (B, T, F)
    diff = diff.amax(-1) if diff.shape[-1] else diff.sum(-1)  # (B, T)
    return torch.nan_to_num(diff, nan=float("inf"))


def _perturbed(
    x: torch.Tensor, position: int, is_ids: bool, vocab_size: int | None, gen: torch.Generator
) -> torch.Tensor:
    """A copy of x whose entries at ``position`` (in every example) are replaced."""
    y = x.clone()
    if is_ids:
        # shift every id by a random non-zero amount modulo V: always a different token
        offset = torch.randint(1, vocab_size, (x.shape[0],), generator=gen)  # (B,)
        y[:, position] = (x[:, position] + offset.to(x.device)) % vocab_size
    else:
        scale = float(x.detach().float().std()) if x.numel() > 1 else 1.0
        if not scale > 0 or scale == float("inf"):  # constant input (std 0) or overflow
            scale = 1.0
        noise = torch.randn(x[:, position].shape, generator=gen) * scale  # (B, ...)
        y[:, position] = noise.to(device=x.device, dtype=x.dtype)
    return y


def _changes(
    fn: Probed, x: torch.Tensor, *, vocab_size: int | None, n_trials: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """change (B, T, T), the baseline output's size (B, T), the baseline's noise (B, T).

    All three are float64 on the CPU. Refuses non-finite inputs and baseline outputs.
    """
    is_ids = _check_inputs(fn, x, vocab_size, n_trials, seed)
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = x.shape[:2]
    with torch.no_grad():
        base = _run(fn, x)  # (B, T, F)
        _require_finite_output(base)
        # a second run on the same input must agree: dropout left on would make every
        # output "change" for reasons that have nothing to do with the input
        noise = _largest_change(_run(fn, x), base)  # (B, T)
        change = torch.zeros(batch, seq_len, seq_len, dtype=torch.float64)  # (B, T, T)
        for _ in range(n_trials):
            for j in range(seq_len):
                out = _run(fn, _perturbed(x, j, is_ids, vocab_size, gen))  # (B, T, F)
                change[:, :, j] = torch.maximum(change[:, :, j], _largest_change(out, base))
    size = base.abs()
    size = size.amax(-1) if size.shape[-1] else size.sum(-1)  # (B, T)
    return change, size, noise


def influence(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    seed: int = 0,
) -> torch.Tensor:
    """How much each output moves when one input position is replaced.

    For every position j, each example's input at j (all of its features) is replaced by a
    random one: another token id for (B, T) ids, fresh normal noise of the input's scale for
    (B, T, D) vectors; every other position is left as it was. This is repeated ``n_trials``
    times with different replacements.

    Args:
        fn: maps x to per-position outputs (B, T, ...), e.g. ``lambda ids: model(ids).logits``.
            Put models in eval mode first (dropout makes every output move).
        x: (B, T) token ids or (B, T, ...) float inputs.
        vocab_size: V, needed for token ids (replacement ids are drawn from 0..V-1).
        n_trials: replacements tried per position (a single one could, by chance, leave an
            output unchanged).
        seed: seeds the replacements, so the result is repeatable.

    Returns:
        (B, T, T) float64 on the CPU: entry [b, i, j] is the largest absolute change of any
        element of output i of example b over the trials that replaced input j; ``inf`` where
        the replacement made output i NaN or inf (it did move).

    Raises:
        ValueError: for bad arguments, a float x holding NaN or inf, or an fn whose output for
            the unchanged x holds NaN or inf (nothing can be concluded from NaN).
    """
    change, _, _ = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    return change


def who_sees_whom(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    per_example: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """Which outputs depend on which inputs, measured by replacing one position at a time.

    Output i "sees" input j when replacing input j (see :func:`influence`) moves some element
    of output i by more than ``atol + rtol * max|output i|``. The tolerance keeps float
    rounding (about 1e-7 relative in float32) from counting as a dependence; a real but
    tinier dependence is missed, so keep atol well below the effects you care about.

    Args:
        fn: maps x to per-position outputs (B, T, ...); the model must be in eval mode.
        x: (B, T) token ids or (B, T, ...) float inputs.
        vocab_size: V, needed for token ids.
        n_trials: replacements tried per position.
        atol, rtol: absolute and relative tolerance for "changed".
        per_example: return one matrix per example instead of their union.
        seed: seeds the replacements.

    Returns:
        Boolean (T, T) on the CPU, entry [i, j] True when output i changed for some example
        when input j was replaced (a causal model gives a lower-triangular matrix); or
        (B, T, T) with ``per_example=True``.

    Raises:
        ValueError: for bad arguments, an fn that does not return (B, T, ...) tensors, an
            fn whose output differs between two calls on the same input (dropout left on),
            or NaN / inf in x or in fn's output for the unchanged x (see :func:`influence`).
    """
    _check_tolerances(atol, rtol)
    require_bool("per_example", per_example)
    change, size, noise = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    sees = _threshold(change, size, noise, atol, rtol)  # (B, T, T)
    return sees if per_example else sees.any(0)


def _threshold(
    change: torch.Tensor, size: torch.Tensor, noise: torch.Tensor, atol: float, rtol: float
) -> torch.Tensor:
    """(B, T, T) bool: change above atol + rtol * |output|; refuses a non-repeatable fn."""
    threshold = atol + rtol * size  # (B, T)
    unstable = noise > threshold
    if bool(unstable.any()):
        b, i = (int(v) for v in torch.nonzero(unstable)[0])
        raise ValueError(
            f"fn gives different outputs for the same input (example {b}, position {i} moved "
            f"by {float(noise[b, i]):.3g} between two calls): is dropout on? Call model.eval() "
            "first, or raise atol if the difference is rounding noise"
        )
    return change > threshold[:, :, None]  # (B, T, T)


@dataclass(frozen=True)
class LeakReport:
    """What :func:`future_leaks` found.

    Attributes:
        sees: (T, T) bool, sees[i, j]: output i changed when input j was replaced.
        change: (T, T) float64, the largest change of output i (over the batch and the
            trials) when input j was replaced.
    """

    sees: torch.Tensor
    change: torch.Tensor

    @property
    def leaks(self) -> torch.Tensor:
        """(T, T) bool: the dependences on later inputs, sees[i, j] with j > i."""
        seq_len = self.sees.shape[0]
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)  # (T, T)
        return self.sees & future

    @property
    def leaking_positions(self) -> list[int]:
        """Positions whose output depends on at least one later input."""
        return torch.nonzero(self.leaks.any(1)).flatten().tolist()

    @property
    def is_causal(self) -> bool:
        """True when no output depends on a later input."""
        return not bool(self.leaks.any())

    @property
    def lookahead(self) -> int:
        """How far ahead the worst leak looks: the largest j - i with sees[i, j] (0 if none)."""
        pairs = torch.nonzero(self.leaks)
        return int((pairs[:, 1] - pairs[:, 0]).max()) if len(pairs) else 0

    def __str__(self) -> str:
        seq_len = self.sees.shape[0]
        if self.is_causal:
            return f"causal: no output depends on a later input (T={seq_len})"
        return (
            f"LEAK: the outputs at positions {self.leaking_positions} depend on later inputs, "
            f"up to {self.lookahead} position(s) ahead (T={seq_len})"
        )


def future_leaks(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> LeakReport:
    """Test a model for future leaks: does any output depend on a later input?

    Runs :func:`who_sees_whom` (same arguments) and summarises it. A correct language model
    (a decoder with a causal mask) gives ``report.is_causal == True``.

    Example:
        >>> report = future_leaks(lambda ids: model(ids).logits, ids, vocab_size=V)
        >>> print(report)              # causal: no output depends on a later input (T=8)
        >>> report.sees                # (T, T) bool, lower-triangular when causal

    Returns:
        A :class:`LeakReport`. It never reports "causal" on NaN: NaN or inf in x or in the
        unperturbed output raises ``ValueError``, and an output that turns NaN when a later
        input is replaced counts as a leak.
    """
    _check_tolerances(atol, rtol)
    change, size, noise = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    sees = _threshold(change, size, noise, atol, rtol).any(0)  # (T, T)
    return LeakReport(sees=sees, change=change.amax(0))
