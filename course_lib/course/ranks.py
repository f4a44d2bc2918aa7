"""Start ranks on this machine and collect what they return: the launchers of chapter 14.

- :func:`torchrun` runs a program (a module such as ``course_lib.course.programs.data_parallel``)
  with PyTorch's own launcher, ``torchrun --standalone --nproc-per-node N -m module``, exactly as
  a learner would in a terminal; each rank hands its result back with :func:`report`.
- :func:`run_ranks` runs one importable function on N spawned processes (the tests' launcher).

Both are course machinery, not lessons: a rank that fails reports its own traceback, a rank that
hangs is stopped at the deadline (of the launch and of every collective), and no process is
left behind. The ranks talk over the loopback interface only.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
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

from .._validate import (
    require_callable,
    require_instance,
    require_positive_int,
    require_positive_number,
)

__all__ = ["report", "run_ranks", "start_ranks", "torchrun"]

RESULTS = "COURSE_LIB_RESULTS"  # the folder where torchrun's ranks leave their results
TIMEOUT = "COURSE_LIB_TIMEOUT_S"  # the limit of each collective, in seconds


def torchrun(program: str, *args: str, nproc: int = 2, timeout_s: float = 120.0) -> list:
    """Run ``torchrun --standalone --nproc-per-node <nproc> <program> <args>`` (PyTorch's
    launcher, with this Python): ``program`` is a module (``-m`` is added) or a ``.py`` file.
    Returns what each rank passed to :func:`report`, in rank order. After ``timeout_s`` (the
    limit of the run and of each collective), ``TimeoutError``; if a rank fails,
    ``RuntimeError`` with the traceback of the first to fail. Either way no process of the run
    is left."""
    require_instance("program", program, str, "a module name such as "
                     "'course_lib.course.programs.data_parallel', or a .py file")
    require_positive_int("nproc", nproc)
    require_positive_number("timeout_s", timeout_s)
    for i, arg in enumerate(args):
        require_instance(f"args[{i}]", arg, str, "a command-line argument (a str)")
    check_program(program)
    script = [program] if program.endswith(".py") else ["-m", program]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", *script, *args]
    with tempfile.TemporaryDirectory(prefix="course_lib_torchrun_") as folder:
        env = {"OMP_NUM_THREADS": "1"} | os.environ | {RESULTS: folder, TIMEOUT: str(timeout_s)}
        log = os.path.join(folder, "output.txt")  # a file, not a pipe: nothing can block on it
        with open(log, "w") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"torchrun {program} did not finish within timeout_s="
                                   f"{timeout_s} s: do all ranks call the same collectives?"
                                   ) from None
            finally:
                _stop(process)
        output = Path(log).read_text()
        if process.returncode != 0:
            raise RuntimeError(_first_failure(folder) or
                               f"torchrun {program} failed:\n{output[-3000:]}")
        missing = [r for r in range(nproc) if not os.path.exists(_result_file(folder, r))]
        if missing:
            raise RuntimeError(f"ranks {missing} of torchrun {program} ended without "
                               "calling report(result)")
        return [torch.load(_result_file(folder, rank), weights_only=False)
                for rank in range(nproc)]  # written by the ranks just now


def start_ranks() -> tuple[int, int]:
    """The first line of a program that :func:`torchrun` (or ``torchrun`` in a terminal)
    starts: join the group (gloo, over the loopback; a rank that waits longer than the
    launch's limit in a collective fails), and have a failing rank save its traceback for
    the launcher. Returns (rank, world size)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    timeout = timedelta(seconds=float(os.environ.get(TIMEOUT, 600)))
    dist.init_process_group("gloo", timeout=timeout)
    rank, folder = dist.get_rank(), os.environ.get(RESULTS)
    if folder:
        def save_failure(kind, error, trace):  # then fail as Python would
            failure = (time.time_ns(), rank, "".join(traceback.format_exception(error)))
            torch.save(failure, os.path.join(folder, f"rank{rank}.error"))
            sys.__excepthook__(kind, error, trace)
        sys.excepthook = save_failure
    return rank, dist.get_world_size()


def report(result: object) -> None:
    """The last line of such a program: hand ``result`` to the launcher (printed by rank 0 when
    the program runs in a terminal), then leave the group together."""
    if folder := os.environ.get(RESULTS):
        torch.save(result, _result_file(folder, dist.get_rank()))
    elif dist.get_rank() == 0:
        print(result)
    dist.barrier()  # nobody leaves while another still talks to it
    dist.destroy_process_group()


def _result_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pt")


def _stop(launcher: subprocess.Popen) -> None:
    """Stop torchrun if it still runs. Its ranks run in sessions of their own, so signals to
    the launcher's group miss them; on SIGTERM torchrun stops them itself, then exits."""
    if launcher.poll() is None:
        launcher.terminate()
        try:
            launcher.wait(timeout=30)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


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


def check_program(program: str) -> None:
    """A .py file that exists, or a module this Python finds."""
    if program.endswith(".py"):
        if not os.path.isfile(program):
            raise FileNotFoundError(f"program {program!r}: no such file")
    elif importlib.util.find_spec(program) is None:
        raise ModuleNotFoundError(f"program {program!r}: no such module; give a module name "
                                  "such as 'course_lib.course.programs.data_parallel' or a "
                                  ".py file")


def check_rank_function(fn: object) -> None:
    """A new process must be able to import ``fn``: the top level of a ``.py`` module."""
    require_callable("fn", fn, "a function")
    where = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
    interactive = not hasattr(sys.modules["__main__"], "__file__")  # a notebook, a REPL
    if "<" in where or (where.startswith("__main__.") and interactive):
        raise ValueError(f"fn is {where}, which a new process cannot import: define it at the "
                         "top level of a .py module and import it from there")
