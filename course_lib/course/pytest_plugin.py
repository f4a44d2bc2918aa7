"""The course's pytest plugin: notebook runs under nbval that do not depend on a quiet machine.

pytest loads it by itself wherever course_lib is installed (the ``pytest11`` entry point in
pyproject.toml), so it applies to ``pytest`` and to ``pytest notebooks/09_training.ipynb`` alike.
It does these things, and nothing when nbval is not in use:

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
3. **Rounding is not a difference.** A number printed with a decimal point or an exponent
   (``0.9129``, ``2.4e-07``) may differ from the stored one by one unit of its last printed
   digit: the same computation rounds differently on another CPU, thread count or PyTorch
   version, and a value near a rounding boundary prints either way. Everything else in a
   compared output (integers, shapes, text) must match exactly. Numbers that legitimately move
   more (trained, sampled or timed ones) sit in cells marked ``# NBVAL_IGNORE_OUTPUT``, which
   check the lesson's claims about them instead (``course_lib.course.claims``).
4. **Notebooks run on the CPU** (``COURSE_DEVICE=cpu`` unless the environment sets it), where
   the stored outputs were made: a GPU sizes some demos up. ``COURSE_DEVICE=cuda pytest
   --nbval-lax ...`` runs them on a GPU and checks the claims, not the outputs.
5. **No more threads than cores.** With ``pytest -n N`` each worker's kernel would use
   ``OMP_NUM_THREADS`` threads (all the cores when unset); N kernels then share the cores
   N times over, and threads that wait for one another on a shared core slowed a training cell
   five-fold, past the cell time limit (two workers of two threads on two cores). When the
   workers' threads would exceed the cores, each kernel gets ``cores // N`` (at least 1).
   The README's command already asks for one (pytest-env); this holds without it too.
6. **Where the time goes.** The sanitize file is found from the repository root, and the
   terminal summary lists each notebook's execution time (kernel start-up included).
"""

from __future__ import annotations

import os
import re

import pytest

OUTPUT_TIMEOUT_S = 120

# a number with a decimal point or an exponent, not part of a word or of a longer number
_FLOAT = re.compile(r"(?<![\w.])[-+]?(?:\d+\.\d*|\.\d+|\d+(?=[eE][-+]?\d))(?:[eE][-+]?\d+)?(?!\w)")


def last_digit_unit(number: str) -> float:
    """One unit of the last printed digit of ``number``: 1e-4 for ``0.9129``, 1e-8 for
    ``2.4e-07``, 1 for ``12.``; 0 for a zero in exponent notation (``0.0e+00``: exactly zero,
    e.g. an underflow, not a rounded small number)."""
    mantissa, _, exponent = number.lower().partition("e")
    if exponent and float(mantissa) == 0:
        return 0.0
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def within_rounding(stored: str, fresh: str) -> str:
    """``fresh`` with each float that is within one unit of the last printed digit of the
    stored one replaced by the stored text, line by line, where the two lines agree everywhere
    else. Anything else is left as it is, for the comparison to report."""
    stored_lines, fresh_lines = stored.split("\n"), fresh.split("\n")
    if len(stored_lines) != len(fresh_lines):
        return fresh
    out = []
    for old, new in zip(stored_lines, fresh_lines, strict=True):
        old_numbers, new_numbers = _FLOAT.findall(old), _FLOAT.findall(new)
        if old == new or len(old_numbers) != len(new_numbers) or \
                _FLOAT.split(old) != _FLOAT.split(new):
            out.append(new)
            continue
        pieces = _FLOAT.split(new)
        for i, (a, b) in enumerate(zip(old_numbers, new_numbers, strict=True)):
            unit = max(last_digit_unit(a), last_digit_unit(b))
            pieces.insert(2 * i + 1, a if abs(float(a) - float(b)) <= unit * (1 + 1e-9) else b)
        out.append("".join(pieces))
    return "\n".join(out)


def _snapped(fresh_outputs: list, stored_outputs: list) -> list:
    """Copies of nbval's fresh outputs with rounding-level float differences from the stored
    outputs (paired in order, texts only) replaced by the stored text."""
    import copy

    fresh_outputs = copy.deepcopy(fresh_outputs)
    for fresh, stored in zip(fresh_outputs, stored_outputs, strict=False):
        if fresh.get("output_type") != stored.get("output_type"):
            continue
        if fresh.get("output_type") == "stream" and fresh.get("name") == stored.get("name"):
            fresh["text"] = within_rounding(stored["text"], fresh["text"])
        elif "text/plain" in fresh.get("data", {}) and "text/plain" in stored.get("data", {}):
            fresh["data"]["text/plain"] = within_rounding(stored["data"]["text/plain"],
                                                          fresh["data"]["text/plain"])
    return fresh_outputs


def _compare_within_rounding() -> None:
    """Make nbval accept outputs that differ from the stored ones only by rounding."""
    from nbval.plugin import IPyNbCell

    if getattr(IPyNbCell, "compares_within_rounding", False):
        return
    exact = IPyNbCell.compare_outputs

    def compare_outputs(self, test, ref, skip_compare=None):
        if exact(self, test, ref, skip_compare):
            return True
        report = self.comparison_traceback  # the exact comparison's report, if this fails too
        if exact(self, _snapped(test, ref), ref, skip_compare):
            return True
        self.comparison_traceback = report
        return False

    IPyNbCell.compare_outputs = compare_outputs
    IPyNbCell.compares_within_rounding = True


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


def kernel_threads(workers: int, requested: str | None, cores: int) -> str | None:
    """``OMP_NUM_THREADS`` for each of ``workers`` kernels on ``cores`` cores, given what the
    environment asks (None: unset, i.e. every core): unchanged unless the kernels together
    would run more threads than there are cores, then ``cores // workers`` (at least 1)."""
    wanted = int(requested) if requested and requested.isdigit() else cores
    if workers * wanted <= cores:
        return requested
    return str(max(1, cores // workers))


def pytest_configure(config):
    if not config.pluginmanager.hasplugin("nbval"):
        return
    _unbounded_iopub()
    _compare_within_rounding()
    os.environ.setdefault("COURSE_DEVICE", "cpu")  # the kernels nbval starts inherit it
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))  # set in each xdist worker
    threads = kernel_threads(workers, os.environ.get("OMP_NUM_THREADS"), os.cpu_count() or 1)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = threads
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
