"""course_lib.instruments.probes: the black-box "who sees whom" and future-leak probes, head ablation,
gradient norms and head_role_scores; none of them ever concludes from NaN or inf."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from helpers import Float64Watch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from course_lib.attention import MultiHeadAttention, causal_mask
from course_lib.blocks import EncoderBlock
from course_lib.configs import DecoderConfig, EncoderConfig
from course_lib.instruments.bert_app import load_pretrained_encoder
from course_lib.instruments.probes import (
    HEAD_ROLES,
    PATH_PARTS,
    LeakReport,
    ablate_head_path,
    ablate_heads,
    future_leaks,
    head_role_scores,
    induction_score,
    influence,
    layer_grad_norms,
    logit_lens,
    previous_token_score,
    who_sees_whom,
)
from course_lib.models import DecoderLM, Encoder
from course_lib.tasks import repeated_segments


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


@pytest.mark.parametrize("x, kwargs, error, match", [
    (torch.randn(5), {}, ValueError, r"^x should have shape \(B, T\).*\(5,\)"),
    ([[1, 2]], {}, TypeError, r"^x must be a torch\.Tensor.*list"),
    (torch.randn(0, 3, 2), {}, ValueError, r"^x has shape \(0, 3, 2\).*at least one example"),
    (torch.ones(2, 3, dtype=torch.bool), {}, ValueError, r"^x has dtype torch\.bool"),
    (torch.zeros(2, 3, dtype=torch.long), {}, ValueError, r"vocab_size is needed"),
    (torch.zeros(2, 3, 4, dtype=torch.long), {"vocab_size": 5}, ValueError,
     r"\(B, T\) token ids.*\(2, 3, 4\)"),
    (torch.zeros(2, 3, dtype=torch.long), {"vocab_size": 1}, ValueError,
     r"^vocab_size .*>= 2.*1"),
    (torch.full((2, 3), 7), {"vocab_size": 5}, ValueError, r"^x .*7.*outside 0\.\.4"),
    (torch.randn(2, 3), {"n_trials": 0}, ValueError, r"^n_trials .*>= 1.*0"),
    (torch.randn(2, 3), {"n_trials": True}, TypeError, r"^n_trials .*>= 1.*True"),
    (torch.randn(2, 3), {"seed": "0"}, TypeError, r"^seed .*integer.*'0'"),
    (torch.randn(2, 3), {"per_example": 1}, TypeError, r"^per_example .*True or False.*1"),
    (torch.randn(2, 3), {"atol": -1.0}, ValueError, r"^atol .*>= 0.*-1\.0"),
    (torch.randn(2, 3), {"atol": math.nan}, ValueError, r"^atol .*>= 0.*nan"),
    (torch.randn(2, 3), {"rtol": "small"}, TypeError, r"^rtol .*>= 0.*'small'"),
], ids=["1-D", "list", "empty", "bool", "no-vocab_size", "3-D-ids", "vocab_size-1",
        "id-outside", "n_trials-0", "n_trials-bool", "seed-str", "per_example-int", "atol<0",
        "atol-nan", "rtol-str"])
def test_bad_arguments_raise_errors_naming_them(x, kwargs, error, match):
    with pytest.raises(error, match=match):
        who_sees_whom(_identity, x, **kwargs)


def test_fn_that_is_not_a_function_is_refused():
    with pytest.raises(TypeError, match=r"^fn must be a function of x.*Tensor"):
        who_sees_whom(torch.randn(1, 3), torch.randn(1, 3))


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
    with pytest.raises(ValueError, match=r"^fn returned shape \(2, 8\) .*\(2, 4, 2\)"):
        who_sees_whom(lambda x: x.reshape(2, -1), torch.randn(2, 4, 2))


def test_a_model_left_in_training_mode_with_dropout_is_refused():
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(vocab_size=7, d_model=8, n_heads=2, n_layers=1,
                                             max_len=4, dropout=0.5))  # training mode
    with pytest.raises(ValueError, match=r"dropout.*model\.eval\(\)"):
        future_leaks(lambda ids: model(ids).logits, torch.zeros(2, 4, dtype=torch.long),
                     vocab_size=7)


# ------------------------------------------------------------------------ NaN and inf: refused

BAD = [float("nan"), float("inf")]


def _attention_without_mask():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    return lambda x: mha(x)[0]  # every output sees every input: it leaks


def test_a_nan_input_never_makes_a_leaking_model_look_causal():
    leaky = _attention_without_mask()
    x = torch.randn(2, 5, 8)
    assert not future_leaks(leaky, x).is_causal
    x[1, 4, 0] = float("nan")  # every output of example 1 becomes NaN
    with pytest.raises(ValueError, match=r"^x .*1 NaN or inf.*\(1, 4, 0\).*conclude nothing"):
        future_leaks(leaky, x)
    x[1, 4, 0] = float("inf")
    with pytest.raises(ValueError, match=r"^x .*1 NaN or inf"):
        influence(leaky, x)


@pytest.mark.parametrize("bad", BAD)
def test_a_model_whose_output_is_not_finite_is_refused(bad):
    causal = torch.ones(4, 4).tril()  # (T, T)

    def model(x):  # causal, but position 2 of example 1 is broken
        out = torch.einsum("ij,bjd->bid", causal, x).clone()
        out[1, 2] = bad
        return out

    with pytest.raises(ValueError, match=r"^fn's output .*NaN or inf.*example 1, positions "
                                         r"\[2\]"):
        future_leaks(model, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match=r"^fn's output .*NaN or inf"):
        who_sees_whom(model, torch.randn(2, 4, 3))


PROBES = [influence, who_sees_whom, future_leaks]


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("value", BAD)
def test_probes_refuse_non_finite_inputs_and_outputs(probe, value):
    x = torch.randn(1, 4, 3)
    bad = x.clone()
    bad[0, 1, 2] = value
    with pytest.raises(ValueError, match=r"^x .*1 NaN or inf.*\(0, 1, 2\)"):
        probe(lambda x: x.cumsum(1), bad)
    with pytest.raises(ValueError, match=r"^fn's output .*NaN or inf"):
        probe(lambda x: x.cumsum(1) * value, x)


@pytest.mark.parametrize("probe", PROBES)
def test_probes_refuse_an_output_without_values(probe):
    with pytest.raises(ValueError, match=r"^fn returned shape \(1, 4, 0\)"):
        probe(lambda x: x[..., :0], torch.randn(1, 4, 3))


def test_outputs_that_turn_nan_under_perturbation_count_as_dependence():
    x = torch.randn(1, 4, 3)
    last = x[:, -1:].clone()

    def model(y):  # causal, except that any change to the last input poisons every output
        poison = torch.where((y[:, -1:] == last).all(), 0.0, float("nan"))
        return y.cumsum(1) + poison

    report = future_leaks(model, x)
    assert not report.is_causal
    assert report.leaking_positions == [0, 1, 2]
    assert report.sees[:, 3].all()
    assert torch.isinf(influence(model, x)[0, :, 3]).all()


def test_a_model_that_turns_nan_on_a_second_call_is_refused():
    calls = []

    def flaky(x):  # NaN on its second call with the same input
        calls.append(1)
        return x * float("nan") if len(calls) == 2 else x

    with pytest.raises(ValueError, match=r"^fn gives different outputs for the same input"):
        future_leaks(flaky, torch.randn(1, 3, 2))


# ------------------------------------------------------------------------ float64 on devices


@on_devices
def test_probes_compare_in_float64_on_the_cpu_only(device):
    with Float64Watch() as watch:  # the watch itself sees float64 off the CPU
        torch.arange(3, device="meta", dtype=torch.float64)
    assert watch.calls == ["arange"]
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).to(device).eval()
    x = torch.randn(2, 4, 8, device=device)
    with Float64Watch() as watch:
        report = future_leaks(lambda x: mha(x, is_causal=True)[0], x)
    assert report.is_causal and watch.calls == []


# ------------------------------------------------------ ablation and gradient norms: refused


def test_an_ablation_block_that_never_runs_the_layer_is_refused():
    torch.manual_seed(0)
    layer, other = MultiHeadAttention(8, 2).eval(), MultiHeadAttention(8, 2).eval()
    with pytest.raises(ValueError, match=r"never ran attention"):
        with ablate_heads(layer, 0):
            other(torch.randn(1, 3, 8))  # another layer: nothing was ablated
    assert not layer.out_proj._forward_pre_hooks
    with ablate_heads(layer, 0):
        layer(torch.randn(1, 3, 8))  # the layer itself: fine


def _stack_after_backward(scale: float | None) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    if scale is not None:
        (layers[1](layers[0](torch.ones(1, 3))).sum() * scale).backward()
    return layers


@pytest.mark.parametrize("value", BAD)
def test_layer_grad_norms_refuses_non_finite_gradients(value):
    layers = _stack_after_backward(1.0)
    layers[1].bias.grad[0] = value
    with pytest.raises(ValueError, match=r"^layers\[1\]\.bias\.grad .*NaN or inf"):
        layer_grad_norms(layers)


def test_layer_grad_norms_refuses_when_nothing_was_measured():
    with pytest.raises(ValueError, match=r"loss\.backward"):
        layer_grad_norms(_stack_after_backward(None))
    with pytest.raises(ValueError, match=r"^layers is empty"):
        layer_grad_norms([])
    assert torch.isfinite(layer_grad_norms(_stack_after_backward(1.0))).all()


# --------------------------------------------------------------------------------------------
# head_role_scores: what a head does, measured over many sentences. Checked on attention maps
# whose roles are known by construction, against a plain loop over the real model's maps,
# with a property test (an even spread scores its own baseline), and bad input.

HEAD_SENTENCE = ["[CLS]", "the", "cat", "saw", "the", "cat", ",", "a", "dog", ",", "[SEP]"]


def built_heads(tokens: list[str]) -> torch.Tensor:
    """(1, 6, n, n): heads that do one thing each, for one sentence."""
    n = len(tokens)
    w = torch.zeros(6, n, n)
    for i in range(n):
        w[0, i, max(i - 1, 0)] = 1.0  # previous token
        w[1, i, min(i + 1, n - 1)] = 1.0  # next token
        w[2, i, 0] = 1.0  # [CLS]
        w[3, i, n - 1] = 1.0  # [SEP]
        w[4, i, 1:n - 1] = 1.0 / (n - 2)  # even over the words
        same = [j for j in range(1, n - 1) if j != i and tokens[j] == tokens[i]]
        w[5, i, same or [i]] = 1.0 / max(len(same), 1)  # the same word, else itself
    return w[None]


def test_heads_built_for_one_role_score_1_on_it():
    roles = head_role_scores([built_heads(HEAD_SENTENCE)], [HEAD_SENTENCE])
    assert roles.n_queries["previous token"] == len(HEAD_SENTENCE) - 2
    expected_best = {"previous token": 0, "next token": 1, "[CLS]": 2, "[SEP]": 3,
                     "same word": 5}
    for role, head in expected_best.items():
        assert roles.scores[role].shape == (1, 6)
        assert roles.scores[role][0, head] == pytest.approx(1.0)
        assert roles.top(role, k=1) == [(0, head, pytest.approx(1.0))]
    # "cat" repeats; "the" is a stop word and "," punctuation: not counted
    assert roles.repeated == ["cat"] and roles.n_queries["same word"] == 2
    # an even spread over the words scores exactly the baseline of the word roles
    for role in ("previous token", "next token", "same word"):
        assert roles.scores[role][0, 4] == pytest.approx(roles.baseline[role])
    assert roles.baseline["same word"] == pytest.approx(1 / 9)  # one other "cat" of 9 words
    assert roles.baseline["[CLS]"] == pytest.approx(1 / len(HEAD_SENTENCE))


def test_stop_words_and_word_pieces_are_chosen_by_the_caller():
    tokens = ["[CLS]", "the", "play", "##s", "the", "play", "##s", "[SEP]"]
    roles = head_role_scores([built_heads(tokens)], [tokens])
    assert roles.repeated == ["play"]  # "##s" is a word piece, "the" a stop word
    roles = head_role_scores([built_heads(tokens)], [tokens], stop_words=())
    assert roles.repeated == ["play", "the"]


def test_no_repeated_word_gives_nan_not_a_number_to_read():
    tokens = ["[CLS]", "one", "two", "[SEP]"]
    roles = head_role_scores([built_heads(tokens)], [tokens])
    assert roles.n_queries["same word"] == 0
    assert torch.isnan(roles.scores["same word"]).all()


def test_padding_is_never_read():
    a = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    b = ["[CLS]", "hi", "[SEP]"]
    padded = torch.full((2, 6, 8, 8), 123.0)  # junk everywhere ...
    padded[0] = built_heads(a)[0]
    padded[1, :, :3, :3] = built_heads(b)[0]  # ... except the real tokens
    together = head_role_scores([padded, padded], [a, b])
    alone_a = head_role_scores([built_heads(a)] * 2, [a])
    alone_b = head_role_scores([built_heads(b)] * 2, [b])
    n_a, n_b = len(a) - 2, len(b) - 2
    for role in ("previous token", "[SEP]"):
        mixed = (alone_a.scores[role] * n_a + alone_b.scores[role] * n_b) / (n_a + n_b)
        torch.testing.assert_close(together.scores[role], mixed)
        assert together.scores[role].shape == (2, 6)


@pytest.fixture(scope="module")
def probed():
    bert = load_pretrained_encoder()
    return bert.encode(["The cat chased the mouse around the kitchen.",
                        "The oven cooked the bread so quickly that the bread burned.",
                        "Zuko made his uncle tea."])


def test_matches_a_plain_loop_on_the_real_model(probed):
    roles = head_role_scores(probed.attentions, probed.tokens)
    L, H = len(probed.attentions), probed.attentions[0].shape[1]
    previous = torch.zeros(L, H, dtype=torch.float64)
    cls = torch.zeros(L, H, dtype=torch.float64)
    count = 0
    for b, tokens in enumerate(probed.tokens):
        for i in range(1, len(tokens) - 1):
            for layer in range(L):
                for head in range(H):
                    row = probed.attentions[layer][b, head, i].double()
                    previous[layer, head] += row[i - 1]
                    cls[layer, head] += row[0]
            count += 1
    torch.testing.assert_close(roles.scores["previous token"], (previous / count).float())
    torch.testing.assert_close(roles.scores["[CLS]"], (cls / count).float())
    assert roles.repeated == ["bread"]
    # all-MiniLM-L6-v2's layer 0, head 2 looks at the previous token
    layer, head, score = roles.top("previous token", k=1)[0]
    assert (layer, head) == (0, 2) and score > 0.9
    stacked = head_role_scores(torch.stack(list(probed.attentions)), probed.tokens)
    torch.testing.assert_close(stacked.scores["same word"], roles.scores["same word"])


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(3, 9), min_size=1, max_size=4),
       n_heads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_scores_are_weights_and_an_even_spread_scores_the_baseline(lengths, n_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    words = ["cat", "dog", "the", "cat", "sun", "dog", "ran", "."]
    tokens = [["[CLS]", *[words[int(j)] for j in torch.randint(0, 8, (n - 2,), generator=gen)],
               "[SEP]"] for n in lengths]
    t = max(lengths)
    random = torch.softmax(torch.randn(len(lengths), n_heads, t, t, generator=gen), dim=-1)
    roles = head_role_scores([random], tokens)
    for role in HEAD_ROLES:
        if roles.n_queries[role]:
            assert ((roles.scores[role] >= 0) & (roles.scores[role] <= 1 + 1e-6)).all()
    even_words = torch.zeros(len(lengths), 1, t, t)
    even_all = torch.zeros(len(lengths), 1, t, t)
    for b, n in enumerate(lengths):
        even_words[b, :, :n, 1:n - 1] = 1.0 / (n - 2)
        even_all[b, :, :n, :n] = 1.0 / n
    by_words = head_role_scores([even_words], tokens)
    by_all = head_role_scores([even_all], tokens)
    for role in HEAD_ROLES:
        if roles.n_queries[role]:
            even = by_all if role in ("[CLS]", "[SEP]") else by_words
            assert float(even.scores[role]) == pytest.approx(roles.baseline[role], abs=1e-6)


def test_head_role_scores_bad_input():
    w = built_heads(HEAD_SENTENCE)
    with pytest.raises(ValueError, match=r"B = 1 .*T = 11"):
        head_role_scores([w], [HEAD_SENTENCE, HEAD_SENTENCE])
    with pytest.raises(ValueError, match=r"B = 1 .*T = 11"):
        head_role_scores([w], [HEAD_SENTENCE + ["extra"]])
    with pytest.raises(TypeError, match=r"^tokens .*list of B token lists"):
        head_role_scores([w], "the cat")
    with pytest.raises(ValueError, match=r"L tensors of one shape \(B, H, T, T\)"):
        head_role_scores([w, w[:, :2]], [HEAD_SENTENCE])
    with pytest.raises(ValueError, match=r"L tensors of one shape \(B, H, T, T\)"):
        head_role_scores([w[0]], [HEAD_SENTENCE])
    with pytest.raises(ValueError, match=r"attentions should have shape \(L, B, H, T, T\)"):
        head_role_scores(w, [HEAD_SENTENCE])
    with pytest.raises(TypeError, match=r"^attentions .*non-empty list"):
        head_role_scores([], [HEAD_SENTENCE])
    with pytest.raises(ValueError, match="float weights"):
        head_role_scores([w.long()], [HEAD_SENTENCE])
    with pytest.raises(TypeError, match=r"^stop_words .*collection"):
        head_role_scores([w], [HEAD_SENTENCE], stop_words="the")
    roles = head_role_scores([w], [HEAD_SENTENCE])
    with pytest.raises(ValueError, match=r"^role .*one of 'previous token'"):
        roles.top("first token")
    with pytest.raises(ValueError, match=r"^k .*>= 1.*0"):
        roles.top("[CLS]", k=0)


SENTENCE = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def _weights(n_layers: int = 2, n_heads: int = 3, t: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(n_layers, 1, n_heads, t, t, generator=gen), -1)


@pytest.mark.parametrize("value", BAD)
def test_a_non_finite_head_is_refused_naming_layer_and_head(value):
    weights = _weights()
    weights[1, 0, 2, 3, 1] = value
    with pytest.raises(ValueError, match=r"^attentions .*NaN or inf.*layer 1, head 2"):
        head_role_scores(weights, [SENTENCE])


def test_junk_in_padding_is_not_refused():
    weights = _weights(t=7)
    weights[..., 5:, :] = float("nan")  # padded queries
    weights[..., :, 5:] = float("nan")  # padded keys
    assert head_role_scores(weights, [SENTENCE]).n_queries["previous token"] == 3


def test_top_never_ranks_nan():
    roles = head_role_scores(_weights(), [SENTENCE])  # no repeated word: 'same word' is NaN
    assert roles.n_queries["same word"] == 0
    with pytest.raises(ValueError, match=r"'same word' hold NaN"):
        roles.top("same word")
    with pytest.raises(ValueError, match="k must be an integer >= 1"):  # arguments first
        roles.top("same word", k=0)
    assert all(score == score for _, _, score in roles.top("previous token", k=6))


@pytest.mark.parametrize("weights, tokens", [
    (_weights(t=2), [["[CLS]", "[SEP]"]]),  # no word token
    (_weights()[:0], [SENTENCE]),  # no layer
    (_weights()[:, :, :0], [SENTENCE]),  # no head
], ids=["no-word", "no-layer", "no-head"])
def test_head_roles_with_nothing_to_score_are_refused(weights, tokens):
    with pytest.raises(ValueError, match=r"nothing to score"):
        head_role_scores(weights, tokens)


# ------------------------------------------------------------------ head ablation (ablate_heads)

TOL = dict(atol=1e-5, rtol=1e-5)
seed_st = st.integers(0, 2**16)


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
    (nn.MultiheadAttention(8, 2), 0, TypeError,
     r"attention .*MultiHeadAttention.*MultiheadAttention"),
    (nn.Linear(8, 8), 0, TypeError, r"attention .*MultiHeadAttention.*Linear"),
    (MultiHeadAttention(8, 2), 2, ValueError, r"heads .*2.*n_heads=2.*0\.\.1"),
    (MultiHeadAttention(8, 2), [0, -1], ValueError, r"heads .*-1.*0\.\.1"),
    (MultiHeadAttention(8, 2), 1.0, TypeError, r"heads .*0\.\.1.*1\.0 \(float\)"),
    (MultiHeadAttention(8, 2), [True], TypeError, r"heads .*True \(bool\)"),
    (MultiHeadAttention(8, 2), "0", TypeError, r"heads .*'0' \(str\)"),
    (MultiHeadAttention(8, 2), torch.tensor([0]), TypeError, r"heads .*\(Tensor\)"),
])
def test_bad_ablation_arguments_are_named(attention, heads, error, match):
    with pytest.raises(error, match=match):
        with ablate_heads(attention, heads):
            pass


# ------------------------------------------------------------------------------ layer_grad_norms


def _stack(n_layers: int, norm_first: bool = True) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(EncoderBlock(16, 2, norm_first=norm_first) for _ in range(n_layers))


def _backward(blocks: nn.ModuleList, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, 16, generator=gen)
    for block in blocks:
        h = block(h)[0]
    (h * torch.randn(h.shape, generator=gen)).sum().backward()


@pytest.mark.parametrize("norm_first", [True, False])
def test_layer_grad_norms_equal_the_norm_of_all_gradients_of_each_layer(norm_first):
    blocks = _stack(4, norm_first)
    _backward(blocks)
    expected = torch.stack([
        torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in block.parameters()]))
        for block in blocks
    ])
    got = layer_grad_norms(blocks)
    assert got.shape == (4,) and got.dtype == torch.float32 and got.device.type == "cpu"
    torch.testing.assert_close(got, expected)
    # a plain list and an nn.Sequential of the same layers give the same answer
    torch.testing.assert_close(layer_grad_norms(list(blocks)), expected)
    torch.testing.assert_close(layer_grad_norms(nn.Sequential(*blocks)), expected)


def test_layer_grad_norms_agree_with_torch_autograd_grad():
    blocks = _stack(3)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, 16, generator=gen)
    for block in blocks:
        h = block(h)[0]
    loss = h.pow(2).mean()
    params = [list(b.parameters()) for b in blocks]
    grads = torch.autograd.grad(loss, [p for ps in params for p in ps], retain_graph=True)
    loss.backward()
    sizes = [len(ps) for ps in params]
    chunks = torch.split(torch.stack([g.pow(2).sum() for g in grads]), sizes)
    torch.testing.assert_close(layer_grad_norms(blocks), torch.stack([c.sum().sqrt()
                                                                      for c in chunks]))


def test_parameters_without_gradient_count_as_zero():
    blocks = _stack(2)
    _backward(blocks)
    blocks.append(nn.Linear(16, 16))  # never used by the loss: .grad is None
    norms = layer_grad_norms(blocks)
    assert norms.shape == (3,) and norms[2] == 0 and bool((norms[:2] > 0).all())


def test_residual_gradients_reach_the_first_layer_of_a_deep_stack():
    """The property chapter 07 relies on: with residual connections the first layer of a
    deep stack still gets a gradient of the same order as the last one."""
    blocks = _stack(12)
    _backward(blocks)
    norms = layer_grad_norms(blocks)
    assert 0.1 < float(norms[0] / norms[-1]) < 10


BAD_GRAD_NORM_CALLS = [
    (lambda: layer_grad_norms(EncoderBlock(16, 2)), TypeError,
     r"^layers .*sequence of modules.*EncoderBlock.*model\.blocks"),
    (lambda: layer_grad_norms(torch.randn(3)), TypeError, r"^layers .*sequence of modules"),
    (lambda: layer_grad_norms(7), TypeError, r"^layers .*sequence of modules.*int"),
    (lambda: layer_grad_norms([]), ValueError, r"^layers is empty"),
    (lambda: layer_grad_norms([nn.Linear(2, 2), "block"]), TypeError,
     r"^layers\[1\] .*torch\.nn\.Module.*str"),
    (lambda: layer_grad_norms([nn.Linear(2, 2), nn.ReLU()]), ValueError,
     r"^layers\[1\] \(ReLU\) has no parameters"),
    (lambda: layer_grad_norms(_stack(2)), ValueError, r"gradient.*loss\.backward\(\)"),
]


@pytest.mark.parametrize("call,error,message", BAD_GRAD_NORM_CALLS)
def test_layer_grad_norms_rejects_bad_input_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_tiny_gradients_are_not_reported_as_zero():
    """Squares of float32 entries below ~1e-23 underflow to 0; the sum runs in float64."""
    layers = [nn.Linear(16, 16), nn.Linear(16, 16)]
    for scale, layer in zip((6e-27, 1e-30), layers, strict=False):
        for p in layer.parameters():
            p.grad = torch.full_like(p, scale)
    assert float((layers[0].weight.grad ** 2).sum()) == 0.0  # what float32 would give
    norms = layer_grad_norms(layers)
    assert norms.dtype == torch.float32 and bool((norms > 0).all())
    expected = torch.tensor([6e-27, 1e-30], dtype=torch.float64) * (16 * 16 + 16) ** 0.5
    torch.testing.assert_close(norms.double(), expected, rtol=1e-5, atol=0)


def test_a_wrong_type_is_a_plain_type_error():
    with pytest.raises(TypeError, match="layers") as info:
        layer_grad_norms(7)
    assert not isinstance(info.value, ValueError)


# --------------------------------------------------------------------------------------------
# previous_token_score and induction_score on hand-built patterns


def _pattern(seq_len: int, key_of) -> torch.Tensor:
    """(T, T) weights putting all of query t's weight on key key_of(t) (t itself if None)."""
    w = torch.zeros(seq_len, seq_len)
    for t in range(seq_len):
        k = key_of(t)
        w[t, t if k is None else k] = 1.0
    return w


