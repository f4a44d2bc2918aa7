"""Generate the exercise notebooks from the solution notebooks.

``solutions/NN_topic.ipynb`` is the single source. In it, solution code sits inside function
bodies between two marker lines::

    def attention_weights(q, k):
        ### BEGIN SOLUTION
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return torch.softmax(scores, dim=-1)
        ### END SOLUTION

and each exercise is followed by a code cell tagged ``graded`` that calls a check. The k-th
graded cell of chapter NN is exercise NN.k, and the solution blocks before it belong to that
exercise. An exercise is worth as many points as the minutes its heading's label gives
(``**★★ standard · 15 min · write**`` in the ``### Exercise`` cell above it: 15 points); a
graded cell without such a heading is worth its metadata ``"points": n``, default 1.

The generator writes ``exercises/NN_topic.ipynb`` with each block replaced by
``raise NotImplementedError("Exercise N.k: ...")`` at the same indentation, every output
cleared, and cells tagged ``solution_only`` removed. Because the stub is inside the function
body, defining the function still works and an unsolved exercise is reported at its own graded
cell: in a notebook the check prints :func:`not_done_line` instead of raising, so Run All goes
on to the next exercise, and the grader reads that line back with :func:`parse_not_done`.

A generated notebook records a fingerprint of its own content. The generator only overwrites a
file whose content still matches its fingerprint, so a learner's work in ``exercises/`` is never
overwritten (use ``--force``, which keeps a backup copy, to replace an edited file anyway).

Command line::

    python -m course_lib.course.exercises            # (re)generate exercises/ from solutions/
    python -m course_lib.course.exercises --check    # exit 1 if exercises/ is out of date
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import nbformat

from .colab import with_link

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
GRADED_TAG = "graded"
SOLUTION_ONLY_TAG = "solution_only"
NB_VERSION = 4
_DEF_RE = re.compile(r"^(\s*)(?:async\s+)?def\s+(\w+)\s*\(")
_CLASS_RE = re.compile(r"^(\s*)class\s+(\w+)\b")
# The label under an exercise's heading: **★★ standard · 15 min · write**
LABEL_RE = re.compile(r"\*\*(★{1,3}) (quick|standard|challenge) · (\d+) min · ([a-z ]+)\*\*")
# The message of a stub this generator writes: "Exercise 9.1: write the body of f"
STUB_RE = re.compile(r"^Exercise \d+\.\d+: ")
_NOT_DONE = "\u23ed {message} (not done yet; the notebook goes on)"
_NOT_DONE_RE = re.compile(r"^\u23ed (.+) \(not done yet; the notebook goes on\)$", re.M)


def is_stub_message(message: str) -> bool:
    """True for the message of a generated stub, ``"Exercise 9.1: write the body of f"``."""
    return bool(STUB_RE.match(message))


def not_done_line(message: str) -> str:
    """The line a check prints, instead of raising, for an exercise that is still a stub."""
    return _NOT_DONE.format(message=message)


def parse_not_done(text: str) -> str | None:
    """The stub's message from a cell's printed output, or None if it holds no not-done line."""
    match = _NOT_DONE_RE.search(text)
    return match.group(1) if match else None


@dataclass(frozen=True)
class GradedCell:
    """A graded cell of a notebook: its index, exercise id (e.g. "2.1"), name, the minutes its
    heading's label gives (None without a label) and its points."""

    index: int
    exercise: str
    name: str
    points: float
    minutes: int | None = None


def chapter_of(path: Path) -> int:
    """The chapter number from a notebook's file name, ``02_self_attention.ipynb`` -> 2."""
    match = re.match(r"(\d+)_", path.name)
    if not match:
        raise ValueError(
            f"{path}: notebook names must start with the chapter number, like 02_topic.ipynb"
        )
    return int(match.group(1))


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def graded_cells(nb: nbformat.NotebookNode, chapter: int) -> list[GradedCell]:
    """The graded cells of a notebook, in order, numbered chapter.1, chapter.2, ...

    Each is worth the minutes of the labelled ``### Exercise`` heading between it and the
    previous graded cell, or, without one, its metadata ``"points"`` (default 1).
    """
    found = []
    minutes = None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.startswith("### Exercise"):
            label = LABEL_RE.search(cell.source)
            minutes = int(label.group(3)) if label else None
        elif cell.cell_type == "code" and GRADED_TAG in _tags(cell):
            number = len(found) + 1
            match = re.search(r"\bcheck_(\w+)\s*\(", cell.source)
            name = match.group(1) if match else f"exercise {number}"
            points = float(minutes if minutes is not None else cell.metadata.get("points", 1))
            found.append(GradedCell(index, f"{chapter}.{number}", name, points, minutes))
            minutes = None
    return found


def _stub_block(lines: list[str], start: int, exercise: str, where: str) -> tuple[str, int]:
    """Return the stub line replacing the block that starts at ``start`` and the index after it."""
    indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
    end = start + 1
    while end < len(lines) and lines[end].strip() != END:
        if lines[end].strip() == BEGIN:
            raise ValueError(f"{where}: nested {BEGIN} before {END}")
        end += 1
    if end == len(lines):
        raise ValueError(f"{where}: {BEGIN} without a matching {END}")
    function, def_indent = None, None
    for line in reversed(lines[:start]):
        match = _DEF_RE.match(line)
        if function is None and match and len(match.group(1)) < len(indent):
            function, def_indent = match.group(2), len(match.group(1))
        elif function is not None and (cls := _CLASS_RE.match(line)) \
                and len(cls.group(1)) < def_indent:
            function = f"{cls.group(2)}.{function}"  # a method: name its class too
            break
    if function is None:
        raise ValueError(
            f"{where}: a solution block must sit inside a function body so that an unsolved "
            "exercise fails at its graded cell"
        )
    message = f"Exercise {exercise}: write the body of {function}"
    return f'{indent}raise NotImplementedError("{message}")', end + 1


