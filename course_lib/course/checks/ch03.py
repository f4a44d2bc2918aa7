"""Checks for chapter 03, position representations.

The references are :mod:`course_lib.positions`: :func:`~course_lib.positions.sinusoidal_encoding`,
:func:`~course_lib.positions.alibi_bias`, :func:`~course_lib.positions.apply_rope` (exercise 3.3
fixes a broken copy of it) and :func:`~course_lib.positions.rope_frequencies` (exercise 3.5
keeps or slows each pair's speed). Exercise 3.4 is a prediction, graded and then shown next to a
measurement.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import torch

from course_lib import positions

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    rand,
    run_cases,
    wrap_checks,
)

BASE = 10000.0


# --------------------------------------------------------------------------------------------
# 3.1 sinusoidal_encoding(n_positions, d_model)


def _angles(n: int, d: int, *, exponent: Callable[[torch.Tensor], torch.Tensor],
            start: int = 0, multiply: bool = False) -> torch.Tensor:
    """(n, d/2) angles p / base^exponent(pair index i) (or p * base^... when multiply)."""
    p = torch.arange(start, start + n, dtype=torch.float64)[:, None]  # (T, 1)
    i = torch.arange(d // 2, dtype=torch.float64)  # (D/2,): the pair index
    scale = BASE ** exponent(i)  # (D/2,)
    return p * scale if multiply else p / scale  # (T, D/2)


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    return torch.stack((even, odd), dim=-1).flatten(-2).float()  # (T, D)


def _pe(n: int, d: int, **kwargs) -> torch.Tensor | None:
    if d % 2:
        return None
    a = _angles(n, d, exponent=kwargs.pop("exponent", lambda i: 2 * i / d), **kwargs)
    return _interleave(a.sin(), a.cos())


def _pe_per_dimension(n: int, d: int) -> torch.Tensor | None:
    if d % 2:
        return None
    p = torch.arange(n, dtype=torch.float64)[:, None]  # (T, 1)
    j = torch.arange(d, dtype=torch.float64)  # (D,): the dimension index itself
    a = p / BASE ** (j / d)  # (T, D)
    out = a.sin()
    out[:, 1::2] = a[:, 1::2].cos()
    return out.float()


def _pe_halves(n: int, d: int) -> torch.Tensor | None:
    if d % 2:
        return None
    a = _angles(n, d, exponent=lambda i: 2 * i / d)
    return torch.cat((a.sin(), a.cos()), dim=-1).float()  # (T, D)


SINUSOIDAL_MISTAKES = [
    Misconception(
        lambda n, d: None if d % 2 else (lambda a: _interleave(a.cos(), a.sin()))(
            _angles(n, d, exponent=lambda i: 2 * i / d)),
        "sin and cos are swapped: the even dimensions 2i hold sin(p / 10000^(2i/d)) and the odd "
        "dimensions 2i+1 hold cos of the same angle (so position 0 starts [0, 1, 0, 1, ...])",
    ),
    Misconception(
        _pe_halves,
        "You put all the sines in the first half and all the cosines in the second half. The "
        "convention here is interleaved: dimension 2i is sin and dimension 2i+1 is cos of the "
        "same angle, e.g. pe[:, 0::2] = sin, pe[:, 1::2] = cos",
    ),
    Misconception(
        lambda n, d: _pe(n, d, exponent=lambda i: i / d),
        "Your frequencies fall too slowly: the exponent is 2i/d where i is the index of the "
        "(sin, cos) pair, i = 0 .. d/2-1. You used i/d (tip: torch.arange(0, d, 2) already "
        "gives the values 2i)",
    ),
    Misconception(
        lambda n, d: _pe(n, d, exponent=lambda i: 4 * i / d),
        "Your frequencies fall too fast: the exponent is 2i/d with i the pair index. If you "
        "took torch.arange(0, d, 2), it already holds 2i: do not multiply it by 2 again",
    ),
    Misconception(
        _pe_per_dimension,
        "Dimension 2i+1 must use the same frequency as dimension 2i: both hold the angle "
        "p / 10000^(2i/d) (sin in 2i, cos in 2i+1). You used the dimension's own index in the "
        "exponent, so the cos dimensions got a slightly different frequency",
    ),
    Misconception(
        lambda n, d: _pe(n, d, start=1),
        "Your positions start at 1: the first row is position p = 0, so it must be "
        "[0, 1, 0, 1, ...] (sin 0 = 0, cos 0 = 1); use torch.arange(n_positions)",
    ),
    Misconception(
        lambda n, d: None if d % 2 else (lambda a: _interleave(a.sin(), a.sin()))(
            _angles(n, d, exponent=lambda i: 2 * i / d)),
        "Every dimension holds a sine: the odd dimensions 2i+1 hold the cosine of the angle",
    ),
]


def _sinusoidal_cases() -> list[Case]:
    return [
        Case("n=10, d=16", (10, 16)),
        Case("n=50, d=64", (50, 64)),
        Case("one position, n=1, d=8", (1, 8)),
        Case("one pair of dimensions, n=7, d=2", (7, 2)),
        Case("many dimensions, n=6, d=512", (6, 512)),
        Case("many positions, n=200, d=32", (200, 32)),
    ]


MULTIPLIED_MESSAGE = (
    "You multiplied the position by 10000^(2i/d); divide by it: the angle is "
    "p / 10000^(2i/d), so the later pairs turn more and more slowly"
)


def _multiplied(got: torch.Tensor, n: int, d: int) -> bool:
    """Does ``got`` hold sin/cos of p * 10000^(2i/d)? Those angles reach the thousands, where
    float32 rounding alone changes the sines, so only entries with moderate angles count."""
    angles = _angles(n, d, exponent=lambda i: 2 * i / d, multiply=True)  # (T, D/2)
    wrong = _interleave(angles.sin(), angles.cos()).double()  # (T, D)
    moderate = (angles < 100).repeat_interleave(2, dim=-1)  # (T, D)
    expected = positions.sinusoidal_encoding(n, d).double()
    got = got.detach().double().cpu()
    differs = (wrong - expected).abs()[moderate].max() > 1e-3
    return bool(differs and torch.allclose(got[moderate], wrong[moderate], atol=1e-4))


def _first_pair_right(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool(torch.allclose(got[:, :2].double(), expected[:, :2].double(), atol=1e-4))


def check_sinusoidal_encoding(sinusoidal_encoding: Callable) -> None:
    """Check ``sinusoidal_encoding(n_positions, d_model)``: PE[p, 2i] = sin(p / 10000^(2i/d)),
    PE[p, 2i+1] = cos(p / 10000^(2i/d)), shape (n_positions, d_model).

    Args:
        sinusoidal_encoding: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        n, d = case.args
        expected = positions.sinusoidal_encoding(n, d)
        if isinstance(got, torch.Tensor) and got.shape == (d, n) and n != d:
            raise CheckFailure(
                f"Your encoding has shape {tuple(got.shape)}: rows should be positions and "
                f"columns dimensions, shape (n_positions, d_model) = {(n, d)} "
                f"(case '{case.name}')"
            )
        if isinstance(got, torch.Tensor) and got.shape == (n, d) and _multiplied(got, n, d):
            raise CheckFailure(f"{MULTIPLIED_MESSAGE} (seen on the case '{case.name}')")
        try:
            compare_tensors(got, expected, case, what="Your encoding",
                            misconceptions=SINUSOIDAL_MISTAKES, atol=1e-4, rtol=1e-4)
        except CheckFailure as failure:
            # The first pair has frequency 1 whatever the base, so a wrong base (or another
            # slip in the exponent) leaves it right and spoils only the later pairs.
            if "wrong values" in str(failure) and d > 2 and _first_pair_right(got, expected):
                raise CheckFailure(
                    f"{failure}. Your first pair of dimensions (frequency 1) is right but later "
                    "pairs are not: check the base (10000) and the exponent 2i/d, where i is "
                    "the pair index"
                ) from None
            raise

    run_cases("sinusoidal_encoding", sinusoidal_encoding, _sinusoidal_cases(), check_one)


