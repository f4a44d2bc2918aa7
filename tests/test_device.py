"""best_time: the warm-up call, the minimum over measurements, the average within one.

The timing tests run on a fake clock that each call advances by a planned duration, so they
assert exact results and do not depend on how busy the machine is."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import course_lib.device as device_module
from course_lib.device import available_devices, best_time, num_threads, synchronize


class FakeClockCalls:
    """A callable that "takes" the next duration from a list on a fake clock and counts its
    calls; install the clock with ``monkeypatch.setattr(device_module, "time", calls.clock)``."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.calls = 0
        self.now = 0.0
        self.clock = SimpleNamespace(perf_counter=lambda: self.now)

    def __call__(self):
        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1


@pytest.fixture
def timed(monkeypatch):
    def make(durations):
        calls = FakeClockCalls(durations)
        monkeypatch.setattr(device_module, "time", calls.clock)
        return calls
    return make


def test_calls_once_untimed_then_repeat_times_number(timed):
    fn = timed([0.0])
    best_time(fn, repeat=4, number=3)
    assert fn.calls == 1 + 4 * 3


def test_the_untimed_first_call_is_left_out(timed):
    fn = timed([0.2, 0.01, 0.03, 0.02])  # a slow first call, as with lazy set-up
    assert best_time(fn, repeat=3) == pytest.approx(0.01)


def test_takes_the_fastest_measurement(timed):
    fn = timed([0.0, 0.06, 0.02, 0.09])  # warm-up, then three measurements
    assert best_time(fn, repeat=3) == pytest.approx(0.02)


def test_averages_the_calls_of_one_measurement(timed):
    fn = timed([0.5, 0.01, 0.03, 0.01, 0.03, 0.02, 0.02, 0.02, 0.02])  # warm-up, 2 x 4 calls
    assert best_time(fn, repeat=2, number=4) == pytest.approx(0.02)  # per call, not per 4


@pytest.mark.parametrize("device", available_devices(), ids=str)
def test_times_tensor_work_on_every_device(device):
    x = torch.randn(64, 64, device=device)
    assert best_time(lambda: x @ x, repeat=2, device=device) > 0
    synchronize(device)


@pytest.mark.parametrize("kwargs, match", [
    ({"repeat": 0}, "repeat must be a positive integer, got 0"),
    ({"number": 1.5}, "number must be a positive integer, got 1.5"),
    ({"repeat": True}, "repeat must be a positive integer, got True"),
])
def test_bad_counts_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        best_time(lambda: None, **kwargs)


def test_a_result_instead_of_a_function_is_named():
    with pytest.raises(ValueError, match="fn must be a function with no arguments, got Tensor"):
        best_time(torch.ones(2))  # a learner forgetting the lambda


def test_num_threads_sets_and_restores():
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1  # a number different from the current one
    with num_threads(other):
        assert torch.get_num_threads() == other
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        with num_threads(other):
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before  # restored after an error too
    with num_threads(None):
        assert torch.get_num_threads() == before


@pytest.mark.parametrize("bad", [0, -2, 1.0, True, "1"])
def test_num_threads_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match=f"n must be a positive integer or None, got {bad!r}"):
        with num_threads(bad):
            pass
