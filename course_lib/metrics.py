"""Accuracy of predicted token ids against targets that mark unscored positions with -100, and
how well cross-attention follows a known alignment. An instrument never gives a false
all-clear: NaN weights, float ids and nothing to score are refused."""

from __future__ import annotations

import torch

from ._validate import (
    check_shapes,
    checks_wanted,
    require_finite,
    require_integer_tensor,
    require_ndim,
    require_tensor,
    shape_of,
    values_checked,
)
from .tokenizer import IGNORE_INDEX


def token_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored target positions (targets != -100) that are predicted right.

    Args:
        predictions: predicted ids (e.g. ``logits.argmax(-1)``), any shape.
        targets: the same shape, with -100 where nothing is predicted.
    """
    check_scored(predictions, targets)
    scored = targets != IGNORE_INDEX
    return float(((predictions == targets) & scored).sum() / scored.sum())


def sequence_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of sequences whose every scored position (targets != -100) is predicted right;
    a sequence with nothing scored is left out.

    Args:
        predictions, targets: (N, T) ids, targets with -100 where nothing is predicted.
    """
    check_scored(predictions, targets)
    check_shapes(targets=(targets, "N T"), predictions=(predictions, "N T"))
    scored = targets != IGNORE_INDEX  # (N, T)
    judged = scored.any(dim=1)  # (N,) sequences with something to score
    correct = ((predictions == targets) | ~scored).all(dim=1) & judged  # (N,)
    return float(correct.sum() / judged.sum())


def alignment_score(weights: torch.Tensor, alignment: torch.Tensor) -> float:
    """Share of the target positions with a gold alignment (``alignment != -100``) whose
    largest attention weight falls on exactly that source position; 1 / S by chance.

    Args:
        weights: (..., T, S) cross-attention weights of one layer and head (or a mean).
        alignment: (..., T), the gold source index of each target position, or -100.
    """
    check_alignment(weights, alignment)
    peaks = weights.argmax(dim=-1)  # (..., T): the source position each query attends most
    scored = alignment != IGNORE_INDEX  # (..., T) positions with a gold alignment
    return float(((peaks == alignment) & scored).sum() / scored.sum())


# --- argument checks


def check_scored(
    predictions: torch.Tensor, targets: torch.Tensor, *,
    names: tuple[str, str] = ("predictions", "targets"),
) -> None:
    """Raise unless both are integer tensors of one shape and some target is not -100 (an
    accuracy of nothing is no accuracy); ``names`` are the arguments as the learner wrote them."""
    if not checks_wanted():
        return
    for name, x in zip(names, (predictions, targets), strict=True):
        require_integer_tensor(name, require_tensor(name, x), "integer ids")
    if predictions.shape != targets.shape:
        raise ValueError(f"{names[0]} has shape {shape_of(predictions)} but {names[1]} has shape "
                         f"{shape_of(targets)}; they must match")
    if not (targets != IGNORE_INDEX).any():
        raise ValueError(f"{names[1]} {shape_of(targets)} has no scored position (all -100?)")


def check_alignment(weights: object, alignment: object) -> None:
    """weights (..., T, S) finite, alignment (..., T) integer positions 0..S-1 or -100, some of
    them scored."""
    if not checks_wanted():
        return
    require_finite("weights", require_tensor("weights", weights), "an argmax of NaN is no peak")
    require_ndim("weights", weights, range(2, 64), "(..., T, S)")
    check_scored(weights.argmax(dim=-1), alignment, names=("weights.argmax(-1)", "alignment"))
    gold = alignment[alignment != IGNORE_INDEX]
    if values_checked(gold) and bool(((gold < 0) | (gold >= weights.shape[-1])).any()):
        raise ValueError(f"alignment holds source positions outside 0..{weights.shape[-1] - 1} "
                         f"(weights have S = {weights.shape[-1]} keys): got {gold.tolist()[:8]}")
