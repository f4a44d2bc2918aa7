"""The chapter 12 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib.course.checks import CheckFailure, ch12
from course_lib.course.checks.ch12 import (
    BLOCK_MISTAKES,
    block_variant,
    buggy_rope,
    check_capacity_prediction,
    check_fixed_rope,
    check_glu_ffn,
    check_llama_block,
    reference_block,
)
from course_lib.positions import apply_rope


@pytest.mark.parametrize("check", [check_glu_ffn, check_llama_block, check_capacity_prediction,
                                   check_fixed_rope])
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


# --------------------------------------------------------------- 12.1 gated FFNs, one fused matrix


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


GATE = {"silu": F.silu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "none": lambda z: z}


def glu_chunk(x, w_gate_up, w_down, activation):
    w_gate, w_up = w_gate_up.chunk(2)
    return (GATE[activation](x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def glu_fused_product(x, w_gate_up, w_down, activation):
    """One product with the fused matrix, the output split; activations written out."""
    gate, up = F.linear(x, w_gate_up).split(w_gate_up.shape[0] // 2, dim=-1)
    if activation == "silu":
        gate = gate * torch.sigmoid(gate)
    elif activation == "gelu":
        gate = 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2)))
    elif activation == "sigmoid":
        gate = torch.sigmoid(gate)
    return F.linear(gate * up, w_down)


def glu_einsum(x, w_gate_up, w_down, activation):
    half = w_gate_up.shape[0] // 2
    both = torch.einsum("...d,fd->...f", x, w_gate_up)
    act = {"silu": F.silu, "gelu": F.gelu, "sigmoid": F.sigmoid}.get(activation, torch.clone)
    return torch.einsum("...f,df->...d", act(both[..., :half]) * both[..., half:], w_down)


@pytest.mark.parametrize("fn", [glu_chunk, glu_fused_product, glu_einsum])
def test_glu_accepts_every_correct_formulation(fn, capsys):
    check_glu_ffn(fn)
    assert "✅ glu_ffn is correct" in capsys.readouterr().out


def test_the_silu_reference_is_course_libs_swiglu_and_the_others_their_formula():
    gen = torch.Generator().manual_seed(0)
    x, w, d = torch.randn(2, 3, 8, generator=gen), torch.randn(24, 8, generator=gen), \
        torch.randn(8, 12, generator=gen)
    for activation in GATE:
        torch.testing.assert_close(ch12.reference_glu(x, w, d, activation),
                                   glu_chunk(x, w, d, activation))
    torch.testing.assert_close(ch12.reference_glu(x, w, d, "silu"),
                               swiglu(x, w[:12], w[12:], d))


def _glu(gate_of, *, swap=False, down=True, up=True, rows=None):
    def wrong(x, w_gate_up, w_down, activation):
        w_gate, w_up = rows(w_gate_up) if rows else w_gate_up.chunk(2)
        if swap:
            w_gate, w_up = w_up, w_gate
        gate = gate_of(activation)(x @ w_gate.T)
        hidden = gate * (x @ w_up.T) if up else gate
        return hidden @ w_down.T if down else hidden
    return wrong


@pytest.mark.parametrize("wrong, match", [
    (_glu(GATE.get, swap=True), "activation on the second half"),
    (_glu(GATE.get, rows=lambda w: (w[0::2], w[1::2])), "alternate rows"),
    (_glu(lambda a: F.silu), "uses SiLU whatever the activation"),
    (_glu(lambda a: (lambda z: F.gelu(z, approximate="tanh")) if a == "gelu" else GATE[a]),
     "tanh approximation"),
    (_glu(lambda a: F.silu if a == "sigmoid" else GATE[a]), "original GLU's gate is sigmoid"),
    (lambda x, gu, d, a: _glu(GATE.get, up=a != "none")(x, gu, d, a), "bilinear layer is"),
    (_glu(GATE.get, down=False), "down projection"),
    (_glu(GATE.get, up=False), "multiplies nothing"),
    (lambda x, gu, d, a: glu_chunk(x, gu, d, a) * 1.01, "wrong values"),
])
def test_glu_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_glu_ffn(wrong)


def test_glu_explains_the_weight_layout_when_the_learner_crashes():
    with pytest.raises(CheckFailure, match=r"(?s)raised RuntimeError.*out_features, in_features"):
        check_glu_ffn(lambda x, gu, d, a: (F.silu(x @ gu[:gu.shape[0] // 2]) * x) @ d)


# ---------------------------------------------------------------------- 12.2 the Llama block


def _rms(x, gain):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain


def block_sdpa(x, w, n_heads, n_kv_heads):
    """torch's fused pieces: F.rms_norm, SDPA with is_causal, apply_rope, index expansion."""
    b, t, d = x.shape
    dh = d // n_heads
    h = F.rms_norm(x, (d,), w["attn_norm"], eps=1e-6)
    q = F.linear(h, w["w_q"]).unflatten(-1, (n_heads, dh)).transpose(1, 2)
    k = F.linear(h, w["w_k"]).unflatten(-1, (n_kv_heads, dh)).transpose(1, 2)
    v = F.linear(h, w["w_v"]).unflatten(-1, (n_kv_heads, dh)).transpose(1, 2)
    index = torch.arange(n_heads) // (n_heads // n_kv_heads)
    k, v = apply_rope(k)[:, index], v[:, index]  # expanding after rotating is the same
    out = F.scaled_dot_product_attention(apply_rope(q), k, v, is_causal=True)
    x = x + F.linear(out.transpose(1, 2).reshape(b, t, d), w["w_o"])
    return x + swiglu(F.rms_norm(x, (d,), w["ff_norm"], eps=1e-6), w["w_gate"], w["w_up"],
                      w["w_down"])


