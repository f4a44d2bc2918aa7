"""Argument checks that turn a learner's mistake into a message naming the problem.

A public function checks its arguments in one line, then computes. A wrong shape or dtype fails
at the call the learner wrote, with the argument's name, what it received and what was expected,
not three frames deep inside torch. A wrong type raises ``TypeError``, anything else
``ValueError``.

One rule, one place: integers (numpy ones too), numbers, probabilities, token ids, shapes and
dtypes are checked only here.

Library code calling library code (a block calling attention, a model calling its blocks) has
checked already: it runs the inner calls inside :func:`inputs_checked`, and each module's own
check helper (at the bottom of the module) starts with ``if not checks_wanted(): return``. The
generic rules below always check. Modules still run through ``module(...)``, so forward hooks see
every call.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

_INPUTS_CHECKED = contextvars.ContextVar("course_lib_inputs_checked", default=False)


@contextlib.contextmanager
def inputs_checked() -> Iterator[None]:
    """Within this block, course_lib's check helpers return at once: the caller checked."""
    if torch.compiler.is_compiling():  # checks_wanted() is False anyway: nothing to set
        yield
        return
    token = _INPUTS_CHECKED.set(True)
    try:
        yield
    finally:
        _INPUTS_CHECKED.reset(token)


def checks_wanted() -> bool:
    """False inside :func:`inputs_checked`, i.e. when a library caller has checked already,
    and while ``torch.compile`` traces a model: the eager call checks, the compiled graph holds
    only the maths (a check that reads a value or a context variable would break the graph)."""
    if torch.compiler.is_compiling():
        return False
    return not _INPUTS_CHECKED.get()


def shape_of(x: torch.Tensor) -> str:
    """A tensor's shape as a tuple, e.g. ``(2, 3, 4)``."""
    return str(tuple(x.shape))


def _conversion(name: str, dtype: torch.dtype) -> str:
    """The call that converts tensor ``name`` to ``dtype``, e.g. ``x.float()``."""
    method = {torch.float32: "float", torch.float64: "double", torch.float16: "half",
              torch.bfloat16: "bfloat16"}.get(dtype)
    return f"{name}.{method}()" if method else f"{name}.to({dtype})"


# ---------------------------------------------------------------------------------- tensors


def require_tensor(name: str, x: object) -> torch.Tensor:
    """``x``, if it is a tensor; ``TypeError`` otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_ndim(name: str, x: object, allowed: Sequence[int], expected: str) -> torch.Tensor:
    """``x``, if it is a tensor with one of the ``allowed`` numbers of dimensions; ``expected``
    is the shape in legend letters, e.g. ``"(B, T, D) or (T, D)"``."""
    if require_tensor(name, x).dim() not in allowed:
        raise ValueError(f"{name} should have shape {expected}, got shape {shape_of(x)}")
    return x


def require_size(name: str, x: torch.Tensor, dim: int, size: int, what: str) -> None:
    """``x.shape[dim]`` must be ``size`` (``what`` names where that size comes from)."""
    if x.shape[dim] != size:
        raise ValueError(f"{name} has shape {shape_of(x)}: dimension {dim} should be {what}={size}")


def require_features(name: str, x: torch.Tensor, size: int, what: str) -> None:
    """The last dimension of ``x`` must be ``size`` (named ``what``, e.g. ``"d_model"``)."""
    if x.dim() == 0 or x.shape[-1] != size:
        raise ValueError(f"{name} has shape {shape_of(x)}; its last dim should be {what}={size}")


def require_broadcastable(name: str, x: torch.Tensor, target: Sequence[int], expected: str) -> None:
    """``x`` must broadcast to the scores' shape ``target`` without growing it."""
    try:
        ok = tuple(torch.broadcast_shapes(x.shape, tuple(target))) == tuple(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} has shape {shape_of(x)}, which does not broadcast to the "
                         f"scores' shape {tuple(target)}; expected {expected}")


