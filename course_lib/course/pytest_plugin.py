"""The course's pytest plugin: notebook runs under nbval that do not depend on a quiet machine.

pytest loads it by itself wherever course_lib is installed (the ``pytest11`` entry point in
pyproject.toml), so it applies to ``pytest`` and to ``pytest notebooks/09_training.ipynb`` alike.
It does three things, and nothing when nbval is not in use:

1. **No lost messages.** nbval sends a cell to the kernel, waits for the reply, and only then
   reads the cell's messages (outputs, then the "idle" status that ends the cell). Until then
   they wait in a ZeroMQ queue whose default limit is 1,000 messages; past it new messages are
   dropped. A cell that redraws a progress bar or a live plot for a minute sends more than that,
   and a busy machine makes the cell longer, hence more redraws: the "idle" message was lost and
   nbval failed with "Timeout of 5 seconds exceeded waiting for output". The kernel client's
   receive queue is made unbounded (messages are small; a long cell queues a few MB).
2. **Patience per message.** nbval waits 5 s for each message of a finished cell; on a loaded
   machine the process that reads them may not run for that long. It waits
   ``OUTPUT_TIMEOUT_S`` instead (a cell's own run time is limited by ``--nbval-cell-timeout``).
3. **Where the time goes.** The sanitize file is found from the repository root, and the
   terminal summary lists each notebook's execution time (kernel start-up included).
"""

from __future__ import annotations

import os

import pytest

OUTPUT_TIMEOUT_S = 120


def _unbounded_iopub() -> None:
    """Give every kernel client that nbval starts an unbounded receive queue."""
    import zmq
    from nbval import kernel

    if getattr(kernel.KernelManager, "unbounded_iopub", False):
        return  # already done in this process

    class KernelManager(kernel.KernelManager):
        unbounded_iopub = True

        def client(self, **kwargs):
            client = super().client(**kwargs)
            client.context.setsockopt(zmq.RCVHWM, 0)  # 0 = no limit; set before connecting
            return client

    kernel.KernelManager = KernelManager


class NotebookTimes:
    """Adds up the time of every cell (and the kernel start-up) of each notebook and prints
    the totals at the end."""

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
    if not config.pluginmanager.hasplugin("nbval"):
        return
    _unbounded_iopub()
    # nbval reads the sanitize file relative to the current directory: anchor it at the root
    path = getattr(config.option, "nbval_sanitize_with", None)
    if path and not os.path.isabs(path):
        config.option.nbval_sanitize_with = str(config.rootpath / path)
    config.pluginmanager.register(NotebookTimes(), "course-notebook-times")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if hasattr(item, "output_timeout"):  # an nbval cell
            item.output_timeout = OUTPUT_TIMEOUT_S
