"""The machinery behind every graded check.

A check runs the learner's function on a list of :class:`Case` objects (random and edge-case
inputs), compares each result with course_lib's reference implementation and, when they differ,
tries to recognise the mistake: it evaluates a few plausible wrong answers (softmax over the
wrong axis, a missing 1/sqrt(d), ...) and, if the learner's output matches one of them, says so.

Outcomes:
    * every case matches: a single line starting with a check mark is printed;
    * the exercise is still a stub: in a notebook (an IPython shell) the check prints one
      not-done line (:func:`course_lib.course.exercises.not_done_line`) and returns, so Run All
      goes on to the next exercise; elsewhere (a script, a test) the learner's
      ``NotImplementedError`` propagates unchanged;
    * anything else: :class:`CheckFailure` (an ``AssertionError``) with a message about the
      likely misconception and the case that exposed it.

Every public ``check_*`` function of a chapter module is wrapped by :func:`graded_check` (each
chapter module ends with ``wrap_checks(sys.modules[__name__])``). Besides the stub rule, the
wrapper makes IPython show an error from a check as its message alone: a :class:`CheckFailure`
as a header and its message, an error the learner's own code raised as its message and the
learner's lines, never the checker's frames (IPython renders an exception through its
``_render_traceback_``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import numbers
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from course_lib.course.exercises import is_stub_message, not_done_line

ATOL = 1e-5
RTOL = 1e-4


class CheckFailure(AssertionError):
    """A learner's function gave a wrong answer; the message says what looks wrong."""

    def _render_traceback_(self) -> list[str]:
        return render_error(self)


_CHECKS_DIR = f"{Path(__file__).resolve().parent}{os.sep}"
# Frames from these folders are not the learner's: course_lib (the checker and the library it
# calls), the standard library and installed packages (torch's own frames, IPython's).
_NOT_THE_LEARNERS = tuple(f"{p}{os.sep}" for p in {
    Path(__file__).resolve().parents[2], *(Path(sysconfig.get_path(k)).resolve()
                                          for k in ("stdlib", "purelib", "platlib"))})


def _learners_frames(tb) -> list[traceback.FrameSummary]:
    """The frames of ``tb`` below the checker's last frame that are the learner's own code."""
    frames = traceback.extract_tb(tb)
    files = [os.path.realpath(f.filename) for f in frames]
    checker = [i for i, name in enumerate(files) if name.startswith(_CHECKS_DIR)]
    start = checker[-1] + 1 if checker else 0
    return [f for f, name in zip(frames[start:], files[start:], strict=True)
            if not name.startswith(_NOT_THE_LEARNERS)]


def _where(filename: str) -> str:
    """``Cell In[5]`` for a notebook cell (as IPython names it), else ``File "path"``."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    format_name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    name = format_name(filename) if format_name is not None else None
    return f"{name[0]} {name[1]}" if name else f'File "{filename}"'


def render_error(exc: BaseException, check: str | None = None) -> list[str]:
    """How IPython shows an error from a check: a header and the message, then the learner's
    own lines that raised it (from the error itself or the error it was raised from), without
    the checker's frames."""
    check = check or getattr(exc, "course_check", None) or "the check"
    if isinstance(exc, CheckFailure):
        lines = [f"\u274c {check} found a problem:", str(exc)]
        raised = exc.__cause__
    else:
        lines = [f"\u274c {check} stopped: your code raised {type(exc).__name__}:", str(exc)]
        raised = exc
    frames = _learners_frames(raised.__traceback__) if raised is not None else []
    if frames:
        lines.append("Your code, where it was raised:")
        for f in frames:
            lines.append(f"  {_where(f.filename)}, line {f.lineno}, in {f.name}")
            if f.line:
                lines.append(f"    {f.line}")
    return lines


def _in_ipython() -> bool:
    """True inside an IPython shell (a Jupyter kernel): Run All must not stop at a stub there."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


_depth = 0  # how many graded checks are running (a check may call another)


def graded_check(check: Callable) -> Callable:
    """Wrap a public check: a stub is reported in one line in a notebook, and an error shows as
    its message and the learner's lines (see the module docstring)."""

    @functools.wraps(check)
    def run(*args: Any, **kwargs: Any) -> Any:
        global _depth
        _depth += 1
        try:
            return check(*args, **kwargs)
        except Exception as exc:
            if (isinstance(exc, NotImplementedError) and is_stub_message(str(exc))
                    and _depth == 1 and _in_ipython()):
                print(not_done_line(str(exc)))
                return None
            if getattr(exc, "course_check", None) is None:
                try:
                    exc.course_check = check.__name__  # the innermost check that saw it
                    if not isinstance(exc, CheckFailure):
                        exc._render_traceback_ = functools.partial(render_error, exc)
                except AttributeError:  # an exception class with __slots__: shown as usual
                    pass
            raise
        finally:
            _depth -= 1

    run.__course_graded__ = True
    return run


