"""Whole Transformers built from course_lib's blocks: an encoder (BERT-style), a decoder
language model (GPT-style) and an encoder-decoder (T5-style), notes sections 3.5-3.7.

Shape legend: B batch, T (target/query) length, S source length, D d_model, H heads, V vocab.

Each model checks its inputs once, in ``forward``, then runs its blocks inside
``inputs_checked()``. The names follow Hugging Face: ``attention_mask`` (True/1 = a real token),
``output_attentions``, ``output_hidden_states``, ``last_hidden_state``, ``logits``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    check_bools,
    check_token_ids,
    checks_wanted,
    inputs_checked,
    require_instance,
    require_integer_tensor,
    require_ndim,
    require_padding_mask,
    require_size,
    require_tensor,
    shape_of,
    values_checked,
)
from .attention import as_bool_mask
from .blocks import DecoderBlock, EncoderBlock, check_block_inputs, check_feed_forward_width
from .cache import KVCache, check_fits
from .configs import (
    DecoderConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    EncoderOutput,
    LMOutput,
    TransformerConfig,
)
from .generation import generate, generate_seq2seq
from .layers import dropout_layer, get_activation, make_norm
from .positions import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
)
from .tokenizer import IGNORE_INDEX


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2-style initialisation: N(0, 0.02) for linear and embedding weights, zero biases,
    and the projections that write into the residual stream scaled down by sqrt(2 n_layers)
    so the stream's variance does not grow with depth."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            std = 0.02
            if name.endswith(("out_proj", "ff.fc2", "ff.down_proj")):
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
    check_bools(trainable_only=trainable_only)
    params = {id(p): p for p in module.parameters() if p.requires_grad or not trainable_only}
    return sum(p.numel() for p in params.values())


def parameter_breakdown(model: nn.Module) -> dict[str, int]:
    """A course_lib model's parameter count by component: ``{group: count}`` for the groups
    with parameters among "embeddings" (tables and an embedding LayerNorm; tied weights count
    here, once), "attention", "feed-forward", "layer norms" and "output head" (untied). The
    counts add up to :func:`count_parameters`."""
    groups = dict.fromkeys(("embeddings", "attention", "feed-forward", "layer norms",
                            "output head", "other"), 0)
    for name, param in model.named_parameters():  # a shared (tied) tensor comes once
        parts = name.split(".")
        group = ("embeddings" if "embeddings" in parts else
                 "attention" if "self_attn" in parts or "cross_attn" in parts else
                 "feed-forward" if "ff" in parts else
                 "layer norms" if any(part.endswith("norm") for part in parts) else
                 "output head" if "lm_head" in parts else "other")
        groups[group] += param.numel()
    return {group: count for group, count in groups.items() if count}


class Embeddings(nn.Module):
    """Token embeddings plus (depending on ``positions``) absolute position vectors and
    segment embeddings, then optional LayerNorm and dropout. With fixed sinusoidal positions
    (RMS about 0.7) the token vectors are scaled by sqrt(D) and initialised with std 1/sqrt(D),
    as in the original Transformer, so tokens and positions start at comparable sizes.

    Shapes:
        forward(ids: (B, T), token_type_ids: (B, T) or None, offset) -> (B, T, D); ``offset``
        is the position of the first id (the number of earlier tokens, with a cache).
    """

    def __init__(self, vocab_size: int, d_model: int, *, max_len: int, positions: str,
                 type_vocab_size: int = 0, norm: bool = False, eps: float = 1e-5,
                 dropout: float = 0.0) -> None:
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

    def forward(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None = None, *,
                offset: int = 0) -> torch.Tensor:
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


def _padding(attention_mask: torch.Tensor | None, ids: torch.Tensor,
             pad_id: int | None) -> torch.Tensor | None:
    """The padding mask as booleans (True = real token): the given one (0/1 integers become
    booleans), or one derived from pad_id; None if neither."""
    if attention_mask is not None:
        return as_bool_mask(attention_mask)
    return None if pad_id is None else ids != pad_id


class _Stack(nn.Module):
    """What the encoder and the decoder share: embeddings, blocks, the final norm, ALiBi."""

    def __init__(self, config: TransformerConfig, blocks: list[nn.Module], *,
                 norm_kind: str = "layer", **embedding) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config.vocab_size, config.d_model, max_len=config.max_len,
                                     positions=config.positions, eps=config.layer_norm_eps,
                                     dropout=config.dropout, **embedding)
        self.blocks = nn.ModuleList(blocks)
        # Pre-norm stacks leave the residual stream unnormalised, so they end with a norm.
        self.final_norm = make_norm(norm_kind, config.d_model, eps=config.layer_norm_eps) \
            if config.norm_first else None
        if config.positions == "alibi":
            self.register_buffer("alibi_slopes", alibi_slopes(config.n_heads), persistent=False)
        else:
            self.alibi_slopes = None

    def alibi(self, seq_len: int, device: torch.device, n_past: int = 0) -> torch.Tensor | None:
        """The ALiBi bias of the last ``seq_len`` of ``n_past + seq_len`` positions, (H, T,
        n_past + T), or None for the other position kinds."""
        if self.alibi_slopes is None:
            return None
        return alibi_bias(seq_len, seq_len + n_past, slopes=self.alibi_slopes, device=device)


class Encoder(_Stack):
    """A Transformer encoder: embeddings, then a stack of unmasked encoder blocks (note 3.5).
    Every position sees the whole sequence. (Not ``torch.nn.TransformerEncoder``, which is a
    bare stack of layers without embeddings.)

    Shapes:
        forward(ids: (B, T), ...) -> EncoderOutput with last_hidden_state (B, T, D)
    """

    def __init__(self, config: EncoderConfig) -> None:
        check_config(config, EncoderConfig)
        blocks = [EncoderBlock(config.d_model, config.n_heads, config.d_ff,
                               **_block_kwargs(config))
                  for _ in range(config.n_layers)]
        super().__init__(config, blocks, type_vocab_size=config.type_vocab_size,
                         norm=config.embed_norm)
        init_weights(self, config.n_layers)

    def forward(self, ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, output_attentions: bool = False,
                output_hidden_states: bool = False) -> EncoderOutput:
        """Encode a batch of token ids.

        Args:
            ids: (B, T) token ids.
            attention_mask: (B, T) bool or 0/1 integers (as Hugging Face tokenizers return),
                True/1 for real tokens (derived from pad_id if None).
            token_type_ids: (B, T) segment ids (models with type_vocab_size > 0).
            output_attentions: also return every block's attention weights.
            output_hidden_states: also return the embeddings and every block's output.
        """
        check_encoder_inputs(self, ids, attention_mask, token_type_ids,
                             output_attentions, output_hidden_states)
        x = self.embeddings(ids, token_type_ids)  # (B, T, D)
        padding = _padding(attention_mask, ids, self.config.pad_id)  # (B, T) or None
        attn_bias = self.alibi(ids.shape[1], ids.device)  # (H, T, T) or None
        hidden_states, attentions = [x], []
        with inputs_checked():  # checked at this model's boundary
            for block in self.blocks:
                x, weights = block(x, attention_mask=padding, attn_bias=attn_bias,
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


class DecoderLM(_Stack):
    """A decoder language model (GPT-style, note 3.6): embeddings, a stack of causally masked
    blocks and a linear layer to vocabulary logits. With ``cross_attention=True`` in its config
    it is the decoder half of an :class:`EncoderDecoder`. (Not ``torch.nn.TransformerDecoder``,
    which is a bare stack of cross-attending layers.)

    Shapes:
        forward(ids: (B, T), ...) -> LMOutput with logits (B, T, V)
    """

    def __init__(self, config: DecoderConfig) -> None:
        check_config(config, DecoderConfig)
        blocks = [DecoderBlock(config.d_model, config.n_heads, config.d_ff,
                               cross_attention=config.cross_attention, norm=config.norm,
                               ffn=config.ffn, n_kv_heads=config.n_kv_heads,
                               rope_theta=config.rope_theta, **_block_kwargs(config))
                  for _ in range(config.n_layers)]
        super().__init__(config, blocks, norm_kind=config.norm)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        init_weights(self, config.n_layers)
        if config.tie_embeddings:
            self.lm_head.weight = self.embeddings.token.weight  # one (V, D) matrix, used twice

    def forward(self, ids: torch.Tensor, *, targets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False,
                past_key_values: KVCache | None = None) -> LMOutput:
        """Next-token logits for every position.

        Args:
            ids: (B, T) token ids.
            targets: (B, T) next tokens; entries equal to -100 are not scored.
            attention_mask: (B, T) bool or 0/1 integers (as Hugging Face tokenizers return),
                True/1 for real tokens (derived from pad_id if None). With a non-empty cache
                it covers the cached tokens too: (B, S + T).
            encoder_hidden_states: (B, S, D) the encoder's output, for cross-attention.
            encoder_attention_mask: (B, S) bool or 0/1 integers, True/1 for real source tokens.
            output_attentions: also return attention weights.
            past_key_values: a :class:`~course_lib.cache.KVCache` holding the keys and
                values of the S tokens before ``ids`` (empty at first): ``ids`` are taken as
                positions S .. S + T - 1, and the cache is extended with them in place (as
                Hugging Face's ``DynamicCache``, passed as ``past_key_values``, or ``cache`` in
                recent transformers releases).
        """
        check_decoder_inputs(self, ids, attention_mask, past_key_values, output_attentions,
                             encoder_hidden_states, encoder_attention_mask)
        n_past = 0 if past_key_values is None else past_key_values.get_seq_length()
        x = self.embeddings(ids, offset=n_past)  # (B, T, D), positions n_past .. n_past + T - 1
        padding = _padding(attention_mask, ids, self.config.pad_id)  # (B, n_past + T) or None
        encoder_padding = _padding(encoder_attention_mask, ids, None)  # (B, S) or None
        attn_bias = self.alibi(ids.shape[1], ids.device, n_past)  # (H, T, n_past + T) or None
        self_attns, cross_attns = [], []
        with inputs_checked():  # checked at this model's boundary
            for i, block in enumerate(self.blocks):
                x, self_w, cross_w = block(
                    x, encoder_hidden_states, attention_mask=padding,
                    encoder_attention_mask=encoder_padding, attn_bias=attn_bias,
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
        check_config(config, EncoderDecoderConfig)
        self.config = config
        self.encoder = Encoder(config.encoder)
        self.decoder = DecoderLM(dataclasses.replace(config.decoder, cross_attention=True))

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, *, targets: torch.Tensor | None = None,
                src_attention_mask: torch.Tensor | None = None,
                tgt_attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False) -> LMOutput:
        """Logits for the next target token at every target position.

        Args:
            src: (B, S) source ids.
            tgt: (B, T) decoder input ids (usually BOS followed by the target shifted right).
            targets: (B, T) the tokens to predict; -100 entries are not scored.
            src_attention_mask, tgt_attention_mask: bool or 0/1 integers, True/1 for real
                tokens (derived from each config's pad_id when None).
            output_attentions: return encoder, decoder and cross-attention weights.
        """
        check_seq2seq_inputs(self.config, src, tgt, src_attention_mask, tgt_attention_mask,
                             output_attentions)
        with inputs_checked():  # checked here: the encoder and the decoder skip their checks
            encoded, src_padding = self.encode(src, src_attention_mask,
                                               output_attentions=output_attentions)
            out = self.decoder(tgt, attention_mask=tgt_attention_mask,
                               encoder_hidden_states=encoded.last_hidden_state,
                               encoder_attention_mask=src_padding,
                               output_attentions=output_attentions)
        out.loss = None if targets is None else lm_loss(out.logits, targets)
        out.encoder_attentions = encoded.attentions
        return out

    def encode(self, src: torch.Tensor, src_attention_mask: torch.Tensor | None = None, *,
               output_attentions: bool = False) -> tuple[EncoderOutput, torch.Tensor | None]:
        """Run the encoder on a (B, S) source batch; returns its output and the source padding
        mask as booleans (True = real token; from pad_id without a mask; None without either)."""
        check_bools(output_attentions=output_attentions)
        check_sequence(self.config.encoder, src, src_attention_mask, "src", "max_src_len")
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


class MaskedLM(nn.Module):
    """An encoder with BERT's masked-language-model head (Hugging Face's BertForMaskedLM): at
    every position, scores over the vocabulary for the token that belongs there. The head
    transforms each final vector (dense D -> D, the activation, LayerNorm), then scores it
    against every token embedding: the output layer's weight *is* the token embedding matrix
    (tied), plus a bias per token.

    Shapes:
        forward(ids: (B, T), ...) -> LMOutput with logits (B, T, V)
    """

    def __init__(self, config: EncoderConfig) -> None:
        check_config(config, EncoderConfig)
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.head_dense = nn.Linear(config.d_model, config.d_model)
        self.head_activation = get_activation(config.activation)
        self.head_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size)  # the bias is the head's own
        init_weights(self, config.n_layers)
        self.lm_head.weight = self.encoder.embeddings.token.weight  # one (V, D) matrix, twice

    def forward(self, ids: torch.Tensor, *, targets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> LMOutput:
        """Token scores at every position, and the loss at the masked ones.

        Args:
            ids: (B, T) token ids, some of them replaced (e.g. by :func:`course_lib.tasks.
                mask_tokens`).
            targets: (B, T) the original token where one is to be predicted, -100 elsewhere
                (Hugging Face calls them ``labels``); the loss averages over the others.
            attention_mask, token_type_ids: as in :meth:`Encoder.forward`.
        """
        hidden = self.encoder(ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state  # (B, T, D)
        h = self.head_norm(self.head_activation(self.head_dense(hidden)))  # (B, T, D)
        logits = self.lm_head(h)  # (B, T, V): h E^T + b
        return LMOutput(logits=logits,
                        loss=None if targets is None else lm_loss(logits, targets))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V) logits against (B, T) targets, ignoring -100 entries."""
    check_targets(logits, targets)
    try:  # -log softmax(logits)[target], averaged over the scored positions
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten().long(),
                               ignore_index=IGNORE_INDEX)  # int32 targets too
    except IndexError as error:  # a target outside the vocabulary, on the CPU
        valid = f"ids 0..{logits.shape[-1] - 1}, or {IGNORE_INDEX} for positions not scored"
        raise ValueError(f"targets: {error}; expected {valid}") from None


