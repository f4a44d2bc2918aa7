"""Checks for chapter 04, elementwise nonlinearity and the feed-forward layer.

Conventions (as in the chapter): weights have ``nn.Linear``'s layout (out, in), so a layer maps
a column vector as ``W x`` and a batch of row vectors as ``x @ W.T``. Value matrices follow the
notes' ``v_k = V x_k``, so one linear attention layer computes ``alpha @ X @ V.T``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from course_lib.attention import causal_mask, softmax
from course_lib.layers import FeedForward
from course_lib.models import EncoderBlock, count_parameters

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    as_int,
    call_learner,
    compare_tensors,
    describe,
    rand,
    run_cases,
)

# --------------------------------------------------------------------------------------------
# Exercise 4.1: the position-wise feed-forward network

LAYOUT_HINT = (
    "W1 has nn.Linear's layout (d_ff, d): it maps x (..., d) to x @ W1.T (..., d_ff), and "
    "W2 (d, d_ff) maps back with @ W2.T. Check the shape of every intermediate result"
)


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


def _quietly(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor | None]:
    """A wrong answer that does not apply to a case (shapes do not fit) is None."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError:
            return None

    return wrapped


FEED_FORWARD_MISTAKES = [
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: x @ W1.T @ W2.T + b1 @ W2.T + b2),
        "Your output is a purely linear function of x: there is no ReLU. Without it the two "
        "layers collapse into one matrix; apply torch.relu to the hidden layer, between the "
        "two linear maps",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(
            torch.relu(x @ W1.T + b1) @ W2.T + b2)),
        "Your output has no negative entries: you applied the ReLU after the second layer as "
        "well. FFN(x) = relu(x W1^T + b1) W2^T + b2 has the activation only on the hidden layer",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T @ W2.T + b1 @ W2.T + b2)),
        "You applied the ReLU at the end instead of between the two layers: the activation "
        "acts on the hidden layer, relu(x W1^T + b1), before W2",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: (torch.relu(x @ W1.T) + b1) @ W2.T + b2),
        "You added b1 after the ReLU: the bias belongs inside, relu(x W1^T + b1), so that it "
        "shifts where each hidden unit switches on",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: F.gelu(x @ W1.T + b1) @ W2.T + b2),
        "You used GELU; this exercise asks for the ReLU, torch.relu (max(0, z))",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T + b1) @ W2.T),
        "You left out b2, the bias of the second layer",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T) @ W2.T + b2),
        "You left out b1, the bias of the first layer (inside the ReLU)",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T + b2) @ W2.T + b1),
        "You swapped the biases: b1 (d_ff,) goes with W1 inside the ReLU, b2 (d,) after W2",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W1 + b1) @ W2 + b2),
        "Your weights are used untransposed: in nn.Linear's layout (out, in) a batch of row "
        "vectors is mapped by x @ W1.T, not x @ W1",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W2.T + b2) @ W1.T + b1),
        "You applied the two layers in the wrong order: W1 (with b1 and the ReLU) comes first "
        "and expands d -> d_ff, then W2 (with b2) projects back",
    ),
    Misconception(
        _quietly(lambda x, W1, b1, W2, b2: torch.relu(x @ W2.T + b1) @ W1.T + b2),
        "You multiplied by W2 first: W1 comes first and expands d -> d_ff, then W2 projects "
        "back to d",
    ),
]


def _ffn_case(gen: torch.Generator, name: str, x_shape: tuple[int, ...], d_ff: int,
              scale: float = 1.0, hint: str = LAYOUT_HINT) -> Case:
    d = x_shape[-1]
    x = rand(gen, *x_shape, scale=scale)
    W1 = rand(gen, d_ff, d, scale=d ** -0.5)
    b1 = rand(gen, d_ff, scale=0.5)
    W2 = rand(gen, d, d_ff, scale=d_ff ** -0.5)
    b2 = rand(gen, d, scale=0.5)
    return Case(name, (x, W1, b1, W2, b2), hint=hint)


def _ffn_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        _ffn_case(gen, "T=5, d=4, d_ff=16", (5, 4), 16),
        _ffn_case(gen, "batched (2, 5, 4), d_ff=16", (2, 5, 4), 16,
                  hint="the same formula must work for any number of leading dimensions; "
                  "W1.T and W2.T are 2-D, so x @ W1.T does"),
        _ffn_case(gen, "square, d = d_ff = 6", (7, 6), 6),
        _ffn_case(gen, "one vector x of shape (8,), d_ff=32", (8,), 32),
        _ffn_case(gen, "leading dims (2, 3, 4, 8), d_ff=20", (2, 3, 4, 8), 20),
        _ffn_case(gen, "one token, T=1, d=3, d_ff=15", (1, 3), 15),
        _ffn_case(gen, "large inputs", (6, 4), 16, scale=30.0),
    ]


