"""Accuracy of predicted token ids against targets that mark unscored positions with -100."""

from __future__ import annotations

import torch

from ._validate import require_tensor, shape_of
from .tokenizer import IGNORE_INDEX


def _require_same_shape(predictions: torch.Tensor, targets: torch.Tensor) -> None:
    require_tensor("predictions", predictions)
    require_tensor("targets", targets)
    if predictions.shape != targets.shape:
        raise ValueError(
            f"predictions has shape {shape_of(predictions)} but targets has shape "
            f"{shape_of(targets)}; they must match"
        )


def token_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored target positions (targets != -100) that are predicted right.

    Args:
        predictions: predicted ids (e.g. ``logits.argmax(-1)``), any shape.
        targets: the same shape, with -100 where nothing is predicted.
    """
    _require_same_shape(predictions, targets)
    scored = targets != IGNORE_INDEX
    if not scored.any():
        raise ValueError("targets has no scored position (every entry is -100)")
    correct = (predictions == targets) & scored
    return float(correct.sum() / scored.sum())


def sequence_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of sequences whose every target position (targets != -100) is predicted right.

    Args:
        predictions: (N, T) predicted ids (e.g. ``logits.argmax(-1)``).
        targets: (N, T) with -100 where nothing is predicted.
    """
    _require_same_shape(predictions, targets)
    scored = targets != IGNORE_INDEX
    correct = (predictions == targets) | ~scored
    return float(correct.all(dim=1).float().mean())
