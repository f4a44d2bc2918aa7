"""The chapter 05 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import stub
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from course_lib import attention
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch05 import (
    bidirectional_in_example_0,
    causal_layer,
    causal_with_rounding_noise,
    check_causal_mask,
    check_fixed_padded_attention,
    check_masked_attention,
    check_padding_mask,
    check_tiny_lm,
    check_who_sees_whom,
    feature_0_sees_next,
    off_by_one_layer,
    previous_token,
)


@pytest.mark.parametrize("check", [check_causal_mask, check_masked_attention, check_padding_mask,
                                   check_who_sees_whom, check_fixed_padded_attention])
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


# ------------------------------------------------------------------------------ 5.1 causal_mask


def causal_tril(t, s):
    return torch.tril(torch.ones(t, s, dtype=torch.bool), diagonal=s - t)


def causal_aranges(t, s):
    queries = torch.arange(s - t, s)  # the absolute positions of the new queries
    return torch.arange(s)[None, :] <= queries[:, None]  # key j <= query's position


def causal_loop(t, s):
    mask = torch.zeros(t, s, dtype=torch.bool)
    for i in range(t):
        for j in range(s - t + i + 1):
            mask[i, j] = True
    return mask


def causal_from_triu(t, s):
    return ~torch.triu(torch.ones(t, s, dtype=torch.bool), diagonal=s - t + 1)


def causal_last_rows(t, s):
    # the last T rows of the square mask of all S positions
    return torch.tril(torch.ones(s, s, dtype=torch.bool))[s - t:]


def causal_torch_helper(t, s):
    return causal_lower_right(t, s)._materialize()


@pytest.mark.parametrize("fn", [causal_tril, causal_aranges, causal_loop, causal_from_triu,
                                causal_last_rows, causal_torch_helper])
def test_causal_mask_accepts_correct_answers(fn, capsys):
    check_causal_mask(fn)
    assert "causal_mask is correct" in capsys.readouterr().out


def test_causal_mask_reference_is_torchs_lower_right_mask():
    for t, s in ((4, 4), (2, 6), (1, 5)):
        expected = causal_lower_right(t, s)._materialize()
        assert torch.equal(attention.causal_mask(t, s), expected)


def _tril(t, s, diagonal):
    return torch.tril(torch.ones(t, s, dtype=torch.bool), diagonal=diagonal)


WRONG_CAUSAL = {
    "inverted (True = blocked)": (lambda t, s: ~causal_tril(t, s), "inverted"),
    "top-left aligned": (lambda t, s: _tril(t, s, 0), "top-left corner"),
    "square (T, T)": (lambda t, s: _tril(t, t, 0), "one column per key"),
    "first rows of the square mask": (lambda t, s: _tril(s, s, 0)[:t], "top-left corner"),
    "strictly lower": (lambda t, s: _tril(t, s, s - t - 1), "own position"),
    "one step ahead": (lambda t, s: _tril(t, s, s - t + 1), "one key into the future"),
    "upper triangle": (lambda t, s: torch.triu(torch.ones(t, s, dtype=torch.bool), s - t),
                       "wrong triangle"),
    "nothing masked": (lambda t, s: torch.ones(t, s, dtype=torch.bool), "allows every key"),
    "float 0/1": (lambda t, s: causal_tril(t, s).float(), "only the dtype is wrong"),
    "int 0/1": (lambda t, s: causal_tril(t, s).long(), "only the dtype is wrong"),
    "float 0/-inf": (lambda t, s: torch.zeros(t, s).masked_fill(~causal_tril(t, s),
                                                                  float("-inf")),
                     "additive float mask"),
    "float, inverted": (lambda t, s: (~causal_tril(t, s)).float(), "also inverted"),
    "a list": (lambda t, s: causal_tril(t, s).tolist(), "should be a tensor"),
    "batched shape": (lambda t, s: causal_tril(t, s)[None], r"shape \(1, 4, 4\)"),
    "off by two (not recognised)": (lambda t, s: _tril(t, s, s - t + 2),
                                     r"wrong values \(case 'T=4, S=4'\)"),
}


@pytest.mark.parametrize("name", list(WRONG_CAUSAL))
def test_causal_mask_rejects_wrong_answers(name):
    fn, message = WRONG_CAUSAL[name]
    with pytest.raises(CheckFailure, match=message):
        check_causal_mask(fn)


def test_causal_mask_messages_name_bool():
    with pytest.raises(CheckFailure, match="torch.bool"):
        check_causal_mask(lambda t, s: causal_tril(t, s).float())


def test_causal_mask_unrecognised_mistake_gets_no_planted_explanation():
    # a wrong mask that matches no listed mistake: the message names the case, nothing else
    def odd(t, s):
        mask = causal_tril(t, s).clone()
        mask[-1, 0] = s == 1  # the last query loses the first key (when there is more than one)
        return mask

    with pytest.raises(CheckFailure) as info:
        check_causal_mask(odd)
    message = str(info.value)
    assert "wrong values" in message and "case 'T=4, S=4'" in message
    for planted in ("top-left", "inverted", "future", "triangle"):
        assert planted not in message


# ------------------------------------------------------------------------- 5.2 masked_attention


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def masked_nan_to_num(q, k, v, mask):
    weights = torch.softmax(_scores(q, k).masked_fill(~mask, float("-inf")), dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # a fully masked row: 0/0 -> 0
    return weights @ v, weights


def masked_where_any(q, k, v, mask):
    scores = torch.where(mask, _scores(q, k), torch.tensor(float("-inf")))
    weights = torch.softmax(scores, dim=-1)
    weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return weights @ v, weights


def masked_big_negative_fixed(q, k, v, mask):
    """-1e9 instead of -inf is fine numerically, as long as empty rows become zeros."""
    weights = torch.softmax(_scores(q, k).masked_fill(~mask, -1e9), dim=-1)
    weights = weights * mask.any(-1, keepdim=True)
    return weights @ v, weights


def masked_renormalised(q, k, v, mask):
    """Zero the future after the softmax, then renormalise (eq. 21 plus renormalisation)."""
    zeroed = torch.softmax(_scores(q, k), dim=-1) * mask
    total = zeroed.sum(-1, keepdim=True)
    weights = zeroed / torch.where(total > 0, total, torch.ones_like(total))
    return weights @ v, weights


def masked_library(q, k, v, mask):
    return attention.scaled_dot_product_attention(q, k, v, mask=mask)


def masked_loop(q, k, v, mask):
    """Row by row: softmax over the allowed keys only."""
    d = q.shape[-1]
    full = torch.broadcast_shapes(q.shape[:-1] + (k.shape[-2],), mask.shape)
    qs = q.expand(*full[:-1], d).reshape(-1, full[-2], d)
    ks = k.expand(*full[:-2], k.shape[-2], d).reshape(-1, k.shape[-2], d)
    vs = v.expand(*full[:-2], *v.shape[-2:]).reshape(-1, *v.shape[-2:])
    ms = mask.expand(full).reshape(-1, *full[-2:])
    weights = torch.zeros(qs.shape[0], full[-2], full[-1])
    for b in range(qs.shape[0]):
        for t in range(full[-2]):
            allowed = ms[b, t]
            if allowed.any():
                scores = ks[b][allowed] @ qs[b, t] / math.sqrt(d)
                weights[b, t, allowed] = torch.softmax(scores, dim=0)
    weights = weights.reshape(full)
    return weights @ vs.reshape(*full[:-2], *v.shape[-2:]), weights


@pytest.mark.parametrize("fn", [masked_nan_to_num, masked_where_any, masked_big_negative_fixed,
                                masked_renormalised, masked_library, masked_loop])
def test_masked_attention_accepts_correct_answers(fn, capsys):
    check_masked_attention(fn)
    assert "masked_attention is correct" in capsys.readouterr().out


def _weights_only(weights_fn):
    def fn(q, k, v, mask):
        weights = weights_fn(q, k, mask)
        return weights @ v, weights
    return fn


def _no_nan_fix(q, k, mask):
    return torch.softmax(_scores(q, k).masked_fill(~mask, float("-inf")), dim=-1)


WRONG_MASKED = {
    "fill with 0": (_weights_only(lambda q, k, m: torch.softmax(
        _scores(q, k).masked_fill(~m, 0.0), dim=-1)), "filled the masked scores with 0"),
    "mask after the softmax": (_weights_only(lambda q, k, m: torch.softmax(
        _scores(q, k), dim=-1) * m), "zeroed afterwards"),
    "inverted mask": (_weights_only(lambda q, k, m: torch.softmax(
        _scores(q, k).masked_fill(m, float("-inf")), dim=-1)), "wrong way round"),
    "inverted mask, NaN cleaned": (_weights_only(lambda q, k, m: torch.softmax(
        _scores(q, k).masked_fill(m, float("-inf")), dim=-1).nan_to_num(0.0)),
        "wrong way round"),
    "no scaling": (_weights_only(lambda q, k, m: attention.softmax(
        (q @ k.transpose(-2, -1)).masked_fill(~m, float("-inf")))), "sqrt"),
    "NaN in fully masked rows": (_weights_only(_no_nan_fix), "NaN in the rows of queries whose "
                                                             "keys are all masked"),
    "-1e9 without fixing empty rows": (_weights_only(lambda q, k, m: torch.softmax(
        _scores(q, k).masked_fill(~m, -1e9), dim=-1)), "uniform weights"),
    "(weights, out)": (lambda q, k, v, m: masked_nan_to_num(q, k, v, m)[::-1],
                       r"order \(out, weights\)"),
    "weights only": (lambda q, k, v, m: masked_nan_to_num(q, k, v, m)[1], r"pair \(out, weights\)"),
    "out = weights @ k": (lambda q, k, v, m: (masked_nan_to_num(q, k, v, m)[1] @ k,
                                              masked_nan_to_num(q, k, v, m)[1]), "weights @ k"),
    "out from the NaN weights": (
        lambda q, k, v, m: (_no_nan_fix(q, k, m) @ v, _no_nan_fix(q, k, m).nan_to_num(0.0)),
        "output contains NaN"),
    "k.T on a batch": (_weights_only(lambda q, k, m: torch.softmax(
        (q @ k.T / math.sqrt(q.shape[-1])).masked_fill(~m, float("-inf")), -1).nan_to_num(0.0)),
        r"k\.transpose\(-2, -1\)"),
}


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", list(WRONG_MASKED))
def test_masked_attention_rejects_wrong_answers(name):
    fn, message = WRONG_MASKED[name]
    with pytest.raises(CheckFailure, match=message):
        check_masked_attention(fn)


def test_masked_attention_reference_agrees_with_pytorch():
    """The check's reference equals PyTorch's fused attention, fully masked rows included."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=gen) for _ in range(3))
    mask = attention.causal_mask(5)[None, None] & torch.tensor(
        [[True] * 5, [False, False, True, True, True]])[:, None, None, :]  # (B, 1, T, S)
    out, _ = attention.scaled_dot_product_attention(q, k, v, mask=mask)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


