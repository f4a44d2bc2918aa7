"""Position representations against independent implementations in Hugging Face transformers
(BLOOM's ALiBi, GPT-J's interleaved rotary embedding) plus their defining properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import Float64Watch
from hypothesis import given
from hypothesis import strategies as st
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.gptj.modeling_gptj import (
    apply_rotary_pos_emb,
    create_sinusoidal_positions,
)

from course_lib.positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    ntk_scaled_base,
    rope_frequencies,
    sinusoidal_encoding,
)


def test_sinusoidal_matches_gptj_tables():
    # GPT-J stores the same sin / cos values as two halves instead of interleaved pairs.
    ref = create_sinusoidal_positions(50, 16)
    ours = sinusoidal_encoding(50, 16)
    torch.testing.assert_close(ours[:, 0::2], ref[:, :8])
    torch.testing.assert_close(ours[:, 1::2], ref[:, 8:])


def test_sinusoidal_dot_product_depends_only_on_offset():
    pe = sinusoidal_encoding(200, 64)
    for offset in (1, 5, 17):
        dots = (pe[:-offset] * pe[offset:]).sum(-1)
        torch.testing.assert_close(dots, dots[0].expand_as(dots), atol=1e-4, rtol=0)


def test_sinusoidal_module_follows_any_length():
    module = SinusoidalPositionalEncoding(8)
    torch.testing.assert_close(module(300), sinusoidal_encoding(300, 8))
    torch.testing.assert_close(module(3, offset=4), sinusoidal_encoding(7, 8)[4:])
    assert len(module.state_dict()) == 0


def test_learned_positions_have_a_hard_length_limit():
    table = LearnedPositionalEmbedding(8, 4)
    assert table(8).shape == (8, 4)
    with pytest.raises(ValueError, match="max_len=8"):
        table(9)


@pytest.mark.parametrize("n_heads", [1, 2, 3, 4, 6, 8, 12, 16, 20])
def test_alibi_slopes_match_bloom(n_heads):
    # BLOOM's alibi tensor is slope_h * position for each head; position 1 gives the slope.
    ref = build_alibi_tensor(torch.ones(1, 4, dtype=torch.long), n_heads, torch.float32)
    torch.testing.assert_close(alibi_slopes(n_heads), ref[:, 0, 1])


def test_alibi_slopes_for_eight_heads_are_the_papers():
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))


def test_alibi_bias_is_eq13_for_one_head_with_slope_one():
    bias = alibi_bias(5, slopes=torch.tensor([1.0]))
    assert bias.shape == (1, 5, 5)
    # row i = [-i, ..., -1, 0, -1, ..., -(n-1-i)]
    assert bias[0, 2].tolist() == [-2.0, -1.0, 0.0, -1.0, -2.0]
    assert bias[0, 0].tolist() == [0.0, -1.0, -2.0, -3.0, -4.0]


def test_alibi_bias_per_head_and_rectangular():
    bias = alibi_bias(3, 5, n_heads=2)
    slopes = alibi_slopes(2)
    assert bias.shape == (2, 3, 5)
    # the last query sits at the last key position
    torch.testing.assert_close(bias[:, -1, -1], torch.zeros(2))
    torch.testing.assert_close(bias[1, 0], -slopes[1] * torch.tensor([2.0, 1, 0, 1, 2]))


def test_rope_matches_gptj():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 3, 16)  # GPT-J's layout: (B, T, H, Dh)
    table = create_sinusoidal_positions(7, 16)  # (T, Dh) = [sin | cos]
    sin, cos = table[None, :, :8], table[None, :, 8:]
    ref = apply_rotary_pos_emb(x, sin, cos)
    ours = apply_rope(x.transpose(1, 2)).transpose(1, 2)  # ours wants (..., T, Dh)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_rotary_module_tables_match_the_function():
    rope = RotaryEmbedding(8)
    long, short = torch.randn(2, 20, 8), torch.randn(2, 5, 8)
    torch.testing.assert_close(rope(short), apply_rope(short))  # builds tables for 5
    torch.testing.assert_close(rope(long), apply_rope(long))  # grows them to 20
    torch.testing.assert_close(rope(short), apply_rope(short))  # reuses a prefix
    positions = torch.tensor([3, 1, 4, 1, 5])
    torch.testing.assert_close(rope(short, positions), apply_rope(short, positions))


def test_rope_keeps_norms_and_position_zero():
    x = torch.randn(3, 10, 8)
    out = apply_rope(x)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, 0], x[:, 0])  # rotation by angle 0


@given(
    p=st.integers(0, 200),
    r=st.integers(0, 200),
    shift=st.integers(0, 500),
    d_half=st.integers(1, 16),
    seed=st.integers(0, 2**16),
)
def test_rope_scores_depend_only_on_offset(p, r, shift, d_half, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2 * d_half, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 2 * d_half, generator=gen, dtype=torch.float64)
    rope = RotaryEmbedding(2 * d_half)

    def score(pos_q, pos_k):
        rq = rope(q.float(), torch.tensor([pos_q]))
        rk = rope(k.float(), torch.tensor([pos_k]))
        return float((rq * rk).sum())

    # moving both tokens by the same amount leaves their score unchanged
    assert score(p, r) == pytest.approx(score(p + shift, r + shift), abs=2e-3)


def test_rope_rejects_odd_dims_and_wrong_positions():
    with pytest.raises(ValueError, match=r"Dh.*even.*5"):
        apply_rope(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"positions .*\(3,\).*T=4"):
        apply_rope(torch.randn(4, 6), torch.arange(3))


def test_tables_built_under_inference_mode_can_still_be_trained_through():
    rope, sinusoids = RotaryEmbedding(8), SinusoidalPositionalEncoding(8)
    with torch.inference_mode():  # e.g. generating text before training
        rope(torch.randn(5, 8))
        sinusoids(5)
    x = torch.randn(5, 8, requires_grad=True)
    (rope(x) * sinusoids(5)).sum().backward()  # both cached tables are saved for backward
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_sinusoidal_module_gives_the_rows_asked_for_after_moving():
    module = SinusoidalPositionalEncoding(8)
    module(10)  # a 10-row table on the CPU
    module.to("meta")
    assert module(3).shape == (3, 8) and module(3).device.type == "meta"
    assert module(2, offset=4).shape == (2, 8)


# ------------------------------------------------- stretching RoPE to longer inputs


def _hf_inv_freq(rope_type: str, d_head: int, factor: float, seq_len: int, trained: int):
    """Hugging Face's inverse frequencies for a Llama config with this RoPE scaling."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=2 * d_head, num_attention_heads=2,
                         max_position_embeddings=trained,
                         rope_parameters={"rope_type": rope_type, "factor": factor,
                                          "rope_theta": 10000.0})
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq


