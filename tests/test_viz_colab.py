"""Plot helpers, the widget helper's fallback, and the shared set-up cell."""

from __future__ import annotations

import sys
import types

import ipywidgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import nbformat  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from test_notebooks import prose_words  # noqa: E402

from course_lib.course import colab  # noqa: E402
from course_lib.instruments.viz import _make_widget, interactive, plot_attention, use_course_style  # noqa: E402


def test_plot_attention_labels_and_values():
    use_course_style()
    weights = torch.softmax(torch.randn(3, 4), dim=-1)
    ax = plot_attention(weights, ["a", "b", "c"], ["w", "x", "y", "z"], title="demo")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["w", "x", "y", "z"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert len(ax.texts) == 12  # every value annotated on a small matrix
    assert ax.get_title() == "demo"
    ax = plot_attention(torch.full((2, 2), 0.25), vmax=1.0)  # pale cells keep dark text
    assert {t.get_color() for t in ax.texts} == {"black"}
    masked = weights.masked_fill(torch.tensor([[False, True, True, True]] * 3), float("-inf"))
    ax = plot_attention(masked, vmin=None)
    assert "-inf" in [t.get_text() for t in ax.texts]
    plt.close("all")


def test_plot_attention_rejects_bad_input():
    with pytest.raises(ValueError, match=r"2-D matrix \(T, S\).*weights\[0, head\]"):
        plot_attention(torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match="queries has 2 labels but the matrix has 3 rows"):
        plot_attention(torch.zeros(3, 3), ["a", "b"])


def test_interactive_without_a_front_end_calls_the_function_once_with_its_defaults():
    calls = []
    interactive(lambda d=64, kind="relu": calls.append((d, kind)), d=(2, 512, 2),
                kind=["gelu", "relu"])
    assert calls == [(64, "relu")]
    calls.clear()
    interactive(lambda n: calls.append(n), n=(1, 9))  # no default: the middle of the range
    assert calls == [5]


def test_interactive_refuses_what_it_cannot_call():
    with pytest.raises(TypeError, match="function must be a function whose keyword arguments "
                                        "are the controls, got str"):
        interactive("plot", n=(1, 9))


def test_widgets_built_from_abbreviations():
    slider = _make_widget(ipywidgets, "temperature", (0.1, 5.0, 0.1), 1.0)
    assert isinstance(slider, ipywidgets.FloatSlider) and slider.value == 1.0
    assert slider.continuous_update is False and slider.style.description_width == "initial"
    assert isinstance(_make_widget(ipywidgets, "d", (2, 512, 2), 64), ipywidgets.IntSlider)
    menu = _make_widget(ipywidgets, "kind", ["a", "b"], "b")
    assert isinstance(menu, ipywidgets.Dropdown) and menu.value == "b"
    existing = ipywidgets.Checkbox()
    assert _make_widget(ipywidgets, "flag", existing) is existing


def test_setup_cell_sync(tmp_path):
    folder = tmp_path / "notebooks"
    folder.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("x = 1")]
    nbformat.write(nb, folder / "03_demo.ipynb")
    assert colab.sync([folder], check=True) == [
        f"{folder / '03_demo.ipynb'}: the first code cell must be the set-up cell (tagged 'setup')"]
    assert colab.sync([folder]) == [f"updated {folder / '03_demo.ipynb'}"]
    fixed = nbformat.read(folder / "03_demo.ipynb", as_version=4)
    assert fixed.cells[1].source == colab.SETUP_CELL and fixed.cells[2].source == "x = 1"
    assert colab.sync([folder], check=True) == []
    fixed.cells[1].source = fixed.cells[1].source.replace("your-account", "someone")
    nbformat.write(fixed, folder / "03_demo.ipynb")
    assert "differs" in colab.sync([folder], check=True)[0]


def _titled(title, *cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nWhat this is."),
                colab.setup_cell(), *cells]
    return nb