# -------------------------------------------------------------------------- 5.3 padding_mask


def padding_compare(lengths, max_len):
    return torch.arange(max_len)[None, :] < lengths[:, None]


def padding_loop(lengths, max_len):
    mask = torch.zeros(len(lengths), max_len, dtype=torch.bool)
    for b, length in enumerate(lengths.tolist()):
        mask[b, :length] = True
    return mask


def padding_from_causal(lengths, max_len):
    """Row L of a lower-triangular matrix with one extra row on top has L leading Trues."""
    table = torch.tril(torch.ones(max_len + 1, max_len, dtype=torch.bool), diagonal=-1)
    return table[lengths]


@pytest.mark.parametrize("fn", [padding_compare, padding_loop, padding_from_causal,
                                attention.padding_mask])
def test_padding_mask_accepts_correct_answers(fn, capsys):
    check_padding_mask(fn)
    assert "padding_mask is correct" in capsys.readouterr().out


WRONG_PADDING = {
    "inverted": (lambda lengths, n: torch.arange(n)[None, :] >= lengths[:, None], "inverted"),
    "<=": (lambda lengths, n: torch.arange(n)[None, :] <= lengths[:, None], "one position too many"),
    "< L - 1": (lambda lengths, n: torch.arange(n)[None, :] < lengths[:, None] - 1,
                "one position too few"),
    "ignores max_len": (lambda lengths, n: torch.arange(int(lengths.max()))[None, :]
                        < lengths[:, None], "max_len"),
    "transposed": (lambda lengths, n: (torch.arange(n)[None, :] < lengths[:, None]).T,
                   "transposed"),
    "float": (lambda lengths, n: (torch.arange(n)[None, :] < lengths[:, None]).float(),
              "only the dtype is wrong"),
    "float, inverted": (lambda lengths, n: (torch.arange(n)[None, :] >= lengths[:, None]).float(),
                        "also inverted: True must mean 'real token'"),
}


