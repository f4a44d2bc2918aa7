"""The learner's path in a real browser: JupyterLab in headless Chromium runs every lecture
notebook with Run > Run All Cells, and we check what a learner would see.

For each notebook: no cell ends in an error (read back from the saved copy), at least one figure
is drawn, and the notebook's widgets appear. Screenshots go to artifacts/screenshots/ (ignored
by git). JupyterLab serves a temporary copy of notebooks/ with the stored outputs cleared, so every figure
and widget seen was produced in the browser, and the repository is never modified.

Needs Debian's ``chromium`` package and the ``playwright`` Python package (never
``playwright install``); skipped when either is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parent.parent
LECTURES = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
CONTROLS = ("interactive(", "ipywidgets", "head_view(")  # a widget a learner operates


def _has_controls(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    return any(word in c.source for c in nb.cells if c.cell_type == "code" for word in CONTROLS)


# nbval already runs every cell of every lecture; the browser adds what only a front end shows
# (figures, widgets that answer a learner), so it runs the lectures that have such widgets.
# A lecture without them (09: a live loss plot and progress bars) costs minutes of training to
# show what the small notebook of test_live_outputs_update_in_jupyterlab shows in seconds.
INTERACTIVE = [p for p in LECTURES if _has_controls(p)]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
# Limits generous enough for a machine busy with other work: they only stop a hung run.
RUN_TIMEOUT_S = 900  # per notebook; the slowest lecture takes about 100 s on a quiet 2-core CPU
WAIT_S = 180  # for the server to start, a kernel to go idle, a figure to be redrawn, a save

sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is needed")
if not Path(CHROMIUM).exists():
    pytest.skip("Chromium is not installed (Debian package 'chromium')", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_settings(settings_dir: Path) -> None:
    """Render every cell (no virtual scrolling) and keep the news pop-up away."""
    for plugin, values in {
        "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification": {
            "fetchNews": "false", "checkForUpdates": False,
        },
    }.items():
        path = settings_dir / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    work = tmp_path_factory.mktemp("lab")
    root_dir = work / "course"
    shutil.copytree(ROOT / "notebooks", root_dir)
    for path in root_dir.glob("*.ipynb"):  # start from blank notebooks, as after "Clear"
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        nb.metadata.pop("widgets", None)
        nbformat.write(nb, path)
    _write_settings(work / "settings")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["JUPYTER_CONFIG_DIR"] = str(work / "config")
    env.pop("MPLBACKEND", None)
    log = open(work / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
         f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root_dir}", f"--LabApp.user_settings_dir={work / 'settings'}",
         f"--LabApp.workspaces_dir={work / 'workspaces'}"],
        cwd=root_dir, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + WAIT_S
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start; see {work / 'jupyterlab.log'}")
            time.sleep(0.5)
    try:
        yield {"base": base, "token": token, "root": root_dir}
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _wait_for_idle(page, timeout_s: float) -> None:
    """Wait until the kernel status in the status bar reads Idle."""
    page.wait_for_function(
        """() => {
            const bar = document.querySelector('#jp-main-statusbar');
            return bar !== null && /\\|\\s*Idle/.test(bar.textContent);
        }""",
        timeout=timeout_s * 1000,
    )


def _run_all(page) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()


def _all_cells_done(page, n_code_cells: int) -> bool:
    return page.evaluate(
        """(n) => {
            const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')];
            const done = prompts.filter(p => /\\[\\d+\\]/.test(p.textContent)).length;
            const busy = prompts.some(p => p.textContent.includes('[*]'));
            return !busy && done >= n;
        }""",
        n_code_cells,
    )


def _first_image(box) -> str:
    images = box.locator("img")
    return images.first.get_attribute("src") if images.count() else ""


def _change_first_control(page, box) -> str:
    """Give the first control of an ``interactive`` box a new value, as a learner would: pick
    another option of a drop-down, or type the other end of a slider's range into its readout.
    Returns what was changed, for messages."""
    select = box.locator("select")
    if select.count():
        options = select.first.locator("option")
        current = select.first.evaluate("s => s.selectedIndex")
        select.first.select_option(index=(current + 1) % options.count())
        return "drop-down"
    handle = box.locator(".noUi-handle").first
    low, high, now = (float(handle.get_attribute(a))
                      for a in ("aria-valuemin", "aria-valuemax", "aria-valuenow"))
    target = low if now != low else high
    readout = box.locator(".widget-readout").first
    readout.click()
    page.keyboard.press("Control+a")
    page.keyboard.type(f"{target:g}")
    page.keyboard.press("Enter")
    return f"slider to {target:g}"


def _widget_redraws(page) -> None:
    """Change the first widget's first control and wait for its figure to be redrawn."""
    box = page.locator(".jp-OutputArea-output .widget-interact").first
    box.scroll_into_view_if_needed()
    before = _first_image(box)
    what = _change_first_control(page, box)
    deadline = time.time() + WAIT_S
    while _first_image(box) in ("", before):
        if time.time() > deadline:
            pytest.fail(f"changing the first widget's {what} did not redraw its figure")
        time.sleep(0.5)


