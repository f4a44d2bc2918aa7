"""Choosing a device, making runs repeatable, and timing code fairly."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ._validate import (
    check_positive_ints,
    checks_wanted,
    require_callable,
    require_instance,
    require_int,
    require_positive_int,
)

COURSE_DEVICES = ("cpu", "cuda", "mps")  # the device types the course runs on


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """Return the best available device: CUDA, then Apple's MPS, then the CPU.

    ``prefer`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) or the environment variable
    ``COURSE_DEVICE`` forces one. Modules never pick a device (they follow their inputs): call
    this once and move the model and the data there.
    """
    forced = require_forced_device(prefer)
    if forced is not None:
        return forced
    devices = available_devices()  # the CPU, then CUDA, then MPS
    return devices[1] if len(devices) > 1 else devices[0]


def available_devices() -> list[torch.device]:
    """Every device this machine can run on, CPU first (used by the tests)."""
    present = (True, torch.cuda.is_available(), torch.backends.mps.is_available())
    return [torch.device(kind) for kind, ok in zip(COURSE_DEVICES, present, strict=True) if ok]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's random number generators (all devices)."""
    seed = require_int("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until the work queued on ``device`` (None: CUDA if in use, and MPS) has finished:
    GPU operations return once queued, so a clock read before then measures almost nothing."""
    kind = None if device is None else require_device("device", device).type
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if kind in (None, "mps") and torch.backends.mps.is_available():
        torch.mps.synchronize()


CLOCKS = {"wall": "perf_counter", "thread": "thread_time"}  # best_time's clocks: time.<name>


def best_time(fn: Callable[[], Any], *, repeat: int = 5, number: int = 1,
              device: torch.device | str | None = None, clock: str = "wall") -> float:
    """Seconds one call of ``fn`` takes: the fastest of ``repeat`` measurements, each the
    average of ``number`` calls, after one untimed warm-up call. Each measurement waits for the
    device (:func:`synchronize`); the minimum is the run least disturbed by other programs.

    Args:
        fn: a function with no arguments, e.g. ``lambda: model(x)``.
        repeat, number: measurements, and calls per measurement (more for fast functions).
        device: the device ``fn`` runs on (None: every device in use).
        clock: ``"wall"`` (the wall clock) or ``"thread"``: the processor time of this thread
            alone, which stops while other programs hold the processor. Use it for CPU work
            inside ``num_threads(1)``, where one thread does all the work; it cannot see a GPU.
    """
    check_timing(fn, repeat, number, clock)
    read = getattr(time, CLOCKS[clock])
    synchronize(device)  # nothing queued before the clock starts
    fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = read()
        for _ in range(number):
            fn()
        synchronize(device)
        times.append((read() - start) / number)
    return min(times)


@contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``n`` CPU threads for torch (None: unchanged), then restore the number:
    ``with num_threads(1): ...``. One thread adds float sums in the same order everywhere, so
    seeded results repeat."""
    if n is not None:
        require_positive_int("n", n)
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- argument checks


def require_forced_device(prefer: object) -> torch.device | None:
    """The available device ``prefer``, or else ``COURSE_DEVICE``, names (None: neither)."""
    name, choice = ("prefer", prefer) if prefer is not None else (
        "COURSE_DEVICE", os.environ.get("COURSE_DEVICE"))
    return require_device(name, choice, available=True) if choice else None


def require_device(name: str, value: object, *, available: bool = False) -> torch.device:
    """``value`` as a torch.device, which ``available`` requires on this machine."""
    require_instance(name, value, (str, torch.device), "a device name ('cuda') or a torch.device")
    try:
        device = torch.device(value)
    except RuntimeError:  # not a device name
        device = None
    have = [d.type for d in available_devices()]
    count = torch.cuda.device_count() if str(value).startswith("cuda") else 1
    if device is None or available and (device.type not in have or (device.index or 0) >= count):
        what = "available" if device and device.type in COURSE_DEVICES else "a device name"
        raise ValueError(f"{name}={str(value)!r} is not {what}: use 'cpu', 'cuda', 'mps' (or "
                         f"'cuda:0', ...); this machine has {', '.join(map(repr, have))}")
    return device


def check_timing(fn: object, repeat: object, number: object, clock: object = "wall") -> None:
    """The arguments of :func:`best_time`."""
    if clock not in CLOCKS:  # checked even when checks are off: the clock is looked up by name
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    if not checks_wanted():
        return
    require_callable("fn", fn, "a function with no arguments", "e.g. lambda: model(x)")
    check_positive_ints(repeat=repeat, number=number)
