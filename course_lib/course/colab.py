"""The set-up cell every notebook starts with, kept in one place.

In Google Colab the cell installs course_lib from the course's repository without touching
Colab's own torch (course_lib asks only for ``torch>=2.2``, which Colab already satisfies);
anywhere else it only sets up inline plotting. While ``REPO_URL`` is still the placeholder, the
cell installs nothing in Colab and prints what to do instead.

To publish the course from your own copy of the repository, set ``REPO_URL`` below and run::

    python -m course_lib.course.colab

which rewrites the set-up cell (the first code cell, tagged ``setup``) of every notebook in
``notebooks/`` and ``solutions/`` and regenerates ``exercises/``. ``--check`` only reports
notebooks whose set-up cell differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

# Fill in: the address of the course repository that Colab installs course_lib from. While it is
# this placeholder, the set-up cell explains in Colab what to do instead of failing inside pip.
PLACEHOLDER_URL = "https://github.com/your-account/self-attention-course"
REPO_URL = PLACEHOLDER_URL
SETUP_TAG = "setup"

_SETUP_TEMPLATE = '''\
# Set-up: run this cell first. In Google Colab it installs the course library from the
# course repository (Colab's own torch is kept); on your own machine it changes nothing.
import sys

IN_COLAB = "google.colab" in sys.modules
if IN_COLAB:
    REPO_URL = "@REPO_URL@"
    if "/your-account/" in REPO_URL:  # the placeholder: this copy does not know its repository
        print(
            "course_lib was NOT installed: REPO_URL in this cell is still a placeholder.\\n"
            "Either upload or clone the course repository into Colab and run\\n"
            "    %pip install -e <the repository's folder>\\n"
            "(then Runtime > Restart session), or set REPO_URL to the course repository's\\n"
            "address (for every notebook: in course_lib/course/colab.py, then run\\n"
            "python -m course_lib.course.colab) and run this cell again."
        )
    else:
        %pip install --quiet "course_lib @ git+{REPO_URL}"
%matplotlib inline'''


def setup_source(repo_url: str = REPO_URL) -> str:
    """The set-up cell's source for a course published at ``repo_url``."""
    return _SETUP_TEMPLATE.replace("@REPO_URL@", repo_url)


SETUP_CELL = setup_source()


def setup_cell() -> nbformat.NotebookNode:
    """A fresh set-up code cell."""
    cell = nbformat.v4.new_code_cell(SETUP_CELL)
    cell.metadata["tags"] = [SETUP_TAG]
    return cell


def _setup_index(nb: nbformat.NotebookNode) -> int | None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            return index if SETUP_TAG in cell.metadata.get("tags", []) else None
    return None


def out_of_date(path: Path) -> str | None:
    """Why ``path``'s set-up cell is not the canonical one, or None if it is."""
    nb = nbformat.read(path, as_version=4)
    index = _setup_index(nb)
    if index is None:
        return f"{path}: the first code cell must be the set-up cell (tagged '{SETUP_TAG}')"
    if nb.cells[index].source != SETUP_CELL:
        return f"{path}: the set-up cell differs from course_lib.course.colab.SETUP_CELL"
    return None


def sync(folders: list[Path], *, check: bool = False) -> list[str]:
    """Rewrite (or with ``check=True`` list) notebooks whose set-up cell is not canonical."""
    report = []
    for folder in folders:
        for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
            problem = out_of_date(path)
            if problem is None:
                continue
            if check:
                report.append(problem)
                continue
            nb = nbformat.read(path, as_version=4)
            index = _setup_index(nb)
            if index is None:
                nb.cells.insert(0 if nb.cells[0].cell_type == "code" else 1, setup_cell())
            else:
                nb.cells[index].source = SETUP_CELL
            nbformat.write(nb, path)
            report.append(f"updated {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.course.colab",
        description="Write course_lib.course.colab.SETUP_CELL into every notebook's set-up cell.",
    )
    parser.add_argument("--check", action="store_true", help="only report differences")
    args = parser.parse_args(argv)
    report = sync([Path("notebooks"), Path("solutions")], check=args.check)
    for line in report:
        print(line)
    if args.check:
        return 1 if report else 0
    if report:
        from .exercises import generate

        for line in generate(Path("solutions"), Path("exercises")):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
