"""FlashAttention-2 in plain PyTorch against references nobody here wrote:
F.scaled_dot_product_attention and its autograd (with a causal mask built by torch's own
``causal_lower_right``), torch.autograd.gradcheck, torch's saved-tensor hooks (what autograd
keeps for the backward pass) and FlopCounterMode (which tiles ran); plus property tests, the
memory claim and bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right
from torch.utils.flop_counter import FlopCounterMode

from course_lib.attention import scaled_dot_product_attention
from course_lib.flash import flash_attention
from course_lib.instruments.measure import peak_memory

F64 = dict(atol=1e-12, rtol=1e-10)  # float64: equal up to rounding (measured <= 4e-15)
F32 = dict(atol=2e-5, rtol=1e-5)  # float32: measured <= 2.4e-6 (n <= 333, Dh 64, CPU)


def _qkv(*lead, seq_len, src_len, d=8, dv=None, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((seq_len, d), (src_len, d), (src_len, dv or d), (seq_len, dv or d))
    q, k, v, d_out = (torch.randn(*lead, *s, generator=gen, dtype=dtype).to(device)
                      for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), d_out


def _torch_mask(seq_len, src_len, device="cpu"):
    """The lower-right causal mask, built by torch (True = may attend)."""
    return causal_lower_right(seq_len, src_len)._materialize(torch.device(device))


def _out_and_grads(fn, q, k, v, d_out):
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), d_out))


def _sdpa_out_and_grads(q, k, v, d_out, is_causal):
    """torch's attention and its autograd. Causal with T > S, the first T - S queries see no
    key: torch's answer for them has changed across versions (NaN, then zeros), so they are
    left out of its call and get zeros and no gradient, as flash_attention's docstring says."""
    empty = max(0, q.shape[-2] - k.shape[-2]) if is_causal else 0
    q_seen = q[..., empty:, :]  # (..., T - empty, Dh)
    mask = _torch_mask(q_seen.shape[-2], k.shape[-2], q.device) if is_causal else None
    out, dq, dk, dv = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask), q_seen, k, v, d_out[..., empty:, :])
    no_out, no_dq = torch.zeros_like(d_out[..., :empty, :]), torch.zeros_like(q[..., :empty, :])
    return torch.cat([no_out, out], -2), torch.cat([no_dq, dq], -2), dk, dv


def _assert_equals_sdpa(q, k, v, d_out, *, block_size, is_causal, tol):
    ours = _out_and_grads(lambda q, k, v: flash_attention(
        q, k, v, block_size=block_size, is_causal=is_causal), q, k, v, d_out)
    ref = _sdpa_out_and_grads(q, k, v, d_out, is_causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref, strict=True):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------- equal to PyTorch's


@on_devices
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("seq_len", "src_len", "block_size"), [
    (32, 32, 8),  # blocks divide T and S
    (37, 37, 5),  # they do not
    (13, 29, 4),  # T < S: a cache's queries, the last T of S positions
    (29, 13, 6),  # T > S: causal, the first 16 queries see no key
    (7, 9, 64),  # one tile, larger than T and S
    (6, 6, 1),  # one query and one key per tile
])
def test_output_and_gradients_equal_pytorch(device, is_causal, seq_len, src_len, block_size):
    for dtype, tol in ((torch.float64, F64), (torch.float32, F32)):
        if device.type == "mps" and dtype == torch.float64:
            continue
        q, k, v, d_out = _qkv(2, 3, seq_len=seq_len, src_len=src_len, d=8, dv=5, dtype=dtype,
                              device=device)
        _assert_equals_sdpa(q, k, v, d_out, block_size=block_size, is_causal=is_causal, tol=tol)


@pytest.mark.parametrize("lead", [(), (2,), (2, 3)], ids=["(T,Dh)", "(B,T,Dh)", "(B,H,T,Dh)"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_any_leading_shape(lead, is_causal):
    q, k, v, d_out = _qkv(*lead, seq_len=11, src_len=14, d=4, dv=6)
    _assert_equals_sdpa(q, k, v, d_out, block_size=4, is_causal=is_causal, tol=F64)


def test_scale_and_huge_scores():
    """An explicit scale, and scores of +-1000: exp would overflow without the running max."""
    q, k, v, d_out = _qkv(2, seq_len=10, src_len=10, d=4)
    ours = _out_and_grads(lambda q, k, v: flash_attention(
        q, k, v, block_size=3, scale=300.0), q, k, v, d_out)
    ref = _out_and_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, scale=300.0), q, k, v, d_out)
    for a, b in zip(ours, ref, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **F64)


@settings(max_examples=30)
@given(lead=st.sampled_from([(), (1,), (2, 1), (1, 2)]), seq_len=st.integers(1, 12),
       src_len=st.integers(1, 12), d=st.integers(1, 5), dv=st.integers(1, 5),
       block_size=st.integers(1, 14), is_causal=st.booleans(), seed=st.integers(0, 2**16))
