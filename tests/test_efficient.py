"""Efficient attention against references nobody here wrote: F.scaled_dot_product_attention
(with a mask built independently where one is needed), torch.logsumexp, torch.profiler's record
of the CPU allocator; plus property tests, the memory claim and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right
from torch.profiler import ProfilerActivity, profile

from course_lib import chunked_attention, sliding_window_attention
from course_lib.attention import scaled_dot_product_attention
from course_lib.efficient import (
    low_rank_attention,
    online_softmax_stats,
    online_softmax_step,
    score_matrix_bytes,
    sliding_window_mask,
)
from course_lib.instruments.measure import kernel_used, peak_memory

TOL = dict(atol=1e-5, rtol=1e-5)


def _qkv(*lead, seq_len, src_len, d=8, dv=None, device="cpu", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*lead, seq_len, d, generator=gen, dtype=dtype)
    k = torch.randn(*lead, src_len, d, generator=gen, dtype=dtype)
    v = torch.randn(*lead, src_len, dv or d, generator=gen, dtype=dtype)
    return q.to(device), k.to(device), v.to(device)


def _band_reference(n, window, causal):
    """The band written with triangular matrices, independently of sliding_window_mask."""
    ones = torch.ones(n, n, dtype=torch.bool)
    if causal:
        return torch.tril(ones) & torch.triu(ones, diagonal=-(window - 1))
    return torch.tril(ones, diagonal=window - 1) & torch.triu(ones, diagonal=-(window - 1))


# ------------------------------------------------------------------------------ online softmax


def test_online_softmax_stats_give_logsumexp_and_max():
    x = torch.randn(3, 4, 23, generator=torch.Generator().manual_seed(1)) * 10
    row_max, row_sum = online_softmax_stats(x.split([5, 1, 9, 8], dim=-1))
    torch.testing.assert_close(row_max, x.amax(-1))
    torch.testing.assert_close(row_max + row_sum.log(), torch.logsumexp(x, -1), **TOL)


def test_online_softmax_handles_huge_scores_and_masked_blocks():
    x = torch.tensor([[1000.0, 990.0, float("-inf"), float("-inf"), 1010.0]])
    row_max, row_sum = online_softmax_stats(x.split([2, 2, 1], dim=-1))  # one block all -inf
    assert torch.isfinite(row_sum).all()
    torch.testing.assert_close(row_max + row_sum.log(), torch.logsumexp(x, -1))


def test_online_softmax_survives_masked_leading_blocks():
    """A row whose first blocks are all -inf: its maximum stays -inf for a while, and
    exp(-inf - (-inf)) would be NaN; the library shifts such rows by 0 instead."""
    x = torch.randn(3, 9, generator=torch.Generator().manual_seed(2))
    x[0, :3] = -math.inf
    x[1, :6] = -math.inf
    x[2, :] = -math.inf  # a row with no allowed key at all
    row_max, row_sum = online_softmax_stats(x.split(3, dim=-1))
    torch.testing.assert_close(row_max[:2] + row_sum[:2].log(), torch.logsumexp(x[:2], -1))
    assert row_max[2].item() == -math.inf and row_sum[2].item() == 0.0


def test_online_softmax_rescales_the_old_sum_when_the_maximum_grows():
    m, s = torch.tensor([[2.0]]), torch.tensor([[3.0]])
    new_max, new_sum, rescale, probs = online_softmax_step(m, s, torch.tensor([[5.0, 1.0]]))
    assert new_max.item() == 5.0
    torch.testing.assert_close(rescale, torch.exp(torch.tensor([[-3.0]])))
    torch.testing.assert_close(new_sum, 3.0 * torch.exp(torch.tensor([[-3.0]])) + 1
                               + torch.exp(torch.tensor([[-4.0]])))
    torch.testing.assert_close(probs, torch.exp(torch.tensor([[0.0, -4.0]])))


def test_online_softmax_all_masked_so_far_is_not_nan():
    m, s = torch.full((1, 1), float("-inf")), torch.zeros(1, 1)
    new_max, new_sum, rescale, probs = online_softmax_step(m, s, torch.full((1, 3), -math.inf))
    assert new_sum.item() == 0.0 and rescale.item() == 0.0 and torch.equal(probs, torch.zeros(1, 3))


# --------------------------------------------------------------------------- chunked attention


@on_devices
@pytest.mark.parametrize("block_size", [1, 3, 7, 16, 100])
@pytest.mark.parametrize("seq_len,src_len", [(13, 13), (5, 19), (1, 1), (17, 17)])
def test_chunked_attention_equals_pytorch(device, block_size, seq_len, src_len):
    q, k, v = _qkv(2, 3, seq_len=seq_len, src_len=src_len, dv=5, device=device)
    expected = F.scaled_dot_product_attention(q, k, v)
    got = chunked_attention(q, k, v, block_size=block_size)
    torch.testing.assert_close(got, expected, **TOL)


@on_devices
@pytest.mark.parametrize("block_size", [1, 4, 7, 64])
@pytest.mark.parametrize("seq_len,src_len", [(13, 13), (5, 19), (30, 30)])
def test_causal_chunked_attention_equals_pytorch(device, block_size, seq_len, src_len):
    """The causal mask is aligned bottom-right (queries are the last T positions), which is
    PyTorch's causal_lower_right; for T == S it is F.scaled_dot_product_attention's
    is_causal=True (which aligns top-left when T != S)."""
    q, k, v = _qkv(2, 3, seq_len=seq_len, src_len=src_len, dv=6, device=device)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(seq_len,
                                                                                   src_len))
    got = chunked_attention(q, k, v, block_size=block_size, is_causal=True)
    torch.testing.assert_close(got, expected, **TOL)
    if seq_len == src_len:
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                   **TOL)


def test_causal_chunked_attention_with_more_queries_than_keys_gives_zeros_for_empty_rows():
    q, k, v = _qkv(2, seq_len=9, src_len=4)
    got = chunked_attention(q, k, v, block_size=2, is_causal=True)
    mask = torch.tril(torch.ones(9, 4, dtype=torch.bool), diagonal=4 - 9)
    expected, _ = scaled_dot_product_attention(q, k, v, mask=mask)
    torch.testing.assert_close(got, expected, **TOL)
    assert torch.equal(got[:, :5], torch.zeros(2, 5, 8))  # queries 0..4 see no key


def test_causal_is_aligned_with_the_last_keys_unlike_torch_is_causal():
    q, k, v = _qkv(2, seq_len=3, src_len=7)
    ours = chunked_attention(q, k, v, block_size=2, is_causal=True)
    lower_right = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 7))
    torch.testing.assert_close(ours, lower_right, **TOL)
    top_left = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(ours, top_left, atol=1e-3)


def test_chunked_attention_unbatched_float64_and_scale():
    q, k, v = _qkv(seq_len=11, src_len=6, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.3)[0]
    torch.testing.assert_close(chunked_attention(q, k, v, block_size=4, scale=0.3), expected)


def test_chunked_attention_is_stable_for_huge_scores():
    q, k, v = _qkv(1, seq_len=8, src_len=8)
    got = chunked_attention(q * 100, k * 100, v, block_size=3)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q * 100, k * 100, v), **TOL)


def test_chunked_attention_gradients_match():
    q, k, v = (t.requires_grad_() for t in _qkv(2, seq_len=7, src_len=7, dtype=torch.float64))
    chunked_attention(q, k, v, block_size=3, is_causal=True).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    F.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    for got, t in zip(grads, (q, k, v), strict=True):
        torch.testing.assert_close(got, t.grad)


@given(
    batch=st.integers(1, 2), heads=st.integers(1, 3), seq_len=st.integers(1, 20),
    extra=st.integers(0, 8), block_size=st.integers(1, 12), causal=st.booleans(),
)
def test_chunked_attention_property(batch, heads, seq_len, extra, block_size, causal):
    src_len = seq_len + extra
    q, k, v = _qkv(batch, heads, seq_len=seq_len, src_len=src_len, dv=3, dtype=torch.float64)
    mask = causal_lower_right(seq_len, src_len) if causal else None
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = chunked_attention(q, k, v, block_size=block_size, is_causal=causal)
    torch.testing.assert_close(got, expected)


# -------------------------------------------------------------------- sliding-window attention


@pytest.mark.parametrize("n", [1, 5, 12])
@pytest.mark.parametrize("window", [1, 2, 3, 12, 20])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_mask_is_the_band(n, window, causal):
    assert torch.equal(sliding_window_mask(n, window, is_causal=causal),
                       _band_reference(n, window, causal))


def test_the_window_counts_the_token_itself():
    mask = sliding_window_mask(10, 3)
    assert mask.sum(-1).tolist() == [1, 2, 3, 3, 3, 3, 3, 3, 3, 3]  # itself and 2 before
    assert mask.diagonal().all()
    assert torch.equal(sliding_window_mask(6, 1), torch.eye(6, dtype=torch.bool))
    assert torch.equal(sliding_window_mask(6, 6), torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    assert sliding_window_mask(10, 3, is_causal=False).sum(-1).tolist()[2:-2] == [5] * 6


def test_sliding_window_mask_with_a_cache_aligns_the_queries_last():
    mask = sliding_window_mask(2, 3, n_keys=6)
    assert torch.equal(mask, _band_reference(6, 3, True)[-2:])


@on_devices
@pytest.mark.parametrize("n", [1, 2, 7, 16, 33])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_attention_equals_masked_pytorch(device, n, window, causal):
    q, k, v = _qkv(2, 3, seq_len=n, src_len=n, dv=5, device=device)
    mask = _band_reference(n, window, causal).to(device)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = sliding_window_attention(q, k, v, window=window, is_causal=causal)
    torch.testing.assert_close(got, expected, **TOL)


def test_a_window_of_one_returns_the_values():
    q, k, v = _qkv(3, seq_len=9, src_len=9)
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=1), v)


def test_sliding_window_attention_unbatched_and_scale():
    q, k, v = _qkv(seq_len=10, src_len=10, dtype=torch.float64)
    mask = _band_reference(10, 4, True)
    expected = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                              scale=2.0)[0]
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=4, scale=2.0), expected)


@given(n=st.integers(1, 40), window=st.integers(1, 45), causal=st.booleans())
def test_sliding_window_attention_property(n, window, causal):
    q, k, v = _qkv(2, seq_len=n, src_len=n, dtype=torch.float64, seed=n * 100 + window)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=sliding_window_mask(n, window, is_causal=causal))
    torch.testing.assert_close(sliding_window_attention(q, k, v, window=window,
                                                        is_causal=causal), expected)


def test_sliding_window_attention_is_causal():
    q, k, v = _qkv(1, seq_len=12, src_len=12)
    out = sliding_window_attention(q, k, v, window=4)
    k2, v2 = k.clone(), v.clone()
    k2[:, 8:] += 5.0
    v2[:, 8:] -= 3.0
    out2 = sliding_window_attention(q, k2, v2, window=4)
    torch.testing.assert_close(out2[:, :8], out[:, :8])  # earlier outputs ignore later tokens
    assert not torch.allclose(out2[:, 8:], out[:, 8:])


@pytest.mark.parametrize("causal", [True, False])
def test_a_window_much_longer_than_the_sequence_costs_no_more_than_window_n(causal):
    """The band reaches no further than the sequence's ends: window=100000 at n=16 is full
    (causal) attention, and takes the memory of window=16, not memory growing with window."""
    q, k, v = _qkv(2, seq_len=16, src_len=16)
    huge = sliding_window_attention(q, k, v, window=100_000, is_causal=causal)
    torch.testing.assert_close(huge, F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                               **TOL)
    on_meta = [t.to("meta") for t in (q, k, v)]
    bytes_huge = peak_memory(lambda: sliding_window_attention(*on_meta, window=100_000,
                                                              is_causal=causal))
    bytes_n = peak_memory(lambda: sliding_window_attention(*on_meta, window=16, is_causal=causal))
    assert bytes_huge == bytes_n < 100_000


@pytest.mark.parametrize("window", [1, 2, 3, 7, 30])
def test_sliding_window_mask_matches_hugging_face(window):
    """Hugging Face's mask functions (used by its Mistral models), evaluated on index grids:
    the causal window keeps kv_idx > q_idx - W; the bidirectional one |q_idx - kv_idx| <= W,
    which is ours with window W + 1."""
    masking_utils = pytest.importorskip("transformers.masking_utils")
    q_idx, kv_idx = torch.arange(12)[:, None], torch.arange(12)[None, :]
    theirs = masking_utils.sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)
    assert torch.equal(sliding_window_mask(12, window), theirs)
    bidirectional = masking_utils.sliding_window_bidirectional_overlay(window)(0, 0, q_idx, kv_idx)
    assert torch.equal(sliding_window_mask(12, window + 1, is_causal=False), bidirectional)


# -------------------------------------------------------------------------- low-rank attention


def test_low_rank_attention_with_the_identity_is_exact_attention():
    q, k, v = _qkv(2, 2, seq_len=6, src_len=9)
    eye = torch.eye(9)
    torch.testing.assert_close(low_rank_attention(q, k, v, eye),
                               F.scaled_dot_product_attention(q, k, v), **TOL)


def test_low_rank_attention_equals_attention_to_the_projected_keys():
    q, k, v = _qkv(2, seq_len=6, src_len=9, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    e = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    f = torch.randn(4, 9, generator=gen, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, e @ k, f @ v)
    torch.testing.assert_close(low_rank_attention(q, k, v, e, f), expected)


def test_low_rank_attention_is_exact_when_keys_repeat_in_segments():
    """Pooling segments of identical keys and values loses nothing: with P the segment-mean
    projection, softmax over segments weighted by their sizes is exact. Equal segment sizes
    give equal weights, so plain mean pooling reproduces full attention."""
    q, _, _ = _qkv(1, seq_len=5, src_len=3, dtype=torch.float64)
    _, k3, v3 = _qkv(1, seq_len=1, src_len=3, dtype=torch.float64, seed=4)
    k, v = k3.repeat_interleave(4, dim=-2), v3.repeat_interleave(4, dim=-2)  # (1, 12, d)
    pool = torch.eye(3, dtype=torch.float64).repeat_interleave(4, dim=1) / 4  # (3, 12)
    torch.testing.assert_close(low_rank_attention(q, k, v, pool),
                               F.scaled_dot_product_attention(q, k, v))


# ------------------------------------------------------------------------------------ memory


@pytest.mark.parametrize("shape", [(1, 1, 8192, 8192), (2, 12, 512, 512), (3, 4, 5, 7),
                                   (8, 32, 32768, 32768), (1, 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_score_matrix_bytes_is_the_size_of_the_tensor(shape, dtype):
    """Against torch's own count: a tensor of that shape on the meta device (no memory)."""
    reference = torch.empty(shape, dtype=dtype, device="meta").nbytes
    batch, heads, n_queries, n_keys = shape
    assert score_matrix_bytes(batch, heads, n_queries, n_keys, dtype=dtype) == reference
    if n_queries == n_keys:
        assert score_matrix_bytes(batch, heads, n_queries, dtype=dtype) == reference