@pytest.mark.parametrize("name", list(WRONG_PADDING))
def test_padding_mask_rejects_wrong_answers(name):
    fn, message = WRONG_PADDING[name]
    with pytest.raises(CheckFailure, match=message):
        check_padding_mask(fn)


# -------------------------------------------------------------------------- 5.4 who_sees_whom


def _changed(new, old, atol):
    batch, seq_len = old.shape[:2]
    moved = (new - old).abs().reshape(batch, seq_len, -1).amax(-1)  # (B, T)
    return (moved > atol).any(0)  # (T,)


def who_loop(f, x, atol=1e-5):
    seq_len = x.shape[1]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        sees[:, j] = _changed(f(y), base, atol)
    return sees


def who_allclose(f, x, atol=1e-5):
    """Element loops with torch.allclose (its default rtol included), three trials each."""
    seq_len = x.shape[1]
    base = f(x)
    rows = []
    for i in range(seq_len):
        row = []
        for j in range(seq_len):
            changed = False
            for _ in range(3):
                y = x.clone()
                y[:, j] = y[:, j] + 1.0 + torch.rand_like(y[:, j])
                changed |= not torch.allclose(f(y)[:, i], base[:, i], atol=atol)
            row.append(changed)
        rows.append(row)
    return torch.tensor(rows)