# --------------------------------------------------------------------------------------------
# 3.2 alibi_bias(n, n_heads)


def _paper_slopes(n_heads: int, *, shift: int = 0) -> torch.Tensor:
    h = torch.arange(1, n_heads + 1, dtype=torch.float64) + shift  # (H,)
    return 2.0 ** (-8.0 * h / n_heads)


def _distance(n: int, *, signed: bool = False, flip: bool = False) -> torch.Tensor:
    i = torch.arange(n, dtype=torch.float64)
    diff = i[:, None] - i[None, :]  # (T, S): query position minus key position
    if flip:
        diff = -diff
    return diff if signed else diff.abs()


def _alibi(slopes: torch.Tensor, distance: torch.Tensor, sign: float = -1.0) -> torch.Tensor:
    return (sign * slopes[:, None, None] * distance).float()  # (H, T, S)


ALIBI_MISTAKES = [
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h), _distance(n), sign=1.0),
        "Your biases are positive: ALiBi *subtracts* m_h * |i - j|, so far-away keys get a "
        "lower score (eq. 13 of the notes: [-i, ..., -1, 0, -1, ..., -(n-1-i)])",
    ),
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h), _distance(n, signed=True)),
        "You used i - j without the absolute value, so keys after the query (j > i) get a "
        "positive bonus. The penalty is -m_h * |i - j| on both sides of the diagonal",
    ),
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h), _distance(n, signed=True, flip=True)),
        "You used j - i without the absolute value, so keys before the query get a positive "
        "bonus. The penalty is -m_h * |i - j| on both sides of the diagonal",
    ),
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h).flip(0), _distance(n)),
        "Your slopes are in reverse order: head 1 has the largest slope, 2^(-8/H), and the "
        "last head the smallest, 2^(-8)",
    ),
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h, shift=-1), _distance(n)),
        "Your slopes are off by one: with heads numbered h = 1 .. H the slope is 2^(-8h/H), "
        "so the first head's slope is 2^(-8/H), not 1 (if you loop with range(H), use h + 1)",
    ),
    Misconception(
        lambda n, h: _alibi(_paper_slopes(h, shift=1), _distance(n)),
        "Your slopes are off by one: with heads numbered h = 1 .. H the slope is 2^(-8h/H), "
        "so the last head's slope is 2^(-8) and the first head's 2^(-8/H)",
    ),
    Misconception(
        lambda n, h: _alibi(2.0 ** -torch.arange(1, h + 1, dtype=torch.float64), _distance(n)),
        "Your slopes are 1/2, 1/4, 1/8, ... whatever the number of heads; that is right only "
        "for H = 8. The slope of head h is 2^(-8h/H), which depends on H",
    ),
    Misconception(
        lambda n, h: _alibi(torch.arange(1, h + 1, dtype=torch.float64) * 2.0 ** (-8.0 / h),
                            _distance(n)),
        "Your slopes grow linearly (h * 2^(-8/H)); they form a geometric sequence: "
        "m_h = (2^(-8/H))^h = 2^(-8h/H)",
    ),
    Misconception(
        lambda n, h: _alibi(torch.ones(h, dtype=torch.float64), _distance(n)),
        "Every head has the same bias -|i - j|: multiply head h's distances by its slope "
        "m_h = 2^(-8h/H)",
    ),
    Misconception(
        lambda n, h: _alibi(1.0 / _paper_slopes(h), _distance(n)),
        "You divided the distances by the slopes; multiply them: the bias is -m_h * |i - j|",
    ),
]