def test_property_equals_pytorch(lead, seq_len, src_len, d, dv, block_size, is_causal, seed):
    q, k, v, d_out = _qkv(*lead, seq_len=seq_len, src_len=src_len, d=d, dv=dv, seed=seed)
    _assert_equals_sdpa(q, k, v, d_out, block_size=block_size, is_causal=is_causal, tol=F64)


@pytest.mark.parametrize(("is_causal", "seq_len", "src_len"),
                         [(False, 5, 7), (True, 5, 7), (True, 7, 4)])
def test_gradcheck(is_causal, seq_len, src_len):
    q, k, v, _ = _qkv(2, seq_len=seq_len, src_len=src_len, d=3, dv=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention(q, k, v, block_size=2, is_causal=is_causal), (q, k, v))


def test_a_query_with_no_allowed_key_gets_zeros_and_passes_no_gradient():
    """Causal with T > S: the first T - S queries come before every key. They get a zero output
    and zero gradients, as torch's attention with an all-False mask row, never NaN."""
    q, k, v, d_out = _qkv(seq_len=9, src_len=4, d=3)
    out, dq, dk, dv = _out_and_grads(lambda q, k, v: flash_attention(
        q, k, v, block_size=3, is_causal=True), q, k, v, d_out)  # block 2 mixes both kinds
    assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv))
    assert (out[:5] == 0).all() and (dq[:5] == 0).all()
    assert (out[5:] != 0).all() and (dq[6:] != 0).all()  # query 5 sees one key: dq = 0


def test_future_keys_change_neither_the_past_outputs_nor_their_gradients():
    q, k, v, d_out = _qkv(seq_len=12, src_len=12, d=4)
    d_out[8:] = 0  # a loss on the first 8 outputs only
    before = _out_and_grads(lambda q, k, v: flash_attention(
        q, k, v, block_size=5, is_causal=True), q, k, v, d_out)
    with torch.no_grad():
        k[8:] += 10.0
        v[8:] -= 3.0
    after = _out_and_grads(lambda q, k, v: flash_attention(
        q, k, v, block_size=5, is_causal=True), q, k, v, d_out)
    torch.testing.assert_close(after[0][:8], before[0][:8], **F64)
    torch.testing.assert_close(after[1], before[1], **F64)  # dq
    assert (after[2][8:] == 0).all() and (after[3][8:] == 0).all()  # dk, dv of future keys


def test_causal_skips_the_key_tiles_in_the_future():
    """FlopCounterMode counts the matmuls: 8 x 8 tiles of 8, causal runs the 36 on and below
    the diagonal, forward and backward."""
    def flops(is_causal):
        q, k, v, d_out = _qkv(seq_len=64, src_len=64, d=8)
        with FlopCounterMode(display=False) as counter:
            out = flash_attention(q, k, v, block_size=8, is_causal=is_causal)
            out.backward(d_out)
        return counter.get_total_flops()
    assert flops(True) * 64 == flops(False) * 36


def test_a_second_derivative_is_refused_not_dropped():
    """The backward pass treats L as a constant: differentiating it again would be wrong."""
    q, k, v, d_out = _qkv(seq_len=4, src_len=4, d=2)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(flash_attention(q, k, v, block_size=2), q, d_out, create_graph=True)


# ---------------------------------------------------------------- what is kept for backward


def _saved_for_backward(fn):
    """Every tensor autograd keeps for the backward pass while ``fn()`` runs, and the output."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return saved, out


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of ``fn()``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in _saved_for_backward(fn)[0]}
    return sum(storages.values())


def _holds_a_score_matrix(saved, seq_len, src_len) -> bool:
    return any(t.shape[-2:] == (seq_len, src_len) or t.numel() >= seq_len * src_len
               for t in saved)


def _naive(q, k, v):
    return scaled_dot_product_attention(q, k, v)[0]  # the equations, autograd keeps weights


def test_backward_keeps_only_q_k_v_out_and_the_logsumexp():
    q, k, v, _ = _qkv(2, 3, seq_len=40, src_len=48, d=4, dv=5)
    saved, out = _saved_for_backward(lambda: flash_attention(q, k, v, block_size=8))
    assert [tuple(t.shape) for t in saved] == [(2, 3, 40, 4), (2, 3, 48, 4), (2, 3, 48, 5),
                                               (2, 3, 40, 5), (2, 3, 40)]
    assert saved[0] is q and saved[1] is k and saved[2] is v
    assert saved[3].data_ptr() == out.data_ptr()
    scores = (q @ k.transpose(-2, -1)) / 2.0  # Dh = 4
    torch.testing.assert_close(saved[4], torch.logsumexp(scores, dim=-1), **F64)
    assert not _holds_a_score_matrix(saved, 40, 48)


def test_the_score_matrix_check_catches_naive_attention():
    """The same inspection finds the (T, S) weights that naive attention's autograd keeps."""
    q, k, v, _ = _qkv(2, 3, seq_len=40, src_len=48, d=4, dv=5)
    saved, _ = _saved_for_backward(lambda: _naive(q, k, v))
    assert _holds_a_score_matrix(saved, 40, 48)


