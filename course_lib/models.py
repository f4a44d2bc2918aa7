"""Whole Transformers built from course_lib's blocks: an encoder (BERT-style), a decoder
language model (GPT-style) and an encoder-decoder (T5-style), notes sections 3.5-3.7.

Shape legend: B batch, T (target/query) length, S source length, D d_model, H heads, V vocab.

Each model validates its inputs once, in ``forward``, then runs the blocks. The names follow
Hugging Face: ``attention_mask`` (True/1 = a real token), ``output_attentions``,
``output_hidden_states``, and outputs with ``last_hidden_state``, ``logits``, ``attentions``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    check_token_ids,
    checks_wanted,
    inputs_checked,
    require_bool,
    require_integer_tensor,
    require_max_length,
    require_ndim,
    require_padding_mask,
    require_tensor,
    shape_of,
    values_checked,
)
from .blocks import DecoderBlock, EncoderBlock, check_encoder_states
from .cache import KVCache
from .configs import (
    DecoderConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    EncoderOutput,
    LMOutput,
    TransformerConfig,
)
from .generation import generate, generate_seq2seq
from .layers import dropout_layer
from .positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
)
from .tokenizer import IGNORE_INDEX

# --------------------------------------------------------------------------------------------
# Input checks (shapes and dtypes always; token values only where reading them is free)


def _position_limit(config: TransformerConfig) -> int | None:
    """Learned position tables end at max_len; the other position kinds extrapolate."""
    return config.max_len if config.positions == "learned" else None


def _check_sequence(ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    config: TransformerConfig, name: str = "ids",
                    mask_name: str = "attention_mask",
                    limit_name: str = "max_len") -> torch.Tensor | None:
    """Check (B, T) token ids and their padding mask (named as the caller wrote them); return
    the mask as booleans (a 0/1 integer mask converted), or None."""
    check_token_ids(name, ids, config.vocab_size)
    require_max_length(name, ids, _position_limit(config), limit_name)
    return require_padding_mask(mask_name, attention_mask, ids.shape,
                                f"should match {name}'s shape {shape_of(ids)}")


def _check_targets(targets: torch.Tensor | None, ids: torch.Tensor, ids_name: str) -> None:
    if targets is None:
        return
    require_ndim("targets", targets, (2,), "(B, T), the next token at every position")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must hold integer token ids (class indices), got dtype "
                         f"{targets.dtype}; convert with targets.long()")
    if targets.shape != ids.shape:
        raise ValueError(f"targets has shape {shape_of(targets)} but the input ids have shape "
                         f"{shape_of(ids)} ({ids_name}); they must match")


def _bad_targets(targets: torch.Tensor, vocab_size: int) -> str | None:
    """What is wrong with targets outside the vocabulary, or None. Run only once the loss has
    failed: reading the targets in every step would cost time (and on a GPU, a sync)."""
    bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
    if not bool(bad.any()):
        return None
    return (f"targets holds {targets[bad][0].item()}, outside the vocabulary 0..{vocab_size - 1} "
            f"(use {IGNORE_INDEX} for positions that are not scored)")


def _padding(attention_mask: torch.Tensor | None, ids: torch.Tensor,
             pad_id: int | None) -> torch.Tensor | None:
    """The given mask, or one derived from pad_id (True = real token); None if neither."""
    if attention_mask is not None:
        return attention_mask
    return None if pad_id is None else ids != pad_id


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
    require_bool("trainable_only", trainable_only)
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
        elif any(part.endswith("norm") for part in parts):
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
    The model checks the ids before calling it.

    Shapes:
        forward(ids: (B, T), token_type_ids: (B, T) or None, offset) -> (B, T, D); ``offset``
        is the position of the first id (the number of earlier tokens, with a cache).
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
        self.token = nn.Embedding(vocab_size, d_model)
        self.token_scale = math.sqrt(d_model) if positions == "sinusoidal" else 1.0
        self.position: nn.Module | None = None
        if positions == "learned":
            self.position = LearnedPositionalEmbedding(max_len, d_model)
        elif positions == "sinusoidal":
            self.position = SinusoidalPositionalEncoding(d_model)
        self.token_type = nn.Embedding(type_vocab_size, d_model) if type_vocab_size else None
        self.norm = nn.LayerNorm(d_model, eps=eps) if norm else None
        self.dropout = dropout_layer(dropout)

    def forward(
        self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None, *, offset: int = 0
    ) -> torch.Tensor:
        x = self.token(ids)  # (B, T, D)
        if self.token_scale != 1.0:
            x = x * self.token_scale  # sqrt(D), with sinusoidal positions
        if self.position is not None:
            x = x + self.position(ids.shape[1], offset=offset)  # (T, D) broadcasts over B
        if self.token_type is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros_like(ids)
            x = x + self.token_type(token_type_ids)  # (B, T, D)
        if self.norm is not None:
            x = self.norm(x)
        return self.dropout(x)


def _block_kwargs(config: TransformerConfig) -> dict:
    return dict(dropout=config.dropout, activation=config.activation,
                norm_first=config.norm_first, eps=config.layer_norm_eps, bias=config.bias,
                rope=config.positions == "rope")


class _Stack(nn.Module):
    """What the encoder and the decoder share: embeddings, blocks, the final norm, ALiBi."""

    def __init__(self, config: TransformerConfig, blocks: list[nn.Module], **embedding) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(
            config.vocab_size, config.d_model, max_len=config.max_len,
            positions=config.positions, eps=config.layer_norm_eps, dropout=config.dropout,
            **embedding,
        )
        self.blocks = nn.ModuleList(blocks)
        # Pre-norm stacks leave the residual stream unnormalised, so they end with a LayerNorm.
        self.final_norm = (
            nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.norm_first else None
        )
        if config.positions == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(config.n_heads), persistent=False)
        else:
            self.alibi_slopes = None

    def _alibi(self, seq_len: int, device: torch.device, n_past: int = 0) -> torch.Tensor | None:
        if self.alibi_slopes is None:
            return None
        # (H, T, n_past + T): the queries are the last T positions
        return alibi_bias(seq_len, seq_len + n_past, slopes=self.alibi_slopes, device=device)


class Encoder(_Stack):
    """A Transformer encoder: embeddings, then a stack of unmasked encoder blocks (note 3.5).
    Every position sees the whole sequence. (Not ``torch.nn.TransformerEncoder``, which is a
    bare stack of layers without embeddings.)

    Shapes:
        forward(ids: (B, T), ...) -> EncoderOutput with last_hidden_state (B, T, D)
    """

    def __init__(self, config: EncoderConfig) -> None:
        if not isinstance(config, EncoderConfig):
            raise TypeError(f"config must be an EncoderConfig, got {type(config).__name__}")
        blocks = [EncoderBlock(config.d_model, config.n_heads, config.d_ff,
                               **_block_kwargs(config))
                  for _ in range(config.n_layers)]
        super().__init__(config, blocks, type_vocab_size=config.type_vocab_size,
                         norm=config.embed_norm)
        init_weights(self, config.n_layers)

    def forward(
        self,
        ids: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Encode a batch of token ids.

        Args:
            ids: (B, T) token ids.
            attention_mask: (B, T) boolean or 0/1 integers (as Hugging Face tokenizers return),
                True/1 for real tokens (derived from pad_id if None).
            token_type_ids: (B, T) segment ids (models with type_vocab_size > 0).
            output_attentions: also return every block's attention weights.
            output_hidden_states: also return the embeddings and every block's output.
        """
        if checks_wanted():  # an EncoderDecoder checks src at its own boundary
            attention_mask = self._check(ids, attention_mask, token_type_ids, output_attentions,
                                         output_hidden_states)
        x = self.embeddings(ids, token_type_ids)  # (B, T, D)
        padding = _padding(attention_mask, ids, self.config.pad_id)  # (B, T) or None
        bias = self._alibi(ids.shape[1], ids.device)  # (H, T, T) or None
        hidden_states, attentions = [x], []
        with inputs_checked():  # checked at this model's boundary
            for block in self.blocks:
                x, weights = block(x, attention_mask=padding, bias=bias,
                                   return_weights=output_attentions)  # (B, T, D)
                hidden_states.append(x)
                attentions.append(weights)
        if self.final_norm is not None:
            x = self.final_norm(x)
            hidden_states[-1] = x
        return EncoderOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )

    def _check(self, ids, attention_mask, token_type_ids, output_attentions,
               output_hidden_states) -> torch.Tensor | None:
        """Check every argument of :meth:`forward`; return attention_mask as booleans."""
        c = self.config
        require_bool("output_attentions", output_attentions)
        require_bool("output_hidden_states", output_hidden_states)
        attention_mask = _check_sequence(ids, attention_mask, c)
        if token_type_ids is not None:
            if c.type_vocab_size == 0:
                raise ValueError(
                    "token_type_ids was given but this encoder has no segment embeddings "
                    "(type_vocab_size=0 in its config); leave it out or build the model with "
                    "type_vocab_size > 0"
                )
            check_token_ids("token_type_ids", token_type_ids, c.type_vocab_size)
            if token_type_ids.shape != ids.shape:
                raise ValueError(f"token_type_ids has shape {shape_of(token_type_ids)} but "
                                 f"ids has shape {shape_of(ids)}; they must match")
        return attention_mask