def _alibi_cases() -> list[Case]:
    return [
        Case("n=6, 2 heads", (6, 2)),
        Case("n=8, 4 heads", (8, 4)),
        Case("one head, n=5", (5, 1)),
        Case("n=12, 8 heads", (12, 8)),
        Case("n=3, 16 heads", (3, 16)),
        Case("one token, n=1, 4 heads", (1, 4)),
    ]


def check_alibi_bias(alibi_bias: Callable) -> None:
    """Check ``alibi_bias(n, n_heads)``: a tensor of shape (H, n, n) whose entry [h, i, j] is
    -m_h * |i - j| with the slopes m_h = 2^(-8h/H), h = 1 .. H (H a power of two).

    Args:
        alibi_bias: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        n, h = case.args
        expected = positions.alibi_bias(n, n_heads=h)
        if isinstance(got, torch.Tensor):
            if got.shape == (n, n, h) != (h, n, n):
                raise CheckFailure(
                    f"Your bias has shape {tuple(got.shape)}, with the heads last; put them "
                    f"first: shape (n_heads, n, n) = {(h, n, n)} (case '{case.name}')"
                )
            if got.shape == (n, n) and h == 1:
                raise CheckFailure(
                    f"With one head the result still needs its head dimension: shape "
                    f"(1, n, n) = {(1, n, n)}, not {(n, n)} (case '{case.name}')"
                )
        compare_tensors(got, expected, case, what="Your bias", misconceptions=ALIBI_MISTAKES)

    run_cases("alibi_bias", alibi_bias, _alibi_cases(), check_one)


# --------------------------------------------------------------------------------------------
# 3.2 alibi_slopes(n_heads) for any number of heads (check_alibi_bias above serves the bias of
# an earlier edition). The paper's rule: the slopes of the closest power of two n <= H, then
# every other slope of 2n heads (the first, third, ...), H - n of them.


def _power_slopes(n: int) -> list[float]:
    return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]


def _closest_power(h: int) -> int:
    n = 1
    while 2 * n <= h:
        n *= 2
    return n


def _slopes(h: int, *, extra_start: int = 0, extras_first: bool = False) -> torch.Tensor:
    n = _closest_power(h)
    extra = _power_slopes(2 * n)[extra_start::2][: h - n]
    return torch.tensor(extra + _power_slopes(n) if extras_first else _power_slopes(n) + extra,
                        dtype=torch.float64)


SLOPE_MISTAKES = [
    Misconception(
        lambda h: _paper_slopes(h),
        "You used 2^(-8h/H) with H itself. That formula is the rule for a power of two only: "
        "for other head counts take the slopes of the closest power of two below H, then "
        "every other slope of twice that many heads",
    ),
    Misconception(
        lambda h: _slopes(h, extra_start=1),
        "Your extra slopes are the 2nd, 4th, ... slopes of 2n heads; those equal slopes you "
        "already have (2n heads include all of n's). Take the 1st, 3rd, 5th, ...: the ones "
        "that fall between the slopes of n heads",
    ),
    Misconception(
        lambda h: torch.tensor(_power_slopes(2 * _closest_power(h))[:h], dtype=torch.float64),
        "You took the first H slopes of the next power of two, 2n heads. The rule keeps all "
        "the slopes of n heads and adds every other slope of 2n heads (the 1st, 3rd, ...)",
    ),
    Misconception(
        lambda h: _slopes(h, extras_first=True),
        "Your slopes are right but in the wrong order: first the n slopes of the closest "
        "power of two, then the extra ones",
    ),
    Misconception(
        lambda h: _slopes(h).sort(descending=True).values,
        "You sorted the slopes. The rule keeps them in the order they are built: the n "
        "slopes of the closest power of two first, then the extra ones",
    ),
    Misconception(
        lambda h: _slopes(h)[:_closest_power(h)],
        "You returned only the slopes of the closest power of two: add H - n extra ones, so "
        "that every head gets a slope",
    ),
]


def _slope_cases() -> list[Case]:
    return [Case(f"{h} head{'s' if h > 1 else ''}", (h,))
            for h in (6, 8, 3, 12, 1, 5, 2, 7, 24, 16)]


def check_alibi_slopes(alibi_slopes: Callable) -> None:
    """Check ``alibi_slopes(n_heads)`` against course_lib's, for powers of two and other counts.

    Args:
        alibi_slopes: the learner's function; returns a (H,) tensor.
    """

    def check_one(got, case: Case) -> None:
        expected = positions.alibi_slopes(*case.args)
        compare_tensors(got, expected, case, what="Your slopes", misconceptions=SLOPE_MISTAKES)

    run_cases("alibi_slopes", alibi_slopes, _slope_cases(), check_one)


# --------------------------------------------------------------------------------------------
# 3.3 apply_rope(x, positions)


def _rope(x: torch.Tensor, pos: torch.Tensor, *, exponent: Callable[[torch.Tensor, int],
          torch.Tensor] | None = None, sign: float = 1.0, halves: bool = False) -> torch.Tensor:
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)  # (Dh/2,): the pair index
    e = 2 * i / d if exponent is None else exponent(i, d)
    angles = sign * pos.double()[:, None] * BASE ** (-e)  # (T, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    xd = x.double()
    if halves:
        a, b = xd[..., : d // 2], xd[..., d // 2:]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)
    a, b = xd[..., 0::2], xd[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


ROPE_MISTAKES = [
    Misconception(
        lambda x, pos: _rope(x, pos, sign=-1.0),
        "You rotate the wrong way (clockwise): the new pair is "
        "(x_2i cos a - x_2i+1 sin a, x_2i sin a + x_2i+1 cos a) with a = p * theta_i",
    ),
    Misconception(
        lambda x, pos: _rope(x, pos, halves=True),
        "You paired dimension i with dimension i + d/2 (the 'rotate half' layout). Here the "
        "pairs are adjacent dimensions (2i, 2i+1): take x[..., 0::2] and x[..., 1::2]",
    ),
    Misconception(
        lambda x, pos: _rope(x, pos, exponent=lambda i, d: i / d),
        "Your rotation speeds are off: theta_i = 10000^(-2i/d) with i the pair index "
        "(i = 0 .. d/2-1); you used 10000^(-i/d)",
    ),
    Misconception(
        lambda x, pos: _rope(x, pos, exponent=lambda i, d: 4 * i / d),
        "Your rotation speeds are off: theta_i = 10000^(-2i/d) with i the pair index. If you "
        "took torch.arange(0, d, 2), it already holds 2i: do not multiply it by 2 again",
    ),
    Misconception(
        lambda x, pos: _rope(x, pos, exponent=lambda i, d: 0 * i),
        "Every pair turns at the same speed (angle p): pair i turns by p * theta_i with "
        "theta_i = 10000^(-2i/d), slower and slower for later pairs",
    ),
    Misconception(
        lambda x, pos: _rope(x, torch.arange(x.shape[-2])),
        "You ignored the positions argument and used 0, 1, ..., T-1: rotate the vector in "
        "row t by positions[t] * theta_i",
    ),
    Misconception(
        lambda x, pos: _rope(x, torch.arange(1, x.shape[-2] + 1)),
        "You used positions 1 .. T instead of the given positions: rotate row t by "
        "positions[t] * theta_i",
    ),
]

ROPE_BATCH_HINT = (
    "x can have leading dimensions, e.g. (batch, heads, T, d): index the last dimension with "
    "x[..., 0::2] and let the (T, d/2) angles broadcast against (..., T, d/2)"
)


def _rope_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("T=6, d=8", (rand(gen, 6, 8), torch.arange(6))),
        Case("batched, (2, 5, 8)", (rand(gen, 2, 5, 8), torch.arange(5)), hint=ROPE_BATCH_HINT),
        Case("batch and heads, (2, 3, 4, 16)", (rand(gen, 2, 3, 4, 16), torch.arange(4)),
             hint=ROPE_BATCH_HINT),
        Case("one pair of dimensions, d=2", (rand(gen, 5, 2), torch.arange(5))),
        Case("one token at position 3", (rand(gen, 1, 8), torch.tensor([3]))),
        Case("positions [7, 0, 3, 12]", (rand(gen, 4, 8), torch.tensor([7, 0, 3, 12]))),
        Case("positions 10, 20, ..., 60, d=32", (rand(gen, 6, 32), torch.arange(10, 70, 10))),
    ]


def check_apply_rope(apply_rope: Callable) -> None:
    """Check ``apply_rope(x, positions)``: the pair of dimensions (2i, 2i+1) of row t of x is
    rotated by the angle positions[t] * 10000^(-2i/d); x has shape (..., T, d).

    Args:
        apply_rope: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        x, pos = case.args
        expected = positions.apply_rope(x, pos)
        compare_tensors(got, expected, case, what="Your rotated x", misconceptions=ROPE_MISTAKES,
                        atol=1e-4, rtol=1e-4)

    run_cases("apply_rope", apply_rope, _rope_cases(seed=3), check_one)


