"""Probes: measure which inputs (and which attention heads) a model's outputs depend on.

The question that matters for a language model is whether the output at position i depends
on an input at a later position j > i: a *future leak*. During training every position is
computed at once and the target of position i is the input at i + 1, so a model that can see
the future only has to copy it. The probes here do not read a model's code or its masks; they
change one input position at a time and watch which outputs move, so they catch a leak
wherever it comes from (a wrong mask, an unmasked layer, a layer that mixes positions).

The same idea works inside a layer: switch one attention head off and measure what the model
can no longer do (:func:`ablate_heads`).

Shape legend: B batch, T sequence length, D feature size (d_model), H heads, Dh = D / H.

Functions:
    influence        (B, T, T): how much output i moves when input j is replaced
    who_sees_whom    (T, T) bool (or (B, T, T)): output i changes when input j changes
    future_leaks     a :class:`LeakReport` summarising who_sees_whom for a causal check
    ablate_heads     a ``with`` block in which chosen heads of a MultiHeadAttention are zeroed
    layer_grad_norms (L,): the gradient norm of each layer of a stack after backward()
    head_role_scores how strongly each head of a trained encoder plays a known role (previous
                     token, next token, [CLS], [SEP], same word), averaged over sentences
    previous_token_score (...,): a causal head's mean weight on the token just before
    induction_score  (...,): on a repeated segment, the mean weight on the token after the
                     earlier copy of the current token (chapter 11)
    ablate_head_path a ``with`` block in which one head's output is removed from what a later
                     layer reads as keys (or queries, or values) only
    logit_lens       (L + 1, B, T, V): what a decoder would predict if it stopped after each layer
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import (
    require_bool,
    require_callable,
    require_finite,
    require_int,
    require_non_negative_number,
    require_positive_int,
    require_tensor,
    shape_of,
)
from ..attention import MultiHeadAttention
from ._checks import require_deterministic

Probed = Callable[[torch.Tensor], torch.Tensor]

__all__ = ["HEAD_ROLES", "STOP_WORDS", "HeadRoles", "LeakReport", "ablate_heads", "future_leaks",
           "ablate_head_path", "head_role_scores", "induction_score", "influence",
           "layer_grad_norms", "logit_lens", "previous_token_score", "who_sees_whom"]


def _check_inputs(fn: object, x: object, vocab_size: int | None, n_trials: int,
                  seed: int) -> bool:
    """Validate the probe's arguments; return True when x holds token ids."""
    require_callable("fn", fn, "a function of x returning per-position outputs",
                     "e.g. lambda ids: model(ids).logits")
    x = require_tensor("x", x)
    if x.dim() < 2:
        raise ValueError(
            f"x should have shape (B, T) of token ids or (B, T, D) of vectors, but got a "
            f"{x.dim()}-D tensor of shape {shape_of(x)}; for one sequence use x[None]"
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"x has shape {shape_of(x)}: it needs at least one example and one "
                         "position")
    require_positive_int("n_trials", n_trials)
    require_int("seed", seed)
    if x.dtype == torch.bool:
        raise ValueError("x has dtype torch.bool; pass token ids (integers) or float vectors")
    is_ids = not torch.is_floating_point(x) and not torch.is_complex(x)
    if is_ids:
        _check_ids(x, vocab_size)
    else:
        require_finite("x", x, "the probe compares outputs before and after a change, and "
                       "NaN compares unequal to everything, so it could conclude nothing")
    return is_ids


def _check_ids(x: torch.Tensor, vocab_size: int | None) -> None:
    if x.dim() != 2:
        raise ValueError(
            f"x holds integers, so it should be (B, T) token ids, but has shape {shape_of(x)}"
        )
    if vocab_size is None:
        raise ValueError(
            "x holds token ids, so vocab_size is needed to pick replacement tokens "
            "(e.g. vocab_size=model.config.vocab_size)"
        )
    require_positive_int("vocab_size", vocab_size)
    if vocab_size < 2:
        raise ValueError(
            f"vocab_size must be >= 2 so that a token can be replaced by a different one, "
            f"got {vocab_size}"
        )
    if int(x.min()) < 0 or int(x.max()) >= vocab_size:
        raise ValueError(
            f"x holds ids from {int(x.min())} to {int(x.max())}, outside 0..{vocab_size - 1} "
            f"(vocab_size={vocab_size})"
        )


def _check_tolerances(atol: float, rtol: float) -> None:
    require_non_negative_number("atol", atol)
    require_non_negative_number("rtol", rtol)


