"""Checks for chapter 02, self-attention.

Exercises and their checks:
    2.1 ``my_weight_predictions()`` (predict)      -> :func:`check_weight_predictions`
    2.2 ``fixed_attention(q, k, v)`` (find the bug) -> :func:`check_fixed_attention`
    2.3 ``my_predictions()`` (predict, then verify) -> :func:`check_score_std_predictions`
    2.4 ``scores_gradient(weights, v, grad_out)``  -> :func:`check_scores_gradient`
    2.5 ``predict_equivariant()`` and ``is_permutation_equivariant(f, X, perm)``
        -> :func:`check_equivariance_study` (the tester alone:
        :func:`check_is_permutation_equivariant`)

Three checks serve no exercise of the current notebook, for anyone who writes the function:
:func:`check_self_attention` (``self_attention(X, W_q, W_k, W_v)``, formerly exercise 2.2),
:func:`check_attention_weights` (``attention_weights(q, k)``, formerly exercise 2.1)
and :func:`check_scaled_dot_product_attention` (a batched ``(out, weights)`` function).

Shape legend: T query length, S key length, d_in input size, d_k query/key size, d_v value size.
Weight matrices use nn.Linear's (out, in) layout: W_q is (d_k, d_in) and Q = X @ W_q.T.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from course_lib.attention import (
    attention_scores,
    causal_mask,
    scaled_dot_product_attention,
    softmax,
)
from course_lib.positions import sinusoidal_encoding

from ._core import (
    ATOL,
    RTOL,
    Case,
    CheckFailure,
    Misconception,
    _close,
    call_learner,
    compare_tensors,
    describe,
    prediction_dict,
    rand,
    require_number,
    run_cases,
    wrap_checks,
)

BATCH_HINT = (
    "your function seems to handle 2-D inputs only. With leading batch dimensions, transpose "
    "just the last two dimensions, k.transpose(-2, -1); k.T reverses all of them"
)


# --------------------------------------------------------------------------- shared pieces


def _raw(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-2, -1)


def _fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` is defined (batch dimensions broadcast, inner sizes agree)."""
    if a.dim() < 2 or b.dim() < 2 or a.shape[-1] != b.shape[-2]:
        return False
    try:
        torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    except RuntimeError:
        return False
    return True


def _times(weights: torch.Tensor | None, v: torch.Tensor) -> torch.Tensor | None:
    """``weights @ v`` when the shapes allow it, None otherwise (a mistake that cannot apply)."""
    if weights is None or not _fits(weights, v):
        return None
    return weights @ v


# Plausible wrong attention weights, as functions of (q, k, d_v). Each returns None when the
# mistake cannot apply to a case (e.g. a d_v-vs-d_k confusion when d_v == d_k). Shared by the
# checks of whole attention functions (2.1 keeps its own list, ATTENTION_WEIGHT_MISTAKES).
WeightMistake = tuple[Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor | None], str]

_WEIGHT_MISTAKES: list[WeightMistake] = [
    (
        lambda q, k, d_v: softmax(_raw(q, k) / math.sqrt(q.shape[-1]), dim=-2),
        "the columns of your attention weights sum to 1 instead of the rows: apply the softmax "
        "over the last dimension (over the keys), e.g. torch.softmax(scores, dim=-1)",
    ),
    (
        lambda q, k, d_v: softmax(_raw(q, k)),
        "you used softmax(Q K^T) without scaling: divide the scores by sqrt(d_k), where d_k is "
        "the size of the queries and keys, before the softmax",
    ),
    (
        lambda q, k, d_v: None if d_v == q.shape[-1] else softmax(_raw(q, k) / math.sqrt(d_v)),
        "you scaled the scores by 1/sqrt(d_v), the size of the values; the scale is "
        "1/sqrt(d_k), the size of the queries and keys (q.shape[-1])",
    ),
    (
        lambda q, k, d_v: softmax(_raw(q, k) / q.shape[-1]),
        "you divided the scores by d_k; the scale is 1/sqrt(d_k) (math.sqrt(d_k) or d_k ** 0.5)",
    ),
    (
        lambda q, k, d_v: (softmax(_raw(k, q) / math.sqrt(q.shape[-1]))
                           if q.shape[-2] == k.shape[-2] else None),
        "your attention weights look transposed: row i should hold query i's weights over all "
        "the keys, so compute the scores as Q @ K^T, not K @ Q^T",
    ),
    (
        lambda q, k, d_v: torch.exp(_raw(q, k) / math.sqrt(q.shape[-1])),
        "your attention weights are not normalised: you exponentiated the scores but did not "
        "divide each row by its sum (that is the rest of the softmax)",
    ),
    (
        lambda q, k, d_v: _raw(q, k) / math.sqrt(q.shape[-1]),
        "you used the scaled scores themselves as weights: apply a softmax over the keys first",
    ),
]


def _weight_misconceptions() -> list[Misconception]:
    """The weight mistakes, as misconceptions about (q, k, v) -> weights."""
    return [
        Misconception(lambda q, k, v, _w=wrong: _w(q, k, v.shape[-1]),
                      message[0].upper() + message[1:])
        for wrong, message in _WEIGHT_MISTAKES
    ]


def _output_misconceptions(prefix: str) -> list[Misconception]:
    """The weight mistakes carried through to the output, as misconceptions (q, k, v) -> out."""
    return [
        Misconception(lambda q, k, v, _w=wrong: _times(_w(q, k, v.shape[-1]), v),
                      f"{prefix}{message}")
        for wrong, message in _WEIGHT_MISTAKES
    ]


# --------------------------------------------------------------------------- exercise 2.1


def _qk_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("T=4, d=8", (rand(gen, 4, 8), rand(gen, 4, 8))),
        Case("3 queries, 5 keys, d=4", (rand(gen, 3, 4), rand(gen, 5, 4))),
        Case("batched, B=2, T=5, d=8", (rand(gen, 2, 5, 8), rand(gen, 2, 5, 8)),
             hint=BATCH_HINT),
        Case("batch and heads, (2, 3, 4, 6)", (rand(gen, 2, 3, 4, 6), rand(gen, 2, 3, 4, 6)),
             hint=BATCH_HINT),
        Case("one token, T=1", (rand(gen, 1, 8), rand(gen, 1, 8))),
        Case("one query, 6 keys", (rand(gen, 1, 16), rand(gen, 6, 16))),
        Case("large scores", (rand(gen, 4, 8, scale=40.0), rand(gen, 4, 8, scale=40.0))),
    ]