def _uniform_causal(seq_len: int) -> torch.Tensor:
    w = torch.ones(seq_len, seq_len).tril()
    return w / w.sum(-1, keepdim=True)  # (T, T)


def test_a_previous_token_head_scores_one_and_zero_for_induction():
    L = 5
    prev = _pattern(2 * L, lambda t: t - 1 if t > 0 else None)
    assert float(previous_token_score(prev)) == 1.0
    assert float(induction_score(prev, L)) == 0.0


def test_an_induction_head_scores_one_and_zero_for_previous_token():
    L = 5
    ind = _pattern(2 * L, lambda t: t - L + 1 if t >= L else None)  # first half: on itself
    assert float(induction_score(ind, L)) == 1.0
    assert float(previous_token_score(ind)) == 0.0


def test_uniform_causal_weights_give_the_mean_of_one_over_the_keys():
    L = 6
    w = _uniform_causal(2 * L)
    # query t has t + 1 keys, each with weight 1 / (t + 1)
    torch.testing.assert_close(previous_token_score(w),
                               torch.tensor(sum(1 / (t + 1) for t in range(1, 2 * L)) / (2 * L - 1)))
    torch.testing.assert_close(induction_score(w, L),
                               torch.tensor(sum(1 / (t + 1) for t in range(L, 2 * L)) / L))


