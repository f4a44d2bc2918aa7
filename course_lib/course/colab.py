"""The set-up cell every notebook starts with, kept in one place.

In Google Colab the cell installs course_lib from the course's repository without touching
Colab's own torch (course_lib asks only for ``torch>=2.6``, which Colab already satisfies);
anywhere else it only sets up inline plotting. While ``REPO_URL`` is still the placeholder (a
learner opened a notebook from a copy of the repository), the cell looks in Colab for a copy
under /content, a mounted Google Drive included (a folder holding ``course_lib/__init__.py``
and ``pyproject.toml``); if there is none it asks for a zip of the repository
(``google.colab.files.upload``) and unzips it under /content/course. It installs course_lib
from the copy with a plain ``%pip install`` (not ``-e``: an editable install is a ``.pth`` hook
that Python reads only at start-up, so the running kernel would need a restart; a plain install
into site-packages is importable at once after ``importlib.invalidate_caches()``). When it finds
nothing, it installs nothing and says what to do.

To publish the course from your own copy of the repository, set ``REPO_URL`` below and run::

    python -m course_lib.course.colab

which rewrites the set-up cell (the first code cell, tagged ``setup``) of every notebook in
``notebooks/``, ``notebooks/deeper/`` and ``solutions/``, puts an "Open in Colab" link under
each notebook's title (a GitHub repository's notebooks open in Colab by address; while
``REPO_URL`` is the placeholder there is no address, so no link) and regenerates
``exercises/``, whose links point at their own files. ``--check`` only reports notebooks whose
set-up cell or link differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

# Fill in: the address of the course repository that Colab installs course_lib from. While it is
# this placeholder, the set-up cell installs course_lib in Colab from a copy of the repository
# (found under /content or a mounted Drive, or uploaded as a zip) instead of failing inside pip.
PLACEHOLDER_URL = "https://github.com/your-account/self-attention-course"
REPO_URL = PLACEHOLDER_URL
SETUP_TAG = "setup"
BRANCH = "main"  # the branch a published notebook opens from
COLAB_GITHUB = "https://colab.research.google.com/github/"
LINK_RE = re.compile(r"^\[Open in Colab\]\(https://colab\.research\.google\.com/github/[^)\s]*\)\n",
                     re.M)
_GITHUB_RE = re.compile(r"^https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?$")
# Every folder of notebooks that starts with the set-up cell (exercises/ is generated).
NOTEBOOK_FOLDERS = (Path("notebooks"), Path("notebooks/deeper"), Path("solutions"))

_SETUP_TEMPLATE = '''\
#@title Set-up: run this cell first (in Colab it installs course_lib) { display-mode: "form" }
import sys

if "google.colab" in sys.modules:
    REPO_URL = "@REPO_URL@"
    if "/your-account/" not in REPO_URL:  # a published course: install from its repository
        %pip install --quiet "course_lib @ git+{REPO_URL}"
    else:  # opened from a copy: find it under /content (a mounted Drive too), or upload a zip
        import glob, importlib, io, os, zipfile
        from google.colab import files

        def course_copies():  # folders holding course_lib/ and pyproject.toml, shallow first
            tops = ["", "*/", "*/*/", "drive/MyDrive/*/", "drive/MyDrive/*/*/"]
            found = [p[:-len("/course_lib/__init__.py")] for t in tops
                     for p in glob.glob(f"/content/{t}course_lib/__init__.py")]
            return [f for f in found if os.path.isfile(f"{f}/pyproject.toml")]

        if not course_copies():
            print("No copy of the course found: choose a zip of the course repository.")
            for name, data in files.upload().items():
                if name.lower().endswith(".zip"):
                    zipfile.ZipFile(io.BytesIO(data)).extractall("/content/course")
        if course_copies():
            COURSE_DIR = course_copies()[0]
            print(f"Installing course_lib from {COURSE_DIR}")
            %pip install --quiet "{COURSE_DIR}"
            importlib.invalidate_caches()  # a plain install is importable without a restart
        else:
            print("course_lib was NOT installed: no copy of the course repository was found. "
                  "Run this cell again and upload a zip of the repository (on GitHub: Code > "
                  "Download ZIP), or put its folder under /content or in your Drive (Files "
                  "pane > Mount Drive) first.")
%matplotlib inline'''


def setup_source(repo_url: str = REPO_URL) -> str:
    """The set-up cell's source for a course published at ``repo_url``."""
    return _SETUP_TEMPLATE.replace("@REPO_URL@", repo_url)


SETUP_CELL = setup_source()


def colab_link(path: str, repo_url: str | None = None) -> str | None:
    """The markdown line that opens ``path`` (from the repository root, e.g.
    ``notebooks/01_rnn_limits.ipynb``) in Colab, or None when the course is not published on
    GitHub (the placeholder, or another host: Colab opens notebooks by address from GitHub)."""
    repo_url = REPO_URL if repo_url is None else repo_url
    match = _GITHUB_RE.match(repo_url)
    if repo_url == PLACEHOLDER_URL or match is None:
        return None
    account, repository = match.groups()
    return f"[Open in Colab]({COLAB_GITHUB}{account}/{repository}/blob/{BRANCH}/{path})"


def repository_path(path: Path) -> str:
    """``path`` from the repository root: the part from its course folder on, e.g.
    ``.../notebooks/deeper/01_x.ipynb`` -> ``notebooks/deeper/01_x.ipynb``."""
    parts = Path(path).parts
    starts = [i for i, part in enumerate(parts) if part in ("notebooks", "solutions", "exercises")]
    return "/".join(parts[starts[-1]:]) if starts else Path(path).name


def with_link(nb: nbformat.NotebookNode, path: str, repo_url: str | None = None) -> bool:
    """Put ``path``'s Colab link on the line under the title of ``nb``'s first markdown cell (or
    take a stale one away); return whether anything changed."""
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if cell is None:
        return False
    line = colab_link(path, repo_url)
    title, _, rest = LINK_RE.sub("", cell.source).partition("\n")
    source = f"{title}\n{line}\n{rest}" if line else (f"{title}\n{rest}" if rest else title)
    changed = source != cell.source
    cell.source = source
    return changed


# Folded where the notebook opens: JupyterLab hides the source, Colab shows the #@title as a form.
SETUP_METADATA = {"jupyter": {"source_hidden": True}, "cellView": "form"}


def setup_cell() -> nbformat.NotebookNode:
    """A fresh set-up code cell."""
    cell = nbformat.v4.new_code_cell(SETUP_CELL)
    cell.metadata.update({"tags": [SETUP_TAG], **SETUP_METADATA})
    return cell


def _folded(cell: nbformat.NotebookNode) -> bool:
    return all(cell.metadata.get(key) == value for key, value in SETUP_METADATA.items())


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
    if not _folded(nb.cells[index]):
        return f"{path}: the set-up cell is not folded ({SETUP_METADATA} in its metadata)"
    if with_link(nb, repository_path(path)):
        return f"{path}: its Open in Colab link differs from REPO_URL's"
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
                nb.cells[index].metadata.update(SETUP_METADATA)
            with_link(nb, repository_path(path))
            nbformat.write(nb, path)
            report.append(f"updated {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_lib.course.colab",
        description="Write course_lib.course.colab.SETUP_CELL into every notebook's set-up cell "
                    "and an Open in Colab link under its title.",
    )
    parser.add_argument("--check", action="store_true", help="only report differences")
    args = parser.parse_args(argv)
    report = sync(list(NOTEBOOK_FOLDERS), check=args.check)
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
