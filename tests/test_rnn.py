"""The Elman RNN against nn.RNN with copied weights."""

from __future__ import annotations

import pytest
import torch
from conftest import on_devices
from torch import nn

from course_lib.rnn import ElmanRNN, elman_forward


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
