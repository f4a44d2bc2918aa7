"""Checks for chapter 04, elementwise nonlinearity and the feed-forward layer.

Conventions (as in the chapter): weights have ``nn.Linear``'s layout (out, in), so a layer maps
a column vector as ``W x`` and a batch of row vectors as ``x @ W.T``. Value matrices follow the
notes' ``v_k = V x_k``, so one bare attention layer computes ``alpha @ X @ V.T``.

Exercises:
    4.1 predict then verify: shape and rank of a collapsed value path (check_collapse_prediction)
    4.2 experiment: a tiny network with and without an activation on XOR (check_xor_experiment)
    4.3 find the bug: an FFN that mixes positions, fixed (check_fixed_ffn)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from course_lib.attention import softmax
from course_lib.course.probes import who_sees_whom
from course_lib.layers import FeedForward

from ._core import (
    Case,
    CheckFailure,
    call_learner,
    describe,
    prediction_dict,
    require_count,
)

# --------------------------------------------------------------------------------------------
# Exercise 4.1: predict the shape and rank of the collapsed value path

D_MODEL, SQUEEZE, N_TOKENS = 16, 4, 10
COLLAPSE_KEYS = ("V_star_shape", "V_star_rank", "out_rank")


def _measure_collapse(seed: int = 0) -> dict[str, Any]:
    """Build the stack of exercise 4.1 with random weights and measure the three answers."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(N_TOKENS, D_MODEL, generator=gen, dtype=torch.float64)  # (T, D)
    V1 = torch.randn(SQUEEZE, D_MODEL, generator=gen, dtype=torch.float64)  # (4, 16)
    V2 = torch.randn(D_MODEL, SQUEEZE, generator=gen, dtype=torch.float64)  # (16, 4)
    alpha1 = softmax(torch.randn(N_TOKENS, N_TOKENS, generator=gen, dtype=torch.float64), -1)
    alpha2 = softmax(torch.randn(N_TOKENS, N_TOKENS, generator=gen, dtype=torch.float64), -1)
    out = alpha2 @ (alpha1 @ X @ V1.T) @ V2.T  # (T, D): the two layers, one after the other
    V_star = V2 @ V1  # (D, D)
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
    if shape == (SQUEEZE, SQUEEZE):
        raise CheckFailure(
            "V_star_shape: you multiplied in the wrong order. A token meets V1 first, then V2, "
            "so V* = V2 @ V1, a (16, 4) @ (4, 16) product of shape (16, 16)")
    if shape != (D_MODEL, D_MODEL):
        raise CheckFailure(f"V_star_shape: {shape} is not it. V* = V2 @ V1 maps a token's "
                           f"{D_MODEL} features to {D_MODEL} features; what shape is that?")
    if ranks["V_star_rank"] == D_MODEL:
        raise CheckFailure(
            "V_star_rank: a 16 x 16 matrix need not have rank 16. Every token passes through "
            "V1, which keeps only 4 numbers: the rank of a product is at most the smallest "
            "rank of its factors")
    if ranks["V_star_rank"] != SQUEEZE:
        raise CheckFailure(f"V_star_rank: {ranks['V_star_rank']} is not it. How many numbers "
                           "does V1 keep of each token? Random matrices lose nothing else")
    if ranks["out_rank"] in (N_TOKENS, D_MODEL):
        raise CheckFailure(
            f"out_rank: the output is {N_TOKENS} x {D_MODEL}, but its rows are averages of "
            "vectors V* x_k, and all of them lie in the column space of V*: averaging cannot "
            "leave that space")
    if ranks["out_rank"] != SQUEEZE:
        raise CheckFailure(f"out_rank: {ranks['out_rank']} is not it. Each output row is a "
                           "weighted average of vectors V* x_k: in how many dimensions can they "
                           "lie?")
    measured = _measure_collapse()
    print("\u2705 your three predictions are right. Measured on random weights "
          f"(T = {N_TOKENS}, D = {D_MODEL}, V1 of shape ({SQUEEZE}, {D_MODEL})):")
    for key in COLLAPSE_KEYS:
        print(f"   {key:>12}: {measured[key]}")


