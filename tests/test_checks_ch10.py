"""The chapter 10 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib import efficient
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch10 import (
    buggy_chunked_attention,
    check_causal_chunked_attention,
    check_fixed_chunked_attention,
    check_longest_sequence,
    check_online_softmax_stats,
    check_sliding_window_mask,
)


@pytest.mark.parametrize("check", [check_online_softmax_stats, check_causal_chunked_attention,
                                   check_sliding_window_mask, check_longest_sequence,
                                   check_fixed_chunked_attention])
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


# ---------------------------------------------------------------------- 10.1 online softmax


def stats_loop(blocks):
    m = torch.full(blocks[0].shape[:-1], float("-inf"))
    s = torch.zeros(blocks[0].shape[:-1])
    for block in blocks:
        new_m = torch.maximum(m, block.amax(-1))
        s = s * torch.exp(m - new_m) + torch.exp(block - new_m[..., None]).sum(-1)
        m = new_m
    return m, s


def stats_loop_guarded(blocks):
    """The loop of stats_loop with the shift that keeps all -inf rows finite."""
    m = torch.full(blocks[0].shape[:-1], float("-inf"))
    s = torch.zeros(blocks[0].shape[:-1])
    for block in blocks:
        new_m = torch.maximum(m, block.amax(-1))
        shift = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
        s = s * torch.exp(m - shift) + torch.exp(block - shift[..., None]).sum(-1)
        m = new_m
    return m, s


def stats_first_block(blocks):
    """Starts from the first block instead of -inf, keepdim until the end, and skips the
    exponentials while a row's maximum is still -inf (nan_to_num)."""
    m = blocks[0].amax(-1, keepdim=True)
    s = torch.exp(blocks[0] - m).nan_to_num(0.0).sum(-1, keepdim=True)
    for block in blocks[1:]:
        new_m = torch.maximum(m, block.amax(-1, keepdim=True))
        s = (s * torch.exp(m - new_m).nan_to_num(0.0)
             + torch.exp(block - new_m).nan_to_num(0.0).sum(-1, keepdim=True))
        m = new_m
    return m.squeeze(-1), s.squeeze(-1)


def stats_logaddexp(blocks):
    """A running log-sum-exp, turned into (max, sum) at the end (a row that saw no key keeps
    lse = m = -inf: its sum is exp(-inf) = 0)."""
    lse = torch.full(blocks[0].shape[:-1], float("-inf"))
    m = lse.clone()
    for block in blocks:
        lse = torch.logaddexp(lse, torch.logsumexp(block, -1))
        m = torch.maximum(m, block.amax(-1))
    return m, torch.exp(lse - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))


@pytest.mark.parametrize("fn", [stats_loop_guarded, stats_first_block, stats_logaddexp,
                                efficient.online_softmax_stats])
def test_online_softmax_accepts_correct_answers(fn, capsys):
    check_online_softmax_stats(fn)
    assert "online_softmax_stats is correct" in capsys.readouterr().out


def _stats_with(update):
    def fn(blocks):
        m = blocks[0].amax(-1)
        s = torch.zeros(blocks[0].shape[:-1])
        for block in blocks:
            new_m = torch.maximum(m, block.amax(-1))
            s = update(s, m, new_m, block)
            m = new_m
        return m, s
    return fn


def stats_keepdim(blocks):
    m, s = stats_loop(blocks)
    return m[..., None], s[..., None]


def stats_no_max(blocks):
    m = torch.cat(blocks, -1).amax(-1)
    return m, sum(torch.exp(b).sum(-1) for b in blocks)


def stats_nan_first_block(blocks):
    """m starts at -inf and the old sum is multiplied by exp(m' - m) = inf: 0 * inf = NaN."""
    m = torch.full(blocks[0].shape[:-1], float("-inf"))
    s = torch.zeros(blocks[0].shape[:-1])
    for block in blocks:
        new_m = torch.maximum(m, block.amax(-1))
        s = s * torch.exp(new_m - m) + torch.exp(block - new_m[..., None]).sum(-1)
        m = new_m
    return m, s