def who_batched(f, x, atol=1e-5):
    """All T perturbations in one batch of B*T sequences."""
    batch, seq_len = x.shape[:2]
    y = x.repeat(seq_len, *([1] * (x.dim() - 1)))  # (T*B, T, D), block j perturbs position j
    for j in range(seq_len):
        y[j * batch:(j + 1) * batch, j] = torch.randn_like(x[:, j])
    moved = (f(y) - f(x).repeat(seq_len, *([1] * (x.dim() - 1)))).abs()
    moved = moved.reshape(seq_len, batch, seq_len, -1).amax(-1).amax(1)  # (T_j, T_i)
    return (moved > atol).T


@pytest.mark.parametrize("fn", [who_loop, who_allclose, who_batched])
def test_who_sees_whom_accepts_correct_answers(fn, capsys):
    check_who_sees_whom(fn)
    assert "who_sees_whom is correct" in capsys.readouterr().out


def who_exact(f, x, atol=1e-5):
    seq_len = x.shape[1]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        sees[:, j] = _changed(f(y), base, 0.0)
    return sees


def who_diagonal(f, x, atol=1e-5):
    seq_len = x.shape[1]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        sees[j, j] = _changed(f(y), base, atol)[j]
    return sees


def who_suffix(f, x, atol=1e-5):
    """Replaces position j and everything after it (not one position at a time)."""
    seq_len = x.shape[1]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j:] = torch.randn_like(y[:, j:])
        sees[:, j] = _changed(f(y), base, atol)
    return sees


def who_accumulating(f, x, atol=1e-5):
    """Forgets to start again from x: perturbations pile up over j."""
    seq_len = x.shape[1]
    base = f(x)
    y = x.clone()
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y[:, j] = torch.randn_like(y[:, j])
        sees[:, j] = _changed(f(y), base, atol)
    return sees