def test_the_scores_keep_the_batch_and_head_dimensions():
    L = 4
    prev = _pattern(2 * L, lambda t: t - 1 if t > 0 else None)
    ind = _pattern(2 * L, lambda t: t - L + 1 if t >= L else None)
    w = torch.stack([torch.stack([prev, ind, _uniform_causal(2 * L)])] * 3)  # (B=3, H=3, T, T)
    assert previous_token_score(w).shape == induction_score(w, L).shape == (3, 3)
    torch.testing.assert_close(previous_token_score(w)[:, 0], torch.ones(3))
    torch.testing.assert_close(induction_score(w, L)[:, 1], torch.ones(3))
    torch.testing.assert_close(induction_score(w, L)[:, 0], torch.zeros(3))


def test_the_scores_read_a_real_models_attentions():
    model = DecoderLM(DecoderConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2,
                                    max_len=16, ffn="none")).eval()
    ids = repeated_segments(4, 5, 11, seed=0).inputs
    attentions = model(ids, output_attentions=True).attentions  # 2 x (B, H, T, T)
    scores = torch.stack([induction_score(a, 5) for a in attentions])  # (L, B, H)
    assert scores.shape == (2, 4, 2)
    assert bool(((scores >= 0) & (scores <= 1)).all())


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: induction_score(torch.rand(2, 10, 10), 4), ValueError, "2 \\* segment_len = 8"),
    (lambda: induction_score(torch.rand(2, 10, 9), 5), ValueError, "\\(\\.\\.\\., T, T\\)"),
    (lambda: previous_token_score(torch.rand(10)), ValueError, "\\(\\.\\.\\., T, T\\)"),
    (lambda: previous_token_score(torch.ones(1, 1)), ValueError, "at least 2"),
    (lambda: previous_token_score(torch.ones(3, 3, dtype=torch.long)), TypeError, "dtype"),
    (lambda: previous_token_score(torch.full((3, 3), float("nan"))), ValueError, "NaN"),
    (lambda: previous_token_score([[0.5, 0.5]]), TypeError, "weights"),
    (lambda: induction_score(torch.rand(4, 4), 0), ValueError, "segment_len"),
    (lambda: induction_score(torch.rand(4, 4), 2.0), TypeError, "segment_len"),
    # no head: an empty score, whose mean is NaN (an empty batch: tests/test_refusals.py)
    (lambda: previous_token_score(torch.rand(3, 0, 4, 4)), ValueError,
     r"weights has shape \(3, 0, 4, 4\): no example or no head"),
])
def test_the_pattern_scores_name_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------
# ablate_head_path and logit_lens