def stats_started_at(blocks, start):
    """The running maximum starts at a very negative finite number instead of -inf: right for
    every row with at least one allowed key, finite (not -inf) for a row with none."""
    m = torch.full(blocks[0].shape[:-1], start)
    s = torch.zeros(blocks[0].shape[:-1])
    for block in blocks:
        new_m = torch.maximum(m, block.amax(-1))
        s = s * torch.exp(m - new_m) + torch.exp(block - new_m[..., None]).sum(-1)
        m = new_m
    return m, s



def stats_logaddexp_unguarded(blocks):
    """The running log-sum-exp, with exp(lse - m) = exp(-inf - (-inf)) = NaN for a row that
    saw no key."""
    lse = torch.full(blocks[0].shape[:-1], float("-inf"))
    m = lse.clone()
    for block in blocks:
        lse = torch.logaddexp(lse, torch.logsumexp(block, -1))
        m = torch.maximum(m, block.amax(-1))
    return m, torch.exp(lse - m)

WRONG_STATS = {
    "no rescaling": (_stats_with(lambda s, m, new_m, b: s + torch.exp(
        b - new_m[..., None]).sum(-1)),
                     "not rescaled when the maximum grows"),
    "inverted rescaling": (_stats_with(lambda s, m, new_m, b: s * torch.exp(new_m - m)
                                       + torch.exp(b - new_m[..., None]).sum(-1)),
                           "wrong way round"),
    "each block's own max": (_stats_with(lambda s, m, new_m, b: s + torch.exp(
        b - b.amax(-1, keepdim=True)).sum(-1)), "that block's own maximum"),
    "no max subtraction": (stats_no_max, "overflows|without subtracting the maximum"),
    "max of the last block": (lambda blocks: (blocks[-1].amax(-1), stats_loop(blocks)[1]),
                              "last block only"),
    "max of the first block": (lambda blocks: (blocks[0].amax(-1), stats_loop(blocks)[1]),
                               "first block only"),
    "keepdim": (stats_keepdim, "trailing dimension of size 1"),
    "only the sum": (lambda blocks: stats_loop(blocks)[1], r"pair \(row_max, row_sum\)"),
    "NaN from -inf start and inverted factor": (stats_nan_first_block, "first block"),
    "NaN after a masked first block": (stats_loop, r"exp\(-inf - \(-inf\)\).*shift such rows by 0"),
    "max started at finfo.min": (lambda blocks: stats_started_at(blocks, torch.finfo(
        torch.float32).min), r"start at torch\.finfo\(dtype\)\.min, not -inf"),
    "max started at -1e9": (lambda blocks: stats_started_at(blocks, -1e9),
                            r"start at -1e\+09, not -inf.*row_max = -inf and row_sum = 0"),
    "NaN for a row with no key": (stats_logaddexp_unguarded, r"shift such rows by 0"),
}



@pytest.mark.parametrize("name", list(WRONG_STATS))
def test_online_softmax_rejects_wrong_answers(name):
    fn, message = WRONG_STATS[name]
    with pytest.raises(CheckFailure, match=message):
        check_online_softmax_stats(fn)


# ---------------------------------------------------------------------- 10.2 causal chunked


def _tile_mask(n, start, size, *, local_keys=False, local_queries=False, offset=0):
    """(n, size) True where query t may see key start + j, optionally with the classic slips."""
    t = torch.arange(n)[:, None]
    s = torch.arange(size)[None, :] + (0 if local_keys else start)
    if local_queries:
        t = t % size
    return s <= t + offset


def causal_loop(q, k, v, block_size, *, fill=float("-inf"), local_keys=False,
                local_queries=False, offset=0, rescale_sum=True, rescale_out=True, scale=True,
                divide=True, subtract_max=True, mask_sum=True):
    """Key blocks over all queries, a per-block mask; the keyword arguments inject mistakes."""
    n = q.shape[-2]
    factor = 1 / math.sqrt(q.shape[-1]) if scale else 1.0
    m = torch.full((*q.shape[:-1], 1), float("-inf"))
    s = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    for start in range(0, n, block_size):
        k_b, v_b = k[..., start:start + block_size, :], v[..., start:start + block_size, :]
        scores = q @ k_b.transpose(-2, -1) * factor
        keep = _tile_mask(n, start, k_b.shape[-2], local_keys=local_keys,
                          local_queries=local_queries, offset=offset)
        if fill is not None:
            scores = scores.masked_fill(~keep, fill)
        new_m = torch.maximum(m, scores.amax(-1, keepdim=True)) if subtract_max \
            else torch.zeros_like(m)
        p = torch.exp(scores - new_m)
        c = torch.exp(m - new_m) if subtract_max else torch.ones_like(m)
        p_out = p if fill is not None else p * keep
        s = (s * c if rescale_sum else s) + (p_out if mask_sum else p).sum(-1, keepdim=True)
        acc = (acc * c if rescale_out else acc) + p_out @ v_b
        m = new_m
    return acc / s if divide else acc


