"""The chapter 03 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself.

The wrong answers are written the way a learner would write them, independently of the
misconceptions inside the checks."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import stub

from course_lib import positions
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch03 import (
    check_alibi_bias,
    check_alibi_slopes,
    check_apply_rope,
    check_by_parts_frequencies,
    check_fixed_rope,
    check_shift_predictions,
    check_sinusoidal_encoding,
    check_value_routes,
    measure_shifted_weights,
    measure_value_routes,
)

# ------------------------------------------------------------------- 3.1 sinusoidal_encoding


def pe_loop(n_positions, d_model):
    pe = torch.zeros(n_positions, d_model)
    for p in range(n_positions):
        for i in range(d_model // 2):
            angle = p / 10000 ** (2 * i / d_model)
            pe[p, 2 * i] = math.sin(angle)
            pe[p, 2 * i + 1] = math.cos(angle)
    return pe


def pe_vectorised(n_positions, d_model):
    """The 'Annotated Transformer' formulation: frequencies through exp and log."""
    position = torch.arange(n_positions).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
    pe = torch.zeros(n_positions, d_model)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe


def pe_stack_float64(n_positions, d_model):
    i = torch.arange(d_model // 2, dtype=torch.float64)
    angles = torch.arange(n_positions, dtype=torch.float64)[:, None] / 10000 ** (2 * i / d_model)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).reshape(n_positions, d_model)


@pytest.mark.parametrize("fn", [pe_loop, pe_vectorised, pe_stack_float64])
def test_sinusoidal_encoding_accepts_correct_answers(fn, capsys):
    check_sinusoidal_encoding(fn)
    assert "sinusoidal_encoding is correct" in capsys.readouterr().out


def _pe_with(n, d, *, freq=None, first="sin", layout="interleaved", start=0, op="divide"):
    """A configurable wrong sinusoidal encoding built the way a learner might."""
    p = torch.arange(start, start + n, dtype=torch.float32)[:, None]
    two_i = torch.arange(0, d, 2, dtype=torch.float32)  # the values 2i
    freq = (lambda two_i, d: 10000 ** (two_i / d)) if freq is None else freq
    angles = p * freq(two_i, d) if op == "multiply" else p / freq(two_i, d)
    sin, cos = angles.sin(), angles.cos()
    if first == "cos":
        sin, cos = cos, sin
    if first == "sin-only":
        cos = sin
    if layout == "halves":
        return torch.cat((sin, cos), dim=-1)
    pe = torch.zeros(n, d)
    pe[:, 0::2], pe[:, 1::2] = sin, cos
    return pe


def pe_per_dimension(n, d):
    p = torch.arange(n, dtype=torch.float32)[:, None]
    angles = p / 10000 ** (torch.arange(d, dtype=torch.float32) / d)  # dimension j, not 2i
    pe = angles.sin()
    pe[:, 1::2] = angles[:, 1::2].cos()
    return pe


WRONG_PE = {
    "sin and cos swapped": (lambda n, d: _pe_with(n, d, first="cos"), "swapped"),
    "halves, not interleaved": (lambda n, d: _pe_with(n, d, layout="halves"), "interleaved"),
    "exponent i/d": (lambda n, d: _pe_with(n, d, freq=lambda two_i, d: 10000 ** (two_i / 2 / d)),
                     "too slowly"),
    "2 * arange(0, d, 2)": (lambda n, d: _pe_with(n, d, freq=lambda two_i, d:
                                                   10000 ** (2 * two_i / d)), "too fast"),
    "frequency per dimension": (pe_per_dimension, "same frequency"),
    "positions from 1": (lambda n, d: _pe_with(n, d, start=1), "start at 1"),
    "multiplied by the frequency": (lambda n, d: _pe_with(n, d, op="multiply"), "multiplied"),
    "sines only": (lambda n, d: _pe_with(n, d, first="sin-only"), "cosine"),
    "base 1000": (lambda n, d: _pe_with(n, d, freq=lambda two_i, d: 1000 ** (two_i / d)),
                  "check the base"),
    "transposed": (lambda n, d: pe_loop(n, d).T, r"rows should be positions"),
    "no return": (lambda n, d: None, "forget to return"),
}


@pytest.mark.parametrize("name", list(WRONG_PE))
def test_sinusoidal_encoding_rejects_misconceptions(name):
    fn, message = WRONG_PE[name]
    with pytest.raises(CheckFailure, match=message):
        check_sinusoidal_encoding(fn)


def test_sinusoidal_encodingstub_propagates():
    with pytest.raises(NotImplementedError):
        check_sinusoidal_encoding(stub)


# ------------------------------------------------------------------------- 3.2 alibi_bias


def alibi_loop(n, n_heads):
    bias = torch.zeros(n_heads, n, n)
    for h in range(n_heads):
        slope = 2 ** (-8 * (h + 1) / n_heads)
        for i in range(n):
            for j in range(n):
                bias[h, i, j] = -slope * abs(i - j)
    return bias


def alibi_vectorised(n, n_heads):
    start = 2 ** (-8 / n_heads)
    slopes = start ** torch.arange(1, n_heads + 1)  # (H,) geometric sequence
    pos = torch.arange(n)
    distance = (pos[:, None] - pos[None, :]).abs()  # (n, n)
    return -slopes[:, None, None] * distance


def alibi_library(n, n_heads):
    return positions.alibi_bias(n, n_heads=n_heads)


@pytest.mark.parametrize("fn", [alibi_loop, alibi_vectorised, alibi_library])
def test_alibi_bias_accepts_correct_answers(fn, capsys):
    check_alibi_bias(fn)
    assert "alibi_bias is correct" in capsys.readouterr().out


def _alibi_with(n, n_heads, *, slopes=None, distance="abs", sign=-1.0, divide=False):
    h = torch.arange(1, n_heads + 1, dtype=torch.float32)
    m = 2 ** (-8 * h / n_heads) if slopes is None else slopes(h, n_heads)
    pos = torch.arange(n, dtype=torch.float32)
    diff = pos[:, None] - pos[None, :]
    dist = {"abs": diff.abs(), "i-j": diff, "j-i": -diff}[distance]
    if divide:
        return sign * dist / m[:, None, None]
    return sign * m[:, None, None] * dist


WRONG_ALIBI = {
    "positive": (lambda n, H: _alibi_with(n, H, sign=1.0), "positive"),
    "i - j without abs": (lambda n, H: _alibi_with(n, H, distance="i-j"), "absolute value"),
    "j - i without abs": (lambda n, H: _alibi_with(n, H, distance="j-i"), "absolute value"),
    "slopes reversed": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: 2 ** (-8 * (H + 1 - h)
                                                                                   / H)),
                        "reverse order"),
    "range(H) exponent": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: 2 ** (-8 * (h - 1)
                                                                                     / H)),
                          "off by one"),
    "exponent h + 1": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: 2 ** (-8 * (h + 1) / H)),
                       "off by one"),
    "slopes 2^-h": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: 2 ** -h), "depends on H"),
    "linear slopes": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: h * 2 ** (-8 / H)),
                      "geometric"),
    "no slopes": (lambda n, H: _alibi_with(n, H, slopes=lambda h, H: torch.ones_like(h)),
                  "same bias"),
    "divided by the slope": (lambda n, H: _alibi_with(n, H, divide=True), "divided"),
    "heads last": (lambda n, H: alibi_loop(n, H).permute(1, 2, 0), "heads last"),
    "no head dimension for H=1": (lambda n, H: alibi_loop(n, H).squeeze(0), "head dimension"),
}


@pytest.mark.parametrize("name", list(WRONG_ALIBI))
def test_alibi_bias_rejects_misconceptions(name):
    fn, message = WRONG_ALIBI[name]
    with pytest.raises(CheckFailure, match=message):
        check_alibi_bias(fn)


def test_alibi_biasstub_propagates():
    with pytest.raises(NotImplementedError):
        check_alibi_bias(stub)


# ------------------------------------------------------------------------- 3.3 apply_rope


def rope_loop(x, positions):
    """Rotate each pair of each row with an explicit 2 x 2 matrix."""
    d = x.shape[-1]
    out = x.clone()
    for t in range(x.shape[-2]):
        for i in range(d // 2):
            angle = float(positions[t]) * 10000 ** (-2 * i / d)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[..., t, 2 * i], x[..., t, 2 * i + 1]
            out[..., t, 2 * i] = a * c - b * s
            out[..., t, 2 * i + 1] = a * s + b * c
    return out


def rope_complex(x, positions):
    """Pairs as complex numbers, rotated by multiplying with e^(i angle)."""
    d = x.shape[-1]
    theta = 10000 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    angles = positions.double()[:, None] * theta  # (T, d/2)
    z = torch.view_as_complex(x.double().reshape(*x.shape[:-1], d // 2, 2).contiguous())
    rotated = z * torch.polar(torch.ones_like(angles), angles)
    return torch.view_as_real(rotated).reshape(x.shape).to(x.dtype)


def rope_vectorised(x, positions):
    d = x.shape[-1]
    theta = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * theta  # (T, d/2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


@pytest.mark.parametrize("fn", [rope_loop, rope_complex, rope_vectorised])
def test_apply_rope_accepts_correct_answers(fn, capsys):
    check_apply_rope(fn)
    assert "apply_rope is correct" in capsys.readouterr().out


def _rope_with(x, positions, *, sign=1.0, freq=None, layout="adjacent"):
    d = x.shape[-1]
    two_i = torch.arange(0, d, 2).float()
    theta = 10000 ** (-two_i / d) if freq is None else freq(two_i, d)
    angles = sign * positions.float()[:, None] * theta
    cos, sin = angles.cos(), angles.sin()
    if layout == "halves":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def rope_ignores_positions(x, positions):
    return _rope_with(x, torch.arange(x.shape[-2]))


def rope_2d_only(x, positions):
    d = x.shape[-1]
    theta = 10000 ** (-torch.arange(0, d, 2).float() / d)
    angles = positions.float()[:, None] * theta
    a, b = x[:, 0::2], x[:, 1::2]  # works for (T, d) only
    return torch.stack((a * angles.cos() - b * angles.sin(), a * angles.sin() + b * angles.cos()),
                       dim=-1).flatten(-2)


def rope_in_place(x, positions):
    out = rope_vectorised(x, positions)
    x.mul_(2.0)  # scribbles on the caller's tensor
    return out


WRONG_ROPE = {
    "wrong direction": (lambda x, p: _rope_with(x, p, sign=-1.0), "wrong way"),
    "rotate half": (lambda x, p: _rope_with(x, p, layout="halves"), "adjacent"),
    "exponent i/d": (lambda x, p: _rope_with(x, p, freq=lambda two_i, d: 10000 ** (-two_i / 2 / d)),
                     "rotation speeds are off"),
    "exponent 4i/d": (lambda x, p: _rope_with(x, p, freq=lambda two_i, d: 10000 ** (-2 * two_i / d)),
                      "rotation speeds are off"),
    "same speed": (lambda x, p: _rope_with(x, p, freq=lambda two_i, d: torch.ones_like(two_i)),
                   "same speed"),
    "ignores positions": (rope_ignores_positions, "ignored the positions"),
    "positions 1..T": (lambda x, p: _rope_with(x, torch.arange(1, x.shape[-2] + 1)),
                       "positions 1 .. T"),
    "2-D only": (rope_2d_only, "leading dimensions"),
    "in place": (rope_in_place, "in place"),
}


@pytest.mark.parametrize("name", list(WRONG_ROPE))
def test_apply_rope_rejects_misconceptions(name):
    fn, message = WRONG_ROPE[name]
    with pytest.raises(CheckFailure, match=message):
        check_apply_rope(fn)


def test_apply_ropestub_propagates():
    with pytest.raises(NotImplementedError):
        check_apply_rope(stub)


# ------------------------------------------------------- 3.3 find the bug: a fixed apply_rope


def rope_planted_bug(x, positions):
    """The exercise's broken function: + instead of - makes each 2 x 2 matrix a non-rotation."""
    d = x.shape[-1]
    theta = 10000 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * theta
    cos, sin = torch.cos(angles), torch.sin(angles)
    first, second = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((first * cos + second * sin, first * sin + second * cos), dim=-1)
    return rotated.flatten(-2)


