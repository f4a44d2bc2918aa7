"""Bad input to rnn, positions, probes and device: every mistake gets an error naming the
argument, what it received and what was expected; probes refuse to conclude from NaN; nothing
computes in float64 on a device that may lack it (MPS)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import DEVICES
from torch.overrides import TorchFunctionMode

from course_lib._validate import WrongTypeError
from course_lib.attention import MultiHeadAttention
from course_lib.device import best_time, get_device, seed_everything, synchronize
from course_lib.positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    rope_frequencies,
    sinusoidal_encoding,
)
from course_lib.probes import future_leaks, influence, who_sees_whom
from course_lib.rnn import ElmanRNN, elman_forward, elman_step, gradient_norms

# ------------------------------------------------------------------------------ mixed dtypes


def test_float64_from_numpy_into_the_rnn_names_x_and_the_fix():
    rnn = ElmanRNN(3, 4)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((2, 5, 3)))  # float64
    with pytest.raises(ValueError, match=r"x has dtype torch.float64 but the RNN's weights are "
                       r"torch.float32: convert it with x\.float\(\) \(numpy arrays"):
        rnn(x)
    with pytest.raises(ValueError, match=r"h0 has dtype torch.float64 .* h0\.float\(\)"):
        rnn(x.float(), torch.zeros(2, 4, dtype=torch.float64))
    assert rnn(x.float())[0].shape == (2, 5, 4)  # the proposed fix works


def test_integer_tensors_into_the_rnn_are_refused():
    rnn = ElmanRNN(3, 4)
    with pytest.raises(ValueError, match=r"x has dtype torch.int64 .* x\.float\(\)"):
        rnn(torch.ones(2, 5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        gradient_norms(lambda v: rnn(v)[0], torch.ones(5, 3, dtype=torch.long))


def test_rnn_functions_name_the_tensor_whose_dtype_differs():
    W, U, b = torch.randn(4, 4), torch.randn(4, 3), torch.randn(4)
    with pytest.raises(ValueError, match=r"x_t has dtype torch.float64 but W has dtype "
                       r"torch.float32.*x_t\.float\(\)"):
        elman_step(torch.randn(3, dtype=torch.float64), torch.zeros(4), W, U, b)
    with pytest.raises(ValueError, match=r"b has dtype torch.float64 but W"):
        elman_forward(torch.randn(5, 3), torch.zeros(4), W, U, b.double())
    with pytest.raises(ValueError, match=r"W must be a floating-point tensor, got dtype torch.int64"):
        elman_forward(torch.randn(5, 3), torch.zeros(4), W.long(), U.long())


@pytest.mark.parametrize("rope", [apply_rope, RotaryEmbedding(4)], ids=["apply_rope", "module"])
def test_rope_refuses_integer_vectors_instead_of_truncating(rope):
    x = torch.full((3, 4), 3, dtype=torch.long)  # rotated, these would come back truncated
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor, got dtype "
                       r"torch.int64; convert it with x\.float\(\)"):
        rope(x)
    with pytest.raises(ValueError, match="positions must hold integer positions, got dtype torch.bool"):
        rope(torch.randn(3, 4), torch.ones(3, dtype=torch.bool))


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


def test_learned_positions_want_a_length_not_a_tensor():
    table = LearnedPositionalEmbedding(8, 4)
    with pytest.raises(TypeError, match=r"seq_len must be an integer >= 0, got 3.0 \(float\); write 3"):
        table(3.0)
    with pytest.raises(TypeError, match=r"seq_len .* a tensor of shape \(2, 3\).*x\.shape\[1\]"):
        table(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="offset must be an integer >= 0, got -1"):
        table(3, offset=-1)


def test_sinusoidal_encoding_refuses_an_integer_dtype():
    with pytest.raises(ValueError, match=r"dtype must be a floating-point dtype .* got torch.int64"):
        sinusoidal_encoding(4, 8, dtype=torch.long)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        sinusoidal_encoding(4, 8, dtype="float32")


# ----------------------------------------------------------------- config values and sizes

CONFIG_ERRORS = [
    (lambda: ElmanRNN(3, 0), ValueError, "hidden_size must be a positive integer, got 0"),
    (lambda: ElmanRNN(3, 4.0), TypeError, r"hidden_size .* got 4.0 \(float\); write 4"),
    (lambda: ElmanRNN(True, 4), TypeError, r"input_size .* got True \(bool\)"),
    (lambda: ElmanRNN(3, 4, bias="no"), TypeError, "bias must be True or False, got 'no'"),
    (lambda: ElmanRNN(3, 4, nonlinearity="softsign"), ValueError,
     "nonlinearity must be one of 'relu', 'sigmoid', 'tanh'; got 'softsign'"),
    (lambda: LearnedPositionalEmbedding(64.0, 8), TypeError, r"max_len .* got 64.0 \(float\)"),
    (lambda: LearnedPositionalEmbedding("64", 8), TypeError, "max_len .* without quotes"),
    (lambda: LearnedPositionalEmbedding(64, -8), ValueError, "d_model must be a positive integer"),
    (lambda: SinusoidalPositionalEncoding(0), ValueError, "d_model must be a positive integer, got 0"),
    (lambda: SinusoidalPositionalEncoding(8.0), TypeError, "d_model must be a positive integer"),
    (lambda: SinusoidalPositionalEncoding(8, base=0), ValueError, "base must be a number > 0, got 0"),
    (lambda: SinusoidalPositionalEncoding(8, base="1e4"), TypeError, "base must be a number > 0"),
    (lambda: sinusoidal_encoding(4, 8, base=-1.0), ValueError, "base must be a number > 0, got -1.0"),
    (lambda: sinusoidal_encoding(4.0, 8), TypeError, "n_positions must be a positive integer"),
    (lambda: RotaryEmbedding(0), ValueError, "d_head must be a positive integer, got 0"),
    (lambda: RotaryEmbedding(8, base=0), ValueError, "base must be a number > 0, got 0"),
    (lambda: RotaryEmbedding(8, base=math.inf), ValueError, "base must be a number > 0, got inf"),
    (lambda: apply_rope(torch.randn(3, 8), base=-10), ValueError, "base must be a number > 0"),
    (lambda: rope_frequencies(8, base=True), TypeError, "base must be a number > 0, got True"),
    (lambda: alibi_slopes(0), ValueError, "n_heads must be a positive integer, got 0"),
    (lambda: alibi_slopes(2.0), TypeError, r"n_heads .* got 2.0 \(float\); write 2"),
    (lambda: alibi_slopes(True), TypeError, r"n_heads .* got True \(bool\)"),
    (lambda: alibi_bias(4, n_heads=0), ValueError, "n_heads must be a positive integer, got 0"),
    (lambda: alibi_bias(4.0, n_heads=2), TypeError, "n_queries must be a positive integer"),
    (lambda: who_sees_whom(lambda x: x, torch.randn(1, 3), n_trials=True), TypeError,
     "n_trials must be a positive integer, got True"),
    (lambda: who_sees_whom(lambda x: x, torch.randn(1, 3), seed="0"), TypeError,
     "seed must be an integer, got '0'"),
    (lambda: who_sees_whom(lambda x: x, torch.randn(1, 3), per_example=1), TypeError,
     "per_example must be True or False, got 1"),
    (lambda: who_sees_whom(lambda x: x, torch.randn(1, 3), atol=math.nan), ValueError,
     "atol must be a number >= 0, got nan"),
    (lambda: who_sees_whom(torch.randn(1, 3), torch.randn(1, 3)), TypeError,
     "fn must be a function of x .* got Tensor"),
    (lambda: seed_everything(True), TypeError, r"seed must be an integer, got True \(bool\)"),
    (lambda: best_time(lambda: None, repeat=2.0), TypeError, "repeat must be a positive integer"),
]


@pytest.mark.parametrize("call, error, match", CONFIG_ERRORS,
                         ids=[m.split(" ")[0] + f"-{i}" for i, (_, _, m) in enumerate(CONFIG_ERRORS)])
def test_bad_config_values_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_a_wrong_type_is_also_a_value_error_for_older_callers():
    with pytest.raises(ValueError, match="max_len"):
        LearnedPositionalEmbedding(64.0, 8)
    assert issubclass(WrongTypeError, TypeError) and issubclass(WrongTypeError, ValueError)


def test_numpy_integers_are_sizes_too():
    assert ElmanRNN(np.int64(3), np.int64(4))(torch.randn(2, 3))[0].shape == (2, 4)
    assert alibi_slopes(np.int64(4)).shape == (4,)


# --------------------------------------------------------------------------- device names


def test_an_unknown_device_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"prefer='gpu' is not a device name: use one of "
                       r"'cpu', 'cuda', 'mps'.*available on this machine: 'cpu'"):
        get_device("gpu")
    with pytest.raises(ValueError, match="prefer='meta' is not a device name"):
        get_device("meta")  # a real torch device, but not one to run the course on
    with pytest.raises(TypeError, match=r"prefer must be a device name .* got 3 \(int\)"):
        get_device(3)


def test_an_unknown_course_device_variable_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"COURSE_DEVICE='gpu' is not a device name.*'cuda'"):
        get_device()
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")


def test_a_device_this_machine_lacks_is_named():
    with pytest.raises(ValueError, match=r"prefer='cuda:99' but .*(CUDA is not available|"
                       r"this machine has \d+ CUDA device)"):
        get_device("cuda:99")
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match=r"prefer='mps' but MPS is not available.*'cpu'"):
            get_device("mps")


def test_timing_helpers_name_a_bad_device():
    with pytest.raises(ValueError, match=r"device='gpu' is not a device name.*'mps'"):
        synchronize("gpu")
    calls = []
    with pytest.raises(ValueError, match=r"device='gpu' is not a device name"):
        best_time(lambda: calls.append(1), device="gpu")
    assert calls == []  # refused before running anything
    synchronize("meta")  # any real torch device is fine: nothing to wait for


# ------------------------------------------------------------------- probes and NaN / inf


def _attention_without_mask():
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).eval()
    return lambda x: mha(x)[0]  # every output sees every input: it leaks


def test_a_nan_input_never_makes_a_leaking_model_look_causal():
    leaky = _attention_without_mask()
    x = torch.randn(2, 5, 8)
    assert not future_leaks(leaky, x).is_causal
    x[1, 4, 0] = float("nan")  # every output of example 1 becomes NaN
    with pytest.raises(ValueError, match=r"x contains 1 NaN or inf value\(s\), the first at "
                       r"index \(1, 4, 0\).*could conclude nothing"):
        future_leaks(leaky, x)
    x[1, 4, 0] = float("inf")
    with pytest.raises(ValueError, match="x contains 1 NaN or inf"):
        influence(leaky, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_model_whose_output_is_not_finite_is_refused(bad):
    causal = torch.ones(4, 4).tril()  # (T, T)

    def model(x):  # causal, but position 2 of example 1 is broken
        out = torch.einsum("ij,bjd->bid", causal, x).clone()
        out[1, 2] = bad
        return out

    with pytest.raises(ValueError, match=r"fn's output contains NaN or inf for the unperturbed "
                       r"input x \(example 1, positions \[2\]\).*cannot conclude"):
        future_leaks(model, torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="fn's output contains NaN or inf"):
        who_sees_whom(model, torch.randn(2, 4, 3))


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

    with pytest.raises(ValueError, match="fn gives different outputs for the same input"):
        future_leaks(flaky, torch.randn(1, 3, 2))


# ------------------------------------------------------------------------ float64 on devices


class Float64Watch(TorchFunctionMode):
    """Records every torch call that produces a float64 tensor off the CPU: on MPS, which has
    no float64, each of them would fail."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.device.type != "cpu":
                self.calls.append(getattr(func, "__name__", str(func)))
        return out


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
        assert ElmanRNN(3, 4).to("meta")(torch.randn(2, 5, 3, device="meta"))[0].shape == (2, 5, 4)
    assert watch.calls == []


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.type)
def test_probes_compare_in_float64_on_the_cpu_only(device):
    torch.manual_seed(0)
    mha = MultiHeadAttention(8, 2).to(device).eval()
    x = torch.randn(2, 4, 8, device=device)
    with Float64Watch() as watch:
        report = future_leaks(lambda x: mha(x, is_causal=True)[0], x)
    assert report.is_causal and watch.calls == []


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
