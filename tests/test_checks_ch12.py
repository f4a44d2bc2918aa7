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
    check_fixed_rope,
    check_kv_cache_prediction,
    check_llama_block,
    check_swiglu,
    reference_block,
)
from course_lib.positions import apply_rope


@pytest.mark.parametrize("check", [check_swiglu, check_llama_block, check_kv_cache_prediction,
                                   check_fixed_rope])
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


# ------------------------------------------------------------------------------ 12.1 SwiGLU


def swiglu(x, w_gate, w_up, w_down):
    return (F.silu(x @ w_gate.T) * (x @ w_up.T)) @ w_down.T


def swiglu_linear_sigmoid(x, w_gate, w_up, w_down):
    """F.linear and silu written out as z * sigmoid(z)."""
    gate = F.linear(x, w_gate)
    return F.linear(gate * torch.sigmoid(gate) * F.linear(x, w_up), w_down)


def swiglu_einsum(x, w_gate, w_up, w_down):
    gate, up = torch.einsum("...d,fd->...f", x, w_gate), torch.einsum("...d,fd->...f", x, w_up)
    return torch.einsum("...f,df->...d", F.silu(gate) * up, w_down)


@pytest.mark.parametrize("fn", [swiglu, swiglu_linear_sigmoid, swiglu_einsum])
def test_swiglu_accepts_every_correct_formulation(fn, capsys):
    check_swiglu(fn)
    assert "✅ swiglu is correct" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, match", [
    (lambda x, g, u, d: (F.silu(x @ u.T) * (x @ g.T)) @ d.T, "SiLU on the up branch"),
    (lambda x, g, u, d: (F.gelu(x @ g.T) * (x @ u.T)) @ d.T, "uses GELU"),
    (lambda x, g, u, d: (F.relu(x @ g.T) * (x @ u.T)) @ d.T, "uses ReLU"),
    (lambda x, g, u, d: (torch.sigmoid(x @ g.T) * (x @ u.T)) @ d.T, "original GLU"),
    (lambda x, g, u, d: F.silu(x @ g.T) * (x @ u.T), "down projection"),
    (lambda x, g, u, d: F.silu(x @ g.T) @ d.T, "multiplies nothing"),
    (lambda x, g, u, d: (F.silu(x @ g.T) * (x @ u.T)) @ d.T * 1.01, "wrong values"),
])
def test_swiglu_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_swiglu(wrong)


def test_swiglu_explains_the_weight_layout_when_the_learner_crashes():
    with pytest.raises(CheckFailure, match=r"(?s)raised RuntimeError.*out_features, in_features"):
        check_swiglu(lambda x, g, u, d: (F.silu(x @ g) * (x @ u)) @ d)


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


# --------------------------------------------------------------------- 12.3 the KV-cache bytes

PER_TOKEN = 2 * 28 * 4 * (3584 // 28) * torch.bfloat16.itemsize  # Qwen2.5 7B's config.json
RIGHT = {"bytes_per_token": PER_TOKEN, "bytes_for_the_batch": PER_TOKEN * 32768 * 8}


@pytest.mark.parametrize("answer", [RIGHT, {k: np.int64(v) for k, v in RIGHT.items()},
                                    {k: np.uint64(v) for k, v in RIGHT.items()},
                                    {**RIGHT, "notes": "7 times less than with 28 kv heads"}])
def test_the_kv_prediction_accepts_the_right_numbers_and_shows_the_measurement(answer, capsys):
    check_kv_cache_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "56 KiB" in out and "14 GiB" in out and "7 times" in out
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
def test_the_kv_prediction_names_the_per_token_mistake(per_token, match):
    answer = {"bytes_per_token": per_token, "bytes_for_the_batch": per_token * 32768 * 8}
    with pytest.raises(CheckFailure, match=match):
        check_kv_cache_prediction(lambda: answer)


@pytest.mark.parametrize("batch, match", [
    (PER_TOKEN * 32768, "forgot the batch"),
    (PER_TOKEN * 8, "forgot the context"),
    (14, "GiB, not bytes"),
    (14 * 1024, "MiB, not bytes"),
    (PER_TOKEN * 32000 * 8, "32,000"),
    (123, "multiply the bytes per token"),
])
def test_the_kv_prediction_names_the_batch_mistake(batch, match):
    with pytest.raises(CheckFailure, match=match):
        check_kv_cache_prediction(lambda: {"bytes_per_token": PER_TOKEN,
                                           "bytes_for_the_batch": batch})


@pytest.mark.parametrize("answer, match", [
    (PER_TOKEN, "should return a dict"),
    ({"bytes_per_token": PER_TOKEN}, "lacks the key"),
    ({"bytes_per_token": 1.5, "bytes_for_the_batch": 1}, "'bytes_per_token' should be a whole"),
    ({k: float(v) for k, v in RIGHT.items()}, r"return an int.*int\(\.\.\.\)"),
    ({k: np.float64(v) for k, v in RIGHT.items()}, r"return an int.*int\(\.\.\.\)"),
    ({k: torch.tensor(v) for k, v in RIGHT.items()}, r"return an int.*\.item\(\)"),
    ({"bytes_per_token": True, "bytes_for_the_batch": 1}, "should be a whole number"),
])
def test_the_kv_prediction_rejects_malformed_answers(answer, match):
    with pytest.raises(CheckFailure, match=match):
        check_kv_cache_prediction(lambda: answer)


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
