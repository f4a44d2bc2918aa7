"""What data parallelism's communication costs: the all-reduce of all the gradients timed
against the backward pass, with and without buckets and overlap. Every rank holds the same
decoder and its share of one batch, and computes with one CPU thread (the ranks share the
machine's cores). The forms below take turns, ``--repeat`` rounds after one untimed warm-up,
the ranks starting each form together; every form must leave the averaged gradients of the
by-hand one.

Forms (the forward pass always runs before the clock starts):

- backward: ``loss.backward()`` alone, no communication;
- all-reduce: course_lib's ``all_reduce_gradients`` alone, after a backward pass (one message
  per parameter, then a division by N); and "one message": the same with all the gradients
  flattened into one vector;
- backward, then all-reduce: the two one after the other, data parallelism by hand;
- overlapped: course_lib's ``OverlappingDataParallel`` (backward, then ``finish()``), with
  small buckets and with one bucket for all the gradients (which fills only when backward
  ends, so nothing overlaps);
- DDP: torch's ``DistributedDataParallel`` (backward, at whose end DDP waits for its
  all-reduces), with the same small buckets and with its default of 25 MB.

Every rank runs this whole file. In a terminal:

    torchrun --standalone --nproc-per-node 2 -m course_lib.course.programs.overlap

Legend: B batch, T length, N ranks (world size).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from course_lib import DecoderConfig, DecoderLM
from course_lib.course.ranks import report, start_ranks
from course_lib.parallel import OverlappingDataParallel, all_reduce_gradients, shard_batch

CONFIG = DecoderConfig(vocab_size=256, d_model=256, n_heads=4, n_layers=4, max_len=64)
BATCH, LENGTH = 8, 64  # the whole batch; each rank takes B/N sequences
SMALL_BUCKET = 2**18  # bytes: 256 KiB, several buckets per block
ONE_BUCKET = 2**40  # larger than all the gradients together


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed runs of each form")
    parser.add_argument("--d-model", type=int, default=CONFIG.d_model)
    parser.add_argument("--layers", type=int, default=CONFIG.n_layers)
    parser.add_argument("--batch", type=int, default=BATCH, help="the whole batch, all ranks")
    parser.add_argument("--small-bucket", type=int, default=SMALL_BUCKET, help="bytes")
    return parser.parse_args(argv)


def new_model(args: argparse.Namespace) -> DecoderLM:
    """The same weights on every rank (the same seed)."""
    torch.manual_seed(0)
    return DecoderLM(dataclasses.replace(CONFIG, d_model=args.d_model, n_layers=args.layers))


def my_batch(args: argparse.Namespace, rank: int, world_size: int) -> torch.Tensor:
    """This rank's (B/N, T + 1) token ids of one batch."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (args.batch, LENGTH + 1), generator=generator)
    return shard_batch(ids, rank, world_size)


def time_once(model: torch.nn.Module, ids: torch.Tensor, step: Callable,
              backward_first: bool) -> float:
    """Seconds of ``step(loss)`` on this rank. The forward pass (and, with ``backward_first``,
    the backward pass) runs before the ranks meet at a barrier and the clock starts."""
    model.zero_grad(set_to_none=True)
    loss = model(ids[:, :-1], targets=ids[:, 1:]).loss
    if backward_first:
        loss.backward()
    dist.barrier()  # the ranks start together
    start = time.perf_counter()
    step(loss)
    return time.perf_counter() - start


def all_reduce_flat(model: torch.nn.Module) -> None:
    """all_reduce_gradients in one message: every gradient flattened into one vector."""
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # one message
    dist.all_reduce(flat)  # sum_r g_r
    flat /= dist.get_world_size()  # (1/N) sum_r g_r
    for p, g in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]),
                    strict=True):
        p.grad.copy_(g.view_as(p))


def gradients(model: torch.nn.Module) -> torch.Tensor:
    """All of ``model``'s gradients, flattened into one vector."""
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rank, world_size = start_ranks()
    torch.set_num_threads(1)  # the ranks share the machine's cores
    ids = my_batch(args, rank, world_size)
    model = new_model(args)
    small = OverlappingDataParallel(new_model(args), bucket_bytes=args.small_bucket)
    whole = OverlappingDataParallel(new_model(args), bucket_bytes=ONE_BUCKET)
    ddp_small = DistributedDataParallel(new_model(args), bucket_cap_mb=args.small_bucket / 2**20)
    ddp = DistributedDataParallel(new_model(args))  # buckets of 25 MB, its default

    def by_hand(loss):
        loss.backward()
        all_reduce_gradients(model)

    def overlapped(wrapper):
        return lambda loss: (loss.backward(), wrapper.finish())

    forms = {  # name: (model, what the clock times, whether backward runs before the clock)
        "backward": (model, lambda loss: loss.backward(), False),
        "all-reduce": (model, lambda loss: all_reduce_gradients(model), True),
        "all-reduce, one message": (model, lambda loss: all_reduce_flat(model), True),
        "backward, then all-reduce": (model, by_hand, False),  # its gradients: the reference
        "overlapped, small buckets": (small, overlapped(small), False),
        "overlapped, one bucket": (whole, overlapped(whole), False),
        "DDP, small buckets": (ddp_small, lambda loss: loss.backward(), False),
        "DDP, 25 MB buckets": (ddp, lambda loss: loss.backward(), False),
    }
    times = {name: [] for name in forms}
    for i in range(args.repeat + 1):  # the forms take turns: a busy moment slows them all
        for name, (module, step, backward_first) in forms.items():
            seconds = time_once(module, ids, step, backward_first)
            if i:  # the first round is a warm-up (DDP sorts its buckets there)
                times[name].append(seconds)
    reference = gradients(model)  # averaged by hand; every form must leave the same
    gaps = {name: float((gradients(module) - reference).abs().max())
            for name, (module, _, _) in forms.items() if module is not model}
    report({"times": times, "gaps": gaps,
            "buckets": {"small": len(small.buckets), "one": len(whole.buckets)},
            "parameters": sum(p.numel() for p in model.parameters()),
            "gradient bytes": reference.nbytes})


if __name__ == "__main__":
    main()
