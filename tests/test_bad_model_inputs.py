"""What a learner gets wrong when calling the attention layers, blocks, models and generation,
and the message each mistake must produce: the exception type, the argument's name, what was
received and what was expected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.attention import MultiHeadAttention, scaled_dot_product_attention
from course_lib.blocks import DecoderBlock, EncoderBlock
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.generation import sample_next_token
from course_lib.layers import FeedForward, LayerNorm, layer_norm
from course_lib.models import DecoderLM, Encoder, EncoderDecoder


def _gpt(**overrides) -> DecoderLM:
    config = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_len=6)
    config.update(overrides)
    return DecoderLM(DecoderConfig(**config))


def _seq2seq() -> EncoderDecoder:
    return EncoderDecoder(EncoderDecoderConfig.shared(
        9, 7, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=5,
        max_tgt_len=4, pad_id=0))


# ------------------------------------------------------------------------------ mixed dtypes


@pytest.mark.parametrize("make", [
    lambda: MultiHeadAttention(8, 2),
    lambda: FeedForward(8),
    lambda: LayerNorm(8),
    lambda: EncoderBlock(8, 2),
    lambda: DecoderBlock(8, 2),
], ids=["attention", "feed-forward", "layernorm", "encoder-block", "decoder-block"])
def test_float64_from_numpy_into_a_float32_layer_names_the_dtypes_and_the_fix(make):
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 3, 8)))  # float64
    layer = make()
    with pytest.raises(ValueError, match=r"x has dtype torch.float64 but .* torch.float32: "
                                         r"convert it with x.float\(\) \(numpy arrays"):
        layer(x)


def test_integer_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="x must be a floating-point tensor, got dtype torch.int64"):
        FeedForward(4)(torch.ones(2, 4, dtype=torch.long))
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="k must be a floating-point tensor.*torch.int64"):
        scaled_dot_product_attention(q, q.long(), q)
    with pytest.raises(ValueError, match=r"q has dtype torch.float32 but v has dtype torch.float64"):
        scaled_dot_product_attention(q, q, q.double())


def test_queries_and_keys_with_different_batch_sizes():
    q, kv = torch.randn(2, 3, 4), torch.randn(5, 3, 4)
    with pytest.raises(ValueError, match=r"q has shape \(2, 3, 4\) and k has shape \(5, 3, 4\).*"
                                         r"leading .* must match"):
        scaled_dot_product_attention(q, kv, kv)


def test_layer_norm_weights_of_the_wrong_size():
    x = torch.randn(2, 5)
    with pytest.raises(ValueError, match=r"weight has shape \(4,\) but x has 5 features.*\(5,\)"):
        layer_norm(x, torch.ones(4))
    with pytest.raises(ValueError, match=r"bias has shape \(5, 1\)"):
        layer_norm(x, torch.ones(5), torch.zeros(5, 1))


# ------------------------------------------------------------------------- sizes and configs


@pytest.mark.parametrize("build,name", [
    (lambda: MultiHeadAttention(0, 1), "d_model"),
    (lambda: MultiHeadAttention(8, -2), "n_heads"),
    (lambda: FeedForward(8, 0), "d_ff"),
    (lambda: LayerNorm(-3), "d_model"),
    (lambda: EncoderBlock(8, 2, 0), "d_ff"),
    (lambda: DecoderConfig(vocab_size=5, max_len=64.0), "max_len"),
    (lambda: DecoderConfig(vocab_size=5, max_len="64"), "max_len"),
    (lambda: DecoderConfig(vocab_size=5, n_layers=0), "n_layers"),
    (lambda: EncoderConfig(vocab_size=5, d_ff=-1), "d_ff"),
], ids=["mha-d_model", "mha-heads", "ffn-width", "ln-size", "block-ffn", "float-max_len",
        "string-max_len", "zero-layers", "negative-d_ff"])
def test_sizes_must_be_positive_integers(build, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got"):
        build()


def test_config_values_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"dropout must be a number in \[0, 1\), got .0.1."):
        DecoderConfig(vocab_size=5, dropout="0.1")
    with pytest.raises(TypeError, match="norm_first must be True or False, got 'yes'"):
        EncoderConfig(vocab_size=5, norm_first="yes")
    with pytest.raises(ValueError, match="layer_norm_eps must be a number > 0, got 0"):
        EncoderConfig(vocab_size=5, layer_norm_eps=0)
    with pytest.raises(ValueError, match="activation must be one of 'relu', 'gelu', 'gelu_tanh'; got 'swish'"):
        FeedForward(8, activation="swish")
    with pytest.raises(TypeError, match="encoder must be an EncoderConfig, got DecoderConfig"):
        EncoderDecoderConfig(DecoderConfig(vocab_size=5), DecoderConfig(vocab_size=5))
    with pytest.raises(ValueError, match=r"encoder.d_model=8 but decoder.d_model=16"):
        EncoderDecoderConfig(EncoderConfig(vocab_size=5, d_model=8, n_heads=2),
                             DecoderConfig(vocab_size=5, d_model=16, n_heads=2))


def test_a_pad_id_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"pad_id must be None or a token id in 0..4 "
                                         r"\(vocab_size=5\), got 5"):
        DecoderConfig(vocab_size=5, pad_id=5)
    with pytest.raises(ValueError, match="pad_id"):
        EncoderDecoderConfig.shared(5, 6, pad_id=-1)


# -------------------------------------------------------------------------- models' inputs


def test_token_type_ids_for_a_model_without_segments_are_refused():
    model = Encoder(EncoderConfig(vocab_size=7, d_model=8, n_heads=2))
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="token_type_ids was given but .*type_vocab_size=0"):
        model(ids, token_type_ids=torch.zeros_like(ids))
    segments = Encoder(EncoderConfig(vocab_size=7, d_model=8, n_heads=2, type_vocab_size=2))
    with pytest.raises(ValueError, match=r"token_type_ids holds ids from 0 to 2.*0..1"):
        segments(ids, token_type_ids=torch.tensor([[0, 1, 2]]))


def test_loss_targets_that_are_floats_or_outside_the_vocabulary():
    model = _gpt()
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="targets must hold integer token ids .*torch.float32"):
        model(ids, targets=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"targets holds 11, outside the vocabulary 0..10 "
                                         r"\(use -100"):
        model(ids, targets=torch.full((2, 4), 11))
    with pytest.raises(ValueError, match=r"targets has shape \(2, 3\) but the input ids have "
                                         r"shape \(2, 4\)"):
        model(ids, targets=torch.zeros(2, 3, dtype=torch.long))
    ignored = torch.full((2, 4), -100)
    ignored[:, 0] = 3
    assert torch.isfinite(model(ids, targets=ignored).loss)  # -100 is allowed


def test_encoder_decoder_errors_name_src_tgt_and_the_limit():
    model = _seq2seq()
    src, tgt = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"src has 6 tokens .* max_src_len=5"):
        model(torch.ones(2, 6, dtype=torch.long), tgt)
    with pytest.raises(ValueError, match=r"tgt has 5 tokens .* max_tgt_len=4"):
        model(src, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"src holds ids from 1 to 9.*0..8"):
        model(torch.tensor([[1, 9]]), tgt[:1])
    with pytest.raises(ValueError, match=r"tgt holds ids from 1 to 7.*0..6"):
        model(src[:1], torch.tensor([[1, 7]]))
    with pytest.raises(ValueError, match="src has batch size 2 but tgt has batch size 1"):
        model(src, tgt[:1])
    with pytest.raises(ValueError, match=r"bos_id must be a target token id in 0..6, got 7"):
        model.generate(src, bos_id=7, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"src has 6 tokens"):
        model.generate(torch.ones(1, 6, dtype=torch.long), bos_id=1, max_new_tokens=2)


def test_generate_refuses_an_empty_prompt_and_bad_sampling_options():
    model = _gpt()
    with pytest.raises(ValueError, match=r"ids is empty \(shape \(1, 0\)\)"):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 3)
    with pytest.raises(ValueError, match=r"ids is empty"):
        model.generate(torch.tensor([], dtype=torch.long), 3)
    prompt = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="temperature must be a number >= 0 .*got None"):
        model.generate(prompt, 3, temperature=None)
    with pytest.raises(ValueError, match="top_k must be a positive integer, got 0"):
        model.generate(prompt, 3, top_k=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 2.5"):
        model.generate(prompt, 2.5)
    with pytest.raises(TypeError, match="temperature"):
        sample_next_token(torch.zeros(1, 3), temperature="hot")


# ------------------------------------------------ checks skipped inside, never for the caller


def test_a_block_called_directly_checks_its_masks():
    block = EncoderBlock(8, 2)
    with pytest.raises(ValueError, match="attention_mask must be a boolean tensor"):
        block(torch.randn(2, 3, 8), attention_mask=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask has shape \(4, 4\), which does not broadcast"):
        block(torch.randn(2, 3, 8), mask=torch.ones(4, 4, dtype=torch.bool))
    cross = DecoderBlock(8, 2, cross_attention=True)
    with pytest.raises(ValueError, match=r"encoder_hidden_states has shape \(2, 5, 6\) but its "
                                         r"last dimension "
                                         r"should be d_model=8"):
        cross(torch.randn(2, 3, 8), torch.randn(2, 5, 6))


def test_checks_skipped_inside_a_model_are_back_for_the_next_call():
    model = _gpt()
    model(torch.zeros(1, 4, dtype=torch.long))  # runs its blocks with the inner checks off
    attention = model.blocks[0].self_attn
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        attention(torch.zeros(1, 4, 8, dtype=torch.float64))

    def fail(*_):
        raise RuntimeError("a failure inside the model")

    handle = model.blocks[0].ff.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="a failure inside"):  # must not leave checks off
        model(torch.zeros(1, 4, dtype=torch.long))
    handle.remove()
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        attention(torch.zeros(1, 4, 8, dtype=torch.float64))


def test_forward_hooks_still_see_every_inner_module():
    model = _gpt(n_layers=2)
    seen = []
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: seen.append(name))
    model(torch.zeros(1, 4, dtype=torch.long))
    for i in range(2):
        assert {f"blocks.{i}.self_attn", f"blocks.{i}.ff", f"blocks.{i}.attn_norm",
                f"blocks.{i}.ff_norm"} <= set(seen)
