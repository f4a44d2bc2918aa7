"""Checks for chapter 14, beyond one device: the model FLOPs utilisation of a stated run (14.1),
a gradient-accumulation step with a planted bug to find (14.2), data parallelism's two
collectives written by hand and run on real ranks (14.3), the memory per GPU of DDP and ZeRO's
three stages, predicted (14.4), an MLP split over ranks as Megatron splits it (14.5), and the
FlashAttention-2 backward of one tile, recomputed from the log-sum-exp (14.6).

The references: PaLM's count of model FLOPs (6N + 12 L T D), one optimizer step on the whole
batch, one process on the whole batch (float64, against 3 gloo ranks started with
:func:`course_lib.course.ranks.run_ranks`), ZeRO's count of 16 bytes per parameter, the full
MLP, and autograd through softmax attention.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import math
import os
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.configs import DecoderConfig
from course_lib.models import DecoderLM
from course_lib.parallel import optimizer_state_bytes, shard_batch

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    prediction_dict,
    require_number,
    require_real,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Exercise 14.1: mfu(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus,
#                    peak_flops)


def model_flops_per_token(n_params: float, n_layers: int, d_model: int, context: int) -> float:
    """PaLM's count of a training step's FLOPs per token (Chowdhery et al., 2022, appendix B):
    6N for the parameters' matrix products (2N forward, 4N backward) plus 12 L T D for each
    layer's two attention products (scores and weighted values), the whole T x T matrix."""
    return 6 * n_params + 12 * n_layers * context * d_model


def reference_mfu(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus,
                  peak_flops) -> float:
    """Model FLOPs per second over the peak FLOP/s of all the GPUs: a fraction."""
    tokens_per_second = batch_size * context / step_seconds
    flops = tokens_per_second * model_flops_per_token(n_params, n_layers, d_model, context)
    return flops / (n_gpus * peak_flops)


def _mfu_with(*, params=6, attention=12, tokens=True, per_second=True, gpus=True, scale=1.0):
    """A wrong MFU: another count of FLOPs per token, or a factor left out."""
    def wrong(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus, peak):
        per_token = params * n_params + attention * n_layers * context * d_model
        rate = batch_size * (context if tokens else 1) / (step_seconds if per_second else 1)
        return scale * rate * per_token / ((n_gpus if gpus else 1) * peak)
    return wrong


MFU_MISTAKES = [
    (_mfu_with(scale=100), "Your MFU is a percentage: return the fraction (0.42, not 42)"),
    (_mfu_with(params=2, attention=4),
     "Your FLOPs per token count the forward pass only (2N + 4LTD): training also runs the "
     "backward pass, which costs about twice the forward, hence 6N + 12LTD"),
    (_mfu_with(params=2, attention=12),
     "Your FLOPs per token count the parameters' forward pass only (2N): a training step runs "
     "forward and backward, 6N"),
    (_mfu_with(attention=0),
     "Your FLOPs per token leave out attention (12·L·T·D): the products q kᵀ and weights·v "
     "have no parameters, so 6N does not count them, and at long contexts they dominate"),
    (_mfu_with(attention=6),
     "Your attention term is 6·L·T·D, half of the chapter's 12·L·T·D: this count takes every "
     "query against all T positions (no saving for the causal mask), as PaLM does"),
    (_mfu_with(attention=4),
     "Your attention term is 4·L·T·D, the forward pass only: times 3 for forward and backward"),
    (_mfu_with(tokens=False),
     "Your throughput counts sequences, not tokens: each of the batch_size sequences holds "
     "context tokens"),
    (_mfu_with(per_second=False),
     "Your throughput is tokens per step, not per second: divide by step_seconds"),
    (_mfu_with(gpus=False),
     "Your MFU compares the run with ONE GPU's peak: the run has n_gpus GPUs, and the "
     "peak of the cluster is n_gpus × peak_flops"),
]

MFU_CASES = (  # name, (n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus,
    #                 peak_flops)
    ("a 124M model on 8 GPUs of 312 TFLOP/s", (124e6, 12, 768, 1024, 480, 0.5, 8, 312e12)),
    ("a 6.7B model on 64 GPUs of 989 TFLOP/s", (6.7e9, 32, 4096, 4096, 256, 2.0, 64, 989e12)),
    ("a 1.3B model at context 32,768 on 16 GPUs",
     (1.3e9, 24, 2048, 32768, 16, 6.0, 16, 312e12)),
    ("a 1M-parameter model on one device of 100 GFLOP/s", (1e6, 4, 128, 64, 12, 0.2, 1, 1e11)),
)


def check_mfu(mfu_fn: Callable) -> None:
    """Check ``mfu(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus,
    peak_flops)`` -> float, the model FLOPs utilisation as a fraction, with 6N + 12 L T D model
    FLOPs per token; then show how attention's share of the FLOPs grows with the context.

    Args:
        mfu_fn: the learner's function.
    """
    for name, args in MFU_CASES:
        case = Case(name, args)
        got = require_real(call_learner(mfu_fn, case, fn_name="mfu"), "mfu's result", case)
        expected = reference_mfu(*args)
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        for wrong, message in MFU_MISTAKES:
            value = wrong(*args)
            if math.isclose(got, value, rel_tol=1e-6) and not math.isclose(value, expected,
                                                                           rel_tol=1e-6):
                raise CheckFailure(f"{message} (seen on the case '{name}')")
        raise CheckFailure(f"Your MFU is {got:.4g} but should be {expected:.4g} (case "
                           f"'{name}'): tokens per second × (6N + 12·L·T·D), over n_gpus × "
                           "peak_flops")
    n_params, n_layers, d_model = 6.7e9, 32, 4096
    shares = []
    for context in (2048, 8192, 32768, 131072):
        attention = 12 * n_layers * context * d_model
        total = model_flops_per_token(n_params, n_layers, d_model, context)
        shares.append(f"T = {context:,}: {attention / total:.0%}")
    print(f"\u2705 mfu is correct on all {len(MFU_CASES)} runs ("
          + "; ".join(name for name, _ in MFU_CASES) + "): MFU "
          + ", ".join(f"{reference_mfu(*args):.1%}" for _, args in MFU_CASES)
          + ".\n   Attention's share of the FLOPs of a 6.7B model (L = 32, D = 4,096) grows "
            "with the context: " + ", ".join(shares))


# --------------------------------------------------------------------------------------------
# Exercise 14.2: find the bug in a gradient-accumulation step

ACCUM_VOCAB, ACCUM_DIM, ACCUM_LENGTH, ACCUM_BATCH = 13, 8, 6, 8
IGNORE = -100  # F.cross_entropy's ignore_index: a padded position's target
ACCUM_LR = 0.5


