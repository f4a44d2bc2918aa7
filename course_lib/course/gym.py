"""The debugging gym of chapter 11: six small Transformer pieces, each with ONE planted mistake.

Every buggy module runs, has the right output shape and the parameter names of the course_lib
module it should equal (``qkv_proj``/``out_proj`` as in :class:`MultiHeadAttention`; the names
of :class:`DecoderBlock`), so a fixed version can hold the reference's ``state_dict`` and be
compared with it. Each case also names the instrument that finds its mistake:

=========  ==========================================  ==========================================
case       the planted mistake                         the instrument that finds it
=========  ==========================================  ==========================================
mask       causal mask off by one                      ``future_leaks`` (chapter 05)
scale      scores divided by sqrt(D), not sqrt(Dh)     ``first_divergence`` (chapter 08), and
                                                       the same layer with one head
merge      heads merged by a reshape alone             permutation equivariance (chapter 02)
dropout    dropout left on in eval mode                ``who_sees_whom``'s repeat check
cache      RoPE positions restart at 0 with a cache    cached = uncached (chapter 09)
prenorm    post-norm where pre-norm is meant           ``first_divergence`` (chapter 08)
=========  ==========================================  ==========================================

Shape legend: B batch, T query length, S key length, D d_model, H heads, Dh head dim.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import require_finite, require_floating, require_int, require_ndim
from ..attention import MultiHeadAttention, causal_mask
from ..blocks import DecoderBlock
from ..cache import LayerKVCache
from ..layers import FeedForward
from ..positions import apply_rope

__all__ = ["CASES", "GymCase", "permutation_gap", "run_cached", "show"]


class GymAttention(nn.Module):
    """The parameters every attention case shares, named as in MultiHeadAttention: ``qkv_proj``
    (rows [W_q; W_k; W_v]) and ``out_proj`` (W_o); ``dropout`` on the weights in training."""

    def __init__(self, d_model: int, n_heads: int, *, dropout: float = 0.0) -> None:
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


# ----------------------------------------------------------------------------- the six suspects


class MaskAttention(GymAttention):
    """Causal self-attention, (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        seq_len = x.shape[1]
        allowed = torch.ones(seq_len, seq_len, dtype=torch.bool).tril(diagonal=1)  # (T, T)
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        scores = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class ScaleAttention(GymAttention):
    """Self-attention without a mask (an encoder's), (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(x.shape[-1])  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        out = (weights @ v).transpose(1, 2).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class MergeAttention(GymAttention):
    """Self-attention without a mask (an encoder's), (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        out = (weights @ v).reshape(x.shape)  # (B, T, D)
        return self.out_proj(out)


class DropoutAttention(GymAttention):
    """Self-attention without a mask, with dropout on the weights while training,
    (B, T, D) -> (B, T, D). One line is wrong."""

    def forward(self, x):
        q, k, v = self.heads(x)  # (B, H, T, Dh) each
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_head)  # (B, H, T, T)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, T)
        weights = F.dropout(weights, p=self.dropout, training=True)
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


class PreNormBlock(nn.Module):
    """A pre-norm decoder block, (B, T, D) -> (B, T, D), with the submodules of course_lib's
    DecoderBlock: causal ``self_attn``, ``attn_norm``, ``ff`` and ``ff_norm``. One line is
    wrong."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(d_model, n_heads)
        self.attn_norm = nn.LayerNorm(d_model)
        self.ff = FeedForward(d_model)
        self.ff_norm = nn.LayerNorm(d_model)

    def forward(self, x):
        x = self.attn_norm(x + self.self_attn(x, is_causal=True)[0])
        x = x + self.ff(self.ff_norm(x))
        return x


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
    GymCase("mask", MaskAttention, lambda d, h: MultiHeadAttention(d, h), True,
            "future_leaks (chapter 05): which outputs depend on later inputs"),
    GymCase("scale", ScaleAttention, lambda d, h: MultiHeadAttention(d, h), False,
            "first_divergence (chapter 08) against course_lib's MultiHeadAttention, and the "
            "same comparison with one head"),
    GymCase("merge", MergeAttention, lambda d, h: MultiHeadAttention(d, h), False,
            "the permutation-equivariance test (chapter 02): permuting the input positions "
            "must permute the outputs the same way"),
    GymCase("dropout", DropoutAttention,
            lambda d, h: MultiHeadAttention(d, h, dropout=0.1), False,
            "who_sees_whom (chapter 05), which runs the layer twice on the same input and "
            "refuses a layer whose two answers differ"),
    GymCase("cache", CacheAttention, lambda d, h: MultiHeadAttention(d, h, rope=True), True,
            "cached = uncached (chapter 09): the sequence fed in pieces through a KV cache "
            "must give what one pass over the whole sequence gives"),
    GymCase("prenorm", PreNormBlock, lambda d, h: DecoderBlock(d, h), True,
            "first_divergence (chapter 08) against course_lib's DecoderBlock: the first "
            "submodule whose output differs, and why"),
)}


def show(name: str) -> None:
    """Print the source of case ``name``'s buggy module (the code to debug)."""
    if name not in CASES:
        raise ValueError(f"name must be one of {sorted(CASES)}, got {name!r}")
    print(inspect.getsource(CASES[name].buggy))


def run_cached(layer: nn.Module, x: torch.Tensor, split: int, **kwargs: object) -> torch.Tensor:
    """Feed x (B, T, D) through ``layer(piece, past_key_value=cache, **kwargs)`` in pieces,
    with one LayerKVCache: the first ``split`` positions at once, then one position at a time
    (for course_lib's MultiHeadAttention pass ``is_causal=True``). Returns (B, T, D)."""
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
