"""Checks for chapter 04, elementwise nonlinearity and the feed-forward layer.

Conventions (as in the chapter): weights have ``nn.Linear``'s layout (out, in), so a layer maps
a column vector as ``W x`` and a batch of row vectors as ``x @ W.T``. Value matrices follow the
notes' ``v_k = V x_k``, so one bare attention layer computes ``alpha @ X @ V.T``.

Exercises:
    4.1 predict then verify: shape and rank of a collapsed three-layer value path
        (check_collapse_prediction)
    4.2 experiment: a tiny network with and without an activation on XOR (check_xor_experiment)
    4.3 find the bug: an FFN that mixes positions, fixed (check_fixed_ffn)
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from course_lib.attention import softmax
from course_lib.instruments.probes import who_sees_whom
from course_lib.layers import FeedForward

from ._core import (
    Case,
    CheckFailure,
    call_learner,
    describe,
    prediction_dict,
    require_count,
    require_real,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Exercise 4.1: predict the shape and rank of the collapsed value path

# Three bare attention layers on T tokens of D features; the value matrices have the shapes
# (WIDE, D), (NARROW, WIDE) and (D, NARROW), so the middle one is the narrowest.
D_MODEL, WIDE, NARROW, N_TOKENS = 16, 8, 5, 3
COLLAPSE_KEYS = ("V_star_shape", "V_star_rank", "out_rank")


def _measure_collapse(seed: int = 0) -> dict[str, Any]:
    """Build the stack of exercise 4.1 with random weights and measure the three answers."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    X = randn(N_TOKENS, D_MODEL)  # (T, D)
    V1, V2, V3 = randn(WIDE, D_MODEL), randn(NARROW, WIDE), randn(D_MODEL, NARROW)
    alphas = [softmax(randn(N_TOKENS, N_TOKENS), -1) for _ in range(3)]  # (T, T) each
    out = X
    for alpha, V in zip(alphas, (V1, V2, V3), strict=True):
        out = alpha @ out @ V.T  # one bare attention layer
    V_star = V3 @ V2 @ V1  # (D, D)
    return {
        "V_star_shape": tuple(V_star.shape),
        "V_star_rank": int(torch.linalg.matrix_rank(V_star)),
        "out_rank": int(torch.linalg.matrix_rank(out)),
    }


def _as_shape(value: object) -> tuple[int, ...] | None:
    if isinstance(value, torch.Size):
        return tuple(value)
    if isinstance(value, (tuple, list)) and all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value):
        return tuple(int(v) for v in value)
    return None


def check_collapse_prediction(predict_collapse: Callable) -> None:
    """Grade the predictions of exercise 4.1, then print what a measurement gives.

    Args:
        predict_collapse: takes no argument and returns a dict with the keys ``V_star_shape``
            (a tuple), ``V_star_rank`` and ``out_rank`` (ints).
    """
    got = prediction_dict(call_learner(predict_collapse, Case("your predictions")),
                          COLLAPSE_KEYS, "predict_collapse")
    shape = _as_shape(got["V_star_shape"])
    if shape is None:
        raise CheckFailure(f"V_star_shape should be a tuple of two ints such as (3, 5), got "
                           f"{got['V_star_shape']!r}")
    ranks = {k: require_count(got[k], k) for k in ("V_star_rank", "out_rank")}
    if shape != (D_MODEL, D_MODEL):
        raise CheckFailure(
            f"V_star_shape: {shape} is not it. V* = V3 @ V2 @ V1 takes a token's {D_MODEL} "
            f"features in and gives {D_MODEL} features out: what shape is that?")
    v_rank, out_rank = ranks["V_star_rank"], ranks["out_rank"]
    if v_rank == D_MODEL:
        raise CheckFailure(
            f"V_star_rank: a {D_MODEL} x {D_MODEL} matrix need not have rank {D_MODEL}. The "
            "rank of a product is at most the smallest rank of its factors")
    if v_rank == WIDE:
        raise CheckFailure(
            f"V_star_rank: V1 keeps {WIDE} numbers of each token, but V2 then keeps only "
            f"{NARROW} of those. The narrowest factor decides, wherever it sits in the product")
    if v_rank != NARROW:
        raise CheckFailure(f"V_star_rank: {v_rank} is not it. What is the fewest numbers a "
                           "token is squeezed into on its way through? Random matrices lose "
                           "nothing else")
    if out_rank == NARROW:
        raise CheckFailure(
            f"out_rank: the output has only T = {N_TOKENS} rows, and a matrix's rank is at most "
            "its number of rows as well as its number of columns")
    if out_rank in (D_MODEL, WIDE):
        raise CheckFailure(
            f"out_rank: every output row lies in the column space of V* (rank {NARROW}), and "
            f"there are only {N_TOKENS} rows: neither bound allows {out_rank}")
    if out_rank != N_TOKENS:
        raise CheckFailure(f"out_rank: {out_rank} is not it. Two things bound the rank of the "
                           f"({N_TOKENS}, {D_MODEL}) output: the space its rows lie in and "
                           "how many rows there are")
    measured = _measure_collapse()
    print("\u2705 your three predictions are right. Measured on random weights "
          f"(T = {N_TOKENS}, D = {D_MODEL}, value matrices ({WIDE}, {D_MODEL}), "
          f"({NARROW}, {WIDE}), ({D_MODEL}, {NARROW})):")
    for key in COLLAPSE_KEYS:
        print(f"   {key:>12}: {measured[key]}")


