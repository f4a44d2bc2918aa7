"""Attention against PyTorch's own implementations (F.scaled_dot_product_attention,
nn.MultiheadAttention), the mask helpers, multi-head attention as heads (the split into heads
and the bug a reshape without a transpose makes, per-head independence, parity for any number
of heads), attention with a key/value cache (PyTorch's lower-right causal mask; cross-attention
takes no cache), hypothesis properties (rows sum to 1, masked weights exactly 0, causality,
permutation equivariance, T=1 and H=1) and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, on_devices
from helpers import copy_mha_from_torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from course_lib.attention import (
    MultiHeadAttention,
    attention_scores,
    causal_mask,
    merge_heads,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    split_heads,
)
from course_lib.cache import KVCache, LayerKVCache

TOL = dict(atol=1e-5, rtol=1e-5)
seed_st = st.integers(0, 2**16)
device_st = st.sampled_from(DEVICES)
heads_st = st.sampled_from([1, 2, 4, 8, 16])


@on_devices
def test_softmax_matches_torch(device):
    x = torch.randn(3, 4, 7, device=device) * 5
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1), **TOL)
    torch.testing.assert_close(softmax(x, dim=1), torch.softmax(x, dim=1), **TOL)


def test_softmax_is_stable_for_huge_scores():
    x = torch.tensor([[1000.0, 1001.0, 1002.0], [-1000.0, -1001.0, -1002.0]])
    out = softmax(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(x.double(), -1).float())
    # the naive formula overflows on the first row: exactly what the max-shift avoids
    naive = torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)
    assert torch.isnan(naive[0]).all()


def test_softmax_fully_masked_row_is_zero_not_nan():
    x = torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]])
    out = softmax(x)
    assert torch.equal(out[1], torch.zeros(2))
    torch.testing.assert_close(out[0], torch.softmax(x[0], -1))


@on_devices
def test_attention_scores_are_scaled_dot_products(device):
    q = torch.randn(2, 5, 8, device=device)
    k = torch.randn(2, 6, 8, device=device)
    expected = torch.einsum("btd,bsd->bts", q, k) / math.sqrt(8)
    torch.testing.assert_close(attention_scores(q, k), expected, **TOL)
    torch.testing.assert_close(attention_scores(q, k, scale=1.0), expected * math.sqrt(8), **TOL)


@on_devices
@pytest.mark.parametrize("shape", [(5, 8), (2, 5, 8), (2, 3, 5, 8)])
def test_sdpa_matches_torch_without_mask(device, shape):
    q, k, v = (torch.randn(*shape, device=device) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), **TOL)
    assert weights.shape == (*shape[:-1], shape[-2])


@on_devices
def test_sdpa_matches_torch_with_bool_masks(device):
    q = torch.randn(2, 3, 5, 8, device=device)
    k = torch.randn(2, 3, 7, 8, device=device)
    v = torch.randn(2, 3, 7, 4, device=device)
    masks = [
        causal_mask(5, 7, device=device),  # (T, S)
        torch.rand(2, 1, 5, 7, device=device) > 0.3,  # per example
        torch.rand(2, 3, 5, 7, device=device) > 0.3,  # per example and head
    ]
    for mask in masks:
        mask = mask.clone()
        mask[..., 0] = True  # keep at least one key per row so the reference is well defined
        ours, _ = scaled_dot_product_attention(q, k, v, mask=mask)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(ours, ref, **TOL)


@on_devices
def test_sdpa_with_bias_and_custom_scale_matches_torch(device):
    q, k, v = (torch.randn(2, 4, 6, 8, device=device) for _ in range(3))
    bias = torch.randn(4, 6, 6, device=device)
    mask = causal_mask(6, device=device)
    ours, _ = scaled_dot_product_attention(q, k, v, mask=mask, attn_bias=bias, scale=0.3)
    float_mask = bias.masked_fill(~mask, float("-inf"))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=0.3)
    torch.testing.assert_close(ours, ref, **TOL)


def test_sdpa_fully_masked_row_matches_torch_zeros():
    q = torch.randn(1, 4, 3)
    k, v = torch.randn(1, 5, 3), torch.randn(1, 5, 5)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    out, weights = scaled_dot_product_attention(q, k, v, mask=mask)
    assert torch.equal(weights[0, 2], torch.zeros(5))
    assert torch.equal(out[0, 2], torch.zeros(5))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_sdpa_dropout_only_in_use_when_asked():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 6, 8) for _ in range(3))
    out, weights = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert (weights == 0).any()  # some weights were dropped...
    kept = weights[weights != 0]
    assert (kept > 0).all()  # ...and the rest rescaled, not negated


def test_causal_mask_shapes_and_values():
    m = causal_mask(4)
    assert m.dtype == torch.bool
    assert torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # queries are the last T of S positions: the last query sees every key
    m = causal_mask(2, 5)
    assert m[-1].all() and m[0].tolist() == [True, True, True, True, False]


def test_padding_mask():
    m = padding_mask([3, 1, 4])
    assert m.tolist() == [
        [True, True, True, False],
        [True, False, False, False],
        [True, True, True, True],
    ]
    assert padding_mask(torch.tensor([2]), max_len=3).tolist() == [[True, True, False]]


def test_split_and_merge_heads_are_inverse():
    x = torch.randn(2, 5, 12)
    heads = split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4)
    # head h sees dimensions h*Dh .. (h+1)*Dh of each position
    torch.testing.assert_close(heads[:, 1], x[..., 4:8])
    torch.testing.assert_close(merge_heads(heads), x)


def _reference_mha(d_model=16, n_heads=4, seed=0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    ours = MultiHeadAttention(d_model, n_heads)
    copy_mha_from_torch(ours, ref)
    return ours.eval(), ref.eval()


@on_devices
def test_mha_self_attention_matches_torch(device):
    ours, ref = _reference_mha()
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(3, 7, 16, device=device)
    out, weights = ours(x, return_weights=True)
    ref_out, ref_weights = ref(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)
    # the fused path agrees too
    fused, none = ours(x)
    assert none is None
    torch.testing.assert_close(fused, ref_out, **TOL)


@on_devices
def test_mha_cross_attention_matches_torch(device):
    ours, ref = _reference_mha(seed=1)
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(2, 4, 16, device=device)
    memory = torch.randn(2, 9, 16, device=device)
    out, weights = ours(x, memory, return_weights=True)
    ref_out, ref_weights = ref(x, memory, memory, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)
    assert weights.shape == (2, 4, 4, 9)


@on_devices
def test_mha_masks_match_torch(device):
    ours, ref = _reference_mha(seed=2)
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(2, 6, 16, device=device)
    lengths = [6, 4]
    keep = padding_mask(lengths, device=device)  # (B, S) True = real token
    future = causal_mask(6, device=device)
    ref_out, ref_weights = ref(
        x, x, x, key_padding_mask=~keep, attn_mask=~future, average_attn_weights=False
    )  # PyTorch's masks mark positions to *block*
    for need_weights in (True, False):
        out, weights = ours(x, attention_mask=keep, is_causal=True, return_weights=need_weights)
        torch.testing.assert_close(out, ref_out, **TOL)
        if need_weights:
            torch.testing.assert_close(weights, ref_weights, **TOL)
    # an explicit mask argument is the same as is_causal=True
    out, _ = ours(x, mask=future, attention_mask=keep)
    torch.testing.assert_close(out, ref_out, **TOL)


def test_mha_unbatched_input():
    ours, ref = _reference_mha(seed=3)
    x = torch.randn(5, 16)
    out, weights = ours(x, return_weights=True)
    ref_out, ref_weights = ref(x, x, x, average_attn_weights=False)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)


def test_mha_bias_is_added_to_scores():
    ours, _ = _reference_mha(seed=4)
    x = torch.randn(2, 5, 16)
    bias = torch.zeros(4, 5, 5)
    bias[:, :, 0] = 50.0  # every query should look (almost) only at key 0
    _, weights = ours(x, attn_bias=bias, return_weights=True)
    assert (weights[..., 0] > 0.99).all()
    fused, _ = ours(x, attn_bias=bias, is_causal=True)
    math_out, _ = ours(x, attn_bias=bias, is_causal=True, return_weights=True)
    torch.testing.assert_close(fused, math_out, **TOL)


def test_mha_dropout_changes_training_output_only():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 5, 16)
    mha.train()
    a, _ = mha(x)
    b, _ = mha(x)
    assert not torch.allclose(a, b)
    mha.eval()
    c, _ = mha(x)
    d, _ = mha(x)
    assert torch.equal(c, d)


def test_mha_attention_mask_takes_bool_or_0_1_integers_and_refuses_floats():
    ours, ref = _reference_mha(seed=5)
    x = torch.randn(2, 4, 16)
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # what Hugging Face tokenizers return
    ref_out, _ = ref(x, x, x, key_padding_mask=keep == 0)
    for mask in (keep, keep.bool(), keep.to(torch.int32)):
        for need_weights in (True, False):
            out, _ = ours(x, attention_mask=mask, return_weights=need_weights)
            torch.testing.assert_close(out, ref_out, **TOL)
    with pytest.raises(ValueError, match=r"attention_mask .*bool.*float32"):
        ours(x, attention_mask=keep.float())
    with pytest.raises(ValueError, match=r"attention_mask .*\(2, 3\).*\(2, 4\)"):
        ours(x, attention_mask=keep[:, :3])


def test_sdpa_docstring_says_it_returns_a_tuple_first():
    first_line = scaled_dot_product_attention.__doc__.splitlines()[0]
    assert first_line.startswith("Returns (out, weights)")


# ------------------------------------------------------------------ splitting into heads


def _rows_moved(split, x: torch.Tensor, n_heads: int, position: int) -> torch.Tensor:
    """(H, T) bool: which rows (head h, position t) of split(x) change when x[:, position]
    is replaced."""
    changed = x.clone()
    changed[:, position] = changed[:, position] + 1.0
    moved = split(changed, n_heads) - split(x, n_heads)  # (B, H, T, Dh)
    return moved.abs().amax(dim=(0, -1)) > 0  # (H, T)


def _keeps_positions_apart(split, x: torch.Tensor, n_heads: int) -> bool:
    """The property: changing position j moves row j of every head, and nothing else."""
    seq_len = x.shape[1]
    for position in range(seq_len):
        expected = torch.zeros(n_heads, seq_len, dtype=torch.bool)
        expected[:, position] = True
        if not torch.equal(_rows_moved(split, x, n_heads, position), expected):
            return False
    return True


def reshape_without_transpose(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The classic bug: the right shape, cut row-major through the positions."""
    batch, seq_len, d_model = x.shape
    return x.reshape(batch, n_heads, seq_len, d_model // n_heads)


@given(b=st.integers(1, 3), t=st.integers(1, 7), h=st.integers(1, 6), dh=st.integers(1, 4),
       seed=seed_st)
def test_split_heads_keeps_each_position_in_its_own_row(b, t, h, dh, seed):
    x = torch.randn(b, t, h * dh, generator=torch.Generator().manual_seed(seed))
    heads = split_heads(x, h)
    assert heads.shape == (b, h, t, dh)
    for head in range(h):  # head h is the slice h*Dh .. (h+1)*Dh of every position
        torch.testing.assert_close(heads[:, head], x[..., head * dh:(head + 1) * dh],
                                   atol=0, rtol=0)
    assert _keeps_positions_apart(split_heads, x, h)


@given(b=st.integers(1, 3), t=st.integers(2, 7), h=st.integers(2, 6), dh=st.integers(1, 4),
       seed=seed_st)
def test_the_property_catches_a_reshape_without_transpose(b, t, h, dh, seed):
    """Same shape, no error: only the property (or the values) can tell the bug apart."""
    x = torch.randn(b, t, h * dh, generator=torch.Generator().manual_seed(seed))
    wrong = reshape_without_transpose(x, h)
    assert wrong.shape == split_heads(x, h).shape
    assert not _keeps_positions_apart(reshape_without_transpose, x, h)


@given(b=st.integers(1, 3), t=st.integers(1, 7), h=st.integers(1, 6), dh=st.integers(1, 4),
       seed=seed_st)
def test_merge_heads_is_the_inverse_of_split_heads(b, t, h, dh, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h * dh, generator=gen)
    y = torch.randn(b, h, t, dh, generator=gen)
    assert torch.equal(merge_heads(split_heads(x, h)), x)
    assert torch.equal(split_heads(merge_heads(y), h), y)
    # merging is concatenation along the features, head 0 first (eq. 24)
    assert torch.equal(merge_heads(y), torch.cat(list(y.unbind(1)), dim=-1))


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: split_heads(torch.randn(2, 3, 10), 4), ValueError,
     r"d_model=10.*n_heads=4.*\[1, 2, 5, 10\]"),
    (lambda: split_heads(torch.randn(3, 8), 2), ValueError,
     r"x .*\(B, T, D\).*\(3, 8\)"),
    (lambda: split_heads(torch.randn(1, 3, 8), 0), ValueError, r"n_heads .*>= 1.*got 0"),
    (lambda: split_heads(torch.randn(1, 3, 8), 2.0), TypeError, r"n_heads .*2\.0.*write 2"),
    (lambda: split_heads([[1.0]], 1), TypeError, r"x .*torch.Tensor.*list"),
    (lambda: merge_heads(torch.randn(2, 3, 8)), ValueError,
     r"x .*\(B, H, T, Dh\).*\(2, 3, 8\)"),
])
def test_split_and_merge_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------ heads, one by one


