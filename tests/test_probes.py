"""course_lib.probes: the black-box "who sees whom" and future-leak probes."""

from __future__ import annotations

import pytest
import torch
from conftest import on_devices
from hypothesis import given
from hypothesis import strategies as st

from course_lib.attention import MultiHeadAttention, causal_mask
from course_lib.configs import DecoderConfig, EncoderConfig
from course_lib.models import DecoderLM, Encoder
from course_lib.probes import LeakReport, future_leaks, influence, who_sees_whom


def _linear_mixer(pattern: torch.Tensor, d: int, seed: int):
    """f(x)[b, i] = sum_j pattern[i, j] * W_ij x[b, j]: output i depends exactly on the inputs j
    with pattern[i, j] True."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = pattern.shape[0]
    weights = (torch.rand(seq_len, seq_len, generator=gen) + 0.5) * pattern  # (T, T), > 0 or 0
    mixing = torch.randn(d, d, generator=gen)

    def f(x):  # (B, T, D) -> (B, T, D)
        return torch.einsum("ij,bjd->bid", weights, x @ mixing)

    return f


@given(t=st.integers(1, 7), b=st.integers(1, 3), d=st.integers(1, 5),
       density=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_recovers_any_dependence_pattern_of_vectors(t, b, d, density, seed):
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.rand(t, t, generator=gen) < density  # (T, T) bool
    x = torch.randn(b, t, d, generator=gen)
    sees = who_sees_whom(_linear_mixer(pattern, d, seed), x, seed=seed)
    assert sees.dtype == torch.bool and sees.shape == (t, t)
    assert torch.equal(sees, pattern)


@given(t=st.integers(1, 7), v=st.integers(2, 9), density=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16))
def test_recovers_any_dependence_pattern_of_token_ids(t, v, density, seed):
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.rand(t, t, generator=gen) < density
    table = torch.randn(v, 4, generator=gen)  # a random embedding per token
    mix = _linear_mixer(pattern, 4, seed)
    ids = torch.randint(0, v, (2, t), generator=gen)
    sees = who_sees_whom(lambda ids: mix(table[ids]), ids, vocab_size=v, seed=seed)
    assert torch.equal(sees, pattern)


@given(t=st.integers(1, 8), ahead=st.integers(0, 3), h=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def test_attention_with_a_banded_mask_sees_exactly_the_band(t, ahead, h, seed):
    torch.manual_seed(seed)
    mha = MultiHeadAttention(8, h).eval()
    band = torch.tril(torch.ones(t, t, dtype=torch.bool), diagonal=ahead)  # (T, T)
    x = torch.randn(2, t, 8)
    report = future_leaks(lambda x: mha(x, mask=band)[0], x)
    assert torch.equal(report.sees, band)
    assert report.is_causal == (ahead == 0 or t == 1)
    assert report.lookahead == min(ahead, t - 1)


@on_devices
def test_a_decoder_is_causal_and_an_encoder_is_not(device):
    torch.manual_seed(0)
    decoder = DecoderLM(DecoderConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2,
                                               max_len=8)).to(device).eval()
    encoder = Encoder(EncoderConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2,
                                               max_len=8)).to(device).eval()
    ids = torch.randint(0, 11, (2, 6), device=device)
    report = future_leaks(lambda ids: decoder(ids).logits, ids, vocab_size=11)
    assert report.is_causal and report.leaking_positions == [] and report.lookahead == 0
    assert torch.equal(report.sees, causal_mask(6))  # and it does use all of the past
    assert str(report).startswith("causal")
    leaky = future_leaks(lambda ids: encoder(ids).last_hidden_state, ids, vocab_size=11)
    assert not leaky.is_causal
    assert leaky.sees.all()
    assert leaky.leaking_positions == [0, 1, 2, 3, 4]
    assert leaky.lookahead == 5
    assert str(leaky).startswith("LEAK") and "5 position(s) ahead" in str(leaky)


def test_leak_report_properties():
    sees = torch.tensor([[True, False, True],
                         [True, True, False],
                         [True, True, True]])
    report = LeakReport(sees=sees, change=sees.double())
    assert report.leaks.tolist() == [[False, False, True], [False, False, False],
                                     [False, False, False]]
    assert report.leaking_positions == [0]
    assert report.lookahead == 2
    assert not report.is_causal


def test_influence_is_exactly_zero_on_the_future_of_a_causal_layer():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(3, 5, 8)
    change = influence(lambda x: mha(x, is_causal=True)[0], x)  # (B, T, T)
    assert change.shape == (3, 5, 5) and change.dtype == torch.float64
    future = ~causal_mask(5)
    assert (change[:, future] == 0).all()
    assert (change[:, ~future] > 0).all()


def test_tolerance_separates_rounding_noise_from_dependence():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()

    def noisy(x):  # causal, plus a ~1e-6 wobble that depends on every input
        return mha(x, is_causal=True)[0] + 5e-7 * x.sum(dim=1, keepdim=True)

    x = torch.randn(2, 5, 8)
    assert torch.equal(who_sees_whom(noisy, x), causal_mask(5))
    assert who_sees_whom(noisy, x, atol=0.0, rtol=0.0).all()


def test_per_example_matrices_show_that_padding_is_never_seen():
    torch.manual_seed(0)
    decoder = DecoderLM(DecoderConfig(vocab_size=9, d_model=16, n_heads=2, n_layers=2,
                                               max_len=8)).eval()
    keep = torch.tensor([[True] * 5, [True, True, True, False, False]])  # (B, S)
    ids = torch.randint(1, 9, (2, 5))
    sees = who_sees_whom(lambda ids: decoder(ids, attention_mask=keep).logits, ids,
                         vocab_size=9, per_example=True)
    assert sees.shape == (2, 5, 5)
    assert torch.equal(sees[0], causal_mask(5))
    real, pad = keep[1], ~keep[1]
    assert not sees[1][real][:, pad].any()  # real outputs never depend on padding
    assert torch.equal(sees[1][real][:, real], causal_mask(3))
    # a pad position still carries its own input forward (the residual path)
    assert sees[1][3, 3] and sees[1][4, 4]
    assert torch.equal(sees.any(0), who_sees_whom(
        lambda ids: decoder(ids, attention_mask=keep).logits, ids, vocab_size=9))


def test_the_probe_is_repeatable_and_leaves_its_input_alone():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 4, 8)
    before = x.clone()
    a = influence(lambda x: mha(x)[0], x, seed=3)
    b = influence(lambda x: mha(x)[0], x, seed=3)
    assert torch.equal(a, b)
    assert torch.equal(x, before)
    c = influence(lambda x: mha(x)[0], x, seed=4)
    assert not torch.equal(a, c)


def test_outputs_without_features_and_constant_inputs_work():
    x = torch.zeros(1, 4, 3)  # std 0: the replacement still has unit scale
    sees = who_sees_whom(lambda x: x.sum(-1).cumsum(1), x)  # (B, T) outputs
    assert torch.equal(sees, causal_mask(4))


# ------------------------------------------------------------------------------- bad input


def _identity(x):
    return x


@pytest.mark.parametrize("x, kwargs, match", [
    (torch.randn(5), {}, r"x should have shape \(B, T\).*\(5,\)"),
    ([[1, 2]], {}, "x must be a torch.Tensor"),
    (torch.randn(0, 3, 2), {}, "at least one example"),
    (torch.ones(2, 3, dtype=torch.bool), {}, "torch.bool"),
    (torch.zeros(2, 3, dtype=torch.long), {}, "vocab_size is needed"),
    (torch.zeros(2, 3, 4, dtype=torch.long), {"vocab_size": 5}, r"\(B, T\) token ids"),
    (torch.zeros(2, 3, dtype=torch.long), {"vocab_size": 1}, "vocab_size must be >= 2"),
    (torch.full((2, 3), 7), {"vocab_size": 5}, "outside 0..4"),
    (torch.randn(2, 3), {"n_trials": 0}, "n_trials must be a positive integer"),
    (torch.randn(2, 3), {"atol": -1.0}, "atol must be a number >= 0"),
    (torch.randn(2, 3), {"rtol": "small"}, "rtol must be a number >= 0"),
])
def test_bad_arguments_raise_value_errors_naming_them(x, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        who_sees_whom(_identity, x, **kwargs)


def test_fn_returning_a_tuple_gets_a_hint():
    mha = MultiHeadAttention(4, 1).eval()
    with pytest.raises(ValueError, match=r"attention\(x\)\[0\]"):
        who_sees_whom(mha, torch.randn(1, 3, 4))


def test_fn_returning_a_model_output_gets_a_hint():
    decoder = DecoderLM(DecoderConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1,
                                               max_len=4)).eval()
    with pytest.raises(ValueError, match=r"model\(ids\)\.logits"):
        future_leaks(decoder, torch.zeros(1, 3, dtype=torch.long), vocab_size=5)


def test_fn_returning_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"fn returned shape \(2, 8\) for an input of shape"):
        who_sees_whom(lambda x: x.reshape(2, -1), torch.randn(2, 4, 2))


def test_a_model_left_in_training_mode_with_dropout_is_refused():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=7, d_model=8, n_heads=2, n_layers=1,
                                             max_len=4, dropout=0.5))  # training mode
    with pytest.raises(ValueError, match=r"dropout.*model\.eval\(\)"):
        future_leaks(lambda ids: model(ids).logits, torch.zeros(2, 4, dtype=torch.long),
                     vocab_size=7)
