"""A learner's usual mistakes give a ValueError naming the argument, what it received and what
was expected -- never a traceback from deep inside torch."""

from __future__ import annotations

import pytest
import torch

from course_lib.attention import (
    MultiHeadAttention,
    attention_scores,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
)
from course_lib.configs import DecoderConfig, EncoderConfig
from course_lib.device import get_device, seed_everything
from course_lib.generation import sample_next_token
from course_lib.layers import FeedForward, LayerNorm
from course_lib.models import DecoderLM, Encoder
from course_lib.positions import alibi_bias, sinusoidal_encoding


def test_d_model_not_divisible_by_n_heads():
    with pytest.raises(ValueError, match=r"d_model=10 is not divisible by n_heads=4.*\[1, 2, 5, 10\]"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4"):
        DecoderConfig(vocab_size=5, d_model=10, n_heads=4)


def test_wrong_model_dimension():
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 6\) but its last dimension should be d_model=8"):
        mha(torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"x should have shape \(B, T, D\) or \(T, D\).*\(2, 2, 3, 8\)"):
        mha(torch.randn(2, 2, 3, 8))
    with pytest.raises(ValueError, match=r"context has batch size 5 \(shape \(5, 4, 8\)\) but x has batch size 2"):
        mha(torch.randn(2, 3, 8), torch.randn(5, 4, 8))
    with pytest.raises(ValueError, match=r"x has shape \(3, 7\) but its last dimension should be d_model=8"):
        FeedForward(8)(torch.randn(3, 7))
    with pytest.raises(ValueError, match="d_model=8"):
        LayerNorm(8)(torch.randn(3, 7))


def test_mismatched_q_k_v():
    with pytest.raises(ValueError, match=r"q and k must have the same last dimension.*\(4, 8\).*\(4, 6\)"):
        attention_scores(torch.randn(4, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"k and v must have the same number of positions S"):
        scaled_dot_product_attention(torch.randn(4, 8), torch.randn(5, 8), torch.randn(6, 8))
    with pytest.raises(ValueError, match=r"q should have shape \(\.\.\., T, Dh\)"):
        attention_scores(torch.randn(8), torch.randn(4, 8))


def test_float_mask_where_bool_expected():
    q = torch.randn(3, 4)
    float_mask = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"mask must be a boolean tensor.*float32.*bias="):
        scaled_dot_product_attention(q, q, q, mask=float_mask)
    with pytest.raises(ValueError, match="attention_mask must be a boolean tensor"):
        MultiHeadAttention(4, 2)(torch.randn(1, 3, 4), attention_mask=torch.ones(1, 3))
    with pytest.raises(ValueError, match="mask must be a boolean tensor"):
        MultiHeadAttention(4, 2)(torch.randn(1, 3, 4), mask=torch.ones(3, 3, dtype=torch.long))


def test_mask_of_wrong_shape():
    q = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"mask has shape \(3, 5\).*does not broadcast.*\(2, 3, 3\)"):
        scaled_dot_product_attention(q, q, q, mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3,\) but should be \(B, S\) = \(1, 3\)"):
        MultiHeadAttention(4, 2)(torch.randn(1, 3, 4), attention_mask=torch.ones(1, 1, 3, dtype=torch.bool)[0, 0])
    with pytest.raises(ValueError, match="bias has shape"):
        MultiHeadAttention(4, 2)(torch.randn(1, 3, 4), bias=torch.zeros(3, 3, 3))


def test_sequence_longer_than_the_context():
    model = DecoderLM(DecoderConfig(vocab_size=7, d_model=8, n_heads=2, max_len=5))
    with pytest.raises(ValueError, match=r"ids has 6 tokens \(shape \(1, 6\)\).*max_len=5"):
        model(torch.zeros(1, 6, dtype=torch.long))


def test_bad_token_ids():
    model = Encoder(EncoderConfig(vocab_size=7, d_model=8, n_heads=2))
    with pytest.raises(ValueError, match=r"ids holds ids from 0 to 9.*valid ids are 0..6"):
        model(torch.tensor([[0, 9]]))
    with pytest.raises(ValueError, match="integer token ids, got dtype torch.float32"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"ids should have shape \(B, T\).*ids\[None\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4, dtype=torch.bool))


def test_bad_config_values():
    with pytest.raises(ValueError, match="positions must be one of"):
        DecoderConfig(vocab_size=5, positions="relative")
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        DecoderConfig(vocab_size=0)
    with pytest.raises(ValueError, match="dropout"):
        EncoderConfig(vocab_size=5, dropout=1.5)
    with pytest.raises(ValueError, match="activation"):
        EncoderConfig(vocab_size=5, activation="swish")
    with pytest.raises(TypeError, match="EncoderConfig"):
        Encoder(DecoderConfig(vocab_size=5))


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="d_model must be even"):
        sinusoidal_encoding(4, 5)
    with pytest.raises(ValueError, match="exactly one of n_heads= or slopes="):
        alibi_bias(4)
    with pytest.raises(ValueError, match=r"lengths has a sequence of length 5 > max_len=3"):
        padding_mask([5, 2], max_len=3)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sample_next_token(torch.zeros(1, 3), temperature=-1)
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        softmax(torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got list"):
        attention_scores([[1.0]], torch.randn(1, 1))
    with pytest.raises(ValueError, match="seed must be an int"):
        seed_everything("42")
    with pytest.raises(ValueError, match="n_heads must be a positive integer"):
        MultiHeadAttention(8, 0)


def test_get_device_and_seed():
    assert get_device("cpu").type == "cpu"
    assert get_device().type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            get_device("cuda")
    seed_everything(3)
    a = torch.rand(2)
    seed_everything(3)
    assert torch.equal(a, torch.rand(2))