def _two_layer_decoder(**options) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=2, max_len=12,
                           ffn="none", **options)
    return DecoderLM(config).eval()


def _ids() -> torch.Tensor:
    return torch.randint(11, (3, 10), generator=torch.Generator().manual_seed(1))


def _by_hand(model, ids, head, parts):
    """The two-layer attention-only model computed without hooks: block 1 reads the chosen
    parts from the stream without head `head` of block 0 (found with ablate_heads)."""
    b0, b1 = model.blocks
    x0 = model.embeddings(ids)  # (B, T, D)
    full = b0.self_attn(b0.attn_norm(x0), is_causal=True)[0]  # (B, T, D)
    with ablate_heads(b0.self_attn, head):
        rest = b0.self_attn(b0.attn_norm(x0), is_causal=True)[0]
    head_out = full - rest  # the head's own term (the output bias cancels)
    x1 = x0 + full
    d = model.config.d_model
    w = b1.self_attn.qkv_proj.weight
    bq = b1.self_attn.qkv_proj.bias
    sources = {p: b1.attn_norm(x1 - head_out if p in parts else x1) for p in PATH_PARTS}
    q, k, v = (F.linear(sources[p], w[i * d:(i + 1) * d], None if bq is None else
                        bq[i * d:(i + 1) * d]) for i, p in enumerate(PATH_PARTS))
    split = lambda t: t.view(*t.shape[:2], 2, 8).transpose(1, 2)  # (B, H, T, Dh)  # noqa: E731
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
    out = b1.self_attn.out_proj(out.transpose(1, 2).reshape(x1.shape))  # (B, T, D)
    return model.lm_head(model.final_norm(x1 + out))