def check_shapes(**specs: tuple[torch.Tensor | None, str]) -> None:
    """Raise unless every tensor has the shape its legend spells, one size per letter across
    all of them, e.g. ``check_shapes(W=(W, "H H"), x=(x, "B? T Din"))``. Letters ending in
    ``?`` may all be missing (an unbatched input); None tensors are skipped. Name weights
    first: a message then blames the input."""
    sizes: dict[str, tuple[int, str]] = {}
    for name, (x, legend) in specs.items():
        if x is None:
            continue
        full = [letter.rstrip("?") for letter in legend.split()]
        short = [letter for letter in legend.split() if not letter.endswith("?")]
        expected = " or ".join(dict.fromkeys(f"({', '.join(s)}{',' * (len(s) == 1)})"
                                             for s in (full, short)))
        require_ndim(name, x, (len(full), len(short)), expected)
        for letter, size in zip(full if x.dim() == len(full) else short, x.shape, strict=True):
            seen, where = sizes.setdefault(letter, (size, name))
            if size != seen:
                raise ValueError(f"{name} has shape {shape_of(x)}: {letter}={size}, but {where} "
                                 f"has {letter}={seen} ({name} should be {expected})")


def require_floating(name: str, x: torch.Tensor) -> None:
    """``x`` must hold floating-point numbers."""
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be floating-point, got {x.dtype}; use {name}.float()")


def require_integer_tensor(name: str, x: torch.Tensor, what: str = "integers") -> None:
    """``x`` must hold integers, not bools (``what`` says what they are, e.g. "token ids")."""
    if x.dtype == torch.bool or x.is_floating_point() or x.is_complex():
        raise ValueError(f"{name} must hold {what} (integers), got {x.dtype}; use {name}.long()")


def require_float_dtype(name: str, dtype: object) -> torch.dtype:
    """``dtype``, if it is a floating-point ``torch.dtype`` (for ``dtype=`` arguments)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype such as torch.float32, got {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype (e.g. torch.float32), got {dtype}")
    return dtype


def require_same_dtype(tensors: Mapping[str, torch.Tensor | None]) -> torch.dtype:
    """All the given tensors (None skipped) must share the first one's dtype: list weights
    first, so the message names the input to convert. Returns the common dtype."""
    present = [(name, t) for name, t in tensors.items() if t is not None]
    ref_name, ref = present[0]
    for name, t in present[1:]:
        require_dtype_of(name, t, ref, ref_name)
    return ref.dtype


def require_dtype_of(name: str, x: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """``x`` must have the dtype of ``reference`` (``what`` names it, e.g. a layer's weights)."""
    numpy = " (numpy arrays arrive as float64)" if x.dtype == torch.float64 else ""
    if x.dtype != reference.dtype:
        raise ValueError(f"{name} has dtype {x.dtype} but {what} are {reference.dtype}: "
                         f"use {_conversion(name, reference.dtype)}{numpy}")


def require_finite(name: str, x: torch.Tensor, why: str = "") -> None:
    """Floating ``x`` must hold no NaN or inf (``why`` says why). This reads the values (a GPU
    sync): use it in analysis tools, never in a training step."""
    bad = ~torch.isfinite(x) if (x.is_floating_point() or x.is_complex()) else None
    if bad is not None and bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"{name} holds {int(bad.sum())} NaN or inf value(s), the first at "
                         f"{where}; it must be finite" + (f": {why}" if why else ""))


