"""Argument checks that turn a learner's mistake into a message naming the problem.

Every public function in course_lib calls these before doing any tensor work, so a wrong shape
or dtype fails at the call the learner wrote, with the argument's name, what it received and
what was expected -- not three frames deep inside torch.

Rules: tensors (require_tensor, require_ndim, require_size, require_features,
require_broadcastable, require_bool_mask); dtypes (require_floating, require_integer_tensor,
require_float_dtype, require_same_dtype, require_dtype_of); plain values (require_int,
require_positive_int, require_non_negative_int, require_positive_number,
require_non_negative_number, require_probability, require_bool, require_choice,
require_callable). A wrong type raises :class:`WrongTypeError`, a TypeError that is also a
ValueError. require_finite reads tensor values (a GPU sync): keep it out of training
steps.

Modules that call other course_lib modules (a block calling attention, a model calling its
blocks) have checked the inputs already: they run the inner calls inside
:func:`inputs_checked`, and the inner modules skip their checks (they still run through
``module(...)``, so forward hooks see every call).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch


class WrongTypeError(TypeError, ValueError):
    """An argument of the wrong type (a float where an int is needed, a string for a number).

    It is a ``TypeError``, and also a ``ValueError`` so that code catching the ``ValueError``
    these checks raised before keeps working.
    """


def _type_name(value: object) -> str:
    return type(value).__name__


def shape_of(x: torch.Tensor) -> str:
    """Format a tensor's shape as a tuple, e.g. ``(2, 3, 4)`` or ``(3,)``."""
    return str(tuple(x.shape))


def require_tensor(name: str, x: object) -> torch.Tensor:
    """Raise ``TypeError`` unless ``x`` is a tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_ndim(name: str, x: object, allowed: Sequence[int], expected: str) -> torch.Tensor:
    """Raise ``ValueError`` unless ``x`` has one of the ``allowed`` numbers of dimensions.

    Args:
        name: argument name as the learner wrote it, e.g. ``"q"``.
        x: the value received.
        allowed: accepted values of ``x.dim()``.
        expected: the expected shape in legend letters, e.g. ``"(B, T, D) or (T, D)"``.
    """
    x = require_tensor(name, x)
    if x.dim() not in allowed:
        raise ValueError(
            f"{name} should have shape {expected}, but got a {x.dim()}-D tensor of shape "
            f"{shape_of(x)}"
        )
    return x


def require_size(name: str, x: torch.Tensor, dim: int, size: int, what: str) -> None:
    """Raise ``ValueError`` unless ``x.shape[dim] == size`` (``what`` names the source of size)."""
    if x.shape[dim] != size:
        raise ValueError(
            f"{name} has size {x.shape[dim]} in dimension {dim} (shape {shape_of(x)}), "
            f"but {what} is {size}"
        )


def require_floating(name: str, x: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``x`` holds floating-point numbers."""
    if not torch.is_floating_point(x):
        raise ValueError(
            f"{name} must be a floating-point tensor, got dtype {x.dtype}; "
            f"convert it with {name}.float()"
        )


def require_integer_tensor(name: str, x: torch.Tensor, what: str = "integers") -> None:
    """Raise ``ValueError`` unless ``x`` holds integers (not bool): token ids, positions.

    ``what`` says what the integers are, e.g. ``"token ids"``.
    """
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise ValueError(
            f"{name} must hold {what} (an integer tensor), got dtype {x.dtype}; "
            f"convert it with {name}.long()"
        )


def require_float_dtype(name: str, dtype: object) -> torch.dtype:
    """Raise unless ``dtype`` is a floating-point ``torch.dtype`` (for ``dtype=`` arguments)."""
    if not isinstance(dtype, torch.dtype):
        raise WrongTypeError(
            f"{name} must be a torch.dtype such as torch.float32, got {dtype!r} "
            f"({_type_name(dtype)})"
        )
    if not dtype.is_floating_point:
        raise ValueError(
            f"{name} must be a floating-point dtype such as torch.float32, got {dtype}: "
            "integer values would be truncated"
        )
    return dtype


