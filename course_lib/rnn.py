"""The Elman RNN, h_t = sigma(W h_{t-1} + U x_t + b), used to show the limits of recurrence.

Shape legend: B batch, T sequence length, Din input size, H hidden size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ._validate import require_ndim, require_size

_NONLINEARITIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
}


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _NONLINEARITIES:
        raise ValueError(
            f"nonlinearity must be one of {sorted(_NONLINEARITIES)}, got {name!r}"
        )
    return _NONLINEARITIES[name]


def elman_forward(
    x: torch.Tensor,
    h0: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    nonlinearity: str = "tanh",
) -> torch.Tensor:
    """Run an Elman RNN over a sequence, one step after another.

    Each step needs the previous hidden state, so the loop over t cannot be parallelised:
    that is the O(T) chain of serial steps attention removes.

    Args:
        x: inputs, shape (B, T, Din) or (T, Din).
        h0: initial hidden state, shape (B, H) or (H,).
        W: hidden-to-hidden weights, shape (H, H).
        U: input-to-hidden weights, shape (H, Din).
        b: bias, shape (H,), or None.
        nonlinearity: ``"tanh"`` (default), ``"sigmoid"`` or ``"relu"``.

    Returns:
        All hidden states h_1..h_T, shape (B, T, H) (or (T, H) for unbatched input).
    """
    sigma = _activation(nonlinearity)
    require_ndim("x", x, (2, 3), "(B, T, Din) or (T, Din)")
    require_ndim("W", W, (2,), "(H, H)")
    require_ndim("U", U, (2,), "(H, Din)")
    hidden = W.shape[0]
    require_size("W", W, 1, hidden, "W must be square: its number of rows H")
    require_size("U", U, 0, hidden, "the hidden size H (rows of W)")
    require_size("x", x, -1, U.shape[1], "the input size Din (columns of U)")
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(0)  # (1, T, Din)
    require_ndim("h0", h0, (1, 2), "(B, H) or (H,)")
    h = h0 if h0.dim() == 2 else h0.unsqueeze(0).expand(x.shape[0], -1)  # (B, H)
    require_size("h0", h, -1, hidden, "the hidden size H")
    if h.shape[0] != x.shape[0]:
        raise ValueError(f"h0 has batch size {h.shape[0]} but x has batch size {x.shape[0]}")
    if b is not None:
        require_ndim("b", b, (1,), "(H,)")
        require_size("b", b, 0, hidden, "the hidden size H")

    inputs = x @ U.T  # (B, T, H): the input part has no time dependence, so do it all at once
    if b is not None:
        inputs = inputs + b
    states = []
    for t in range(x.shape[1]):  # the serial part
        h = sigma(h @ W.T + inputs[:, t])  # (B, H)
        states.append(h)
    out = torch.stack(states, dim=1)  # (B, T, H)
    return out.squeeze(0) if unbatched else out


class ElmanRNN(nn.Module):
    """A single-layer Elman RNN with parameters W (H, H), U (H, Din) and b (H,).

    Args:
        input_size: Din.
        hidden_size: H.
        nonlinearity: ``"tanh"`` (default, as in ``nn.RNN``), ``"sigmoid"`` or ``"relu"``.
        bias: whether to learn b.

    Shapes:
        forward(x: (B, T, Din) or (T, Din), h0: (B, H) or None) -> (outputs (B, T, H), h_T (B, H))
    """

    def __init__(
        self, input_size: int, hidden_size: int, *, nonlinearity: str = "tanh", bias: bool = True
    ) -> None:
        super().__init__()
        _activation(nonlinearity)
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.nonlinearity = nonlinearity
        bound = 1.0 / math.sqrt(hidden_size)  # the same initialisation as nn.RNN
        self.W = nn.Parameter(torch.empty(hidden_size, hidden_size).uniform_(-bound, bound))
        self.U = nn.Parameter(torch.empty(hidden_size, input_size).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.empty(hidden_size).uniform_(-bound, bound)) if bias else None

    def forward(
        self, x: torch.Tensor, h0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        require_ndim("x", x, (2, 3), "(B, T, Din) or (T, Din)")
        if h0 is None:
            batch = () if x.dim() == 2 else (x.shape[0],)
            h0 = x.new_zeros(*batch, self.hidden_size)
        out = elman_forward(x, h0, self.W, self.U, self.b, nonlinearity=self.nonlinearity)
        return out, out[..., -1, :]

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, nonlinearity={self.nonlinearity!r}"