def _run(fn: Probed, x: torch.Tensor) -> torch.Tensor:
    """fn(x) as (B, T, F) float64 on the CPU (MPS has no float64), after checking that fn
    returned a (B, T, ...) tensor for a (B, T, ...) input."""
    out = fn(x)
    if not isinstance(out, torch.Tensor):
        kind = type(out).__name__
        hint = ""
        if isinstance(out, tuple):
            hint = " (for MultiHeadAttention use lambda x: attention(x)[0])"
        elif hasattr(out, "logits"):
            hint = " (for a language model such as DecoderLM use lambda ids: model(ids).logits)"
        elif hasattr(out, "last_hidden_state"):
            hint = " (for an Encoder use lambda ids: model(ids).last_hidden_state)"
        raise ValueError(f"fn must return a tensor of shape (B, T, ...), got a {kind}{hint}")
    if out.dim() < 2 or tuple(out.shape[:2]) != tuple(x.shape[:2]):
        raise ValueError(
            f"fn returned shape {shape_of(out)} for an input of shape {shape_of(x)}; it must "
            f"return one output per position, shape (B, T, ...) = {tuple(x.shape[:2])} + (...)"
        )
    if out.numel() == 0:
        raise ValueError(f"fn returned shape {shape_of(out)}, with no values: there is no output "
                         "to watch, so nothing could be measured")
    return out.detach().reshape(x.shape[0], x.shape[1], -1).cpu().double()  # (B, T, F)


def _require_finite_output(base: torch.Tensor) -> None:
    """Refuse to probe a model whose output for the unchanged input holds NaN or inf."""
    bad = ~torch.isfinite(base).all(-1)  # (B, T)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0, 0])
        positions = torch.nonzero(bad[b]).flatten().tolist()
        raise ValueError(
            f"fn's output contains NaN or inf for the unperturbed input x (example {b}, "
            f"positions {positions}); the probe compares outputs before and after a change "
            "and cannot conclude anything from NaN: find where it comes from first (a fully "
            "masked row? an overflow?)"
        )


