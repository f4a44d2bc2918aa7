"""A lesson's claims about measured results, checked on the learner's own machine.

A trained, sampled or timed number depends on the machine that computes it: another CPU, more
threads, a GPU or another PyTorch version adds the same floats in another order, and a seeded
training run lands somewhere else. The sentence next to the number must hold anyway. So a cell
that measures something also checks what the lesson says about it, with a margin that the book
measured over several seeds and machines:

- :func:`claim` checks one sentence of the lesson ("the repeated half's loss falls below 1 nat")
  and prints ``✓ claim holds: ...``; if this run does not bear it out, it stops the cell with a
  message that says which claim failed and what was measured.
- :func:`agree` checks that two computations of the same quantity agree to within rounding, and
  prints the bound (``agree to < 1e-06``), never the digits of the rounding noise, which differ
  from machine to machine.
- :func:`compare_to_book` prints this run's number next to the range the book measured, so a
  learner whose digits differ from the stored ones sees that they should.

The tests run every notebook, so a change that breaks a lesson's claim fails them, and
``python -m benchmarks.seed_sweep NOTEBOOK`` runs a notebook with other values of its ``SEED``
and tabulates what these functions saw (each call appends one JSON line to the file named by
the environment variable ``COURSE_CLAIMS_LOG``, when it is set).
"""

from __future__ import annotations

import json
import math
import numbers
import os

import numpy as np
import torch

__all__ = ["ClaimError", "agree", "claim", "compare_to_book"]

LOG_VARIABLE = "COURSE_CLAIMS_LOG"


def _log(**record: object) -> None:
    """Append ``record`` as a JSON line to the file ``COURSE_CLAIMS_LOG`` names, if any."""
    path = os.environ.get(LOG_VARIABLE)
    if path:
        with open(path, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


class ClaimError(AssertionError):
    """A lesson's claim that this run does not bear out."""


def _truth_value(holds: object) -> bool:
    """``holds`` as a bool, if it is one truth value: a Python bool, a numpy bool or a
    one-element bool tensor. A number is refused: ``tensor(1.7)`` or a count of right answers
    would read as "true", so a claim about it could never fail."""
    fix = "compare to get one, e.g. claim('the loss falls below 1 nat', loss < 1)"
    if isinstance(holds, bool | np.bool_):
        return bool(holds)
    if isinstance(holds, torch.Tensor) and holds.dtype == torch.bool:
        if holds.numel() != 1:
            raise ValueError(f"holds must be one truth value, got a bool tensor of shape "
                             f"{tuple(holds.shape)}: reduce it with .all() or .any()")
        return bool(holds)
    got = (f"a {holds.dtype} tensor of shape {tuple(holds.shape)}"
           if isinstance(holds, torch.Tensor) else f"{holds!r} ({type(holds).__name__})")
    raise TypeError(f"holds must be True or False (a bool, a numpy bool or a one-element bool "
                    f"tensor), got {got}; {fix}")


def _number(name: str, value: object) -> float:
    """``value`` as a float, if it is one real number: an int or float (numpy ones too, not a
    bool) or a one-element int or float tensor. NaN passes: the caller reports it as NaN."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(f"{name} must be one number, got a {value.dtype} tensor of shape "
                             f"{tuple(value.shape)}")
        return float(value)
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {value!r} "
                        f"({type(value).__name__})")
    return float(value)


def _numbers(name: str, value: object) -> torch.Tensor:
    """``value`` as a float64 CPU tensor, if it is a number or a tensor of numbers."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must hold real numbers, got a {value.dtype} tensor")
        return value.detach().double().cpu()
    return torch.tensor(_number(name, value), dtype=torch.float64)


def _require_statement(name: str, text: object) -> None:
    if not isinstance(text, str) or not text:
        raise TypeError(f"{name} must be a non-empty string, got {text!r}")


