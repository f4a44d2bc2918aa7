"""Autoregressive generation: pick the next token from the logits, append it, repeat.

Shape legend: B batch, T prompt length, S source length, V vocabulary.

The loops call the model's ``forward`` on the whole context at every step (no key/value cache),
which is the plainest form of generation: the model sees at most its last ``max_len`` tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._validate import check_token_ids, require_ndim, require_positive_int

if TYPE_CHECKING:
    from .models import DecoderLM, EncoderDecoder


def _check_sampling(temperature: object, top_k: object) -> None:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None:
        require_positive_int("top_k", top_k)


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
    _check_sampling(temperature, top_k)
    return _sample(logits, temperature, top_k, generator)


def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1), the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    if generator is not None and generator.device != probs.device:
        probs = probs.to(generator.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(
    model: DecoderLM,
    ids: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend a prompt by sampling one token at a time from a decoder language model.

    Args:
        model: a :class:`~course_lib.models.DecoderLM`.
        ids: (B, T) or (T,) prompt token ids, at least one token.
        max_new_tokens: how many tokens to add.
        temperature: divides the logits; 0 means greedy (always the most likely token).
        top_k: sample only among the k most likely tokens.
        generator: a torch.Generator for repeatable sampling.

    Returns:
        (B, T + max_new_tokens) token ids (or 1-D for a 1-D prompt).
    """
    require_positive_int("max_new_tokens", max_new_tokens)
    _check_sampling(temperature, top_k)
    unbatched = isinstance(ids, torch.Tensor) and ids.dim() == 1
    if unbatched:
        ids = ids[None]
    check_token_ids("ids", ids, model.config.vocab_size)  # the prompt may exceed max_len
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids[:, -model.config.max_len:]  # (B, <= max_len)
            logits = model(context).logits[:, -1, :]  # (B, V)
            next_id = _sample(logits, temperature, top_k, generator)  # (B,)
            ids = torch.cat([ids, next_id[:, None]], dim=1)  # (B, T + 1)
    finally:
        model.train(was_training)
    return ids[0] if unbatched else ids


@torch.no_grad()
def generate_seq2seq(
    model: EncoderDecoder,
    src: torch.Tensor,
    *,
    bos_id: int,
    max_new_tokens: int,
    eos_id: int | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    src_attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode a target for each source with an encoder-decoder, greedily by default.

    Returns:
        (B, 1 + n) target ids starting with ``bos_id``; generation stops early once every
        sequence has produced ``eos_id`` (later positions are filled with ``eos_id``).
    """
    tgt_vocab = model.decoder.config.vocab_size
    require_positive_int("max_new_tokens", max_new_tokens)
    _check_sampling(temperature, top_k)
    for name, value in (("bos_id", bos_id), ("eos_id", eos_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < tgt_vocab):
            raise ValueError(f"{name} must be a target token id in 0..{tgt_vocab - 1}, "
                             f"got {value!r}")
    model.check_src(src, src_attention_mask)
    was_training = model.training
    model.eval()
    try:
        encoded, src_padding = model.encode(src, src_attention_mask)
        memory = encoded.last_hidden_state  # (B, S, D)
        tgt = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        finished = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        limit = max_new_tokens
        if model.decoder.config.positions == "learned":  # the position table ends there
            limit = min(limit, model.decoder.config.max_len - 1)
        for _ in range(limit):
            logits = model.decoder._decode(tgt, None, None, memory, src_padding,
                                           False).logits[:, -1, :]  # (B, V)
            next_id = _sample(logits, temperature, top_k, generator)  # (B,)
            if eos_id is not None:
                next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
                finished |= next_id == eos_id
            tgt = torch.cat([tgt, next_id[:, None]], dim=1)  # (B, 1 + n)
            if eos_id is not None and bool(finished.all()):
                break
    finally:
        model.train(was_training)
    return tgt