def _largest_change(out: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """(B, T): the largest |out - base| over the features; a NaN or inf in out counts as an
    infinite change (the output did move, and NaN compares unequal to everything)."""
    diff = (out - base).abs().amax(-1)  # (B, T)
    return torch.nan_to_num(diff, nan=float("inf"))


def _perturbed(
    x: torch.Tensor, position: int, is_ids: bool, vocab_size: int | None, gen: torch.Generator
) -> torch.Tensor:
    """A copy of x whose entries at ``position`` (in every example) are replaced."""
    y = x.clone()
    if is_ids:
        # shift every id by a random non-zero amount modulo V: always a different token
        offset = torch.randint(1, vocab_size, (x.shape[0],), generator=gen)  # (B,)
        y[:, position] = (x[:, position] + offset.to(x.device)) % vocab_size
    else:
        scale = float(x.detach().float().std()) if x.numel() > 1 else 1.0
        if not scale > 0 or scale == float("inf"):  # constant input (std 0) or overflow
            scale = 1.0
        noise = torch.randn(x[:, position].shape, generator=gen) * scale  # (B, ...)
        y[:, position] = noise.to(device=x.device, dtype=x.dtype)
    return y


def _changes(
    fn: Probed, x: torch.Tensor, *, vocab_size: int | None, n_trials: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """change (B, T, T), the baseline output's size (B, T), the baseline's noise (B, T).

    All three are float64 on the CPU. Refuses non-finite inputs and baseline outputs.
    """
    is_ids = _check_inputs(fn, x, vocab_size, n_trials, seed)
    gen = torch.Generator().manual_seed(seed)
    batch, seq_len = x.shape[:2]
    with torch.no_grad():
        base = _run(fn, x)  # (B, T, F)
        _require_finite_output(base)
        # a second run on the same input must agree: dropout left on would make every
        # output "change" for reasons that have nothing to do with the input
        noise = _largest_change(_run(fn, x), base)  # (B, T)
        change = torch.zeros(batch, seq_len, seq_len, dtype=torch.float64)  # (B, T, T)
        for _ in range(n_trials):
            for j in range(seq_len):
                out = _run(fn, _perturbed(x, j, is_ids, vocab_size, gen))  # (B, T, F)
                change[:, :, j] = torch.maximum(change[:, :, j], _largest_change(out, base))
    size = base.abs().amax(-1)  # (B, T)
    return change, size, noise


def influence(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    seed: int = 0,
) -> torch.Tensor:
    """How much each output moves when one input position is replaced.

    For every position j, each example's input at j (all of its features) is replaced by a
    random one: another token id for (B, T) ids, fresh normal noise of the input's scale for
    (B, T, D) vectors; every other position is left as it was. This is repeated ``n_trials``
    times with different replacements.

    Args:
        fn: maps x to per-position outputs (B, T, ...), e.g. ``lambda ids: model(ids).logits``.
            Put models in eval mode first (dropout makes every output move).
        x: (B, T) token ids or (B, T, ...) float inputs.
        vocab_size: V, needed for token ids (replacement ids are drawn from 0..V-1).
        n_trials: replacements tried per position (a single one could, by chance, leave an
            output unchanged).
        seed: seeds the replacements, so the result is repeatable.

    Returns:
        (B, T, T) float64 on the CPU: entry [b, i, j] is the largest absolute change of any
        element of output i of example b over the trials that replaced input j; ``inf`` where
        the replacement made output i NaN or inf (it did move).

    Raises:
        ValueError: for bad arguments, a float x holding NaN or inf, or an fn whose output for
            the unchanged x holds NaN or inf (nothing can be concluded from NaN).
    """
    change, _, _ = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    return change


def who_sees_whom(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    per_example: bool = False,
    seed: int = 0,
) -> torch.Tensor:
    """Which outputs depend on which inputs, measured by replacing one position at a time.

    Output i "sees" input j when replacing input j (see :func:`influence`) moves some element
    of output i by more than ``atol + rtol * max|output i|``. The tolerance keeps float
    rounding (about 1e-7 relative in float32) from counting as a dependence; a real but
    tinier dependence is missed, so keep atol well below the effects you care about.

    Args:
        fn: maps x to per-position outputs (B, T, ...); the model must be in eval mode.
        x: (B, T) token ids or (B, T, ...) float inputs.
        vocab_size: V, needed for token ids.
        n_trials: replacements tried per position.
        atol, rtol: absolute and relative tolerance for "changed".
        per_example: return one matrix per example instead of their union.
        seed: seeds the replacements.

    Returns:
        Boolean (T, T) on the CPU, entry [i, j] True when output i changed for some example
        when input j was replaced (a causal model gives a lower-triangular matrix); or
        (B, T, T) with ``per_example=True``.

    Raises:
        ValueError: for bad arguments, an fn that does not return (B, T, ...) tensors, an
            fn whose output differs between two calls on the same input (dropout left on),
            or NaN / inf in x or in fn's output for the unchanged x (see :func:`influence`).
    """
    _check_tolerances(atol, rtol)
    require_bool("per_example", per_example)
    change, size, noise = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    sees = _threshold(change, size, noise, atol, rtol)  # (B, T, T)
    return sees if per_example else sees.any(0)


def _threshold(
    change: torch.Tensor, size: torch.Tensor, noise: torch.Tensor, atol: float, rtol: float
) -> torch.Tensor:
    """(B, T, T) bool: change above atol + rtol * |output|; refuses a non-repeatable fn."""
    threshold = atol + rtol * size  # (B, T)
    unstable = noise > threshold
    if bool(unstable.any()):
        b, i = (int(v) for v in torch.nonzero(unstable)[0])
        raise ValueError(
            f"fn gives different outputs for the same input (example {b}, position {i} moved "
            f"by {float(noise[b, i]):.3g} between two calls): is dropout on? Call model.eval() "
            "first, or raise atol if the difference is rounding noise"
        )
    return change > threshold[:, :, None]  # (B, T, T)


@dataclass(frozen=True)
class LeakReport:
    """What :func:`future_leaks` found.

    Attributes:
        sees: (T, T) bool, sees[i, j]: output i changed when input j was replaced.
        change: (T, T) float64, the largest change of output i (over the batch and the
            trials) when input j was replaced.
    """

    sees: torch.Tensor
    change: torch.Tensor

    @property
    def leaks(self) -> torch.Tensor:
        """(T, T) bool: the dependences on later inputs, sees[i, j] with j > i."""
        seq_len = self.sees.shape[0]
        future = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)  # (T, T)
        return self.sees & future

    @property
    def leaking_positions(self) -> list[int]:
        """Positions whose output depends on at least one later input."""
        return torch.nonzero(self.leaks.any(1)).flatten().tolist()

    @property
    def is_causal(self) -> bool:
        """True when no output depends on a later input."""
        return not bool(self.leaks.any())

    @property
    def lookahead(self) -> int:
        """How far ahead the worst leak looks: the largest j - i with sees[i, j] (0 if none)."""
        pairs = torch.nonzero(self.leaks)
        return int((pairs[:, 1] - pairs[:, 0]).max()) if len(pairs) else 0

    def __str__(self) -> str:
        seq_len = self.sees.shape[0]
        if self.is_causal:
            return f"causal: no output depends on a later input (T={seq_len})"
        return (
            f"LEAK: the outputs at positions {self.leaking_positions} depend on later inputs, "
            f"up to {self.lookahead} position(s) ahead (T={seq_len})"
        )


def future_leaks(
    fn: Probed,
    x: torch.Tensor,
    *,
    vocab_size: int | None = None,
    n_trials: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    seed: int = 0,
) -> LeakReport:
    """Test a model for future leaks: does any output depend on a later input?

    Runs :func:`who_sees_whom` (same arguments) and summarises it. A correct language model
    (a decoder with a causal mask) gives ``report.is_causal == True``.

    Example:
        >>> report = future_leaks(lambda ids: model(ids).logits, ids, vocab_size=V)
        >>> print(report)              # causal: no output depends on a later input (T=8)
        >>> report.sees                # (T, T) bool, lower-triangular when causal

    Returns:
        A :class:`LeakReport`. It never reports "causal" on NaN: NaN or inf in x or in the
        unperturbed output raises ``ValueError``, and an output that turns NaN when a later
        input is replaced counts as a leak.
    """
    _check_tolerances(atol, rtol)
    change, size, noise = _changes(fn, x, vocab_size=vocab_size, n_trials=n_trials, seed=seed)
    sees = _threshold(change, size, noise, atol, rtol).any(0)  # (T, T)
    return LeakReport(sees=sees, change=change.amax(0))


# ------------------------------------------------------------------------------ head ablation


def _check_heads_to_ablate(attention: object, heads: object) -> list[int]:
    """The heads as a sorted list of distinct ints in 0..H-1, after checking the layer."""
    if not isinstance(attention, MultiHeadAttention):
        hint = ""
        if isinstance(attention, nn.MultiheadAttention):
            hint = (" (torch.nn.MultiheadAttention applies its output projection inside one "
                    "functional call, so there is no place to switch a head off; copy its "
                    "weights into course_lib.MultiHeadAttention)")
        raise TypeError(
            f"attention must be a course_lib MultiHeadAttention layer, e.g. "
            f"model.blocks[0].self_attn, got {type(attention).__name__}{hint}"
        )
    n_heads = attention.n_heads
    if not isinstance(heads, Iterable) or isinstance(heads, (str, torch.Tensor)):
        heads = [heads]  # one head given on its own
    chosen = []
    for head in heads:
        if isinstance(head, bool) or not isinstance(head, numbers.Integral):
            raise TypeError(
                f"heads must be a head index or a list of them (ints in 0..{n_heads - 1}), got "
                f"{head!r} ({type(head).__name__})"
            )
        if not 0 <= head < n_heads:
            raise ValueError(
                f"heads contains {head}, but this layer has n_heads={n_heads}: valid heads are "
                f"0..{n_heads - 1}"
            )
        chosen.append(int(head))
    return sorted(set(chosen))


@contextlib.contextmanager
def ablate_heads(
    attention: MultiHeadAttention, heads: int | Iterable[int]
) -> Iterator[MultiHeadAttention]:
    """Switch chosen heads of a multi-head attention layer off inside a ``with`` block.

    Head h's output is its slice ``h*Dh:(h+1)*Dh`` of the concatenated heads, the input of the
    output projection W_o (eq. 24 of the notes). Zeroing that slice removes exactly head h's
    term from ``out = sum_h W_o[:, slice_h] head_h + b_o``; the other heads, their attention
    weights and W_o's bias are untouched. This is *zero ablation*: the model sees a value
    (0) it never produced in training, which is the simplest choice, not the only one.

    It works through a forward pre-hook on ``attention.out_proj`` that is removed when the
    block ends (also after an error), so the layer's code and its fast path stay as they are.

    Args:
        attention: a course_lib :class:`~course_lib.attention.MultiHeadAttention` (inside a
            model, e.g. ``model.blocks[0].self_attn``).
        heads: one head index or several, each in 0..H-1; an empty list ablates nothing.

    Yields:
        The same layer, for ``with ablate_heads(layer, [0, 2]) as layer: ...``.

    Raises:
        ValueError: for bad arguments, or, when the block ends, if the layer never ran inside
            it (nothing was ablated, so nothing was measured).

    Example:
        >>> with ablate_heads(model.attn, 1):
        ...     loss_without_head_1 = evaluate(model)
    """
    chosen = _check_heads_to_ablate(attention, heads)
    d_head = attention.d_head
    ran = []  # filled when the layer runs inside the block

    def zero_chosen_heads(module: nn.Module, args: tuple) -> tuple:
        ran.append(True)
        concat = args[0]  # (B, T, D): the heads' outputs side by side
        drop = torch.zeros(concat.shape[-1], dtype=torch.bool, device=concat.device)  # (D,)
        for head in chosen:
            drop[head * d_head:(head + 1) * d_head] = True
        return (concat.masked_fill(drop, 0.0), *args[1:])  # (B, T, D)

    handle = attention.out_proj.register_forward_pre_hook(zero_chosen_heads)
    try:
        yield attention
    finally:
        handle.remove()
    if not ran:  # (not reached after an error inside the block)
        raise ValueError(
            "the with block never ran attention (the layer given to ablate_heads), so no head "
            "was switched off and whatever it measured is the unchanged model: run the model "
            "that holds this very layer inside the block (not a copy of it)"
        )


def layer_grad_norms(layers: Iterable[nn.Module]) -> torch.Tensor:
    """The size of each layer's gradient after a backward pass: how much learning signal
    reaches every layer of a stack.

    Entry l is the L2 norm of all of layer l's parameter gradients together,
    sqrt(sum over its parameters p of ||p.grad||^2). A parameter whose ``.grad`` is None (the
    loss did not depend on it) counts as 0. NaN or inf gradients are refused.

    The squares are summed in float64: squaring a float32 entry below about 1e-23 underflows
    to 0, so a float32 sum would report a tiny gradient (as deep in a plain stack) as exactly
    0. The result is returned in float32, which holds any such norm (it is at least as large
    as the largest entry); on MPS, which has no float64, the sum moves to the CPU first.

    Example:
        >>> model(ids, targets=targets).loss.backward()
        >>> layer_grad_norms(model.blocks)     # (n_layers,), first block first

    Args:
        layers: the layers in order, e.g. ``model.blocks`` (an ``nn.ModuleList``), an
            ``nn.Sequential`` or a list of modules, each with parameters.

    Returns:
        (L,) float32 on the CPU.

    Raises:
        ValueError: no layers, a layer without parameters, no gradient at all (call
            ``loss.backward()`` first), or a NaN or inf gradient (naming the layer and the
            parameter).
    """
    layers = _check_layers(layers)
    norms, any_grad = [], False
    for i, layer in enumerate(layers):
        grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
        any_grad = any_grad or bool(grads)
        for name, grad in grads.items():
            require_finite(f"layers[{i}].{name}.grad", grad, "a norm of NaN or inf says nothing "
                           "about the learning signal; was the loss NaN or inf (check "
                           "torch.isfinite(loss) before backward()), or did it overflow?")
        squares = [_sum_of_squares(g) for g in grads.values()]  # float64 on the CPU
        norms.append(torch.stack(squares).sum().sqrt().float() if squares else torch.tensor(0.0))
    if not any_grad:
        raise ValueError(
            "none of the layers' parameters has a gradient: call loss.backward() first (and "
            "do not zero the gradients in between)"
        )
    return torch.stack(norms)  # (L,)


def _sum_of_squares(grad: torch.Tensor) -> torch.Tensor:
    """sum(grad^2) as a float64 CPU scalar (float64 so that tiny entries do not square to 0)."""
    grad = grad.detach()
    if grad.device.type == "mps":  # MPS has no float64
        grad = grad.cpu()
    return grad.double().pow(2).sum().cpu()


def _check_layers(layers: object) -> list[nn.Module]:
    """A non-empty list of modules that all have parameters."""
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList | nn.Sequential):
        raise TypeError(
            f"layers must be a sequence of modules (the layers of a stack), got one "
            f"{type(layers).__name__}; pass its layers, e.g. model.blocks"
        )
    if isinstance(layers, torch.Tensor) or not isinstance(layers, Iterable):
        raise TypeError(
            f"layers must be a sequence of modules such as model.blocks, got "
            f"{type(layers).__name__}"
        )
    layers = list(layers)
    if not layers:
        raise ValueError("layers is empty: give at least one layer")
    for i, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layers[{i}] must be a torch.nn.Module, got "
                                 f"{type(layer).__name__}")
        if next(layer.parameters(), None) is None:
            raise ValueError(f"layers[{i}] ({type(layer).__name__}) has no parameters, so it "
                             "has no gradient to measure")
    return layers