@pytest.mark.parametrize("d_head", [8, 16, 64])
@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_ntk_scaled_base_matches_hugging_face_dynamic_ntk(d_head, factor):
    # HF's dynamic NTK with factor 1 at seq_len = factor * trained length is the static formula
    ref = _hf_inv_freq("dynamic", d_head, 1.0, int(32 * factor), 32)
    ours = rope_frequencies(d_head, base=ntk_scaled_base(d_head, factor))
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_position_interpolation_matches_hugging_face_linear_scaling(factor):
    d_head = 16
    inv_freq = _hf_inv_freq("linear", d_head, factor, 32, 32)  # theta_i / factor
    x = torch.randn(2, 3, 40, d_head)
    angles = torch.arange(40.0)[:, None] * inv_freq.float()  # (T, Dh/2)
    cos, sin = angles.cos(), angles.sin()
    expected = torch.stack((x[..., 0::2] * cos - x[..., 1::2] * sin,
                            x[..., 0::2] * sin + x[..., 1::2] * cos), dim=-1).flatten(-2)
    rope = RotaryEmbedding(d_head, scaling_factor=factor)
    torch.testing.assert_close(rope(x), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope(x, torch.arange(40)), expected, atol=1e-5, rtol=1e-5)


def test_ntk_scaling_keeps_the_fastest_pair_and_slows_the_slowest_by_the_factor():
    for d_head, factor in ((8, 2.0), (16, 4.0), (64, 8.0)):
        plain = rope_frequencies(d_head)
        scaled = rope_frequencies(d_head, base=ntk_scaled_base(d_head, factor))
        assert scaled[0] == plain[0] == 1.0
        assert float(plain[-1] / scaled[-1]) == pytest.approx(factor, rel=1e-5)
        ratios = plain / scaled  # grow geometrically from 1 to the factor
        assert bool((ratios[1:] > ratios[:-1]).all())