# --- argument checks


def check_config(config: object, expected: type) -> None:
    """Raise ``TypeError`` unless ``config`` is an ``expected``."""
    require_instance("config", config, expected, f"a {expected.__name__}")


def check_sequence(config: TransformerConfig, ids: object, attention_mask: object,
                   name: str = "ids", limit_name: str = "max_len", n_past: int = 0) -> None:
    """(B, T) token ids of the vocabulary, at most the context long after n_past cached tokens
    (learned positions), and their padding mask (B, n_past + T), named as the caller wrote them."""
    if not checks_wanted():
        return
    check_token_ids(name, ids, config.vocab_size)
    limit = config.max_len if config.positions == "learned" else None
    if limit is not None and n_past + ids.shape[1] > limit:
        got = f"{ids.shape[1]} tokens" + (f" after {n_past} cached ones" if n_past else "")
        raise ValueError(f"{name} has {got}: more than this model's {limit_name}={limit}")
    expected = (ids.shape[0], n_past + ids.shape[1])
    mask_name = "attention_mask" if name == "ids" else f"{name}_attention_mask"
    what = f"should be {expected}" + (f", the {n_past} cached tokens and the new" if n_past else "")
    require_padding_mask(mask_name, attention_mask, expected, what)


def check_stack(model: _Stack) -> None:
    """Blocks whose feed-forward sublayer was replaced must still map d_model to d_model."""
    for block in model.blocks:
        check_feed_forward_width(block.ff, model.config.d_model)


