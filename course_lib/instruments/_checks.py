"""Checks only the instruments need, on top of the library's rules in ``course_lib._validate``."""

from __future__ import annotations

import torch


def require_deterministic(name: str, model: torch.nn.Module) -> None:
    """Refuse a model in training mode with dropout: every run differs, so nothing would agree
    (the instruments that compare runs or read one pass need a deterministic model)."""
    random_parts = [
        f"{part or type(model).__name__} (p={p:g})" for part, module in model.named_modules()
        if module.training and (p := _dropout_p(module)) > 0
    ]
    if random_parts:
        raise ValueError(
            f"{name} ({type(model).__name__}) is in training mode and has dropout: "
            f"{', '.join(random_parts[:3])}{', ...' if len(random_parts) > 3 else ''}. Its "
            f"outputs are random, so no two runs agree; call {name}.eval() first"
        )


def _dropout_p(module: torch.nn.Module) -> float:
    """The dropout probability a module applies in training mode (0 if none): a dropout
    layer's p, or an attention layer's float ``dropout`` (course_lib's MultiHeadAttention)."""
    if isinstance(module, torch.nn.modules.dropout._DropoutNd):
        return float(module.p)
    p = getattr(module, "dropout", None)
    return float(p) if isinstance(p, float) else 0.0
