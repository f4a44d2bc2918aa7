"""Checks for chapter 06, multi-head attention: a layer whose merge puts the heads' outputs in
the wrong places (find the bug), a prediction of each head's score variance, multi-head
attention with a value width of its own, the FLOP count of cross-attention, and switching heads
off. ``check_split_heads`` and
``check_merge_heads`` check the two reshapes on their own (practice; no graded cell uses them)."""

from __future__ import annotations

import copy
import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib.attention import (
    MultiHeadAttention,
    merge_heads,
    scaled_dot_product_attention,
    split_heads,
)
from course_lib.instruments.probes import ablate_heads, who_sees_whom

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    rand,
    require_count,
    require_number,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Practice (no graded cell): split_heads(x, n_heads)

HEAD_MIXING = (
    "Your heads mix positions: reshaping (B, T, D) straight to (B, H, T, Dh) gives the right "
    "shape, but it cuts each sequence's numbers in memory order, so row 1 of head 0 holds more "
    "of position 0's features instead of position 1's, and so on. First reshape to "
    "(B, T, H, Dh), which splits only the feature axis, then swap the head and position axes "
    "with .transpose(1, 2)"
)
INTERLEAVED = (
    "Your head h got every H-th feature (h, h + H, h + 2H, ...). Head h owns the contiguous "
    "block of features h*Dh .. (h+1)*Dh - 1, the same block its rows of W_q, W_k, W_v produce: "
    "reshape the feature axis as (H, Dh), not (Dh, H)"
)


def _sizes(x: torch.Tensor, n_heads: int) -> tuple[int, int, int, int]:
    batch, seq_len, d_model = x.shape
    return batch, seq_len, n_heads, d_model // n_heads


SPLIT_MISTAKES = [
    Misconception(
        lambda x, n_heads: x.reshape(_sizes(x, n_heads)[0], n_heads, x.shape[1], -1),
        HEAD_MIXING,
    ),
    Misconception(
        lambda x, n_heads: x.reshape(*x.shape[:2], n_heads, -1),
        "Your result is (B, T, H, Dh): the features are split into heads, but the head axis "
        "must come before the positions, (B, H, T, Dh), so that each head is a batch of "
        "sequences: add .transpose(1, 2)",
    ),
    Misconception(
        lambda x, n_heads: x.reshape(*x.shape[:2], -1, n_heads).permute(0, 3, 1, 2),
        INTERLEAVED,
    ),
    Misconception(
        lambda x, n_heads: x.reshape(*x.shape[:2], n_heads, -1).permute(0, 2, 3, 1),
        "Your result is (B, H, Dh, T): positions and features are swapped within each head. "
        "Swap only the position and head axes: reshape to (B, T, H, Dh), then .transpose(1, 2)",
    ),
    Misconception(
        lambda x, n_heads: x.transpose(1, 2).reshape(x.shape[0], n_heads, x.shape[1], -1),
        "You transposed (B, T, D) to (B, D, T) and then reshaped to (B, H, T, Dh): that cuts "
        "through the features of different positions. Reshape first, (B, T, D) -> "
        "(B, T, H, Dh), then transpose the head and position axes",
    ),
]


def _split_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("B=2, T=5, D=12, H=3", (rand(gen, 2, 5, 12), 3)),
        Case("T = H = 4 (a missing transpose keeps the shape)", (rand(gen, 2, 4, 16), 4)),
        Case("one head, H=1", (rand(gen, 2, 3, 6), 1)),
        Case("Dh=1: as many heads as features", (rand(gen, 1, 3, 4), 4)),
        Case("one position, T=1", (rand(gen, 3, 1, 8), 2)),
        Case("B=1, T=7, D=24, H=6", (rand(gen, 1, 7, 24), 6)),
    ]


