"""The Elman RNN, h_t = sigma(W h_{t-1} + U x_t + b), used to show the limits of recurrence,
and two measurements of those limits: how many operations must run one after another
(:func:`sequential_depth`) and how strongly each input still reaches the last output
(:func:`gradient_norms`). Then the bridge to self-attention: attention first appeared inside
RNN encoder-decoders (:class:`RNNAttention`, :class:`RNNEncoderDecoder`).

Shape legend: B batch, T sequence length, Din input size, H hidden size.

Convention: vectors are rows, so W h_{t-1} for a batch of states is ``h_prev @ W.T``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    check_id,
    check_token_ids,
    require_bool,
    require_bool_mask,
    require_choice,
    require_dtype_of,
    require_floating,
    require_ndim,
    require_positive_int,
    require_same_dtype,
    require_size,
    shape_of,
)
from .tokenizer import IGNORE_INDEX

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


# ------------------------------------------------- attention over an RNN encoder's states
#
# Before self-attention, attention was added to RNN encoder-decoders (Bahdanau et al., 2015):
# at every output step the decoder's state asks a question of all the encoder's states and
# reads a weighted average of them, instead of squeezing the source into one fixed vector.
# Legend for this part: B batch, S source length, T target length, E embedding size,
# H hidden size, Dq query size, Dk key (= value) size, A additive score width, V vocabulary.

_SCORES = ("additive", "dot")


class RNNAttention(nn.Module):
    """Attention of decoder states over encoder states, as in RNN encoder-decoders.

    The query is a decoder state s; the keys, which are also the values, are the encoder
    states h_1..h_S. Two ways to score them:

    - ``"additive"`` (Bahdanau et al., 2015): e_j = v^T tanh(W_s s + W_h h_j);
    - ``"dot"`` (Luong et al., 2015, their "general" score): e_j = (W_s s) . h_j.

    Then alpha = softmax(e) over the source positions and the context is
    c = sum_j alpha_j h_j. Source positions where ``mask`` is False (padding) get weight 0;
    a query with no allowed position gets all-zero weights and a zero context.

    Args:
        query_size: Dq, the size of a decoder state.
        key_size: Dk, the size of an encoder state.
        score: ``"additive"`` (default) or ``"dot"``.
        attention_size: A, the width of the additive score's hidden layer (default Dk);
            not used by ``"dot"``.

    Shapes:
        forward(query: (B, Dq) or (B, T, Dq), keys: (B, S, Dk), mask: (B, S) bool or None)
        -> (context: (B, Dk) or (B, T, Dk), weights: (B, S) or (B, T, S))
    """

    def __init__(
        self, query_size: int, key_size: int, *, score: str = "additive",
        attention_size: int | None = None,
    ) -> None:
        super().__init__()
        require_positive_int("query_size", query_size)
        require_positive_int("key_size", key_size)
        require_choice("score", score, _SCORES)
        self.score = score
        if score == "dot":
            self.query_proj = nn.Linear(query_size, key_size, bias=False)  # W_s
            return
        attention_size = key_size if attention_size is None else attention_size
        require_positive_int("attention_size", attention_size)
        self.query_proj = nn.Linear(query_size, attention_size, bias=False)  # W_s
        self.key_proj = nn.Linear(key_size, attention_size, bias=False)  # W_h
        self.v = nn.Linear(attention_size, 1, bias=False)  # v^T

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_attention_args(query, keys, mask, self.query_proj.in_features,
                              self.query_proj.weight)
        single = query.dim() == 2
        q = query.unsqueeze(1) if single else query  # (B, T, Dq)
        scores = self._scores(q, keys, self.project_keys(keys))  # (B, T, S)
        context, weights = _attend(scores, keys, mask)  # (B, T, Dk), (B, T, S)
        return (context.squeeze(1), weights.squeeze(1)) if single else (context, weights)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """W_h h_j for every key (B, S, A), or None for the dot score. A decoder computes it
        once per source and reuses it at every step, as Bahdanau et al. do."""
        return None if self.score == "dot" else self.key_proj(keys)  # (B, S, A)

    def _scores(
        self, q: torch.Tensor, keys: torch.Tensor, projected_keys: torch.Tensor | None
    ) -> torch.Tensor:
        if self.score == "dot":
            # e_tj = (W_s s_t) . h_j
            return self.query_proj(q) @ keys.transpose(1, 2)  # (B, T, S)
        # e_tj = v^T tanh(W_s s_t + W_h h_j)
        hidden = torch.tanh(self.query_proj(q)[:, :, None] + projected_keys[:, None])
        return self.v(hidden).squeeze(-1)  # (B, T, S)

    def _step(
        self, query: torch.Tensor, keys: torch.Tensor, projected_keys: torch.Tensor | None,
        blocked: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder query (B, Dq) on checked inputs whose every row has an allowed key;
        ``blocked`` is ~mask, (B, S). Returns the context (B, Dk) and the weights (B, S)."""
        scores = self._scores(query[:, None], keys, projected_keys)[:, 0]  # (B, S)
        weights = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1)  # (B, S)
        return (weights[:, None] @ keys)[:, 0], weights  # (B, Dk), (B, S)

    def extra_repr(self) -> str:
        return f"score={self.score!r}"


