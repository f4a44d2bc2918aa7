"""Efficient attention: the cost of softmax(q k^T / sqrt(Dh)) v, and three ways to lower it.

Shape legend: B batch, H heads, T query length, S key/value length, Dh query/key size, Dv value
size, W window, R rank; ``(...)`` stands for any leading dimensions, e.g. (B, H).

Exact attention builds a (T, S) score matrix per example and head: time and memory grow like n^2.

* :func:`chunked_attention`: *exact*, block by block, with an online softmax
  (:func:`online_softmax_step`): O(n) extra memory. FlashAttention's algorithm, in plain PyTorch.
* :func:`sliding_window_attention`: exact attention with a band mask
  (:func:`sliding_window_mask`), computing only the band: O(n W).
* :func:`low_rank_attention` (Linformer): keys and values projected to R rows: O(n R), approximate.

The cost is counted by :func:`score_matrix_bytes` (arithmetic) and measured by the instrument
:func:`course_lib.instruments.measure.peak_memory` (any device). Masks are True = may attend; a
query with no allowed key gets a zero output.
``is_causal`` is lower-right aligned: the T queries are the *last* T of S positions, as in
:func:`course_lib.causal_mask` and Hugging Face (``F.scaled_dot_product_attention`` aligns
top-left when T != S; for T == S they agree).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_dtype_of,
    require_float_dtype,
    require_floating,
    require_instance,
    require_ndim,
    shape_of,
)
from .attention import check_qkv, softmax

# ---------------------------------------------------------------------------------- measuring


def score_matrix_bytes(batch: int, heads: int, n_queries: int, n_keys: int | None = None,
                       dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one (B, H, T, S) score matrix: B * H * T * S * bytes per element (float32 4,
    float16 and bfloat16 2); naive attention holds at least one. ``n_keys`` defaults to T."""
    n_keys = n_queries if n_keys is None else n_keys
    check_positive_ints(batch=batch, heads=heads, n_queries=n_queries, n_keys=n_keys)
    require_float_dtype("dtype", dtype)
    return batch * heads * n_queries * n_keys * dtype.itemsize


# ------------------------------------------------------------------------------ online softmax


def online_softmax_step(row_max: torch.Tensor, row_sum: torch.Tensor, scores: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold a new block of scores into the running maximum m and sum l = sum_j exp(s_j - m).

    m' = max(m, max(block)), l' = l exp(m - m') + sum exp(block - m'): the old sum was measured
    against the old maximum, so it is rescaled to the new one.

    Args:
        row_max: m, (..., 1); -inf before the first block.
        row_sum: l, (..., 1); 0 before the first block.
        scores: the new block, (..., b); -inf entries are masked keys.

    Returns:
        ``(row_max, row_sum, rescale, probs)``: m' and l' (..., 1), exp(m - m') (..., 1) and
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
    """m = max_j x_j and l = sum_j exp(x_j - m) of a row that arrives in blocks, seeing each
    block once (softmax(x)_j = exp(x_j - m) / l; m + log(l) is the row's logsumexp).

    Args:
        blocks: the row's pieces in order, (..., b_i) each, with the same (...).

    Returns:
        ``(row_max, row_sum)``, each (...).
    """
    blocks = require_blocks(blocks)
    first = blocks[0]  # (..., b_0)
    row_max = first.new_full((*first.shape[:-1], 1), float("-inf"))  # m_0 = -inf, (..., 1)
    row_sum = first.new_zeros((*first.shape[:-1], 1))  # l_0 = 0, (..., 1)
    for block in blocks:  # one step per block
        row_max, row_sum, _, _ = online_softmax_step(row_max, row_sum, block)
    return row_max.squeeze(-1), row_sum.squeeze(-1)  # (...), (...)


# --------------------------------------------------------------------------- chunked attention


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
                      is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """Exact attention, softmax(q k^T / sqrt(Dh)) v, without ever building the (T, S) matrix.

    Queries and keys are taken ``block_size`` at a time; an online softmax (running maximum,
    sum and output, rescaled whenever the maximum grows) combines the tiles. Extra memory: a
    few (block, block) tiles, O(n) instead of O(n^2) (in the forward pass: autograd keeps every
    tile, FlashAttention recomputes them). With ``is_causal`` the tiles in the future are
    skipped and only those on the diagonal are masked.

    Args:
        q, k, v: (..., T, Dh), (..., S, Dh), (..., S, Dv).
        block_size: queries and keys per tile, >= 1 (need not divide T or S).
        is_causal: apply the future mask, lower-right aligned (query t sees keys s <= t + S - T).
        scale: > 0; defaults to 1/sqrt(Dh).

    Returns:
        out, (..., T, Dv); a query with no allowed key gets zeros.
    """
    _check_blockwise(q, k, v, scale, is_causal, block_size=block_size)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    seq_len, src_len = q.shape[-2], k.shape[-2]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (..., T, Dv), filled block by block
    for start in range(0, seq_len, block_size):
        q_block = q[..., start:start + block_size, :]  # (..., bq, Dh)
        first = start + src_len - seq_len  # key position of the block's first query
        out[..., start:start + block_size, :] = _attend_query_block(
            q_block, k, v, first, block_size, is_causal, scale)  # (..., bq, Dv)
    return out


def _attend_query_block(q_block: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int,
                        block_size: int, is_causal: bool, scale: float) -> torch.Tensor:
    """One block of queries against every key block, combined by the online softmax."""
    n_q, src_len = q_block.shape[-2], k.shape[-2]
    row_max = q_block.new_full((*q_block.shape[:-1], 1), float("-inf"))  # m, (..., bq, 1)
    row_sum = q_block.new_zeros((*q_block.shape[:-1], 1))  # l, (..., bq, 1)
    acc = q_block.new_zeros((*q_block.shape[:-1], v.shape[-1]))  # sum_j e^(s_j - m) v_j
    last_key = min(src_len - 1, first + n_q - 1) if is_causal else src_len - 1
    q_pos = torch.arange(first, first + n_q, device=q_block.device)  # (bq,)
    for k_start in range(0, last_key + 1, block_size):
        k_block = k[..., k_start:k_start + block_size, :]  # (..., bk, Dh)
        scores = (q_block @ k_block.transpose(-2, -1)) * scale  # q k^T / sqrt(Dh), (..., bq, bk)
        if is_causal and k_start + k_block.shape[-2] - 1 > first:  # tile crosses the diagonal
            k_pos = k_start + torch.arange(k_block.shape[-2], device=q_block.device)  # (bk,)
            scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        row_max, row_sum, rescale, probs = online_softmax_step(row_max, row_sum, scores)
        acc = acc * rescale + probs @ v[..., k_start:k_start + block_size, :]  # (..., bq, Dv)
    # a query with no allowed key has l = 0 and acc = 0: divide by 1 to return zeros
    return acc / torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))  # (..., bq, Dv)