def rope_rotate_half_sign(x, positions):
    """The same sign slip written the Hugging Face way, x cos + rotate_half(x) sin."""
    d = x.shape[-1]
    theta = 10000 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = (positions.float()[:, None] * theta).repeat_interleave(2, dim=-1)  # (T, d)
    swapped = torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # no minus sign
    return x * angles.cos() + swapped * angles.sin()


def rope_cos_only(x, positions):
    """Scales each pair by cos a without the sin terms: lengths change, scores not relative."""
    d = x.shape[-1]
    theta = 10000 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = (positions.float()[:, None] * theta).repeat_interleave(2, dim=-1)
    return x * angles.cos()


@pytest.mark.parametrize("fn", [rope_vectorised, rope_complex, rope_loop])
def test_fixed_rope_accepts_every_correct_fix(fn, capsys):
    check_fixed_rope(fn)
    out = capsys.readouterr().out
    assert "relative-position test passes" in out and "apply_rope is correct" in out


WRONG_FIXES = {
    "the planted bug, unfixed": (rope_planted_bug, "relative-position test fails"),
    "the same slip via rotate_half": (rope_rotate_half_sign, "relative-position test fails"),
    "cos only": (rope_cos_only, "relative-position test fails"),
    # relative but not the course's rotation: the comparison with the reference finds these
    "rotated the wrong way": (lambda x, p: _rope_with(x, p, sign=-1.0),
                              r"wrong way(.|\n)*comparing your function with course_lib"),
    "rotate-half layout": (lambda x, p: _rope_with(x, p, layout="halves"), "adjacent"),
    "returns nothing": (lambda x, p: None, "must return a tensor"),
}