def check_split_heads(split_heads_fn: Callable) -> None:
    """Check ``split_heads(x, n_heads)``: (B, T, D) -> (B, H, T, Dh), head h holding features
    h*Dh .. (h+1)*Dh - 1 of every position.

    Args:
        split_heads_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        expected = split_heads(*case.args)
        compare_tensors(got, expected, case, what="Your heads", misconceptions=SPLIT_MISTAKES,
                        atol=0.0, rtol=0.0)

    _run("split_heads", split_heads_fn, _split_cases(seed=61), check_one)


# --------------------------------------------------------------------------------------------
# Practice (no graded cell): merge_heads(x)


def _merged_shape(x: torch.Tensor) -> tuple[int, int, int]:
    batch, n_heads, seq_len, d_head = x.shape
    return batch, seq_len, n_heads * d_head


MERGE_MISTAKES = [
    Misconception(
        lambda x: x.reshape(_merged_shape(x)),
        "Your merge mixes positions: reshaping (B, H, T, Dh) straight to (B, T, D) reads the "
        "numbers head by head, so position 0 receives head 0's outputs for positions 0, 1, "
        "... First bring the positions next to the batch, .transpose(1, 2) -> (B, T, H, Dh), "
        "then flatten the last two axes",
    ),
    Misconception(
        lambda x: x.permute(0, 2, 3, 1).reshape(_merged_shape(x)),
        "Your merge interleaves the heads (feature 0 of every head, then feature 1, ...). "
        "Concatenate them instead: head 0's Dh features, then head 1's, ... -- transpose to "
        "(B, T, H, Dh) and flatten (H, Dh)",
    ),
    Misconception(
        lambda x: x.sum(dim=1),
        "You added the heads' outputs. Multi-head attention concatenates them (eq. 24): the "
        "result has D = H * Dh features, head h in features h*Dh .. (h+1)*Dh - 1",
    ),
    Misconception(
        lambda x: x.mean(dim=1),
        "You averaged the heads' outputs. Multi-head attention concatenates them (eq. 24): the "
        "result has D = H * Dh features, head h in features h*Dh .. (h+1)*Dh - 1",
    ),
    Misconception(
        lambda x: torch.cat(list(x.unbind(1)), dim=1),
        "You stacked the heads along the positions, (B, H*T, Dh). Concatenate along the "
        "features instead: (B, T, H*Dh)",
    ),
    Misconception(
        lambda x: x.transpose(1, 2),
        "Your result is (B, T, H, Dh): the axes are in the right order; now flatten the last "
        "two into one axis of H * Dh features, e.g. .reshape(B, T, H * Dh)",
    ),
]


def _merge_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("B=2, H=3, T=5, Dh=4", (rand(gen, 2, 3, 5, 4),)),
        Case("T = H = 4", (rand(gen, 2, 4, 4, 4),)),
        Case("one head, H=1", (rand(gen, 1, 1, 3, 6),)),
        Case("Dh=1", (rand(gen, 2, 4, 3, 1),)),
        Case("one position, T=1", (rand(gen, 3, 2, 1, 4),)),
    ]


def check_merge_heads(merge_heads_fn: Callable) -> None:
    """Check ``merge_heads(x)``: (B, H, T, Dh) -> (B, T, H*Dh), the heads concatenated along
    the features, head 0 first.

    Args:
        merge_heads_fn: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        expected = merge_heads(*case.args)
        compare_tensors(got, expected, case, what="Your merged heads",
                        misconceptions=MERGE_MISTAKES, atol=0.0, rtol=0.0)

    _run("merge_heads", merge_heads_fn, _merge_cases(seed=62), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 6.1 (find the bug): a multi-head layer whose merge interleaves the heads

_REFERENCE = "nn.MultiheadAttention with the same weights"
_APART = "the heads-apart property test"


def _build_layers(layer_class: Callable, name: str, d_model: int, n_heads: int,
                  seed: int) -> tuple[nn.Module, nn.MultiheadAttention]:
    """The learner's layer and nn.MultiheadAttention, both holding the same random weights
    (non-zero biases), built without touching the learner's random stream."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        reference = nn.MultiheadAttention(d_model, n_heads, batch_first=True).eval()
        with torch.no_grad():
            for p in reference.parameters():
                p.add_(0.2 * torch.randn_like(p))  # non-zero biases, clearly different heads
        layer = call_learner(layer_class, Case("building the layer", (d_model, n_heads)),
                             fn_name=name)
    finally:
        torch.random.set_rng_state(state)
    shapes = {"qkv_proj": (3 * d_model, d_model), "out_proj": (d_model, d_model)}
    for attr, shape in shapes.items():
        linear = getattr(layer, attr, None)
        if not isinstance(linear, nn.Linear) or tuple(linear.weight.shape) != shape \
                or linear.bias is None:
            raise CheckFailure(f"{name}({d_model}, {n_heads}) has no nn.Linear '{attr}' with "
                               f"weight {shape} and a bias: keep the __init__ of the layer "
                               "you are repairing (subclass it and rewrite forward only)")
    with torch.no_grad():
        layer.qkv_proj.weight.copy_(reference.in_proj_weight)  # rows [W_q; W_k; W_v]
        layer.qkv_proj.bias.copy_(reference.in_proj_bias)
        layer.out_proj.weight.copy_(reference.out_proj.weight)
        layer.out_proj.bias.copy_(reference.out_proj.bias)
    return layer.eval().requires_grad_(False), reference


def _concat_seen_by_out_proj(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The input of layer.out_proj during layer(x): the heads' outputs side by side, (B, T, D);
    None when the layer never calls out_proj as a module."""
    seen = []
    handle = layer.out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            layer(x)
    finally:
        handle.remove()
    return seen[0] if seen and isinstance(seen[0], torch.Tensor) else None


def heads_moved_by(layer: nn.Module, x: torch.Tensor, head: int,
                   n_heads: int) -> list[int] | None:
    """The heads-apart property test: change only ``head``'s rows of W_q, W_k and W_v (in a
    copy of the layer) and list the heads whose slice of the concatenation (the input of
    out_proj) moved. A correct layer moves exactly ``[head]``. None when the layer never calls
    out_proj as a module (nothing to measure)."""
    probe = copy.deepcopy(layer)
    before = _concat_seen_by_out_proj(probe, x)
    if before is None or before.shape != x.shape:
        return None
    d_model = x.shape[-1]
    d_head = d_model // n_heads
    gen = torch.Generator().manual_seed(67)
    with torch.no_grad():
        for part in range(3):  # W_q, W_k, W_v
            rows = slice(part * d_model + head * d_head, part * d_model + (head + 1) * d_head)
            probe.qkv_proj.weight[rows] += 0.5 * torch.randn(d_head, d_model, generator=gen)
    after = _concat_seen_by_out_proj(probe, x)
    change = (after - before).abs().view(*x.shape[:2], n_heads, d_head).amax(dim=(0, 1, 3))
    return [h for h in range(n_heads) if change[h] > 1e-5 * (1.0 + float(before.abs().max()))]


def _layer_variant(layer: nn.Module, x: torch.Tensor, n_heads: int, *, split="right",
                   merge="right", scale="head", softmax_dim=-1, use_out=True) -> torch.Tensor:
    """The layer's computation with switches that reproduce plausible wrong repairs."""
    batch, seq_len, d_model = x.shape
    d_head = d_model // n_heads
    q, k, v = layer.qkv_proj(x).chunk(3, dim=-1)  # (B, T, D) each
    split_fn = {"right": lambda t: split_heads(t, n_heads),
                "mixing": lambda t: _mixing_split(t, n_heads),
                "interleaved": lambda t: _interleaved_split(t, n_heads)}[split]
    q, k, v = (split_fn(t) for t in (q, k, v))  # (B, H, T, Dh)
    divisor = {"head": math.sqrt(d_head), "model": math.sqrt(d_model), "none": 1.0}[scale]
    heads = torch.softmax(q @ k.transpose(-2, -1) / divisor, dim=softmax_dim) @ v
    concat = {"right": merge_heads, "mixing": _mixing_merge,
              "interleaved": _interleaved_merge}[merge](heads)  # (B, T, D)
    return layer.out_proj(concat) if use_out else concat


_FOUND_BY_REFERENCE = f" (found by comparing with {_REFERENCE})"
_REPAIR_MISTAKES = [
    (dict(merge="interleaved"),
     "The heads-apart property test finds the mistake: changing only head 0's rows of W_q, "
     "W_k and W_v moves numbers in every head's slice of the concatenation (the input of "
     "out_proj). Your merge interleaves the heads: it puts the head axis after the features, "
     "so feature e of head h lands at column e*H + h instead of h*Dh + e, and out_proj's "
     "columns for head h receive numbers from all heads. Undo the split in the reverse order "
     "of its axes"),
    (dict(merge="mixing"),
     "Your merge mixes positions: reshaping "
     "(B, H, T, Dh) straight to (B, T, D) reads the numbers head by head. Bring the positions "
     "back next to the batch first, then flatten the heads' features" + _FOUND_BY_REFERENCE),
    (dict(split="mixing", merge="mixing"),
     "Your layer splits (B, T, D) straight into (B, H, T, Dh) and merges back the same way: "
     "each 'head' then sees only the positions that landed in its chunk of memory. "
     "who_sees_whom finds it: each output depends on only some of the input positions"),
    (dict(scale="model"),
     "You divide the scores by sqrt(d_model): each head dots "
     "Dh-dimensional vectors, so divide by sqrt(Dh)" + _FOUND_BY_REFERENCE),
    (dict(scale="none"),
     "Your scores are not scaled: divide by sqrt(Dh)"
     + _FOUND_BY_REFERENCE),
    (dict(softmax_dim=-2),
     "Your softmax runs over the queries (dim -2); each query's weights must sum to 1 over "
     "the keys, the last dimension" + _FOUND_BY_REFERENCE),
    (dict(use_out=False),
     "You return the concatenated heads: finish with the output projection, self.out_proj, "
     "where the heads are mixed" + _FOUND_BY_REFERENCE),
]


def _diagnose_layer(layer: nn.Module, x: torch.Tensor, got: torch.Tensor,
                    expected: torch.Tensor, n_heads: int, case: Case) -> str:
    """Why a repaired layer's output differs from the reference: a known wrong repair, then
    the two instruments, heads-apart and who_sees_whom."""
    for switches, message in _REPAIR_MISTAKES:
        with torch.no_grad():
            wrong = _layer_variant(layer, x, n_heads, **switches)
        if torch.allclose(got, wrong, atol=1e-5, rtol=1e-4) and not torch.allclose(
                wrong, expected, atol=1e-5, rtol=1e-4):
            return f"{message} (case '{case.name}')"
    diff = float((got - expected).abs().max())
    lines = [f"Your layer's output differs from {_REFERENCE} (largest difference {diff:.3g}, "
             f"case '{case.name}')."]
    with torch.no_grad():
        sees = who_sees_whom(layer, x)  # (T, T) bool
    if not bool(sees.all()):
        counts = sees.sum(1).tolist()
        lines.append(f"who_sees_whom finds the cause: without a mask every output should "
                     f"depend on all {x.shape[1]} input positions, but yours depend on "
                     f"{counts}. Your heads mix positions: each 'head' holds the positions "
                     "that landed in its chunk of memory.")
    moved = [(h, heads_moved_by(layer, x, h, n_heads)) for h in sorted({0, n_heads - 1})]
    broken = [(h, m) for h, m in moved if m is not None and m != [h]]
    if broken:
        h, m = broken[0]
        lines.append(f"The heads-apart property test finds the cause: changing only head "
                     f"{h}'s rows of W_q, W_k and W_v moved the slices of heads {m} of the "
                     f"concatenation (the input of out_proj); in a correct layer only head "
                     f"{h}'s slice moves. Somewhere between the split and the merge, numbers "
                     "cross from one head to another (or from one position to another): head h "
                     "must work on features h*Dh .. (h+1)*Dh - 1 of its own position and fill "
                     "the same features of the concatenation, the columns of W_o that belong "
                     "to it.")
    if len(lines) == 1:
        lines.append(f"who_sees_whom and {_APART} both pass, so the split into heads and "
                     "the merge look right: compare the rest of forward (scaling, softmax, "
                     "out_proj) with the lecture's layer.")
    return " ".join(lines)


def _repair_cases() -> list[tuple[str, int, int, tuple[int, int], int]]:
    """(name, d_model, n_heads, (B, T), seed)."""
    return [
        ("D=12, H=3, B=2, T=6", 12, 3, (2, 6), 1),
        ("T = H = 4, D=16", 16, 4, (2, 4), 2),
        ("one head, H=1", 8, 1, (2, 5), 3),
        ("D=24, H=6, B=1, T=7", 24, 6, (1, 7), 4),
        ("one position, T=1", 16, 2, (3, 1), 5),
    ]


def check_fixed_attention(layer_class: Callable) -> None:
    """Check a repaired multi-head self-attention class: ``layer_class(d_model, n_heads)``
    keeps the suspect layer's ``qkv_proj`` (rows [W_q; W_k; W_v]) and ``out_proj``, and
    ``forward(x)`` (B, T, D) -> (B, T, D) must equal nn.MultiheadAttention holding the same
    weights on every case. A wrong layer is examined with who_sees_whom and the heads-apart
    property test, and the message names the instrument that finds the mistake.

    Args:
        layer_class: the learner's class (an nn.Module subclass).
    """
    name = getattr(layer_class, "__name__", "your layer")
    if not (isinstance(layer_class, type) and issubclass(layer_class, nn.Module)):
        raise CheckFailure(f"expected a class (an nn.Module subclass), got "
                           f"{describe(layer_class)}: pass the class itself, not an instance")
    labels = []
    for label, d_model, n_heads, (batch, seq_len), seed in _repair_cases():
        layer, reference = _build_layers(layer_class, name, d_model, n_heads, seed)
        x = rand(torch.Generator().manual_seed(660 + seed), batch, seq_len, d_model)
        case = Case(label, (x,))
        got = call_learner(layer, case, fn_name=f"{name}.forward")
        with torch.no_grad():
            expected = reference(x, x, x, need_weights=False)[0]  # (B, T, D)
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            got = got.detach()
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                raise CheckFailure(_diagnose_layer(layer, x, got, expected, n_heads, case))
        compare_tensors(got, expected, case, what=f"The output of {name}")
        labels.append(label)
    print(f"\u2705 {name} equals {_REFERENCE} on all {len(labels)} test cases "
          f"({'; '.join(labels)})")


# --------------------------------------------------------------------------------------------
# Exercise 6.2 (predict, then verify): the divisor at initialisation. A fresh
# MultiHeadAttention(576, 16) has nn.Linear's default weights, uniform on (-1/sqrt(D), 1/sqrt(D)),
# variance 1/(3D): an entry of q or k has variance D / (3D) = 1/3 (biases add 1/(3D)), a head's
# dot product 36 * (1/3)^2 = 4, the scores q.k / 6 have variance 4/36 = 1/9, and the divisor
# sqrt(4) = 2 gives them variance 1.

INIT_D_MODEL, INIT_HEADS = 576, 16
INIT_D_HEAD = INIT_D_MODEL // INIT_HEADS  # 36: the layer divides by sqrt(36) = 6
_PREDICTION_SETTING = (
    "course_lib.MultiHeadAttention(576, 16) as built, heads of Dh = 36, scores divided by "
    "sqrt(36) = 6, weights uniform on (-1/sqrt(576), 1/sqrt(576)), inputs with independent "
    "entries of mean 0 and variance 1"
)
VARIANCE_MISTAKES = {
    1.0: "1 is the lecture's answer for queries and keys whose entries have variance 1. A "
         "fresh layer's do not: an entry of q is a sum of 576 products w_j x_j, each w_j "
         "uniform on (-1/24, 1/24)",
    1 / 3: "1/3 is the variance of one entry of q (or of k). A score multiplies a query entry "
           "by a key entry, and a product of two independent numbers of mean 0 has the product "
           "of their variances",
    4.0: "4 is the variance of the dot products q.k, before the layer divides them by 6",
    1 / 144: "A uniform number on (-a, a) has variance a^2 / 3 (the formula (b - a)^2 / 12 "
             "with the width 2a), not a^2 / 12",
    16 / 9: "You summed over all 576 features. A head dots its own 36 query and key features",
    1 / 324: "You divided 1/9, the variance of one product q_i k_i, by 36; but a score first "
             "sums 36 such products (variance 36/9 = 4), and only then is divided by 6",
}
DIVISOR_MISTAKES = {
    6.0: "6 = sqrt(Dh) is the layer's divisor, right for unit-variance queries and keys. Here "
         "the dot products have variance 4, not 36",
    1 / 3: "1/3 is the factor by which the divisor must change, 6 * (1/3); the question asks "
           "for the divisor itself",
    4.0: "4 is the variance of the dot products; divide by their standard deviation",
    24.0: "sqrt(576) = 24 belongs to one head of width d_model; each head here dots 36 features",
    12.0: "With divisor 12 = Dh / 3 the variance is 4 / 144, far below 1: divide by the "
          "standard deviation of the dot products",
    1.0: "Without a divisor the scores keep the dot products' variance, 4",
}


def _grade_one(value: float, expected: float, mistakes: dict[float, str], what: str) -> None:
    if math.isclose(value, expected, rel_tol=0.05):
        return
    for wrong, message in mistakes.items():
        if math.isclose(value, wrong, rel_tol=0.05):
            raise CheckFailure(f"Your {what} is {value:g}. {message}")
    raise CheckFailure(f"Your {what} is {value:g}, which does not match the setting "
                       f"({_PREDICTION_SETTING}). Work it out in three steps: the variance of "
                       "one weight, of one entry of q, then of a head's dot product; dividing "
                       "a number by c divides its variance by c squared")


def measured_score_stats(divisor: float, *, seed: int = 62, n_keys: int = 64
                         ) -> tuple[float, float]:
    """Variance of one head's scores q.k / divisor and the mean entropy (nats) of each query's
    weights, for a freshly built MultiHeadAttention(576, 16) (weights drawn from ``seed``, the
    learner's random stream left alone) on inputs with unit-variance entries."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = MultiHeadAttention(INIT_D_MODEL, INIT_HEADS)
    x = torch.randn(8, n_keys, INIT_D_MODEL,  # a stream of its own, not the weights'
                    generator=torch.Generator().manual_seed(seed + 1000))
    with torch.no_grad():
        q, k, _ = layer.qkv_proj(x).chunk(3, dim=-1)  # (B, T, D) each
    q, k = (split_heads(t, INIT_HEADS) for t in (q, k))  # (B, H, T, Dh)
    scores = q @ k.transpose(-2, -1) / divisor  # (B, H, T, S)
    weights = torch.softmax(scores, dim=-1)
    return float(scores.var()), float(torch.special.entr(weights).sum(-1).mean())


def check_scale_predictions(predictions: Callable) -> None:
    """Check ``predictions()`` -> (variance, divisor): the variance of one head's scores of a
    freshly built ``MultiHeadAttention(576, 16)`` (divisor 6), and the divisor that would make
    it 1; then print the measurement. Both are numbers: ``(1/9, 2)`` and ``(0.111, 2.0)`` are
    the same answer.

    Args:
        predictions: the learner's function of no arguments.
    """
    case = Case("the setting of exercise 6.2")
    got = call_learner(predictions, case)
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        raise CheckFailure(f"predictions() should return two numbers, (variance, divisor), "
                           f"but returned {describe(got)}")
    variance = require_number(got[0], "the predicted variance", case)  # any real number:
    divisor = require_number(got[1], "the divisor", case)  # 2 and 2.0 are the same answer
    _grade_one(variance, 1 / 9, VARIANCE_MISTAKES, "predicted variance with divisor 6")
    _grade_one(divisor, 2.0, DIVISOR_MISTAKES, "divisor")
    (var_6, ent_6), (var_2, ent_2) = measured_score_stats(6.0), measured_score_stats(2.0)
    print(f"\u2705 Your predictions hold: variance {variance:.3g} with divisor 6, and divisor "
          f"{divisor:g} brings it to 1.\nMeasured on a fresh MultiHeadAttention(576, 16), 64 "
          f"keys: score variance {var_6:.3f} with divisor 6, {var_2:.2f} with divisor 2; entropy "
          f"of the weights {ent_6:.2f} and {ent_2:.2f} nats (uniform weights: log 64 = "
          f"{math.log(64):.2f}), so at initialisation every head starts close to averaging "
          "everything, whatever its size.")


# --------------------------------------------------------------------------------------------
# Exercise 6.3: multi_head_attention(x, W_q, W_k, W_v, W_o, n_heads), with d_v != d_k


def _interleaved_split(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    return x.reshape(*x.shape[:2], -1, n_heads).permute(0, 3, 1, 2)  # (B, H, T, Dh)


def _interleaved_merge(x: torch.Tensor) -> torch.Tensor:
    return x.permute(0, 2, 3, 1).reshape(_merged_shape(x))  # (B, T, D)


def _mixing_split(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    return x.reshape(x.shape[0], n_heads, x.shape[1], -1)  # (B, H, T, Dh), positions mixed


def _mixing_merge(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(_merged_shape(x))  # (B, T, D), positions mixed


def _mha(x, W_q, W_k, W_v, W_o, n_heads, *, scale="head", split=split_heads, merge=merge_heads,
         use_w_o=True, transpose=True, softmax_dim=-1):
    """Multi-head attention (head widths read from the weights) with switches that reproduce
    common mistakes."""
    t = (lambda w: w.T) if transpose else (lambda w: w)
    q, k, v = (split(x @ t(w), n_heads) for w in (W_q, W_k, W_v))  # (B, H, T, d_k or d_v)
    d_k, d_v = q.shape[-1], v.shape[-1]
    divisor = {"head": math.sqrt(d_k), "value": math.sqrt(d_v), "model": math.sqrt(x.shape[-1]),
               "none": 1.0, "d_head": d_k}[scale]
    scores = q @ k.transpose(-2, -1) / divisor  # (B, H, T, T)
    out = torch.softmax(scores, dim=softmax_dim) @ v  # (B, H, T, d_v)
    concat = merge(out)  # (B, T, H * d_v)
    return concat @ t(W_o) if use_w_o else concat


MHA_MISTAKES = [
    Misconception(
        functools.partial(_mha, scale="value"),
        "You divided the scores by sqrt(d_v). A score is the dot product of a query and a key, "
        "d_k features each, so its typical size is sqrt(d_k): the value width plays no part "
        "in it. Divide by sqrt(d_k)",
    ),
    Misconception(
        functools.partial(_mha, scale="model"),
        "You divided the scores by sqrt(d_model). Each head's dot products run over its own "
        "d_k query and key features, so their typical size is sqrt(d_k): divide by sqrt(d_k)",
    ),
    Misconception(
        functools.partial(_mha, scale="none"),
        "Your scores are not scaled: divide each head's q k^T by sqrt(d_k)",
    ),
    Misconception(
        functools.partial(_mha, scale="d_head"),
        "You divided the scores by d_k itself. A dot product of d_k features has variance d_k, "
        "so its typical size is sqrt(d_k): divide by sqrt(d_k), not d_k",
    ),
    Misconception(
        functools.partial(_mha, use_w_o=False),
        "You returned the concatenated heads without the output projection: finish with W_o, "
        "out = concat @ W_o.T (eq. 24). W_o is where the heads' outputs are mixed",
    ),
    Misconception(
        functools.partial(_mha, split=_mixing_split, merge=_mixing_merge),
        HEAD_MIXING.replace("Dh", "d_k") + " (and undo it in the same way: .transpose(1, 2), "
        "then reshape)",
    ),
    Misconception(
        functools.partial(_mha, merge=_mixing_merge),
        "Your split into heads is right, but your merge mixes positions: reshaping "
        "(B, H, T, d_v) straight to (B, T, H * d_v) reads the numbers head by head. Transpose "
        "back to (B, T, H, d_v) first, then flatten the last two axes",
    ),
    Misconception(
        functools.partial(_mha, split=_interleaved_split, merge=_interleaved_merge),
        INTERLEAVED.replace("h*Dh .. (h+1)*Dh - 1", "h*d_k .. (h+1)*d_k - 1 (h*d_v .. for the "
                            "values)").replace("(H, Dh), not (Dh, H)", "(H, d), not (d, H)"),
    ),
    Misconception(
        functools.partial(_mha, transpose=False),
        "The weights are stored like nn.Linear's, shape (out, in), so a projection is "
        "x @ W.T (q = x @ W_q.T, ..., out = concat @ W_o.T); you multiplied by W itself",
    ),
    Misconception(
        lambda x, W_q, W_k, W_v, W_o, n_heads: _mha(x, W_q, W_k, W_v, W_o, 1),
        "You computed a single head as wide as all the heads together. Split the queries and "
        "keys into n_heads heads of d_k features, the values into n_heads heads of d_v "
        "features, and attend within each head separately",
    ),
    Misconception(
        functools.partial(_mha, softmax_dim=-2),
        "Your softmax runs over the queries (dim -2): each query's weights must sum to 1 over "
        "the keys, the last dimension of the scores (B, H, T, S)",
    ),
]


def _weights(gen: torch.Generator, d_model: int, n_heads: int, d_k: int, d_v: int,
             scale: float) -> tuple:
    """W_q, W_k (H*d_k, D), W_v (H*d_v, D) and W_o (D, H*d_v), in nn.Linear's layout."""
    shapes = [(n_heads * d_k, d_model)] * 2 + [(n_heads * d_v, d_model),
                                               (d_model, n_heads * d_v)]
    return tuple(rand(gen, *shape, scale=scale / math.sqrt(shape[1])) for shape in shapes)


def _mha_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    # d_k != d_v, and sqrt(d_k) differs from sqrt(d_v), sqrt(D) and d_k, in every case but the
    # usual layer's (d_k = d_v = D / H) and the one with d_k = 1
    specs = [  # name, (B, T, D), H, d_k, d_v, weight scale
        ("B=2, T=5, D=12, H=3, d_k=4, d_v=9", (2, 5, 12), 3, 4, 9, 2.0),
        ("one head, H=1, D=8, d_k=3, d_v=8", (2, 4, 8), 1, 3, 8, 2.0),
        ("d_k=1: D=6, H=6, d_v=2", (1, 5, 6), 6, 1, 2, 2.0),
        ("one position, T=1, D=8, H=2, d_k=4, d_v=3", (2, 1, 8), 2, 4, 3, 2.0),
        ("narrow values: D=24, H=3, d_k=9, d_v=2", (1, 7, 24), 3, 9, 2, 2.0),
        ("the usual layer: d_k = d_v = D/H, D=32, H=4", (2, 4, 32), 4, 8, 8, 3.0),
    ]
    hint = ("W_q and W_k are (H*d_k, D), W_v is (H*d_v, D) and W_o is (D, H*d_v), in "
            "nn.Linear's (out, in) layout: read d_k and d_v from the weights' shapes, not "
            "from D")
    return [Case(name, (rand(gen, *shape), *_weights(gen, shape[-1], h, d_k, d_v, scale), h),
                 hint=hint)
            for name, shape, h, d_k, d_v, scale in specs]


def reference_multi_head_attention(x: torch.Tensor, W_q: torch.Tensor, W_k: torch.Tensor,
                                   W_v: torch.Tensor, W_o: torch.Tensor,
                                   n_heads: int) -> torch.Tensor:
    """course_lib's heads and attention with d_k = W_q.shape[0] / H and d_v = W_v.shape[0] / H:
    (B, T, D) -> (B, T, D), scores scaled by 1/sqrt(d_k)."""
    q, k, v = (split_heads(x @ w.T, n_heads) for w in (W_q, W_k, W_v))  # (B, H, T, d_k / d_v)
    heads, _ = scaled_dot_product_attention(q, k, v)  # (B, H, T, d_v), 1/sqrt(d_k) scaling
    return merge_heads(heads) @ W_o.T  # (B, T, D)


def check_multi_head_attention(multi_head_attention: Callable) -> None:
    """Check ``multi_head_attention(x, W_q, W_k, W_v, W_o, n_heads)`` -> (B, T, D): H heads whose
    queries and keys have d_k features and whose values have d_v (read from the weights'
    shapes), scaled by 1/sqrt(d_k), concatenated, then W_o; weights in nn.Linear's (out, in)
    layout, no biases, no mask.

    Args:
        multi_head_attention: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        expected = reference_multi_head_attention(*case.args)
        compare_tensors(got, expected, case, what="Your output", misconceptions=MHA_MISTAKES)

    _run("multi_head_attention", multi_head_attention, _mha_cases(seed=63), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 6.4: cross_attention_flops(batch, seq_len, context_len, d_model, n_heads)


@functools.cache
def measured_flops(batch: int, seq_len: int, context_len: int, d_model: int,
                   n_heads: int) -> int:
    """FLOPs of one forward pass of course_lib's MultiHeadAttention as cross-attention (queries
    from x, (B, T, D); keys and values from a context, (B, S, D)), with the attention weights
    materialised so every matrix product is visible, counted by torch.utils.flop_counter on
    the ``meta`` device (shapes only, nothing is computed)."""
    with torch.device("meta"):
        layer = MultiHeadAttention(d_model, n_heads)
        x = torch.empty(batch, seq_len, d_model)  # (B, T, D)
        context = torch.empty(batch, context_len, d_model)  # (B, S, D)
    with FlopCounterMode(display=False) as counter:
        layer(x, context=context, return_weights=True)
    return counter.get_total_flops()


def _self_attention(b: int, t: int, s: int, d: int, h: int) -> int:
    return measured_flops(b, t, t, d, h)  # the context ignored: keys and values from x


def _wrong(b: int, t: int, s: int, d: int, h: int, *, query_side: int = 2, context_side: int = 2,
           kv_len: int | None = None, score_len: int | None = None, products: int = 2,
           heads: float = 1.0) -> int:
    """A cross-attention count with switches for common mistakes: ``query_side`` (D, D)
    products on the T query positions (W_q, W_o), ``context_side`` on the kv_len positions
    (W_k, W_v), and ``products`` attention products of T x score_len x Dh per head, ``heads``
    times too many heads."""
    kv_len = s if kv_len is None else kv_len
    score_len = s if score_len is None else score_len
    projections = 2 * b * d * d * (query_side * t + context_side * kv_len)
    return int(projections + products * 2 * b * t * score_len * d * heads)


CROSS_FLOP_MISTAKES = [
    Misconception(
        lambda b, t, s, d, h: measured_flops(b, t, s, d, h) // 2,
        "Your count is exactly half: you counted multiply-adds (MACs). A multiply-add is two "
        "floating-point operations, and FlopCounterMode counts 2 * m * k * n for an (m, k) @ "
        "(k, n) product",
    ),
    Misconception(
        _self_attention,
        "Your count is that of self-attention on x: context_len never mattered. In "
        "cross-attention the keys and the values come from the context, S positions, and each "
        "of the T queries is compared with each of the S keys",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, kv_len=t),
        "You projected keys and values from the T positions of x. W_k and W_v act on the "
        "context: S positions, not T",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, score_len=t),
        "Your attention products compare the T queries with T keys. There are S keys (and S "
        "values), one per context position: the scores of one head form a (T, S) matrix",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, query_side=1),
        "You left out one product on the query side: besides W_q, the output projection W_o "
        "also acts on the T positions, after the heads are concatenated",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, products=0),
        "You counted only the four projections. The attention itself is two more products "
        "per head: the scores q k^T and the weighted sum weights @ v",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, products=1),
        "You counted one attention product per head; there are two of the same size: the "
        "scores q k^T and the weighted sum weights @ v",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, heads=h),
        "Your attention products grow with the number of heads: each head works in "
        "Dh = D / H dimensions, not D, so more heads means more but thinner products, and "
        "the total does not change",
    ),
    Misconception(
        lambda b, t, s, d, h: _wrong(b, t, s, d, h, heads=1 / h),
        "You counted the attention products of one head only: there are n_heads heads",
    ),
    Misconception(
        lambda b, t, s, d, h: h * _wrong(b, t, s, d, h, products=0) + _wrong(
            b, t, s, d, h, query_side=0, context_side=0),
        "Your projections grow with the number of heads: each head projects to Dh = D / H "
        "features, so all heads together make one (D, D) product for each of W_q, W_k, W_v",
    ),
    Misconception(
        lambda b, t, s, d, h: measured_flops(1, t, s, d, h),
        "Your count ignores the batch: every one of the B examples goes through the same "
        "products",
    ),
]

_PARTS = (
    "the products on the T positions of x alone (the query projection, and the output "
    "projection once the heads are merged)",
    "the products on the S positions of the context alone (the key and the value "
    "projections)",
    "the attention products, which pair each of the T queries with each of the S keys "
    "(in every head)",
    "a part that depends on neither T nor S",
)


def _as_count(got: Any, case: Case) -> int:
    """A learner's FLOP count under the course's one rule for counts (an int or a numpy
    integer); a float also gets the reminder to keep the arithmetic in integers."""
    try:
        return require_count(got, "the FLOP count", case)
    except CheckFailure as failure:
        if isinstance(got, float):
            raise CheckFailure(f"{failure} Keep the arithmetic in integers (// rather than /) "
                               "so that no rounding creeps in") from None
        raise


def _number(fn: Callable, case: Case) -> int:
    """The learner's count for a case, or a CheckFailure when it is not an int."""
    return _as_count(call_learner(fn, case), case)