ATTENTION_WEIGHT_MISTAKES = [
    Misconception(
        lambda q, k: softmax(_raw(q, k) / math.sqrt(q.shape[-1]), dim=-2),
        "The columns of your weights sum to 1 instead of the rows: apply the softmax over the "
        "last dimension (over the keys), e.g. torch.softmax(scores, dim=-1)",
    ),
    Misconception(
        lambda q, k: softmax(_raw(q, k)),
        "Your weights equal softmax(q k^T) without scaling: divide the scores by sqrt(d), "
        "where d = q.shape[-1], before the softmax",
    ),
    Misconception(
        lambda q, k: softmax(_raw(q, k) / q.shape[-1]),
        "You divided the scores by d; the scale is 1/sqrt(d) (use math.sqrt(d) or d ** 0.5)",
    ),
    Misconception(
        lambda q, k: softmax(_raw(k, q) / math.sqrt(q.shape[-1])),
        "Your weights look transposed: row i should hold query i's weights over all the keys, "
        "so compute the scores as q @ k^T, not k @ q^T",
    ),
    Misconception(
        lambda q, k: torch.exp(_raw(q, k) / math.sqrt(q.shape[-1])),
        "Your rows do not sum to 1: you exponentiated the scores but did not divide by each "
        "row's sum (that is the rest of the softmax)",
    ),
    Misconception(
        lambda q, k: _raw(q, k) / math.sqrt(q.shape[-1]),
        "You returned the scaled scores themselves: apply a softmax over the keys to turn them "
        "into weights",
    ),
]


def _overflow_nan(got: Any, case: Case) -> None:
    if isinstance(got, torch.Tensor) and torch.isnan(got).any() and case.name == "large scores":
        raise CheckFailure(
            "Your weights contain NaN when the scores are large: exp() overflows. Subtract "
            "each row's maximum before exponentiating (it cancels in the ratio), or use "
            "torch.softmax, which does this for you"
        )


def _batched_shape(got: Any, expected: torch.Tensor, q: torch.Tensor, what: str) -> None:
    """A batched result with the right last two sizes but wrong leading ones: k.T on a batch."""
    if (
        isinstance(got, torch.Tensor)
        and got.dim() >= 2
        and q.dim() > 2
        and got.shape[-2:] == expected.shape[-2:]
        and got.shape != expected.shape
    ):
        raise CheckFailure(
            f"For batched inputs of shape {tuple(q.shape)} {what} should have shape "
            f"{tuple(expected.shape)}, got {tuple(got.shape)}. Transpose only the last two "
            "dimensions of k: k.transpose(-2, -1) (k.T flips every dimension)"
        )


def check_attention_weights(attention_weights: Callable) -> None:
    """Check ``attention_weights(q, k)`` = softmax(q k^T / sqrt(d)) over the keys.

    Args:
        attention_weights: the learner's function taking q (..., T, d) and k (..., S, d) and
            returning weights of shape (..., T, S).
    """

    def check_one(got, case: Case) -> None:
        q, k = case.args
        expected = softmax(attention_scores(q, k))
        _overflow_nan(got, case)
        _batched_shape(got, expected, q, "the weights")
        compare_tensors(got, expected, case, what="Your attention weights",
                        misconceptions=ATTENTION_WEIGHT_MISTAKES)

    run_cases("attention_weights", attention_weights, _qk_cases(seed=2), check_one)


# --------------------------------------------------------------- exercise 2.1 (predictions)
# Predict, then verify: what changes the attention weights? One fixed sentence (T = 5 tokens,
# D = 8) and fixed projections (d_k = 4); each question changes one thing and the check
# measures the weights before and after with course_lib's scaled_dot_product_attention.

WEIGHT_QUESTIONS = ("zero queries", "shift keys", "shift queries", "double inputs")
SHARPNESS_CHOICES = ("sharper", "flatter", "unchanged")
WEIGHT_TOKENS = 5


def _weights_of(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, *,
                q_shift: torch.Tensor | None = None,
                k_shift: torch.Tensor | None = None) -> torch.Tensor:
    q, k = x @ w_q.T, x @ w_k.T  # (T, d_k) each
    q = q if q_shift is None else q + q_shift
    k = k if k_shift is None else k + k_shift
    return scaled_dot_product_attention(q, k, k)[1]  # (T, T)


def _row_entropy(weights: torch.Tensor) -> float:
    return float(-(weights * weights.clamp_min(1e-30).log()).sum(-1).mean())


def measure_weight_changes(seed: int = 21) -> dict[str, Any]:
    """The measurements behind exercise 2.1's questions (seeded; the global stream is left
    alone): the weights with all queries zero, whether adding one vector to every key or to
    every query changes the weights, and whether doubling the input makes the rows sharper."""
    gen = torch.Generator().manual_seed(seed)
    x = rand(gen, WEIGHT_TOKENS, 8)  # (T, D)
    w_q, w_k = rand(gen, 4, 8, scale=0.5), rand(gen, 4, 8, scale=0.5)  # (d_k, D)
    c = rand(gen, 4, scale=2.0)  # (d_k,): one vector added to every key, or to every query
    base = _weights_of(x, w_q, w_k)  # (T, T)
    zero = _weights_of(x, torch.zeros_like(w_q), w_k)
    keys = _weights_of(x, w_q, w_k, k_shift=c)
    queries = _weights_of(x, w_q, w_k, q_shift=c)
    doubled = _weights_of(2 * x, w_q, w_k)
    before, after = _row_entropy(base), _row_entropy(doubled)
    return {
        "zero queries": float(zero.mean()),
        "shift keys": float((keys - base).abs().max()),
        "shift queries": float((queries - base).abs().max()),
        "double inputs": (before, after),
    }


WEIGHT_WHY = {
    "zero queries": "A zero query has score 0 with every key, and the softmax of T equal "
                    "scores is 1/T in every place",
    "shift keys": "Adding c to every key adds q_i . c to every score of row i: the same "
                  "number across the row, and the softmax ignores a constant added to a "
                  "whole row",
    "shift queries": "Adding c to every query adds c . k_j to score (i, j): a different "
                     "number for each key, so the weights change",
    "double inputs": "Both the queries and the keys double, so every score is multiplied by "
                     "4: larger gaps between scores make each row's softmax sharper",
}


def _read_weight_predictions(got: Any) -> dict[str, Any]:
    predictions = prediction_dict(got, WEIGHT_QUESTIONS, "my_weight_predictions()")
    read: dict[str, Any] = {
        "zero queries": require_number(predictions["zero queries"],
                                     "Your prediction for 'zero queries'")}
    for key in ("shift keys", "shift queries"):
        answer = predictions[key]
        if not isinstance(answer, bool | np.bool_):
            raise CheckFailure(f"Your prediction for {key!r} should be True (the weights "
                               f"change) or False (they do not), got {describe(answer)}")
        read[key] = bool(answer)
    answer = predictions["double inputs"]
    choice = answer.strip().lower() if isinstance(answer, str) else None
    if choice not in SHARPNESS_CHOICES:
        raise CheckFailure(f"Your prediction for 'double inputs' is {answer!r}; choose one of "
                           f"{SHARPNESS_CHOICES}")
    read["double inputs"] = choice
    return read


