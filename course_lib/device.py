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

from ._validate import WrongTypeError, require_callable, require_int, require_positive_int

COURSE_DEVICES = ("cpu", "cuda", "mps")  # the device types the course runs on


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """Return the best available device: CUDA, then Apple's MPS, then the CPU.

    Args:
        prefer: force a device (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``). The environment
            variable ``COURSE_DEVICE`` does the same without editing a notebook.

    Returns:
        A ``torch.device``. Modules in course_lib never pick a device themselves: they follow
        their inputs, so call this once and move the model and data there.

    Raises:
        ValueError: for a name that is not one of cpu, cuda, mps, or a device this machine
            does not have.
    """
    name = "prefer" if prefer else "COURSE_DEVICE"
    choice = prefer or os.environ.get("COURSE_DEVICE")
    if choice:
        return _require_available(name, choice, _parse_device(name, choice, COURSE_DEVICES))
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _available_names() -> str:
    return ", ".join(repr(d.type) for d in available_devices())


def _parse_device(name: str, value: object, types: tuple[str, ...] | None) -> torch.device:
    """``value`` (a string or a torch.device) as a torch.device whose type is in ``types``
    (None: any type torch knows); raise a ValueError listing the valid names otherwise."""
    if not isinstance(value, (str, torch.device)):
        raise WrongTypeError(
            f"{name} must be a device name such as 'cpu' or 'cuda', or a torch.device; got "
            f"{value!r} ({type(value).__name__})"
        )
    try:
        device = torch.device(value)
    except RuntimeError:
        device = None
    if device is None or (types is not None and device.type not in types):
        raise ValueError(
            f"{name}={str(value)!r} is not a device name: use one of "
            f"{', '.join(map(repr, COURSE_DEVICES))} (optionally with an index, e.g. "
            f"'cuda:0'); available on this machine: {_available_names()}"
        )
    return device


def _require_available(name: str, value: object, device: torch.device) -> torch.device:
    """Raise ``ValueError`` unless this machine has ``device``."""
    if device.type == "cuda" and not torch.cuda.is_available():
        problem = "CUDA is not available on this machine"
    elif device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        problem = f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    elif device.type == "mps" and not _mps_available():
        problem = "MPS is not available on this machine"
    else:
        return device
    raise ValueError(f"{name}={str(value)!r} but {problem} (available: {_available_names()})")


def available_devices() -> list[torch.device]:
    """Every device this machine can run on, CPU first (used by the tests)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    if _mps_available():
        devices.append(torch.device("mps"))
    return devices


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and PyTorch's random number generators (all devices).

    Args:
        seed: any integer. For a separate random stream, use ``torch.Generator().manual_seed``.
    """
    seed = require_int("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until the work queued on ``device`` has finished (nothing to wait for on a CPU).

    GPU operations return as soon as they are queued; a clock read before the queue is empty
    measures almost nothing. ``None`` waits for CUDA if it is in use and for MPS if present.
    """
    kind = None if device is None else _parse_device("device", device, None).type
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if kind in (None, "mps") and _mps_available():
        torch.mps.synchronize()


def best_time(
    fn: Callable[[], Any],
    *,
    repeat: int = 5,
    number: int = 1,
    device: torch.device | str | None = None,
) -> float:
    """Seconds one call of ``fn`` takes: the fastest of ``repeat`` measurements.

    ``fn`` is called once first and not timed (memory allocation, caches, lazy
    initialisation). Each measurement averages ``number`` calls and waits for the device to
    finish (see :func:`synchronize`). The minimum is the run least disturbed by other
    programs, which is what to compare between two pieces of code.

    Args:
        fn: a function with no arguments, e.g. ``lambda: model(x)``.
        repeat: how many measurements to take the minimum of.
        number: calls averaged in each measurement (more for very fast functions).
        device: the device ``fn`` runs on (None: every device in use).
    """
    require_callable("fn", fn, "a function with no arguments",
                     "wrap the call in a lambda, e.g. lambda: model(x)")
    require_positive_int("repeat", repeat)
    require_positive_int("number", number)
    if device is not None:
        _parse_device("device", device, None)
    fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - start) / number)
    return min(times)


@contextmanager
def num_threads(n: int | None) -> Iterator[None]:
    """Run a block with ``n`` CPU threads for torch, then restore the previous number.

    One thread makes float sums add up in the same order on every machine (so seeded
    results repeat exactly), and for tiny matrices it is as fast as several.
    ``None`` leaves the number unchanged.

    Example::

        with num_threads(1):
            history = train(model, batches, config)
    """
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n must be a positive integer or None, got {n!r}")
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
