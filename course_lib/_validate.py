"""Argument checks that turn a learner's mistake into a message naming the problem.

Every public function in course_lib calls these before doing any tensor work, so a wrong shape
or dtype fails at the call the learner wrote, with the argument's name, what it received and
what was expected -- not three frames deep inside torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shape_of(x: torch.Tensor) -> str:
    """Format a tensor's shape as a tuple, e.g. ``(2, 3, 4)`` or ``(3,)``."""
    return str(tuple(x.shape))


def require_tensor(name: str, x: object) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_ndim(name: str, x: object, allowed: Sequence[int], expected: str) -> torch.Tensor:
    """Raise ``ValueError`` unless ``x`` has one of the ``allowed`` numbers of dimensions.

    Args:
        name: argument name as the learner wrote it, e.g. ``"q"``.
        x: the value received.
        allowed: accepted values of ``x.dim()``.
        expected: the expected shape in legend letters, e.g. ``"(B, T, D) or (T, D)"``.
    """
    x = require_tensor(name, x)
    if x.dim() not in allowed:
        raise ValueError(
            f"{name} should have shape {expected}, but got a {x.dim()}-D tensor of shape "
            f"{shape_of(x)}"
        )
    return x


def require_size(name: str, x: torch.Tensor, dim: int, size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``x.shape[dim] == size`` (``what`` names the source of size)."""
    if x.shape[dim] != size:
        raise ValueError(
            f"{name} has size {x.shape[dim]} in dimension {dim} (shape {shape_of(x)}), "
            f"but {what} is {size}"
        )


def require_floating(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` holds floating-point numbers."""
    if not torch.is_floating_point(x):
        raise ValueError(
            f"{name} must be a floating-point tensor, got dtype {x.dtype}; "
            f"convert it with {name}.float()"
        )


def require_bool_mask(name: str, mask: object) -> torch.Tensor:
    """Raise ``ValueError`` unless ``mask`` is a boolean tensor (True = may attend)."""
    mask = require_tensor(name, mask)
    if mask.dtype != torch.bool:
        hint = ""
        if torch.is_floating_point(mask):
            hint = (
                ". An additive float mask of 0 / -inf is a bias, not a mask: pass it as bias=..., "
                f"or turn it into a boolean mask with ({name} == 0)"
            )
        raise ValueError(
            f"{name} must be a boolean tensor where True means 'may attend', got dtype "
            f"{mask.dtype}{hint}"
        )
    return mask


def require_broadcastable(
    name: str, x: torch.Tensor, target: Sequence[int], expected: str
) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts to ``target`` without growing it."""
    try:
        ok = tuple(torch.broadcast_shapes(x.shape, tuple(target))) == tuple(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} has shape {shape_of(x)}, which does not broadcast to the attention scores' "
            f"shape ({', '.join(str(s) for s in target)}); expected {expected}"
        )


def require_positive_int(name: str, value: object) -> int:
    """Raise ``ValueError`` unless ``value`` is an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value
