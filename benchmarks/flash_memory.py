"""Memory and time of attention's forward + backward pass: naive vs FlashAttention-2's algorithm
(chapter 14's ``course_lib.flash.flash_attention``), re-measured on any machine.

    python -m benchmarks.flash_memory                       # n = 256 .. 4096, one head of 64
    python -m benchmarks.flash_memory --plot flash_memory.png
    python -m benchmarks.flash_memory --device cuda --sizes 1024 2048 4096 8192 16384

For each sequence length n (T = S = n, batch 1, ``--heads`` heads of ``--head-dim``) one
forward and backward pass, ``torch.autograd.grad(out, (q, k, v), d_out)``, is run four ways:

* naive: course_lib's ``scaled_dot_product_attention`` (the equations; autograd keeps the
  (n, n) weights);
* chunked: chapter 10's ``chunked_attention`` (online softmax, O(n) forward, but autograd keeps
  every tile it built: O(n^2) for the backward pass);
* flash: ``flash_attention`` (keeps q, k, v, out and the log-sum-exp; the backward pass
  recomputes the tiles);
* fused: ``F.scaled_dot_product_attention`` (PyTorch's kernel, for comparison).

Columns: the bytes autograd keeps for the backward pass ("kept", exact: the distinct storages
its saved-tensor hooks see), the peak memory of forward + backward beyond the inputs ("peak":
on CUDA ``torch.cuda.max_memory_allocated``, elsewhere course_lib's ``peak_memory``, which
counts every tensor until it is freed and does not see a fused kernel's private scratch
memory), and the time (the fastest of ``--repeat`` runs; on a CPU one thread's processor time).
The last rows are the least-squares slopes of log(peak) and log(time) against log(n): 2 for
memory that grows like n^2, 1 for O(n).

Measured 2026-11-28 on this course's build machine (2-core AMD EPYC, CPU only, torch 2.13.0+cpu,
one thread, float32, other work running), ``python -m benchmarks.flash_memory``; kept and peak
in MiB, times in ms:

                          naive              chunked                flash                fused
         n   kept   peak     ms   kept   peak     ms   kept   peak     ms   kept   peak     ms
       256   0.94    1.9      1   0.89    1.0      2   0.25    0.6      1   0.25    0.3      1
       512   3.38    7.3      4   3.04    3.3      6   0.50    0.8      4   0.50    0.5      2
      1024  12.76   28.5     18  11.14   11.8     23   1.00    1.3     17   1.00    1.0     10
      2048  49.52  113.0     70  42.55   44.0    106   2.01    2.3     68   2.01    2.0     41
      4096 195.04  450.0    681 166.16  169.1    487   4.02    4.4    271   4.02    4.0    158
    log-log slopes (2: grows like n^2, 1: like n):
         naive: peak memory 1.98, time 2.28
       chunked: peak memory 1.85, time 2.08
         flash: peak memory 0.74, time 1.95
         fused: peak memory 1.00, time 1.99

Flash keeps exactly q, k, v, out and L: 4.02 MiB at n = 4096 against naive attention's 195 MiB
(chapter 10's chunked attention, O(n) in its forward pass, still keeps 166 MiB); its peak adds
about 0.3 MiB of (128, 128) tiles whatever n, which is why its slope over 256..4096 is below 1.
Times on a shared machine vary by tens of percent between runs; flash's tiles run as Python
loops, so on a CPU it is not faster than the fused kernel, only smaller than naive.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.attention_cost import DTYPES, measure_memory
from course_lib import best_time, chunked_attention, num_threads, scaled_dot_product_attention
from course_lib.device import get_device
from course_lib.flash import flash_attention
from course_lib.instruments.measure import saved_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128, help="chunked and flash tiles")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (the fastest counts)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--device", default=None, help="cpu, cuda or mps (default: the best)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--plot", metavar="FILE", default=None, help="write a log-log PNG")
    return parser.parse_args(argv)


def variants(block_size: int, causal: bool) -> dict[str, Callable]:
    def naive(q, k, v):
        n = q.shape[-2]
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril() if causal else None
        return scaled_dot_product_attention(q, k, v, mask=mask)[0]

    return {
        "naive": naive,
        "chunked": functools.partial(chunked_attention, block_size=block_size, is_causal=causal),
        "flash": functools.partial(flash_attention, block_size=block_size, is_causal=causal),
        # T == S here, so torch's top-left-aligned is_causal is the same mask as ours
        "fused": functools.partial(F.scaled_dot_product_attention, is_causal=causal),
    }


def measure(fn: Callable, n: int, args: argparse.Namespace, device: torch.device,
            dtype: torch.dtype) -> tuple[int, int, float]:
    """(kept bytes, peak bytes, seconds) of one forward + backward pass at length n."""
    gen = torch.Generator().manual_seed(n)
    shape = (1, args.heads, n, args.head_dim)
    q, k, v, d_out = (torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        return torch.autograd.grad(fn(q, k, v), (q, k, v), d_out)

    clock = "thread" if device.type == "cpu" else "wall"
    seconds = best_time(step, repeat=args.repeat, device=device, clock=clock)
    return saved_bytes(lambda: fn(q, k, v)), measure_memory(step, device), seconds


def slope(sizes: list[int], values: list[float]) -> float:
    """The least-squares slope of log(value) against log(n)."""
    return float(np.polyfit(np.log(sizes), np.log(values), 1)[0])


def plot(path: str, sizes: list[int], peaks: dict[str, list[int]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name, values in peaks.items():
        ax.loglog(sizes, [b / 2**20 for b in values], "o-", base=2,
                  label=f"{name} (slope {slope(sizes, values):.2f})")
    ax.set(xlabel="sequence length n", ylabel="peak memory of forward + backward (MiB)",
           title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Software": None})
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = get_device(args.device), DTYPES[args.dtype]
    fns = variants(args.block_size, args.causal)
    title = (f"{device}, {dtype}, batch 1, {args.heads} head(s) of {args.head_dim}, "
             f"block {args.block_size}, {'causal' if args.causal else 'no mask'}")
    print(f"torch {torch.__version__}, {title}, {args.threads} CPU thread(s); kept and peak "
          "in MiB, times in ms")
    print(f"{'':>6}" + "".join(f"{name:>21}" for name in fns))
    print(f"{'n':>6}" + f"{'kept':>7}{'peak':>7}{'ms':>7}" * len(fns))
    peaks = {name: [] for name in fns}
    times = {name: [] for name in fns}
    with num_threads(args.threads):
        for n in args.sizes:
            row = f"{n:>6}"
            for name, fn in fns.items():
                kept, peak, seconds = measure(fn, n, args, device, dtype)
                peaks[name].append(peak)
                times[name].append(seconds)
                row += f"{kept / 2**20:>7.2f}{peak / 2**20:>7.1f}{seconds * 1e3:>7.0f}"
            print(row, flush=True)
    if len(args.sizes) > 1:
        print("log-log slopes (2: grows like n^2, 1: like n):")
        for name in fns:
            print(f"  {name:>8}: peak memory {slope(args.sizes, peaks[name]):.2f}, "
                  f"time {slope(args.sizes, times[name]):.2f}")
    if args.plot:
        plot(args.plot, args.sizes, peaks, title)


if __name__ == "__main__":
    main()