# --------------------------------------------------------------------------------------------
# Exercise 4.2: an experiment, XOR with and without an activation

XOR_STEPS = 300
AFFINE_BOUND = 1.0  # the best mean squared error any affine function reaches on +-1 XOR
ONE_HINGE_BOUND = 2 / 3  # the best one ReLU unit reaches (measured: training ends at 0.667)
N_CORNERS = 4
# Measured over seeds 0-5 and learning rates 0.005-0.2: the affine runs end in [1.000, 1.002],
# one ReLU unit in [0.667, 1.008], 16 ReLU units below 0.003.
AFFINE_BAND = (AFFINE_BOUND - 1e-3, AFFINE_BOUND + 0.02)
ONE_HINGE_BAND = (ONE_HINGE_BOUND - 0.01, AFFINE_BOUND + 0.05)
FAR_ABOVE = 1.5  # a final loss above this, and above the run's first, is training gone wrong


def _losses(fit_xor: Callable, activation: str, hidden_units: int, seed: int) -> list[float]:
    case = Case(f"activation='{activation}', hidden_units={hidden_units}, seed={seed}",
                (activation, hidden_units, seed))
    got = call_learner(fit_xor, case)
    if isinstance(got, np.ndarray):
        got = list(got)
    if not isinstance(got, (list, tuple)):
        raise CheckFailure(f"fit_xor should return a list of {XOR_STEPS} losses (floats), one "
                           f"per update, got {describe(got)} (case '{case.name}')")
    if len(got) != XOR_STEPS:
        raise CheckFailure(f"fit_xor returned {len(got)} losses for the case '{case.name}'; "
                           f"it should make {XOR_STEPS} updates and record the loss of each")
    losses = [require_real(v, "each loss", case) for v in got]
    if not all(math.isfinite(v) for v in losses):
        raise CheckFailure(f"a loss is NaN or inf (case '{case.name}'): is the learning rate "
                           "0.05, as the steps say?")
    return losses


def _rounded(values: Sequence[float]) -> list[float]:
    return [round(v, 3) for v in values]