def _parts(count: Callable[..., float], b: int, t: int, s: int, d: int, h: int) -> list[float]:
    """Split count(b, t, s, d, h) into the parts that grow with T alone, with S alone, with T
    and S together, and with neither, from its values at T or 2T and S or 2S (exact for any
    count of the form a + p*T + q*S + r*T*S)."""
    f11, f21, f12, f22 = (count(b, tt, ss, d, h)
                          for tt, ss in ((t, s), (2 * t, s), (t, 2 * s), (2 * t, 2 * s)))
    both = f22 - f21 - f12 + f11
    query_side, context_side = f21 - f11 - both, f12 - f11 - both
    return [query_side, context_side, both, f11 - query_side - context_side - both]


def _small_multiple(extra: float, unit: int, most: int) -> bool:
    k = extra / unit
    return 1 <= k <= most and math.isclose(k, round(k), abs_tol=1e-6)


def _part_message(i: int, yours: float, theirs: float, args: tuple) -> str:
    b, t, s, d, h = args
    extra = yours - theirs
    if i == 0 and _small_multiple(extra, b * t * d, 4) or i == 1 and _small_multiple(
            extra, b * s * d, 4):
        return (f"{_PARTS[i]}: you added the bias additions ({extra:,.0f} FLOPs). "
                "FlopCounterMode counts only matrix products, and a bias addition is not one: "
                "leave the biases out")
    if i == 2 and (_small_multiple(extra, b * h * t * s, 10)
                   or _small_multiple(extra, b * t * s, 10)):
        return (f"{_PARTS[i]}: you added work done on each score ({extra:,.0f} FLOPs: the "
                "scaling by 1/sqrt(Dh), the softmax or the masking). FlopCounterMode counts "
                "only matrix products: leave the elementwise work out")
    return f"{_PARTS[i]}: you count {yours:,.0f} FLOPs, FlopCounterMode {theirs:,.0f}"


