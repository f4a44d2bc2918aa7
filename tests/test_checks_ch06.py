"""The chapter 06 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib.attention import MultiHeadAttention, merge_heads, split_heads
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch06 import (
    check_ablated_output,
    check_cross_attention_flops,
    check_fixed_attention,
    check_merge_heads,
    check_multi_head_attention,
    check_scale_predictions,
    check_split_heads,
    heads_moved_by,
    measured_flops,
    measured_score_stats,
)
from course_lib.instruments.probes import ablate_heads

CHECKS = [check_split_heads, check_merge_heads, check_multi_head_attention,
          check_cross_attention_flops, check_ablated_output, check_scale_predictions]


@pytest.mark.parametrize("check", CHECKS)
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


@pytest.mark.parametrize("check", CHECKS)
def test_a_function_that_crashes_gets_a_check_failure(check):
    def crashes(*args):
        raise IndexError("oops")

    with pytest.raises(CheckFailure, match="raised IndexError"):
        check(crashes)


# ------------------------------------------------------------------------------ 6.1 split_heads


def split_view_transpose(x, n_heads):
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def split_permute(x, n_heads):
    return x.reshape(*x.shape[:2], n_heads, -1).permute(0, 2, 1, 3)


def split_loop(x, n_heads):
    dh = x.shape[-1] // n_heads
    return torch.stack([x[..., h * dh:(h + 1) * dh] for h in range(n_heads)], dim=1)


def split_chunk(x, n_heads):
    return torch.stack(x.chunk(n_heads, dim=-1), dim=1)


def split_unflatten(x, n_heads):
    return x.unflatten(-1, (n_heads, -1)).transpose(1, 2).contiguous()


@pytest.mark.parametrize("fn", [split_view_transpose, split_permute, split_loop, split_chunk,
                                split_unflatten])
def test_split_heads_accepts_correct_answers(fn, capsys):
    check_split_heads(fn)
    assert "split_heads is correct" in capsys.readouterr().out


def _split_in_place(x, n_heads):
    out = split_view_transpose(x, n_heads).clone()
    x.zero_()
    return out


WRONG_SPLIT = {
    "reshape without transpose": (
        lambda x, h: x.reshape(x.shape[0], h, x.shape[1], -1), "mix positions"),
    "view without transpose": (
        lambda x, h: x.view(x.shape[0], h, x.shape[1], x.shape[2] // h), "mix positions"),
    "no transpose at all": (lambda x, h: x.reshape(*x.shape[:2], h, -1),
                            r"\(B, T, H, Dh\).*transpose\(1, 2\)"),
    "interleaved": (lambda x, h: x.reshape(*x.shape[:2], -1, h).permute(0, 3, 1, 2),
                    "every H-th feature"),
    "features and positions swapped": (
        lambda x, h: x.reshape(*x.shape[:2], h, -1).permute(0, 2, 3, 1), r"\(B, H, Dh, T\)"),
    "transpose first": (lambda x, h: x.transpose(1, 2).reshape(x.shape[0], h, x.shape[1], -1),
                        "Reshape first"),
    "unbatched result": (lambda x, h: split_view_transpose(x, h)[0], "shape"),
    "a list of heads": (lambda x, h: list(split_view_transpose(x, h).unbind(1)),
                        "should be a tensor"),
    "changes x in place": (_split_in_place, "in place"),
}


@pytest.mark.parametrize("name", list(WRONG_SPLIT))
def test_split_heads_rejects_wrong_answers(name):
    fn, message = WRONG_SPLIT[name]
    with pytest.raises(CheckFailure, match=message):
        check_split_heads(fn)


# ------------------------------------------------------------------------------ 6.2 merge_heads


def merge_transpose(x):
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


def merge_cat(x):
    return torch.cat(list(x.unbind(1)), dim=-1)


def merge_loop(x):
    return torch.cat([x[:, h] for h in range(x.shape[1])], dim=-1)


def merge_flatten(x):
    return x.permute(0, 2, 1, 3).flatten(2)


@pytest.mark.parametrize("fn", [merge_transpose, merge_cat, merge_loop, merge_flatten])
def test_merge_heads_accepts_correct_answers(fn, capsys):
    check_merge_heads(fn)
    assert "merge_heads is correct" in capsys.readouterr().out


WRONG_MERGE = {
    "reshape without transpose": (
        lambda x: x.reshape(x.shape[0], x.shape[2], -1), "mixes positions"),
    "interleaved": (lambda x: x.permute(0, 2, 3, 1).reshape(x.shape[0], x.shape[2], -1),
                    "interleaves"),
    "sum of heads": (lambda x: x.sum(1), "added"),
    "mean of heads": (lambda x: x.mean(1), "averaged"),
    "along the positions": (lambda x: torch.cat(list(x.unbind(1)), dim=1), "along the positions"),
    "not flattened": (lambda x: x.transpose(1, 2), "flatten the last two"),
    "returns the input": (lambda x: x, "shape"),
}


@pytest.mark.parametrize("name", list(WRONG_MERGE))
def test_merge_heads_rejects_wrong_answers(name):
    fn, message = WRONG_MERGE[name]
    with pytest.raises(CheckFailure, match=message):
        check_merge_heads(fn)


# ------------------------------------------------------------------- 6.3 multi_head_attention


def mha_split(x, W_q, W_k, W_v, W_o, n_heads):
    b, t, _ = x.shape
    q, k, v = ((x @ w.T).view(b, t, n_heads, -1).transpose(1, 2) for w in (W_q, W_k, W_v))
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(b, t, -1)
    return out @ W_o.T


def mha_list_of_heads(x, W_q, W_k, W_v, W_o, n_heads):
    d_k, d_v = W_q.shape[0] // n_heads, W_v.shape[0] // n_heads
    heads = []
    for h in range(n_heads):
        q = x @ W_q[h * d_k:(h + 1) * d_k].T
        k = x @ W_k[h * d_k:(h + 1) * d_k].T
        v = x @ W_v[h * d_v:(h + 1) * d_v].T
        scores = q @ k.transpose(-2, -1) / d_k ** 0.5
        heads.append(torch.softmax(scores, dim=-1) @ v)
    return torch.cat(heads, dim=-1) @ W_o.T


def mha_einsum_per_head_w_o(x, W_q, W_k, W_v, W_o, n_heads):
    d = x.shape[-1]
    wq, wk, wv = (w.view(n_heads, -1, d) for w in (W_q, W_k, W_v))
    q = torch.einsum("btd,hed->bhte", x, wq)
    k = torch.einsum("btd,hed->bhte", x, wk)
    v = torch.einsum("btd,hfd->bhtf", x, wv)
    weights = torch.einsum("bhte,bhse->bhts", q, k).div(math.sqrt(wq.shape[1])).softmax(-1)
    heads = torch.einsum("bhts,bhsf->bhtf", weights, v)
    w_o = W_o.view(d, n_heads, -1)  # W_o^(h) = W_o[:, h*d_v:(h+1)*d_v]
    return torch.einsum("bhtf,dhf->btd", heads, w_o)  # a sum over heads


def mha_sdpa(x, W_q, W_k, W_v, W_o, n_heads):
    b, t, _ = x.shape
    q, k, v = (F.linear(x, w).view(b, t, n_heads, -1).transpose(1, 2) for w in (W_q, W_k, W_v))
    out = F.scaled_dot_product_attention(q, k, v)  # torch's own, with v's width its own
    return F.linear(out.transpose(1, 2).flatten(2), W_o)


def mha_float64(x, W_q, W_k, W_v, W_o, n_heads):
    args = [a.double() for a in (x, W_q, W_k, W_v, W_o)]
    return mha_split(*args, n_heads).float()


def mha_numpy_heads(x, W_q, W_k, W_v, W_o, n_heads):
    # the number of heads arrives as a numpy integer in a learner's own experiments
    return mha_split(x, W_q, W_k, W_v, W_o, int(np.int64(n_heads)))


@pytest.mark.parametrize("fn", [mha_split, mha_list_of_heads, mha_einsum_per_head_w_o, mha_sdpa,
                                mha_float64, mha_numpy_heads])
def test_multi_head_attention_accepts_correct_answers(fn, capsys):
    check_multi_head_attention(fn)
    assert "multi_head_attention is correct" in capsys.readouterr().out


def test_the_reference_is_torchs_sdpa_and_nn_multihead_attention():
    from course_lib.course.checks.ch06 import _mha_cases, reference_multi_head_attention

    for case in _mha_cases(seed=63):
        torch.testing.assert_close(reference_multi_head_attention(*case.args),
                                   mha_sdpa(*case.args), atol=1e-5, rtol=1e-4)
    # with d_k = d_v = D / H it is nn.MultiheadAttention without biases
    torch.manual_seed(0)
    layer = nn.MultiheadAttention(12, 3, bias=False, batch_first=True).eval()
    x = torch.randn(2, 5, 12)
    W_q, W_k, W_v = layer.in_proj_weight.detach().chunk(3)
    with torch.no_grad():
        expected = layer(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(
        reference_multi_head_attention(x, W_q, W_k, W_v, layer.out_proj.weight.detach(), 3),
        expected, atol=1e-5, rtol=1e-4)


def _mha_variant(*, scale="head", split="right", use_w_o=True, transpose=True, softmax_dim=-1,
                 one_head=False, d_head_from_d_model=False):
    def fn(x, W_q, W_k, W_v, W_o, n_heads):
        b, t, d = x.shape
        h = 1 if one_head else n_heads
        tr = (lambda w: w.T) if transpose else (lambda w: w)

        def to_heads(y):
            width = d // h if d_head_from_d_model else y.shape[-1] // h
            if split == "mixing":
                return y.reshape(b, h, t, width)
            if split == "interleaved":
                return y.reshape(b, t, width, h).permute(0, 3, 1, 2)
            return y.reshape(b, t, h, width).transpose(1, 2)

        def from_heads(y):
            if split in ("mixing", "merge_mixing"):
                return y.reshape(b, t, -1)
            if split == "interleaved":
                return y.permute(0, 2, 3, 1).reshape(b, t, -1)
            return y.transpose(1, 2).reshape(b, t, -1)

        q, k, v = (to_heads(x @ tr(w)) for w in (W_q, W_k, W_v))
        d_k, d_v = q.shape[-1], v.shape[-1]
        divisor = {"head": math.sqrt(d_k), "value": math.sqrt(d_v), "model": math.sqrt(d),
                   "none": 1.0, "d_head": d_k}[scale]
        out = from_heads(torch.softmax(q @ k.transpose(-2, -1) / divisor, dim=softmax_dim) @ v)
        return out @ tr(W_o) if use_w_o else out

    return fn


WRONG_MHA = {
    "scaled by sqrt(d_v)": (_mha_variant(scale="value"), r"sqrt\(d_v\).*sqrt\(d_k\)"),
    "scaled by sqrt(d_model)": (_mha_variant(scale="model"), r"sqrt\(d_model\).*sqrt\(d_k\)"),
    "scaled by d_k": (_mha_variant(scale="d_head"), "by d_k itself"),
    "not scaled": (_mha_variant(scale="none"), "not scaled"),
    "no W_o": (_mha_variant(use_w_o=False), "without the output projection"),
    "reshape without transpose": (_mha_variant(split="mixing"), "mix positions"),
    "merge without transpose": (_mha_variant(split="merge_mixing"), "your merge mixes"),
    "interleaved heads": (_mha_variant(split="interleaved"), "every H-th feature"),
    "weights not transposed": (_mha_variant(transpose=False), r"(?s)raised RuntimeError.*d_k and d_v"),
    "one head of all widths": (_mha_variant(one_head=True), "single head as wide"),
    "softmax over queries": (_mha_variant(softmax_dim=-2), "over the queries"),
    "head width D / H for the values too": (_mha_variant(d_head_from_d_model=True),
                                            r"(?s)raised RuntimeError.*not\s+from D"),
    "returns (out, weights)": (lambda *a: (mha_split(*a), None), "not a tuple"),
    "mean over the heads instead of W_o": (
        lambda x, W_q, W_k, W_v, W_o, h: mha_split(x, W_q, W_k, W_v,
                                                   torch.eye(W_v.shape[0]), h)
        .view(*x.shape[:2], h, -1).mean(2), "shape"),
}


@pytest.mark.parametrize("name", list(WRONG_MHA))
def test_multi_head_attention_rejects_wrong_answers(name):
    fn, message = WRONG_MHA[name]
    with pytest.raises(CheckFailure, match=message):
        check_multi_head_attention(fn)


def test_dividing_by_d_k_is_not_reported_as_dividing_by_sqrt_d_model():
    with pytest.raises(CheckFailure) as failure:
        check_multi_head_attention(_mha_variant(scale="d_head"))
    assert "sqrt(d_model)" not in str(failure.value)


def test_an_unrecognised_mistake_gets_no_planted_explanation():
    def off(x, W_q, W_k, W_v, W_o, n_heads):
        return mha_split(x, W_q, W_k, W_v, W_o, n_heads) * 1.01  # wrong, but no listed mistake

    with pytest.raises(CheckFailure) as failure:
        check_multi_head_attention(off)
    message = str(failure.value)
    assert "wrong values" in message and "case 'B=2, T=5, D=12, H=3, d_k=4, d_v=9'" in message
    for planted in ("sqrt", "transpose", "W_o", "softmax"):
        assert planted not in message


def test_the_multi_head_cases_tell_the_widths_apart():
    from course_lib.course.checks.ch06 import _mha_cases

    names = [case.name for case in _mha_cases(seed=63)]
    distinct = 0
    for case in _mha_cases(seed=63):
        x, W_q, _, W_v, _, n_heads = case.args
        d_k, d_v = W_q.shape[0] // n_heads, W_v.shape[0] // n_heads
        distinct += len({math.sqrt(d_k), math.sqrt(d_v), math.sqrt(x.shape[-1]), d_k}) == 4
    assert distinct >= 3, names


# ------------------------------------------------------------------ 6.4 cross_attention_flops


def flops_formula(batch, seq_len, context_len, d_model, n_heads):
    return (4 * batch * seq_len * d_model**2 + 4 * batch * context_len * d_model**2
            + 4 * batch * seq_len * context_len * d_model)


def flops_per_head(batch, seq_len, context_len, d_model, n_heads):
    d_head = d_model // n_heads
    total = 0
    for _ in range(n_heads):
        total += 2 * batch * seq_len * d_model * d_head  # this head's queries
        total += 2 * 2 * batch * context_len * d_model * d_head  # its keys and values
        total += 2 * batch * seq_len * d_head * context_len  # q k^T
        total += 2 * batch * seq_len * context_len * d_head  # weights @ v
    return total + 2 * batch * seq_len * d_model * d_model  # W_o


def flops_counted_by_hand(batch, seq_len, context_len, d_model, n_heads):
    with torch.device("meta"):
        x = torch.empty(batch, seq_len, d_model)
        context = torch.empty(batch, context_len, d_model)
        w_q, w_k, w_v, w_o = (torch.empty(d_model, d_model) for _ in range(4))
    with FlopCounterMode(display=False) as counter:
        q = (x @ w_q.T).view(batch, seq_len, n_heads, -1).transpose(1, 2)
        k = (context @ w_k.T).view(batch, context_len, n_heads, -1).transpose(1, 2)
        v = (context @ w_v.T).view(batch, context_len, n_heads, -1).transpose(1, 2)
        heads = (q @ k.transpose(-2, -1)).softmax(-1) @ v
        heads.transpose(1, 2).reshape(batch, seq_len, d_model) @ w_o.T
    return counter.get_total_flops()


def flops_of_torch_mha(batch, seq_len, context_len, d_model, n_heads):
    """torch.nn.MultiheadAttention as cross-attention, counted by FlopCounterMode."""
    with torch.device("meta"):
        layer = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        x = torch.empty(batch, seq_len, d_model)
        context = torch.empty(batch, context_len, d_model)
    with FlopCounterMode(display=False) as counter:
        layer(x, context, context, need_weights=True)
    return counter.get_total_flops()


def flops_float(*args):
    return float(flops_formula(*args))


def flops_tensor(*args):
    return torch.tensor(flops_formula(*args))


def flops_numpy_int(*args):
    return np.int64(flops_formula(*args))


@pytest.mark.parametrize("fn", [flops_formula, flops_per_head, flops_counted_by_hand,
                                flops_of_torch_mha, flops_numpy_int])
def test_cross_attention_flops_accepts_correct_answers(fn, capsys):
    check_cross_attention_flops(fn)
    assert "cross_attention_flops is correct" in capsys.readouterr().out


@pytest.mark.parametrize("args", [(2, 10, 30, 64, 4), (1, 1, 1, 8, 2), (3, 17, 5, 96, 96)])
def test_the_reference_count_is_the_formula_and_torchs_count(args):
    assert measured_flops(*args) == flops_formula(*args) == flops_of_torch_mha(*args)


def _plus(extra):
    return lambda b, t, s, d, h: flops_formula(b, t, s, d, h) + extra(b, t, s, d, h)


def _self_attention_formula(b, t, s, d, h):
    return 8 * b * t * d * d + 4 * b * t * t * d


WRONG_FLOPS = {
    "multiply-adds": (lambda *a: flops_formula(*a) // 2, "multiply-adds"),
    "self-attention on x": (_self_attention_formula, "self-attention on x"),
    "keys and values from x": (
        lambda b, t, s, d, h: 8 * b * t * d * d + 4 * b * t * s * d,
        "projected keys and values from the T positions"),
    "T x T scores": (lambda b, t, s, d, h: 4 * b * t * d * d + 4 * b * s * d * d
                     + 4 * b * t * t * d, "compare the T queries with T keys"),
    "no W_o": (lambda b, t, s, d, h: flops_formula(b, t, s, d, h) - 2 * b * t * d * d,
               "output projection W_o"),
    "projections only": (lambda b, t, s, d, h: 4 * b * (t + s) * d * d,
                         "only the four projections"),
    "no weights @ v": (lambda b, t, s, d, h: flops_formula(b, t, s, d, h) - 2 * b * t * s * d,
                       "one attention product per head"),
    "attention times H": (_plus(lambda b, t, s, d, h: 4 * b * t * s * d * (h - 1)),
                          "grow with the number of heads"),
    "one head's attention": (
        lambda b, t, s, d, h: 4 * b * (t + s) * d * d + 4 * b * t * s * (d // h),
        "one head only"),
    "projections times H": (_plus(lambda b, t, s, d, h: 4 * b * (t + s) * d * d * (h - 1)),
                            "projections grow"),
    "no batch": (lambda b, t, s, d, h: flops_formula(1, t, s, d, h), "ignores the batch"),
    "bias additions counted": (_plus(lambda b, t, s, d, h: 2 * b * t * d + 2 * b * s * d),
                               "bias additions"),
    "softmax counted": (_plus(lambda b, t, s, d, h: 5 * b * h * t * s), "work done on each score"),
    "scaling counted": (_plus(lambda b, t, s, d, h: b * h * t * s), "work done on each score"),
    "masking counted, once per score of all heads": (
        _plus(lambda b, t, s, d, h: b * t * s), "work done on each score"),
    "bias and softmax counted": (
        _plus(lambda b, t, s, d, h: 2 * b * (t + s) * d + 3 * b * h * t * s),
        r"(?s)bias additions.*work done on each score"),
    "attention products three times": (
        _plus(lambda b, t, s, d, h: 8 * b * t * s * d),
        r"attention products, which pair.*you count 691,200 FLOPs, FlopCounterMode 230,400"),
    "key and value projections 1.5 times": (
        _plus(lambda b, t, s, d, h: 2 * b * s * d * d), r"S positions of the context alone.*"
        r"you count 2,211,840 FLOPs, FlopCounterMode 1,474,560"),
    "a constant added": (_plus(lambda *a: 7), "neither T nor S: you count 7 FLOPs"),
    "T x T scores and bias": (
        lambda b, t, s, d, h: _self_attention_formula(b, t, s, d, h) - 4 * b * t * d * d
        + 4 * b * s * d * d + 2 * b * t * d, "grows faster than in proportion to T"),
    "a string": (lambda *a: f"{flops_formula(*a)}", "return an int"),
    "nothing returned": (lambda *a: None, "return an int"),
    "the right count as a float": (flops_float, r"return an int.*a float.*// rather than /"),
    "the right count as a 0-d tensor": (flops_tensor, r"return an int.*tensor.*\.item\(\)"),
    "a bool": (lambda *a: True, "return an int"),
}


@pytest.mark.parametrize("name", list(WRONG_FLOPS))
def test_cross_attention_flops_rejects_wrong_answers(name):
    fn, message = WRONG_FLOPS[name]
    with pytest.raises(CheckFailure, match=message):
        check_cross_attention_flops(fn)


@pytest.mark.parametrize("name", ["attention products three times",
                                  "key and value projections 1.5 times", "a constant added"])
def test_the_fallback_names_the_part_that_is_off_not_the_formula(name):
    with pytest.raises(CheckFailure) as failure:
        check_cross_attention_flops(WRONG_FLOPS[name][0])
    message = str(failure.value)
    assert "2 * B" not in message and "D * D" not in message and "T * S" not in message
    assert message.count("\n  - ") == 1  # exactly one part is named


def test_a_function_that_fails_only_when_t_doubles_is_reported_as_such():
    def crashes_on_long_inputs(b, t, s, d, h):
        if t > 10:
            raise ValueError("too long")
        return flops_formula(b, t, s, d, h) + 1

    with pytest.raises(CheckFailure, match="raised ValueError on the case .*with T or S changed"):
        check_cross_attention_flops(crashes_on_long_inputs)


# ------------------------------------------------------------------------- 6.5 ablated_output


def ablate_with_a_hook(attention, x, heads):
    dh = attention.d_head

    def hook(module, args):
        concat = args[0].clone()
        for h in heads:
            concat[..., h * dh:(h + 1) * dh] = 0.0
        return (concat,)

    handle = attention.out_proj.register_forward_pre_hook(hook)
    try:
        return attention(x)[0]
    finally:
        handle.remove()


def ablate_by_hand(attention, x, heads):
    b, t, d = x.shape
    q, k, v = attention.qkv_proj(x).chunk(3, dim=-1)
    q, k, v = (y.view(b, t, attention.n_heads, -1).transpose(1, 2) for y in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
    keep = torch.ones(attention.n_heads, 1, 1)
    keep[list(heads)] = 0.0
    return attention.out_proj((out * keep).transpose(1, 2).reshape(b, t, d))


def ablate_w_o_columns_of_a_copy(attention, x, heads):
    layer = copy.deepcopy(attention)
    dh = layer.d_head
    with torch.no_grad():
        for h in heads:
            layer.out_proj.weight[:, h * dh:(h + 1) * dh] = 0.0
    return layer(x)[0]


def ablate_values_and_their_bias_of_a_copy(attention, x, heads):
    """A head whose values are all 0 outputs 0: also a correct ablation."""
    layer = copy.deepcopy(attention)
    d, dh = layer.d_model, layer.d_head
    with torch.no_grad():
        for h in heads:
            layer.qkv_proj.weight[2 * d + h * dh:2 * d + (h + 1) * dh] = 0.0
            layer.qkv_proj.bias[2 * d + h * dh:2 * d + (h + 1) * dh] = 0.0
    return layer(x)[0]


def ablate_with_the_library(attention, x, heads):
    with ablate_heads(attention, heads):
        return attention(x)[0]


@pytest.mark.parametrize("fn", [ablate_with_a_hook, ablate_by_hand, ablate_w_o_columns_of_a_copy,
                                ablate_values_and_their_bias_of_a_copy, ablate_with_the_library])
def test_ablated_output_accepts_correct_answers(fn, capsys):
    check_ablated_output(fn)
    assert "ablated_output is correct" in capsys.readouterr().out


def _zero_rows_of_a_copy(part, bias):
    def fn(attention, x, heads):
        layer = copy.deepcopy(attention)
        d, dh = layer.d_model, layer.d_head
        with torch.no_grad():
            for h in heads:
                rows = slice(part * d + h * dh, part * d + (h + 1) * dh)
                layer.qkv_proj.weight[rows] = 0.0
                if bias:
                    layer.qkv_proj.bias[rows] = 0.0
        return layer(x)[0]

    return fn


def _from_concat(select, *, bias=True, scale=False):
    def fn(attention, x, heads):
        seen = []
        handle = attention.out_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        attention(x)
        handle.remove()
        concat = seen[0]
        keep = select(attention, heads)
        concat = concat * keep
        if scale and keep.any():
            concat = concat * keep.numel() / keep.sum()
        out = concat @ attention.out_proj.weight.T
        return out + attention.out_proj.bias if bias else out

    return fn


def _contiguous(attention, heads):
    keep = torch.ones(attention.d_model)
    for h in heads:
        keep[h * attention.d_head:(h + 1) * attention.d_head] = 0.0
    return keep


def _interleaved(attention, heads):
    keep = torch.ones(attention.d_model)
    for h in heads:
        keep[h::attention.n_heads] = 0.0
    return keep


def _output_slice_zeroed(attention, x, heads):
    return attention(x)[0] * _contiguous(attention, heads)


def _hook_left_behind(attention, x, heads):
    dh = attention.d_head

    def hook(module, args):
        concat = args[0].clone()
        for h in heads:
            concat[..., h * dh:(h + 1) * dh] = 0.0
        return (concat,)

    attention.out_proj.register_forward_pre_hook(hook)
    return attention(x)[0]


def _weights_changed_in_place(attention, x, heads):
    dh = attention.d_head
    with torch.no_grad():
        for h in heads:
            attention.out_proj.weight[:, h * dh:(h + 1) * dh] = 0.0
    return attention(x)[0]


WRONG_ABLATION = {
    "after W_o": (_output_slice_zeroed, "after W_o"),
    "queries zeroed": (_zero_rows_of_a_copy(0, bias=True), "queries does not switch it off"),
    "value weights only": (_zero_rows_of_a_copy(2, bias=False), "not of the value bias"),
    "bias of W_o dropped": (_from_concat(_contiguous, bias=False), "dropped W_o's bias"),
    "complement": (_from_concat(lambda a, h: 1.0 - _contiguous(a, h)), "other way round"),
    "interleaved": (_from_concat(_interleaved), "every H-th feature"),
    "rescaled": (_from_concat(_contiguous, scale=True), "scaled the remaining heads"),
    "nothing ablated": (lambda attention, x, heads: attention(x)[0], "wrong values"),
    "returns (out, weights)": (lambda attention, x, heads: attention(x), "not a tuple"),
    "hook left registered": (_hook_left_behind, "left a hook"),
    "weights changed in place": (_weights_changed_in_place, "changed the layer's parameters"),
}


@pytest.mark.parametrize("name", list(WRONG_ABLATION))
def test_ablated_output_rejects_wrong_answers(name):
    fn, message = WRONG_ABLATION[name]
    with pytest.raises(CheckFailure, match=message):
        check_ablated_output(fn)


def test_the_checks_leave_the_learners_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_ablated_output(ablate_with_the_library)
    check_multi_head_attention(mha_split)
    check_cross_attention_flops(flops_formula)
    assert torch.equal(torch.rand(3), expected)


def test_the_new_checks_leave_the_learners_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_fixed_attention(FixedWithSdpa)
    with pytest.raises(CheckFailure):
        check_fixed_attention(SuspectAttention)  # the diagnosis runs the instruments too
    check_scale_predictions(lambda: (1 / 9, 2))
    assert torch.equal(torch.rand(3), expected)


def test_the_ablation_layers_are_not_changed_by_the_check():
    layer = MultiHeadAttention(16, 4)
    before = copy.deepcopy(layer.state_dict())
    ablate_with_the_library(layer, torch.randn(1, 2, 16), [0])
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())


# ------------------------------------------------------------- 6.1 FixedAttention (find the bug)


class SuspectAttention(nn.Module):
    """The exercise's layer, with its planted mistake: the heads merged as (B, T, Dh, H)."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        q, k, v = (y.reshape(b, t, self.n_heads, self.d_head).transpose(1, 2) for y in (q, k, v))
        heads = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.d_head), dim=-1) @ v
        return self.out_proj(heads.permute(0, 2, 3, 1).reshape(b, t, d))


