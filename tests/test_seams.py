"""Arguments that a model forwards to inner modules which skip their own checks: the model
checks them, with the name the learner wrote (src_attention_mask, max_src_len, ...), and a
0/1 integer mask (as Hugging Face tokenizers return) means what a boolean one does."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from course_lib.attention import MultiHeadAttention
from course_lib.blocks import DecoderBlock, EncoderBlock
from course_lib.cache import KVCache, LayerKVCache
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.generation import (
    generate,
    generate_seq2seq,
    sample_next_token,
)
from course_lib.models import DecoderLM, Encoder, EncoderDecoder, lm_loss


def _gpt(**overrides) -> DecoderLM:
    config = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_len=6)
    config.update(overrides)
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**config)).eval()


def _encoder() -> Encoder:
    torch.manual_seed(0)
    return Encoder(EncoderConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1,
                                 max_len=6)).eval()


def _seq2seq() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(EncoderDecoderConfig.shared(
        9, 7, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=5,
        max_tgt_len=4, pad_id=0)).eval()


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # (2, 4)
MEMORY = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))  # (B, S, D)
KEEP = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # (2, 5), 0/1 as a tokenizer gives
SRC = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 0]])  # padded with pad_id 0
TGT = torch.tensor([[1, 2, 3], [1, 4, 5]])


# ------------------------------------------------------------------ a decoder's cross-attention


def test_a_float_encoder_attention_mask_is_refused_not_added_to_the_scores():
    decoder = _gpt(cross_attention=True)
    with pytest.raises(ValueError, match=r"encoder_attention_mask must be a boolean .*float32.*"
                                         r"encoder_attention_mask.bool\(\)"):
        decoder(IDS, encoder_hidden_states=MEMORY, encoder_attention_mask=KEEP.float())


@pytest.mark.parametrize("mask", [KEEP, KEEP.bool()], ids=["0/1 integers", "booleans"])
def test_masked_source_positions_do_not_move_the_decoder(mask):
    decoder = _gpt(cross_attention=True)
    changed = MEMORY.clone()
    changed[0, 3:] = 100.0  # padding positions of the first source
    with torch.no_grad():
        a = decoder(IDS, encoder_hidden_states=MEMORY, encoder_attention_mask=mask).logits
        b = decoder(IDS, encoder_hidden_states=changed, encoder_attention_mask=mask).logits
    assert torch.equal(a, b)


def test_an_encoder_attention_mask_of_the_wrong_shape_is_named():
    decoder = _gpt(cross_attention=True)
    with pytest.raises(ValueError, match=r"encoder_attention_mask has shape \(2, 4\).*\(2, 5\)"):
        decoder(IDS, encoder_hidden_states=MEMORY,
                encoder_attention_mask=torch.ones(2, 4, dtype=torch.bool))


@pytest.mark.parametrize("name, value", [
    ("encoder_hidden_states", MEMORY),
    ("encoder_attention_mask", KEEP.bool()),
])
def test_cross_attention_inputs_to_a_decoder_without_it_are_refused(name, value):
    with pytest.raises(ValueError, match=rf"{name} was given but this decoder has no "
                                         r"cross-attention"):
        _gpt()(IDS, **{name: value})


@pytest.mark.parametrize("states, message", [
    (MEMORY.double(), r"encoder_hidden_states has dtype torch.float64.*\.float\(\)"),
    (MEMORY[:1], r"encoder_hidden_states has size 1 in dimension 0.*batch size of ids is 2"),
    (MEMORY[..., :6], r"encoder_hidden_states has shape \(2, 5, 6\).*d_model=8"),
])
def test_encoder_hidden_states_that_do_not_fit_are_named(states, message):
    with pytest.raises(ValueError, match=message):
        _gpt(cross_attention=True)(IDS, encoder_hidden_states=states)


# ---------------------------------------------------------- 0/1 integer masks at every model


def test_integer_masks_give_the_boolean_masks_results():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    encoder, decoder = _encoder(), _gpt()
    with torch.no_grad():
        torch.testing.assert_close(encoder(IDS, attention_mask=mask).last_hidden_state,
                                   encoder(IDS, attention_mask=mask.bool()).last_hidden_state)
        torch.testing.assert_close(decoder(IDS, attention_mask=mask).logits,
                                   decoder(IDS, attention_mask=mask.bool()).logits)
        model = _seq2seq()
        src_mask, tgt_mask = (SRC != 0).long(), torch.tensor([[1, 1, 0], [1, 1, 1]])
        torch.testing.assert_close(
            model(SRC, TGT, src_attention_mask=src_mask, tgt_attention_mask=tgt_mask).logits,
            model(SRC, TGT, src_attention_mask=src_mask.bool(),
                  tgt_attention_mask=tgt_mask.bool()).logits)
    assert torch.equal(
        generate_seq2seq(model, SRC, bos_id=1, max_new_tokens=3, src_attention_mask=src_mask),
        generate_seq2seq(model, SRC, bos_id=1, max_new_tokens=3,
                         src_attention_mask=src_mask.bool()))


def test_an_integer_mask_with_a_cache_gives_the_boolean_masks_results():
    model = _gpt(pad_id=0)
    ids = torch.tensor([[0, 5, 6]])
    outs = []
    for mask in (torch.tensor([[0, 1, 1, 1]]), torch.tensor([[False, True, True, True]])):
        cache = KVCache()
        with torch.no_grad():
            model(ids, past_key_values=cache)
            outs.append(model(torch.tensor([[7]]), past_key_values=cache,
                              attention_mask=mask).logits)
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("call, name", [
    (lambda: _encoder()(IDS, attention_mask=torch.ones(2, 4)), "attention_mask"),
    (lambda: _gpt()(IDS, attention_mask=torch.ones(2, 4)), "attention_mask"),
    (lambda: _seq2seq()(SRC, TGT, src_attention_mask=torch.ones(2, 5)), "src_attention_mask"),
    (lambda: _seq2seq()(SRC, TGT, tgt_attention_mask=torch.ones(2, 3)), "tgt_attention_mask"),
    (lambda: _seq2seq().encode(SRC, torch.ones(2, 5)), "src_attention_mask"),
    (lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1, max_new_tokens=2,
                              src_attention_mask=torch.ones(2, 5)), "src_attention_mask"),
    (lambda: _gpt()(IDS, past_key_values=KVCache(), attention_mask=torch.ones(2, 4)),
     "attention_mask"),
], ids=["encoder", "decoder", "src", "tgt", "encode", "generate_seq2seq", "cached"])
def test_float_masks_are_refused_by_the_name_the_learner_wrote(call, name):
    with pytest.raises(ValueError, match=rf"^{name} must be a boolean \(or 0/1 integer\) "
                                         r"tensor.*float32"):
        call()


@pytest.mark.parametrize("kwargs, message", [
    ({"src_attention_mask": torch.ones(2, 4, dtype=torch.bool)},
     r"^src_attention_mask has shape \(2, 4\) but should match src's shape \(2, 5\)"),
    ({"tgt_attention_mask": torch.ones(2, 4, dtype=torch.bool)},
     r"^tgt_attention_mask has shape \(2, 4\) but should match tgt's shape \(2, 3\)"),
    ({"targets": torch.ones(2, 2, dtype=torch.long)}, r"targets has shape \(2, 2\).*\(tgt\)"),
])
def test_encoder_decoder_shape_errors_name_its_own_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _seq2seq()(SRC, TGT, **kwargs)


def test_encoder_decoder_length_errors_name_max_src_len_and_max_tgt_len():
    model = _seq2seq()
    with pytest.raises(ValueError, match=r"src has 6 tokens .*max_src_len=5"):
        model(torch.ones(2, 6, dtype=torch.long), TGT)
    with pytest.raises(ValueError, match=r"tgt has 5 tokens .*max_tgt_len=4"):
        model(SRC, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"src has 6 tokens .*max_src_len=5"):
        model.generate(torch.ones(2, 6, dtype=torch.long), bos_id=1, max_new_tokens=2)


@pytest.mark.parametrize("call, name", [
    (lambda: _encoder()(IDS, output_attentions=1), "output_attentions"),
    (lambda: _encoder()(IDS, output_hidden_states="yes"), "output_hidden_states"),
    (lambda: _gpt()(IDS, output_attentions="yes"), "output_attentions"),
    (lambda: _seq2seq()(SRC, TGT, output_attentions=1), "output_attentions"),
    (lambda: EncoderBlock(8, 2)(MEMORY, return_weights="yes"), "return_weights"),
    (lambda: DecoderBlock(8, 2)(MEMORY, return_weights=1), "return_weights"),
])
def test_output_flags_must_be_true_or_false(call, name):
    with pytest.raises(TypeError, match=rf"^{name} must be True or False"):
        call()


def test_int32_targets_give_the_int64_loss():
    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lm_loss(logits, IDS.int()), lm_loss(logits, IDS))
    with pytest.raises(ValueError, match="targets must hold token ids"):
        lm_loss(logits, IDS.float())


def test_the_inner_checks_are_back_after_an_encoder_decoder_call():
    model = _seq2seq()
    model(SRC, TGT)  # runs the encoder and the decoder with their checks off
    with pytest.raises(ValueError, match="attention_mask must be a boolean"):
        model.encoder(SRC, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="ids has 5 tokens"):
        model.decoder(torch.ones(2, 5, dtype=torch.long), encoder_hidden_states=MEMORY)


# ------------------------------------------------------------------------------- the KV cache


def test_a_cache_refuses_another_batch_size_by_name():
    model, cache = _gpt(), KVCache()
    model(IDS, past_key_values=cache)
    with pytest.raises(ValueError, match=r"past_key_values was filled with a batch of 2"):
        model(torch.ones(3, 1, dtype=torch.long), past_key_values=cache)


def test_a_cache_cropped_to_zero_takes_a_new_batch_like_a_fresh_one():
    model, cache = _gpt(), KVCache()
    model(IDS, past_key_values=cache)
    cache.crop(0)
    assert cache.get_seq_length() == 0
    ids = torch.tensor([[1, 2], [3, 4], [5, 6]])
    with torch.no_grad():
        out = model(ids, past_key_values=cache).logits
        torch.testing.assert_close(out, model(ids).logits)
    assert cache.layers[0].keys.shape[0] == 3


def test_a_cache_filled_by_another_model_is_refused_by_name():
    cache = KVCache()
    _gpt()(IDS, past_key_values=cache)  # 2 heads of size 4, 1 layer
    with pytest.raises(ValueError, match=r"past_key_values holds 2 heads of size 4 but this "
                                         r"model has 3 heads of size 4"):
        _gpt(d_model=12, n_heads=3)(IDS[:, :1], past_key_values=cache)
    with pytest.raises(ValueError, match="past_key_values holds 1 layers but this model has 2"):
        _gpt(n_layers=2)(IDS[:, :1], past_key_values=cache)


def test_a_cache_whose_layers_were_cropped_apart_is_refused():
    model, cache = _gpt(n_layers=2), KVCache()
    model(IDS, past_key_values=cache)
    cache.layers[0].crop(2)
    with pytest.raises(ValueError, match=r"past_key_values holds layers of different lengths "
                                         r"\[2, 4\]"):
        model(IDS[:, :1], past_key_values=cache)


def test_a_layer_cache_refuses_keys_of_another_shape():
    cache = LayerKVCache()
    cache.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"past_key_value holds keys of 2 sequences.*"
                                         r"\(3, 2, 1, 4\)"):
        cache.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    layer = MultiHeadAttention(12, 3)  # 3 heads of size 4
    with pytest.raises(ValueError, match="past_key_value holds keys of 2 sequences with 2 heads"):
        layer(torch.randn(2, 1, 12), is_causal=True, past_key_value=cache)
    with pytest.raises(TypeError, match="max_length must be an integer"):
        cache.crop("1")


def test_a_block_takes_one_layers_cache_not_the_whole_cache():
    with pytest.raises(TypeError, match=r"past_key_value must be one layer's cache.*got KVCache"):
        DecoderBlock(8, 2)(MEMORY, past_key_value=KVCache())


# ----------------------------------------------------------------------- blocks called directly


def test_a_decoder_block_names_the_encoder_attention_mask():
    cross = DecoderBlock(8, 2, cross_attention=True)
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="encoder_attention_mask must be a boolean tensor"):
        cross(x, MEMORY, encoder_attention_mask=KEEP.float())
    with pytest.raises(ValueError, match=r"encoder_attention_mask has shape \(2, 4\).*\(2, 5\)"):
        cross(x, MEMORY, encoder_attention_mask=torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"encoder_hidden_states has size 1 .*batch size of x"):
        cross(x, MEMORY[:1])
    with pytest.raises(ValueError, match="encoder_attention_mask= was given but this decoder "
                                         "block has no cross-attention"):
        DecoderBlock(8, 2)(x, encoder_attention_mask=KEEP.bool())


@pytest.mark.parametrize("build, name", [
    (lambda: EncoderBlock(8, 2, norm_first="no"), "norm_first"),
    (lambda: DecoderBlock(8, 2, eps="1e-5"), "eps"),
    (lambda: EncoderBlock(8, 2, eps=-1.0), "eps"),
    (lambda: DecoderBlock(8, 2, cross_attention="yes"), "cross_attention"),
])
def test_block_options_that_only_the_configs_checked_are_checked(build, name):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        build()


def test_a_cache_layer_index_must_be_an_integer():
    with pytest.raises(TypeError, match=r"layer_idx must be an integer >= 0, got 1.0"):
        KVCache().update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), 1.0)


# ------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("make, message", [
    (_seq2seq, r"model must be a decoder language model .*got EncoderDecoder.*generate_seq2seq"),
    (_encoder, r"model must be a decoder language model.*got Encoder"),
    (lambda: torch.nn.Linear(2, 2), r"model must be a decoder language model.*got Linear"),
])
def test_generate_says_which_models_it_serves(make, message):
    with pytest.raises(TypeError, match=message):
        generate(make(), IDS, 2)


def test_generate_with_a_cache_needs_a_model_that_takes_one():
    class Bigram(torch.nn.Module):  # a model of one's own: generate reads its config
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 11)
            self.config = DecoderConfig(vocab_size=11, d_model=8, n_heads=2, max_len=6)

        def forward(self, ids):
            return SimpleNamespace(logits=self.table(ids))

    assert generate(Bigram(), IDS, 2).shape == (2, 6)
    with pytest.raises(ValueError, match=r"use_cache=True needs a model whose forward takes "
                                         r"past_key_values="):
        generate(Bigram(), IDS, 2, use_cache=True)


def test_generate_refuses_a_decoder_that_needs_an_encoder():
    with pytest.raises(ValueError, match=r"EncoderDecoder.generate \(generate_seq2seq\)"):
        generate(_gpt(cross_attention=True), IDS, 2)


@pytest.mark.parametrize("call", [
    lambda: generate(_gpt(), IDS, 2, generator=42),
    lambda: _gpt().generate(IDS, 2, generator=42),
    lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1, max_new_tokens=2, temperature=1.0,
                             generator=42),
    lambda: sample_next_token(torch.zeros(1, 3), generator=42),
], ids=["generate", "DecoderLM.generate", "generate_seq2seq", "sample_next_token"])
def test_a_seed_instead_of_a_generator_is_refused_by_name(call):
    with pytest.raises(TypeError, match=r"^generator must be a torch.Generator or None, got 42"):
        call()


def test_generate_seq2seq_checks_its_model_and_ids():
    with pytest.raises(TypeError, match=r"model must be an EncoderDecoder, got DecoderLM.*"
                                        r"generate\(model, ids"):
        generate_seq2seq(_gpt(), IDS, bos_id=1, max_new_tokens=2)
    model = _seq2seq()
    with pytest.raises(ValueError, match="src must hold integer token ids"):
        generate_seq2seq(model, SRC.float(), bos_id=1, max_new_tokens=2)
    with pytest.raises(TypeError, match=r"bos_id must be an integer >= 0, got 1.0"):
        generate_seq2seq(model, SRC, bos_id=1.0, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"eos_id must be a target token id in 0..6, got 7"):
        generate_seq2seq(model, SRC, bos_id=1, eos_id=7, max_new_tokens=2)
    out = generate_seq2seq(model, SRC, bos_id=np.int64(1), max_new_tokens=2)  # numpy ints
    assert out.shape == (2, 3) and (out[:, 0] == 1).all()


def test_attention_takes_one_layers_cache_not_the_whole_cache():
    from course_lib import MultiHeadAttention

    attention = MultiHeadAttention(8, 2)
    with pytest.raises(TypeError, match="past_key_value must be one layer's cache"):
        attention(torch.randn(1, 3, 8), past_key_value=KVCache())


def test_mean_pool_takes_a_0_1_integer_mask_like_the_models():
    from course_lib.pretrained import mean_pool

    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(mean_pool(hidden, mask), mean_pool(hidden, mask.bool()))
    with pytest.raises(ValueError, match="attention_mask must be a boolean"):
        mean_pool(hidden, mask.float())
    with pytest.raises(ValueError, match="attention_mask has shape"):
        mean_pool(hidden, mask[:, :3])


def test_count_parameters_refuses_a_truthy_string():
    from course_lib import count_parameters

    with pytest.raises(TypeError, match="trainable_only"):
        count_parameters(torch.nn.Linear(2, 2), trainable_only="yes")