def block_loops(x, w, n_heads, n_kv_heads):
    """Head by head, query head h reading kv head h // group; rotation after the expansion;
    float64 inside, a mask from torch.triu."""
    x64 = x.double()
    w = {k: v.double() for k, v in w.items()}
    b, t, d = x.shape
    dh, group = d // n_heads, n_heads // n_kv_heads
    h = _rms(x64, w["attn_norm"])
    q, k, v = h @ w["w_q"].T, h @ w["w_k"].T, h @ w["w_v"].T
    future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    heads = []
    for head in range(n_heads):
        kv = head // group
        qh = apply_rope(q[..., head * dh:(head + 1) * dh])
        kh = apply_rope(k[..., kv * dh:(kv + 1) * dh])
        scores = (qh @ kh.transpose(-2, -1) / dh ** 0.5).masked_fill(future, float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[..., kv * dh:(kv + 1) * dh])
    x64 = x64 + torch.cat(heads, dim=-1) @ w["w_o"].T
    h = _rms(x64, w["ff_norm"])
    x64 = x64 + (F.silu(h @ w["w_gate"].T) * (h @ w["w_up"].T)) @ w["w_down"].T
    return x64.float()


@pytest.mark.parametrize("fn", [block_sdpa, block_loops, block_variant, reference_block])
def test_llama_block_accepts_every_correct_formulation(fn, capsys):
    check_llama_block(fn)
    assert "✅ llama_block is correct on all 6 test cases" in capsys.readouterr().out


def test_the_written_out_block_is_course_libs_block():
    gen = torch.Generator().manual_seed(0)
    for n_heads, n_kv_heads in ((4, 2), (4, 1), (4, 4)):
        x = torch.randn(2, 6, 16, generator=gen)
        w = ch12._block_weights(gen, 16, n_heads, n_kv_heads, 24)
        torch.testing.assert_close(block_variant(x, w, n_heads, n_kv_heads),
                                   reference_block(x, w, n_heads, n_kv_heads))


def _wrong(**change):
    return lambda x, w, h, hkv: block_variant(x, w, h, hkv, **change)