def _repaired(*, split="right", merge="right", scale="head", softmax_dim=-1, use_out=True,
              returns_tuple=False):
    class Repaired(SuspectAttention):
        def forward(self, x):
            b, t, d = x.shape
            h, dh = self.n_heads, self.d_head
            q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
            to_heads = {
                "right": lambda y: y.reshape(b, t, h, dh).transpose(1, 2),
                "mixing": lambda y: y.reshape(b, h, t, dh),
                "interleaved": lambda y: y.reshape(b, t, dh, h).permute(0, 3, 1, 2),
            }[split]
            q, k, v = (to_heads(y) for y in (q, k, v))
            divisor = {"head": math.sqrt(dh), "model": math.sqrt(d)}[scale]
            heads = torch.softmax(q @ k.transpose(-2, -1) / divisor, dim=softmax_dim) @ v
            from_heads = {
                "right": lambda y: y.transpose(1, 2).reshape(b, t, d),
                "mixing": lambda y: y.reshape(b, t, d),
                "interleaved": lambda y: y.permute(0, 2, 3, 1).reshape(b, t, d),
            }[merge]
            out = self.out_proj(from_heads(heads)) if use_out else from_heads(heads)
            return (out, None) if returns_tuple else out

    return Repaired


class FixedWithSdpa(SuspectAttention):
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.n_heads, -1).transpose(1, 2)
                   for y in self.qkv_proj(x).split(d, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class FixedWithALoop(SuspectAttention):
    def forward(self, x):
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        dh = self.d_head
        heads = []
        for h in range(self.n_heads):
            cols = slice(h * dh, (h + 1) * dh)
            scores = q[..., cols] @ k[..., cols].transpose(-2, -1) / dh ** 0.5
            heads.append(torch.softmax(scores, dim=-1) @ v[..., cols])
        return self.out_proj(torch.cat(heads, dim=-1))


class FixedWithTheLibrary(SuspectAttention):
    def forward(self, x):
        q, k, v = (split_heads(y, self.n_heads) for y in self.qkv_proj(x).chunk(3, dim=-1))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(self.d_head), dim=-1)
        return self.out_proj(merge_heads(weights @ v))


