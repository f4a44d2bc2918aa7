"""course_lib.blocks: the encoder and decoder blocks against nn.TransformerEncoderLayer /
nn.TransformerDecoderLayer (weights copied, eval mode), and their argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import on_devices
from helpers import copy_linear, copy_mha_from_torch, copy_norm
from torch import nn

from course_lib.attention import causal_mask, padding_mask
from course_lib.blocks import DecoderBlock, EncoderBlock
from course_lib.cache import KVCache

TOL = dict(atol=1e-5, rtol=1e-5)
D, H, F_ = 16, 4, 40


def _encoder_pair(norm_first: bool, activation: str):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(
        D, H, F_, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    )
    for p in ref.parameters():  # move LayerNorm gains/biases away from 1/0 so they matter
        nn.init.normal_(p, std=0.3)
    ours = EncoderBlock(D, H, F_, activation=activation, norm_first=norm_first)
    copy_mha_from_torch(ours.self_attn, ref.self_attn)
    copy_linear(ours.ff.fc1, ref.linear1)
    copy_linear(ours.ff.fc2, ref.linear2)
    copy_norm(ours.attn_norm, ref.norm1)
    copy_norm(ours.ff_norm, ref.norm2)
    return ours.eval(), ref.eval()


@on_devices
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_block_matches_torch(device, norm_first, activation):
    ours, ref = _encoder_pair(norm_first, activation)
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(3, 7, D, device=device)
    keep = padding_mask([7, 5, 2], device=device)
    # On CUDA the fast path of nn.TransformerEncoderLayer fuses GELU into cuBLAS's matrix product,
    # which computes the tanh approximation (off by up to 3e-4): compare with the layer's exact
    # path there, as documented. Everywhere else the fast path is compared.
    exact_gelu = device.type == "cuda" and activation == "gelu"
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fast_path and not exact_gelu)
    try:
        with torch.no_grad():
            ref_out = ref(x, src_key_padding_mask=~keep)
            ref_unmasked = ref(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
    with torch.no_grad():
        out, weights = ours(x, attention_mask=keep, return_weights=True)
        fused, _ = ours(x, attention_mask=keep)
        unmasked = ours(x)[0]
    # PyTorch's fast path fills padded *query* rows with zeros; compare the real tokens.
    torch.testing.assert_close(out[keep], ref_out[keep], **TOL)
    torch.testing.assert_close(fused[keep], ref_out[keep], **TOL)
    assert weights.shape == (3, H, 7, 7)
    torch.testing.assert_close(unmasked, ref_unmasked, **TOL)


def _decoder_pair(norm_first: bool):
    torch.manual_seed(1)
    ref = nn.TransformerDecoderLayer(
        D, H, F_, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    for p in ref.parameters():
        nn.init.normal_(p, std=0.3)
    ours = DecoderBlock(D, H, F_, cross_attention=True, norm_first=norm_first)
    copy_mha_from_torch(ours.self_attn, ref.self_attn)
    copy_mha_from_torch(ours.cross_attn, ref.multihead_attn)
    copy_linear(ours.ff.fc1, ref.linear1)
    copy_linear(ours.ff.fc2, ref.linear2)
    copy_norm(ours.attn_norm, ref.norm1)
    copy_norm(ours.cross_attn_norm, ref.norm2)
    copy_norm(ours.ff_norm, ref.norm3)
    return ours.eval(), ref.eval()


@on_devices
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_decoder_block_matches_torch(device, norm_first):
    ours, ref = _decoder_pair(norm_first)
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(2, 6, D, device=device)
    memory = torch.randn(2, 9, D, device=device)
    mem_keep = padding_mask([9, 4], device=device)
    with torch.no_grad():
        ref_out = ref(
            x, memory, tgt_mask=~causal_mask(6, device=device), tgt_is_causal=True,
            memory_key_padding_mask=~mem_keep,
        )
        for return_weights in (True, False):
            out, self_w, cross_w = ours(
                x, memory, encoder_attention_mask=mem_keep, return_weights=return_weights
            )
            torch.testing.assert_close(out, ref_out, **TOL)
    assert self_w is None and cross_w is None  # return_weights=False on the last pass
    _, self_w, cross_w = ours(x, memory, encoder_attention_mask=mem_keep, return_weights=True)
    assert self_w.shape == (2, H, 6, 6) and cross_w.shape == (2, H, 6, 9)
    assert torch.equal(cross_w[1, ..., 4:], torch.zeros_like(cross_w[1, ..., 4:]))


# ------------------------------------------------------------------------------ bad input

X = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))  # (B, T, D)
MEMORY = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))  # (B, S, D)
KEEP = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # (B, S), 0/1 as a tokenizer gives


@pytest.mark.parametrize("make", [lambda: EncoderBlock(8, 2), lambda: DecoderBlock(8, 2)],
                         ids=["encoder-block", "decoder-block"])
def test_float64_from_numpy_into_a_float32_block_names_the_dtypes_and_the_fix(make):
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 3, 8)))  # float64
    with pytest.raises(ValueError, match=r"^x has dtype torch\.float64.*float32.*x\.float\(\)"):
        make()(x)


def test_an_encoder_block_called_directly_checks_its_masks():
    block = EncoderBlock(8, 2)
    with pytest.raises(ValueError, match=r"^attention_mask .*float32.*attention_mask\.bool\(\)"):
        block(X, attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"^mask has shape \(4, 4\).*\(2, 2, 3, 3\)"):
        block(X, mask=torch.ones(4, 4, dtype=torch.bool))


def test_a_decoder_block_names_the_encoder_inputs():
    cross = DecoderBlock(8, 2, cross_attention=True)
    with pytest.raises(ValueError, match=r"^encoder_hidden_states .*\(2, 5, 6\).*d_model=8"):
        cross(X, torch.randn(2, 5, 6))
    with pytest.raises(ValueError, match=r"^encoder_hidden_states has shape \(1, 5, 8\).*=2"):
        cross(X, MEMORY[:1])  # the batch size of x
    with pytest.raises(ValueError, match=r"^encoder_attention_mask .*float32.*\.bool\(\)"):
        cross(X, MEMORY, encoder_attention_mask=KEEP.float())
    with pytest.raises(ValueError, match=r"^encoder_attention_mask has shape \(2, 4\).*\(2, 5\)"):
        cross(X, MEMORY, encoder_attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="needs encoder_hidden_states"):
        cross(X)


@pytest.mark.parametrize("name, value", [
    ("encoder_hidden_states", MEMORY),
    ("encoder_attention_mask", KEEP.bool()),
])
def test_a_decoder_block_without_cross_attention_refuses_encoder_inputs(name, value):
    with pytest.raises(ValueError, match="no cross-attention.*encoder_hidden_states"):
        DecoderBlock(8, 2)(X, **{name: value})


def test_a_decoder_block_without_cross_attention_names_the_encoder_attention_mask():
    with pytest.raises(ValueError, match="no cross-attention.*encoder_attention_mask"):
        DecoderBlock(8, 2)(X, encoder_attention_mask=KEEP.bool())


def test_a_block_takes_one_layers_cache_not_the_whole_cache():
    with pytest.raises(TypeError, match=r"^past_key_value .*layer.*KVCache"):
        DecoderBlock(8, 2)(MEMORY, past_key_value=KVCache())


@pytest.mark.parametrize("call, error, name", [
    (lambda: EncoderBlock(8, 2, norm_first="no"), TypeError, "norm_first"),
    (lambda: DecoderBlock(8, 2, eps="1e-5"), TypeError, "eps"),
    (lambda: EncoderBlock(8, 2, eps=-1.0), ValueError, "eps"),
    (lambda: DecoderBlock(8, 2, cross_attention="yes"), TypeError, "cross_attention"),
    (lambda: EncoderBlock(8, 2, 0), ValueError, "d_ff"),
    (lambda: EncoderBlock(8, 2)(MEMORY, return_weights="yes"), TypeError, "return_weights"),
    (lambda: DecoderBlock(8, 2)(MEMORY, return_weights=1), TypeError, "return_weights"),
], ids=["norm_first", "eps-type", "eps-value", "cross_attention", "d_ff", "encoder-weights",
        "decoder-weights"])
def test_block_options_are_checked_by_name(call, error, name):
    with pytest.raises(error, match=rf"^{name} must be"):
        call()


# ------------------------------------------------------------ the Llama-style decoder block


def test_a_llama_style_decoder_block_is_causal_and_built_from_its_options():
    torch.manual_seed(0)
    block = DecoderBlock(16, 4, 24, norm="rms", ffn="swiglu", n_kv_heads=1, rope=True,
                         bias=False, eps=1e-6, rope_theta=500.0).eval()
    assert type(block.attn_norm) is type(block.ff_norm) is torch.nn.RMSNorm
    assert block.ff_norm.eps == 1e-6 and block.self_attn.rotary.base == 500.0
    assert block.ff.gate_proj.weight.shape == (24, 16) and block.ff.down_proj.bias is None
    assert block.self_attn.qkv_proj.weight.shape == (16 + 2 * 4, 16)  # one key/value head
    x = torch.randn(2, 6, 16)
    changed = x.clone()
    changed[:, 4:] += 1.0
    a, b = block(x)[0], block(changed)[0]
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize(("options", "error", "match"), [
    (dict(norm="batch"), ValueError, r"^norm .*'layer', 'rms'.*'batch'"),
    (dict(ffn="moe"), ValueError, r"^ffn .*'mlp', 'swiglu'.*'moe'"),
    (dict(n_kv_heads=3), ValueError, r"n_kv_heads=3"),
])
def test_a_decoder_block_names_a_bad_llama_option(options, error, match):
    with pytest.raises(error, match=match):
        DecoderBlock(16, 4, **options)
