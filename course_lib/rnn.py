"""The Elman RNN, h_t = sigma(W h_{t-1} + U x_t + b), used to show the limits of recurrence,
and two measurements of those limits: how many operations must run one after another
(:func:`sequential_depth`) and how strongly each input still reaches the last output
(:func:`gradient_norms`).

Shape legend: B batch, T sequence length, Din input size, H hidden size.

Convention: vectors are rows, so W h_{t-1} for a batch of states is ``h_prev @ W.T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from ._validate import (
    require_bool,
    require_choice,
    require_dtype_of,
    require_floating,
    require_ndim,
    require_positive_int,
    require_same_dtype,
    require_size,
    shape_of,
)

Activation = Callable[[torch.Tensor], torch.Tensor]

_NONLINEARITIES: dict[str, Activation] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
}


def _activation(name: str) -> Activation:
    require_choice("nonlinearity", name, sorted(_NONLINEARITIES))
    return _NONLINEARITIES[name]


# ------------------------------------------------------------------------- argument checks


def _check_weights(W: torch.Tensor, U: torch.Tensor, b: torch.Tensor | None) -> int:
    """Check the shapes W (H, H), U (H, Din), b (H,) or None, and that W is floating; return H."""
    require_ndim("W", W, (2,), "(H, H)")
    require_ndim("U", U, (2,), "(H, Din)")
    hidden = W.shape[0]
    require_size("W", W, 1, hidden, "W must be square: its number of rows H")
    require_size("U", U, 0, hidden, "the hidden size H (rows of W)")
    if b is not None:
        require_ndim("b", b, (1,), "(H,)")
        require_size("b", b, 0, hidden, "the hidden size H")
    require_floating("W", W)
    return hidden


def _check_batch(x_name: str, x_batch: int, h_name: str, h: torch.Tensor) -> None:
    """A batched hidden state (B, H) must have the inputs' batch size."""
    if h.dim() == 2 and h.shape[0] != x_batch:
        raise ValueError(
            f"{x_name} has batch size {x_batch} but {h_name} has batch size {h.shape[0]} "
            f"(shape {shape_of(h)})"
        )


def _check_step(
    x_t: torch.Tensor, h_prev: torch.Tensor, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None,
) -> None:
    """The arguments of :func:`elman_step`."""
    require_ndim("x_t", x_t, (1, 2), "(B, Din) or (Din,)")
    require_ndim("h_prev", h_prev, (1, 2), "(B, H) or (H,)")
    hidden = _check_weights(W, U, b)
    require_size("x_t", x_t, -1, U.shape[1], "the input size Din (columns of U)")
    require_size("h_prev", h_prev, -1, hidden, "the hidden size H (rows of W)")
    if x_t.dim() == 2:
        _check_batch("x_t", x_t.shape[0], "h_prev", h_prev)
    require_same_dtype({"W": W, "U": U, "b": b, "x_t": x_t, "h_prev": h_prev})


def _check_sequence(
    x: torch.Tensor, h0: torch.Tensor | None, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None,
) -> None:
    """The arguments of :func:`elman_forward` (h0 may be None: zeros)."""
    require_ndim("x", x, (2, 3), "(B, T, Din) or (T, Din)")
    if h0 is not None:
        require_ndim("h0", h0, (1, 2), "(B, H) or (H,)")
    hidden = _check_weights(W, U, b)
    require_size("x", x, -1, U.shape[1], "the input size Din (columns of U)")
    if h0 is not None:
        require_size("h0", h0, -1, hidden, "the hidden size H")
        _check_batch("x", x.shape[0] if x.dim() == 3 else 1, "h0", h0)
    require_same_dtype({"W": W, "U": U, "b": b, "x": x, "h0": h0})


# ----------------------------------------------------------------------------- computation