def _diagnose(fn: Callable, case: Case, value: float, expected: int) -> str:
    """Say which parts of the learner's count differ from FlopCounterMode's."""
    def yours(*args):
        return _number(fn, Case(f"{case.name}, with T or S changed", args))

    b, t, s, d, h = case.args
    bent = [name for name, curvature in (
        ("T", yours(b, 3 * t, s, d, h) - 2 * yours(b, 2 * t, s, d, h) + yours(b, t, s, d, h)),
        ("S", yours(b, t, 3 * s, d, h) - 2 * yours(b, t, 2 * s, d, h) + yours(b, t, s, d, h)),
    ) if abs(curvature) > 0.5]
    lines = [f"with the other sizes fixed, your count grows faster than in proportion to "
             f"{name}, as if a product ran over {name} x {name} pairs: each of the products "
             f"runs over the T positions, over the S positions, or over the (T, S) pairs"
             for name in bent]
    mine, reference = _parts(yours, *case.args), _parts(measured_flops, *case.args)
    pairs = enumerate(zip(mine, reference, strict=True))
    lines += [_part_message(i, y, r, case.args) for i, (y, r) in pairs
              if not math.isclose(y, r, rel_tol=1e-9, abs_tol=0.5) and not (bent and i == 3)]
    return (f"Your count is {value:,.0f} FLOPs, FlopCounterMode's {expected:,} for the case "
            f"'{case.name}' (batch, seq_len, context_len, d_model, n_heads = {case.args}). "
            "Changing T and S one at a time shows where the difference is:\n  - "
            + "\n  - ".join(lines or ["(no single part: compare the whole count)"]))


