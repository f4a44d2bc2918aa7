"""Run a function on several processes of one gloo group, as ``torchrun`` would: the launcher
that chapter 14's notebooks and tests use to run course_lib.parallel's pieces. It is course
machinery, not a lesson: it starts the ranks, collects their results, and makes sure that a
rank that fails or hangs never hangs the caller or leaves a process behind.

The ranks meet through a file (``dist.FileStore`` in a temporary folder) and talk over the
loopback interface only.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._validate import require_callable, require_positive_int, require_positive_number

__all__ = ["run_ranks"]


def run_ranks(fn: Callable, world_size: int, *args: object, timeout_s: float = 60.0) -> list:
    """Run ``fn(*args)`` on ``world_size`` new processes in one gloo group (on this machine's
    loopback, as ``torchrun --nproc-per-node`` would); their results in rank order. The first
    rank's error is raised here; after ``timeout_s`` (the limit of the run and of each
    collective), ``TimeoutError``. Either way every rank is stopped. ``fn`` must be importable
    (at the top level of a ``.py`` module)."""
    check_rank_function(fn)
    require_positive_int("world_size", world_size)
    require_positive_number("timeout_s", timeout_s)
    with tempfile.TemporaryDirectory(prefix="course_lib_ranks_") as folder:
        context = mp.start_processes(_rank_main, (fn, args, world_size, folder, timeout_s),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:  # join raises as soon as one rank fails, after stopping the others
            while not context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the ranks did not finish within timeout_s={timeout_s}"
                                       " s: do all of them call the same collectives?")
        except mp.ProcessRaisedException as error:  # often a rank fails because another did
            raise RuntimeError(_first_failure(folder) or str(error)) from None
        finally:  # no process left behind, whatever happened
            for process, error_file in zip(context.processes, context.error_files, strict=True):
                if process.is_alive():
                    process.kill()
                process.join()
                if os.path.exists(error_file):
                    os.remove(error_file)
        return [torch.load(os.path.join(folder, f"rank{rank}.pt"), weights_only=False)
                for rank in range(world_size)]  # written by our own processes just now


def _first_failure(folder: str) -> str:
    """The traceback of the rank that failed first, as its process saved it."""
    failed = sorted(torch.load(path) for path in Path(folder).glob("*.error"))
    return "rank {1} failed first:\n{2}".format(*failed[0]) if failed else ""


def _rank_main(rank: int, fn: Callable, args: tuple, world_size: int, folder: str,
               timeout_s: float) -> None:
    """One rank: meet the others through a file, talk over the loopback, save fn's result."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo0" if sys.platform == "darwin" else "lo"
    torch.set_num_threads(1)  # the ranks share the cores
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
    except Exception:  # the time says which rank failed first
        failure = (time.time_ns(), rank, traceback.format_exc())
        torch.save(failure, os.path.join(folder, f"rank{rank}.error"))
        raise
    dist.barrier()  # nobody leaves while another still talks to it
    dist.destroy_process_group()
    torch.save(result, os.path.join(folder, f"rank{rank}.pt"))


# --- argument checks


def check_rank_function(fn: object) -> None:
    """A new process must be able to import ``fn``: the top level of a ``.py`` module."""
    require_callable("fn", fn, "a function")
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    interactive = not hasattr(sys.modules["__main__"], "__file__")  # a notebook, a REPL
    if "<" in where or (where.startswith("__main__.") and interactive):
        raise ValueError(f"fn is {where}, which a new process cannot import: define it at the "
                         "top level of a .py module and import it from there")