def _wait_for_redraw(box, before: str, what: str) -> str:
    deadline = time.time() + WAIT_S
    while _first_image(box) in ("", before):
        if time.time() > deadline:
            pytest.fail(f"{what} did not redraw the figure")
        time.sleep(0.5)
    return _first_image(box)


def _text_widget_responds(page, stem: str) -> None:
    """A widget with a text box (the head view): step each slider with the keyboard, then type a
    new sentence; each change must redraw the figure."""
    box = page.locator(".jp-OutputArea-output .widget-interact",
                       has=page.locator("input[type='text']")).first
    box.scroll_into_view_if_needed()
    src = _first_image(box)
    handles = box.locator(".noUi-handle")
    for i in range(handles.count()):
        handle = handles.nth(i)
        at_end = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
        handle.focus()
        page.keyboard.press("ArrowLeft" if at_end else "ArrowRight")
        src = _wait_for_redraw(box, src, f"slider {i} of the text widget")
    text = box.locator("input[type='text']").first
    text.fill("Dogs bark at the mailman every morning.")
    text.press("Enter")
    _wait_for_redraw(box, src, "typing a sentence")
    box.screenshot(path=str(SCREENSHOTS / f"{stem}-text-widget-changed.png"))


def _rendered(page, has_widget: bool) -> tuple[int, int]:
    """The number of figures and widgets on the page, once the last outputs have rendered
    (waits up to WAIT_S for at least one figure, and one widget where the notebook has any)."""
    deadline = time.time() + WAIT_S
    while True:
        images = page.locator(".jp-OutputArea-output img").count()
        widgets = page.locator(".jp-OutputArea-output .widget-interact, "
                               ".jp-OutputArea-output .jupyter-widgets").count()
        if (images and (widgets or not has_widget)) or time.time() > deadline:
            return images, widgets
        time.sleep(0.5)


def _save(page, path: Path) -> nbformat.NotebookNode:
    """Save the notebook (Ctrl+S) and read it back once the file on disk has changed."""
    before = path.stat().st_mtime_ns
    page.keyboard.press("Control+s")
    deadline = time.time() + WAIT_S
    while path.stat().st_mtime_ns == before:
        if time.time() > deadline:
            pytest.fail(f"{path.name}: JupyterLab did not save the notebook in {WAIT_S} s")
        time.sleep(0.5)
    while True:  # the server may still be writing it
        try:
            return nbformat.read(path, as_version=4)
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.5)


def _shut_down_kernels(lab) -> None:
    """Stop the kernels of the notebooks already tested: an idle kernel still costs CPU time
    (its heartbeat and widget traffic), which the next notebook's kernel needs."""
    api = f"{lab['base']}/api/sessions"
    with urllib.request.urlopen(f"{api}?token={lab['token']}", timeout=WAIT_S) as response:
        sessions = json.load(response)
    for session in sessions:
        request = urllib.request.Request(f"{api}/{session['id']}?token={lab['token']}",
                                         method="DELETE")
        urllib.request.urlopen(request, timeout=WAIT_S).close()