def check_weight_predictions(my_weight_predictions: Callable[[], dict]) -> None:
    """Grade the predictions of exercise 2.1, then print the measurement.

    Args:
        my_weight_predictions: the learner's function, no arguments, returning a dict with
            "zero queries" (a float: every weight when all T = 5 queries are zero), "shift
            keys" and "shift queries" (bools: do the weights change when one vector is added
            to every key / every query?) and "double inputs" ("sharper", "flatter" or
            "unchanged": the rows when the input X is doubled).
    """
    said = _read_weight_predictions(my_weight_predictions())
    m = measure_weight_changes()
    before, after = m["double inputs"]
    if after < before - 1e-3:
        sharpness = "sharper"
    else:
        sharpness = "flatter" if after > before + 1e-3 else "unchanged"
    truth = {
        "zero queries": m["zero queries"],
        "shift keys": m["shift keys"] > 1e-4,
        "shift queries": m["shift queries"] > 1e-4,
        "double inputs": sharpness,
    }
    shown = {
        "zero queries": f"every weight {m['zero queries']:.4f}",
        "shift keys": ("largest change below 1e-4 (float rounding)" if m["shift keys"] < 1e-4
                       else f"largest change {m['shift keys']:.2f}"),
        "shift queries": f"largest change {m['shift queries']:.2f}",
        "double inputs": f"row entropy {before:.2f} -> {after:.2f}",
    }
    print(f"{'question':>14} | {'you predicted':>13} | measured")
    for key in WEIGHT_QUESTIONS:
        print(f"{key:>14} | {str(said[key]):>13} | {shown[key]}")
    wrong = [key for key in WEIGHT_QUESTIONS if (
        abs(said[key] - truth[key]) > 0.01 if key == "zero queries" else said[key] != truth[key])]
    if wrong:
        raise CheckFailure("Not quite: " + " ".join(
            f"{key!r}: {WEIGHT_WHY[key]}." for key in wrong))
    print("\u2705 your predictions match the measurement: the softmax of each row ignores a "
          "constant added to the whole row, and the scores grow with the square of the inputs")


# --------------------------------------------------------------------------- exercise 2.2
# Find the bug: an attention function whose softmax runs over dim=1. On one sentence, scores
# are (T, S) and dim 1 is the keys, so it looks right; with a batch in front, (B, T, S), dim 1
# is the queries (and with heads, (B, H, T, S), it is the heads).


def buggy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The function of exercise 2.2, planted mistake included (do not fix it here).

    Shapes: q (..., T, d_k), k (..., S, d_k), v (..., S, d_v) -> (..., T, d_v).
    """
    d_k = q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_k)  # (..., T, S)
    weights = torch.softmax(scores, dim=1)  # (..., T, S)
    return weights @ v  # (..., T, d_v)


FIXED_ATTENTION_INSTRUMENT = (
    "Instrument that finds it: the rows of attention weights sum to 1 for every input, so "
    "check weights.sum(dim=-1) on a batched input, or compare the output with "
    "course_lib.scaled_dot_product_attention on inputs with batch (and head) dimensions, not "
    "only on one sentence"
)


def _fixed_attention_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def case(name, q_shape, k_shape, v_shape, *, scale=1.0):
        return Case(name, (rand(gen, *q_shape, scale=scale), rand(gen, *k_shape, scale=scale),
                           rand(gen, *v_shape)), hint=BATCH_HINT)

    # batch and heads first: there a softmax over dim 0, 1 or -2 is three different mistakes
    return [
        case("batch and heads (2, 3), T=S=6, d_k=4, d_v=5", (2, 3, 6, 4), (2, 3, 6, 4),
             (2, 3, 6, 5)),
        case("batched, B=3, T=S=5, d_k=4, d_v=6", (3, 5, 4), (3, 5, 4), (3, 5, 6)),
        case("one sentence, T=S=5, d_k=d_v=4", (5, 4), (5, 4), (5, 4)),
        case("batched, B=2, 4 queries, 7 keys, d_k=8, d_v=3", (2, 4, 8), (2, 7, 8), (2, 7, 3)),
        case("one token per sequence, B=4, T=S=1", (4, 1, 4), (4, 1, 4), (4, 1, 2)),
        case("large scores, B=2, T=S=5, d_k=d_v=8", (2, 5, 8), (2, 5, 8), (2, 5, 8), scale=20.0),
    ]


def _softmax_over(dim: int) -> Callable:
    """Attention whose softmax runs over a fixed axis counted from the front."""

    def wrong(q, k, v):
        if dim >= q.dim():
            return None
        return softmax(_raw(q, k) / math.sqrt(q.shape[-1]), dim=dim) @ v

    return wrong


FIXED_ATTENTION_MISTAKES = [
    Misconception(
        _softmax_over(1),
        "Your output still equals the planted bug's: the softmax runs over dim=1. For one "
        "sentence the scores are (T, S) and dim 1 is the keys, but with a batch in front, "
        "(B, T, S), dim 1 is the queries, and with heads, (B, H, T, S), it is the heads. "
        "Normalise over the keys, the last dimension, whatever stands in front",
    ),
    Misconception(
        _softmax_over(0),
        "Your softmax runs over dim=0, the batch axis when the input is batched. Normalise "
        "over the keys, the last dimension, whatever stands in front",
    ),
    *(Misconception(lambda q, k, v, _w=wrong: _times(_w(q, k, v.shape[-1]), v),
                    message[0].upper() + message[1:])
      for wrong, message in _WEIGHT_MISTAKES),
]


def check_fixed_attention(fixed_attention: Callable) -> None:
    """Check a fix of :func:`buggy_attention`: ``fixed_attention(q, k, v)`` must equal
    softmax(q k^T / sqrt(d_k)) v for any leading batch (and head) dimensions.

    Args:
        fixed_attention: the learner's function taking q (..., T, d_k), k (..., S, d_k) and
            v (..., S, d_v) and returning the output, shape (..., T, d_v).
    """

    def check_one(got, case: Case) -> None:
        q, k, v = case.args
        expected, _ = scaled_dot_product_attention(q, k, v)
        if isinstance(got, tuple):
            raise CheckFailure(
                f"fixed_attention should return only the output, a tensor of shape "
                f"{tuple(expected.shape)}, like buggy_attention; it returned {describe(got)} "
                f"(case '{case.name}')"
            )
        _batched_shape(got, expected, q, "the output")
        try:
            compare_tensors(got, expected, case, what="Your output",
                            misconceptions=FIXED_ATTENTION_MISTAKES)
        except CheckFailure as failure:
            # the instrument belongs to the planted bug only: other failures keep their message
            if str(failure).startswith(FIXED_ATTENTION_MISTAKES[0].message):
                raise CheckFailure(f"{failure}\n{FIXED_ATTENTION_INSTRUMENT}") from None
            raise

    run_cases("fixed_attention", fixed_attention, _fixed_attention_cases(seed=25), check_one)


# --------------------------------------------------------------------------- exercise 2.3
# Predict, then verify: the spread of dot products. For d = 64 and independent entries of
# mean 0, std(q . k) = sqrt(d) * std(q_m) * std(k_m): 8 for unit entries; with entries of
# std 2 in both q and k, std(q . k / sqrt(d)) = 2 * 2 = 4.

PREDICTION_D = 64
PREDICTION_TOLERANCE = 0.15  # relative: a prediction within 15% of the exact value passes


def measure_score_stds(d: int = PREDICTION_D, n_pairs: int = 100_000,
                       seed: int = 0) -> tuple[float, float]:
    """Measured (std of q.k with unit-variance entries, std of q.k / sqrt(d) with entries of
    std 2), over ``n_pairs`` random pairs of dimension ``d``."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n_pairs, d, generator=gen)  # (N, d)
    k = torch.randn(n_pairs, d, generator=gen)  # (N, d)
    dots = (q * k).sum(dim=-1)  # (N,)
    wide = ((2 * q) * (2 * k)).sum(dim=-1) / math.sqrt(d)  # (N,): entries of std 2, scaled
    return dots.std().item(), wide.std().item()


