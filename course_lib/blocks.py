"""Transformer blocks: the encoder block and the decoder block (with optional cross-attention).

Shape legend: B batch, T (query/target) length, S source length, D d_model, H heads.

Each block is attention and a feed-forward network, each with a residual connection and a
LayerNorm, in one of the two orders of the notes (eqs. 29-31):

* pre-norm (``norm_first=True``, GPT-2 and most models since): ``x = x + f(LN(x))``;
* post-norm (``norm_first=False``, the original Transformer and BERT): ``x = LN(x + f(x))``.

The norms are ``torch.nn.LayerNorm`` (one fused kernel); :class:`course_lib.layers.LayerNorm`
is the same function written from the equations, and a test proves they agree. A decoder block
can also be Llama's: RMSNorm (``norm="rms"``), the SwiGLU feed-forward network
(``ffn="swiglu"``) and grouped-query attention (``n_kv_heads``), with RoPE (``rope=True``).
"""

from __future__ import annotations

import torch
from torch import nn

from ._validate import (
    check_bools,
    checks_wanted,
    require_ndim,
    require_padding_mask,
    require_positive_number,
)
from .attention import MultiHeadAttention, check_attention_inputs
from .cache import LayerKVCache
from .layers import FeedForward, dropout_layer, make_feed_forward, make_norm


class EncoderBlock(nn.Module):
    """One encoder block: unmasked self-attention, then the feed-forward network (note 3.5).

    Args:
        d_model, n_heads, d_ff: sizes (d_ff defaults to 4 * d_model).
        dropout: on the attention weights, inside the feed-forward network and on each
            sublayer's output before it is added to the residual stream.
        activation: the feed-forward activation.
        norm_first: pre-norm (True) or post-norm (False, the original Transformer and BERT).
        eps: LayerNorm eps.
        bias: biases in the linear layers.
        rope: rotary positions inside self-attention.

    Shapes:
        forward(x: (B, T, D), ...) -> (x (B, T, D), weights (B, H, T, T) or None)
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, *,
                 dropout: float = 0.0, activation: str = "relu", norm_first: bool = True,
                 eps: float = 1e-5, bias: bool = True, rope: bool = False) -> None:
        super().__init__()
        check_bools(norm_first=norm_first)  # the sublayers check the other options
        require_positive_number("eps", eps)
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias, rope=rope)
        self.attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ff_norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = dropout_layer(dropout)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, attn_bias: torch.Tensor | None = None,
                return_weights: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args: x (B, T, D); mask, attention_mask (B, T), attn_bias and return_weights as in
        :meth:`MultiHeadAttention.forward`."""
        kw = dict(mask=mask, attention_mask=attention_mask, attn_bias=attn_bias,
                  return_weights=return_weights)
        check_block_inputs(self, x, **kw)
        if self.norm_first:  # pre-norm: x + f(LN(x))
            a, weights = self.self_attn(self.attn_norm(x), **kw)
            x = x + self.dropout(a)
            x = x + self.dropout(self.ff(self.ff_norm(x)))
        else:  # post-norm: LN(x + f(x))
            a, weights = self.self_attn(x, **kw)
            x = self.attn_norm(x + self.dropout(a))
            x = self.ff_norm(x + self.dropout(self.ff(x)))
        return x, weights  # (B, T, D), (B, H, T, T) or None


