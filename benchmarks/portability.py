"""The test suite across PyTorch versions, thread counts and instruction sets, without pins.

    python -m benchmarks.portability                              # the floor and 2.15.0
    python -m benchmarks.portability --torch 2.13.0 --configs 2:default
    python -m benchmarks.portability --what notebooks --configs 1:avx2 1:avx512
    python -m benchmarks.portability --device cuda --torch current # on a GPU machine

Not part of the test command: it downloads PyTorch wheels (several GB each, CUDA builds from
PyPI). For each version it builds a virtual environment in ``.portability/torch-VERSION`` (kept
for the next run; ``--rebuild`` starts again) with ``torch==VERSION`` and course_lib's test
extra; ``current`` means this interpreter, as it is. Then, for each configuration
``THREADS:ISA`` (``ISA`` is ``default`` for PyTorch's own choice, or a value of
``ATEN_CPU_CAPABILITY`` such as ``avx2``, ``avx512``), it runs with ``pytest -p no:env`` (none
of pyproject's environment defaults):

- ``library``: ``tests/`` without the browser test (every device the machine has), once per
  version, under the first configuration (the library tests compare with tolerances, not with
  stored digits);
- ``notebooks``: every lecture and solution notebook under nbval (two workers with one thread
  each, one worker otherwise); with ``--device cuda`` they run on the GPU with
  ``--nbval-lax``: every cell must run and every claim hold, outputs are not compared (the
  stored ones were made on a CPU, where some demos are smaller).

It prints one line per cell of the matrix: version, threads, instruction set (as requested, and
what PyTorch then uses), passed/failed per part, minutes. Exit status 1 if anything failed;
the failing tests are listed after the table.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENVS = ROOT / ".portability"
NEWEST = "2.15.0"


def floor() -> str:
    """The lowest torch version pyproject.toml admits."""
    text = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'"torch>=([\d.]+)"', text).group(1)
    return version + ".0" * (3 - len(version.split(".")))  # 2.6 -> 2.6.0


def below_floor(version: str) -> bool:
    """Whether ``version`` is below the floor: the Hugging Face references the tests compare
    with (transformers >= 5.1) turn themselves off below torch 2.6, so such a run says nothing."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", v)[:3])
    return version != "current" and key(version) < key(floor())


def python_for(version: str, rebuild: bool) -> str:
    """The interpreter of an environment with torch ``version`` and course_lib's test extra."""
    if version == "current":
        return sys.executable
    venv = VENVS / f"torch-{version}"
    python = venv / "bin" / "python"
    if rebuild or not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip"], check=True)
        subprocess.run([*pip, f"torch=={version}", "-e", f"{ROOT}[test]"], check=True)
    return str(python)


def summary(output: str) -> tuple[int, int, list[str]]:
    """Passed and failed (errors included) counts of a pytest run, and the failing tests."""
    def count(word: str) -> int:
        found = re.findall(rf"(\d+) {word}", output.splitlines()[-1] if output else "")
        return int(found[-1]) if found else 0

    failing = re.findall(r"^(?:FAILED|ERROR) (\S+(?: \d+)?)", output, re.M)
    return count("passed"), count("failed") + count("error"), failing


def capability(python: str, isa: str) -> str:
    """The instruction set PyTorch's CPU kernels use under this ``ATEN_CPU_CAPABILITY``."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if isa != "default":
        env["ATEN_CPU_CAPABILITY"] = isa
    ask = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([python, "-c", ask],
                          env=env, capture_output=True, text=True).stdout.strip() or "?"


def run_part(python: str, part: str, threads: int, isa: str, device: str) -> tuple[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "COURSE_DEVICE")}
    env["OMP_NUM_THREADS"] = str(threads)
    if isa != "default":
        env["ATEN_CPU_CAPABILITY"] = isa
    workers = "2" if threads == 1 else "1"
    if part == "library":
        args = ["tests", "--deselect", "tests/test_browser.py"]
    else:
        args = ["notebooks", "solutions"]
        if device != "cpu":
            env["COURSE_DEVICE"] = device
            args = ["--nbval-lax", *args]
    command = [python, "-m", "pytest", "-p", "no:env", "-p", "no:cacheprovider", "-q", "-n",
               workers, "-o", "addopts=--nbval --nbval-current-env --nbval-cell-timeout=600 "
               "--nbval-sanitize-with=tests/nbval_sanitize.cfg --dist loadfile -ra", *args]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    passed, failed, failing = summary(result.stdout.strip())
    if result.returncode not in (0, 1):
        failed, failing = max(failed, 1), failing or [f"pytest exit {result.returncode}: "
                                                      + result.stdout.strip()[-300:]]
    return f"{passed} passed, {failed} failed", failing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", nargs="+", default=None,
                        help=f"versions (default: the floor and {NEWEST}); 'current': this one")
    parser.add_argument("--configs", nargs="+", default=["1:default", "2:default", "1:avx2"],
                        help="THREADS:ISA pairs, ISA 'default' or an ATEN_CPU_CAPABILITY value")
    parser.add_argument("--what", nargs="+", choices=["library", "notebooks"],
                        default=["library", "notebooks"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "mps"],
                        help="where the notebooks run (the library tests use every device)")
    parser.add_argument("--rebuild", action="store_true", help="build the environments anew")
    args = parser.parse_args(argv)
    versions = args.torch or [floor(), NEWEST]
    if low := [v for v in versions if below_floor(v)]:
        parser.error(f"torch {', '.join(low)} is below the floor, torch {floor()}: "
                     "the Hugging Face reference tests cannot run there")

    rows, failures = [], []
    print(f"{'torch':<22} {'threads':>7} {'ISA (used)':<18} "
          + " ".join(f"{w:<22}" for w in args.what) + " minutes", flush=True)
    for version in versions:
        python = python_for(version, args.rebuild)
        actual = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                                capture_output=True, text=True, check=True).stdout.strip()
        for i, config in enumerate(args.configs):
            threads, isa = config.split(":")
            started = time.perf_counter()
            cells = []
            for part in args.what:
                if part == "library" and i > 0:
                    cells.append("(once per version)")
                    continue
                text, failing = run_part(python, part, int(threads), isa, args.device)
                cells.append(text)
                failures += [f"torch {actual}, {config}, {part}: {f}" for f in failing]
            used = capability(python, isa)
            row = (f"{actual:<22} {threads:>7} {isa + ' (' + used + ')':<18} "
                   + " ".join(f"{c:<22}" for c in cells)
                   + f" {(time.perf_counter() - started) / 60:7.1f}")
            rows.append(row)
            print(row, flush=True)
    for f in failures:
        print(f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
