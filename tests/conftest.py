"""Shared test configuration: devices to run on and hypothesis settings."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from course_lib.device import available_devices

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


# ------------------------------------------------------------------ notebooks under nbval

_NOTEBOOK_SECONDS: dict[str, float] = {}


def pytest_configure(config):
    """Resolve the nbval sanitize file against the repository root, so `pytest` works from any
    working directory (nbval itself reads the path relative to the current directory)."""
    path = getattr(config.option, "nbval_sanitize_with", None)
    if path and not os.path.isabs(path):
        config.option.nbval_sanitize_with = str(config.rootpath / path)


def pytest_runtest_logreport(report):
    """Add up the time of every cell (and the kernel start-up) of each notebook."""
    path = report.nodeid.split("::", 1)[0]
    if path.endswith(".ipynb"):
        _NOTEBOOK_SECONDS[path] = _NOTEBOOK_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _NOTEBOOK_SECONDS:
        return
    terminalreporter.section("notebook execution times")
    for path, seconds in sorted(_NOTEBOOK_SECONDS.items()):
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")