# ---------------------------------------------------------------------- sliding-window attention


def sliding_window_mask(n_queries: int, window: int, *, n_keys: int | None = None,
                        is_causal: bool = True,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The band mask of sliding-window attention, (T, S), True = may attend; the window counts
    the token itself.

    Causal (the default): query t sees keys t - window < s <= t, the ``window`` most recent
    positions (Hugging Face's Mistral mask, kv_idx > q_idx - window). Not causal: keys with
    |t - s| < window (Hugging Face's bidirectional window W is ours with ``window=W + 1``).

    Args:
        n_queries, window: T and W >= 1 (keys per query, counting the query's own position).
        n_keys: S (defaults to T); the queries are the last T positions.
        is_causal: only past keys (True) or both sides (False).
    """
    n_keys = n_queries if n_keys is None else n_keys
    check_positive_ints(n_queries=n_queries, window=window, n_keys=n_keys)
    check_bools(is_causal=is_causal)
    q_pos = torch.arange(n_keys - n_queries, n_keys, device=device)  # (T,) key position of query t
    distance = q_pos[:, None] - torch.arange(n_keys, device=device)[None, :]  # t - s, (T, S)
    if is_causal:
        return (distance >= 0) & (distance < window)  # (T, S)
    return distance.abs() < window  # (T, S)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, window: int,
                             is_causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Self-attention restricted to a band of ``window`` keys per query, computing only the band.

    Equal to exact attention with :func:`sliding_window_mask`, but the (n, n) matrix is never
    built: each block of b = min(window, n) queries is scored only against the keys its band
    reaches, gathered with ``unfold``: time and memory grow like n * min(window, n).

    Args:
        q, k, v: (..., n, Dh), (..., n, Dh), (..., n, Dv) (self-attention: S == T = n).
        window: W >= 1, keys per query counting itself.
        is_causal: only the past (True, the default) or both sides (False).
        scale: > 0; defaults to 1/sqrt(Dh).

    Returns:
        out, (..., n, Dv).
    """
    _check_blockwise(q, k, v, scale, is_causal, window=window)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    n = q.shape[-2]
    block = min(window, n)  # also the reach: no key lies more than n - 1 positions away
    n_blocks = -(-n // block)
    pad = n_blocks * block - n  # the last query block is padded to full size
    before, after = block - 1, (0 if is_causal else block - 1)  # keys before / after a query
    q_blocks = F.pad(q, (0, 0, 0, pad)).unflatten(-2, (n_blocks, block))  # (..., nb, b, Dh)
    k_t = _key_windows(k, before, after, pad, block)  # (..., nb, Dh, c), c = b + before + after
    v_win = _key_windows(v, before, after, pad, block).transpose(-2, -1)  # (..., nb, c, Dv)
    scores = (q_blocks @ k_t) * scale  # q k^T / sqrt(Dh) inside the band, (..., nb, b, c)
    keep = _band(n, block, n_blocks, before, after, q.device)  # (nb, b, c)
    weights = softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)  # (..., nb, b, c)
    out = weights @ v_win  # (..., nb, b, Dv)
    return out.flatten(-3, -2)[..., :n, :]  # (..., n, Dv)


def _key_windows(x: torch.Tensor, before: int, after: int, pad: int, block: int) -> torch.Tensor:
    """(..., n, d) -> (..., nb, d, c): for query block j, the rows j*block - before ..
    (j+1)*block - 1 + after of x, zero outside 0..n-1; a view (the windows overlap)."""
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


def low_rank_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, proj_k: torch.Tensor,
                       proj_v: torch.Tensor | None = None, *,
                       scale: float | None = None) -> torch.Tensor:
    """Linformer-style attention: project the S keys and values down to R rows first.

    softmax(q (E k)^T / sqrt(Dh)) (F v), E = ``proj_k`` and F = ``proj_v`` both (R, S): the
    scores are (T, R), the cost grows like n * R. An approximation, good only with learned E
    and F (Linformer); E and F fix S, and no causal mask is possible.

    Args:
        q, k, v: (..., T, Dh), (..., S, Dh), (..., S, Dv).
        proj_k: E, (R, S).
        proj_v: F, (R, S); defaults to ``proj_k`` (one shared projection).
        scale: > 0; defaults to 1/sqrt(Dh).

    Returns:
        out, (..., T, Dv).
    """
    proj_v = proj_k if proj_v is None else proj_v
    _check_low_rank(q, k, v, proj_k, proj_v, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k_low = proj_k @ k  # E k, (..., R, Dh)
    v_low = proj_v @ v  # F v, (..., R, Dv)
    scores = (q @ k_low.transpose(-2, -1)) * scale  # q (E k)^T / sqrt(Dh), (..., T, R)
    weights = softmax(scores, dim=-1)  # (..., T, R)
    return weights @ v_low  # (..., T, Dv)


# ------------------------------------------------------------------------------ argument checks


def require_blocks(blocks: object) -> list[torch.Tensor]:
    """``blocks`` as a list, if it holds one or more floating (..., b) tensors with the first
    block's leading dimensions."""
    if isinstance(blocks, torch.Tensor):  # iterating it would take its rows for blocks
        raise TypeError("blocks must be the row's pieces, a list of tensors, got one tensor "
                        f"{shape_of(blocks)}: split it, e.g. list(x.split(4, dim=-1))")
    blocks = list(require_instance("blocks", blocks, Iterable, "a list of tensors"))
    if not blocks:
        raise ValueError("blocks is empty; give at least one block of scores")
    for i, block in enumerate(blocks):
        name = f"blocks[{i}]"
        require_floating(name, require_ndim(name, block, range(1, 64), "(..., b)"))
        if block.shape[:-1] != blocks[0].shape[:-1]:
            raise ValueError(f"{name} has shape {shape_of(block)}; expected (..., b) like "
                             f"blocks[0] {shape_of(blocks[0])}")
    return blocks


def _check_blockwise(q, k, v, scale, is_causal, **sizes) -> None:
    """chunked_attention's and sliding_window_attention's arguments; sliding windows are
    self-attention (S == T)."""
    if not checks_wanted():
        return
    check_qkv(q, k, v, scale=scale)
    check_positive_ints(**sizes)
    check_bools(is_causal=is_causal)
    if "window" in sizes and k.shape[-2] != q.shape[-2]:
        raise ValueError(f"k has {k.shape[-2]} positions but q has {q.shape[-2]}: sliding windows "
                         "are self-attention (with a cache: sliding_window_mask(T, W, n_keys=S))")


def _check_low_rank(q, k, v, proj_k, proj_v, scale) -> None:
    """q, k, v as for attention; proj_k and proj_v (R, S) with k's S and dtype, one R."""
    if not checks_wanted():
        return
    check_qkv(q, k, v, scale=scale)
    for name, proj in (("proj_k", proj_k), ("proj_v", proj_v)):
        require_dtype_of(name, require_ndim(name, proj, (2,), "(R, S)"), k, "k's values")
        expected = (proj_k.shape[0], k.shape[-2])  # R from proj_k, S from k
        if proj.shape != expected:
            raise ValueError(f"{name} has shape {shape_of(proj)}; expected (R, S) = {expected}")
    if proj_k.shape[0] > k.shape[-2]:  # R > S: more summaries than keys, nothing saved
        raise ValueError(f"proj_k projects S = {k.shape[-2]} keys onto R = {proj_k.shape[0]} > S "
                         "rows: a low-rank projection needs R <= S")
