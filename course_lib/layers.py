"""The pieces around attention: the position-wise feed-forward networks (the MLP of the
original Transformer and GPT, the gated SwiGLU of Llama), LayerNorm and RMSNorm.
Shape legend: B batch, T sequence length, D d_model, F feed-forward width.

``layer_norm``/``LayerNorm`` write eqs. 27-28 out; the models run the fused ``nn.LayerNorm``,
and a test proves both agree. ``rms_norm``/``RMSNorm`` (Llama) subtract no mean, have no bias.
:func:`make_norm` and :func:`make_feed_forward` build the kind a block's ``norm``/``ffn``
option names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_choice,
    require_dtype_of,
    require_features,
    require_floating,
    require_ndim,
    require_positive_number,
    require_probability,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # the exact erf form, as in BERT and nn.TransformerEncoderLayer
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
}
NORMS = ("layer", "rms")  # LayerNorm (GPT-2, BERT) or RMSNorm (Llama)
# FeedForward (GPT-2, BERT), SwiGLU (Llama) or none (an attention-only model, chapter 11)
FEED_FORWARDS = ("mlp", "swiglu", "none")


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called ``name``: one of ``ACTIVATIONS``."""
    require_choice("activation", name, tuple(ACTIVATIONS))
    return ACTIVATIONS[name]


def dropout_layer(p: float) -> nn.Module:
    """``nn.Dropout(p)``, or ``nn.Identity()`` when p is 0 (it would do nothing, at a cost)."""
    return nn.Dropout(p) if p > 0 else nn.Identity()