def causal_einsum_where(q, k, v, block_size):
    """torch.split, einsum, torch.where for the mask, the maximum from the first block."""
    n = q.shape[-2]
    out = m = s = None
    for i, (k_b, v_b) in enumerate(zip(k.split(block_size, -2), v.split(block_size, -2),
                                       strict=True)):
        scores = torch.einsum("...td,...sd->...ts", q, k_b) / q.shape[-1] ** 0.5
        key_pos = i * block_size + torch.arange(k_b.shape[-2])
        future = key_pos[None, :] > torch.arange(n)[:, None]
        scores = torch.where(future, torch.tensor(float("-inf")), scores)
        block_max = scores.amax(-1, keepdim=True)
        if m is None:  # key 0 is in the first block: every row's maximum is finite
            m, s = block_max, torch.zeros_like(block_max)
            out = torch.zeros(*q.shape[:-1], v.shape[-1])
        new_m = torch.maximum(m, block_max)
        p = (scores - new_m).exp()
        correction = (m - new_m).exp()
        s = correction * s + p.sum(-1, keepdim=True)
        out = correction * out + torch.einsum("...ts,...sd->...td", p, v_b)
        m = new_m
    return out / s


def causal_tiles_skipping(q, k, v, block_size):
    """Query blocks and key blocks, future tiles skipped: the library's function."""
    return efficient.chunked_attention(q, k, v, block_size=block_size, is_causal=True)


@pytest.mark.parametrize("fn", [causal_loop, causal_einsum_where, causal_tiles_skipping])
def test_causal_chunked_attention_accepts_correct_answers(fn, capsys):
    check_causal_chunked_attention(fn)
    assert "causal_chunked_attention is correct" in capsys.readouterr().out


def causal_full_mask(q, k, v, block_size):
    """Right answer, but an (n, n) boolean mask is built first and sliced per block."""
    n = q.shape[-2]
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    m = torch.full((*q.shape[:-1], 1), float("-inf"))
    s = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    for start in range(0, n, block_size):
        scores = q @ k[..., start:start + block_size, :].transpose(-2, -1) / math.sqrt(
            q.shape[-1])
        scores = scores.masked_fill(~mask[:, start:start + block_size], float("-inf"))
        new_m = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - new_m)
        s = s * torch.exp(m - new_m) + p.sum(-1, keepdim=True)
        acc = acc * torch.exp(m - new_m) + p @ v[..., start:start + block_size, :]
        m = new_m
    return acc / s


def causal_full_scores(q, k, v, block_size):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    n = q.shape[-2]
    scores = scores.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool)), float("-inf"))
    return torch.softmax(scores, -1) @ v


def causal_fused(q, k, v, block_size):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def causal_dot_T(q, k, v, block_size):
    """k_block.T reverses every dimension: fine for (S, d), wrong for (B, H, S, d)."""
    n = q.shape[-2]
    m = torch.full((*q.shape[:-1], 1), float("-inf"))
    s = torch.zeros_like(m)
    acc = torch.zeros(*q.shape[:-1], v.shape[-1])
    for start in range(0, n, block_size):
        k_b = k[..., start:start + block_size, :]
        scores = q @ k_b.T / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~_tile_mask(n, start, k_b.shape[-2]), float("-inf"))
        new_m = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - new_m)
        s = s * torch.exp(m - new_m) + p.sum(-1, keepdim=True)
        acc = acc * torch.exp(m - new_m) + p @ v[..., start:start + block_size, :]
        m = new_m
    return acc / s