def check_encoder_inputs(model: Encoder, ids: object, attention_mask: object,
                         token_type_ids: object, output_attentions: object,
                         output_hidden_states: object) -> None:
    """What :meth:`Encoder.forward` takes: ids, their mask, segment ids, and the flags."""
    if not checks_wanted():
        return
    config = model.config
    check_stack(model)
    check_bools(output_attentions=output_attentions, output_hidden_states=output_hidden_states)
    check_sequence(config, ids, attention_mask)
    if token_type_ids is not None:
        check_token_ids("token_type_ids", token_type_ids, max(config.type_vocab_size, 1))
        if token_type_ids.shape != ids.shape or not config.type_vocab_size:
            got = f"shape {shape_of(token_type_ids)}, type_vocab_size={config.type_vocab_size}"
            raise ValueError(f"token_type_ids: got {got}; expected ids's shape and a vocabulary")


def check_decoder_inputs(model: DecoderLM, ids: object, attention_mask: object,
                         cache: object, output_attentions: object,
                         encoder_hidden_states: object, encoder_attention_mask: object) -> None:
    """What :meth:`DecoderLM.forward` takes besides the targets (checked by :func:`lm_loss`);
    the encoder's output as the first block will see it."""
    if not checks_wanted():
        return
    config = model.config
    check_stack(model)
    check_bools(output_attentions=output_attentions)
    if cache is not None and not isinstance(cache, KVCache):
        got = type(cache).__name__
        raise TypeError(f"past_key_values must be a course_lib.cache.KVCache or None, got {got}")
    if cache is not None and len(cache) not in (0, config.n_layers):
        raise ValueError(f"past_key_values holds {len(cache)} layers but this model has "
                         f"{config.n_layers}: a cache belongs to the model that filled it")
    if cache is not None and len(cache):
        attention = model.blocks[0].self_attn
        check_fits("past_key_values", cache.layer(0), require_ndim("ids", ids, (2,), "(B, T)")
                   .shape[0], attention.n_kv_heads, attention.d_head, attention.d_head)
    n_past = 0 if cache is None else cache.get_seq_length()
    check_sequence(config, ids, attention_mask, n_past=n_past)
    if n_past and attention_mask is None and config.pad_id is not None:
        shape = (ids.shape[0], n_past + ids.shape[1])  # which cached tokens were padding?
        raise ValueError(f"pad_id is set and the cache is not empty: pass attention_mask {shape}")
    if config.cross_attention or encoder_hidden_states is not None \
            or encoder_attention_mask is not None:
        weight = model.embeddings.token.weight  # x as the blocks will get it, (B, T, D)
        x = weight.new_zeros(()).expand(*ids.shape, config.d_model)
        check_block_inputs(model.blocks[0], x, encoder_hidden_states, encoder_attention_mask)