def check_cross_attention_flops(cross_attention_flops: Callable) -> None:
    """Check ``cross_attention_flops(batch, seq_len, context_len, d_model, n_heads)``: the
    FLOPs of the matrix products of one multi-head cross-attention forward pass (queries from
    T positions, keys and values from S context positions; 2 FLOPs per multiply-add; biases,
    scaling and softmax not counted), against torch.utils.flop_counter's count for
    course_lib's layer.

    Args:
        cross_attention_flops: the learner's function.
    """
    cases = [
        Case("B=3, T=10, S=30, D=64, H=4", (3, 10, 30, 64, 4)),
        Case("one query, T=1 (one decoding step), S=50", (3, 1, 50, 32, 2)),
        Case("one context position, S=1", (2, 12, 1, 48, 3)),
        Case("one head, H=1", (3, 20, 7, 16, 1)),
        Case("Dh=1: D=24, H=24", (1, 5, 9, 24, 24)),
        Case("S = T = 16", (2, 16, 16, 32, 4)),
        Case("a translation layer: B=8, T=40, S=60, D=512, H=8", (8, 40, 60, 512, 8)),
    ]

    def check_one(got, case: Case) -> None:
        expected = measured_flops(*case.args)
        value = _as_count(got, case)
        if value == expected:
            return
        for m in CROSS_FLOP_MISTAKES:
            wrong = m.wrong(*case.args)
            if math.isclose(value, wrong, rel_tol=1e-9) and wrong != expected:
                raise CheckFailure(f"{m.message} (seen on the case '{case.name}')")
        raise CheckFailure(_diagnose(cross_attention_flops, case, value, expected))

    _run("cross_attention_flops", cross_attention_flops, cases, check_one)


