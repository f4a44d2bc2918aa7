"""Attention against PyTorch's own implementations (F.scaled_dot_product_attention,
nn.MultiheadAttention), plus the mask helpers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from helpers import copy_mha_from_torch
from torch import nn

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

TOL = dict(atol=1e-5, rtol=1e-5)


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
    ours, _ = scaled_dot_product_attention(q, k, v, mask=mask, bias=bias, scale=0.3)
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
    _, weights = ours(x, bias=bias, return_weights=True)
    assert (weights[..., 0] > 0.99).all()
    fused, _ = ours(x, bias=bias, is_causal=True)
    math_out, _ = ours(x, bias=bias, is_causal=True, return_weights=True)
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
