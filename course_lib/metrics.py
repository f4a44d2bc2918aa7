"""Accuracy of predicted token ids against targets that mark unscored positions with -100, and
how well cross-attention follows a known alignment."""

from __future__ import annotations

import torch

from ._validate import (
    require_finite,
    require_integer_tensor,
    require_ndim,
    require_tensor,
    shape_of,
)
from .tokenizer import IGNORE_INDEX


def _check_scored(predictions: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Check two integer tensors of one shape; return the scored positions (targets != -100),
    refusing when there is none (an accuracy of nothing is no accuracy)."""
    require_tensor("predictions", predictions)
    require_tensor("targets", targets)
    if predictions.shape != targets.shape:
        raise ValueError(
            f"predictions has shape {shape_of(predictions)} but targets has shape "
            f"{shape_of(targets)}; they must match"
        )
    require_integer_tensor("predictions", predictions, "predicted token ids")
    require_integer_tensor("targets", targets, "target token ids")
    scored = targets != IGNORE_INDEX
    if not scored.any():
        raise ValueError(f"targets (shape {shape_of(targets)}) has no scored position: it is "
                         f"empty or every entry is {IGNORE_INDEX}, so there is nothing to score")
    return scored


def token_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of the scored target positions (targets != -100) that are predicted right.

    Args:
        predictions: predicted ids (e.g. ``logits.argmax(-1)``), any shape.
        targets: the same shape, with -100 where nothing is predicted.
    """
    scored = _check_scored(predictions, targets)
    correct = (predictions == targets) & scored
    return float(correct.sum() / scored.sum())


def sequence_accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Share of sequences whose every target position (targets != -100) is predicted right.
    A sequence with no scored position is left out (there is nothing to judge in it).

    Args:
        predictions: (N, T) predicted ids (e.g. ``logits.argmax(-1)``).
        targets: (N, T) with -100 where nothing is predicted.
    """
    require_ndim("targets", targets, (2,), "(N, T): one row per sequence")
    scored = _check_scored(predictions, targets)  # (N, T)
    judged = scored.any(dim=1)  # (N,) sequences with something to score
    correct = ((predictions == targets) | ~scored).all(dim=1) & judged  # (N,)
    return float(correct.sum() / judged.sum())


def alignment_score(weights: torch.Tensor, alignment: torch.Tensor) -> float:
    """How often attention peaks on the gold source position: the share of the target
    positions that have a gold alignment (``alignment != -100``) whose largest attention
    weight falls on exactly that source position.

    Args:
        weights: (..., T, S) cross-attention weights, e.g. (B, T, S) for one layer and head
            (``out.cross_attentions[layer][:, head]``) or averaged over heads.
        alignment: (..., T), the same leading shape: the gold source index of each target
            position, -100 where there is none.

    Returns:
        A float in [0, 1]; 1 / S for attention that peaks on a random position.
    """
    require_tensor("weights", weights)
    require_tensor("alignment", alignment)
    require_finite("weights", weights, "the argmax of a row holding NaN is meaningless")
    if weights.dim() < 2 or alignment.shape != weights.shape[:-1]:
        raise ValueError(
            f"weights has shape {shape_of(weights)} and alignment {shape_of(alignment)}: "
            f"weights must be (..., T, S) and alignment (..., T) with the same leading shape "
            f"(pick one layer and head first, e.g. weights[:, head])"
        )
    if alignment.dtype.is_floating_point or alignment.dtype == torch.bool:
        raise ValueError(f"alignment must hold integer source positions, got dtype "
                         f"{alignment.dtype}")
    scored = alignment != IGNORE_INDEX
    if not scored.any():
        raise ValueError("alignment has no scored position (every entry is -100)")
    n_src = weights.shape[-1]
    if int(alignment[scored].min()) < 0 or int(alignment[scored].max()) >= n_src:
        raise ValueError(f"alignment holds source positions outside 0..{n_src - 1} "
                         f"(weights has S={n_src} source positions)")
    peaks = weights.argmax(dim=-1)  # (..., T): the source position each query attends most
    return float(((peaks == alignment) & scored).sum() / scored.sum())
