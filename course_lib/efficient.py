"""Efficient attention: the cost of softmax(q k^T / sqrt(Dh)) v, and three ways to lower it.

Shape legend: B batch, H heads, T query length, S key/value length, Dh query/key size, Dv value
size, W window, R rank. ``(...)`` stands for any leading batch-like dimensions, e.g. (B, H).

Exact attention builds a (T, S) score matrix for every example and head: its time and memory
grow with T * S, i.e. quadratically in the sequence length n. What is here:

* **Chunked attention** (:func:`chunked_attention`) computes *exactly* the same output, block of
  queries by block of keys, with an online softmax (:func:`online_softmax_step`): a running
  maximum and a running sum per query, rescaled whenever the maximum grows. Only one
  (block, block) tile of scores exists at a time, so the extra memory is O(n), not O(n^2).
  This is the algorithm of FlashAttention, written in plain PyTorch to be read, not to be fast.
* **Sliding-window attention** (:func:`sliding_window_attention`, :func:`sliding_window_mask`)
  lets each query see only its ``window`` nearest keys (itself included) and computes only that
  band: O(n W) time and memory. It is exact attention *with a band mask*, not an approximation
  of full attention.
* **Low-rank attention** (:func:`low_rank_attention`, Linformer-style) projects the S keys and
  values down to R rows with (R, S) matrices: O(n R), an approximation of full attention.

And the tools to measure the cost: :func:`score_matrix_bytes` (the arithmetic) and
:func:`peak_memory` (a measurement on any device, CPU included).

Masks follow the course's convention (True = may attend) and a query with no allowed key gets a
zero output, as in :mod:`course_lib.attention`. The causal switch is called ``causal``, not
``is_causal``: when T < S the queries are the *last* T positions (query t sits at key position
t + S - T, as in :func:`course_lib.causal_mask` and ``torch.nn.attention.bias.causal_lower_right``),
whereas ``F.scaled_dot_product_attention(is_causal=True)`` aligns the mask with the *first* keys.
For T == S the two agree.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ._validate import (
    require_bool,
    require_callable,
    require_float_dtype,
    require_floating,
    require_ndim,
    require_positive_int,
    require_tensor,
    shape_of,
)

# the attention module's private helpers, shared inside the library on purpose: one set of
# q/k/v and scale checks and one softmax (zeros, not NaN, for a row with no allowed key) for
# every path
from .attention import _check_qkv, _check_scale, _softmax

# ---------------------------------------------------------------------------------- measuring


def score_matrix_bytes(
    batch: int,
    heads: int,
    n_queries: int,
    n_keys: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> int:
    """Bytes of one (B, H, T, S) score matrix: B * H * T * S * bytes per element.

    Naive attention holds at least one such matrix (usually two: the scores and the weights).

    Args:
        batch, heads: B and H.
        n_queries: T.
        n_keys: S (defaults to T, self-attention).
        dtype: the element type; float32 takes 4 bytes, float16 and bfloat16 take 2.

    Returns:
        The size in bytes, an int.
    """
    for name, value in (("batch", batch), ("heads", heads), ("n_queries", n_queries)):
        require_positive_int(name, value)
    n_keys = n_queries if n_keys is None else require_positive_int("n_keys", n_keys)
    require_float_dtype("dtype", dtype)
    return batch * heads * n_queries * n_keys * dtype.itemsize


class _TensorMemory(TorchDispatchMode):
    """Adds up the bytes of every storage created by an operator while active, and subtracts
    them again when the storage is freed; keeps the largest total seen."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
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
        key = storage._cdata
        if key in self._alive:
            return
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))

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

    Every operator that runs inside ``fn`` is intercepted (a ``TorchDispatchMode``): each new
    tensor storage adds its size, and its release (the last tensor using it is gone)
    subtracts it. The result is the largest total, relative to the start of the call: memory
    beyond what existed before (the inputs are not counted, nor are views of them or in-place
    results). PyTorch exposes no running peak for the CPU allocator (CUDA has
    ``torch.cuda.max_memory_allocated``; ``torch.profiler`` with ``profile_memory=True`` records
    CPU allocation events, slowly); this count is exact and repeatable, and works on the
    ``meta`` device, because it counts tensors rather than reading the process's memory.

    What it does not see:

    * scratch memory a single kernel allocates and frees inside itself (the per-thread buffers
      of a fused attention kernel, a matmul's workspace);
    * the allocator's rounding and caching: it counts ``storage.nbytes()``, not the block the
      allocator handed out;
    * memory released when ``fn`` drops the last reference to a tensor that existed before
      the call (it was never counted, so its release is not subtracted either);
    * growth of an existing storage in place, by ``out=`` arguments or ``resize_``.

    Args:
        fn: a function with no arguments, e.g. ``lambda: attention(q, k, v)``. Its result is
            dropped before returning, so the output counts while it is alive inside ``fn``.

    Returns:
        Peak bytes, an int.
    """
    require_callable("fn", fn, "a function with no arguments",
                     "wrap the call in a lambda, e.g. lambda: chunked_attention(q, k, v, "
                     "block_size=64)")
    tracker = _TensorMemory()
    with tracker:
        result = fn()
        del result
    return tracker.peak


# ------------------------------------------------------------------------------ online softmax


def online_softmax_step(
    row_max: torch.Tensor, row_sum: torch.Tensor, scores: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of the online softmax: fold a new block of scores into the running statistics.

    With m the largest score seen so far and l = sum_j exp(s_j - m), a block of new scores
    gives m' = max(m, max(block)) and l' = l * exp(m - m') + sum exp(block - m'): the old sum
    was measured against the old maximum, so it is rescaled to the new one.

    Args:
        row_max: m, shape (..., 1); -inf before the first block.
        row_sum: l, shape (..., 1); 0 before the first block.
        scores: the new block, shape (..., b); -inf entries are masked keys.

    Returns:
        ``(row_max, row_sum, rescale, probs)``: the new m' and l' (..., 1), the factor
        exp(m - m') (..., 1) that rescales anything summed against the old maximum, and
        exp(block - m') (..., b).
    """
    new_max = torch.maximum(row_max, scores.amax(dim=-1, keepdim=True))  # (..., 1)
    # a row with no allowed key yet has m' = -inf: shift by 0 so that exp gives 0, not NaN
    shift = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))  # (..., 1)
    rescale = torch.exp(row_max - shift)  # exp(m - m'), (..., 1)
    probs = torch.exp(scores - shift)  # exp(s - m'), (..., b)
    new_sum = row_sum * rescale + probs.sum(dim=-1, keepdim=True)  # l', (..., 1)
    return new_max, new_sum, rescale, probs