# --------------------------------------------------------------------------------------------
# What do a trained encoder's heads do? Role scores measured over many sentences


HEAD_ROLES = ("previous token", "next token", "[CLS]", "[SEP]", "same word")

# function words: a head linking "the" to "the" is not matching what a sentence is about
STOP_WORDS = frozenset(
    "a an the and or but if so of to in on at by for from with as into than then that this "
    "these those it its is are was were be been being has have had do does did not no he she "
    "they we you i me my his her our your their them him us who which what when where how "
    "all any each every other some such very can will would should could".split()
)


@dataclass(frozen=True)
class HeadRoles:
    """What :func:`head_role_scores` measured.

    Attributes:
        scores: ``{role: (L, H)}``, each head's mean weight on the role's key tokens (NaN
            when no query token has that role).
        baseline: ``{role: float}``, the same score for a head that spreads its weight
            evenly: over the word tokens for "previous token", "next token" and "same word"
            (the keys such a head could prefer), over all tokens for "[CLS]" and "[SEP]".
        n_queries: ``{role: int}``, how many query tokens were averaged.
        repeated: the words counted for "same word", each once, sorted.
    """

    scores: dict[str, torch.Tensor]
    baseline: dict[str, float]
    n_queries: dict[str, int]
    repeated: list[str]

    def top(self, role: str, k: int = 3) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the highest score for ``role``, best first, as
        ``(layer, head, score)``."""
        if role not in HEAD_ROLES:
            raise ValueError(f"role must be one of {', '.join(map(repr, HEAD_ROLES))}, "
                             f"got {role!r}")
        k = require_positive_int("k", k)
        score = self.scores[role]  # (L, H)
        if not bool(torch.isfinite(score).all()):  # NaN would rank first
            raise ValueError(
                f"the scores for role {role!r} hold NaN (n_queries[{role!r}] = "
                f"{self.n_queries[role]}: no query token had this role, e.g. no repeated word "
                "for 'same word'), so there is nothing to rank; give more sentences")
        best = score.flatten().topk(min(k, score.numel()))
        n_heads = score.shape[1]
        return [(int(i) // n_heads, int(i) % n_heads, float(v))
                for v, i in zip(best.values, best.indices, strict=True)]


def head_role_scores(
    attentions: list[torch.Tensor] | tuple[torch.Tensor, ...] | torch.Tensor,
    tokens: list[list[str]],
    *,
    stop_words: Iterable[str] = STOP_WORDS,
) -> HeadRoles:
    """Measure, for every head of an encoder, how much weight it gives to a few kinds of key
    token, averaged over every word token of many sentences (not eyeballed on one).

    Each sequence is BERT-style, ``[CLS] w_1 ... w_k [SEP]``; the queries are its word tokens
    (all but the first and the last). The roles, after Clark et al. (2019):

    * "previous token" / "next token": the weight on the token just before / after;
    * "[CLS]" / "[SEP]": the weight on the first / the last token;
    * "same word": for a word whose token occurs again in the sentence, the weight on its
      other occurrences. Stop words, punctuation and word pieces (``##...``) are not counted.

    Args:
        attentions: L tensors (B, H, T, T), a model's ``attentions`` for a padded batch, or
            one (L, B, H, T, T) tensor.
        tokens: B lists of token strings, real tokens only (padding is never read).
        stop_words: words (any case) never counted as "same word".

    Returns:
        A :class:`HeadRoles`: (L, H) scores per role, the even-spread baselines, the number
        of queries, and the repeated words counted.

    Raises:
        ValueError: for bad arguments, NaN or inf weights at real tokens (naming the layer
            and head), or no word token at all (nothing to score).
    """
    stack, tokens, stop = _check_role_inputs(attentions, tokens, stop_words)  # (L, B, H, T, T)
    n_layers, _, n_heads = stack.shape[:3]
    sums = {role: torch.zeros(n_layers, n_heads, dtype=torch.float64) for role in HEAD_ROLES}
    base = dict.fromkeys(HEAD_ROLES, 0.0)
    counts = dict.fromkeys(HEAD_ROLES, 0)
    repeated: set[str] = set()
    for b, sentence in enumerate(tokens):
        n = len(sentence)
        if n < 3:  # no word token
            continue
        w = stack[:, b, :, :n, :n].double()  # (L, H, n, n)
        over_words = torch.zeros(n, dtype=torch.float64)  # an even spread over the words
        over_words[1:n - 1] = 1.0 / (n - 2)
        over_all = torch.full((n,), 1.0 / n, dtype=torch.float64)  # ... over every token
        for role, pairs in _role_keys(sentence, stop).items():
            even = over_all if role in ("[CLS]", "[SEP]") else over_words
            for query, keys in pairs:
                sums[role] += w[:, :, query, keys].sum(-1)  # (L, H)
                base[role] += float(even[keys].sum())
                counts[role] += 1
                if role == "same word":
                    repeated.add(sentence[query].lower())
    nan = float("nan")
    return HeadRoles(
        scores={r: (sums[r] / counts[r] if counts[r] else sums[r] + nan).float()
                for r in HEAD_ROLES},
        baseline={r: base[r] / counts[r] if counts[r] else nan for r in HEAD_ROLES},
        n_queries=counts,
        repeated=sorted(repeated),
    )


def _role_keys(sentence: list[str], stop: frozenset[str]) -> dict[str, list]:
    """For each role, ``(query position, [key positions])`` for every word token that has it."""
    n = len(sentence)
    words = range(1, n - 1)
    low = [token.lower() for token in sentence]
    same = []
    for i in words:
        if low[i] in stop or low[i].startswith("##") or not any(c.isalnum() for c in low[i]):
            continue
        others = [j for j in words if j != i and low[j] == low[i]]
        if others:
            same.append((i, others))
    return {
        "previous token": [(i, [i - 1]) for i in words],
        "next token": [(i, [i + 1]) for i in words],
        "[CLS]": [(i, [0]) for i in words],
        "[SEP]": [(i, [n - 1]) for i in words],
        "same word": same,
    }


def _check_role_inputs(
    attentions: object, tokens: object, stop_words: object
) -> tuple[torch.Tensor, list[list[str]], frozenset[str]]:
    """head_role_scores' arguments, checked: (L, B, H, T, T) weights on the CPU, the token
    lists, and the stop words in lower case."""
    if isinstance(attentions, torch.Tensor):
        if attentions.dim() != 5:
            raise ValueError(f"attentions should have shape (L, B, H, T, T), got "
                             f"{shape_of(attentions)}")
        stack = attentions
    else:
        if not isinstance(attentions, (list, tuple)) or not attentions:
            raise TypeError(
                "attentions must be a non-empty list of (B, H, T, T) tensors (a model's "
                f"attentions), got {type(attentions).__name__}")
        shapes = {tuple(require_tensor(f"attentions[{i}]", a).shape)
                  for i, a in enumerate(attentions)}
        if len(shapes) != 1 or len(next(iter(shapes))) != 4:
            raise ValueError(f"attentions should be L tensors of one shape (B, H, T, T), got "
                             f"shapes {sorted(shapes)}")
        stack = torch.stack(list(attentions))  # (L, B, H, T, T)
    if not stack.is_floating_point() or stack.shape[-1] != stack.shape[-2]:
        raise ValueError(f"attentions should hold float weights of shape (..., T, T), got "
                         f"{shape_of(stack)} and dtype {stack.dtype}")
    if isinstance(tokens, str) or not isinstance(tokens, (list, tuple)) or not all(
            isinstance(s, (list, tuple)) and all(isinstance(t, str) for t in s) for s in tokens):
        raise TypeError("tokens must be a list of B token lists (strings), e.g. "
                             f"out.tokens, got {type(tokens).__name__}")
    if len(tokens) != stack.shape[1] or any(len(s) > stack.shape[-1] for s in tokens):
        raise ValueError(
            f"tokens has {len(tokens)} sequences of up to {max(map(len, tokens), default=0)} "
            f"tokens, but attentions has shape {shape_of(stack)}: expected B = "
            f"{stack.shape[1]} sequences of at most T = {stack.shape[-1]} tokens")
    if isinstance(stop_words, str) or not isinstance(stop_words, Iterable) \
            or not all(isinstance(w, str) for w in stop_words):
        raise TypeError("stop_words must be a collection of words (strings)")
    stack = stack.detach().cpu()
    _require_scoreable(stack, tokens)
    return stack, [list(s) for s in tokens], frozenset(w.lower() for w in stop_words)


def _require_scoreable(stack: torch.Tensor, tokens: list) -> None:
    """Refuse weights with no layer, head or word token to score, or NaN / inf at real tokens
    (a NaN head would rank first)."""
    if stack.shape[0] == 0 or stack.shape[2] == 0 or not any(len(s) >= 3 for s in tokens):
        raise ValueError(
            f"nothing to score: attentions has shape {shape_of(stack)} (L layers, H heads) and "
            f"tokens has {sum(len(s) >= 3 for s in tokens)} sequences with a word token "
            "([CLS] w ... [SEP], 3 tokens or more); give at least one layer, head and word")
    for b, sentence in enumerate(tokens):
        n = len(sentence)
        bad = ~torch.isfinite(stack[:, b, :, :n, :n]).flatten(2).all(-1)  # (L, H)
        if bool(bad.any()):
            layer, head = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(
                f"attentions holds NaN or inf for layer {layer}, head {head} (sequence {b}, "
                "at real tokens): its scores would be NaN, and NaN cannot be ranked; find "
                "where it comes from first (a fully masked row? an overflow?)")


# --------------------------------------------------------------------------------------------
# Two patterns of a decoder's heads: previous token and induction (chapter 11)


def _check_weights(weights: object, min_len: int = 2) -> torch.Tensor:
    """Attention weights (..., T, T), floating point, finite, T >= min_len."""
    weights = require_tensor("weights", weights)
    if weights.dim() < 2 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights should be attention weights of shape (..., T, T) (rows = "
                         f"queries, columns = keys), got shape {shape_of(weights)}")
    if not weights.is_floating_point():
        raise TypeError(f"weights should hold float attention weights, got dtype {weights.dtype}")
    if weights.shape[-1] < min_len:
        raise ValueError(f"weights has T = {weights.shape[-1]} positions; the score needs at "
                         f"least {min_len}")
    if weights.numel() == 0:
        raise ValueError(f"weights has shape {shape_of(weights)}: no example or no head "
                         "(a dimension of size 0), so there is no score to measure (its mean "
                         "would be NaN); give at least one sequence and one head")
    require_finite("weights", weights, "a score of NaN says nothing about the head")
    return weights


def previous_token_score(weights: torch.Tensor) -> torch.Tensor:
    """How much a head attends to the token just before the query: the mean over queries
    t = 1..T-1 of ``weights[..., t, t - 1]`` (1 for a pure previous-token head; a head that
    spreads evenly over t + 1 causal keys scores the mean of 1 / (t + 1)).

    Args:
        weights: (..., T, T) attention weights, rows = queries, e.g. one layer's
            ``model(ids, output_attentions=True).attentions[l]`` (B, H, T, T); T >= 2.

    Returns:
        (...): the score of every head (and example); average over the batch dimension
        yourself, e.g. ``previous_token_score(w).mean(0)`` for (H,).
    """
    weights = _check_weights(weights)
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)  # (...,)


def induction_score(weights: torch.Tensor, segment_len: int) -> torch.Tensor:
    """How much a head does what an induction head does on a repeated segment
    (``course_lib.tasks.repeated_segments``: L random tokens, then the same L again): the mean
    over the queries t = L..2L-1 of the second copy of ``weights[..., t, t - L + 1]``, the
    weight on the token that came right after the earlier copy of the current token (the one
    to predict next). A pure induction head scores 1; a previous-token head scores about 0.

    Args:
        weights: (..., 2L, 2L) attention weights on sequences from ``repeated_segments``.
        segment_len: L.

    Returns:
        (...): the score of every head (and example).
    """
    weights = _check_weights(weights)
    seg = require_positive_int("segment_len", segment_len)
    if weights.shape[-1] != 2 * seg:
        raise ValueError(
            f"weights has T = {weights.shape[-1]} positions, but a repeated segment of "
            f"segment_len = {seg} has T = 2 * segment_len = {2 * seg}: pass the segment "
            "length the sequences were made with")
    # key t - L + 1 sits L - 1 positions below the diagonal
    return weights.diagonal(offset=-(seg - 1), dim1=-2, dim2=-1)[..., 1:].mean(-1)  # (...,)


# --------------------------------------------------------------------------------------------
# Inside a decoder: one head's path into a later layer, and the logit lens (chapter 11)

PATH_PARTS = ("queries", "keys", "values")


def _check_blocks(model: object) -> list[nn.Module]:
    """The model's blocks, each with a course_lib ``self_attn``, ``attn_norm``, ``norm_first``."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(model, nn.Module) or not isinstance(blocks, nn.ModuleList) or not all(
            isinstance(getattr(b, "self_attn", None), MultiHeadAttention) for b in blocks):
        raise TypeError(f"model must be a course_lib DecoderLM (or Encoder), with blocks whose "
                        f"self_attn is a MultiHeadAttention; got {type(model).__name__}")
    return list(blocks)


