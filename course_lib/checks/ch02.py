"""Checks for chapter 02, self-attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..attention import attention_scores, softmax
from ._core import Case, CheckFailure, Misconception, compare_tensors, rand, run_cases

BATCH_HINT = (
    "your function seems to handle 2-D inputs only. With leading batch dimensions, transpose "
    "just the last two dimensions, k.transpose(-2, -1); k.T reverses all of them"
)


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


def _raw(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-2, -1)


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


def check_attention_weights(attention_weights: Callable) -> None:
    """Check ``attention_weights(q, k)`` = softmax(q k^T / sqrt(d)) over the keys.

    Args:
        attention_weights: the learner's function taking q (..., T, d) and k (..., S, d) and
            returning weights of shape (..., T, S).
    """

    def check_one(got, case: Case) -> None:
        q, k = case.args
        expected = softmax(attention_scores(q, k))
        if isinstance(got, torch.Tensor) and torch.isnan(got).any() and case.name == "large scores":
            raise CheckFailure(
                "Your weights contain NaN when the scores are large: exp() overflows. Subtract "
                "each row's maximum before exponentiating (it cancels in the ratio), or use "
                "torch.softmax, which does this for you"
            )
        if (
            isinstance(got, torch.Tensor)
            and got.dim() >= 2
            and q.dim() > 2
            and got.shape[-2:] == expected.shape[-2:]
            and got.shape != expected.shape
        ):
            raise CheckFailure(
                f"For batched inputs of shape {tuple(q.shape)} the weights should have shape "
                f"{tuple(expected.shape)}, got {tuple(got.shape)}. Transpose only the last two "
                "dimensions of k: k.transpose(-2, -1) (k.T flips every dimension)"
            )
        compare_tensors(got, expected, case, what="Your attention weights",
                        misconceptions=ATTENTION_WEIGHT_MISTAKES)

    run_cases("attention_weights", attention_weights, _qk_cases(seed=2), check_one)
