"""Grade exercise notebooks.

Usage: ``python -m course_lib.course.grade [PATH ...] [--json] [--timeout S]``.

Each notebook is executed from an in-memory copy in a temporary folder, with the Python
environment grade itself runs in, so the learner's files are never written. Every graded cell
(tagged ``graded``, see :mod:`course_lib.course.exercises`) is scored:

========  ================================================================
pass      the check ran without an error or a not-done line
fail      the check raised AssertionError: the answer is wrong
not done  the check printed its not-done line, or NotImplementedError
error     any other exception (a NameError after a broken cell, say)
timeout   the cell ran longer than the per-cell timeout
not run   the kernel crashed earlier, so the cell never ran
========  ================================================================

An exercise is worth the minutes its label gives (see
:func:`~course_lib.course.exercises.graded_cells`). The report lists the failures first,
each with its whole message, then counts the exercises not done yet in one line, then a line
per notebook and the total in points and percent.
A notebook that cannot be read, has a syntax error, loops forever or crashes its kernel is
reported as such, and the remaining notebooks are still graded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from .exercises import NB_VERSION, chapter_of, graded_cells, parse_not_done

DEFAULT_TIMEOUT = 300
_TIMEOUT_ENAME = "CellTimeout"
_KERNEL_NAME = "course-current-env"


class _CurrentEnvKernelSpecs(KernelSpecManager):
    """Run notebooks with the same Python that runs the grader (its packages, its course_lib)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(
            argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            display_name="Python (current environment)",
            language="python",
        )


@dataclass
class ExerciseResult:
    """The outcome of one graded cell."""

    exercise: str
    name: str
    status: str
    points: float
    max_points: float
    detail: str = ""
    minutes: int | None = None


