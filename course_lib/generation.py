"""Autoregressive generation: pick the next token from the logits, append it, repeat.

Shape legend: B batch, T prompt (or new-token) length, S source length (or cached length),
V vocabulary, H heads, Dh head dim.

Picking the next token:
    * greedy (``temperature=0``): always the most likely token. Treating temperature 0 as
      greedy is a course_lib convention (the limit tau -> 0); Hugging Face's ``generate``
      requires temperature > 0 and selects greedy decoding with ``do_sample=False``;
    * temperature: divide the logits by it before the softmax (< 1 sharpens, > 1 flattens);
    * top-k: keep only the k most likely tokens;
    * top-p (nucleus): keep the smallest set of most likely tokens whose probability adds up
      to at least p.
The filters apply in that order (temperature, then top-k, then top-p, as in Hugging Face's
``generate``); the kept tokens' probabilities are renormalised and one token is drawn.

Generating with or without a key/value cache gives the same tokens. Without one, every step
runs the model on the whole context again; with one (``use_cache=True``), each self-attention
layer keeps the keys and values of the positions it has already processed (a
:class:`~course_lib.cache.KVCache`), so a step only computes the new token's. The model sees
at most its last ``max_len`` tokens: once the sequence is longer, every position of the window
shifts at every step, so the cached keys no longer apply and each step runs on the whole window
again.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from ._validate import (
    WrongTypeError,
    check_token_ids,
    inputs_checked,
    require_bool,
    require_generator,
    require_int,
    require_ndim,
    require_positive_int,
)
from .cache import KVCache
from .configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig

# --------------------------------------------------------------------------------------------
# Choosing the next token


def _check_sampling(temperature: object, top_k: object, top_p: object = None) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise WrongTypeError(
            f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}"
        )
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), "
                         f"got {temperature}")
    if top_k is not None:
        require_positive_int("top_k", top_k)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise WrongTypeError(f"top_p must be a number in (0, 1] or None, got {top_p!r}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(
                f"top_p must be in (0, 1] (the probability mass to keep; 1 keeps every token), "
                f"got {top_p}"
            )


def _filtered_logits(logits: torch.Tensor, temperature: float, top_k: int | None,
                     top_p: float | None) -> torch.Tensor:
    """Tempered logits with the tokens outside top-k and top-p set to -inf (temperature > 0)."""
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1), the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(logits, dim=-1)  # (B, V)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        # mass of the tokens ranked before each one; once it reaches p the set is complete,
        # so the token that crosses p is kept and every later one is dropped
        cumulative = torch.cumsum(sorted_probs, dim=-1)  # (B, V)
        before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        drop_sorted = before >= top_p  # (B, V); the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (B, V), vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token_probs(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The distribution :func:`sample_next_token` draws from.

    Args:
        logits: (B, V) unnormalised scores.
        temperature: > 0 divides the logits; 0 means greedy (all mass on the argmax).
        top_k: keep only the k highest logits.
        top_p: keep the smallest set of most likely tokens whose probability (after the
            temperature and top-k) adds up to at least top_p, in (0, 1].

    Returns:
        (B, V) float32 probabilities: zero outside the kept tokens, each row summing to 1.
    """
    require_ndim("logits", logits, (2,), "(B, V)")
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, greedy, 1.0)
    return torch.softmax(_filtered_logits(logits, temperature, top_k, top_p), dim=-1)  # (B, V)


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row of (B, V) logits.

    Args:
        logits: (B, V) unnormalised scores.
        temperature: > 0 divides the logits (lower is more conservative); 0 means greedy.
        top_k: keep only the k highest logits before sampling.
        top_p: nucleus sampling: keep the smallest set of most likely tokens whose
            probability adds up to at least top_p, in (0, 1].
        generator: a torch.Generator for repeatable sampling.

    Returns:
        (B,) token ids.
    """
    require_ndim("logits", logits, (2,), "(B, V)")
    _check_sampling(temperature, top_k, top_p)
    require_generator("generator", generator)
    return _sample(logits, temperature, top_k, generator, top_p)


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None, top_p: float | None = None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    probs = torch.softmax(_filtered_logits(logits, temperature, top_k, top_p), dim=-1)  # (B, V)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


# --------------------------------------------------------------------------------------------
# Generation loops


def _check_decoder_lm(model: object, use_cache: bool) -> None:
    """What :func:`generate` calls: a decoder LM, i.e. a module whose config is a DecoderConfig
    without cross-attention, taking past_key_values= when ``use_cache``."""
    config, name = getattr(model, "config", None), type(model).__name__
    if isinstance(config, EncoderDecoderConfig):
        raise WrongTypeError(
            f"model must be a decoder language model (a DecoderLM), got {name}: for an "
            "encoder-decoder use generate_seq2seq(model, src, bos_id=..., max_new_tokens=...), "
            "i.e. EncoderDecoder.generate"
        )
    if not isinstance(config, DecoderConfig):
        raise WrongTypeError(
            f"model must be a decoder language model: a DecoderLM, or a module whose .config is "
            f"a DecoderConfig and whose output has .logits; got {name}"
            + (": an encoder has no next-token head" if isinstance(config, EncoderConfig) else "")
        )
    if config.cross_attention:
        raise ValueError(
            "model is a decoder with cross-attention: it needs an encoder's output; use "
            "EncoderDecoder.generate (generate_seq2seq) instead"
        )
    if use_cache:
        takes = inspect.signature(model.forward).parameters
        if "past_key_values" not in takes and all(p.kind is not p.VAR_KEYWORD
                                                  for p in takes.values()):
            raise ValueError(
                f"use_cache=True needs a model whose forward takes past_key_values= and "
                f"attention_mask= (a DecoderLM); {name}.forward does not: generate with "
                "use_cache=False"
            )


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = False,
) -> torch.Tensor:
    """Extend a prompt by sampling one token at a time from a decoder language model.

    Args:
        model: a :class:`~course_lib.models.DecoderLM` (or a module of one's own whose
            ``.config`` is a DecoderConfig and whose output has ``.logits``).
        ids: (B, T) or (T,) prompt token ids, at least one token.
        max_new_tokens: how many tokens to add.
        temperature: divides the logits; 0 means greedy (always the most likely token).
        top_k: sample only among the k most likely tokens.
        top_p: sample only among the smallest set of most likely tokens with probability
            mass >= top_p (nucleus sampling).
        generator: a torch.Generator for repeatable sampling.
        use_cache: keep every layer's keys and values (:class:`KVCache`), so each step
            computes only the new token's; the tokens are the same as without it.

    Returns:
        (B, T + max_new_tokens) token ids (or 1-D for a 1-D prompt).
    """
    require_bool("use_cache", use_cache)
    _check_decoder_lm(model, use_cache)
    require_positive_int("max_new_tokens", max_new_tokens)
    _check_sampling(temperature, top_k, top_p)
    require_generator("generator", generator)
    unbatched = isinstance(ids, torch.Tensor) and ids.dim() == 1
    if unbatched:
        ids = ids[None]
    check_token_ids("ids", ids, model.config.vocab_size)  # the prompt may exceed max_len
    was_training = model.training
    model.eval()
    try:
        cache = KVCache() if use_cache else None
        for _ in range(max_new_tokens):
            logits = _next_logits(model, ids, cache)  # (B, V)
            next_id = _sample(logits, temperature, top_k, generator, top_p)  # (B,)
            ids = torch.cat([ids, next_id[:, None]], dim=1)  # (B, T + 1)
    finally:
        model.train(was_training)
    return ids[0] if unbatched else ids


def _next_logits(model: nn.Module, ids: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """The logits of the token after ``ids`` (B, L): from the cache while the sequence fits in
    the context, else from the last max_len tokens."""
    max_len, pad_id = model.config.max_len, model.config.pad_id
    if cache is None or ids.shape[1] > max_len:
        return model(ids[:, -max_len:]).logits[:, -1, :]  # (B, V)
    new = ids[:, cache.get_seq_length():]  # (B, T): the whole prompt first, then one token
    mask = None if pad_id is None else ids != pad_id  # (B, L): covers cached and new tokens
    return model(new, attention_mask=mask, past_key_values=cache).logits[:, -1, :]  # (B, V)


def _check_target_ids(tgt_vocab: int, **ids: int | None) -> None:
    for name, value in ids.items():
        if value is not None and require_int(name, value, minimum=0) >= tgt_vocab:
            raise ValueError(f"{name} must be a target token id in 0..{tgt_vocab - 1}, "
                             f"got {value!r}")


@torch.no_grad()
def generate_seq2seq(
    model: nn.Module,
    src: torch.Tensor,
    *,
    bos_id: int,
    max_new_tokens: int,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    src_attention_mask: torch.Tensor | None = None,
    use_cache: bool = False,
) -> torch.Tensor:
    """Decode a target for each source with an encoder-decoder, greedily by default.

    The source is encoded once; the decoder starts from ``bos_id`` and adds one token per
    step, cross-attending to the encoder's output (with ``use_cache``, its self-attention
    keys and values are cached; the tokens are the same).

    Args:
        model: a :class:`~course_lib.models.EncoderDecoder`.
        src: (B, S) source token ids.
        bos_id: the start token the decoder begins from.
        max_new_tokens: how many tokens to add at most. With learned target positions the
            decoder's inputs can be at most ``max_len`` long, so n <= ``max_len`` (the
            decoder's ``max_len``, i.e. ``max_tgt_len``): a model trained on ``tgt_in`` of
            length ``max_len`` can decode targets of that length, its final ``eos_id``
            included.
        eos_id: the end token; a sequence is finished once it has produced it.
        temperature: divides the logits; 0 (the default) means greedy. This is a course_lib
            convention: Hugging Face's ``generate`` needs temperature > 0 and chooses greedy
            decoding with ``do_sample=False``.
        top_k, top_p: as in :func:`generate`.
        generator: a torch.Generator for repeatable sampling.
        src_attention_mask: (B, S) True (or 1) at real source tokens, False (0) at padding.
        use_cache: cache the decoder's self-attention keys and values.

    Returns:
        (B, 1 + n) target ids starting with ``bos_id``, n <= min(max_new_tokens, max_len);
        generation stops early once every sequence has produced ``eos_id`` (later positions
        are filled with ``eos_id``).
    """
    if not isinstance(getattr(model, "config", None), EncoderDecoderConfig):
        raise WrongTypeError(
            f"model must be an EncoderDecoder, got {type(model).__name__}; for a decoder "
            "language model use generate(model, ids, max_new_tokens)")
    require_positive_int("max_new_tokens", max_new_tokens)
    _check_sampling(temperature, top_k, top_p)
    require_generator("generator", generator)
    require_bool("use_cache", use_cache)
    _check_target_ids(model.decoder.config.vocab_size, bos_id=bos_id, eos_id=eos_id)
    src_attention_mask = model.check_src(src, src_attention_mask)  # as booleans
    was_training = model.training
    model.eval()
    try:
        with inputs_checked():  # checked above
            encoded, src_padding = model.encode(src, src_attention_mask)
        memory = encoded.last_hidden_state  # (B, S, D)
        tgt = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        limit = max_new_tokens
        if model.decoder.config.positions == "learned":
            # the last step's decoder input is bos_id plus n - 1 tokens: n <= max_len fits the
            # position table, exactly as a teacher-forced tgt_in of length max_len does
            limit = min(limit, model.decoder.config.max_len)
        cache = KVCache() if use_cache else None
        for _ in range(limit):
            logits = _next_target_logits(model, tgt, memory, src_padding, cache)  # (B, V)
            next_id = _sample(logits, temperature, top_k, generator, top_p)  # (B,)
            if eos_id is not None:
                next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
                finished |= next_id == eos_id
            tgt = torch.cat([tgt, next_id[:, None]], dim=1)  # (B, 1 + n)
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return tgt


def _next_target_logits(model: nn.Module, tgt: torch.Tensor, memory: torch.Tensor,
                        src_padding: torch.Tensor | None, cache: KVCache | None) -> torch.Tensor:
    """The decoder's logits for the token after ``tgt`` (B, L), with or without a cache."""
    pad_id = model.decoder.config.pad_id
    mask = None if pad_id is None else tgt != pad_id  # (B, L): covers cached and new tokens
    new = tgt if cache is None else tgt[:, cache.get_seq_length():]  # (B, L) or (B, 1)
    with inputs_checked():  # generate_seq2seq checked the source; the loop builds tgt
        out = model.decoder(new, attention_mask=mask, encoder_hidden_states=memory,
                            encoder_attention_mask=src_padding, past_key_values=cache)
    return out.logits[:, -1, :]  # (B, V)
