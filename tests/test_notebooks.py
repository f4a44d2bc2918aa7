"""The course's notebooks as a whole: structure, the exercise notebooks, the set-up cells.

(nbval, configured in pyproject.toml, separately re-runs every lecture and solution notebook
and compares each cell's output with the stored one.)
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_lib.course import colab, exercises
from course_lib.course.grade import grade_notebook

ROOT = Path(__file__).resolve().parent.parent
LECTURES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _ids(paths):
    return [p.stem for p in paths]


def test_every_solution_has_a_current_exercise_notebook():
    assert [p.name for p in SOLUTIONS] == [p.name for p in EXERCISES]
    stale = exercises.generate(ROOT / "solutions", ROOT / "exercises", check=True)
    assert stale == [], "exercise notebooks are stale; run: python -m course_lib.course.exercises"


def test_every_notebook_starts_with_the_set_up_cell():
    assert colab.sync([ROOT / "notebooks", ROOT / "solutions"], check=True) == []


@pytest.mark.parametrize("path", LECTURES + SOLUTIONS, ids=_ids(LECTURES + SOLUTIONS))
def test_notebook_structure(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "title cell first"
    last = nb.cells[-1]
    assert last.cell_type == "markdown" and "References" in last.source, "references cell last"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), "notebooks are stored executed"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert errors == [], "a stored output is an error"


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_solution_notebooks_have_graded_exercises(path):
    nb = nbformat.read(path, as_version=4)
    graded = exercises.graded_cells(nb, exercises.chapter_of(path))
    assert len(graded) >= 3
    for cell in graded:
        assert "check_" in nb.cells[cell.index].source


@pytest.mark.parametrize("path", EXERCISES, ids=_ids(EXERCISES))
def test_exercise_notebook_fails_only_at_its_graded_cells(path):
    """Run the unsolved notebook: every graded cell, and nothing else, stops with
    NotImplementedError (so the lecture part runs and each stub fails at its own check)."""
    result = grade_notebook(path, timeout=300)
    assert result.problems == []
    assert result.exercises, "no graded cells"
    for e in result.exercises:
        assert e.status == "not done", f"{e.exercise} {e.name}: {e.status} ({e.detail})"
        assert f"Exercise {e.exercise}:" in e.detail
