"""The Elman RNN against nn.RNN with copied weights."""

from __future__ import annotations

import pytest
import torch
from conftest import on_devices
from torch import nn

from course_lib.attention import MultiHeadAttention
from course_lib.rnn import (
    ElmanRNN,
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
    with pytest.raises(ValueError, match=r"x has size 5 .* input size Din"):
        elman_forward(torch.randn(2, 6, 5), torch.zeros(2, 4), W, U)
    with pytest.raises(ValueError, match="W must be square"):
        elman_forward(torch.randn(6, 3), torch.zeros(4), torch.randn(4, 5), U)
    with pytest.raises(ValueError, match="h0 has batch size 3"):
        elman_forward(torch.randn(2, 6, 3), torch.zeros(3, 4), W, U)
    with pytest.raises(ValueError, match="nonlinearity"):
        ElmanRNN(3, 4, nonlinearity="softsign")


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
    with pytest.raises(ValueError, match=r"x_t has size 5 .* input size Din"):
        elman_step(torch.randn(2, 5), torch.zeros(2, 4), W, U)
    with pytest.raises(ValueError, match=r"h_prev has size 3 .* hidden size H"):
        elman_step(torch.randn(2, 3), torch.zeros(2, 3), W, U)
    with pytest.raises(ValueError, match=r"x_t has batch size 2 .* h_prev has batch size 3"):
        elman_step(torch.randn(2, 3), torch.zeros(3, 4), W, U)
    with pytest.raises(ValueError, match=r"b has size 5"):
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
    with pytest.raises(ValueError, match="no autograd graph"):
        sequential_depth(torch.randn(3) * 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
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
    with pytest.raises(ValueError, match=r"x should have shape \(T, Din\) or \(B, T, Din\)"):
        gradient_norms(lambda v: rnn(v)[0], torch.randn(3))
    with pytest.raises(ValueError, match="lambda x: module\\(x\\)\\[0\\]"):
        gradient_norms(rnn, torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"fn\(x\) has shape \(5,\)"):
        gradient_norms(lambda v: rnn(v)[1], torch.randn(4, 3))
    with pytest.raises(ValueError, match="floating-point"):
        gradient_norms(lambda v: rnn(v)[0], torch.ones(4, 3, dtype=torch.long))