WRONG_CAUSAL = {
    "no mask": (lambda q, k, v, b: efficient.chunked_attention(q, k, v, block_size=b),
                "without the causal mask"),
    "future instead of past": (lambda q, k, v, b: _future(q, k, v, b), "keeps the future"),
    "diagonal hidden": (lambda q, k, v, b: causal_loop(q, k, v, b, offset=-1),
                        "also hides the diagonal"),
    "block-local key positions": (lambda q, k, v, b: causal_loop(q, k, v, b, local_keys=True),
                                  "inside its block"),
    "tile-local positions": (lambda q, k, v, b: causal_loop(q, k, v, b, local_keys=True,
                                                            local_queries=True),
                             "inside the tile"),
    "filled with 0": (lambda q, k, v, b: causal_loop(q, k, v, b, fill=0.0), "not to -inf"),
    "sum counts masked keys": (lambda q, k, v, b: causal_loop(q, k, v, b, fill=None,
                                                              mask_sum=False),
                               "still counts"),
    "no rescaling": (lambda q, k, v, b: causal_loop(q, k, v, b, rescale_sum=False,
                                                    rescale_out=False),
                     "not rescaled when the maximum grows"),
    "sum rescaled, output not": (lambda q, k, v, b: causal_loop(q, k, v, b, rescale_out=False),
                                 "but not the running output"),
    "output rescaled, sum not": (lambda q, k, v, b: causal_loop(q, k, v, b, rescale_sum=False),
                                 "but not the running sum"),
    "no max subtraction": (lambda q, k, v, b: causal_loop(q, k, v, b, subtract_max=False),
                           "inf or NaN"),
    "unscaled": (lambda q, k, v, b: causal_loop(q, k, v, b, scale=False), "sqrt"),
    "no final division": (lambda q, k, v, b: causal_loop(q, k, v, b, divide=False),
                          "without the final division"),
    "an (n, n) mask": (causal_full_mask, r"whole \(n, n\) mask"),
    "the whole score matrix": (causal_full_scores, "whole score matrix"),
    "fused attention": (causal_fused, "comes from F.scaled_dot_product_attention"),
    "fused attention, batched": (lambda q, k, v, b: causal_fused(q, k, v, b) if q.dim() == 4
                                 else causal_loop(q, k, v, b), "fused kernel"),
    "k.T on a batch": (causal_dot_T, "transpose only the last two"),
    "(out, None)": (lambda q, k, v, b: (causal_loop(q, k, v, b), None), "only the output"),
}


def _future(q, k, v, block_size):
    """Query t sees the keys s >= t (the mask upside down)."""
    n = q.shape[-2]
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", list(WRONG_CAUSAL))
def test_causal_chunked_attention_rejects_wrong_answers(name):
    fn, message = WRONG_CAUSAL[name]
    with pytest.raises(CheckFailure, match=message):
        check_causal_chunked_attention(fn)


# ---------------------------------------------------------------------- 10.3 sliding window


def window_aranges(n_queries, n_keys, window):
    t = torch.arange(n_keys - n_queries, n_keys)[:, None]
    s = torch.arange(n_keys)[None, :]
    return (s <= t) & (s > t - window)


def window_tril_triu(n_queries, n_keys, window):
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool)
    shift = n_keys - n_queries
    return torch.tril(ones, diagonal=shift) & torch.triu(ones, diagonal=shift - (window - 1))


def window_loop(n_queries, n_keys, window):
    mask = torch.zeros(n_queries, n_keys, dtype=torch.bool)
    for i in range(n_queries):
        position = i + n_keys - n_queries
        for s in range(max(0, position - window + 1), position + 1):
            mask[i, s] = True
    return mask


def window_last_rows(n_queries, n_keys, window):
    """The (S, S) band, then its last T rows."""
    return efficient.sliding_window_mask(n_keys, window)[n_keys - n_queries:]


@pytest.mark.parametrize("fn", [window_aranges, window_tril_triu, window_loop,
                                window_last_rows])
def test_sliding_window_mask_accepts_correct_answers(fn, capsys):
    check_sliding_window_mask(fn)
    assert "sliding_window_mask is correct" in capsys.readouterr().out


