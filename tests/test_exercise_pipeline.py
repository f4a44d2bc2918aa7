"""The exercise generator and the grader, on small notebooks built here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest

from course_lib.course import exercises, grade
from course_lib.course.exercises import generate, make_exercise_notebook, strip_solutions

SOLVED = '''\
def double(x):
    """Return 2 x."""
    # multiply by two
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION'''

CHECK_DOUBLE = "assert double(3) == 6, 'double(3) should be 6'\nprint('check_double passed')"


def _cell(source, *tags, points=None):
    cell = nbformat.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    if points is not None:
        cell.metadata["points"] = points
    return cell


def _solution_notebook(path, extra_cells=()):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Chapter 7 practice"),
        _cell("import math"),
        _cell(SOLVED),
        _cell(CHECK_DOUBLE, "graded", points=2),
        nbformat.v4.new_markdown_cell("Worked answer, solutions only", metadata={
            "tags": ["solution_only"]}),
        _cell("def halve(x):\n    ### BEGIN SOLUTION\n    return x / 2\n    ### END SOLUTION"),
        _cell("assert halve(8) == 4\nprint('ok')", "graded"),
        _cell("print('after the exercises')"),
        *extra_cells,
    ]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", name="stdout", text="leak")]
    nbformat.write(nb, path)
    return path


def test_strip_keeps_indentation_comments_and_names_the_function():
    out = strip_solutions(SOLVED, "7.1", "here")
    assert out.splitlines()[-1] == '    raise NotImplementedError("Exercise 7.1: write the body of double")'
    assert "# multiply by two" in out and "2 * x" not in out


def test_a_method_stub_names_its_class():
    source = ("class Block:\n    def __init__(self):\n        pass\n\n    def forward(self, x):\n"
              "        ### BEGIN SOLUTION\n        return x\n        ### END SOLUTION\n")
    assert 'NotImplementedError("Exercise 9.7: write the body of Block.forward")' in \
        strip_solutions(source, "9.7", "here")


@pytest.mark.parametrize("source,message", [
    ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", "inside a function body"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1", "without a matching"),
    ("def f():\n    return 1\n    ### END SOLUTION", "without a matching"),
])
def test_malformed_solution_blocks_are_rejected(source, message):
    with pytest.raises(ValueError, match=message):
        strip_solutions(source, "1.1", "cell 3")


def test_generated_notebook(tmp_path):
    solution = _solution_notebook(tmp_path / "07_practice.ipynb")
    nb = make_exercise_notebook(solution)
    sources = [c.source for c in nb.cells]
    assert not any("BEGIN SOLUTION" in s or "return 2 * x" in s for s in sources)
    assert 'NotImplementedError("Exercise 7.1: write the body of double")' in sources[2]
    assert 'NotImplementedError("Exercise 7.2: write the body of halve")' in sources[4]
    assert not any("Worked answer" in s for s in sources)  # solution_only cell removed
    assert all(c.outputs == [] and c.execution_count is None for c in nb.cells
               if c.cell_type == "code")
    assert [g.exercise for g in exercises.graded_cells(nb, 7)] == ["7.1", "7.2"]


def test_generate_never_overwrites_a_learners_work(tmp_path):
    sol_dir, ex_dir = tmp_path / "solutions", tmp_path / "exercises"
    sol_dir.mkdir()
    _solution_notebook(sol_dir / "07_practice.ipynb")
    assert generate(sol_dir, ex_dir) == [f"wrote {ex_dir / '07_practice.ipynb'}"]
    assert generate(sol_dir, ex_dir, check=True) == []
    target = ex_dir / "07_practice.ipynb"
    assert exercises.is_untouched(target)

    # the learner solves the exercise and saves
    nb = nbformat.read(target, as_version=4)
    nb.cells[2].source = "def double(x):\n    return x + x"
    nbformat.write(nb, target)
    learner_text = target.read_text()
    assert not exercises.is_untouched(target)

    # the solution changes; regenerating must keep the learner's file as it is
    sol = nbformat.read(sol_dir / "07_practice.ipynb", as_version=4)
    sol.cells[0].source = "# Chapter 7 practice, revised"
    nbformat.write(sol, sol_dir / "07_practice.ipynb")
    report = generate(sol_dir, ex_dir)
    assert report and report[0].startswith("skipped") and "your work is kept" in report[0]
    assert target.read_text() == learner_text
    assert generate(sol_dir, ex_dir, check=True) == [f"{target} is out of date"]

    # --force replaces it but keeps a backup of the learner's version
    report = generate(sol_dir, ex_dir, force=True)
    backups = list(ex_dir.glob("07_practice.backup-*.ipynb"))
    assert len(backups) == 1 and backups[0].read_text() == learner_text
    assert "revised" in target.read_text()


def test_generate_reports_orphans_and_bad_names(tmp_path):
    sol_dir, ex_dir = tmp_path / "solutions", tmp_path / "exercises"
    sol_dir.mkdir()
    ex_dir.mkdir()
    _solution_notebook(sol_dir / "07_practice.ipynb")
    generate(sol_dir, ex_dir)
    (ex_dir / "08_orphan.ipynb").write_text("{}")
    assert generate(sol_dir, ex_dir, check=True) == [f"{ex_dir / '08_orphan.ipynb'} has no solution notebook"]
    with pytest.raises(ValueError, match="chapter number"):
        exercises.chapter_of(tmp_path / "practice.ipynb")


def test_exercises_command_line(tmp_path):
    sol_dir, ex_dir = tmp_path / "solutions", tmp_path / "exercises"
    sol_dir.mkdir()
    _solution_notebook(sol_dir / "07_practice.ipynb")
    args = [sys.executable, "-m", "course_lib.course.exercises", "--solutions", str(sol_dir),
            "--exercises", str(ex_dir)]
    check = subprocess.run([*args, "--check"], capture_output=True, text=True)
    assert check.returncode == 1 and "missing" in check.stdout
    assert subprocess.run(args, capture_output=True, text=True).returncode == 0
    check = subprocess.run([*args, "--check"], capture_output=True, text=True)
    assert check.returncode == 0 and "up to date" in check.stdout


# ---------------------------------------------------------------------------- grading

@pytest.fixture(scope="module")
def graded_folder(tmp_path_factory):
    """Five notebooks covering every outcome, graded once for all the tests below."""
    folder = tmp_path_factory.mktemp("grading")
    sol_dir, ex_dir = folder / "solutions", folder / "exercises"
    sol_dir.mkdir()
    _solution_notebook(sol_dir / "07_practice.ipynb")
    generate(sol_dir, ex_dir)
    learner = folder / "learner"
    learner.mkdir()
    stub = nbformat.read(ex_dir / "07_practice.ipynb", as_version=4)

    # 01: solved 7.1 correctly, 7.2 wrong
    nb = nbformat.read(ex_dir / "07_practice.ipynb", as_version=4)
    nb.cells[2].source = "def double(x):\n    return x + x"
    nb.cells[4].source = "def halve(x):\n    return x // 3"
    nbformat.write(nb, learner / "01_mixed.ipynb")
    # 02: a syntax error in the first exercise cell
    nb = nbformat.read(ex_dir / "07_practice.ipynb", as_version=4)
    nb.cells[2].source = "def double(x)\n    return 2 * x"
    nbformat.write(nb, learner / "02_syntax.ipynb")
    # 03: an infinite loop in the first exercise
    nb = nbformat.read(ex_dir / "07_practice.ipynb", as_version=4)
    nb.cells[2].source = "def double(x):\n    while True:\n        pass"
    nbformat.write(nb, learner / "03_loop.ipynb")
    # 04: the kernel dies in the first graded cell
    nb = nbformat.read(ex_dir / "07_practice.ipynb", as_version=4)
    nb.cells[3].source = "import os\nos._exit(1)"
    nbformat.write(nb, learner / "04_crash.ipynb")
    # 05: not a notebook at all
    (learner / "05_broken.ipynb").write_text("{ this is not json")
    nbformat.write(stub, learner / "06_untouched.ipynb")

    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in learner.iterdir()}
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "course_lib.course.grade", str(learner), str(sol_dir), "--json",
         "--timeout", "20"],
        capture_output=True, text=True, env=env, timeout=240,
    )
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in learner.iterdir()}
    return {"proc": proc, "json": json.loads(proc.stdout), "before": before, "after": after,
            "learner": learner, "solutions": sol_dir}


def _by_chapter(report):
    return {nb["chapter"]: nb for nb in report["notebooks"]}


def test_grade_never_writes_the_learners_files(graded_folder):
    assert graded_folder["before"] == graded_folder["after"]


def test_grade_scores_correct_wrong_and_unfinished_work(graded_folder):
    report = _by_chapter(graded_folder["json"])
    mixed = report["01_mixed"]
    assert [(e["exercise"], e["status"], e["points"], e["max_points"]) for e in mixed["exercises"]] == [
        ("1.1", "pass", 2, 2), ("1.2", "fail", 0, 1)]
    untouched = report["06_untouched"]
    assert [e["status"] for e in untouched["exercises"]] == ["not done", "not done"]
    assert "write the body of double" in untouched["exercises"][0]["detail"]
    solved = report["07_practice"]
    assert solved["points"] == solved["max_points"] == 3


def test_grade_reports_syntax_errors_loops_crashes_and_unreadable_files(graded_folder):
    report = _by_chapter(graded_folder["json"])
    syntax = report["02_syntax"]
    assert any("SyntaxError" in p for p in syntax["problems"])
    assert syntax["exercises"][0]["status"] == "error"
    assert "NameError" in syntax["exercises"][0]["detail"]
    assert syntax["exercises"][1]["status"] == "not done"  # the rest is still graded

    loop = report["03_loop"]
    assert loop["exercises"][0]["status"] == "timeout"
    assert any("infinite loop" in p for p in loop["problems"])
    assert loop["exercises"][1]["status"] == "not done"  # the kernel recovered

    crash = report["04_crash"]
    assert any("kernel crashed" in p for p in crash["problems"])
    assert [e["status"] for e in crash["exercises"]] == ["error", "not run"]

    broken = report["05_broken"]
    assert broken["exercises"] == [] and "could not read" in broken["problems"][0]


def test_grade_table_output(graded_folder):
    learner = graded_folder["learner"]
    proc = subprocess.run(
        [sys.executable, "-m", "course_lib.course.grade", str(learner / "01_mixed.ipynb")],
        capture_output=True, text=True, timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 0
    assert "chapter" in out and "01_mixed" in out
    assert "1.1" in out and "pass" in out and "2 / 2" in out
    assert "1.2" in out and "fail" in out and "0 / 1" in out
    assert "total: 2 / 3 points" in out


def test_format_report_lists_problems():
    result = grade.NotebookResult(path="x.ipynb", chapter="09_x", problems=["kernel crashed"])
    text = grade.format_report([result])
    assert "no score" in text and "09_x: kernel crashed" in text
