"""Position representations against independent implementations in Hugging Face transformers
(BLOOM's ALiBi, GPT-J's interleaved rotary embedding) plus their defining properties."""

from __future__ import annotations

import pytest
import torch
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
    with pytest.raises(ValueError, match="even"):
        apply_rope(torch.randn(4, 5))
    with pytest.raises(ValueError, match="positions"):
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
    with pytest.raises(ValueError, match="scaling_factor"):
        RotaryEmbedding(8, scaling_factor=0.0)
    with pytest.raises(ValueError, match="d_head must be at least 4"):
        ntk_scaled_base(2, 2.0)
    with pytest.raises(ValueError, match="scaling_factor"):
        ntk_scaled_base(8, -1.0)
    with pytest.raises(TypeError, match="d_head"):
        ntk_scaled_base(8.0, 2.0)
    assert "scaling_factor=2.0" in repr(RotaryEmbedding(8, scaling_factor=2.0))