@dataclass
class NotebookResult:
    """The outcome of one notebook: its exercises and any notebook-level problems."""

    path: str
    chapter: str
    exercises: list[ExerciseResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def points(self) -> float:
        return sum(e.points for e in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(e.max_points for e in self.exercises)


def _first_line(text: str, limit: int = 200) -> str:
    line = next((ln for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _error_of(cell) -> tuple[str, str] | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return output.get("ename", "Error"), output.get("evalue", "")
    return None


def _printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def _status_for(error: tuple[str, str] | None, printed: str = "") -> tuple[str, str]:
    """(status, detail) of a cell from its error and its printed text; details are whole."""
    if error is None:
        stub = parse_not_done(printed)
        return ("not done", stub) if stub else ("pass", "")
    ename, evalue = error
    if ename in ("AssertionError", "CheckFailure"):
        return "fail", evalue.strip() or ename
    if ename == "NotImplementedError":
        return "not done", evalue.strip() or "the exercise is still a stub"
    return "error", f"{ename}: {evalue.strip()}"


def grade_notebook(
    path: Path | str, *, timeout: int = DEFAULT_TIMEOUT, startup_timeout: int = 60
) -> NotebookResult:
    """Execute a copy of one exercise notebook and score its graded cells.

    Args:
        path: the notebook (it is only read).
        timeout: seconds each cell may run before it is interrupted and marked ``timeout``.
        startup_timeout: seconds to wait for the kernel to start.
    """
    path = Path(path)
    result = NotebookResult(path=str(path), chapter=path.stem)
    start = time.perf_counter()
    try:
        chapter = chapter_of(path)
        nb = nbformat.read(path, as_version=NB_VERSION)
    except Exception as exc:  # unreadable JSON, wrong name, missing file
        result.problems.append(f"could not read the notebook: {_first_line(exc)}")
        return result
    graded = graded_cells(nb, chapter)
    if not graded:
        result.problems.append("no graded cells found (cells tagged 'graded')")
    statuses = _execute(nb, {g.index for g in graded}, result.problems,
                        timeout=timeout, startup_timeout=startup_timeout)
    for g in graded:
        status, detail = statuses.get(g.index, ("not run", "an earlier problem stopped grading"))
        result.exercises.append(ExerciseResult(
            exercise=g.exercise, name=g.name, status=status,
            points=g.points if status == "pass" else 0.0, max_points=g.points, detail=detail,
            minutes=g.minutes,
        ))
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _execute(
    nb: nbformat.NotebookNode, graded: set[int], problems: list[str], *,
    timeout: int, startup_timeout: int,
) -> dict[int, tuple[str, str]]:
    """Run ``nb`` (in memory) in a fresh kernel in a temporary folder.

    Returns (status, detail) for each code cell that ran, by cell index; notebook-level
    problems (crashes, timeouts, errors outside graded cells) are appended to ``problems``.
    """
    statuses: dict[int, tuple[str, str]] = {}
    timed_out: set[int] = set()

    def note_timeout(cell, cell_index, execute_reply) -> None:
        if (execute_reply or {}).get("content", {}).get("ename") == _TIMEOUT_ENAME:
            timed_out.add(cell_index)

    with tempfile.TemporaryDirectory(prefix="course-grade-") as workdir:
        # nbclient drives the kernel from an event loop, so it needs the asynchronous manager.
        km = AsyncKernelManager(
            kernel_name=_KERNEL_NAME, kernel_spec_manager=_CurrentEnvKernelSpecs(),
            transport="ipc", ip=str(Path(workdir) / "kernel"),  # local sockets, not TCP
        )
        # On a timeout nbclient interrupts the kernel and finishes the cell with this error, so
        # the next cells run normally (an infinite loop costs one cell, not the notebook).
        client = NotebookClient(
            nb, km=km, timeout=timeout, startup_timeout=startup_timeout, allow_errors=True,
            interrupt_on_timeout=True,
            error_on_timeout={"ename": _TIMEOUT_ENAME, "evalue": f"longer than {timeout} s",
                              "traceback": []},
            on_cell_executed=note_timeout,
            resources={"metadata": {"path": workdir}},
        )
        try:
            with client.setup_kernel():
                _run_cells(client, nb, graded, timed_out, statuses, problems, timeout)
        except Exception as exc:  # the kernel never started, or died during set-up
            problems.append(f"could not run the notebook: {_first_line(exc)}")
        finally:  # nbclient leaves a kernel it did not create running: stop it ourselves
            if km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
    return statuses


def _run_cells(
    client: NotebookClient, nb: nbformat.NotebookNode, graded: set[int], timed_out: set[int],
    statuses: dict[int, tuple[str, str]], problems: list[str], timeout: int,
) -> None:
    """Execute the code cells in order, filling ``statuses`` and ``problems`` as they run.

    Stops at a crashed kernel, or after two timeouts in a row (the kernel no longer answers).
    """
    consecutive_timeouts = 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        try:
            client.execute_cell(cell, index)
        except DeadKernelError:
            problems.append(f"the kernel crashed while running cell {index}")
            statuses[index] = ("error", "the kernel crashed while running this cell")
            return
        if index in timed_out:
            statuses[index] = ("timeout", f"the cell ran longer than {timeout} s")
            problems.append(
                f"cell {index} ran longer than {timeout} s and was interrupted (an infinite loop?)"
            )
            consecutive_timeouts += 1
            if consecutive_timeouts == 2:
                problems.append("the kernel does not respond; stopped grading")
                return
            continue
        consecutive_timeouts = 0
        error = _error_of(cell)
        statuses[index] = _status_for(error, _printed(cell))
        if error and index not in graded:
            kind = {"SyntaxError": "has a", "IndentationError": "has an"}.get(error[0], "raised")
            problems.append(f"cell {index} {kind} {error[0]}: {_first_line(error[1])}")


def find_notebooks(paths: list[str]) -> list[Path]:
    """Expand folders into their NN_*.ipynb notebooks; keep files as given."""
    found: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found.extend(sorted(path.glob("[0-9][0-9]_*.ipynb")))
        else:
            found.append(path)
    return found


def _fmt(points: float) -> str:
    return f"{points:,.0f}" if float(points).is_integer() else f"{points:,.1f}"


def _percent(points: float, max_points: float) -> str:
    return f"{100 * points / max_points:.0f}%" if max_points else "-"


def _indented(text: str, prefix: str = "      ", width: int = 100) -> list[str]:
    """``text`` indented by ``prefix``, its long lines wrapped (between words, none cut)."""
    out: list[str] = []
    for line in text.splitlines():
        out += textwrap.wrap(line, width, initial_indent=prefix, subsequent_indent=prefix,
                             break_long_words=False, break_on_hyphens=False) or [""]
    return out


def format_report(results: list[NotebookResult]) -> str:
    """The human-readable report: failures first (whole messages), the exercises not done yet
    in one line, problems, a line per notebook and the total."""
    lines: list[str] = []
    failed = [(nb, e) for nb in results for e in nb.exercises
              if e.status not in ("pass", "not done")]
    if failed:
        lines.append(f"to fix ({len(failed)}):")
        for nb, e in failed:
            lines.append(f"  {e.exercise} {e.name} ({nb.chapter}, {_fmt(e.max_points)} points): "
                         f"{e.status}")
            lines += _indented(e.detail)
        lines.append("")
    not_done = [e for nb in results for e in nb.exercises if e.status == "not done"]
    if not_done:
        open_points = sum(e.max_points for e in not_done)
        lines += [f"not done yet: {len(not_done)} exercise{'s' * (len(not_done) != 1)} "
                  f"({_fmt(open_points)} points); each one's graded cell says what to write", ""]
    problems = [f"  {nb.chapter}: {p}" for nb in results for p in nb.problems]
    if problems:
        lines += ["problems:", *problems, ""]
    rows = [("notebook", "points", "pass", "to fix", "not done")]
    for nb in results:
        counts = [sum(e.status == "pass" for e in nb.exercises),
                  sum(e.status not in ("pass", "not done") for e in nb.exercises),
                  sum(e.status == "not done" for e in nb.exercises)]
        score = f"{_fmt(nb.points)} / {_fmt(nb.max_points)}" if nb.exercises else "no score"
        rows.append((nb.chapter, score, *map(str, counts)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    table.insert(1, "  ".join("-" * w for w in widths))
    total, max_total = _totals(results)
    lines += [*table, "", f"total: {_fmt(total)} / {_fmt(max_total)} points "
              f"({_percent(total, max_total)})"]
    return "\n".join(lines)


def _totals(results: list[NotebookResult]) -> tuple[float, float]:
    return sum(r.points for r in results), sum(r.max_points for r in results)


def to_json(results: list[NotebookResult]) -> dict:
    """The same report as a JSON-serialisable dict (each exercise with its minutes and points)."""
    total, max_total = _totals(results)
    return {
        "notebooks": [
            {**{k: v for k, v in asdict(nb).items() if k != "exercises"},
             "points": nb.points, "max_points": nb.max_points,
             "exercises": [asdict(e) for e in nb.exercises]}
            for nb in results
        ],
        "total": {"points": total, "max_points": max_total,
                  "percent": round(100 * total / max_total, 1) if max_total else None},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.course.grade",
        description="Run copies of exercise notebooks and print a score report.",
    )
    parser.add_argument("paths", nargs="*", default=["exercises"],
                        help="notebooks or folders of notebooks (default: exercises/)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT,
                        help=f"seconds a cell may run (default {DEFAULT_TIMEOUT})")
    args = parser.parse_args(argv)
    notebooks = find_notebooks(args.paths)
    if not notebooks:
        parser.error(f"no notebooks found in {' '.join(args.paths)}")
    results = []
    for path in notebooks:
        if not args.json:
            print(f"grading {path} ...", file=sys.stderr, flush=True)
        results.append(grade_notebook(path, timeout=args.timeout))
    if args.json:
        print(json.dumps(to_json(results), indent=2))
    else:
        print(format_report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