class FixedWithEinsum(SuspectAttention):
    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.unflatten(-1, (self.n_heads, -1)) for y in self.qkv_proj(x).chunk(3, -1))
        scores = torch.einsum("bthe,bshe->bhts", q, k) / math.sqrt(self.d_head)
        heads = torch.einsum("bhts,bshe->bthe", scores.softmax(-1), v)
        return self.out_proj(heads.reshape(b, t, d))


@pytest.mark.parametrize("cls", [_repaired(), FixedWithSdpa, FixedWithALoop,
                                 FixedWithTheLibrary, FixedWithEinsum])
def test_fixed_attention_accepts_correct_repairs(cls, capsys):
    check_fixed_attention(cls)
    assert "equals nn.MultiheadAttention with the same weights" in capsys.readouterr().out


class StubbedRepair(SuspectAttention):
    def forward(self, x):
        raise NotImplementedError("Exercise: write the body")


class CrashingRepair(SuspectAttention):
    def forward(self, x):
        raise IndexError("oops")


def test_fixed_attention_lets_an_unsolved_stub_fail_as_itself():
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_fixed_attention(StubbedRepair)


def test_fixed_attention_reports_a_crash():
    with pytest.raises(CheckFailure, match="raised IndexError"):
        check_fixed_attention(CrashingRepair)