def accumulation_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The exercise's language model (an embedding and a linear layer to vocabulary logits,
    float64, the same weights for the same seed) and plain SGD over it. Building it leaves
    the global random state as it was. ``model(ids)``: (B, T) -> (B, T, V) logits."""
    with torch.random.fork_rng(devices=[]):
        model = nn.Sequential(nn.Embedding(ACCUM_VOCAB, ACCUM_DIM),
                              nn.Linear(ACCUM_DIM, ACCUM_VOCAB)).double()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model, torch.optim.SGD(model.parameters(), lr=ACCUM_LR)


def _padded_batch(generator: torch.Generator, batch: int, lengths: Sequence[int] | None):
    """(inputs, targets), each (batch, ACCUM_LENGTH): sequence i holds lengths[i] real tokens
    (all of them when ``lengths`` is None); the rest is padding, id 0 and target -100."""
    ids = torch.randint(1, ACCUM_VOCAB, (batch, ACCUM_LENGTH + 1), generator=generator)
    inputs, targets = ids[:, :-1].clone(), ids[:, 1:].clone()
    for i, length in enumerate(lengths or ()):
        inputs[i, length:], targets[i, length:] = 0, IGNORE
    return inputs, targets


def accumulation_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Twelve batches of 8 sequences of 6 positions, (inputs, targets): four unpadded, eight
    padded with random lengths from 1 to 6. Targets of -100 are padding."""
    generator = torch.Generator().manual_seed(142)
    batches = []
    for i in range(12):
        lengths = None if i % 3 == 0 else torch.randint(
            1, ACCUM_LENGTH + 1, (ACCUM_BATCH,), generator=generator).tolist()
        batches.append(_padded_batch(generator, ACCUM_BATCH, lengths))
    return batches


def whole_batch_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                     targets: torch.Tensor) -> None:
    """One optimizer step on the whole batch: the loss is the mean over its real tokens."""
    optimizer.zero_grad()
    logits = model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    loss.backward()
    optimizer.step()


def buggy_accumulated_step(model, optimizer, inputs, targets, k):
    # One optimizer step on the whole batch (inputs, targets), computed in k micro-batches of
    # B/k sequences: backward adds each micro-batch's gradient into .grad. One bug.
    optimizer.zero_grad()
    for x, y in zip(inputs.chunk(k), targets.chunk(k)):  # noqa: B905 - as the notebook shows it
        logits = model(x)  # (B/k, T, V)
        # the mean over this micro-batch's real tokens (targets of -100 are skipped)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        (loss / k).backward()  # k micro-batches: each adds 1/k of its gradient
    optimizer.step()


def _accumulate(model, optimizer, inputs, targets, k, *, weight, zero_inside=False,
                step_inside=False):
    """An accumulation step whose micro-batch loss is weight(sum, mean, x, y) (with the token
    losses' sum and mean), optionally zeroing or stepping inside the loop."""
    optimizer.zero_grad()
    for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True):
        token_losses = F.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                       ignore_index=IGNORE, reduction="none")
        real = (y != IGNORE).sum()
        if zero_inside:
            optimizer.zero_grad()
        weight(token_losses.sum(), token_losses.sum() / real, x, y).backward()
        if step_inside:
            optimizer.step()
    if not step_inside:
        optimizer.step()


def _accumulation_variant(weight, **options) -> Callable:
    def step(model, optimizer, inputs, targets, k):
        n_real = (targets != IGNORE).sum()
        _accumulate(model, optimizer, inputs, targets, k, **options,
                    weight=lambda total, mean, x, y: weight(total, mean, x, y, k, n_real,
                                                            inputs))
    return step


PLANTED_ACCUMULATION = (
    "The planted bug is still there: each micro-batch's MEAN loss, divided by k, gives every "
    "real token the weight 1 / (k × the real tokens of its micro-batch), so the tokens of "
    "short micro-batches count more than in the whole batch's mean, where each weighs "
    "1 / (the batch's real tokens). Without padding every micro-batch holds as many real "
    "tokens and the two agree, which is why it hid. The instrument that finds it: the weights "
    "after one accumulated step compared with one whole-batch step (torch.allclose), on "
    "padded batches")

ACCUMULATION_MISTAKES = [
    (buggy_accumulated_step, PLANTED_ACCUMULATION),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: mean),
     "Your step adds the micro-batches' mean losses without dividing: a gradient about k "
     "times the whole batch's (the sum of k means is not a mean)"),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: total),
     "Your step sums the token losses (reduction='sum') but never divides: divide each "
     "micro-batch's sum by the real tokens of the WHOLE batch"),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: total / inputs.numel()),
     "Your step divides by every position of the batch, padding included: the whole batch's "
     "mean counts its real tokens only, (targets != -100).sum()"),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: total / (y != IGNORE).sum()
                           / k), PLANTED_ACCUMULATION),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: total / n, zero_inside=True),
     "Your step zeroes the gradients inside the loop, so only the last micro-batch's "
     "gradient is left when the optimizer steps: zero once, before the loop"),
    (_accumulation_variant(lambda total, mean, x, y, k, n, inputs: total / n, step_inside=True),
     "Your step calls optimizer.step() inside the loop: that is k small steps, each from a "
     "partial gradient; step once, after the last micro-batch"),
]


def _accumulation_cases() -> list[Case]:
    """(inputs, targets, k): padded and unpadded batches, k from 1 to B; the last case has a
    micro-batch with no real token."""
    generator = torch.Generator().manual_seed(1421)
    full, padded = None, [1, 6, 2, 5, 6, 3, 4, 6]
    cases = [Case("no padding, B=8, k=4", (*_padded_batch(generator, 8, full), 4)),
             Case("padding (1 to 6 real tokens a sequence), B=8, k=4",
                  (*_padded_batch(generator, 8, padded), 4)),
             Case("padding, B=8, k=2", (*_padded_batch(generator, 8, [6, 1, 1, 2, 6, 6, 5, 3]),
                                        2)),
             Case("padding, B=6, k=3", (*_padded_batch(generator, 6, [2, 6, 4, 1, 5, 5]), 3)),
             Case("padding, k=1: the whole batch at once", (*_padded_batch(generator, 8, padded),
                                                           1)),
             Case("padding, B=8, k=8: one sequence a micro-batch",
                  (*_padded_batch(generator, 8, [3, 6, 1, 4, 2, 6, 5, 1]), 8)),
             Case("k=4 with a micro-batch of padding only (two empty sequences)",
                  (*_padded_batch(generator, 8, [5, 6, 0, 0, 2, 6, 1, 4]), 4))]
    return cases


def _weights_after(step_fn: Callable, case: Case, fn_name: str | None = None):
    """Flat weights after step_fn(model, optimizer, *case.args) from the exercise's start, and
    the largest batch the model saw."""
    model, optimizer = accumulation_model()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))

    def on_fresh_model(inputs, targets, k):  # the learner's step, on this start
        return step_fn(model, optimizer, inputs, targets, k)
    if fn_name is None:
        on_fresh_model(*case.args)
    else:
        call_learner(on_fresh_model, case, fn_name=fn_name)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), max(seen, default=0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-9, atol=1e-12))