def _attend(
    scores: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha = softmax over the allowed source positions, c = alpha @ h."""
    if mask is not None:
        allowed = mask[:, None, :]  # (B, 1, S)
        scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # (B, T, S)
    if mask is not None:  # a query with no allowed key: zeros, not NaN
        weights = weights.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    return weights @ keys, weights  # (B, T, Dk), (B, T, S)


def _check_attention_args(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, query_size: int,
    weight: torch.Tensor,
) -> None:
    """Shapes and dtypes of an :class:`RNNAttention` call (no values are read)."""
    require_ndim("query", query, (2, 3), "(B, Dq) or (B, T, Dq)")
    require_ndim("keys", keys, (3,), "(B, S, Dk)")
    require_size("query", query, -1, query_size, "the query_size Dq of this attention")
    require_dtype_of("query", query, weight, "the attention's weights")
    require_dtype_of("keys", keys, weight, "the attention's weights")
    if query.shape[0] != keys.shape[0]:
        raise ValueError(f"query has batch size {query.shape[0]} but keys has batch size "
                         f"{keys.shape[0]} (shape {shape_of(keys)}); they must match")
    if mask is not None:
        require_bool_mask("mask", mask)
        if mask.shape != keys.shape[:2]:
            raise ValueError(f"mask has shape {shape_of(mask)} but should be (B, S) = "
                             f"{tuple(keys.shape[:2])}, one entry per key (True = real token)")


class RNNSeq2SeqOutput(NamedTuple):
    """What :class:`RNNEncoderDecoder` returns.

    Attributes:
        logits: (B, T, V) scores for the next target token at every target position.
        loss: mean cross-entropy against ``targets`` (-100 entries not scored), or None.
        weights: (B, T, S) the attention weights of every target step over the source
            (None for a model without attention).
    """

    logits: torch.Tensor
    loss: torch.Tensor | None
    weights: torch.Tensor | None


class RNNEncoderDecoder(nn.Module):
    """A GRU encoder-decoder for translation, with or without attention over the source.

    Encoder: an embedding and a bidirectional GRU; source word j is represented by
    h_j = [forward state; backward state] (2H numbers), the word in its context on both sides.

    Decoder: a GRU cell that writes the target one token at a time from the previous target
    token y_{t-1} and a context vector c_t:

    - ``attention=None``: c_t = c for every t, where c joins the last forward and the first
      backward state: the whole source squeezed into one vector (Cho et al., 2014);
    - ``attention="additive"`` or ``"dot"``: c_t = sum_j alpha_tj h_j, with alpha_t computed by
      :class:`RNNAttention` from the previous decoder state s_{t-1} (Bahdanau et al., 2015).

    Then s_t = GRU([emb(y_{t-1}); c_t], s_{t-1}) and logits_t = W_o [s_t; c_t], starting
    from s_0 = tanh(W_0 c). Sources are right-padded; padding is skipped by the encoder and
    never attended to.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes.
        d_embed: E, the embedding size.
        hidden_size: H, the GRUs' hidden size.
        attention: ``"additive"`` (default), ``"dot"`` or None.
        pad_id: the source padding id, used when no ``src_attention_mask`` is given.

    Shapes:
        forward(src (B, S), tgt (B, T), targets (B, T) or None, src_attention_mask (B, S))
        -> RNNSeq2SeqOutput(logits (B, T, V), loss, weights (B, T, S) or None)
    """

    def __init__(
        self, src_vocab_size: int, tgt_vocab_size: int, *, d_embed: int = 32,
        hidden_size: int = 64, attention: str | None = "additive", pad_id: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("src_vocab_size", src_vocab_size), ("d_embed", d_embed),
                            ("tgt_vocab_size", tgt_vocab_size), ("hidden_size", hidden_size)):
            require_positive_int(name, value)
        if attention is not None:
            require_choice("attention", attention, _SCORES)
        if pad_id is not None:
            check_id("pad_id", pad_id, src_vocab_size)
        self.src_vocab_size, self.tgt_vocab_size, self.pad_id = \
            src_vocab_size, tgt_vocab_size, pad_id
        self.src_embed = nn.Embedding(src_vocab_size, d_embed)
        self.tgt_embed = nn.Embedding(tgt_vocab_size, d_embed)
        self.encoder = nn.GRU(d_embed, hidden_size, batch_first=True, bidirectional=True)
        self.init_state = nn.Linear(2 * hidden_size, hidden_size)  # W_0
        self.attention = (None if attention is None else
                          RNNAttention(hidden_size, 2 * hidden_size, score=attention))
        self.cell = nn.GRUCell(d_embed + 2 * hidden_size, hidden_size)
        self.out = nn.Linear(3 * hidden_size, tgt_vocab_size)  # W_o on [s_t; c_t]

    def forward(
        self, src: torch.Tensor, tgt: torch.Tensor, *, targets: torch.Tensor | None = None,
        src_attention_mask: torch.Tensor | None = None,
    ) -> RNNSeq2SeqOutput:
        mask = self._check(src, src_attention_mask)
        check_token_ids("tgt", tgt, self.tgt_vocab_size)
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"src has batch size {src.shape[0]} but tgt has batch size "
                             f"{tgt.shape[0]}; they must match")
        if targets is not None and targets.shape != tgt.shape:
            raise ValueError(f"targets has shape {shape_of(targets)} but tgt has shape "
                             f"{shape_of(tgt)}: one target per decoder input")
        memory = self._memory(src, mask)
        s = torch.tanh(self.init_state(memory[1]))  # (B, H): s_0
        embedded = self.tgt_embed(tgt)  # (B, T, E)
        outputs, weights = [], []
        for t in range(tgt.shape[1]):  # one target token after another
            s, context, alpha = self._step(embedded[:, t], s, memory)
            outputs.append(torch.cat([s, context], dim=-1))  # (B, 3H)
            weights.append(alpha)
        logits = self.out(torch.stack(outputs, dim=1))  # (B, T, V)
        loss = None
        if targets is not None:  # mean cross-entropy over the scored (not -100) positions
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
        alignment = None if self.attention is None else torch.stack(weights, dim=1)  # (B, T, S)
        return RNNSeq2SeqOutput(logits, loss, alignment)

    def encode(
        self, src: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states h_j (B, S, 2H) and the summary c (B, 2H), for checked inputs."""
        lengths = mask.sum(dim=1).cpu()  # (B,)
        packed = nn.utils.rnn.pack_padded_sequence(
            self.src_embed(src), lengths, batch_first=True, enforce_sorted=False)
        out, last = self.encoder(packed)  # last: (2, B, H), final state of each direction
        states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                     total_length=src.shape[1])  # (B, S, 2H)
        return states, torch.cat([last[0], last[1]], dim=-1)  # (B, S, 2H), (B, 2H)

    def _memory(self, src: torch.Tensor, mask: torch.Tensor) -> tuple:
        """What every decoder step reads: the encoder states (B, S, 2H), the summary c
        (B, 2H), the keys' projection for an additive score (or None) and ~mask (B, S)."""
        states, summary = self.encode(src, mask)
        keys = None if self.attention is None else self.attention.project_keys(states)
        return states, summary, keys, ~mask

    def _step(self, y_prev: torch.Tensor, s: torch.Tensor, memory: tuple) -> tuple:
        """One decoder step: (s_t (B, H), c_t (B, 2H), alpha_t (B, S) or None)."""
        states, summary, projected_keys, blocked = memory
        alpha = None
        if self.attention is None:
            context = summary  # (B, 2H): the same vector at every step
        else:  # the query is s_{t-1}
            context, alpha = self.attention._step(s, states, projected_keys, blocked)
        s = self.cell(torch.cat([y_prev, context], dim=-1), s)  # (B, H): s_t
        return s, context, alpha

    @torch.no_grad()
    def generate(
        self, src: torch.Tensor, *, bos_id: int, max_new_tokens: int,
        eos_id: int | None = None, src_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Greedy decoding: (B, max_new_tokens) target ids, without the leading ``bos_id``;
        after ``eos_id`` a row is filled with ``eos_id``."""
        mask = self._check(src, src_attention_mask)
        check_id("bos_id", bos_id, self.tgt_vocab_size)
        if eos_id is not None:
            check_id("eos_id", eos_id, self.tgt_vocab_size)
        require_positive_int("max_new_tokens", max_new_tokens)
        memory = self._memory(src, mask)
        s = torch.tanh(self.init_state(memory[1]))  # (B, H)
        y = torch.full((src.shape[0],), bos_id, dtype=torch.long, device=src.device)  # (B,)
        done = torch.zeros_like(y, dtype=torch.bool)
        out = []
        for _ in range(max_new_tokens):
            s, context, _ = self._step(self.tgt_embed(y), s, memory)
            y = self.out(torch.cat([s, context], dim=-1)).argmax(-1)  # (B,)
            if eos_id is not None:
                y = y.masked_fill(done, eos_id)
                done = done | (y == eos_id)
            out.append(y)
        return torch.stack(out, dim=1)  # (B, max_new_tokens)

    def _check(self, src: torch.Tensor, src_attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Check a source batch; return its (B, S) mask of real tokens (right-padded)."""
        check_token_ids("src", src, self.src_vocab_size)
        if src_attention_mask is None:
            if self.pad_id is None:
                return torch.ones_like(src, dtype=torch.bool)  # (B, S)
            mask = src != self.pad_id  # (B, S)
        else:
            mask = require_bool_mask("src_attention_mask", src_attention_mask)
            if mask.shape != src.shape:
                raise ValueError(f"src_attention_mask has shape {shape_of(mask)} but src has "
                                 f"shape {shape_of(src)}; they must match")
        lengths = mask.sum(dim=1)  # (B,)
        right_padded = torch.arange(src.shape[1], device=src.device) < lengths[:, None]
        if not torch.equal(mask, right_padded) or int(lengths.min()) == 0:
            raise ValueError(
                "every source must start with at least one real token and be padded on the "
                "right only (mask like [True, True, False]); got a source mask of "
                f"{mask.int().tolist()}"[:400]
            )
        return mask

    def extra_repr(self) -> str:
        score = "none" if self.attention is None else self.attention.score
        return f"attention={score}"