# --------------------------------------------------------------------------------------------
# Exercise 6.5: ablated_output(attention, x, heads)


@functools.cache
def _layer(d_model: int, n_heads: int, seed: int) -> MultiHeadAttention:
    """A MultiHeadAttention with random weights and biases, built without touching the
    learner's random stream."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        layer = MultiHeadAttention(d_model, n_heads).eval().requires_grad_(False)
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.2 * torch.randn_like(p))  # non-zero biases, clearly different heads
    finally:
        torch.random.set_rng_state(state)
    return layer


def _concat(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The input of W_o: the heads' outputs side by side, (B, T, D)."""
    seen = []
    handle = attention.out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            attention(x)
    finally:
        handle.remove()
    return seen[0]


def _slices(attention: MultiHeadAttention, heads: Sequence[int], interleaved: bool = False):
    keep = torch.ones(attention.d_model, dtype=torch.bool)
    for h in heads:
        if interleaved:
            keep[h::attention.n_heads] = False
        else:
            keep[h * attention.d_head:(h + 1) * attention.d_head] = False
    return keep  # (D,) True for the features kept


def _after_w_o(attention, x, heads):
    with torch.no_grad():
        return attention(x)[0] * _slices(attention, heads)


def _with_rows_zeroed(attention, x, heads, part: int, bias: bool):
    """Zero head h's rows of W_q (part 0) or W_v (part 2), and optionally of the bias."""
    layer = copy.deepcopy(attention)
    d, dh = layer.d_model, layer.d_head
    with torch.no_grad():
        for h in heads:
            rows = slice(part * d + h * dh, part * d + (h + 1) * dh)
            layer.qkv_proj.weight[rows] = 0.0
            if bias:
                layer.qkv_proj.bias[rows] = 0.0
        return layer(x)[0]


