"""Plotting and widget helpers shared by the notebooks.

Shape legend: T query length, S key length.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import matplotlib.pyplot as plt
import torch

from .._validate import require_callable, require_int, require_positive_int


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
    require_callable("function", function, "a function whose keyword arguments are the controls")
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


# --------------------------------------------------------------------------------------------
# The head view: one attention head of a real model, on a sentence the learner types.
# Plain matplotlib inside standard ipywidgets, so it works offline in JupyterLab, Notebook and
# Colab (no JavaScript library to fetch, nothing a front end may block).

AttentionFn = Callable[[str], tuple[Any, Sequence[str]]]


def _attention_stack(attentions: Any, tokens: Sequence[str]) -> torch.Tensor:
    """Every layer's weights for one sequence as one (L, H, n, n) tensor on the CPU.

    Accepts an (L, H, n, n) tensor or a sequence of L tensors of (H, n, n) or (1, H, T, T)
    (a model's ``attentions`` for a batch of one; padding beyond the n tokens is cut off).
    """
    layers = list(attentions) if not isinstance(attentions, torch.Tensor) else [*attentions]
    if not layers:
        raise ValueError("attentions is empty: the model returned no attention weights")
    n = len(tokens)
    stacked = []
    for i, w in enumerate(layers):
        w = torch.as_tensor(w).detach().float().cpu()
        if w.dim() == 4 and w.shape[0] != 1:
            raise ValueError(
                f"attentions[{i}] has shape {tuple(w.shape)}: a batch of {w.shape[0]} "
                "sequences, but one sequence is drawn. Pick it first, e.g. "
                "[a[b:b + 1] for a in out.attentions] with tokens out.tokens[b]"
            )
        if w.dim() == 4:
            w = w[0]  # (H, T, T): the only sequence of the batch
        if w.dim() != 3 or w.shape[-1] < n or w.shape[-2] < n:
            raise ValueError(
                f"attentions[{i}] has shape {tuple(w.shape)}, expected (H, n, n) or "
                f"(1, H, T, T) with n = {n} tokens"
            )
        stacked.append(w[:, :n, :n])
    return torch.stack(stacked)  # (L, H, n, n)


def _encoder_fn(model: Any) -> AttentionFn:
    """A function sentence -> (attentions, tokens) for a model with ``.encode`` (such as
    course_lib.instruments.bert_app's PretrainedEncoder) or for such a function itself."""
    if hasattr(model, "encode"):
        def attend(sentence: str) -> tuple[Any, Sequence[str]]:
            out = model.encode(sentence, output_attentions=True, output_hidden_states=False)
            return out.attentions, out.tokens[0]
        return attend
    if callable(model):
        return model
    raise TypeError(
        f"model must have an .encode(sentence) method (e.g. load_pretrained_encoder()) or be a "
        f"function sentence -> (attentions, tokens), got {type(model).__name__}"
    )


def _check_index(name: str, value: object, size: int) -> int:
    """A layer or head index in -size..size-1 (negative counts from the end), as 0..size-1."""
    value = require_int(name, value)
    if not -size <= value < size:
        raise ValueError(f"{name} must be an integer in 0..{size - 1}, got {value!r}")
    return value % size


def plot_head(
    attentions: Any,
    tokens: Sequence[str],
    layer: int,
    head: int,
    *,
    ax: plt.Axes | None = None,
) -> plt.Axes:
    """Draw one head's attention over a sentence, its tokens on both axes.

    Args:
        attentions: (L, H, n, n), or L tensors of (H, n, n) or (1, H, T, T).
        tokens: the n token strings.
        layer, head: which one to draw.
        ax: draw into this axes (a new figure otherwise).

    Returns:
        The axes (row = query token, column = key token).
    """
    stack = _attention_stack(attentions, tokens)  # (L, H, n, n)
    layer = _check_index("layer", layer, stack.shape[0])
    head = _check_index("head", head, stack.shape[1])
    n = len(tokens)
    if ax is None:
        size = min(9.0, 2.0 + 0.42 * n)
        _, ax = plt.subplots(figsize=(size + 1.0, size))
    plot_attention(stack[layer, head], tokens, tokens, ax=ax, vmin=0.0, vmax=1.0,
                   annotate=n <= 10, title=f"layer {layer}, head {head}")
    return ax


def plot_layer_heads(
    attentions: Any, tokens: Sequence[str], layer: int, *, columns: int = 6
) -> plt.Figure:
    """All heads of one layer side by side (small multiples, tokens on both axes of the
    first column and the last row)."""
    columns = require_positive_int("columns", columns)
    stack = _attention_stack(attentions, tokens)  # (L, H, n, n)
    n_heads, n = stack.shape[1], len(tokens)
    layer = _check_index("layer", layer, stack.shape[0])
    rows = -(-n_heads // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.1 * columns, 2.1 * rows + 0.4),
                             squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= n_heads:
            ax.axis("off")
            continue
        ax.imshow(stack[layer, h].numpy(), cmap="Blues", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(n), labels=tokens if h // columns == rows - 1 else [""] * n,
                      rotation=90, fontsize=6)
        ax.set_yticks(range(n), labels=tokens if h % columns == 0 else [""] * n, fontsize=6)
    fig.suptitle(f"layer {layer}: every head (row = query, column = key)")
    fig.tight_layout()
    return fig


def head_view_widget(
    model: Any, sentence: str = "The cat sat on the mat because it was tired.", *,
    layer: int = 0, head: int = 0,
) -> Any:
    """Build (without showing) the interactive head view; see :func:`head_view`.

    Returns:
        An ``ipywidgets.interactive`` whose children are the sentence box, the layer and head
        sliders and the output; its ``.result`` is the (n, n) matrix last drawn.

    Raises:
        ValueError: ``layer`` or ``head`` outside the model's range (negative values count
            from the end).
    """
    import ipywidgets

    encoder_fn = _encoder_fn(model)
    require_int("layer", layer)  # their range is checked once the model has run
    require_int("head", head)
    attend = lru_cache(maxsize=8)(lambda text: _as_stack(encoder_fn, text))
    stack, _ = attend(sentence)
    n_layers, n_heads = stack.shape[:2]
    layer = _check_index("layer", layer, n_layers)  # the sliders start in range
    head = _check_index("head", head, n_heads)

    def show(sentence: str, layer: int, head: int) -> torch.Tensor:
        weights, tokens = attend(sentence)
        plot_head(weights, tokens, layer, head)
        plt.show()
        return weights[layer, head]  # (n, n)

    style = {"description_width": "initial"}
    return ipywidgets.interactive(
        show,
        sentence=ipywidgets.Text(value=sentence, description="sentence (Enter to update)",
                                 continuous_update=False, style=style,
                                 layout=ipywidgets.Layout(width="95%")),
        layer=ipywidgets.IntSlider(value=layer, min=0, max=n_layers - 1, description="layer",
                                   continuous_update=False, style=style),
        head=ipywidgets.IntSlider(value=head, min=0, max=n_heads - 1, description="head",
                                  continuous_update=False, style=style),
    )


def _as_stack(attend: AttentionFn, sentence: str) -> tuple[torch.Tensor, list[str]]:
    if not isinstance(sentence, str):
        raise TypeError(f"sentence must be a string, got {type(sentence).__name__}")
    attentions, tokens = attend(sentence)
    tokens = list(tokens)
    return _attention_stack(attentions, tokens), tokens


def head_view(
    model: Any, sentence: str = "The cat sat on the mat because it was tired.", *,
    layer: int = 0, head: int = 0,
) -> None:
    """An interactive view of one attention head of a real model: type a sentence (press
    Enter), pick the layer and the head; the heatmap shows every query token's weights over
    the key tokens.

    Args:
        model: anything with ``.encode(sentence)`` returning ``.attentions`` and ``.tokens``
            (e.g. ``load_pretrained_encoder()``), or a function sentence ->
            (attentions, tokens).
        sentence: the first sentence shown.
        layer, head: the first layer and head shown.

    Without a live front end (or without ipywidgets) it draws the first view once.

    Raises:
        ValueError: ``layer`` or ``head`` outside the model's range (negative values count
            from the end).
    """
    encoder_fn = _encoder_fn(model)
    require_int("layer", layer)  # their range is checked once the model has run
    require_int("head", head)
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        stack, tokens = _as_stack(encoder_fn, sentence)
        plot_head(stack, tokens, layer, head)  # checks layer and head
        plt.show()
        return
    display(head_view_widget(model, sentence, layer=layer, head=head))  # checks them too


# --------------------------------------------------------------------------------------------
# Loss curves


def draw_losses(
    ax: Any,
    steps: Sequence[int],
    curves: dict[str, Sequence[float]],
    baselines: dict[str, float] | None = None,
    *,
    best: tuple[int, float] | None = None,
) -> None:
    """Draw loss curves against the update number, with dashed baseline levels.

    Args:
        ax: the matplotlib Axes to draw on.
        steps: the update number of each evaluation.
        curves: name -> losses, one per evaluation so far (a curve may be shorter than
            ``steps`` while training runs).
        baselines: name -> loss level, drawn as labelled dashed lines (e.g. the bigram
            cross-entropy).
        best: (step, loss) of the kept checkpoint, marked with a star.
    """
    if not isinstance(curves, dict):
        raise TypeError(f"curves must be a dict of name -> losses, got {type(curves).__name__}")
    for name, values in curves.items():
        ax.plot(list(steps)[: len(values)], list(values), marker="o", markersize=3, label=name)
    shades = ["0.6", "0.45", "0.3", "0.15"]
    for i, (name, value) in enumerate((baselines or {}).items()):
        color = shades[i % len(shades)]
        ax.axhline(value, ls="--", lw=1, color=color)
        ax.text(0, value, f" {name}", va="bottom", fontsize=8, color=color)
    if best is not None:
        ax.plot(*best, marker="*", markersize=14, color="gold", markeredgecolor="black",
                label="best checkpoint", ls="none")
    ax.set_xlabel("update")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(loc="upper right")


class LivePlot:
    """A loss plot redrawn in place while a notebook cell is still running.

    Create it before training and call :meth:`update` from the training loop (e.g. from
    ``course_lib.train.train``'s ``callback``). Outside a notebook, the figure is simply kept
    up to date and nothing is shown.

    Args:
        baselines: name -> loss level drawn as dashed lines (see :func:`draw_losses`).
        ylim: (bottom, top) of the loss axis, fixed so the redraws do not jump.
        figsize: the figure size in inches.
    """

    def __init__(self, baselines: dict[str, float] | None = None,
                 ylim: tuple[float, float] | None = None,
                 figsize: tuple[float, float] = (7, 4)) -> None:
        self.fig, self.ax = plt.subplots(figsize=figsize)
        self.baselines, self.ylim = baselines, ylim
        try:
            from IPython.display import display

            self.handle = display(self.fig, display_id=True)
        except ImportError:  # no IPython: keep the figure only
            self.handle = None
        plt.close(self.fig)  # shown through the display handle only

    def update(self, steps: Sequence[int], curves: dict[str, Sequence[float]],
               best: tuple[int, float] | None = None) -> None:
        """Redraw with the curves so far (arguments as for :func:`draw_losses`)."""
        self.ax.clear()
        draw_losses(self.ax, steps, curves, self.baselines, best=best)
        if self.ylim is not None:
            self.ax.set_ylim(*self.ylim)
        if self.handle is not None:
            self.handle.update(self.fig)