def _check_affine_runs(runs: dict[tuple[str, int], list[list[float]]]) -> None:
    """The runs without an activation must end at the affine model's floor, 1.0."""
    finals = {key: [losses[-1] for losses in value] for key, value in runs.items()}
    affine = finals[("none", 16)]
    lowest_linear = min(min(ls) for ls in runs[("none", 16)])
    worse = [ls[-1] for value in runs.values() for ls in value
             if ls[-1] > FAR_ABOVE and ls[-1] > ls[0]]
    if all(abs(f - N_CORNERS * AFFINE_BOUND) < 0.1 for f in affine):
        raise CheckFailure(
            f"with activation='none' your losses end at {_rounded(affine)}, {N_CORNERS} times "
            f"the affine floor of {AFFINE_BOUND}: the loss is summed over the {N_CORNERS} "
            "corners. Minimise the mean squared error (the mean, not the sum)")
    if worse:
        raise CheckFailure(
            f"some of your final losses are far above {AFFINE_BOUND}, the loss an affine model "
            f"reaches by predicting 0 (activation='none': {_rounded(affine)}; with ReLU, 16 "
            f"units: {_rounded(finals[('relu', 16)])}). Training makes them worse, not better: "
            "the gradients probably accumulate from one update to the next. Call "
            "optimizer.zero_grad() in every update, before loss.backward()")
    if lowest_linear < AFFINE_BAND[0]:
        raise CheckFailure(
            f"with activation='none' your loss reached {lowest_linear:.3f}, below 1.0, the best "
            "any affine function can do on XOR with targets x1 * x2 = +-1. Either an activation "
            "is still applied for 'none', or the targets are not x1 * x2 (a 0/1 coding gives a "
            "different bound)")
    if max(affine) > AFFINE_BAND[1]:
        raise CheckFailure(
            f"with activation='none' your final losses are {_rounded(affine)}; an affine model "
            f"reaches its floor, {AFFINE_BOUND}, well within {XOR_STEPS} updates (the reference "
            f"ends below {AFFINE_BAND[1]}). Check the learning rate (0.05), the number of "
            "updates and that the loss is the mean squared error of all four corners")


def check_xor_experiment(fit_xor: Callable) -> None:
    """Run the learner's ``fit_xor(activation, hidden_units, seed)`` and grade properties of the
    measured losses: the runs without an activation end at the affine floor, one ReLU unit ends
    between 2/3 and 1, a wide ReLU network reaches (almost) zero. Then print the measured table.
    """
    seeds = (0, 1, 2)
    runs = {(act, h): [_losses(fit_xor, act, h, s) for s in seeds]
            for act, h in (("relu", 16), ("none", 16), ("relu", 1))}
    finals = {key: [losses[-1] for losses in value] for key, value in runs.items()}
    if all(abs(ls[-1] - ls[0]) < 1e-6 for value in runs.values() for ls in value):
        raise CheckFailure("your losses never change: the network is not trained. Each update "
                           "needs zero_grad(), loss.backward() and optimizer.step()")
    _check_affine_runs(runs)
    if min(finals[("relu", 16)]) > 0.05:
        stuck = all(f > AFFINE_BOUND - 0.05 for f in finals[("relu", 16)])
        raise CheckFailure(
            "with activation='relu' and 16 hidden units your final losses are "
            f"{_rounded(finals[('relu', 16)])}; such a network fits XOR (below "
            "0.05). " + ("It behaves like the linear one: is the ReLU applied between the two "
                         "layers?" if stuck else "Check the learning rate (0.05), the number of "
                         f"updates ({XOR_STEPS}) and that all four corners are in every batch"))
    if min(min(ls) for ls in runs[("relu", 1)]) < ONE_HINGE_BAND[0]:
        raise CheckFailure(
            "with hidden_units=1 your network beat 2/3, the best one ReLU unit (a single hinge) "
            "can do: is hidden_units used as the width of the hidden layer?")
    if max(finals[("relu", 1)]) > ONE_HINGE_BAND[1]:
        raise CheckFailure(
            f"with activation='relu' and 1 hidden unit your final losses are "
            f"{_rounded(finals[('relu', 1)])}; one ReLU unit ends at 2/3 or, when the unit is "
            f"switched off everywhere, at the affine floor {AFFINE_BOUND}, not above. Check the "
            "learning rate (0.05) and the number of updates")
    print("\u2705 fit_xor behaves as the theory says. Final losses, seeds 0, 1, 2:")
    for (act, h), value in finals.items():
        print(f"   {'activation=' + repr(act):>17}, {h:>2} hidden units: "
              f"{', '.join(f'{v:.3f}' for v in value)}")
    print(f"   (affine bound {AFFINE_BOUND:.3f}; "
          f"one ReLU unit cannot go below {ONE_HINGE_BOUND:.3f})")


# --------------------------------------------------------------------------------------------
# Exercise 4.3: find the bug, an FFN that mixes positions


