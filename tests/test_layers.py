"""LayerNorm, FeedForward and the residual wrappers."""

from __future__ import annotations

import pytest
import torch
from conftest import on_devices
from torch import nn

from course_lib.layers import AddNorm, FeedForward, LayerNorm, Residual, layer_norm


@on_devices
@pytest.mark.parametrize("eps", [1e-5, 1e-12])
def test_layernorm_matches_torch(device, eps):
    torch.manual_seed(0)
    ref = nn.LayerNorm(10, eps=eps).to(device)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    ours = LayerNorm(10, eps=eps).to(device)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 10, device=device) * 3 + 2
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_layernorm_without_gain_or_bias_matches_torch():
    x = torch.randn(6, 8)
    ref = nn.LayerNorm(8, elementwise_affine=False)
    torch.testing.assert_close(LayerNorm(8, elementwise_affine=False)(x), ref(x))
    assert len(list(LayerNorm(8, elementwise_affine=False).parameters())) == 0
    ref_no_bias = nn.LayerNorm(8, bias=False)
    ours_no_bias = LayerNorm(8, bias=False)
    assert [n for n, _ in ours_no_bias.named_parameters()] == ["weight"]
    torch.testing.assert_close(ours_no_bias(x), ref_no_bias(x))


def test_layernorm_output_has_zero_mean_unit_variance_per_position():
    x = torch.randn(5, 7, 32) * 4 - 1
    out = layer_norm(x)
    torch.testing.assert_close(out.mean(-1), torch.zeros(5, 7), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(5, 7), atol=1e-3, rtol=0)


def test_layernorm_treats_positions_independently():
    x = torch.randn(1, 4, 8)
    y = x.clone()
    y[0, 2] *= 100
    diff = (layer_norm(x) - layer_norm(y)).abs().amax(-1)[0]
    assert diff[[0, 1, 3]].max() == 0


@pytest.mark.parametrize("activation,fn", [("relu", torch.relu), ("gelu", nn.GELU())])
def test_feedforward_is_two_linears_around_an_activation(activation, fn):
    torch.manual_seed(0)
    ff = FeedForward(8, 32, activation=activation)
    ref = nn.Sequential(nn.Linear(8, 32), nn.ReLU() if activation == "relu" else fn,
                        nn.Linear(32, 8))
    ref[0].load_state_dict(ff.fc1.state_dict())
    ref[2].load_state_dict(ff.fc2.state_dict())
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(ff(x), ref(x))


def test_feedforward_default_width_and_positionwise():
    ff = FeedForward(6)
    assert ff.fc1.out_features == 24
    x = torch.randn(2, 5, 6)
    whole = ff(x)
    one_by_one = torch.stack([ff(x[:, t]) for t in range(5)], dim=1)
    torch.testing.assert_close(whole, one_by_one)


def test_residual_adds_input():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    torch.testing.assert_close(Residual(lin)(x), x + lin(x))
    with pytest.raises(ValueError, match="keep the shape"):
        Residual(nn.Linear(4, 5))(x)


def test_addnorm_pre_and_post_orders():
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)
    x = torch.randn(2, 3, 6)
    pre = AddNorm(6, norm_first=True)
    post = AddNorm(6, norm_first=False)
    torch.testing.assert_close(pre(x, lin), x + lin(layer_norm(x)))  # eq. 30
    torch.testing.assert_close(post(x, lin), layer_norm(x + lin(x)))  # eq. 31
