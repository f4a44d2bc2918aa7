"""The Elman RNN against nn.RNN with copied weights; the attention of RNN encoder-decoders
against F.scaled_dot_product_attention, Bahdanau's formula and nn.GRU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from helpers import Float64Watch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from course_lib.attention import MultiHeadAttention
from course_lib.instruments.probes import future_leaks
from course_lib.rnn import (
    ElmanRNN,
    RNNAttention,
    RNNEncoderDecoder,
    elman_forward,
    elman_step,
    gradient_norms,
    sequential_depth,
)


@on_devices
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_elman_matches_torch_rnn(device, nonlinearity):
    torch.manual_seed(0)
    ref = nn.RNN(5, 7, nonlinearity=nonlinearity, batch_first=True).to(device)
    ours = ElmanRNN(5, 7, nonlinearity=nonlinearity).to(device)
    with torch.no_grad():
        ours.W.copy_(ref.weight_hh_l0)
        ours.U.copy_(ref.weight_ih_l0)
        ours.b.copy_(ref.bias_ih_l0 + ref.bias_hh_l0)  # two biases in a sum are one bias
    x = torch.randn(3, 11, 5, device=device)
    h0 = torch.randn(3, 7, device=device)
    ref_out, ref_h = ref(x, h0[None])
    out, h = ours(x, h0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, ref_h[0], atol=1e-5, rtol=1e-5)


def test_sigmoid_elman_follows_the_recurrence():
    torch.manual_seed(0)
    W, U, b = torch.randn(4, 4), torch.randn(4, 3), torch.randn(4)
    x = torch.randn(6, 3)
    h = torch.zeros(4)
    expected = []
    for t in range(6):
        h = torch.sigmoid(W @ h + U @ x[t] + b)
        expected.append(h)
    out = elman_forward(x, torch.zeros(4), W, U, b, nonlinearity="sigmoid")
    torch.testing.assert_close(out, torch.stack(expected))


def test_unbatched_and_default_h0():
    rnn = ElmanRNN(3, 4)
    out, h = rnn(torch.randn(5, 3))
    assert out.shape == (5, 4) and h.shape == (4,)
    out, h = rnn(torch.randn(2, 5, 3))
    assert out.shape == (2, 5, 4) and h.shape == (2, 4)


def test_early_input_reaches_the_last_state_only_through_the_chain():
    # changing x_0 changes every later state: information flows one step at a time
    torch.manual_seed(0)
    rnn = ElmanRNN(2, 3)
    x = torch.randn(1, 6, 2)
    y = x.clone()
    y[0, 0] += 1.0
    diff = (rnn(x)[0] - rnn(y)[0]).abs().sum(-1)[0]
    assert (diff > 0).all()


def test_bad_inputs_name_the_argument():
    W, U = torch.randn(4, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"x has shape \(2, 6, 5\).*Din=3"):
        elman_forward(torch.randn(2, 6, 5), torch.zeros(2, 4), W, U)
    with pytest.raises(ValueError, match=r"W has shape \(4, 5\).*\(H, H\)"):
        elman_forward(torch.randn(6, 3), torch.zeros(4), torch.randn(4, 5), U)
    with pytest.raises(ValueError, match=r"h0 has shape \(3, 4\).*B=2"):
        elman_forward(torch.randn(2, 6, 3), torch.zeros(3, 4), W, U)


CONFIG_ERRORS = [
    (lambda: ElmanRNN(3, 0), ValueError, r"hidden_size.*>= 1.*0"),
    (lambda: ElmanRNN(3, 4.0), TypeError, r"hidden_size.*4\.0.*write 4"),
    (lambda: ElmanRNN(True, 4), TypeError, r"input_size.*True"),
    (lambda: ElmanRNN(3, 4, bias="no"), TypeError, r"bias.*True or False.*'no'"),
    (lambda: ElmanRNN(3, 4, nonlinearity="softsign"), ValueError,
     r"nonlinearity.*'relu', 'sigmoid', 'tanh'.*'softsign'"),
]


@pytest.mark.parametrize("call, error, match", CONFIG_ERRORS,
                         ids=["hidden_size-0", "hidden_size-float", "input_size-bool", "bias-str",
                              "nonlinearity"])
def test_bad_config_values_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_wrong_type_is_a_plain_type_error():
    with pytest.raises(TypeError, match="hidden_size") as info:
        ElmanRNN(3, 4.0)
    assert not isinstance(info.value, ValueError)


def test_numpy_integers_are_sizes_too():
    assert ElmanRNN(np.int64(3), np.int64(4))(torch.randn(2, 3))[0].shape == (2, 4)


# ------------------------------------------------------------------------------ mixed dtypes


def test_float64_from_numpy_into_the_rnn_names_x_and_the_fix():
    rnn = ElmanRNN(3, 4)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 5, 3)))  # float64
    with pytest.raises(ValueError, match=r"x has dtype torch\.float64.*torch\.float32.*"
                                         r"x\.float\(\).*numpy"):
        rnn(x)
    with pytest.raises(ValueError, match=r"h0 has dtype torch\.float64.*h0\.float\(\)"):
        rnn(x.float(), torch.zeros(2, 4, dtype=torch.float64))
    assert rnn(x.float())[0].shape == (2, 5, 4)  # the proposed fix works


def test_integer_tensors_into_the_rnn_are_refused():
    rnn = ElmanRNN(3, 4)
    with pytest.raises(ValueError, match=r"x has dtype torch\.int64.*x\.float\(\)"):
        rnn(torch.ones(2, 5, 3, dtype=torch.long))


def test_rnn_functions_name_the_tensor_whose_dtype_differs():
    W, U, b = torch.randn(4, 4), torch.randn(4, 3), torch.randn(4)
    with pytest.raises(ValueError, match=r"x_t has dtype torch\.float64.*W.*torch\.float32.*"
                                         r"x_t\.float\(\)"):
        elman_step(torch.randn(3, dtype=torch.float64), torch.zeros(4), W, U, b)
    with pytest.raises(ValueError, match=r"b has dtype torch\.float64.*W"):
        elman_forward(torch.randn(5, 3), torch.zeros(4), W, U, b.double())
    with pytest.raises(ValueError, match=r"W must be floating-point.*torch\.int64"):
        elman_forward(torch.randn(5, 3), torch.zeros(4), W.long(), U.long())



def test_the_rnn_never_computes_in_float64_on_the_device():
    # "meta" stands in for MPS: it runs no kernels but keeps track of dtypes and devices
    with Float64Watch() as watch:
        torch.arange(3, device="meta", dtype=torch.float64)  # the watch sees float64 off the CPU
    assert watch.calls == ["arange"]
    with Float64Watch() as watch:
        out, _ = ElmanRNN(3, 4).to("meta")(torch.randn(2, 5, 3, device="meta"))
        assert out.shape == (2, 5, 4) and out.device.type == "meta"
    assert watch.calls == []


# ------------------------------------------------------------------------------- elman_step


def test_elman_step_matches_torch_rnn_cell():
    torch.manual_seed(0)
    cell = nn.RNNCell(3, 5)
    x, h = torch.randn(4, 3), torch.randn(4, 5)
    b = cell.bias_ih + cell.bias_hh
    out = elman_step(x, h, cell.weight_hh, cell.weight_ih, b)
    torch.testing.assert_close(out, cell(x, h))
    # unbatched vectors follow the textbook column-vector form W h + U x + b
    torch.testing.assert_close(
        elman_step(x[0], h[0], cell.weight_hh, cell.weight_ih, b),
        torch.tanh(cell.weight_hh @ h[0] + cell.weight_ih @ x[0] + b),
    )


def test_elman_forward_is_elman_step_in_a_loop():
    torch.manual_seed(1)
    W, U, b = torch.randn(4, 4), torch.randn(4, 2), torch.randn(4)
    x, h0 = torch.randn(3, 7, 2), torch.randn(3, 4)
    h, states = h0, []
    for t in range(7):
        h = elman_step(x[:, t], h, W, U, b, nonlinearity="relu")
        states.append(h)
    torch.testing.assert_close(
        elman_forward(x, h0, W, U, b, nonlinearity="relu"), torch.stack(states, dim=1)
    )


def test_elman_step_bad_inputs_name_the_argument():
    W, U = torch.randn(4, 4), torch.randn(4, 3)
    with pytest.raises(ValueError, match=r"x_t has shape \(2, 5\).*Din=3"):
        elman_step(torch.randn(2, 5), torch.zeros(2, 4), W, U)
    with pytest.raises(ValueError, match=r"h_prev has shape \(2, 3\).*H=4"):
        elman_step(torch.randn(2, 3), torch.zeros(2, 3), W, U)
    with pytest.raises(ValueError, match=r"h_prev has shape \(3, 4\).*B=2"):
        elman_step(torch.randn(2, 3), torch.zeros(3, 4), W, U)
    with pytest.raises(ValueError, match=r"b has shape \(5,\).*H=4"):
        elman_step(torch.randn(3), torch.zeros(4), W, U, torch.zeros(5))


# ------------------------------------------------------------------------- sequential_depth


def test_sequential_depth_counts_a_chain_of_operations():
    x = torch.randn(3, requires_grad=True)
    y = x
    for _ in range(5):
        y = torch.tanh(y)
    assert sequential_depth(y) == 5
    # parallel branches do not add up: the longest one counts
    z = torch.tanh(torch.tanh(x)) + torch.sin(x)
    assert sequential_depth(z) == 3


@pytest.mark.parametrize("steps", [1, 10, 200])
def test_sequential_depth_grows_with_rnn_length_but_not_attention(steps):
    torch.manual_seed(0)
    rnn = ElmanRNN(4, 8)
    attention = MultiHeadAttention(8, 2)
    short = sequential_depth(rnn(torch.randn(1, 1, 4))[0])
    # three operations per step on the chain: h @ W.T, + the input part, tanh
    assert sequential_depth(rnn(torch.randn(1, steps, 4))[0]) == short + 3 * (steps - 1)
    assert sequential_depth(attention(torch.randn(1, steps, 8))[0]) == sequential_depth(
        attention(torch.randn(1, 2, 8))[0]
    )


def test_sequential_depth_needs_a_graph():
    with pytest.raises(ValueError, match="output.*no autograd graph"):
        sequential_depth(torch.randn(3) * 2)
    with pytest.raises(TypeError, match=r"output.*torch\.Tensor.*list"):
        sequential_depth([1.0])


# --------------------------------------------------------------------------- gradient_norms


def test_gradient_norms_match_autograd_by_hand():
    torch.manual_seed(0)
    rnn = ElmanRNN(3, 5)
    x = torch.randn(6, 3)
    leaf = x.clone().requires_grad_(True)
    rnn(leaf)[0][-1].sum().backward()
    expected = leaf.grad.norm(dim=-1)
    rnn.zero_grad(set_to_none=True)
    got = gradient_norms(lambda v: rnn(v)[0], x)
    torch.testing.assert_close(got, expected)
    assert not got.requires_grad and not x.requires_grad and x.grad is None
    assert all(p.grad is None for p in rnn.parameters())


def test_gradient_norms_batched_is_per_example():
    torch.manual_seed(0)
    rnn = ElmanRNN(3, 5)
    x = torch.randn(4, 6, 3)
    batched = gradient_norms(lambda v: rnn(v)[0], x)
    assert batched.shape == (4, 6)
    for i in range(4):
        torch.testing.assert_close(batched[i], gradient_norms(lambda v: rnn(v)[0], x[i]))


def test_gradient_norms_vanish_in_an_rnn_but_not_through_attention():
    torch.manual_seed(0)
    rnn = ElmanRNN(4, 16)
    with torch.no_grad():
        rnn.W.mul_(0.5 / torch.linalg.eigvals(rnn.W).abs().max())
    x = torch.randn(8, 40, 4)
    rnn_norms = gradient_norms(lambda v: rnn(v)[0], x).mean(0)  # (T,)
    assert rnn_norms[0] < 1e-6 * rnn_norms[-1]  # 39 steps back: vanished
    attention = MultiHeadAttention(4, 2)
    attn_norms = gradient_norms(lambda v: attention(v)[0], x).mean(0)
    assert attn_norms[0] > 0.2 * attn_norms[-2]  # as far back as one step back
    # with W = 0 only the last input reaches h_T at all
    with torch.no_grad():
        rnn.W.zero_()
    norms = gradient_norms(lambda v: rnn(v)[0], x[0])
    assert (norms[:-1] == 0).all() and norms[-1] > 0


def test_gradient_norms_bad_inputs():
    rnn = ElmanRNN(3, 5)
    with pytest.raises(ValueError, match=r"x.*\(T, Din\) or \(B, T, Din\).*\(3,\)"):
        gradient_norms(lambda v: rnn(v)[0], torch.randn(3))
    with pytest.raises(ValueError, match=r"fn\(x\).*lambda x: module\(x\)\[0\]"):
        gradient_norms(rnn, torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"fn\(x\).*\(4, 'H'\).*\(5,\)"):
        gradient_norms(lambda v: rnn(v)[1], torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"x must be floating-point.*x\.float\(\)"):
        gradient_norms(lambda v: rnn(v)[0], torch.ones(4, 3, dtype=torch.long))


# ------------------------------------------- attention in an RNN encoder-decoder (Bahdanau)


def test_dot_score_attention_is_scaled_dot_product_attention_with_scale_one():
    torch.manual_seed(0)
    attention = RNNAttention(6, 10, score="dot")
    query, keys = torch.randn(3, 4, 6), torch.randn(3, 7, 10)
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        context, weights = attention(query, keys, mask)
        q = attention.query_proj(query)  # (B, T, Dk): W_s s
    ref = F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask[:, None, :], scale=1.0)
    torch.testing.assert_close(context, ref, atol=1e-5, rtol=1e-5)
    assert weights.shape == (3, 4, 7)
    assert float(weights[1, :, 5:].abs().max()) == 0.0


def test_additive_score_follows_bahdanaus_formula():
    torch.manual_seed(0)
    attention = RNNAttention(5, 8, score="additive", attention_size=6)
    s, h = torch.randn(2, 5), torch.randn(2, 4, 8)
    context, weights = attention(s, h)  # one query per example: (B, Dk), (B, S)
    W_s, W_h = attention.query_proj.weight, attention.key_proj.weight  # (A, Dq), (A, Dk)
    v = attention.v.weight[0]  # (A,)
    for b in range(2):
        e = torch.stack([v @ torch.tanh(W_s @ s[b] + W_h @ h[b, j]) for j in range(4)])
        alpha = torch.softmax(e, dim=0)
        torch.testing.assert_close(weights[b], alpha)
        torch.testing.assert_close(context[b], alpha @ h[b])


@given(batch=st.integers(1, 3), n_keys=st.integers(1, 6), n_queries=st.integers(1, 4),
       score=st.sampled_from(["additive", "dot"]), seed=st.integers(0, 2**16))
def test_attention_weights_are_distributions_over_the_real_keys(batch, n_keys, n_queries,
                                                                 score, seed):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    attention = RNNAttention(4, 6, score=score)
    lengths = torch.randint(1, n_keys + 1, (batch,), generator=gen)
    mask = torch.arange(n_keys) < lengths[:, None]  # (B, S)
    keys = torch.randn(batch, n_keys, 6, generator=gen)
    _, weights = attention(torch.randn(batch, n_queries, 4, generator=gen), keys, mask)
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch, n_queries))
    assert bool((weights[~mask[:, None, :].expand_as(weights)] == 0).all())
    assert bool((weights >= 0).all())


def test_a_query_with_no_allowed_key_gets_zeros_not_nan():
    attention = RNNAttention(4, 4)
    mask = torch.tensor([[True, False], [False, False]])
    with torch.no_grad():
        context, weights = attention(torch.randn(2, 4), torch.randn(2, 2, 4), mask)
    assert not bool(weights.isnan().any())
    assert float(weights[1].abs().sum()) == 0.0 and float(context[1].abs().sum()) == 0.0


def _seq2seq(attention="additive"):
    torch.manual_seed(0)
    return RNNEncoderDecoder(12, 9, d_embed=8, hidden_size=10, attention=attention,
                             pad_id=0).eval()


@pytest.mark.parametrize("attention", ["additive", "dot", None])
def test_padding_changes_nothing(attention):
    # one source alone, and the same source padded in a batch with a longer one
    model = _seq2seq(attention)
    short = torch.tensor([[3, 4, 5]])
    batch = torch.tensor([[3, 4, 5, 0, 0, 0], [6, 7, 8, 9, 10, 11]])
    tgt = torch.tensor([[1, 2, 3, 4], [1, 5, 6, 7]])
    with torch.no_grad():
        alone = model(short, tgt[:1])
        together = model(batch, tgt)
    torch.testing.assert_close(together.logits[0], alone.logits[0], atol=1e-5, rtol=1e-5)
    if attention is not None:
        torch.testing.assert_close(together.weights[0, :, :3], alone.weights[0])
        assert float(together.weights[0, :, 3:].abs().max()) == 0.0
    else:
        assert together.weights is None


def test_encoder_is_a_bidirectional_torch_gru_on_each_unpadded_source():
    model = _seq2seq()
    src = torch.tensor([[3, 4, 5, 0, 0], [6, 7, 8, 9, 10]])
    with torch.no_grad():
        states, summary = model.encode(src, src != 0)  # (B, S, 2H), (B, 2H)
    for b, length in enumerate((3, 5)):
        with torch.no_grad():
            out, last = model.encoder(model.src_embed(src[b:b + 1, :length]))  # plain nn.GRU
        torch.testing.assert_close(states[b, :length], out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(summary[b], torch.cat([last[0, 0], last[1, 0]]),
                                   atol=1e-5, rtol=1e-5)
    assert float(states[0, 3:].abs().max()) == 0.0


def test_decoder_is_causal_over_the_target():
    model = _seq2seq()
    src = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    report = future_leaks(lambda tgt: model(src, tgt).logits, torch.randint(1, 9, (2, 6)),
                          vocab_size=9)
    assert report.is_causal, report


def test_loss_is_cross_entropy_over_scored_targets():
    model = _seq2seq()
    src, tgt = torch.tensor([[3, 4, 5]]), torch.tensor([[1, 2, 3, 4]])
    targets = torch.tensor([[2, 3, 4, -100]])
    out = model(src, tgt, targets=targets)
    ref = F.cross_entropy(out.logits[0, :3], targets[0, :3])
    torch.testing.assert_close(out.loss, ref)


def test_a_trained_attention_model_learns_to_reverse():
    # a tiny reversal task: the alignment must become the anti-diagonal
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = RNNEncoderDecoder(8, 8, d_embed=16, hidden_size=32, attention="dot")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        src = torch.randint(2, 8, (32, 5), generator=gen)
        tgt = torch.cat([torch.ones(32, 1, dtype=torch.long), src.flip(1)[:, :-1]], 1)
        loss = model(src, tgt, targets=src.flip(1)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        out = model(src, tgt, targets=src.flip(1))
    assert float(out.loss) < 0.3
    looked_at = out.weights.argmax(-1).float().mean(0)  # (T,): most attended source position
    torch.testing.assert_close(looked_at, torch.tensor([4.0, 3, 2, 1, 0]), atol=0.3, rtol=0)


def test_seq2seq_bad_inputs_name_the_argument():
    model = _seq2seq()
    src, tgt = torch.tensor([[3, 4, 0]]), torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match=r"src.*token ids.*src\.long\(\)"):
        model(src.float(), tgt)
    with pytest.raises(ValueError, match=r"padding on the right.*\[\[0, 1, 1\]\]"):
        model(torch.tensor([[0, 3, 4]]), tgt)
    with pytest.raises(ValueError, match=r"real token.*\[\[0, 0, 0\]\]"):
        model(torch.tensor([[0, 0, 0]]), tgt)
    with pytest.raises(ValueError, match=r"tgt has shape \(2, 2\).*B=1"):
        model(src, torch.tensor([[1, 2], [1, 2]]))
    with pytest.raises(ValueError, match=r"targets has shape \(1, 3\).*T=2"):
        model(src, tgt, targets=torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"src_attention_mask.*\(1, 2\)"):
        model(src, tgt, src_attention_mask=torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"tgt.*99.*0\.\.8"):
        model(src, torch.tensor([[1, 99]]))
    with pytest.raises(ValueError, match=r"attention.*'additive', 'dot', None.*'multiplicative'"):
        RNNEncoderDecoder(5, 5, attention="multiplicative")
    with pytest.raises(TypeError, match=r"hidden_size.*8\.0"):
        RNNEncoderDecoder(5, 5, hidden_size=8.0)
    with pytest.raises(ValueError, match=r"pad_id is 10.*0\.\.9"):
        RNNEncoderDecoder(10, 12, pad_id=10)


def test_rnn_attention_bad_inputs_name_the_argument():
    attention = RNNAttention(4, 6)
    with pytest.raises(ValueError, match=r"query has shape \(2, 5\).*Dq=4"):
        attention(torch.randn(2, 5), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"keys.*\(B, S, Dk\).*\(3, 6\)"):
        attention(torch.randn(2, 4), torch.randn(3, 6))
    with pytest.raises(ValueError, match=r"keys has shape \(3, 3, 6\).*B=2"):
        attention(torch.randn(2, 4), torch.randn(3, 3, 6))
    with pytest.raises(ValueError, match=r"query has dtype torch\.float64.*query\.float\(\)"):
        attention(torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 3, 6))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 4\).*S=3"):
        attention(torch.randn(2, 4), torch.randn(2, 3, 6), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"mask must be a boolean.*float32.*mask\.bool\(\)"):
        attention(torch.randn(2, 4), torch.randn(2, 3, 6), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"score.*'additive', 'dot'.*'cosine'"):
        RNNAttention(4, 6, score="cosine")
