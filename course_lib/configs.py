"""Configurations of the top-level models (frozen dataclasses; every block below them takes
plain keyword arguments) and what the models return.

Each config checks its own fields when it is created, so a wrong value fails where it was
written, with the field's name, and never deep inside a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ._validate import (
    require_bool,
    require_choice,
    require_int,
    require_non_negative_int,
    require_positive_int,
    require_positive_number,
    require_probability,
)
from .layers import ACTIVATIONS

POSITION_KINDS = ("learned", "sinusoidal", "alibi", "rope", "none")


def _require_optional_id(name: str, value: object, vocab_size: int) -> None:
    if value is None:
        return
    if not 0 <= require_int(name, value) < vocab_size:
        raise ValueError(
            f"{name} must be None or a token id in 0..{vocab_size - 1} (vocab_size={vocab_size}), "
            f"got {value!r}"
        )


@dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters shared by every model.

    Attributes:
        vocab_size: V.
        d_model, n_heads, n_layers: sizes.
        d_ff: feed-forward width, defaults to 4 * d_model.
        max_len: the context length: the longest sequence the model takes (a hard limit for
            learned positions; generation keeps the last ``max_len`` tokens).
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
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_len"):
            require_positive_int(name, getattr(self, name))
        if self.d_ff is not None:
            require_positive_int("d_ff", self.d_ff)
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}: each head "
                f"gets d_model // n_heads dimensions"
            )
        require_probability("dropout", self.dropout)
        require_choice("activation", self.activation, tuple(ACTIVATIONS))
        require_choice("positions", self.positions, POSITION_KINDS)
        require_positive_number("layer_norm_eps", self.layer_norm_eps)
        for f in fields(self):
            if f.type in (bool, "bool"):
                require_bool(f.name, getattr(self, f.name))
        _require_optional_id("pad_id", self.pad_id, self.vocab_size)


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

    Attributes:
        tie_embeddings: share the token embedding matrix with the output layer.
        cross_attention: add cross-attention to every block (set by ``EncoderDecoder``).
    """

    tie_embeddings: bool = True
    cross_attention: bool = False


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Config of an :class:`~course_lib.models.EncoderDecoder`: an encoder's config and a
    decoder's config. Both must have the same d_model (the decoder's cross-attention reads the
    encoder's output); the decoder is given cross-attention whatever its config says.

    ``EncoderDecoderConfig.shared(...)`` builds both halves from one set of sizes.
    """

    encoder: EncoderConfig
    decoder: DecoderConfig

    def __post_init__(self) -> None:
        if not isinstance(self.encoder, EncoderConfig):
            raise TypeError(f"encoder must be an EncoderConfig, got {type(self.encoder).__name__}")
        if not isinstance(self.decoder, DecoderConfig):
            raise TypeError(f"decoder must be a DecoderConfig, got {type(self.decoder).__name__}")
        if self.encoder.d_model != self.decoder.d_model:
            raise ValueError(
                f"encoder.d_model={self.encoder.d_model} but decoder.d_model="
                f"{self.decoder.d_model}: cross-attention needs them equal"
            )

    @classmethod
    def shared(
        cls,
        src_vocab_size: int,
        tgt_vocab_size: int,
        *,
        n_encoder_layers: int = 2,
        n_decoder_layers: int = 2,
        max_src_len: int = 64,
        max_tgt_len: int = 64,
        pad_id: int | None = None,
        tie_embeddings: bool = True,
        **sizes,
    ) -> EncoderDecoderConfig:
        """Both halves with the same sizes (d_model, n_heads, d_ff, dropout, activation,
        norm_first, positions, layer_norm_eps, bias: any TransformerConfig field in ``sizes``),
        each with its own vocabulary, depth and length; ``pad_id`` marks padding in both."""
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
    encoder_attentions: tuple[torch.Tensor, ...] | None = field(default=None)
