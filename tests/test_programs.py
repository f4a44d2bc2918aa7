"""Chapter 14's programs under PyTorch's own launcher (torchrun, 2 gloo ranks on this CPU), and
the launcher the notebooks use to run them: every parallel form equals one process, and a rank
that fails or hangs stops the run quickly and leaves no process behind."""

from __future__ import annotations

import os
import textwrap
import time

import pytest
import torch
from helpers import alive

from course_lib.course.programs import data_parallel, tensor_parallel
from course_lib.course.ranks import torchrun

TOL = dict(rtol=0, atol=1e-10)  # float64: one process and 2 ranks agree to rounding


@pytest.fixture(scope="module")
def data_parallel_ranks():
    return torchrun("course_lib.course.programs.data_parallel", nproc=2, timeout_s=180)


@pytest.fixture(scope="module")
def one_process():
    model = data_parallel.new_model(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), **data_parallel.ADAMW)
    losses = data_parallel.train(model, optimizer)
    return model.state_dict(), losses, data_parallel.summary(model, optimizer, losses)["bytes"]


@pytest.mark.parametrize("form", ["by hand", "overlapped", "DDP", "ZeRO-1", "FSDP by hand", "FSDP2"])
def test_each_data_parallel_form_trains_like_one_process(data_parallel_ranks, one_process, form):
    weights, losses, _ = one_process
    for rank in data_parallel_ranks:
        assert rank[form]["tied"], "the head is no longer the embedding"
        assert rank[form]["weights"].keys() == weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(rank[form]["weights"][name], tensor, **TOL, msg=name)
    mean_losses = torch.tensor([r[form]["losses"] for r in data_parallel_ranks]).mean(0)
    torch.testing.assert_close(mean_losses, torch.tensor(losses, dtype=mean_losses.dtype), **TOL)


def test_sharding_keeps_one_nth_per_rank(data_parallel_ranks, one_process):
    whole = one_process[2]
    step_counts = 4 * len(one_process[0])  # AdamW's float32 step count, one per parameter
    for rank in data_parallel_ranks:
        assert rank["DDP"]["bytes"] == whole  # a full replica on every rank
        for form in ("FSDP by hand", "FSDP2"):
            fsdp = rank[form]["bytes"]
            assert 2 * fsdp["parameters"] == whole["parameters"], form  # no padding here
            assert 2 * fsdp["gradients"] == whole["gradients"], form
            assert abs(fsdp["optimizer state"] - whole["optimizer state"] / 2) < step_counts
        assert abs(rank["ZeRO-1"]["bytes"]["optimizer state"] - whole["optimizer state"] / 2) \
            < step_counts
        assert rank["ZeRO-1"]["bytes"]["parameters"] == whole["parameters"]


def test_tensor_parallel_layers_equal_the_one_device_layers():
    ranks = torchrun("course_lib.course.programs.tensor_parallel", nproc=2, timeout_s=180)
    layers = tensor_parallel.one_device_layers()
    for form in ranks[0]:
        name = form.split(",")[0]
        reference = tensor_parallel.forward_backward(layers[name], causal=name == "attention")
        whole = sum(p.numel() for p in layers[name].parameters())
        for rank in ranks:
            torch.testing.assert_close(rank[form]["y"], reference["y"], **TOL)
            torch.testing.assert_close(rank[form]["x grad"], reference["x grad"], **TOL)
            biases = layers[name].out_proj.bias if name == "attention" else layers[name].fc2.bias
            assert rank[form]["weights here"] == (whole - biases.numel()) / 2 + biases.numel()


FAILING = """
import os, time, torch, torch.distributed as dist
from course_lib.course.ranks import report, start_ranks
rank, _ = start_ranks()
open(os.path.join({folder!r}, f"{{os.getpid()}}.pid"), "w").close()
if rank == 1:
    {what}
dist.all_reduce(torch.ones(1))
report(rank)
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")
@pytest.mark.parametrize(("what", "timeout_s", "error", "match"), [
    ("raise ValueError('planted failure on rank 1')", 120, RuntimeError,
     r"rank 1[\s\S]*planted failure on rank 1"),
    ("time.sleep(600)", 5, TimeoutError, "did not finish within timeout_s=5"),
], ids=["failing", "hanging"])
def test_a_failing_or_hanging_rank_stops_torchrun_and_leaves_no_process(tmp_path, what,
                                                                        timeout_s, error, match):
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(FAILING.format(folder=str(tmp_path), what=what)))
    start = time.monotonic()
    with pytest.raises(error, match=match):
        torchrun(str(script), nproc=2, timeout_s=timeout_s)
    assert time.monotonic() - start < 60, "the failure took too long to reach the caller"
    pids = [int(p.stem) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(alive(pid) for pid in pids)


@pytest.mark.parametrize(("call", "kind", "words"), [
    (lambda: torchrun("course_lib.no_such_program"), ModuleNotFoundError, "no such module"),
    (lambda: torchrun("missing.py"), FileNotFoundError, "no such file"),
    (lambda: torchrun(data_parallel), TypeError, "program"),
    (lambda: torchrun("course_lib.course.programs.data_parallel", nproc=0), ValueError, "nproc"),
    (lambda: torchrun("course_lib.course.programs.data_parallel", 3), TypeError, r"args\[0\]"),
])
def test_wrong_launches_say_what_is_wrong(call, kind, words):
    with pytest.raises(kind, match=words):
        call()
