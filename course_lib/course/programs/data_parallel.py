"""Data parallelism on N ranks, replicated and sharded, built by hand and then with torch's
engine: every form trains the same model on the same batches and must end with the weights one
process gets from the whole batches (float64, so only rounding may differ).

Every rank runs this whole file. In a terminal:

    torchrun --standalone --nproc-per-node 2 -m course_lib.course.programs.data_parallel

Legend: B batch, T length, N ranks (world size), r this rank.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from course_lib import DecoderConfig, DecoderLM
from course_lib.course.ranks import report, start_ranks
from course_lib.parallel import (
    FullyShardedDataParallel,
    OverlappingDataParallel,
    ShardedOptimizer,
    all_reduce_gradients,
    broadcast_parameters,
    shard_batch,
)

CONFIG = DecoderConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=2, max_len=16,
                       tie_embeddings=True)  # one weight for the embedding and the head
BATCH, LENGTH, STEPS = 8, 16, 4
ADAMW = dict(lr=1e-2, weight_decay=0.1)


def new_model(seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(CONFIG).double()


def batches() -> torch.Tensor:
    """STEPS batches of (B, T + 1) token ids, the same on every rank."""
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, LENGTH + 1), generator=generator)


def train(model, optimizer, rank: int = 0, world_size: int = 1, after_backward=None) -> list:
    """STEPS AdamW updates; rank r reads the r-th slice of every batch. The losses of its slice."""
    losses = []
    for ids in batches():
        mine = shard_batch(ids, rank, world_size)  # (B/N, T + 1)
        loss = model(mine[:, :-1], targets=mine[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def summary(model, optimizer, losses: list) -> dict:
    """The full weights, whether the head is still the embedding, the losses, and the bytes this
    rank keeps for parameters, gradients and optimizer state."""
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if isinstance(model, FullyShardedDataParallel):  # gathered from the shards, tie included
        weights = model.full_state_dict()
        tied = weights["lm_head.weight"] is weights["embeddings.token.weight"]
    else:
        weights = {k: full(v) for k, v in model.state_dict().items()}
        tied = model.lm_head.weight is model.embeddings.token.weight
    return {"weights": weights, "tied": tied,
            "losses": losses,
            "bytes": {"parameters": local_bytes(model.parameters()),
                      "gradients": local_bytes(grads), "optimizer state": local_bytes(state)}}


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one (a DTensor of fully_shard) gathered from all ranks."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def local_bytes(tensors) -> int:
    """Bytes this rank holds: of a DTensor, only its own shard."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def main() -> None:
    rank, world_size = start_ranks()
    results = {}

    # 1. By hand: rank 0's weights to everyone, then average the gradients before each step.
    model = new_model(seed=rank)  # each rank draws its own weights...
    broadcast_parameters(model)  # ...and takes rank 0's
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = train(model, optimizer, rank, world_size, lambda: all_reduce_gradients(model))
    results["by hand"] = summary(model, optimizer, losses)

    # 2. By hand, overlapped: each bucket's all-reduce starts while backward still runs.
    wrapper = OverlappingDataParallel(new_model(seed=rank), bucket_bytes=16_384)
    optimizer = torch.optim.AdamW(wrapper.parameters(), **ADAMW)
    losses = train(wrapper, optimizer, rank, world_size, wrapper.finish)
    results["overlapped"] = summary(wrapper.module, optimizer, losses)

    # 3. torch's DistributedDataParallel: the same idea, hooks and buckets inside.
    ddp = DistributedDataParallel(new_model(seed=rank))
    optimizer = torch.optim.AdamW(ddp.parameters(), **ADAMW)
    results["DDP"] = summary(ddp.module, optimizer, train(ddp, optimizer, rank, world_size))

    # 4. ZeRO-1 by hand: each rank keeps AdamW's moments for its share of the parameters only.
    model = new_model(seed=rank)
    broadcast_parameters(model)
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
    losses = train(model, optimizer, rank, world_size, lambda: all_reduce_gradients(model))
    results["ZeRO-1"] = summary(model, optimizer.optimizer, losses)

    # 5. Fully sharded by hand (ZeRO-3): each rank stores 1/N of the weights; a block's are
    #    gathered just before it runs and freed after, its gradients reduce-scattered.
    fsdp = FullyShardedDataParallel(new_model(seed=rank))  # units: each of model.blocks
    optimizer = torch.optim.AdamW(fsdp.parameters(), **ADAMW)  # over this rank's shards
    results["FSDP by hand"] = summary(fsdp, optimizer, train(fsdp, optimizer, rank, world_size))

    # 6. torch's fully_shard (FSDP2): the same sharding, on torch's DTensor.
    model = new_model(seed=0)  # fully_shard keeps each rank's slice; they must start equal
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)  # gathered one block at a time
    fully_shard(model, mesh=mesh)  # the rest: embedding (= head), final norm
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    results["FSDP2"] = summary(model, optimizer, train(model, optimizer, rank, world_size))

    report(results)


if __name__ == "__main__":
    main()
