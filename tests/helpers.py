"""Small helpers shared by the tests."""

from __future__ import annotations

import torch
from torch import nn

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