def wrap_checks(module: Any) -> None:
    """Wrap every public ``check_*`` function a chapter module defines with :func:`graded_check`."""
    for name, value in list(vars(module).items()):
        if (name.startswith("check_") and inspect.isfunction(value)
                and value.__module__ == module.__name__
                and not getattr(value, "__course_graded__", False)):
            setattr(module, name, graded_check(value))


@dataclass
class Case:
    """One set of inputs for the learner's function.

    Attributes:
        name: short description shown in messages, e.g. ``"batched, T=1"``.
        args: positional arguments.
        kwargs: keyword arguments.
        hint: added to the message when the learner's function raises on this case (e.g. a
            batched case: "transpose the last two dimensions, not all of them").
    """

    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    hint: str = ""


@dataclass
class Misconception:
    """A plausible wrong answer and what to tell a learner whose output matches it.

    Attributes:
        wrong: computes the wrong answer from the case's inputs (same arguments as the learner's
            function); may return None when it does not apply to a case.
        message: what to tell the learner.
    """

    wrong: Callable[..., Any]
    message: str


def _number_type_error(value: Any, what: str, kind: str, case: Case | None) -> CheckFailure:
    extra = ""
    if isinstance(value, torch.Tensor):
        extra = " (a tensor: turn it into a Python number with .item())"
    elif kind == "an int" and isinstance(value, numbers.Real) and not isinstance(value, bool):
        extra = f" ({value!r}: int(...) makes it an int)"
    elif kind == "a float" and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        extra = f" ({value!r}: float(...) makes it a float)"
    where = f" (case '{case.name}')" if case is not None else ""
    noun = "a whole number" if kind == "an int" else "a number"
    ask = "an int or a float" if kind == "a number" else kind
    return CheckFailure(f"{what} should be {noun}: return {ask}, but your function returned "
                        f"{describe(value)}{extra}{where}")


def require_count(value: Any, what: str, case: Case | None = None) -> int:
    """The one rule for a count (a rank, a number of parameters, bytes, ...): a Python int or a
    numpy integer. Floats (whole ones too), bools and tensors are refused, with a message that
    says how to convert them, in every check alike."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise _number_type_error(value, what, "an int", case)
    return int(value)


def require_real(value: Any, what: str, case: Case | None = None) -> float:
    """The one rule for a real number (a loss, a ratio, a score, ...): a Python float or a numpy
    floating scalar. Ints, bools and tensors (0-d ones too) are refused, with a message that
    says how to convert them, in every check alike."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, float | np.floating):
        raise _number_type_error(value, what, "a float", case)
    return float(value)


def require_number(value: Any, what: str, case: Case | None = None) -> float:
    """The one rule for a value the spec asks for as "a number" (a prediction, a divisor, a
    learning rate, ...): any real number, a Python or numpy int or float, so that ``4`` and
    ``4.0`` are the same answer. Bools and tensors (0-d ones too) are refused, with a message
    that says how to convert them."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
        raise _number_type_error(value, what, "a number", case)
    return float(value)


def describe(value: Any) -> str:
    """A short description of a value for messages: a tensor's shape and dtype, or its type."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} items"
    if value is None:
        return "None (did you forget to return the result?)"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _snapshot(values: Iterable[Any]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for v in values]


def _arg_names(fn: Callable, n_args: int) -> list[str]:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"argument {i + 1}" for i in range(n_args)]


def call_learner(fn: Callable, case: Case, *, fn_name: str | None = None) -> Any:
    """Call ``fn`` on a case and turn learner-side problems into clear messages.

    The inputs are copied first and compared afterwards, so a function that modifies its
    inputs in place is caught (and the caller's tensors are never touched).
    """
    name = fn_name or getattr(fn, "__name__", "your function")
    if not callable(fn):
        raise CheckFailure(f"expected a function, got {describe(fn)}")
    args = _snapshot(case.args)
    kwargs = dict(zip(case.kwargs, _snapshot(case.kwargs.values()), strict=True))
    before = _snapshot(args), _snapshot(kwargs.values())
    try:
        result = fn(*args, **kwargs)
    except NotImplementedError:
        raise  # an unsolved exercise: let it fail as itself
    except CheckFailure:
        raise
    except Exception as exc:
        raise CheckFailure(
            f"{name} raised {type(exc).__name__} on the case '{case.name}' "
            f"(inputs: {_describe_inputs(fn, case)}):\n    {exc}"
            + (f"\nHint: {case.hint}" if case.hint else "")
        ) from exc
    names = _arg_names(fn, len(args)) + list(kwargs)
    for arg_name, old, new in zip(names, [*before[0], *before[1]], [*args, *kwargs.values()],
                                  strict=True):
        if isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor):
            if old.shape != new.shape or not torch.equal(old, new):
                raise CheckFailure(
                    f"{name} changed its input '{arg_name}' in place (case '{case.name}'). "
                    f"Operations such as {arg_name} /= ..., {arg_name}[...] = ... or "
                    f"{arg_name}.mul_(...) overwrite the caller's tensor; compute a new tensor "
                    "instead."
                )
    return result