def who_per_example(f, x, atol=1e-5):
    batch, seq_len = x.shape[:2]
    base = f(x)
    sees = torch.zeros(batch, seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        sees[:, :, j] = (f(y) - base).abs().reshape(batch, seq_len, -1).amax(-1) > atol
    return sees


def who_in_place(f, x, atol=1e-5):
    base = f(x)
    seq_len = x.shape[1]
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        x[:, j] = torch.randn_like(x[:, j])  # overwrites the caller's tensor
        sees[:, j] = _changed(f(x), base, atol)
    return sees


def who_every_example(f, x, atol=1e-5):
    """Combines the batch's examples with all() instead of any()."""
    batch, seq_len = x.shape[:2]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        moved = (f(y) - base).abs().reshape(batch, seq_len, -1).amax(-1)  # (B, T)
        sees[:, j] = (moved > atol).all(0)
    return sees


def who_min_features(f, x, atol=1e-5):
    """Reduces over the features with min: every feature has to move."""
    batch, seq_len = x.shape[:2]
    base = f(x)
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn_like(y[:, j])
        moved = (f(y) - base).abs().reshape(batch, seq_len, -1).amin(-1)  # (B, T)
        sees[:, j] = (moved > atol).any(0)
    return sees


WRONG_WHO = {
    "all() over the batch": (who_every_example, "EVERY example"),
    "min over the features": (who_min_features, "ANY of its numbers"),
    "transposed": (lambda f, x, atol=1e-5: who_loop(f, x, atol).T, "transposed"),
    "diagonal only": (who_diagonal, "diagonal only"),
    "exact comparison": (who_exact, "rounding"),
    "suffix replaced": (who_suffix, "every input after it"),
    "perturbations accumulate": (who_accumulating, "inputs 0..j were replaced together"),
    "inverted": (lambda f, x, atol=1e-5: ~who_loop(f, x, atol), "inverted"),
    "per example": (who_per_example, "one matrix per example"),
    "float 0/1": (lambda f, x, atol=1e-5: who_loop(f, x, atol).float(),
                  "only the dtype is wrong"),
    "modifies x in place": (who_in_place, "in place"),
}


@pytest.mark.parametrize("name", list(WRONG_WHO))
def test_who_sees_whom_rejects_wrong_answers(name):
    fn, message = WRONG_WHO[name]
    with pytest.raises(CheckFailure, match=message):
        check_who_sees_whom(fn)


def test_the_probed_functions_have_the_dependences_their_docstrings_claim():
    """The check's test functions, measured with the library probe."""
    from course_lib.instruments.probes import who_sees_whom

    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(6, 6, dtype=torch.bool)
    assert torch.equal(who_sees_whom(causal_layer, x), torch.tril(ones))
    assert torch.equal(who_sees_whom(off_by_one_layer, x), torch.tril(ones, diagonal=1))
    assert torch.equal(who_sees_whom(previous_token, x), torch.tril(ones, -1) & torch.triu(ones, -1))
    assert torch.equal(who_sees_whom(causal_with_rounding_noise, x), torch.tril(ones))
    per_example = who_sees_whom(bidirectional_in_example_0, x, per_example=True)  # (B, T, T)
    assert torch.equal(per_example[0], ones) and torch.equal(per_example[1], torch.tril(ones))
    assert torch.equal(who_sees_whom(feature_0_sees_next, x), torch.tril(ones, diagonal=1))
    assert who_sees_whom(causal_with_rounding_noise, x, atol=0.0, rtol=0.0).all()


def test_building_the_probed_layers_leaves_the_global_random_stream_alone():
    from course_lib.course.checks import ch05

    ch05._probe_layers.cache_clear()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ch05._probe_layers()
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------- 5.5 find the bug: padded attention


def padded_keys(q, k, v, lengths):
    keep = attention.padding_mask(lengths, k.shape[1])  # (B, S)
    return attention.scaled_dot_product_attention(q, k, v, mask=keep[:, None, :])[0]


def padded_by_hand(q, k, v, lengths):
    # another formulation: scores by einsum, -inf fill with an arange comparison, torch.softmax
    scores = torch.einsum("btd,bsd->bts", q, k) / math.sqrt(q.shape[-1])
    real_key = torch.arange(k.shape[1])[None, None, :] < lengths[:, None, None]  # (B, 1, S)
    weights = torch.softmax(scores.masked_fill(~real_key, float("-inf")), dim=-1)
    return weights @ v


def padded_both_ways_safe(q, k, v, lengths):
    # pad queries masked too: their rows are empty, and course_lib's attention gives zeros there
    keep = attention.padding_mask(lengths, k.shape[1])  # (B, S)
    mask = keep[:, :, None] & keep[:, None, :]  # (B, T, S)
    return attention.scaled_dot_product_attention(q, k, v, mask=mask)[0]


@pytest.mark.parametrize("fn", [padded_keys, padded_by_hand, padded_both_ways_safe])
def test_fixed_padded_attention_accepts_correct_fixes(fn, capsys):
    check_fixed_padded_attention(fn)
    assert "finds no real output reading the padding" in capsys.readouterr().out


def padded_wrong_axis(q, k, v, lengths):  # the planted bug: the mask acts on the queries
    keep = attention.padding_mask(lengths, k.shape[1])
    return attention.scaled_dot_product_attention(q, k, v, mask=keep.unsqueeze(-1))[0]


def padded_no_mask(q, k, v, lengths):
    return attention.scaled_dot_product_attention(q, k, v)[0]


def padded_both_ways_naive(q, k, v, lengths):
    keep = attention.padding_mask(lengths, k.shape[1])
    mask = keep[:, :, None] & keep[:, None, :]
    scores = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v  # NaN in the pad query rows


def padded_unscaled(q, k, v, lengths):
    keep = attention.padding_mask(lengths, k.shape[1])
    scores = (q @ k.transpose(-2, -1)).masked_fill(~keep[:, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def padded_returns_pair(q, k, v, lengths):
    keep = attention.padding_mask(lengths, k.shape[1])
    return attention.scaled_dot_product_attention(q, k, v, mask=keep[:, None, :])


PADDED_WRONG = {
    padded_wrong_axis: "who_sees_whom finds that the real output",
    padded_no_mask: "the key axis",
    padded_both_ways_naive: "NaN or inf",
    padded_unscaled: r"differ from attention\s+with a key padding mask",
    padded_returns_pair: "return only the output",
}


@pytest.mark.parametrize("fn", list(PADDED_WRONG), ids=lambda f: f.__name__)
def test_fixed_padded_attention_rejects_mistakes(fn):
    with pytest.raises(CheckFailure, match=PADDED_WRONG[fn]):
        check_fixed_padded_attention(fn)


def test_fixed_padded_attention_crash_is_named():
    def crashes(q, k, v, lengths):
        return q @ k  # (B, T, d) @ (B, S, d): shapes do not fit

    with pytest.raises(CheckFailure, match="raised RuntimeError"):
        check_fixed_padded_attention(crashes)


# ------------------------------------------------------------------ 5.6 the capstone language model


class _LMParts(nn.Module):
    """The layers of the capstone model; subclasses write forward in different ways."""

    def __init__(self, vocab_size, d_model=64, max_len=64):
        super().__init__()
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(max_len, d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model))
        self.head = nn.Linear(d_model, vocab_size)

    def embed(self, ids, positions=True):
        x = self.token(ids)  # (B, T, D)
        return x + self.position(torch.arange(ids.shape[1])) if positions else x

    def finish(self, x, attended):
        x = x + self.out(attended)
        x = x + self.ffn(x)
        return SimpleNamespace(logits=self.head(x), loss=None)

    def attend(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return attention.scaled_dot_product_attention(q, k, v, mask=mask)[0]


class LMWithCourseFunctions(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        return self.finish(x, self.attend(x, attention.causal_mask(ids.shape[1])))


class LMWithTorchAttention(_LMParts):
    """is_causal=True in PyTorch's fused kernel, heads-free, einsum-free: another formulation."""

    def forward(self, ids, targets=None):
        x = self.token(ids) + self.position.weight[: ids.shape[1]]
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.finish(x, attended)


class LMWithoutMask(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        return self.finish(x, self.attend(x, None))


class LMMaskOffByOne(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        n = ids.shape[1]
        return self.finish(x, self.attend(x, torch.tril(torch.ones(n, n, dtype=torch.bool), 1)))


class LMOnlyItself(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        return self.finish(x, self.attend(x, torch.eye(ids.shape[1], dtype=torch.bool)))


class LMWithoutPositions(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids, positions=False)
        return self.finish(x, self.attend(x, attention.causal_mask(ids.shape[1])))


class LMMixingTheBatch(_LMParts):
    """Attends across the whole batch as one long sequence."""

    def forward(self, ids, targets=None):
        x = self.embed(ids)  # (B, T, D)
        flat = x.reshape(1, -1, x.shape[-1])  # (1, B*T, D)
        attended = self.attend(flat, attention.causal_mask(flat.shape[1])).reshape(x.shape)
        return self.finish(x, attended)


class LMWithoutHead(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        return SimpleNamespace(logits=self.out(x), loss=None)  # forgot the read-out


class LMStub(_LMParts):
    def forward(self, ids, targets=None):
        raise NotImplementedError("Exercise 5.6: write the body of forward")


class LMByHand(_LMParts):
    """Another correct formulation: explicit slices, einsum scores, -inf fill, torch.softmax."""

    def forward(self, ids, targets=None):
        T, D = ids.shape[1], self.out.in_features
        x = self.token(ids) + self.position(torch.arange(T))
        fused = self.qkv(x)
        q, k, v = fused[..., :D], fused[..., D:2 * D], fused[..., 2 * D:]
        scores = torch.einsum("btd,bsd->bts", q, k) / math.sqrt(D)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        attended = torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v
        return self.finish(x, attended)


@pytest.mark.parametrize("model_class", [LMWithCourseFunctions, LMWithTorchAttention, LMByHand])
def test_tiny_lm_accepts_correct_models(model_class, capsys):
    check_tiny_lm(model_class)
    assert "your language model follows the equations" in capsys.readouterr().out


class LMNoAttentionResidual(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        x = self.out(self.attend(x, attention.causal_mask(ids.shape[1])))  # replaced, not added
        return SimpleNamespace(logits=self.head(x + self.ffn(x)), loss=None)


class LMNoFFNResidual(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        x = x + self.out(self.attend(x, attention.causal_mask(ids.shape[1])))
        return SimpleNamespace(logits=self.head(self.ffn(x)), loss=None)


class LMNoResiduals(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        x = self.out(self.attend(x, attention.causal_mask(ids.shape[1])))
        return SimpleNamespace(logits=self.head(self.ffn(x)), loss=None)


class LMQueriesKeysSwapped(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        k, q, v = self.qkv(x).chunk(3, dim=-1)
        mask = attention.causal_mask(ids.shape[1])
        return self.finish(x, attention.scaled_dot_product_attention(q, k, v, mask=mask)[0])


class LMUnscaled(_LMParts):
    def forward(self, ids, targets=None):
        x = self.embed(ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        mask = attention.causal_mask(ids.shape[1])
        attended = attention.scaled_dot_product_attention(q, k, v, mask=mask, scale=1.0)[0]
        return self.finish(x, attended)


STEP_MISTAKES = {
    LMNoAttentionResidual: r"attention output instead of adding it.*x1 = x0 \+ out",
    LMNoFFNResidual: r"self.ffn\(x\) instead of adding it.*x2 = x1 \+ ffn\(x1\)",
    LMNoResiduals: "replaced x instead of adding to it, twice",
    LMQueriesKeysSwapped: "swapped queries and keys",
    LMUnscaled: "differ from the exercise's",
}


@pytest.mark.parametrize("model_class", list(STEP_MISTAKES), ids=lambda c: c.__name__)
def test_tiny_lm_grades_the_written_steps(model_class):
    # each of these is causal, reads the past, uses positions and keeps examples apart, so only
    # the comparison with the exercise's equations can reject it
    with pytest.raises(CheckFailure, match=STEP_MISTAKES[model_class]):
        check_tiny_lm(model_class)


WRONG_LMS = {
    LMWithoutMask: "leaks the future",
    LMMaskOffByOne: "off by one",
    LMOnlyItself: "does not depend on the token",
    LMWithoutPositions: "does not see word order",
    LMMixingTheBatch: "examples mix",
    LMWithoutHead: r"logits has shape \(3, 10, 16\)",
}


@pytest.mark.parametrize("model_class", list(WRONG_LMS), ids=lambda c: c.__name__)
def test_tiny_lm_rejects_misconceptions(model_class):
    with pytest.raises(CheckFailure, match=WRONG_LMS[model_class]):
        check_tiny_lm(model_class)


def test_tiny_lmstub_propagates_and_the_check_keeps_the_random_state():
    before = torch.random.get_rng_state()
    with pytest.raises(NotImplementedError, match="Exercise 5.6"):
        check_tiny_lm(LMStub)
    assert torch.equal(before, torch.random.get_rng_state())


def test_tiny_lm_check_reports_a_class_it_cannot_build():
    class NeedsMore(_LMParts):
        def __init__(self, vocab_size, n_layers, d_model=64, max_len=64):
            super().__init__(vocab_size, d_model, max_len)

    with pytest.raises(CheckFailure, match="could not build the model"):
        check_tiny_lm(NeedsMore)