def _conversion(name: str, dtype: torch.dtype) -> str:
    """The call that converts tensor ``name`` to ``dtype``, e.g. ``x.float()``."""
    method = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
              torch.bfloat16: "bfloat16"}.get(dtype)
    return f"{name}.{method}()" if method else f"{name}.to({dtype})"


def require_same_dtype(tensors: Mapping[str, torch.Tensor | None]) -> torch.dtype:
    """Raise ``ValueError`` unless all the given tensors (``None`` skipped) share one dtype.

    The first tensor is the reference, so list weights first: the message then names the
    input to convert, e.g. ``{"W": W, "U": U, "x": x}``. Returns the common dtype.
    """
    present = [(name, t) for name, t in tensors.items() if t is not None]
    ref_name, ref = present[0]
    for name, t in present[1:]:
        if t.dtype != ref.dtype:
            raise ValueError(
                f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}: "
                f"{', '.join(n for n, _ in present)} must all have one dtype; convert it with "
                f"{_conversion(name, ref.dtype)}"
                + (" (numpy arrays arrive as float64)" if t.dtype == torch.float64 else "")
            )
    return ref.dtype


def require_finite(name: str, x: torch.Tensor, why: str = "") -> None:
    """Raise ``ValueError`` if floating ``x`` holds NaN or inf, naming the first such entry.

    ``why`` adds the reason finite values are needed. This reads the tensor's values (a GPU
    sync): use it in analysis tools and set-up code, never in a training step.
    """
    if not (x.is_floating_point() or x.is_complex()):
        return
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(
            f"{name} contains {int(bad.sum())} NaN or inf value(s), the first at index "
            f"{where} ({x[where].item()}); it must hold finite numbers"
            + (f": {why}" if why else "")
        )


def require_bool_mask(name: str, mask: object) -> torch.Tensor:
    """Raise ``ValueError`` unless ``mask`` is a boolean tensor (True = may attend)."""
    mask = require_tensor(name, mask)
    if mask.dtype != torch.bool:
        hint = ""
        if torch.is_floating_point(mask):
            hint = (
                f". A 0/1 float mask becomes a boolean one with {name}.bool(); an additive mask "
                f"of 0 / -inf is a bias, not a mask: pass it as bias=..., or turn it into a "
                f"boolean mask with ({name} == 0)"
            )
        raise ValueError(
            f"{name} must be a boolean tensor where True means 'may attend', got dtype "
            f"{mask.dtype}{hint}"
        )
    return mask


def require_broadcastable(
    name: str, x: torch.Tensor, target: Sequence[int], expected: str
) -> None:
    """Raise ``ValueError`` unless ``x`` broadcasts to ``target`` without growing it."""
    try:
        ok = tuple(torch.broadcast_shapes(x.shape, tuple(target))) == tuple(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"{name} has shape {shape_of(x)}, which does not broadcast to the attention scores' "
            f"shape ({', '.join(str(s) for s in target)}); expected {expected}"
        )


def _not_an_int(value: object) -> bool:
    # torch.SymInt: a size under torch.compile with dynamic shapes
    return isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt))


def _as_int(value: object) -> int:
    return value if isinstance(value, torch.SymInt) else int(value)


def _wrong_int(name: str, value: object, needed: str) -> WrongTypeError:
    """The error for a non-integer where an integer is needed, with the fix when obvious."""
    got, hint = f"{value!r} ({_type_name(value)})", ""
    if isinstance(value, float) and value.is_integer():
        hint = f"; write {int(value)}"
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        hint = f"; write {int(value)} without quotes"
    elif isinstance(value, torch.Tensor):
        got = f"a tensor of shape {shape_of(value)} and dtype {value.dtype}"
        hint = "; pass a Python int (a size such as x.shape[1], or int(t) for a 0-D tensor t)"
    return WrongTypeError(f"{name} must be {needed}, got {got}{hint}")


