"""Whole Transformers built from course_lib's blocks: encoder, decoder (GPT-style language model)
and encoder-decoder, plus autoregressive generation.

Shape legend: B batch, T (target/query) length, S source length, D d_model, H heads, V vocab.

Only these top-level models take a (frozen dataclass) config; every block below them takes
plain keyword arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    require_bool_mask,
    require_ndim,
    require_positive_int,
    shape_of,
)
from .attention import MultiHeadAttention
from .layers import ACTIVATIONS, AddNorm, FeedForward, LayerNorm
from .positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
)

POSITION_KINDS = ("learned", "sinusoidal", "alibi", "rope", "none")
IGNORE_INDEX = -100  # targets equal to this are left out of the loss (padding)


# --------------------------------------------------------------------------------------------
# Blocks


class EncoderBlock(nn.Module):
    """One encoder block: self-attention, then the feed-forward network, each wrapped in
    Add & Norm (pre-norm or post-norm).

    Args:
        d_model, n_heads, d_ff: sizes (d_ff defaults to 4 * d_model).
        dropout: dropout on attention weights and on each sublayer's output.
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
        self.self_attn = MultiHeadAttention(
            d_model, n_heads, dropout=dropout, bias=bias, rope=rope
        )
        self.attn_addnorm = AddNorm(d_model, norm_first=norm_first, dropout=dropout, eps=eps)
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ff_addnorm = AddNorm(d_model, norm_first=norm_first, dropout=dropout, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        weights: torch.Tensor | None = None

        def attend(h: torch.Tensor) -> torch.Tensor:
            nonlocal weights
            out, weights = self.self_attn(
                h, mask=mask, key_padding_mask=key_padding_mask, bias=bias,
                need_weights=need_weights,
            )
            return out

        x = self.attn_addnorm(x, attend)  # (B, T, D)
        x = self.ff_addnorm(x, self.ff)  # (B, T, D)
        return x, weights


class DecoderBlock(nn.Module):
    """One decoder block: masked (causal) self-attention, optional cross-attention to an
    encoder's output, then the feed-forward network, each wrapped in Add & Norm.

    Args: as :class:`EncoderBlock`, plus
        cross_attention: add the cross-attention sublayer (encoder-decoder models).

    Shapes:
        forward(x: (B, T, D), memory: (B, S, D) or None, ...) ->
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
        self.self_attn = MultiHeadAttention(
            d_model, n_heads, dropout=dropout, bias=bias, rope=rope
        )
        self.self_attn_addnorm = AddNorm(d_model, norm_first=norm_first, dropout=dropout, eps=eps)
        self.cross_attn: MultiHeadAttention | None = None
        self.cross_attn_addnorm: AddNorm | None = None
        if cross_attention:
            self.cross_attn = MultiHeadAttention(d_model, n_heads, dropout=dropout, bias=bias)
            self.cross_attn_addnorm = AddNorm(
                d_model, norm_first=norm_first, dropout=dropout, eps=eps
            )
        self.ff = FeedForward(d_model, d_ff, activation=activation, dropout=dropout, bias=bias)
        self.ff_addnorm = AddNorm(d_model, norm_first=norm_first, dropout=dropout, eps=eps)

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        memory_key_padding_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        self_weights: torch.Tensor | None = None
        cross_weights: torch.Tensor | None = None

        def self_attend(h: torch.Tensor) -> torch.Tensor:
            nonlocal self_weights
            out, self_weights = self.self_attn(
                h, key_padding_mask=key_padding_mask, bias=bias, is_causal=True,
                need_weights=need_weights,
            )
            return out

        def cross_attend(h: torch.Tensor) -> torch.Tensor:
            nonlocal cross_weights
            out, cross_weights = self.cross_attn(
                h, memory, key_padding_mask=memory_key_padding_mask, need_weights=need_weights
            )
            return out

        x = self.self_attn_addnorm(x, self_attend)  # (B, T, D)
        if self.cross_attn is not None:
            if memory is None:
                raise ValueError(
                    "this decoder block has cross-attention, so it needs memory= (the encoder "
                    "output, shape (B, S, D))"
                )
            x = self.cross_attn_addnorm(x, cross_attend)  # (B, T, D)
        elif memory is not None:
            raise ValueError(
                "memory= was given but this decoder block has no cross-attention "
                "(build it with cross_attention=True)"
            )
        x = self.ff_addnorm(x, self.ff)  # (B, T, D)
        return x, self_weights, cross_weights


# --------------------------------------------------------------------------------------------
# Configs


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
        activation: ``"relu"``, ``"gelu"`` or ``"gelu_tanh"``.
        norm_first: pre-norm (True) or post-norm (False).
        positions: ``"learned"``, ``"sinusoidal"``, ``"alibi"``, ``"rope"`` or ``"none"``.
        layer_norm_eps: LayerNorm eps.
        bias: biases in the linear layers.
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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers", "max_len"):
            require_positive_int(name, getattr(self, name))
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )
        if self.positions not in POSITION_KINDS:
            raise ValueError(f"positions must be one of {POSITION_KINDS}, got {self.positions!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class EncoderConfig(TransformerConfig):
    """Config of a :class:`TransformerEncoder`.

    Attributes:
        type_vocab_size: number of segment (token type) embeddings, 2 in BERT, 0 for none.
        embed_norm: apply LayerNorm to the summed embeddings (BERT does).
        pad_id: if set, positions holding this token are masked out as keys automatically.
    """

    type_vocab_size: int = 0
    embed_norm: bool = False
    pad_id: int | None = None


@dataclass(frozen=True)
class DecoderConfig(TransformerConfig):
    """Config of a :class:`TransformerDecoder` (a GPT-style language model).

    Attributes:
        tie_embeddings: share the token embedding matrix with the output layer.
        cross_attention: add cross-attention to every block (set by :class:`EncoderDecoder`).
        pad_id: if set, positions holding this token are masked out as keys automatically.
    """

    tie_embeddings: bool = True
    cross_attention: bool = False
    pad_id: int | None = None


@dataclass(frozen=True)
class EncoderDecoderConfig:
    """Config of an :class:`EncoderDecoder`.

    The encoder and the decoder share every size; each has its own vocabulary and length.
    ``pad_id`` marks padding in both source and target (masked as keys automatically).
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 128
    n_heads: int = 4
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    d_ff: int | None = None
    max_src_len: int = 64
    max_tgt_len: int = 64
    dropout: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    positions: str = "learned"
    layer_norm_eps: float = 1e-5
    bias: bool = True
    tie_embeddings: bool = True
    pad_id: int | None = None

    def _shared(self) -> dict:
        return dict(
            d_model=self.d_model, n_heads=self.n_heads, d_ff=self.d_ff, dropout=self.dropout,
            activation=self.activation, norm_first=self.norm_first, positions=self.positions,
            layer_norm_eps=self.layer_norm_eps, bias=self.bias,
        )

    def encoder(self) -> EncoderConfig:
        """The encoder half's config."""
        return EncoderConfig(
            vocab_size=self.src_vocab_size, n_layers=self.n_encoder_layers,
            max_len=self.max_src_len, pad_id=self.pad_id, **self._shared(),
        )

    def decoder(self) -> DecoderConfig:
        """The decoder half's config (with cross-attention)."""
        return DecoderConfig(
            vocab_size=self.tgt_vocab_size, n_layers=self.n_decoder_layers,
            max_len=self.max_tgt_len, tie_embeddings=self.tie_embeddings,
            cross_attention=True, pad_id=self.pad_id, **self._shared(),
        )

    def __post_init__(self) -> None:
        self.encoder(), self.decoder()  # validates every field


# --------------------------------------------------------------------------------------------
# Outputs


@dataclass
class EncoderOutput:
    """What :class:`TransformerEncoder` returns.

    Attributes:
        last_hidden_state: (B, T, D).
        hidden_states: the embeddings and every block's output, n_layers + 1 tensors of
            (B, T, D), when requested.
        attentions: every block's attention weights, n_layers tensors of (B, H, T, T), when
            requested.
    """

    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None


@dataclass
class LMOutput:
    """What :class:`TransformerDecoder` and :class:`EncoderDecoder` return.

    Attributes:
        logits: (B, T, V), next-token scores at every position.
        loss: mean cross-entropy against the targets, if targets were given.
        attentions: every decoder block's self-attention weights (B, H, T, T), when requested.
        cross_attentions: every decoder block's cross-attention weights (B, H, T, S), when
            requested (encoder-decoder only).
        encoder_attentions: the encoder's attention weights (encoder-decoder only).
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    attentions: tuple[torch.Tensor, ...] | None = None
    cross_attentions: tuple[torch.Tensor, ...] | None = None
    encoder_attentions: tuple[torch.Tensor, ...] | None = field(default=None)


# --------------------------------------------------------------------------------------------
# Shared pieces


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2-style initialisation: N(0, 0.02) for linear and embedding weights, zero biases,
    and the projections that write into the residual stream scaled down by sqrt(2 n_layers)
    so the stream's variance does not grow with depth."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = 0.02
            if name.endswith("out_proj") or name.endswith("ff.fc2"):
                std = 0.02 / math.sqrt(2 * n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
    for module in model.modules():
        if isinstance(module, Embeddings) and module.token_scale != 1.0:
            # token vectors of RMS 1 after scaling, comparable to the fixed sinusoids
            nn.init.normal_(module.token.weight, mean=0.0, std=1.0 / module.token_scale)


def count_parameters(module: nn.Module, *, trainable_only: bool = False) -> int:
    """Number of parameters in ``module`` (shared tensors, like tied embeddings, count once)."""
    params = {id(p): p for p in module.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in params.values())


def parameter_breakdown(model: nn.Module) -> dict[str, int]:
    """Count a course_lib model's parameters by the kind of component that holds them.

    Groups: ``"embeddings"`` (token, position and segment tables, and an embedding LayerNorm),
    ``"attention"`` (self- and cross-attention projections), ``"feed-forward"``,
    ``"layer norms"`` (inside the blocks and the final one) and ``"output head"`` (an untied
    output layer). Tied weights are counted once, under embeddings.

    Returns:
        ``{group: count}`` for every group with parameters; the counts add up to
        :func:`count_parameters`.
    """
    groups = {"embeddings": 0, "attention": 0, "feed-forward": 0, "layer norms": 0,
              "output head": 0, "other": 0}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        parts = name.split(".")
        if "embeddings" in parts:
            group = "embeddings"
        elif "self_attn" in parts or "cross_attn" in parts:
            group = "attention"
        elif "ff" in parts:
            group = "feed-forward"
        elif "norm" in parts or "final_norm" in parts:
            group = "layer norms"
        elif "lm_head" in parts:
            group = "output head"
        else:
            group = "other"
        groups[group] += param.numel()
    return {group: count for group, count in groups.items() if count}


class Embeddings(nn.Module):
    """Token embeddings plus (depending on ``positions``) absolute position vectors and
    segment embeddings, then optional LayerNorm and dropout.

    With fixed sinusoidal positions (RMS about 0.7 per entry) the token vectors are multiplied
    by sqrt(D) and initialised with std 1/sqrt(D), as in the original Transformer, so that
    tokens and positions start at comparable sizes; learned tables start small together.

    Shapes:
        forward(ids: (B, T), token_type_ids: (B, T) or None) -> (B, T, D)
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        *,
        max_len: int,
        positions: str,
        type_vocab_size: int = 0,
        norm: bool = False,
        eps: float = 1e-5,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.positions = positions
        self.token = nn.Embedding(vocab_size, d_model)
        self.token_scale = math.sqrt(d_model) if positions == "sinusoidal" else 1.0
        self.position: nn.Module | None = None
        if positions == "learned":
            self.position = LearnedPositionalEmbedding(max_len, d_model)
        elif positions == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(d_model)
        self.token_type = nn.Embedding(type_vocab_size, d_model) if type_vocab_size else None
        self.norm = LayerNorm(d_model, eps=eps) if norm else None
        self.dropout = nn.Dropout(dropout)

    def forward(
        self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_token_ids("ids", ids, self.vocab_size)
        seq_len = ids.shape[1]
        if self.positions == "learned" and seq_len > self.max_len:
            raise ValueError(
                f"ids has {seq_len} tokens (shape {shape_of(ids)}), longer than this model's "
                f"context of max_len={self.max_len} tokens; crop the input to its last "
                f"{self.max_len} tokens"
            )
        x = self.token(ids) * self.token_scale  # (B, T, D)
        if self.position is not None:
            x = x + self.position(seq_len)  # (T, D) broadcasts over the batch
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            check_token_ids("token_type_ids", token_type_ids, self.token_type.num_embeddings)
            if token_type_ids.shape != ids.shape:
                raise ValueError(
                    f"token_type_ids has shape {shape_of(token_type_ids)} but ids has shape "
                    f"{shape_of(ids)}"
                )
            x = x + self.token_type(token_type_ids)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def check_token_ids(name: str, ids: torch.Tensor, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``ids`` is a (B, T) integer tensor of ids below vocab_size."""
    require_ndim(name, ids, (2,), "(B, T) of token ids (for one sequence use ids[None])")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds ids from {int(ids.min())} to {int(ids.max())}, but the vocabulary has "
            f"{vocab_size} entries (valid ids are 0..{vocab_size - 1})"
        )


def _padding_from(
    name: str,
    ids: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    pad_id: int | None,
) -> torch.Tensor | None:
    """Use the given key padding mask, or derive one from pad_id; None when there is no padding."""
    if key_padding_mask is not None:
        require_bool_mask(name, key_padding_mask)
        if key_padding_mask.shape != ids.shape:
            raise ValueError(
                f"{name} has shape {shape_of(key_padding_mask)} but should match the ids' shape "
                f"{shape_of(ids)} (True marks real tokens)"
            )
        return key_padding_mask
    if pad_id is not None:
        mask = ids != pad_id
        return None if bool(mask.all()) else mask
    return None


class _AlibiMixin:
    """Builds the ALiBi bias (H, T, S) once per forward for models configured with it."""

    def _setup_alibi(self, config: TransformerConfig) -> None:
        if config.positions == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(config.n_heads), persistent=False)
        else:
            self.alibi_slopes = None

    def _alibi(self, seq_len: int, device: torch.device) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        return alibi_bias(seq_len, slopes=self.alibi_slopes, device=device)  # (H, T, T)


# --------------------------------------------------------------------------------------------
# Models


class TransformerEncoder(_AlibiMixin, nn.Module):
    """A Transformer encoder: embeddings, then a stack of unmasked encoder blocks
    (section 3.5 of the notes). Every position sees the whole sequence.

    Shapes:
        forward(ids: (B, T), ...) -> EncoderOutput with last_hidden_state (B, T, D)
    """

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = Embeddings(
            config.vocab_size, config.d_model, max_len=config.max_len,
            positions=config.positions, type_vocab_size=config.type_vocab_size,
            norm=config.embed_norm, eps=config.layer_norm_eps, dropout=config.dropout,
        )
        self.blocks = nn.ModuleList(
            EncoderBlock(
                config.d_model, config.n_heads, config.d_ff, dropout=config.dropout,
                activation=config.activation, norm_first=config.norm_first,
                eps=config.layer_norm_eps, bias=config.bias, rope=config.positions == "rope",
            )
            for _ in range(config.n_layers)
        )
        # Pre-norm stacks leave the residual stream unnormalised, so they end with a LayerNorm.
        self.final_norm = (
            LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
        )
        self._setup_alibi(config)
        init_weights(self, config.n_layers)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        need_weights: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Encode a batch of token ids.

        Args:
            ids: (B, T) token ids.
            key_padding_mask: (B, T) boolean, True for real tokens (derived from pad_id if None).
            token_type_ids: (B, T) segment ids (models with type_vocab_size > 0).
            need_weights: also return every block's attention weights.
            output_hidden_states: also return the embeddings and every block's output.
        """
        x = self.embeddings(ids, token_type_ids)  # (B, T, D)
        padding = _padding_from("key_padding_mask", ids, key_padding_mask, self.config.pad_id)
        bias = self._alibi(ids.shape[1], ids.device)
        hidden_states = [x]
        attentions = []
        for block in self.blocks:
            x, weights = block(
                x, key_padding_mask=padding, bias=bias, need_weights=need_weights
            )
            hidden_states.append(x)
            attentions.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
            hidden_states[-1] = x
        return EncoderOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if need_weights else None,
        )


class TransformerDecoder(_AlibiMixin, nn.Module):
    """A Transformer decoder: embeddings, a stack of causally masked blocks and a linear layer
    to vocabulary logits (section 3.6 of the notes). With ``cross_attention=True`` in its config
    it is the decoder half of an encoder-decoder.

    Shapes:
        forward(ids: (B, T), ...) -> LMOutput with logits (B, T, V)
    """

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = Embeddings(
            config.vocab_size, config.d_model, max_len=config.max_len,
            positions=config.positions, eps=config.layer_norm_eps, dropout=config.dropout,
        )
        self.blocks = nn.ModuleList(
            DecoderBlock(
                config.d_model, config.n_heads, config.d_ff,
                cross_attention=config.cross_attention, dropout=config.dropout,
                activation=config.activation, norm_first=config.norm_first,
                eps=config.layer_norm_eps, bias=config.bias, rope=config.positions == "rope",
            )
            for _ in range(config.n_layers)
        )
        self.final_norm = (
            LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
        )
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self._setup_alibi(config)
        init_weights(self, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embeddings.token.weight  # one (V, D) matrix, used twice

    def forward(
        self,
        ids: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> LMOutput:
        """Next-token logits for every position.

        Args:
            ids: (B, T) token ids.
            targets: (B, T) next tokens; entries equal to -100 are ignored in the loss.
            key_padding_mask: (B, T) boolean, True for real tokens (derived from pad_id if None).
            memory: (B, S, D) encoder output, for cross-attention.
            memory_key_padding_mask: (B, S) boolean, True for real source tokens.
            need_weights: also return attention weights.
        """
        x = self.embeddings(ids)  # (B, T, D)
        padding = _padding_from("key_padding_mask", ids, key_padding_mask, self.config.pad_id)
        bias = self._alibi(ids.shape[1], ids.device)
        self_attns, cross_attns = [], []
        for block in self.blocks:
            x, self_w, cross_w = block(
                x, memory, key_padding_mask=padding,
                memory_key_padding_mask=memory_key_padding_mask, bias=bias,
                need_weights=need_weights,
            )
            self_attns.append(self_w)
            cross_attns.append(cross_w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits = self.lm_head(x)  # (B, T, V)
        loss = None
        if targets is not None:
            loss = lm_loss(logits, targets)
        return LMOutput(
            logits=logits,
            loss=loss,
            attentions=tuple(self_attns) if need_weights else None,
            cross_attentions=(
                tuple(cross_attns) if need_weights and self.config.cross_attention else None
            ),
        )

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``ids`` by sampling one token at a time (the model sees at most its last
        ``max_len`` tokens).

        Args:
            ids: (B, T) or (T,) prompt token ids.
            max_new_tokens: how many tokens to add.
            temperature: divides the logits; 0 means greedy (always the most likely token).
            top_k: sample only among the k most likely tokens.
            generator: a torch.Generator for repeatable sampling.

        Returns:
            (B, T + max_new_tokens) token ids (or 1-D for a 1-D prompt).
        """
        if self.config.cross_attention:
            raise ValueError(
                "this decoder needs an encoder's memory; use EncoderDecoder.generate instead"
            )
        require_positive_int("max_new_tokens", max_new_tokens)
        unbatched = ids.dim() == 1
        if unbatched:
            ids = ids.unsqueeze(0)
        check_token_ids("ids", ids, self.config.vocab_size)
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                context = ids[:, -self.config.max_len:]  # (B, <= max_len)
                logits = self(context).logits[:, -1, :]  # (B, V)
                next_id = sample_next_token(
                    logits, temperature=temperature, top_k=top_k, generator=generator
                )  # (B,)
                ids = torch.cat([ids, next_id[:, None]], dim=1)
        finally:
            self.train(was_training)
        return ids.squeeze(0) if unbatched else ids


class EncoderDecoder(nn.Module):
    """A Transformer encoder-decoder (section 3.7 of the notes): the encoder reads the source
    with full attention, the decoder writes the target causally and cross-attends to the
    encoder's output.

    Shapes:
        forward(src: (B, S), tgt: (B, T), ...) -> LMOutput with logits (B, T, V_tgt)
    """

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, EncoderDecoderConfig):
            raise TypeError(f"config must be an EncoderDecoderConfig, got {type(config).__name__}")
        self.config = config
        self.encoder = TransformerEncoder(config.encoder())
        self.decoder = TransformerDecoder(config.decoder())

    def encode(
        self, src: torch.Tensor, *, src_key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[EncoderOutput, torch.Tensor | None]:
        """Run the encoder; returns its output and the source padding mask it used."""
        padding = _padding_from("src_key_padding_mask", src, src_key_padding_mask,
                                self.config.pad_id)
        return self.encoder(src, key_padding_mask=padding, need_weights=need_weights), padding

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
        tgt_key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> LMOutput:
        """Logits for the next target token at every target position.

        Args:
            src: (B, S) source ids.
            tgt: (B, T) decoder input ids (usually BOS followed by the target shifted right).
            targets: (B, T) the tokens to predict; -100 entries are ignored.
            src_key_padding_mask, tgt_key_padding_mask: boolean, True for real tokens.
            need_weights: return encoder, decoder and cross-attention weights.
        """
        encoded, src_padding = self.encode(
            src, src_key_padding_mask=src_key_padding_mask, need_weights=need_weights
        )
        if tgt.dim() == 2 and src.dim() == 2 and tgt.shape[0] != src.shape[0]:
            raise ValueError(
                f"src has batch size {src.shape[0]} but tgt has batch size {tgt.shape[0]}"
            )
        out = self.decoder(
            tgt, targets=targets, key_padding_mask=tgt_key_padding_mask,
            memory=encoded.last_hidden_state, memory_key_padding_mask=src_padding,
            need_weights=need_weights,
        )
        out.encoder_attentions = encoded.attentions
        return out

    @torch.no_grad()
    def generate(
        self,
        src: torch.Tensor,
        *,
        bos_id: int,
        max_new_tokens: int,
        eos_id: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        src_key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode a target for each source, greedily by default.

        Returns:
            (B, 1 + n) target ids starting with ``bos_id``; generation stops early once every
            sequence has produced ``eos_id`` (later positions are filled with ``eos_id``).
        """
        require_positive_int("max_new_tokens", max_new_tokens)
        was_training = self.training
        self.eval()
        try:
            encoded, src_padding = self.encode(src, src_key_padding_mask=src_key_padding_mask)
            memory = encoded.last_hidden_state  # (B, S, D)
            tgt = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
            finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
            limit = min(max_new_tokens, self.config.max_tgt_len - 1) if (
                self.config.positions == "learned") else max_new_tokens
            for _ in range(limit):
                logits = self.decoder(
                    tgt, memory=memory, memory_key_padding_mask=src_padding
                ).logits[:, -1, :]  # (B, V)
                next_id = sample_next_token(
                    logits, temperature=temperature, top_k=top_k, generator=generator
                )
                if eos_id is not None:
                    next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
                    finished |= next_id == eos_id
                tgt = torch.cat([tgt, next_id[:, None]], dim=1)
                if eos_id is not None and bool(finished.all()):
                    break
        finally:
            self.train(was_training)
        return tgt


# --------------------------------------------------------------------------------------------
# Loss and sampling


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, ignoring -100 entries."""
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets has shape {shape_of(targets)} but the logits are {shape_of(logits)}; "
            f"targets should be {tuple(logits.shape[:-1])}"
        )
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of (B, V) logits.

    Args:
        logits: (B, V) unnormalised scores.
        temperature: > 0 divides the logits (lower is more conservative); 0 means greedy.
        top_k: keep only the k highest logits before sampling.
        generator: a torch.Generator for repeatable sampling.

    Returns:
        (B,) token ids.
    """
    require_ndim("logits", logits, (2,), "(B, V)")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None:
        require_positive_int("top_k", top_k)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)