def elman_step(
    x_t: torch.Tensor,
    h_prev: torch.Tensor,
    W: torch.Tensor,
    U: torch.Tensor,
    b: torch.Tensor | None = None,
    *,
    nonlinearity: str = "tanh",
) -> torch.Tensor:
    """One step of an Elman RNN, h_t = sigma(W h_{t-1} + U x_t + b) (eq. 4 of the notes).

    Args:
        x_t: the input at step t, shape (B, Din) or (Din,).
        h_prev: the previous hidden state h_{t-1}, shape (B, H) or (H,).
        W: hidden-to-hidden weights, shape (H, H).
        U: input-to-hidden weights, shape (H, Din).
        b: bias, shape (H,), or None.
        nonlinearity: ``"tanh"`` (default), ``"sigmoid"`` or ``"relu"``.

    Returns:
        h_t, shape (B, H), or (H,) when both x_t and h_prev are unbatched.

    Raises:
        ValueError: for shapes that do not fit together, or tensors of different dtypes
            (e.g. float64 from numpy with float32 weights).
    """
    sigma = _activation(nonlinearity)
    _check_step(x_t, h_prev, W, U, b)
    return _elman_step(x_t, h_prev, W, U, b, sigma)


def _elman_step(
    x_t: torch.Tensor, h_prev: torch.Tensor, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None, sigma: Activation,
) -> torch.Tensor:
    # h_t = sigma(W h_{t-1} + U x_t + b); with row vectors W h is h @ W.T
    pre = h_prev @ W.T + x_t @ U.T  # (B, H)
    if b is not None:
        pre = pre + b
    return sigma(pre)  # (B, H)


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

    Raises:
        ValueError: for shapes that do not fit together or tensors of different dtypes.
    """
    sigma = _activation(nonlinearity)
    require_ndim("h0", h0, (1, 2), "(B, H) or (H,)")
    _check_sequence(x, h0, W, U, b)
    return _elman_forward(x, h0, W, U, b, sigma)


def _elman_forward(
    x: torch.Tensor, h0: torch.Tensor | None, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None, sigma: Activation,
) -> torch.Tensor:
    """The loop of :func:`elman_forward` on checked arguments (h0 None means zeros)."""
    unbatched = x.dim() == 2
    if unbatched:
        x = x.unsqueeze(0)  # (1, T, Din)
    batch, hidden = x.shape[0], W.shape[0]
    if h0 is None:
        h0 = x.new_zeros(batch, hidden)  # (B, H)
    h = h0 if h0.dim() == 2 else h0.expand(batch, hidden)  # (B, H)

    # U x_t + b has no time dependence: compute it for every t at once
    inputs = x @ U.T  # (B, T, H)
    if b is not None:
        inputs = inputs + b
    states = []
    for t in range(x.shape[1]):  # the serial part
        h = sigma(h @ W.T + inputs[:, t])  # h_t = sigma(W h_{t-1} + U x_t + b), (B, H)
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
        self.input_size = require_positive_int("input_size", input_size)
        self.hidden_size = require_positive_int("hidden_size", hidden_size)
        require_bool("bias", bias)
        self.nonlinearity = nonlinearity
        bound = 1.0 / math.sqrt(hidden_size)  # the same initialisation as nn.RNN
        self.W = nn.Parameter(torch.empty(hidden_size, hidden_size).uniform_(-bound, bound))
        self.U = nn.Parameter(torch.empty(hidden_size, input_size).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.empty(hidden_size).uniform_(-bound, bound)) if bias else None

    def forward(
        self, x: torch.Tensor, h0: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_input(x, h0)
        sigma = _NONLINEARITIES[self.nonlinearity]
        out = _elman_forward(x, h0, self.W, self.U, self.b, sigma)  # (B, T, H)
        return out, out[..., -1, :]

    def _check_input(self, x: torch.Tensor, h0: torch.Tensor | None) -> None:
        """Shapes as in :func:`elman_forward`; x and h0 in the dtype of the weights."""
        require_ndim("x", x, (2, 3), "(B, T, Din) or (T, Din)")
        require_dtype_of("x", x, self.W, "the RNN's weights")
        if h0 is not None:
            require_ndim("h0", h0, (1, 2), "(B, H) or (H,)")
            require_dtype_of("h0", h0, self.W, "the RNN's weights")
        _check_sequence(x, h0, self.W, self.U, self.b)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, nonlinearity={self.nonlinearity!r}"


def sequential_depth(output: torch.Tensor) -> int:
    """The number of operations on the longest chain of the autograd graph behind ``output``.

    Operations on that chain each need the previous one's result, so they must run one after
    another however many processors there are: it counts the serial steps of a computation.
    An Elman RNN over T steps adds a few operations per step (so the depth grows like T); a
    self-attention layer has the same depth for every T.

    Args:
        output: a tensor computed, with gradients enabled, from tensors that require grad
            (e.g. a module's parameters).

    Returns:
        The number of operations (autograd nodes other than the leaves) on the longest path.
    """
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"output must be a torch.Tensor, got {type(output).__name__}")
    if output.grad_fn is None:
        raise ValueError(
            "output has no autograd graph (output.grad_fn is None): compute it with gradients "
            "enabled (not under torch.no_grad()) from tensors that require grad"
        )
    depth: dict = {}
    stack = [(output.grad_fn, False)]
    # Iterative post-order walk: an RNN's graph is thousands of nodes deep, too deep to recurse.
    while stack:
        node, children_done = stack.pop()
        if node in depth:
            continue
        children = [n for n, _ in node.next_functions if n is not None]
        if children_done:
            is_leaf = type(node).__name__ == "AccumulateGrad"
            depth[node] = 0 if is_leaf else 1 + max((depth[c] for c in children), default=0)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if c not in depth)
    return depth[output.grad_fn]


def gradient_norms(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """How strongly each input position reaches the output at the last position.

    Entry t is the L2 norm of the gradient of ``fn(x)[..., -1, :].sum()`` (the sum of the
    last output vector, h_T for an RNN) with respect to the input vector x_t. For an Elman
    RNN it shrinks (or grows) geometrically with the distance T - t; for self-attention it
    does not depend on the distance.

    Args:
        fn: maps inputs (T, Din) or (B, T, Din) to outputs (T, H) or (B, T, H), e.g.
            ``lambda x: rnn(x)[0]``. With a batch, the examples must not interact (true of
            RNNs and attention layers), so each example gets its own gradient.
        x: the inputs, shape (T, Din) or (B, T, Din). Not modified.

    Returns:
        Norms of shape (T,) (or (B, T)), detached. Nothing is accumulated in the ``.grad``
        of x or of any parameter.
    """
    require_ndim("x", x, (2, 3), "(T, Din) or (B, T, Din)")
    require_floating("x", x)
    if not callable(fn):
        raise TypeError(f"fn must be a function of x, got {type(fn).__name__}")
    leaf = x.detach().clone().requires_grad_(True)  # (B, T, Din) or (T, Din)
    with torch.enable_grad():
        out = fn(leaf)
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"fn must return a tensor of outputs (T, H) or (B, T, H), got "
                f"{type(out).__name__}; for a module returning a tuple use "
                "lambda x: module(x)[0]"
            )
        if out.dim() != x.dim() or out.shape[:-1] != x.shape[:-1]:
            raise ValueError(
                f"fn(x) has shape {shape_of(out)}, but for x of shape {shape_of(x)} it should "
                f"have shape {tuple(x.shape[:-1]) + ('H',)}: one output vector per position"
            )
        if not out.requires_grad:
            raise ValueError("fn(x) does not depend on x through differentiable operations")
        (grad,) = torch.autograd.grad(out[..., -1, :].sum(), leaf)  # (B, T, Din)
    return grad.norm(dim=-1)  # (B, T) or (T,)