@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_fixed_rope_rejects_wrong_fixes(name):
    fn, message = WRONG_FIXES[name]
    with pytest.raises(CheckFailure, match=message):
        check_fixed_rope(fn)


def test_fixed_rope_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_fixed_rope(stub)


# ----------------------------------------- 3.4 predict then verify: which values see position


def test_value_routes_measurement_separates_the_routes():
    spread = measure_value_routes()
    assert spread["input"] > 1e-2 and spread["qkv"] > 1e-2
    assert spread["alibi"] < 1e-5 and spread["rope"] < 1e-5


@pytest.mark.parametrize("answer", [{"input", "qkv"}, ["qkv", "input"], ("Input", "QKV")])
def test_value_routes_accepts_the_right_prediction_in_any_form(answer, capsys):
    check_value_routes(lambda: answer)
    out = capsys.readouterr().out
    assert "right" in out and "rope:" in out  # the measurement is shown too


WRONG_ROUTES = {
    "RoPE rotates the values too": ({"input", "qkv", "rope"}, "values are not rotated"),
    "ALiBi changes the values": ({"input", "qkv", "alibi"}, "only adds a number"),
    "the input route spares v": ({"qkv"}, "passes through W_v"),
    "lecture 9 adds to q and k only": ({"input"}, "adds p_i to v_i"),
    "nothing depends": (set(), "passes through W_v"),
    "an unknown name": ({"input", "sinusoidal"}, "not a route name"),
    "not a collection": (3, "set of route names"),
}


