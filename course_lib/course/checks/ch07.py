"""Checks for chapter 07, norms, residuals, scaling and dropout: LayerNorm from its equations
(and RMSNorm, which the lecture builds), a whole stack of residual sublayers in either order
(pre-norm with its final norm, or post-norm), a pre-norm block whose dropout sits in the wrong
place, graded by equality with course_lib's block in eval and in training mode from the same
seeds, the per-layer gradient norms of a stack, drop path (one coin per example, inverted
scaling, a train/eval switch, independent draws), and
the 1/sqrt(2N) initialisation as an experiment graded by the properties of its measurements,
and learning-rate warm-up: the schedule, then a sweep over warm-up lengths graded by what it
measured (no warm-up stalls at a high peak, a long enough warm-up trains)."""

from __future__ import annotations

import copy
import functools
import math
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from course_lib.blocks import EncoderBlock
from course_lib.configs import DecoderConfig
from course_lib.device import num_threads
from course_lib.instruments.divergence import first_divergence
from course_lib.instruments.probes import layer_grad_norms as reference_layer_grad_norms
from course_lib.layers import layer_norm, rms_norm
from course_lib.models import DecoderLM

from ._core import (
    ATOL,
    RTOL,
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    prediction_dict,
    rand,
    require_number,
    require_real,
    run_cases,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Shared helpers


def _quietly(mistakes: list[Misconception]) -> list[Misconception]:
    """The same mistakes, computed without warnings (an unbiased variance of one value warns,
    and a check's output must not depend on where the library is installed)."""

    def silenced(wrong: Callable) -> Callable:
        @functools.wraps(wrong)
        def run(*args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return wrong(*args, **kwargs)
        return run

    return [Misconception(silenced(m.wrong), m.message) for m in mistakes]


# --------------------------------------------------------------------------------------------
# Exercise 7.1: layer_norm(x, weight, bias, eps)


def _centred(x: torch.Tensor, dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    return x - x.mean(dim, keepdim=True)


def _affine(x_hat: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return x_hat * weight + bias


LAYER_NORM_MISTAKES = _quietly([
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            _centred(x) / torch.sqrt(x.var(-1, keepdim=True) + eps), w, b),
        "Your variance divides by d - 1: torch.var and torch.std do that by default "
        "(correction=1, the 'unbiased' estimate). Eq. 27 and nn.LayerNorm divide by d: use "
        "x.var(-1, keepdim=True, correction=0), or ((x - mean) ** 2).mean(-1, keepdim=True)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            _centred(x) / (x.std(-1, keepdim=True, correction=0) + eps), w, b),
        "You added eps to the standard deviation, (x - mean) / (sigma + eps). Some slides write "
        "it that way, but nn.LayerNorm (and every checkpoint you will load) puts eps inside "
        "the square root: (x - mean) / torch.sqrt(var + eps). The two differ when a vector is "
        "nearly constant, as in this case",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            _centred(x) / x.std(-1, keepdim=True, correction=0), w, b),
        "You left out eps: (x - mean) / sqrt(var + eps) needs the eps inside the square root, "
        "otherwise a (nearly) constant vector is divided by (almost) zero",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            _centred(x, 0) / torch.sqrt(x.var(0, keepdim=True, correction=0) + eps), w, b),
        "You normalised over the wrong dimension: your statistics are computed for each feature "
        "over the positions (dim 0), which is what batch norm does. LayerNorm computes one mean "
        "and one variance per position, over its d features: the last dimension, "
        "x.mean(-1, keepdim=True)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            (x - x.mean()) / torch.sqrt(x.var(correction=0) + eps), w, b),
        "You normalised the whole tensor with one mean and one variance. LayerNorm computes "
        "them per position, over the last dimension only: x.mean(-1, keepdim=True)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            (x - x.mean(-1)) / torch.sqrt(x.var(-1, correction=0) + eps), w, b),
        "Your mean and variance lost their last dimension: x.mean(-1) has shape (..., T), which "
        "then broadcasts against the features instead of the positions. Keep the dimension: "
        "x.mean(-1, keepdim=True)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: layer_norm(x, eps=eps),
        "Your output is the normalised x without the gain and the bias: multiply by weight "
        "(gamma) and add bias (beta) at the end",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(layer_norm(x, eps=eps), b, w),
        "You swapped the gain and the bias: weight (gamma) multiplies the normalised x and "
        "bias (beta) is added: x_hat * weight + bias",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: (layer_norm(x, eps=eps) + b) * w,
        "You added the bias before multiplying by the gain: it is x_hat * weight + bias",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            _centred(x) / (x.var(-1, keepdim=True, correction=0) + eps), w, b),
        "You divided by the variance instead of the standard deviation: take the square root, "
        "(x - mean) / torch.sqrt(var + eps)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(
            x / torch.sqrt(x.var(-1, keepdim=True, correction=0) + eps), w, b),
        "You divided by the standard deviation but did not subtract the mean first: "
        "x_hat = (x - mean) / sqrt(var + eps)",
    ),
    Misconception(
        lambda x, w, b, eps=1e-5: _affine(rms_norm(x, eps=eps), w, b),
        "You computed RMSNorm (x / sqrt(mean(x^2) + eps)): LayerNorm subtracts the mean first "
        "and divides by the standard deviation, (x - mean) / sqrt(var + eps)",
    ),
])


def _layer_norm_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def params(d: int) -> tuple[torch.Tensor, torch.Tensor]:
        return 1 + 0.5 * rand(gen, d), 0.5 * rand(gen, d)

    flat = 0.05 + 1e-3 * rand(gen, 4, 16)  # nearly constant rows (var 1e-6 < eps): eps matters
    keepdim = ("if the error is about sizes that do not match, compute the statistics with "
               "keepdim=True (x.mean(-1, keepdim=True)) so that they broadcast against x")
    return [
        Case("T=4 positions, D=8, offset and scaled", (rand(gen, 4, 8, scale=3.0) + 2.0,
                                                       *params(8)), hint=keepdim),
        Case("batched (2, 3, 16)", (rand(gen, 2, 3, 16), *params(16)), hint=keepdim),
        Case("T = D = 8 (a square input)", (rand(gen, 8, 8, scale=2.0) - 1.0, *params(8))),
        Case("D=2", (rand(gen, 5, 2), *params(2))),
        Case("one position, T=1", (rand(gen, 1, 1, 12) * 5, *params(12))),
        Case("nearly constant rows (std ~1e-3)", (flat, *params(16))),
        Case("eps=1e-3 given", (rand(gen, 3, 6, scale=0.05), *params(6)), {"eps": 1e-3}),
        Case("gain 1, bias 0", (rand(gen, 4, 10) + 4.0, torch.ones(10), torch.zeros(10))),
    ]


def check_layer_norm(layer_norm_fn: Callable) -> None:
    """Check ``layer_norm(x, weight, bias, eps=1e-5)`` -> (..., D): eqs. 27-28 over the last
    dimension with the biased variance, eps inside the square root, then gain and bias.

    Args:
        layer_norm_fn: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        x, weight, bias = case.args
        expected = layer_norm(x, weight, bias, eps=case.kwargs.get("eps", 1e-5))
        compare_tensors(got, expected, case, what="Your LayerNorm output",
                        misconceptions=LAYER_NORM_MISTAKES)

    run_cases("layer_norm", layer_norm_fn, _layer_norm_cases(seed=71), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 7.1 (predict, then verify): what LayerNorm does to a few given inputs

LN_PREDICTION_KEYS = ("pair", "spike", "shifted_spike", "sum_of_squares")
LN_TOLERANCE = 0.02  # predictions are graded to two decimals


def _ln_inputs() -> dict[str, torch.Tensor]:
    """The inputs of exercise 7.1, one row each (gain 1, bias 0, eps 1e-5)."""
    return {
        "pair": torch.tensor([3.0, 7.0]),
        "spike": torch.tensor([0.0, 0.0, 0.0, 4.0]),
        "shifted_spike": torch.tensor([5.0, 5.0, 5.0, 9.0]),
        "sum_of_squares": torch.linspace(-2.0, 5.0, 8) ** 2,  # any row that is not constant
    }


def _ln_measure() -> dict[str, float]:
    """What nn.LayerNorm (gain 1, bias 0) gives for each question of exercise 7.1."""
    out = {}
    with torch.no_grad():
        for key, x in _ln_inputs().items():
            y = nn.LayerNorm(x.shape[-1])(x)  # (D,)
            out[key] = float((y ** 2).sum()) if key == "sum_of_squares" else float(y[
                0 if key == "pair" else -1])
    return out


def _ln_unbiased() -> dict[str, float]:
    """The same numbers with the variance divided by D - 1 (torch.var's default)."""
    out = {}
    for key, x in _ln_inputs().items():
        y = _centred(x) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5)  # (D,)
        out[key] = float((y ** 2).sum()) if key == "sum_of_squares" else float(y[
            0 if key == "pair" else -1])
    return out


def _ln_blame(key: str, value: float, got: dict[str, float]) -> str | None:
    """What a wrong prediction for ``key`` most likely comes from, or None when unrecognised."""
    near = functools.partial(math.isclose, value, abs_tol=LN_TOLERANCE)
    x = _ln_inputs()[key]
    d = x.shape[-1]
    if near(_ln_unbiased()[key]):
        return (f"{value:.3g} is what you get dividing the sum of squares by D - 1 = {d - 1}. "
                "Eq. 27 (and nn.LayerNorm) divide by D: the variance is the plain mean of the "
                "squared deviations")
    if key == "sum_of_squares":
        if near(1.0):
            return ("after LayerNorm the features of a position have mean 0 and variance 1: "
                    "the MEAN of their squares is 1. What is their sum over 8 features?")
        return None
    entry = 0 if key == "pair" else -1
    rms = float(x[entry] / torch.sqrt((x ** 2).mean()))
    if near(rms):
        return (f"{value:.3g} is x divided by its root mean square, RMSNorm: LayerNorm first "
                "subtracts the mean of the features")
    if near(-_ln_measure()[key]):
        return ("the sign is wrong: is this feature above or below the mean of its row?")
    var = float(((x - x.mean()) ** 2).mean())
    if var > 0 and near(float(x[entry] - x.mean()) / var):
        return ("you divided by the variance: LayerNorm divides by the standard deviation, "
                "its square root")
    if key == "shifted_spike" and math.isclose(got["spike"], _ln_measure()["spike"],
                                                abs_tol=LN_TOLERANCE):
        return ("this row is the 'spike' row plus 5 in every feature. What does adding the "
                "same number to every feature do to the mean, and to the deviations from it?")
    return None