# (value the learner may say, what that value means) for each of the two predictions
_STD_DOT_MISTAKES = [
    (64.0, "64 is the variance of q . k, a sum of 64 independent terms of variance 1; the "
           "standard deviation is its square root"),
    (1.0, "1 is the spread after dividing by sqrt(d). Unscaled, the 64 terms add up: their "
          "variances sum to 64"),
    (0.0, "0 is the mean of q . k (positive and negative terms cancel on average); the "
          "question is its spread, the standard deviation"),
]
_STD_WIDE_MISTAKES = [
    (1.0, "Dividing by sqrt(d) removes the growth with d, not the size of the entries: with "
          "entries of std 2, each product q_m k_m has variance 4 * 4 = 16"),
    (2.0, "Both factors have std 2, so each product q_m k_m has std 2 * 2 = 4 (variances "
          "multiply: 4 * 4 = 16), not 2"),
    (16.0, "16 is the variance of the scaled score (64 products of variance 16, divided by "
           "64); the standard deviation is its square root"),
    (32.0, "32 is the spread before the scaling: divide by sqrt(64) = 8"),
]


def _grade_prediction(said: float, exact: float, measured: float, what: str,
                      mistakes: list[tuple[float, str]]) -> None:
    if abs(said - exact) <= PREDICTION_TOLERANCE * exact:
        return
    for value, message in mistakes:
        if abs(said - value) <= PREDICTION_TOLERANCE * max(abs(value), 0.1):
            raise CheckFailure(f"You predicted {said:g} for {what}. {message}. Measured: "
                               f"{measured:.2f}")
    raise CheckFailure(
        f"You predicted {said:g} for {what}; measured: {measured:.2f}. For independent entries "
        "of mean 0, the variance of a product is the product of the variances, and the "
        "variance of a sum of independent terms is the sum of their variances"
    )


def check_score_std_predictions(my_predictions: Callable) -> None:
    """Grade the two predictions of exercise 2.3, then print the measurement.

    Args:
        my_predictions: the learner's function with no arguments, returning two numbers:
            the standard deviation of q . k for d = 64 with unit-variance entries, and the
            standard deviation of q . k / sqrt(64) when every entry of q and k has std 2.
    """
    got = call_learner(my_predictions, Case("your predictions"))
    if not (isinstance(got, tuple | list) and len(got) == 2):
        raise CheckFailure(
            "my_predictions should return two numbers, (std_dot, std_scaled_wide), e.g. "
            f"return 3.0, 0.5; it returned {describe(got)}"
        )
    said = (require_number(got[0], "Your first prediction, the std of q . k"),
            require_number(got[1], "Your second prediction, the std of the scaled score"))
    if not all(math.isfinite(x) for x in said):
        raise CheckFailure(f"Your predictions should be finite numbers, got {said}")
    measured_dot, measured_wide = measure_score_stds()
    _grade_prediction(said[0], math.sqrt(PREDICTION_D), measured_dot,
                      "the std of q . k (unit-variance entries)", _STD_DOT_MISTAKES)
    _grade_prediction(said[1], 4.0, measured_wide,
                      "the std of q . k / sqrt(64) (entries of std 2)", _STD_WIDE_MISTAKES)
    print(f"\u2705 both predictions are within {PREDICTION_TOLERANCE:.0%} of the exact values. "
          f"Measured over 100,000 random pairs, d = {PREDICTION_D}:\n"
          f"   std of q . k, entries of variance 1    = {measured_dot:.2f} "
          f"(you said {said[0]:g})\n"
          f"   std of q . k / sqrt(64), entries std 2 = {measured_wide:.2f} "
          f"(you said {said[1]:g})")


# ------------------------------------------------- self_attention (no exercise uses it now)

CONVENTION_HINT = (
    "the weights are stored like nn.Linear.weight, one row per output feature: X is "
    "(T, d_in) and W_q is (d_k, d_in), so Q = X @ W_q.T, K = X @ W_k.T, V = X @ W_v.T "
    "(torch.nn.functional.linear(X, W_q) computes the same X @ W_q.T)"
)


def _projection_case(gen: torch.Generator, name: str, t: int, d_in: int, d_k: int, d_v: int,
                     *, scale: float = 1.0) -> Case:
    x = rand(gen, t, d_in, scale=scale)
    # nn.Linear's (out, in) layout; scaled by 1/sqrt(d_in) so the projections have unit-size
    # entries
    w_q, w_k, w_v = (rand(gen, d, d_in, scale=1.0 / math.sqrt(d_in)) for d in (d_k, d_k, d_v))
    return Case(name, (x, w_q, w_k, w_v), hint=CONVENTION_HINT)


def _self_attention_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        # square weights first: shapes alone cannot reveal an untransposed W or a missing W_v
        _projection_case(gen, "square weights, T=5, d_in=d_k=d_v=4", 5, 4, 4, 4),
        _projection_case(gen, "T=4, d_in=6, d_k=3, d_v=5", 4, 6, 3, 5),
        _projection_case(gen, "T=3, d_in=8, d_k=4, d_v=3", 3, 8, 4, 3),
        _projection_case(gen, "T=6, d_in=5, d_k=7, d_v=2", 6, 5, 7, 2),
        _projection_case(gen, "one token, T=1, d_in=4, d_k=2, d_v=3", 1, 4, 2, 3),
        _projection_case(gen, "large scores, T=5, d_in=d_k=d_v=6", 5, 6, 6, 6, scale=15.0),
    ]


def _qkv(x, w_q, w_k, w_v):
    return x @ w_q.T, x @ w_k.T, x @ w_v.T  # (T, d_k), (T, d_k), (T, d_v)


def _untransposed_projections(x, w_q, w_k, w_v):
    """X @ W instead of X @ W.T: only runs (and so only needs its own message) on square W."""
    if not all(w.shape[0] == w.shape[1] for w in (w_q, w_k, w_v)):
        return None
    return scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v)[0]