def test_saved_bytes_grow_linearly_for_flash_and_quadratically_for_naive():
    """Exact: flash keeps (T Dh + S Dh + S Dv + T Dv + T) numbers per head, n^1; naive attention
    keeps its (n, n) weights, so doubling n nearly quadruples what it keeps."""
    def saved(fn, n):
        q, k, v, _ = _qkv(1, 2, seq_len=n, src_len=n, d=8, dtype=torch.float32)
        return _saved_bytes(lambda: fn(q, k, v))
    flash = {n: saved(lambda q, k, v: flash_attention(q, k, v, block_size=16), n)
             for n in (64, 128, 256)}
    naive = {n: saved(_naive, n) for n in (64, 128, 256)}
    for n in flash:
        assert flash[n] == 4 * 2 * (4 * n * 8 + n)  # float32, 2 heads, q k v out + L
    assert flash[256] == 2 * flash[128] == 4 * flash[64]
    assert naive[256] > 3.5 * naive[128] and naive[128] > 3.0 * naive[64]


def _slope(sizes, values) -> float:
    """The least-squares slope of log(value) against log(n)."""
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def test_peak_memory_of_forward_and_backward_is_linear_for_flash():
    """course_lib's peak_memory counts every tensor created until it is freed, the backward
    pass's too (exact and repeatable): flash grows like n, naive attention like n^2."""
    def peak(fn, n):
        q, k, v, d_out = _qkv(1, seq_len=n, src_len=n, d=16, dtype=torch.float32)
        return peak_memory(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), d_out))
    sizes = (128, 256, 512)
    flash = [peak(lambda q, k, v: flash_attention(q, k, v, block_size=32), n) for n in sizes]
    naive = [peak(_naive, n) for n in sizes]
    assert _slope(sizes, flash) < 1.1 and _slope(sizes, naive) > 1.7
    assert flash[2] - flash[1] == 2 * (flash[1] - flash[0])  # exactly a + b n
    assert flash[-1] < naive[-1] / 5


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("change", "error", "names"), [
    (dict(q=[[1.0]]), TypeError, "q"),
    (dict(q=torch.ones(5)), ValueError, "q"),
    (dict(k=torch.ones(2, 6, 3)), ValueError, "k"),  # Dh 3 against q's 4
    (dict(v=torch.ones(2, 5, 4)), ValueError, "v"),  # S 5 against k's 6
    (dict(k=torch.ones(3, 6, 4)), ValueError, "k"),  # another batch
    (dict(q=torch.ones(2, 4, 4, dtype=torch.long)), ValueError, "q"),
    (dict(v=torch.ones(2, 6, 4, dtype=torch.float64)), ValueError, "v"),
    (dict(block_size=0), ValueError, "block_size"),
    (dict(block_size=-4), ValueError, "block_size"),
    (dict(block_size=4.0), TypeError, "block_size"),
    (dict(block_size="4"), TypeError, "block_size"),
    (dict(block_size=True), TypeError, "block_size"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(scale=0.0), ValueError, "scale"),
    (dict(scale=-0.5), ValueError, "scale"),
    (dict(scale=float("nan")), ValueError, "scale"),
    (dict(scale="0.5"), TypeError, "scale"),
])
def test_bad_inputs_are_refused_naming_the_argument(change, error, names):
    kwargs = dict(q=torch.ones(2, 4, 4), k=torch.ones(2, 6, 4), v=torch.ones(2, 6, 4),
                  block_size=4, is_causal=False, scale=None) | change
    with pytest.raises(error, match=names):
        flash_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), **kwargs)


# ---------------------------------------------------------------------------------- benchmark


def test_the_flash_memory_benchmark_runs_and_its_numbers_add_up(capsys, monkeypatch, tmp_path):
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    flash_memory = importlib.import_module("benchmarks.flash_memory")
    flash_memory.main(["--sizes", "64", "128", "--repeat", "1", "--block-size", "16",
                       "--plot", str(tmp_path / "memory.png")])
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
            for line in out.splitlines() if line.split()[:1] in (["64"], ["128"])}
    assert sorted(rows) == [64, 128]
    for n, cells in rows.items():
        kept = dict(zip(("naive", "chunked", "flash", "fused"), cells[0::3], strict=True))
        # float32, one head of 64: q, k, v, out (n, 64) and L (n,), printed to 0.01 MiB
        assert kept["flash"] == round(4 * (4 * n * 64 + n) / 2**20, 2)
        assert kept["naive"] > kept["flash"] and kept["chunked"] > kept["flash"]
    assert "log-log slopes" in out and (tmp_path / "memory.png").stat().st_size > 0