@pytest.mark.parametrize("name", list(WRONG_ROUTES))
def test_value_routes_rejects_wrong_predictions(name):
    answer, message = WRONG_ROUTES[name]
    with pytest.raises(CheckFailure, match=message):
        check_value_routes(lambda: answer)


def test_value_routes_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_value_routes(stub)


# ------------------------------------------------------------- 3.5 by_parts_frequencies


def by_parts_where(d_head, factor, trained_length, base):
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)  # (d/2,)
    full_turn = (trained_length - 1) * theta >= 2 * math.pi
    return torch.where(full_turn, theta, theta / factor)


def by_parts_loop(d_head, factor, trained_length, base):
    """Pair by pair in Python floats, through the wavelength 2 pi / theta_i."""
    speeds = []
    for i in range(d_head // 2):
        theta = base ** (-2 * i / d_head)
        wavelength = 2 * math.pi / theta  # positions per full turn
        speeds.append(theta if wavelength <= trained_length - 1 else theta / factor)
    return torch.tensor(speeds, dtype=torch.float64)


def by_parts_library(d_head, factor, trained_length, base):
    theta = positions.rope_frequencies(d_head, base=base)  # (d/2,)
    slow = (trained_length - 1) * theta < 2 * torch.pi
    return theta / torch.where(slow, factor, 1.0)


@pytest.mark.parametrize("fn", [by_parts_where, by_parts_loop, by_parts_library])
def test_by_parts_accepts_correct_answers(fn, capsys):
    check_by_parts_frequencies(fn)
    out = capsys.readouterr().out
    assert "by_parts_frequencies is correct" in out and "keeps the first 2 of the 6" in out


def _by_parts_wrong(turn=2 * math.pi, largest=lambda L: L - 1, slow=lambda t, f: t / f,
                    swap=False):
    def fn(d_head, factor, trained_length, base):
        theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
        full_turn = largest(trained_length) * theta >= turn
        if swap:
            full_turn = ~full_turn
        return torch.where(full_turn, theta, slow(theta, factor))
    return fn


WRONG_BY_PARTS = {
    "nothing slowed": (_by_parts_wrong(turn=-1.0), "trained ones"),
    "everything slowed": (_by_parts_wrong(turn=math.inf), "position interpolation"),
    "groups swapped": (_by_parts_wrong(swap=True), "slowed the wrong group"),
    "L, not L - 1": (_by_parts_wrong(largest=lambda L: L), "off by one offset"),
    "multiplied": (_by_parts_wrong(slow=lambda t, f: t * f), "divide"),
    "half a turn": (_by_parts_wrong(turn=math.pi), "half a turn"),
    "one radian": (_by_parts_wrong(turn=1.0), "with 1 radian"),
    "NTK": (lambda d, f, L, b: positions.rope_frequencies(
        d, base=positions.ntk_scaled_base(d, f, base=b)), "NTK-aware"),
    "per dimension": (lambda d, f, L, b: by_parts_where(d, f, L, b).repeat_interleave(2),
                      "one speed per dimension"),
    "a list": (lambda d, f, L, b: by_parts_where(d, f, L, b).tolist(), "torch.tensor"),
    "integers": (lambda d, f, L, b: by_parts_where(d, f, L, b).long(), "floating-point"),
}


@pytest.mark.parametrize("name", list(WRONG_BY_PARTS))
def test_by_parts_rejects_wrong_answers(name):
    fn, message = WRONG_BY_PARTS[name]
    with pytest.raises(CheckFailure, match=message):
        check_by_parts_frequencies(fn)


def test_by_parts_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_by_parts_frequencies(stub)


def test_value_routes_leaves_the_learners_random_state_alone(capsys):
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_value_routes(lambda: {"input", "qkv"})
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------ 3.2 alibi_slopes for any head count


def slopes_rule(n_heads):
    n = 2 ** math.floor(math.log2(n_heads))
    first = [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]
    between = [2.0 ** (-8.0 * h / (2 * n)) for h in range(1, 2 * n + 1, 2)]
    return torch.tensor(first + between[: n_heads - n])


def slopes_geometric_means(n_heads):
    # the extra slopes are the geometric means of neighbours (and 2^(-4/n) before the first)
    n = 1 << (n_heads.bit_length() - 1)
    first = torch.tensor([2.0 ** (-8.0 * h / n) for h in range(1, n + 1)], dtype=torch.float64)
    previous = torch.cat([torch.ones(1, dtype=torch.float64), first[:-1]])
    return torch.cat([first, (previous * first).sqrt()[: n_heads - n]])


def slopes_library(n_heads):
    return positions.alibi_slopes(n_heads)


@pytest.mark.parametrize("fn", [slopes_rule, slopes_geometric_means, slopes_library])
def test_alibi_slopes_accept_correct_answers(fn, capsys):
    check_alibi_slopes(fn)
    assert "alibi_slopes is correct" in capsys.readouterr().out


def _power(h, *, start=0):
    n = 2 ** math.floor(math.log2(h))
    first = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    return n, first, [2.0 ** (-8.0 * k / (2 * n)) for k in range(1, 2 * n + 1)][start::2]


WRONG_SLOPES = {
    "2^(-8h/H) for every H": (
        lambda h: 2.0 ** (-8.0 * torch.arange(1, h + 1) / h), "with H itself"),
    "2nd, 4th, ... of 2n": (
        lambda h: torch.tensor(_power(h)[1] + _power(h, start=1)[2][: h - _power(h)[0]]),
        "the 2nd, 4th"),
    "first H of 2n": (
        lambda h: torch.tensor([2.0 ** (-8.0 * k / (2 * _power(h)[0])) for k in range(1, h + 1)])
        if h & (h - 1) else positions.alibi_slopes(h),
        "first H slopes of the next power"),
    "extras first": (
        lambda h: torch.tensor(_power(h)[2][: h - _power(h)[0]] + _power(h)[1]),
        "wrong order"),
    "sorted": (lambda h: positions.alibi_slopes(h).sort(descending=True).values,
               "You sorted the slopes"),
    "only n slopes": (lambda h: torch.tensor(_power(h)[1]), r"only the slopes of the closest"),
    "reversed": (lambda h: positions.alibi_slopes(h).flip(0),
                 r"wrong values \(case '6 heads'"),
    "a list": (lambda h: positions.alibi_slopes(h).tolist(), "should be a tensor"),
}


@pytest.mark.parametrize("name", list(WRONG_SLOPES))
def test_alibi_slopes_reject_wrong_answers(name):
    fn, message = WRONG_SLOPES[name]
    with pytest.raises(CheckFailure, match=message):
        check_alibi_slopes(fn)


def test_alibi_slopes_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_alibi_slopes(stub)


# ----------------------------------------- 3.4 which weights survive a shift? (predict, verify)


def test_shift_measurement_matches_the_references():
    """ALiBi and RoPE are relative (torch's own rotation of a pair agrees); the added routes
    are not."""
    change = measure_shifted_weights()
    assert change["alibi"] <= 1e-4 and change["rope"] <= 1e-4
    assert change["input"] > 0.01 and change["qkv"] > 0.01
    # RoPE's relative property with a rotation built from torch.polar, not course_lib
    q, k = torch.randn(2, 1, 2, generator=torch.Generator().manual_seed(0))
    def rotate(x, p):
        z = torch.view_as_complex(x.contiguous()) * torch.polar(torch.ones(1), torch.tensor([p]))
        return torch.view_as_real(z)
    score = [float((rotate(q, p) * rotate(k, p + 3.0)).sum()) for p in (0.0, 50.0)]
    assert score[0] == pytest.approx(score[1], abs=1e-5)


@pytest.mark.parametrize("answer", [{"alibi", "rope"}, ["rope", "alibi"], (" ALiBi", "RoPE"),
                                    frozenset({"alibi", "rope"})])
def test_shift_predictions_accept_the_right_set_in_any_form(answer, capsys):
    check_shift_predictions(lambda: answer)
    out = capsys.readouterr().out
    assert "right: only ['alibi', 'rope']" in out


WRONG_SHIFTS = {
    "sinusoids are relative": ({"input", "alibi", "rope"},
                               r"in 'input' the weights change: .*cross terms"),
    "everything is relative": ({"input", "qkv", "alibi", "rope"},
                               r"(?s)'input' the weights change.*'qkv' the weights change"),
    "RoPE is absolute": ({"alibi"}, r"in 'rope' the weights stay the same"),
    "nothing survives": (set(), r"(?s)'alibi' the weights stay.*'rope' the weights stay"),
}


@pytest.mark.parametrize("name", list(WRONG_SHIFTS))
def test_shift_predictions_reject_wrong_sets_naming_only_the_wrong_routes(name, capsys):
    answer, message = WRONG_SHIFTS[name]
    with pytest.raises(CheckFailure, match=message) as failure:
        check_shift_predictions(lambda: answer)
    wrong = answer ^ {"alibi", "rope"}
    for route in ("input", "qkv", "alibi", "rope"):
        assert (f"in '{route}'" in str(failure.value)) == (route in wrong)
    assert "largest change of an attention weight" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [("positions", "not a route name"),
                                             (3, "set of route names")])
def test_shift_predictions_refuse_other_answers(answer, message):
    with pytest.raises(CheckFailure, match=message):
        check_shift_predictions(lambda: answer)


def test_shift_predictions_stub_and_random_state():
    with pytest.raises(NotImplementedError):
        check_shift_predictions(stub)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_shift_predictions(lambda: {"alibi", "rope"})
    assert torch.equal(torch.rand(3), expected)