def test_peak_memory_counts_new_tensors_once_and_not_views_or_inputs():
    x = torch.randn(1000)
    assert peak_memory(lambda: torch.empty(250)) == 1000
    assert peak_memory(lambda: x.view(10, 100).T[2:]) == 0  # views of the input
    assert peak_memory(lambda: x.mul_(1.0)) == 0  # in place
    assert peak_memory(lambda: (x + 1).chunk(4)) == 4000  # one storage, four views


def test_peak_memory_sees_temporaries_freed_before_the_end():
    x = torch.randn(1000)

    def freed_early():
        a = x * 2  # 4000 bytes
        b = a + 1  # 4000 more: 8000 alive, the peak
        del a  # 4000
        return b.sum()  # 4004

    def kept():
        a = x * 2
        b = a + 1
        return b.sum()  # a, b and the sum alive together: 8004

    assert peak_memory(freed_early) == 8000
    assert peak_memory(kept) == 8004


def _profiler_peak(fn) -> int:
    """Peak bytes held by the CPU allocator during fn(), from the allocation events that
    torch.profiler records (a second, independent measurement)."""
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
                sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


def test_peak_memory_agrees_with_the_profiler_on_naive_attention():
    q, k, v = _qkv(1, 2, seq_len=512, src_len=512, d=32)

    def naive():
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(32), dim=-1) @ v

    with torch.no_grad():
        ours, theirs = peak_memory(naive), _profiler_peak(naive)
    assert ours == 2 * score_matrix_bytes(1, 2, 512)  # the scores and the weights
    assert abs(ours - theirs) <= 0.02 * theirs


