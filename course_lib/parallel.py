"""Beyond one device (chapter 14): data parallelism, optimizer-state sharding (ZeRO-1), fully
sharded data parallelism (ZeRO-3, FSDP) and tensor parallelism by hand from torch.distributed's
collectives, each equal to one process. Every rank runs the same program and calls the same
collectives in the same order: ``broadcast`` (one rank's tensor to all), ``all_reduce`` (the
sum, to all), ``all_gather`` (the ranks' pieces, concatenated, to all), ``reduce_scatter`` (the
sum, each rank keeping its piece). Left out: NCCL, uneven batches, unused parameters, pipeline
and sequence parallelism, FSDP's prefetching, hybrid sharding and CPU offload.

Legend: B batch, T length, D d_model, F d_ff, H heads, Hkv key/value heads, Dh head dim,
N ranks (the world size), r this rank.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._validate import (
    checks_wanted,
    inputs_checked,
    require_bool,
    require_float_dtype,
    require_instance,
    require_int,
    require_integer_tensor,
    require_ndim,
    require_positive_int,
    require_tensor,
    shape_of,
)
from .attention import MultiHeadAttention, merge_heads, split_heads
from .layers import FeedForward

# ------------------------------------------------------------------------------ data parallelism


def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``: all replicas
    start from the same weights (as DDP does when it wraps a model)."""
    require_instance("module", module, nn.Module, "a torch.nn.Module")
    check_in_group(src=src)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:  # a tied weight comes once
            dist.broadcast(tensor, src=src)


def all_reduce_gradients(module: nn.Module) -> None:
    """Each gradient becomes its mean over the ranks: the whole batch's gradient when each
    rank's loss is the mean over its equal share. A tied weight is one parameter whose
    ``.grad`` holds both uses; ``parameters()`` yields it once, so it is averaged once."""
    require_instance("module", module, nn.Module, "a torch.nn.Module")
    check_in_group()
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)  # sum_r g_r
            param.grad /= dist.get_world_size()  # (1/N) sum_r g_r


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """The ``rank``-th of ``world_size`` equal contiguous slices of ``batch`` along dim 0:
    (B, ...) -> (B/N, ...); the slices of ranks 0..N-1 concatenate back to the batch."""
    check_shard(batch, rank, world_size)
    size = batch.shape[0] // world_size  # B/N
    return batch[rank * size:(rank + 1) * size]  # (B/N, ...)