@pytest.mark.parametrize("change, stage, match", [
    (dict(norm="layer"), "feed-forward half", "LayerNorm"),
    (dict(gain=False), "feed-forward half", "leave out their gains"),
    (dict(post_norm=True), "feed-forward half", "post-norm"),
    (dict(residual=False), "feed-forward half", "without adding x back"),
    (dict(swap_gate=True), "feed-forward half", "gate and up projections are swapped"),
    (dict(expand="tile"), "single position", "tiles the heads"),
    (dict(rotate=("q", "k", "v")), "over 6 positions", "rotates the values too"),
    (dict(rotate=("q",)), "over 6 positions", "queries but not the keys"),
    (dict(rotate=("k",)), "over 6 positions", "keys but not the queries"),
    (dict(rope="none"), "over 6 positions", "has no RoPE"),
    (dict(rope="halves"), "over 6 positions", "rotate_half layout"),
    (dict(rope="width"), "over 6 positions", "whole width"),
    (dict(mask="none"), "over 6 positions", "no causal mask"),
    (dict(mask="future"), "over 6 positions", r"wrong way round.*LATER positions"),
    (dict(swap_qk=True), "over 6 positions", "queries and the keys are swapped"),
    (dict(scale_by="d_model"), "over 6 positions", r"sqrt\(D\)"),
    (dict(scale_by="d_head_itself"), "over 6 positions", r"divided by Dh: .*sqrt\(Dh\)"),
    (dict(scale_by="none"), "over 6 positions", "not scaled"),
    (dict(norm="sum"), "feed-forward half", r"SUM\(x\^2\).*MEAN of the squares"),
    (dict(norm="no_sqrt"), "feed-forward half", "without the square root"),
])
def test_llama_block_names_the_part_and_the_mistake(change, stage, match):
    with pytest.raises(CheckFailure, match=rf"(?s){match}.*{stage}") as info:
        check_llama_block(_wrong(**change))
    if change != dict(scale_by="d_model"):  # sqrt(D) is named for that mistake only
        assert "sqrt(D)" not in str(info.value)


def test_the_first_attention_cases_tell_the_head_sizes_apart():
    """D_h, H and sqrt(D) all differ where attention is first graded, so that a division by
    D_h is not blamed as one by sqrt(D) and a split as (D_h, H) cannot pass."""
    for case in ch12._block_cases(seed=122)[1:3]:
        x, _, n_heads, _ = case.args
        d_model = x.shape[-1]
        d_head = d_model // n_heads
        assert len({d_head, n_heads, math.sqrt(d_model)}) == 3


def test_a_head_split_as_dh_by_h_is_refused_with_the_split_named():
    def split_dh_h(x, w, n_heads, n_kv_heads):
        b, t, d = x.shape
        dh = d // n_heads
        h = _rms(x, w["attn_norm"])
        q, k, v = (F.linear(h, w[name]).view(b, t, dh, -1).transpose(1, 2)  # (B, Dh, T, n)
                   for name in ("w_q", "w_k", "w_v"))
        group = n_heads // n_kv_heads
        k, v = apply_rope(k).repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(apply_rope(q), k, v, is_causal=True)
        x = x + out.transpose(1, 2).reshape(b, t, d) @ w["w_o"].T
        return x + swiglu(_rms(x, w["ff_norm"]), w["w_gate"], w["w_up"], w["w_down"])

    with pytest.raises(CheckFailure, match=r"(?s)raised RuntimeError.*as \(heads, Dh\): "
                                           r"view\(B, T, n, Dh\)"):
        check_llama_block(split_dh_h)
    with pytest.raises(CheckFailure, match=r"heads are split as \(Dh, H\)"):  # with H = Hkv
        check_llama_block(lambda x, w, h, hkv: block_variant(x, w, h, hkv, split="dh_h")
                          if h == hkv else reference_block(x, w, h, hkv))


@pytest.mark.parametrize("index", range(len(BLOCK_MISTAKES)))
def test_every_block_mistake_is_refused(index):
    with pytest.raises(CheckFailure):
        check_llama_block(BLOCK_MISTAKES[index].wrong)


def test_llama_block_says_where_an_unknown_mistake_shows():
    def off_when_attention_runs(x, w, h, hkv):  # an unrecognised slip in attention only
        return block_variant(x, w, h, hkv) + 0.01 * (w["w_o"].abs().sum() > 0)
    with pytest.raises(CheckFailure, match=r"right shape but wrong values \(case 'the norms"):
        check_llama_block(lambda x, w, h, hkv: block_variant(x, w, h, hkv) * 1.01)
    with pytest.raises(CheckFailure, match=r"wrong values \(case 'attention at a single"):
        check_llama_block(off_when_attention_runs)