def strip_solutions(source: str, exercise: str, where: str) -> str:
    """Replace every solution block in a cell's source by a NotImplementedError stub."""
    lines = source.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped == BEGIN:
            stub, i = _stub_block(lines, i, exercise, where)
            out.append(stub)
            continue
        if stripped == END:
            raise ValueError(f"{where}: {END} without a matching {BEGIN}")
        out.append(lines[i])
        i += 1
    return "\n".join(out)


def _fingerprint(nb: nbformat.NotebookNode) -> str:
    body = copy.deepcopy(nb)
    body.metadata.get("course", {}).pop("fingerprint", None)
    text = json.dumps(body, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def make_exercise_notebook(solution_path: Path) -> nbformat.NotebookNode:
    """Build the exercise notebook for one solution notebook (nothing is written)."""
    solution_path = Path(solution_path)
    chapter = chapter_of(solution_path)
    nb = nbformat.read(solution_path, as_version=NB_VERSION)
    cells = []
    graded_so_far = 0
    n_blocks = 0
    for index, cell in enumerate(nb.cells):
        if SOLUTION_ONLY_TAG in _tags(cell):
            continue
        cell = copy.deepcopy(cell)
        if cell.cell_type == "code":
            if GRADED_TAG in _tags(cell):
                graded_so_far += 1
            if BEGIN in cell.source:
                exercise = f"{chapter}.{graded_so_far + 1}"
                where = f"{solution_path.name}, cell {index}"
                cell.source = strip_solutions(cell.source, exercise, where)
                n_blocks += 1
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
        cells.append(cell)
    if n_blocks == 0:
        raise ValueError(f"{solution_path}: no {BEGIN} blocks found")
    nb.cells = cells
    with_link(nb, f"exercises/{solution_path.name}")  # the published link opens this notebook
    nb.metadata["course"] = {"generated_from": f"solutions/{solution_path.name}"}
    nb.metadata["course"]["fingerprint"] = _fingerprint(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    """Serialise a notebook exactly as it is written to disk."""
    return nbformat.writes(nb, version=NB_VERSION) + "\n"


def is_untouched(path: Path) -> bool:
    """True if ``path`` is a generated exercise notebook nobody has edited since."""
    try:
        nb = nbformat.read(path, as_version=NB_VERSION)
    except Exception:
        return False
    recorded = nb.metadata.get("course", {}).get("fingerprint")
    return recorded is not None and recorded == _fingerprint(nb)


def generate(
    solutions_dir: Path, exercises_dir: Path, *, check: bool = False, force: bool = False
) -> list[str]:
    """Generate (or with ``check=True`` verify) every exercise notebook.

    Returns:
        Human-readable lines describing what was done or, in check mode, what is out of date.
    """
    report = []
    solutions = sorted(Path(solutions_dir).glob("[0-9][0-9]_*.ipynb"))
    expected_names = set()
    for solution in solutions:
        text = render(make_exercise_notebook(solution))
        target = Path(exercises_dir) / solution.name
        expected_names.add(target.name)
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current == text:
            continue
        if check:
            report.append(f"{target} is {'missing' if current is None else 'out of date'}")
            continue
        if current is not None and not is_untouched(target):
            if not force:
                report.append(
                    f"skipped {target}: it has been edited since it was generated (your work is "
                    "kept). Use --force to replace it; a backup copy is kept."
                )
                continue
            backup = target.with_name(f"{target.stem}.backup-{time.strftime('%Y%m%d-%H%M%S')}"
                                      f"{target.suffix}")
            shutil.copy2(target, backup)
            report.append(f"backed up {target} to {backup}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")
        report.append(f"wrote {target}")
    if check:
        for extra in sorted(Path(exercises_dir).glob("[0-9][0-9]_*.ipynb")):
            if extra.name not in expected_names:
                report.append(f"{extra} has no solution notebook")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.course.exercises",
        description="Generate exercise notebooks from the solution notebooks.",
    )
    parser.add_argument("--solutions", type=Path, default=Path("solutions"),
                        help="folder of solution notebooks (default: ./solutions)")
    parser.add_argument("--exercises", type=Path, default=Path("exercises"),
                        help="folder to write exercise notebooks to (default: ./exercises)")
    parser.add_argument("--check", action="store_true",
                        help="only report whether the exercises are up to date (exit 1 if not)")
    parser.add_argument("--force", action="store_true",
                        help="replace edited exercise notebooks too (a backup copy is kept)")
    args = parser.parse_args(argv)
    report = generate(args.solutions, args.exercises, check=args.check, force=args.force)
    for line in report:
        print(line)
    if args.check:
        if report:
            print("run: python -m course_lib.course.exercises")
            return 1
        print("exercise notebooks are up to date")
    elif not report:
        print("exercise notebooks are already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