def require_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int; raise unless it is an integer (not a bool) >= ``minimum``.

    A float such as ``64.0``, a string such as ``"64"`` or a bool raises ``WrongTypeError``
    (a TypeError that is also a ValueError); a value below ``minimum`` raises ``ValueError``.
    NumPy integers are accepted.
    """
    needed = "an integer" if minimum is None else f"an integer >= {minimum}"
    if _not_an_int(value):
        raise _wrong_int(name, value, needed)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {needed}, got {value!r}")
    return _as_int(value)


def require_positive_int(name: str, value: object) -> int:
    """Raise unless ``value`` is an int >= 1 (``WrongTypeError`` for floats, strings, bools)."""
    if _not_an_int(value):
        raise _wrong_int(name, value, "a positive integer")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return _as_int(value)


def require_non_negative_int(name: str, value: object) -> int:
    """Raise unless ``value`` is an int >= 0 (``WrongTypeError`` for floats, strings, bools)."""
    return require_int(name, value, minimum=0)


def _require_real(name: str, value: object, expected: str, hint: str = "") -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WrongTypeError(
            f"{name} must be {expected}, got {value!r} ({_type_name(value)}){hint}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}{hint}")
    return float(value)


def require_positive_number(name: str, value: object, hint: str = "") -> float:
    """Raise unless ``value`` is a finite real number > 0 (a base, a scale); return it as float.
    ``hint`` (how to get a good value) ends the message."""
    hint = f"; {hint}" if hint else ""
    number = _require_real(name, value, "a number > 0", hint)
    if not number > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}{hint}")
    return number


def require_non_negative_number(name: str, value: object) -> float:
    """Raise unless ``value`` is a finite real number >= 0 (a tolerance); return it as float."""
    number = _require_real(name, value, "a number >= 0")
    if not number >= 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return number


def require_bool(name: str, value: object) -> bool:
    """Raise ``WrongTypeError`` unless ``value`` is True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise WrongTypeError(f"{name} must be True or False, got {value!r} ({_type_name(value)})")
    return value


def require_callable(name: str, fn: object, expected: str, hint: str = "") -> Callable:
    """Raise ``WrongTypeError`` unless ``fn`` can be called.

    ``expected`` says what it should be (``"a function of x"``); ``hint`` how to get one
    (``"wrap the call in a lambda: lambda: model(x)"``).
    """
    if not callable(fn):
        raise WrongTypeError(
            f"{name} must be {expected}, got {_type_name(fn)}" + (f"; {hint}" if hint else "")
        )
    return fn


def require_probability(name: str, value: object) -> float:
    """Raise unless ``value`` is a number in [0, 1) (a dropout probability)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise WrongTypeError(f"{name} must be a number in [0, 1), got {value!r}")
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value}")
    return float(value)


def require_choice(name: str, value: object, options: Sequence[object]) -> object:
    """Raise ``ValueError`` unless ``value`` is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def require_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """Raise ``ValueError`` unless the last dimension of ``x`` is ``size`` (named ``what``)."""
    if x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(
            f"{name} has shape {shape_of(x)} but its last dimension should be {what}={size}"
        )


