"""The chapter 04 checks: they accept correct answers written in different ways, reject the
likely mistakes with a message naming them, and let an unsolved stub's NotImplementedError
through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib import EncoderBlock, count_parameters
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch04 import (
    check_block_parameter_count,
    check_collapse_two_layers,
    check_feed_forward,
    reference_block_parameter_count,
    reference_collapse,
    reference_feed_forward,
)

# ------------------------------------------------------------------ references


def test_reference_feed_forward_matches_functional_form():
    torch.manual_seed(0)
    x, W1, b1 = torch.randn(2, 3, 4), torch.randn(10, 4), torch.randn(10)
    W2, b2 = torch.randn(4, 10), torch.randn(4)
    expected = F.linear(F.relu(F.linear(x, W1, b1)), W2, b2)
    torch.testing.assert_close(reference_feed_forward(x, W1, b1, W2, b2), expected)


def test_reference_collapse_reproduces_two_linear_attention_layers():
    torch.manual_seed(0)
    a1 = torch.softmax(torch.randn(5, 5), -1)
    a2 = torch.softmax(torch.randn(5, 5), -1)
    V1, V2, X = torch.randn(4, 3), torch.randn(2, 4), torch.randn(5, 3)
    alpha_star, V_star = reference_collapse(a1, a2, V1, V2)
    torch.testing.assert_close(alpha_star @ X @ V_star.T, a2 @ (a1 @ X @ V1.T) @ V2.T)
    torch.testing.assert_close(alpha_star.sum(-1), torch.ones(5))


@pytest.mark.parametrize("d, f, bias", [(8, 32, True), (6, 10, False), (1, 1, True)])
def test_reference_block_count_matches_a_real_block_and_the_formula(d, f, bias):
    real = count_parameters(EncoderBlock(d, 1, f, bias=bias))
    formula = 4 * d * d + 2 * d * f + 4 * d + ((4 * d + f + d) if bias else 0)
    assert reference_block_parameter_count(d, f, bias) == real == formula


# ------------------------------------------------------------------ 4.1 feed_forward


def ffn_matmul(x, W1, b1, W2, b2):
    return torch.relu(x @ W1.T + b1) @ W2.T + b2


def ffn_functional(x, W1, b1, W2, b2):
    return F.linear(F.relu(F.linear(x, W1, b1)), W2, b2)


def ffn_einsum_clamp(x, W1, b1, W2, b2):
    hidden = torch.einsum("...d,fd->...f", x, W1) + b1
    return torch.einsum("...f,df->...d", hidden.clamp(min=0), W2) + b2


def ffn_row_loop(x, W1, b1, W2, b2):
    rows = x.reshape(-1, x.shape[-1])
    out = [W2 @ torch.maximum(W1 @ r + b1, torch.zeros(())) + b2 for r in rows]
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("fn", [ffn_matmul, ffn_functional, ffn_einsum_clamp, ffn_row_loop])
def test_feed_forward_accepts_correct_answers(fn, capsys):
    check_feed_forward(fn)
    assert "feed_forward is correct" in capsys.readouterr().out


FFN_WRONG = {
    "no activation": (lambda x, W1, b1, W2, b2: (x @ W1.T + b1) @ W2.T + b2, "no ReLU"),
    "relu on both layers": (
        lambda x, W1, b1, W2, b2: torch.relu(torch.relu(x @ W1.T + b1) @ W2.T + b2),
        "after the second layer as well"),
    "relu at the end": (
        lambda x, W1, b1, W2, b2: torch.relu((x @ W1.T + b1) @ W2.T + b2),
        "at the end instead of between"),
    "bias after relu": (
        lambda x, W1, b1, W2, b2: (torch.relu(x @ W1.T) + b1) @ W2.T + b2, "added b1 after"),
    "gelu": (lambda x, W1, b1, W2, b2: F.gelu(x @ W1.T + b1) @ W2.T + b2, "GELU"),
    "no b2": (lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T + b1) @ W2.T, "left out b2"),
    "no b1": (lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T) @ W2.T + b2, "left out b1"),
    # square-only mistakes: in the non-square cases they raise, and the check then reaches a
    # square case where the values expose them
    "biases swapped": (
        lambda x, W1, b1, W2, b2: torch.relu(x @ W1.T + b2) @ W2.T + b1
        if W1.shape[0] == W1.shape[1] else ffn_matmul(x, W1, b1, W2, b2),
        "swapped the biases"),
    "untransposed": (
        lambda x, W1, b1, W2, b2: torch.relu(x @ W1 + b1) @ W2 + b2
        if W1.shape[0] == W1.shape[1] else ffn_matmul(x, W1, b1, W2, b2),
        "untransposed"),
    "layers in the wrong order": (
        lambda x, W1, b1, W2, b2: torch.relu(x @ W2.T + b2) @ W1.T + b1
        if W1.shape[0] == W1.shape[1] else ffn_matmul(x, W1, b1, W2, b2),
        "wrong order"),
}


@pytest.mark.parametrize("name", list(FFN_WRONG))
def test_feed_forward_rejects_mistakes(name):
    fn, match = FFN_WRONG[name]
    with pytest.raises(CheckFailure, match=match):
        check_feed_forward(fn)


def test_feed_forward_untransposed_weights_fail_with_the_layout_hint():
    with pytest.raises(CheckFailure, match="nn.Linear's layout"):
        check_feed_forward(lambda x, W1, b1, W2, b2: torch.relu(x @ W1 + b1) @ W2 + b2)


def test_feed_forward_2d_only_code_gets_a_message_on_the_batched_case():
    def two_d_only(x, W1, b1, W2, b2):
        if x.dim() != 2:
            raise ValueError("expected a matrix")
        return ffn_matmul(x, W1, b1, W2, b2)

    with pytest.raises(CheckFailure, match="batched"):
        check_feed_forward(two_d_only)


def test_feed_forward_in_place_change_is_caught():
    def in_place(x, W1, b1, W2, b2):
        x.mul_(1.0)
        x[..., 0] = x[..., 0] + 1.0
        return ffn_matmul(x, W1, b1, W2, b2)

    with pytest.raises(CheckFailure, match="in place"):
        check_feed_forward(in_place)


def test_feed_forwardstub_propagates():
    with pytest.raises(NotImplementedError):
        check_feed_forward(stub)


# ------------------------------------------------------------------ 4.2 collapse_two_layers


def collapse_matmul(alpha1, alpha2, V1, V2):
    return alpha2 @ alpha1, V2 @ V1


def collapse_einsum(alpha1, alpha2, V1, V2):
    return torch.einsum("...ij,...jk->...ik", alpha2, alpha1), torch.einsum("ab,bc->ac", V2, V1)


def collapse_loops(alpha1, alpha2, V1, V2):
    T = alpha1.shape[-1]
    alpha_star = torch.zeros_like(alpha1)
    for i in range(T):
        for k in range(T):
            alpha_star[..., i, k] = (alpha2[..., i, :] * alpha1[..., :, k]).sum(-1)
    V_star = (V1.T @ V2.T).T  # (V2 V1)^T^T written the long way
    return [alpha_star, V_star]


@pytest.mark.parametrize("fn", [collapse_matmul, collapse_einsum, collapse_loops])
def test_collapse_accepts_correct_answers(fn, capsys):
    check_collapse_two_layers(fn)
    assert "collapse_two_layers is correct" in capsys.readouterr().out


COLLAPSE_WRONG = {
    "alpha order": (lambda a1, a2, V1, V2: (a1 @ a2, V2 @ V1), "wrong order"),
    "alpha transposed": (
        lambda a1, a2, V1, V2: ((a2 @ a1).transpose(-2, -1), V2 @ V1), "transposed"),
    "alpha elementwise": (lambda a1, a2, V1, V2: (a1 * a2, V2 @ V1), "elementwise"),
    "alpha2 only": (lambda a1, a2, V1, V2: (a2, V2 @ V1), "alpha1\\) is missing"),
    "V transposed": (lambda a1, a2, V1, V2: (a2 @ a1, (V2 @ V1).T), "V_star is transposed"),
    "V order, square only": (
        lambda a1, a2, V1, V2: (a2 @ a1, V1 @ V2 if V1.shape == V2.shape[::-1] == V1.shape[::-1]
                                else V2 @ V1),
        "V_star is V1 @ V2"),
    "V elementwise, square only": (
        lambda a1, a2, V1, V2: (a2 @ a1, V1 * V2 if V1.shape == V2.shape else V2 @ V1),
        "elementwise"),
    "swapped pair": (lambda a1, a2, V1, V2: (V2 @ V1, a2 @ a1), "order \\(alpha_star, V_star\\)"),
    "one value": (lambda a1, a2, V1, V2: a2 @ a1, "should return a pair"),
    "rescaled pair": (lambda a1, a2, V1, V2: (2 * a2 @ a1, V2 @ V1 / 2), "rows sum to 2"),
}


@pytest.mark.parametrize("name", list(COLLAPSE_WRONG))
def test_collapse_rejects_mistakes(name):
    fn, match = COLLAPSE_WRONG[name]
    with pytest.raises(CheckFailure, match=match):
        check_collapse_two_layers(fn)


def test_collapse_wrong_V_order_fails_with_the_order_hint_on_non_square_values():
    with pytest.raises(CheckFailure, match="V1 acts first"):
        check_collapse_two_layers(lambda a1, a2, V1, V2: (a2 @ a1, V1 @ V2))


def test_collapsestub_propagates():
    with pytest.raises(NotImplementedError):
        check_collapse_two_layers(stub)


# ------------------------------------------------------------------ 4.3 block_parameter_count


def count_by_parts(d_model, d_ff, bias=True):
    attention = 4 * d_model * d_model + (4 * d_model if bias else 0)
    ffn = 2 * d_model * d_ff + ((d_ff + d_model) if bias else 0)
    norms = 2 * (2 * d_model)
    return attention + ffn + norms


def count_by_shapes(d_model, d_ff, bias=True):
    shapes = [(3 * d_model, d_model), (d_model, d_model), (d_ff, d_model), (d_model, d_ff)]
    total = sum(a * b for a, b in shapes)
    if bias:
        total += 3 * d_model + d_model + d_ff + d_model
    return np.int64(total + 4 * d_model)  # numpy integers are accepted too


def count_by_building(d_model, d_ff, bias=True):
    return float(count_parameters(EncoderBlock(d_model, 1, d_ff, bias=bias)))


@pytest.mark.parametrize("fn", [count_by_parts, count_by_shapes, count_by_building])
def test_block_count_accepts_correct_answers(fn, capsys):
    check_block_parameter_count(fn)
    assert "block_parameter_count is correct" in capsys.readouterr().out


def _wrong(attention_mats=4, attention_bias=True, ffn_bias=True, ffn_mats=2, norms=2,
           norm_bias=True, ignore_bias_flag=False, d_ff_is_4d=False):
    def count(d_model, d_ff, bias=True):
        b = True if ignore_bias_flag else bias
        f = 4 * d_model if d_ff_is_4d else d_ff
        total = attention_mats * d_model * d_model + ffn_mats * d_model * f
        total += (attention_mats * d_model if b and attention_bias else 0)
        total += ((f + d_model) if b and ffn_bias else 0)
        total += norms * d_model * (2 if norm_bias else 1)
        return total

    return count


BLOCK_WRONG = {
    "no biases": (_wrong(attention_bias=False, ffn_bias=False), "left out the biases"),
    "no attention biases": (_wrong(attention_bias=False), "attention projections' biases"),
    "no FFN biases": (_wrong(ffn_bias=False), "feed-forward layers' biases"),
    "3 attention projections": (_wrong(attention_mats=3), "3 attention projections"),
    "no layer norms": (_wrong(norms=0), "left out the two LayerNorms"),
    "one layer norm": (_wrong(norms=1), "the block has two of\\s+them"),
    "gain-only layer norms, bias=True": (_wrong(norm_bias=False), "LayerNorm"),
    "one FFN matrix": (_wrong(ffn_mats=1), "only one of the FFN's two weight matrices"),
    "biases despite bias=False": (_wrong(ignore_bias_flag=True), "With bias=False"),
    "ignores d_ff": (_wrong(d_ff_is_4d=True), "d_ff = 4 \\* d_model instead"),
    "one attention matrix": (_wrong(attention_mats=1), "one d_model x d_model\\s+matrix"),
    "returns a string": (lambda d, f, bias=True: str(count_by_parts(d, f, bias)), "whole number"),
    "off by a constant": (lambda d, f, bias=True: count_by_parts(d, f, bias) + 7, "off by \\+7"),
    "no default for bias": (lambda d, f, bias: count_by_parts(d, f, bias), "give bias a default"),
    "bias default False": (lambda d, f, bias=False: count_by_parts(d, f, bias), "should default to True"),
}


@pytest.mark.parametrize("name", list(BLOCK_WRONG))
def test_block_count_rejects_mistakes(name):
    fn, match = BLOCK_WRONG[name]
    with pytest.raises(CheckFailure, match=match):
        check_block_parameter_count(fn)


def test_block_count_bias_false_dropping_layer_norm_shift_is_named():
    def no_shift_without_bias(d_model, d_ff, bias=True):
        return count_by_parts(d_model, d_ff, bias) - (0 if bias else 2 * d_model)

    with pytest.raises(CheckFailure, match="only removes the linear layers' biases"):
        check_block_parameter_count(no_shift_without_bias)


def test_block_countstub_propagates():
    with pytest.raises(NotImplementedError):
        check_block_parameter_count(stub)