def _x_in_place(cls):
    class InPlace(cls):
        def forward(self, x):
            out = super().forward(x)
            x.mul_(2.0)
            return out

    return InPlace


class NewInit(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.attention = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x)[0]


WRONG_REPAIR = {
    "the suspect unchanged": (SuspectAttention,
                              r"heads-apart property test finds the mistake.*interleaves"),
    "split and merge both mixing": (_repaired(split="mixing", merge="mixing"), "who_sees_whom"),
    "interleaved heads": (_repaired(split="interleaved", merge="interleaved"),
                          "heads-apart property test"),
    "merge mixes positions": (_repaired(merge="mixing"), "Your merge mixes positions"),
    "the lecture's split bug": (_repaired(split="mixing"),
                                "heads-apart property test finds the cause"),
    "interleaved split only": (_repaired(split="interleaved"),
                               "heads-apart property test finds the cause"),
    "scaled by sqrt(d_model)": (_repaired(scale="model"), r"sqrt\(d_model\)"),
    "softmax over the queries": (_repaired(softmax_dim=-2), "over the queries"),
    "no output projection": (_repaired(use_out=False), "output projection"),
    "returns (out, None)": (_repaired(returns_tuple=True), "not a tuple"),
    "changes x in place": (_x_in_place(_repaired()), "in place"),
    "an instance instead of the class": (_repaired()(12, 3), "pass the class itself"),
    "a new __init__": (NewInit, "keep the __init__"),
}


