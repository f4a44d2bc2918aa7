"""Small helpers shared by the tests."""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from course_lib.attention import MultiHeadAttention


def copy_mha_from_torch(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    """Load nn.MultiheadAttention's weights into ours: in_proj_weight is [W_q; W_k; W_v]."""
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(ref.in_proj_weight)
        ours.qkv_proj.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)


def copy_linear(ours: nn.Linear, ref: nn.Linear) -> None:
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        if ref.bias is not None:
            ours.bias.copy_(ref.bias)


def copy_norm(ours: nn.Module, ref: nn.LayerNorm) -> None:
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        ours.bias.copy_(ref.bias)


def stub(*args, **kwargs):
    """An unsolved exercise: the body the generator leaves for the learner."""
    raise NotImplementedError("Exercise: write the body")


class Float64Watch(TorchFunctionMode):
    """Records every torch call that produces a float64 tensor off the CPU: on MPS, which has
    no float64, each of them would fail."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.device.type != "cpu":
                self.calls.append(getattr(func, "__name__", str(func)))
        return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, finished but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS), or gone meanwhile
        return True