class DecoderBlock(nn.Module):
    """One decoder block: causal self-attention, optional cross-attention to an encoder's
    output (note 3.7: queries from the decoder, keys and values from the encoder), then the
    feed-forward network.

    Args: as :class:`EncoderBlock`, plus
        cross_attention: add the cross-attention sublayer (encoder-decoder models).
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, Llama), with eps ``eps``.
        ffn: ``"mlp"`` (:class:`~course_lib.layers.FeedForward` with ``activation``),
            ``"swiglu"`` (:class:`~course_lib.layers.SwiGLU`, Llama) or ``"none"`` (no
            feed-forward sublayer: ``ff`` and ``ff_norm`` are None, attention only).
        n_kv_heads, rope_theta: key/value heads (grouped-query attention; None = n_heads) and
            the RoPE base, as in :class:`MultiHeadAttention` (for both attentions).

    Shapes:
        forward(x: (B, T, D), encoder_hidden_states: (B, S, D) or None, ...) ->
        (x (B, T, D), self_weights (B, H, T, T) or None, cross_weights (B, H, T, S) or None)
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, *,
                 cross_attention: bool = False, dropout: float = 0.0, activation: str = "relu",
                 norm_first: bool = True, eps: float = 1e-5, bias: bool = True,
                 rope: bool = False, norm: str = "layer", ffn: str = "mlp",
                 n_kv_heads: int | None = None, rope_theta: float = 10000.0) -> None:
        super().__init__()
        check_bools(norm_first=norm_first, cross_attention=cross_attention)
        require_positive_number("eps", eps)
        self.d_model = d_model
        self.norm_first = norm_first
        heads = dict(dropout=dropout, bias=bias, n_kv_heads=n_kv_heads)
        self.self_attn = MultiHeadAttention(d_model, n_heads, rope=rope, rope_theta=rope_theta,
                                            **heads)
        self.attn_norm = make_norm(norm, d_model, eps=eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.Module | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, n_heads, **heads)
            self.cross_attn_norm = make_norm(norm, d_model, eps=eps)
        self.ff = make_feed_forward(ffn, d_model, d_ff, activation=activation, dropout=dropout,
                                    bias=bias)  # None with ffn="none": attention only
        self.ff_norm = None if self.ff is None else make_norm(norm, d_model, eps=eps)
        self.dropout = dropout_layer(dropout)

    def forward(self, x: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None, *,
                attention_mask: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                attn_bias: torch.Tensor | None = None, return_weights: bool = False,
                past_key_value: LayerKVCache | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Args:
            x: (B, T, D) the decoder's stream.
            encoder_hidden_states: (B, S, D) the encoder's output (cross-attention blocks only).
            attention_mask: (B, T) bool or 0/1, True for real target tokens.
            encoder_attention_mask: (B, S) bool or 0/1, True for real source tokens.
            attn_bias: added to the self-attention scores (e.g. ALiBi).
            return_weights: also return the attention weights.
            past_key_value: the self-attention's cache of earlier positions' keys and values
                (see :meth:`MultiHeadAttention.forward`); attention_mask and attn_bias then
                cover the cached positions too.
        """
        self_kw = dict(attention_mask=attention_mask, attn_bias=attn_bias, is_causal=True,
                       return_weights=return_weights, past_key_value=past_key_value)
        cross_kw = dict(attention_mask=encoder_attention_mask, return_weights=return_weights)
        check_block_inputs(self, x, encoder_hidden_states, encoder_attention_mask, **self_kw)
        cross_weights = None
        if self.norm_first:  # pre-norm: x + f(LN(x))
            a, self_weights = self.self_attn(self.attn_norm(x), **self_kw)
            x = x + self.dropout(a)
            if self.cross_attn is not None:
                c, cross_weights = self.cross_attn(
                    self.cross_attn_norm(x), encoder_hidden_states, **cross_kw)
                x = x + self.dropout(c)
            if self.ff is not None:
                x = x + self.dropout(self.ff(self.ff_norm(x)))
        else:  # post-norm: LN(x + f(x))
            a, self_weights = self.self_attn(x, **self_kw)
            x = self.attn_norm(x + self.dropout(a))
            if self.cross_attn is not None:
                c, cross_weights = self.cross_attn(x, encoder_hidden_states, **cross_kw)
                x = self.cross_attn_norm(x + self.dropout(c))
            if self.ff is not None:
                x = self.ff_norm(x + self.dropout(self.ff(x)))
        return x, self_weights, cross_weights  # (B, T, D), (B, H, T, T), (B, H, T, S)


# --- argument checks


def check_block_inputs(block: EncoderBlock | DecoderBlock, x: object,
                       encoder_hidden_states: object = None, encoder_attention_mask: object = None,
                       **attention: object) -> None:
    """x (B, T, D) and the self-attention's arguments as :meth:`MultiHeadAttention.forward`
    checks them; encoder_hidden_states (B, S, D) and encoder_attention_mask (B, S) exactly when
    the block has cross-attention."""
    if not checks_wanted():
        return
    require_ndim("x", x, (3,), "(B, T, D)")
    check_attention_inputs(block.self_attn, x, **attention)
    check_feed_forward_width(block.ff, x.shape[-1])
    cross, states = getattr(block, "cross_attn", None), encoder_hidden_states
    given = states is not None or encoder_attention_mask is not None
    if (cross is None and given) or (cross is not None and states is None):
        needs = ("needs encoder_hidden_states (B, S, D)" if cross is not None else
                 "has no cross-attention (cross_attention=False): give no "
                 "encoder_hidden_states or encoder_attention_mask")
        raise ValueError(f"this decoder block {needs}")
    if cross is not None:
        check_attention_inputs(cross, x, states, context_name="encoder_hidden_states")
        require_padding_mask("encoder_attention_mask", encoder_attention_mask, states.shape[:2],
                             f"should be (B, S) = {tuple(states.shape[:2])}")


def check_feed_forward_width(ff: nn.Module | None, d_model: int) -> None:
    """A replaced feed-forward sublayer must map d_model features to d_model: the residual
    x + ff(x) adds tensors of one shape. (Checked on its first and last linear layers; None is
    an attention-only block.)"""
    linears = [m for m in ff.modules() if isinstance(m, nn.Linear)] if ff is not None else []
    d_in, d_out = (linears[0].in_features, linears[-1].out_features) if linears else (d_model,) * 2
    if (d_in, d_out) != (d_model, d_model):
        raise ValueError(f"block.ff maps {d_in} features to {d_out}, but x has D = {d_model}: the "
                         f"residual x + ff(x) needs a sublayer mapping D features to D")
