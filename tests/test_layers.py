"""course_lib.layers: LayerNorm (the teaching path and torch's fused one), RMSNorm (against
torch.nn.RMSNorm and F.rms_norm), FeedForward, SwiGLU (against Hugging Face's LlamaMLP with
copied weights; position-wise), the norm and feed-forward factories, and their argument
checks."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from course_lib._validate import inputs_checked
from course_lib.configs import DecoderConfig
from course_lib.layers import (
    FeedForward,
    LayerNorm,
    RMSNorm,
    SwiGLU,
    layer_norm,
    make_feed_forward,
    make_norm,
    rms_norm,
)
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
    # exact identity: rms_norm(s x, eps = s^2 e) = x / sqrt(mean(x^2) + e), whatever mean(x^2)
    torch.testing.assert_close(rms_norm(scale * x, eps=scale**2 * 1e-12), out)
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
    # the public functions refuse eps = 0; their equations, run unchecked, show why
    with inputs_checked():
        assert bool(torch.isnan(rms_norm(torch.zeros(2, 4), eps=0.0)).all())
        assert bool(torch.isnan(layer_norm(torch.full((2, 4), 3.0), eps=0.0)).all())


# ------------------------------------------------------------------------------ bad input

X64 = torch.from_numpy(np.random.default_rng(0).normal(size=(2, 3, 8)))  # float64, from numpy
X64_MESSAGE = r"^x has dtype torch\.float64.*float32.*x\.float\(\)"  # names the fix

BAD_LAYER_CALLS = [
    # not a tensor, too few or too many dimensions, integers
    (lambda: rms_norm([1.0, 2.0]), TypeError, r"^x .*torch\.Tensor.*list"),
    (lambda: rms_norm(torch.tensor(3.0)), ValueError, r"^x .*\(\.\.\., D\).*\(\)"),
    (lambda: rms_norm(torch.arange(4)), ValueError, r"^x .*floating-point.*int64"),
    (lambda: RMSNorm(8)(torch.ones(3, 8, dtype=torch.long)), ValueError,
     r"^x .*floating-point.*int64"),
    (lambda: FeedForward(4)(torch.ones(2, 4, dtype=torch.long)), ValueError,
     r"^x .*floating-point.*int64"),
    # a last dimension that is not the layer's size
    (lambda: FeedForward(8)(torch.randn(3, 7)), ValueError, r"^x has shape \(3, 7\).*=8"),
    (lambda: LayerNorm(8)(torch.randn(3, 7)), ValueError, r"^x has shape \(3, 7\).*=8"),
    (lambda: RMSNorm(8)(torch.randn(3, 7)), ValueError, r"^x has shape \(3, 7\).*=8"),
    (lambda: rms_norm(torch.randn(2, 5), torch.ones(4)), ValueError,
     r"^x has shape \(2, 5\).*weight\.shape\[-1\]=4"),
    (lambda: layer_norm(torch.randn(2, 5), torch.ones(4)), ValueError,
     r"^x has shape \(2, 5\).*weight\.shape\[-1\]=4"),
    (lambda: layer_norm(torch.randn(2, 5), torch.ones(5), torch.zeros(5, 1)), ValueError,
     r"bias\.shape\[-1\]=1"),
    # mixed dtypes: float64 from numpy into a float32 layer, and the fix
    (lambda: FeedForward(8)(X64), ValueError, X64_MESSAGE),
    (lambda: LayerNorm(8)(X64), ValueError, X64_MESSAGE),
    (lambda: RMSNorm(8)(X64), ValueError, X64_MESSAGE),
    (lambda: rms_norm(torch.randn(2, 5), torch.ones(5, dtype=torch.float64)), ValueError,
     r"^x has dtype torch\.float32.*weight.*float64"),
    (lambda: layer_norm(torch.randn(2, 5), None, torch.zeros(5, dtype=torch.float16)),
     ValueError, r"^x has dtype torch\.float32.*bias.*float16"),
    # eps
    (lambda: rms_norm(torch.randn(2, 5), eps=0), ValueError, r"^eps .*> 0.*got 0"),
    (lambda: rms_norm(torch.randn(2, 5), eps="1e-6"), TypeError, r"^eps .*> 0.*'1e-6'"),
    (lambda: layer_norm(torch.randn(2, 5), eps=-1.0), ValueError, r"^eps .*> 0.*-1\.0"),
    (lambda: RMSNorm(8, eps=0.0)(torch.randn(3, 8)), ValueError, r"^eps .*> 0.*0\.0"),
    # sizes <= 0 and sizes of the wrong type
    (lambda: RMSNorm(0), ValueError, r"^d_model .*>= 1.*got 0"),
    (lambda: RMSNorm(8.0), TypeError, r"^d_model .*8\.0.*write 8"),
    (lambda: LayerNorm(-3), ValueError, r"^d_model .*>= 1.*got -3"),
    (lambda: FeedForward(8, 0), ValueError, r"^d_ff .*>= 1.*got 0"),
    # options
    (lambda: FeedForward(8, activation="swish"), ValueError, r"^activation .*'gelu'.*'swish'"),
    (lambda: FeedForward(8, dropout=1.5), ValueError, r"^dropout .*\[0, 1\).*1\.5"),
]


@pytest.mark.parametrize("call,error,message", BAD_LAYER_CALLS)
def test_layers_reject_bad_input_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()


BOOLEAN_OPTIONS = {
    "FeedForward bias": (lambda v: FeedForward(8, bias=v), "bias"),
    "LayerNorm elementwise_affine": (lambda v: LayerNorm(8, elementwise_affine=v),
                                     "elementwise_affine"),
    "LayerNorm bias": (lambda v: LayerNorm(8, bias=v), "bias"),
    "RMSNorm elementwise_affine": (lambda v: RMSNorm(8, elementwise_affine=v),
                                   "elementwise_affine"),
}


@pytest.mark.parametrize("value", ["post", "False", 0, None])
@pytest.mark.parametrize("option", sorted(BOOLEAN_OPTIONS))
def test_boolean_options_refuse_anything_but_true_and_false(option, value):
    build, name = BOOLEAN_OPTIONS[option]
    with pytest.raises(TypeError, match=rf"^{name} must be True or False"):
        build(value)


@pytest.mark.parametrize("ndim", [1, 8])
def test_functions_and_modules_accept_the_same_numbers_of_dimensions(ndim):
    x = torch.randn(*([1] * (ndim - 1)), 4)
    for norm in (layer_norm, rms_norm, LayerNorm(4), RMSNorm(4)):
        assert norm(x).shape == x.shape


def test_functions_and_modules_reject_the_same_too_many_dimensions():
    x = torch.randn(*([1] * 8), 4)  # 9-D
    for norm in (layer_norm, rms_norm, LayerNorm(4), RMSNorm(4)):
        with pytest.raises(ValueError, match=r"^x .*\(\.\.\., D\).*\(1, 1, 1, 1, 1, 1, 1, 1, 4\)"):
            norm(x)


@pytest.mark.parametrize("module", [LayerNorm(8), RMSNorm(8)], ids=["LayerNorm", "RMSNorm"])
def test_modules_check_inputs_unless_a_library_caller_has(module):
    """As FeedForward: checked when called directly, trusted inside inputs_checked()."""
    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^x has dtype torch\.float64"):
        module(x)
    with inputs_checked():
        assert module(x).shape == (3, 8)  # no check: torch promotes to float64


# ------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_matches_hugging_face_llama_mlp(bias):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    reference = LlamaMLP(LlamaConfig(hidden_size=24, intermediate_size=40, num_attention_heads=4,
                                    num_key_value_heads=4, mlp_bias=bias))
    ours = SwiGLU(24, 40, bias=bias)
    assert set(ours.state_dict()) == set(reference.state_dict())  # the same names
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(3, 5, 24) * 3
    torch.testing.assert_close(ours(x), reference(x), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(FeedForward(24, 40, activation="gelu")(x), reference(x))


@given(t=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_swiglu_is_position_wise(t, seed):
    """Each position's output depends on that position only: a shuffle of positions shuffles
    the output, and position 0 alone gives its row."""
    torch.manual_seed(seed)
    ff, x = SwiGLU(8, 12, bias=True), torch.randn(2, t, 8)
    order = torch.randperm(t)
    torch.testing.assert_close(ff(x)[:, order], ff(x[:, order]))
    torch.testing.assert_close(ff(x)[:, :1], ff(x[:, :1]))


def test_swiglu_defaults_and_dropout():
    ff = SwiGLU(8)
    assert ff.gate_proj.weight.shape == ff.up_proj.weight.shape == (32, 8)  # F = 4 D
    assert ff.down_proj.bias is None  # Llama's projections have no biases
    noisy = SwiGLU(8, dropout=0.5).train()
    x = torch.randn(4, 8)
    assert not torch.equal(noisy(x), noisy.eval()(x))


def test_the_factories_build_the_named_kind_and_refuse_others():
    assert type(make_norm("layer", 8, eps=1e-6)) is nn.LayerNorm
    rms = make_norm("rms", 8, eps=1e-6)
    assert type(rms) is nn.RMSNorm and rms.eps == 1e-6 and rms.weight.shape == (8,)
    x = torch.randn(3, 8)
    torch.testing.assert_close(rms(x), rms_norm(x, eps=1e-6))
    assert type(make_feed_forward("swiglu", 8, 16)) is SwiGLU
    mlp = make_feed_forward("mlp", 8, 16, activation="gelu", bias=False)
    assert type(mlp) is FeedForward and mlp.activation_name == "gelu" and mlp.fc1.bias is None
    with pytest.raises(ValueError, match=r"norm must be one of 'layer', 'rms'; got 'batch'"):
        make_norm("batch", 8)
    assert make_feed_forward("none", 8, 16) is None  # an attention-only block
    with pytest.raises(ValueError,
                       match=r"ffn must be one of 'mlp', 'swiglu', 'none'; got 'glu'"):
        make_feed_forward("glu", 8)


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: SwiGLU(0), ValueError, r"d_model .*>= 1"),
    (lambda: SwiGLU(8, 2.5), TypeError, r"d_ff .*integer"),
    (lambda: SwiGLU(8, bias=1), TypeError, r"bias must be True or False"),
    (lambda: SwiGLU(8)(torch.randn(2, 6)), ValueError, r"x .*\(2, 6\)"),
    (lambda: SwiGLU(8)(torch.ones(2, 8, dtype=torch.long)), ValueError, r"x .*int64"),
])
def test_swiglu_names_a_bad_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
