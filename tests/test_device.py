"""device.py: best_time (the warm-up call, the minimum over measurements, the average within
one), num_threads, choosing a device by name, seeding; and the errors for bad arguments.

The timing tests run on a fake clock that each call advances by a planned duration, so they
assert exact results and do not depend on how busy the machine is."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import course_lib.device as device_module
from course_lib.device import (
    available_devices,
    best_time,
    get_device,
    num_threads,
    seed_everything,
    synchronize,
)


class FakeClockCalls:
    """A callable that "takes" the next duration from a list on a fake clock and counts its
    calls; install the clock with ``monkeypatch.setattr(device_module, "time", calls.clock)``."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.calls = 0
        self.now = 0.0
        self.clock = SimpleNamespace(perf_counter=lambda: self.now, thread_time=lambda: self.now)

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


def test_the_thread_clock_is_read_the_same_way(timed, monkeypatch):
    fn = timed([0.0, 0.06, 0.02, 0.09])
    monkeypatch.setattr(fn.clock, "perf_counter", lambda: pytest.fail("the wall clock was read"))
    assert best_time(fn, repeat=3, clock="thread") == pytest.approx(0.02)


def test_an_unknown_clock_is_refused():
    with pytest.raises(ValueError, match=r"clock must be one of \['thread', 'wall'\], got 'cpu'"):
        best_time(lambda: None, clock="cpu")


def test_averages_the_calls_of_one_measurement(timed):
    fn = timed([0.5, 0.01, 0.03, 0.01, 0.03, 0.02, 0.02, 0.02, 0.02])  # warm-up, 2 x 4 calls
    assert best_time(fn, repeat=2, number=4) == pytest.approx(0.02)  # per call, not per 4


@pytest.mark.parametrize("device", available_devices(), ids=str)
def test_times_tensor_work_on_every_device(device):
    x = torch.randn(64, 64, device=device)
    assert best_time(lambda: x @ x, repeat=2, device=device) > 0
    synchronize(device)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"repeat": 0}, ValueError, r"repeat.*>= 1.*0"),
    ({"number": 1.5}, TypeError, r"number.*>= 1.*1\.5"),
    ({"repeat": True}, TypeError, r"repeat.*>= 1.*True"),
    ({"repeat": 2.0}, TypeError, r"repeat.*>= 1.*2\.0"),
])
def test_bad_counts_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        best_time(lambda: None, **kwargs)


def test_a_result_instead_of_a_function_is_named():
    with pytest.raises(TypeError, match=r"fn.*function.*Tensor"):
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


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.0, TypeError),
                                        (True, TypeError), ("1", TypeError)])
def test_num_threads_rejects_bad_counts(bad, error):
    before = torch.get_num_threads()
    with pytest.raises(error, match=rf"n must be .*>= 1.*{re.escape(repr(bad))}"):
        with num_threads(bad):
            pass
    assert torch.get_num_threads() == before


def test_get_device():
    assert get_device("cpu") == torch.device("cpu")
    assert get_device().type in {"cpu", "cuda", "mps"}
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"prefer='cuda'.*not available.*'cpu'"):
            get_device("cuda")


def test_device_names_are_checked():
    # an unknown name lists the valid ones and what this machine has
    with pytest.raises(ValueError, match=r"prefer='gpu'.*'cpu', 'cuda', 'mps'.*this machine has "
                                         r"'cpu'"):
        get_device("gpu")
    with pytest.raises(ValueError, match=r"prefer='meta'.*not a device name"):
        get_device("meta")  # a real torch device, but not one to run the course on
    with pytest.raises(TypeError, match=r"prefer.*device name.*3 \(int\)"):
        get_device(3)


def test_a_device_this_machine_lacks_is_named():
    with pytest.raises(ValueError, match=r"prefer='cuda:99'.*not available"):
        get_device("cuda:99")
    if not torch.backends.mps.is_available():
        with pytest.raises(ValueError, match=r"prefer='mps'.*not available.*'cpu'"):
            get_device("mps")


def test_an_unknown_course_device_variable_is_named(monkeypatch):
    monkeypatch.setenv("COURSE_DEVICE", "gpu")
    with pytest.raises(ValueError, match=r"COURSE_DEVICE='gpu'.*not a device name.*'cuda'"):
        get_device()
    monkeypatch.setenv("COURSE_DEVICE", "cpu")
    assert get_device() == torch.device("cpu")


def test_timing_helpers_name_a_bad_device():
    with pytest.raises(ValueError, match=r"device='gpu'.*not a device name.*'mps'"):
        synchronize("gpu")
    calls = []
    with pytest.raises(ValueError, match=r"device='gpu'.*not a device name"):
        best_time(lambda: calls.append(1), device="gpu")
    assert calls == []  # refused before running anything
    synchronize("meta")  # any real torch device is fine: nothing to wait for


def test_seed_everything_repeats_a_run():
    seed_everything(3)
    a = torch.rand(2)
    seed_everything(3)
    assert torch.equal(a, torch.rand(2))


@pytest.mark.parametrize("seed, match", [("42", r"seed.*integer.*'42'"),
                                         (True, r"seed.*integer.*True \(bool\)")])
def test_seed_everything_refuses_a_seed_that_is_not_an_int(seed, match):
    with pytest.raises(TypeError, match=match):
        seed_everything(seed)