def values_checked(t: torch.Tensor) -> bool:
    """Whether checks may read ``t``'s values: free on the CPU; on a GPU it would wait for every
    queued kernel, so value checks are skipped there (shapes are always checked), and so they
    are while ``torch.compile`` traces (reading a value breaks the graph)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


# ------------------------------------------------------------------------------------ masks


def require_bool_mask(name: str, mask: object) -> torch.Tensor:
    """``mask``, if it is a boolean tensor (True = may attend)."""
    if require_tensor(name, mask).dtype != torch.bool:
        fix = (f"; a 0/1 mask becomes {name}.bool(), an additive 0/-inf mask is an attn_bias"
               if torch.is_floating_point(mask) else "")
        raise ValueError(f"{name} must be a boolean tensor (True = attend), got {mask.dtype}{fix}")
    return mask


def require_padding_mask(name: str, mask: object, shape: Sequence[int],
                         expected: str) -> None:
    """A padding mask (True/1 = a real token), or None.

    Boolean and 0/1 integer masks (what Hugging Face tokenizers return) are accepted; a float
    mask is refused: attention would add it to the scores, so a 0/1 float mask would mask
    nothing. ``shape`` is the shape it must have, ``expected`` says so in words.
    """
    if mask is None:
        return
    if require_tensor(name, mask).is_floating_point() or mask.is_complex():
        raise ValueError(f"{name} must be bool or 0/1 integers (True/1 = a real token), got "
                         f"{mask.dtype}; use {name}.bool()")
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {shape_of(mask)} but {expected}")


# ------------------------------------------------------------------------ numbers and flags


def _wrong_int(name: str, value: object, needed: str) -> TypeError:
    """The error for a non-integer where an integer is needed, with the fix when obvious."""
    got, fix = f"{value!r} ({type(value).__name__})", ""
    if isinstance(value, float) and value.is_integer():
        fix = f"; write {int(value)}"
    elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
        fix = f"; write {int(value)} without quotes"
    elif isinstance(value, torch.Tensor):
        got = f"a tensor of shape {shape_of(value)}"
        fix = "; pass a Python int (a size such as x.shape[1], or int(t) for a 0-D tensor t)"
    return TypeError(f"{name} must be {needed}, got {got}{fix}")


def require_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as an int, if it is an integer (numpy ones too, not a bool) >= ``minimum``."""
    needed = "an integer" if minimum is None else f"an integer >= {minimum}"
    # torch.SymInt: a size under torch.compile with dynamic shapes
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise _wrong_int(name, value, needed)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {needed}, got {value!r}")
    return value if isinstance(value, torch.SymInt) else int(value)


def require_positive_int(name: str, value: object) -> int:
    """``value`` as an int, if it is an integer >= 1."""
    return require_int(name, value, minimum=1)


def require_non_negative_int(name: str, value: object) -> int:
    """``value`` as an int, if it is an integer >= 0."""
    return require_int(name, value, minimum=0)


def check_positive_ints(**values: object) -> None:
    """Every keyword's value must be an integer >= 1, e.g.
    ``check_positive_ints(d_model=d_model, n_heads=n_heads)``."""
    for name, value in values.items():
        require_int(name, value, minimum=1)


def _require_real(name: str, value: object, expected: str, ok: Callable[[float], bool],
                  hint: str = "") -> float:
    """``value`` as a float, if it is a finite real number (not a bool) with ``ok(value)``."""
    hint = f"; {hint}" if hint else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__}){hint}")
    if not (math.isfinite(value) and ok(value)):
        raise ValueError(f"{name} must be {expected}, got {value!r}{hint}")
    return float(value)


def require_positive_number(name: str, value: object, hint: str = "") -> float:
    """``value`` as a float, if it is a finite number > 0 (a base, a scale); ``hint`` (how to
    get a good value) ends the message."""
    return _require_real(name, value, "a number > 0", lambda v: v > 0, hint)


def require_non_negative_number(name: str, value: object) -> float:
    """``value`` as a float, if it is a finite number >= 0 (a tolerance)."""
    return _require_real(name, value, "a number >= 0", lambda v: v >= 0)


def require_probability(name: str, value: object) -> float:
    """``value`` as a float, if it is a number in [0, 1) (a dropout probability)."""
    return _require_real(name, value, "a number in [0, 1)", lambda v: 0 <= v < 1)


def require_bool(name: str, value: object) -> bool:
    """``value``, if it is True or False (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_bools(**values: object) -> None:
    """Every keyword's value must be True or False."""
    for name, value in values.items():
        require_bool(name, value)


def check_text(name: str, text: object) -> None:
    """``text`` must be a str (bytes are named, with the fix)."""
    if not isinstance(text, str):
        fix = f"; decode bytes first: {name}.decode('utf-8')" if isinstance(text, bytes) else ""
        raise TypeError(f"{name} must be a str, got {type(text).__name__}{fix}")


def require_choice(name: str, value: object, options: Sequence[object]) -> object:
    """``value``, if it is one of ``options``."""
    if value not in options:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, options))}; got {value!r}")
    return value