def require_dtype_of(name: str, x: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Raise ``ValueError`` unless ``x`` has the dtype of ``reference`` (e.g. a layer's weight).

    The usual culprits are float64 arrays from numpy and integer tensors.
    """
    if x.dtype != reference.dtype:
        raise ValueError(
            f"{name} has dtype {x.dtype} but {what} are {reference.dtype}: convert it with "
            f"{_conversion(name, reference.dtype)}"
            + (" (numpy arrays arrive as float64)" if x.dtype == torch.float64 else "")
        )


def values_checked(t: torch.Tensor) -> bool:
    """Whether checks may read ``t``'s values: on the CPU it is free; on a GPU it would wait
    for every queued kernel, so value checks are skipped there (shapes are always checked)."""
    return t.device.type == "cpu"


def check_token_ids(name: str, ids: object, vocab_size: int, max_len: int | None = None) -> None:
    """Raise unless ``ids`` is a non-empty (B, T) integer tensor of ids below ``vocab_size``
    (and, given ``max_len``, at most ``max_len`` long)."""
    require_ndim(name, ids, (2,), f"(B, T) of token ids (for one sequence use {name}[None])")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}; "
                         f"convert with {name}.long()")
    if ids.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {shape_of(ids)}): give at least one token")
    if max_len is not None and ids.shape[1] > max_len:
        raise ValueError(
            f"{name} has {ids.shape[1]} tokens (shape {shape_of(ids)}), longer than this model's "
            f"context of max_len={max_len} tokens; crop it to its last {max_len} tokens"
        )
    if values_checked(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{name} holds ids from {int(ids.min())} to {int(ids.max())}, but the vocabulary has "
            f"{vocab_size} entries (valid ids are 0..{vocab_size - 1})"
        )


_INPUTS_CHECKED = contextvars.ContextVar("course_lib_inputs_checked", default=False)


@contextlib.contextmanager
def inputs_checked() -> Iterator[None]:
    """Within this block, course_lib modules skip their argument checks: the caller (a block
    or a model) validated the inputs at its own boundary."""
    token = _INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        _INPUTS_CHECKED.reset(token)


def checks_wanted() -> bool:
    """False inside :func:`inputs_checked`, i.e. when a library caller has checked already."""
    return not _INPUTS_CHECKED.get()


def require_padding_mask(name: str, mask: object, shape: Sequence[int],
                         expected: str) -> torch.Tensor | None:
    """Return a padding mask (True/1 = a real token) as a boolean tensor, None for None.

    Boolean masks pass as they are; 0/1 integer masks (what Hugging Face tokenizers return)
    become ``mask != 0``. A float mask is refused: attention would add it to the scores as a
    bias, and a 0/1 float mask would then mask nothing. ``shape`` is the shape it must have,
    ``expected`` says so in words (e.g. ``"should match ids's shape (2, 5)"``).
    """
    if mask is None:
        return None
    mask = require_tensor(name, mask)
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"{name} must be a boolean (or 0/1 integer) tensor where True/1 marks a real token, "
            f"got dtype {mask.dtype}: a float mask would be added to the attention scores, not "
            f"mask them. Convert a 0/1 mask with {name}.bool() (an additive 0/-inf mask with "
            f"{name} == 0)"
        )
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {shape_of(mask)} but {expected} "
                         "(True marks real tokens, False padding)")
    return mask if mask.dtype == torch.bool else mask != 0


def require_max_length(name: str, ids: torch.Tensor, limit: int | None, limit_name: str) -> None:
    """Raise ``ValueError`` if (B, T) ``ids`` hold more than ``limit`` tokens (None: no limit);
    ``limit_name`` is the limit as the learner set it, e.g. ``"max_src_len"``."""
    if limit is not None and ids.shape[1] > limit:
        raise ValueError(
            f"{name} has {ids.shape[1]} tokens (shape {shape_of(ids)}), longer than this model's "
            f"context of {limit_name}={limit} tokens; crop it to its last {limit} tokens"
        )


def require_generator(name: str, generator: object) -> torch.Generator | None:
    """Raise ``WrongTypeError`` unless ``generator`` is None or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise WrongTypeError(
            f"{name} must be a torch.Generator or None, got {generator!r} "
            f"({_type_name(generator)}); for a seed s pass torch.Generator().manual_seed(s)"
        )
    return generator


def check_id(name: str, value: object, vocab_size: int, *, also: tuple[int, ...] = ()) -> int:
    """``value`` as an int: an id of a vocabulary of ``vocab_size`` entries (0..vocab_size-1)
    or one of ``also`` (e.g. -100); raise naming ``name`` otherwise."""
    value = require_int(name, value)
    if not (0 <= value < vocab_size or value in also):
        extra = "".join(f" or {a}" for a in also)
        raise ValueError(f"{name} is {value}, but valid ids are integers 0..{vocab_size - 1}"
                         f"{extra} (the vocabulary has {vocab_size} entries)")
    return value


def check_id_list(
    name: str, ids: object, vocab_size: int, *, also: tuple[int, ...] = ()
) -> list[int]:
    """``ids`` (a list of ints or a 0-D/1-D integer tensor) as a list of ints, each checked by
    :func:`check_id`: what decode-style functions call first, so a wrong id fails naming it,
    not with an IndexError (and a negative id does not silently count from the end)."""
    if isinstance(ids, torch.Tensor):
        require_ndim(name, ids, (0, 1), "(T,) (one sequence at a time)")
        require_integer_tensor(name, ids, "token ids")
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise WrongTypeError(f"{name} must be a list or 1-D tensor of token ids, got "
                             f"{ids!r:.60} ({type(ids).__name__})")
    return [check_id(f"{name}[{i}]", idx, vocab_size, also=also) for i, idx in enumerate(ids)]