@pytest.mark.parametrize("name", list(WRONG_REPAIR))
def test_fixed_attention_rejects_wrong_repairs(name):
    cls, message = WRONG_REPAIR[name]
    with pytest.raises(CheckFailure, match=message):
        check_fixed_attention(cls)


@pytest.mark.parametrize("name", ["the suspect unchanged", "split and merge both mixing",
                                  "interleaved heads", "merge mixes positions",
                                  "scaled by sqrt(d_model)", "no output projection"])
def test_a_wrong_repair_is_told_which_instrument_finds_it(name):
    with pytest.raises(CheckFailure) as failure:
        check_fixed_attention(WRONG_REPAIR[name][0])
    message = str(failure.value)
    assert any(tool in message for tool in ("who_sees_whom", "heads-apart property test",
                                            "comparing with nn.MultiheadAttention"))


def test_heads_apart_holds_for_a_correct_layer_and_fails_for_the_suspect():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 12)
    good, bad = _repaired()(12, 3).eval(), SuspectAttention(12, 3).eval()
    assert [heads_moved_by(good, x, h, 3) for h in range(3)] == [[0], [1], [2]]
    assert heads_moved_by(bad, x, 0, 3) != [0]


# ------------------------------------------------------------ 6.2 predictions (predict, verify)