def check_layer_norm_prediction(predict_layer_norm: Callable) -> None:
    """Grade the predictions of exercise 7.1, then print what nn.LayerNorm measures.

    Args:
        predict_layer_norm: takes no argument and returns a dict with the keys ``pair``,
            ``spike``, ``shifted_spike`` and ``sum_of_squares``, each a number (int or float).
    """
    got = prediction_dict(call_learner(predict_layer_norm, Case("your predictions")),
                          LN_PREDICTION_KEYS, "predict_layer_norm")
    values = {k: require_number(got[k], f"your prediction '{k}'") for k in LN_PREDICTION_KEYS}
    measured = _ln_measure()
    for key in LN_PREDICTION_KEYS:
        if math.isclose(values[key], measured[key], abs_tol=LN_TOLERANCE):
            continue
        blame = _ln_blame(key, values[key], values)
        raise CheckFailure(f"'{key}': your prediction {values[key]:.3g} is not what LayerNorm "
                           "gives" + (f": {blame}" if blame else
                                      f" (graded to within {LN_TOLERANCE}). Work it out with "
                                      "eq. 27: the mean of the row, then the mean of the "
                                      "squared deviations from it"))
    print(f"\u2705 your {len(LN_PREDICTION_KEYS)} predictions are right. nn.LayerNorm "
          "(gain 1, bias 0, eps 1e-5) measures:")
    for key, x in _ln_inputs().items():
        what = ("sum of the squared outputs" if key == "sum_of_squares" else
                "first output" if key == "pair" else "last output")
        row = ", ".join(f"{v:g}" for v in x.tolist())
        print(f"  {key:>14}: LN([{row}]) -> {what} {measured[key]:.4f}")


# --------------------------------------------------------------------------------------------
# RMSNorm: rms_norm(x, weight, eps) (built in the lecture; a check for learners who want it)


RMS_NORM_MISTAKES = _quietly([
    Misconception(
        lambda x, w, eps=1e-6: layer_norm(x, eps=eps) * w,
        "You subtracted the mean: that is LayerNorm. RMSNorm divides x itself by its root mean "
        "square, x / sqrt(mean(x^2) + eps), without centring it",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps) * w,
        "You added eps to the root mean square, x / (rms + eps). As in nn.RMSNorm, eps goes "
        "inside the square root: x / torch.sqrt(mean(x^2) + eps). The two differ when x is tiny, "
        "as in this case",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / torch.linalg.vector_norm(x, dim=-1, keepdim=True) * w,
        "You divided by the L2 norm ||x||, the square root of the SUM of the squares. The root "
        "mean square is ||x|| / sqrt(d): take the MEAN of the squares, "
        "x / torch.sqrt((x ** 2).mean(-1, keepdim=True) + eps)",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / x.pow(2).mean(-1, keepdim=True).sqrt() * w,
        "You left out eps: it goes inside the square root, x / torch.sqrt(mean(x^2) + eps), so "
        "that a tiny (or zero) vector is not divided by (almost) zero",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / (x.pow(2).mean(-1, keepdim=True) + eps) * w,
        "You divided by the mean square, not its square root: x / sqrt(mean(x^2) + eps)",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / torch.sqrt(x.var(-1, keepdim=True) + eps) * w,
        "You divided by the variance's square root (the standard deviation, which subtracts the "
        "mean inside). RMSNorm uses the plain mean of the squares: (x ** 2).mean(-1, "
        "keepdim=True)",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / torch.sqrt(x.pow(2).mean(0, keepdim=True) + eps) * w,
        "You took the mean over the wrong dimension (dim 0, the positions): each position is "
        "normalised by the root mean square of its own d features, the last dimension",
    ),
    Misconception(
        lambda x, w, eps=1e-6: x / torch.sqrt(x.pow(2).mean(-1) + eps) * w,
        "Your mean square lost its last dimension and broadcasts against the features: use "
        "keepdim=True",
    ),
    Misconception(
        lambda x, w, eps=1e-6: rms_norm(x, eps=eps),
        "Your output is not multiplied by the gain: multiply the normalised x by weight",
    ),
    Misconception(
        lambda x, w, eps=1e-6: rms_norm(x, eps=eps) + w,
        "You added weight instead of multiplying by it: RMSNorm has a gain (a scale) and no "
        "bias, x_hat * weight",
    ),
])


def _rms_norm_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def gain(d: int) -> torch.Tensor:
        return 1 + 0.5 * rand(gen, d)

    keepdim = ("if the error is about sizes that do not match, take the mean with keepdim=True "
               "so that it broadcasts against x")
    return [
        Case("T=4, D=8, non-zero mean", (rand(gen, 4, 8) + 2.0, gain(8)), hint=keepdim),
        Case("batched (2, 3, 16)", (rand(gen, 2, 3, 16, scale=4.0), gain(16)), hint=keepdim),
        Case("T = D = 6 (a square input)", (rand(gen, 6, 6) - 0.5, gain(6))),
        Case("tiny values (rms ~1e-4)", (rand(gen, 3, 12, scale=1e-4), gain(12))),
        Case("D=1", (rand(gen, 4, 1), gain(1))),
        Case("a zero vector", (torch.zeros(2, 5), gain(5))),
        Case("eps=1e-2 given", (rand(gen, 3, 8, scale=0.1), gain(8)), {"eps": 1e-2}),
    ]


def check_rms_norm(rms_norm_fn: Callable) -> None:
    """Check ``rms_norm(x, weight, eps=1e-6)`` -> (..., D): x / sqrt(mean(x^2) + eps) * weight
    over the last dimension, as ``torch.nn.RMSNorm``.

    Args:
        rms_norm_fn: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        x, weight = case.args
        expected = rms_norm(x, weight, eps=case.kwargs.get("eps", 1e-6))
        compare_tensors(got, expected, case, what="Your RMSNorm output",
                        misconceptions=RMS_NORM_MISTAKES)

    run_cases("rms_norm", rms_norm_fn, _rms_norm_cases(seed=72), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 7.2: residual_stack(x, sublayers, norms, norm_first, final_norm=None)


class SelfAttentionOnly(nn.Module):
    """A MultiHeadAttention that returns only its output (the sublayer f of eqs. 30-31)."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x)[0]  # (B, T, D)


def _pre_step(x, f, norm):
    return x + f(norm(x))  # eq. 30


def _post_step(x, f, norm):
    return norm(x + f(x))  # eq. 31


def _final(x, final_norm):
    return x if final_norm is None else final_norm(x)


def _run(step, x, subs, norms):
    for f, norm in zip(subs, norms, strict=True):
        x = step(x, f, norm)
    return x


def _wrong_each_step(pre_step, post_step=None):
    """A stack whose steps are wrong in the same way in both orders (final norm kept); None
    for an order the mistake does not apply to."""
    def wrong(x, subs, norms, norm_first, final_norm=None):
        if norm_first:
            return _final(_run(pre_step, x, subs, norms), final_norm)
        return None if post_step is None else _run(post_step, x, subs, norms)
    return wrong


def _right(x, subs, norms, norm_first, final_norm=None):
    if norm_first:
        return _final(_run(_pre_step, x, subs, norms), final_norm)
    return _run(_post_step, x, subs, norms)


def _parallel(x, subs, norms, norm_first, final_norm=None):
    if norm_first:
        return _final(x + sum(f(norm(x)) for f, norm in zip(subs, norms, strict=True)),
                      final_norm)
    return norms[-1](x + subs[-1](x))  # every step recomputed from x: only the last one counts


def _first_only(x, subs, norms, norm_first, final_norm=None):
    return _right(x, subs[:1], norms[:1], norm_first, final_norm)


