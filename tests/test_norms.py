"""RMSNorm (against torch.nn.RMSNorm and F.rms_norm), the stricter argument checks of
layer_norm, and the per-layer gradient norms of a stack (against autograd by hand, and with
gradients too small to square in float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from course_lib import EncoderBlock, RMSNorm, layer_norm, rms_norm
from course_lib._validate import WrongTypeError, inputs_checked
from course_lib.layers import LayerNorm, _layer_norm, _rms_norm
from course_lib.probes import layer_grad_norms

# ------------------------------------------------------------------------------ RMSNorm


@on_devices
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-12])
def test_rmsnorm_matches_torch(device, eps):
    torch.manual_seed(0)
    ref = nn.RMSNorm(10, eps=eps).to(device)
    with torch.no_grad():
        ref.weight.normal_()
    ours = RMSNorm(10, eps=eps).to(device)
    ours.load_state_dict(ref.state_dict())  # the same parameter name, "weight"
    x = torch.randn(4, 3, 10, device=device) * 3 + 2
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm(x, ours.weight, eps=eps),
                               F.rms_norm(x, (10,), ours.weight, eps=eps), atol=1e-5, rtol=1e-5)


def test_rmsnorm_without_gain_matches_torch_and_has_no_parameters():
    x = torch.randn(6, 8) - 3
    ref = nn.RMSNorm(8, eps=1e-6, elementwise_affine=False)
    ours = RMSNorm(8, elementwise_affine=False)
    torch.testing.assert_close(ours(x), ref(x))
    assert list(ours.parameters()) == []
    assert [n for n, _ in RMSNorm(8).named_parameters()] == ["weight"]


def test_rmsnorm_gradients_match_torch():
    torch.manual_seed(1)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    ours, ref = RMSNorm(16), nn.RMSNorm(16, eps=1e-6)
    (ours(x) * torch.arange(16.0)).sum().backward()
    (ref(x_ref) * torch.arange(16.0)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad)


def test_rmsnorm_differs_from_layernorm_exactly_by_the_mean():
    """Centre x first and RMSNorm is LayerNorm (both without gain and bias)."""
    x = torch.randn(5, 32) * 2 + 4
    centred = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(rms_norm(centred, eps=1e-5), layer_norm(x, eps=1e-5))
    assert (rms_norm(x, eps=1e-5) - layer_norm(x, eps=1e-5)).abs().max() > 0.1


@given(
    shape=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    d=st.integers(2, 48),
    scale=st.floats(0.01, 100.0),
    seed=st.integers(0, 2**16),
)
def test_rmsnorm_output_has_unit_rms_and_ignores_the_input_scale(shape, d, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=gen, dtype=torch.float64) + 0.5
    out = rms_norm(x, eps=1e-12)
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones_like(rms))
    torch.testing.assert_close(rms_norm(scale * x, eps=1e-12), out)
    torch.testing.assert_close(out, F.rms_norm(x, (d,), eps=1e-12))


@given(t=st.integers(1, 6), j=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_rmsnorm_treats_positions_independently(t, j, seed):
    j = j % t
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 8, generator=gen)
    y = x.clone()
    y[j] = torch.randn(8, generator=gen) * 10
    moved = (rms_norm(x) - rms_norm(y)).abs().amax(-1)  # (T,)
    others = torch.arange(t) != j
    assert bool((moved[others] == 0).all())


def test_a_zero_vector_stays_zero_thanks_to_eps():
    """With eps the library's norms map a zero (or constant) vector to 0 and have finite
    gradients there; the same library code with eps = 0 divides 0 by 0."""
    x = torch.zeros(2, 4, requires_grad=True)
    out = rms_norm(x)
    assert torch.equal(out, torch.zeros(2, 4))
    constant = torch.full((2, 4), 3.0, requires_grad=True)
    assert torch.equal(layer_norm(constant), torch.zeros(2, 4))
    (out.sum() + layer_norm(constant).sum()).backward()
    assert bool(torch.isfinite(x.grad).all()) and bool(torch.isfinite(constant.grad).all())
    # the public functions refuse eps = 0; their equation-level bodies show why
    assert bool(torch.isnan(_rms_norm(torch.zeros(2, 4), None, 0.0)).all())
    assert bool(torch.isnan(_layer_norm(torch.full((2, 4), 3.0), None, None, 0.0)).all())


# ------------------------------------------------------------------------------ bad input

BAD_NORM_CALLS = [
    (lambda: rms_norm([1.0, 2.0]), TypeError, r"x must be a torch.Tensor, got list"),
    (lambda: rms_norm(torch.tensor(3.0)), ValueError, r"x should have shape \(\.\.\., D\)"),
    (lambda: rms_norm(torch.arange(4)), ValueError, r"x must be a floating-point tensor, "
                                                     r"got dtype torch.int64; .*x\.float\(\)"),
    (lambda: rms_norm(torch.randn(2, 5), torch.ones(4)), ValueError,
     r"weight has shape \(4,\) but x has 5 features .* should have shape \(5,\)"),
    (lambda: rms_norm(torch.randn(2, 5), torch.ones(5, dtype=torch.float64)), ValueError,
     r"weight has dtype torch.float64 but x's values are torch.float32"),
    (lambda: rms_norm(torch.randn(2, 5), eps=0), ValueError, r"eps must be a number > 0, got 0"),
    (lambda: rms_norm(torch.randn(2, 5), eps="1e-6"), TypeError, r"eps must be a number > 0"),
    (lambda: layer_norm(torch.randn(2, 5), eps=-1.0), ValueError, r"eps must be a number > 0"),
    (lambda: layer_norm(torch.randn(2, 5), None, torch.zeros(5, dtype=torch.float16)),
     ValueError, r"bias has dtype torch.float16 but x's values are torch.float32"),
    (lambda: RMSNorm(0), ValueError, r"d_model must be a positive integer, got 0"),
    (lambda: RMSNorm(8.0), TypeError, r"d_model must be a positive integer, got 8.0 .*write 8"),
    (lambda: RMSNorm(8, eps=0.0), ValueError, r"eps must be a number > 0"),
    (lambda: RMSNorm(8)(torch.randn(3, 7)), ValueError,
     r"x has shape \(3, 7\) but its last dimension should be d_model=8"),
    (lambda: RMSNorm(8)(torch.randn(3, 8, dtype=torch.float64)), ValueError,
     r"x has dtype torch.float64 but the RMSNorm's weights are torch.float32: .*x\.float\(\)"),
    (lambda: RMSNorm(8)(torch.ones(3, 8, dtype=torch.long)), ValueError,
     r"x must be a floating-point tensor"),
]


@pytest.mark.parametrize("call,error,message", BAD_NORM_CALLS)
def test_norms_reject_bad_input_with_a_clear_message(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("ndim", [1, 8])
def test_functions_and_modules_accept_the_same_numbers_of_dimensions(ndim):
    x = torch.randn(*([1] * (ndim - 1)), 4)
    for norm in (layer_norm, rms_norm, LayerNorm(4), RMSNorm(4)):
        assert norm(x).shape == x.shape


def test_functions_and_modules_reject_the_same_too_many_dimensions():
    x = torch.randn(*([1] * 8), 4)  # 9-D
    for norm in (layer_norm, rms_norm, LayerNorm(4), RMSNorm(4)):
        with pytest.raises(ValueError, match=r"x should have shape \(\.\.\., D\), but got a 9-D"):
            norm(x)


@pytest.mark.parametrize("module", [LayerNorm(8), RMSNorm(8)])
def test_modules_check_inputs_unless_a_library_caller_has(module):
    """As FeedForward: checked when called directly, trusted inside inputs_checked()."""
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="x has dtype torch.float64"):
        module(x)
    with inputs_checked():
        assert module(x).shape == (3, 8)  # no check: torch promotes to float64


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
     r"layers must be a sequence of modules .* got one EncoderBlock; pass its layers, "
     r"e\.g\. model\.blocks"),
    (lambda: layer_grad_norms(torch.randn(3)), TypeError, r"layers must be a sequence of modules"),
    (lambda: layer_grad_norms(7), TypeError, r"layers must be a sequence of modules .* got int"),
    (lambda: layer_grad_norms([]), ValueError, r"layers is empty"),
    (lambda: layer_grad_norms([nn.Linear(2, 2), "block"]), TypeError,
     r"layers\[1\] must be a torch\.nn\.Module, got str"),
    (lambda: layer_grad_norms([nn.Linear(2, 2), nn.ReLU()]), ValueError,
     r"layers\[1\] \(ReLU\) has no parameters"),
    (lambda: layer_grad_norms(_stack(2)), ValueError,
     r"none of the layers' parameters has a gradient: call loss\.backward\(\) first"),
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


def test_wrong_type_errors_are_also_value_errors():
    with pytest.raises(WrongTypeError):
        layer_grad_norms(7)