def test_publishing_puts_a_colab_link_under_every_title(tmp_path, monkeypatch):
    from course_lib.course import exercises

    url = "https://github.com/someone/attention-course"
    monkeypatch.setattr(colab, "REPO_URL", url)
    monkeypatch.setattr(colab, "SETUP_CELL", colab.setup_source(url))
    folders = [tmp_path / "notebooks", tmp_path / "notebooks" / "deeper", tmp_path / "solutions"]
    for folder in folders:
        folder.mkdir(parents=True)
    nbformat.write(_titled("01 demo"), folders[0] / "01_demo.ipynb")
    nbformat.write(_titled("01 deeper"), folders[1] / "01_deeper.ipynb")
    solution = _titled("01 exercises", nbformat.v4.new_code_cell(
        "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION"))
    nbformat.write(solution, folders[2] / "01_demo.ipynb")
    assert len(colab.sync(folders, check=True)) == 3  # set-up cells and links out of date
    colab.sync(folders)
    assert colab.sync(folders, check=True) == []
    nb = nbformat.read(folders[0] / "01_demo.ipynb", as_version=4)
    nb.cells[0].source = nb.cells[0].source.replace("someone", "somebody")
    nbformat.write(nb, folders[0] / "01_demo.ipynb")
    assert colab.sync(folders, check=True) == [
        f"{folders[0] / '01_demo.ipynb'}: its Open in Colab link differs from REPO_URL's"]
    colab.sync(folders)
    opens = "https://colab.research.google.com/github/someone/attention-course/blob/main/"
    for path, where in [(folders[0] / "01_demo.ipynb", "notebooks/01_demo.ipynb"),
                        (folders[1] / "01_deeper.ipynb", "notebooks/deeper/01_deeper.ipynb"),
                        (folders[2] / "01_demo.ipynb", "solutions/01_demo.ipynb")]:
        title = nbformat.read(path, as_version=4).cells[0].source
        assert title.splitlines()[:2] == [title.splitlines()[0], f"[Open in Colab]({opens}{where})"]
    exercise = exercises.make_exercise_notebook(folders[2] / "01_demo.ipynb")
    assert f"[Open in Colab]({opens}exercises/01_demo.ipynb)" in exercise.cells[0].source
    assert "solutions/" not in exercise.cells[0].source
    # the words of a lesson do not count the link
    assert prose_words(nbformat.read(folders[0] / "01_demo.ipynb", as_version=4)) == len(
        "# 01 demo What this is.".split())
    # back to the placeholder: the links go, and the titles are as they were
    monkeypatch.setattr(colab, "REPO_URL", colab.PLACEHOLDER_URL)
    monkeypatch.setattr(colab, "SETUP_CELL", colab.setup_source())
    assert len(colab.sync(folders, check=True)) == 3
    colab.sync(folders)
    assert colab.sync(folders, check=True) == []
    assert nbformat.read(folders[0] / "01_demo.ipynb", as_version=4).cells[0].source == (
        "# 01 demo\n\nWhat this is.")


def test_a_colab_link_needs_a_github_address():
    assert colab.colab_link("notebooks/x.ipynb") is None  # the placeholder
    assert colab.colab_link("notebooks/x.ipynb", "https://gitlab.com/a/b") is None
    assert colab.colab_link("notebooks/x.ipynb", "https://github.com/a/b.git") == (
        "[Open in Colab](https://colab.research.google.com/github/a/b/blob/main/notebooks/x.ipynb)")


def test_setup_cell_keeps_colabs_torch():
    assert "%pip install" in colab.SETUP_CELL and "torch" not in colab.SETUP_CELL.split("%pip")[1]
    assert colab.REPO_URL in colab.SETUP_CELL
    assert 'if "google.colab" in sys.modules:' in colab.SETUP_CELL


class _FakeIPython:
    """Records the magics a cell calls instead of running them (no pip, no matplotlib)."""

    def __init__(self):
        self.magics: list[tuple[str, str]] = []

    def run_line_magic(self, name, line, _stack_depth=1):
        self.magics.append((name, line))


def _run_setup_cell(source, monkeypatch, *, in_colab):
    """Execute the set-up cell's Python (magics translated as IPython does) with a fake shell."""
    from IPython.core.inputtransformer2 import TransformerManager

    if in_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    shell = _FakeIPython()
    namespace = {"get_ipython": lambda: shell}
    exec(compile(TransformerManager().transform_cell(source), "<setup cell>", "exec"), namespace)
    return shell.magics, namespace


# The placeholder URL in Colab (a copy of the repository is found, uploaded or asked for) is
# tested in tests/test_colab_copy.py.


def test_setup_cell_with_a_real_url_installs_course_lib_in_colab(monkeypatch, capsys):
    url = "https://github.com/someone/self-attention-course"
    magics, namespace = _run_setup_cell(colab.setup_source(url), monkeypatch, in_colab=True)
    # IPython expands {REPO_URL} from the cell's namespace when it runs the magic
    assert magics == [("pip", 'install --quiet "course_lib @ git+{REPO_URL}"'),
                      ("matplotlib", "inline")]
    assert namespace["REPO_URL"] == url
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("url", [colab.PLACEHOLDER_URL, "https://github.com/someone/course"])
def test_setup_cell_does_nothing_outside_colab(url, monkeypatch, capsys):
    magics, _ = _run_setup_cell(colab.setup_source(url), monkeypatch, in_colab=False)
    assert magics == [("matplotlib", "inline")] and capsys.readouterr().out == ""