def check_accumulated_step(accumulated_step_fn: Callable) -> None:
    """Check ``accumulated_step(model, optimizer, inputs, targets, k)``: one optimizer step
    equal to :func:`whole_batch_step`, computed in k micro-batches of B/k sequences (the model
    never sees more at once), on padded and unpadded batches.

    Args:
        accumulated_step_fn: the learner's fixed step.
    """
    cases = _accumulation_cases()
    start, _ = _weights_after(lambda *args: None, cases[0])
    for case in cases:
        inputs, targets, k = case.args
        got, largest = _weights_after(accumulated_step_fn, case, "accumulated_step")
        expected, _ = _weights_after(lambda m, o, x, y, k: whole_batch_step(m, o, x, y), case)
        if largest > len(inputs) // k:
            raise CheckFailure(f"Your step ran the model on {largest} sequences at once (case "
                               f"'{case.name}'), more than a micro-batch's B/k = "
                               f"{len(inputs) // k}: accumulation exists so that only one "
                               "micro-batch's activations are in memory at a time")
        if _same(got, expected):
            continue
        if _same(got, start):
            raise CheckFailure(f"The weights did not change (case '{case.name}'): call "
                               "optimizer.step() once, after the last micro-batch")
        if not torch.isfinite(got).all():
            raise CheckFailure(
                f"Your step makes the weights NaN on the case '{case.name}', where a "
                "micro-batch holds no real token: dividing by that micro-batch's count of real "
                "tokens gives 0 / 0 = NaN, and no later factor (not even × 0) removes it. Sum "
                "the token losses and divide by the real tokens of the whole batch")
        for wrong_fn, message in ACCUMULATION_MISTAKES:
            wrong, _ = _weights_after(wrong_fn, case)
            if _same(got, wrong) and not _same(wrong, expected):
                raise CheckFailure(f"{message} (seen on the case '{case.name}')")
        raise CheckFailure(f"After your step the weights differ from one step on the whole "
                           f"batch (case '{case.name}'), by up to "
                           f"{float((got - expected).abs().max()):.3g}")
    print(f"\u2705 accumulated_step takes exactly the whole batch's step on all {len(cases)} "
          "cases (" + "; ".join(c.name for c in cases) + "), one micro-batch at a time")


# --------------------------------------------------------------------------------------------
# Exercise 14.3: sync_initial_weights(model) and average_gradients(model), on real ranks

DP_WORLD, DP_BATCH, DP_LENGTH, DP_STEPS, DP_LR = 3, 6, 8, 2, 0.5
DP_CONFIG = DecoderConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_len=DP_LENGTH,
                          tie_embeddings=True)
DP_TIMEOUT_S = 60.0
TIED = "embeddings.token.weight"  # also lm_head.weight: one tensor used twice
LEARNER_HEADER = ("# Exercise 14.3's functions, as the check runs them on every rank\n"
                  "import math\n\nimport torch\nimport torch.distributed as dist\n"
                  "from torch import nn\n\n\n")


def _dp_model(seed: int) -> DecoderLM:
    """The exercise's model in float64: seed r gives rank r's own random start."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DecoderLM(DP_CONFIG).double()


def _dp_batches() -> torch.Tensor:
    """DP_STEPS batches of DP_BATCH sequences of DP_LENGTH + 1 tokens (inputs and targets)."""
    generator = torch.Generator().manual_seed(143)
    return torch.randint(0, DP_CONFIG.vocab_size, (DP_STEPS, DP_BATCH, DP_LENGTH + 1),
                         generator=generator)


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.detach().clone()
            for name, p in model.named_parameters()}


def _train(model: nn.Module, average: Callable, rank: int, world_size: int) -> dict:
    """DP_STEPS SGD steps, each rank on its shard of every batch; ``average`` after backward.
    Records the first step's gradients and weights before and after ``average``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=DP_LR)
    record = {}
    for step, ids in enumerate(_dp_batches()):
        mine = shard_batch(ids, rank, world_size)  # (B/N, T + 1)
        loss = model(mine[:, :-1], targets=mine[:, 1:]).loss
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            record |= {"local": _grads(model), "before": _params(model)}
        average(model)
        if step == 0:
            record |= {"averaged": _grads(model), "after": _params(model)}
        optimizer.step()
    return record | {"final": _params(model)}


def data_parallel_reference() -> dict:
    """One process, rank 0's start, the whole batches: its start, first gradients and final
    weights."""
    model = _dp_model(seed=0)
    start = _params(model)
    record = _train(model, lambda m: None, 0, 1)
    return {"start": start, "grads": record["local"], "final": record["final"]}