@pytest.mark.parametrize("answer", [(1 / 9, 2.0), (36 * (1 / 3) ** 2 / 36, math.sqrt(4)),
                                    [0.111, 2.0], (np.float32(1 / 9), np.float64(2)),
                                    (0.11, 2.01), (1 / 9, 2), (1 / 9, np.int64(2)),
                                    (Fraction(1, 9), 2)],
                         ids=["floats", "computed", "a list", "numpy floats", "rounded",
                              "an int divisor", "a numpy int divisor", "a fraction and an int"])
def test_scale_predictions_accepts_the_right_numbers(answer, capsys):
    check_scale_predictions(lambda: answer)
    out = capsys.readouterr().out
    assert "predictions hold" in out and "score variance 0.11" in out
    assert "1.00 with divisor 2" in out or "0.99 with divisor 2" in out


WRONG_PREDICTIONS = {
    "the lecture's 1": ((1.0, 2.0), "lecture's answer"),
    "one entry's 1/3": ((1 / 3, 2.0), "one entry of q"),
    "before the division": ((4.0, 2.0), "before the layer divides"),
    "uniform a^2/12": ((1 / 144, 2.0), r"a\^2 / 3"),
    "summed over D": ((16 / 9, 2.0), "all 576 features"),
    "divided too soon": ((1 / 324, 2.0), r"first\s+sums 36"),
    "sqrt(Dh) kept": ((1 / 9, 6.0), "layer's divisor"),
    "the factor": ((1 / 9, 1 / 3), "the divisor itself"),
    "the variance as divisor": ((1 / 9, 4.0), "standard deviation"),
    "sqrt(d_model)": ((1 / 9, 24.0), "width d_model"),
    "Dh / 3": ((1 / 9, 12.0), "Dh / 3"),
    "no divisor": ((1 / 9, 1), "Without a divisor"),
    "a number from nowhere": ((3.0, 2.0), "does not match the setting"),
    "a divisor from nowhere": ((1 / 9, 7.0), "does not match the setting"),
    "one number": (1 / 9, "two numbers"),
    "nothing": (None, "two numbers"),
    "three numbers": ((1 / 9, 2.0, 1.0), "two numbers"),
    "a str divisor": ((1 / 9, "2"), r"the divisor should be a number.*an int or a float"),
    "0-d tensors": ((torch.tensor(1 / 9), torch.tensor(2.0)),
                    r"the predicted variance should be.*\.item\(\)"),
    "a bool": ((True, 2.0), "should be a number"),
    "an int variance that is wrong": ((1, 2), "lecture's answer"),
}


