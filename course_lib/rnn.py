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
    check_bools,
    check_positive_ints,
    check_shapes,
    check_token_ids,
    checks_wanted,
    inputs_checked,
    require_bool_mask,
    require_callable,
    require_choice,
    require_floating,
    require_id,
    require_ndim,
    require_padding_mask,
    require_same_dtype,
    require_tensor,
    shape_of,
)
from .attention import as_bool_mask
from .tokenizer import IGNORE_INDEX

_NONLINEARITIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
}


def elman_step(
    x_t: torch.Tensor, h_prev: torch.Tensor, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None = None, *, nonlinearity: str = "tanh",
) -> torch.Tensor:
    """One step of an Elman RNN, h_t = sigma(W h_{t-1} + U x_t + b) (eq. 4 of the notes).

    Args:
        x_t: the input at step t, (B, Din) or (Din,).
        h_prev: the previous hidden state h_{t-1}, (B, H) or (H,).
        W: hidden-to-hidden weights (H, H); U: input-to-hidden weights (H, Din); b: (H,) or None.
        nonlinearity: ``"tanh"`` (default), ``"sigmoid"`` or ``"relu"``.

    Returns:
        h_t, (B, H), or (H,) when both x_t and h_prev are unbatched.
    """
    check_elman({"x_t": (x_t, "B? Din"), "h_prev": (h_prev, "B? H")}, W, U, b, nonlinearity)
    # h_t = sigma(W h_{t-1} + U x_t + b); with row vectors W h is h @ W.T
    pre = h_prev @ W.T + x_t @ U.T  # (B, H)
    if b is not None:
        pre = pre + b
    return _NONLINEARITIES[nonlinearity](pre)  # (B, H)


def elman_forward(
    x: torch.Tensor, h0: torch.Tensor | None, W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None = None, *, nonlinearity: str = "tanh",
) -> torch.Tensor:
    """Run an Elman RNN over a sequence, one step after another: each step needs the previous
    hidden state, the O(T) chain of serial steps that attention removes.

    Args:
        x: inputs, (B, T, Din) or (T, Din).
        h0: initial hidden state, (B, H) or (H,), or None for zeros.
        W, U, b, nonlinearity: as in :func:`elman_step`.

    Returns:
        All hidden states h_1..h_T, (B, T, H) (or (T, H) for unbatched input).
    """
    check_elman({"x": (x, "B? T Din"), "h0": (h0, "B? H")}, W, U, b, nonlinearity)
    sigma = _NONLINEARITIES[nonlinearity]
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
        input_size: Din. hidden_size: H. bias: whether to learn b.
        nonlinearity: ``"tanh"`` (default, as in ``nn.RNN``), ``"sigmoid"`` or ``"relu"``.

    Shapes:
        forward(x: (B, T, Din) or (T, Din), h0: (B, H) or None) -> (outputs (B, T, H), h_T (B, H))
    """

    def __init__(
        self, input_size: int, hidden_size: int, *, nonlinearity: str = "tanh", bias: bool = True
    ) -> None:
        super().__init__()
        check_positive_ints(input_size=input_size, hidden_size=hidden_size)
        check_bools(bias=bias)
        self.nonlinearity = require_choice("nonlinearity", nonlinearity, sorted(_NONLINEARITIES))
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        bound = 1.0 / math.sqrt(hidden_size)  # the same initialisation as nn.RNN
        self.W = nn.Parameter(torch.empty(hidden_size, hidden_size).uniform_(-bound, bound))
        self.U = nn.Parameter(torch.empty(hidden_size, input_size).uniform_(-bound, bound))
        self.b = nn.Parameter(torch.empty(hidden_size).uniform_(-bound, bound)) if bias else None

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        out = elman_forward(x, h0, self.W, self.U, self.b, nonlinearity=self.nonlinearity)
        return out, out[..., -1, :]  # (B, T, H), h_T (B, H)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, nonlinearity={self.nonlinearity!r}"


def sequential_depth(output: torch.Tensor) -> int:
    """The number of operations (autograd nodes other than leaves) on the longest chain of the
    graph behind ``output``, a tensor computed with gradients enabled: the serial steps, which
    run one after another however many processors there are. An Elman RNN adds a few per step
    (the depth grows like T); a self-attention layer has the same depth for every T."""
    check_graph(output)
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

    Entry t is || d fn(x)[..., -1, :].sum() / d x_t ||_2. For an Elman RNN it shrinks (or
    grows) geometrically with the distance T - t; for self-attention it does not depend on it.

    Args:
        fn: maps inputs (T, Din) or (B, T, Din) to outputs (T, H) or (B, T, H), e.g.
            ``lambda x: rnn(x)[0]``; examples of a batch must not interact.
        x: the inputs, (T, Din) or (B, T, Din). Not modified.

    Returns:
        Norms (T,) or (B, T), detached; no ``.grad`` is touched.
    """
    require_callable("fn", fn, "a function of the inputs, e.g. lambda x: rnn(x)[0]", n_args=1)
    require_floating("x", require_ndim("x", x, (2, 3), "(T, Din) or (B, T, Din)"))
    leaf = x.detach().clone()  # (B, T, Din) or (T, Din)
    leaf.requires_grad = True
    with torch.enable_grad():
        out = fn(leaf)  # (B, T, H)
        check_outputs(out, x)
        (grad,) = torch.autograd.grad(out[..., -1, :].sum(), leaf)  # (B, T, Din)
    return grad.norm(dim=-1)  # (B, T) or (T,)


