"""Choosing a device and making runs repeatable."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def get_device(prefer: str | None = None) -> torch.device:
    """Return the best available device: CUDA, then Apple's MPS, then the CPU.

    Args:
        prefer: force a device (``"cpu"``, ``"cuda"``, ``"mps"``). The environment variable
            ``COURSE_DEVICE`` does the same without editing a notebook.

    Returns:
        A ``torch.device``. Modules in course_lib never pick a device themselves: they follow
        their inputs, so call this once and move the model and data there.
    """
    choice = prefer or os.environ.get("COURSE_DEVICE")
    if choice:
        device = torch.device(choice)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"prefer={choice!r} but CUDA is not available on this machine")
        if device.type == "mps" and not _mps_available():
            raise ValueError(f"prefer={choice!r} but MPS is not available on this machine")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


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
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