def _load_learner(path: str, index: int):
    spec = importlib.util.spec_from_file_location(f"_exercise_14_3_{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_error(error: BaseException, path: str) -> dict:
    """What a learner's exception on a rank says: its type, text, and the learner's line."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == path]
    return {"type": type(error).__name__, "message": str(error),
            "function": frames[-1].name if frames else None,
            "line": frames[-1].line if frames else None}


def data_parallel_rank(paths: Sequence[str], names: Sequence[tuple[str, str]]) -> list[dict]:
    """One rank of the check (run by run_ranks): for each file of learner functions, start
    from this rank's own random weights, sync them, train DP_STEPS steps on this rank's shard
    averaging with the learner's functions; what happened, or the learner's error."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    records = []
    for index, (path, (sync_name, average_name)) in enumerate(zip(paths, names, strict=True)):
        dist.barrier()  # every rank starts each variant together
        try:
            module = _load_learner(path, index)
            model = _dp_model(seed=rank)
            own = _params(model)
            getattr(module, sync_name)(model)
            record = {"own": own, "synced": _params(model)}
            record |= _train(model, getattr(module, average_name), rank, world_size)
        except Exception as error:  # the learner's: reported, never raised on the rank
            record = {"error": _rank_error(error, path)}
        records.append(record)
    return records


def _source_of(fn: Callable, what: str) -> str:
    """A learner's function as source code, or a message saying why it cannot travel."""
    if not callable(fn):
        raise CheckFailure(f"{what} should be a function, got {describe(fn)}")
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        source = ""
    if not source.lstrip().startswith(("def ", "async def ", "@")):  # decorators are fine
        raise CheckFailure(f"The check could not read {what}'s source: define it with def "
                           "in a notebook cell (not as a lambda, not through another function)")
    return source


def _raise_if_unsolved(*fns: Callable) -> None:
    """Let an unsolved stub fail as itself, here, before any process starts: each function is
    called on an empty model (no parameters; outside a process group, anything else fails
    and is ignored)."""
    for fn in fns:
        try:
            fn(nn.Module())
        except NotImplementedError:
            raise
        except Exception:  # noqa: S110 - a solved function: it needs the ranks
            pass


def run_data_parallel(variants: Sequence[tuple[str, str, str, str]],
                      timeout_s: float = DP_TIMEOUT_S) -> list[list[dict]]:
    """Run each (sync name, sync source, average name, average source) on DP_WORLD ranks, all
    in one start of the processes; for each variant, the ranks' records."""
    from course_lib.course.ranks import run_ranks  # starts processes: only when needed

    with tempfile.TemporaryDirectory(prefix="course_lib_ch14_") as folder:
        paths, names = [], []
        for index, (sync_name, sync_source, average_name, average_source) in enumerate(variants):
            path = os.path.join(folder, f"exercise_14_3_{index}.py")
            with open(path, "w", encoding="utf-8") as file:
                file.write(LEARNER_HEADER + sync_source + "\n\n" + average_source + "\n")
            paths.append(path)
            names.append((sync_name, average_name))
        try:
            per_rank = run_ranks(data_parallel_rank, DP_WORLD, paths, names,
                                 timeout_s=timeout_s)
        except TimeoutError:
            raise CheckFailure(
                f"The {DP_WORLD} ranks were still waiting for each other after {timeout_s:.0f} "
                "s: every rank must call the same collectives, in the same order, on tensors "
                "of the same shapes (is a call inside an `if rank == 0`, or in a loop whose "
                "length differs between ranks?)") from None
    return [list(records) for records in zip(*per_rank, strict=True)]


def check_data_parallel(sync_initial_weights_fn: Callable, average_gradients_fn: Callable
                        ) -> None:
    """Check ``sync_initial_weights(model)`` (every rank's parameters become rank 0's) and
    ``average_gradients(model)`` (every .grad becomes its mean over the ranks) on 3 real gloo
    ranks, each training a tied-weight decoder on its third of every batch: the ranks' weights
    after 2 SGD steps must equal one process on the whole batch (float64).

    Args:
        sync_initial_weights_fn: the learner's broadcast of rank 0's weights.
        average_gradients_fn: the learner's all-reduce of the gradients.
    """
    sources = (_source_of(sync_initial_weights_fn, "sync_initial_weights"),
               _source_of(average_gradients_fn, "average_gradients"))
    _raise_if_unsolved(sync_initial_weights_fn, average_gradients_fn)
    variant = (sync_initial_weights_fn.__name__, sources[0], average_gradients_fn.__name__,
               sources[1])
    records = run_data_parallel([variant])[0]
    judge_data_parallel(records, data_parallel_reference())
    print(f"\u2705 On {DP_WORLD} gloo ranks, each with its third of every batch: after "
          "sync_initial_weights every rank holds rank 0's weights, after average_gradients "
          "every rank holds the whole batch's gradient (the tied embedding's too), and after "
          f"{DP_STEPS} SGD steps every rank's weights equal one process trained on the whole "
          "batch (float64, to within 1e-12)")


def _listed(names: Sequence[str], limit: int = 3) -> str:
    """A few names, and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _differing(got: Mapping[str, Any], expected: Mapping[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ (a missing gradient differs from everything)."""
    return [name for name, value in expected.items()
            if not isinstance(got.get(name), torch.Tensor) or not _same(got[name], value)]


def _raise_rank_error(error: Mapping[str, Any]) -> None:
    kind, message, function = error["type"], error["message"], error["function"]
    if kind == "NotImplementedError":
        raise NotImplementedError(message)  # an unsolved exercise fails as itself
    where = f"\n    in {function}: {error['line']}" if error["line"] else ""
    if function is None:
        raise CheckFailure(f"Training on the ranks failed after your functions ran: {kind}: "
                           f"{message} (did they leave every .grad a tensor of its parameter's "
                           "shape?)")
    if kind == "NameError":
        raise CheckFailure(f"{function} uses a name the ranks do not have ({message}){where}\n"
                           "The check runs your two functions' own source on each rank, with "
                           "math, torch, torch.distributed as dist and nn imported: define or "
                           "import what they need inside them")
    if "AVG" in message:
        raise CheckFailure(f"{function} asked gloo for ReduceOp.AVG, which this PyTorch's "
                           f"gloo does not have ({message}){where}\nSum with all_reduce (its "
                           "default), then divide by dist.get_world_size()")
    raise CheckFailure(f"{function} raised {kind} on the ranks: {message}{where}")


def _judge_sync(records: Sequence[dict], start: Mapping[str, torch.Tensor]) -> None:
    """Every rank must hold rank 0's start after sync_initial_weights."""
    for rank, record in enumerate(records):
        wrong = _differing(record["synced"], start)
        if not wrong:
            continue
        synced, owns = record["synced"], [r["own"] for r in records]
        if all(not _differing(r["synced"], synced) for r in records):  # they agree, wrongly
            mean = {name: sum(own[name] for own in owns) / len(owns) for name in start}
            if not _differing(synced, mean):
                raise CheckFailure("After sync_initial_weights the ranks agree on the AVERAGE "
                                   "of their random starts: copy rank 0's weights to every "
                                   "rank (dist.broadcast(p, src=0)) instead of averaging them")
            for source, own in enumerate(owns):
                if not _differing(synced, own):
                    raise CheckFailure(
                        f"After sync_initial_weights every rank holds rank {source}'s starting "
                        "weights: broadcast from rank 0 (src=0), whose start the one-process "
                        "run shares")
        if not _differing(synced, record["own"]):
            raise CheckFailure(
                f"sync_initial_weights left rank {rank}'s weights as they were: broadcast every "
                "parameter from rank 0, in place, into each rank's model (dist.broadcast "
                "writes into the tensor it is given, so give it the parameter, not a copy)")
        raise CheckFailure(f"After sync_initial_weights, rank {rank}'s {_listed(wrong)} "
                           "differ from rank 0's: broadcast every parameter of the model "
                           "(model.parameters())")


def _gradient_forms(expected: torch.Tensor, local: torch.Tensor, world: int) -> dict[str, Any]:
    """What a parameter's gradient looks like after average_gradients, right or wrong."""
    return {"right": expected, "local": local, "summed": expected * world,
            "divided twice": expected / world, "no all_reduce": local / world,
            "divided by 2": expected * world / 2 if world != 2 else None}


GRADIENT_MISTAKES = {
    "local": "After average_gradients every rank still holds the gradient of its own shard: "
             "all_reduce each p.grad in place (the gradient itself, not a copy of it, not p), "
             "then divide",
    "summed": "Your gradients are the SUM over the {world} ranks, {world} times the whole "
              "batch's: divide by dist.get_world_size() after the all_reduce (each rank's loss "
              "is already a mean over its shard)",
    "divided twice": "Your gradients are the mean divided by {world} once more: divide once, "
                     "after the all_reduce (or before it, not both)",
    "no all_reduce": "Your gradients are each rank's own gradient divided by {world}: the "
                     "all_reduce that adds them up is missing, or its result never reached "
                     "p.grad",
    "divided by 2": "Your gradients are the sum over the ranks divided by 2, but this run has "
                    "{world} ranks: divide by dist.get_world_size(), not a fixed number",
}


def _classify(record: dict, expected: Mapping[str, torch.Tensor], world: int) -> dict[str, str]:
    """For each parameter, which form its averaged gradient has ('unknown' if none)."""
    kinds = {}
    for name, grad in expected.items():
        got = record["averaged"][name]
        forms = _gradient_forms(grad, record["local"][name], world)
        kinds[name] = "missing" if got is None else next(
            (kind for kind, form in forms.items() if form is not None and _same(got, form)),
            "unknown")
    return kinds


def _judge_gradients(records: Sequence[dict], expected: Mapping[str, torch.Tensor]) -> None:
    """Every rank's first gradients, after average_gradients, must be the whole batch's."""
    world = len(records)
    for rank, record in enumerate(records):
        if moved := _differing(record["after"], record["before"]):
            raise CheckFailure(f"average_gradients changed the parameters themselves (rank "
                               f"{rank}: {_listed(moved)}): average p.grad and leave p "
                               "to the optimizer")
    kinds = [_classify(record, expected, world) for record in records]
    if all(kind == "right" for k in kinds for kind in k.values()):
        return
    if all(kind == "right" for kind in kinds[0].values()):
        rank = next(r for r, k in enumerate(kinds) if any(v != "right" for v in k.values()))
        raise CheckFailure(f"Rank 0 holds the whole batch's gradient but rank {rank} does not: "
                           "every rank steps its own copy of the model, so every rank needs "
                           "the mean (dist.reduce sends the sum to one rank, dist.all_reduce "
                           "to every rank)")
    for rank, k in enumerate(kinds):
        if missing := [name for name, kind in k.items() if kind == "missing"]:
            raise CheckFailure(f"After average_gradients rank {rank} has no gradient for "
                               f"{_listed(missing)}: keep .grad a tensor")
        wrong = {kind for kind in k.values() if kind != "right"}
        if len(wrong) == 1 and "right" not in k.values() and "unknown" not in wrong:
            raise CheckFailure(GRADIENT_MISTAKES[wrong.pop()].format(world=world))
        skipped = [name for name, kind in k.items() if kind == "local"]
        if skipped and all(kind in ("right", "local") for kind in k.values()):
            tied = (f" {TIED} is the token embedding and also the output layer's weight (tied): "
                    "one tensor whose .grad holds both uses, which model.parameters() yields "
                    "once" if TIED in skipped else "")
            raise CheckFailure(f"The gradients of {_listed(skipped, 8)} were not averaged (the "
                               "others were): average every parameter, looping over "
                               f"model.parameters().{tied}")
    rank, name = next((r, n) for r, k in enumerate(kinds) for n, kind in k.items()
                      if kind != "right")
    got = records[rank]["averaged"][name]
    raise CheckFailure(f"After average_gradients, rank {rank}'s gradient of {name} is not the "
                       "mean over the ranks of their gradients: it differs from the whole "
                       f"batch's gradient by up to {float((got - expected[name]).abs().max()):.3g}")


def judge_data_parallel(records: Sequence[dict], reference: Mapping[str, Any]) -> None:
    """Fail with the likely mistake unless the ranks' records match one process."""
    errors = [record["error"] for record in records if "error" in record]
    if errors:
        _raise_rank_error(errors[0])
    _judge_sync(records, reference["start"])
    _judge_gradients(records, reference["grads"])
    for rank, record in enumerate(records):
        if wrong := _differing(record["final"], reference["final"]):
            raise CheckFailure(f"The first step was right, but after {DP_STEPS} steps rank "
                               f"{rank}'s {_listed(wrong)} differ from one process on the "
                               "whole batch: does average_gradients behave the same at every "
                               "call?")


# --------------------------------------------------------------------------------------------
# Exercise 14.4: memory per GPU with DDP and ZeRO's three stages, predicted

ZERO_PARAMS, ZERO_GPUS = 7e9, 8
ZERO_KEYS = ("ddp", "zero1", "zero2", "zero3")
ZERO_TOLERANCE = 0.02  # a prediction within 2%: rounded figures pass


def zero_bytes_per_gpu(n_params: float, n_gpus: int, *, weights: float = 2, grads: float = 2,
                       states: float = 12) -> dict[str, float]:
    """Bytes of model states per GPU: stage 1 shards the optimizer states, stage 2 the
    gradients too, stage 3 the weights too (Rajbhandari et al., 2020)."""
    w, g, s = weights * n_params, grads * n_params, states * n_params
    return {"ddp": w + g + s, "zero1": w + g + s / n_gpus, "zero2": w + (g + s) / n_gpus,
            "zero3": (w + g + s) / n_gpus}


def _zero_table(**change) -> Callable[[], dict[str, float]]:
    return lambda: zero_bytes_per_gpu(ZERO_PARAMS, ZERO_GPUS, **change)


def _sharding(*sharded: str) -> float:
    """Bytes per GPU when the parts ``sharded`` (of 'w', 'g', 's') are split over the GPUs."""
    parts = {"w": 2 * ZERO_PARAMS, "g": 2 * ZERO_PARAMS, "s": 12 * ZERO_PARAMS}
    return sum(v / ZERO_GPUS if name in sharded else v for name, v in parts.items())


ZERO_MISTAKES = [  # whole tables
    (_zero_table(states=8),
     "Your figures count 8 bytes of optimizer state per parameter, AdamW's m and v: mixed "
     "precision also keeps an fp32 master copy of every weight (4 bytes more, 12 in all), "
     "because the bf16 weights cannot absorb small updates"),
    (_zero_table(weights=4, grads=4, states=8),
     "Your figures are those of fp32 training (4-byte weights and gradients, 8 bytes of "
     "moments): the same 16 bytes per parameter, but here the weights and gradients are bf16 "
     "(2 + 2 bytes) and the optimizer state is 12 bytes, so the stages save different amounts"),
    (lambda: {key: 16 * ZERO_PARAMS / ZERO_GPUS for key in ZERO_KEYS},
     "You divided everything by the 8 GPUs: plain DDP keeps a full copy of every model state "
     "on every GPU; each ZeRO stage shards one part more"),
]

CUMULATIVE = ("the stages are cumulative: stage 1 shards the optimizer state, stage 2 the "
              "optimizer state and the gradients, stage 3 those and the weights")
ZERO_STAGE_MISTAKES = {  # one stage's figure
    "ddp": [(_sharding("s"), "Your DDP figure shards the optimizer state: plain data "
                             "parallelism keeps a full copy of everything on every GPU")],
    "zero1": [(_sharding("w", "s"), "Your ZeRO-1 shards more than the optimizer state (the "
                                    "weights or the gradients too): stage 1 shards only the "
                                    "optimizer state (master copy, m and v); every GPU still "
                                    "holds the full bf16 weights and gradients"),
              (_sharding(), "Your ZeRO-1 shards nothing: stage 1 splits the optimizer state "
                            "(12 of the 16 bytes) over the GPUs"),
              (_sharding("g"), "Your ZeRO-1 shards the gradients (or the weights) instead of "
                               f"the optimizer state: {CUMULATIVE}")],
    "zero2": [(_sharding("s"), "Your ZeRO-2 is ZeRO-1's figure: stage 2 also shards the "
                               "gradients"),
              (_sharding("w", "g", "s"), "Your ZeRO-2 shards the weights too: that is stage 3"),
              (_sharding("g"), f"Your ZeRO-2 shards only the gradients: {CUMULATIVE}")],
    "zero3": [(_sharding("g", "s"), "Your ZeRO-3 is ZeRO-2's figure: stage 3 also shards the "
                                    "weights"),
              (_sharding("w"), f"Your ZeRO-3 shards only the weights: {CUMULATIVE}")],
}


def _zero_diagnosis(got: Mapping[str, float], expected: Mapping[str, float]) -> str:
    """The likely mistake behind a wrong table of predictions."""
    def close(a, b):
        return abs(a - b) <= ZERO_TOLERANCE * abs(b)
    for table, message in ZERO_MISTAKES:
        wrong = table()
        if all(close(got[k], wrong[k]) for k in ZERO_KEYS):
            return message
    key = next(k for k in ZERO_KEYS if not close(got[k], expected[k]))
    for value, message in ZERO_STAGE_MISTAKES[key]:
        if close(got[key], value):
            return message
    for unit, name in ((1e9, "GB"), (2**30, "GiB")):
        if close(got[key] * unit, expected[key]):
            return f"Your '{key}' is in {name}: give bytes (7e9 * 16 is a fine way to write one)"
    return (f"Your '{key}' is {got[key]:.4g} bytes, which is not right: count what one GPU "
            "holds, 2 + 2 + 12 bytes per parameter, and divide by 8 only the parts that "
            "stage shards")


def measured_bytes_per_parameter() -> dict[str, float]:
    """Mixed-precision AdamW's model states, measured on a small MLP: bf16 weights and
    gradients, an fp32 master copy stepped by AdamW (its m and v); bytes per parameter. The
    global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).bfloat16()
    master = [p.detach().float().clone() for p in model.parameters()]  # fp32 copies
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    model(x).float().square().mean().backward()
    for copy_, param in zip(master, model.parameters(), strict=True):
        copy_.grad = param.grad.float()  # the fp32 gradient lives only during the update
    optimizer = torch.optim.AdamW(master)
    optimizer.step()
    n = sum(p.numel() for p in model.parameters())
    moments = sum(t.nbytes for state in optimizer.state.values()
                  for key, t in state.items() if key in ("exp_avg", "exp_avg_sq"))
    return {"parameters": n,
            "weights (bf16)": sum(p.nbytes for p in model.parameters()) / n,
            "gradients (bf16)": sum(p.grad.nbytes for p in model.parameters()) / n,
            "master weights (fp32)": sum(p.nbytes for p in master) / n,
            "AdamW's m and v (fp32)": moments / n,
            "step counts (bytes in all)": optimizer_state_bytes(optimizer) - moments}


def check_memory_prediction(memory_prediction_fn: Callable) -> None:
    """Check ``memory_prediction()`` -> {"ddp", "zero1", "zero2", "zero3"}: bytes of model
    states per GPU for a 7e9-parameter model on 8 GPUs with mixed-precision AdamW (2 + 2 + 12
    bytes per parameter), within 2%; then show the bytes measured on a small model and the
    table for 7B and 70B.

    Args:
        memory_prediction_fn: the learner's function (no arguments).
    """
    got = prediction_dict(call_learner(memory_prediction_fn, Case("7B on 8 GPUs")), ZERO_KEYS,
                          "memory_prediction")
    values = {key: require_number(got[key], f"'{key}'") for key in ZERO_KEYS}
    expected = zero_bytes_per_gpu(ZERO_PARAMS, ZERO_GPUS)
    if any(abs(values[k] - expected[k]) > ZERO_TOLERANCE * expected[k] for k in ZERO_KEYS):
        raise CheckFailure(_zero_diagnosis(values, expected))
    measured = measured_bytes_per_parameter()
    parts = [f"{name} {value:.2f}" for name, value in list(measured.items())[1:5]]
    print(f"\u2705 All four predictions are within 2%. Measured on a small MLP "
          f"({measured['parameters']:,} parameters), bytes per parameter: " + ", ".join(parts)
          + f" = {sum(list(measured.values())[1:5]):.2f} (plus {measured['step counts (bytes in all)']:.0f} "  # noqa: E501
          "bytes of AdamW step counts in all).\n   Model states per GPU in GB (1e9 bytes), "
          "before activations (an 80 GB GPU holds at most 80):")
    for n_params, label in ((7e9, "7B "), (70e9, "70B")):
        table = zero_bytes_per_gpu(n_params, ZERO_GPUS)
        print(f"   {label} on 8 GPUs: " + ", ".join(
            f"{key} {table[key] / 1e9:7.2f}" for key in ZERO_KEYS))
    print(f"   70B at ZeRO-3 needs at least {math.ceil(16 * 70e9 / 80e9)} GPUs of 80 GB for its "
          "model states alone")


# --------------------------------------------------------------------------------------------
# Exercise 14.5: shard_mlp(fc1, fc2, rank, world_size) -> (w1, b1, w2, b2), Megatron's split


def _linear(generator: torch.Generator, d_in: int, d_out: int) -> nn.Linear:
    """An nn.Linear (float64) with weights drawn from ``generator``, not the global RNG."""
    with torch.random.fork_rng(devices=[]):
        linear = nn.Linear(d_in, d_out, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(d_out, d_in, generator=generator, dtype=torch.float64))
        linear.bias.copy_(torch.randn(d_out, generator=generator, dtype=torch.float64))
    return linear


def _mlp_cases() -> list[Case]:
    """(fc1, fc2, world_size, x): D, F and N of several sizes."""
    generator = torch.Generator().manual_seed(145)
    cases = []
    for d_model, d_ff, world in ((8, 32, 2), (8, 32, 4), (6, 12, 3), (4, 8, 1), (8, 16, 8)):
        fc1, fc2 = _linear(generator, d_model, d_ff), _linear(generator, d_ff, d_model)
        x = torch.randn(2, 5, d_model, generator=generator, dtype=torch.float64)
        cases.append(Case(f"D={d_model}, F={d_ff}, N={world}", (fc1, fc2, world, x)))
    return cases


def _mlp_pieces(shard_fn: Callable, case: Case) -> list[tuple[torch.Tensor, ...]]:
    """Each rank's (w1, b1, w2, b2), after checking types; fc1 and fc2 are left unchanged."""
    fc1, fc2, world, _ = case.args
    pieces = []
    for rank in range(world):
        mine, theirs = (copy.deepcopy(fc1), copy.deepcopy(fc2)), (fc1, fc2)

        def on_copies(fc1, fc2, rank, world_size):  # the learner's function on our copies
            return shard_fn(*mine, rank, world_size)  # noqa: B023 - called at once
        got = call_learner(on_copies, Case(case.name, (fc1, fc2, rank, world)),
                           fn_name="shard_mlp")
        if any(not torch.equal(a.weight, b.weight) or not torch.equal(a.bias, b.bias)
               for a, b in zip(mine, theirs, strict=True)):
            raise CheckFailure(f"shard_mlp changed fc1 or fc2 in place (case '{case.name}'): "
                               "slice their weights into new tensors and leave the layers as "
                               "they are (the other ranks still need them here)")
        if not (isinstance(got, tuple | list) and len(got) == 4
                and all(isinstance(t, torch.Tensor) for t in got)):
            raise CheckFailure(f"shard_mlp should return four tensors (w1, b1, w2, b2), got "
                               f"{describe(got)} (case '{case.name}', rank {rank})")
        pieces.append(tuple(t.detach() for t in got))
    return pieces


def _mlp_shape_problem(piece: tuple, fc1: nn.Linear, world: int) -> str | None:
    """What is wrong with one rank's shapes, or None."""
    d_ff, d_model = fc1.weight.shape
    share = d_ff // world
    w1, b1, w2, b2 = (tuple(t.shape) for t in piece)
    if w1 == (d_ff, d_model // world) != (share, d_model):
        return ("w1 has shape (F, D/N): you split fc1.weight's COLUMNS, its input features. "
                "Column-parallel (Megatron's name, for Y = X A with A = Wᵀ) gives each rank "
                "some of fc1's OUTPUT features, which nn.Linear stores as ROWS of its (out, in) "
                "weight")
    if w1 != (share, d_model):
        transposed = " (a transpose?)" if w1 == (d_model, share) else ""
        return (f"w1 has shape {w1}{transposed}; rank r's rows of fc1.weight, (out, in), make "
                f"it (F/N, D) = {(share, d_model)}")
    if b1 != (share,):
        return (f"b1 has shape {b1}: each rank adds only the biases of its own F/N hidden units, "
                f"shape ({share},)")
    if w2 == (d_model // world, d_ff) != (d_model, share):
        return ("w2 has shape (D/N, F): you split fc2.weight's ROWS, its output features. "
                "Row-parallel splits fc2's INPUT features, the hidden units this rank computed: "
                "COLUMNS of its (out, in) weight")
    if w2 != (d_model, share):
        transposed = " (a transpose?)" if w2 == (share, d_model) else ""
        return (f"w2 has shape {w2}{transposed}; rank r's columns of fc2.weight, (out, in), "
                f"make it (D, F/N) = {(d_model, share)}")
    if b2 != (d_model,):
        return (f"b2 has shape {b2}: it is added to this rank's whole (..., D) output, shape "
                f"({d_model},)")
    return None


def _matching_rows(piece: torch.Tensor, full: torch.Tensor) -> list[int | None]:
    """For each row of ``piece``, the index of the equal row of ``full`` (None if none)."""
    distance = (piece[:, None, :] - full.detach()[None, :, :]).abs().amax(dim=-1)  # (n, F)
    best = distance.min(dim=1)
    return [int(j) if d < 1e-9 else None for d, j in zip(best.values, best.indices, strict=True)]


def _spans(units: Sequence[int]) -> str:
    """Units as ranges: [0, 1, 2, 5] -> '0-2, 5'."""
    units, spans = sorted(units), []
    for unit in units:
        if spans and unit == spans[-1][1] + 1:
            spans[-1][1] = unit
        else:
            spans.append([unit, unit])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _mlp_value_problem(pieces: list[tuple], fc1: nn.Linear, fc2: nn.Linear) -> str | None:
    """What is wrong with the ranks' values, or None: each rank's w1 rows, b1 and w2 columns
    must be the same hidden units, and the ranks' units must cover each unit once."""
    units = []
    for rank, (w1, b1, w2, _) in enumerate(pieces):
        rows, cols = _matching_rows(w1, fc1.weight), _matching_rows(w2.T, fc2.weight.T)
        if None in rows:
            return f"rank {rank}'s w1 holds rows that are not rows of fc1.weight"
        if None in cols:
            return f"rank {rank}'s w2 holds columns that are not columns of fc2.weight"
        if rows != cols:
            return (f"on rank {rank}, w1's rows compute the hidden units {_spans(rows)} but "
                    f"w2's columns read the units {_spans(cols)}: fc2's columns on a rank must "
                    "be the hidden units its fc1 rows compute, in the same order")
        if not _same(b1, fc1.bias.detach()[rows]):
            return (f"rank {rank}'s b1 is not the bias of its hidden units {_spans(rows)}: take "
                    "fc1.bias at the same indices as fc1.weight's rows")
        units += rows
    missing = sorted(set(range(fc1.out_features)) - set(units))
    twice = sorted({u for u in units if units.count(u) > 1})
    if missing or twice:
        return (f"the ranks hold the hidden units {_spans(twice)} more than once and "
                f"{_spans(missing)} on no rank: rank r takes units r·F/N to (r+1)·F/N - 1, so "
                "that the N ranks cover each of the F units once")
    total = sum(piece[3] for piece in pieces)
    bias = fc2.bias.detach()
    if len(pieces) > 1 and _same(total, len(pieces) * bias):
        return ("every rank adds fc2's whole bias, so the sum over the ranks counts it N "
                "times: give it to one rank (zeros on the others) or add it once after the "
                "sum, as course_lib's RowParallelLinear does")
    if not _same(total, bias):
        return "the ranks' b2 do not add up to fc2.bias: the sum over the ranks adds them all"
    return None


def check_shard_mlp(shard_mlp_fn: Callable) -> None:
    """Check ``shard_mlp(fc1, fc2, rank, world_size)`` -> (w1, b1, w2, b2), one rank's share
    of the MLP fc2(GELU(fc1(x))): summed over the ranks, w2 GELU(w1 x + b1) + b2 must be the
    full MLP. Any equal split of the hidden units that pairs fc1's rows with fc2's columns
    passes (contiguous blocks, as the spec asks, or strided).

    Args:
        shard_mlp_fn: the learner's function.
    """
    cases, strided = _mlp_cases(), False
    for case in cases:
        fc1, fc2, world, x = case.args
        pieces = _mlp_pieces(shard_mlp_fn, case)
        for rank, piece in enumerate(pieces):
            if problem := _mlp_shape_problem(piece, fc1, world):
                raise CheckFailure(f"On rank {rank} of {world} (case '{case.name}'), {problem}")
        if problem := _mlp_value_problem(pieces, fc1, fc2):
            raise CheckFailure(f"With {world} ranks (case '{case.name}'), {problem}")
        # the ranks' outputs, summed as an all-reduce sums them
        out = sum(F.gelu(x @ w1.T + b1) @ w2.T + b2 for w1, b1, w2, b2 in pieces)
        with torch.no_grad():
            full = fc2(F.gelu(fc1(x)))
        compare_tensors(out, full, case, what="the sum over the ranks", atol=1e-10, rtol=1e-9)
        first = _matching_rows(pieces[0][0], fc1.weight)
        strided |= first != list(range(len(first)))
    note = (" Your split is not in contiguous blocks (rank 0 does not hold units 0 to F/N - 1); "
            "that is correct too, as long as fc1's rows and fc2's columns agree."
            if strided else "")
    print(f"\u2705 shard_mlp is correct on all {len(cases)} cases ("
          + "; ".join(c.name for c in cases) + "): summed over the ranks, "
          "w2 GELU(w1 x + b1) + b2 is the full MLP, while each rank held 1/N of both weight "
          "matrices and the ranks exchanged one (..., D) sum." + note)


# --------------------------------------------------------------------------------------------
# Exercise 14.6: flash_backward(q, k, v, out, d_out, lse, scale) -> (dq, dk, dv)


def attention_gradients(q, k, v, d_out, scale) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv by autograd through softmax(q kᵀ scale) v, the whole (T, S) matrix kept."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.softmax(q @ k.T * scale, dim=-1) @ v  # (T, Dv)
    return torch.autograd.grad(out, (q, k, v), d_out)


def _flash_variant(q, k, v, out, d_out, lse, scale, *, delta="out", sign=1.0, grad_scale=True,
                   p_scale=True, dv_transposed=False):
    """The tile's backward from lse, right by default; each option is one plausible slip."""
    weights = torch.exp(q @ k.T * (scale if p_scale else 1.0) - lse[:, None])  # P (T, S)
    dv = weights @ d_out if dv_transposed else weights.T @ d_out  # Pᵀ dO: (S, Dv)
    d_weights = d_out @ v.T  # dP = dO Vᵀ: (T, S)
    rows = {"out": (d_out * out).sum(-1, keepdim=True), "none": 0.0,
            "dp": d_weights.sum(-1, keepdim=True)}[delta]  # D (T, 1)
    d_scores = sign * weights * (d_weights - rows)  # dS = P ∘ (dP - D): (T, S)
    factor = scale if grad_scale else 1.0
    return d_scores @ k * factor, d_scores.T @ q * factor, dv


def _flash_wrong(index: int, **options) -> Callable:
    return lambda *args: _flash_variant(*args, **options)[index]


FLASH_DELTA = ("dS = P ∘ (dP − D) with D_i = rowsum(dO_i ∘ O_i): the weights of a row sum to 1, "
               "so raising one lowers the others, and D is that correction")
FLASH_MISTAKES = {  # by the output they show in: 0 dq, 1 dk, 2 dv
    2: [(dict(dv_transposed=True), "Your dv is P dO; it must be Pᵀ dO, of shape (S, Dv): "
                                   "value j receives Σ_i P_ij dO_i, from every query i that "
                                   "weighted it"),
        (dict(p_scale=False), "You recomputed P from q kᵀ without the scale: lse is the "
                              "log-sum-exp of the SCALED scores, so P = exp(q kᵀ · scale − lse)")],
    0: [(dict(delta="none"), f"Your dS leaves out the softmax's correction: {FLASH_DELTA}"),
        (dict(delta="dp"), "Your dS subtracts rowsum(dP), an unweighted sum: the softmax's "
                           "backward subtracts Σ_j P_ij dP_ij, which equals rowsum(dO ∘ O)"),
        (dict(sign=-1.0), "Your dS has the wrong sign: dS = P ∘ (dP − D), not P ∘ (D − dP)"),
        (dict(grad_scale=False), "Your dq and dk leave out the scale: S = q kᵀ · scale, so "
                                 "dq = dS k · scale and dk = dSᵀ q · scale"),
        (dict(p_scale=False), "You recomputed P from q kᵀ without the scale: lse is the "
                              "log-sum-exp of the SCALED scores, so P = exp(q kᵀ · scale − lse)")],
}
FLASH_MISTAKES[1] = FLASH_MISTAKES[0]


def _flash_case(name: str, generator: torch.Generator, t: int, s: int, d_head: int,
                d_value: int, scale: float | None = None, spread: float = 1.0) -> Case:
    q, k = (torch.randn(n, d_head, generator=generator, dtype=torch.float64) * spread
            for n in (t, s))
    v = torch.randn(s, d_value, generator=generator, dtype=torch.float64)
    d_out = torch.randn(t, d_value, generator=generator, dtype=torch.float64)
    scale = 1 / math.sqrt(d_head) if scale is None else scale
    scores = q @ k.T * scale  # (T, S)
    lse = torch.logsumexp(scores, dim=-1)  # (T,)
    out = torch.softmax(scores, dim=-1) @ v  # (T, Dv)
    return Case(name, (q, k, v, out, d_out, lse, scale))


def _flash_cases() -> list[Case]:
    generator = torch.Generator().manual_seed(146)
    cases = [_flash_case("T=S=6, Dh=Dv=8, scale=0.3", generator, 6, 6, 8, 8, scale=0.3),
             _flash_case("T=5, S=7, Dh=4, Dv=3", generator, 5, 7, 4, 3),
             _flash_case("T=1, S=1", generator, 1, 1, 4, 2),
             _flash_case("T=3, S=9, Dh=2, Dv=5, scale=1", generator, 3, 9, 2, 5, scale=1.0),
             _flash_case("T=4, S=6, large scores", generator, 4, 6, 4, 3, scale=1.0,
                         spread=12.0)]
    largest = float(cases[-1].args[5].max())  # lse >= every score of its row
    cases[-1].name += f" (the largest {largest:,.0f}: exp of it overflows float64)"
    return cases


def _check_order(got: Sequence[Any], expected: Sequence[torch.Tensor], case: Case) -> None:
    """Fail if a returned gradient is right but in another gradient's place."""
    names = ("dq", "dk", "dv")
    for i, j in ((i, j) for i in range(3) for j in range(3) if i != j):
        if (isinstance(got[i], torch.Tensor) and _same(got[i], expected[j])
                and not _same(got[i], expected[i])):
            raise CheckFailure(f"Your {names[i]} is what {names[j]} should be (case "
                               f"'{case.name}'): return (dq, dk, dv), in that order")


def check_flash_backward(flash_backward_fn: Callable) -> None:
    """Check ``flash_backward(q, k, v, out, d_out, lse, scale)`` -> (dq, dk, dv) for one tile
    of non-causal attention, 2-D inputs: equal to autograd through softmax(q kᵀ scale) v
    (float64), including where exp of the scores alone would overflow.

    Args:
        flash_backward_fn: the learner's function.
    """
    cases = _flash_cases()
    for case in cases:
        q, k, v, out, d_out, lse, scale = case.args
        got = call_learner(flash_backward_fn, case, fn_name="flash_backward")
        if not (isinstance(got, tuple | list) and len(got) == 3):
            raise CheckFailure(f"flash_backward should return (dq, dk, dv), got {describe(got)} "
                               f"(case '{case.name}')")
        expected = attention_gradients(q, k, v, d_out, scale)
        _check_order(got, expected, case)
        for index in (2, 0, 1):
            name = ("dq", "dk", "dv")[index]
            if isinstance(got[index], torch.Tensor) and not torch.isfinite(got[index]).all():
                raise CheckFailure(f"Your {name} holds NaN or inf (case '{case.name}'): "
                                   "exp(S) overflows for large scores; P = exp(S − lse) never "
                                   "exceeds 1, so subtract before exponentiating")
            compare_tensors(got[index], expected[index], case, what=name, atol=1e-10,
                            rtol=1e-8, misconceptions=[
                                Misconception(_flash_wrong(index, **options), message)
                                for options, message in FLASH_MISTAKES[index]])
    t, bytes_ = 8192, 4
    print(f"\u2705 flash_backward equals autograd through softmax(q kᵀ · scale) v on all "
          f"{len(cases)} cases (" + "; ".join(c.name for c in cases) + "). It needed lse, T "
          f"numbers, where autograd keeps P, T × S: at T = S = {t:,} in float32 that is "
          f"{t * bytes_ // 2**10} KiB against {t * t * bytes_ // 2**20} MiB per head")


__all__ = ["accumulation_batches", "accumulation_model", "buggy_accumulated_step",
           "check_accumulated_step", "check_data_parallel", "check_flash_backward",
           "check_memory_prediction", "check_mfu", "check_shard_mlp", "whole_batch_step"]


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
