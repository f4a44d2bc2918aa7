"""The pieces around attention: position-wise feed-forward, LayerNorm, residual connections.

Shape legend: B batch, T sequence length, D d_model, F feed-forward width.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import require_floating, require_positive_int, require_tensor, shape_of

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact erf form, as in BERT and nn.TransformerEncoderLayer
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Look up an activation by name: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def _require_last_dim(name: str, x: torch.Tensor, size: int, owner: str) -> None:
    require_tensor(name, x)
    if x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(
            f"{name} has shape {shape_of(x)} but its last dimension should be {owner}={size}"
        )


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
        self.activation_name = activation
        self.activation = get_activation(activation)
        self.d_model = d_model
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)  # expand: D -> F
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)  # project back: F -> D
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self.d_model, "d_model")
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
    require_tensor("x", x)
    require_floating("x", x)
    mean = x.mean(dim=-1, keepdim=True)  # (..., 1)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)  # (..., 1), divides by D, not D-1
    out = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
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
        self.d_model = d_model
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(d_model)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _require_last_dim("x", x, self.d_model, "d_model")
        return layer_norm(x, self.weight, self.bias, eps=self.eps)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, affine={self.weight is not None}"


class Residual(nn.Module):
    """A residual connection around any module: f(h) + h (eq. 29 of the notes).

    Shapes:
        forward(x: (..., D), *args, **kwargs) -> (..., D)
    """

    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        out = self.fn(x, *args, **kwargs)
        if out.shape != x.shape:
            raise ValueError(
                f"a residual connection needs the sublayer to keep the shape: input {shape_of(x)}, "
                f"sublayer output {shape_of(out)}"
            )
        return x + out


class AddNorm(nn.Module):
    """"Add & Norm" around a sublayer, in either of its two orders.

    * pre-norm (``norm_first=True``, eq. 30): h + dropout(f(LN(h)))
    * post-norm (``norm_first=False``, eq. 31, the original Transformer and BERT):
      LN(h + dropout(f(h)))

    The sublayer is passed to :meth:`forward` as a callable, so one wrapper serves attention
    (which needs masks) and the feed-forward network alike.

    Args:
        d_model: D.
        norm_first: pre-norm if True, post-norm if False.
        dropout: dropout on the sublayer's output during training.
        eps: LayerNorm's eps.

    Shapes:
        forward(x: (B, T, D), fn: (B, T, D) -> (B, T, D)) -> (B, T, D)
    """

    def __init__(
        self, d_model: int, *, norm_first: bool = True, dropout: float = 0.0, eps: float = 1e-5
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm = LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        if self.norm_first:
            return x + self.dropout(fn(self.norm(x)))
        return self.norm(x + self.dropout(fn(x)))

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}"
