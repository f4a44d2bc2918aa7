"""The debugging gym of chapter 11: five small Transformer pieces, each with ONE planted mistake.

Every buggy module runs, has the right output shape and the parameter names of the course_lib
module it should equal (``qkv_proj``/``out_proj`` as in :class:`MultiHeadAttention`), so a
fixed version can hold the reference's ``state_dict`` and be compared with it; the buggy
sampler has the signature of a correct one. A case and its class are named after the symptom a
learner meets, never after the mistake, so the names give nothing away. Each case also names
the instrument that finds its mistake:

===========  ========================================  ========================================
case         the planted mistake                       the instrument that finds it
===========  ========================================  ========================================
too_fast     softmax over the queries (dim=-2)         ``future_leaks`` (chapter 05)
disagrees    scores divided by sqrt(D), not sqrt(Dh)   ``first_divergence`` (chapter 08), and
                                                       the same layer with one head
rope         RoPE applied to the values as well        the repeated-token test (chapter 03)
temperature  probabilities, not logits, divided by T   :func:`sample_frequencies` (chapter 09)
cache        RoPE positions restart at 0 with a cache  cached = uncached (chapter 09)
===========  ========================================  ========================================

Shape legend: B batch, T query length, S key length, D d_model, H heads, Dh head dim, V
vocabulary.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .._validate import (
    require_callable,
    require_choice,
    require_finite,
    require_floating,
    require_int,
    require_ndim,
    require_positive_int,
    require_positive_number,
    require_probability,
)
from ..attention import MultiHeadAttention, causal_mask, check_heads
from ..cache import LayerKVCache
from ..positions import apply_rope

__all__ = ["CASES", "GymCase", "permutation_gap", "repeated_token_spread", "run_cached",
           "sample_frequencies", "sample_with_temperature", "show", "suspect"]


class GymAttention(nn.Module):
    """The parameters every attention case shares, named as in MultiHeadAttention: ``qkv_proj``
    (rows [W_q; W_k; W_v]) and ``out_proj`` (W_o); ``dropout`` on the weights in training."""

    def __init__(self, d_model: int, n_heads: int, *, dropout: float = 0.0) -> None:
        check_station(self, d_model, n_heads, dropout)  # the sizes MultiHeadAttention takes
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)  # rows [W_q; W_k; W_v]
        self.out_proj = nn.Linear(d_model, d_model)  # W_o

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of every head: (B, T, D) -> three (B, H, T, Dh)."""
        batch, seq_len, d_model = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # (B, T, D) each
        return tuple(t.reshape(batch, seq_len, self.n_heads, self.d_head).transpose(1, 2)
                     for t in (q, k, v))  # (B, H, T, Dh) each


# ----------------------------------------------------------------------------- the suspects