class OverlappingDataParallel(nn.Module):
    """DDP's core by hand: gradients are all-reduced while backward still runs. Parameters
    fill buckets of about ``bucket_bytes``, last layers first (backward's order); once a
    bucket's gradients are in, a hook flattens them and starts their all-reduce without
    waiting (``async_op=True``). Call :meth:`finish` after each backward, before the
    optimizer's step. The model (with rank 0's weights) is kept at ``.module``."""

    def __init__(self, module: nn.Module, *, bucket_bytes: int = 25 * 2**20) -> None:
        require_positive_int("bucket_bytes", bucket_bytes)
        require_instance("module", module, nn.Module, "a torch.nn.Module")
        check_in_group()
        super().__init__()
        self.module = module
        broadcast_parameters(module)
        params = [p for p in module.parameters() if p.requires_grad][::-1]  # last layers first
        self.buckets: list[list[nn.Parameter]] = [[]]
        for param in params:  # close a bucket when the next parameter would overfill it
            if self.buckets[-1] and _nbytes(self.buckets[-1] + [param]) > bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(param)
            param.register_post_accumulate_grad_hook(
                functools.partial(self._arrived, len(self.buckets) - 1))
        self.arrived = [0] * len(self.buckets)  # gradients in, per bucket
        self.launched: list[tuple[dist.Work, torch.Tensor, list[nn.Parameter]]] = []

    def forward(self, *args: object, **kwargs: object) -> object:
        return self.module(*args, **kwargs)

    def _arrived(self, index: int, param: nn.Parameter) -> None:
        """Start the all-reduce of each complete bucket, in bucket order on every rank."""
        self.arrived[index] += 1
        while len(self.launched) < len(self.buckets) and \
                self.arrived[len(self.launched)] == len(self.buckets[len(self.launched)]):
            bucket = self.buckets[len(self.launched)]
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])  # one message per bucket
            self.launched.append((dist.all_reduce(flat, async_op=True), flat, bucket))

    def finish(self) -> None:
        """Wait for every bucket's all-reduce; each gradient becomes (1/N) sum_r g_r."""
        check_all_launched(self)
        for work, flat, bucket in self.launched:
            work.wait()
            flat /= dist.get_world_size()  # (1/N) sum_r g_r
            for param, grad in zip(bucket, flat.split([p.numel() for p in bucket]), strict=True):
                param.grad.copy_(grad.view_as(param))
        self.arrived, self.launched = [0] * len(self.buckets), []


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ShardedOptimizer:
    """ZeRO stage 1 by hand (Rajbhandari et al., 2020): each rank keeps the optimizer state
    (AdamW's moments) of its share of ``params`` only, about 1/N. Every rank holds all the
    parameters and their averaged gradients (:func:`all_reduce_gradients` or DDP); ``step``
    runs ``optimizer_class(share, **kwargs)``, then each owner broadcasts its parameters."""

    def __init__(self, params: Iterable[nn.Parameter], optimizer_class: type, **kwargs: object):
        params = list(params)
        check_sharded_optimizer(params, optimizer_class)
        self.params = list(dict.fromkeys(params))  # each tensor once
        # owners: the largest first, each to the rank with the fewest elements so far
        load, self.owners = [0] * dist.get_world_size(), [0] * len(self.params)
        for i in sorted(range(len(self.params)), key=lambda i: -self.params[i].numel()):
            self.owners[i] = min(range(len(load)), key=load.__getitem__)
            load[self.owners[i]] += self.params[i].numel()
        mine = [p for p, r in zip(self.params, self.owners, strict=True) if r == dist.get_rank()]
        self.optimizer = optimizer_class(mine, **kwargs)  # state for this rank's share only

    def step(self) -> None:
        """Update this rank's parameters, then broadcast each from its owner to every rank."""
        self.optimizer.step()
        with torch.no_grad():
            for param, owner in zip(self.params, self.owners, strict=True):
                dist.broadcast(param, src=owner)

    def zero_grad(self) -> None:
        """Drop the gradients of all the parameters, not only of this rank's share."""
        for param in self.params:
            param.grad = None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of the tensors in ``optimizer``'s state (AdamW: 2 moments + a step count)."""
    require_instance("optimizer", optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer",
                     "for a ShardedOptimizer pass its .optimizer")
    return _nbytes(t for state in optimizer.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor))


