"""Plotting and widget helpers shared by the notebooks.

Shape legend: T query length, S key length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import matplotlib.pyplot as plt
import torch


def use_course_style() -> None:
    """Set the course's matplotlib defaults and make inline figures reproducible.

    Inline PNGs normally embed the matplotlib version; dropping that metadata keeps a saved
    notebook byte-identical across re-runs with the same seed.
    """
    plt.rcParams.update({
        "figure.figsize": (6.0, 4.0),
        "figure.dpi": 90,
        "axes.grid": False,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "font.size": 10,
    })
    try:
        from IPython import get_ipython
    except ImportError:  # plain Python: nothing more to configure
        return
    shell = get_ipython()
    if shell is None or not hasattr(shell, "kernel"):  # not inside a Jupyter kernel
        return
    try:
        import matplotlib_inline.backend_inline as inline

        inline.InlineBackend.instance(parent=shell).print_figure_kwargs = {
            "bbox_inches": "tight", "metadata": {"Software": None},
        }
    except Exception:  # another front end or backend: the defaults are fine
        pass


def _as_matrix(weights: Any, name: str) -> torch.Tensor:
    matrix = torch.as_tensor(weights).detach().float().cpu()
    if matrix.dim() != 2:
        raise ValueError(
            f"{name} should be a 2-D matrix (T, S), got shape {tuple(matrix.shape)}; pick one "
            "example and one head first, e.g. weights[0, head]"
        )
    return matrix


def plot_attention(
    weights: Any,
    queries: Sequence[str] | None = None,
    keys: Sequence[str] | None = None,
    *,
    ax: plt.Axes | None = None,
    title: str | None = None,
    annotate: bool | None = None,
    cmap: str = "Blues",
    vmin: float | None = 0.0,
    vmax: float | None = None,
    colorbar: bool = True,
) -> plt.Axes:
    """Draw a (T, S) attention matrix: row t is query t's distribution over the keys.

    Args:
        weights: (T, S) tensor or array.
        queries, keys: token labels for the rows and columns.
        ax: draw into this axes (a new figure otherwise).
        title: the axes title.
        annotate: write each value in its cell (default: when the matrix is at most 12 x 12).
        cmap, vmin, vmax: colour map and range (vmin=None lets matplotlib choose, e.g. for
            scores that can be negative).
        colorbar: add a colour bar.

    Returns:
        The matplotlib axes.
    """
    matrix = _as_matrix(weights, "weights")
    n_rows, n_cols = matrix.shape
    for labels, size, what in ((queries, n_rows, "queries"), (keys, n_cols, "keys")):
        if labels is not None and len(labels) != size:
            raise ValueError(f"{what} has {len(labels)} labels but the matrix has {size} "
                             f"{'rows' if what == 'queries' else 'columns'}")
    if ax is None:
        _, ax = plt.subplots(figsize=(1.0 + 0.45 * n_cols, 0.8 + 0.4 * n_rows))
    finite = matrix[torch.isfinite(matrix)]
    image = ax.imshow(matrix.numpy(), cmap=cmap, vmin=vmin,
                      vmax=vmax if vmax is not None else (float(finite.max()) if finite.numel()
                                                          else None))
    ax.set_xticks(range(n_cols), labels=list(keys) if keys is not None else range(n_cols),
                  rotation=60 if keys is not None else 0, ha="right" if keys is not None else
                  "center")
    ax.set_yticks(range(n_rows), labels=list(queries) if queries is not None else range(n_rows))
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    if title:
        ax.set_title(title)
    if annotate is None:
        annotate = n_rows <= 12 and n_cols <= 12
    if annotate:
        # white text on the darker cells: 60% of the way up the colour scale actually used
        top = vmax if vmax is not None else (float(finite.max()) if finite.numel() else 0.0)
        bottom = vmin if vmin is not None else (float(finite.min()) if finite.numel() else 0.0)
        threshold = bottom + 0.6 * (top - bottom)
        for t in range(n_rows):
            for s in range(n_cols):
                value = float(matrix[t, s])
                text = "-inf" if value == float("-inf") else f"{value:.2f}"
                ax.text(s, t, text, ha="center", va="center", fontsize=7,
                        color="white" if value > threshold else "black")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    return ax


def interactive(function: Callable[..., Any], **controls: Any) -> None:
    """Show ``function`` with ipywidgets controls, or call it once if widgets are unavailable.

    The widgets only work with a live front end (JupyterLab, Notebook, Colab). Elsewhere --
    a plain Python run, or ipywidgets not installed -- the function is called once with each
    control's starting value so the cell still shows its output.

    Args:
        function: a plain function whose keyword arguments match ``controls``.
        controls: ipywidgets controls, or abbreviations: ``(min, max)`` or ``(min, max, step)``
            for a slider (integer if all are ints), a list of options for a drop-down. Each
            control starts at the function's default for that argument (else the middle).

    Nothing is returned, so the widget is shown once even when this is a cell's last line.
    """
    try:
        import ipywidgets
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        ipywidgets = None
    defaults = {
        name: p.default for name, p in inspect.signature(function).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    if ipywidgets is None or get_ipython() is None:
        function(**{name: defaults.get(name, _initial_value(c)) for name, c in controls.items()})
        return
    widgets = {name: _make_widget(ipywidgets, name, c, defaults.get(name))
               for name, c in controls.items()}
    display(ipywidgets.interactive(function, **widgets))


def _make_widget(ipywidgets: Any, name: str, control: Any, default: Any = None) -> Any:
    """Turn an abbreviation into a widget whose label is shown in full and which updates when
    the slider is released (so a slow plot does not redraw at every pixel of a drag)."""
    style = {"description_width": "initial"}
    if isinstance(control, ipywidgets.Widget):
        return control
    if isinstance(control, tuple) and 2 <= len(control) <= 3 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in control
    ):
        low, high = control[0], control[1]
        value = default if default is not None and low <= default <= high else (
            _initial_value(control))
        if all(isinstance(v, int) for v in control):
            step = control[2] if len(control) == 3 else 1
            return ipywidgets.IntSlider(value=value, min=low, max=high, step=step,
                                        description=name, style=style,
                                        continuous_update=False)
        step = control[2] if len(control) == 3 else (high - low) / 100
        return ipywidgets.FloatSlider(value=value, min=low, max=high, step=step,
                                      description=name, style=style, continuous_update=False)
    if isinstance(control, (list, tuple)) and control:
        value = default if default in control else control[0]
        return ipywidgets.Dropdown(options=list(control), value=value, description=name,
                                   style=style)
    return control


def _initial_value(control: Any) -> Any:
    """The value a widget would start at, for the no-widget fallback."""
    if hasattr(control, "value"):
        return control.value
    if isinstance(control, tuple) and len(control) >= 2:
        low, high = control[0], control[1]
        mid = (low + high) / 2
        return int(mid) if all(isinstance(v, int) for v in control) else mid
    if isinstance(control, (list, tuple)) and control:
        return control[0]
    return control