def prediction_dict(got: Any, keys: Sequence[str], fn_name: str) -> Mapping[str, Any]:
    """A learner's predictions as a mapping holding ``keys``, or a message saying what is off."""
    if not isinstance(got, Mapping):
        raise CheckFailure(f"{fn_name} should return a dict with the keys {list(keys)}, "
                           f"got {describe(got)}")
    missing = [k for k in keys if k not in got]
    if missing:
        raise CheckFailure(f"your dict lacks the key(s) {missing}; it needs {list(keys)}")
    return got


def _describe_inputs(fn: Callable, case: Case) -> str:
    names = _arg_names(fn, len(case.args))
    parts = [f"{n}: {describe(v)}" for n, v in zip(names, case.args, strict=True)]
    parts += [f"{k}: {describe(v)}" for k, v in case.kwargs.items()]
    return "; ".join(parts) if parts else "none"


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    if a.shape != b.shape:
        return False
    return bool(torch.allclose(a.double().cpu(), b.double().cpu(), atol=atol, rtol=rtol,
                               equal_nan=False))


def compare_tensors(
    got: Any,
    expected: torch.Tensor,
    case: Case,
    *,
    what: str,
    misconceptions: Sequence[Misconception] = (),
    atol: float = ATOL,
    rtol: float = RTOL,
) -> None:
    """Fail with a specific message unless ``got`` matches ``expected``.

    Order of diagnosis: not a tensor; a known misconception (checked even when the shape is
    wrong, since some mistakes change the shape); a wrong shape; NaN or inf; wrong values.
    """
    if not isinstance(got, torch.Tensor):
        hint = ""
        if isinstance(got, tuple) and any(isinstance(g, torch.Tensor) for g in got):
            hint = " Return only the tensor asked for, not a tuple."
        raise CheckFailure(
            f"{what} should be a tensor of shape {tuple(expected.shape)}, but your function "
            f"returned {describe(got)} (case '{case.name}').{hint}"
        )
    for m in misconceptions:
        try:
            wrong = m.wrong(*case.args, **case.kwargs)
        except Exception:  # this mistake cannot even be computed for this case: not it
            continue
        if isinstance(wrong, torch.Tensor) and _close(got, wrong, atol, rtol) and not _close(
            wrong, expected, atol, rtol
        ):
            raise CheckFailure(f"{m.message} (seen on the case '{case.name}')")
    if got.shape != expected.shape:
        raise CheckFailure(
            f"{what} has shape {tuple(got.shape)} but should have shape "
            f"{tuple(expected.shape)} (case '{case.name}')"
        )
    if not torch.isfinite(got).all() and torch.isfinite(expected).all():
        raise CheckFailure(
            f"{what} contains NaN or inf (case '{case.name}'); look for exp() of large numbers "
            "or a division by zero"
        )
    if not _close(got, expected, atol, rtol):
        diff = (got.double().cpu() - expected.double().cpu()).abs()
        where = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
        raise CheckFailure(
            f"{what} has the right shape but wrong values (case '{case.name}'): the largest "
            f"difference from the expected result is {float(diff.max()):.3g} at index {where}"
        )


def run_cases(
    name: str,
    fn: Callable,
    cases: Sequence[Case],
    check_one: Callable[[Any, Case], None],
) -> None:
    """Run every case through ``check_one(result, case)`` and print one pass line at the end."""
    for case in cases:
        result = call_learner(fn, case)
        check_one(result, case)
    labels = "; ".join(c.name for c in cases)
    print(f"\u2705 {name} is correct on all {len(cases)} test cases ({labels})")


def rand(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    """A float32 normal tensor from ``gen`` (checks are reproducible, not learner-seeded)."""
    return torch.randn(*shape, generator=gen) * scale