def test_chunked_attention_peak_memory_is_at_most_ten_percent_of_naive():
    """The memory claim like for like (exact attention without a mask, both ways) at the
    largest size this CPU test affords, measured twice: with peak_memory (tensors created by
    each operator) and with torch.profiler (every allocation of the CPU allocator, kernels'
    scratch buffers included)."""
    n = 4096
    q, k, v = _qkv(1, 1, seq_len=n, src_len=n, d=64)

    def naive():
        return scaled_dot_product_attention(q, k, v)[0]

    def chunked():
        return chunked_attention(q, k, v, block_size=256)

    with torch.no_grad():
        for measure in (peak_memory, _profiler_peak):
            assert measure(chunked) <= 0.10 * measure(naive)
        assert peak_memory(naive) >= 2 * score_matrix_bytes(1, 1, n)


def test_chunked_and_windowed_memory_grow_linearly_naive_quadratically():
    """Doubling n adds twice as much memory the second time for a linear cost (a + b n),
    four times as much for a quadratic one."""
    def growth(fn):
        peaks = []
        for n in (512, 1024, 2048):
            q, k, v = _qkv(1, seq_len=n, src_len=n, d=16)
            with torch.no_grad():
                peaks.append(peak_memory(lambda q=q, k=k, v=v: fn(q, k, v)))
        return (peaks[2] - peaks[1]) / (peaks[1] - peaks[0])

    assert 1.9 < growth(lambda q, k, v: chunked_attention(q, k, v, block_size=64)) < 2.1
    assert 1.9 < growth(lambda q, k, v: sliding_window_attention(q, k, v, window=32)) < 2.1
    assert 3.9 < growth(lambda q, k, v: scaled_dot_product_attention(q, k, v)[0]) < 4.1


