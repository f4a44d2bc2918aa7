"""The set-up cell in Colab when the course was opened from a copy of the repository.

While ``REPO_URL`` is the placeholder, the cell looks for a copy of the repository under /content
(a mounted Google Drive included), asks for a zip of it when there is none, and installs
course_lib from the copy with ``%pip``. Here ``google.colab`` is a fake module, /content is a
temporary folder and the magics are recorded instead of run.
"""

from __future__ import annotations

import io
import sys
import types
import zipfile
from pathlib import Path

import pytest

from course_lib.course import colab


class _FakeIPython:
    """Records the magics a cell calls instead of running them (no pip, no matplotlib)."""

    def __init__(self):
        self.magics: list[tuple[str, str]] = []

    def run_line_magic(self, name, line, _stack_depth=1):
        self.magics.append((name, line))


class _FakeFiles:
    """google.colab.files: ``upload()`` returns what the learner 'chose' (name -> bytes)."""

    def __init__(self, uploads: dict[str, bytes]):
        self.uploads = uploads
        self.calls = 0

    def upload(self):
        self.calls += 1
        return dict(self.uploads)


def _make_copy(folder: Path) -> Path:
    """A minimal copy of the repository: what the cell looks for."""
    (folder / "course_lib").mkdir(parents=True)
    (folder / "course_lib" / "__init__.py").write_text("")
    (folder / "pyproject.toml").write_text("[project]\nname = 'course_lib'\n")
    return folder


def _zip_of_copy(top: str) -> bytes:
    """A zip as GitHub's 'Download ZIP' makes it: everything under one top folder."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"{top}course_lib/__init__.py", "")
        archive.writestr(f"{top}course_lib/course/__init__.py", "")
        archive.writestr(f"{top}pyproject.toml", "[project]\nname = 'course_lib'\n")
        archive.writestr(f"{top}notebooks/00_start_here.ipynb", "{}")
    return buffer.getvalue()


def _run_in_fake_colab(content: Path, monkeypatch, uploads=None):
    """Run the placeholder set-up cell as Colab would, with ``content`` standing for /content."""
    from IPython.core.inputtransformer2 import TransformerManager

    files = _FakeFiles(uploads or {})
    fake_colab = types.ModuleType("google.colab")
    fake_colab.files = files
    fake_colab.drive = types.ModuleType("google.colab.drive")  # never mounted by the cell
    monkeypatch.setitem(sys.modules, "google.colab", fake_colab)
    source = colab.setup_source(colab.PLACEHOLDER_URL)
    assert source.count("/content") >= 2  # the paths the cell searches and unzips into
    source = source.replace("/content", content.as_posix())
    shell = _FakeIPython()
    namespace = {"get_ipython": lambda: shell}
    exec(compile(TransformerManager().transform_cell(source), "<setup cell>", "exec"), namespace)
    return shell.magics, namespace, files


def _pip_folder(magics, namespace) -> Path:
    """The folder the cell asked %pip to install (IPython expands {COURSE_DIR} when it runs)."""
    assert magics == [("pip", 'install --quiet "{COURSE_DIR}"'), ("matplotlib", "inline")]
    return Path(namespace["COURSE_DIR"])


def test_the_placeholder_is_still_in_place():
    assert colab.REPO_URL == colab.PLACEHOLDER_URL  # publishing the course changes this test


def test_a_copy_under_content_is_found_and_installed_without_asking(tmp_path, monkeypatch, capsys):
    copy = _make_copy(tmp_path / "self-attention-course")
    (tmp_path / "sample_data").mkdir()  # Colab's own folder is not mistaken for the course
    magics, namespace, files = _run_in_fake_colab(tmp_path, monkeypatch)
    assert _pip_folder(magics, namespace) == copy
    assert files.calls == 0, "a copy was there: the cell must not ask for an upload"
    assert f"Installing course_lib from {copy}" in capsys.readouterr().out


def test_a_copy_in_a_mounted_drive_is_found(tmp_path, monkeypatch):
    copy = _make_copy(tmp_path / "drive" / "MyDrive" / "Colab Notebooks" / "course")
    magics, namespace, files = _run_in_fake_colab(tmp_path, monkeypatch)
    assert _pip_folder(magics, namespace) == copy and files.calls == 0


def test_a_folder_without_pyproject_is_not_a_copy(tmp_path, monkeypatch, capsys):
    (tmp_path / "half" / "course_lib").mkdir(parents=True)
    (tmp_path / "half" / "course_lib" / "__init__.py").write_text("")  # no pyproject.toml
    magics, _, files = _run_in_fake_colab(tmp_path, monkeypatch)
    assert files.calls == 1 and magics == [("matplotlib", "inline")]
    assert "course_lib was NOT installed" in capsys.readouterr().out


@pytest.mark.parametrize("top", ["self-attention-course-main/", ""],
                         ids=["github-zip", "zip-without-top-folder"])
def test_an_uploaded_zip_is_unzipped_and_installed(top, tmp_path, monkeypatch, capsys):
    uploads = {"notes.txt": b"not a zip", "Self-Attention-Course.ZIP": _zip_of_copy(top)}
    magics, namespace, files = _run_in_fake_colab(tmp_path, monkeypatch, uploads)
    assert files.calls == 1
    folder = _pip_folder(magics, namespace)
    assert folder == tmp_path / "course" / top.rstrip("/")
    assert (folder / "course_lib" / "__init__.py").is_file()
    assert (folder / "notebooks" / "00_start_here.ipynb").is_file()
    printed = capsys.readouterr().out
    assert "choose a zip of the course repository" in printed
    assert f"Installing course_lib from {folder}" in printed


@pytest.mark.parametrize("uploads", [{}, {"course.tar.gz": b"\x1f\x8b"}],
                         ids=["upload-cancelled", "not-a-zip"])
def test_nothing_found_nothing_uploaded_explains_instead_of_installing(uploads, tmp_path,
                                                                        monkeypatch, capsys):
    magics, namespace, files = _run_in_fake_colab(tmp_path, monkeypatch, uploads)
    assert files.calls == 1
    assert magics == [("matplotlib", "inline")]  # no %pip call at all
    assert "COURSE_DIR" not in namespace
    printed = capsys.readouterr().out
    assert "course_lib was NOT installed" in printed
    assert "upload a zip of the repository" in printed and "Mount Drive" in printed


def test_the_cell_installs_a_plain_copy_not_an_editable_one():
    # An editable install is a .pth hook that Python reads only at start-up: the running
    # kernel would not see course_lib before a restart. A plain install is importable at once.
    branch = colab.SETUP_CELL.split("else:")[1]
    assert '%pip install --quiet "{COURSE_DIR}"' in branch and " -e " not in branch
    assert "importlib.invalidate_caches()" in branch
    assert "torch" not in branch.split("%pip")[1].split("\n")[0]


def test_the_cell_stays_readable():
    lines = colab.SETUP_CELL.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 100
