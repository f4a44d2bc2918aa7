"""Where do two implementations of the same network first disagree?

Porting a checkpoint into your own code usually "almost" works: the final outputs differ a
little, and nothing says why. The locator here runs two models on the same input with forward
hooks on matching submodules, walks the submodules in the order the reference computes them,
and reports the first one whose output differs beyond a tolerance. Because every module
before it agreed, the cause lies in that module or in the code just before it. A hint names
the usual suspects when their fingerprints are found (a setting such as eps or the GELU form
is blamed only when putting the reference's value back makes that first module agree, so a
harmless difference is never blamed for another mistake):

* ``layer_norm_eps``: LayerNorm eps 1e-5 (PyTorch's default) where BERT uses 1e-12;
* ``activation``: the tanh approximation of GELU where the exact erf form is used (or ReLU);
* ``norm_order``: pre-norm ``x + f(LN(x))`` where the reference is post-norm ``LN(x + f(x))``;
* ``token_types``: segment (token-type) embeddings missing from the embedding sum;
* ``qkv_layout``: the fused projection's rows stacked in another order than [W_q; W_k; W_v];
* ``transposed_weight``: a weight loaded as (in, out) instead of nn.Linear's (out, in).

:func:`inject_mistake` makes a copy of a course_lib model with one of these mistakes, to see
the locator find it.

Shape legend: B batch, T tokens, D d_model, F feed-forward width.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._validate import (
    require_bool_mask,
    require_callable,
    require_choice,
    require_finite,
    require_non_negative_number,
    shape_of,
)
from ..attention import MultiHeadAttention
from ..blocks import DecoderBlock, EncoderBlock
from ..layers import ACTIVATIONS, FeedForward, get_activation
from ..models import Embeddings
from ._checks import require_deterministic

__all__ = ["MISTAKES", "Call", "Divergence", "DivergenceReport", "first_divergence",
           "inject_mistake", "record_calls"]

# mistake name -> what it does (the names are also the causes the locator reports)
MISTAKES = {
    "layer_norm_eps": "every LayerNorm with eps=1e-5 (PyTorch's default) instead of the "
                      "checkpoint's value (1e-12 for BERT)",
    "activation": "the tanh approximation of GELU instead of the exact erf form (or the "
                  "other way round)",
    "norm_order": "pre-norm blocks, x + f(LN(x)), instead of post-norm LN(x + f(x))",
    "token_types": "no token-type (segment) embeddings in the embedding sum",
    "qkv_layout": "the fused q/k/v projection's rows stacked [W_k; W_q; W_v] instead of "
                  "[W_q; W_k; W_v]",
    "transposed_weight": "the attention output projections loaded transposed",
}

HINTS = {
    "layer_norm_eps": "LayerNorm eps differs: {detail}. BERT-family checkpoints use eps=1e-12, "
                      "torch.nn.LayerNorm defaults to 1e-5; read layer_norm_eps from "
                      "config.json",
    "activation": "the activation between the two feed-forward layers differs: {detail}. "
                  "BERT's 'gelu' is the exact erf form (F.gelu), GPT-2's 'gelu_new' the tanh "
                  "approximation (F.gelu(x, approximate='tanh')). The two differ by at most "
                  "about 4.7e-4 (near |x| = 2.7; below 2e-5 for |x| < 0.5), so this shows only "
                  "where the pre-activations are large",
    "norm_order": "the LayerNorms sit in another place: {detail}. Post-norm (BERT, the "
                  "original Transformer) computes LN(x + f(x)); pre-norm (GPT-2) computes "
                  "x + f(LN(x)) and ends with a final LayerNorm",
    "token_types": "a vector is missing from the embedding sum: {detail}. BERT adds a "
                   "token-type (segment) embedding to every token, type 0 even for a single "
                   "sentence (type_vocab_size=2 in config.json)",
    "qkv_layout": "the query/key/value weights are in another layout: {detail}. The fused "
                  "qkv_proj stacks the rows [W_q; W_k; W_v] (as nn.MultiheadAttention's "
                  "in_proj_weight); a checkpoint's separate query, key and value tensors are "
                  "concatenated in that order",
    "transposed_weight": "a weight is transposed: {detail}. nn.Linear stores its weight as "
                         "(out_features, in_features) and so do checkpoints; copy it as it is",
    "weights": "the module got the same input but holds other parameters: {detail}. A tensor "
               "was loaded into the wrong place, or not loaded at all",
    "non_finite": "the candidate's output holds NaN or inf where the reference's is finite: "
                  "{detail}. NaN compares unequal to everything, so nothing after this module "
                  "can be compared; fix this first",
    "unknown": "{detail}",
}


# --------------------------------------------------------------------------------------------
# Recording what every module computed


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor in a module's output or inputs (a tensor, a tuple, a dict, or an
    output object such as EncoderOutput)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, Mapping):
        value = list(value.values())
    elif hasattr(value, "__dataclass_fields__"):
        value = [getattr(value, name) for name in value.__dataclass_fields__]
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


@dataclass
class Call:
    """One recorded forward call of a module: its arguments and its output."""

    args: tuple
    kwargs: dict
    output: Any
    order: int

    @property
    def input(self) -> torch.Tensor | None:
        """The first tensor among the positional, then the keyword arguments."""
        return _first_tensor([*self.args, *self.kwargs.values()])

    @property
    def out(self) -> torch.Tensor | None:
        """The first tensor of the output (e.g. ``out`` of attention's ``(out, weights)``)."""
        return _first_tensor(self.output)


@contextlib.contextmanager
def record_calls(model: nn.Module, names: set[str] | None = None) -> Iterator[dict[str, Call]]:
    """Record the first forward call of each named submodule of ``model`` while the block runs.

    Calls are numbered in the order they *finish*, so a module comes after everything it calls
    (``blocks.0.ff.fc1`` before ``blocks.0.ff`` before ``blocks.0``).

    Args:
        model: the model whose submodules are recorded.
        names: record only these submodule names (default: every submodule).

    Yields:
        ``{name: Call}``, filled in as the model runs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if names is not None:
        if isinstance(names, str) or not isinstance(names, Iterable) \
                or not all(isinstance(n, str) for n in names):
            raise TypeError(
                f"names must be a set of submodule names (strings) or None, got {names!r}")
        known = {n for n, _ in model.named_modules()}
        absent = sorted(set(names) - known)
        if absent:
            raise ValueError(f"names lists modules that {type(model).__name__} does not have: "
                             f"{absent[:5]}; it has e.g. {sorted(known - {''})[:5]}")
    calls: dict[str, Call] = {}
    handles = []

    def hook_for(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if name not in calls:
                calls[name] = Call(args, kwargs, output, len(calls))
        return hook

    try:
        for name, module in model.named_modules():
            if name and (names is None or name in names):
                handles.append(module.register_forward_hook(hook_for(name), with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


# --------------------------------------------------------------------------------------------
# Comparing


@dataclass(frozen=True)
class _Compare:
    """Compares tensors at real token positions with tolerance atol + rtol * rms(reference)
    (the root mean square: a few outlier features, common in BERT, do not loosen it)."""

    keep: torch.Tensor | None
    atol: float
    rtol: float

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().double().cpu()
        if self.keep is not None and tuple(t.shape[:2]) == tuple(self.keep.shape):
            return t[self.keep.cpu()]  # (real tokens, ...)
        return t

    def gap(self, candidate: Any, reference: Any) -> tuple[float, float]:
        """(largest |candidate - reference|, tolerance); the gap is inf when the two cannot
        be compared (a missing tensor or other sizes)."""
        if not isinstance(candidate, torch.Tensor) or not isinstance(reference, torch.Tensor):
            return float("inf"), self.atol
        c, r = self._flat(candidate), self._flat(reference)
        if c.numel() != r.numel():
            return float("inf"), self.atol
        scale = float(r.pow(2).mean().sqrt()) if r.numel() else 0.0  # RMS: outliers aside
        inf = float("inf")  # NaN counts as an infinite difference: it never agrees
        diff = float((c.reshape(r.shape) - r).abs().nan_to_num(nan=inf, posinf=inf).max()) \
            if r.numel() else 0.0
        return diff, self.atol + self.rtol * scale

    def same(self, candidate: Any, reference: Any) -> bool:
        diff, tol = self.gap(candidate, reference)
        return diff <= tol

    def finite(self, t: Any) -> bool:
        """Whether t holds no NaN or inf at the compared (real-token) positions."""
        return not isinstance(t, torch.Tensor) or not t.is_floating_point() \
            or bool(torch.isfinite(self._flat(t)).all())


# --------------------------------------------------------------------------------------------
# The report


@dataclass(frozen=True)
class Divergence:
    """The first pair of modules whose outputs differ.

    Attributes:
        candidate, reference: the module's name in each model.
        difference: the largest absolute difference of their outputs (real tokens only).
        tolerance: what was allowed.
        input_agreed: whether the two modules got the same input (None: not comparable).
        cause: one of :data:`MISTAKES`' names, ``"weights"``, ``"non_finite"`` (the
            candidate's output holds NaN or inf) or ``"unknown"``.
        hint: what probably went wrong, in words.
    """

    candidate: str
    reference: str
    difference: float
    tolerance: float
    input_agreed: bool | None
    cause: str
    hint: str


@dataclass(frozen=True)
class DivergenceReport:
    """What :func:`first_divergence` found.

    Attributes:
        compared: ``(candidate name, reference name, largest difference)`` for every pair
            compared, in the reference's order, up to and including the divergence.
        divergence: the first pair that differs, or None when all agree.
        unmatched: reference modules that ran but have no counterpart in the candidate.
    """

    compared: list[tuple[str, str, float]]
    divergence: Divergence | None
    unmatched: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        """True when every compared module agrees within tolerance."""
        return self.divergence is None

    @property
    def cause(self) -> str | None:
        """The diagnosed cause (None when the models agree)."""
        return None if self.divergence is None else self.divergence.cause

    def __str__(self) -> str:
        if self.divergence is None:
            return f"all {len(self.compared)} compared modules agree within tolerance"
        d = self.divergence
        where = d.candidate if d.candidate == d.reference else f"{d.candidate} " \
            f"(reference: {d.reference})"
        agreed = {True: "its input agreed", False: "its input already differed",
                  None: "its inputs are not comparable"}[d.input_agreed]
        return (
            f"first divergence after {len(self.compared) - 1} agreeing modules: {where}\n"
            f"  largest difference {d.difference:.2g} (tolerance {d.tolerance:.2g}); {agreed}\n"
            f"  likely cause [{d.cause}]: {d.hint}"
        )


# --------------------------------------------------------------------------------------------
# The locator


def first_divergence(
    reference: nn.Module,
    candidate: nn.Module,
    run_reference: Callable[[nn.Module], Any],
    run_candidate: Callable[[nn.Module], Any] | None = None,
    *,
    pairs: Mapping[str, str] | None = None,
    attention_mask: torch.Tensor | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> DivergenceReport:
    """Run two models that should compute the same function and find the first submodule
    whose output differs.

    Args:
        reference: the model that is known to be right (e.g. Hugging Face's BertModel).
        candidate: the model under test (e.g. course_lib's Encoder with the same weights).
        run_reference: called as ``run_reference(reference)``; runs the model on the input.
        run_candidate: the same for the candidate (defaults to ``run_reference``, for two
            models that take the same arguments).
        pairs: ``{candidate module name: reference module name}`` for the modules to compare;
            defaults to every module name the two models share (two course_lib models).
            :func:`course_lib.pretrained.bert_module_pairs` gives the table for BERT.
        attention_mask: (B, T) bool, True for real tokens: outputs shaped (B, T, ...) are
            compared at real tokens only (what padded positions hold does not matter).
        atol, rtol: outputs agree when max|candidate - reference| <= atol + rtol *
            rms(reference), the root mean square of the reference's output (at real tokens).

    Returns:
        A :class:`DivergenceReport`; ``print(report)`` says where and, when it recognises
        the fingerprint of a known mistake, why.

    Raises:
        ValueError: a model is in training mode with dropout (its outputs are random: call
            ``.eval()`` on both), ``pairs`` names modules the reference does not have,
            ``attention_mask`` does not fit the outputs, a model's input or a reference
            module's output holds NaN or inf, or nothing could be compared (a run function
            that does not call the model it is given, no pairs that both models ran).
    """
    cand_run_name = "run_reference" if run_candidate is None else "run_candidate"
    run_candidate = _check_locator_args(reference, candidate, run_reference, run_candidate,
                                        pairs, attention_mask, atol, rtol)
    compare = _Compare(attention_mask, atol, rtol)
    ref_calls = _run_recorded(reference, "reference", run_reference, "run_reference",
                              None if pairs is None else set(pairs.values()))
    cand_calls = _run_recorded(candidate, "candidate", run_candidate, cand_run_name, None)
    if attention_mask is not None:
        _require_mask_fits(attention_mask, ref_calls)
    cand_modules = dict(candidate.named_modules())
    if pairs is None:  # shared names, leaving out modules that compute nothing in eval mode
        pairs = {name: name for name in ref_calls if name in cand_modules
                 and not _computes_nothing(cand_modules[name])}
    by_reference = {r: c for c, r in pairs.items()}
    ordered = sorted(ref_calls, key=lambda name: ref_calls[name].order)
    unmatched = [r for r in ordered if by_reference.get(r) not in cand_calls
                 and not _computes_nothing(reference.get_submodule(r))]
    compared: list[tuple[str, str, float]] = []
    for ref_name in ordered:
        cand_name = by_reference.get(ref_name)
        if cand_name not in cand_calls:
            continue
        if not compare.finite(ref_calls[ref_name].out):  # the reference must be right
            also = "too" if not compare.finite(cand_calls[cand_name].out) else "not"
            raise ValueError(
                f"the reference's {ref_name} outputs NaN or inf (the candidate's {cand_name} "
                f"{also}): {_nan_source(reference, ref_name, ref_calls[ref_name], compare)}. "
                "The reference must compute finite numbers to be compared against")
        cand_out, ref_out = cand_calls[cand_name].out, ref_calls[ref_name].out
        if not compared:  # models of other sizes differ from the first module on
            _require_same_sizes(cand_name, ref_name, cand_out, ref_out)
        diff, tol = compare.gap(cand_out, ref_out)
        compared.append((cand_name, ref_name, diff))
        if diff > tol:
            scene = _Scene(reference, candidate, ref_calls, cand_calls, compare,
                           compared, unmatched, cand_name, ref_name, run_candidate)
            return DivergenceReport(compared, scene.divergence(diff, tol), unmatched)
    if not compared:
        raise ValueError(
            "nothing was compared: no module that ran in the candidate is paired with one that "
            "ran in the reference, so there is nothing to agree on. This usually happens when "
            "the two models name their modules differently (pass pairs={candidate name: "
            "reference name}; course_lib.pretrained.bert_module_pairs() gives BERT's) or when "
            "a model has no submodules (the locator compares submodules)"
        )
    return DivergenceReport(compared, None, unmatched)


def _require_same_sizes(cand_name: str, ref_name: str, cand_out: Any, ref_out: Any) -> None:
    if (isinstance(cand_out, torch.Tensor) and isinstance(ref_out, torch.Tensor)
            and cand_out.shape != ref_out.shape):
        raise ValueError(
            f"the models cannot be compared: the first paired modules, {cand_name} (candidate) "
            f"and {ref_name} (reference), output shapes {tuple(cand_out.shape)} and "
            f"{tuple(ref_out.shape)}. Build the candidate with the reference's sizes (d_model, "
            "vocabulary, ...)")


@contextlib.contextmanager
def _first_call(model: nn.Module) -> Iterator[list]:
    """Catch ``(module, args, kwargs)`` of the first module of ``model`` that starts running:
    the call the run function made, with the model's input."""
    first: list = []

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not first:
            first.append((module, args, kwargs))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules()]
    try:
        yield first
    finally:
        for handle in handles:
            handle.remove()


def _run_recorded(model: nn.Module, role: str, run: Callable, run_name: str,
                  names: set[str] | None) -> dict[str, Call]:
    """Run ``run(model)`` recording its submodules' calls; refuse a run that never calls the
    model, and an input that holds NaN or inf (nothing could be concluded from it)."""
    with torch.no_grad(), _first_call(model) as first, record_calls(model, names) as calls:
        run(model)
    if not first:
        raise ValueError(
            f"nothing was compared: {run_name} never called the {role} "
            f"({type(model).__name__}) it was given, so no module of it ran. This usually "
            f"happens when {run_name} runs another model than its argument, e.g. lambda m: "
            "model(ids) instead of lambda m: m(ids)"
        )
    module, args, kwargs = first[0]
    params = list(inspect.signature(module.forward).parameters)
    for arg, value in [*zip(params, args, strict=False), *kwargs.items()]:
        if isinstance(value, torch.Tensor):  # the input: the first tensor, as in Call.input
            require_finite(f"{arg} (the input that {run_name} gives the {role})", value,
                           "the locator compares outputs, and NaN compares unequal to "
                           "everything, so it could conclude nothing")
            break
    return calls


def _require_mask_fits(attention_mask: torch.Tensor, ref_calls: dict[str, Call]) -> None:
    """attention_mask must be (B, T) of the outputs, or it would silently be ignored."""
    sizes = collections.Counter(tuple(c.out.shape[:2]) for c in ref_calls.values()
                                if isinstance(c.out, torch.Tensor) and c.out.dim() >= 2)
    if sizes and tuple(attention_mask.shape) not in sizes:
        expected = sizes.most_common(1)[0][0]
        raise ValueError(
            f"attention_mask has shape {shape_of(attention_mask)}, but the reference's outputs "
            f"are (B, T, ...) with (B, T) = {expected}: expected attention_mask of shape "
            f"{expected}, True for the real tokens of the batch the models ran on"
        )


def _nan_source(model: nn.Module, name: str, call: Call, compare: _Compare) -> str:
    """Where a module's NaN or inf output comes from: its input, a parameter, or the module."""
    if not compare.finite(call.input):
        return "its input already holds NaN or inf (computed between the hooked modules)"
    for param, value in model.get_submodule(name).named_parameters():
        if not bool(torch.isfinite(value).all()):
            return f"its parameter {name}.{param} holds NaN or inf (a weight not loaded?)"
    return ("its input and parameters are finite, so the module itself produced them (an "
            "overflow, a division by zero, a fully masked row?)")


def _computes_nothing(module: nn.Module) -> bool:
    """Identity and dropout (in eval mode) pass their input through unchanged."""
    return isinstance(module, (nn.Identity, nn.Dropout))


def _check_locator_args(
    reference: object, candidate: object, run_reference: object, run_candidate: object,
    pairs: object, attention_mask: object, atol: object, rtol: object,
) -> Callable:
    """Check first_divergence's arguments; return the function that runs the candidate."""
    for name, model in (("reference", reference), ("candidate", candidate)):
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{name} must be a torch.nn.Module, got {type(model).__name__}; for a "
                "PretrainedEncoder pass its .model"
            )
    for name, model in (("reference", reference), ("candidate", candidate)):
        require_deterministic(name, model)
    how = "a function that runs the model on the input"
    require_callable("run_reference", run_reference, how, "e.g. lambda m: m(ids)")
    if run_candidate is not None:
        require_callable("run_candidate", run_candidate, how, "e.g. lambda m: m(ids)")
    if pairs is not None:
        if not isinstance(pairs, Mapping):
            raise TypeError(
                f"pairs must be a dict {{candidate module name: reference module name}}, got "
                f"{type(pairs).__name__}"
            )
        known = dict(reference.named_modules())  # (candidate names may be missing: reported)
        absent = [n for n in pairs.values() if n not in known]
        if absent:
            raise ValueError(
                f"pairs names reference modules that do not exist: {absent[:5]}; the "
                f"reference's modules include {list(known)[1:6]}"
            )
    if attention_mask is not None:
        require_bool_mask("attention_mask", attention_mask)
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask should have shape (B, T), got "
                             f"{shape_of(attention_mask)}")
        if not bool(attention_mask.any()):
            raise ValueError(f"attention_mask (shape {shape_of(attention_mask)}) has no True "
                             "entry, so no token would be compared: True marks the real tokens")
    require_non_negative_number("atol", atol)
    require_non_negative_number("rtol", rtol)
    return run_reference if run_candidate is None else run_candidate


