"""FlashAttention-2 in plain PyTorch: exact attention whose backward never stores the (T, S) matrix.

Shape legend: B batch, H heads, T query length, S key/value length, Dh query/key size, Dv value
size, bq and bk the queries and keys of one tile; ``(...)`` stands for any leading dimensions,
e.g. (B, H).

Chapter 10's :func:`course_lib.chunked_attention` computes the forward pass in O(n) extra memory,
but autograd keeps every tile it built for the backward pass: O(n^2) again. Here a
``torch.autograd.Function`` keeps only q, k, v, out and each query's log-sum-exp
L = m + log(l) (..., T), and the backward pass recomputes the weights P = exp(S - L) one tile at
a time (Dao, "FlashAttention-2", 2023, Algorithms 1 and 2). What it leaves out: the fused GPU
kernel (the loops here run in Python, one matmul per tile) and double backward.
"""

from __future__ import annotations

import math

import torch

from ._validate import check_bools, check_positive_ints, checks_wanted
from .attention import check_qkv
from .efficient import online_softmax_step


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, block_size: int,
                    is_causal: bool = False, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v, computed tile by tile forward *and* backward: O(n) memory.

    The forward pass is :func:`course_lib.chunked_attention`'s online softmax, which also keeps
    each query's log-sum-exp L; the backward pass recomputes each tile's weights from q, k and L
    instead of reading them from memory.

    Args:
        q, k, v: (..., T, Dh), (..., S, Dh), (..., S, Dv), as ``F.scaled_dot_product_attention``.
        block_size: queries and keys per tile, >= 1 (need not divide T or S).
        is_causal: apply the future mask, lower-right aligned like ``chunked_attention``: the T
            queries are the last T of S positions (query t sees keys s <= t + S - T).
        scale: > 0; defaults to 1/sqrt(Dh).

    Returns:
        out, (..., T, Dv); a query with no allowed key (causal, T > S) gets zeros and passes no
        gradient back, never NaN. Differentiable once (no ``create_graph=True``).
    """
    _check_flash(q, k, v, block_size, is_causal, scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _FlashAttention.apply(q, k, v, block_size, is_causal, scale)


class _FlashAttention(torch.autograd.Function):
    """The forward and backward passes of :func:`flash_attention`, which checked the inputs."""

    @staticmethod
    def forward(ctx, q, k, v, block_size, is_causal, scale):
        out, lse = _forward(q, k, v, block_size, is_causal, scale)  # (..., T, Dv), (..., T)
        ctx.save_for_backward(q, k, v, out, lse)  # O(n): nothing of size T * S
        ctx.block_size, ctx.is_causal, ctx.scale = block_size, is_causal, scale
        return out

    @staticmethod
    def backward(ctx, d_out):
        if torch.is_grad_enabled():  # create_graph=True: L is a constant here, so refuse
            raise RuntimeError("flash_attention has no second derivative: call backward or "
                               "autograd.grad without create_graph=True")
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(q, k, v, out, lse, d_out, ctx.block_size, ctx.is_causal, ctx.scale)
        return *grads, None, None, None  # dq, dk, dv; block_size, is_causal, scale have none


def _forward(q, k, v, block_size, is_causal, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """out and L = m + log(l), one block of queries at a time against its key blocks."""
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))  # (..., T, Dv)
    lse = q.new_empty(q.shape[:-1])  # (..., T)
    offset = k.shape[-2] - q.shape[-2]  # the T queries are the last T of S positions
    for q0 in range(0, q.shape[-2], block_size):
        rows = slice(q0, q0 + block_size)
        q_blk = q[..., rows, :]  # (..., bq, Dh)
        # m_0 = -inf, l_0 = 0, O_0 = 0
        row_max = q_blk.new_full((*q_blk.shape[:-1], 1), float("-inf"))  # (..., bq, 1)
        row_sum = q_blk.new_zeros((*q_blk.shape[:-1], 1))  # (..., bq, 1)
        acc = q_blk.new_zeros((*q_blk.shape[:-1], v.shape[-1]))  # (..., bq, Dv)
        first = q0 + offset  # key position of the block's first query
        for k0 in _key_starts(first, q_blk.shape[-2], k.shape[-2], block_size, is_causal):
            cols = slice(k0, k0 + block_size)
            scores = _tile_scores(q_blk, k[..., cols, :], first, k0, is_causal, scale)
            row_max, row_sum, rescale, probs = online_softmax_step(row_max, row_sum, scores)
            # O = diag(exp(m_old - m)) O + exp(S - m) V_j
            acc = acc * rescale + probs @ v[..., cols, :]  # (..., bq, Dv)
        # O = diag(l)^-1 O; a query with no allowed key has l = 0 and O = 0: divide by 1
        out[..., rows, :] = acc / torch.where(row_sum > 0, row_sum, 1.0)  # (..., bq, Dv)
        # L = m + log(l): -inf for a query with no allowed key
        lse[..., rows] = (row_max + torch.log(row_sum)).squeeze(-1)  # (..., bq)
    return out, lse


def _backward(q, k, v, out, lse, d_out, block_size, is_causal, scale):
    """dq, dk, dv from the tiles' weights recomputed as P = exp(S - L).

    FlashAttention-2 puts the key blocks in the outer loop, so that each GPU thread block owns
    one block of dK and dV; sequential PyTorch may keep the forward's order, and does.
    """
    # D = rowsum(dO * O), once for every query (it equals rowsum(P * dP))
    delta = (d_out * out).sum(dim=-1, keepdim=True)  # (..., T, 1)
    # a query with no allowed key has L = -inf: subtract 0 instead, so that P = exp(-inf) = 0
    lse = torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1)  # (..., T, 1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    offset = k.shape[-2] - q.shape[-2]  # the T queries are the last T of S positions
    for q0 in range(0, q.shape[-2], block_size):
        rows = slice(q0, q0 + block_size)
        q_blk, do_blk = q[..., rows, :], d_out[..., rows, :]  # (..., bq, Dh), (..., bq, Dv)
        first = q0 + offset  # key position of the block's first query
        for k0 in _key_starts(first, q_blk.shape[-2], k.shape[-2], block_size, is_causal):
            cols = slice(k0, k0 + block_size)
            k_blk, v_blk = k[..., cols, :], v[..., cols, :]  # (..., bk, Dh), (..., bk, Dv)
            # P = exp(S - L), the tile's attention weights
            weights = torch.exp(_tile_scores(q_blk, k_blk, first, k0, is_causal, scale)
                                - lse[..., rows, :])  # (..., bq, bk)
            # dV_j += P^T dO_i
            dv[..., cols, :] += weights.transpose(-2, -1) @ do_blk  # (..., bk, Dv)
            # dP = dO_i V_j^T
            d_weights = do_blk @ v_blk.transpose(-2, -1)  # (..., bq, bk)
            # dS = P * (dP - D_i), the softmax's backward
            d_scores = weights * (d_weights - delta[..., rows, :])  # (..., bq, bk)
            # dQ_i += dS K_j * scale
            dq[..., rows, :] += (d_scores @ k_blk) * scale  # (..., bq, Dh)
            # dK_j += dS^T Q_i * scale
            dk[..., cols, :] += (d_scores.transpose(-2, -1) @ q_blk) * scale  # (..., bk, Dh)
    return dq, dk, dv


def _key_starts(first: int, n_q: int, src_len: int, block_size: int, is_causal: bool) -> range:
    """The first key of every key block that a block of n_q queries, the first at key position
    ``first``, sees; causal: key blocks wholly in their future are skipped."""
    last_key = min(src_len - 1, first + n_q - 1) if is_causal else src_len - 1
    return range(0, last_key + 1, block_size)


def _tile_scores(q_blk: torch.Tensor, k_blk: torch.Tensor, first: int, k0: int,
                 is_causal: bool, scale: float) -> torch.Tensor:
    """S = q k^T * scale for one tile (queries from key position ``first``, keys from ``k0``);
    causal: -inf where a key lies in its query's future, which only diagonal tiles have."""
    scores = (q_blk @ k_blk.transpose(-2, -1)) * scale  # (..., bq, bk)
    if is_causal and k0 + k_blk.shape[-2] - 1 > first:  # the tile crosses the diagonal
        q_pos = first + torch.arange(q_blk.shape[-2], device=q_blk.device)  # (bq,)
        k_pos = k0 + torch.arange(k_blk.shape[-2], device=q_blk.device)  # (bk,)
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return scores  # (..., bq, bk)


def _check_flash(q, k, v, block_size, is_causal, scale) -> None:
    """q, k, v and scale as for attention; block_size >= 1; is_causal True or False."""
    if not checks_wanted():
        return
    check_qkv(q, k, v, scale=scale)
    check_positive_ints(block_size=block_size)
    check_bools(is_causal=is_causal)