@pytest.mark.parametrize("parts", ["keys", "queries", ("values",), ("queries", "keys", "values")])
def test_ablate_head_path_removes_the_head_from_the_chosen_parts_only(parts):
    model, ids = _two_layer_decoder(), _ids()
    chosen = (parts,) if isinstance(parts, str) else parts
    with torch.no_grad(), ablate_head_path(model, 0, 1, into_layer=1, parts=parts):
        ablated = model(ids).logits
    torch.testing.assert_close(ablated, _by_hand(model, ids, 1, chosen))
    assert not torch.allclose(ablated, model(ids).logits)  # it changed something
    torch.testing.assert_close(model(ids).logits, _by_hand(model, ids, 1, ()))  # hooks gone


def test_ablate_head_path_changes_nothing_for_a_silent_head():
    model, ids = _two_layer_decoder(positions="rope"), _ids()
    with torch.no_grad():
        model.blocks[0].self_attn.out_proj.weight[:, 8:] = 0.0  # head 1 writes nothing
        before = model(ids).logits
        with ablate_head_path(model, 0, 1, into_layer=1, parts=PATH_PARTS):
            after = model(ids).logits
    torch.testing.assert_close(after, before)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(layer=1, head=0, into_layer=1), ValueError, "layer < into_layer"),
    (dict(layer=0, head=0, into_layer=2), ValueError, "into_layer"),
    (dict(layer=0, head=2, into_layer=1), ValueError, "n_heads=2"),
    (dict(layer=0, head=0, into_layer=1, parts="weights"), ValueError, "parts"),
    (dict(layer=-1, head=0, into_layer=1), ValueError, "layer"),
    # the argument is head (one head), not heads
    (dict(layer=0, head=1.5, into_layer=1), TypeError, r"^head must be an integer >= 0, got 1.5"),
    (dict(layer=0, head=[0, 1], into_layer=1), TypeError, r"^head must be an integer"),
    (dict(layer=0, head=0, into_layer=1, parts=3), TypeError, "parts must be one of"),
])
def test_ablate_head_path_names_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match), ablate_head_path(_two_layer_decoder(), **kwargs):
        pass