# --------------------------------------------------------------------------------------------
# 3.3 find the bug: a fixed apply_rope, graded by the relative-position property, then by
# equality with the reference


RELATIVE_STARTS = (0, 7, 50, 300)  # the same offset tried from several absolute positions
RELATIVE_OFFSETS = (-5, 0, 3, 20)


def _relative_failure(apply_rope: Callable) -> str | None:
    """Run the relative-position test on the learner's apply_rope: the score of a query at p
    and a key at p + k must not depend on p, and rotations keep lengths. A message, or None."""
    gen = torch.Generator().manual_seed(11)
    q, k = rand(gen, 1, 16), rand(gen, 1, 16)  # (1, Dh) each
    for offset in RELATIVE_OFFSETS:
        scores = []
        for start in RELATIVE_STARTS:
            case = Case(f"relative test, query at {start}, key at {start + offset}",
                        (q, torch.tensor([start])))
            q_p = call_learner(apply_rope, case)
            k_r = call_learner(apply_rope, Case(case.name, (k, torch.tensor([start + offset]))))
            for got in (q_p, k_r):
                if not isinstance(got, torch.Tensor) or got.shape != q.shape:
                    return (f"your function returned {describe(got)} for x of shape (1, 16); "
                            "it must return a tensor of the same shape as x")
            scores.append(float((q_p * k_r).sum()))
        if max(scores) - min(scores) > 1e-3 * (1 + abs(scores[0])):
            listed = ", ".join(f"{s:.3f}" for s in scores)
            return (
                f"The relative-position test fails: the score of a query at position p and a "
                f"key at p {'-' if offset < 0 else '+'} {abs(offset)} should be the same for every "
                "p, but for "
                f"p = {', '.join(map(str, RELATIVE_STARTS))} yours gives {listed}. "
                "Only a rotation of each pair makes R_p^T R_r depend on r - p alone: look at "
                "the 2 x 2 matrix each pair is multiplied by (a rotation has -sin a in one "
                "corner and +sin a in the other)"
            )
    rotated = call_learner(apply_rope, Case("length test, position 40", (q, torch.tensor([40]))))
    if abs(float(rotated.norm()) - float(q.norm())) > 1e-3 * float(q.norm()):
        return (f"Your function changes the length of the vector (from {float(q.norm()):.3f} to "
                f"{float(rotated.norm()):.3f}); a rotation keeps lengths")
    return None