@pytest.mark.parametrize("name", list(WRONG_PREDICTIONS))
def test_scale_predictions_rejects_wrong_numbers(name):
    answer, message = WRONG_PREDICTIONS[name]
    with pytest.raises(CheckFailure, match=message):
        check_scale_predictions(lambda: answer)


@pytest.mark.parametrize("seed", [62, 0, 1])
def test_the_measurement_agrees_with_the_prediction(seed):
    var_6, entropy_6 = measured_score_stats(6.0, seed=seed)
    var_2, entropy_2 = measured_score_stats(2.0, seed=seed)
    assert abs(var_6 - 1 / 9) < 0.01 and abs(var_2 - 1.0) < 0.06
    assert entropy_2 < entropy_6 < math.log(64)


def test_the_measurement_builds_the_layer_it_describes():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = MultiHeadAttention(576, 16)
    bound, weight = 1 / math.sqrt(576), layer.qkv_proj.weight.detach()
    assert layer.d_head == 36 and float(weight.abs().max()) <= bound
    assert abs(float(weight.var()) - bound ** 2 / 3) < 1e-5


def test_fixed_attention_that_cannot_be_built_is_named():
    class Broken(nn.Module):
        def __init__(self, d_model, n_heads):
            raise ValueError("boom")

    with pytest.raises(CheckFailure, match="Broken raised ValueError on the case 'building"):
        check_fixed_attention(Broken)
