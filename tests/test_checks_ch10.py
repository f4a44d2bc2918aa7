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
    attend_to_part,
    buggy_split_attention,
    check_causal_chunked_attention,
    check_fixed_split_attention,
    check_longest_sequence,
    check_online_softmax_stats,
    check_sliding_window_mask,
)


@pytest.mark.parametrize("check", [check_online_softmax_stats, check_causal_chunked_attention,
                                   check_sliding_window_mask, check_longest_sequence,
                                   check_fixed_split_attention])
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


def _parts(q, k, v, n_parts):
    outs, lses = [], []
    for k_part, v_part in zip(k.chunk(n_parts, dim=-2), v.chunk(n_parts, dim=-2), strict=True):
        out, lse = attend_to_part(q, k_part, v_part)
        outs.append(out)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)  # (P, ..., n, d_v), (P, ..., n)


def split_softmax(q, k, v, n_parts):
    """The reference fix: the parts' shares are a softmax of their log-sum-exps."""
    outs, lses = _parts(q, k, v, n_parts)
    return (torch.softmax(lses, dim=0)[..., None] * outs).sum(0)


def split_max_subtracted(q, k, v, n_parts):
    """The same with the maximum subtracted by hand."""
    outs, lses = _parts(q, k, v, n_parts)
    mass = torch.exp(lses - lses.amax(0, keepdim=True))  # the largest part has mass 1
    return (mass[..., None] * outs).sum(0) / mass.sum(0)[..., None]


def split_running(q, k, v, n_parts):
    """Another correct fix: fold the parts in one at a time, keeping the running log-sum-exp
    (the lecture's rescaling, one level up)."""
    out, lse = None, None
    for k_part, v_part in zip(k.chunk(n_parts, dim=-2), v.chunk(n_parts, dim=-2), strict=True):
        part_out, part_lse = attend_to_part(q, k_part, v_part)
        if out is None:
            out, lse = part_out, part_lse
            continue
        new_lse = torch.logaddexp(lse, part_lse)  # (..., n)
        out = (torch.exp(lse - new_lse)[..., None] * out
               + torch.exp(part_lse - new_lse)[..., None] * part_out)
        lse = new_lse
    return out


@pytest.mark.parametrize("fn", [split_softmax, split_max_subtracted, split_running,
                                lambda q, k, v, p: efficient.chunked_attention(
                                    q, k, v, block_size=-(-q.shape[-2] // p))])
def test_fixed_split_attention_accepts_correct_fixes(fn, capsys):
    check_fixed_split_attention(fn)
    assert "fixed_split_attention is correct" in capsys.readouterr().out


def test_the_planted_bug_shows_only_on_extreme_scores():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 10, 8, generator=gen) for _ in range(3))
    exact = F.scaled_dot_product_attention(q, k, v)
    for n_parts in (1, 3, 10):  # ordinary scores: right with any parts
        torch.testing.assert_close(buggy_split_attention(q, k, v, n_parts), exact)
    large = 20 * q.abs(), 20 * k.abs(), v  # scores in the hundreds
    assert torch.isnan(buggy_split_attention(*large, 2)).any()
    torch.testing.assert_close(split_softmax(*large, 2), F.scaled_dot_product_attention(*large),
                               atol=1e-4, rtol=1e-4)  # scores in the hundreds: float32 rounding
    low = q.abs() + 0.5, -(k.abs() + 0.5) * 200, v  # every score below -104
    assert bool((low[0] @ low[1].transpose(-2, -1) / math.sqrt(8) < -104).all())
    assert torch.isnan(buggy_split_attention(*low, 2)).all()
    torch.testing.assert_close(split_softmax(*low, 2), F.scaled_dot_product_attention(*low),
                               atol=1e-3, rtol=1e-3)  # scores in the thousands: float32 rounding


def _combined_with(weights_of):
    def combined(q, k, v, n_parts):
        outs, lses = _parts(q, k, v, n_parts)
        return (weights_of(lses)[..., None] * outs).sum(0)
    return combined


WRONG_FIX = {
    "unchanged": (buggy_split_attention, "planted bug is still there"),
    "the planted bug, retyped": (_combined_with(lambda lses: lses.exp() / lses.exp().sum(0)),
                                 "planted bug is still there"),
    "in float64": (lambda q, k, v, p: buggy_split_attention(q.double(), k.double(), v.double(),
                                                            p).float(), "float64"),
    "plain mean": (_combined_with(lambda lses: torch.full_like(lses, 1 / len(lses))),
                   "plain mean"),
    "not normalised": (_combined_with(lambda lses: torch.exp(lses - lses.amax(0))),
                       "do not add up to 1"),
    "softmax over the queries": (_combined_with(lambda lses: torch.softmax(lses, dim=-1)),
                                 "over the queries"),
    "off by a little": (lambda q, k, v, p: split_softmax(q, k, v, p) * 1.01, "wrong values"),
    "whole score matrix": (lambda q, k, v, p: torch.softmax(
        q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v, "whole score matrix"),
    "fused attention": (lambda q, k, v, p: F.scaled_dot_product_attention(q, k, v),
                        "comes from F.scaled_dot_product_attention"),
    "a tuple": (lambda q, k, v, p: (split_softmax(q, k, v, p), None), "not a tuple"),
}


@pytest.mark.parametrize("name", list(WRONG_FIX))
def test_fixed_split_attention_rejects_wrong_fixes(name):
    fn, message = WRONG_FIX[name]
    with pytest.raises(CheckFailure, match=message) as failure:
        check_fixed_split_attention(fn)
    planted = name in ("unchanged", "the planted bug, retyped")
    # the planted bug and its instrument are named only when the output is the planted bug's
    assert ("planted bug" in str(failure.value)) == planted
