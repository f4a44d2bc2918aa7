"""course_lib's character-level GPT side by side with a minimal plain-PyTorch GPT.

    python -m benchmarks.compare_char_lm                  # reference config, 2,000 updates each
    python -m benchmarks.compare_char_lm --iters 300      # a short run
    python -m benchmarks.compare_char_lm --profile 30     # torch.profiler: top ops of 30 updates
    python -m benchmarks.compare_char_lm --phases 400     # forward, backward, update timed apart

Both models are the benchmark's reference configuration (``train_char_lm.CONFIGS
["reference"]``: 4 layers, 4 heads, d_model 128, context 64, batch 12, no dropout, no biases,
exact GELU, learned positions, tied embeddings) and train in this one process on the same
batches: every batch is drawn once and fed to both. By default the baseline
(:mod:`benchmarks.minimal_gpt`) starts from a copy of the course model's initial weights, so the
two runs differ only by rounding, and the final losses can be compared finely (``--own-init``
gives the baseline its own initialisation).

The models take turns in blocks of ``--block`` updates (50), and the one that goes first
alternates, so slow spells of a shared machine hit both alike; each keeps its caches warm
within a block. Only updates are timed: setting the learning rate, forward, backward, gradient
clipping, the optimizer step and reading the loss (which waits for the device). The course
side uses course_lib's own training pieces: ``param_groups`` and the ``TrainConfig`` schedule
(``lr_at``), and the optimizer as ``course_lib.train.train`` builds it; ``train`` itself runs a
whole training at once and cannot take turns, so its update is replicated here line for line
(including reading the gradient norm it records), and the baseline runs the same update
(:func:`update_parts`).

``--phases N`` times the three parts of N updates apart (forward with the loss; zero_grad and
backward; clipping, the optimizer step and reading the loss and gradient norm), the models
alternating update by update, so it shows where the two differ.

Printed: the median (and mean) milliseconds per update of each, the ratio course / baseline of
the medians and the median of the per-block ratios, and each model's loss over the whole
validation text, cut into non-overlapping windows.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.minimal_gpt import (
    GPTConfig,
    MinimalGPT,
    configure_optimizer,
    copy_course_weights,
    get_lr,
)
from benchmarks.train_char_lm import CONFIGS, _load, build_model, load_corpus

# course_lib names used here; train_char_lm imports the model class and the corpus
from course_lib.models import count_parameters
from course_lib.train import lm_batches, lr_schedule, param_groups

Step = Callable[[dict[str, torch.Tensor], int], float]


def course_optimizer(model: nn.Module, train_config) -> torch.optim.Optimizer:
    """The optimizer exactly as ``course_lib.train.train`` builds it (a library that has
    ``make_optimizer`` provides it; otherwise this replicates train()'s lines)."""
    from course_lib import train as train_module

    if hasattr(train_module, "make_optimizer"):
        return train_module.make_optimizer(model, train_config)
    device = next(model.parameters()).device
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(
        param_groups(model, train_config.weight_decay), lr=train_config.lr,
        betas=train_config.betas, **fused,
    )


Parts = tuple[Callable, Callable, Callable]


def update_parts(model: nn.Module, optimizer: torch.optim.Optimizer, train_config, *,
                 course: bool) -> Parts:
    """One update in three parts: ``forward(batch, i) -> loss`` (set the learning rate, then
    the forward pass with the loss), ``backward(loss)`` (zero_grad, backward) and
    ``update(loss) -> float`` (clip the gradient's global norm, optimizer step, read the loss).

    The course side (``course=True``) is ``course_lib.train.train``'s update line for line: the
    ``TrainConfig`` schedule (``lr_at``), ``model(**batch).loss``, and reading the gradient norm
    it records. The baseline's differs only where the minimal GPT does: its own copy of the
    schedule (``get_lr``) and its ``(logits, loss)`` forward.
    """
    max_norm = train_config.grad_clip if train_config.grad_clip is not None else math.inf
    decay = train_config.lr_decay_iters or train_config.max_iters

    def forward(batch: dict[str, torch.Tensor], i: int) -> torch.Tensor:
        lr = train_config.lr_at(i) if course else get_lr(
            i, lr=train_config.lr, min_lr=train_config.min_lr,
            warmup_iters=train_config.warmup_iters, decay_iters=decay)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return model(**batch).loss if course else model(batch["ids"], batch["targets"])[1]

    def backward(loss: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def update(loss: torch.Tensor) -> float:
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        loss_value = loss.item()  # waits for the device: the update is complete
        if course:
            float(grad_norm)  # train() records it every update
        return loss_value

    return forward, backward, update


def as_step(parts: Parts) -> Step:
    """The three parts as one update, ``step(batch, i) -> loss``."""
    forward, backward, update = parts

    def step(batch: dict[str, torch.Tensor], i: int) -> float:
        loss = forward(batch, i)
        backward(loss)
        return update(loss)

    return step


@torch.no_grad()
def stream_loss(loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                ids: torch.Tensor, block_size: int, batch_size: int = 256) -> float:
    """Mean next-character loss over a whole token stream in non-overlapping windows."""
    n = (len(ids) - 1) // block_size
    x = ids[: n * block_size].view(n, block_size)  # (N, T)
    y = ids[1 : n * block_size + 1].view(n, block_size)  # (N, T), the next characters
    total = 0.0
    for start in range(0, n, batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        total += loss_of(xb, yb).item() * len(xb)
    return total / n


def build(setup, vocab_size: int, seed: int, own_init: bool):
    """The course model (seeded as train_char_lm builds it) and the baseline."""
    course = build_model(setup, vocab_size, seed)
    cfg = course.config
    baseline_config = GPTConfig(
        vocab_size=vocab_size, block_size=cfg.max_len, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_embd=cfg.d_model, bias=cfg.bias,
        gelu_approximate={"gelu": "none", "gelu_tanh": "tanh"}[cfg.activation],
    )
    torch.manual_seed(seed)
    baseline = MinimalGPT(baseline_config)
    if not own_init:
        copy_course_weights(baseline, course)
    if count_parameters(course) != count_parameters(baseline):
        raise RuntimeError(f"parameter counts differ: course {count_parameters(course)}, "
                           f"baseline {count_parameters(baseline)}")
    return course, baseline


def check_same(course: nn.Module, baseline: MinimalGPT, train_config, batch: dict) -> str:
    """Same schedule and (without --own-init) the same function at the start."""
    decay = train_config.lr_decay_iters or train_config.max_iters
    for i in range(train_config.max_iters):
        ours = get_lr(i, lr=train_config.lr, min_lr=train_config.min_lr,
                      warmup_iters=train_config.warmup_iters, decay_iters=decay)
        theirs = lr_schedule(i, lr=train_config.lr, min_lr=train_config.min_lr,
                             warmup_iters=train_config.warmup_iters, decay_iters=decay)
        if ours != theirs or theirs != train_config.lr_at(i):
            raise RuntimeError(f"learning rates differ at update {i}: {ours} vs {theirs}")
    with torch.no_grad():
        a = course(batch["ids"]).logits
        b = baseline(batch["ids"])[0]
    return f"max |logits difference| at the start: {(a - b).abs().max().item():.2e}"


def profile(steps: dict[str, Step], batches: list, n: int, top: int, rounds: int = 3) -> None:
    """torch.profiler tables (self CPU time) of ``n`` updates of each model, after warm-up.

    The models are profiled in turns, ``rounds`` times each, and each model's least disturbed
    round (smallest total) is kept, since a shared machine's slow spells swamp small ops.
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    best: dict[str, tuple[float, dict, object]] = {}
    for step in steps.values():  # warm-up
        for i in range(5):
            step(batches[i], i)
    for _ in range(rounds):
        for name, step in steps.items():
            with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(n):
                    step(batches[5 + i], 5 + i)
            averages = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in averages)
            if name not in best or total < best[name][0]:
                best[name] = (total, {e.key: e for e in averages}, averages)
    for name, (total, _, averages) in best.items():
        print(f"\n=== {name}: {n} updates (best of {rounds} rounds, {total / n / 1000:.1f} ms of "
              f"op self time per update), top {top} ops by self CPU time ===")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=top))
    course, base = best["course"][1], best["baseline"][1]

    def per_update(table: dict, key: str) -> tuple[float, float]:
        e = table.get(key)
        return (e.self_cpu_time_total / n / 1000, e.count / n) if e else (0.0, 0.0)

    keys = sorted(set(course) | set(base),
                  key=lambda k: -abs(per_update(course, k)[0] - per_update(base, k)[0]))
    print("=== per update, ops sorted by |difference| (self CPU ms and calls per update) ===")
    print(f"{'op':<52} {'course ms':>9} {'calls':>6} {'base ms':>8} {'calls':>6} {'diff ms':>8}")
    for k in keys[:top]:
        (cm, cc), (bm, bc) = per_update(course, k), per_update(base, k)
        print(f"{k[:52]:<52} {cm:>9.3f} {cc:>6.1f} {bm:>8.3f} {bc:>6.1f} {cm - bm:>8.3f}")
    totals = [sum(per_update(t, k)[i] for k in t) for t in (course, base) for i in (0, 1)]
    print(f"{'all ops':<52} {totals[0]:>9.3f} {totals[1]:>6.0f} {totals[2]:>8.3f} "
          f"{totals[3]:>6.0f} {totals[0] - totals[2]:>8.3f}")


def phases(parts: dict[str, Parts], draw: Callable[[], dict],
           n: int, warmup: int = 20) -> None:
    """Median milliseconds of each part of ``n`` updates per model (after ``warmup``), the
    models taking turns update by update, each update on the same batch."""
    names = ("forward", "backward", "update")
    times = {model: {name: [] for name in names} for model in parts}
    for i in range(warmup + n):
        batch = draw()
        for model in list(parts) if i % 2 == 0 else list(reversed(parts)):
            forward, backward, update = parts[model]
            t0 = time.perf_counter()
            loss = forward(batch, i)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            update(loss)
            t3 = time.perf_counter()
            if i >= warmup:
                for name, seconds in zip(names, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    times[model][name].append(seconds)
    print(f"\n{n} updates each, median ms per part (models alternating update by update)")
    print(f"{'part':<10} {'course':>8} {'baseline':>9} {'difference':>11}")
    total = {"course": 0.0, "baseline": 0.0}
    for name in names:
        ms = {model: 1000 * statistics.median(times[model][name]) for model in parts}
        total = {model: total[model] + ms[model] for model in parts}
        print(f"{name:<10} {ms['course']:>8.3f} {ms['baseline']:>9.3f} "
              f"{ms['course'] - ms['baseline']:>+11.3f}")
    print(f"{'sum':<10} {total['course']:>8.3f} {total['baseline']:>9.3f} "
          f"{total['course'] - total['baseline']:>+11.3f}  (ratio "
          f"{total['course'] / total['baseline']:.3f}); load average after {_load()}")


def side_by_side(steps: dict[str, Step], draw: Callable[[], dict], first: dict, iters: int,
                 block: int) -> tuple[dict[str, list[float]], dict[str, list[float]], list[float]]:
    """Train every model for ``iters`` updates on the same batches, in turns of ``block``.

    Returns:
        ``(times, losses, turn_ratios)``: seconds and loss of every update per model, and the
        course / baseline ratio of the median update time in each turn.
    """
    times: dict[str, list[float]] = {name: [] for name in steps}
    losses: dict[str, list[float]] = {name: [] for name in steps}
    turn_ratios = []
    started = time.perf_counter()
    for turn, start in enumerate(range(0, iters, block)):
        n = min(block, iters - start)
        batches = [first if start + i == 0 else draw() for i in range(n)]  # drawn once
        for name in list(steps) if turn % 2 == 0 else list(reversed(steps)):
            for i, batch in enumerate(batches):
                t0 = time.perf_counter()
                losses[name].append(steps[name](batch, start + i))
                times[name].append(time.perf_counter() - t0)
        turn_ratios.append(statistics.median(times["course"][-n:])
                           / statistics.median(times["baseline"][-n:]))
        done = start + n
        if done % 250 == 0 or done == iters:
            print(f"  {done:>5}/{iters}  loss course {losses['course'][-1]:.3f} baseline "
                  f"{losses['baseline'][-1]:.3f}  median ms course "
                  f"{1000 * statistics.median(times['course']):.2f} baseline "
                  f"{1000 * statistics.median(times['baseline']):.2f}  "
                  f"({time.perf_counter() - started:.0f} s)", flush=True)
    return times, losses, turn_ratios


def print_table(times: dict[str, list[float]], losses: dict[str, list[float]],
                val: dict[str, float], turn_ratios: list[float]) -> None:
    """The result table and the ratio line."""
    median = {name: 1000 * statistics.median(t) for name, t in times.items()}
    header = (f"{'model':<10} {'updates':>7} {'median ms':>9} {'mean ms':>8} {'p90 ms':>7} "
              f"{'last-50 train':>13} {'full val loss':>13}")
    print(f"\n{header}\n{'-' * len(header)}")
    for name, t in times.items():
        t = sorted(t)
        print(f"{name:<10} {len(t):>7} {median[name]:>9.2f} {1000 * statistics.fmean(t):>8.2f} "
              f"{1000 * t[int(0.9 * (len(t) - 1))]:>7.2f} "
              f"{statistics.fmean(losses[name][-50:]):>13.4f} {val[name]:>13.4f}")
    print(f"ratio course / baseline: {median['course'] / median['baseline']:.3f} (medians), "
          f"{statistics.median(turn_ratios):.3f} (median of the {len(turn_ratios)} per-turn "
          f"ratios); full val loss difference {val['course'] - val['baseline']:+.4f}")
    print(f"timed: lr, forward, backward, clip, optimizer step, loss.item(); load average after "
          f"{_load()}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=None,
                        help="updates per model (default: the reference's 2,000); the cosine "
                             "is fitted to it")
    parser.add_argument("--block", type=int, default=50, help="updates per turn (default 50)")
    parser.add_argument("--own-init", action="store_true",
                        help="initialise the baseline itself instead of copying the course's")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: leave torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plays", default="default", help="'default' or 'all'")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N updates of each model instead of training")
    parser.add_argument("--phases", type=int, default=0, metavar="N",
                        help="time forward, backward and update apart over N updates each")
    parser.add_argument("--top", type=int, default=25, help="rows of the profile tables")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    setup = CONFIGS["reference"]
    train_config = setup.train
    if args.iters is not None:
        train_config = dataclasses.replace(train_config, max_iters=args.iters, lr_decay_iters=None)
    tokenizer, train_ids, val_ids = load_corpus(args.plays)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {_load()}")
    print(f"corpus '{args.plays}': vocabulary {tokenizer.vocab_size}, train {len(train_ids):,} / "
          f"val {len(val_ids):,} characters; {setup.note}; {train_config.max_iters} updates "
          f"each, turns of {args.block}")

    course, baseline = build(setup, tokenizer.vocab_size, args.seed, args.own_init)
    draw = lm_batches(train_ids, setup.batch_size, setup.block_size,
                      generator=torch.Generator().manual_seed(args.seed + 1))
    optimizers = {
        "course": course_optimizer(course, train_config),
        "baseline": configure_optimizer(baseline, lr=train_config.lr,
                                        weight_decay=train_config.weight_decay,
                                        betas=train_config.betas),
    }
    parts = {name: update_parts(model, optimizers[name], train_config, course=name == "course")
             for name, model in (("course", course), ("baseline", baseline))}
    steps = {name: as_step(p) for name, p in parts.items()}
    first = draw()
    print(f"parameters: {count_parameters(course):,} each; "
          + check_same(course, baseline, train_config, first))
    course.train()
    baseline.train()
    if args.phases:
        phases(parts, draw, args.phases)
        return 0
    if args.profile:
        profile(steps, [first] + [draw() for _ in range(args.profile + 5)], args.profile, args.top)
        return 0

    times, losses, turn_ratios = side_by_side(steps, draw, first, train_config.max_iters,
                                              args.block)
    course.eval()
    baseline.eval()
    val = {
        "course": stream_loss(lambda x, y: course(x, targets=y).loss, val_ids, setup.block_size),
        "baseline": stream_loss(lambda x, y: baseline(x, y)[1], val_ids, setup.block_size),
    }
    print_table(times, losses, val, turn_ratios)
    return 0


if __name__ == "__main__":
    sys.exit(main())