# --------------------------------------------------------------------------------------------
# Exercise 4.2: an experiment, XOR with and without an activation

XOR_STEPS = 300
AFFINE_BOUND = 1.0  # the best mean squared error any affine function reaches on +-1 XOR
ONE_HINGE_BOUND = 2 / 3  # the best one ReLU unit reaches (measured: training ends at 0.667)


def _losses(fit_xor: Callable, activation: str, hidden_units: int, seed: int) -> list[float]:
    case = Case(f"activation='{activation}', hidden_units={hidden_units}, seed={seed}",
                (activation, hidden_units, seed))
    got = call_learner(fit_xor, case)
    if isinstance(got, torch.Tensor):
        got = got.detach().flatten().tolist()
    if not isinstance(got, (list, tuple)) or not all(
            isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1)
            for v in got):
        raise CheckFailure(f"fit_xor should return a list of {XOR_STEPS} losses (floats), one "
                           f"per update, got {describe(got)} (case '{case.name}')")
    losses = [float(v) for v in got]
    if len(losses) != XOR_STEPS:
        raise CheckFailure(f"fit_xor returned {len(losses)} losses for the case '{case.name}'; "
                           f"it should make {XOR_STEPS} updates and record the loss of each")
    if not all(math.isfinite(v) for v in losses):
        raise CheckFailure(f"a loss is NaN or inf (case '{case.name}'): is the learning rate "
                           "0.05, as the steps say?")
    return losses


def check_xor_experiment(fit_xor: Callable) -> None:
    """Run the learner's ``fit_xor(activation, hidden_units, seed)`` and grade properties of the
    measured losses: the affine bound without an activation, one ReLU unit stuck above 2/3,
    a wide ReLU network reaching (almost) zero. Then print the measured table.
    """
    seeds = (0, 1, 2)
    runs = {(act, h): [_losses(fit_xor, act, h, s) for s in seeds]
            for act, h in (("relu", 16), ("none", 16), ("relu", 1))}
    finals = {key: [losses[-1] for losses in value] for key, value in runs.items()}
    if all(abs(ls[-1] - ls[0]) < 1e-6 for value in runs.values() for ls in value):
        raise CheckFailure("your losses never change: the network is not trained. Each update "
                           "needs zero_grad(), loss.backward() and optimizer.step()")
    lowest_linear = min(min(ls) for ls in runs[("none", 16)])
    if lowest_linear < AFFINE_BOUND - 1e-3:
        raise CheckFailure(
            f"with activation='none' your loss reached {lowest_linear:.3f}, below 1.0, the best "
            "any affine function can do on XOR with targets x1 * x2 = +-1. Either an activation "
            "is still applied for 'none', or the targets are not x1 * x2 (a 0/1 coding gives a "
            "different bound)")
    if min(finals[("relu", 16)]) > 0.05:
        stuck = all(f > AFFINE_BOUND - 0.05 for f in finals[("relu", 16)])
        raise CheckFailure(
            "with activation='relu' and 16 hidden units your final losses are "
            f"{[round(f, 3) for f in finals[('relu', 16)]]}; such a network fits XOR (below "
            "0.05). " + ("It behaves like the linear one: is the ReLU applied between the two "
                         "layers?" if stuck else "Check the learning rate (0.05), the number of "
                         f"updates ({XOR_STEPS}) and that all four corners are in every batch"))
    if min(min(ls) for ls in runs[("relu", 1)]) < ONE_HINGE_BOUND - 0.01:
        raise CheckFailure(
            "with hidden_units=1 your network beat 2/3, the best one ReLU unit (a single hinge) "
            "can do: is hidden_units used as the width of the hidden layer?")
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
