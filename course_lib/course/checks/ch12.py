"""Checks for chapter 12, today's decoders: the gated feed-forward networks (SwiGLU, GeGLU, GLU,
bilinear) from one fused matrix, a whole Llama-style block assembled from its parts, how many
sequences of a published model fit on one GPU (predicted, then the cache formula measured),
and a rotary embedding with a planted bug to find.

The references are course_lib's :class:`~course_lib.layers.SwiGLU`,
:class:`~course_lib.blocks.DecoderBlock` (``norm="rms"``, ``ffn="swiglu"``, ``rope=True``,
``n_kv_heads``, no biases), :class:`~course_lib.cache.KVCache` and
:func:`~course_lib.positions.apply_rope`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from course_lib.blocks import DecoderBlock
from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig
from course_lib.layers import SwiGLU
from course_lib.models import DecoderLM
from course_lib.positions import apply_rope

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    prediction_dict,
    rand,
    require_count,
    run_cases,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Exercise 12.1: glu_ffn(x, w_gate_up, w_down, activation), from one fused matrix

GATES = {"silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "none": lambda z: z}
GLU_NAMES = {"silu": "SwiGLU", "gelu": "GeGLU", "sigmoid": "GLU", "none": "the bilinear layer"}


def reference_glu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  activation: str) -> torch.Tensor:
    """W_down (act(W_gate x) * W_up x), W_gate the first F rows of ``w_gate_up`` (2F, D) and
    W_up the last F; for "silu", course_lib's SwiGLU holding these weights."""
    w_gate, w_up = w_gate_up.chunk(2, dim=0)  # (F, D) each
    if activation == "silu":
        with torch.random.fork_rng(devices=[]):  # its random init is overwritten
            swiglu = SwiGLU(w_gate.shape[1], w_gate.shape[0])
        with torch.no_grad():
            for linear, weight in ((swiglu.gate_proj, w_gate), (swiglu.up_proj, w_up),
                                   (swiglu.down_proj, w_down)):
                linear.weight.copy_(weight)
            return swiglu(x)  # (..., D)
    return (GATES[activation](x @ w_gate.T) * (x @ w_up.T)) @ w_down.T  # (..., D)


def _glu_with(*, act: str | None = None, split: str = "halves", swap: bool = False,
              down: bool = True, up: bool = True) -> Callable[..., torch.Tensor]:
    """A plausible wrong GLU: another gate activation (``act``: always that one), rows split
    another way, the halves swapped, or a part missing."""
    def wrong(x, w_gate_up, w_down, activation):
        if split == "interleaved":
            w_gate, w_up = w_gate_up[0::2], w_gate_up[1::2]
        else:
            w_gate, w_up = w_gate_up.chunk(2, dim=0)
        if swap:
            w_gate, w_up = w_up, w_gate
        gate = _ACTS[act or activation](x @ w_gate.T)  # (..., F)
        hidden = gate * (x @ w_up.T) if up else gate
        return hidden @ w_down.T if down else hidden
    return wrong


_ACTS = {**GATES, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}

GLU_MISTAKES = [
    Misconception(_glu_with(swap=True),
                  "Your output puts the activation on the second half of w_gate_up and "
                  "multiplies by the first: the first F rows are W_gate (the gate, through the "
                  "activation), the last F are W_up"),
    Misconception(_glu_with(split="interleaved"),
                  "Your output takes W_gate and W_up from alternate rows of w_gate_up: they are "
                  "stacked, [W_gate; W_up], the first F rows and the last F rows"),
    Misconception(lambda x, gu, d, a: None if a != "sigmoid" else
                  _glu_with(act="silu")(x, gu, d, a),
                  "Your GLU uses SiLU, z * sigmoid(z): the original GLU's gate is sigmoid(z) "
                  "itself"),
    Misconception(lambda x, gu, d, a: None if a != "gelu" else
                  _glu_with(act="gelu_tanh")(x, gu, d, a),
                  "Your GeGLU uses GELU's tanh approximation: \"gelu\" here is the exact GELU, "
                  "x * Phi(x), F.gelu's default"),
    Misconception(lambda x, gu, d, a: None if a == "silu" else _glu_with(act="silu")(x, gu, d, a),
                  "Your output uses SiLU whatever the activation: the argument chooses the "
                  "gate's activation (GELU for GeGLU, the sigmoid for GLU, none for the "
                  "bilinear layer)"),
    Misconception(lambda x, gu, d, a: None if a != "none" else _glu_with(up=False)(x, gu, d, a),
                  "With no activation the gate is W_gate x itself, and it still multiplies "
                  "W_up x: the bilinear layer is W_down (W_gate x * W_up x), not one linear "
                  "map"),
    Misconception(_glu_with(down=False),
                  "Your output has the hidden width F: the gated product still has to go "
                  "through the down projection back to D"),
    Misconception(_glu_with(up=False),
                  "Your output is W_down act(W_gate x): the gate multiplies nothing. It "
                  "multiplies, elementwise, the second projection W_up x"),
]


