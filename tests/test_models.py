"""Encoder and decoder blocks against nn.TransformerEncoderLayer / nn.TransformerDecoderLayer
(weights copied, eval mode), and the full models' behaviour."""

from __future__ import annotations

import pytest
import torch
from conftest import on_devices
from helpers import copy_linear, copy_mha_from_torch, copy_norm
from torch import nn

from course_lib.attention import causal_mask, padding_mask
from course_lib.blocks import DecoderBlock, EncoderBlock
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.generation import sample_next_token
from course_lib.models import (
    DecoderLM,
    Encoder,
    EncoderDecoder,
    count_parameters,
    parameter_breakdown,
)

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
    with torch.no_grad():
        ref_out = ref(x, src_key_padding_mask=~keep)
        out, weights = ours(x, attention_mask=keep, return_weights=True)
        fused, _ = ours(x, attention_mask=keep)
    # PyTorch's fast path fills padded *query* rows with zeros; compare the real tokens.
    torch.testing.assert_close(out[keep], ref_out[keep], **TOL)
    torch.testing.assert_close(fused[keep], ref_out[keep], **TOL)
    assert weights.shape == (3, H, 7, 7)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], ref(x), **TOL)


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


def test_decoder_block_without_cross_attention_rejects_encoder_states():
    block = DecoderBlock(D, H)
    with pytest.raises(ValueError, match="no cross-attention"):
        block(torch.randn(1, 3, D), torch.randn(1, 4, D))
    with pytest.raises(ValueError, match="needs encoder_hidden_states"):
        DecoderBlock(D, H, cross_attention=True)(torch.randn(1, 3, D))


def _gpt(**overrides) -> DecoderLM:
    cfg = dict(vocab_size=20, d_model=16, n_heads=2, n_layers=2, max_len=12)
    cfg.update(overrides)
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**cfg)).eval()


def test_tied_embeddings_share_one_matrix():
    tied = _gpt()
    untied = _gpt(tie_embeddings=False)
    assert tied.lm_head.weight.data_ptr() == tied.embeddings.token.weight.data_ptr()
    assert count_parameters(untied) - count_parameters(tied) == 20 * 16


def test_parameter_count_matches_formula():
    model = _gpt(positions="learned", tie_embeddings=True)
    d, f, v, n, ctx = 16, 64, 20, 2, 12
    attn = 3 * d * d + 3 * d + d * d + d
    ff = d * f + f + f * d + d
    norms = 2 * 2 * d
    expected = v * d + ctx * d + n * (attn + ff + norms) + 2 * d
    assert count_parameters(model) == expected


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "alibi", "rope", "none"])
def test_decoder_loss_near_log_vocab_at_init(positions):
    # An untied output layer starts small, so every model starts near the uniform guess.
    # (Tied to a sinusoidal model's sqrt(D)-scaled token table, the output layer starts out
    # favouring the current token instead; that model is checked for a finite loss.)
    model = _gpt(positions=positions, tie_embeddings=False)
    ids = torch.randint(0, 20, (4, 12))
    out = model(ids, targets=ids)
    assert out.logits.shape == (4, 12, 20)
    assert abs(out.loss.item() - torch.log(torch.tensor(20.0)).item()) < 0.3
    tied = _gpt(positions=positions)(ids, targets=ids).loss
    assert torch.isfinite(tied)


def test_loss_ignores_minus_100_targets():
    model = _gpt()
    ids = torch.randint(0, 20, (2, 6))
    targets = ids.clone()
    targets[:, 3:] = -100
    full = model(ids[:, :3], targets=ids[:, :3]).loss
    partial = model(ids, targets=targets).loss
    torch.testing.assert_close(full, partial)


def test_generation_is_repeatable_and_respects_top_k():
    model = _gpt()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (1, 11)
    assert torch.equal(a[:, :3], prompt)
    # generation past the context length keeps working (the model sees the last max_len)
    long = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0))
    assert long.shape == (1, 23)
    assert model.generate(torch.tensor([4, 5]), 2).shape == (4,)


def test_greedy_and_top_k_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample_next_token(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next_token(logits, top_k=2, generator=gen).item() for _ in range(200)}
    assert draws == {1, 3}
    hot = {sample_next_token(logits, temperature=100.0, generator=gen).item() for _ in range(300)}
    assert hot == {0, 1, 2, 3}


def test_generation_past_the_context_sees_the_last_max_len_tokens():
    model = _gpt()  # max_len 12
    torch.manual_seed(1)
    prompt = torch.randint(0, 20, (2, 30))
    out = model.generate(prompt, 1, temperature=0)
    expected = model(prompt[:, -12:]).logits[:, -1].argmax(-1)
    assert torch.equal(out[:, -1], expected)


def test_greedy_generation_takes_the_argmax():
    model = _gpt()
    prompt = torch.tensor([[3, 1, 4]])
    out = model.generate(prompt, 1, temperature=0)
    assert out[0, -1] == model(prompt).logits[0, -1].argmax()


