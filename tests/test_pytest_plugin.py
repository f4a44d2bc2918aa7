"""course_lib's pytest plugin: a notebook cell that floods its output channel still passes.

A cell that redraws a display thousands of times (as a progress bar or a live loss plot does on
a slow machine) sends more messages than ZeroMQ queues by default. Without the plugin's
unbounded queue the message that ends the cell is dropped and nbval fails with "Timeout ...
waiting for output"; the second test shows that the flood is large enough for that to happen
(it is skipped on a machine whose socket buffers hold the whole flood).
"""

from __future__ import annotations

import subprocess
import sys

import nbformat
import pytest

pytest.importorskip("nbval")

REDRAWS = 8_000  # well above ZeroMQ's default queue of 1,000 messages at each end
PAYLOAD = 4_000  # characters a redraw: 32 MB in all, more than the sockets' buffers hold


@pytest.fixture(scope="module")
def flood(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flood")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from IPython.display import display\n"
            "handle = display('starting', display_id=True)\n"
            f"for i in range({REDRAWS}):\n"
            f"    handle.update(str(i).rjust({PAYLOAD}))\n"
            "print('done')"),
        nbformat.v4.new_code_cell("print('the next cell runs too')"),
    ]
    nbformat.write(nb, folder / "flood.ipynb")
    return folder


def _run_nbval(folder, *extra):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p",
         "no:cacheprovider", "-q", *extra, "flood.ipynb"],
        cwd=folder, capture_output=True, text=True, timeout=600,
    )


def test_a_cell_that_floods_its_output_passes(flood):
    result = _run_nbval(flood)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "2 passed" in result.stdout


def test_without_the_plugin_the_flood_loses_the_end_of_the_cell(flood):
    result = _run_nbval(flood, "-p", "no:course")
    if result.returncode == 0:  # larger socket buffers than here held the whole flood
        pytest.skip(f"this machine queued all {REDRAWS} messages without the plugin")
    assert result.returncode == 1
    assert "exceeded waiting for output" in result.stdout
