"""LayerNorm (the teaching path and torch's fused one) and FeedForward."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import on_devices
from torch import nn

from course_lib.configs import DecoderConfig
from course_lib.layers import FeedForward, LayerNorm, layer_norm
from course_lib.models import DecoderLM


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


def _with_teaching_norms(model: nn.Module) -> int:
    """Replace every nn.LayerNorm in ``model`` by course_lib's LayerNorm with the same weights."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.LayerNorm):
                ours = LayerNorm(child.normalized_shape[0], eps=child.eps)
                ours.load_state_dict(child.state_dict())
                setattr(parent, name, ours)
                swapped += 1
    return swapped


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
def test_models_fused_layernorm_equals_the_teaching_layernorm(norm_first):
    """The models run torch's fused LayerNorm; the equation-level one gives the same output."""
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=30, d_model=24, n_heads=4, n_layers=3, max_len=16,
                           norm_first=norm_first)
    fast = DecoderLM(config).eval()
    for module in fast.modules():  # gains and shifts away from 1 and 0, so they matter
        if isinstance(module, nn.LayerNorm):
            nn.init.normal_(module.weight, 1.0, 0.3)
            nn.init.normal_(module.bias, 0.0, 0.3)
    teaching = copy.deepcopy(fast)
    assert _with_teaching_norms(teaching) == 2 * config.n_layers + int(norm_first)
    ids = torch.randint(0, 30, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(teaching(ids).logits, fast(ids).logits, atol=1e-5, rtol=1e-5)