def test_llama_block_reports_a_crash_with_the_weight_layout_hint():
    def no_expansion(x, w, n_heads, n_kv_heads):  # forgets to share the kv heads
        return block_variant(x, w, n_heads, n_heads)
    with pytest.raises(CheckFailure, match=r"(?s)raised .*Hkv \* Dh rows"):
        check_llama_block(no_expansion)


def test_llama_block_refuses_a_tuple():
    with pytest.raises(CheckFailure, match="not a tuple"):
        check_llama_block(lambda x, w, h, hkv: (block_variant(x, w, h, hkv), None))


# ----------------------------------------------------------- 12.3 sequences that fit on one GPU

PER_TOKEN = 2 * 28 * 4 * (3584 // 28) * torch.bfloat16.itemsize  # Qwen2.5 7B's config.json
GPU, WEIGHTS, CONTEXT = 80 * 2**30, 2 * 7_615_616_512, 32768
RIGHT = {"bytes_per_token": PER_TOKEN, "max_sequences": (GPU - WEIGHTS) // (PER_TOKEN * CONTEXT),
         "max_sequences_mha": (GPU - WEIGHTS) // (7 * PER_TOKEN * CONTEXT)}


def test_the_parameter_count_is_qwen25_7b_from_its_config():
    """vocab 152,064, hidden 3,584, 28 layers, 28 query and 4 key/value heads of 128, MLP
    18,944, biases on q, k and v only, untied embeddings: the published 7,615,616,512."""
    d, kv, ff, vocab = 3584, 4 * 128, 18944, 152064
    layer = (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * ff + 2 * d
    assert 28 * layer + d + 2 * vocab * d == ch12.QWEN25_7B_PARAMETERS
    assert ch12.mha_parameters() - ch12.QWEN25_7B_PARAMETERS == 28 * 2 * (d - kv) * (d + 1)


@pytest.mark.parametrize("answer", [RIGHT, {k: np.int64(v) for k, v in RIGHT.items()},
                                    {k: np.uint64(v) for k, v in RIGHT.items()},
                                    {**RIGHT, "notes": "the weights first"}])
def test_the_capacity_prediction_accepts_the_right_numbers_and_shows_the_measurement(answer,
                                                                                    capsys):
    assert RIGHT["max_sequences"] == 37 and RIGHT["max_sequences_mha"] == 5
    check_capacity_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "56 KiB" in out and "37 sequences fit" in out and "28 key/value heads, 5" in out
    assert "still leave room for 5" in out
    assert "cache.nbytes = 3,840 bytes" in out and "= 3,840 bytes" in out


@pytest.mark.parametrize("per_token, match", [
    (PER_TOKEN // 2, r"keys AND values.*or counted 1 byte"),
    (PER_TOKEN * 7, r"28 query heads.*hidden_size / num_key_value_heads"),
    (PER_TOKEN // 28, "forgot the layers"),
    (PER_TOKEN * 2, "4 bytes per element"),
    (PER_TOKEN * 8, "bits"),
    (PER_TOKEN // 128, "forgot the head dimension"),
    (PER_TOKEN * 28, "hidden_size numbers per key/value head"),
    (PER_TOKEN + 1, r"count 2 \(keys and values\)"),
])
def test_the_capacity_prediction_names_the_per_token_mistake(per_token, match):
    with pytest.raises(CheckFailure, match=match):
        check_capacity_prediction(lambda: {**RIGHT, "bytes_per_token": per_token})


@pytest.mark.parametrize("key, value, match", [
    ("max_sequences", 45, "forgot the weights"),
    ("max_sequences", 34, r"80 x 10\^9"),
    ("max_sequences", 29, "4 bytes a parameter"),
    ("max_sequences", 38, "rounded up"),
    ("max_sequences", 37 * 32768, "tokens, not the number of sequences"),
    ("max_sequences", 12, "subtract the weights' bytes"),
    ("max_sequences_mha", 37, "kept 4 key/value heads"),
    ("max_sequences_mha", 6, "forgot the weights.* or rounded up"),
    ("max_sequences_mha", 4, r"80 x 10\^9.* or counted the weights at 4 bytes"),
    ("max_sequences_mha", 1, "redo max_sequences with 28 key/value heads"),
])
def test_the_capacity_prediction_names_the_fit_mistake(key, value, match):
    with pytest.raises(CheckFailure, match=match):
        check_capacity_prediction(lambda: {**RIGHT, key: value})


@pytest.mark.parametrize("answer, match", [
    (PER_TOKEN, "should return a dict"),
    ({"bytes_per_token": PER_TOKEN}, "lacks the key"),
    ({**RIGHT, "bytes_per_token": 1.5}, "'bytes_per_token' should be a whole"),
    ({k: float(v) for k, v in RIGHT.items()}, r"return an int.*int\(\.\.\.\)"),
    ({k: np.float64(v) for k, v in RIGHT.items()}, r"return an int.*int\(\.\.\.\)"),
    ({k: torch.tensor(v) for k, v in RIGHT.items()}, r"return an int.*\.item\(\)"),
    ({**RIGHT, "max_sequences": True}, "should be a whole number"),
])
def test_the_capacity_prediction_rejects_malformed_answers(answer, match):
    with pytest.raises(CheckFailure, match=match):
        check_capacity_prediction(lambda: answer)


# ---------------------------------------------------------------------- 12.4 the RoPE bug


def rope_stack(x, positions=None, base=10000.0):
    d = x.shape[-1]
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    theta = base ** (-torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * theta
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * angles.cos() - odd * angles.sin(),
                        even * angles.sin() + odd * angles.cos()), dim=-1).flatten(-2)


def rope_complex(x, positions=None, base=10000.0):
    """Meta's formulation: pairs as complex numbers, multiplied by e^(i p theta)."""
    d = x.shape[-1]
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    theta = base ** (-torch.arange(0, d, 2).double() / d)
    turn = torch.polar(torch.ones(len(positions), d // 2, dtype=torch.float64),
                       positions.double()[:, None] * theta)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def rope_library(x, positions=None, base=10000.0):
    return apply_rope(x, positions, base=base)


@pytest.mark.parametrize("fn", [rope_stack, rope_complex, rope_library])
def test_fixed_rope_accepts_every_correct_formulation(fn, capsys):
    check_fixed_rope(fn)
    assert "relative-position property and equality" in capsys.readouterr().out


def rope_backwards(x, positions=None, base=10000.0):
    return rope_stack(x, -(torch.arange(x.shape[-2]) if positions is None else positions), base)


def rope_squared_positions(x, positions=None, base=10000.0):
    """Turns by p^2 theta: a rotation, but the score then depends on more than the offset."""
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    return rope_stack(x, positions * positions, base)


def rope_halves(x, positions=None, base=10000.0):
    """A learner who "fixes" the pairs into Hugging Face's layout: i with i + Dh/2."""
    d = x.shape[-1]
    positions = torch.arange(x.shape[-2]) if positions is None else positions
    angles = positions.float()[:, None] * base ** (-torch.arange(0, d, 2).float() / d)
    first, second = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((first * angles.cos() - second * angles.sin(),
                      first * angles.sin() + second * angles.cos()), dim=-1)


def rope_twice_doubled(x, positions=None, base=10000.0):
    return rope_stack(x, positions, base ** 2)  # base^(-2 * 2i/Dh): both fixes at once


@pytest.mark.parametrize("wrong, match", [
    (buggy_rope, r"planted bug is still there.*equality with course_lib's apply_rope"),
    (rope_twice_doubled, r"doubled twice.*first_divergence"),
    (rope_backwards, r"turns the other way.*first_divergence"),
    (lambda x, positions=None, base=10000.0: rope_stack(x, positions, base) * 2, "length"),
    (rope_squared_positions, "relative-position property test fails"),
    (lambda x, positions=None, base=10000.0: rope_stack(x, positions, base ** 0.5),
     "planted bug is still there"),
    (rope_halves, r"rotate_half.*the bug is elsewhere"),
])
def test_fixed_rope_names_the_mistake_and_the_instrument(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_fixed_rope(wrong)


def test_the_buggy_rope_is_apply_rope_at_the_square_root_of_its_base():
    # base^(-i/Dh) = (base^(1/2))^(-2i/Dh): the bug is RoPE with another base, a valid rotation
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(buggy_rope(x), apply_rope(x, base=10000.0 ** 0.5))
    assert not torch.allclose(buggy_rope(x), apply_rope(x))
    torch.testing.assert_close(buggy_rope(x)[..., :2], apply_rope(x)[..., :2])  # pair 0 agrees
