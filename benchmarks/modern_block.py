"""Chapter 12's block ladder at equal wall time: a GPT-2-style decoder changed one thing at a
time towards Llama's (RMSNorm, SwiGLU, RoPE, no biases), each trained for the same seconds.

    python -m benchmarks.modern_block                    # 20 s per run, seeds 0 1 2, 1 thread
    python -m benchmarks.modern_block --budget 40 --seeds 0 1 2 3 4
    python -m benchmarks.modern_block --updates 200      # equal updates instead of equal time

The model is the one chapter 12's notebook trains (2 blocks, 4 heads, d_model 64, context 64,
batches of 16, learning rate 3e-3 with 30 warm-up updates and a cosine to 3e-4), so the two
can be read side by side. With ``--budget`` every run trains for that many seconds, the cosine
fitted to the updates that fit (``benchmarks.timed_train.train_for``); the order of the
variants is rotated from seed to seed, so a slow spell of the machine does not always hit the
same one. The loss is measured afterwards on the whole validation text
(``benchmarks.train_char_lm.full_loss``).

Measured on a 2-core CPU, one thread, while other programs shared the machine (2026-11-24,
``--budget 20``, seeds 0 1 2; chapter 12's notebook quotes this table)::

    variant        params  updates  ms/update  val loss (mean of 3 seeds)  spread
    GPT-2 block   108,224     1103       18.1                       2.023   0.028
    + RMSNorm     107,904     1009       19.8                       2.054   0.030
    + SwiGLU      110,144     1088       18.5                       2.080   0.125
    + RoPE        106,048      879       22.9                       1.935   0.036
    - biases      104,704      819       24.8                       1.953   0.074

RoPE pays at equal time although it costs about a fifth of the updates; RMSNorm and SwiGLU do
not pay at this scale; dropping the biases is within the seeds' spread. The number of updates
that fit moves with the machine's load (up to a fifth between seeds here).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

from benchmarks.timed_train import train_for
from benchmarks.train_char_lm import full_loss, load_corpus
from course_lib.configs import DecoderConfig
from course_lib.models import DecoderLM, count_parameters
from course_lib.train import TrainConfig, lm_batches, train

SHAPE = dict(d_model=64, n_heads=4, n_layers=2, max_len=64, activation="gelu_tanh")
BATCH, CONTEXT = 16, 64
SWIGLU_WIDTH = 176  # 2/3 of 4 * 64 = 170.7, rounded up to a multiple of 8 (Llama's rule)
# Each rung keeps the changes above it.
VARIANTS = {
    "GPT-2 block": {},
    "+ RMSNorm": dict(norm="rms"),
    "+ SwiGLU": dict(norm="rms", ffn="swiglu", d_ff=SWIGLU_WIDTH),
    "+ RoPE": dict(norm="rms", ffn="swiglu", d_ff=SWIGLU_WIDTH, positions="rope"),
    "- biases": dict(norm="rms", ffn="swiglu", d_ff=SWIGLU_WIDTH, positions="rope", bias=False),
}


def schedule(max_iters: int) -> TrainConfig:
    """The notebook's schedule (evaluations only at the start and the end)."""
    return TrainConfig(max_iters=max_iters, lr=3e-3, min_lr=3e-4, warmup_iters=30,
                       eval_interval=max_iters, eval_iters=1)


def run_one(name: str, seed: int, vocab_size: int, train_ids: torch.Tensor,
            val_ids: torch.Tensor, *, budget: float | None, updates: int) -> tuple[int, float,
                                                                                    float, int]:
    """Train one variant from one seed; return (updates, ms per update, full val loss,
    parameters)."""
    torch.manual_seed(seed)
    model = DecoderLM(DecoderConfig(vocab_size=vocab_size, **SHAPE, **VARIANTS[name]))
    batches = lm_batches(train_ids, BATCH, CONTEXT, generator=torch.Generator().manual_seed(seed))
    val = lm_batches(val_ids, BATCH, CONTEXT, generator=torch.Generator().manual_seed(seed + 1))
    if budget is None:
        history = train(model, batches, schedule(updates), val_batches=val, progress=False)
    else:
        history, _ = train_for(model, batches, schedule(100_000), time_budget=budget,
                               val_batches=val, progress=False)
    return (len(history.steps), history.ms_per_iter, full_loss(model, val_ids, CONTEXT),
            count_parameters(model))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per run")
    parser.add_argument("--updates", type=int, default=None,
                        help="train for this many updates instead of a time budget")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    budget = None if args.updates is not None else args.budget
    tokenizer, train_ids, val_ids = load_corpus("default")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          + (f"{budget:g} s per run" if budget else f"{args.updates} updates per run"))
    names = list(VARIANTS)
    results: dict[str, list[tuple[int, float, float, int]]] = {n: [] for n in names}
    for i, seed in enumerate(args.seeds):
        for name in names[i % len(names):] + names[: i % len(names)]:  # rotate the order
            results[name].append(run_one(name, seed, tokenizer.vocab_size, train_ids, val_ids,
                                         budget=budget, updates=args.updates or 0))
            n, ms, loss, _ = results[name][-1]
            print(f"  seed {seed} {name:<12} {n:>5} updates {ms:>6.1f} ms/update loss {loss:.3f}",
                  flush=True)
    print(f"\n{'variant':<12} {'params':>8} {'updates':>8} {'ms/update':>10} "
          f"{'val loss (mean of ' + str(len(args.seeds)) + ' seeds)':>30} {'spread':>7}")
    for name in names:
        runs = results[name]
        losses = [r[2] for r in runs]
        print(f"{name:<12} {runs[0][3]:>8,} {statistics.mean(r[0] for r in runs):>8.0f} "
              f"{statistics.mean(r[1] for r in runs):>10.1f} {statistics.mean(losses):>30.3f} "
              f"{max(losses) - min(losses):>7.3f}")
    print("spread: largest minus smallest loss over the seeds; loss: the whole validation text")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
