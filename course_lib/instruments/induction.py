"""Chapter 11's recipe: a small attention-only decoder that grows induction heads on a CPU,
and the measurements that watch it happen.

Public names (stable; exercises and notebooks use them):
    INDUCTION_VOCAB, SEGMENT_LENS, EVAL_SEGMENT_LEN   the task's sizes
    induction_model(n_layers=2, *, seed=0)            a fresh attention-only DecoderLM
    train_induction(model, *, steps, seed=0, ...)     train it on repeated random segments;
                                                      returns an :class:`InductionLog`
    half_losses(model, ids)                           (first half, second half) mean losses
    first_half_losses(model, ids)                     the first half split: new tokens, and
                                                      tokens seen before by accident
    head_scores(model, ids)                           (previous-token, induction) scores (L, H)
    InductionLog                                      what train_induction measured

The model is two layers of attention and nothing else (``ffn="none"``), with rotary positions
(RoPE, chapter 03), so a head can look "one back" whatever the position, and untied input and
output embeddings. Each training batch is :func:`course_lib.tasks.repeated_segments` with a
segment length drawn from ``SEGMENT_LENS``: with one fixed length L, a single layer can solve
the task by position alone (always look L - 1 back), and no induction head is needed.

Shape legend: B batch, T = 2L positions, L segment length, V vocabulary, H heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .._validate import (
    require_bool,
    require_callable,
    require_choice,
    require_int,
    require_positive_int,
    require_positive_number,
)
from ..configs import DecoderConfig
from ..models import DecoderLM
from ..tasks import repeated_segments
from ..tokenizer import IGNORE_INDEX
from .probes import induction_score, previous_token_score

__all__ = ["EVAL_SEGMENT_LEN", "INDUCTION_VOCAB", "SEGMENT_LENS", "InductionLog", "half_losses",
           "first_half_losses", "head_scores", "induction_model", "train_induction"]

INDUCTION_VOCAB = 32  # V: the first half's loss cannot go below log V = 3.47
SEGMENT_LENS = (8, 24)  # each batch draws its segment length L from this range (inclusive)
EVAL_SEGMENT_LEN = 16  # the fixed L of the evaluation sequences


def induction_model(n_layers: int = 2, *, seed: int = 0, vocab_size: int = INDUCTION_VOCAB,
                    d_model: int = 64, n_heads: int = 2) -> DecoderLM:
    """A fresh attention-only decoder for the repeated-segments task (initialised from
    ``seed``, without touching the global random state)."""
    require_int("seed", seed)
    config = DecoderConfig(vocab_size=vocab_size, d_model=d_model, n_heads=n_heads,
                           n_layers=n_layers, max_len=2 * SEGMENT_LENS[1], ffn="none",
                           positions="rope", tie_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DecoderLM(config)


def _next_token_losses(model: DecoderLM, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) cross-entropy of every position's next-token prediction (0 at the last one,
    which has no next token); the model is put in eval mode."""
    model.eval()
    targets = torch.full_like(ids, IGNORE_INDEX)  # (B, T)
    targets[:, :-1] = ids[:, 1:]
    return F.cross_entropy(model(ids).logits.transpose(1, 2), targets,
                           ignore_index=IGNORE_INDEX, reduction="none")  # (B, T)


def _check_model(model: object) -> DecoderLM:
    if not isinstance(model, DecoderLM):
        raise TypeError(f"model must be a course_lib DecoderLM (a decoder-only language model: "
                        f"induction is measured on next-token losses and causal attention), got "
                        f"{type(model).__name__}")
    return model


def _check_trainable(model: DecoderLM) -> None:
    """A DecoderLM that the training sequences fit and that has something to train."""
    config = model.config
    longest = 2 * SEGMENT_LENS[1]
    if config.positions == "learned" and config.max_len < longest:
        raise ValueError(f"model has max_len={config.max_len} (learned positions), but the "
                         f"training sequences are up to {longest} tokens long (two copies of a "
                         f"segment of up to {SEGMENT_LENS[1]}); build it with max_len >= "
                         f"{longest}, as induction_model does")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model has no parameter that requires grad (all are frozen, "
                         "requires_grad=False), so training could change nothing; unfreeze "
                         "them with model.requires_grad_(True)")


def _check_ids(ids: object) -> torch.Tensor:
    if (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] % 2
            or ids.shape[1] < 4 or ids.shape[0] == 0):
        got = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"ids should be (B, 2L) repeated segments with B >= 1 and L >= 2 (e.g. "
                         f"repeated_segments(...).inputs), got {got}")
    return ids


@torch.no_grad()
def half_losses(model: DecoderLM, ids: torch.Tensor) -> tuple[float, float]:
    """The mean next-token loss on each half of repeated segments.

    Args:
        model: a DecoderLM (put in eval mode here, and left so).
        ids: (B, 2L) sequences from ``repeated_segments`` (``task.inputs``).

    Returns:
        ``(first, second)``: the mean loss of the predictions made at positions 0..L-1 (the
        next token is new: at best log V) and at L..2L-2 (the next token was seen before).
    """
    seg = _check_ids(ids).shape[1] // 2
    loss = _next_token_losses(_check_model(model), ids)  # (B, 2L)
    return float(loss[:, :seg].mean()), float(loss[:, seg:-1].mean())