STACK_MISTAKES = [
    Misconception(
        lambda x, s, n, nf, fn=None: _final(_run(_post_step, x, s, n), fn) if nf else None,
        "With norm_first=True (pre-norm, eq. 30) your steps normalise AFTER the residual add, "
        "LN(x + f(x)): that is post-norm. In pre-norm each norm is applied to its sublayer's "
        "input only, x = x + f(LN(x)), and the stream x itself is never normalised",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: None if nf else _run(_pre_step, x, s, n),
        "With norm_first=False (post-norm, eq. 31) your steps normalise the sublayer's input, "
        "x + f(LN(x)): that is pre-norm. In post-norm the norm comes after the residual add: "
        "x = LN(x + f(x))",
    ),
    Misconception(
        _wrong_each_step(lambda x, f, norm: f(norm(x)), lambda x, f, norm: norm(f(x))),
        "Your stack has no residual connections: each step must add the stream it started "
        "from back (eq. 29), x + f(...)",
    ),
    Misconception(
        _wrong_each_step(lambda x, f, norm: x + norm(f(x)), lambda x, f, norm: x + norm(f(x))),
        "You normalised each sublayer's OUTPUT before adding it, x + LN(f(x)). Pre-norm "
        "normalises the input, x + f(LN(x)); post-norm normalises the sum, LN(x + f(x))",
    ),
    Misconception(
        _wrong_each_step(lambda x, f, norm: norm(x) + f(norm(x))),
        "Your residual adds the normalised stream, LN(x) + f(LN(x)). The residual connection "
        "must carry the stream x itself, unchanged: x + f(LN(x))",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: None if nf else _run(
            lambda h, f, norm: norm(h + f(norm(h))), x, s, n),
        "Your post-norm sublayers read a normalised input AND the sum is normalised again: in "
        "post-norm each sublayer reads the stream directly, x = LN(x + f(x))",
    ),
    Misconception(
        _parallel,
        "Your sublayers all read the stack's input x. They run one after the other: each reads "
        "the stream as the previous step left it, so update x inside the loop",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _right(x, s, n[::-1], nf, fn),
        "Your norms are paired with the wrong sublayers (in reverse order): norms[i] belongs "
        "to sublayers[i]",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _right(x, s[::-1], n[::-1], nf, fn),
        "Your sublayers run in reverse order: sublayers[0] reads x first",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _right(x, s, [n[0]] * len(n), nf, fn),
        "You used norms[0] for every sublayer: each sublayer has its own norm, norms[i]",
    ),
    Misconception(
        _first_only,
        "Only your first sublayer ran: does your function return inside the loop?",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _run(_pre_step, x, s, n) if nf and fn is not None
        else None,
        "Your output leaves out final_norm: a pre-norm stream is never normalised inside the "
        "stack, so the model applies one more LayerNorm after the last sublayer. When "
        "final_norm is given, apply it once at the end",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _run(_pre_step, fn(x), s, n) if nf and fn is not None
        else None,
        "You applied final_norm to the stack's INPUT: it belongs at the end, after the last "
        "sublayer",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: _run(lambda h, f, norm: fn(_pre_step(h, f, norm)), x, s, n)
        if nf and fn is not None else None,
        "You applied final_norm after every sublayer: that normalises the stream inside the "
        "stack. It is applied once, after the last sublayer",
    ),
    Misconception(
        lambda x, s, n, nf, fn=None: n[-1](_run(_pre_step, x, s, n)) if nf else None,
        "You normalised the output with the last sublayer's norm, norms[-1]. The stack's output "
        "goes through final_norm when it is given, and through nothing when it is None",
    ),
]


def _zero_ff(block: EncoderBlock) -> None:
    """Make a pre-norm block's feed-forward sublayer add exactly 0 (x + 0 = x): the block then
    computes its attention step alone, a reference for stacks that end after an attention."""
    with torch.no_grad():
        block.ff.fc2.weight.zero_()
        block.ff.fc2.bias.zero_()


def _stack_case(name: str, x: torch.Tensor, n_blocks: int, n_sublayers: int, n_heads: int,
                norm_first: bool, final: bool, seed: int) -> tuple[Case, torch.Tensor]:
    """A case (the learner's arguments) and its expected output, from course_lib's
    EncoderBlocks (the reference) and, for pre-norm stacks, a final nn.LayerNorm."""
    d = x.shape[-1]
    with torch.random.fork_rng(devices=[]):  # leave the learner's random stream alone
        torch.manual_seed(seed)
        blocks = [EncoderBlock(d, n_heads, norm_first=norm_first).eval()
                  for _ in range(n_blocks)]
        final_norm = nn.LayerNorm(d) if final else None
        with torch.no_grad():  # random gains and biases, so that a wrong norm shows
            for norm in [m for b in blocks for m in (b.attn_norm, b.ff_norm)] + [final_norm]:
                if norm is not None:
                    norm.weight.copy_(1 + 0.5 * torch.randn(d))
                    norm.bias.copy_(0.5 * torch.randn(d))
    if n_sublayers < 2 * n_blocks:  # the stack ends after the last block's attention
        _zero_ff(blocks[-1])
    subs, norms = [], []
    for b in blocks:
        subs += [SelfAttentionOnly(b.self_attn), b.ff]
        norms += [b.attn_norm, b.ff_norm]
    for module in [*blocks, final_norm]:
        if module is not None:
            module.requires_grad_(False)
    with torch.no_grad():
        expected = x
        for b in blocks:
            expected = b(expected)[0]  # (B, T, D)
        expected = _final(expected, final_norm)
    args = (x, subs[:n_sublayers], norms[:n_sublayers], norm_first, final_norm)
    hint = "final_norm may be None: then the stream is returned as it is" if not final else ""
    return Case(name, args, hint=hint), expected


