"""Shared test configuration: devices to run on and hypothesis settings."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from course_lib.device import available_devices

# On CUDA the references compute in float32, as course_lib does: cuDNN's RNNs would otherwise use
# TF32 (a 10-bit mantissa) on Ampere and newer GPUs, about 1e-3 away from float32.
torch.backends.cudnn.allow_tf32 = False

# Property tests: enough examples to find shape edge cases, no deadline (CPU speed varies).
settings.register_profile(
    "course",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("course")

DEVICES = available_devices()

# Run a test once per available device: always the CPU, CUDA and MPS when present.
on_devices = pytest.mark.parametrize("device", DEVICES, ids=lambda d: d.type)

# Notebooks under nbval (an unbounded message queue, patience on a busy machine, the sanitize
# file, execution times) are handled by course_lib's pytest plugin, course_lib/course/pytest_plugin.py.