def _open_and_run_all(page, lab, path: Path, n_code: int) -> None:
    """Open the notebook in a fresh JupyterLab workspace, Run All Cells, wait until done."""
    # A workspace of its own per notebook: otherwise JupyterLab restores the tabs of the
    # previous test, and selectors would find cells in a hidden notebook.
    page.goto(f"{lab['base']}/lab/workspaces/{path.stem}/tree/{path.name}"
              f"?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=WAIT_S * 1000)
    _wait_for_idle(page, WAIT_S)
    page.keyboard.press("Control+b")  # hide the file browser: more notebook on screenshots
    _run_all(page)
    deadline = time.time() + RUN_TIMEOUT_S
    while not _all_cells_done(page, n_code):
        if time.time() > deadline:
            pytest.fail(f"{path.name}: cells still running after {RUN_TIMEOUT_S} s")
        time.sleep(1)
    _wait_for_idle(page, WAIT_S)


def _errors_and_not_run(saved: nbformat.NotebookNode) -> tuple[list[str], list[int]]:
    errors = [
        f"cell {i}: {o.get('ename')}: {o.get('evalue')}"
        for i, c in enumerate(saved.cells) if c.cell_type == "code"
        for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    not_run = [i for i, c in enumerate(saved.cells)
               if c.cell_type == "code" and c.source.strip() and not c.execution_count]
    return errors, not_run


@pytest.mark.parametrize("path", INTERACTIVE, ids=[p.stem for p in INTERACTIVE])
def test_lecture_runs_in_jupyterlab(lab, browser, path):
    nb = nbformat.read(path, as_version=4)
    # the folded set-up cell shows no input prompt: count the cells whose prompts are on screen
    # (that the set-up cell ran too is checked on the saved notebook below)
    n_code = sum(1 for c in nb.cells if c.cell_type == "code" and c.source.strip()
                 and not c.metadata.get("jupyter", {}).get("source_hidden"))
    has_widget = _has_controls(path)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_and_run_all(page, lab, path, n_code)
        images, widgets = _rendered(page, has_widget)

        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / f"{path.stem}.png"))
        if widgets:
            page.locator(".jp-OutputArea-output .jupyter-widgets").first.scroll_into_view_if_needed()
            page.screenshot(path=str(SCREENSHOTS / f"{path.stem}-widget.png"))
        if page.locator(".jp-OutputArea-output .widget-interact img").count():
            _widget_redraws(page)
            page.screenshot(path=str(SCREENSHOTS / f"{path.stem}-widget-changed.png"))
        if page.locator(".jp-OutputArea-output .widget-interact input[type='text']").count():
            _text_widget_responds(page, path.stem)

        # a widget's text box keeps key presses to itself: leave it before saving
        page.evaluate("() => document.activeElement && document.activeElement.blur()")
        saved = _save(page, lab["root"] / path.name)
    finally:
        page.close()
        _shut_down_kernels(lab)

    errors, not_run = _errors_and_not_run(saved)
    assert errors == [], f"{path.name} produced errors in the browser: {errors}"
    assert not_run == [], f"{path.name}: cells {not_run} did not run"
    assert images >= 1, f"{path.name}: no figure was rendered"
    if has_widget:
        assert widgets >= 1, f"{path.name}: its widgets did not render"


LIVE_CELLS = [
    "%matplotlib inline\n"
    "import torch\n"
    "from course_lib import DecoderConfig, DecoderLM, seed_everything\n"
    "from course_lib.train import TrainConfig, lm_batches, train\n"
    "from course_lib.instruments.viz import LivePlot",
    "seed_everything(0)\n"
    "model = DecoderLM(DecoderConfig(vocab_size=16, d_model=16, n_heads=2, n_layers=1, max_len=16))\n"
    "batches = lm_batches(torch.randint(0, 16, (2000,)), 4, 16,\n"
    "                     generator=torch.Generator().manual_seed(0))\n"
    "live, steps, losses = LivePlot(ylim=(0, 4)), [], []\n"
    "\n"
    "def on_eval(step, history):\n"
    "    steps.append(step)\n"
    "    losses.append(history.val_losses[-1])\n"
    "    live.update(steps, {'validation': losses})\n"
    "\n"
    "run = TrainConfig(max_iters=60, warmup_iters=5, eval_interval=10, eval_iters=1)\n"
    "history = train(model, batches, run, val_batches=batches, callback=on_eval, desc='live')\n"
    "print('evaluations drawn:', len(steps))",
]


def test_live_outputs_update_in_jupyterlab(lab, browser):
    """What chapter 09's training cells show, in seconds: course_lib's train() with a progress
    bar and a LivePlot redrawn after every evaluation, in place (one figure, not one per
    redraw), and the bar at its end."""
    path = lab["root"] / "live_outputs.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in LIVE_CELLS]
    nb.metadata["kernelspec"] = nbformat.read(LECTURES[0], as_version=4).metadata["kernelspec"]
    nbformat.write(nb, path)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        _open_and_run_all(page, lab, path, len(LIVE_CELLS))
        images, widgets = _rendered(page, has_widget=True)
        cell = page.locator(".jp-CodeCell").nth(1)
        figures = cell.locator(".jp-OutputArea-output img").count()
        bar_text = cell.locator(".jp-OutputArea-output .jupyter-widgets").first.inner_text()
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / "live_outputs.png"))
        saved = _save(page, path)
    finally:
        page.close()
        _shut_down_kernels(lab)
    errors, not_run = _errors_and_not_run(saved)
    assert errors == [] and not_run == [], (errors, not_run)
    assert figures == 1, f"the live plot should be redrawn in place, found {figures} figures"
    assert "60/60" in bar_text, f"the progress bar did not reach its end: {bar_text!r}"
    text = "".join(o.get("text", "") for o in saved.cells[1].outputs)
    assert "evaluations drawn: 7" in text  # before the first update, every 10, and at the end