def check_fixed_rope(apply_rope: Callable) -> None:
    """Check a fixed ``apply_rope(x, positions)``: first the relative-position property (the
    score of a rotated query and key depends only on their offset), then equality with
    :func:`course_lib.positions.apply_rope` on several inputs.

    Args:
        apply_rope: the learner's fixed function.
    """
    failure = _relative_failure(apply_rope)
    if failure is not None:
        raise CheckFailure(failure)
    print("✅ the relative-position test passes: the score depends on the offset alone")
    try:
        check_apply_rope(apply_rope)
    except CheckFailure as error:
        raise CheckFailure(
            f"{error}\n(found by comparing your function with course_lib.positions.apply_rope "
            "on several inputs: the relative-position test alone cannot see this)"
        ) from None


# --------------------------------------------------------------------------------------------
# 3.4 predict then verify: in which routes do the value vectors depend on position?

ROUTES = {
    "input": "positions added to the input, x_i + p_i (learned or sinusoidal)",
    "qkv": "positions added after the projections to q, k and v (lecture 9)",
    "alibi": "ALiBi, a bias -m |i - j| added to the scores",
    "rope": "RoPE, q and k rotated by their positions",
}

ROUTE_REASONS = {
    "input": "x_i + p_i passes through W_v like the rest of the input: v_i = W_v x_i + W_v p_i "
             "depends on the position",
    "qkv": "the lecture 9 route adds p_i to v_i as well as to q_i and k_i",
    "alibi": "ALiBi only adds a number to each score; the values v_j = W_v x_j never see it",
    "rope": "RoPE rotates only the queries and the keys; the values are not rotated",
}