def reference_feed_forward(
    x: torch.Tensor, W1: torch.Tensor, b1: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """course_lib's FeedForward (ReLU) with the given weights, applied to x (..., d)."""
    d_ff, d_model = W1.shape
    ffn = FeedForward(d_model, d_ff, activation="relu").to(x.dtype)
    with torch.no_grad():
        ffn.fc1.weight.copy_(W1)
        ffn.fc1.bias.copy_(b1)
        ffn.fc2.weight.copy_(W2)
        ffn.fc2.bias.copy_(b2)
        return ffn(x)  # (..., d)


FIXED_FFN_SHAPES: Sequence[tuple[int, int, int, int]] = (
    (2, 5, 4, 16),  # B, T, D, d_ff
    (3, 4, 4, 8),  # T == D
    (1, 6, 3, 12),
    (2, 1, 5, 20),  # one position
)


def _build(model_class: Callable, d_model: int, d_ff: int, seed: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = call_learner(model_class, Case(
            "building the module", (d_model, d_ff),
            hint="Keep BuggyFFN's __init__ and fix only forward"))
    for name in ("fc1", "fc2"):
        if not isinstance(getattr(model, name, None), torch.nn.Linear):
            raise CheckFailure(f"your module has no nn.Linear '{name}': subclass BuggyFFN and "
                               "change only forward")
    return model.eval()


def _first_mixing(sees: torch.Tensor) -> tuple[int, list[int]] | None:
    off = sees & ~torch.eye(sees.shape[0], dtype=torch.bool)  # (T, T)
    if not bool(off.any()):
        return None
    i = int(torch.nonzero(off.any(1))[0])
    return i, torch.nonzero(off[i]).flatten().tolist()


def check_fixed_ffn(model_class: Callable) -> None:
    """Grade a fixed position-wise FFN with course_lib's ``who_sees_whom`` (each output must
    depend on its own position only) and equality with course_lib's FeedForward holding the
    same weights, on several shapes.

    Args:
        model_class: built as ``model_class(d_model, d_ff)``; has ``fc1``, ``fc2``
            (nn.Linear) and maps (B, T, D) to (B, T, D).
    """
    for seed, (B, T, D, d_ff) in enumerate(FIXED_FFN_SHAPES):
        model = _build(model_class, D, d_ff, seed)
        x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(100 + seed))  # (B, T, D)
        name = f"B={B}, T={T}, D={D}, d_ff={d_ff}"
        with torch.no_grad():
            got = call_learner(model, Case(name, (x,)), fn_name="your forward")
        if not isinstance(got, torch.Tensor) or got.shape != x.shape:
            raise CheckFailure(f"forward should return a tensor of shape {tuple(x.shape)}, got "
                               f"{describe(got)} (case '{name}')")
        if T > 1:
            mixing = _first_mixing(who_sees_whom(model, x))
            if mixing is not None:
                i, js = mixing
                raise CheckFailure(
                    f"course_lib's who_sees_whom finds that output {i} changes when input(s) "
                    f"{js} change (case '{name}'): your FFN still mixes positions. Each "
                    "position must go through fc1, ReLU and fc2 on its own")
        weights = (model.fc1.weight, model.fc1.bias, model.fc2.weight, model.fc2.bias)
        with torch.no_grad():
            expected = reference_feed_forward(x, *weights)  # (B, T, D)
            linear = F.linear(F.linear(x, *weights[:2]), *weights[2:])  # no activation
        if torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
            continue
        if torch.allclose(got, linear, atol=1e-5, rtol=1e-4):
            raise CheckFailure(
                f"your output equals fc2(fc1(x)) without the ReLU (case '{name}'): the "
                "activation goes between the two layers; without it they collapse into one "
                "linear map")
        raise CheckFailure(
            f"positions are kept apart, but your output differs from course_lib's FeedForward "
            f"with the same weights by up to {float((got - expected).abs().max()):.3g} (case "
            f"'{name}'): FFN(x) = fc2(relu(fc1(x))) at every position")
    print(f"\u2705 your FFN keeps positions apart (who_sees_whom gives the identity) and equals "
          f"course_lib's FeedForward on all {len(FIXED_FFN_SHAPES)} test shapes")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