def _distance(n_queries, n_keys, *, last=True):
    t = torch.arange(n_queries)[:, None] + (n_keys - n_queries if last else 0)
    return t - torch.arange(n_keys)[None, :]


WRONG_WINDOW = {
    "queries first": (lambda t, s, w: (_distance(t, s, last=False) >= 0)
                      & (_distance(t, s, last=False) < w), r"\*newest\*"),
    "one too many": (lambda t, s, w: (_distance(t, s) >= 0) & (_distance(t, s) <= w),
                     "one key too many"),
    "one too few": (lambda t, s, w: (_distance(t, s) >= 0) & (_distance(t, s) < w - 1),
                    "one key too few"),
    "itself left out": (lambda t, s, w: (_distance(t, s) >= 1) & (_distance(t, s) <= w),
                        "leaves out the token itself"),
    "symmetric": (lambda t, s, w: _distance(t, s).abs() < w, "reaches into the future"),
    "future band": (lambda t, s, w: (_distance(t, s) <= 0) & (_distance(t, s) > -w),
                    "in the future of each query"),
    "inverted": (lambda t, s, w: ~window_aranges(t, s, w), "inverted"),
    "plain causal": (lambda t, s, w: _distance(t, s) >= 0, "plain causal mask"),
    "float": (lambda t, s, w: window_aranges(t, s, w).float(), "pattern is right"),
    "float, wrong": (lambda t, s, w: (_distance(t, s).abs() < w).float(), "dtype=torch.bool"),
    "transposed": (lambda t, s, w: window_aranges(t, s, w).T, "future"),
}


@pytest.mark.parametrize("name", list(WRONG_WINDOW))
def test_sliding_window_mask_rejects_wrong_answers(name):
    fn, message = WRONG_WINDOW[name]
    with pytest.raises(CheckFailure, match=message):
        check_sliding_window_mask(fn)


# ---------------------------------------------------------------------- 10.4 longest sequence


