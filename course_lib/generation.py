"""Autoregressive generation: pick the next token from the logits, append it, repeat.

Shape legend: B batch, T prompt (or new-token) length, S source length, V vocabulary.

Picking the next token, in this order (as in Hugging Face's ``generate``):
    * temperature: divide the logits by it (< 1 sharpens, > 1 flattens); 0 means greedy,
      always the most likely token (a course_lib convention, the limit tau -> 0; Hugging Face
      chooses greedy decoding with ``do_sample=False`` instead);
    * top-k: keep only the k most likely tokens;
    * top-p (nucleus): keep the smallest set of most likely tokens whose probability adds up
      to at least p.
The kept tokens' probabilities are renormalised and one token is drawn.

With ``use_cache=True`` each self-attention layer keeps the keys and values of the positions
it has processed (a :class:`~course_lib.cache.KVCache`), so a step computes only the new
token's; the tokens are the same as without it. Once the sequence is longer than ``max_len``
the window slides, every position shifts, and each step runs on the whole window again.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ._validate import (
    check_bools,
    check_positive_ints,
    check_token_ids,
    checks_wanted,
    inputs_checked,
    require_generator,
    require_id,
    require_ndim,
    require_non_negative_number,
    require_positive_int,
    require_positive_number,
)
from .cache import KVCache
from .configs import DecoderConfig, EncoderDecoderConfig


def next_token_probs(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                     top_p: float | None = None) -> torch.Tensor:
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
    check_sampling(temperature, top_k, top_p, logits=logits)
    if temperature == 0:
        greedy = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, greedy, 1.0)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1), the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1,
                                         descending=True, stable=True)  # (B, V)
        # mass of the tokens ranked before each one; once it reaches p the set is complete,
        # so the token that crosses p is kept and every later one is dropped
        cumulative = torch.cumsum(sorted_probs, dim=-1)  # (B, V)
        before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
        drop_sorted = before >= top_p  # (B, V); the most likely token always stays
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (B, V), vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)  # (B, V)


def sample_next_token(logits: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of (B, V) logits.

    Args:
        logits: (B, V) unnormalised scores.
        temperature, top_k, top_p: as in :func:`next_token_probs` (temperature 0: greedy).
        generator: a torch.Generator for repeatable sampling.

    Returns:
        (B,) token ids.
    """
    check_sampling(temperature, top_k, top_p, generator, logits=logits)
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    probs = next_token_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


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
        temperature, top_k, top_p, generator: as in :func:`sample_next_token`.
        use_cache: keep every layer's keys and values (:class:`KVCache`), so each step
            computes only the new token's; the tokens are the same as without it.

    Returns:
        (B, T + max_new_tokens) token ids (or 1-D for a 1-D prompt).
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    check_generation(model, DecoderConfig, max_new_tokens, use_cache, **sampling)
    check_prompt(ids, model.config.vocab_size)  # the prompt may exceed max_len
    unbatched = ids.dim() == 1
    ids = ids[None] if unbatched else ids  # (B, T)
    max_len, pad_id = model.config.max_len, model.config.pad_id
    cache = KVCache() if use_cache else None
    was_training = model.training
    model.eval()
    try:
        with inputs_checked():  # checked above; the loop builds the model's inputs itself
            for _ in range(max_new_tokens):
                if cache is None or ids.shape[1] > max_len:  # the last max_len tokens
                    logits = model(ids[:, -max_len:]).logits[:, -1, :]  # (B, V)
                else:  # the tokens not yet cached: the whole prompt first, then one token
                    mask = None if pad_id is None else ids != pad_id  # (B, L), cached and new
                    out = model(ids[:, cache.get_seq_length():], attention_mask=mask,
                                past_key_values=cache)
                    logits = out.logits[:, -1, :]  # (B, V)
                next_id = sample_next_token(logits, **sampling)  # (B,)
                ids = torch.cat([ids, next_id[:, None]], dim=1)  # (B, T + 1)
    finally:
        model.train(was_training)
    return ids[0] if unbatched else ids


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
    step, cross-attending to the encoder's output.

    Args:
        model: a :class:`~course_lib.models.EncoderDecoder`.
        src: (B, S) source token ids.
        bos_id: the start token the decoder begins from.
        max_new_tokens: how many tokens to add at most; with learned target positions at most
            the decoder's ``max_len`` (its longest input, as in teacher forcing).
        eos_id: the end token; a sequence is finished once it has produced it.
        temperature, top_k, top_p, generator: as in :func:`sample_next_token` (temperature 0,
            the default here, is greedy).
        src_attention_mask: (B, S) True (or 1) at real source tokens, False (0) at padding.
        use_cache: cache the decoder's self-attention keys and values.

    Returns:
        (B, 1 + n) target ids starting with ``bos_id``, n <= min(max_new_tokens, max_len);
        generation stops once every sequence has produced ``eos_id`` (later positions are
        filled with ``eos_id``).
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    check_generation(model, EncoderDecoderConfig, max_new_tokens, use_cache,
                     special_ids={"bos_id": bos_id, "eos_id": eos_id}, **sampling)
    config = model.decoder.config
    limit = min(max_new_tokens, config.max_len) if config.positions == "learned" else max_new_tokens
    was_training = model.training
    model.eval()
    try:
        encoded, src_padding = model.encode(src, src_attention_mask)  # checks src
        memory = encoded.last_hidden_state  # (B, S, D)
        tgt = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)  # (B,)
        cache = KVCache() if use_cache else None
        with inputs_checked():  # checked above; the loop builds the decoder's inputs itself
            for _ in range(limit):
                new = tgt if cache is None else tgt[:, cache.get_seq_length():]  # (B, L) or (B, 1)
                mask = None if config.pad_id is None else tgt != config.pad_id  # (B, L)
                out = model.decoder(new, attention_mask=mask, encoder_hidden_states=memory,
                                    encoder_attention_mask=src_padding, past_key_values=cache)
                next_id = sample_next_token(out.logits[:, -1, :], **sampling)  # (B,)
                if eos_id is not None:
                    next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
                    finished |= next_id == eos_id
                tgt = torch.cat([tgt, next_id[:, None]], dim=1)  # (B, 1 + n)
                if eos_id is not None and bool(finished.all()):
                    break
    finally:
        model.train(was_training)
    return tgt