def _per_head_reference(mha: MultiHeadAttention, x: torch.Tensor,
                        mask: torch.Tensor | None) -> torch.Tensor:
    """H single-head attentions through F.scaled_dot_product_attention, each from its own
    rows of the projection weights, concatenated, then W_o (eqs. 22-24)."""
    d, dh = mha.d_model, mha.d_head
    weight, bias = mha.qkv_proj.weight, mha.qkv_proj.bias
    outputs = []
    for head in range(mha.n_heads):
        rows = [part * d + head * dh + i for part in range(3) for i in range(dh)]
        w = weight[rows]  # (3*Dh, D): this head's W_q, W_k, W_v
        b = None if bias is None else bias[rows]
        q, k, v = F.linear(x, w, b).chunk(3, dim=-1)  # (B, T, Dh) each
        outputs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return mha.out_proj(torch.cat(outputs, dim=-1))  # (B, T, D)


@given(h=heads_st, t=st.integers(1, 6), b=st.integers(1, 2), bias=st.booleans(),
       causal=st.booleans(), seed=seed_st, device=device_st)
def test_multi_head_attention_is_h_single_heads_concatenated(h, t, b, bias, causal, seed,
                                                             device):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(16, h, bias=bias).to(device).eval()
    x = torch.randn(b, t, 16, device=device)
    mask = causal_mask(t, device=device) if causal else None
    expected = _per_head_reference(mha, x, mask)
    for return_weights in (False, True):
        out, _ = mha(x, mask=mask, return_weights=return_weights)
        torch.testing.assert_close(out, expected, **TOL)


