"""Transformer blocks: the encoder block and the decoder block (with optional cross-attention).

Shape legend: B batch, T (query/target) length, S source length, D d_model, H heads.

Each block is attention and a feed-forward network, each with a residual connection and a
LayerNorm, in one of the two orders of the notes (eqs. 29-31):

* pre-norm (``norm_first=True``, GPT-2 and most models since): ``x = x + f(LN(x))``;
* post-norm (``norm_first=False``, the original Transformer and BERT): ``x = LN(x + f(x))``.

The forward passes spell both orders out, so which one runs is visible at a glance. The norms
are ``torch.nn.LayerNorm`` (one fused kernel); :class:`course_lib.layers.LayerNorm` is the same
function written from the equations, and a test proves they agree.
"""

from __future__ import annotations

import torch
from torch import nn

from ._validate import (
    WrongTypeError,
    checks_wanted,
    inputs_checked,
    require_bool,
    require_bool_mask,
    require_dtype_of,
    require_features,
    require_ndim,
    require_positive_number,
    require_size,
    shape_of,
)
from .attention import MultiHeadAttention, check_attention_inputs
from .cache import LayerKVCache
from .layers import FeedForward, dropout_layer


def check_encoder_states(encoder_hidden_states: object, batch_size: int, batch_of: str,
                         cross_attn: MultiHeadAttention) -> None:
    """What cross-attention reads, named as the caller wrote it: encoder_hidden_states must be
    (B, S, D) with the batch size of ``batch_of``, d_model features and the weights' dtype."""
    require_ndim("encoder_hidden_states", encoder_hidden_states, (3,), "(B, S, D)")
    require_features("encoder_hidden_states", encoder_hidden_states, cross_attn.d_model,
                     "d_model")
    require_dtype_of("encoder_hidden_states", encoder_hidden_states,
                     cross_attn.out_proj.weight, "the cross-attention's weights")
    require_size("encoder_hidden_states", encoder_hidden_states, 0, batch_size,
                 f"the batch size of {batch_of}")


def _check_block_input(x: object, attention: MultiHeadAttention, return_weights: object,
                       **attention_inputs) -> None:
    """x must be (B, T, D) and fit the block's attention, with valid masks."""
    require_ndim("x", x, (3,), "(B, T, D)")
    check_attention_inputs(attention, x, **attention_inputs)
    require_bool("return_weights", return_weights)