def _residual_stack_cases(seed: int) -> list[tuple[Case, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    specs = [  # name, (B, T, D), blocks, sublayers, heads, norm_first, final norm, scale
        ("pre-norm, 2 blocks (4 sublayers), final norm, (2, 5, 16)", (2, 5, 16), 2, 4, 2,
         True, True, 1.0),
        ("post-norm, 2 blocks (4 sublayers), final_norm=None, (2, 5, 16)", (2, 5, 16), 2, 4, 2,
         False, False, 1.0),
        ("pre-norm, 3 sublayers (attention, FFN, attention), final norm", (1, 6, 8), 2, 3, 1,
         True, True, 1.0),
        ("pre-norm, 3 blocks, final_norm=None, input of size 3 with offset 1", (1, 6, 8), 3,
         6, 2, True, False, 3.0),
        ("post-norm, 3 blocks, input of size 3 with offset 1", (1, 6, 8), 3, 6, 2, False,
         False, 3.0),
        ("pre-norm, one sublayer, final norm, T=1", (3, 1, 8), 1, 1, 2, True, True, 1.0),
        ("post-norm, one block, T=1", (3, 1, 8), 1, 2, 2, False, False, 1.0),
    ]
    cases = []
    for i, (name, shape, n_blocks, n_subs, heads, norm_first, final, scale) in enumerate(specs):
        x = rand(gen, *shape, scale=scale) + (1.0 if scale != 1.0 else 0.0)
        cases.append(_stack_case(name, x, n_blocks, n_subs, heads, norm_first, final,
                                 seed + 10 * i))
    return cases


def check_residual_stack(residual_stack: Callable) -> None:
    """Check ``residual_stack(x, sublayers, norms, norm_first, final_norm=None)`` -> (B, T, D):
    every sublayer applied in order with its residual connection and its own norm, pre-norm
    (eq. 30) or post-norm (eq. 31), then ``final_norm`` once when given. The expected outputs
    come from course_lib's ``EncoderBlock`` built from the same sublayers.

    Args:
        residual_stack: the learner's function.
    """
    cases_and_expected = _residual_stack_cases(seed=73)
    expected_of = {case.name: expected for case, expected in cases_and_expected}

    def check_one(got: Any, case: Case) -> None:
        compare_tensors(got, expected_of[case.name], case, what="Your stack's output",
                        misconceptions=STACK_MISTAKES)

    with torch.no_grad():
        run_cases("residual_stack", residual_stack, [c for c, _ in cases_and_expected],
                  check_one)


# --------------------------------------------------------------------------------------------
# Exercise 7.4: layer_grad_norms(layers, x, loss_fn)


class ResidualMLP(nn.Module):
    """x + W2 tanh(W1 LN(x)): a small pre-norm residual layer."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 2 * d_model), nn.Linear(2 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class BlockOutput(nn.Module):
    """An EncoderBlock that returns only its output tensor, so layers can be chained."""

    def __init__(self, block: EncoderBlock) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


class LayersWithGradients(nn.ModuleList):
    """A ModuleList whose copies keep the parameters' ``.grad`` (copy.deepcopy drops it):
    layers that still hold the gradients of an earlier backward pass."""

    def __deepcopy__(self, memo: dict) -> LayersWithGradients:
        clone = type(self)(copy.deepcopy(list(self), memo))
        for new, old in zip(clone.parameters(), self.parameters(), strict=True):
            if old.grad is not None:
                new.grad = old.grad.clone()
        return clone


def mean_square(h: torch.Tensor) -> torch.Tensor:
    """loss = mean(h^2)."""
    return h.pow(2).mean()


class FixedReadout:
    """loss = mean(h * r) for a fixed random r: the same gradient enters at every depth."""

    def __init__(self, shape: tuple[int, ...], seed: int) -> None:
        self.r = torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return (h * self.r).mean()


def _seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return build()
    finally:
        torch.random.set_rng_state(state)


def _run_stack(layers: nn.ModuleList, x: torch.Tensor, loss_fn: Callable, *,
               zero: bool = True) -> list[torch.Tensor]:
    """Backpropagate loss_fn(layers(x)) on a copy; return the grads of the inputs of every
    layer and of the output, [dL/dh_0, ..., dL/dh_L], and leave the copy's .grad filled."""
    if zero:
        layers.zero_grad(set_to_none=True)
    hs, h = [], x.detach().clone().requires_grad_(True)
    for layer in layers:
        hs.append(h)
        h = layer(h)
        h.retain_grad()
    hs.append(h)
    loss_fn(h).backward()
    return [t.grad for t in hs]


def _norms(layers: nn.ModuleList, per_param: Callable[[torch.Tensor], torch.Tensor],
           combine: Callable[[torch.Tensor], torch.Tensor],
           select: Callable[[torch.Tensor], bool] = lambda p: True) -> torch.Tensor:
    values = []
    for layer in layers:
        parts = [per_param(p.grad) for p in layer.parameters() if p.grad is not None and select(p)]
        values.append(combine(torch.stack(parts)) if parts else torch.tensor(0.0))
    return torch.stack(values)


def _stack_variants(layers: nn.ModuleList, x: torch.Tensor, loss_fn: Callable
                    ) -> dict[str, torch.Tensor]:
    """The right answer and the plausible wrong ones, each computed on a fresh copy."""
    fresh = copy.deepcopy(layers)
    activation_grads = _run_stack(fresh, x, loss_fn)
    stale = copy.deepcopy(layers)
    _run_stack(stale, x, loss_fn, zero=False)
    norm = torch.linalg.vector_norm
    return {
        "expected": reference_layer_grad_norms(fresh),
        "stale": reference_layer_grad_norms(stale),
        "sum of norms": _norms(fresh, norm, torch.sum),
        "squared": _norms(fresh, lambda g: g.pow(2).sum(), torch.sum),
        "weights only": _norms(fresh, lambda g: g.pow(2).sum(), lambda s: s.sum().sqrt(),
                               lambda p: p.dim() >= 2),
        "mean abs": _norms(fresh, lambda g: g.abs().sum(), torch.sum)
        / torch.tensor([float(sum(p.numel() for p in layer.parameters())) for layer in fresh]),
        "inputs": torch.stack([norm(g) for g in activation_grads[:-1]]),
        "outputs": torch.stack([norm(g) for g in activation_grads[1:]]),
    }


_GRAD_NORM_MESSAGES = {
    "stale": "Your norms include the gradients the layers already held from an earlier backward "
             "pass: loss.backward() ADDS to .grad. Clear them first (layers.zero_grad(), or "
             "p.grad = None for every parameter), or compute the gradients with "
             "torch.autograd.grad, which does not touch .grad",
    "reversed": "Your norms are in reverse order: entry 0 must be the FIRST layer (the one that "
                "reads x), the last entry the layer next to the loss",
    "sum of norms": "You added up the norms of each layer's parameters. A layer's gradient norm "
                    "is the norm of all its gradient entries together: sqrt of the sum of the "
                    "squares of every entry of every parameter, sqrt(sum_p ||grad_p||^2)",
    "squared": "Your values are squared norms: take the square root of the sum of squares",
    "weights only": "You left out some parameters (the biases, or the LayerNorm gains): a "
                    "layer's gradient norm covers every parameter in layer.parameters()",
    "mean abs": "You averaged the absolute gradient entries; the exercise asks for the L2 norm, "
                "sqrt(sum of squares)",
    "inputs": "Your norms are those of the gradients with respect to the ACTIVATIONS (each "
              "layer's input). The exercise asks for the gradients of each layer's "
              "PARAMETERS, p.grad for p in layer.parameters()",
    "outputs": "Your norms are those of the gradients with respect to the ACTIVATIONS (each "
               "layer's output). The exercise asks for the gradients of each layer's "
               "PARAMETERS, p.grad for p in layer.parameters()",
}


def _grad_norm_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    d = 8

    def blocks(n: int, norm_first: bool, s: int) -> nn.ModuleList:
        return nn.ModuleList(BlockOutput(_seeded(s + i, lambda: EncoderBlock(
            d, 2, norm_first=norm_first))) for i in range(n))

    residual = nn.ModuleList(_seeded(seed + i, lambda: ResidualMLP(d)) for i in range(4))
    plain = nn.Sequential(*(_seeded(seed + 10 + i, lambda: nn.Sequential(nn.Linear(d, d),
                                                                         nn.Tanh()))
                            for i in range(6)))
    old = LayersWithGradients(_seeded(seed + 20 + i, lambda: ResidualMLP(d)) for i in range(3))
    for p in old.parameters():
        p.grad = torch.randn(p.shape, generator=gen)  # left over from an earlier step
    return [
        Case("4 residual MLP layers, mean-square loss", (residual, rand(gen, 2, 5, d),
                                                         mean_square)),
        Case("6 plain Linear + tanh layers (an nn.Sequential)",
             (plain, rand(gen, 4, d), FixedReadout((4, d), seed))),
        Case("3 pre-norm EncoderBlocks", (blocks(3, True, seed + 30), rand(gen, 2, 4, d),
                                          FixedReadout((2, 4, d), seed + 1))),
        Case("3 post-norm EncoderBlocks", (blocks(3, False, seed + 40), rand(gen, 2, 4, d),
                                           FixedReadout((2, 4, d), seed + 2))),
        Case("one layer", (nn.ModuleList([_seeded(seed + 50, lambda: ResidualMLP(d))]),
                           rand(gen, 3, d), mean_square)),
        Case("3 layers that still hold gradients from an earlier backward pass",
             (old, rand(gen, 2, 3, d), mean_square),
             hint="loss.backward() adds to whatever .grad already holds"),
    ]


def check_layer_grad_norms(layer_grad_norms: Callable) -> None:
    """Check ``layer_grad_norms(layers, x, loss_fn)`` -> (L,): run x through the layers in
    order, backpropagate loss_fn(output), and return each layer's parameter-gradient norm.

    Args:
        layer_grad_norms: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        layers, x, loss_fn = case.args
        variants = _stack_variants(layers, x, loss_fn)
        expected = variants.pop("expected")
        variants["reversed"] = expected.flip(0)
        if isinstance(got, (list, tuple)) and all(
            isinstance(v, (float, int, torch.Tensor)) for v in got
        ):
            raise CheckFailure(
                f"Your function returned a {type(got).__name__} of {len(got)} values; return "
                f"one tensor of shape ({len(layers)},), e.g. torch.stack(norms) or "
                f"torch.tensor(norms) (case '{case.name}')"
            )
        if isinstance(got, torch.Tensor):
            got = got.detach()
            n_params = sum(1 for _ in layers.parameters())
            if got.dim() == 1 and len(got) == n_params != len(layers):
                raise CheckFailure(
                    f"Your result has {n_params} entries, one per parameter tensor; combine all "
                    f"the parameters of a layer into one norm, {len(layers)} entries in all "
                    f"(case '{case.name}')"
                )
        mistakes = [Misconception(lambda *args, v=value: v, _GRAD_NORM_MESSAGES[name])
                    for name, value in variants.items()]
        compare_tensors(got, expected, case, what="Your gradient norms",
                        misconceptions=mistakes)

    run_cases("layer_grad_norms", layer_grad_norms, _grad_norm_cases(seed=74), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 7.5: drop_path(branch, p, training), stochastic depth: each example's whole residual
# branch is zeroed with probability p (one coin per example) and kept ones are divided by 1 - p.

N_REPEATS = 200


def _fail(message: str, case: Case) -> CheckFailure:
    return CheckFailure(f"{message} (case '{case.name}')")


def _check_eval(got: torch.Tensor, x: torch.Tensor, p: float, case: Case) -> None:
    if torch.equal(got, x):
        return
    if p > 0 and torch.allclose(got, x * (1 - p)):
        raise _fail("With training=False your function returns x * (1 - p): that is the old, "
                    "non-inverted scaling. The kept branches are scaled by 1 / (1 - p) during "
                    "training, so at evaluation the branch is returned unchanged", case)
    if bool(((got == 0) & (x != 0)).any()):
        raise _fail("With training=False your function still drops values. Drop path, like "
                    "dropout, acts only during training; at evaluation return the branch "
                    "unchanged", case)
    raise _fail("With training=False your function must return the branch unchanged, but it "
                "changed the values", case)


def _check_kept_values(got: torch.Tensor, x: torch.Tensor, p: float, case: Case) -> None:
    kept = got != 0
    if not bool(kept.any()):
        raise _fail(f"Every value was dropped with p = {p}: keep each example's branch with "
                    "probability 1 - p", case)
    ratio = got[kept] / x[kept]
    scale = 1 / (1 - p)
    for value, message in (
        (1.0, "The branches you keep are unchanged: divide them by (1 - p), so that the "
              "expected value of every element stays x ((1 - p) * x / (1 - p) + p * 0 = x) "
              "and evaluation needs no rescaling"),
        (1 - p, "You multiplied the kept branches by (1 - p); divide by (1 - p) instead"),
        (1 / p if p > 0 else math.inf, "You divided the kept branches by p; divide by (1 - p), "
                                       "the probability of KEEPING a branch"),
    ):
        if abs(value - scale) > 1e-3 and torch.allclose(ratio, torch.full_like(ratio, value),
                                                        rtol=1e-4):
            raise _fail(message, case)
    if not torch.allclose(got[kept], x[kept] * scale, rtol=1e-5, atol=1e-6):
        raise _fail(f"Every value you keep should be x / (1 - p) = x * {scale:.4g}, and every "
                    "other value 0; some of yours are neither", case)


def _dropped(got: torch.Tensor) -> torch.Tensor:
    """(B, n) booleans: which values of each example were zeroed."""
    return (got == 0).reshape(got.shape[0], -1)


def _check_per_example(got: torch.Tensor, case: Case) -> None:
    """Each example all dropped or all kept; name the unit that was used otherwise."""
    per_example = _dropped(got)
    whole = per_example.all(-1) | ~per_example.any(-1)  # (B,)
    if bool(whole.all()):
        return
    if got.dim() >= 3:
        rows = (got == 0).reshape(*got.shape[:2], -1)  # (B, T, n)
        if bool((rows.all(-1) | ~rows.any(-1)).all()):
            raise _fail("You drop whole positions, one coin per example AND position: drop "
                        "path decides once per example, for all its positions and features "
                        "together (the mask has size 1 on every axis but the first)", case)
    columns = per_example.all(0) | ~per_example.any(0)  # (n,): the same in every example
    if bool(columns.all()):
        raise _fail("Every example drops the same features: your coins are drawn along the "
                    "wrong axis. Draw one per example (along the first axis), shared by all of "
                    "that example's values", case)
    raise _fail("You drop single values, as dropout does: drop path zeroes an example's whole "
                "branch or keeps all of it, one coin per example", case)


def _check_example_fraction(got: torch.Tensor, again: torch.Tensor, p: float,
                            case: Case) -> None:
    dropped = _dropped(got).all(-1)  # (B,): examples whose branch was zeroed
    if bool(dropped.all()) or not bool(dropped.any()):
        raise _fail(f"Your function {'dropped' if bool(dropped.all()) else 'kept'} every "
                    "example's branch in the same call: one coin for the whole batch. Draw one "
                    "per example", case)
    if torch.equal(dropped, _dropped(again).all(-1)):
        raise _fail("Two calls on the same input dropped exactly the same examples: draw new "
                    "coins at every call (do not call torch.manual_seed inside your "
                    "function)", case)
    fraction = float(dropped.float().mean())
    if abs(fraction - (1 - p)) < 0.02 and abs(p - 0.5) > 0.05:
        raise _fail(f"You dropped {fraction:.1%} of the examples with p = {p}: p is the "
                    "probability of DROPPING a branch", case)
    if abs(fraction - p) >= 0.02:
        raise _fail(f"You dropped {fraction:.1%} of the examples, but with p = {p} about "
                    f"{p:.0%} of them should lose their branch, each independently", case)


REPEATED_CASE = f"training, p=0.5, 64 examples, {N_REPEATS} calls"


def _check_count_varies(drop_path: Callable, got: torch.Tensor, case: Case) -> None:
    """Each example is dropped independently, so the NUMBER dropped is binomial: over many
    calls it varies, with a standard deviation of sqrt(B p (1 - p)) (4 for B = 64, p = 0.5)."""
    x, p, _ = case.args
    counts = [float(_dropped(got).all(-1).sum())]
    for _ in range(N_REPEATS - 1):
        counts.append(float(_dropped(call_learner(drop_path, case)).all(-1).sum()))
    spread = float(torch.tensor(counts).std())
    expected = math.sqrt(x.shape[0] * p * (1 - p))
    if spread < expected / 4:
        raise _fail(f"Your function dropped {counts[0]:.0f} of {x.shape[0]} examples at every "
                    f"one of {N_REPEATS} calls (spread {spread:.2f}). Each example gets its own "
                    "coin, so the number dropped varies from call to call like a binomial "
                    f"(standard deviation sqrt(B p (1 - p)) = {expected:.1f} here)", case)


_SHAPE_HINT = ("the coins' tensor needs one entry per example and size 1 on every other axis, "
               "however many axes the branch has")


def _drop_path_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    big = rand(gen, 10_000, 2, 5) + 0.1  # 10,000 examples, no value 0
    return [
        Case("eval mode, p=0.5, (4, 3, 6)", (rand(gen, 4, 3, 6), 0.5, False)),
        Case("training, p=0.5, 10,000 examples of (2, 5)", (big, 0.5, True), hint=_SHAPE_HINT),
        Case("training, p=0.2, 10,000 examples of (2, 5)", (big, 0.2, True)),
        Case("training, p=0.9, 10,000 examples of (2, 5)", (big, 0.9, True)),
        Case("training, p=0", (rand(gen, 3, 4, 5), 0.0, True)),
        Case("training, p=0.3, 2-D branch (300, 8)", (rand(gen, 300, 8) + 3.0, 0.3, True),
             hint=_SHAPE_HINT),
        Case("training, p=0.4, 4-D branch (400, 2, 3, 2)",
             (rand(gen, 400, 2, 3, 2) + 3.0, 0.4, True), hint=_SHAPE_HINT),
        Case("eval mode, p=0.3, 2-D (3, 4)", (rand(gen, 3, 4), 0.3, False)),
        Case(REPEATED_CASE, (rand(gen, 64, 3, 4) + 3.0, 0.5, True)),
    ]


def check_drop_path(drop_path: Callable) -> None:
    """Check ``drop_path(branch, p, training)``: in training each example's whole branch (all
    of ``branch[b]``) is zeroed with probability p, the others divided by (1 - p); otherwise
    the branch is returned unchanged. Judged by statistics of many draws, not one mask.

    The learner's function draws random numbers; the check seeds torch's generator for its own
    calls and restores the learner's random state afterwards.

    Args:
        drop_path: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        x, p, training = case.args
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            hint = (f": {_SHAPE_HINT}" if isinstance(got, torch.Tensor)
                    and got.dim() != x.dim() else "")
            raise _fail(f"Your function should return a tensor of the branch's shape "
                        f"{tuple(x.shape)}, but returned {describe(got)}{hint}", case)
        if not training:
            _check_eval(got, x, p, case)
            return
        if p == 0:
            if not torch.equal(got, x):
                raise _fail("With p = 0 nothing is dropped and 1 / (1 - p) = 1: the output must "
                            "equal the branch", case)
            return
        _check_kept_values(got, x, p, case)
        _check_per_example(got, case)
        if case.name == REPEATED_CASE:
            _check_count_varies(drop_path, got, case)
        elif x.shape[0] >= 10_000:  # enough examples for a fraction within 0.02 (4 sd)
            _check_example_fraction(got, call_learner(drop_path, case), p, case)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(75)
        run_cases("drop_path", drop_path, _drop_path_cases(seed=75), check_one)
    print("   In a block, x + drop_path(f(LN(x)), p, training) leaves the stream of a dropped "
          "example untouched: for that example the whole block is skipped.")


# --------------------------------------------------------------------------------------------
# Exercise 7.3 (find the bug): a pre-norm block with dropout that agrees with the reference in
# eval mode; its bug (dropout on the stream, not on the sublayer's output) shows only in
# training mode. Both blocks are run from the same seed, so they draw the same masks.


_INSTRUMENT = ("Instrument: equality with the reference, course_lib's "
               "EncoderBlock(norm_first=True, dropout=p) with your block's weights copied in, "
               "run in training mode from the same seed (torch.manual_seed before each call), "
               "so that both draw the same dropout masks; in eval mode every dropout is off "
               "and such a comparison cannot see where a dropout sits")


def _pre_norm_variants(ref: EncoderBlock, x: torch.Tensor, seed: int
                       ) -> dict[str, torch.Tensor]:
    """What plausible wrong fixes compute in training mode, from the reference block's own
    sublayers, each drawn from ``seed`` as the learner's block is."""
    def attn(h: torch.Tensor) -> torch.Tensor:
        return ref.self_attn(h)[0]  # (B, T, D)

    drop, ln1, ln2, ff = ref.dropout, ref.attn_norm, ref.ff_norm, ref.ff
    steps = {
        "unchanged": lambda: (h := drop(x + attn(ln1(x)))) + drop(ff(ln2(h))),
        "both streams dropped": lambda: drop((h := drop(x + attn(ln1(x)))) + ff(ln2(h))),
        "no dropout": lambda: (h := x + attn(ln1(x))) + ff(ln2(h)),
        "inputs dropped": lambda: (h := x + attn(drop(ln1(x)))) + ff(drop(ln2(h))),
        "one dropout": lambda: (h := x + drop(attn(ln1(x)))) + ff(ln2(h)),
    }
    out = {}
    for name, step in steps.items():
        torch.manual_seed(seed)
        out[name] = step()
    return out


_PRE_NORM_MESSAGES = {
    "unchanged": "In training mode your block still computes what the buggy block computes: "
                 "its first step drops values of the stream itself, x + a, so parts of the "
                 "residual stream vanish. Dropout belongs on the sublayer's output before it "
                 "joins the stream, x + dropout(f(LN(x)))",
    "both streams dropped": "Your block drops values of the stream itself (after an addition). "
                            "Dropout belongs on each sublayer's output before it joins the "
                            "stream, x + dropout(f(LN(x))), so the stream passes untouched",
    "no dropout": "Your block has no dropout on its residual branches: in training it must drop "
                  "each sublayer's output before adding it, x + dropout(f(LN(x))), as "
                  "EncoderBlock(dropout=p) does",
    "inputs dropped": "Your block drops the sublayers' INPUTS, f(dropout(LN(x))). The reference "
                      "(and the original Transformer) drops each sublayer's OUTPUT before it "
                      "joins the stream, x + dropout(f(LN(x)))",
    "one dropout": "Only your attention step drops its output; the feed-forward step must too, "
                   "x + dropout(f(LN(x))) for both sublayers",
}


def _locate(ref: nn.Module, block: nn.Module, x: torch.Tensor) -> str:
    try:
        report = first_divergence(ref, block, lambda m: m(x))
        if report.agree:
            return (f"{report}: every submodule's own output agrees, so the difference is in "
                    "the code between them (the residual additions, which norm is applied to "
                    "what)")
        return str(report)
    except (ValueError, RuntimeError) as exc:  # e.g. NaN outputs: nothing to conclude
        return f"(the locator could not run: {exc})"


def _build_block(block_cls: Callable, d: int, n_heads: int, p: float,
                 ref: EncoderBlock) -> nn.Module:
    block = call_learner(block_cls, Case(
        "building the block", (d, n_heads, p),
        hint="keep the buggy block's __init__ (subclass it and override forward only)"))
    if not isinstance(block, nn.Module):
        raise CheckFailure(f"expected an nn.Module class, got {describe(block)}")
    mine, theirs = set(block.state_dict()), set(ref.state_dict())
    if mine != theirs:
        raise CheckFailure(f"Your block's parameters are not the buggy block's: missing "
                           f"{sorted(theirs - mine)[:4]}, extra {sorted(mine - theirs)[:4]}. "
                           "Keep its __init__ and fix forward only")
    block.load_state_dict(ref.state_dict())
    return block


def check_pre_norm_block(block_cls: Callable) -> None:
    """Check a fixed pre-norm block with dropout: ``block_cls(d_model, n_heads, dropout)`` with
    the attributes ``self_attn``, ``attn_norm``, ``ff``, ``ff_norm``, ``dropout``, whose
    ``forward(x)`` returns (B, T, D). It is compared with course_lib's
    ``EncoderBlock(norm_first=True, dropout=p)`` holding the same weights, in eval mode and then
    in training mode from the same seeds; a difference in training mode is matched against
    common wrong placements of the dropout.

    Args:
        block_cls: the learner's block class.
    """
    gen = torch.Generator().manual_seed(76)
    specs = [("(2, 5, 16), 2 heads, p=0.1", (2, 5, 16), 2, 0.1),
             ("(1, 7, 32), 4 heads, p=0.5", (1, 7, 32), 4, 0.5),
             ("(3, 1, 16), one position, p=0.3", (3, 1, 16), 2, 0.3),
             ("(2, 6, 8), 1 head, p=0.2, a large input", (2, 6, 8), 1, 0.2)]
    cases = []
    with torch.random.fork_rng(devices=[]):  # leave the learner's random stream alone
        for i, (name, shape, heads, p) in enumerate(specs):
            torch.manual_seed(760 + i)
            ref = EncoderBlock(shape[-1], heads, dropout=p, norm_first=True)
            with torch.no_grad():  # random gains and biases, so that a misplaced norm shows
                for norm in (ref.attn_norm, ref.ff_norm):
                    norm.weight.copy_(1 + 0.5 * torch.randn(shape[-1]))
                    norm.bias.copy_(0.5 * torch.randn(shape[-1]))
            scale = 20.0 if "large" in name else 1.0
            cases.append((Case(name, (rand(gen, *shape, scale=scale),)), ref, heads, p))
    with torch.random.fork_rng(devices=[]):  # building and running blocks draws numbers too
        for case, ref, heads, p in cases:
            _compare_block(block_cls, case, ref, heads, p)
    labels = "; ".join(c.name for c, _, _, _ in cases)
    print(f"\u2705 your block equals course_lib's pre-norm EncoderBlock(dropout=p) with the same "
          f"weights, in eval mode and in training mode from the same seeds, on all "
          f"{len(cases)} inputs ({labels})")


def _compare_block(block_cls: Callable, case: Case, ref: EncoderBlock, heads: int,
                   p: float) -> None:
    """Build the learner's block with the reference's weights and compare one input, in eval
    mode, then in training mode from three seeds."""
    (x,) = case.args
    block = _build_block(block_cls, x.shape[-1], heads, p, ref)
    with torch.no_grad():
        block.eval()
        ref.eval()
        got = call_learner(block, case, fn_name="your block")
        if isinstance(got, tuple) and got and isinstance(got[0], torch.Tensor):
            got = got[0]  # (out, weights), as EncoderBlock returns: the output is enough
        expected = ref(x)[0]  # (B, T, D)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and not torch.allclose(
                got, expected, atol=ATOL, rtol=RTOL):
            if not torch.equal(got, call_learner(block, case, fn_name="your block")):
                raise CheckFailure(
                    f"In eval mode your block gives a different output at every call (case "
                    f"'{case.name}'): something still drops values. F.dropout's training "
                    "argument defaults to True; the block's own self.dropout (an nn.Dropout) "
                    "follows .eval()")
            raise CheckFailure(f"In eval mode, where no dropout acts, your block differs from "
                               f"the reference (case '{case.name}'): keep the buggy block's "
                               f"norms and residual additions as they are.\n"
                               f"{_locate(ref, block, x)}")
        compare_tensors(got, expected, case, what="Your block's output in eval mode")
        block.train()
        ref.train()
        for seed in (0, 1, 2):
            torch.manual_seed(seed)
            expected = ref(x)[0]  # (B, T, D): the masks drawn from this seed
            torch.manual_seed(seed)
            got = call_learner(block, case, fn_name="your block")
            if isinstance(got, tuple) and got and isinstance(got[0], torch.Tensor):
                got = got[0]
            variants = _pre_norm_variants(ref, x, seed)
            mistakes = [Misconception(lambda *args, v=v: v, _PRE_NORM_MESSAGES[k])
                        for k, v in variants.items()]
            try:
                compare_tensors(got, expected, case,
                                what=f"Your block's output in training mode (seed {seed})",
                                misconceptions=mistakes)
            except CheckFailure as failure:
                raise CheckFailure(f"{failure}\n{_INSTRUMENT}") from None


