"""The cost of attention, re-measured on any machine (chapter 10's figures).

    python -m benchmarks.attention_cost                          # a short run (under a minute)
    python -m benchmarks.attention_cost --sizes 1024 2048 4096 8192 16384 --heads 8
    python -m benchmarks.attention_cost --device cuda --dtype float16 --causal
    python -m benchmarks.attention_cost --skip-attention         # only the MultiHeadAttention part

Part 1 prints, for each sequence length n, the time and the peak memory of one attention call
(batch 1, ``--heads`` heads of ``--head-dim``) computed four ways:

* naive: course_lib's ``scaled_dot_product_attention`` (the math path, builds the (n, n) weights);
* chunked: ``course_lib.chunked_attention`` (online softmax over blocks, exact);
* windowed: ``course_lib.sliding_window_attention`` (a band of ``--window`` keys; a different
  function, exact attention with a band mask);
* fused: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks the kernel).

Times are the fastest of ``--repeat`` runs (``course_lib.best_time``, which waits for the GPU).
Peak memory is what the call allocates beyond its inputs: on CUDA
``torch.cuda.max_memory_allocated`` (every allocation, kernels' scratch memory included); on
other devices ``course_lib.efficient.peak_memory``, which counts every tensor an operator
creates until it is freed (exact and repeatable; it does not see scratch buffers private to one
fused kernel). Naive attention is skipped where its score matrices would exceed
``--max-naive-gib``.

Part 2 times course_lib's ``MultiHeadAttention`` (fused path) against
``torch.nn.MultiheadAttention`` with the same weights, forward and backward, in alternating
rounds, and prints the median ratio (goal: at most 1.05).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import (
    MultiHeadAttention,
    best_time,
    chunked_attention,
    scaled_dot_product_attention,
    sliding_window_attention,
)
from course_lib.device import get_device, synchronize
from course_lib.efficient import score_matrix_bytes
from course_lib.instruments.measure import peak_memory

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256, help="chunked attention's tile")
    parser.add_argument("--window", type=int, default=128, help="sliding window, keys per query")
    parser.add_argument("--causal", action="store_true", help="causal attention everywhere")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (the fastest counts)")
    parser.add_argument("--max-naive-gib", type=float, default=2.0)
    parser.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-mha", action="store_true")
    parser.add_argument("--mha-shape", type=int, nargs=4, default=None,
                        metavar=("BATCH", "LENGTH", "D_MODEL", "HEADS"),
                        help="default: 8 256 512 8 on a GPU, 4 128 256 4 on a CPU")
    parser.add_argument("--mha-rounds", type=int, default=7)
    parser.add_argument("--mha-iters", type=int, default=5, help="forward+backward per round")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------ part 1


def measure_memory(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes ``fn`` allocates beyond what was allocated before it ran."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - before
    return peak_memory(fn)


def attention_variants(args: argparse.Namespace) -> dict[str, Callable]:
    causal = args.causal

    def naive(q, k, v):
        mask = None
        if causal:
            n = q.shape[-2]
            mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # (T, S)
        return scaled_dot_product_attention(q, k, v, mask=mask)[0]

    return {
        "naive": naive,
        "chunked": lambda q, k, v: chunked_attention(q, k, v, block_size=args.block_size,
                                                     is_causal=causal),
        "windowed": lambda q, k, v: sliding_window_attention(q, k, v, window=args.window,
                                                             is_causal=causal),
        # T == S here, so torch's top-left-aligned is_causal is the same mask as ours
        "fused": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
    }


def run_attention(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    variants = attention_variants(args)
    print(f"\nattention on {device} ({dtype}), batch 1, {args.heads} heads of {args.head_dim}, "
          f"{'causal' if args.causal else 'no mask'}; chunked block {args.block_size}, "
          f"window {args.window}")
    header = "".join(f"{name:>22}" for name in variants)
    print(f"{'n':>7}{header}")
    print(f"{'':>7}" + f"{'ms':>11}{'MiB':>11}" * len(variants))
    gen = torch.Generator().manual_seed(0)
    for n in args.sizes:
        q, k, v = (torch.randn(1, args.heads, n, args.head_dim, generator=gen).to(device, dtype)
                   for _ in range(3))
        cells = []
        for name, fn in variants.items():
            naive_bytes = 3 * score_matrix_bytes(1, args.heads, n, dtype=dtype)
            if name == "naive" and naive_bytes > args.max_naive_gib * 2**30:
                cells.append(f"{'skipped':>11}{'':>11}")
                continue
            call = functools.partial(fn, q, k, v)
            with torch.no_grad():
                seconds = best_time(call, repeat=args.repeat, device=device)
                peak = measure_memory(call, device)
            cells.append(f"{seconds * 1e3:>11.2f}{peak / 2**20:>11.2f}")
        print(f"{n:>7}" + "".join(cells), flush=True)


# ------------------------------------------------------------------------------ part 2


def matched_layers(d_model: int, n_heads: int, device: torch.device, dtype: torch.dtype
                   ) -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    """course_lib's layer and torch's, with the same weights (in_proj = [W_q; W_k; W_v])."""
    theirs = nn.MultiheadAttention(d_model, n_heads, batch_first=True).to(device, dtype)
    ours = MultiHeadAttention(d_model, n_heads).to(device, dtype)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(theirs.in_proj_weight)
        ours.qkv_proj.bias.copy_(theirs.in_proj_bias)
        ours.out_proj.weight.copy_(theirs.out_proj.weight)
        ours.out_proj.bias.copy_(theirs.out_proj.bias)
    return ours, theirs


def _timed(step: Callable[[], None], iters: int, device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    synchronize(device)
    return (time.perf_counter() - start) / iters


def run_mha(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
    default = (8, 256, 512, 8) if device.type == "cuda" else (4, 128, 256, 4)
    batch, length, d_model, n_heads = args.mha_shape or default
    ours, theirs = matched_layers(d_model, n_heads, device, dtype)
    x = torch.randn(batch, length, d_model, device=device, dtype=dtype, requires_grad=True)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # True = attend
    torch_mask = ~causal  # nn.MultiheadAttention's boolean mask: True = NOT allowed
    print(f"\nMultiHeadAttention (fused path) vs torch.nn.MultiheadAttention, forward + backward,"
          f" batch {batch}, length {length}, d_model {d_model}, {n_heads} heads, {dtype}")
    for label, is_causal in (("no mask", False), ("causal", True)):
        torch_kwargs = dict(attn_mask=torch_mask, is_causal=True) if is_causal else {}

        def step_ours(is_causal=is_causal):
            out, _ = ours(x, is_causal=is_causal)
            out.sum().backward()

        def step_theirs(torch_kwargs=torch_kwargs):
            out, _ = theirs(x, x, x, need_weights=False, **torch_kwargs)
            out.sum().backward()

        out_ours, _ = ours(x, is_causal=is_causal)
        out_theirs, _ = theirs(x, x, x, need_weights=False, **torch_kwargs)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out_ours, out_theirs, atol=tol, rtol=tol)
        for step in (step_ours, step_theirs):  # warm-up
            step()
        ratios, t_ours, t_theirs = [], [], []
        for r in range(args.mha_rounds):
            order = (step_ours, step_theirs) if r % 2 == 0 else (step_theirs, step_ours)
            times = {step: _timed(step, args.mha_iters, device) for step in order}
            t_ours.append(times[step_ours])
            t_theirs.append(times[step_theirs])
            ratios.append(times[step_ours] / times[step_theirs])
        ratio = statistics.median(ratios)
        print(f"  {label:>8}: course_lib {statistics.median(t_ours) * 1e3:8.3f} ms, torch "
              f"{statistics.median(t_theirs) * 1e3:8.3f} ms (medians); median of the per-round "
              f"ratios {ratio:.3f} ({'within' if ratio <= 1.05 else 'above'} the 1.05 goal)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = get_device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cpu" and dtype == torch.float16:
        print("note: float16 on a CPU is slow and not what this benchmark is about")
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", {torch.get_num_threads()} CPU threads")
    if not args.skip_attention:
        run_attention(args, device, dtype)
    if not args.skip_mha:
        run_mha(args, device, dtype)


if __name__ == "__main__":
    main()