@given(h=heads_st, t=st.integers(1, 6), b=st.integers(1, 2), seed=seed_st)
def test_any_number_of_heads_matches_nn_multihead_attention_with_its_mask_convention(
        h, t, b, seed):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(16, h, batch_first=True).eval()
    ours = MultiHeadAttention(16, h).eval()
    copy_mha_from_torch(ours, ref)
    x = torch.randn(b, t, 16)
    allowed = torch.rand(t, t) > 0.4
    allowed[:, 0] = True  # every query keeps a key (nn.MultiheadAttention gives NaN otherwise)
    # ours: True = may attend; nn.MultiheadAttention's boolean attn_mask: True = may NOT
    ref_out, ref_weights = ref(x, x, x, attn_mask=~allowed, average_attn_weights=False)
    out, weights = ours(x, mask=allowed, return_weights=True)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(weights, ref_weights, **TOL)
    fused, _ = ours(x, mask=allowed)
    torch.testing.assert_close(fused, ref_out, **TOL)


def _concatenated_heads(mha: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """The input of the output projection: the heads' outputs side by side, (B, T, D)."""
    seen = []
    handle = mha.out_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        mha(x)
    finally:
        handle.remove()
    return seen[0]


@given(h=st.sampled_from([2, 4, 8]), head=st.integers(0, 7), t=st.integers(1, 6),
       part=st.sampled_from(["q", "k", "v", "qkv"]), seed=seed_st)
def test_changing_one_heads_projections_changes_only_that_heads_slice(h, head, t, part, seed):
    head = head % h
    torch.manual_seed(seed)
    mha = MultiHeadAttention(16, h).eval()
    x = torch.randn(2, t, 16)
    dh = mha.d_head
    before = _concatenated_heads(mha, x)
    with torch.no_grad():
        for index, name in enumerate("qkv"):
            if name in part:
                rows = slice(index * 16 + head * dh, index * 16 + (head + 1) * dh)
                mha.qkv_proj.weight[rows] += torch.randn(dh, 16)
                mha.qkv_proj.bias[rows] += 1.0
    moved = (_concatenated_heads(mha, x) - before).abs()  # (B, T, D)
    mine = slice(head * dh, (head + 1) * dh)
    others = torch.ones(16, dtype=torch.bool)
    others[mine] = False
    assert torch.equal(moved[..., others], torch.zeros_like(moved[..., others]))
    if "v" in part or t > 1:  # with one key, its weight is 1 whatever the queries and keys
        assert moved[..., mine].max() > 1e-4


# ------------------------------------------------------- attention with a key/value cache


@on_devices
@pytest.mark.parametrize("t_new", [1, 3])
def test_attention_with_a_cache_equals_sdpa_with_a_lower_right_causal_mask(device, t_new):
    """The new queries sit at the end: PyTorch's causal_lower_right, not is_causal=True."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4).to(device).eval()
    x = torch.randn(2, 5 + t_new, 16, device=device)
    cache = LayerKVCache()
    layer(x[:, :5], is_causal=True, past_key_value=cache)
    out, _ = layer(x[:, 5:], is_causal=True, past_key_value=cache)
    q, k, v = layer.qkv_proj(x).chunk(3, dim=-1)
    q, k, v = (t.view(2, -1, 4, 4).transpose(1, 2) for t in (q, k, v))  # (B, H, S, Dh)
    mask = causal_lower_right(t_new, 5 + t_new)
    expected = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=mask)
    expected = layer.out_proj(expected.transpose(1, 2).reshape(2, t_new, 16))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    top_left = F.scaled_dot_product_attention(q[:, :, 5:], k, v, is_causal=True)
    if t_new > 1:  # the top-left mask hides keys the new queries must see
        assert not torch.allclose(layer.out_proj(top_left.transpose(1, 2).reshape(2, t_new, 16)),
                                  expected, atol=1e-4)


def test_attention_weights_with_a_cache_follow_the_lower_right_mask():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).eval()
    cache = LayerKVCache()
    layer(torch.randn(1, 3, 8), is_causal=True, past_key_value=cache)
    _, weights = layer(torch.randn(1, 2, 8), is_causal=True, past_key_value=cache,
                       return_weights=True)
    assert weights.shape == (1, 2, 2, 5)
    assert (weights[0, :, 0, 4] == 0).all() and (weights[0, :, 0, :4] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 2))


def test_cross_attention_takes_no_cache():
    layer = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="past_key_value"):
        layer(torch.randn(1, 2, 8), torch.randn(1, 3, 8), past_key_value=LayerKVCache())


# ------------------------------------------------------------------ properties (hypothesis)


def _randn(gen, *shape, device):
    return torch.randn(*shape, generator=gen).to(device)


@given(b=st.integers(1, 3), h=st.integers(1, 4), t=st.integers(1, 9), s=st.integers(1, 9),
       d=st.integers(1, 8), seed=seed_st, device=device_st)
def test_weights_rows_sum_to_one_and_masked_weights_are_exactly_zero(b, h, t, s, d, seed, device):
    gen = torch.Generator().manual_seed(seed)
    q, k = _randn(gen, b, h, t, d, device=device), _randn(gen, b, h, s, d, device=device)
    v = _randn(gen, b, h, s, d, device=device)
    mask = (torch.rand(b, 1, t, s, generator=gen) > 0.4).to(device)
    _, weights = scaled_dot_product_attention(q, k, v, mask=mask)
    assert (weights[~mask.expand_as(weights)] == 0).all()
    sums = weights.sum(-1)
    has_key = mask.any(-1).expand_as(sums)
    torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
    assert (sums[~has_key] == 0).all()  # a fully masked row is all zeros, not NaN
    assert torch.isfinite(weights).all()


@given(b=st.integers(1, 3), h=st.sampled_from([1, 2, 4]), t=st.integers(1, 8),
       s=st.integers(1, 8), causal=st.booleans(), use_padding=st.booleans(),
       use_bias=st.booleans(), seed=seed_st, device=device_st)
def test_math_path_equals_fused_path(b, h, t, s, causal, use_padding, use_bias, seed, device):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, h).to(device).eval()
    x = torch.randn(b, t, 8, device=device)
    context = None
    if not causal:
        context = torch.randn(b, s, 8, device=device)
    src = t if context is None else s
    keep = None
    if use_padding:
        keep = torch.rand(b, src, device=device) > 0.3
        keep[:, 0] = True
    bias = torch.randn(h, t, src, device=device) if use_bias else None
    math_out, weights = mha(x, context, attention_mask=keep, attn_bias=bias, is_causal=causal,
                            return_weights=True)
    fused_out, _ = mha(x, context, attention_mask=keep, attn_bias=bias, is_causal=causal)
    torch.testing.assert_close(math_out, fused_out, atol=1e-5, rtol=1e-5)
    assert weights.shape == (b, h, t, src)


@given(t=st.integers(1, 10), h=st.sampled_from([1, 2, 4]), seed=seed_st, device=device_st)
def test_self_attention_without_positions_is_permutation_equivariant(t, h, seed, device):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, h).to(device).eval()
    x = torch.randn(2, t, 8, device=device)
    perm = torch.randperm(t, device=device)
    out, _ = mha(x)
    out_perm, _ = mha(x[:, perm])
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-5, rtol=1e-5)


@given(t=st.integers(1, 9), cut=st.integers(0, 8), h=st.sampled_from([1, 2, 4]),
       need_weights=st.booleans(), seed=seed_st, device=device_st)
def test_causal_attention_ignores_the_future(t, cut, h, need_weights, seed, device):
    cut = min(cut, t - 1)  # positions <= cut must not see changes after cut
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, h).to(device).eval()
    x = torch.randn(1, t, 8, device=device)
    y = x.clone()
    y[:, cut + 1:] = torch.randn_like(y[:, cut + 1:])
    a, _ = mha(x, is_causal=True, return_weights=need_weights)
    b, _ = mha(y, is_causal=True, return_weights=need_weights)
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], atol=1e-6, rtol=1e-6)


def test_single_token_and_single_head_edge_cases():
    torch.manual_seed(0)
    mha = MultiHeadAttention(4, 1).eval()
    x = torch.randn(3, 1, 4)
    out, weights = mha(x, is_causal=True, return_weights=True)
    assert torch.equal(weights, torch.ones(3, 1, 1, 1))  # the only key gets all the weight
    v = x @ mha.qkv_proj.weight[8:].T + mha.qkv_proj.bias[8:]
    torch.testing.assert_close(out, mha.out_proj(v))  # so the output is that key's value
    mask = causal_mask(1)
    assert mask.tolist() == [[True]]


# ---------------------------------------------------------------------------------- bad input

QKV_ERRORS = {
    "q-k-features": (lambda: attention_scores(torch.randn(4, 8), torch.randn(4, 6)),
                     ValueError, r"q .*\(4, 8\).*k .*\(4, 6\).*\(\.\.\., S, Dh\)"),
    "k-v-positions": (lambda: scaled_dot_product_attention(torch.randn(4, 8), torch.randn(5, 8),
                                                           torch.randn(6, 8)),
                      ValueError, r"k .*\(5, 8\).*v .*\(6, 8\).*\(\.\.\., S, Dv\)"),
    "q-1d": (lambda: attention_scores(torch.randn(8), torch.randn(4, 8)),
             ValueError, r"q .*\(\.\.\., T, Dh\).*\(8,\)"),
    "q-k-batch": (lambda: scaled_dot_product_attention(torch.randn(2, 3, 4), torch.randn(5, 3, 4),
                                                       torch.randn(5, 3, 4)),
                  ValueError, r"q .*\(2, 3, 4\).*k .*\(5, 3, 4\)"),
    "float-mask": (lambda: scaled_dot_product_attention(*[torch.randn(3, 4)] * 3,
                                                        mask=torch.zeros(3, 3)),
                   ValueError, r"mask .*boolean.*float32"),
    "mask-shape": (lambda: scaled_dot_product_attention(*[torch.randn(2, 3, 4)] * 3,
                                                        mask=torch.ones(3, 5, dtype=torch.bool)),
                   ValueError, r"mask .*\(3, 5\).*\(2, 3, 3\)"),
    "integer-k": (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.ones(3, 4).long(),
                                                       torch.randn(3, 4)),
                  ValueError, r"k .*floating-point.*int64"),
    "float64-v": (lambda: scaled_dot_product_attention(torch.randn(3, 4), torch.randn(3, 4),
                                                       torch.randn(3, 4).double()),
                  ValueError, r"v .*torch.float64.*torch.float32.*v\.float\(\)"),
    "softmax-integers": (lambda: softmax(torch.tensor([1, 2, 3])),
                         ValueError, r"x .*floating-point.*int64"),
    "q-list": (lambda: attention_scores([[1.0]], torch.randn(1, 1)),
               TypeError, r"q .*torch.Tensor.*list"),
}


@pytest.mark.parametrize("name", list(QKV_ERRORS))
def test_attention_functions_name_a_bad_argument(name):
    call, error, match = QKV_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


MHA_ERRORS = {
    "not-divisible": (lambda: MultiHeadAttention(10, 4),
                      ValueError, r"d_model=10.*n_heads=4.*\[1, 2, 5, 10\]"),
    "zero-heads": (lambda: MultiHeadAttention(8, 0), ValueError, r"n_heads .*>= 1.*got 0"),
    "x-features": (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 6)),
                   ValueError, r"x .*\(2, 3, 6\).*d_model=8"),
    "x-4d": (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 2, 3, 8)),
             ValueError, r"x .*\(B, T, D\) or \(T, D\).*\(2, 2, 3, 8\)"),
    "context-batch": (lambda: MultiHeadAttention(8, 2)(torch.randn(2, 3, 8), torch.randn(5, 4, 8)),
                      ValueError, r"context .*\(5, 4, 8\).*batch size=2"),
    "integer-mask": (lambda: MultiHeadAttention(4, 2)(torch.randn(1, 3, 4),
                                                      mask=torch.ones(3, 3, dtype=torch.long)),
                     ValueError, r"mask .*boolean.*int64"),
    "attention_mask-1d": (lambda: MultiHeadAttention(4, 2)(
        torch.randn(1, 3, 4), attention_mask=torch.ones(3, dtype=torch.bool)),
        ValueError, r"attention_mask .*\(3,\).*\(1, 3\)"),
    "attn_bias-shape": (lambda: MultiHeadAttention(4, 2)(torch.randn(1, 3, 4),
                                                         attn_bias=torch.zeros(3, 3, 3)),
                        ValueError, r"attn_bias .*\(3, 3, 3\).*\(1, 2, 3, 3\)"),
    "whole-cache": (lambda: MultiHeadAttention(8, 2)(torch.randn(1, 3, 8),
                                                     past_key_value=KVCache()),
                    TypeError, r"past_key_value .*one layer's cache.*KVCache"),
}


@pytest.mark.parametrize("name", list(MHA_ERRORS))
def test_multi_head_attention_names_a_bad_argument(name):
    call, error, match = MHA_ERRORS[name]
    with pytest.raises(error, match=match):
        call()


def test_padding_mask_names_a_length_beyond_max_len():
    with pytest.raises(ValueError, match=r"lengths .*max_len=3.*\[5, 2\]"):
        padding_mask([5, 2], max_len=3)


@pytest.mark.parametrize("max_len", [4.5, 4.0, True, "4"])
def test_padding_mask_refuses_a_max_len_that_is_not_an_int(max_len):
    with pytest.raises(TypeError, match=r"max_len .*integer"):
        padding_mask([2, 3], max_len)


def test_padding_mask_still_takes_numpy_ints():
    assert padding_mask([2, 3], np.int64(4)).shape == (2, 4)


Q = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # (B, T, Dh)
SCALED = {
    "scaled_dot_product_attention": lambda s: scaled_dot_product_attention(Q, Q, Q, scale=s),
    "attention_scores": lambda s: attention_scores(Q, Q, scale=s),
}


@pytest.mark.parametrize("name", sorted(SCALED))
@pytest.mark.parametrize("scale", [1 // math.sqrt(8), -0.5, float("nan")])
def test_a_scale_of_zero_or_less_is_refused_with_the_usual_formula(name, scale):
    with pytest.raises(ValueError, match=r"scale .*> 0.*1 / math\.sqrt"):
        SCALED[name](scale)


@pytest.mark.parametrize("scale", ["0.35", True, torch.tensor(0.35)])
def test_a_scale_that_is_not_a_number_is_a_type_error(scale):
    with pytest.raises(TypeError, match=r"scale .*> 0"):
        scaled_dot_product_attention(Q, Q, Q, scale=scale)


def test_a_positive_scale_still_works():
    out, weights = scaled_dot_product_attention(Q, Q, Q, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(Q, Q, Q))


# ------------------------------------------------- grouped-query and multi-query attention


def _reference_gqa(layer, x, context=None, causal=False):
    """The layer's function written with torch's own GQA: q, k, v from the rows [W_q; W_k; W_v]
    of qkv_proj, then F.scaled_dot_product_attention(..., enable_gqa=True)."""
    d, kv_dim, dh = layer.d_model, layer.n_kv_heads * layer.d_head, layer.d_head
    w, b = layer.qkv_proj.weight, layer.qkv_proj.bias
    parts = [slice(0, d), slice(d, d + kv_dim), slice(d + kv_dim, d + 2 * kv_dim)]
    sources = (x, x if context is None else context, x if context is None else context)
    q, k, v = (F.linear(src, w[rows], None if b is None else b[rows])
               for src, rows in zip(sources, parts, strict=True))
    q, k, v = (t.unflatten(-1, (-1, dh)).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, Dh)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return layer.out_proj(out.transpose(1, 2).flatten(-2))  # (B, T, D)


@given(h=st.sampled_from([1, 2, 4, 8]), groups=st.sampled_from([1, 2, 4, 8]),
       t=st.integers(1, 6), b=st.integers(1, 2), bias=st.booleans(), causal=st.booleans(),
       cross=st.booleans(), seed=seed_st)
def test_grouped_query_attention_matches_torch_sdpa_with_enable_gqa(h, groups, t, b, bias,
                                                                    causal, cross, seed):
    n_kv = max(h // groups, 1)
    causal = causal and not cross
    torch.manual_seed(seed)
    layer = MultiHeadAttention(8 * h, h, bias=bias, n_kv_heads=n_kv).eval()
    x = torch.randn(b, t, 8 * h)
    context = torch.randn(b, t + 2, 8 * h) if cross else None
    expected = _reference_gqa(layer, x, context, causal)
    for return_weights in (False, True):
        out, weights = layer(x, context, is_causal=causal, return_weights=return_weights)
        torch.testing.assert_close(out, expected, **TOL)
    assert weights.shape == (b, h, t, t + 2 if cross else t)  # one map per query head


def test_grouped_query_attention_with_n_kv_heads_equal_to_n_heads_is_todays_attention():
    torch.manual_seed(0)
    today = MultiHeadAttention(32, 4, rope=True).eval()
    torch.manual_seed(0)
    gqa = MultiHeadAttention(32, 4, rope=True, n_kv_heads=4).eval()
    assert gqa.qkv_proj.weight.shape == (96, 32)  # rows [W_q; W_k; W_v], 3D as before
    x = torch.randn(2, 5, 32)
    for return_weights in (False, True):
        a, b = (m(x, is_causal=True, return_weights=return_weights)[0] for m in (today, gqa))
        assert torch.equal(a, b)
    assert repr(today) == repr(gqa)


def test_grouping_is_what_matters_a_model_that_shares_no_heads_differs():
    """The property the reference test relies on can fail: repeating kv heads in the wrong
    order (tile instead of repeat_interleave) gives other outputs."""
    torch.manual_seed(1)
    layer = MultiHeadAttention(32, 4, n_kv_heads=2).eval()
    x = torch.randn(1, 5, 32)
    d = 32
    w = layer.qkv_proj.weight
    q = F.linear(x, w[:d], layer.qkv_proj.bias[:d]).unflatten(-1, (4, 8)).transpose(1, 2)
    kv = F.linear(x, w[d:], layer.qkv_proj.bias[d:]).unflatten(-1, (4, 8)).transpose(1, 2)
    k, v = kv[:, :2].repeat(1, 2, 1, 1), kv[:, 2:].repeat(1, 2, 1, 1)  # tiled: the wrong groups
    wrong = layer.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2))
    assert not torch.allclose(layer(x)[0], wrong, atol=1e-4)


def test_multi_query_attention_caches_one_key_and_value_head():
    torch.manual_seed(2)
    layer = MultiHeadAttention(32, 4, n_kv_heads=1, rope=True).eval()
    assert layer.qkv_proj.weight.shape == (32 + 2 * 8, 32)  # W_q (D, D), W_k and W_v (Dh, D)
    assert "n_kv_heads=1" in repr(layer)
    x = torch.randn(2, 7, 32)
    cache = LayerKVCache()
    steps = [layer(x[:, a:c], is_causal=True, past_key_value=cache)[0]
             for a, c in ((0, 3), (3, 4), (4, 7))]
    torch.testing.assert_close(torch.cat(steps, 1), layer(x, is_causal=True)[0], **TOL)
    assert cache.keys.shape == cache.values.shape == (2, 1, 7, 8)  # (B, Hkv, S, Dh)
    _, weights = layer(x, is_causal=True, return_weights=True)
    assert weights.shape == (2, 4, 7, 7)


@given(t=st.integers(1, 9), cut=st.integers(0, 8), n_kv=st.sampled_from([1, 2]),
       seed=seed_st)
def test_grouped_query_attention_ignores_the_future(t, cut, n_kv, seed):
    cut = min(cut, t - 1)
    torch.manual_seed(seed)
    layer = MultiHeadAttention(16, 4, n_kv_heads=n_kv, rope=True).eval()
    x = torch.randn(1, t, 16)
    changed = x.clone()
    changed[:, cut + 1:] = torch.randn(1, t - cut - 1, 16)
    a, b = layer(x, is_causal=True)[0], layer(changed, is_causal=True)[0]
    torch.testing.assert_close(a[:, :cut + 1], b[:, :cut + 1], **TOL)


@pytest.mark.parametrize(("n_kv_heads", "error", "match"), [
    (3, ValueError, r"n_heads=4 is not divisible by n_kv_heads=3.*\[1, 2, 4\]"),
    (8, ValueError, r"n_kv_heads=8"),
    (0, ValueError, r"n_kv_heads .*>= 1.*got 0"),
    (2.0, TypeError, r"n_kv_heads .*integer.*2\.0"),
])
def test_n_kv_heads_must_divide_n_heads_and_is_named(n_kv_heads, error, match):
    with pytest.raises(error, match=match):
        MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads)