def _with_qkv(wrong: Callable) -> Callable:
    """Lift a mistake about (q, k, v) to one about (X, W_q, W_k, W_v)."""
    return lambda x, w_q, w_k, w_v: wrong(*_qkv(x, w_q, w_k, w_v))


SELF_ATTENTION_MISTAKES = [
    Misconception(
        lambda x, w_q, w_k, w_v: softmax(attention_scores(*_qkv(x, w_q, w_k, w_v)[:2])),
        "You returned the attention weights A (T, T); the exercise asks for the output "
        "Z = A @ V, of shape (T, d_v), where V = X @ W_v.T",
    ),
    Misconception(
        _untransposed_projections,
        "You multiplied by the weights without transposing them (X @ W). The weights are "
        "stored like nn.Linear.weight, shape (d_out, d_in) with one row per output feature, "
        "so the projections are Q = X @ W_q.T, K = X @ W_k.T, V = X @ W_v.T",
    ),
    Misconception(
        lambda x, w_q, w_k, w_v: softmax(attention_scores(*_qkv(x, w_q, w_k, w_v)[:2])) @ x,
        "You averaged the inputs X instead of the values: the output is A @ V with "
        "V = X @ W_v.T (W_v is the third weight matrix, do not skip it)",
    ),
    Misconception(
        lambda x, w_q, w_k, w_v: (None if x.shape[-1] == w_q.shape[0] else
                                  scaled_dot_product_attention(
                                      *_qkv(x, w_q, w_k, w_v),
                                      scale=1.0 / math.sqrt(x.shape[-1]))[0]),
        "You scaled the scores by 1/sqrt(d_in), the size of the inputs; the scale is "
        "1/sqrt(d_k), the size of the queries and keys (W_q.shape[0])",
    ),
    *(Misconception(_with_qkv(m.wrong), m.message)
      for m in _output_misconceptions("Your output is wrong because ")),
]


def check_self_attention(self_attention: Callable) -> None:
    """Check ``self_attention(X, W_q, W_k, W_v)`` = softmax(Q K^T / sqrt(d_k)) V.

    Args:
        self_attention: the learner's function taking X (T, d_in), W_q and W_k (d_k, d_in) and
            W_v (d_v, d_in) in nn.Linear's (out, in) layout, with Q = X @ W_q.T,
            K = X @ W_k.T, V = X @ W_v.T, and returning the output of shape (T, d_v).
    """

    def check_one(got, case: Case) -> None:
        x, w_q, w_k, w_v = case.args
        expected, _ = scaled_dot_product_attention(*_qkv(x, w_q, w_k, w_v))
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], torch.Tensor):
            raise CheckFailure(
                "self_attention should return only the output Z, a tensor of shape "
                f"{tuple(expected.shape)}, not a tuple (case '{case.name}')"
            )
        compare_tensors(got, expected, case, what="Your output Z",
                        misconceptions=SELF_ATTENTION_MISTAKES)

    run_cases("self_attention", self_attention, _self_attention_cases(seed=22), check_one)


# ------------------------------------- scaled_dot_product_attention (no exercise uses it now)


def _sdpa_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def case(name, q_shape, k_shape, v_shape, *, scale=1.0, hint=""):
        return Case(name, (rand(gen, *q_shape, scale=scale), rand(gen, *k_shape, scale=scale),
                           rand(gen, *v_shape)), hint=hint)

    return [
        case("T=S=4, d_k=d_v=8", (4, 8), (4, 8), (4, 8)),
        case("3 queries, 5 keys, d_k=4, d_v=6", (3, 4), (5, 4), (5, 6)),
        case("T=S=d_v=4, d_k=6", (4, 6), (4, 6), (4, 4)),
        case("batched, B=2, T=5, S=7, d_k=6, d_v=3", (2, 5, 6), (2, 7, 6), (2, 7, 3),
             hint=BATCH_HINT),
        case("batch and heads, (2, 3, 4, 8), S=6, d_v=5", (2, 3, 4, 8), (2, 3, 6, 8),
             (2, 3, 6, 5), hint=BATCH_HINT),
        case("one query, T=1, S=6", (1, 8), (6, 8), (6, 2)),
        case("one key, S=1 (batched)", (2, 3, 4), (2, 1, 4), (2, 1, 5), hint=BATCH_HINT),
        case("large scores", (4, 8), (5, 8), (5, 8), scale=30.0),
    ]


SDPA_WEIGHT_MISTAKES = _weight_misconceptions()
SDPA_OUTPUT_MISTAKES = _output_misconceptions(
    "Your weights are right but your output is wrong: to compute it, ")


def check_scaled_dot_product_attention(scaled_dot_product_attention_fn: Callable) -> None:
    """Check ``scaled_dot_product_attention(q, k, v)`` returns ``(out, weights)``.

    Args:
        scaled_dot_product_attention_fn: the learner's function taking q (..., T, d_k),
            k (..., S, d_k) and v (..., S, d_v) and returning ``(out, weights)`` with out of
            shape (..., T, d_v) and weights = softmax(q k^T / sqrt(d_k)) of shape (..., T, S).
    """

    def check_one(got, case: Case) -> None:
        q, k, v = case.args
        out, weights = scaled_dot_product_attention(q, k, v)
        if isinstance(got, torch.Tensor):
            which = ("the output" if _close(got, out, ATOL, RTOL) else
                     "the weights" if _close(got, weights, ATOL, RTOL) else "one tensor")
            raise CheckFailure(
                f"Return a tuple (out, weights); your function returned only {which}, "
                f"{describe(got)} (case '{case.name}')"
            )
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(
                f"Return a tuple (out, weights) of two tensors; your function returned "
                f"{describe(got)} (case '{case.name}')"
            )
        got_out, got_weights = got
        if isinstance(got_out, torch.Tensor) and isinstance(got_weights, torch.Tensor):
            by_value = _close(got_out, weights, ATOL, RTOL) and _close(got_weights, out, ATOL,
                                                                         RTOL)
            by_shape = (got_out.shape == weights.shape and got_weights.shape == out.shape
                        and out.shape != weights.shape)
            if by_value or by_shape:
                raise CheckFailure(
                    "Your function returned (weights, out): swap them and return (out, weights), "
                    f"the order course_lib and this exercise use (case '{case.name}')"
                )
        _overflow_nan(got_weights, case)
        _batched_shape(got_weights, weights, q, "the weights")
        compare_tensors(got_weights, weights, case, what="Your weights (the second item)",
                        misconceptions=SDPA_WEIGHT_MISTAKES)
        _batched_shape(got_out, out, q, "the output")
        compare_tensors(got_out, out, case, what="Your output (the first item)",
                        misconceptions=SDPA_OUTPUT_MISTAKES)

    run_cases("scaled_dot_product_attention", scaled_dot_product_attention_fn,
              _sdpa_cases(seed=23), check_one)


