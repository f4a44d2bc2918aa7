"""The pieces around attention: the position-wise feed-forward network, LayerNorm and RMSNorm.

Shape legend: B batch, T sequence length, D d_model, F feed-forward width.

``layer_norm``/``LayerNorm`` are the teaching path: eqs. 27-28 written out. The models run
``torch.nn.LayerNorm`` (one fused kernel instead of six), and a test proves both agree.
``rms_norm``/``RMSNorm`` are the variant of most recent models (Llama, T5): no mean is
subtracted and there is no bias; tests compare them with ``torch.nn.RMSNorm``.
Residual connections are one addition each and are written inline in the blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    checks_wanted,
    require_bool,
    require_choice,
    require_dtype_of,
    require_features,
    require_floating,
    require_ndim,
    require_positive_int,
    require_positive_number,
    require_probability,
    require_tensor,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact erf form, as in BERT and nn.TransformerEncoderLayer
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Look up an activation by name: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``."""
    require_choice("activation", name, tuple(ACTIVATIONS))
    return ACTIVATIONS[name]


def dropout_layer(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity()`` when p is 0 (it would do nothing, at a cost)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


def _check_input(x: object, layer: nn.Module, weight: torch.Tensor | None, d_model: int) -> None:
    """x must be a floating (..., D) tensor of the layer's dtype."""
    require_ndim("x", x, range(1, 9), "(..., D)")
    require_floating("x", x)
    require_features("x", x, d_model, "d_model")
    if weight is not None:
        require_dtype_of("x", x, weight, f"the {type(layer).__name__}'s weights")


class FeedForward(nn.Module):
    """Position-wise feed-forward network, W2 act(W1 h + b1) + b2 (eq. 17 of the notes).

    The same two-layer MLP is applied to every position separately: nothing here mixes
    positions, which is left to attention. The hidden width F is usually 4 to 5 times D.

    Args:
        d_model: D.
        d_ff: F, defaults to 4 * D.
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.
        dropout: dropout after the activation, during training.
        bias: whether the two linear layers have biases.

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        *,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
    ) -> None:
        super().__init__()
        require_positive_int("d_model", d_model)
        d_ff = 4 * d_model if d_ff is None else require_positive_int("d_ff", d_ff)
        require_probability("dropout", dropout)
        require_bool("bias", bias)
        self.activation_name = activation
        self.activation = get_activation(activation)
        self.d_model = d_model
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)  # expand: D -> F
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)  # project back: F -> D
        self.dropout = dropout_layer(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if checks_wanted():
            _check_input(x, self, self.fc1.weight, self.d_model)
        # W2 act(W1 h + b1) + b2
        return self.fc2(self.dropout(self.activation(self.fc1(x))))  # (..., D)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}"


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Layer normalisation over the last dimension (eqs. 27-28 of the notes, plus eps).

    mu and sigma^2 are the mean and the (biased, 1/D) variance of each position's D features;
    each position is normalised on its own, so positions never share statistics.

    Args:
        x: activations, shape (..., D).
        weight: the gain gamma, shape (D,), or None.
        bias: the shift beta, shape (D,), or None.
        eps: added to the variance before the square root so a constant vector does not
            divide by zero.

    Returns:
        (x - mu) / sqrt(sigma^2 + eps) * gamma + beta, shape (..., D).
    """
    _check_norm_args(x, eps, weight=weight, bias=bias)
    return _layer_norm(x, weight, bias, eps)


def _check_norm_args(x: object, eps: object, **params: torch.Tensor | None) -> None:
    """x a floating (..., D) tensor (the same 1 to 8 dimensions as the modules accept, see
    _check_input), eps > 0, each given param (D,) of x's dtype."""
    require_ndim("x", x, range(1, 9), "(..., D)")
    require_floating("x", x)
    require_positive_number("eps", eps)
    for name, param in params.items():
        if param is not None:
            require_tensor(name, param)
            if param.shape != x.shape[-1:]:
                raise ValueError(
                    f"{name} has shape {tuple(param.shape)} but x has {x.shape[-1]} features "
                    f"(shape {tuple(x.shape)}); {name} should have shape ({x.shape[-1]},)"
                )
            require_dtype_of(name, param, x, "x's values")


def _layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    # eq. 27: mu = mean_j x_j, sigma^2 = mean_j (x_j - mu)^2, per position
    mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # (..., 1), divides by D, not D-1
    # eq. 28 with eps: x_hat = (x - mu) / sqrt(sigma^2 + eps)
    out = (x - mean) / torch.sqrt(var + eps)  # (..., D)
    if weight is not None:
        out = out * weight  # (..., D) gamma * x_hat
    if bias is not None:
        out = out + bias  # (..., D) gamma * x_hat + beta
    return out


class LayerNorm(nn.Module):
    """LayerNorm written from the equations, with optional learned gain and bias.

    Args:
        d_model: D.
        eps: numerical-stability constant (1e-5 as in ``nn.LayerNorm``; BERT uses 1e-12).
        elementwise_affine: learn a gain gamma (initialised to 1).
        bias: also learn a shift beta (initialised to 0); ignored without a gain.

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(
        self, d_model: int, *, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True
    ) -> None:
        super().__init__()
        require_positive_int("d_model", d_model)
        require_positive_number("eps", eps)
        require_bool("elementwise_affine", elementwise_affine)
        require_bool("bias", bias)
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(d_model)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if checks_wanted():
            _check_input(x, self, self.weight, self.d_model)
        return _layer_norm(x, self.weight, self.bias, self.eps)  # (..., D)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, affine={self.weight is not None}"


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor | None = None, *, eps: float = 1e-6
) -> torch.Tensor:
    """RMS normalisation over the last dimension (Zhang and Sennrich, 2019).

    LayerNorm with one step left out: the mean is not subtracted, so each position is divided
    by its root mean square sqrt(mean(x^2) + eps) instead of its standard deviation, and
    there is a gain but no shift. Same as ``torch.nn.functional.rms_norm``.

    Args:
        x: activations, shape (..., D).
        weight: the gain gamma, shape (D,), or None.
        eps: added to the mean square before the square root (Llama uses 1e-6).

    Returns:
        x / sqrt(mean(x^2) + eps) * gamma, shape (..., D).
    """
    _check_norm_args(x, eps, weight=weight)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    mean_square = (x**2).mean(dim=-1, keepdim=True)  # (..., 1), no mean subtracted
    # x / sqrt(mean_j x_j^2 + eps): LayerNorm's eq. 28 without "- mu"
    out = x / torch.sqrt(mean_square + eps)  # (..., D)
    return out if weight is None else out * weight  # (..., D) gamma * x / rms(x)


class RMSNorm(nn.Module):
    """RMSNorm written from its equation, with an optional learned gain (no bias).

    The parameter is called ``weight``, as in ``torch.nn.RMSNorm``, so state dicts load
    either way. ``torch.nn.RMSNorm``'s default eps (None) means ``torch.finfo(x.dtype).eps``;
    here it is a number, 1e-6 by default, as in Llama.

    Args:
        d_model: D.
        eps: numerical-stability constant inside the square root.
        elementwise_affine: learn a gain gamma (initialised to 1).

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6, elementwise_affine: bool = True) -> None:
        super().__init__()
        require_positive_int("d_model", d_model)
        require_positive_number("eps", eps)
        require_bool("elementwise_affine", elementwise_affine)
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if checks_wanted():
            _check_input(x, self, self.weight, self.d_model)
        return _rms_norm(x, self.weight, self.eps)  # (..., D)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, affine={self.weight is not None}"
