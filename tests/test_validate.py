"""The generic argument rules of course_lib._validate, held across the public functions of
several modules: numpy integers are sizes and ids, bools are not ints, truthy strings are not
flags, float masks are refused, a wrong type is a plain TypeError, and every message names the
argument (and the expected value). Checks skipped inside a model are back for the next call."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib._validate import (
    check_positive_ints,
    checks_wanted,
    inputs_checked,
    require_bool,
    require_id,
    require_id_list,
    require_int,
    require_padding_mask,
)
from course_lib.attention import MultiHeadAttention, as_bool_mask, scaled_dot_product_attention
from course_lib.blocks import DecoderBlock, EncoderBlock
from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig, TransformerConfig
from course_lib.corpus import train_val_split
from course_lib.efficient import chunked_attention, sliding_window_attention
from course_lib.generation import generate, generate_seq2seq, sample_next_token
from course_lib.layers import FeedForward, LayerNorm, RMSNorm
from course_lib.models import DecoderLM, Encoder, EncoderDecoder
from course_lib.positions import LearnedPositionalEmbedding, alibi_slopes
from course_lib.rnn import ElmanRNN
from course_lib.tasks import copy_task, recall_task, word_order_task
from course_lib.tokenizer import CharTokenizer, Seq2SeqVocab
from course_lib.train import lm_batches


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


Q = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # (B, T, Dh)
IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # (2, 4)
MEMORY = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))  # (B, S, D)
SRC = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 0]])  # padded with pad_id 0
TGT = torch.tensor([[1, 2, 3], [1, 4, 5]])


# ---------------------------------------------------------------------- the helpers themselves


@pytest.mark.parametrize("value", [np.int64(3), np.int32(3), np.uint8(3), 3])
def test_numpy_integers_are_integers(value):
    assert require_int("n", value, minimum=1) == 3 and type(require_int("n", value)) is int
    assert require_id("token", value, 5) == 3
    assert require_id_list("ids", np.array([value, 0]), 5) == [3, 0]


@pytest.mark.parametrize("value", [True, False, 3.0, "3", torch.tensor(3), None])
def test_bools_floats_strings_and_tensors_are_not_integers(value):
    with pytest.raises(TypeError, match=r"n_layers.*integer") as info:
        check_positive_ints(d_model=8, n_layers=value)
    assert not isinstance(info.value, ValueError)


@pytest.mark.parametrize("value", ["True", "False", "yes", 1, 0, None])
def test_truthy_values_are_not_flags(value):
    with pytest.raises(TypeError, match=r"normalize.*True or False"):
        require_bool("normalize", value)


def test_padding_masks_take_bool_and_0_1_integers_and_refuse_floats():
    keep = torch.tensor([[1, 1, 0]])
    require_padding_mask("attention_mask", keep, (1, 3), "(B, S)")  # accepted as it is
    require_padding_mask("attention_mask", keep.bool(), (1, 3), "(B, S)")
    assert torch.equal(as_bool_mask(keep), keep.bool())  # the one conversion, in attention.py
    assert as_bool_mask(None) is None
    with pytest.raises(ValueError, match=r"attention_mask.*bool.*float32"):
        require_padding_mask("attention_mask", keep.float(), (1, 3), "(B, S)")
    with pytest.raises(ValueError, match=r"attention_mask.*\(1, 2\)"):
        require_padding_mask("attention_mask", keep[:, :2], (1, 3), "(B, S)")


def test_checks_are_off_only_inside_inputs_checked():
    assert checks_wanted()
    with pytest.raises(RuntimeError, match="inside"):
        with inputs_checked():
            assert not checks_wanted()  # the caller checked: module checks return at once
            with inputs_checked():
                pass
            assert not checks_wanted()  # a nested block leaves the outer one off
            raise RuntimeError("an error inside the block")
    assert checks_wanted()  # and an error does not leave them off


# ------------------------------------------------------------------ a wrong type is a TypeError


def test_a_wrong_type_is_a_plain_type_error():
    with pytest.raises(TypeError, match="max_len") as info:
        LearnedPositionalEmbedding(64.0, 8)
    assert not isinstance(info.value, ValueError)


def test_numpy_integers_are_sizes_too():
    assert ElmanRNN(np.int64(3), np.int64(4))(torch.randn(2, 3))[0].shape == (2, 4)
    assert alibi_slopes(np.int64(4)).shape == (4,)


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
    with pytest.raises(ValueError, match=r"x .*torch.float64.*torch.float32.*x\.float\(\)"):
        layer(x)


# ------------------------------------------------------------------------- sizes and configs


@pytest.mark.parametrize("build, error, name", [
    (lambda: MultiHeadAttention(0, 1), ValueError, "d_model"),
    (lambda: MultiHeadAttention(8, -2), ValueError, "n_heads"),
    (lambda: FeedForward(8, 0), ValueError, "d_ff"),
    (lambda: LayerNorm(-3), ValueError, "d_model"),
    (lambda: EncoderBlock(8, 2, 0), ValueError, "d_ff"),
    (lambda: DecoderConfig(vocab_size=5, max_len=64.0), TypeError, "max_len"),
    (lambda: DecoderConfig(vocab_size=5, max_len="64"), TypeError, "max_len"),
    (lambda: DecoderConfig(vocab_size=5, n_layers=0), ValueError, "n_layers"),
    (lambda: EncoderConfig(vocab_size=5, d_ff=-1), ValueError, "d_ff"),
], ids=["mha-d_model", "mha-heads", "ffn-width", "ln-size", "block-ffn", "float-max_len",
        "string-max_len", "zero-layers", "negative-d_ff"])
def test_sizes_must_be_positive_integers(build, error, name):
    with pytest.raises(error, match=rf"{name}.*integer >= 1, got"):
        build()


@pytest.mark.parametrize("call, name", [
    (lambda: lm_batches(torch.arange(50), 2, 4.0), "block_size"),
    (lambda: recall_task(4, 3.0), "distance"),
    (lambda: word_order_task(4, max_adjectives=True), "max_adjectives"),
    (lambda: copy_task(4, seed=1.5), "seed"),
    (lambda: copy_task(4, generator=3), "generator"),
    (lambda: train_val_split(torch.arange(50), "0.1"), "val_fraction"),
])
def test_sizes_counts_and_seeds_must_have_the_right_type(call, name):
    with pytest.raises(TypeError, match=name):
        call()


# --------------------------------------------------------------- truthy strings for booleans

BOOLEAN_OPTIONS = {
    "MultiHeadAttention bias": (lambda v: MultiHeadAttention(8, 2, bias=v), "bias"),
    "MultiHeadAttention rope": (lambda v: MultiHeadAttention(8, 2, rope=v), "rope"),
    "forward is_causal": (lambda v: MultiHeadAttention(8, 2)(Q, is_causal=v), "is_causal"),
    "forward return_weights": (lambda v: MultiHeadAttention(8, 2)(Q, return_weights=v),
                               "return_weights"),
    "FeedForward bias": (lambda v: FeedForward(8, bias=v), "bias"),
    "LayerNorm elementwise_affine": (lambda v: LayerNorm(8, elementwise_affine=v),
                                     "elementwise_affine"),
    "LayerNorm bias": (lambda v: LayerNorm(8, bias=v), "bias"),
    "RMSNorm elementwise_affine": (lambda v: RMSNorm(8, elementwise_affine=v),
                                   "elementwise_affine"),
    "chunked_attention is_causal": (
        lambda v: chunked_attention(Q, Q, Q, block_size=2, is_causal=v), "is_causal"),
    "sliding_window_attention is_causal": (
        lambda v: sliding_window_attention(Q, Q, Q, window=2, is_causal=v), "is_causal"),
    "TransformerConfig norm_first": (lambda v: TransformerConfig(vocab_size=5, norm_first=v),
                                     "norm_first"),
    "EncoderConfig embed_norm": (lambda v: EncoderConfig(vocab_size=5, embed_norm=v),
                                 "embed_norm"),
    "DecoderConfig tie_embeddings": (lambda v: DecoderConfig(vocab_size=5, tie_embeddings=v),
                                     "tie_embeddings"),
    "Encoder output_attentions": (lambda v: _encoder()(IDS, output_attentions=v),
                                  "output_attentions"),
    "Encoder output_hidden_states": (lambda v: _encoder()(IDS, output_hidden_states=v),
                                     "output_hidden_states"),
    "DecoderLM output_attentions": (lambda v: _gpt()(IDS, output_attentions=v),
                                    "output_attentions"),
    "EncoderDecoder output_attentions": (lambda v: _seq2seq()(SRC, TGT, output_attentions=v),
                                         "output_attentions"),
    "EncoderBlock return_weights": (lambda v: EncoderBlock(8, 2)(MEMORY, return_weights=v),
                                    "return_weights"),
    "DecoderBlock return_weights": (lambda v: DecoderBlock(8, 2)(MEMORY, return_weights=v),
                                    "return_weights"),
}


@pytest.mark.parametrize("value", ["post", "False", "yes", 0, 1, None])
@pytest.mark.parametrize("option", sorted(BOOLEAN_OPTIONS))
def test_boolean_options_refuse_anything_but_true_and_false(option, value):
    build, name = BOOLEAN_OPTIONS[option]
    with pytest.raises(TypeError, match=rf"^{name}.*True or False"):
        build(value)


# ------------------------------------------------------------------------ float masks by name


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
    (lambda: MultiHeadAttention(8, 2)(Q, attention_mask=torch.ones(2, 6)), "attention_mask"),
], ids=["encoder", "decoder", "src", "tgt", "encode", "generate_seq2seq", "cached", "attention"])
def test_float_masks_are_refused_by_the_name_the_learner_wrote(call, name):
    with pytest.raises(ValueError, match=rf"^{name} .*bool.*float32"):
        call()


def test_a_float_mask_where_a_boolean_one_is_expected_names_attn_bias_as_the_fix():
    with pytest.raises(ValueError, match=r"^mask .*boolean.*float32.*attn_bias"):
        scaled_dot_product_attention(Q, Q, Q, mask=torch.ones(6, 6))


# ----------------------------------------------------------------- a seed is not a generator


@pytest.mark.parametrize("call", [
    lambda: generate(_gpt(), IDS, 2, generator=42),
    lambda: _gpt().generate(IDS, 2, generator=42),
    lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1, max_new_tokens=2, temperature=1.0,
                             generator=42),
    lambda: sample_next_token(torch.zeros(1, 3), generator=42),
], ids=["generate", "DecoderLM.generate", "generate_seq2seq", "sample_next_token"])
def test_a_seed_instead_of_a_generator_is_refused_by_name(call):
    with pytest.raises(TypeError, match=r"^generator .*torch.Generator.*42"):
        call()


# ------------------------------------------------------- out-of-range ids (require_id_list)

TASK = copy_task(4, 3, n_symbols=4)  # vocabulary: 4 symbols and "|"
WORDS = word_order_task(2)
VOCAB = Seq2SeqVocab(("<pad>", "<bos>", "<eos>", "a", "b"))
DECODERS = {
    "CharTokenizer.decode": (CharTokenizer("abc").decode, 3),
    "Seq2SeqVocab.labels": (VOCAB.labels, VOCAB.vocab_size),
    "LMTask.decode": (TASK.decode, 5),
    "AlignedTranslationTask.words": (WORDS.words, WORDS.vocab.vocab_size),
}


@pytest.mark.parametrize("bad", ["too large", "negative"])
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_every_decoder_names_an_out_of_range_id_and_the_vocabulary_size(decoder, bad):
    decode, size = DECODERS[decoder]
    wrong = size if bad == "too large" else -1
    with pytest.raises(ValueError, match=rf"ids\[1\] is {wrong}\b.*0\.\.{size - 1}.*{size}"):
        decode([0, wrong])
    with pytest.raises(ValueError, match=rf"ids\[0\] is {wrong}"):
        decode(torch.tensor([wrong, 0]))


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_decoders_refuse_float_ids_and_accept_numpy_ints(decoder):
    decode, _ = DECODERS[decoder]
    with pytest.raises(ValueError, match=r"ids .*integer.*ids\.long\(\)"):
        decode(torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match=r"ids\[0\] must be an integer.*1\.0"):
        decode([1.0])
    assert decode(np.array([0, 1])) == decode([0, 1])