# --------------------------------------------------------------------------- exercise 2.4
# The backward pass of attention, from the output to the scores: with A = softmax(S) and
# out = A V, dL/dA = G V^T for G = dL/dout, and each row of dL/dS is J^T dL/dA with the
# softmax Jacobian J = diag(p) - p p^T, i.e. p * (g - sum_j p_j g_j).


def _reference_scores_gradient(weights: torch.Tensor, v: torch.Tensor,
                               grad_out: torch.Tensor) -> torch.Tensor:
    """dL/dS by autograd: recover scores whose softmax is ``weights`` and differentiate."""
    scores = weights.double().clamp_min(1e-300).log().requires_grad_(True)  # softmax(log p) = p
    with torch.enable_grad():
        out = torch.softmax(scores, dim=-1) @ v.double()
        (grad,) = torch.autograd.grad(out, scores, grad_out.double())
    return grad.to(weights.dtype)


GRADIENT_BATCH_HINT = (
    "with leading batch dimensions, transpose only the last two dimensions of v, "
    "v.transpose(-2, -1), and sum over the last dimension only"
)


def _grad_weights(weights, v, grad_out):
    return grad_out @ v.transpose(-2, -1)  # (..., T, S): dL/dA


def _scores_gradient_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def case(name, t, s, d_v, batch=(), *, scale=1.0, hint=GRADIENT_BATCH_HINT):
        weights = torch.softmax(rand(gen, *batch, t, s, scale=scale), dim=-1)
        return Case(name, (weights, rand(gen, *batch, s, d_v), rand(gen, *batch, t, d_v)),
                    hint=hint)

    return [
        case("T=S=4, d_v=3", 4, 4, 3),
        case("3 queries, 5 keys, d_v=2", 3, 5, 2),
        case("T=S=d_v=5", 5, 5, 5),
        case("batched, B=2, T=4, S=6, d_v=3", 4, 6, 3, (2,)),
        case("batch and heads (2, 3), T=4, S=5, d_v=2", 4, 5, 2, (2, 3)),
        case("one query, T=1, S=6", 1, 6, 4),
        case("one key, S=1: the weight is always 1", 3, 1, 2),
        case("saturated softmax (large scores)", 4, 6, 3, scale=20.0),
    ]


SCORES_GRADIENT_MISTAKES = [
    Misconception(
        _grad_weights,
        "You returned the gradient with respect to the weights, dL/dA = grad_out @ v^T. The "
        "scores reach the loss through the softmax, so the gradient still has to pass "
        "backwards through it (its Jacobian)",
    ),
    Misconception(
        lambda w, v, g: _grad_weights(w, v, g).transpose(-2, -1),
        "Your result is transposed: dL/dA has one row per query and one column per key, "
        "(..., T, S), like the weights; it is grad_out @ v^T, not v @ grad_out^T",
    ),
    Misconception(
        lambda w, v, g: w * _grad_weights(w, v, g),
        "You kept only the diagonal of the softmax Jacobian, p_i * g_i. Raising one score "
        "also lowers every other weight of its row (the weights sum to 1), which is the "
        "-p p^T part: subtract the weighted mean of the row, sum_j p_j g_j",
    ),
    Misconception(
        lambda w, v, g: w * (_grad_weights(w, v, g)
                             - _grad_weights(w, v, g).sum(-1, keepdim=True)),
        "You subtracted the plain sum of the row's weight gradients; the Jacobian "
        "diag(p) - p p^T subtracts the *weighted* sum, sum_j p_j g_j",
    ),
    Misconception(
        lambda w, v, g: w * (_grad_weights(w, v, g)
                             - (w * _grad_weights(w, v, g)).sum(-2, keepdim=True)),
        "The weighted sum must run over the keys of each row (the last dimension, dim=-1), "
        "not over the queries",
    ),
    Misconception(
        lambda w, v, g: _grad_weights(w, v, g) - (w * _grad_weights(w, v, g)).sum(
            -1, keepdim=True),
        "You subtracted the weighted mean but did not multiply by the weights: the Jacobian "
        "is diag(p) - p p^T, so each entry is p_i * (g_i - sum_j p_j g_j)",
    ),
]


def _batched_gradient_shape(got: Any, expected: torch.Tensor) -> None:
    if (isinstance(got, torch.Tensor) and expected.dim() > 2 and got.dim() >= 2
            and got.shape[-2:] == expected.shape[-2:] and got.shape != expected.shape):
        raise CheckFailure(
            f"For batched inputs the gradient should have shape {tuple(expected.shape)}, got "
            f"{tuple(got.shape)}. Transpose only the last two dimensions of v, "
            "v.transpose(-2, -1) (v.T flips every dimension)"
        )


def _show_gradient_fading(scores_gradient: Callable) -> None:
    """Print the learner's gradient on one row of scores made 1, 4, 16 and 64 times larger: it
    fades as the softmax saturates. In float64: float32 would round the tiniest gradients away
    (to 0, or to its rounding noise)."""
    gen = torch.Generator().manual_seed(0)
    v, grad_out = torch.randn(6, 4, generator=gen), torch.randn(1, 4, generator=gen)
    raw = torch.randn(1, 6, generator=gen)  # (T=1, S=6): one row of scores
    v, grad_out, raw = v.double(), grad_out.double(), raw.double()
    for size in (1, 4, 16, 64):
        weights = torch.softmax(size * raw, dim=-1)  # (1, 6): larger scores, sharper softmax
        case = Case(f"one row of scores x {size}", (weights, v, grad_out))
        grad = call_learner(scores_gradient, case)  # (1, 6)
        print(f"scores x {size:>2}: largest weight {weights.max():.3f}, "
              f"gradient norm {grad.norm():.2e}")


def check_scores_gradient(scores_gradient: Callable) -> None:
    """Check ``scores_gradient(weights, v, grad_out)`` against autograd, then show how the
    gradient it computes fades on a row of ever larger scores.

    Args:
        scores_gradient: the learner's function taking the attention weights
            A = softmax(S) of shape (..., T, S), the values v (..., S, d_v) and the gradient
            of the loss with respect to out = A v, grad_out (..., T, d_v), and returning the
            gradient of the loss with respect to the scores S, shape (..., T, S).
    """

    def check_one(got, case: Case) -> None:
        weights, v, grad_out = case.args
        expected = _reference_scores_gradient(weights, v, grad_out)
        _batched_gradient_shape(got, expected)
        compare_tensors(got, expected, case, what="Your gradient with respect to the scores",
                        misconceptions=SCORES_GRADIENT_MISTAKES)

    run_cases("scores_gradient", scores_gradient, _scores_gradient_cases(seed=24), check_one)
    _show_gradient_fading(scores_gradient)


# --------------------------------------------------------------------------- exercise 2.5
# The learner's function answers a yes/no question, so each case knows the right answer and
# a plausible wrong implementation is recognised by the pattern of its answers over all cases.


