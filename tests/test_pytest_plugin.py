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


# --- rounding is not a difference: floats may differ by one unit of their last printed digit

from course_lib.course.pytest_plugin import (  # noqa: E402
    kernel_threads,
    last_digit_unit,
    within_rounding,
)


@pytest.mark.parametrize("number, unit", [("0.9129", 1e-4), ("2.4e-07", 1e-8), ("12.", 1.0),
                                          ("-3.50", 1e-2), ("1e-06", 1e-6), ("0.0e+00", 0.0)])
def test_last_digit_unit(number, unit):
    assert last_digit_unit(number) == pytest.approx(unit, abs=0)


@pytest.mark.parametrize("stored, fresh", [
    ("weights 0.1234, gap 2.4e-07, 12 heads", "weights 0.1235, gap 2.5e-07, 12 heads"),
    ("x 1.0e-05", "x 9.9e-06"),  # one unit of the fresh value's last digit
    ("loss -0.000 then 2.50.", "loss 0.000 then 2.49."),
    ("two\nlines 0.5", "two\nlines 0.6"),
])
def test_rounding_differences_are_accepted(stored, fresh):
    assert within_rounding(stored, fresh) == stored


@pytest.mark.parametrize("stored, fresh", [
    ("loss 0.1234", "loss 0.1236"),  # two units
    ("12 heads", "13 heads"),  # integers are exact
    ("sum 0.0e+00", "sum 1.2e-08"),  # an exact zero is not a rounded small number
    ("shape (2, 3)", "shape (2, 4)"),
    ("loss 0.12 (pre-norm)", "loss 0.12 (post-norm)"),  # the text around the numbers differs
    ("one line 0.5", "one line 0.5\nand another"),
])
def test_other_differences_are_kept(stored, fresh):
    assert within_rounding(stored, fresh) != stored


def _run_cell_against_stored(tmp_path, stored_text, printed):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(f"print({printed!r})", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored_text + "\n")]
    nb.cells = [cell]
    nbformat.write(nb, tmp_path / "rounding.ipynb")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-p",
         "no:cacheprovider", "-q", "rounding.ipynb"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)


def test_nbval_accepts_a_last_digit_rounding_difference(tmp_path):
    result = _run_cell_against_stored(tmp_path, "mean 0.9129", "mean 0.9130")
    assert result.returncode == 0, result.stdout[-2000:]


def test_nbval_still_fails_a_real_difference(tmp_path):
    result = _run_cell_against_stored(tmp_path, "mean 0.9129", "mean 0.9131")
    assert result.returncode == 1
    assert "0.9129" in result.stdout  # the report shows the stored output


@pytest.mark.parametrize("workers, requested, cores, expected", [
    (2, "1", 2, "1"),      # the README's command: one thread each, unchanged
    (2, None, 8, "4"),     # unset means every core: 2 x 8 on 8 cores becomes 2 x 4
    (2, "2", 2, "1"),      # two workers of two threads on two cores: oversubscribed
    (1, None, 2, None),    # one kernel may use every core: left unset
    (4, "8", 2, "1"),      # never below one
    (2, "x", 16, "8"),     # not a number: treated as unset
])
def test_kernels_never_ask_for_more_threads_than_cores(workers, requested, cores, expected):
    assert kernel_threads(workers, requested, cores) == expected