def _from_concat(attention, x, heads, *, interleaved=False, complement=False, bias=True,
                 rescale=False):
    keep = _slices(attention, heads, interleaved)
    if complement:
        keep = ~keep
    concat = _concat(attention, x) * keep  # (B, T, D)
    if rescale and keep.any():
        concat = concat * (attention.d_model / int(keep.sum()))
    out = concat @ attention.out_proj.weight.T
    return out + attention.out_proj.bias if bias else out


ABLATION_MISTAKES = [
    Misconception(
        _after_w_o,
        "You zeroed the head's slice of the layer's output, after W_o. W_o mixes every head "
        "into every output feature, so that removes parts of all heads and leaves the chosen "
        "one in the other features. Zero the head's slice of the concatenated heads, the "
        "input of out_proj, before W_o",
    ),
    Misconception(
        lambda attention, x, heads: _with_rows_zeroed(attention, x, heads, 0, bias=True),
        "Zeroing a head's queries does not switch it off: all its scores become 0, so it "
        "attends uniformly and outputs the average of its values. Zero the head's output "
        "instead (its slice of the concatenated heads, before W_o)",
    ),
    Misconception(
        lambda attention, x, heads: _with_rows_zeroed(attention, x, heads, 2, bias=False),
        "You zeroed the head's rows of W_v but not of the value bias: every value of that "
        "head is then the bias, and so is its output. Zero the head's output (its slice of "
        "the concatenated heads), or the bias rows too",
    ),
    Misconception(
        functools.partial(_from_concat, bias=False),
        "You dropped W_o's bias. The bias of out_proj belongs to no head: keep it, "
        "out = concat @ W_o.T + b_o",
    ),
    Misconception(
        functools.partial(_from_concat, complement=True),
        "You kept only the heads listed in `heads` and switched off all the others: it is the "
        "other way round, the listed heads are the ones to zero",
    ),
    Misconception(
        functools.partial(_from_concat, interleaved=True),
        "You zeroed every H-th feature (h, h + H, ...). Head h's output is the contiguous "
        "slice h*Dh .. (h+1)*Dh - 1 of the concatenated heads, Dh = d_model / n_heads",
    ),
    Misconception(
        functools.partial(_from_concat, rescale=True),
        "You scaled the remaining heads up (as dropout does). An ablation only removes the "
        "chosen heads' terms; leave the other heads as they are",
    ),
]


