"""Categories of bad input that used to give silent nonsense or a deep traceback: scales <= 0,
non-integer sizes, float token streams, inconsistent learning-rate schedules, truthy strings
for booleans and out-of-range ids. Each must now fail at the call, naming the argument."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from course_lib._validate import WrongTypeError
from course_lib.attention import (
    MultiHeadAttention,
    attention_scores,
    padding_mask,
    scaled_dot_product_attention,
)
from course_lib.configs import DecoderConfig, EncoderConfig, TransformerConfig
from course_lib.corpus import get_batch, train_val_split
from course_lib.efficient import chunked_attention, low_rank_attention, sliding_window_attention
from course_lib.layers import FeedForward, LayerNorm, RMSNorm
from course_lib.rnn import RNNEncoderDecoder
from course_lib.tasks import copy_task, date_task, date_vocab, recall_task, word_order_task
from course_lib.tokenizer import IGNORE_INDEX, CharTokenizer, Seq2SeqVocab
from course_lib.train import TrainConfig, lm_batches, lr_schedule

Q = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # (B, T, Dh)

# ------------------------------------------------------------------------------- scales <= 0

SCALED = {
    "scaled_dot_product_attention": lambda s: scaled_dot_product_attention(Q, Q, Q, scale=s),
    "attention_scores": lambda s: attention_scores(Q, Q, scale=s),
    "chunked_attention": lambda s: chunked_attention(Q, Q, Q, block_size=4, scale=s),
    "sliding_window_attention": lambda s: sliding_window_attention(Q, Q, Q, window=2, scale=s),
    "low_rank_attention": lambda s: low_rank_attention(Q, Q, Q, torch.randn(3, 6), scale=s),
}


@pytest.mark.parametrize("name", sorted(SCALED))
@pytest.mark.parametrize("scale", [1 // math.sqrt(8), -0.5, float("nan")])
def test_a_scale_of_zero_or_less_is_refused_with_the_usual_formula(name, scale):
    with pytest.raises(ValueError, match=r"scale must be a number > 0.*1 / math\.sqrt"):
        SCALED[name](scale)


@pytest.mark.parametrize("scale", ["0.35", True, torch.tensor(0.35)])
def test_a_scale_that_is_not_a_number_is_a_type_error(scale):
    with pytest.raises(WrongTypeError, match="scale must be a number > 0"):
        scaled_dot_product_attention(Q, Q, Q, scale=scale)


def test_a_positive_scale_still_works():
    out, weights = scaled_dot_product_attention(Q, Q, Q, scale=1 / math.sqrt(8))
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(Q, Q, Q))


# ------------------------------------------------------------------------ non-integer sizes


@pytest.mark.parametrize("max_len", [4.5, 4.0, True, "4"])
def test_padding_mask_refuses_a_max_len_that_is_not_an_int(max_len):
    with pytest.raises(WrongTypeError, match="max_len must be an integer"):
        padding_mask([2, 3], max_len)


def test_padding_mask_still_takes_numpy_ints():
    assert padding_mask([2, 3], np.int64(4)).shape == (2, 4)


@pytest.mark.parametrize("call, name", [
    (lambda: lm_batches(torch.arange(50), 2, 4.0), "block_size"),
    (lambda: recall_task(4, 3.0), "distance"),
    (lambda: word_order_task(4, max_adjectives=True), "max_adjectives"),
    (lambda: date_task(4, first_year=1950.5), "first_year"),
    (lambda: date_task(4, last_year=2000.0), "last_year"),
    (lambda: copy_task(4, seed=1.5), "seed"),
    (lambda: copy_task(4, generator=3), "generator"),
    (lambda: train_val_split(torch.arange(50), "0.1"), "val_fraction"),
])
def test_sizes_counts_and_seeds_must_have_the_right_type(call, name):
    with pytest.raises(WrongTypeError, match=name):
        call()


# ------------------------------------------------------------------------ float token data


def test_get_batch_refuses_a_float_token_stream():
    data = torch.rand(100)  # cast to long, every id would be 0
    with pytest.raises(ValueError, match=r"data must hold token ids.*data\.long\(\)"):
        get_batch(data, 2, 4)
    with pytest.raises(ValueError, match="data must hold token ids"):
        lm_batches(data, 2, 4)


def test_get_batch_still_takes_int32_ids():
    x, y = get_batch(torch.arange(100, dtype=torch.int32), 2, 4)
    assert x.dtype == torch.long and torch.equal(y[:, :-1], x[:, 1:])


# ------------------------------------------------------------------ inconsistent schedules


def test_a_warm_up_longer_than_the_run_is_refused():
    with pytest.raises(ValueError, match=r"warmup_iters=500 .*max_iters=100"):
        TrainConfig(max_iters=100, warmup_iters=500)
    with pytest.raises(ValueError, match=r"warmup_iters=100 \(its default\).*max_iters=50"):
        TrainConfig(max_iters=50)


def test_a_decay_that_ends_before_the_warm_up_is_refused():
    with pytest.raises(ValueError, match=r"lr_decay_iters=200 .*warmup_iters=500"):
        TrainConfig(max_iters=1000, warmup_iters=500, lr_decay_iters=200)
    with pytest.raises(ValueError, match=r"decay_iters=5 .*warmup_iters=10"):
        lr_schedule(0, lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=5)
    with pytest.raises(ValueError, match=r"min_lr=0.01 .*lr=0.001"):
        lr_schedule(0, lr=1e-3, min_lr=1e-2, warmup_iters=1, decay_iters=5)


def test_consistent_edge_cases_of_the_schedule_are_accepted():
    # evaluating only at the end, a warm-up as long as the run, a decay beyond the run
    TrainConfig(max_iters=10, warmup_iters=1, eval_interval=250)
    config = TrainConfig(max_iters=10, warmup_iters=10, lr=1e-3)
    assert config.lr_at(9) == pytest.approx(1e-3)  # the peak is reached at the last update
    TrainConfig(max_iters=100, warmup_iters=10, lr_decay_iters=500)
    TrainConfig(max_iters=100, warmup_iters=10, lr_decay_iters=10)


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
    "chunked_attention causal": (lambda v: chunked_attention(Q, Q, Q, block_size=2, causal=v),
                                 "causal"),
    "sliding_window_attention causal": (
        lambda v: sliding_window_attention(Q, Q, Q, window=2, causal=v), "causal"),
    "TransformerConfig norm_first": (lambda v: TransformerConfig(vocab_size=5, norm_first=v),
                                     "norm_first"),
    "EncoderConfig embed_norm": (lambda v: EncoderConfig(vocab_size=5, embed_norm=v),
                                 "embed_norm"),
    "DecoderConfig tie_embeddings": (lambda v: DecoderConfig(vocab_size=5, tie_embeddings=v),
                                     "tie_embeddings"),
    "Seq2SeqVocab.decode strip": (lambda v: date_vocab().decode([3, 4], strip=v), "strip"),
}


@pytest.mark.parametrize("value", ["post", "False", 0, None])
@pytest.mark.parametrize("option", sorted(BOOLEAN_OPTIONS))
def test_boolean_options_refuse_anything_but_true_and_false(option, value):
    build, name = BOOLEAN_OPTIONS[option]
    with pytest.raises(WrongTypeError, match=f"{name} must be True or False"):
        build(value)


# ----------------------------------------------------------------------- out-of-range ids

TASK = copy_task(4, 3, n_symbols=4)  # vocabulary: 4 symbols and "|"
WORDS = word_order_task(2)
VOCAB = date_vocab()
DECODERS = {
    "CharTokenizer.decode": (CharTokenizer("abc").decode, 3),
    "Seq2SeqVocab.decode": (VOCAB.decode, VOCAB.vocab_size),
    "Seq2SeqVocab.labels": (VOCAB.labels, VOCAB.vocab_size),
    "LMTask.decode": (TASK.decode, 5),
    "AlignedTranslationTask.words": (WORDS.words, WORDS.vocab.vocab_size),
}


@pytest.mark.parametrize("bad", ["too large", "negative"])
@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_every_decoder_names_an_out_of_range_id_and_the_vocabulary_size(decoder, bad):
    decode, size = DECODERS[decoder]
    wrong = size if bad == "too large" else -1
    with pytest.raises(ValueError, match=rf"ids\[1\] is {wrong}, .*0\.\.{size - 1}.*{size}"):
        decode([0, wrong])
    with pytest.raises(ValueError, match=rf"ids\[0\] is {wrong}"):
        decode(torch.tensor([wrong, 0]))


@pytest.mark.parametrize("decoder", sorted(DECODERS))
def test_decoders_refuse_float_ids_and_accept_numpy_ints(decoder):
    decode, _ = DECODERS[decoder]
    with pytest.raises(ValueError, match="ids"):
        decode(torch.tensor([0.0, 1.0]))
    with pytest.raises(WrongTypeError, match=r"ids\[0\] must be an integer"):
        decode([1.0])
    assert decode(np.array([0, 1])) == decode([0, 1])


def test_the_ignore_index_still_decodes_where_it_did():
    assert VOCAB.decode([IGNORE_INDEX, 4], strip=False)[0] == "·"
    assert VOCAB.labels([IGNORE_INDEX])[0] == ""
    assert TASK.decode([IGNORE_INDEX, 0]) == ". 0"
    with pytest.raises(ValueError, match=r"ids\[0\] is -100"):
        CharTokenizer("abc").decode([IGNORE_INDEX])  # no -100 in a plain tokenizer


def test_special_ids_must_lie_in_their_vocabulary():
    with pytest.raises(ValueError, match=r"eos_id is 2, .*0\.\.1"):
        Seq2SeqVocab(("<pad>", "<bos>"))
    with pytest.raises(ValueError, match=r"pad_id is 10, .*0\.\.9"):
        RNNEncoderDecoder(10, 12, pad_id=10)
    model = RNNEncoderDecoder(10, 12, d_embed=4, hidden_size=4)
    src = torch.randint(10, (2, 3), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"bos_id is 12, .*0\.\.11"):
        model.generate(src, bos_id=12, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"eos_id is -1"):
        model.generate(src, bos_id=1, eos_id=-1, max_new_tokens=2)
