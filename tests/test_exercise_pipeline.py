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
        nbformat.v4.new_markdown_cell("### Exercise 7.2: halve\n**★★ standard · 15 min · write**"),
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
    assert 'NotImplementedError("Exercise 7.2: write the body of halve")' in sources[5]
    assert not any("Worked answer" in s for s in sources)  # solution_only cell removed
    assert all(c.outputs == [] and c.execution_count is None for c in nb.cells
               if c.cell_type == "code")
    graded = exercises.graded_cells(nb, 7)
    assert [(g.exercise, g.minutes, g.points) for g in graded] == [("7.1", None, 2), ("7.2", 15, 15)]


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
    nb.cells[5].source = "def halve(x):\n    return x // 3"
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
    assert [(e["exercise"], e["status"], e["points"], e["max_points"], e["minutes"])
            for e in mixed["exercises"]] == [("1.1", "pass", 2, 2, None), ("1.2", "fail", 0, 15, 15)]
    untouched = report["06_untouched"]
    assert [e["status"] for e in untouched["exercises"]] == ["not done", "not done"]
    assert "write the body of double" in untouched["exercises"][0]["detail"]
    solved = report["07_practice"]
    assert solved["points"] == solved["max_points"] == 17
    total = graded_folder["json"]["total"]
    assert total["percent"] == round(100 * total["points"] / total["max_points"], 1)


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
    assert "1.2 exercise 2 (01_mixed, 15 points): fail" in out
    assert "01_mixed  2 / 17" in out
    assert out.rstrip().endswith("total: 2 / 17 points (12%)")


def test_format_report_lists_problems():
    result = grade.NotebookResult(path="x.ipynb", chapter="09_x", problems=["kernel crashed"])
    text = grade.format_report([result])
    assert "no score" in text and "09_x: kernel crashed" in text


def _exercise(exercise, status, minutes, detail=""):
    return grade.ExerciseResult(exercise=exercise, name=f"f{exercise}", status=status,
                                points=minutes if status == "pass" else 0, max_points=minutes,
                                detail=detail, minutes=minutes)


ZERO_GRAD = ("your train_step does not reset the gradients: call optimizer.zero_grad() before "
             "loss.backward(), or the gradients of every step add up. " + "x" * 300
             + "\nsecond line of the message")


def test_grade_report_puts_whole_failures_first_and_counts_the_rest_in_one_line():
    results = [
        grade.NotebookResult(path="a", chapter="01_a", exercises=[
            _exercise("1.1", "not done", 10, "Exercise 1.1: write the body of f"),
            _exercise("1.2", "pass", 15)]),
        grade.NotebookResult(path="b", chapter="09_b", exercises=[
            _exercise(f"9.{i}", "not done", 10, f"Exercise 9.{i}: write the body of g")
            for i in range(1, 6)] + [_exercise("9.7", "fail", 60, ZERO_GRAD)]),
    ]
    text = grade.format_report(results)
    lines = text.splitlines()
    assert lines[0] == "to fix (1):"
    assert lines[1] == "  9.7 f9.7 (09_b, 60 points): fail"
    message = lines[2:lines.index("second line of the message".rjust(32)) + 1]
    assert all(line.startswith("      ") and len(line) <= 100 for line in message if "xxx" not in line)
    assert " ".join(" ".join(message).split()) == " ".join(ZERO_GRAD.split())
    not_done = [line for line in lines if "not done yet" in line]
    assert not_done == ["not done yet: 6 exercises (60 points); each one's graded cell says what "
                        "to write"]
    assert "write the body" not in text
    assert lines.index(not_done[0]) > 3
    assert lines[-1] == "total: 15 / 135 points (11%)"


def test_grade_json_weights_each_exercise_by_its_minutes():
    results = [grade.NotebookResult(path="a", chapter="09_a", exercises=[
        _exercise("9.1", "pass", 10), _exercise("9.7", "pass", 60), _exercise("9.2", "fail", 20)])]
    report = grade.to_json(results)
    assert [(e["minutes"], e["points"], e["max_points"]) for e in report["notebooks"][0]["exercises"]] \
        == [(10, 10, 10), (60, 60, 60), (20, 0, 20)]
    assert report["total"] == {"points": 70, "max_points": 90, "percent": 77.8}


@pytest.mark.parametrize("error,printed,expected", [
    (None, "", ("pass", "")),
    (None, "some output\n" + exercises.not_done_line("Exercise 3.2: write the body of f") + "\n",
     ("not done", "Exercise 3.2: write the body of f")),
    (("CheckFailure", ZERO_GRAD), "", ("fail", ZERO_GRAD)),
    (("NotImplementedError", "Exercise 3.2: write the body of f"), "",
     ("not done", "Exercise 3.2: write the body of f")),
    (("NameError", "name 'f' is not defined"), "", ("error", "NameError: name 'f' is not defined")),
])
def test_grade_status_of_a_cell(error, printed, expected):
    assert grade._status_for(error, printed) == expected


# ----------------------------------------------------------- what a learner sees in a notebook