class FeedForward(nn.Module):
    """Position-wise feed-forward network, W2 act(W1 h + b1) + b2 (eq. 17 of the notes): the
    same two-layer MLP at every position; nothing here mixes positions.

    Args:
        d_model, d_ff: D and F (F defaults to 4 * D).
        activation, dropout: the activation's name and the dropout after it (in training).
        bias: whether the two linear layers have biases.

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(self, d_model: int, d_ff: int | None = None, *, activation: str = "relu",
                 dropout: float = 0.0, bias: bool = True) -> None:
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else d_ff
        check_positive_ints(d_model=d_model, d_ff=d_ff)
        require_probability("dropout", dropout)
        check_bools(bias=bias)
        self.activation_name = activation
        self.activation = get_activation(activation)
        self.d_model = d_model
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias)  # expand: D -> F
        self.fc2 = nn.Linear(d_ff, d_model, bias=bias)  # project back: F -> D
        self.dropout = dropout_layer(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(x, weight=self.fc1.weight)
        # W2 act(W1 h + b1) + b2
        return self.fc2(self.dropout(self.activation(self.fc1(x))))  # (..., D)

    def extra_repr(self) -> str:
        return f"activation={self.activation_name!r}"


class SwiGLU(nn.Module):
    """The gated feed-forward network of Llama (Shazeer, 2020, "GLU variants"), position-wise
    like :class:`FeedForward`: one projection, through SiLU, gates another elementwise.
    The submodules have the names of Hugging Face's ``LlamaMLP``.

    Args:
        d_model, d_ff: D and F (F defaults to 4 * D; Llama takes about 8/3 D, so that its three
            matrices hold as many parameters as the MLP's two at 4 D).
        dropout: dropout on the gated product (in training).
        bias: whether the three linear layers have biases (Llama's have none).

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(self, d_model: int, d_ff: int | None = None, *, dropout: float = 0.0,
                 bias: bool = False) -> None:
        super().__init__()
        d_ff = 4 * d_model if d_ff is None else d_ff
        check_positive_ints(d_model=d_model, d_ff=d_ff)
        require_probability("dropout", dropout)
        check_bools(bias=bias)
        self.d_model = d_model
        self.gate_proj = nn.Linear(d_model, d_ff, bias=bias)  # D -> F, through SiLU: the gate
        self.up_proj = nn.Linear(d_model, d_ff, bias=bias)  # D -> F, the values it gates
        self.down_proj = nn.Linear(d_ff, d_model, bias=bias)  # project back: F -> D
        self.dropout = dropout_layer(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layer_input(x, weight=self.gate_proj.weight)
        # W_down (silu(W_gate h) * (W_up h)), silu(z) = z * sigmoid(z)
        gated = F.silu(self.gate_proj(x)) * self.up_proj(x)  # (..., F)
        return self.down_proj(self.dropout(gated))  # (..., D)


def make_feed_forward(ffn: str, d_model: int, d_ff: int | None = None, *,
                      activation: str = "relu", dropout: float = 0.0,
                      bias: bool = True) -> nn.Module | None:
    """The feed-forward network called ``ffn``: ``"mlp"`` a :class:`FeedForward` with
    ``activation``, ``"swiglu"`` a :class:`SwiGLU` (whose activation is always SiLU), or
    ``"none"`` None (a block without one)."""
    require_choice("ffn", ffn, FEED_FORWARDS)
    if ffn == "none":
        return None
    if ffn == "swiglu":
        return SwiGLU(d_model, d_ff, dropout=dropout, bias=bias)
    return FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)


def make_norm(norm: str, d_model: int, *, eps: float = 1e-5) -> nn.Module:
    """The fused normalisation called ``norm``: ``"layer"`` ``nn.LayerNorm`` (gain and
    bias) or ``"rms"`` ``nn.RMSNorm`` (gain only), each with this ``eps``. The equations are
    :func:`layer_norm` and :func:`rms_norm`."""
    require_choice("norm", norm, NORMS)
    check_positive_ints(d_model=d_model)
    require_positive_number("eps", eps)
    if norm == "rms":
        return nn.RMSNorm(d_model, eps=eps)
    return nn.LayerNorm(d_model, eps=eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, *, eps: float = 1e-5) -> torch.Tensor:
    """Layer normalisation over the last dimension (eqs. 27-28 of the notes, plus eps).

    Args:
        x, weight, bias: activations (..., D), the gain gamma and the shift beta (D,) or None.
        eps: added to the variance so that a constant vector does not divide by zero.

    Returns:
        (x - mu) / sqrt(sigma^2 + eps) * gamma + beta, shape (..., D).
    """
    check_layer_input(x, eps, weight=weight, bias=bias)
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
    """:func:`layer_norm` as a module, with optional learned gain and bias.

    Args:
        d_model, eps: D, and eps as in :func:`layer_norm` (1e-5 as in ``nn.LayerNorm``).
        elementwise_affine, bias: learn a gain gamma (initialised to 1), and a shift beta
            (initialised to 0; only with a gain).

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(self, d_model: int, *, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True) -> None:
        check_positive_ints(d_model=d_model)
        check_bools(elementwise_affine=elementwise_affine, bias=bias)
        require_positive_number("eps", eps)
        super().__init__()
        self.d_model = d_model
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d_model)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(d_model)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, eps=self.eps)  # (..., D)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, affine={self.weight is not None}"


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, *,
             eps: float = 1e-6) -> torch.Tensor:
    """RMS normalisation over the last dimension, as ``torch.nn.functional.rms_norm``.

    Args:
        x, weight: activations (..., D) and the gain gamma (D,) or None.
        eps: added to the mean square before the square root (Llama uses 1e-6).

    Returns:
        x / sqrt(mean(x^2) + eps) * gamma, shape (..., D).
    """
    check_layer_input(x, eps, weight=weight)
    mean_square = (x**2).mean(dim=-1, keepdim=True)  # (..., 1), no mean subtracted
    # x / sqrt(mean_j x_j^2 + eps): LayerNorm's eq. 28 without "- mu"
    out = x / torch.sqrt(mean_square + eps)  # (..., D)
    return out if weight is None else out * weight  # (..., D) gamma * x / rms(x)


class RMSNorm(nn.Module):
    """:func:`rms_norm` as a module, with an optional learned gain ``weight`` (as in
    ``torch.nn.RMSNorm``, whose default eps is the dtype's; here it is 1e-6, as in Llama).

    Args:
        d_model, eps: D, and eps as in :func:`rms_norm`.
        elementwise_affine: learn a gain gamma (initialised to 1).

    Shapes:
        forward(x: (..., D)) -> (..., D)
    """

    def __init__(self, d_model: int, *, eps: float = 1e-6, elementwise_affine: bool = True) -> None:
        check_positive_ints(d_model=d_model)
        check_bools(elementwise_affine=elementwise_affine)
        require_positive_number("eps", eps)
        super().__init__()
        self.d_model = d_model
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(d_model)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, eps=self.eps)  # (..., D)

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}, affine={self.weight is not None}"


# --- argument checks


def check_layer_input(x: object, eps: object = 1.0, **params: torch.Tensor | None) -> None:
    """x a floating (..., D) tensor, eps > 0, each given parameter of size D in its last
    dimension and of x's dtype."""
    if not checks_wanted():
        return
    require_floating("x", require_ndim("x", x, range(1, 9), "(..., D)"))
    require_positive_number("eps", eps)
    for name, param in params.items():
        if param is not None:
            require_features("x", x, param.shape[-1], f"{name}.shape[-1]")  # D
            require_dtype_of("x", x, param, f"{name}'s values")