def test_peak_memory_on_the_meta_device_equals_the_real_run():
    """Shapes alone decide the allocations: a meta run measures big sizes for free."""
    q, k, v = _qkv(1, seq_len=256, src_len=256)

    def naive(q, k, v):
        return scaled_dot_product_attention(q, k, v)[0]

    on_meta = [t.to("meta") for t in (q, k, v)]  # no data, only shapes
    real = peak_memory(lambda: naive(q, k, v))
    meta = peak_memory(lambda: naive(*on_meta))
    assert real == meta > 0


# ---------------------------------------------------------------------------------- bad inputs


BAD_CHUNKED = {
    "block_size=0": (dict(block_size=0), ValueError, r"block_size .*>= 1.*got 0"),
    "block_size=2.5": (dict(block_size=2.5), TypeError, r"block_size .*>= 1.*2\.5"),
    "block_size='4'": (dict(block_size="4"), TypeError, r"block_size .*'4'.*without quotes"),
    "is_causal=1": (dict(block_size=4, is_causal=1), TypeError, r"is_causal .*True or False"),
    "scale=0": (dict(block_size=4, scale=0.0), ValueError, r"scale .*> 0"),
}


@pytest.mark.parametrize("name", list(BAD_CHUNKED))
def test_chunked_attention_bad_arguments(name):
    kwargs, error, message = BAD_CHUNKED[name]
    q, k, v = _qkv(seq_len=4, src_len=4)
    with pytest.raises(error, match=message):
        chunked_attention(q, k, v, **kwargs)