def test_ablate_head_path_refuses_a_block_where_the_model_never_ran():
    model = _two_layer_decoder()
    with pytest.raises(ValueError, match="never ran"), ablate_head_path(model, 0, 0,
                                                                        into_layer=1):
        pass
    with pytest.raises(TypeError, match="DecoderLM"), ablate_head_path(nn.Linear(2, 2), 0, 0,
                                                                       into_layer=1):
        pass


def test_the_logit_lens_ends_at_the_models_logits_and_starts_at_the_embeddings():
    model, ids = _two_layer_decoder(), _ids()
    lens = logit_lens(model, ids)
    assert lens.shape == (3, 3, 10, 11) and not lens.requires_grad
    torch.testing.assert_close(lens[-1], model(ids).logits)
    torch.testing.assert_close(lens[0], model.lm_head(model.final_norm(model.embeddings(ids))))
    x1 = model.blocks[0](model.embeddings(ids))[0]  # (B, T, D)
    torch.testing.assert_close(lens[1], model.lm_head(model.final_norm(x1)))
    assert not model.embeddings._forward_hooks and not model.blocks[0]._forward_hooks
    with pytest.raises(TypeError, match="lm_head"):
        logit_lens(Encoder(EncoderConfig(vocab_size=11, d_model=16, n_heads=2, n_layers=1)),
                   ids)
