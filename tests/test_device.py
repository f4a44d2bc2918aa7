"""best_time: the warm-up call, the minimum over measurements, the average within one."""

from __future__ import annotations

import time

import pytest
import torch

from course_lib.device import available_devices, best_time, num_threads, synchronize


class SleepThenCount:
    """A callable that sleeps the next duration from a list and counts its calls."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.calls = 0

    def __call__(self):
        time.sleep(self.durations[self.calls % len(self.durations)])
        self.calls += 1


def test_calls_once_untimed_then_repeat_times_number():
    fn = SleepThenCount([0.0])
    best_time(fn, repeat=4, number=3)
    assert fn.calls == 1 + 4 * 3


def test_the_untimed_first_call_is_left_out():
    fn = SleepThenCount([0.2, 0.01, 0.01, 0.01])  # a slow first call, as with lazy set-up
    assert best_time(fn, repeat=3) < 0.1


def test_takes_the_fastest_measurement():
    fn = SleepThenCount([0.0, 0.06, 0.02, 0.09])  # warm-up, then three measurements
    seconds = best_time(fn, repeat=3)
    assert 0.02 <= seconds < 0.05


def test_averages_the_calls_of_one_measurement():
    seconds = best_time(SleepThenCount([0.01]), repeat=2, number=4)
    assert 0.01 <= seconds < 0.03  # seconds per call, not per measurement of 4 calls


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
