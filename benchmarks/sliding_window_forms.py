"""Two ways to compute exact sliding-window attention without the (n, n) matrix: chapter 10's
*per-query* form (each query gathers its w keys with ``unfold(-2, w, 1)``) and course_lib's
*blockwise* form (``sliding_window_attention``: a block of w queries against the 2w - 1 keys
its band reaches, one matrix product per block). Both equal full attention with the band mask.

    python -m benchmarks.sliding_window_forms              # w = 128, 4 heads of 64, one thread

The per-query form is the simpler to read, but its product q (n, 1, d) @ k_windows (n, d, w)
copies the overlapping windows into an (n, d, w) tensor: d times the memory of the (n, w)
scores. The blockwise form reads each key tile once per block of queries. Peak memory is
counted on the meta device (``course_lib.peak_memory``); times are the best of 3 runs.

Measured on a 2-core CPU (2026-11-27, PyTorch 2.13, one thread)::

     n   per-query: MiB      ms   blockwise: MiB      ms
   256             34.2    40.8              5.1     4.0
  1024            136.2   162.7             19.5    11.4
  4096            544.2   626.4             77.2    66.3

so course_lib keeps the blockwise form: 7 times less memory, 9 to 14 times less time.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F


def per_query_window_attention(q, k, v, window: int):
    """Causal sliding-window attention, each query against its own w keys (chapter 10's form)."""
    n = q.shape[-2]
    k_win = F.pad(k, (0, 0, window - 1, 0)).unfold(-2, window, 1)  # (..., n, d, w)
    v_win = F.pad(v, (0, 0, window - 1, 0)).unfold(-2, window, 1)  # (..., n, dv, w)
    scores = (q[..., None, :] @ k_win)[..., 0, :] / math.sqrt(q.shape[-1])  # (..., n, w)
    key_pos = (torch.arange(n, device=q.device)[:, None] - (window - 1)
               + torch.arange(window, device=q.device))  # (n, w)
    weights = torch.softmax(scores.masked_fill(key_pos < 0, float("-inf")), dim=-1)
    return (v_win @ weights[..., None])[..., 0]  # (..., n, dv)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args(argv)
    from course_lib import best_time, sliding_window_attention
    from course_lib.efficient import sliding_window_mask
    from course_lib.instruments.measure import peak_memory

    forms = {"per-query": lambda q, k, v: per_query_window_attention(q, k, v, args.window),
             "blockwise": lambda q, k, v: sliding_window_attention(q, k, v, window=args.window)}
    torch.set_num_threads(1)
    print(f"{'n':>6}" + "".join(f"{name + ': MiB':>17}{'ms':>8}" for name in forms))
    for n in args.sizes:
        q, k, v = (torch.randn(1, 4, n, 64, generator=torch.Generator().manual_seed(i))
                   for i in range(3))
        reference = F.scaled_dot_product_attention(
            q, k, v, attn_mask=sliding_window_mask(n, args.window))
        meta = [torch.empty(1, 4, n, 64, device="meta") for _ in range(3)]
        row = f"{n:>6}"
        with torch.no_grad():
            for form in forms.values():
                torch.testing.assert_close(form(q, k, v), reference)
                memory = peak_memory(lambda form=form, meta=meta: form(*meta))
                seconds = best_time(lambda form=form, qkv=(q, k, v): form(*qkv), repeat=3)
                row += f"{memory / 2**20:>17.1f}{seconds * 1e3:>8.1f}"
        print(row)


if __name__ == "__main__":
    main()
