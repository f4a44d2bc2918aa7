"""The course's notebooks as a whole: structure, the exercise notebooks, the set-up cells.

(nbval, configured in pyproject.toml, separately re-runs every lecture and solution notebook
and compares each cell's output with the stored one.)
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from course_lib.course import colab, exercises, grade

ROOT = Path(__file__).resolve().parent.parent
LECTURES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
DEEPER = sorted((ROOT / "notebooks" / "deeper").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))


def _ids(paths):
    return [p.stem for p in paths]


def test_every_solution_has_a_current_exercise_notebook():
    assert [p.name for p in SOLUTIONS] == [p.name for p in EXERCISES]
    stale = exercises.generate(ROOT / "solutions", ROOT / "exercises", check=True)
    assert stale == [], "exercise notebooks are stale; run: python -m course_lib.course.exercises"


def test_every_notebook_starts_with_the_set_up_cell():
    assert colab.sync([ROOT / folder for folder in colab.NOTEBOOK_FOLDERS], check=True) == []


@pytest.mark.parametrize(
    "path", LECTURES + DEEPER + SOLUTIONS, ids=_ids(LECTURES + DEEPER + SOLUTIONS)
)
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


@pytest.mark.parametrize(
    "path", LECTURES + DEEPER + SOLUTIONS, ids=_ids(LECTURES + DEEPER + SOLUTIONS)
)
def test_stored_runs_lie_inside_the_ranges_the_prose_gives(path):
    """A stored run is the reader's first example: each value it sets next to the book's
    range (course_lib.course.claims.compare_to_book) lies inside that range."""
    nb = nbformat.read(path, as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                      for o in c.outputs if o.output_type == "stream")
    outside = [line for line in printed.splitlines() if "outside the book's range" in line]
    assert outside == [], "a stored value lies outside its stated range; widen the range " \
        "with what was measured, or rerun the notebook"


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_solution_notebooks_have_graded_exercises(path):
    nb = nbformat.read(path, as_version=4)
    graded = exercises.graded_cells(nb, exercises.chapter_of(path))
    assert len(graded) >= 3
    for cell in graded:
        assert "check_" in nb.cells[cell.index].source


@pytest.mark.parametrize("path", EXERCISES, ids=_ids(EXERCISES))
def test_exercise_notebook_runs_to_the_end_and_reports_each_stub_at_its_graded_cell(path):
    """Run All on the unsolved notebook, as the grader runs it: no cell raises (each graded cell
    prints its one not-done line and the notebook goes on), and every graded exercise is
    reported "not done" with its own stub's "Exercise N.M:" text."""
    nb = nbformat.read(path, as_version=4)
    graded = exercises.graded_cells(nb, exercises.chapter_of(path))
    assert graded, "no graded cells"
    problems: list[str] = []
    statuses = grade._execute(nb, {g.index for g in graded}, problems, timeout=300,
                              startup_timeout=60)
    assert problems == []
    raised = [f"cell {i}: {o.ename}: {o.evalue}" for i, c in enumerate(nb.cells)
              if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert raised == [], "Run All would stop here"
    for g in graded:
        status, detail = statuses[g.index]
        assert status == "not done", f"{g.exercise} {g.name}: {status} ({detail})"
        assert detail.startswith(f"Exercise {g.exercise}:"), f"{g.exercise}: {detail}"


# --- the learner's path (DESIGN.md): an hour's core notebook, depth apart, labelled exercises

WORD_BUDGET = 2500
KINDS_THAT_MAKE_YOU_THINK = ("predict then verify", "experiment", "find the bug")
LABEL_RE = re.compile(r"\*\*(★{1,3}) (quick|standard|challenge) · (\d+) min · ([a-z ]+)\*\*")


def prose_words(nb: nbformat.NotebookNode) -> int:
    """Words of markdown in a notebook (everything a learner reads, answers and references too;
    not the Open in Colab link that publishing writes under the title)."""
    return sum(len(colab.LINK_RE.sub("", c.source).split())
               for c in nb.cells if c.cell_type == "markdown")


# Seconds each core notebook takes to run top to bottom on a two-core CPU, one thread: pytest's
# "notebook execution times" summary of the latest full run of the suite (2 cores, 2026-11-28).
# To re-measure one: `pytest notebooks/NN_x.ipynb` prints its time.
RUN_SECONDS = {
    "00_start_here": 4.8,
    "01_rnn_limits": 16.4,
    "02_self_attention": 4.4,
    "03_positions": 29.8,
    "04_nonlinearity": 4.0,
    "05_masking": 5.5,
    "06_multi_head": 6.8,
    "07_norms_residuals": 23.5,
    "08_architectures": 17.4,
    "09_training": 40.6,
    "10_cost_of_attention": 12.4,
    "11_inside_a_transformer": 60.2,
    "12_modern_decoders": 54.7,
    "13_tokens": 60.1,
    "14_beyond_one_device": 18.3,
}


def minutes_to_work_through(nb: nbformat.NotebookNode, run_seconds: float) -> float:
    """Minutes a learner takes to work through a core notebook the first time, counted the same
    way for every chapter (chapter 00 states the rule): prose at 62 words a minute and code at
    9.5 lines a minute (a learner's speed on new material; the set-up cell and comment lines
    left out), 3 minutes per prediction, 5 for the check-yourself questions, plus the notebook's
    measured run time (RUN_SECONDS). A notebook states this rounded to the nearest 5 minutes.
    Readers measured 1.3-1.5x the earlier skim-speed rule (100 words and 15 lines a minute, no
    run time)."""
    code_lines = sum(
        1 for c in nb.cells if c.cell_type == "code" and "setup" not in c.metadata.get("tags", [])
        for line in c.source.splitlines() if line.strip() and not line.strip().startswith("#"))
    predictions = sum(c.source.count("**Predict") for c in nb.cells if c.cell_type == "markdown")
    return prose_words(nb) / 62 + code_lines / 9.5 + 3 * predictions + 5 + run_seconds / 60


def _stated_minutes(path: Path) -> int:
    source = nbformat.read(path, as_version=4).cells[0].source
    return int(re.search(r"\*\*Time:\*\* about (\d+) min", source).group(1))


def test_every_core_notebook_has_a_measured_run_time():
    assert sorted(RUN_SECONDS) == [p.stem for p in LECTURES], \
        "RUN_SECONDS lists each core notebook once; time a new one with pytest notebooks/NN_x.ipynb"


@pytest.mark.parametrize("path", LECTURES, ids=_ids(LECTURES))
def test_core_notebook_states_the_minutes_a_first_reading_takes(path):
    nb = nbformat.read(path, as_version=4)
    stated = _stated_minutes(path)
    counted = minutes_to_work_through(nb, RUN_SECONDS[path.stem])
    rounded = 5 * round(counted / 5)
    assert stated % 5 == 0, f"states {stated} min; round to the nearest 5 ({rounded})"
    assert abs(stated - counted) <= 5, \
        f"states {stated} min; the rule counts {counted:.0f} (state {rounded})"


@pytest.mark.parametrize("path", LECTURES, ids=_ids(LECTURES))
def test_core_notebook_is_an_hour_with_its_time_and_prerequisites(path):
    nb = nbformat.read(path, as_version=4)
    words = prose_words(nb)
    assert words <= WORD_BUDGET, f"{words} words of prose; the core notebook's budget is {WORD_BUDGET}"
    intro = nb.cells[0].source
    assert re.search(r"\*\*Time:\*\* about \d+ min", intro), "the first cell gives the time"
    assert "**Assumes:**" in intro, "the first cell says what the chapter assumes"
    quiz = [c.source for c in nb.cells if c.cell_type == "markdown" and "Check yourself" in c.source]
    assert quiz, "a 'Check yourself' section near the end"
    assert 3 <= quiz[-1].count("<details>") <= 5, "3-5 questions with folded answers"


@pytest.mark.parametrize("path", LECTURES[1:], ids=_ids(LECTURES[1:]))
def test_core_notebook_links_its_deeper_companion(path):
    deeper = ROOT / "notebooks" / "deeper" / f"{path.stem}_deeper.ipynb"
    assert deeper.exists(), f"missing {deeper.relative_to(ROOT)}"
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    assert f"deeper/{deeper.name}" in text, "the core notebook links its companion where it branches"


@pytest.mark.parametrize("path", SOLUTIONS, ids=_ids(SOLUTIONS))
def test_every_exercise_has_a_difficulty_minutes_and_a_kind(path):
    nb = nbformat.read(path, as_version=4)
    kinds = []
    for cell in exercises.graded_cells(nb, exercises.chapter_of(path)):
        heading = next(
            c.source for c in reversed(nb.cells[: cell.index])
            if c.cell_type == "markdown" and c.source.startswith("### Exercise")
        )
        label = LABEL_RE.search(heading)
        assert label, f"exercise {cell.exercise}: no '**★★ standard · 15 min · kind**' label"
        kinds.append(label.group(4))
    assert set(kinds) & set(KINDS_THAT_MAKE_YOU_THINK), f"only {kinds}: add a thinking exercise"


def _exercise_labels(path: Path) -> list[re.Match]:
    nb = nbformat.read(path, as_version=4)
    headings = [c.source for c in nb.cells
                if c.cell_type == "markdown" and c.source.startswith("### Exercise")]
    return [LABEL_RE.search(h) for h in headings]


def test_chapter_00s_time_table_matches_the_chapters():
    """The table in 00_start_here gives each core notebook's minutes as its first cell does,
    each chapter's exercise minutes as the sum of its exercises' labels, and a totals row that
    adds the columns up, with the core path (core + exercises) and everything (+ deeper) in
    hours, rounded."""
    table = "\n".join(c.source for c in nbformat.read(LECTURES[0], as_version=4).cells)
    rows = {m.group(1): (int(m.group(2)), m.group(3).strip(), m.group(4).strip()) for m in
            re.finditer(r"^\| (\d\d) \|[^|]*\|[^|]*\| (\d+) \| ([^|]*) \| ([^|]*) \|", table, re.M)}
    assert sorted(rows) == [p.stem[:2] for p in LECTURES], "a row per chapter"
    assert rows["00"][0] == _stated_minutes(LECTURES[0]), "chapter 00's row"
    for path in LECTURES[1:]:
        chapter = path.stem[:2]
        solution = ROOT / "solutions" / path.name
        exercise_minutes = sum(int(label.group(3)) for label in _exercise_labels(solution))
        assert rows[chapter][:2] == (_stated_minutes(path), str(exercise_minutes)), \
            f"chapter {chapter}'s row"
    core, exercise, deeper = (sum(int(row[i]) for row in rows.values() if row[i] != "-")
                              for i in range(3))
    total = re.search(r"^\| \| \*\*total\*\* \| core path: about (\d+) h; everything: about "
                      r"(\d+) h \| \*\*(\d+)\*\* \| \*\*(\d+)\*\* \| \*\*(\d+)\*\* \|", table, re.M)
    assert total, "a totals row"
    assert tuple(int(g) for g in total.groups()) == (
        round((core + exercise) / 60), round((core + exercise + deeper) / 60),
        core, exercise, deeper), "the totals row adds up the columns"


@pytest.mark.parametrize("path", LECTURES[1:], ids=_ids(LECTURES[1:]))
def test_exercise_minutes_are_the_sum_of_the_labels(path):
    """A core notebook's Time line and its exercise notebook's opening both give the minutes of
    the chapter's exercises as the sum of their labels."""
    solution = ROOT / "solutions" / path.name
    total = sum(int(label.group(3)) for label in _exercise_labels(solution))
    stated = re.search(r"\(\+ (\d+) min for the exercises", nbformat.read(path, as_version=4).cells[0].source)
    opening = re.search(r"about (\d+) minutes in all",
                        nbformat.read(solution, as_version=4).cells[0].source)
    assert stated and int(stated.group(1)) == total, f"{path.name}'s Time line: {total} min"
    assert opening and int(opening.group(1)) == total, f"{solution.name}'s opening: {total} min"


@pytest.mark.parametrize("path", LECTURES + DEEPER + SOLUTIONS, ids=_ids(LECTURES + DEEPER + SOLUTIONS))
def test_nbval_markers_stand_alone_on_their_line(path):
    """nbval reads '# NBVAL_IGNORE_OUTPUT' only as a line of its own: with words after it the
    cell's output is compared after all."""
    bad = [i for i, c in enumerate(nbformat.read(path, as_version=4).cells)
           if c.cell_type == "code" and any(
               line.startswith("# NBVAL_") and len(line.split()) > 2
               for line in c.source.splitlines())]
    assert bad == [], f"cells {bad}: put the explanation on the next line"


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", LECTURES + DEEPER + SOLUTIONS + EXERCISES,
                         ids=_ids(LECTURES + DEEPER + SOLUTIONS + EXERCISES))
def test_every_relative_link_resolves(path):
    """A link to another file of the course opens from JupyterLab started at the repository
    root (the README's Quick start): the file exists where the link points."""
    nb = nbformat.read(path, as_version=4)
    targets = [m.group(1) for c in nb.cells if c.cell_type == "markdown"
               for m in _LINK.finditer(c.source)]
    broken = [t for t in targets if not re.match(r"[a-z]+:|#", t)
              and not (path.parent / t.split("#")[0]).resolve().exists()]
    assert broken == [], f"links to missing files: {broken}"
