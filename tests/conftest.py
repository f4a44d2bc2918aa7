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


# ------------------------------------------------------------------ notebooks under nbval


class NotebookTimes:
    """Adds up the time of every cell (and the kernel start-up) of each notebook and prints
    the totals at the end. Registered as a global plugin: hooks in this conftest would only
    see the items under tests/, not the notebooks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::", 1)[0]
        if path.endswith(".ipynb"):
            self.seconds[path] = self.seconds.get(path, 0.0) + report.duration

    def pytest_terminal_summary(self, terminalreporter):
        if not self.seconds:
            return
        terminalreporter.section("notebook execution times")
        for path, seconds in sorted(self.seconds.items()):
            terminalreporter.write_line(f"{seconds:7.1f} s  {path}")


def pytest_configure(config):
    # nbval reads the sanitize file relative to the current directory: anchor it at the root
    path = getattr(config.option, "nbval_sanitize_with", None)
    if path and not os.path.isabs(path):
        config.option.nbval_sanitize_with = str(config.rootpath / path)
    config.pluginmanager.register(NotebookTimes(), "course-notebook-times")