# --------------------------------------------------------------------------------------------
# Exercise 7.6 (experiment): the 1/sqrt(2N) initialisation and the residual stream

SWEEP = (2, 6, 12, 24, 48)
# The experiment is random: its result depends on the weights drawn, and a correct experiment
# that draws them in another order than the book gets other numbers. So each depth is graded
# against the distribution of the correct experiment, not against one run. Measured with
# `python -m benchmarks.grader_7_6_band band --seeds 1000` (one run per seed, the check's input):
# (scaled, N) -> (geometric mean of the stream's std, spread = sd of log(std) of ONE run; a
# learner who seeds inside the function gets one run however many the check averages). Over
# the 1,000 draws the farthest run was 4.1 spreads from the mean.
STREAM_STD = {
    (False, 2): (0.0568, 0.039), (False, 6): (0.0989, 0.055), (False, 12): (0.1422, 0.066),
    (False, 24): (0.2036, 0.068), (False, 48): (0.2920, 0.071),
    (True, 2): (0.0328, 0.025), (True, 6): (0.0331, 0.028), (True, 12): (0.0333, 0.029),
    (True, 24): (0.0333, 0.029), (True, 48): (0.0333, 0.030),
}
STREAM_BAND = 6.0  # spreads either side of the mean: 1.9 beyond the farthest of 1,000 draws
# The plausible wrong experiments the check names, measured the same way (geometric means;
# each keeps the right trends and differs from the book at some depth by 8 spreads or more)
WRONG_STREAM_STD = {
    "one block too few": (
        "your stack has one block fewer than n_blocks (an off-by-one in the loop that builds "
        "or runs the blocks?)",
        {(False, 2): 0.0414, (False, 6): 0.0901, (False, 12): 0.1362, (False, 24): 0.2003,
         (False, 48): 0.2906, (True, 2): 0.0269, (True, 6): 0.0313, (True, 12): 0.0323,
         (True, 24): 0.0329, (True, 48): 0.0331}),
    "divisor sqrt(N)": (
        "your scaled projections start at 0.02 / sqrt(N): GPT-2 divides by sqrt(2N), since "
        "each of the N blocks adds TWO outputs (attention and feed-forward) to the stream",
        {(False, 2): 0.0570, (False, 6): 0.0989, (False, 12): 0.1417, (False, 24): 0.2047,
         (False, 48): 0.2904, (True, 2): 0.0423, (True, 6): 0.0431, (True, 12): 0.0432,
         (True, 24): 0.0436, (True, 48): 0.0432}),
}