# ------------------------------------------------------ fully sharded data parallelism (ZeRO-3)

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (gloo has both)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _all_gather(shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's shard (S,) in ``dtype``, in rank order: w = [w_0; ...; w_{N-1}] (N S,)."""
    full = shard.new_empty(shard.numel() * dist.get_world_size(), dtype=dtype)
    _ALL_GATHER(full, shard.detach().to(dtype))
    return full


class GatherShards(torch.autograd.Function):
    """Forward: the full flat weights w (N S,) in ``dtype`` (all-gather). Backward: rank r's
    slice of the mean gradient, (1/N) sum_r' dL_r'/dw [r S:(r + 1) S] (S,), in the shard's
    dtype (reduce-scatter: the sum over the ranks, each keeping its slice)."""

    @staticmethod
    def forward(ctx: object, shard: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.shard_dtype = shard.dtype
        return _all_gather(shard, dtype)  # (N S,)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = grad.new_empty(grad.numel() // dist.get_world_size())  # (S,)
        _REDUCE_SCATTER(mine, grad / dist.get_world_size())  # sum_r' g_r' / N, my slice
        return mine.to(ctx.shard_dtype), None


class FullyShardedDataParallel(nn.Module):
    """ZeRO stage 3 (FSDP's idea) by hand: each rank stores 1/N of the weights, so 1/N of
    their gradients and optimizer state. Units (default: each of ``module.blocks``, if any;
    the root unit holds the rest, e.g. embeddings, final norm, a tied head) are flattened,
    padded to a multiple of N and split: rank r keeps slice r, ``.shards[u]`` (S,), the only
    parameters the optimizer sees. Just before a unit runs, its weights are all-gathered (in
    ``compute_dtype`` if given) as views of one flat w; just after, w is freed: autograd
    saves where a view of it sits, not its data (saved-tensor hooks); backward all-gathers
    the unit again, then reduce-scatters its gradient. So only the root and the running unit
    are ever whole. ``.module`` is the model (weights empty between calls); use
    :meth:`full_state_dict` to save. Left out: frozen weights, overlapping communication."""

    def __init__(self, module: nn.Module, units: Iterable[nn.Module] | None = None, *,
                 compute_dtype: torch.dtype | None = None) -> None:
        units = require_units(module, units, compute_dtype)
        super().__init__()
        self.module, self.state_keys = module, list(module.state_dict())  # in order
        broadcast_parameters(module)  # rank 0's weights on every rank, then sharded
        names: dict[nn.Parameter, list[str]] = {}  # each weight once, with all its names
        for name, param in module.named_parameters(remove_duplicate=False):
            names.setdefault(param, []).append(name)
        held = Counter(p for unit in units for p in unit.parameters())  # units holding each
        unit_of = {p: 0 for p in names} | {p: u for u, unit in enumerate(units, 1)  # 0: root
                                           for p in unit.parameters() if held[p] == 1}
        dtype = next(iter(names)).dtype  # the shards'; the gathered weights' is self.dtype
        self.dtype = compute_dtype or dtype
        self.layouts, self.shards = [], nn.ParameterList()  # per unit: weights, shard
        self.gathered, self.regathered = {}, {}  # unit -> its full flat weights w (N S,)
        for u, unit in enumerate([module, *units]):
            params = [p for p in names if unit_of[p] == u]
            self.layouts.append([(p.shape, names[p]) for p in params])
            flat = torch.cat([torch.zeros(0, dtype=dtype)]  # (n,): none for an empty root
                             + [p.detach().reshape(-1) for p in params])
            flat = F.pad(flat, (0, -flat.numel() % dist.get_world_size()))  # (N S,)
            shard = flat.tensor_split(dist.get_world_size())[dist.get_rank()]  # (S,)
            self.shards.append(nn.Parameter(shard.clone()))
            self.shards[u].register_post_accumulate_grad_hook(functools.partial(self._done, u))
            self._free(u)  # the full weights go, the shard stays
            unit.register_forward_pre_hook(functools.partial(self._gather, u))
            unit.register_forward_hook(functools.partial(self._free, u))

    def forward(self, *args: object, **kwargs: object) -> object:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _gather(self, u: int, *_: object) -> None:
        """Before unit u runs: its weights, views of its all-gathered flat weights."""
        self.gathered[u] = GatherShards.apply(self.shards[u], self.dtype)  # (N S,)
        for names, weight in _views(self.gathered[u], self.layouts[u]):
            for name in names:
                _set(self.module, name, weight)

    def _free(self, u: int, *_: object) -> None:
        """After unit u ran: its weights become empty tensors (nothing else holds them)."""
        self.gathered.pop(u, None)
        for _, names in self.layouts[u]:
            for name in names:
                _set(self.module, name, self.shards[u].new_empty(0, dtype=self.dtype))

    def _pack(self, tensor: torch.Tensor) -> object:
        """What autograd saves: a view of gathered weights as (unit, place), not its data."""
        for u, full in self.gathered.items():
            if tensor.untyped_storage().data_ptr() == full.untyped_storage().data_ptr():
                return u, tensor.shape, tensor.stride(), tensor.storage_offset()
        return tensor  # activations as they are

    def _unpack(self, packed: object) -> torch.Tensor:
        """In backward: unit u gathered again, once, until its shard's gradient is in."""
        if isinstance(packed, torch.Tensor):
            return packed
        u, shape, stride, offset = packed
        if u not in self.regathered:
            self.regathered[u] = _all_gather(self.shards[u], self.dtype)  # (N S,)
        return self.regathered[u].as_strided(shape, stride, offset)

    def _done(self, u: int, shard: nn.Parameter) -> None:
        self.regathered.pop(u, None)  # unit u's backward is over: free its weights

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The unwrapped model's ``state_dict()``, gathered on every rank (for saving): the
        same keys in the same order, the shards' dtype, a tied weight under both names."""
        state = self.module.state_dict()  # the buffers: the weights are no parameters here
        for shard, layout in zip(self.shards, self.layouts, strict=True):
            for names, weight in _views(_all_gather(shard, shard.dtype), layout):
                state |= dict.fromkeys(names, weight)
        return {key: state[key] for key in self.state_keys}


def _views(full: torch.Tensor, layout: list) -> list[tuple[list[str], torch.Tensor]]:
    """Each weight's names and its view of the unit's flat weights w (N S,), padding left."""
    sizes = [shape.numel() for shape, _ in layout]
    return [(names, flat.view(shape)) for (shape, names), flat
            in zip(layout, full[:sum(sizes)].split(sizes), strict=True)]


def _set(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """``module``'s weight ``name`` (e.g. "blocks.0.ff.fc1.weight") becomes ``tensor``."""
    owner, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner)
    owner._parameters.pop(attr, None)  # the first time: no parameter now (the shards are)
    setattr(owner, attr, tensor)


# ---------------------------------------------------------------- tensor parallelism (Megatron)


class CopyToParallel(torch.autograd.Function):
    """Megatron's f: identity forward; backward sums the ranks' dL/dx = sum_r dL_r/dx."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()  # all_reduce works in place
        dist.all_reduce(grad)  # sum_r dL_r/dx
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's g: forward sums the ranks' parts y = sum_r y_r; backward, dy/dy_r = 1."""

    @staticmethod
    def forward(ctx: object, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()  # all_reduce works in place
        dist.all_reduce(total)  # sum_r y_r
        return total

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ColumnParallelLinear(nn.Module):
    """Some output features of ``linear``: y_r = x W_r^T + b_r, W_r the rows ``features`` of
    W (out, in) (Megatron's columns of W^T; default the r-th of N blocks). No communication
    forward; backward sums dL/dx over the ranks (f). (..., in) -> (..., len(features))."""

    def __init__(self, linear: nn.Linear, features: torch.Tensor | None = None) -> None:
        check_parallel_linear(linear, features, dim=0)
        super().__init__()
        features = _my_block(linear.out_features) if features is None else features
        self.weight = nn.Parameter(linear.weight.detach()[features].clone())  # (out/N, in)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach()[features].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToParallel.apply(x)  # f: identity; backward sum_r dL_r/dx
        return F.linear(x, self.weight, self.bias)  # x W_r^T + b_r: (..., out/N)


class RowParallelLinear(nn.Module):
    """Some input features of ``linear``: rank r multiplies its slice x_r of the input by the
    columns ``features`` of W (out, in) (default the r-th of N blocks); one all-reduce sums
    the parts, y = sum_r x_r W_r^T + b (g). (..., len(features)) -> (..., out)."""

    def __init__(self, linear: nn.Linear, features: torch.Tensor | None = None) -> None:
        check_parallel_linear(linear, features, dim=1)
        super().__init__()
        features = _my_block(linear.in_features) if features is None else features
        self.weight = nn.Parameter(linear.weight.detach()[:, features].clone())  # (out, in/N)
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())  # (out,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # x_r W_r^T: (..., out), this rank's share
        out = ReduceFromParallel.apply(partial)  # g: sum_r x_r W_r^T = x W^T
        return out if self.bias is None else out + self.bias  # (..., out)


def _my_block(size: int) -> torch.Tensor:
    """Rank r's block of ``size`` features: r size/N .. (r+1) size/N - 1."""
    block = size // dist.get_world_size()
    return torch.arange(dist.get_rank() * block, (dist.get_rank() + 1) * block)  # (size/N,)


class TensorParallelAttention(nn.Module):
    """A :class:`~course_lib.attention.MultiHeadAttention` split by heads: rank r computes
    heads r H/N .. (r+1) H/N - 1. ``qkv_proj`` is column-parallel (their rows of W_q, W_k,
    W_v), ``out_proj`` row-parallel (the columns reading them): heads never mix, so out_proj's
    all-reduce is all the communication. A decoder block's ``self_attn`` without masks,
    ALiBi, cache or dropout. x (B, T, D) -> (out (B, T, D) on every rank, None)."""

    def __init__(self, attention: MultiHeadAttention) -> None:
        check_tensor_parallel(attention, MultiHeadAttention)
        check_divided(n_heads=attention.n_heads, n_kv_heads=attention.n_kv_heads)
        super().__init__()
        rank, d_head = dist.get_rank(), attention.d_head
        self.n_heads = attention.n_heads // dist.get_world_size()  # H/N query heads here
        self.n_kv_heads = attention.n_kv_heads // dist.get_world_size()  # Hkv/N here
        self.q_dim, self.kv_dim = self.n_heads * d_head, self.n_kv_heads * d_head  # per rank
        q = torch.arange(rank * self.q_dim, (rank + 1) * self.q_dim)  # my rows of W_q
        k = attention.d_model + torch.arange(rank * self.kv_dim, (rank + 1) * self.kv_dim)
        v = k + attention.n_kv_heads * d_head  # W_v's rows sit below W_k's
        with inputs_checked():
            # rows [W_q; W_k; W_v] of my heads: (H/N Dh + 2 Hkv/N Dh, D)
            self.qkv_proj = ColumnParallelLinear(attention.qkv_proj, torch.cat([q, k, v]))
            self.out_proj = RowParallelLinear(attention.out_proj, q)  # (D, H/N Dh)
        self.rotary = attention.rotary

    def forward(self, x: torch.Tensor, *, is_causal: bool = False, **unsupported: object
                ) -> tuple[torch.Tensor, None]:
        check_parallel_attention_inputs(x, is_causal, unsupported)
        q, k, v = self.qkv_proj(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        q = split_heads(q, self.n_heads)  # (B, H/N, T, Dh)
        k = split_heads(k, self.n_kv_heads)  # (B, Hkv/N, T, Dh)
        v = split_heads(v, self.n_kv_heads)  # (B, Hkv/N, T, Dh)
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        k = k.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H/N, T, Dh)
        v = v.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)  # (B, H/N, T, Dh)
        # softmax(q k^T / sqrt(Dh)) v, my heads
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)  # (B, H/N, T, Dh)
        return self.out_proj(merge_heads(out)), None  # (B, T, D), summed over the ranks


