"""The chapter 12 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch12 import (
    buggy_rope,
    check_expand_kv,
    check_fixed_rope,
    check_kv_cache_prediction,
    check_swiglu,
)
from course_lib.positions import apply_rope


@pytest.mark.parametrize("check", [check_swiglu, check_expand_kv, check_kv_cache_prediction,
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


# ---------------------------------------------------------------------- 12.2 the kv expansion


def expand_interleave(kv, n_heads):
    return kv.repeat_interleave(n_heads // kv.shape[1], dim=1)


def expand_broadcast(kv, n_heads):
    b, hkv, s, d = kv.shape
    return kv[:, :, None].expand(b, hkv, n_heads // hkv, s, d).reshape(b, n_heads, s, d)


def expand_index(kv, n_heads):
    group = n_heads // kv.shape[1]
    return kv[:, torch.arange(n_heads) // group]


def expand_loop(kv, n_heads):
    group = n_heads // kv.shape[1]
    return torch.stack([kv[:, h // group] for h in range(n_heads)], dim=1)


@pytest.mark.parametrize("fn", [expand_interleave, expand_broadcast, expand_index, expand_loop])
def test_expand_kv_accepts_every_correct_formulation(fn, capsys):
    check_expand_kv(fn)
    assert "inside grouped-query attention" in capsys.readouterr().out


@pytest.mark.parametrize("wrong, match", [
    (lambda kv, h: kv.repeat(1, h // kv.shape[1], 1, 1), r"tiles the key/value heads.*h % Hkv"),
    (lambda kv, h: kv.repeat_interleave(h // kv.shape[1], dim=2), "along the positions"),
    (lambda kv, h: kv.repeat_interleave(h // kv.shape[1], dim=-1), "head dimension Dh"),
    (lambda kv, h: torch.cat([kv[:, :1]] * h, dim=1), "wrong values"),
    (lambda kv, h: kv, "shape"),
])
def test_expand_kv_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_expand_kv(wrong)


# --------------------------------------------------------------------- 12.3 the KV-cache bytes

RIGHT = {"bytes_per_token": 131_072, "bytes_for_the_batch": 4 * 2**30}


@pytest.mark.parametrize("answer", [RIGHT, {k: np.int64(v) for k, v in RIGHT.items()},
                                    {"bytes_per_token": 2 * 32 * 8 * 128 * 2,
                                     "bytes_for_the_batch": 2 * 32 * 8 * 128 * 2 * 8192 * 4}])
def test_the_kv_prediction_accepts_the_right_numbers_and_shows_the_measurement(answer, capsys):
    check_kv_cache_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "128 KiB" in out and "4 GiB" in out
    assert "cache.nbytes = 3,840 bytes" in out and "= 3,840 bytes" in out


@pytest.mark.parametrize("per_token, match", [
    (65_536, r"keys AND values.*or counted 1 byte"),
    (524_288, "32 query heads"),
    (4_096, "forgot the layers"),
    (262_144, "4 bytes per element"),
    (1_048_576, "bits"),
    (1_024, "head dimension"),
    (131_000, r"count 2 \(keys and values\)"),
])
def test_the_kv_prediction_names_the_per_token_mistake(per_token, match):
    answer = {"bytes_per_token": per_token, "bytes_for_the_batch": per_token * 8192 * 4}
    with pytest.raises(CheckFailure, match=match):
        check_kv_cache_prediction(lambda: answer)


@pytest.mark.parametrize("batch, match", [
    (131_072 * 8192, "forgot the batch"),
    (131_072 * 4, "forgot the context"),
    (4, "GiB, not bytes"),
    (123, "multiply the bytes per token"),
])
def test_the_kv_prediction_names_the_batch_mistake(batch, match):
    with pytest.raises(CheckFailure, match=match):
        check_kv_cache_prediction(lambda: {"bytes_per_token": 131_072,
                                           "bytes_for_the_batch": batch})


@pytest.mark.parametrize("answer, match", [
    (131_072, "should return a dict"),
    ({"bytes_per_token": 131_072}, "lacks the key"),
    ({"bytes_per_token": 1.5, "bytes_for_the_batch": 1}, "'bytes_per_token' should be a whole"),
    ({k: float(v) for k, v in RIGHT.items()}, r"return an int.*int\(\.\.\.\)"),
    ({k: torch.tensor(v) for k, v in RIGHT.items()}, r"return an int.*\.item\(\)"),
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


@pytest.mark.parametrize("wrong, match", [
    (buggy_rope, r"planted bug is still there.*equality with course_lib's apply_rope"),
    (rope_backwards, r"turns the other way.*first_divergence"),
    (lambda x, positions=None, base=10000.0: rope_stack(x, positions, base) * 2, "length"),
    (rope_squared_positions, "relative-position property test fails"),
    (lambda x, positions=None, base=10000.0: rope_stack(x, positions, base ** 0.5),
     "frequencies"),
])
def test_fixed_rope_names_the_mistake_and_the_instrument(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_fixed_rope(wrong)


def test_the_buggy_rope_is_a_valid_rotation_in_another_layout():
    x = torch.randn(3, 8)
    halves = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)  # interleaved -> halves
    back = buggy_rope(halves)
    torch.testing.assert_close(torch.stack(back.chunk(2, dim=-1), dim=-1).flatten(-2),
                               apply_rope(x))
