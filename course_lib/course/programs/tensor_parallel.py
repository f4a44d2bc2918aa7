"""Tensor parallelism on N ranks: one attention layer split by heads and one MLP split along
its hidden units, by hand (course_lib.parallel) and with torch's DTensor. Every rank holds 1/N
of each layer's weights, and the outputs and the input's gradient must equal the one-device
layer's (float64).

Every rank runs this whole file. In a terminal:

    torchrun --standalone --nproc-per-node 2 -m course_lib.course.programs.tensor_parallel
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from course_lib.attention import MultiHeadAttention, merge_heads, split_heads
from course_lib.course.ranks import report, start_ranks
from course_lib.layers import FeedForward
from course_lib.parallel import TensorParallelAttention, TensorParallelFeedForward

D, H, F = 32, 4, 128  # d_model, heads, d_ff


def one_device_layers() -> dict:
    """The layers every rank starts from: the same seeds, the same weights."""
    torch.manual_seed(0)
    attention = MultiHeadAttention(D, H).double()
    torch.manual_seed(1)
    return {"attention": attention, "MLP": FeedForward(D, F, activation="gelu").double()}


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, T, D) that wants a gradient, and the weights of a scalar loss sum(y * w)."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, D, generator=generator, dtype=torch.float64, requires_grad=True)
    return x, torch.randn(2, 6, D, generator=generator, dtype=torch.float64)


def forward_backward(layer: torch.nn.Module, causal: bool) -> dict:
    """The layer's output and dL/dx for L = sum(y * w)."""
    x, w = inputs()
    y = layer(x, is_causal=True)[0] if causal else layer(x)
    (y * w).sum().backward()
    return {"y": y.detach(), "x grad": x.grad}


class SeparateProjections(nn.Module):
    """``attention`` with W_q, W_k, W_v as three linear layers (course_lib fuses them), the
    layout DTensor's plans split: each rank's share of q_proj's rows is whole heads, so it
    computes as many heads as its q_proj makes. x (B, T, D) -> (out (B, T, D), None)."""

    def __init__(self, attention: MultiHeadAttention) -> None:
        super().__init__()
        self.d_head = attention.d_head
        q, k, v = attention.qkv_proj.weight.detach().split(attention.d_model)  # (D, D) each
        bq, bk, bv = attention.qkv_proj.bias.detach().split(attention.d_model)
        for name, weight, bias in (("q_proj", q, bq), ("k_proj", k, bk), ("v_proj", v, bv)):
            layer = nn.Linear(D, D, dtype=weight.dtype)
            layer.weight.data, layer.bias.data = weight.clone(), bias.clone()
            setattr(self, name, layer)
        self.out_proj = attention.out_proj

    def forward(self, x: torch.Tensor, *, is_causal: bool = False) -> tuple[torch.Tensor, None]:
        heads = self.q_proj(x).shape[-1] // self.d_head  # H, or H/N under a plan
        q, k, v = (split_heads(proj(x), heads) for proj in (self.q_proj, self.k_proj,
                                                              self.v_proj))
        # (B, heads, T, Dh)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        return self.out_proj(merge_heads(out)), None


def local_numel(layer: torch.nn.Module) -> int:
    """Weights this rank holds (of a DTensor, its own shard)."""
    return sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in layer.parameters())


def main() -> None:
    rank, world_size = start_ranks()
    layers = one_device_layers()
    results = {}

    # By hand: column-parallel in (my heads' rows of W_q, W_k, W_v; my rows of W1),
    # row-parallel out (the columns of W_o and W2 that read them), one all-reduce per layer.
    attention = TensorParallelAttention(layers["attention"])
    results["attention, by hand"] = forward_backward(attention, causal=True)
    results["attention, by hand"]["weights here"] = local_numel(attention)
    mlp = TensorParallelFeedForward(layers["MLP"])
    results["MLP, by hand"] = forward_backward(mlp, causal=False)
    results["MLP, by hand"]["weights here"] = local_numel(mlp)

    # torch's DTensor: the same plan, named per submodule.
    mesh = init_device_mesh("cpu", (world_size,))
    attention = parallelize_module(SeparateProjections(one_device_layers()["attention"]), mesh,
                                   {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                    "v_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    results["attention, DTensor"] = forward_backward(attention, causal=True)
    results["attention, DTensor"]["weights here"] = local_numel(attention)
    mlp = parallelize_module(one_device_layers()["MLP"], mesh,
                             {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    results["MLP, DTensor"] = forward_backward(mlp, causal=False)
    results["MLP, DTensor"]["weights here"] = local_numel(mlp)

    report(results)


if __name__ == "__main__":
    main()