def _ablation_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("H=4, switch off head 1", (_layer(16, 4, 1), rand(gen, 2, 5, 16), [1])),
        Case("H=4, heads 0 and 2", (_layer(16, 4, 1), rand(gen, 2, 5, 16), [0, 2])),
        Case("no head switched off, heads = []", (_layer(16, 4, 2), rand(gen, 1, 4, 16), [])),
        Case("every head switched off", (_layer(16, 4, 2), rand(gen, 2, 3, 16), [0, 1, 2, 3])),
        Case("one head, H=1", (_layer(8, 1, 3), rand(gen, 2, 4, 8), [0])),
        Case("H=8 (Dh=2), the last head, T=1", (_layer(16, 8, 4), rand(gen, 3, 1, 16), [7])),
    ]


def _check_layer_left_alone(ablated_output: Callable) -> None:
    """Call the learner's function once more and make sure the layer is as it was."""
    layer = copy.deepcopy(_layer(16, 4, 5))
    before = {name: t.clone() for name, t in layer.state_dict().items()}
    x = torch.randn(1, 3, 16, generator=torch.Generator().manual_seed(65))
    try:
        ablated_output(layer, x, [2])
    except Exception as exc:
        raise CheckFailure(
            f"ablated_output raised {type(exc).__name__} when called on a fresh layer: {exc}"
        ) from exc
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in layer.modules())
    if hooks:
        raise CheckFailure(
            "Your function left a hook registered on the layer, so the head stays switched "
            "off for every later call. Keep the handle that register_forward_pre_hook returns "
            "and call handle.remove() when you are done (in a finally: block)"
        )
    changed = [name for name, t in layer.state_dict().items() if not torch.equal(t, before[name])]
    if changed:
        raise CheckFailure(
            f"Your function changed the layer's parameters ({', '.join(changed)}) in place, so "
            "the head stays switched off afterwards. Compute the output without modifying the "
            "layer (or work on a copy.deepcopy of it)"
        )


def check_ablated_output(ablated_output: Callable) -> None:
    """Check ``ablated_output(attention, x, heads)`` -> (B, T, D): the output of a course_lib
    MultiHeadAttention on x with the listed heads switched off (their outputs zeroed before
    W_o), leaving the layer unchanged.

    Args:
        ablated_output: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        attention, x, heads = case.args
        with torch.no_grad(), ablate_heads(attention, heads):
            expected = attention(x)[0]
        if isinstance(got, torch.Tensor):
            got = got.detach()
        compare_tensors(got, expected, case, what="Your output",
                        misconceptions=ABLATION_MISTAKES)

    _run("ablated_output", ablated_output, _ablation_cases(seed=64), check_one,
         after=lambda: _check_layer_left_alone(ablated_output))


# --------------------------------------------------------------------------------------------


def _run(name: str, fn: Callable, cases: Sequence[Case], check_one: Callable,
         after: Callable[[], None] | None = None) -> None:
    """Run the cases (as _core.run_cases does), then an optional final check, then print the
    pass line."""
    for case in cases:
        check_one(call_learner(fn, case), case)
    if after is not None:
        after()
    labels = "; ".join(c.name for c in cases)
    print(f"\u2705 {name} is correct on all {len(cases)} test cases ({labels})")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
