"""Checks for chapter 12, today's decoders: the SwiGLU feed-forward network from its equation,
grouped-query attention's key/value expansion, the KV cache of a published model (predicted,
then measured), and a rotary embedding with a planted bug to find.

The references are course_lib's :class:`~course_lib.layers.SwiGLU`,
:class:`~course_lib.attention.MultiHeadAttention` (``n_kv_heads``),
:class:`~course_lib.cache.KVCache` and :func:`~course_lib.positions.apply_rope`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from course_lib.attention import MultiHeadAttention, merge_heads, split_heads
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
)

# --------------------------------------------------------------------------------------------
# Exercise 12.1: swiglu(x, w_gate, w_up, w_down)


def _swiglu_with(act: Callable[[torch.Tensor], torch.Tensor], *, on: str = "gate",
                 down: bool = True, up: bool = True) -> Callable[..., torch.Tensor]:
    """SwiGLU written with another activation, on the other branch, or missing a part."""
    def wrong(x, w_gate, w_up, w_down):
        gate, value = x @ w_gate.T, x @ w_up.T  # (..., F) each
        if on == "up":
            gate, value = value, gate
        hidden = act(gate) * value if up else act(gate)  # (..., F)
        return hidden @ w_down.T if down else hidden
    return wrong


SWIGLU_MISTAKES = [
    Misconception(_swiglu_with(F.silu, on="up"),
                  "Your output puts SiLU on the up branch and multiplies by the gate branch: the "
                  "gate is W_gate x, through SiLU; W_up x is what it multiplies"),
    Misconception(_swiglu_with(F.gelu),
                  "Your output uses GELU where SwiGLU uses SiLU, silu(z) = z * sigmoid(z) "
                  "(GELU with a gate is GeGLU, another of Shazeer's variants)"),
    Misconception(_swiglu_with(F.relu),
                  "Your output uses ReLU where SwiGLU uses SiLU, silu(z) = z * sigmoid(z) "
                  "(ReLU with a gate is ReGLU)"),
    Misconception(_swiglu_with(torch.sigmoid),
                  "Your output uses sigmoid(W_gate x) as the gate: that is the original GLU. "
                  "SwiGLU's gate is silu(z) = z * sigmoid(z), which can also be negative"),
    Misconception(_swiglu_with(F.silu, down=False),
                  "Your output has the hidden width F: the gated product still has to go "
                  "through the down projection back to D"),
    Misconception(_swiglu_with(F.silu, up=False),
                  "Your output is W_down silu(W_gate x): the gate multiplies nothing. SwiGLU "
                  "multiplies silu(W_gate x) elementwise by a second projection, W_up x"),
]


def _swiglu_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    hint = ("the weights are in nn.Linear's layout (out_features, in_features): x @ w.T, or "
            "F.linear(x, w), maps (..., in) to (..., out)")

    def weights(d, f):
        return rand(gen, f, d, scale=d ** -0.5), rand(gen, f, d, scale=d ** -0.5), \
            rand(gen, d, f, scale=f ** -0.5)

    return [
        Case("batch 2, 5 positions, D=8, F=12", (rand(gen, 2, 5, 8), *weights(8, 12)), hint=hint),
        Case("unbatched, 4 positions, D=6, F=16", (rand(gen, 4, 6), *weights(6, 16)), hint=hint),
        Case("(2, 3, 4, D=16), F=40", (rand(gen, 2, 3, 4, 16), *weights(16, 40)), hint=hint),
        Case("large inputs, where the activations differ most",
             (rand(gen, 3, 8, scale=4.0), *weights(8, 20)), hint=hint),
    ]


def check_swiglu(swiglu_fn: Callable) -> None:
    """Check ``swiglu(x, w_gate, w_up, w_down)`` -> (..., D): W_down (silu(W_gate x) * W_up x)
    with nn.Linear's weight layout, against course_lib's ``SwiGLU`` holding the same weights.

    Args:
        swiglu_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        x, w_gate, w_up, w_down = case.args
        reference = SwiGLU(w_gate.shape[1], w_gate.shape[0])
        with torch.no_grad():
            for linear, weight in ((reference.gate_proj, w_gate), (reference.up_proj, w_up),
                                   (reference.down_proj, w_down)):
                linear.weight.copy_(weight)
            expected = reference(x)
        compare_tensors(got, expected, case, what="Your SwiGLU output",
                        misconceptions=SWIGLU_MISTAKES)

    run_cases("swiglu", swiglu_fn, _swiglu_cases(seed=121), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 12.2: expand_kv(kv, n_heads)

KV_MISTAKES = [
    Misconception(lambda kv, n_heads: kv.repeat(1, n_heads // kv.shape[1], 1, 1),
                  "Your expansion tiles the key/value heads (0, 1, 0, 1, ...), as "
                  "Tensor.repeat does, so query head h reads kv head h % Hkv. In grouped-query "
                  "attention neighbouring query heads share one kv head (0, 0, 1, 1, ...): "
                  "query head h reads kv head h // (H / Hkv)"),
    Misconception(lambda kv, n_heads: kv.repeat_interleave(n_heads // kv.shape[1], dim=2),
                  "Your expansion repeats along the positions (dim 2), not along the heads "
                  "(dim 1): the result has H/Hkv times as many positions"),
    Misconception(lambda kv, n_heads: kv.repeat_interleave(n_heads // kv.shape[1], dim=-1),
                  "Your expansion repeats along the head dimension Dh (the last dim), not along "
                  "the heads (dim 1)"),
]


def _kv_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("Hkv=2 -> H=4, B=2, S=5, Dh=4", (rand(gen, 2, 2, 5, 4), 4)),
        Case("Hkv=3 -> H=12 (groups of 4)", (rand(gen, 1, 3, 6, 8), 12)),
        Case("Hkv=4 -> H=8, S=1 (one cached step)", (rand(gen, 3, 4, 1, 2), 8)),
        Case("Hkv=1 -> H=8 (multi-query)", (rand(gen, 2, 1, 7, 4), 8)),
        Case("Hkv=H=4 (plain multi-head: unchanged)", (rand(gen, 2, 4, 3, 4), 4)),
    ]


def _attention_with(expand_kv_fn: Callable, mha: MultiHeadAttention,
                    x: torch.Tensor) -> torch.Tensor:
    """Grouped-query causal attention built from ``mha``'s weights, with the learner's
    expansion of the keys and values (no RoPE)."""
    kv_dim = mha.n_kv_heads * mha.d_head
    q, k, v = mha.qkv_proj(x).split([mha.d_model, kv_dim, kv_dim], dim=-1)
    q = split_heads(q, mha.n_heads)  # (B, H, T, Dh)
    k, v = split_heads(k, mha.n_kv_heads), split_heads(v, mha.n_kv_heads)  # (B, Hkv, T, Dh)
    case = Case(f"inside attention, H={mha.n_heads}, Hkv={mha.n_kv_heads}", (k, mha.n_heads))
    k = call_learner(expand_kv_fn, case)
    v = call_learner(expand_kv_fn, Case(case.name, (v, mha.n_heads)))
    for name, t in (("keys", k), ("values", v)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape:
            raise CheckFailure(f"inside attention your expanded {name} should have the queries' "
                               f"shape {tuple(q.shape)}, got {getattr(t, 'shape', t)!r}")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, Dh)
    return mha.out_proj(merge_heads(out))  # (B, T, D)


def check_expand_kv(expand_kv_fn: Callable) -> None:
    """Check ``expand_kv(kv, n_heads)``: (B, Hkv, S, Dh) -> (B, H, S, Dh), query head h
    reading key/value head h // (H / Hkv); then, inside causal attention, against course_lib's
    grouped-query ``MultiHeadAttention`` with the same weights.

    Args:
        expand_kv_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        kv, n_heads = case.args
        expected = kv.repeat_interleave(n_heads // kv.shape[1], dim=1)
        compare_tensors(got, expected, case, what="Your expanded tensor",
                        misconceptions=KV_MISTAKES)

    cases = _kv_cases(seed=122)
    for case in cases:
        check_one(call_learner(expand_kv_fn, case), case)
    gen = torch.Generator().manual_seed(1220)
    for n_kv_heads in (2, 1):
        torch.manual_seed(1221 + n_kv_heads)
        mha = MultiHeadAttention(32, 8, n_kv_heads=n_kv_heads).eval()
        x = rand(gen, 2, 6, 32)
        with torch.no_grad():
            got, expected = _attention_with(expand_kv_fn, mha, x), mha(x, is_causal=True)[0]
        if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            raise CheckFailure(
                f"Inside attention (H=8, Hkv={n_kv_heads}) your expansion gives another output "
                "than course_lib's grouped-query MultiHeadAttention with the same weights: "
                "query head h must read kv head h // (H / Hkv)")
    print(f"\u2705 expand_kv is correct on all {len(cases)} test cases and inside grouped-query "
          "attention (H=8 with Hkv=2 and Hkv=1: the same output as course_lib's "
          "MultiHeadAttention)")


# --------------------------------------------------------------------------------------------
# Exercise 12.3: the KV cache of Llama 3 8B, predicted

LLAMA3_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 hidden_size=4096, torch_dtype="bfloat16")
CONTEXT, BATCH = 8192, 4
KV_KEYS = ("bytes_per_token", "bytes_for_the_batch")


def _per_token(layers=32, kv_heads=8, d_head=128, bytes_per=2, kv=2) -> int:
    return kv * layers * kv_heads * d_head * bytes_per


PER_TOKEN_MISTAKES = {
    "forgot the factor 2: the cache holds keys AND values": _per_token(kv=1),
    "used all 32 query heads instead of the 8 key/value heads (or hidden_size, 32 x 128, "
    "instead of num_key_value_heads x head_dim)": _per_token(kv_heads=32),
    "forgot the layers: every one of the 32 layers caches its own keys and values":
        _per_token(layers=1),
    "counted 4 bytes per element (float32); bfloat16 takes 2": _per_token(bytes_per=4),
    "counted 1 byte per element; bfloat16 takes 2": _per_token(bytes_per=1),
    "counted 16 per element: that is bits, bfloat16 takes 2 bytes": _per_token(bytes_per=16),
    "forgot the head dimension (128 numbers per head)": _per_token(d_head=1),
}


def _named(mistakes: Mapping[str, int], value: int) -> str | None:
    """The mistakes that give ``value`` (several can give the same number), joined by 'or'."""
    names = [name for name, wrong in mistakes.items() if wrong == value]
    return " or ".join(names) if names else None


def check_kv_cache_prediction(kv_cache_prediction_fn: Callable) -> None:
    """Check ``kv_cache_prediction()`` -> {"bytes_per_token": int, "bytes_for_the_batch": int}
    for Llama 3 8B in bfloat16 (context 8192, batch 4), then show the measurement on a small
    model's KVCache.

    Args:
        kv_cache_prediction_fn: the learner's function (no arguments).
    """
    got = prediction_dict(call_learner(kv_cache_prediction_fn, Case("Llama 3 8B")), KV_KEYS,
                          "kv_cache_prediction")
    expected = {"bytes_per_token": _per_token()}
    expected["bytes_for_the_batch"] = expected["bytes_per_token"] * CONTEXT * BATCH
    values = {key: require_count(got[key], f"'{key}'") for key in KV_KEYS}
    per_token = values["bytes_per_token"]
    if per_token != expected["bytes_per_token"]:
        named = _named(PER_TOKEN_MISTAKES, per_token)
        raise CheckFailure(f"bytes_per_token = {per_token:,} is not right: "
                           + (f"you probably {named}" if named else
                              "count 2 (keys and values) x layers x key/value heads x "
                              "head dimension x bytes per element"))
    batch = values["bytes_for_the_batch"]
    if batch != expected["bytes_for_the_batch"]:
        mistakes = {"forgot the batch: each of the 4 sequences has its own cache":
                        per_token * CONTEXT,
                    "forgot the context: the cache holds 8192 positions per sequence":
                        per_token * BATCH,
                    "gave GiB, not bytes": expected["bytes_for_the_batch"] // 2**30,
                    "gave MiB, not bytes": expected["bytes_for_the_batch"] // 2**20}
        named = _named(mistakes, batch)
        raise CheckFailure(f"bytes_for_the_batch = {batch:,} is not right: "
                           + (f"you probably {named}" if named else
                              "multiply the bytes per token by the positions and the batch"))
    print(f"\u2705 Llama 3 8B in bfloat16 caches {per_token:,} bytes per token "
          f"({per_token / 2**10:.0f} KiB); a batch of {BATCH} at {CONTEXT:,} tokens: "
          f"{batch:,} bytes ({batch / 2**30:.0f} GiB)")
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
    """The exercise's function, planted bug included: it pairs dimension i with i + Dh/2
    (Hugging Face's rotate_half layout) where course_lib pairs 2i with 2i + 1."""
    return _rope_halves(x, positions, base=base)


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
                  "Your rotation still pairs dimension i with i + Dh/2, as the given function "
                  "does: the planted bug is still there. It passes the relative-position test "
                  "(it is a valid rotary embedding, Hugging Face's layout) but course_lib pairs "
                  "2i with 2i + 1, so weights trained with one layout give other scores with "
                  "the other"),
    Misconception(lambda x, positions=None, base=10000.0: _rope_interleaved(x, positions,
                                                                              base=base, sign=-1),
                  "Your rotation turns the other way (by -p theta_i): the sin terms have the "
                  "wrong signs. Scores still depend only on the offset, but on its negative"),
    Misconception(lambda x, positions=None, base=10000.0: _rope_interleaved(
                      x, positions, base=base, exponent=1.0),
                  "Your frequencies are base^(-i/Dh): pair i turns at theta_i = base^(-2i/Dh)"),
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


__all__ = ["buggy_rope", "check_expand_kv", "check_fixed_rope", "check_kv_cache_prediction",
           "check_swiglu"]