def online_softmax_stats(blocks: Iterable[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax's maximum and normaliser of a row that arrives in blocks, in one pass.

    softmax(x)_j = exp(x_j - m) / l with m = max_j x_j and l = sum_j exp(x_j - m); this finds m
    and l while seeing each block once, never the whole row (see :func:`online_softmax_step`).
    ``m + log(l)`` is ``torch.logsumexp`` of the whole row.

    Args:
        blocks: tensors of shape (..., b_i) with the same leading dimensions, the row's pieces
            in order (the last dimension may differ from block to block).

    Returns:
        ``(row_max, row_sum)``, each of shape (...).
    """
    row_max = row_sum = None
    for i, block in enumerate(blocks):
        name = f"blocks[{i}]"
        require_tensor(name, block)
        require_floating(name, block)
        if block.dim() == 0:
            raise ValueError(f"{name} is a 0-D tensor; each block must have shape (..., b)")
        if row_max is None:
            row_max = block.new_full((*block.shape[:-1], 1), float("-inf"))  # (..., 1)
            row_sum = block.new_zeros((*block.shape[:-1], 1))  # (..., 1)
        elif block.shape[:-1] != row_max.shape[:-1]:
            raise ValueError(
                f"{name} has shape {shape_of(block)} but the first block's leading dimensions "
                f"are {tuple(row_max.shape[:-1])}; every block must have shape (..., b)"
            )
        row_max, row_sum, _, _ = online_softmax_step(row_max, row_sum, block)
    if row_max is None:
        raise ValueError("blocks is empty; give at least one block of scores")
    return row_max.squeeze(-1), row_sum.squeeze(-1)  # (...), (...)


# --------------------------------------------------------------------------- chunked attention


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact attention, softmax(q k^T / sqrt(Dh)) v, without ever building the (T, S) matrix.

    The queries are taken ``block_size`` at a time; for each block the keys and values are
    read ``block_size`` at a time too, and an online softmax (running maximum, running sum and
    running output, rescaled whenever the maximum grows) combines the tiles. The result equals
    exact attention up to float rounding. Extra memory: the output plus a few
    (block_size, block_size) temporaries per example and head (a tile's scores, their
    exponentials, and the previous tile's until they are replaced), i.e. O(n) instead of O(n^2).

    With ``causal`` the key blocks entirely in a query block's future are skipped (about half
    the work), and only the tiles on the diagonal are masked. The mask is aligned with the
    *last* keys, like :func:`course_lib.causal_mask` and
    ``torch.nn.attention.bias.causal_lower_right``: query t sees keys s <= t + S - T. (That is
    why the argument is not called ``is_causal``: ``F.scaled_dot_product_attention`` aligns
    its ``is_causal`` mask with the first keys when T != S. For T == S they agree.)

    Only the forward pass saves memory here: autograd would keep every tile for the backward
    pass. FlashAttention avoids that by recomputing the tiles during the backward pass.

    Args:
        q: queries, shape (..., T, Dh).
        k: keys, shape (..., S, Dh).
        v: values, shape (..., S, Dv).
        block_size: queries and keys per tile, >= 1 (need not divide T or S).
        causal: apply the future mask, aligned with the last keys (see above).
        scale: multiplier of the scores; defaults to 1/sqrt(Dh).

    Returns:
        out, shape (..., T, Dv); a query with no allowed key gets zeros.
    """
    _check_qkv(q, k, v)
    block_size = require_positive_int("block_size", block_size)
    require_bool("causal", causal)
    _check_scale(scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seq_len, src_len = q.shape[-2], k.shape[-2]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (..., T, Dv), filled block by block
    for start in range(0, seq_len, block_size):
        q_block = q[..., start:start + block_size, :]  # (..., bq, Dh)
        first = start + src_len - seq_len  # key position of the block's first query
        out[..., start:start + block_size, :] = _attend_query_block(
            q_block, k, v, first, block_size, causal, scale)  # (..., bq, Dv)
    return out


def _attend_query_block(
    q_block: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    block_size: int,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """One block of queries against every key block, combined by the online softmax."""
    n_q, src_len = q_block.shape[-2], k.shape[-2]
    row_max = q_block.new_full((*q_block.shape[:-1], 1), float("-inf"))  # m, (..., bq, 1)
    row_sum = q_block.new_zeros((*q_block.shape[:-1], 1))  # l, (..., bq, 1)
    acc = q_block.new_zeros((*q_block.shape[:-1], v.shape[-1]))  # sum_j e^(s_j - m) v_j
    last_key = min(src_len - 1, first + n_q - 1) if causal else src_len - 1
    q_pos = torch.arange(first, first + n_q, device=q_block.device)  # (bq,)
    for k_start in range(0, last_key + 1, block_size):
        k_block = k[..., k_start:k_start + block_size, :]  # (..., bk, Dh)
        scores = (q_block @ k_block.transpose(-2, -1)) * scale  # q k^T / sqrt(Dh), (..., bq, bk)
        if causal and k_start + k_block.shape[-2] - 1 > first:  # tile crosses the diagonal
            k_pos = k_start + torch.arange(k_block.shape[-2], device=q_block.device)  # (bk,)
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        row_max, row_sum, rescale, probs = online_softmax_step(row_max, row_sum, scores)
        acc = acc * rescale + probs @ v[..., k_start:k_start + block_size, :]  # (..., bq, Dv)
    # a query with no allowed key has l = 0 and acc = 0: divide by 1 to return zeros
    return acc / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))  # (..., bq, Dv)


# ---------------------------------------------------------------------- sliding-window attention


def sliding_window_mask(
    n_queries: int,
    window: int,
    *,
    n_keys: int | None = None,
    causal: bool = True,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The band mask of sliding-window attention; the window counts the token itself.

    Causal (the default): query t sees the ``window`` most recent positions, itself included,
    keys s with t - window < s <= t. With ``window=1`` a token sees only itself; with
    window >= n this is the causal mask. (Hugging Face's sliding-window mask, used by its
    Mistral models, keeps keys with kv_idx > q_idx - window: the same convention. A
    description such as "positions i - W to i" counts W + 1 keys, so check the convention
    before comparing numbers.)
    Not causal: query t sees keys s with |t - s| < window, itself and window - 1 neighbours on
    each side (2 * window - 1 keys away from the edges). Hugging Face's bidirectional window
    keeps |q_idx - kv_idx| <= W: ours with ``window=W + 1``.

    Args:
        n_queries: T.
        window: W >= 1, keys per query counting the query's own position.
        n_keys: S (defaults to T); when S > T the queries are the last T positions (query t
            sits at position t + S - T, as in :func:`course_lib.causal_mask`).
        causal: only past keys (True) or both sides (False).
        device: where to build the mask.

    Returns:
        Boolean (T, S), True = may attend.
    """
    require_positive_int("n_queries", n_queries)
    window = require_positive_int("window", window)
    n_keys = n_queries if n_keys is None else require_positive_int("n_keys", n_keys)
    require_bool("causal", causal)
    q_pos = torch.arange(n_keys - n_queries, n_keys, device=device)  # (T,) key position of query t
    distance = q_pos[:, None] - torch.arange(n_keys, device=device)[None, :]  # t - s, (T, S)
    if causal:
        return (distance >= 0) & (distance < window)  # (T, S)
    return distance.abs() < window  # (T, S)


def sliding_window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    window: int,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Self-attention restricted to a band of ``window`` keys per query, computing only the band.

    Equal to exact attention with :func:`sliding_window_mask` (the window counts the token
    itself), but the (n, n) matrix is never built: the queries are cut into blocks of
    ``b = min(window, n)`` and each block is scored only against the keys its band can reach
    (``b + w - 1`` keys, or ``b + 2 (w - 1)`` without the causal mask, where
    ``w = min(window, n)``: a window longer than the sequence reaches no further than its
    ends), gathered with ``unfold``. Time and memory grow like n * min(window, n). About half
    of each block's scores fall outside the band, so for window >= n / 2 this costs as much
    as full attention or more: the band pays off when window << n.

    Args:
        q: queries, shape (..., n, Dh).
        k: keys, shape (..., n, Dh) (self-attention: as many keys as queries).
        v: values, shape (..., n, Dv).
        window: W >= 1, keys per query counting itself.
        causal: only the past (True, the default) or both sides (False). T == S here, so
            this is the same mask as ``F.scaled_dot_product_attention(is_causal=True)``
            intersected with the band.
        scale: multiplier of the scores; defaults to 1/sqrt(Dh).

    Returns:
        out, shape (..., n, Dv).
    """
    _check_qkv(q, k, v)
    if k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"sliding_window_attention is self-attention over one sequence: q has "
            f"{q.shape[-2]} positions (shape {shape_of(q)}) but k has {k.shape[-2]} (shape "
            f"{shape_of(k)}). For queries that are the last T of S keys (a cache), use "
            "scaled_dot_product_attention with sliding_window_mask(T, window, n_keys=S)"
        )
    window = require_positive_int("window", window)
    require_bool("causal", causal)
    _check_scale(scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n = q.shape[-2]
    block = min(window, n)  # also the reach: no key lies more than n - 1 positions away
    n_blocks = -(-n // block)
    pad = n_blocks * block - n  # the last query block is padded to full size
    before, after = block - 1, (0 if causal else block - 1)  # keys before / after each query
    q_blocks = F.pad(q, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block))  # (..., nb, b, Dh)
    k_t = _key_windows(k, before, after, pad, block)  # (..., nb, Dh, c), c = b + before + after
    v_win = _key_windows(v, before, after, pad, block).transpose(-2, -1)  # (..., nb, c, Dv)
    scores = (q_blocks @ k_t) * scale  # q k^T / sqrt(Dh) inside the band, (..., nb, b, c)
    keep = _band(n, block, n_blocks, before, after, q.device)  # (nb, b, c)
    weights = _softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)  # (..., nb, b, c)
    out = weights @ v_win  # (..., nb, b, Dv)
    return out.flatten(-3, -2)[..., :n, :]  # (..., n, Dv)


def _key_windows(
    x: torch.Tensor, before: int, after: int, pad: int, block: int
) -> torch.Tensor:
    """For query block j, the positions j*block - before ... (j+1)*block - 1 + after of x,
    zero-padded outside 0..n-1 (``pad`` more rows at the end fill the last, short block):
    (..., n, d) -> (..., n_blocks, d, block + before + after).

    ``unfold`` returns a view (no copy): consecutive windows overlap in memory."""
    padded = F.pad(x, (0, 0, before, after + pad))  # (..., before + n + pad + after, d)
    return padded.unfold(-2, block + before + after, block)  # (..., nb, d, c)


def _band(n: int, block: int, n_blocks: int, before: int, after: int,
          device: torch.device) -> torch.Tensor:
    """Which (query, key) pairs of each block's tile are inside the band and the sequence."""
    i = torch.arange(block, device=device)[:, None]  # (b, 1) query within the block
    c = torch.arange(block + before + after, device=device)[None, :]  # (1, c) key in the tile
    distance = i - c + before  # query position - key position, (b, c)
    in_band = (distance >= -after) & (distance <= before)  # (b, c)
    key_pos = torch.arange(n_blocks, device=device)[:, None] * block - before + c  # (nb, c)
    in_sequence = (key_pos >= 0) & (key_pos < n)  # (nb, c), padding is never attended to
    return in_band[None] & in_sequence[:, None, :]  # (nb, b, c)


# -------------------------------------------------------------------------- low-rank attention


def low_rank_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    proj_k: torch.Tensor,
    proj_v: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Linformer-style attention: project the S keys and values down to R rows first.

    softmax(q (E k)^T / sqrt(Dh)) (F v) with E = ``proj_k`` and F = ``proj_v``, both (R, S).
    The score matrix is (T, R) instead of (T, S), so the cost grows like n * R. It can only
    approximate full attention when the (T, S) weight matrix is close to low rank, and only
    with good E and F: Linformer *learns* them with the rest of the model. Fixed random
    projections (entries N(0, 1/R)) plugged into a pretrained model are useless (chapter 10
    measures relative errors above 1, worse than an output of zeros); segment pooling is
    better but still far from exact. E and F have S columns, so they fix the key length: a
    model built this way takes sequences of exactly S positions (shorter ones padded). There
    is no causal mask: each projected row mixes every position.

    Args:
        q: queries (..., T, Dh).
        k: keys (..., S, Dh).
        v: values (..., S, Dv).
        proj_k: E, shape (R, S).
        proj_v: F, shape (R, S); defaults to ``proj_k`` (one shared projection).
        scale: multiplier of the scores; defaults to 1/sqrt(Dh).

    Returns:
        out, shape (..., T, Dv).
    """
    _check_qkv(q, k, v)
    proj_v = proj_k if proj_v is None else proj_v
    for name, proj in (("proj_k", proj_k), ("proj_v", proj_v)):
        require_ndim(name, proj, (2,), "(R, S)")
        require_floating(name, proj)
        if proj.shape[-1] != k.shape[-2] or proj.dtype != k.dtype:
            raise ValueError(
                f"{name} has shape {shape_of(proj)} and dtype {proj.dtype}, but it must be "
                f"(R, S) with S = {k.shape[-2]} key positions (k has shape {shape_of(k)}) and "
                f"dtype {k.dtype}"
            )
        if proj.device != k.device:
            raise ValueError(f"{name} is on {proj.device} but k is on {k.device}; move it "
                             f"with {name}.to(k.device)")
    if proj_k.shape[0] != proj_v.shape[0]:
        raise ValueError(f"proj_k has {proj_k.shape[0]} rows but proj_v has {proj_v.shape[0]}; "
                         "both project to the same rank R")
    _check_scale(scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_low = proj_k @ k  # E k, (..., R, Dh)
    v_low = proj_v @ v  # F v, (..., R, Dv)
    scores = (q @ k_low.transpose(-2, -1)) * scale  # q (E k)^T / sqrt(Dh), (..., T, R)
    weights = _softmax(scores, dim=-1)  # (..., T, R)
    return weights @ v_low  # (..., T, Dv)