# --------------------------------------------------------------------------------------------
# Diagnosis: look for the fingerprints of the known mistakes


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_layer_norm(module: nn.Module) -> bool:
    return isinstance(getattr(module, "eps", None), float) and hasattr(module, "weight")


@dataclass
class _Scene:
    """Everything the diagnosis may look at."""

    reference: nn.Module
    candidate: nn.Module
    ref_calls: dict[str, Call]
    cand_calls: dict[str, Call]
    compare: _Compare
    compared: list[tuple[str, str, float]]
    unmatched: list[str]
    cand_name: str
    ref_name: str
    run_candidate: Callable[[nn.Module], Any]

    def module(self, name: str) -> nn.Module:
        return self.candidate.get_submodule(name)

    def agrees_once(self, fix: Callable[[nn.Module], None]) -> bool:
        """Whether the divergent module agrees with the reference when a copy of the
        candidate, changed by ``fix``, runs again: did what ``fix`` changes cause it?"""
        fixed = copy.deepcopy(self.candidate)
        with torch.no_grad():
            fix(fixed)
            with record_calls(fixed, {self.cand_name}) as calls:
                self.run_candidate(fixed)
        call = calls.get(self.cand_name)
        return call is not None and self.compare.same(call.out,
                                                      self.ref_calls[self.ref_name].out)

    def divergence(self, diff: float, tol: float) -> Divergence:
        cand_in = self.cand_calls[self.cand_name].input
        ref_in = self.ref_calls[self.ref_name].input
        agreed = None
        if isinstance(cand_in, torch.Tensor) and isinstance(ref_in, torch.Tensor) \
                and cand_in.shape == ref_in.shape and cand_in.is_floating_point():
            agreed = self.compare.same(cand_in, ref_in)
        elif isinstance(cand_in, torch.Tensor) and isinstance(ref_in, torch.Tensor) \
                and cand_in.shape == ref_in.shape:
            agreed = bool(torch.equal(cand_in, ref_in))
        cause, detail = self.diagnose(agreed)
        return Divergence(self.cand_name, self.ref_name, diff, tol, agreed, cause,
                          HINTS[cause].format(detail=detail))

    def diagnose(self, input_agreed: bool | None) -> tuple[str, str]:
        call = self.cand_calls[self.cand_name]
        if not self.compare.finite(call.out):
            return "non_finite", _nan_source(self.candidate, self.cand_name, call,
                                             self.compare)
        suspects = [_eps_suspect, _activation_suspect, _token_type_suspect]
        suspects += [_linear_suspect] if input_agreed else [_norm_order_suspect,
                                                            _attention_layout_suspect]
        for suspect in suspects:
            found = suspect(self)
            if found is not None:
                return found
        if input_agreed:
            return "unknown", (
                f"{self.cand_name} got the same input as the reference's {self.ref_name} but "
                "computed something else: compare its parameters and settings"
            )
        return "unknown", (
            f"the input of {self.cand_name} already differs although every module compared "
            "before it agreed: the difference arises in code between the hooked modules (a "
            "residual connection, the order of the norms, an activation, a mask)"
        )