class EncoderBlock(nn.Module):
    """One encoder block: unmasked self-attention, then the feed-forward network (note 3.5).

    Args:
        d_model, n_heads, d_ff: sizes (d_ff defaults to 4 * d_model).
        dropout: dropout on the attention weights, inside the feed-forward network and on each
            sublayer's output before it is added to the residual stream.
        activation: the feed-forward activation.
        norm_first: pre-norm (True) or post-norm (False, the original Transformer and BERT).
        eps: LayerNorm eps.
        bias: biases in the linear layers.
        rope: rotary positions inside self-attention.

    Shapes:
        forward(x: (B, T, D), ...) -> (x (B, T, D), weights (B, H, T, T) or None)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = True,
        eps: float = 1e-5,
        bias: bool = True,
        rope: bool = False,
    ) -> None:
        super().__init__()
        require_bool("norm_first", norm_first)  # the sublayers check the other options
        require_positive_number("eps", eps)
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias, rope=rope)
        self.attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ff_norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = dropout_layer(dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Args: x (B, T, D); mask, attention_mask (B, T), bias and return_weights as in
        :meth:`MultiHeadAttention.forward`."""
        if checks_wanted():
            _check_block_input(x, self.self_attn, return_weights, context=None, mask=mask,
                               attention_mask=attention_mask, bias=bias)
        kw = dict(mask=mask, attention_mask=attention_mask, bias=bias,
                  return_weights=return_weights)
        with inputs_checked():  # the sublayers trust what was checked here
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

    Shapes:
        forward(x: (B, T, D), encoder_hidden_states: (B, S, D) or None, ...) ->
        (x (B, T, D), self_weights (B, H, T, T) or None, cross_weights (B, H, T, S) or None)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        cross_attention: bool = False,
        dropout: float = 0.0,
        activation: str = "relu",
        norm_first: bool = True,
        eps: float = 1e-5,
        bias: bool = True,
        rope: bool = False,
    ) -> None:
        super().__init__()
        require_bool("norm_first", norm_first)  # the sublayers check the other options
        require_positive_number("eps", eps)
        self.d_model = d_model
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias, rope=rope)
        self.attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_norm: nn.LayerNorm | None = None
        if require_bool("cross_attention", cross_attention):
            self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias)
            self.cross_attn_norm = nn.LayerNorm(d_model, eps=eps)
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ff_norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = dropout_layer(dropout)

    def forward(
        self,
        x: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        return_weights: bool = False,
        past_key_value: LayerKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Args:
            x: (B, T, D) the decoder's stream.
            encoder_hidden_states: (B, S, D) the encoder's output (cross-attention blocks only).
            attention_mask: (B, T) boolean, True for real target tokens.
            encoder_attention_mask: (B, S) boolean, True for real source tokens.
            bias: added to the self-attention scores (e.g. ALiBi).
            return_weights: also return the attention weights.
            past_key_value: the self-attention's cache of earlier positions' keys and values
                (see :meth:`MultiHeadAttention.forward`); attention_mask and bias then cover
                the cached positions too.
        """
        if checks_wanted():
            self._check(x, encoder_hidden_states, attention_mask, encoder_attention_mask, bias,
                        return_weights, past_key_value)
        self_kw = dict(attention_mask=attention_mask, bias=bias, is_causal=True,
                       return_weights=return_weights, past_key_value=past_key_value)
        cross_kw = dict(attention_mask=encoder_attention_mask, return_weights=return_weights)
        cross_weights = None
        with inputs_checked():  # the sublayers trust what was checked here
            if self.norm_first:  # pre-norm: x + f(LN(x))
                a, self_weights = self.self_attn(self.attn_norm(x), **self_kw)
                x = x + self.dropout(a)
                if self.cross_attn is not None:
                    c, cross_weights = self.cross_attn(
                        self.cross_attn_norm(x), encoder_hidden_states, **cross_kw)
                    x = x + self.dropout(c)
                x = x + self.dropout(self.ff(self.ff_norm(x)))
            else:  # post-norm: LN(x + f(x))
                a, self_weights = self.self_attn(x, **self_kw)
                x = self.attn_norm(x + self.dropout(a))
                if self.cross_attn is not None:
                    c, cross_weights = self.cross_attn(x, encoder_hidden_states, **cross_kw)
                    x = self.cross_attn_norm(x + self.dropout(c))
                x = self.ff_norm(x + self.dropout(self.ff(x)))
        return x, self_weights, cross_weights  # (B, T, D), (B, H, T, T), (B, H, T, S)

    def _check(self, x: torch.Tensor, encoder_hidden_states: torch.Tensor | None,
               attention_mask: torch.Tensor | None, encoder_attention_mask: torch.Tensor | None,
               bias: torch.Tensor | None, return_weights: object,
               past_key_value: object) -> None:
        if past_key_value is not None and not isinstance(past_key_value, LayerKVCache):
            raise WrongTypeError(
                f"past_key_value must be one layer's cache, a LayerKVCache (a KVCache's "
                f".layer(i)), got {type(past_key_value).__name__}")
        n_past = 0 if past_key_value is None else past_key_value.get_seq_length()
        _check_block_input(x, self.self_attn, return_weights, context=None, mask=None,
                           attention_mask=attention_mask, bias=bias, n_past=n_past)
        if self.cross_attn is not None and encoder_hidden_states is not None:
            check_encoder_states(encoder_hidden_states, x.shape[0], "x", self.cross_attn)
            if encoder_attention_mask is not None:
                require_bool_mask("encoder_attention_mask", encoder_attention_mask)
                if encoder_attention_mask.shape != encoder_hidden_states.shape[:2]:
                    raise ValueError(
                        f"encoder_attention_mask has shape {shape_of(encoder_attention_mask)} "
                        f"but should be (B, S) = {tuple(encoder_hidden_states.shape[:2])}, the "
                        "batch and source positions of encoder_hidden_states"
                    )
        if self.cross_attn is not None and encoder_hidden_states is None:
            raise ValueError(
                "this decoder block has cross-attention, so it needs encoder_hidden_states= "
                "(the encoder's output, shape (B, S, D))"
            )
        for name, given in (("encoder_hidden_states", encoder_hidden_states),
                            ("encoder_attention_mask", encoder_attention_mask)):
            if self.cross_attn is None and given is not None:
                raise ValueError(
                    f"{name}= was given but this decoder block has no cross-attention "
                    "(build it with cross_attention=True)"
                )