CHECKS_NOTEBOOK = [
    ("code", "import torch\nfrom course_lib.course.checks.ch05 import check_causal_mask"),
    ("markdown", "### Exercise 8.1: a stub\n**★ quick · 10 min · write**"),
    ("code", "def mask_a(T, S):\n    raise NotImplementedError(\"Exercise 8.1: write the body of "
             "mask_a\")"),
    ("graded", "check_causal_mask(mask_a)"),
    ("markdown", "### Exercise 8.2: a wrong answer\n**★★★ challenge · 60 min · write**"),
    ("code", "def mask_b(T, S):\n    return torch.ones(T, S, dtype=torch.bool)"),
    ("graded", "check_causal_mask(mask_b)"),
    ("markdown", "### Exercise 8.3: an error in the learner's code\n**★★ standard · 15 min · write**"),
    ("code", "def mask_c(T, S):\n    keep = torch.ones(T, S).tril(S - T)\n"
             "    return keep.bool() & undefined_name"),
    ("graded", "check_causal_mask(mask_c)"),
    ("graded", "check_causal_mask(mask_a)"),
    ("code", "print('reached the end')"),
]


@pytest.fixture(scope="module")
def checked_notebook():
    """A small notebook calling a real check on a stub, a wrong answer and a broken function,
    run once in a kernel as the grader runs it (outputs kept)."""
    nb = nbformat.v4.new_notebook()
    for kind, source in CHECKS_NOTEBOOK:
        nb.cells.append(nbformat.v4.new_markdown_cell(source) if kind == "markdown"
                        else _cell(source, *(["graded"] if kind == "graded" else [])))
    graded = exercises.graded_cells(nb, 8)
    problems: list[str] = []
    statuses = grade._execute(nb, {g.index for g in graded}, problems, timeout=120,
                              startup_timeout=60)
    return {"nb": nb, "graded": graded, "statuses": statuses, "problems": problems}


def _errors(cell):
    return [o for o in cell.outputs if o.output_type == "error"]


def test_run_all_goes_past_an_unsolved_exercise(checked_notebook):
    nb, graded = checked_notebook["nb"], checked_notebook["graded"]
    assert checked_notebook["problems"] == []
    assert [checked_notebook["statuses"][g.index][0] for g in graded] == [
        "not done", "fail", "fail", "not done"]
    stub_cell = nb.cells[graded[0].index]
    assert _errors(stub_cell) == []
    assert grade._printed(stub_cell) == exercises.not_done_line(
        "Exercise 8.1: write the body of mask_a") + "\n"
    assert "reached the end" in grade._printed(nb.cells[-1])
    assert [(g.minutes, g.points) for g in graded] == [(10, 10), (60, 60), (15, 15), (None, 1)]


def test_a_failing_check_shows_its_message_not_the_checkers_frames(checked_notebook):
    (error,) = _errors(checked_notebook["nb"].cells[checked_notebook["graded"][1].index])
    shown = "\n".join(error.traceback)
    assert error.ename == "CheckFailure"
    assert shown.splitlines()[0] == "\u274c check_causal_mask found a problem:"
    assert error.evalue in shown and "case 'T=" in error.evalue
    assert "course_lib" not in shown and "File " not in shown and "Cell In" not in shown


def test_an_error_in_the_learners_code_keeps_the_learners_line(checked_notebook):
    (error,) = _errors(checked_notebook["nb"].cells[checked_notebook["graded"][2].index])
    shown = "\n".join(error.traceback)
    assert "mask_c raised NameError" in shown
    assert "Your code, where it was raised:" in shown
    assert "line 3, in mask_c" in shown and "return keep.bool() & undefined_name" in shown
    assert "course_lib" not in shown and "check_one" not in shown


def test_a_stub_raises_outside_a_notebook_and_reports_inside_one(monkeypatch, capsys):
    from course_lib.course.checks import _core
    from course_lib.course.checks.ch05 import check_causal_mask

    def stub(T, S):
        raise NotImplementedError("Exercise 5.1: write the body of causal_mask")

    def unsupported(T, S):  # what torch raises for an operation a device lacks
        raise NotImplementedError("The operator 'aten::tril' is not implemented for MPS")

    with pytest.raises(NotImplementedError, match="Exercise 5.1"):
        check_causal_mask(stub)
    monkeypatch.setattr(_core, "_in_ipython", lambda: True)
    assert check_causal_mask(stub) is None
    assert capsys.readouterr().out == exercises.not_done_line(
        "Exercise 5.1: write the body of causal_mask") + "\n"
    with pytest.raises(NotImplementedError, match="MPS"):
        check_causal_mask(unsupported)


def test_an_error_raised_by_the_learners_code_outside_call_learner_shows_the_learners_line():
    from course_lib.course.checks import _core

    def learners_check_one(result, case):
        raise ValueError(f"cannot use {result}")

    check = _core.graded_check(_core.run_cases)
    with pytest.raises(ValueError) as info:
        check("f", lambda: 1, [_core.Case("one")], learners_check_one)
    shown = info.value._render_traceback_()
    assert shown[:2] == ["\u274c run_cases stopped: your code raised ValueError:", "cannot use 1"]
    assert 'raise ValueError(f"cannot use {result}")' in shown[-1]
    assert not any("_core.py" in line for line in shown)


def test_every_chapters_checks_are_graded_checks():
    """Each chapter module wraps its public checks (a stub's not-done line, short failures)."""
    import importlib
    import inspect
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "course_lib" / "course" / "checks"
    unwrapped = []
    for path in sorted(folder.glob("ch[0-9][0-9].py")):
        module = importlib.import_module(f"course_lib.course.checks.{path.stem}")
        unwrapped += [f"{path.stem}.{name}" for name, fn in vars(module).items()
                      if name.startswith("check_") and inspect.isfunction(fn)
                      and not getattr(fn, "__course_graded__", False)]
    assert unwrapped == [], "end the module with wrap_checks(sys.modules[__name__])"