def check_seq2seq_inputs(config: EncoderDecoderConfig, src: object, tgt: object,
                         src_attention_mask: object, tgt_attention_mask: object,
                         output_attentions: object) -> None:
    """What :meth:`EncoderDecoder.forward` takes besides the targets, named as the learner
    wrote them (src, max_src_len, ...)."""
    if not checks_wanted():
        return
    check_bools(output_attentions=output_attentions)
    check_sequence(config.encoder, src, src_attention_mask, "src", "max_src_len")
    check_sequence(config.decoder, tgt, tgt_attention_mask, "tgt", "max_tgt_len")
    require_size("tgt", tgt, 0, src.shape[0], "src's batch size")


def check_targets(logits: torch.Tensor, targets: object) -> None:
    """targets: integer token ids of shape logits.shape[:-1]."""
    if not checks_wanted():
        return
    require_integer_tensor("targets", require_tensor("targets", targets), "token ids")
    if targets.shape != logits.shape[:-1]:
        expected = tuple(logits.shape[:-1])  # the logits' (B, T)
        raise ValueError(f"targets has shape {shape_of(targets)}; expected {expected}")
    if values_checked(targets) and bool((targets == IGNORE_INDEX).all()):
        raise ValueError(f"every target is {IGNORE_INDEX} (not scored): there is nothing to "
                         "predict and the loss would be NaN; with mask_tokens on a short batch, "
                         "draw the masks again or use a longer batch")