# ------------------------------------------------- attention over an RNN encoder's states
# Before self-attention, attention was added to RNN encoder-decoders (Bahdanau et al., 2015):
# at every output step the decoder's state reads a weighted average of the encoder's states,
# instead of the source squeezed into one vector. Legend: B batch, S source length, T target
# length, E embedding, H hidden, Dq query, Dk key (= value), A additive score width, V vocab.

_SCORES = ("additive", "dot")


class RNNAttention(nn.Module):
    """Attention of decoder states (queries) over encoder states (keys, also the values).

    Scores: ``"additive"`` (Bahdanau et al., 2015) e_j = v^T tanh(W_s s + W_h h_j), or ``"dot"``
    (Luong et al., 2015, their "general" score) e_j = (W_s s) . h_j. Then alpha = softmax(e)
    and c = sum_j alpha_j h_j. Keys where ``mask`` is False (padding) get weight 0; a query with
    no allowed key gets all-zero weights and a zero context.

    Args:
        query_size: Dq. key_size: Dk. score: ``"additive"`` (default) or ``"dot"``.
        attention_size: A, the additive score's hidden width (default Dk; unused by ``"dot"``).

    Shapes:
        forward(query: (B, Dq) or (B, T, Dq), keys: (B, S, Dk), mask: (B, S) bool or None,
        projected_keys: :meth:`project_keys` (keys) or None)
        -> (context: (B, Dk) or (B, T, Dk), weights: (B, S) or (B, T, S))
    """

    def __init__(
        self, query_size: int, key_size: int, *, score: str = "additive",
        attention_size: int | None = None,
    ) -> None:
        super().__init__()
        attention_size = key_size if attention_size is None else attention_size
        check_positive_ints(query_size=query_size, key_size=key_size, attention_size=attention_size)
        self.score = require_choice("score", score, _SCORES)
        if score == "dot":
            self.query_proj = nn.Linear(query_size, key_size, bias=False)  # W_s
        else:
            self.query_proj = nn.Linear(query_size, attention_size, bias=False)  # W_s
            self.key_proj = nn.Linear(key_size, attention_size, bias=False)  # W_h
            self.v = nn.Linear(attention_size, 1, bias=False)  # v^T

    def forward(
        self, query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None, *,
        projected_keys: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_attention(query, keys, mask, self.query_proj.weight)
        single = query.dim() == 2
        q = query.unsqueeze(1) if single else query  # (B, T, Dq)
        if self.score == "dot":
            scores = self.query_proj(q) @ keys.transpose(1, 2)  # e_tj = (W_s s_t) . h_j, (B, T, S)
        else:  # e_tj = v^T tanh(W_s s_t + W_h h_j)
            if projected_keys is None:
                projected_keys = self.project_keys(keys)  # (B, S, A)
            hidden = torch.tanh(self.query_proj(q)[:, :, None] + projected_keys[:, None])
            scores = self.v(hidden).squeeze(-1)  # (B, T, S)
        if mask is not None:
            allowed = mask[:, None, :]  # (B, 1, S)
            scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # alpha_tj, (B, T, S)
        if mask is not None:  # a query with no allowed key: zeros, not NaN
            weights = weights.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        context = weights @ keys  # c_t = sum_j alpha_tj h_j, (B, T, Dk)
        return (context.squeeze(1), weights.squeeze(1)) if single else (context, weights)

    def project_keys(self, keys: torch.Tensor) -> torch.Tensor | None:
        """W_h h_j for every key (B, S, A), or None for the dot score. A decoder computes it
        once per source and passes it to every step, as Bahdanau et al. do."""
        return None if self.score == "dot" else self.key_proj(keys)  # (B, S, A)

    def extra_repr(self) -> str:
        return f"score={self.score!r}"


class RNNSeq2SeqOutput(NamedTuple):
    """What :class:`RNNEncoderDecoder` returns: ``logits`` (B, T, V); ``loss``, the mean
    cross-entropy against ``targets`` (-100 not scored) or None; ``weights`` (B, T, S), the
    attention of every target step over the source (None without attention)."""

    logits: torch.Tensor
    loss: torch.Tensor | None
    weights: torch.Tensor | None


class RNNEncoderDecoder(nn.Module):
    """A GRU encoder-decoder for translation, with or without attention over the source.

    Encoder: an embedding and a bidirectional GRU; source word j is h_j = [forward state;
    backward state] (2H numbers). Decoder: s_t = GRU([emb(y_{t-1}); c_t], s_{t-1}) from
    s_0 = tanh(W_0 c), and logits_t = W_o [s_t; c_t], where the context c_t is

    - ``attention=None``: c, the last forward and first backward state joined, at every step:
      the whole source squeezed into one vector (Cho et al., 2014);
    - ``attention="additive"`` or ``"dot"``: sum_j alpha_tj h_j, alpha_t from
      :class:`RNNAttention` with the query s_{t-1} (Bahdanau et al., 2015).

    Sources are right-padded; padding is skipped by the encoder and never attended to.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes. d_embed: E. hidden_size: H.
        attention: ``"additive"`` (default), ``"dot"`` or None. pad_id: the source padding id.

    Shapes:
        forward(src (B, S), tgt (B, T), targets (B, T) or None, src_attention_mask (B, S))
        -> RNNSeq2SeqOutput(logits (B, T, V), loss, weights (B, T, S) or None)
    """

    def __init__(
        self, src_vocab_size: int, tgt_vocab_size: int, *, d_embed: int = 32,
        hidden_size: int = 64, attention: str | None = "additive", pad_id: int | None = None,
    ) -> None:
        super().__init__()
        check_positive_ints(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
                            d_embed=d_embed, hidden_size=hidden_size)
        require_choice("attention", attention, (*_SCORES, None))
        self.pad_id = None if pad_id is None else require_id("pad_id", pad_id, src_vocab_size)
        self.src_vocab_size, self.tgt_vocab_size = src_vocab_size, tgt_vocab_size
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
        check_seq2seq(self, src, src_attention_mask, tgt, targets)
        if src_attention_mask is not None:
            mask = as_bool_mask(src_attention_mask)  # (B, S): bool, or 0/1 from a tokenizer
        elif self.pad_id is not None:
            mask = src != self.pad_id  # (B, S)
        else:
            mask = torch.ones_like(src, dtype=torch.bool)  # (B, S)
        states, c = self.encode(src, mask)  # (B, S, 2H), (B, 2H)
        keys = None if self.attention is None else self.attention.project_keys(states)
        s = torch.tanh(self.init_state(c))  # s_0 = tanh(W_0 c), (B, H)
        embedded = self.tgt_embed(tgt)  # (B, T, E)
        outputs, weights = [], []
        for t in range(tgt.shape[1]):  # one target token after another
            context, alpha = c, None  # without attention: the same c at every step
            if self.attention is not None:  # c_t = sum_j alpha_tj h_j, queried by s_{t-1}
                with inputs_checked():
                    context, alpha = self.attention(s, states, mask, projected_keys=keys)
            s = self.cell(torch.cat([embedded[:, t], context], dim=-1), s)  # s_t, (B, H)
            outputs.append(torch.cat([s, context], dim=-1))  # [s_t; c_t], (B, 3H)
            weights.append(alpha)  # (B, S)
        logits = self.out(torch.stack(outputs, dim=1))  # (B, T, V)
        loss = None
        if targets is not None:  # mean cross-entropy over the scored (not -100) positions
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                   ignore_index=IGNORE_INDEX)
        alignment = None if self.attention is None else torch.stack(weights, dim=1)  # (B, T, S)
        return RNNSeq2SeqOutput(logits, loss, alignment)

    def encode(self, src: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder states h_j (B, S, 2H) and the summary c (B, 2H) of a source (B, S) whose
        ``mask`` (B, S) marks its real tokens (at least one, then padding on the right)."""
        check_right_padded(mask)
        lengths = mask.sum(dim=1).cpu()  # (B,)
        packed = nn.utils.rnn.pack_padded_sequence(
            self.src_embed(src), lengths, batch_first=True, enforce_sorted=False)
        out, last = self.encoder(packed)  # last: (2, B, H), final state of each direction
        states, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True,
                                                     total_length=src.shape[1])  # (B, S, 2H)
        return states, torch.cat([last[0], last[1]], dim=-1)  # (B, S, 2H), (B, 2H)

    def extra_repr(self) -> str:
        return f"attention={'none' if self.attention is None else self.attention.score}"


# --- argument checks


def check_elman(
    inputs: dict[str, tuple[torch.Tensor | None, str]], W: torch.Tensor, U: torch.Tensor,
    b: torch.Tensor | None, nonlinearity: str,
) -> None:
    """The arguments of :func:`elman_step` and :func:`elman_forward`; ``inputs`` maps the
    names of the input and the state to (tensor, shape legend) as for :func:`check_shapes`."""
    if not checks_wanted():
        return
    require_choice("nonlinearity", nonlinearity, sorted(_NONLINEARITIES))
    check_shapes(W=(W, "H H"), U=(U, "H Din"), b=(b, "H"), **inputs)
    require_floating("W", W)
    require_same_dtype({"W": W, "U": U, "b": b, **{name: t for name, (t, _) in inputs.items()}})


def check_graph(output: object) -> None:
    """Raise unless ``output`` is a tensor with an autograd graph."""
    if not checks_wanted():
        return
    if require_tensor("output", output).grad_fn is None:
        raise ValueError("output has no autograd graph: compute it with gradients enabled")


def check_outputs(out: object, x: torch.Tensor) -> None:
    """Raise unless ``fn(x)`` of :func:`gradient_norms` holds one output vector per position
    of x."""
    if not checks_wanted():
        return
    got = shape_of(out) if isinstance(out, torch.Tensor) else f"a {type(out).__name__}"
    if not isinstance(out, torch.Tensor) or out.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"fn(x) should have shape {(*x.shape[:-1], 'H')}, got {got}; for a "
                         "module returning a tuple use lambda x: module(x)[0]")


def check_attention(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, W_s: torch.Tensor
) -> None:
    """The arguments of :class:`RNNAttention`; ``W_s`` is its query projection (A, Dq)."""
    if not checks_wanted():
        return
    check_shapes(W_s=(W_s, "A Dq"), query=(query, "B T? Dq"), keys=(keys, "B S Dk"),
                 mask=(mask, "B S"))
    require_same_dtype({"W_s": W_s, "query": query, "keys": keys})
    if mask is not None:
        require_bool_mask("mask", mask)


def check_seq2seq(
    model: RNNEncoderDecoder, src: torch.Tensor, src_attention_mask: torch.Tensor | None,
    tgt: torch.Tensor, targets: torch.Tensor | None,
) -> None:
    """The arguments of :meth:`RNNEncoderDecoder.forward`."""
    if not checks_wanted():
        return
    for name, ids, size in (("src", src, model.src_vocab_size), ("tgt", tgt, model.tgt_vocab_size)):
        check_token_ids(name, ids, size)
    require_padding_mask("src_attention_mask", src_attention_mask, src.shape, "should match src")
    check_shapes(src=(src, "B S"), tgt=(tgt, "B T"), targets=(targets, "B T"))


def check_right_padded(mask: torch.Tensor) -> None:
    """Raise unless every row of the (B, S) source mask is some True, then only False."""
    if not checks_wanted():
        return
    lengths = mask.sum(dim=1)  # (B,)
    right_padded = torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]  # (B, S)
    if not torch.equal(mask, right_padded) or int(lengths.min()) == 0:
        raise ValueError("each source needs a real token, then padding on the right only; got "
                         f"the mask {mask.int().tolist()!s:.200}")