def test_chunked_attention_bad_tensors():
    q, k, v = _qkv(2, seq_len=4, src_len=5)
    with pytest.raises(ValueError, match=r"q .*\(2, 4, 8\).*k .*\(2, 5, 3\)"):
        chunked_attention(q, k[..., :3], v, block_size=2)
    with pytest.raises(ValueError, match=r"v .*\(2, 4, 8\).*\(\.\.\., S, Dv\)"):
        chunked_attention(q, k, v[:, :4], block_size=2)
    with pytest.raises(ValueError, match=r"k .*torch.float64.*k\.float\(\)"):
        chunked_attention(q, k.double(), v, block_size=2)
    with pytest.raises(ValueError, match=r"q .*floating-point.*int64"):
        chunked_attention(q.long(), k, v, block_size=2)
    with pytest.raises(ValueError, match=r"q .*\(\.\.\., T, Dh\).*\(8,\)"):
        chunked_attention(q[0, 0], k, v, block_size=2)
    with pytest.raises(TypeError, match=r"q .*torch.Tensor.*list"):
        chunked_attention(q.tolist(), k, v, block_size=2)


Q = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))  # (B, T, Dh)
SCALED = {
    "chunked_attention": lambda s: chunked_attention(Q, Q, Q, block_size=4, scale=s),
    "sliding_window_attention": lambda s: sliding_window_attention(Q, Q, Q, window=2, scale=s),
    "low_rank_attention": lambda s: low_rank_attention(Q, Q, Q, torch.randn(3, 6), scale=s),
}


