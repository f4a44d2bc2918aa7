"""Instruments that watch PyTorch run a function: which attention kernel it reached
(:func:`kernel_used`), how much tensor memory it held at its peak (:func:`peak_memory`) and how
much autograd kept for the backward pass (:func:`saved_bytes`).

The first two intercept every low-level operator inside the function with a
``TorchDispatchMode``, the hook PyTorch calls for each operator before it runs (the same
mechanism as ``torch.utils.flop_counter.FlopCounterMode``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._validate import require_callable


class _OperatorNames(TorchDispatchMode):
    """Records the name of every low-level operator that runs while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def kernel_used(fn: Callable[[], Any]) -> str:
    """Which attention kernel a call runs: the name of the fused ``scaled_dot_product``
    operator it reached (e.g. ``_scaled_dot_product_flash_attention_for_cpu``), or
    ``"math path: op, op, ..."`` with the operators it ran instead. Every operator inside ``fn``
    is seen by a ``TorchDispatchMode``, the hook :func:`peak_memory` uses too.

    Args:
        fn: a function with no arguments, e.g. ``lambda: F.scaled_dot_product_attention(q, k, v)``.
    """
    require_callable("fn", fn, "a function with no arguments, called as fn()",
                     "wrap the call in a lambda: lambda: attention(q, k, v)", n_args=0)
    with _OperatorNames() as ops:
        fn()
    fused = [name for name in ops.names if "scaled_dot_product" in name]
    return fused[0] if fused else f"math path: {', '.join(dict.fromkeys(ops.names))}"


class _TensorMemory(TorchDispatchMode):
    """Adds up the bytes of every storage created by an operator while active, and subtracts
    them again when the storage is freed; keeps the largest total seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:
                self._track(t)  # a new allocation; views and in-place results are not
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key not in self._alive:
            self.live += size
            self.peak = max(self.peak, self.live)
            self._alive[key] = weakref.ref(storage, lambda _, k=key, n=size: self._free(k, n))

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._alive.pop(key, None)


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. sparse)
        return None


def peak_memory(fn: Callable[[], Any]) -> int:
    """Bytes of tensor memory that ``fn()`` allocates and holds at its peak, on any device.

    Every operator inside ``fn`` is intercepted (a ``TorchDispatchMode``): each new tensor
    storage adds its size, its release subtracts it; the result is the largest total beyond
    what existed before (inputs, views of them and in-place results are not counted). Exact,
    repeatable, and it works on the ``meta`` device. It does not see scratch memory inside one
    kernel (a fused kernel's buffers, a matmul's workspace), the allocator's rounding and
    caching, or storages grown in place (``out=``, ``resize_``).

    Args:
        fn: no arguments, e.g. ``lambda: attention(q, k, v)``; its result counts while alive
            inside ``fn``.

    Returns:
        Peak bytes, an int.
    """
    require_callable("fn", fn, "a function with no arguments, called as fn()",
                     "wrap the call in a lambda: lambda: attention(q, k, v)", n_args=0)
    tracker = _TensorMemory()
    with tracker:
        result = fn()
        del result
    return tracker.peak


def saved_bytes(fn: Callable[[], Any]) -> int:
    """Bytes that autograd keeps for the backward pass while ``fn()`` runs: the distinct
    storages of every tensor saved for backward (``saved_tensors_hooks`` sees each one), the
    inputs and weights it saves included. Exact and repeatable.

    Args:
        fn: no arguments, e.g. ``lambda: model(ids, targets=targets).loss``; call backward
            outside it.
    """
    require_callable("fn", fn, "a function with no arguments, called as fn()",
                     "wrap the call in a lambda: lambda: model(ids).logits", n_args=0)
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())