def require_callable(name: str, fn: object, expected: str, hint: str = "", *,
                     n_args: int | None = None) -> Callable:
    """``fn``, if it can be called (with ``n_args`` positional arguments, when given);
    ``expected`` says what it should be (``"a function of x"``), ``hint`` how to get one
    (``"wrap the call in a lambda: lambda: model(x)"``)."""
    hint = f"; {hint}" if hint else ""
    if not callable(fn):
        raise TypeError(f"{name} must be {expected}, got {type(fn).__name__}{hint}")
    if n_args is not None:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # some builtins have none: trust them
            return fn
        try:
            signature.bind(*range(n_args))
        except TypeError:
            raise TypeError(f"{name} must be {expected}: it is called with {n_args} arguments, "
                            f"but its signature is {signature}{hint}") from None
    return fn


def require_instance(name: str, value: object, types: type | tuple[type, ...],
                     expected: str, hint: str = "") -> object:
    """``value``, if it is an instance of ``types``; ``expected`` says what it should be,
    ``hint`` how to get one."""
    if not isinstance(value, types):
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
        shown = shown.replace("\n", " ")
        hint = f"; {hint}" if hint else ""
        raise TypeError(f"{name} must be {expected}, got {shown} ({type(value).__name__}){hint}")
    return value


def require_writable_file(name: str, path: str | os.PathLike) -> Path:
    """``path`` as a Path, if it names a file that can be written: its folder exists and it is
    not itself a folder. Nothing is created."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{name} must be a file path, got the folder {str(path)!r}: name a "
                         f"file in it, e.g. {str(path / 'run.pt')!r}")
    if not path.parent.is_dir():
        raise ValueError(f"{name} must be a file path in an existing folder, got {str(path)!r} "
                         f"but there is no folder {str(path.parent)!r}: create it first "
                         "(Path(...).mkdir(parents=True))")
    return path


def require_generator(name: str, generator: object) -> torch.Generator | None:
    """``generator``, if it is None or a ``torch.Generator``."""
    if generator is not None:
        require_instance(name, generator, torch.Generator, "a torch.Generator or None",
                         "for a seed s pass torch.Generator().manual_seed(s)")
    return generator


# -------------------------------------------------------------------------------- token ids


def check_token_ids(name: str, ids: object, vocab_size: int) -> None:
    """``ids`` must be a non-empty (B, T) integer tensor of ids below ``vocab_size``."""
    require_ndim(name, ids, (2,), f"(B, T) of token ids (for one sequence use {name}[None])")
    require_integer_tensor(name, ids, "token ids")
    if ids.numel() == 0:
        raise ValueError(f"{name} is empty (shape {shape_of(ids)}): give one or more tokens")
    if values_checked(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{name} holds ids {int(ids.min())}..{int(ids.max())}; valid ids are "
                         f"0..{vocab_size - 1} (vocab_size={vocab_size})")


def require_id(name: str, value: object, vocab_size: int, *, also: tuple[int, ...] = ()) -> int:
    """``value`` as an int, if it is an id 0..vocab_size-1 or one of ``also`` (e.g. -100)."""
    value = require_int(name, value)
    if not (0 <= value < vocab_size or value in also):
        extra = "".join(f" or {a}" for a in also)
        raise ValueError(f"{name} is {value}; valid ids are 0..{vocab_size - 1}{extra} "
                         f"(vocab_size={vocab_size})")
    return value


def require_id_list(
    name: str, ids: object, vocab_size: int, *, also: tuple[int, ...] = ()
) -> list[int]:
    """``ids`` (a list of ints or a 0-D/1-D integer tensor) as a list of ints, each checked by
    :func:`require_id`, so a wrong id fails naming it (a negative one does not count from the
    end)."""
    if isinstance(ids, torch.Tensor):
        require_ndim(name, ids, (0, 1), "(T,) (one sequence at a time)")
        require_integer_tensor(name, ids, "token ids")
        ids = ids.reshape(-1).tolist()
    elif isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"{name} must be a list or 1-D tensor of ids, got {type(ids).__name__}")
    return [require_id(f"{name}[{i}]", idx, vocab_size, also=also) for i, idx in enumerate(ids)]
