"""Shared test configuration: devices to run on and hypothesis settings."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from course_lib.device import available_devices

# The environment of every kernel the tests start (one thread, pinned vector kernels) is set
# in pyproject.toml ([tool.pytest.ini_options] env), so stored outputs compare exactly.

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