@given(offset=st.integers(0, 60), shift=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_scaled_rope_scores_still_depend_only_on_offset(offset, shift, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, 1, 16, generator=gen, dtype=torch.float64)
    for rope in (RotaryEmbedding(16, scaling_factor=4.0),
                 RotaryEmbedding(16, base=ntk_scaled_base(16, 4.0))):
        def score(p, r, rope=rope):
            return float((rope(q, torch.tensor([p])) * rope(k, torch.tensor([r]))).sum())
        assert score(0, offset) == pytest.approx(score(shift, shift + offset), abs=1e-9)


def test_position_interpolation_at_factor_times_the_position_is_plain_rope():
    x = torch.randn(3, 10, 8)
    positions = torch.arange(10)
    stretched = RotaryEmbedding(8, scaling_factor=2.0)(x, 2 * positions)
    torch.testing.assert_close(stretched, apply_rope(x, positions))


def test_scaling_arguments_are_checked():
    with pytest.raises(ValueError, match=r"scaling_factor.*> 0"):
        RotaryEmbedding(8, scaling_factor=0.0)
    with pytest.raises(ValueError, match=r"d_head.*4.*got 2"):
        ntk_scaled_base(2, 2.0)
    with pytest.raises(ValueError, match=r"scaling_factor.*> 0.*-1"):
        ntk_scaled_base(8, -1.0)
    with pytest.raises(TypeError, match=r"d_head.*integer"):
        ntk_scaled_base(8.0, 2.0)
    assert "scaling_factor=2.0" in repr(RotaryEmbedding(8, scaling_factor=2.0))


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("rope", [apply_rope, RotaryEmbedding(4)], ids=["apply_rope", "module"])
def test_rope_refuses_integer_vectors_instead_of_truncating(rope):
    x = torch.full((3, 4), 3, dtype=torch.long)  # rotated, these would come back truncated
    with pytest.raises(ValueError, match=r"x .*floating-point.*int64.*x\.float\(\)"):
        rope(x)


@pytest.mark.parametrize("rope", [apply_rope, RotaryEmbedding(4)], ids=["apply_rope", "module"])
def test_rope_refuses_boolean_positions(rope):
    with pytest.raises(ValueError, match=r"positions .*integer.*bool"):
        rope(torch.randn(3, 4), torch.ones(3, dtype=torch.bool))


def test_learned_positions_want_a_length_not_a_tensor():
    table = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(TypeError, match=r"seq_len .*integer >= 0.*3\.0.*write 3"):
        table(3.0)
    with pytest.raises(TypeError, match=r"seq_len .* a tensor of shape \(2, 3\).*x\.shape\[1\]"):
        table(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"offset .*integer >= 0.*-1"):
        table(3, offset=-1)


def test_sinusoidal_encoding_refuses_an_integer_dtype():
    with pytest.raises(ValueError, match=r"dtype .*floating-point.*torch.int64"):
        sinusoidal_encoding(4, 8, dtype=torch.long)
    with pytest.raises(TypeError, match=r"dtype .*torch.dtype.*'float32'"):
        sinusoidal_encoding(4, 8, dtype="float32")


CONFIG_ERRORS = [
    (lambda: LearnedPositionalEmbedding(64.0, 8), TypeError, r"max_len .*64\.0 \(float\)"),
    (lambda: LearnedPositionalEmbedding("64", 8), TypeError, "max_len .* without quotes"),
    (lambda: LearnedPositionalEmbedding(64, -8), ValueError, r"d_model .*>= 1.*-8"),
    (lambda: SinusoidalPositionalEncoding(0), ValueError, r"d_model .*>= 1.*0"),
    (lambda: SinusoidalPositionalEncoding(8.0), TypeError, r"d_model .*>= 1.*8\.0"),
    (lambda: SinusoidalPositionalEncoding(8, base=0), ValueError, r"base .*> 0.*got 0"),
    (lambda: SinusoidalPositionalEncoding(8, base="1e4"), TypeError, r"base .*> 0.*'1e4'"),
    (lambda: sinusoidal_encoding(4, 8, base=-1.0), ValueError, r"base .*> 0.*-1\.0"),
    (lambda: sinusoidal_encoding(4.0, 8), TypeError, r"n_positions .*>= 1.*4\.0"),
    (lambda: sinusoidal_encoding(4, 5), ValueError, r"d_model .*even.*5"),
    (lambda: RotaryEmbedding(0), ValueError, r"d_head .*>= 1.*0"),
    (lambda: RotaryEmbedding(8, base=0), ValueError, r"base .*> 0.*got 0"),
    (lambda: RotaryEmbedding(8, base=math.inf), ValueError, r"base .*> 0.*inf"),
    (lambda: apply_rope(torch.randn(3, 8), base=-10), ValueError, r"base .*> 0.*-10"),
    (lambda: rope_frequencies(8, base=True), TypeError, r"base .*> 0.*True"),
    (lambda: alibi_slopes(0), ValueError, r"n_heads .*>= 1.*0"),
    (lambda: alibi_slopes(2.0), TypeError, r"n_heads .*2\.0 \(float\); write 2"),
    (lambda: alibi_slopes(True), TypeError, r"n_heads .*True \(bool\)"),
    (lambda: alibi_bias(4, n_heads=0), ValueError, r"n_heads .*>= 1.*0"),
    (lambda: alibi_bias(4.0, n_heads=2), TypeError, r"n_queries .*>= 1.*4\.0"),
    (lambda: alibi_bias(4), ValueError, r"n_heads= or slopes="),
]


@pytest.mark.parametrize("call, error, match", CONFIG_ERRORS,
                         ids=[f"{m.split()[0]}-{i}" for i, (_, _, m) in enumerate(CONFIG_ERRORS)])
def test_bad_config_values_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# -------------------------------------------------------------- float64 and float32 accuracy


def _rope_reference(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE with complex numbers in float64: pair (a, b) at position p times e^(i p theta)."""
    seq_len, d_head = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, d_head, 2, dtype=torch.float64) / d_head)
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * theta  # (T, Dh/2)
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)).flatten(-2)


def test_float64_rope_is_computed_in_float64():
    torch.manual_seed(0)
    x = torch.randn(2, 300, 8, dtype=torch.float64)
    expected = _rope_reference(x)
    rope = RotaryEmbedding(8)
    rope(x.float())  # a float32 table in the cache must not serve float64 input
    for out in (apply_rope(x), rope(x), rope(x, torch.arange(300))):
        assert out.dtype == torch.float64
        torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert rope(x.float()).dtype == torch.float32  # and float32 input still gets float32


def test_sinusoids_keep_float64_accuracy_in_float32():
    # the table is computed in float64 (on the CPU) and rounded once; computing the angles
    # p / 10000^(2i/D) in float32 instead would be off by about 5e-4 at p = 10000
    p = np.arange(10000)[:, None]
    angles = p / 10000.0 ** (np.arange(0, 64, 2) / 64)
    expected = np.empty((10000, 64))
    expected[:, 0::2], expected[:, 1::2] = np.sin(angles), np.cos(angles)
    ours = sinusoidal_encoding(10000, 64).double().numpy()
    assert np.abs(ours - expected).max() < 1e-7
    module = SinusoidalPositionalEncoding(64)(10000).double().numpy()
    assert np.abs(module - expected).max() < 1e-7


def test_float32_rope_is_accurate_enough():
    # angles p * theta_i in float32 lose about p * 6e-8 radians: still < 1e-4 relative at 2048
    torch.manual_seed(0)
    x = torch.randn(2048, 64, dtype=torch.float64)
    error = (apply_rope(x.float()).double() - _rope_reference(x)).abs().max()
    assert error < 1e-4 * x.abs().max()



def test_the_watch_sees_float64_off_the_cpu():
    with Float64Watch() as watch:
        torch.arange(3, device="meta", dtype=torch.float64)
        torch.arange(3, dtype=torch.float64)  # on the CPU: fine
    assert watch.calls == ["arange"]


def test_positions_never_compute_in_float64_on_the_device():
    # "meta" stands in for MPS: it runs no kernels but keeps track of dtypes and devices
    with Float64Watch() as watch:
        assert sinusoidal_encoding(16, 8, device="meta").device.type == "meta"
        assert SinusoidalPositionalEncoding(8).to("meta")(5).shape == (5, 8)
        x = torch.randn(2, 5, 8, device="meta")
        assert apply_rope(x).dtype == torch.float32
        assert RotaryEmbedding(8)(x).dtype == torch.float32
        assert apply_rope(x, torch.arange(5, device="meta")).device.type == "meta"
        assert alibi_bias(4, n_heads=2, device="meta").dtype == torch.float32
    assert watch.calls == []