def check_feed_forward(feed_forward: Callable) -> None:
    """Check ``feed_forward(x, W1, b1, W2, b2)`` = relu(x W1^T + b1) W2^T + b2.

    Args:
        feed_forward: the learner's function; x (..., d), W1 (d_ff, d), b1 (d_ff,),
            W2 (d, d_ff), b2 (d,); returns (..., d).
    """

    def check_one(got, case: Case) -> None:
        expected = reference_feed_forward(*case.args)
        compare_tensors(got, expected, case, what="Your feed-forward output",
                        misconceptions=FEED_FORWARD_MISTAKES)

    run_cases("feed_forward", feed_forward, _ffn_cases(seed=4), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 4.2: two linear attention layers collapse into one


def reference_collapse(
    alpha1: torch.Tensor, alpha2: torch.Tensor, V1: torch.Tensor, V2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha* = alpha2 @ alpha1 (..., T, T) and V* = V2 @ V1 (d2, d0)."""
    return alpha2 @ alpha1, V2 @ V1


ORDER_HINT = (
    "V1 acts first and V2 second, so V* = V2 @ V1: shapes (d2, d1) @ (d1, d0) -> (d2, d0)"
)

ALPHA_STAR_MISTAKES = [
    Misconception(
        lambda a1, a2, V1, V2: a1 @ a2,
        "alpha_star is alpha1 @ alpha2, the wrong order: layer 2 averages the outputs of "
        "layer 1, so alpha_star[i, k] = sum_j alpha2[i, j] alpha1[j, k], i.e. alpha2 @ alpha1",
    ),
    Misconception(
        lambda a1, a2, V1, V2: (a2 @ a1).transpose(-2, -1),
        "alpha_star is transposed: its rows (queries) should sum to 1; transpose only the last "
        "two dimensions if at all (alpha2 @ alpha1 needs no transpose)",
    ),
    Misconception(
        lambda a1, a2, V1, V2: a1.transpose(-2, -1) @ a2.transpose(-2, -1),
        "alpha_star is transposed: its rows (queries) should sum to 1; alpha2 @ alpha1 needs no "
        "transpose",
    ),
    Misconception(
        lambda a1, a2, V1, V2: a1 * a2,
        "You multiplied the weights elementwise: combining two averaging steps is a matrix "
        "product, alpha_star[i, k] = sum_j alpha2[i, j] alpha1[j, k]",
    ),
    Misconception(
        lambda a1, a2, V1, V2: a2,
        "alpha_star equals alpha2: the first layer's averaging (alpha1) is missing",
    ),
    Misconception(
        lambda a1, a2, V1, V2: a1,
        "alpha_star equals alpha1: the second layer's averaging (alpha2) is missing",
    ),
]

V_STAR_MISTAKES = [
    Misconception(
        _quietly(lambda a1, a2, V1, V2: V1 @ V2),
        "V_star is V1 @ V2, the wrong order: with column vectors, v = V x, layer 1 applies V1 "
        "first, so V_star x = V2 (V1 x), i.e. V_star = V2 @ V1",
    ),
    Misconception(
        _quietly(lambda a1, a2, V1, V2: (V2 @ V1).T),
        "V_star is transposed: it should map d0 inputs to d2 outputs in nn.Linear's layout, "
        "shape (d2, d0), i.e. V2 @ V1",
    ),
    Misconception(
        _quietly(lambda a1, a2, V1, V2: V2.T @ V1.T),
        "You returned V2.T @ V1.T; V_star = V2 @ V1 (shape (d2, d0)) with no transposes",
    ),
    Misconception(
        _quietly(lambda a1, a2, V1, V2: V1 * V2),
        "You multiplied V1 and V2 elementwise: composing two linear maps is a matrix product, "
        "V2 @ V1",
    ),
]


def _weights(gen: torch.Generator, *shape: int, causal: bool = False) -> torch.Tensor:
    """Random attention weights: a softmax over random scores, rows sum to 1."""
    scores = rand(gen, *shape, scale=1.5)
    if causal:
        scores = scores.masked_fill(~causal_mask(shape[-1]), float("-inf"))
    return softmax(scores, dim=-1)


def _collapse_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)

    def case(name, lead, T, d0, d1, d2, causal=False):
        return Case(
            name,
            (_weights(gen, *lead, T, T, causal=causal), _weights(gen, *lead, T, T, causal=causal),
             rand(gen, d1, d0), rand(gen, d2, d1)),
            hint=ORDER_HINT,
        )

    return [
        case("T=5, d0=3, d1=4, d2=2", (), 5, 3, 4, 2),
        case("square values, T=4, d=3", (), 4, 3, 3, 3),
        case("batch of 2, T=6, d=4", (2,), 6, 4, 4, 4),
        case("batch and heads (2, 3), T=4, d0=5, d1=2, d2=3", (2, 3), 4, 5, 2, 3),
        case("causal weights, T=5, d=3", (), 5, 3, 3, 3, causal=True),
        case("one token, T=1, d=2", (), 1, 2, 2, 2),
    ]


def check_collapse_two_layers(collapse_two_layers: Callable) -> None:
    """Check ``collapse_two_layers(alpha1, alpha2, V1, V2)`` -> ``(alpha_star, V_star)``.

    alpha1, alpha2: (..., T, T) weights of layers 1 and 2; V1 (d1, d0), V2 (d2, d1). The pair
    must satisfy alpha2 @ (alpha1 @ X @ V1.T) @ V2.T == alpha_star @ X @ V_star.T for every X.
    """
    gen = torch.Generator().manual_seed(404)

    def check_one(got, case: Case) -> None:
        alpha1, alpha2, V1, V2 = case.args
        expected_alpha, expected_V = reference_collapse(*case.args)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            what = (f"a {type(got).__name__} of {len(got)} items"
                    if isinstance(got, (tuple, list)) else describe(got))
            raise CheckFailure(
                "collapse_two_layers should return a pair (alpha_star, V_star), but it returned "
                f"{what} (case '{case.name}')"
            )
        alpha_star, V_star = got
        both = isinstance(alpha_star, torch.Tensor) and isinstance(V_star, torch.Tensor)
        if (both and alpha_star.shape == expected_V.shape and V_star.shape == expected_alpha.shape
                and expected_V.shape != expected_alpha.shape):
            raise CheckFailure(
                "You returned (V_star, alpha_star); return the pair in the order "
                f"(alpha_star, V_star) (case '{case.name}')"
            )
        if (both and alpha_star.shape == expected_alpha.shape and V_star.shape == expected_V.shape
                and not torch.allclose(alpha_star, expected_alpha, atol=1e-5, rtol=1e-4)):
            # A rescaled pair (c * alpha, V / c) gives the same output but is no longer a pair
            # of attention weights and values: say so rather than "wrong values".
            X = rand(gen, *alpha1.shape[:-1], V1.shape[1])  # (..., T, d0)
            two_layers = alpha2 @ (alpha1 @ X @ V1.T) @ V2.T  # (..., T, d2)
            one_layer = alpha_star.float() @ X @ V_star.float().T  # (..., T, d2)
            if torch.allclose(one_layer, two_layers, atol=1e-4, rtol=1e-4):
                sums = alpha_star.sum(-1)
                raise CheckFailure(
                    "Your pair reproduces the two-layer output, but alpha_star is not a weight "
                    f"matrix: its rows sum to {float(sums.flatten()[0]):.3g}, not 1. Put all the "
                    "scaling into V_star and keep alpha_star = alpha2 @ alpha1 "
                    f"(case '{case.name}')"
                )
        compare_tensors(alpha_star, expected_alpha, case, what="Your alpha_star",
                        misconceptions=ALPHA_STAR_MISTAKES)
        compare_tensors(V_star, expected_V, case, what="Your V_star",
                        misconceptions=V_STAR_MISTAKES)

    run_cases("collapse_two_layers", collapse_two_layers, _collapse_cases(seed=42), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 4.3: how many parameters does a Transformer block have?


def reference_block_parameter_count(d_model: int, d_ff: int, bias: bool = True) -> int:
    """Count course_lib's EncoderBlock by building one on the meta device (no memory used)."""
    with torch.device("meta"):
        block = EncoderBlock(d_model, 1, d_ff, bias=bias)
    return count_parameters(block)


def _count_mistakes(d: int, f: int, bias: bool) -> list[tuple[int, str]]:
    """(wrong count, message) for every likely mistake, on one case. The right count is
    4d^2 + 2df + 4d (LayerNorms) + (4d + f + d if bias). A mistake's count may happen to equal
    the right one on some cases (e.g. ignoring d_ff when d_ff = 4d)."""
    weights = 4 * d * d + 2 * d * f
    linear_biases = 4 * d + f + d
    norms = 4 * d
    right = weights + (linear_biases if bias else 0) + norms
    attention_bias = 4 * d if bias else 0
    return [
        (right - (linear_biases if bias else 0),
         "You left out the biases of the linear layers: with bias=True each of the 4 attention "
         "projections has d_model biases and the FFN's two layers have d_ff and d_model"),
        (right - (4 * d if bias else 0),
         "You left out the attention projections' biases (4 x d_model)"),
        (right - (f + d if bias else 0),
         "You left out the feed-forward layers' biases (d_ff + d_model)"),
        (right - d * d - (d if bias else 0),
         "You counted 3 attention projections (queries, keys, values) but the block has 4: the "
         "output projection W_o (d_model x d_model, plus its bias) mixes the heads' outputs"),
        (right - 3 * d * d - 3 * attention_bias // 4,
         "You counted one d_model x d_model matrix for attention; it has four: W_q, W_k, W_v and "
         "the output projection W_o"),
        (right - d * f, "You counted only one of the FFN's two weight matrices: W1 is "
         "(d_ff, d_model) and W2 is (d_model, d_ff)"),
        (right - norms, "You left out the two LayerNorms: each has a gain and a shift of "
         "d_model numbers, 4 x d_model in all"),
        (right - 2 * d, "You counted 2 x d_model for the LayerNorms; the block "
         "has two of them, each with a gain gamma and a shift beta of d_model numbers: "
         "4 x d_model"),
        (right - (0 if bias else 2 * d), "bias=False only removes the linear layers' biases; "
         "course_lib's two LayerNorms keep their gain and their shift beta (2 x d_model each)"),
        (right + (0 if bias else linear_biases), "With bias=False the linear layers have no "
         "biases: leave out 4 x d_model (attention) and d_ff + d_model (FFN)"),
        (right - (bias and d), "You are one bias vector of size d_model short: did you forget "
         "the output projection's bias, or b2 of the FFN?"),
        (right + 2 * d * (4 * d - f) + (4 * d - f if bias else 0),
         "You used d_ff = 4 * d_model instead of the d_ff argument"),
    ]


def check_block_parameter_count(block_parameter_count: Callable) -> None:
    """Check ``block_parameter_count(d_model, d_ff, bias=True)`` against course_lib's
    EncoderBlock (4 attention projections, a two-layer FFN, two LayerNorms).
    """
    cases = [
        Case("d_model=8, d_ff=32, bias=True", (8, 32), {"bias": True}),
        Case("d_model=16, d_ff=40, bias=True", (16, 40), {"bias": True}),
        Case("d_model=12, d_ff=60 (5x), bias=True", (12, 60), {"bias": True}),
        Case("d_model=8, d_ff=32, bias=False", (8, 32), {"bias": False}),
        Case("d_model=24, d_ff=100, bias=False", (24, 100), {"bias": False}),
        Case("d_model=768, d_ff=3072 (GPT-2 small's block)", (768, 3072), {"bias": True}),
        Case("d_model=1, d_ff=1", (1, 1), {"bias": True}),
        Case("bias left at its default", (10, 40),
             hint="give bias a default value: def block_parameter_count(d_model, d_ff, "
             "bias=True)"),
    ]

    counts: list[int] = []
    for case in cases:  # first collect every answer: a mistake must explain all of them
        got = call_learner(block_parameter_count, case)
        count = as_int(got)
        if count is None:
            raise CheckFailure(
                f"block_parameter_count should return a whole number (an int), got {got!r} "
                f"(case '{case.name}')"
            )
        counts.append(count)
    settings = [(*c.args, c.kwargs.get("bias", True)) for c in cases]
    expected = [reference_block_parameter_count(*s) for s in settings]
    if counts == expected:
        labels = "; ".join(c.name for c in cases)
        print(f"\u2705 block_parameter_count is correct on all {len(cases)} test cases ({labels})")
        return
    if counts[:-1] == expected[:-1] and counts[-1] == reference_block_parameter_count(
            *cases[-1].args, False):
        raise CheckFailure(
            "Your count is right when bias is given, but with bias left out you count a block "
            "without biases: bias should default to True, def block_parameter_count(d_model, "
            "d_ff, bias=True)"
        )
    first_wrong = next(i for i, (c, e) in enumerate(zip(counts, expected, strict=True)) if c != e)
    per_case = [_count_mistakes(*s) for s in settings]
    for m, (_, message) in enumerate(per_case[0]):
        if all(count == mistakes[m][0] for count, mistakes in zip(counts, per_case, strict=True)):
            raise CheckFailure(f"{message} (seen on the case '{cases[first_wrong].name}')")
    raise CheckFailure(
        f"Your count {counts[first_wrong]} is off by "
        f"{counts[first_wrong] - expected[first_wrong]:+d} (case '{cases[first_wrong].name}'). "
        "Count each part: attention (4 matrices d_model x d_model, plus biases), the FFN (W1, b1, "
        "W2, b2) and two LayerNorms (gain and shift, d_model each)"
    )