class TensorParallelFeedForward(nn.Module):
    """A :class:`~course_lib.layers.FeedForward` split along F: fc1 column-parallel (F/N
    hidden units here), fc2 row-parallel (the columns reading them), one all-reduce:
    W2 act(W1 x + b1) + b2 = sum_r W2_r act(W1_r x + b1_r) + b2. (..., D) -> (..., D)."""

    def __init__(self, feed_forward: FeedForward) -> None:
        check_tensor_parallel(feed_forward, FeedForward)
        check_divided(d_ff=feed_forward.fc1.out_features)
        super().__init__()
        with inputs_checked():
            self.fc1 = ColumnParallelLinear(feed_forward.fc1)  # (F/N, D)
            self.fc2 = RowParallelLinear(feed_forward.fc2)  # (D, F/N)
        self.activation = feed_forward.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))  # (..., F/N) -> (..., D)


# ------------------------------------------------------------------------------ argument checks


def check_in_group(**ranks: object) -> None:
    """A running process group (course_lib.course.ranks.run_ranks and torchrun scripts start
    one); ``ranks`` in it."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no process group: run this on ranks started by run_ranks, or call "
                           "torch.distributed.init_process_group first (as under torchrun)")
    for name, rank in ranks.items():
        if not 0 <= require_int(name, rank) < dist.get_world_size():
            raise ValueError(f"{name} must be a rank 0..{dist.get_world_size() - 1}, got {rank}")


def check_shard(batch: object, rank: object, world_size: object) -> None:
    require_ndim("batch", batch, range(1, 9), "(B, ...)")
    if not 0 <= require_int("rank", rank) < require_positive_int("world_size", world_size):
        raise ValueError(f"rank must be 0..{world_size - 1}, got {rank}")
    if batch.shape[0] % world_size:
        raise ValueError(f"batch has shape {shape_of(batch)}: B={batch.shape[0]} is not "
                         f"divisible by world_size={world_size}; give every rank as many")


def check_all_launched(wrapper: OverlappingDataParallel) -> None:
    if waiting := _nbytes(p for b in wrapper.buckets[len(wrapper.launched):] for p in b):
        raise RuntimeError(f"finish() found {waiting} bytes of gradients not yet in: call it "
                           "after loss.backward(), with every parameter in the loss")


def check_sharded_optimizer(params: list, optimizer_class: object) -> None:
    for i, param in enumerate(params):
        require_tensor(f"params[{i}]", param)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class,
                                                             torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class such as "
                        f"torch.optim.AdamW, got {optimizer_class!r}")
    check_in_group()
    if len(dict.fromkeys(params)) < dist.get_world_size():
        raise ValueError(f"params holds {len(dict.fromkeys(params))} tensor(s), fewer than "
                         f"the {dist.get_world_size()} ranks: each rank needs one or more")


def require_units(module: object, units: object, compute_dtype: object) -> list[nn.Module]:
    """The units of a :class:`FullyShardedDataParallel` as a list (default each of
    ``module.blocks``): submodules of ``module``, each listed once, none inside another."""
    require_instance("module", module, nn.Module, "a torch.nn.Module")
    if compute_dtype is not None:
        require_float_dtype("compute_dtype", compute_dtype)
    check_in_group()
    if len(dtypes := {str(p.dtype) for p in module.parameters()}) != 1:
        raise ValueError(f"module must hold weights of one dtype (they are flattened), got "
                         f"{sorted(dtypes)}: convert it, e.g. module.float()")
    if frozen := [n for n, p in module.named_parameters() if not p.requires_grad]:
        raise ValueError(f"module has frozen weights {frozen}: here every weight is trained")
    units = list(require_instance("units", getattr(module, "blocks", []) if units is None
                                  else units, (list, tuple, nn.ModuleList),
                                  "a list of submodules of module, such as module.blocks"))
    for i, unit in enumerate(units):
        if require_instance(f"units[{i}]", unit, nn.Module, "a submodule of module") is module \
                or unit not in set(module.modules()):
            raise ValueError(f"units[{i}] ({type(unit).__name__}) is not a submodule of module:"
                             " a unit is a part of it, such as module.blocks[0]")
        if unit in units[:i]:
            raise ValueError(f"units[{i}] is units[{units.index(unit)}] again: list each once")
        if nested := [j for j, other in enumerate(units) if other in set(unit.modules()) - {unit}]:
            raise ValueError(f"units[{nested[0]}] is inside units[{i}]: units cannot nest")
    return units


def check_parallel_linear(linear: object, features: object, dim: int) -> None:
    """An nn.Linear and the features to keep along W's ``dim``, or a size the ranks divide."""
    if not checks_wanted():
        return
    size = require_instance("linear", linear, nn.Linear, "a torch.nn.Linear").weight.shape[dim]
    check_in_group()
    if features is None:
        check_divided(**{("out_features", "in_features")[dim]: size})
        return
    require_integer_tensor("features", require_ndim("features", features, (1,), "(n,)"))
    if features.numel() == 0 or not 0 <= int(features.min()) <= int(features.max()) < size:
        raise ValueError(f"features must be indices 0..{size - 1}, got {features.tolist()}")


def check_tensor_parallel(module: object, kind: type) -> None:
    """A ``kind`` module without dropout (the ranks' random masks would differ)."""
    require_instance("module", module, kind, f"a course_lib {kind.__name__}")
    check_in_group()
    if isinstance(module.dropout, nn.Dropout) or (isinstance(module.dropout, float)
                                                  and module.dropout > 0):
        raise ValueError("module has dropout; tensor parallelism here runs without it: build "
                         "it with dropout=0.0")


def check_divided(**sizes: int) -> None:
    """Each size must split evenly over the ranks."""
    for name, size in sizes.items():
        if size % dist.get_world_size():
            raise ValueError(f"{name}={size} is not divisible by the world size "
                             f"{dist.get_world_size()}: each rank needs an equal share")


def check_parallel_attention_inputs(x: object, is_causal: object, unsupported: dict) -> None:
    require_ndim("x", x, (3,), "(B, T, D)")
    require_bool("is_causal", is_causal)
    if given := sorted(k for k, v in unsupported.items() if v is not None and v is not False):
        raise ValueError(f"TensorParallelAttention takes x and is_causal only, got {given}")