class DecoderLM(_Stack):
    """A decoder language model (GPT-style, note 3.6): embeddings, a stack of causally masked
    blocks and a linear layer to vocabulary logits. With ``cross_attention=True`` in its config
    it is the decoder half of an :class:`EncoderDecoder`. (Not ``torch.nn.TransformerDecoder``,
    which is a bare stack of cross-attending layers.)

    Shapes:
        forward(ids: (B, T), ...) -> LMOutput with logits (B, T, V)
    """

    def __init__(self, config: DecoderConfig) -> None:
        if not isinstance(config, DecoderConfig):
            raise TypeError(f"config must be a DecoderConfig, got {type(config).__name__}")
        blocks = [DecoderBlock(config.d_model, config.n_heads, config.d_ff,
                               cross_attention=config.cross_attention,
                               **_block_kwargs(config))
                  for _ in range(config.n_layers)]
        super().__init__(config, blocks)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embeddings.token.weight  # one (V, D) matrix, used twice

    def forward(
        self,
        ids: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        past_key_values: KVCache | None = None,
    ) -> LMOutput:
        """Next-token logits for every position.

        Args:
            ids: (B, T) token ids.
            targets: (B, T) next tokens; entries equal to -100 are not scored.
            attention_mask: (B, T) boolean or 0/1 integers (as Hugging Face tokenizers return),
                True/1 for real tokens (derived from pad_id if None). With a non-empty cache
                it covers the cached tokens too: (B, S + T).
            encoder_hidden_states: (B, S, D) the encoder's output, for cross-attention.
            encoder_attention_mask: (B, S) boolean or 0/1 integers, True/1 for real source
                tokens.
            output_attentions: also return attention weights.
            past_key_values: a :class:`~course_lib.cache.KVCache` holding the keys and
                values of the S tokens before ``ids`` (empty at first): ``ids`` are taken as
                positions S .. S + T - 1, and the cache is extended with them in place (as
                Hugging Face's ``DynamicCache``).
        """
        if checks_wanted():  # an EncoderDecoder checks tgt and the encoder's output itself
            require_bool("output_attentions", output_attentions)
            if past_key_values is None:
                attention_mask = _check_sequence(ids, attention_mask, self.config)
            else:
                attention_mask = self._check_cached(ids, attention_mask, past_key_values)
            _check_targets(targets, ids, "ids")
            encoder_attention_mask = self._check_encoder_states(
                ids, encoder_hidden_states, encoder_attention_mask)
        n_past = 0 if past_key_values is None else past_key_values.get_seq_length()
        x = self.embeddings(ids, offset=n_past)  # (B, T, D), positions n_past .. n_past + T - 1
        padding = _padding(attention_mask, ids, self.config.pad_id)  # (B, n_past + T) or None
        bias = self._alibi(ids.shape[1], ids.device, n_past)  # (H, T, n_past + T) or None
        self_attns, cross_attns = [], []
        with inputs_checked():  # checked at this model's boundary
            for i, block in enumerate(self.blocks):
                x, self_w, cross_w = block(
                    x, encoder_hidden_states, attention_mask=padding,
                    encoder_attention_mask=encoder_attention_mask, bias=bias,
                    return_weights=output_attentions,
                    past_key_value=None if past_key_values is None else past_key_values.layer(i),
                )  # (B, T, D)
                self_attns.append(self_w)
                cross_attns.append(cross_w)
        if self.final_norm is not None:
            x = self.final_norm(x)
        logits = self.lm_head(x)  # (B, T, V)
        cross = output_attentions and self.config.cross_attention
        return LMOutput(
            logits=logits,
            loss=None if targets is None else lm_loss(logits, targets),
            attentions=tuple(self_attns) if output_attentions else None,
            cross_attentions=tuple(cross_attns) if cross else None,
        )

    def _check_encoder_states(self, ids, encoder_hidden_states,
                              encoder_attention_mask) -> torch.Tensor | None:
        """What cross-attention takes: check it (or refuse it without cross-attention); return
        encoder_attention_mask as booleans."""
        if not self.config.cross_attention:
            for name, given in (("encoder_hidden_states", encoder_hidden_states),
                                ("encoder_attention_mask", encoder_attention_mask)):
                if given is not None:
                    raise ValueError(
                        f"{name} was given but this decoder has no cross-attention "
                        "(cross_attention=False in its config), so it would be ignored: leave "
                        "it out, or use an EncoderDecoder"
                    )
            return None
        if encoder_hidden_states is None:
            raise ValueError("this decoder has cross-attention: pass encoder_hidden_states= "
                             "(B, S, D), or use EncoderDecoder")
        check_encoder_states(encoder_hidden_states, ids.shape[0], "ids", self.blocks[0].cross_attn)
        batch, src_len = encoder_hidden_states.shape[:2]
        return require_padding_mask(
            "encoder_attention_mask", encoder_attention_mask, (batch, src_len),
            f"should be (B, S) = {(batch, src_len)}: the batch and the S source positions of "
            "encoder_hidden_states")

    def _check_cached(self, ids, attention_mask, cache: object) -> torch.Tensor | None:
        """The checks of ids and attention_mask for new tokens that follow the cached ones;
        returns attention_mask as booleans."""
        if not isinstance(cache, KVCache):
            raise TypeError(f"past_key_values must be a course_lib.cache.KVCache (start "
                            f"with an empty KVCache()), got {type(cache).__name__}")
        c, n_past = self.config, cache.get_seq_length()
        _check_sequence(ids, None, c)
        if len(cache) > len(self.blocks) or (n_past and len(cache) != len(self.blocks)):
            raise ValueError(f"past_key_values holds {len(cache)} layers but this model has "
                             f"{len(self.blocks)}: was it filled by another model?")
        lengths = [layer.get_seq_length() for layer in cache.layers]
        if len(set(lengths)) > 1:
            raise ValueError(f"past_key_values holds layers of different lengths {lengths}: "
                             "crop the whole cache (cache.crop(n)), not one layer")
        if n_past:
            held = cache.layers[0].keys.shape  # (B, H, S, Dh)
            if held[0] != ids.shape[0]:
                raise ValueError(f"past_key_values was filled with a batch of {held[0]} "
                                 f"sequences but ids has batch size {ids.shape[0]}")
            if (held[1], held[3]) != (c.n_heads, c.d_model // c.n_heads):
                raise ValueError(
                    f"past_key_values holds {held[1]} heads of size {held[3]} but this model "
                    f"has {c.n_heads} heads of size {c.d_model // c.n_heads}: was it filled by "
                    "another model? Start with a new KVCache()")
        limit = _position_limit(c)
        if limit is not None and n_past + ids.shape[1] > limit:
            raise ValueError(
                f"past_key_values holds {n_past} tokens and ids adds {ids.shape[1]}, more than "
                f"this model's context of max_len={limit} tokens (learned positions end there)"
            )
        expected = (ids.shape[0], n_past + ids.shape[1])
        if attention_mask is None and n_past and c.pad_id is not None:
            raise ValueError(
                "this model masks padding (pad_id is set), and with a non-empty cache it cannot "
                f"tell which cached tokens were padding: pass attention_mask of shape {expected}"
            )
        return require_padding_mask(
            "attention_mask", attention_mask, expected,
            f"with {n_past} cached tokens it must cover them and the new ones: (B, S + T) = "
            f"{expected}")

    def generate(self, ids: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """Extend ``ids`` (B, T) or (T,) by ``max_new_tokens`` sampled tokens; see
        :func:`course_lib.generation.generate` for the sampling options."""
        return generate(self, ids, max_new_tokens, **sampling)


class EncoderDecoder(nn.Module):
    """A Transformer encoder-decoder (note 3.7): the encoder reads the source with full
    attention, the decoder writes the target causally and cross-attends to the encoder's
    output.

    Shapes:
        forward(src: (B, S), tgt: (B, T), ...) -> LMOutput with logits (B, T, V_tgt)
    """

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        if not isinstance(config, EncoderDecoderConfig):
            raise TypeError(f"config must be an EncoderDecoderConfig, got {type(config).__name__}")
        self.config = config
        self.encoder = Encoder(config.encoder)
        decoder = config.decoder
        if not decoder.cross_attention:
            decoder = dataclasses.replace(decoder, cross_attention=True)
        self.decoder = DecoderLM(decoder)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        *,
        targets: torch.Tensor | None = None,
        src_attention_mask: torch.Tensor | None = None,
        tgt_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> LMOutput:
        """Logits for the next target token at every target position.

        Args:
            src: (B, S) source ids.
            tgt: (B, T) decoder input ids (usually BOS followed by the target shifted right).
            targets: (B, T) the tokens to predict; -100 entries are not scored.
            src_attention_mask, tgt_attention_mask: boolean or 0/1 integers, True/1 for real
                tokens (derived from each config's pad_id when None).
            output_attentions: return encoder, decoder and cross-attention weights.
        """
        require_bool("output_attentions", output_attentions)
        src_attention_mask = self.check_src(src, src_attention_mask)
        tgt_attention_mask = _check_sequence(tgt, tgt_attention_mask, self.decoder.config, "tgt",
                                             "tgt_attention_mask", "max_tgt_len")
        if tgt.shape[0] != src.shape[0]:
            raise ValueError(f"src has batch size {src.shape[0]} but tgt has batch size "
                             f"{tgt.shape[0]}; they must match")
        _check_targets(targets, tgt, "tgt")
        with inputs_checked():  # checked here: the encoder and the decoder skip their checks
            encoded, src_padding = self.encode(src, src_attention_mask, output_attentions)
            out = self.decoder(tgt, targets=targets, attention_mask=tgt_attention_mask,
                               encoder_hidden_states=encoded.last_hidden_state,
                               encoder_attention_mask=src_padding,
                               output_attentions=output_attentions)
        out.encoder_attentions = encoded.attentions
        return out

    def check_src(self, src: torch.Tensor,
                  src_attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Validate a source batch (messages name ``src``, ``src_attention_mask`` and
        ``max_src_len``); returns src_attention_mask as booleans, or None."""
        return _check_sequence(src, src_attention_mask, self.config.encoder, "src",
                               "src_attention_mask", "max_src_len")

    def encode(
        self, src: torch.Tensor, src_attention_mask: torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[EncoderOutput, torch.Tensor | None]:
        """Run the encoder on a source batch; returns its output and the boolean source padding
        mask (True = real token; derived from pad_id without a mask; None without either)."""
        if checks_wanted():
            require_bool("output_attentions", output_attentions)
            src_attention_mask = self.check_src(src, src_attention_mask)
        padding = _padding(src_attention_mask, src, self.config.encoder.pad_id)  # (B, S)
        with inputs_checked():
            encoded = self.encoder(src, attention_mask=padding,
                                   output_attentions=output_attentions)
        return encoded, padding

    def generate(self, src: torch.Tensor, *, bos_id: int, max_new_tokens: int,
                 **sampling) -> torch.Tensor:
        """Decode a target for each source (greedy by default); see
        :func:`course_lib.generation.generate_seq2seq`."""
        return generate_seq2seq(self, src, bos_id=bos_id, max_new_tokens=max_new_tokens,
                                **sampling)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, ignoring -100 entries."""
    require_integer_tensor("targets", require_tensor("targets", targets),
                           "token ids (class indices)")
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets has shape {shape_of(targets)} but the logits are {shape_of(logits)}; "
            f"targets should be {tuple(logits.shape[:-1])}"
        )
    try:  # -log softmax(logits)[target], averaged over the scored positions
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten().long(),
                               ignore_index=IGNORE_INDEX)  # int32 targets too
    except (IndexError, RuntimeError):
        problem = _bad_targets(targets, logits.shape[-1]) if values_checked(targets) else None
        if problem is None:
            raise
        raise ValueError(problem) from None