def _repeats(n_blocks: int) -> int:
    """Runs averaged at each depth: a shallow stack has few random matrices, so its stream's
    size varies more from seed to seed; averaging several runs steadies it."""
    return max(1, 12 // n_blocks)


def stream_range(scaled: bool, n_blocks: int) -> tuple[float, float]:
    """The range of the stream's std that a correct experiment gives at this depth, whatever
    weights it draws: STREAM_BAND spreads either side of the mean, in log space."""
    mean, spread = STREAM_STD[scaled, n_blocks]
    return mean * math.exp(-STREAM_BAND * spread), mean * math.exp(STREAM_BAND * spread)


def reference_stream_std(x: torch.Tensor, n_blocks: int, scaled: bool, *,
                         n_built: int | None = None,
                         divisor: Callable[[int], float] | None = None) -> float:
    """The experiment of exercise 7.6 done by the book: ``n_blocks`` pre-norm EncoderBlocks
    (4 heads) initialised as GPT-2 does, the two projections into the stream at std
    0.02 / sqrt(2N) when ``scaled``; returns the std of the stream after the last block.
    ``n_built`` and ``divisor`` build the plausible wrong versions (another number of blocks,
    another divisor) whose distributions are in WRONG_STREAM_STD."""
    divisor = divisor or (lambda n: math.sqrt(2 * n))
    blocks = [EncoderBlock(x.shape[-1], 4) for _ in range(n_blocks if n_built is None
                                                        else n_built)]
    for block in blocks:
        for module in (block.self_attn, block.ff):
            for linear in [m for m in module.modules() if isinstance(m, nn.Linear)]:
                nn.init.normal_(linear.weight, std=0.02)
                nn.init.zeros_(linear.bias)
        if scaled:
            for linear in (block.self_attn.out_proj, block.ff.fc2):
                nn.init.normal_(linear.weight, std=0.02 / divisor(n_blocks))
    h = x
    with torch.no_grad():
        for block in blocks:
            h = block(h)[0]  # (B, T, D)
    return float(h.std())


def _measure(stream_std_after: Callable, x: torch.Tensor, n_blocks: int, scaled: bool) -> float:
    case = Case(f"n_blocks={n_blocks}, scaled={scaled}", (x, n_blocks, scaled))
    got = require_real(call_learner(stream_std_after, case), "stream_std_after's result", case)
    if not math.isfinite(got) or got <= 0:
        raise CheckFailure(f"stream_std_after returned {got} (case '{case.name}'): a standard "
                           "deviation is a positive, finite number")
    return got


def _sweep(fn: Callable[[torch.Tensor, int, bool], float], x: torch.Tensor,
           scaled: bool) -> list[float]:
    """fn's stream std at every depth of SWEEP, averaged over _repeats(N) seeded runs (the
    learner's random stream is restored afterwards)."""
    means = []
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        for n in SWEEP:
            runs = []
            for i in range(_repeats(n)):
                torch.manual_seed(1000 * n + 10 * i + int(scaled))
                runs.append(fn(x, n, scaled))
            means.append(sum(runs) / len(runs))
    return means


def _fits(values: list[float], scaled: bool, means: dict | None = None) -> bool:
    """Whether every depth's std lies within STREAM_BAND spreads of ``means`` (the correct
    experiment's, or a wrong one's) for this setting."""
    means = means or {key: mean for key, (mean, _) in STREAM_STD.items()}
    return all(abs(math.log(v / means[scaled, n])) <= STREAM_BAND * STREAM_STD[scaled, n][1]
               for n, v in zip(SWEEP, values, strict=True))


def _judge_trends(unscaled: list[float], scaled: list[float], x_std: float) -> None:
    """Only for measurements outside the band: what their trends say is wrong."""
    growth, spread = unscaled[-1] / unscaled[0], max(scaled) / min(scaled)
    shrink = scaled[0] / scaled[-1]
    if growth < 2:
        raise CheckFailure(f"Without the scaling your stream grows only x{growth:.2f} from "
                           f"{SWEEP[0]} to {SWEEP[-1]} blocks; it should grow several times. Start "
                           "every weight matrix at std 0.02 and every bias at 0 (GPT-2's "
                           "initialisation), leave the LayerNorms alone, and pass x through "
                           "the blocks unchanged")
    if spread > 1.25 or shrink > 1.12:
        trend = "shrinks" if shrink > 1.12 else "still grows"
        fix = ("divide the std by sqrt(2N), not by 2N" if trend == "shrinks" else
               "give the two projections that WRITE into the stream (self_attn.out_proj and "
               "ff.fc2) std 0.02 / sqrt(2N), with N the number of blocks of THIS stack, and "
               "every bias 0")
        raise CheckFailure(f"With the scaling your stream {trend} with depth (from "
                           f"{scaled[0]:.3f} to {scaled[-1]:.3f}): {fix}")
    if min(scaled) < x_std * 0.9:
        raise CheckFailure(f"Your scaled stream ({min(scaled):.3f}) is smaller than its input "
                           f"({x_std:.3f}): blocks add to the stream, they cannot shrink it. "
                           "Is the input passed through every block, h = block(h)[0]?")


def _judge(unscaled: list[float], scaled: list[float], x_std: float) -> None:
    """Pass when every depth of both settings lies in the band of the correct experiment;
    otherwise name the mistake: by the band of a known wrong experiment first, then by the
    trends, then the depth that is out of range."""
    if _fits(unscaled, False) and _fits(scaled, True):
        return
    if all(abs(v - 1) < 0.05 for v in unscaled + scaled):
        raise CheckFailure("Every standard deviation you measured is about 1: that is the size "
                           "of a LayerNorm's output. Measure the residual stream itself, the "
                           "block's output h, with no final LayerNorm")
    growth = unscaled[-1] / unscaled[0]
    if (_fits(unscaled, True) and _fits(scaled, False)) or (
            growth < 2 and scaled[-1] / scaled[0] >= 2):
        raise CheckFailure(f"Your two settings look swapped: with scaled=False your stream "
                           f"stays flat (x{growth:.2f} from {SWEEP[0]} to {SWEEP[-1]} blocks), "
                           f"with scaled=True it grows (x{scaled[-1] / scaled[0]:.2f}). The "
                           "0.02 / sqrt(2N) initialisation belongs to scaled=True")
    if _fits(unscaled, False) and _fits(scaled, False):
        raise CheckFailure("With scaled=True your stream is as large as without: does your "
                           "function use its `scaled` argument?")
    for message, means in WRONG_STREAM_STD.values():
        if _fits(unscaled, False, means) and _fits(scaled, True, means):
            raise CheckFailure(f"Your measurements match an experiment in which {message}")
    _judge_trends(unscaled, scaled, x_std)
    for setting, values in ((False, unscaled), (True, scaled)):
        for n, value in zip(SWEEP, values, strict=True):
            low, high = stream_range(setting, n)
            if not low <= value <= high:
                raise CheckFailure(
                    f"With scaled={setting} and N = {n} blocks your stream's std is "
                    f"{value:.4f}, outside {low:.4f} to {high:.4f}: the range that the same "
                    f"experiment gives with any random weights (its mean over 1,000 draws is "
                    f"{STREAM_STD[setting, n][0]:.4f}). Compare your initialisation, the number "
                    "of blocks and what you measure with the exercise's description")


def check_scaled_init(stream_std_after: Callable) -> None:
    """Check the experiment ``stream_std_after(x, n_blocks, scaled)`` -> float: the standard
    deviation of the residual stream after ``n_blocks`` pre-norm EncoderBlocks initialised
    GPT-2-style, with or without the 1/sqrt(2N) scaling. The check runs the sweep itself
    (averaging a few seeded runs of the shallow stacks) and grades each depth of both settings
    against the range that the correct experiment gives with any random weights (STREAM_STD,
    measured over 1,000 draws), so a correct experiment that draws its weights in another order
    passes; outside it, it names the mistake. Only when all of that holds does it print the
    measurements, next to the book's means.

    Args:
        stream_std_after: the learner's function.
    """
    x = 0.02 * torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(77))  # (B, T, D)

    def learner(x: torch.Tensor, n: int, s: bool) -> float:
        return _measure(stream_std_after, x, n, s)

    unscaled = _sweep(learner, x, False)
    scaled = _sweep(learner, x, True)
    _judge(unscaled, scaled, float(x.std()))
    print(f"\u2705 the unscaled stream grows x{unscaled[-1] / unscaled[0]:.1f} from {SWEEP[0]} "
          f"to {SWEEP[-1]} blocks; with 1/sqrt(2N) it stays within "
          f"x{max(scaled) / min(scaled):.2f}")
    print(f"input std {float(x.std()):.3f}; each number is a mean over "
          + ", ".join(f"{_repeats(n)} run{'s' * (_repeats(n) > 1)} at N = {n}"
                      for n in SWEEP if _repeats(n) > 1) + ", one run deeper; other weights "
          "give other digits (the book: its mean over 1,000 draws)")
    print(f"{'blocks N':>8} {'std 0.02':>9} {'(book)':>7} {'0.02 / sqrt(2N)':>16} {'(book)':>7}")
    for n, u, s in zip(SWEEP, unscaled, scaled, strict=True):
        print(f"{n:>8} {u:9.3f} {STREAM_STD[False, n][0]:7.3f} {s:16.3f} "
              f"{STREAM_STD[True, n][0]:7.3f}")