def _eps_suspect(scene: _Scene) -> tuple[str, str] | None:
    """Some of the candidate's LayerNorms have another eps than the reference's, and with the
    reference's eps the first module that differs agrees: the eps alone explains it. (A wrong
    eps that this module does not depend on enough to matter is not blamed: the mistake that
    shows here is another one.)"""
    fixes = _eps_fixes(scene)

    def use_reference_eps(model: nn.Module) -> None:
        for name, eps in fixes.items():
            model.get_submodule(name).eps = eps

    if not fixes or not scene.agrees_once(use_reference_eps):
        return None
    name, eps = next(iter(fixes.items()))
    return "layer_norm_eps", (
        f"the candidate's {name} has eps={scene.module(name).eps:g} where the reference uses "
        f"eps={eps:g}{f' (and {len(fixes) - 1} more LayerNorms)' if len(fixes) > 1 else ''}; "
        f"with the reference's eps, {scene.cand_name} agrees"
    )


def _eps_fixes(scene: _Scene) -> dict[str, float]:
    """{candidate LayerNorm: the reference's eps} for those whose eps differs: paired ones
    compared so far get their partner's eps, the others (inside the divergent module, e.g. a
    block's norms) the reference's eps when all its LayerNorms share one."""
    ref_eps = {m.eps for m in scene.reference.modules() if _is_layer_norm(m)}
    fixes = {}
    for cand_name, ref_name, _ in scene.compared:
        ours, theirs = scene.module(cand_name), scene.reference.get_submodule(ref_name)
        if _is_layer_norm(ours) and _is_layer_norm(theirs) and ours.eps != theirs.eps:
            fixes[cand_name] = theirs.eps
    if len(ref_eps) == 1:
        (eps,) = ref_eps
        for name in scene.cand_calls:
            module = scene.module(name)
            if name not in fixes and _is_layer_norm(module) and module.eps != eps:
                fixes[name] = eps
    return fixes


