"""Configurations of the top-level models (frozen dataclasses that check their fields when
created) and what the models return. Blocks below the models take plain keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ._validate import (
    check_bools,
    check_positive_ints,
    require_choice,
    require_id,
    require_instance,
    require_non_negative_int,
    require_positive_number,
    require_probability,
)
from .attention import check_heads
from .layers import ACTIVATIONS, FEED_FORWARDS, NORMS

POSITION_KINDS = ("learned", "sinusoidal", "alibi", "rope", "none")


@dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters shared by every model.

    Attributes:
        vocab_size: V.
        d_model, n_heads, n_layers: sizes.
        d_ff: feed-forward width, defaults to 4 * d_model.
        max_len: the context length (a hard limit with learned positions).
        dropout: dropout probability used throughout during training.
        activation: ``"relu"``, ``"gelu"`` (exact) or ``"gelu_tanh"``.
        norm_first: pre-norm (True) or post-norm (False).
        positions: ``"learned"``, ``"sinusoidal"``, ``"alibi"``, ``"rope"`` or ``"none"``.
        layer_norm_eps: LayerNorm eps.
        bias: biases in the linear layers.
        pad_id: if set, positions holding this token are masked out as keys automatically.
    """

    vocab_size: int
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int | None = None
    max_len: int = 256
    dropout: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    positions: str = "learned"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    pad_id: int | None = None

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "d_model", "n_heads", "n_layers", "max_len", "d_ff")
        check_positive_ints(**{n: getattr(self, n) for n in sizes if getattr(self, n) is not None})
        check_heads(self.d_model, self.n_heads)
        require_probability("dropout", self.dropout)
        require_choice("activation", self.activation, tuple(ACTIVATIONS))
        require_choice("positions", self.positions, POSITION_KINDS)
        require_positive_number("layer_norm_eps", self.layer_norm_eps)
        check_bools(**{f.name: getattr(self, f.name) for f in fields(self) if f.type == "bool"})
        if self.pad_id is not None:
            require_id("pad_id", self.pad_id, self.vocab_size)


@dataclass(frozen=True)
class EncoderConfig(TransformerConfig):
    """Config of an :class:`~course_lib.models.Encoder`.

    Attributes:
        type_vocab_size: number of segment (token type) embeddings, 2 in BERT, 0 for none.
        embed_norm: apply LayerNorm to the summed embeddings (BERT does).
    """

    type_vocab_size: int = 0
    embed_norm: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require_non_negative_int("type_vocab_size", self.type_vocab_size)


@dataclass(frozen=True)
class DecoderConfig(TransformerConfig):
    """Config of a :class:`~course_lib.models.DecoderLM` (a GPT-style language model).

    The last four fields make a Llama-style decoder (with ``positions="rope"``,
    ``bias=False``, ``tie_embeddings=False``, ``layer_norm_eps=1e-6``); their defaults keep
    the GPT-2-style one.

    Attributes:
        tie_embeddings: share the token embedding matrix with the output layer.
        cross_attention: add cross-attention to every block (set by ``EncoderDecoder``).
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, Llama), in the blocks and the
            final norm; its eps is ``layer_norm_eps`` either way.
        ffn: ``"mlp"`` (two layers with ``activation``), ``"swiglu"`` (Llama's gated
            network; ``activation`` is then unused, SwiGLU's is SiLU) or ``"none"`` (no
            feed-forward sublayer: an attention-only model).
        n_kv_heads: key/value heads for grouped-query attention (Hugging Face's
            ``num_key_value_heads``), dividing n_heads; None = n_heads, 1 = multi-query.
        rope_theta: the RoPE base (Hugging Face's name), with ``positions="rope"``.
    """

    tie_embeddings: bool = True
    cross_attention: bool = False
    norm: str = "layer"
    ffn: str = "mlp"
    n_kv_heads: int | None = None
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require_choice("norm", self.norm, NORMS)
        require_choice("ffn", self.ffn, FEED_FORWARDS)
        check_heads(self.d_model, self.n_heads, self.n_kv_heads)
        require_positive_number("rope_theta", self.rope_theta)
        if self.rope_theta != 10000.0 and self.positions != "rope":
            raise ValueError(f"rope_theta={self.rope_theta!r} is the RoPE base, but positions="
                             f"{self.positions!r}: set positions='rope', or leave rope_theta out")


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Config of an :class:`~course_lib.models.EncoderDecoder`: the two halves' configs, with
    one d_model (the decoder, given cross-attention whatever its config says, reads the
    encoder's output). ``EncoderDecoderConfig.shared(...)`` builds both from one set of sizes.
    """

    encoder: EncoderConfig
    decoder: DecoderConfig

    def __post_init__(self) -> None:
        enc, dec = self.encoder, self.decoder
        require_instance("encoder", enc, EncoderConfig, "an EncoderConfig")
        require_instance("decoder", dec, DecoderConfig, "a DecoderConfig")
        if enc.d_model != dec.d_model:
            raise ValueError(f"encoder.d_model={enc.d_model} but decoder.d_model={dec.d_model}")

    @classmethod
    def shared(cls, src_vocab_size: int, tgt_vocab_size: int, *, n_encoder_layers: int = 2,
               n_decoder_layers: int = 2, max_src_len: int = 64, max_tgt_len: int = 64,
               pad_id: int | None = None, tie_embeddings: bool = True,
               **sizes) -> EncoderDecoderConfig:
        """Both halves with the same sizes (d_model, n_heads, d_ff, dropout, activation,
        norm_first, positions, layer_norm_eps, bias: any TransformerConfig field in ``sizes``),
        each with its own vocabulary, depth and length; ``pad_id`` marks padding in both."""
        check_positive_ints(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size,
                            n_encoder_layers=n_encoder_layers, n_decoder_layers=n_decoder_layers,
                            max_src_len=max_src_len, max_tgt_len=max_tgt_len)
        encoder = EncoderConfig(vocab_size=src_vocab_size, n_layers=n_encoder_layers,
                                max_len=max_src_len, pad_id=pad_id, **sizes)
        decoder = DecoderConfig(vocab_size=tgt_vocab_size, n_layers=n_decoder_layers,
                                max_len=max_tgt_len, pad_id=pad_id, cross_attention=True,
                                tie_embeddings=tie_embeddings, **sizes)
        return cls(encoder=encoder, decoder=decoder)


@dataclass
class EncoderOutput:
    """What :class:`~course_lib.models.Encoder` returns (Hugging Face's field names).

    Attributes:
        last_hidden_state: (B, T, D).
        hidden_states: the embeddings and every block's output, n_layers + 1 tensors of
            (B, T, D), with ``output_hidden_states=True``.
        attentions: every block's attention weights, n_layers tensors of (B, H, T, T), with
            ``output_attentions=True``.
    """

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class LMOutput:
    """What :class:`~course_lib.models.DecoderLM` and ``EncoderDecoder`` return.

    Attributes:
        logits: (B, T, V), next-token scores at every position.
        loss: mean cross-entropy against the targets, if targets were given.
        attentions: every decoder block's self-attention weights (B, H, T, T), with
            ``output_attentions=True``.
        cross_attentions: every decoder block's cross-attention weights (B, H, T, S)
            (encoder-decoder only).
        encoder_attentions: the encoder's attention weights (encoder-decoder only).
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None
    encoder_attentions: tuple[torch.Tensor, ...] | None = None