def _routes_of(answer: object) -> set[str]:
    if isinstance(answer, str):
        answer = [answer]
    if not isinstance(answer, (set, frozenset, list, tuple)):
        raise CheckFailure(
            f"Return a set of route names, e.g. {{'input'}}, not {describe(answer)}")
    names = set()
    for item in answer:
        if not isinstance(item, str) or item.strip().lower() not in ROUTES:
            raise CheckFailure(
                f"{item!r} is not a route name: use names among {sorted(ROUTES)}")
        names.add(item.strip().lower())
    return names


def measure_value_routes(n_tokens: int = 6, d_model: int = 8, seed: int = 0) -> dict[str, float]:
    """Feed one token repeated at every position through one attention head, with position
    entering by each route, and return how much the outputs at different positions differ.

    The attention weights of a row sum to 1, so if every value vector is the same, every
    output is that vector: a spread above zero means the values depend on the position.
    """
    from course_lib.attention import MultiHeadAttention, scaled_dot_product_attention

    with torch.random.fork_rng(devices=[]):  # leave the learner's random state alone
        torch.manual_seed(seed)
        head = MultiHeadAttention(d_model, n_heads=1)
        for weight in head.parameters():  # weights of a trained size, not the small initial ones
            torch.nn.init.normal_(weight, std=d_model**-0.5)
        x = torch.randn(d_model).expand(n_tokens, d_model)  # (T, D): the same token everywhere
        rope_head = MultiHeadAttention(d_model, n_heads=1, rope=True)
    rope_head.load_state_dict(head.state_dict())
    p = positions.sinusoidal_encoding(n_tokens, d_model)  # (T, D)
    with torch.no_grad():
        q, k, v = head.qkv_proj(x).chunk(3, dim=-1)  # (T, D) each
        qkv_out, _ = scaled_dot_product_attention(q + p, k + p, v + p)  # (T, D)
        outs = {
            "input": head(x + p)[0],
            "qkv": head.out_proj(qkv_out),
            "alibi": head(x, attn_bias=positions.alibi_bias(n_tokens, n_heads=1))[0],
            "rope": rope_head(x)[0],
        }
    return {route: float((out - out[0]).abs().max()) for route, out in outs.items()}


def check_value_routes(prediction: Callable) -> None:
    """Grade ``prediction()``: the set of routes (among ``ROUTES``) in which a token's value
    vector depends on its position; then show the measurement.

    Args:
        prediction: the learner's function of no arguments.
    """
    answer = call_learner(prediction, Case("your prediction"))
    predicted = _routes_of(answer)
    spread = measure_value_routes()
    print("One token repeated at 6 positions; largest difference between the outputs at "
          "two positions:")
    for route, description in ROUTES.items():
        size = f"{spread[route]:.3f}" if spread[route] > 1e-4 else "0 (float rounding)"
        print(f"  {route:>5}: {size:<18}   ({description})")
    depends = {route for route, value in spread.items() if value > 1e-4}
    wrong = sorted(predicted ^ depends)
    if wrong:
        raise CheckFailure(
            "Not quite: " + "; ".join(
                f"'{route}' {'does' if route in depends else 'does not'} put position into "
                f"the values ({ROUTE_REASONS[route]})" for route in wrong)
        )
    print(f"✅ right: the values depend on position in {sorted(depends)} only. Every row of "
          "weights sums to 1, so when every value is the same vector the output is that vector, "
          "whatever the weights")


