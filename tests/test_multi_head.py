"""Multi-head attention as heads: the split into heads (and the bug a reshape without a
transpose makes), per-head independence, parity with per-head F.scaled_dot_product_attention
and with nn.MultiheadAttention for any number of heads, and head ablation.

(tests/test_attention.py covers nn.MultiheadAttention parity for self- and cross-attention,
padding and causal masks at H=4; the tests here vary the number of heads and look inside.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES
from helpers import copy_mha_from_torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from course_lib.attention import MultiHeadAttention, causal_mask, merge_heads, split_heads
from course_lib.configs import DecoderConfig
from course_lib.models import DecoderLM
from course_lib.probes import ablate_heads

TOL = dict(atol=1e-5, rtol=1e-5)
seed_st = st.integers(0, 2**16)
device_st = st.sampled_from(DEVICES)
heads_st = st.sampled_from([1, 2, 4, 8, 16])


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
     r"d_model=10 is not divisible by n_heads=4.*one of \[1, 2, 5, 10\]"),
    (lambda: split_heads(torch.randn(3, 8), 2), ValueError,
     r"x should have shape \(B, T, D\).*\(3, 8\)"),
    (lambda: split_heads(torch.randn(1, 3, 8), 0), ValueError, "n_heads must be a positive"),
    (lambda: split_heads(torch.randn(1, 3, 8), 2.0), TypeError, "n_heads.*write 2"),
    (lambda: split_heads([[1.0]], 1), TypeError, "x must be a torch.Tensor, got list"),
    (lambda: merge_heads(torch.randn(2, 3, 8)), ValueError,
     r"x should have shape \(B, H, T, Dh\).*\(2, 3, 8\)"),
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


# ------------------------------------------------------------------ head ablation


def _torch_layer_without(ours: MultiHeadAttention, heads: list[int]) -> nn.MultiheadAttention:
    """nn.MultiheadAttention with our weights and W_o's columns of the given heads zeroed."""
    ref = nn.MultiheadAttention(ours.d_model, ours.n_heads, batch_first=True).eval()
    dh = ours.d_head
    with torch.no_grad():
        ref.in_proj_weight.copy_(ours.qkv_proj.weight)
        ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)
        for head in heads:
            ref.out_proj.weight[:, head * dh:(head + 1) * dh] = 0.0
    return ref


@given(h=st.sampled_from([1, 2, 4, 8]), chosen=st.sets(st.integers(0, 7)),
       t=st.integers(1, 6), causal=st.booleans(), seed=seed_st)
def test_ablating_heads_equals_zeroing_their_columns_of_w_o(h, chosen, t, causal, seed):
    heads = sorted(c for c in chosen if c < h)
    torch.manual_seed(seed)
    ours = MultiHeadAttention(16, h).eval()
    x = torch.randn(2, t, 16)
    mask = causal_mask(t) if causal else None
    ref = _torch_layer_without(ours, heads)
    expected, _ = ref(x, x, x, attn_mask=None if mask is None else ~mask)
    _, weights_before = ours(x, mask=mask, return_weights=True)
    with ablate_heads(ours, heads) as layer:
        assert layer is ours
        fused, _ = ours(x, mask=mask)
        math_out, weights = ours(x, mask=mask, return_weights=True)
    torch.testing.assert_close(fused, expected, **TOL)
    torch.testing.assert_close(math_out, expected, **TOL)
    assert torch.equal(weights, weights_before)  # where the heads look is left alone


@given(seed=seed_st, split=st.integers(0, 2**4 - 1))
def test_head_contributions_add_up(seed, split):
    """out = b_o + sum over heads of each head's term: removing two disjoint sets of heads
    removes the sum of what each removal removes."""
    torch.manual_seed(seed)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    first = [h for h in range(4) if split >> h & 1]
    second = [h for h in range(4) if not split >> h & 1]
    full, _ = mha(x)
    with ablate_heads(mha, first):
        without_first, _ = mha(x)
    with ablate_heads(mha, second):
        without_second, _ = mha(x)
    with ablate_heads(mha, range(4)):
        without_all, _ = mha(x)
    torch.testing.assert_close(full - without_all,
                               (full - without_first) + (full - without_second), **TOL)
    torch.testing.assert_close(without_all, mha.out_proj.bias.expand_as(full).detach(), **TOL)


def test_ablation_ends_with_the_block_even_after_an_error():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 4, 8)
    full, _ = mha(x)
    with pytest.raises(RuntimeError, match="inside"):
        with ablate_heads(mha, 0):
            raise RuntimeError("an error inside the block")
    assert torch.equal(mha(x)[0], full)
    assert not mha.out_proj._forward_pre_hooks


def test_nested_ablations_combine_and_unwind():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 4).eval()
    x = torch.randn(1, 3, 8)
    with ablate_heads(mha, [0, 1]):
        both, _ = mha(x)
    with ablate_heads(mha, 0):
        with ablate_heads(mha, np.int64(1)):  # NumPy integers are head indices too
            nested, _ = mha(x)
        with ablate_heads(mha, 0):
            only_zero, _ = mha(x)
    torch.testing.assert_close(nested, both)
    with ablate_heads(mha, []):  # nothing ablated
        assert torch.equal(mha(x)[0], mha(x)[0])
    assert not torch.allclose(only_zero, both)


def test_ablation_inside_a_model_changes_its_logits_only_inside_the_block():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=11, d_model=16, n_heads=4, n_layers=2,
                                    max_len=8)).eval()
    ids = torch.randint(0, 11, (2, 6))
    with torch.no_grad():
        before = model(ids).logits
        with ablate_heads(model.blocks[1].self_attn, [2]):
            ablated = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(before, ablated)
    assert torch.equal(before, after)


@pytest.mark.parametrize(("attention", "heads", "error", "match"), [
    (nn.MultiheadAttention(8, 2), 0, TypeError, "copy its weights into course_lib"),
    (nn.Linear(8, 8), 0, TypeError, "MultiHeadAttention layer.*got Linear"),
    (MultiHeadAttention(8, 2), 2, ValueError, r"heads contains 2.*n_heads=2.*0\.\.1"),
    (MultiHeadAttention(8, 2), [0, -1], ValueError, r"heads contains -1"),
    (MultiHeadAttention(8, 2), 1.0, TypeError, r"ints in 0\.\.1.*1\.0 \(float\)"),
    (MultiHeadAttention(8, 2), [True], TypeError, r"True \(bool\)"),
    (MultiHeadAttention(8, 2), "0", TypeError, r"'0' \(str\)"),
    (MultiHeadAttention(8, 2), torch.tensor([0]), TypeError, r"\(Tensor\)"),
])
def test_bad_ablation_arguments_are_named(attention, heads, error, match):
    with pytest.raises(error, match=match):
        with ablate_heads(attention, heads):
            pass