@pytest.mark.parametrize("name", sorted(SCALED))
@pytest.mark.parametrize("scale", [1 // math.sqrt(8), -0.5, float("nan")])
def test_a_scale_of_zero_or_less_is_refused_with_the_usual_formula(name, scale):
    with pytest.raises(ValueError, match=r"scale .*> 0.*1 / math\.sqrt"):
        SCALED[name](scale)


def test_sliding_window_bad_inputs():
    q, k, v = _qkv(2, seq_len=6, src_len=6)
    with pytest.raises(ValueError, match=r"window .*>= 1.*got 0"):
        sliding_window_attention(q, k, v, window=0)
    with pytest.raises(TypeError, match=r"window .*>= 1.*3\.0"):
        sliding_window_attention(q, k, v, window=3.0)
    with pytest.raises(ValueError, match=r"k .*6 positions.*q .*2.*sliding_window_mask"):
        sliding_window_attention(q[:, :2], k, v, window=3)
    with pytest.raises(ValueError, match=r"window .*>= 1.*-1"):
        sliding_window_mask(5, -1)
    with pytest.raises(TypeError, match=r"is_causal .*True or False"):
        sliding_window_mask(5, 2, is_causal="yes")


def test_low_rank_bad_inputs():
    q, k, v = _qkv(seq_len=4, src_len=6)
    with pytest.raises(ValueError, match=r"proj_k .*\(3, 5\).*\(R, S\) = \(3, 6\)"):
        low_rank_attention(q, k, v, torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"proj_k .*\(R, S\).*\(6,\)"):
        low_rank_attention(q, k, v, torch.randn(6))
    with pytest.raises(ValueError, match=r"proj_k .*torch.float64.*proj_k\.float\(\)"):
        low_rank_attention(q, k, v, torch.randn(3, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"proj_v .*\(2, 6\).*\(R, S\) = \(3, 6\)"):
        low_rank_attention(q, k, v, torch.randn(3, 6), torch.randn(2, 6))


def test_memory_helpers_bad_inputs():
    with pytest.raises(TypeError, match=r"dtype .*torch.dtype.*'float16'"):
        score_matrix_bytes(1, 1, 4, dtype="float16")
    with pytest.raises(ValueError, match=r"dtype .*floating-point.*int64"):
        score_matrix_bytes(1, 1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"heads .*>= 1.*got 0"):
        score_matrix_bytes(1, 0, 4)
    with pytest.raises(TypeError, match=r"fn .*function.*Tensor"):
        peak_memory(torch.randn(3))


def test_online_softmax_stats_bad_inputs():
    with pytest.raises(ValueError, match=r"blocks .*empty"):
        online_softmax_stats([])
    with pytest.raises(ValueError, match=r"blocks\[1\] .*\(3, 2\).*\(\.\.\., b\)"):
        online_softmax_stats([torch.randn(2, 4), torch.randn(3, 2)])
    with pytest.raises(ValueError, match=r"blocks\[0\] .*floating-point"):
        online_softmax_stats([torch.ones(2, 3, dtype=torch.long)])


# ---------------------------------------------------------------------------------- benchmark


def test_the_attention_cost_benchmark_runs_and_its_numbers_add_up(capsys):
    import importlib.util
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_cost.py"
    spec = importlib.util.spec_from_file_location("attention_cost", path)
    attention_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(attention_cost)

    attention_cost.main(["--sizes", "64", "96", "--repeat", "1", "--block-size", "32",
                         "--window", "8", "--heads", "2", "--head-dim", "64",
                         "--mha-shape", "2", "16", "32", "2", "--mha-rounds", "1",
                         "--mha-iters", "1"])
    out = capsys.readouterr().out
    for word in ("naive", "chunked", "windowed", "fused", "no mask", "causal", "ratios"):
        assert word in out
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
            for line in out.splitlines() if line.split()[:1] in (["64"], ["96"])}
    assert sorted(rows) == [64, 96]
    mib = 2**20
    for n, cells in rows.items():
        assert len(cells) == 8  # (ms, MiB) for naive, chunked, windowed, fused
        times, peaks = cells[0::2], dict(zip(("naive", "chunked", "windowed", "fused"),
                                             cells[1::2], strict=True))
        assert all(t > 0 for t in times)
        # course_lib's naive attention holds the scores, their exponentials and the weights,
        # and at most one output of (2 heads, n, 64) besides (printed to 0.01 MiB)
        matrices, output = 3 * score_matrix_bytes(1, 2, n), 2 * n * 64 * 4
        assert matrices / mib - 0.005 <= peaks["naive"] <= (matrices + output) / mib + 0.005
        assert peaks["fused"] < peaks["naive"]
    assert rows[96][3] < rows[96][1]  # chunked below naive once n exceeds the block
    ratios = [float(x) for x in re.findall(r"per-round ratios (\d+\.\d+)", out)]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)


def test_kernel_used_names_the_fused_kernel_or_the_math_path_operators():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(1, 2, 16, 8)
    fused = kernel_used(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert "scaled_dot_product" in fused and not fused.startswith("math path")
    with sdpa_kernel(SDPBackend.MATH):
        math = kernel_used(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q))
    assert math.startswith("math path: ") and "softmax" in math  # the operators it ran instead
    with pytest.raises(TypeError, match="fn must be a function with no arguments"):
        kernel_used(q)