def _activation_suspect(scene: _Scene) -> tuple[str, str] | None:
    """A feed-forward network compared so far received another activation of the same
    pre-activations than the reference's, and with the reference's activation the first module
    that differs agrees."""
    fixes = {}  # feed-forward name -> the reference's activation
    for cand_name, ref_name, _ in scene.compared:
        ff_name = _parent(cand_name)
        ff = scene.module(ff_name) if ff_name else None
        fc1 = scene.cand_calls.get(_join(ff_name, "fc1"))
        if ff is None or fc1 is None or getattr(ff, "fc2", None) is not scene.module(cand_name):
            continue
        pre = fc1.out  # (B, T, F) the pre-activation, which agreed
        ref_fc1 = scene.ref_calls.get(_join(_parent(ref_name), "fc1"))  # same layout: exact
        ref_pre = pre if ref_fc1 is None else ref_fc1.out
        ref_act = _which_activation(scene.compare, ref_pre, scene.ref_calls[ref_name].input)
        cand_act = _which_activation(scene.compare, pre, scene.cand_calls[cand_name].input)
        if ref_act and cand_act and ref_act != cand_act:
            fixes[ff_name] = (ref_act, cand_act, ref_name)

    def use_reference_activations(model: nn.Module) -> None:
        for name, (act, _, _) in fixes.items():
            ff = model.get_submodule(name)
            ff.activation_name, ff.activation = act, get_activation(act)

    if not fixes or not scene.agrees_once(use_reference_activations):
        return None
    ff_name, (ref_act, cand_act, ref_name) = next(iter(fixes.items()))
    return "activation", (
        f"the candidate's {ff_name} applies {cand_act!r}, but the reference's {ref_name} "
        f"receives {ref_act!r} of the same pre-activations"
    )