@contextlib.contextmanager
def ablate_head_path(
    model: nn.Module, layer: int, head: int, *, into_layer: int,
    parts: str | Iterable[str] = "keys",
) -> Iterator[nn.Module]:
    """Remove one head's output from what a later layer reads as keys (or queries, or values)
    only, inside a ``with`` block: a *targeted* ablation, to test how two layers compose.

    Head ``head`` of block ``layer`` adds ``c = W_o[:, slice_h] head_h`` to the residual stream
    x. Inside the block, block ``into_layer`` computes the chosen parts from ``x - c`` (through
    its own norm, as it would) and the others from the full x; every other layer, and the
    stream itself, still contain ``c``. So ``parts="keys"`` asks: does the later layer need
    this head's output to *find* where to look (K-composition), while its queries and the
    values it reads are untouched? Only the direct path is removed (what c contributes
    through a feed-forward sublayer in between is not).

    Args:
        model: a course_lib DecoderLM (``model.blocks``), in eval mode for a measurement.
        layer, head: the head whose output is removed (block ``layer``'s self-attention).
        into_layer: the later block that reads the stream without it (> layer).
        parts: ``"queries"``, ``"keys"``, ``"values"`` or several of them.

    Yields:
        The model, for ``with ablate_head_path(model, 0, 1, into_layer=1): model(ids)``.

    Raises:
        ValueError / TypeError: for bad arguments, or (when the block ends) if the model never
            ran inside it.
    """
    blocks = _check_blocks(model)
    n_layers = len(blocks)
    layer = require_int("layer", layer, minimum=0)
    into_layer = require_int("into_layer", into_layer, minimum=0)
    if not layer < into_layer < n_layers:
        raise ValueError(f"need layer < into_layer < n_layers = {n_layers}; got layer={layer}, "
                         f"into_layer={into_layer}: a head can only change what later "
                         "layers read")
    n_heads = blocks[layer].self_attn.n_heads
    chosen = require_int("head", head, minimum=0)
    if chosen >= n_heads:
        raise ValueError(f"head must be a head of block {layer}, 0..{n_heads - 1} "
                         f"(n_heads={n_heads}), got {head}")
    if not isinstance(parts, Iterable):
        raise TypeError(f"parts must be one of {PATH_PARTS} or a list of them, got {parts!r}")
    parts = [parts] if isinstance(parts, str) else list(parts)
    if not parts:
        raise ValueError(f"parts is empty: nothing would be ablated; choose from {PATH_PARTS}")
    for part in parts:
        if part not in PATH_PARTS:
            raise ValueError(f"parts must be among {PATH_PARTS}, got {part!r}")
    source, target = blocks[layer].self_attn, blocks[into_layer]
    seen: dict[str, torch.Tensor] = {}  # the head's term c and the stream x of the latest run
    ran = []  # filled when the target layer runs inside the block

    def keep_head_output(module: nn.Module, args: tuple) -> None:
        d_head = source.d_head
        part = args[0][..., chosen * d_head:(chosen + 1) * d_head]  # (B, T, Dh)
        seen["c"] = part @ module.weight[:, chosen * d_head:(chosen + 1) * d_head].T  # (B, T, D)

    def keep_stream(module: nn.Module, args: tuple) -> None:
        seen["x"] = args[0]  # (B, T, D): the residual stream entering the target block

    def replace_parts(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        x = seen["x"] - seen["c"]  # (B, T, D): the stream without the head
        if target.norm_first:
            x = target.attn_norm(x)
        without = F.linear(x, module.weight, module.bias)  # (B, T, D + 2 Hkv Dh)
        d, kv = target.self_attn.d_model, target.self_attn.n_kv_heads * target.self_attn.d_head
        spans = {"queries": (0, d), "keys": (d, d + kv), "values": (d + kv, d + 2 * kv)}
        out = out.clone()
        for part in parts:
            start, end = spans[part]
            out[..., start:end] = without[..., start:end]
        ran.append(True)
        return out

    handles = [source.out_proj.register_forward_pre_hook(keep_head_output),
               target.register_forward_pre_hook(keep_stream),
               target.self_attn.qkv_proj.register_forward_hook(replace_parts)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
    if not ran:
        raise ValueError("the with block never ran the model given to ablate_head_path, so "
                         "nothing was ablated: run that very model inside the block")


def logit_lens(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """What a decoder would predict if it stopped after each layer: its final norm and its
    output layer applied to the residual stream after the embeddings and after every block
    (nostalgebraist's *logit lens*). The last entry is the model's own logits.

    Args:
        model: a course_lib DecoderLM (``embeddings``, ``blocks``, ``final_norm``, ``lm_head``).
        ids: (B, T) token ids, as the model takes them.

    Returns:
        (n_layers + 1, B, T, V) logits, entry 0 from the embeddings alone, computed without
        gradients.
    """
    blocks = _check_blocks(model)
    if not hasattr(model, "lm_head"):
        raise TypeError(f"model must be a language model with an lm_head (a DecoderLM), got "
                        f"{type(model).__name__}")
    require_deterministic("model", model)
    streams: list[torch.Tensor] = []
    hooks = [model.embeddings.register_forward_hook(lambda m, a, out: streams.append(out))]
    hooks += [b.register_forward_hook(lambda m, a, out: streams.append(out[0])) for b in blocks]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        stack = torch.stack(streams)  # (L + 1, B, T, D)
        if model.final_norm is not None:
            stack = model.final_norm(stack)
        return model.lm_head(stack)  # (L + 1, B, T, V)