def attention_layer(d: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """A fixed single-head self-attention layer without positions, X (..., T, d) -> (..., T, d)."""
    gen = torch.Generator().manual_seed(seed)
    w_q, w_k, w_v = (rand(gen, d, d, scale=1.0 / math.sqrt(d)) for _ in range(3))

    def self_attention(x: torch.Tensor) -> torch.Tensor:
        return scaled_dot_product_attention(x @ w_q.T, x @ w_k.T, x @ w_v.T)[0]

    return self_attention


def _with_positions(f: Callable) -> Callable[[torch.Tensor], torch.Tensor]:
    """``f`` applied after adding sinusoidal position vectors (so order matters)."""

    def attention_with_positions(x: torch.Tensor) -> torch.Tensor:
        return f(x + sinusoidal_encoding(x.shape[-2], x.shape[-1], dtype=x.dtype))

    return attention_with_positions


def _tokenwise_mlp(d: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = rand(gen, 2 * d, d), rand(gen, d, 2 * d)  # (out, in), as nn.Linear

    def tokenwise_mlp(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w1.T) @ w2.T

    return tokenwise_mlp


def _running_sum(x: torch.Tensor) -> torch.Tensor:
    return x.cumsum(dim=-2)


def _minus_first_token(x: torch.Tensor) -> torch.Tensor:
    return x - x[..., :1, :]


@dataclass
class _EquivarianceCase:
    name: str
    f: Callable[[torch.Tensor], torch.Tensor]
    x: torch.Tensor
    perm: torch.Tensor
    expected: bool
    why: str  # what f is and why the answer is what it is

    def as_case(self) -> Case:
        return Case(self.name, (self.f, self.x, self.perm), hint=(
            "permute the token axis, which is the second-to-last one (dim -2): "
            "X[..., perm, :] and f(X)[..., perm, :]. X may have batch dimensions in front"))


def _cycle(n: int, shift: int = 1) -> torch.Tensor:
    """A permutation that is not its own inverse (for n > 2)."""
    return torch.roll(torch.arange(n), shift)


def _equivariance_cases(seed: int) -> list[_EquivarianceCase]:
    gen = torch.Generator().manual_seed(seed)
    att8, att6, att16 = attention_layer(8, seed + 1), attention_layer(6, seed + 2), \
        attention_layer(16, seed + 3)
    swap_and_cycle = torch.tensor([2, 0, 1, 4, 3, 5])
    return [
        _EquivarianceCase(
            "self-attention, T=6, d=8", att8, rand(gen, 6, 8), swap_and_cycle, True,
            "f is self-attention without positions, which is permutation equivariant"),
        _EquivarianceCase(
            "self-attention after adding positions, T=6, d=8", _with_positions(att8),
            rand(gen, 6, 8), swap_and_cycle, False,
            "f adds a position vector to each token before attending, so reordering the "
            "tokens changes the outputs"),
        _EquivarianceCase(
            "token-wise MLP, batched X (3, 5, 4)", _tokenwise_mlp(4, seed + 4),
            rand(gen, 3, 5, 4), _cycle(5, 2), True,
            "f transforms every token on its own (X has a batch dimension in front)"),
        _EquivarianceCase(
            "running sum over tokens, T=d=5", _running_sum, rand(gen, 5, 5), _cycle(5), False,
            "f is a running sum over the tokens, which depends on their order"),
        _EquivarianceCase(
            "self-attention, T=d=6", att6, rand(gen, 6, 6), _cycle(6, 2), True,
            "f is self-attention without positions"),
        _EquivarianceCase(
            "self-attention, T=40, d=16 (float rounding)", att16, rand(gen, 40, 16),
            torch.randperm(40, generator=gen), True,
            "f is self-attention without positions; the two sides differ only by float "
            "rounding (about 1e-7)"),
        _EquivarianceCase(
            "self-attention, swap two tokens, T=4, d=6", att6, rand(gen, 4, 6),
            torch.tensor([0, 3, 2, 1]), True,
            "f is self-attention without positions"),
        _EquivarianceCase(
            "running sum, identity permutation", _running_sum, rand(gen, 4, 3),
            torch.arange(4), True,
            "perm is the identity: every function passes this test"),
        _EquivarianceCase(
            "subtract the first token, batched X (2, 6, 3)", _minus_first_token,
            rand(gen, 2, 6, 3), _cycle(6), False,
            "f subtracts the first token from every token, so it treats position 0 specially"),
        _EquivarianceCase(
            "self-attention after adding positions, batched X (2, 5, 8)", _with_positions(att8),
            rand(gen, 2, 5, 8), _cycle(5, 3), False,
            "f adds position vectors before attending"),
    ]


def _permute(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    return x[..., perm, :]


EQUIVARIANCE_MISTAKES = [
    Misconception(
        lambda f, x, perm: torch.allclose(f(_permute(x, perm)), f(x), atol=1e-5),
        "You compared f(X[perm]) with f(X) itself. Equivariance means the outputs move with "
        "the inputs: compare f(X[perm]) with f(X)[perm], the rows of f(X) reordered the same "
        "way",
    ),
    Misconception(
        lambda f, x, perm: torch.equal(f(_permute(x, perm)), _permute(f(x), perm)),
        "You tested exact equality (== or torch.equal). Reordering changes the order of the "
        "additions inside f, so the two sides differ by float rounding (about 1e-7): compare "
        "with torch.allclose(a, b, atol=1e-5)",
    ),
    Misconception(
        lambda f, x, perm: torch.allclose(f(_permute(x, perm)), _permute(f(x), perm)),
        "torch.allclose's default tolerance (atol=1e-8) is too strict for float32 numbers "
        "close to 0, which carry rounding errors of about 1e-7: pass atol=1e-5",
    ),
    Misconception(
        lambda f, x, perm: torch.allclose(f(_permute(x, perm)),
                                          _permute(f(x), torch.argsort(perm)), atol=1e-5),
        "You reordered f(X) with the inverse permutation. Apply the same perm to both: "
        "f(X[perm]) against f(X)[perm]",
    ),
    Misconception(
        lambda f, x, perm: torch.allclose(f(x[..., perm]), f(x)[..., perm], atol=1e-5),
        "You permuted the last axis (the features). The tokens are along the second-to-last "
        "axis: use X[..., perm, :] and f(X)[..., perm, :]",
    ),
    Misconception(
        lambda f, x, perm: torch.allclose(f(x[perm]), f(x)[perm], atol=1e-5),
        "You permuted the first axis, which is the batch when X is batched. The tokens are "
        "along the second-to-last axis: use X[..., perm, :] and f(X)[..., perm, :]",
    ),
]


def _as_bool(value: Any, case: Case) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        return bool(value)
    if type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    hint = ""
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        hint = " You returned one answer per element: reduce it with .all(), or use torch.allclose."
    raise CheckFailure(
        f"is_permutation_equivariant should return True or False, got {describe(value)} "
        f"(case '{case.name}').{hint}"
    )


def _answers(fn: Callable, cases: Sequence[_EquivarianceCase]) -> list[bool | None]:
    """A reference implementation's answers; None where it raises (it does not apply)."""
    answers: list[bool | None] = []
    for c in cases:
        try:
            answers.append(bool(fn(c.f, c.x.clone(), c.perm.clone())))
        except Exception:
            answers.append(None)
    return answers


def check_is_permutation_equivariant(is_permutation_equivariant: Callable) -> None:
    """Check ``is_permutation_equivariant(f, X, perm)`` = whether f(X[perm]) ~ f(X)[perm].

    Args:
        is_permutation_equivariant: the learner's function taking f (a function from
            (..., T, d) to (..., T, d_out)), X (..., T, d) and perm (T,), a permutation of
            range(T), and returning a bool: True if f(X[..., perm, :]) equals
            f(X)[..., perm, :] up to float rounding.
    """
    cases = _grade_tester(is_permutation_equivariant)
    labels = "; ".join(c.name for c in cases)
    print(f"\u2705 is_permutation_equivariant is correct on all {len(cases)} test cases "
          f"({labels})")


def _grade_tester(is_permutation_equivariant: Callable) -> list[_EquivarianceCase]:
    """Run the learner's tester on every case; raise CheckFailure on the first wrong answer."""
    cases = _equivariance_cases(seed=24)
    got = []
    for c in cases:
        got.append(_as_bool(call_learner(is_permutation_equivariant, c.as_case()), c.as_case()))
    expected = [c.expected for c in cases]
    if got != expected:
        first = next(i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e)
        case = cases[first]
        for m in EQUIVARIANCE_MISTAKES:
            answers = _answers(m.wrong, cases)
            if all(a is None or a == g for a, g in zip(answers, got, strict=True)) and (
                answers[first] == got[first]
            ):
                raise CheckFailure(f"{m.message} (seen on the case '{case.name}')")
        raise CheckFailure(
            f"On the case '{case.name}' your function returned {got[first]}, but the answer is "
            f"{case.expected}: {case.why}. Compare f(X[..., perm, :]) with f(X)[..., perm, :] "
            "using torch.allclose(a, b, atol=1e-5)"
        )
    return cases


# The five functions of exercise 2.5, each (..., T, 8) -> (..., T, 8): which of them are
# permutation equivariant? The learner predicts, then the check runs the learner's tester on
# each of them (a batch of inputs, several permutations) and grades the predictions against
# the reference answers.


def _causal_attention(d: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w_q, w_k, w_v = (rand(gen, d, d, scale=1.0 / math.sqrt(d)) for _ in range(3))

    def causal_attention(x: torch.Tensor) -> torch.Tensor:
        mask = causal_mask(x.shape[-2], device=x.device)  # (T, T): query t sees keys 0..t
        return scaled_dot_product_attention(x @ w_q.T, x @ w_k.T, x @ w_v.T, mask=mask)[0]

    return causal_attention


def _mean_added_back(x: torch.Tensor) -> torch.Tensor:
    return x + x.mean(dim=-2, keepdim=True)  # (..., T, d)


def equivariance_suspects(d: int = 8, seed: int = 25) -> dict[str, Callable]:
    """The five functions of exercise 2.5, by name, each mapping (..., T, d) to (..., T, d)."""
    attention = attention_layer(d, seed)
    return {
        "attention": attention,
        "attention with positions": _with_positions(attention),
        "causal attention": _causal_attention(d, seed),
        "per-token MLP": _tokenwise_mlp(d, seed + 1),
        "mean added back": _mean_added_back,
    }


SUSPECT_ANSWERS = {
    "attention": True,
    "attention with positions": False,
    "causal attention": False,
    "per-token MLP": True,
    "mean added back": True,
}

SUSPECT_WHY = {
    "attention": "without positions a token's weights depend only on the vectors of the "
                 "tokens, not on where they stand, and the softmax's sum does not care about "
                 "the order of its terms",
    "attention with positions": "the position vector added to a token belongs to the place, "
                                "not to the token: after a reordering each token carries "
                                "another position vector",
    "causal attention": "the mask lets token t see the tokens before it; after a reordering "
                        "a token has other tokens before it, so it averages another set",
    "per-token MLP": "each output row is computed from its own input row alone, so the rows "
                     "simply move with the tokens",
    "mean added back": "the mean over the tokens does not depend on their order, and adding "
                       "the same vector to every row keeps the rows' order",
}


def _read_suspect_predictions(got: Any) -> dict[str, bool]:
    predictions = prediction_dict(got, list(SUSPECT_ANSWERS), "predict_equivariant()")
    read = {}
    for name in SUSPECT_ANSWERS:
        answer = predictions[name]
        if not isinstance(answer, bool | np.bool_):
            raise CheckFailure(f"Your prediction for {name!r} should be True (equivariant) or "
                               f"False (not), got {describe(answer)}")
        read[name] = bool(answer)
    return read


def _tester_verdict(tester: Callable, f: Callable, gen: torch.Generator) -> bool:
    """The tester's answer over a batch of inputs and three permutations that move tokens."""
    verdicts = []
    for _ in range(3):
        x = rand(gen, 2, 6, 8)  # (B, T, D)
        perm = torch.randperm(6, generator=gen)
        while bool((perm == torch.arange(6)).all()):
            perm = torch.randperm(6, generator=gen)
        case = Case("the five functions", (f, x, perm))
        verdicts.append(_as_bool(call_learner(tester, case), case))
    return all(verdicts)


def check_equivariance_study(predict_equivariant: Callable[[], dict],
                             is_permutation_equivariant: Callable) -> None:
    """Exercise 2.5: grade the tester (as :func:`check_is_permutation_equivariant`), then the
    predictions about :func:`equivariance_suspects`, and print what the tester measured.

    Args:
        predict_equivariant: the learner's function, no arguments, returning a dict that maps
            each of the five names to True (equivariant) or False.
        is_permutation_equivariant: the learner's tester, (f, X, perm) -> bool.
    """
    said = _read_suspect_predictions(predict_equivariant())
    _grade_tester(is_permutation_equivariant)
    gen = torch.Generator().manual_seed(26)
    measured = {name: _tester_verdict(is_permutation_equivariant, f, gen)
                for name, f in equivariance_suspects().items()}
    print(f"{'function':>24} | {'you predicted':>13} | {'your tester says':>16}")
    for name in SUSPECT_ANSWERS:
        print(f"{name:>24} | {str(said[name]):>13} | {str(measured[name]):>16}")
    wrong = [name for name in SUSPECT_ANSWERS if said[name] != SUSPECT_ANSWERS[name]]
    if wrong:
        raise CheckFailure("Your tester works, and it disagrees with some predictions: " + " ".join(
            f"{name!r} is {'' if SUSPECT_ANSWERS[name] else 'not '}equivariant: "
            f"{SUSPECT_WHY[name]}." for name in wrong))
    print("\u2705 your tester works on all the test cases, and your predictions match it: "
          "anything that looks at where a token stands (a position vector, a mask) breaks "
          "equivariance; anything that treats the tokens as a set keeps it")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