def _which_activation(compare: _Compare, pre: Any, post: Any) -> str | None:
    if not isinstance(pre, torch.Tensor) or not isinstance(post, torch.Tensor):
        return None
    # the closest one, not the first within tolerance: GELU's two forms differ by about 1e-4
    gaps = {name: compare.gap(fn(pre), post) for name, fn in ACTIVATIONS.items()}
    best = min(gaps, key=lambda name: gaps[name][0])
    return best if gaps[best][0] <= gaps[best][1] else None


def _token_type_suspect(scene: _Scene) -> tuple[str, str] | None:
    """The input differs from the reference's by one vector, the same at every position."""
    cand_in = scene.cand_calls[scene.cand_name].input
    ref_in = scene.ref_calls[scene.ref_name].input
    if not isinstance(cand_in, torch.Tensor) or not isinstance(ref_in, torch.Tensor) \
            or cand_in.shape != ref_in.shape or cand_in.dim() != 3:
        return None
    gap = scene.compare._flat(ref_in) - scene.compare._flat(cand_in)  # (N, D) real tokens
    shift = gap.mean(0)  # (D,)
    _, tol = scene.compare.gap(ref_in, ref_in)
    if float(shift.abs().max()) <= tol or float((gap - shift).abs().max()) > tol:
        return None
    missing = [name for name in scene.unmatched if "type" in name or "segment" in name]
    also = f"; {', '.join(missing)} ran in the reference and has no counterpart" if missing \
        else ""
    return "token_types", (
        f"the input of the candidate's {scene.cand_name} lacks the same vector (norm "
        f"{float(shift.norm()):.3g}) at every token{also}"
    )