# --------------------------------------------------------------------------------------------
# 3.4 (this edition) predict then verify: the same sentence at positions 0.. and at 50..; in
# which routes do the attention weights stay the same?

SHIFT = 50

SHIFT_REASONS = {
    "input": "q_i . k_j now holds cross terms such as (W_q x_i) . (W_k p_j), which depend on "
             "where p_j sits, not only on i - j; only the sinusoids' own dot product p_i . p_j "
             "is a function of the offset",
    "qkv": "(q_i + p_i) . (k_j + p_j) still holds q_i . p_j and p_i . k_j, which depend on the "
           "absolute positions",
    "alibi": "the bias -m |i - j| is the same for every pair at the same offset",
    "rope": "rotating q by p and k by r leaves q . R_(r-p) k, a function of the offset alone",
}


def measure_shifted_weights(n_tokens: int = 6, d_model: int = 8, seed: int = 0,
                            shift: int = SHIFT) -> dict[str, float]:
    """One attention head on one sentence, positions 0..T-1 and then shift..shift+T-1, for
    each route; returns the largest change of an attention weight (seeded, the global random
    stream left alone)."""
    from course_lib.attention import MultiHeadAttention, scaled_dot_product_attention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = MultiHeadAttention(d_model, n_heads=1)
        for weight in head.parameters():
            torch.nn.init.normal_(weight, std=d_model**-0.5)
        x = torch.randn(n_tokens, d_model)  # (T, D)
    table = positions.sinusoidal_encoding(shift + n_tokens, d_model)  # (shift + T, D)
    slope = float(positions.alibi_slopes(1)[0])

    def weights(start: int) -> dict[str, torch.Tensor]:
        pos = torch.arange(start, start + n_tokens)  # (T,)
        p = table[pos]  # (T, D)
        q, k, v = head.qkv_proj(x).chunk(3, dim=-1)  # (T, D) each
        q_in, k_in, v_in = head.qkv_proj(x + p).chunk(3, dim=-1)
        bias = -slope * (pos[:, None] - pos[None, :]).abs().float()  # (T, T)
        attend = scaled_dot_product_attention
        return {
            "input": attend(q_in, k_in, v_in)[1],
            "qkv": attend(q + p, k + p, v + p)[1],
            "alibi": attend(q, k, v, attn_bias=bias)[1],
            "rope": attend(positions.apply_rope(q, pos), positions.apply_rope(k, pos), v)[1],
        }

    with torch.no_grad():
        before, after = weights(0), weights(shift)
    return {route: float((after[route] - before[route]).abs().max()) for route in ROUTES}


def check_shift_predictions(prediction: Callable) -> None:
    """Grade ``prediction()``: the set of routes (among ``ROUTES``) whose attention weights do
    not change when every position of a sentence is shifted by 50; then show the measurement.

    Args:
        prediction: the learner's function of no arguments.
    """
    predicted = _routes_of(call_learner(prediction, Case("your prediction")))
    change = measure_shifted_weights()
    print(f"One sentence of 6 tokens at positions 0-5, then at {SHIFT}-{SHIFT + 5}; largest "
          "change of an attention weight:")
    for route, description in ROUTES.items():
        size = f"{change[route]:.3f}" if change[route] > 1e-4 else "0 (float rounding)"
        print(f"  {route:>5}: {size:<18}   ({description})")
    same = {route for route, value in change.items() if value <= 1e-4}
    wrong = sorted(predicted ^ same)
    if wrong:
        raise CheckFailure("Not quite: " + "; ".join(
            f"in '{route}' the weights {'stay the same' if route in same else 'change'}: "
            f"{SHIFT_REASONS[route]}" for route in wrong))
    print(f"\u2705 right: only {sorted(same)} keep their weights. They see positions only "
          "through the offset i - j; a position vector added to a token, or to its query and "
          "key, also tells the score where the token is")


# --------------------------------------------------------------------------------------------
# 3.5 by_parts_frequencies(d_head, factor, trained_length, base): keep the speed of every pair
# that made a full turn within the trained offsets 0 .. L - 1, slow the others by the factor.

FULL_TURN = 2 * math.pi