def longest_isqrt(budget, batch, heads, dtype):
    return math.isqrt(budget // (batch * heads * dtype.itemsize))


def longest_float_sqrt(budget, batch, heads, dtype):
    return int(math.sqrt(budget / (batch * heads * torch.finfo(dtype).bits / 8)))


def longest_search(budget, batch, heads, dtype):
    """Doubling, then bisection, on the byte count (a tensor result)."""
    def fits(n):
        return batch * heads * n * n * torch.empty((), dtype=dtype).element_size() <= budget

    high = 1
    while fits(high):
        high *= 2
    low = high // 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def longest_numpy(budget, batch, heads, dtype):
    """A numpy integer, as np.floor(...).astype(np.int64) or np.int64(...) give."""
    return np.int64(np.sqrt(budget // (batch * heads * dtype.itemsize)))


@pytest.mark.parametrize("fn", [longest_isqrt, longest_float_sqrt, longest_search,
                                longest_numpy])
def test_longest_sequence_accepts_correct_answers(fn, capsys):
    check_longest_sequence(fn)
    assert "longest_sequence is correct" in capsys.readouterr().out


def _n(budget, per_element):
    return math.isqrt(budget // per_element)


WRONG_LONGEST = {
    "always 4 bytes": (lambda b, bt, h, dt: _n(b, bt * h * 4), "4 bytes per element"),
    "bits": (lambda b, bt, h, dt: _n(b, bt * h * torch.finfo(dt).bits), "bits, not bytes"),
    "no batch": (lambda b, bt, h, dt: _n(b, h * dt.itemsize), "leaves out the batch"),
    "no heads": (lambda b, bt, h, dt: _n(b, bt * dt.itemsize), "leaves out the heads"),
    "one matrix": (lambda b, bt, h, dt: _n(b, dt.itemsize), r"one \(n, n\) matrix"),
    "scores and weights": (lambda b, bt, h, dt: _n(b, 2 * bt * h * dt.itemsize),
                           "two matrices"),
    "linear": (lambda b, bt, h, dt: b // (bt * h * dt.itemsize), "square root"),
    "rounded up": (lambda b, bt, h, dt: math.ceil(math.sqrt(b / (bt * h * dt.itemsize))),
                   "rounded up"),
    "rounded": (lambda b, bt, h, dt: round(math.sqrt(b / (bt * h * dt.itemsize))),
                "rounded"),
    "strict <": (lambda b, bt, h, dt: _n(b - 1, bt * h * dt.itemsize), "fills the budget exactly"),
    "not rounded": (lambda b, bt, h, dt: math.sqrt(b / (bt * h * dt.itemsize)) + 0.5,
                    r"should be a whole number: return an int.*int\(\.\.\.\) makes it an int"),
    "a string": (lambda b, bt, h, dt: f"{longest_isqrt(b, bt, h, dt)} tokens",
                 "return an int, but your function returned a str"),
    "a whole float": (lambda b, bt, h, dt: float(longest_isqrt(b, bt, h, dt)),
                      r"return an int, but your function returned a float \(\d+\.0: int"),
    "a tensor": (lambda b, bt, h, dt: torch.tensor(longest_isqrt(b, bt, h, dt)),
                 r"return an int, but your function returned a tensor of shape \(\).*"
                 r"\.item\(\)"),
    "a numpy float": (lambda b, bt, h, dt: np.floor(np.sqrt(b / (bt * h * dt.itemsize))),
                      "return an int"),
    "a bool": (lambda b, bt, h, dt: True, "return an int"),
    "off by two": (lambda b, bt, h, dt: longest_isqrt(b, bt, h, dt) - 2, "a longer sequence"),
    "too long": (lambda b, bt, h, dt: longest_isqrt(b, bt, h, dt) + 3, "does not fit"),
}


@pytest.mark.parametrize("name", list(WRONG_LONGEST))
def test_longest_sequence_rejects_wrong_answers(name):
    fn, message = WRONG_LONGEST[name]
    with pytest.raises(CheckFailure, match=message):
        check_longest_sequence(fn)



# ---------------------------------------------------------------------- 10.5 find the bug


def fixed_loop(q, k, v, block_size, start_max=float("-inf")):
    """The given function with the running sum rescaled too: the reference solution (with
    ``start_max=0``, the running maximum started at 0 instead of -inf)."""
    row_max = torch.full((*q.shape[:-1], 1), start_max)
    row_sum = torch.zeros((*q.shape[:-1], 1))
    out = torch.zeros((*q.shape[:-1], v.shape[-1]))
    for k_block, v_block in zip(k.split(block_size, -2), v.split(block_size, -2), strict=True):
        scores = q @ k_block.transpose(-2, -1) / math.sqrt(q.shape[-1])
        new_max = torch.maximum(row_max, scores.amax(-1, keepdim=True))
        correction = torch.exp(row_max - new_max)
        p = torch.exp(scores - new_max)
        row_sum = row_sum * correction + p.sum(-1, keepdim=True)
        out = out * correction + p @ v_block
        row_max = new_max
    return out / row_sum


def fixed_normalised(q, k, v, block_size):
    """Another correct formulation: keep the output normalised after every block (out is the
    softmax-weighted average so far), with einsum."""
    m = total = out = None
    for start in range(0, k.shape[-2], block_size):
        s = torch.einsum("...td,...sd->...ts", q, k[..., start:start + block_size, :])
        s = s / q.shape[-1] ** 0.5
        block_max = s.amax(-1, keepdim=True)
        m_new = block_max if m is None else torch.maximum(m, block_max)
        p = (s - m_new).exp()
        block_out = torch.einsum("...ts,...sd->...td", p, v[..., start:start + block_size, :])
        if m is None:
            l_new = p.sum(-1, keepdim=True)
            out = block_out / l_new
        else:
            old = total * (m - m_new).exp()
            l_new = old + p.sum(-1, keepdim=True)
            out = (out * old + block_out) / l_new
        m, total = m_new, l_new
    return out


@pytest.mark.parametrize("fn", [fixed_loop, fixed_normalised,
                                lambda q, k, v, b: efficient.chunked_attention(
                                    q, k, v, block_size=b)])
def test_fixed_chunked_attention_accepts_correct_fixes(fn, capsys):
    check_fixed_chunked_attention(fn)
    assert "fixed_chunked_attention is correct" in capsys.readouterr().out


def test_the_planted_bug_shows_only_when_the_scores_fall_far_between_blocks():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 8, generator=gen) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)
    for block_size in (10, 3, 1):  # ordinary scores: right with any blocks
        torch.testing.assert_close(buggy_chunked_attention(q, k, v, block_size), exact)
    falling = 60 * q.abs(), k.abs() * torch.linspace(1.0, -1.0, 10)[:, None], v
    exact = F.scaled_dot_product_attention(*falling)
    torch.testing.assert_close(buggy_chunked_attention(*falling, 10), exact)  # one block
    assert torch.isnan(buggy_chunked_attention(*falling, 2)).any()
    torch.testing.assert_close(fixed_loop(*falling, 2), exact)


def zero_start_loop(q, k, v, block_size):
    """fixed_loop with its running maximum started at 0: exact until exp underflows."""
    return fixed_loop(q, k, v, block_size, start_max=0.0)


def test_a_running_maximum_started_at_0_fails_only_on_scores_below_minus_104():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 8, generator=gen) for _ in range(3))
    torch.testing.assert_close(zero_start_loop(q, k, v, 3), F.scaled_dot_product_attention(
        q, k, v))  # ordinary scores hide it
    low = q.abs() + 0.5, -(k.abs() + 0.5) * 200, v  # every score below -104
    assert bool((low[0] @ low[1].transpose(-2, -1) / math.sqrt(8) < -104).all())
    assert torch.isnan(zero_start_loop(*low, 3)).all()
    torch.testing.assert_close(fixed_loop(*low, 3), F.scaled_dot_product_attention(*low),
                               atol=1e-3, rtol=1e-3)  # scores in the thousands: float32 rounding


WRONG_FIX = {
    "unchanged": (buggy_chunked_attention, "planted bug is still there"),
    "the planted bug, retyped": (lambda q, k, v, b: torch.stack([
        buggy_chunked_attention(qi, ki, vi, b) for qi, ki, vi in zip(q, k, v, strict=True)])
        if q.dim() > 2 else buggy_chunked_attention(q, k, v, b), "planted bug is still there"),
    "running maximum started at 0": (zero_start_loop, "starts at 0 instead of -inf"),
    "output rescaled, sum not": (lambda q, k, v, b: unmasked_loop(q, k, v, b, rescale_sum=False),
                                 "rescales the running output but not the running sum"),
    "neither rescaled": (lambda q, k, v, b: unmasked_loop(q, k, v, b, rescale_sum=False,
                                                             rescale_out=False),
                         "neither the running sum nor the running output"),
    "sum rescaled, output not": (lambda q, k, v, b: unmasked_loop(q, k, v, b,
                                                                  rescale_out=False),
                                 "rescales the running sum but not the running output"),
    "no division": (lambda q, k, v, b: unmasked_loop(q, k, v, b, divide=False),
                    "without the final division"),
    "off by a little": (lambda q, k, v, b: fixed_loop(q, k, v, b) * 1.01, "wrong values"),
    "whole score matrix": (lambda q, k, v, b: torch.softmax(
        q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v, "whole score matrix"),
    "fused attention": (lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v),
                        "comes from F.scaled_dot_product_attention"),
    "a tuple": (lambda q, k, v, b: (fixed_loop(q, k, v, b), None), "not a tuple"),
}


def unmasked_loop(q, k, v, block_size, **slips):
    """Key-blocked attention without a mask, with the given slips (see causal_loop)."""
    n = q.shape[-2]
    big = n + k.shape[-2]  # an offset past every key: nothing is masked
    return causal_loop(q, k, v, block_size, offset=big, **slips)


@pytest.mark.parametrize("name", list(WRONG_FIX))
def test_fixed_chunked_attention_rejects_wrong_fixes(name):
    fn, message = WRONG_FIX[name]
    with pytest.raises(CheckFailure, match=message) as failure:
        check_fixed_chunked_attention(fn)
    planted = name in ("unchanged", "the planted bug, retyped")
    # the planted bug and its instrument are named only when the output is the planted bug's
    assert ("planted bug" in str(failure.value)) == planted
    assert ("FALL from one block to the next" in str(failure.value)) == planted