QKV = ("W_q", "W_k", "W_v")


def _linear_suspect(scene: _Scene) -> tuple[str, str] | None:
    """Same input, other output, and both modules hold a weight matrix: compare the weights."""
    ours = scene.module(scene.cand_name)
    theirs = scene.reference.get_submodule(scene.ref_name)
    w, w_ref = getattr(ours, "weight", None), getattr(theirs, "weight", None)
    if not isinstance(w, torch.Tensor) or not isinstance(w_ref, torch.Tensor) or w.dim() != 2 \
            or w_ref.dim() != 2:
        return None
    close = _Compare(None, scene.compare.atol, scene.compare.rtol).same
    where = f"the candidate's {scene.cand_name}.weight"
    if w.shape == w_ref.T.shape and close(w, w_ref.T):
        return "transposed_weight", f"{where} equals the transpose of the reference's"
    if w.shape == w_ref.shape and w.shape[0] % 3 == 0:
        for order in itertools.permutations(range(3)):
            if order != (0, 1, 2) and close(w, _reorder(w_ref, order)):
                names = "; ".join(QKV[i] for i in order)
                return "qkv_layout", f"{where} holds the reference's rows in the order [{names}]"
    if w.shape != w_ref.shape or not close(w, w_ref):
        return "weights", f"{where} differs from the reference's {scene.ref_name}.weight"
    return "weights", f"the weights agree; {scene.cand_name}'s bias or settings differ"