def _by_parts(d: int, factor: float, length: int, base: float, *, largest: int | None = None,
              turn: float = FULL_TURN, keep_slow: bool = False,
              slow: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(d/2,) speeds: theta_i where (largest offset) * theta_i >= turn, else slow(theta_i)
    (theta_i / factor); ``keep_slow`` swaps the two groups (a mistake)."""
    theta = positions.rope_frequencies(d, base=base, dtype=torch.float64)  # (d/2,)
    offset = length - 1 if largest is None else largest
    full_turn = offset * theta >= turn  # (d/2,): this pair met every angle in training
    if keep_slow:
        full_turn = ~full_turn
    slowed = theta / factor if slow is None else slow(theta)
    return torch.where(full_turn, theta, slowed)  # (d/2,)


BY_PARTS_MISTAKES = [
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, turn=-1.0),
        "Your speeds are the trained ones, theta_i = base^(-2i/d), for every pair: slow the "
        "pairs that never made a full turn in training by the factor",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, turn=math.inf),
        "You slowed every pair by the factor: that is position interpolation, which also "
        "slows the fast pairs that training already showed every angle. Keep those",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, keep_slow=True),
        "You slowed the wrong group: the pairs that made a full turn within the trained "
        "offsets have met every angle and keep their speed; the slow ones, which never "
        "completed a turn, are the ones to slow down",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, largest=L),
        "Your boundary is off by one offset: a model trained on L tokens has met the offsets "
        "0 to L - 1, so a pair made a full turn when (L - 1) * theta_i >= 2 pi, not "
        "L * theta_i",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, slow=lambda t: t * f),
        "You multiplied the slow pairs' speeds by the factor, which makes them turn faster; "
        "to turn `factor` times more slowly, divide",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, turn=math.pi),
        "You compared the angle with pi, half a turn; a pair has met every angle once it has "
        "turned a full circle, 2 pi radians",
    ),
    Misconception(
        lambda d, f, L, b: _by_parts(d, f, L, b, turn=1.0),
        "You compared the angle with 1 radian; a pair has met every angle once it has turned "
        "a full circle, 2 pi radians",
    ),
    Misconception(
        lambda d, f, L, b: positions.rope_frequencies(
            d, base=positions.ntk_scaled_base(d, f, base=b), dtype=torch.float64),
        "Those are the NTK-aware speeds, where every pair but the first slows by its own "
        "amount; here each pair either keeps its speed or slows by the full factor",
    ),
]


def _by_parts_cases() -> list[Case]:
    return [
        Case("d_head=12, factor 4, trained on 32 tokens (chapter 03's models)",
             (12, 4.0, 32, 10000.0)),
        Case("d_head=64, factor 8, trained on 2048 tokens", (64, 8.0, 2048, 10000.0)),
        Case("d_head=12, factor 4, trained on 30 tokens", (12, 4.0, 30, 10000.0)),
        Case("d_head=8, factor 2, trained on 7 tokens", (8, 2.0, 7, 10000.0)),
        Case("d_head=128, factor 16, trained on 8192 tokens, base 500000",
             (128, 16.0, 8192, 500000.0)),
        Case("one pair, d_head=2, trained on 4 tokens", (2, 3.0, 4, 10000.0)),
        Case("factor 1: nothing to stretch", (16, 1.0, 64, 10000.0)),
    ]


def check_by_parts_frequencies(by_parts_frequencies: Callable) -> None:
    """Check ``by_parts_frequencies(d_head, factor, trained_length, base)``: the (d_head/2,)
    speeds theta_i = base^(-2i/d_head), kept for the pairs with (trained_length - 1) * theta_i
    >= 2 pi (a full turn within the trained offsets) and divided by ``factor`` for the others.
    Compared relatively (the slowest speeds are below 1e-5).

    Args:
        by_parts_frequencies: the learner's function.
    """

    def check_one(got: object, case: Case) -> None:
        d, factor, length, base = case.args
        expected = _by_parts(d, factor, length, base)
        if isinstance(got, list | tuple) and len(got) == d // 2:
            raise CheckFailure(f"Your function returned {describe(got)}; return a tensor of "
                               f"shape ({d // 2},) (torch.tensor turns a list into one)")
        if isinstance(got, torch.Tensor) and got.shape == (d,) and d > 2:
            raise CheckFailure(
                f"Your tensor has shape ({d},): one speed per dimension. Return one per pair "
                f"of dimensions, shape ({d // 2},) (case '{case.name}')")
        if isinstance(got, torch.Tensor) and not got.is_floating_point():
            raise CheckFailure(f"Your speeds have dtype {got.dtype}; return a floating-point "
                               f"tensor (case '{case.name}')")
        compare_tensors(got, expected, case, what="Your speeds", misconceptions=BY_PARTS_MISTAKES,
                        atol=0.0, rtol=1e-4)

    run_cases("by_parts_frequencies", by_parts_frequencies, _by_parts_cases(), check_one)
    kept = int((_by_parts(12, 4.0, 32, BASE) == positions.rope_frequencies(
        12, dtype=torch.float64)).sum())
    print(f"   On chapter 03's models (d_head = 12, 32 trained tokens, factor 4) it keeps the "
          f"first {kept} of the 6 pairs and slows the other {6 - kept} by 4.")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