class TooFastAttention(GymAttention):
    """Causal self-attention, (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        allowed = causal_mask(x.shape[1])  # (T, T): key s <= query t
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-2)  # (B, H, T, T)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class DisagreeingAttention(GymAttention):
    """Self-attention without a mask (an encoder's), (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class RotaryAttention(GymAttention):
    """Self-attention with rotary positions and no mask (an encoder's), (B, T, D) -> (B, T, D).
    One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        positions = torch.arange(x.shape[1])  # (T,)
        q, k, v = (apply_rope(t, positions) for t in (q, k, v))  # rotate by position
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class CacheAttention(GymAttention):
    """Causal self-attention with RoPE and a KV cache, (B, T, D) -> (B, T, D): x holds the T
    positions after the S - T that ``past_key_value`` (a LayerKVCache) holds. One line is
    wrong."""

    def forward(self, x, past_key_value=None):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        seq_len = x.shape[1]
        n_past = 0 if past_key_value is None else past_key_value.get_seq_length()
        positions = torch.arange(seq_len)  # (T,)
        q, k = apply_rope(q, positions), apply_rope(k, positions)  # rotate by position
        if past_key_value is not None:
            k, v = past_key_value.update(k, v)  # (B, H, S, Dh): the cached positions first
        allowed = causal_mask(seq_len, n_past + seq_len)  # (T, S), lower-right aligned
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, S)
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


def sample_with_temperature(logits, temperature, generator=None):
    """One token per row of (B, V) logits, drawn at the given temperature (> 0): (B,) ids.
    One line is wrong."""
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    probs = probs / temperature  # sharper below 1, flatter above 1
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)




# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class GymCase:
    """One station of the gym.

    Attributes:
        name: the case's short name (a key of :data:`CASES`).
        buggy: the module class with the planted mistake.
        reference: builds the course_lib module it must equal from (d_model, n_heads).
        causal: whether the module must be causal (masked self-attention).
        instrument: the instrument that finds the mistake, in words.
    """

    name: str
    buggy: type[nn.Module]
    reference: Callable[[int, int], nn.Module]
    causal: bool
    instrument: str


CASES = {case.name: case for case in (
    GymCase("too_fast", TooFastAttention, lambda d, h: MultiHeadAttention(d, h), True,
            "future_leaks (chapter 05): which outputs depend on later inputs"),
    GymCase("disagrees", DisagreeingAttention, lambda d, h: MultiHeadAttention(d, h), False,
            "first_divergence (chapter 08) against course_lib's MultiHeadAttention, and the "
            "same comparison with one head"),
    GymCase("rope", RotaryAttention, lambda d, h: MultiHeadAttention(d, h, rope=True), False,
            "the repeated-token test (chapter 03): one token at every position "
            "must give one output at every position when the positions only steer the weights"),
    GymCase("cache", CacheAttention, lambda d, h: MultiHeadAttention(d, h, rope=True), True,
            "cached = uncached (chapter 09): the sequence fed in pieces through a KV cache "
            "must give what one pass over the whole sequence gives"),
)}
SAMPLER_INSTRUMENT = ("sample_frequencies: the share of each token among many draws, compared "
                      "with course_lib's next_token_probs at two temperatures (chapter 09)")


def show(name: str) -> None:
    """Print the source of case ``name``'s buggy module, or of the buggy sampler for
    ``"temperature"`` (the code to debug)."""
    require_choice("name", name, [*sorted(CASES), "temperature"])
    if name == "temperature":
        print(inspect.getsource(sample_with_temperature))
        return
    print(inspect.getsource(CASES[name].buggy))


def suspect(name: str, d_model: int, n_heads: int, *, seed: int = 0
            ) -> tuple[nn.Module, nn.Module]:
    """``(suspect, reference)`` for station ``name``: the buggy module and the course_lib module
    it should equal, built with (d_model, n_heads), holding the same seeded weights, in eval
    mode."""
    require_choice("name", name, sorted(CASES))
    check_heads(d_model, n_heads)
    seed = require_int("seed", seed)
    case = CASES[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        reference = case.reference(d_model, n_heads)
    buggy = case.buggy(d_model, n_heads)
    buggy.load_state_dict(reference.state_dict())
    return buggy.eval(), reference.eval()


def repeated_token_spread(fn: Callable[[torch.Tensor], torch.Tensor], d_model: int, *,
                          seq_len: int = 6, seed: int = 0) -> float:
    """The repeated-token test: feed one random token vector at every one of ``seq_len``
    positions, (1, T, D), and return how far apart the T outputs are (the largest difference
    from position 0's). Every row of attention weights sums to 1, so when the values do not
    depend on position the outputs are all equal (rounding noise, about 1e-7), whatever the
    positions do to the weights."""
    require_callable("fn", fn, "a function of x (1, T, D) -> (1, T, D)",
                     "e.g. lambda h: attention(h)[0]", n_args=1)
    require_positive_int("d_model", d_model)
    if require_int("seq_len", seq_len) < 2:
        raise ValueError(f"seq_len must be 2 or more to compare positions, got {seq_len}")
    gen = torch.Generator().manual_seed(require_int("seed", seed))
    x = torch.randn(1, 1, d_model, generator=gen).expand(1, seq_len, d_model)  # (1, T, D)
    with torch.no_grad():
        out = fn(x.clone())
    if not (isinstance(out, torch.Tensor) and out.dim() == 3 and out.shape[:2] == (1, seq_len)):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"fn must return a (1, {seq_len}, D) tensor, got {got}")
    return float((out - out[:, :1]).abs().max())


def sample_frequencies(sample: Callable, logits: torch.Tensor, temperature: float, *,
                       n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """The share of each token among ``n`` draws of ``sample(logits, temperature, generator)``
    from one row of logits (V,): returns (V,) frequencies, to compare with
    ``next_token_probs(logits[None], temperature=...)``. 20,000 draws put each share within
    about 0.01 of its probability."""
    require_callable("sample", sample, "a sampler called as sample(logits, temperature, "
                     "generator)", n_args=3)
    require_floating("logits", require_ndim("logits", logits, (1,), "(V,): one row of logits"))
    if logits.numel() == 0:
        raise ValueError("logits has shape (0,): there is no token to draw")
    require_positive_number("temperature", temperature)
    n = require_positive_int("n", n)
    gen = torch.Generator().manual_seed(require_int("seed", seed))
    with torch.no_grad():
        ids = sample(logits.expand(n, -1), temperature, gen)  # (n,)
    if not isinstance(ids, torch.Tensor) or ids.shape != (n,):
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"sample must return (B,) token ids for (B, V) logits, got {got}")
    return torch.bincount(ids.long(), minlength=logits.shape[-1]).float() / n  # (V,)


def run_cached(layer: nn.Module, x: torch.Tensor, split: int, **kwargs: object) -> torch.Tensor:
    """Feed x (B, T, D) through ``layer(piece, past_key_value=cache, **kwargs)`` in pieces,
    with one LayerKVCache: the first ``split`` positions at once, then one position at a time
    (for course_lib's MultiHeadAttention pass ``is_causal=True``). Returns (B, T, D)."""
    require_callable("layer", layer, "an attention layer called as layer(x, "
                     "past_key_value=cache)", "e.g. MultiHeadAttention(16, 4)")
    require_ndim("x", x, (3,), "(B, T, D)")
    if not 1 <= require_int("split", split) <= x.shape[1]:
        raise ValueError(f"split must be 1..T = 1..{x.shape[1]} (the positions fed at once before "
                         f"the one-at-a-time steps), got {split}")
    cache = LayerKVCache()
    pieces = [x[:, :split]] + [x[:, t:t + 1] for t in range(split, x.shape[1])]
    outs = []
    for piece in pieces:
        out = layer(piece, past_key_value=cache, **kwargs)
        outs.append(out[0] if isinstance(out, tuple) else out)
    return torch.cat(outs, dim=1)  # (B, T, D)


def permutation_gap(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *,
                    seed: int = 0) -> float:
    """How far ``fn`` is from permutation equivariance on x (B, T, D): the largest
    |fn(x[:, perm]) - fn(x)[:, perm]| for a random permutation of the T positions. A layer
    with no positions and no mask gives rounding noise (about 1e-7); a layer that mixes up
    positions gives a difference of the size of its outputs."""
    require_callable("fn", fn, "a function of x (B, T, D) -> (B, T, ...)",
                     "e.g. lambda h: attention(h)[0]", n_args=1)
    require_floating("x", require_ndim("x", x, (3,), "(B, T, D): add a batch dimension, x[None]"))
    require_finite("x", x, "a NaN would hide any difference")
    if x.shape[1] < 2:
        raise ValueError(f"x has T = {x.shape[1]} position: a permutation needs two or more")
    gen = torch.Generator().manual_seed(require_int("seed", seed))
    perm = torch.randperm(x.shape[1], generator=gen)  # (T,)
    if bool((perm == torch.arange(x.shape[1])).all()):  # the identity tests nothing
        perm = perm.roll(1)
    with torch.no_grad():
        out, moved = fn(x), fn(x[:, perm])
    if not (isinstance(out, torch.Tensor) and out.shape == moved.shape
            and out.dim() >= 2 and out.shape[:2] == x.shape[:2]):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"fn must return a (B, T, ...) tensor with x's B and T "
                         f"{tuple(x.shape[:2])}, got {got}")
    return float((moved - out[:, perm]).abs().max())


def check_station(station: GymAttention, d_model: object, n_heads: object,
                  dropout: object) -> None:
    """A station's sizes as MultiHeadAttention checks them; rotary stations need an even Dh."""
    check_heads(d_model, n_heads)
    require_probability("dropout", dropout)
    if isinstance(station, (RotaryAttention, CacheAttention)) and (d_model // n_heads) % 2:
        raise ValueError(f"d_model / n_heads = {d_model} / {n_heads} = {d_model // n_heads} "
                         f"is the head dim Dh, which must be even for rotary positions "
                         f"(RoPE turns pairs of dimensions): e.g. d_model={2 * d_model}")