# --- argument checks


def check_sampling(temperature: object, top_k: object, top_p: object, generator: object = None,
                   *, logits: object = None) -> None:
    """temperature >= 0 (0: greedy), top_k >= 1 or None, top_p in (0, 1] or None, generator a
    torch.Generator or None, logits (if given) (B, V)."""
    if not checks_wanted():
        return
    require_non_negative_number("temperature", temperature)
    if top_k is not None:
        require_positive_int("top_k", top_k)
    if top_p is not None and require_positive_number("top_p", top_p) > 1:
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p}")
    require_generator("generator", generator)
    if logits is not None:
        require_ndim("logits", logits, (2,), "(B, V)")


def check_prompt(ids: object, vocab_size: int) -> None:
    """ids: token ids (B, T), or (T,) for one prompt."""
    one = isinstance(ids, torch.Tensor) and ids.dim() == 1
    check_token_ids("ids", ids[None] if one else ids, vocab_size)


def check_generation(model: object, config_type: type, max_new_tokens: object, use_cache: object,
                     special_ids: Mapping[str, object] | None = None, **sampling: object) -> None:
    """model's config is a ``config_type`` (a decoder without cross-attention for generate),
    then the loop's options and ``special_ids`` (name -> id or None) of its vocabulary."""
    config, name = getattr(model, "config", None), type(model).__name__
    if not isinstance(config, config_type):
        want, other = (("a DecoderLM", "generate_seq2seq") if config_type is DecoderConfig
                       else ("an EncoderDecoder", "generate"))
        raise TypeError(f"model must be {want} (its .config a {config_type.__name__}), got "
                        f"{name}; for other models use {other}")
    if getattr(config, "cross_attention", False):
        raise ValueError("model needs an encoder: use EncoderDecoder.generate (generate_seq2seq)")
    check_positive_ints(max_new_tokens=max_new_tokens)
    check_bools(use_cache=use_cache)
    check_sampling(**sampling)
    vocab_size = (config.decoder if isinstance(config, EncoderDecoderConfig) else config).vocab_size
    for name, value in (special_ids or {}).items():
        if value is not None:
            require_id(name, value, vocab_size)