def _glu_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    hint = ("w_gate_up is (2F, D) and w_down (D, F), in nn.Linear's layout (out_features, "
            "in_features): x @ w.T, or F.linear(x, w), maps (..., in) to (..., out)")

    def weights(d, f):
        return rand(gen, 2 * f, d, scale=d ** -0.5), rand(gen, d, f, scale=f ** -0.5)

    return [
        Case("SwiGLU, batch 2, 5 positions, D=8, F=12",
             (rand(gen, 2, 5, 8), *weights(8, 12), "silu"), hint=hint),
        Case("GeGLU, unbatched, 4 positions, D=6, F=16",
             (rand(gen, 4, 6, scale=2.0), *weights(6, 16), "gelu"), hint=hint),
        Case("GLU, (2, 3, 4, D=16), F=40", (rand(gen, 2, 3, 4, 16), *weights(16, 40), "sigmoid"),
             hint=hint),
        Case("bilinear, batch 3, D=8, F=20", (rand(gen, 3, 8), *weights(8, 20), "none"),
             hint=hint),
        Case("SwiGLU, large inputs, D=8, F=20",
             (rand(gen, 3, 8, scale=4.0), *weights(8, 20), "silu"), hint=hint),
    ]


def check_glu_ffn(glu_fn: Callable) -> None:
    """Check ``glu_ffn(x, w_gate_up, w_down, activation)`` -> (..., D): W_down (act(W_gate x) *
    W_up x) with [W_gate; W_up] stacked in ``w_gate_up`` (2F, D) and ``activation`` one of
    "silu", "gelu", "sigmoid", "none", in nn.Linear's weight layout.

    Args:
        glu_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        expected = reference_glu(*case.args)
        compare_tensors(got, expected, case, what=f"Your {GLU_NAMES[case.args[-1]]} output",
                        misconceptions=GLU_MISTAKES)

    run_cases("glu_ffn", glu_fn, _glu_cases(seed=121), check_one)

# --------------------------------------------------------------------------------------------
# Exercise 12.2: llama_block(x, weights, n_heads, n_kv_heads), assembled from its parts

BLOCK_KEYS = ("attn_norm", "w_q", "w_k", "w_v", "w_o", "ff_norm", "w_gate", "w_up", "w_down")
BLOCK_EPS = 1e-6  # RMSNorm's eps, as in Llama's config.json (rms_norm_eps)


def reference_block(x: torch.Tensor, weights: Mapping[str, torch.Tensor], n_heads: int,
                    n_kv_heads: int) -> torch.Tensor:
    """course_lib's Llama-style :class:`~course_lib.blocks.DecoderBlock` (RMSNorm, RoPE,
    grouped-query attention, SwiGLU, no biases) holding ``weights``, applied to x (B, T, D)."""
    d_model, d_ff = x.shape[-1], weights["w_gate"].shape[0]
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the state
        block = DecoderBlock(d_model, n_heads, d_ff, norm="rms", ffn="swiglu", rope=True,
                             n_kv_heads=n_kv_heads, bias=False, eps=BLOCK_EPS).eval()
    copies = {block.attn_norm.weight: weights["attn_norm"],
              block.self_attn.qkv_proj.weight: torch.cat([weights[k] for k in ("w_q", "w_k",
                                                                                "w_v")]),
              block.self_attn.out_proj.weight: weights["w_o"],
              block.ff_norm.weight: weights["ff_norm"], block.ff.gate_proj.weight:
              weights["w_gate"], block.ff.up_proj.weight: weights["w_up"],
              block.ff.down_proj.weight: weights["w_down"]}
    with torch.no_grad():
        for parameter, value in copies.items():
            parameter.copy_(value)
        return block(x)[0]  # (B, T, D)


def block_variant(x, weights, n_heads, n_kv_heads, *, norm="rms", gain=True, post_norm=False,
                  rope="pairs", rotate=("q", "k"), expand="interleave", mask="causal",
                  swap_gate=False, scale_by="d_head", residual=True, split="heads",
                  swap_qk=False) -> torch.Tensor:
    """The block written out, with one part changed by a keyword: the wrong answers the check
    recognises (with the defaults it is the right block; a test proves it). ``norm``: "rms",
    "layer" (mean-centred first), "sum" (sqrt of the sum of squares), "no_sqrt" (divided by
    mean(x^2) + eps itself); ``scale_by``: "d_head" (sqrt), "d_model" (sqrt), "d_head_itself",
    "none"; ``mask``: "causal", "none", "future" (itself and later keys only); ``split``:
    "heads" (view (B, T, n, Dh)) or "dh_h" (view (B, T, Dh, n), then transpose(1, 2))."""
    w = weights
    batch, seq_len, d_model = x.shape
    d_head = d_model // n_heads

    def normed(h, g):  # RMSNorm, or one of its wrong versions, with or without the gain
        if norm == "layer":
            h = h - h.mean(-1, keepdim=True)
        squares = h.pow(2).sum(-1, keepdim=True) if norm == "sum" else \
            h.pow(2).mean(-1, keepdim=True)
        h = h / (squares + BLOCK_EPS) if norm == "no_sqrt" else h * torch.rsqrt(
            squares + BLOCK_EPS)
        return h * g if gain else h

    def turn(t):  # (B, heads, T, Dh) or, rope="width", (B, T, width) before the head split
        if rope in ("pairs", "width"):
            return apply_rope(t)
        return _rope_halves(t) if rope == "halves" else t

    def heads(t, n):  # (B, T, n Dh) -> (B, n, T, Dh)
        if split == "dh_h":  # (B, Dh, T, n): Dh 'heads' of n features
            return t.view(batch, seq_len, d_head, n).transpose(1, 2)
        return t.view(batch, seq_len, n, d_head).transpose(1, 2)

    def attention(h):
        q, k, v = h @ w["w_q"].T, h @ w["w_k"].T, h @ w["w_v"].T
        named = {"q": q, "k": k, "v": v}
        if rope == "width":
            named = {n: turn(t) if n in rotate else t for n, t in named.items()}
        q, k, v = heads(named["q"], n_heads), heads(named["k"], n_kv_heads), \
            heads(named["v"], n_kv_heads)
        if rope != "width":
            q, k, v = (turn(t) if n in rotate else t for n, t in (("q", q), ("k", k), ("v", v)))
        group = n_heads // n_kv_heads
        if expand == "tile":
            k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if swap_qk:
            q, k = k, q
        divisor = {"d_head": math.sqrt(d_head), "d_model": math.sqrt(d_model),
                   "d_head_itself": d_head, "none": 1.0}[scale_by]
        scores = q @ k.transpose(-2, -1) / divisor
        ones = torch.ones(seq_len, seq_len, dtype=torch.bool)
        keep = {"causal": ones.tril(), "none": ones, "future": ones.triu()}[mask]
        scores = scores.masked_fill(~keep, float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq_len, d_model)
        return out @ w["w_o"].T

    def ffn(h):
        gate, up = h @ w["w_gate"].T, h @ w["w_up"].T
        if swap_gate:
            gate, up = up, gate
        return (F.silu(gate) * up) @ w["w_down"].T

    if post_norm:
        x = normed(x + attention(x), w["attn_norm"])
        return normed(x + ffn(x), w["ff_norm"])
    if not residual:
        x = attention(normed(x, w["attn_norm"]))
        return ffn(normed(x, w["ff_norm"]))
    x = x + attention(normed(x, w["attn_norm"]))
    return x + ffn(normed(x, w["ff_norm"]))


def _variant(**change) -> Callable[..., torch.Tensor]:
    return lambda x, weights, n_heads, n_kv_heads: block_variant(x, weights, n_heads,
                                                                 n_kv_heads, **change)


BLOCK_MISTAKES = [
    Misconception(_variant(norm="layer"),
                  "Your norm subtracts the mean first: that is LayerNorm. RMSNorm only divides "
                  "by sqrt(mean(x^2) + eps) and multiplies by its gain"),
    Misconception(_variant(gain=False),
                  "Your norms leave out their gains: multiply each normalised vector by "
                  "weights['attn_norm'] (before attention) or weights['ff_norm'] (before the "
                  "feed-forward network)"),
    Misconception(_variant(post_norm=True),
                  "Your block normalises after each residual sum (post-norm, x = norm(x + f(x))). "
                  "Llama's block is pre-norm: x = x + f(norm(x)), the stream itself never "
                  "normalised"),
    Misconception(_variant(residual=False),
                  "Your block returns f(norm(x)) without adding x back: each sublayer's output "
                  "is added to the residual stream, x = x + f(norm(x))"),
    Misconception(_variant(swap_gate=True),
                  "Your feed-forward network puts SiLU on W_up x and multiplies by W_gate x: "
                  "SwiGLU's gate and up projections are swapped (the gate is silu(W_gate h))"),
    Misconception(_variant(rotate=("q", "k", "v")),
                  "Your block rotates the values too. RoPE turns queries and keys only, so that "
                  "their scores see offsets; the values are what gets averaged, unrotated"),
    Misconception(_variant(rotate=("q",)),
                  "Your block rotates the queries but not the keys: RoPE turns both, each by its "
                  "own position, so that a score depends on their offset"),
    Misconception(_variant(rotate=("k",)),
                  "Your block rotates the keys but not the queries: RoPE turns both, each by its "
                  "own position, so that a score depends on their offset"),
    Misconception(_variant(rope="none"),
                  "Your block has no RoPE: rotate the queries and the keys of every head by "
                  "their positions 0..T-1 (apply_rope) before the scores"),
    Misconception(_variant(rope="halves"),
                  "Your rotation pairs dimension i of a head with i + Dh/2 (Hugging Face's "
                  "rotate_half layout). These weights follow apply_rope's pairs (2i, 2i + 1): "
                  "the other layout computes other scores with the same weights"),
    Misconception(_variant(rope="width"),
                  "Your block rotates q and k across the whole width before splitting the heads: "
                  "RoPE works inside each head, on (..., T, Dh), pairs of one head's dimensions"),
    Misconception(_variant(expand="tile"),
                  "Your key/value expansion tiles the heads (0, 1, 0, 1, ...), as Tensor.repeat "
                  "does: query head h must read key/value head h // (H / Hkv), neighbours "
                  "sharing (0, 0, 1, 1, ...)"),
    Misconception(_variant(norm="sum"),
                  "Your norm divides by sqrt(SUM(x^2) + eps): RMSNorm takes the MEAN of the "
                  "squares, x / sqrt(mean(x^2) + eps), so that its output has a root mean "
                  "square of 1 whatever D is"),
    Misconception(_variant(norm="no_sqrt"),
                  "Your norm divides by mean(x^2) + eps without the square root: RMSNorm "
                  "divides by the ROOT mean square, sqrt(mean(x^2) + eps) (torch.rsqrt)"),
    Misconception(_variant(mask="none"),
                  "Your attention has no causal mask: every position also reads the later ones. "
                  "A decoder's position t may attend only to positions <= t"),
    Misconception(_variant(mask="future"),
                  "Your causal mask is the wrong way round: each position attends to itself and "
                  "the LATER positions (the upper triangle, triu) and never to the past. "
                  "Position t may attend to positions <= t: keep the lower triangle (tril)"),
    Misconception(_variant(swap_qk=True),
                  "Your scores are k q^T: the queries and the keys are swapped. scores[t, s] is "
                  "query t (from w_q) dotted with key s (from w_k): q @ k.transpose(-2, -1)"),
    Misconception(_variant(scale_by="d_model"),
                  "Your scores are divided by sqrt(D); scaled dot-product attention divides by "
                  "sqrt(Dh), the size of one head"),
    Misconception(_variant(scale_by="d_head_itself"),
                  "Your scores are divided by Dh: the divisor is its square root, sqrt(Dh), the "
                  "standard deviation of a dot product of Dh unit-variance terms"),
    Misconception(_variant(scale_by="none"),
                  "Your scores are not scaled: divide q k^T by sqrt(Dh) before the softmax"),
    Misconception(_variant(split="dh_h"),
                  "Your heads are split as (Dh, H): view(B, T, Dh, n_heads) makes Dh 'heads' of "
                  "H features each. Head h owns the contiguous features h*Dh .. (h+1)*Dh - 1: "
                  "view(B, T, n_heads, Dh), then transpose(1, 2)"),
]


def _block_weights(gen: torch.Generator, d_model: int, n_heads: int, n_kv_heads: int,
                   d_ff: int, *, attention: bool = True, feed_forward: bool = True) -> dict:
    """Random weights in nn.Linear's layout; gains away from 1 so that a missing gain shows.
    ``attention=False`` zeroes W_o (the block is then x + ffn(norm(x))), ``feed_forward=False``
    zeroes W_down (x + attn(norm(x)))."""
    kv_dim = n_kv_heads * (d_model // n_heads)
    s, f = d_model ** -0.5, d_ff ** -0.5
    weights = {"attn_norm": 1 + 0.5 * rand(gen, d_model), "w_q": rand(gen, d_model, d_model,
                                                                      scale=2 * s),
               "w_k": rand(gen, kv_dim, d_model, scale=2 * s),
               "w_v": rand(gen, kv_dim, d_model, scale=s), "w_o": rand(gen, d_model, d_model,
                                                                        scale=s),
               "ff_norm": 1 + 0.5 * rand(gen, d_model), "w_gate": rand(gen, d_ff, d_model,
                                                                       scale=s),
               "w_up": rand(gen, d_ff, d_model, scale=s), "w_down": rand(gen, d_model, d_ff,
                                                                         scale=f)}
    if not attention:
        weights["w_o"] = torch.zeros_like(weights["w_o"])
    if not feed_forward:
        weights["w_down"] = torch.zeros_like(weights["w_down"])
    return weights


def _block_cases(seed: int) -> list[Case]:
    """In the order a learner would debug: each part alone first, then whole blocks."""
    gen = torch.Generator().manual_seed(seed)
    hint = ("the weights are in nn.Linear's layout (out_features, in_features); w_k and w_v "
            "have Hkv * Dh rows, fewer than w_q's H * Dh; split each projection's features as "
            "(heads, Dh): view(B, T, n, Dh), then transpose(1, 2)")

    def case(name, shape, n_heads, n_kv_heads, d_ff, **parts):
        x = rand(gen, *shape)
        weights = _block_weights(gen, shape[-1], n_heads, n_kv_heads, d_ff, **parts)
        return Case(name, (x, weights, n_heads, n_kv_heads), hint=hint)

    # D = 24, H = 4: Dh = 6, H and sqrt(D) = 4.9 all differ, so that no mix-up of them (a split
    # as (Dh, H), a division by sqrt(D) or by Dh) computes the right block
    return [
        case("the norms and the feed-forward half (attention switched off: w_o = 0)",
             (2, 5, 24), 4, 2, 32, attention=False),
        case("attention at a single position (feed-forward off: w_down = 0; T=1, H=4, Hkv=2)",
             (2, 1, 24), 4, 2, 32, feed_forward=False),
        case("attention over 6 positions (feed-forward off: w_down = 0; D=24, H=4, Hkv=2)",
             (2, 6, 24), 4, 2, 32, feed_forward=False),
        case("the whole block, B=2, T=7, D=32, H=8, Hkv=2, F=40", (2, 7, 32), 8, 2, 40),
        case("the whole block, multi-query: H=4, Hkv=1", (1, 9, 32), 4, 1, 48),
        case("the whole block, no sharing: H=Hkv=2, Dh=8", (3, 5, 16), 2, 2, 32),
    ]


def check_llama_block(block_fn: Callable) -> None:
    """Check ``llama_block(x, weights, n_heads, n_kv_heads)`` -> (B, T, D): a pre-norm block
    with RMSNorm (eps 1e-6), RoPE on q and k, grouped-query causal attention and SwiGLU, no
    biases, against course_lib's :class:`~course_lib.blocks.DecoderBlock` holding the same
    weights. The first cases switch one half of the block off, so a failure names the part.

    Args:
        block_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        expected = reference_block(*case.args)
        compare_tensors(got, expected, case, what="Your block's output",
                        misconceptions=BLOCK_MISTAKES)

    run_cases("llama_block", block_fn, _block_cases(seed=122), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 12.3: how many sequences of Qwen2.5 7B fit on one GPU, predicted

QWEN25_7B = dict(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 hidden_size=3584, torch_dtype="bfloat16")  # Qwen/Qwen2.5-7B's config.json
QWEN25_7B_PARAMETERS = 7_615_616_512  # the checkpoint's count (tests/test_checks_ch12.py)
GPU_BYTES = 80 * 2**30  # an 80 GiB GPU
CONTEXT = 32768
KV_KEYS = ("bytes_per_token", "max_sequences", "max_sequences_mha")


def _per_token(layers=28, kv_heads=4, d_head=128, bytes_per=2, kv=2) -> int:
    return kv * layers * kv_heads * d_head * bytes_per


def _fits(per_token: int, *, memory: int = GPU_BYTES, weight_bytes: int = 2,
          context: int = CONTEXT) -> int:
    return (memory - QWEN25_7B_PARAMETERS * weight_bytes) // (per_token * context)


def mha_parameters() -> int:
    """Qwen2.5 7B with 28 key/value heads: W_k and W_v (and their biases) grow from 4 heads'
    rows to 28 heads' in each of the 28 layers."""
    extra_rows = (28 - 4) * 128  # per projection
    return QWEN25_7B_PARAMETERS + 28 * 2 * extra_rows * (3584 + 1)


PER_TOKEN_MISTAKES = {
    "forgot the factor 2: the cache holds keys AND values": _per_token(kv=1),
    "used all 28 query heads instead of the 4 key/value heads (or took the head dimension as "
    "hidden_size / num_key_value_heads; it is hidden_size / num_attention_heads = 128)":
        _per_token(kv_heads=28),
    "forgot the layers: every one of the 28 layers caches its own keys and values":
        _per_token(layers=1),
    "counted 4 bytes per element (float32); bfloat16 takes 2": _per_token(bytes_per=4),
    "counted 1 byte per element; bfloat16 takes 2": _per_token(bytes_per=1),
    "counted 16 per element: that is bits, bfloat16 takes 2 bytes": _per_token(bytes_per=16),
    "forgot the head dimension (128 numbers per head)": _per_token(d_head=1),
    "counted hidden_size numbers per key/value head: a head holds hidden_size / "
    "num_attention_heads = 128": _per_token(d_head=3584),
}


def _named(mistakes: Mapping[str, int], value: int) -> str | None:
    """The mistakes that give ``value`` (several can give the same number), joined by 'or'."""
    names = [name for name, wrong in mistakes.items() if wrong == value]
    return " or ".join(names) if names else None


def _fit_mistakes(per_token: int) -> dict[str, int]:
    right = _fits(per_token)
    return {
        "forgot the weights: they take their share of the memory before any cache":
            GPU_BYTES // (per_token * CONTEXT),
        "took 80 GiB as 80 x 10^9 bytes; the GPU has 80 x 2^30": _fits(per_token,
                                                                       memory=80 * 10**9),
        "counted the weights at 4 bytes a parameter; in bfloat16 they take 2":
            _fits(per_token, weight_bytes=4),
        "rounded up: the last of those sequences would not fit; round down": right + 1,
        "gave the sequences' tokens, not the number of sequences":
            right * CONTEXT,
    }


def check_capacity_prediction(capacity_prediction_fn: Callable) -> None:
    """Check ``capacity_prediction()`` -> {"bytes_per_token", "max_sequences",
    "max_sequences_mha"} for Qwen2.5 7B in bfloat16 on an 80 GiB GPU, sequences of 32,768
    tokens, then show the measurement of the per-token formula on a small model's KVCache.
    Counts follow the course's number rule (``require_count``: Python or numpy ints).

    Args:
        capacity_prediction_fn: the learner's function (no arguments).
    """
    got = prediction_dict(call_learner(capacity_prediction_fn, Case("Qwen2.5 7B")), KV_KEYS,
                          "capacity_prediction")
    values = {key: require_count(got[key], f"'{key}'") for key in KV_KEYS}
    per_token, right = values["bytes_per_token"], _per_token()
    if per_token != right:
        named = _named(PER_TOKEN_MISTAKES, per_token)
        raise CheckFailure(f"bytes_per_token = {per_token:,} is not right: "
                           + (f"you probably {named}" if named else
                              "count 2 (keys and values) x layers x key/value heads x "
                              "head dimension x bytes per element"))
    fits, fits_mha = _fits(right), _fits(_per_token(kv_heads=28))
    if values["max_sequences"] != fits:
        named = _named(_fit_mistakes(right), values["max_sequences"])
        raise CheckFailure(f"max_sequences = {values['max_sequences']:,} is not right: "
                           + (f"you probably {named}" if named else
                              "subtract the weights' bytes from the GPU's, then see how many "
                              f"caches of {CONTEXT:,} tokens fit in what is left"))
    if values["max_sequences_mha"] != fits_mha:
        mistakes = _fit_mistakes(_per_token(kv_heads=28))
        mistakes["kept 4 key/value heads: with one per query head there are 28, and each "
                  "token's cache is 7 times larger"] = fits
        named = _named(mistakes, values["max_sequences_mha"])
        raise CheckFailure(f"max_sequences_mha = {values['max_sequences_mha']:,} is not right: "
                           + (f"you probably {named}" if named else
                              "redo max_sequences with 28 key/value heads"))
    weights = QWEN25_7B_PARAMETERS * 2
    per_sequence = right * CONTEXT
    mha_fits = (GPU_BYTES - mha_parameters() * 2) // (7 * per_sequence)
    print(f"\u2705 Qwen2.5 7B in bfloat16 caches {right:,} bytes per token ({right / 2**10:.0f} "
          f"KiB), {per_sequence / 2**30:.2f} GiB per sequence of {CONTEXT:,} tokens. Its "
          f"weights take {weights / 2**30:.1f} GiB of the 80, so {fits} sequences fit; with 28 "
          f"key/value heads, {fits_mha}. (The larger W_k and W_v of that model, "
          f"{(mha_parameters() - QWEN25_7B_PARAMETERS) / 1e6:.0f} million more parameters, "
          f"still leave room for {mha_fits}.) Sharing each key/value head among 7 query heads "
          f"serves {fits / fits_mha:.1f} times as many sequences at once")
    _measure_small_cache()


def _measure_small_cache() -> None:
    """The same formula against the bytes a small bfloat16 model's KVCache really holds."""
    config = DecoderConfig(vocab_size=50, d_model=64, n_heads=8, n_kv_heads=2, n_layers=3,
                           max_len=64, positions="rope", norm="rms", ffn="swiglu", bias=False)
    with torch.random.fork_rng():  # leave the learner's random state alone
        torch.manual_seed(0)
        model = DecoderLM(config).to(torch.bfloat16).eval()
    batch, positions = 2, 10
    ids = torch.randint(0, 50, (batch, positions), generator=torch.Generator().manual_seed(0))
    cache = KVCache()
    with torch.no_grad():
        model(ids, past_key_values=cache)
    d_head = config.d_model // config.n_heads
    formula = 2 * config.n_layers * config.n_kv_heads * d_head * 2 * batch * positions
    print(f"   measured on a small model (3 layers, 8 query heads, 2 key/value heads, Dh=8, "
          f"bfloat16; batch 2, 10 positions):\n   formula 2 x 3 x 2 x 8 x 2 bytes x 2 x 10 = "
          f"{formula:,} bytes; cache.nbytes = {cache.nbytes:,} bytes")
    if formula != cache.nbytes:  # pragma: no cover - a library regression, not the learner
        raise AssertionError("course_lib's KVCache no longer matches the formula")


# --------------------------------------------------------------------------------------------
# Exercise 12.4: find the bug in a rotary embedding


def buggy_rope(x: torch.Tensor, positions: torch.Tensor | None = None, *,
               base: float = 10000.0) -> torch.Tensor:
    """The exercise's function, planted bug included: its speeds are theta_i = base^(-i/Dh)
    where RoPE's are base^(-2i/Dh), so every pair but the first turns too fast."""
    return _rope_interleaved(x, positions, base=base, exponent=1.0)


def _rope_halves(x, positions=None, *, base=10000.0):
    d = x.shape[-1]
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # (Dh/2,)
    angles = positions.float()[:, None] * theta  # (T, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def _rope_interleaved(x, positions=None, *, base=10000.0, sign=1.0, exponent=2.0):
    d = x.shape[-1]
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    theta = base ** (-exponent * torch.arange(d // 2, dtype=torch.float32) / d)  # (Dh/2,)
    angles = positions.float()[:, None] * theta  # (T, Dh/2)
    cos, sin = angles.cos(), sign * angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


INSTRUMENTS = (
    "The instrument that finds this: equality with course_lib's apply_rope on several "
    "inputs (in a whole model, first_divergence against a reference names the first "
    "attention layer that differs)"
)

ROPE_MISTAKES = [
    Misconception(buggy_rope,
                  "Your rotation still turns pair i at theta_i = base^(-i/Dh), as the given "
                  "function does: the planted bug is still there. It passes the relative-position "
                  "test (any fixed speeds do) but only pair 0 turns at RoPE's speed; "
                  "theta_i = base^(-2i/Dh)"),
    Misconception(lambda x, positions=None, base=10000.0: _rope_interleaved(
                      x, positions, base=base, exponent=4.0),
                  "Your speeds are base^(-4i/Dh): the exponent was doubled twice (a factor 2 "
                  "and a step-2 arange together). theta_i = base^(-2i/Dh): either "
                  "arange(0, Dh, 2) / Dh or 2 * arange(Dh // 2) / Dh, not both"),
    Misconception(lambda x, positions=None, base=10000.0: _rope_interleaved(x, positions,
                                                                              base=base, sign=-1),
                  "Your rotation turns the other way (by -p theta_i): the sin terms have the "
                  "wrong signs. Scores still depend only on the offset, but on its negative"),
    Misconception(lambda x, positions=None, base=10000.0: _rope_halves(x, positions, base=base),
                  "Your rotation pairs dimension i with i + Dh/2 (Hugging Face's rotate_half "
                  "layout): a valid rotary embedding, but not this one. The pairs were right: "
                  "(2i, 2i + 1), as in apply_rope; the bug is elsewhere"),
]


def _rope_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("(B=2, H=3, T=6, Dh=8), positions 0..5", (rand(gen, 2, 3, 6, 8),)),
        Case("(T=5, Dh=4), positions 7..11 (after a cache)", (rand(gen, 5, 4),),
             {"positions": torch.arange(7, 12)}),
        Case("(B=1, H=2, T=4, Dh=16), positions 100, 3, 50, 0",
             (rand(gen, 1, 2, 4, 16),), {"positions": torch.tensor([100, 3, 50, 0])}),
        Case("(T=3, Dh=6), base 500", (rand(gen, 3, 6),), {"base": 500.0}),
    ]


def _relative_position_problem(rope_fn: Callable) -> str | None:
    """What breaks RoPE's defining property, scores depending only on the offset (and norms
    kept), or None."""
    gen = torch.Generator().manual_seed(124)
    q, k = rand(gen, 1, 8), rand(gen, 1, 8)
    scores = []
    for p in (0, 5, 23):  # the same offset 4 at three places
        q_rot = call_learner(rope_fn, Case(f"position {p + 4}", (q,),
                                           {"positions": torch.tensor([p + 4])}))
        k_rot = call_learner(rope_fn, Case(f"position {p}", (k,),
                                           {"positions": torch.tensor([p])}))
        if not isinstance(q_rot, torch.Tensor) or q_rot.shape != q.shape:
            return None  # compare_tensors reports the shape
        if not torch.allclose(q_rot.norm(), q.norm(), rtol=1e-4):
            return ("your function changes the length of the vector (a rotation keeps it): "
                    "each pair must become (a cos - b sin, a sin + b cos)")
        scores.append(float((q_rot * k_rot).sum()))
    if max(scores) - min(scores) > 1e-4 * max(1.0, abs(scores[0])):
        return ("the score of a rotated query and key changes when both move by the same "
                f"number of positions ({', '.join(f'{s:.4f}' for s in scores)} for offset 4 at "
                "three places): the relative-position property test fails. Rotate both by "
                "their own position, each pair by the angle p * theta_i")
    return None


def check_fixed_rope(rope_fn: Callable) -> None:
    """Check ``rope(x, positions=None, base=10000.0)`` -> (..., T, Dh): the given rotary
    embedding with its one bug fixed, i.e. course_lib's :func:`apply_rope` (pairs (2i, 2i+1)
    turned by p * base^(-2i/Dh)). First the relative-position property, then equality.

    Args:
        rope_fn: the learner's function.
    """
    problem = _relative_position_problem(rope_fn)
    if problem is not None:
        raise CheckFailure(f"Your rope: {problem}")

    def check_one(got, case: Case) -> None:
        expected = apply_rope(*case.args, **case.kwargs)
        try:
            compare_tensors(got, expected, case, what="Your rotated tensor",
                            misconceptions=ROPE_MISTAKES)
        except CheckFailure as failure:
            raise CheckFailure(f"{failure}. {INSTRUMENTS}") from None

    run_cases("rope (relative-position property and equality with apply_rope)", rope_fn,
              _rope_cases(seed=124), check_one)


__all__ = ["buggy_rope", "check_capacity_prediction", "check_fixed_rope", "check_glu_ffn",
           "check_llama_block"]


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
