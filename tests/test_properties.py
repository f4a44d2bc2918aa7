"""Property tests (hypothesis): the invariants attention and the models must satisfy for any
shapes, including T=1 and H=1."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES
from hypothesis import given
from hypothesis import strategies as st

from course_lib.attention import MultiHeadAttention, causal_mask, scaled_dot_product_attention
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.models import DecoderLM, Encoder, EncoderDecoder

device_st = st.sampled_from(DEVICES)
seed_st = st.integers(0, 2**16)


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
    context = None if not causal and s != t else None
    if not causal:
        context = torch.randn(b, s, 8, device=device)
    src = t if context is None else s
    keep = None
    if use_padding:
        keep = torch.rand(b, src, device=device) > 0.3
        keep[:, 0] = True
    bias = torch.randn(h, t, src, device=device) if use_bias else None
    math_out, weights = mha(x, context, attention_mask=keep, bias=bias, is_causal=causal,
                            return_weights=True)
    fused_out, _ = mha(x, context, attention_mask=keep, bias=bias, is_causal=causal)
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


@given(t=st.integers(2, 10), seed=seed_st)
def test_encoder_without_positions_is_permutation_equivariant(t, seed):
    torch.manual_seed(seed)
    enc = Encoder(
        EncoderConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, positions="none")
    ).eval()
    ids = torch.randint(0, 11, (1, t))
    perm = torch.randperm(t)
    out = enc(ids).last_hidden_state
    torch.testing.assert_close(enc(ids[:, perm]).last_hidden_state, out[:, perm],
                               atol=1e-5, rtol=1e-5)


@given(t=st.integers(3, 10), seed=seed_st)
def test_encoder_with_positions_is_not_permutation_equivariant(t, seed):
    torch.manual_seed(seed)
    enc = Encoder(
        EncoderConfig(vocab_size=50, d_model=8, n_heads=2, n_layers=1, positions="learned")
    ).eval()
    ids = torch.arange(t)[None] + 1  # all tokens different
    perm = torch.roll(torch.arange(t), 1)
    out = enc(ids).last_hidden_state
    assert not torch.allclose(enc(ids[:, perm]).last_hidden_state, out[:, perm], atol=1e-4)


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


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "alibi", "rope", "none"])
@given(t=st.integers(1, 12), cut=st.integers(0, 11), seed=seed_st)
def test_whole_decoder_is_causal(positions, t, cut, seed):
    cut = min(cut, t - 1)
    torch.manual_seed(seed)
    model = DecoderLM(
        DecoderConfig(vocab_size=13, d_model=8, n_heads=2, n_layers=2, max_len=12,
                      positions=positions)
    ).eval()
    ids = torch.randint(0, 13, (2, t))
    changed = ids.clone()
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 1) % 13
    a = model(ids).logits
    b = model(changed).logits
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], atol=1e-5, rtol=1e-5)
    if cut + 1 < t:  # and the future is not ignored by everybody: the last position sees it
        assert not torch.allclose(a[:, -1], b[:, -1])


@given(t=st.integers(1, 8), cut=st.integers(0, 7), seed=seed_st)
def test_encoder_decoder_target_side_is_causal(t, cut, seed):
    cut = min(cut, t - 1)
    torch.manual_seed(seed)
    model = EncoderDecoder(EncoderDecoderConfig.shared(
        src_vocab_size=9, tgt_vocab_size=9, d_model=8, n_heads=2, max_src_len=8, max_tgt_len=8
    )).eval()
    src = torch.randint(0, 9, (1, 5))
    tgt = torch.randint(0, 9, (1, t))
    changed = tgt.clone()
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 1) % 9
    a = model(src, tgt).logits
    b = model(src, changed).logits
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], atol=1e-5, rtol=1e-5)


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