def _reorder(t: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """t's three row blocks (e.g. [W_q; W_k; W_v]) stacked in ``order``."""
    chunks = t.chunk(3, dim=0)
    return torch.cat([chunks[i] for i in order], dim=0)


def _ancestors(name: str) -> list[str]:
    """``a.b.c`` -> [``a.b.c``, ``a.b``, ``a``] (the module and the modules holding it)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _norm_order_suspect(scene: _Scene) -> tuple[str, str] | None:
    """The divergent module (or a module holding it) reads LN(x), where x is the input of a
    block that holds that LayerNorm: the block normalises before its sublayer (pre-norm)."""
    path = _ancestors(scene.cand_name)
    for depth, block_name in enumerate(path[1:], start=1):
        block, call = scene.module(block_name), scene.cand_calls.get(block_name)
        norms = {n: m for n, m in block.named_children() if _is_layer_norm(m)}
        if call is None or not norms or not isinstance(call.input, torch.Tensor):
            continue
        for inner in path[:depth]:
            inner_in = scene.cand_calls[inner].input if inner in scene.cand_calls else None
            for norm_name, norm in norms.items():
                if isinstance(inner_in, torch.Tensor) and inner_in.shape == call.input.shape \
                        and scene.compare.same(inner_in, norm(call.input)):
                    flag = " (norm_first=True)" if getattr(block, "norm_first", None) else ""
                    return "norm_order", (
                        f"the candidate's {inner} reads {_join(block_name, norm_name)}(x), the "
                        f"normalised input of {block_name}: a pre-norm block{flag}"
                    )
    return None


def _attention_layout_suspect(scene: _Scene) -> tuple[str, str] | None:
    """An attention layer whose output matches the reference once its fused q/k/v rows are
    put in another order."""
    for name in _ancestors(scene.cand_name)[:2]:
        attention, call = scene.module(name), scene.cand_calls.get(name)
        qkv = getattr(attention, "qkv_proj", None)
        out_proj = getattr(attention, "out_proj", None)
        if call is None or not isinstance(qkv, nn.Linear) or not isinstance(out_proj, nn.Linear):
            continue
        if scene.module(scene.cand_name) not in (attention, out_proj):
            continue
        target = scene.ref_calls[scene.ref_name].out
        for order in itertools.permutations(range(3)):
            if order == (0, 1, 2):
                continue
            trial = copy.deepcopy(attention)
            with torch.no_grad():
                inverse = tuple(order.index(i) for i in range(3))
                trial.qkv_proj.weight.copy_(_reorder(qkv.weight, inverse))
                if qkv.bias is not None:
                    trial.qkv_proj.bias.copy_(_reorder(qkv.bias, inverse))
                out = _first_tensor(trial(*call.args, **call.kwargs))
            if scene.compare.same(out, target):
                names = "; ".join(QKV[i] for i in order)
                return "qkv_layout", (
                    f"the candidate's {name}.qkv_proj stacks its rows as [{names}]: reordered "
                    f"to [W_q; W_k; W_v] it reproduces the reference's {scene.ref_name}"
                )
    return None


# --------------------------------------------------------------------------------------------
# Mistakes to find


def inject_mistake(model: nn.Module, mistake: str) -> nn.Module:
    """A copy of a course_lib model with one deliberate mistake (the model is not changed).

    Args:
        model: an Encoder, DecoderLM or EncoderDecoder (or a module holding course_lib
            blocks), e.g. ``load_pretrained_encoder().model``.
        mistake: one of :data:`MISTAKES`:
            ``"layer_norm_eps"``, ``"activation"``, ``"norm_order"``, ``"token_types"``,
            ``"qkv_layout"``, ``"transposed_weight"``.

    Returns:
        The modified copy, in the same mode (train/eval) as ``model``.

    Raises:
        ValueError: unknown mistake, or the model has nothing it applies to (e.g.
            ``"token_types"`` for a model without segment embeddings).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    require_choice("mistake", mistake, tuple(MISTAKES))
    broken = copy.deepcopy(model)
    changed = 0
    with torch.no_grad():
        for module in broken.modules():
            changed += _break(module, mistake)
    if not changed:
        raise ValueError(
            f"mistake={mistake!r} does not apply to this model: it has no "
            f"{_TARGETS[mistake]}"
        )
    return broken


_OTHER_GELU = {"gelu": "gelu_tanh", "gelu_tanh": "gelu"}
_TARGETS = {
    "layer_norm_eps": "nn.LayerNorm", "activation": "FeedForward with GELU",
    "norm_order": "post-norm EncoderBlock or DecoderBlock",
    "token_types": "token-type embeddings (Embeddings.token_type)",
    "qkv_layout": "MultiHeadAttention", "transposed_weight": "MultiHeadAttention",
}


def _break(module: nn.Module, mistake: str) -> int:
    """Apply ``mistake`` to this one module if it is of the kind the mistake targets;
    return 1 if it was changed."""
    if mistake == "layer_norm_eps" and isinstance(module, nn.LayerNorm):
        module.eps = 1e-5 if module.eps != 1e-5 else 1e-12
    elif mistake == "activation" and isinstance(module, FeedForward) \
            and module.activation_name in _OTHER_GELU:
        other = _OTHER_GELU[module.activation_name]
        module.activation_name, module.activation = other, get_activation(other)
    elif mistake == "norm_order" and isinstance(module, (EncoderBlock, DecoderBlock)) \
            and not module.norm_first:
        module.norm_first = True
    elif mistake == "token_types" and isinstance(module, Embeddings) \
            and module.token_type is not None:
        module.token_type = None
    elif mistake == "qkv_layout" and isinstance(module, MultiHeadAttention):
        module.qkv_proj.weight.copy_(_reorder(module.qkv_proj.weight, (1, 0, 2)))
        if module.qkv_proj.bias is not None:
            module.qkv_proj.bias.copy_(_reorder(module.qkv_proj.bias, (1, 0, 2)))
    elif mistake == "transposed_weight" and isinstance(module, MultiHeadAttention):
        module.out_proj.weight.copy_(module.out_proj.weight.T.clone())
    else:
        return 0
    return 1