def test_encoder_returns_hidden_states_and_attentions():
    cfg = EncoderConfig(vocab_size=30, d_model=16, n_heads=4, n_layers=3, max_len=10, pad_id=0)
    enc = Encoder(cfg).eval()
    ids = torch.randint(1, 30, (2, 10))
    ids[1, 6:] = 0
    out = enc(ids, output_attentions=True, output_hidden_states=True)
    assert out.last_hidden_state.shape == (2, 10, 16)
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    # padding is masked automatically from pad_id: no query looks at a pad key
    assert out.attentions[0][1, ..., 6:].abs().max() == 0
    # and real tokens do not depend on what the padding holds
    ids2 = ids.clone()
    ids2[1, 6:] = 7
    mask = ids != 0
    out2 = enc(ids2, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state[mask], out2.last_hidden_state[mask])


def test_encoder_token_types_and_embed_norm():
    cfg = EncoderConfig(vocab_size=30, d_model=16, n_heads=4, n_layers=1, max_len=10,
                        type_vocab_size=2, embed_norm=True, norm_first=False)
    enc = Encoder(cfg).eval()
    ids = torch.randint(0, 30, (1, 6))
    a = enc(ids).last_hidden_state
    b = enc(ids, token_type_ids=torch.ones_like(ids)).last_hidden_state
    assert not torch.allclose(a, b)
    assert enc.final_norm is None  # post-norm stacks end normalised already


def _seq2seq(**overrides) -> EncoderDecoder:
    cfg = dict(src_vocab_size=15, tgt_vocab_size=17, d_model=16, n_heads=2, max_src_len=10,
               max_tgt_len=10, pad_id=0)
    cfg.update(overrides)
    torch.manual_seed(0)
    return EncoderDecoder(EncoderDecoderConfig.shared(**cfg)).eval()


def test_encoder_decoder_shapes_and_cross_attention():
    model = _seq2seq()
    src = torch.randint(1, 15, (2, 8))
    src[1, 5:] = 0
    tgt = torch.randint(1, 17, (2, 6))
    out = model(src, tgt, targets=tgt, output_attentions=True)
    assert out.logits.shape == (2, 6, 17)
    assert len(out.cross_attentions) == 2 and out.cross_attentions[0].shape == (2, 2, 6, 8)
    assert len(out.encoder_attentions) == 2
    assert out.cross_attentions[0][1, ..., 5:].abs().max() == 0  # padded source never read
    assert out.loss is not None


def test_encoder_decoder_generation():
    model = _seq2seq()
    src = torch.randint(1, 15, (3, 7))
    out = model.generate(src, bos_id=1, max_new_tokens=5)
    assert out.shape == (3, 6) and (out[:, 0] == 1).all()
    # greedy decoding equals taking the argmax of a forward pass at each step
    step = model(src, out[:, :-1]).logits.argmax(-1)
    assert torch.equal(step, out[:, 1:])
    # learned target positions cap the new tokens at max_tgt_len (the last decoder input,
    # <bos> plus max_tgt_len - 1 tokens, fits the position table): 1 + 10 ids
    assert model.generate(src, bos_id=1, max_new_tokens=50).shape[1] == 11


def test_encoder_decoder_stops_at_eos():
    model = _seq2seq()
    src = torch.randint(1, 15, (2, 5))
    first = model.generate(src, bos_id=1, max_new_tokens=1)[:, 1]
    eos = int(first[0])
    out = model.generate(src, bos_id=1, max_new_tokens=9, eos_id=eos)
    assert out[0, 1] == eos
    assert (out[0, 1:] == eos).all()  # finished rows are filled with eos


def test_generate_needs_the_right_model():
    model = _seq2seq()
    with pytest.raises(ValueError, match="EncoderDecoder.generate"):
        model.decoder.generate(torch.tensor([[1]]), 2)


def test_parameter_breakdown_adds_up_and_matches_the_formula():
    model = _gpt(tie_embeddings=False)
    parts = parameter_breakdown(model)
    assert sum(parts.values()) == count_parameters(model)
    d, f, n = 16, 64, 2
    assert parts["attention"] == n * (4 * d * d + 4 * d)
    assert parts["feed-forward"] == n * (2 * d * f + f + d)
    assert parts["layer norms"] == n * 4 * d + 2 * d
    assert parts["embeddings"] == 20 * d + 12 * d
    assert parts["output head"] == 20 * d
    assert "output head" not in parameter_breakdown(_gpt())  # tied: counted as embeddings
    seq2seq = _seq2seq()
    assert sum(parameter_breakdown(seq2seq).values()) == count_parameters(seq2seq)
    assert "other" not in parameter_breakdown(seq2seq)


def test_sinusoidal_models_scale_tokens_to_the_size_of_the_positions():
    model = _gpt(positions="sinusoidal", d_model=64, n_heads=4)
    ids = torch.randint(0, 20, (4, 12))
    with torch.no_grad():
        tokens = model.embeddings.token(ids) * model.embeddings.token_scale
    positions = model.embeddings.position(12)
    ratio = float(tokens.pow(2).mean().sqrt() / positions.pow(2).mean().sqrt())
    assert 0.5 < ratio < 3.0  # same order of magnitude, not 35x apart
    assert _gpt(positions="learned").embeddings.token_scale == 1.0