def claim(statement: str, holds: bool | torch.Tensor, detail: str = "") -> None:
    """Check one claim of the lesson on this run: print ``✓ claim holds: statement``, or stop
    with a :class:`ClaimError` that quotes the claim and ``detail`` (what was measured).

    Args:
        statement: the claim, as the lesson states it.
        holds: whether this run bears it out: a bool, a numpy bool or a one-element bool
            tensor (a comparison such as ``loss < 1``), never a number.
        detail: what was measured, shown only when the claim fails.
    """
    _require_statement("statement", statement)
    holds = _truth_value(holds)
    if not isinstance(detail, str):
        raise TypeError(f"detail must be a string, got {detail!r} ({type(detail).__name__})")
    _log(kind="claim", statement=statement, holds=holds, detail=detail)
    if not holds:
        measured = f" Measured on this run: {detail}." if detail else ""
        raise ClaimError(
            f"✗ this run does not bear out the lesson's claim: {statement}.{measured} The book "
            "checked this claim over several seeds and machines; if it fails again on a fresh "
            "run of the notebook (Kernel > Restart and Run All), your machine lands outside "
            "what the book measured.")
    print(f"✓ claim holds: {statement}")


def agree(a: torch.Tensor | float, b: torch.Tensor | float, *, atol: float,
          what: str = "the two") -> None:
    """Check that two computations of one quantity agree to within ``atol`` everywhere, and
    print ``{what} agree to < {atol}``. The bound, unlike the largest difference itself (a few
    units of float32 rounding), is the same on every machine.

    Args:
        a, b: tensors of the same shape, or numbers.
        atol: the largest absolute difference allowed.
        what: the two computations, e.g. ``"ours and nn.MultiheadAttention"``.
    """
    a, b = _numbers("a", a), _numbers("b", b)
    if not isinstance(atol, numbers.Real) or isinstance(atol, bool) or not atol > 0:
        raise ValueError(f"atol must be a positive number, got {atol!r}")
    _require_statement("what", what)
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    gap = float((a - b).abs().max()) if a.numel() else 0.0
    _log(kind="agree", what=what, atol=atol, gap=gap)
    if math.isnan(gap):
        raise ClaimError(f"✗ {what} should agree to < {atol:g}, but one of them holds NaN "
                         f"(a: {int(a.isnan().sum())}, b: {int(b.isnan().sum())} NaN values)")
    if not gap < atol:
        raise ClaimError(f"✗ {what} should agree to < {atol:g}, but differ by up to {gap:.2e}")
    print(f"{what} agree to < {atol:g}")


def _as_printed(value: float, fmt: str) -> float:
    """``value`` rounded as ``format(value, fmt)`` prints it (``"12.5%"`` -> 0.125)."""
    text = format(value, fmt).replace(",", "").replace("_", "")
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:  # a format that does not print a plain number
        return value


def _require_float_format(fmt: object) -> None:
    try:
        format(0.5, fmt)
    except (TypeError, ValueError):
        raise ValueError(f"fmt must be a format for a float such as '.2f', '.1%' or '.3g', "
                         f"got {fmt!r}") from None


def compare_to_book(what: str, value: float | torch.Tensor, low: float, high: float, *,
                    over: str, fmt: str = ".2f") -> None:
    """Print this run's ``value`` next to the range ``[low, high]`` the book measured ``over``
    (e.g. ``"5 seeds"``), and say so when the value, as printed, falls outside it (0.1243
    printed with ``fmt=".3f"`` is inside a range that ends at 0.124). It checks nothing: the
    lesson's claims are checked by :func:`claim`, with their own margins.

    Args:
        what: the quantity, e.g. ``"validation loss"``.
        value: this run's number (a number or a one-element tensor).
        low, high: the range the book measured.
        over: what the range was measured over, e.g. ``"5 seeds"``.
        fmt: how to print the numbers, e.g. ``".3f"``.
    """
    _require_statement("what", what)
    value, low, high = (_number(name, v) for name, v in
                        (("value", value), ("low", low), ("high", high)))
    _require_statement("over", over)
    _require_float_format(fmt)
    if not low <= high:
        raise ValueError(f"low and high must be numbers with low <= high, got {low!r}, {high!r}")
    _log(kind="book", what=what, value=value, low=low, high=high, over=over)
    shown, low_shown, high_shown = (_as_printed(v, fmt) for v in (value, low, high))
    if math.isnan(value):
        note = (" (NaN: this run's computation produced no number; look for a division by "
                "zero or a loss that diverged, not at your machine)")
    elif not low_shown <= shown <= high_shown:
        note = " (outside the book's range: your machine or seed differs more than the book's did)"
    else:
        note = ""
    print(f"{what}: {value:{fmt}} on this run; the book measured {low:{fmt}} to "
          f"{high:{fmt}} over {over}{note}")