@torch.no_grad()
def first_half_losses(model: DecoderLM, ids: torch.Tensor) -> tuple[float, float, float]:
    """The first half's loss split by whether the current token already occurred earlier in
    the sequence (by chance: the tokens are random, so V = 32 and L = 16 repeat some).

    Returns:
        ``(new, seen, fraction_seen)``: the mean loss at first-half positions whose token is
        new, at those whose token was seen before, and the share of the latter.
    """
    seg = _check_ids(ids).shape[1] // 2
    loss = _next_token_losses(_check_model(model), ids)[:, :seg]  # (B, L)
    first = ids[:, :seg]  # (B, L)
    seen = (first[:, :, None] == first[:, None, :]).tril(-1).any(-1)  # (B, L): seen before t
    return float(loss[~seen].mean()), float(loss[seen].mean()), float(seen.float().mean())


@torch.no_grad()
def head_scores(model: DecoderLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every head's previous-token and induction score on repeated segments, averaged over
    the batch: two (n_layers, H) tensors (see course_lib.instruments.probes)."""
    seg = _check_ids(ids).shape[1] // 2
    _check_model(model).eval()
    weights = model(ids, output_attentions=True).attentions  # n_layers x (B, H, 2L, 2L)
    prev = torch.stack([previous_token_score(w).mean(0) for w in weights])  # (n_layers, H)
    ind = torch.stack([induction_score(w, seg).mean(0) for w in weights])  # (n_layers, H)
    return prev, ind


@dataclass
class InductionLog:
    """What :func:`train_induction` measured at every evaluation.

    Attributes:
        steps: the update counts of the evaluations (0 = before training).
        first, second: the mean loss on the first and the repeated half (:func:`half_losses`).
        prev, induction: per evaluation, the (n_layers, H) head scores (:func:`head_scores`).
        vocab_size: V, so that ``math.log(V)`` is the first half's floor.
    """

    steps: list[int] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    second: list[float] = field(default_factory=list)
    prev: list[torch.Tensor] = field(default_factory=list)
    induction: list[torch.Tensor] = field(default_factory=list)
    vocab_size: int = INDUCTION_VOCAB

    def scores(self, kind: str) -> torch.Tensor:
        """(n_evals, n_layers, H): ``"prev"`` or ``"induction"`` scores through training."""
        require_choice("kind", kind, ("prev", "induction"))
        if not self.steps:
            raise ValueError("the log is empty: nothing was evaluated yet (train_induction "
                             "fills it, and measures before the first update)")
        return torch.stack(self.prev if kind == "prev" else self.induction)

    def drop_step(self, threshold: float = 1.0) -> int | None:
        """The first evaluated step whose repeated-half loss is below ``threshold`` (None if
        none): where the phase change happened."""
        require_positive_number("threshold", threshold)
        if any(math.isnan(loss) for loss in self.second):  # NaN < threshold is False: no "drop"
            raise ValueError("the repeated half's loss became NaN during training: the run "
                             "diverged, so no phase change can be read off it (try a lower lr)")
        return next((s for s, loss in zip(self.steps, self.second, strict=True)
                     if loss < threshold), None)


def train_induction(
    model: DecoderLM, *, steps: int, seed: int = 0, lr: float = 1e-3, batch_size: int = 32,
    eval_every: int = 25, n_eval: int = 256, progress: bool = True,
    callback: Callable[[int, InductionLog], None] | None = None,
) -> InductionLog:
    """Train ``model`` on repeated random segments (AdamW) and measure it as it learns.

    Every batch is ``repeated_segments(batch_size, L, V)`` with L drawn from
    ``SEGMENT_LENS`` and fresh tokens (never a fixed data set, so the first half stays
    unpredictable). Every ``eval_every`` updates, and before the first, the model is measured
    on one fixed set of ``n_eval`` sequences of ``EVAL_SEGMENT_LEN``: the two half losses and
    every head's two scores.

    Args:
        model: e.g. ``induction_model(2, seed=0)``; trained in place.
        steps: updates. seed: the data stream's seed (the model's is its own).
        lr, batch_size: AdamW's learning rate (weight decay 0.01) and the batch size.
        eval_every, n_eval: how often, and on how many sequences, to measure.
        progress: show a progress bar.
        callback: called as ``callback(step, log)`` after each evaluation (a live plot).

    Returns:
        The :class:`InductionLog`; the model is left in eval mode.
    """
    _check_model(model)
    if callback is not None:
        require_callable("callback", callback, "a function callback(step, log)", n_args=2)
    steps, batch_size, n_eval = (require_positive_int(n, v) for n, v in
                                 (("steps", steps), ("batch_size", batch_size),
                                  ("n_eval", n_eval)))
    eval_every = require_positive_int("eval_every", eval_every)
    require_positive_number("lr", lr)
    require_bool("progress", progress)
    _check_trainable(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(require_int("seed", seed))
    device = next(model.parameters()).device
    eval_ids = repeated_segments(n_eval, EVAL_SEGMENT_LEN, vocab, seed=10_000).inputs.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    log = InductionLog(vocab_size=vocab)

    def evaluate(step: int) -> None:
        first, second = half_losses(model, eval_ids)
        prev, ind = head_scores(model, eval_ids)
        log.steps.append(step)
        log.first.append(first)
        log.second.append(second)
        log.prev.append(prev)
        log.induction.append(ind)
        if callback is not None:
            callback(step, log)

    evaluate(0)
    for step in tqdm(range(1, steps + 1), desc="training", disable=not progress):
        seg = int(torch.randint(SEGMENT_LENS[0], SEGMENT_LENS[1] + 1, (1,), generator=gen))
        task = repeated_segments(batch_size, seg, vocab, generator=gen)
        model.train()
        loss = model(task.inputs.to(device), targets=task.targets.to(device)).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    model.eval()
    return log