# --------------------------------------------------------------------------------------------
# Exercise 7.7 (experiment): learning-rate warm-up, the schedule and a sweep over its length

WARMUP_VOCAB = 16  # tokens of the toy task
WARMUP_STEPS = 80  # updates of one run
WARMUP_PEAK = 2.5e-2  # a peak learning rate high enough that no warm-up stalls the model
WARMUP_SWEEP = (0, 5, 20, 50)


def warmup_model() -> DecoderLM:
    """The experiment's model: a post-norm DecoderLM of 6 blocks (d_model 32, 4 heads, context
    16, vocabulary 16), seeded, so every call returns the same initial weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return DecoderLM(DecoderConfig(vocab_size=WARMUP_VOCAB, d_model=32, n_heads=4,
                                       n_layers=6, max_len=16, norm_first=False))


def train_with_schedule(model: nn.Module, schedule: Callable[[int], float],
                        steps: int = WARMUP_STEPS) -> list[float]:
    """Train ``model`` on the toy task (random tokens; at every position, predict the previous
    token, position 0 its own) with Adam (betas 0.9, 0.98), no clipping, the learning rate of
    update ``step`` (0, 1, ..., steps - 1) being ``schedule(step)``. The batches (16 x 16) are
    the same in every call. Returns the training loss of every update, measured before it."""
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98))
    losses = []
    model.train()
    with num_threads(1):  # tiny matrices: one thread is as fast and gives the same numbers
        for step in range(steps):
            ids = torch.randint(0, WARMUP_VOCAB, (16, 16), generator=gen)  # (B, T)
            targets = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)  # (B, T), the previous token
            for group in optimizer.param_groups:
                group["lr"] = float(schedule(step))
            loss = model(ids, targets=targets).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def reference_lr_at(step: int, peak: float, warmup_steps: int) -> float:
    """Linear warm-up over ``warmup_steps`` updates (update warmup_steps - 1 is the first at the
    peak, as in course_lib's ``train``), then constant."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    return peak


def _lr_value(lr_at: Callable, step: int, peak: float, warmup: int) -> float:
    hint = ("warmup_steps=0 means no warm-up: the peak from update 0 on (so nothing to divide "
            "by)" if warmup == 0 else "")
    case = Case(f"step={step}, peak={peak}, warmup_steps={warmup}", (step, peak, warmup),
                hint=hint)
    return require_number(call_learner(lr_at, case), "lr_at's learning rate", case)


def _close_lr(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def _judge_schedule(lr_at: Callable, peak: float, warmup: int) -> None:
    last = max(warmup + 12, 30)
    got = [_lr_value(lr_at, step, peak, warmup) for step in range(last)]
    want = [reference_lr_at(step, peak, warmup) for step in range(last)]
    if all(_close_lr(g, w) for g, w in zip(got, want, strict=True)):
        return
    where = f"(peak={peak}, warmup_steps={warmup})"
    if warmup == 0:
        raise CheckFailure(f"With warmup_steps=0 there is no warm-up: every update uses the "
                           f"peak, but your lr at update 0 is {got[0]:.4g} {where}")
    if warmup > 1 and _close_lr(got[0], peak):
        raise CheckFailure(f"Your schedule starts at the peak ({got[0]:.4g} at update 0) "
                           f"{where}: that is no warm-up. Update 0 should use peak / "
                           "warmup_steps, and the learning rate rise linearly from there")
    if got[0] == 0:
        raise CheckFailure(f"Your learning rate at update 0 is 0 {where}: the first update "
                           "does nothing (an off-by-one, or an integer division). Update 0 "
                           f"should use peak / warmup_steps = {want[0]:.4g}: count it as the "
                           "first of the warm-up's updates, (step + 1)")
    rising = got[:warmup]
    if any(b < a for a, b in zip(rising, rising[1:], strict=False)):
        raise CheckFailure(f"Your learning rate decreases during the warm-up {where}: it "
                           "should rise linearly from peak / warmup_steps to the peak")
    if any(g > peak * (1 + 1e-6) for g in got):
        step = next(i for i, g in enumerate(got) if g > peak * (1 + 1e-6))
        raise CheckFailure(f"Your learning rate overshoots the peak: {got[step]:.4g} at update "
                           f"{step} {where}. After the warm-up it stays at the peak")
    after = got[warmup:]
    if not all(_close_lr(g, peak) for g in after):
        if all(g < peak * (1 - 1e-6) for g in got):
            raise CheckFailure(f"Your schedule never reaches the peak {where}: its largest "
                               f"value is {max(got):.4g}. Update warmup_steps - 1 should be "
                               "the first at the peak, and every later one stays there")
        step = next(i for i, g in enumerate(after) if not _close_lr(g, peak)) + warmup
        raise CheckFailure(f"After the warm-up your learning rate changes ({got[step]:.4g} at "
                           f"update {step}) {where}: in this exercise it stays constant at the "
                           "peak (no decay)")
    if not _close_lr(got[warmup - 1], peak):
        raise CheckFailure(f"Your warm-up reaches the peak one update late {where}: update "
                           f"{warmup - 1} has {got[warmup - 1]:.4g}, not the peak. The warm-up "
                           "has warmup_steps updates, 0 to warmup_steps - 1, the last of them "
                           "at the peak: peak * (step + 1) / warmup_steps")
    step = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not _close_lr(g, w))
    raise CheckFailure(f"Your learning rate at update {step} is {got[step]:.4g}, expected "
                       f"{want[step]:.4g} {where}. During the warm-up, update step uses "
                       "peak * (step + 1) / warmup_steps")


def check_lr_at(lr_at: Callable) -> None:
    """Check ``lr_at(step, peak, warmup_steps)`` -> float: a linear warm-up, update ``step``
    (0-based) using ``peak * (step + 1) / warmup_steps`` while ``step < warmup_steps``, then the
    constant peak; ``warmup_steps=0`` is no warm-up.

    Args:
        lr_at: the learner's function.
    """
    settings = [(1e-3, 10), (2.5e-2, 4), (0.5, 1), (3e-4, 0), (1.0, 50), (6e-4, 3)]
    for peak, warmup in settings:
        _judge_schedule(lr_at, peak, warmup)
    print(f"\u2705 lr_at matches the schedule on {len(settings)} settings (warm-ups of 0 to 50 "
          "updates, every update from 0 to well after the warm-up)")
    print(f"peak {WARMUP_PEAK}, warm-up 5: " + ", ".join(
        f"{_lr_value(lr_at, step, WARMUP_PEAK, 5):.3g}" for step in range(7)))


class _Recorder:
    """Wraps make_model and train_run to see what the learner's sweep does, and stops it at
    the first run that cannot give a fair comparison (before it trains)."""

    def __init__(self, peak: float, warmups: tuple[int, ...]) -> None:
        self.peak, self.warmups = peak, warmups
        self.models: list[nn.Module] = []  # kept alive: a freed model's id can come back
        self.used: list[int] = []  # the warm-up of every run so far
        self.losses: list[list[float]] = []

    def make_model(self) -> DecoderLM:
        return warmup_model()

    def _warmup_of(self, schedule: Callable[[int], float], steps: int) -> int:
        lrs = [float(schedule(step)) for step in range(steps)]
        for w in self.warmups:
            if all(_close_lr(lr, reference_lr_at(s, self.peak, w)) for s, lr in enumerate(lrs)):
                return w
        raise CheckFailure(f"A run's learning rates ({', '.join(f'{v:.3g}' for v in lrs[:4])}"
                           f", ...) are not lr_at(step, peak, w) for any warm-up w of the sweep "
                           f"(peak={self.peak}, warmups={list(self.warmups)}). Give train_run a "
                           "function of the update alone, step -> lr_at(step, peak, w), with "
                           "this run's w")

    def train_run(self, model: nn.Module, schedule: Callable[[int], float],
                  steps: int = WARMUP_STEPS) -> list[float]:
        if not isinstance(model, nn.Module):
            raise CheckFailure(f"train_run's first argument should be a model from "
                               f"make_model(), but it got {describe(model)}")
        if steps != WARMUP_STEPS:
            raise CheckFailure(f"Your sweep trains for {steps} updates: keep train_run's "
                               f"default, {WARMUP_STEPS}, the length the experiment is built for")
        if any(model is seen for seen in self.models):
            raise CheckFailure("Your sweep trained the same model object in a second run: it "
                               "would start from weights that the first run had already "
                               "trained (or broken), so the comparison is not fair. Build a "
                               "fresh model with make_model() for every run")
        self.models.append(model)
        warmup = self._warmup_of(schedule, steps)
        if warmup in self.used:
            raise CheckFailure(f"Two of your runs used the same schedule (warm-up {warmup}). "
                               "If you built the schedules with lambda in a loop and called "
                               "them later, they all see the loop variable's last value: create "
                               "each run's schedule and train it in the same iteration")
        self.used.append(warmup)
        losses = train_with_schedule(model, schedule, steps)
        self.losses.append(losses)
        return list(losses)


def _curve(value: Any, warmup: int) -> list[float]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        raise CheckFailure(f"Your sweep returned one number for warm-up {warmup}: return the "
                           "whole list of losses that train_run returns, one per update")
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise CheckFailure(f"For warm-up {warmup} your sweep returned {describe(value)}: "
                           "return the list of losses that train_run returns")
    return [float(v) for v in value]


def _lowest(curve: list[float], k: int = 10) -> float:
    """The lowest mean loss over ``k`` consecutive updates: how far a run got. A run that
    learns the task can lose some of it again at the peak learning rate, so its last updates
    say less about whether it learned than its best stretch."""
    return min(sum(curve[i - k:i]) / k for i in range(k, len(curve) + 1))


def _judge_warmup(curves: dict[int, list[float]],
                  warmups: tuple[int, ...]) -> tuple[dict[int, float], dict[int, float]]:
    """Grade a sweep by what held on every seed and machine the book tried: without warm-up
    the loss never leaves the cost of guessing; some warm-up gets it more than 1 nat lower.
    Returns each run's mean loss over its last 10 updates and its lowest 10-update mean."""
    firsts = {w: curves[w][0] for w in warmups}
    if max(firsts.values()) - min(firsts.values()) > 1e-5:
        raise CheckFailure("Your runs do not start from the same loss "
                           f"({', '.join(f'{v:.3f}' for v in firsts.values())}): each run must "
                           "start from the same initial model, make_model(), untouched")
    final = {w: sum(c[-10:]) / 10 for w, c in curves.items()}  # mean of the last 10 updates
    low = {w: _lowest(c) for w, c in curves.items()}
    chance = math.log(WARMUP_VOCAB)
    best = min(low.values())
    if best > chance - 1:
        raise CheckFailure(f"None of your runs learned the task (lowest loss over 10 updates "
                           f"{best:.2f}, guessing gives ln {WARMUP_VOCAB} = {chance:.2f}): train "
                           "each run for train_run's full 80 updates")
    if low[0] < best + 1:
        raise CheckFailure(f"Without warm-up your run gets down to {low[0]:.2f}, close to the "
                           f"best ({best:.2f}): at this peak it should stall. Is your run "
                           "without warm-up really at the peak from update 0?")
    return final, low


def check_warmup_sweep(warmup_sweep: Callable) -> None:
    """Check the experiment ``warmup_sweep(make_model, train_run, peak, warmups)`` -> dict
    warm-up -> list of losses. The check runs it with ``warmup_model`` and
    ``train_with_schedule`` at a high peak, then grades what the sweep did (a fresh model and
    the right schedule for every run) and what it measured (no warm-up stalls, a long enough
    warm-up learns: each run judged by its lowest mean over 10 consecutive updates), not exact
    numbers; then it prints each run's lowest and final losses.

    Args:
        warmup_sweep: the learner's function.
    """
    rec = _Recorder(WARMUP_PEAK, WARMUP_SWEEP)

    def make_model() -> DecoderLM:  # plain functions: the check's copy of the inputs keeps them
        return rec.make_model()

    def train_run(model: nn.Module, schedule: Callable[[int], float],
                  steps: int = WARMUP_STEPS) -> list[float]:
        return rec.train_run(model, schedule, steps)

    case = Case(f"peak={WARMUP_PEAK}, warmups={WARMUP_SWEEP}",
                (make_model, train_run, WARMUP_PEAK, WARMUP_SWEEP))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        got = call_learner(warmup_sweep, case)
    if not isinstance(got, dict):
        raise CheckFailure(f"warmup_sweep should return a dict warm-up -> losses, but returned "
                           f"{describe(got)}")
    if sorted(got) != sorted(WARMUP_SWEEP):
        raise CheckFailure(f"Your dict's keys are {sorted(got)}: one entry for each warm-up "
                           f"of the sweep, {list(WARMUP_SWEEP)}")
    if sorted(rec.used) != sorted(WARMUP_SWEEP):
        raise CheckFailure(f"Your sweep trained {len(rec.used)} runs (warm-ups {rec.used}): "
                           f"one run for each warm-up of {list(WARMUP_SWEEP)}")
    curves = {w: _curve(got[w], w) for w in WARMUP_SWEEP}
    for w in WARMUP_SWEEP:
        if curves[w] != rec.losses[rec.used.index(w)]:
            raise CheckFailure(f"Your dict's entry for warm-up {w} is not the list of losses "
                               "that the run with that warm-up returned: store each run's "
                               "losses under its own warm-up")
    final, low = _judge_warmup(curves, WARMUP_SWEEP)
    print(f"\u2705 at peak {WARMUP_PEAK}, no warm-up stalls (never below {low[0]:.2f}, guessing "
          f"gives {math.log(WARMUP_VOCAB):.2f}) and a warm-up lets it learn (down to "
          f"{min(low.values()):.2f})")
    print("(trained runs: the digits differ from machine to machine, the verdict does not)")
    print(f"{'warm-up':>7} {'lr at update 0':>15} {'lowest loss':>12} "
          f"{'loss, last 10 updates':>22}")
    for w in WARMUP_SWEEP:
        print(f"{w:>7} {reference_lr_at(0, WARMUP_PEAK, w):15.2e} {low[w]:12.2f} {final[w]:22.2f}")
    print("(lowest loss: the lowest mean over 10 consecutive updates)")


def check_warmup(lr_at: Callable, warmup_sweep: Callable) -> None:
    """Check exercise 7.7: first the schedule ``lr_at`` (:func:`check_lr_at`), then the sweep
    ``warmup_sweep`` (:func:`check_warmup_sweep`), which the learner builds on it.

    Args:
        lr_at: the learner's schedule.
        warmup_sweep: the learner's sweep.
    """
    check_lr_at(lr_at)
    check_warmup_sweep(warmup_sweep)


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
