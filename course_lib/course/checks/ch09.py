"""Checks for chapter 09, training Transformers: the language-model loss on right-padded
sequences, the sampling distribution (temperature, top-k, top-p), a greedy decoding loop for an
encoder-decoder, a planted bug in the alignment score of cross-attention (a batch that exposes
it, and the fix), one step of attention with a key/value cache, a prediction of the cache's
bytes after a generation, and the capstone: the learner's own GPT, compared part by part with
course_lib's DecoderLM under copied weights, then trained on Shakespeare's characters with the
learner's loop."""

from __future__ import annotations

import contextlib
import functools
import io
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

from course_lib import generation
from course_lib.attention import scaled_dot_product_attention
from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig, EncoderDecoderConfig
from course_lib.corpus import shakespeare_text, train_val_split
from course_lib.generation import generate_seq2seq, next_token_probs
from course_lib.metrics import alignment_score
from course_lib.models import DecoderLM, EncoderDecoder, lm_loss
from course_lib.tokenizer import IGNORE_INDEX, CharTokenizer
from course_lib.train import lm_batches

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    rand,
    require_count,
    require_real,
    run_cases,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Exercise 9.1: next_token_loss(logits, ids, pad_id), on right-padded windows


def _flat_ce(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **kwargs)


def _unpadded(targets: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The targets with every padding entry replaced by -100, which the loss skips."""
    return targets.masked_fill(targets == pad_id, IGNORE_INDEX)


def _reference_loss(logits: torch.Tensor, ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    # position t predicts token t + 1, and only a real token is a target
    return lm_loss(logits[:, :-1], _unpadded(ids[:, 1:], pad_id))


def _masked_mean(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, *,
                 over: str = "kept") -> torch.Tensor:
    """Cross-entropy of each (position, target), kept where ``keep``; averaged over the kept
    entries, over every entry, or per sequence and then over the sequences."""
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T')
    kept = losses * keep
    if over == "all":
        return kept.sum() / keep.numel()
    if over == "sequences":
        return (kept.sum(1) / keep.sum(1)).mean()
    return kept.sum() / keep.sum()


LOSS_MISTAKES = [
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits, _unpadded(ids, pad_id)),
        "Your loss scores each position against its own input token, so the model would learn "
        "to copy its input. The target of position t is the NEXT token, ids[:, t + 1]",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits[:, 1:], _unpadded(ids[:, :-1], pad_id)),
        "Your targets are shifted the wrong way: position t + 1 is asked for token t, the "
        "past. Position t's target is token t + 1",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits, _unpadded(torch.roll(ids, -1, dims=1),
                                                               pad_id)),
        "Your targets are ids rolled by one: the last position's target wraps around to the "
        "first token of the window, which does not follow it. The last position has no "
        "target",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits[:, :-1], ids[:, 1:]),
        "Your loss also scores the positions whose target is padding: the model would be "
        "trained to predict pad_id after the end of every sequence. Leave out every position "
        "whose next token is pad_id",
    ),
    Misconception(
        lambda logits, ids, pad_id: _masked_mean(logits[:, :-1], ids[:, 1:],
                                                 ids[:, :-1] != pad_id),
        "You kept the positions whose INPUT is a real token, so each sequence's last real "
        "token is still scored, against the padding that follows it. Decide by the TARGET: "
        "a position counts when its next token is not pad_id",
    ),
    Misconception(
        lambda logits, ids, pad_id: _masked_mean(logits[:, :-1], ids[:, 1:],
                                                 ids[:, 1:] != pad_id, over="all"),
        "You zeroed the padded positions but divided by every position, padded ones "
        "included, so padding pulls the loss down. Divide by the number of scored positions",
    ),
    Misconception(
        lambda logits, ids, pad_id: _masked_mean(logits[:, :-1], ids[:, 1:],
                                                 ids[:, 1:] != pad_id, over="sequences"),
        "You averaged each sequence's loss, then the sequences: a sequence with 2 scored "
        "positions then weighs as much as one with 10. Every scored position counts the same: "
        "one mean over all of them in the batch",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits[:, :-1], _unpadded(ids[:, 1:], pad_id),
                                             reduction="sum"),
        "Your loss is the sum over the scored positions, not the mean: its size would grow "
        "with the batch and the sequence length (and so would the gradients). Average it",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(logits[:, :-1], _unpadded(ids[:, 1:], pad_id),
                                             reduction="sum") / logits.shape[0],
        "Your loss is the sum over positions averaged over the batch only: average over "
        "every scored position",
    ),
    Misconception(
        lambda logits, ids, pad_id: _flat_ce(torch.softmax(logits[:, :-1], -1),
                                             _unpadded(ids[:, 1:], pad_id)),
        "You applied a softmax before F.cross_entropy, which applies log-softmax itself: "
        "pass the raw logits",
    ),
]

ONE_TOKEN = "a sequence of one real token (nothing to score in it), pad_id=0"


def _loss_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(901)

    def ids(lengths: list[int], t: int, v: int, pad_id: int) -> torch.Tensor:
        """Rows of ``lengths`` real tokens (never pad_id), then pad_id up to t."""
        real = [i for i in range(v) if i != pad_id]
        drawn = torch.tensor(real)[torch.randint(0, len(real), (len(lengths), t), generator=gen)]
        positions = torch.arange(t)[None, :]  # (1, T)
        return drawn.masked_fill(positions >= torch.tensor(lengths)[:, None], pad_id)

    def case(name: str, lengths: list[int], t: int, v: int, pad_id: int, scale: float = 2.0,
             **kwargs) -> Case:
        logits = rand(gen, len(lengths), t, v, scale=scale)
        return Case(name, (logits, ids(lengths, t, v, pad_id), pad_id), **kwargs)

    return [
        case("B=3, T=8, V=9: sequences of 8, 5 and 3 tokens, pad_id=0", [8, 5, 3], 8, 9, 0),
        case("no padding, B=2, T=6, V=7", [6, 6], 6, 7, 0),
        case("pad_id=11, the last id of V=12: lengths 2 and 9", [2, 9], 9, 12, 11,
             hint="F.cross_entropy wants (N, V) logits and (N,) targets: flatten the batch "
                  "and time dimensions"),
        case(ONE_TOKEN, [1, 6, 4], 6, 5, 0),
        case("B=4, T=10, V=30, confident logits, pad_id=3", [10, 7, 2, 5], 10, 30, 3,
             scale=4.0),
        case("one sequence, T=2 (a single prediction), pad_id=0", [2], 2, 5, 0),
    ]


def check_next_token_loss(next_token_loss: Callable) -> None:
    """Check ``next_token_loss(logits, ids, pad_id)`` -> the mean cross-entropy of predicting
    ``ids[:, t + 1]`` from ``logits[:, t]`` over the positions whose next token is not
    ``pad_id`` (a 0-D tensor or a float).

    Args:
        next_token_loss: the learner's function of logits (B, T, V), right-padded ids (B, T)
            and the padding id.
    """

    def check_one(got: Any, case: Case) -> None:
        logits, ids, pad_id = case.args
        if isinstance(got, float):
            got = torch.tensor(got)
        if (isinstance(got, torch.Tensor) and got.dim() == 0 and not bool(torch.isfinite(got))
                and case.name == ONE_TOKEN):
            raise CheckFailure(
                f"Your loss is {float(got)} on the case '{case.name}': that sequence has no "
                "scored position, and a mean over its positions divides 0 by 0. Average "
                "over every scored position of the batch at once, never per sequence")
        compare_tensors(got, _reference_loss(logits, ids, pad_id), case, what="Your loss",
                        misconceptions=LOSS_MISTAKES)

    run_cases("next_token_loss", next_token_loss, _loss_cases(), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 9.2: next_token_probs(logits, temperature, top_k, top_p)


def _keep_top_k(logits: torch.Tensor, k: int | None) -> torch.Tensor:
    if k is None or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, max(k, 1), dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _nucleus(logits: torch.Tensor, p: float | None, rule: str = "crossing") -> torch.Tensor:
    """Top-p on logits with one of several keep rules, right or wrong."""
    if p is None or p >= 1.0:
        return logits
    probs = torch.softmax(logits, -1)
    descending = rule != "ascending"
    sorted_probs, order = torch.sort(probs, dim=-1, descending=descending, stable=True)
    if rule == "unsorted":
        sorted_probs, order = probs, torch.arange(probs.shape[-1]).expand_as(probs)
    cumulative = sorted_probs.cumsum(-1)
    if rule == "exclude_crossing":
        drop = cumulative > p  # also drops the token that makes the mass reach p
    elif rule == "keep_tie":
        drop = cumulative - sorted_probs > p  # keeps a token whose mass before it equals p
    else:
        drop = cumulative - sorted_probs >= p
    drop[:, 0] = False
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def _probs_variant(logits, temperature, top_k, top_p, *, k_offset=0, p_rule="crossing",
                   p_first=False, p_on_raw=False, renormalise=True, skip_k=False,
                   skip_p=False) -> torch.Tensor:
    """The sampling distribution computed with one mistake (or none)."""
    scaled = logits / temperature
    k = None if top_k is None or skip_k else top_k + k_offset
    top_p = None if skip_p else top_p
    if p_on_raw:  # top-p decided on the untempered distribution
        kept = _nucleus(_keep_top_k(logits, k), top_p, p_rule) > float("-inf")
        scaled = _keep_top_k(scaled, k).masked_fill(~kept, float("-inf"))
    elif p_first:
        scaled = _keep_top_k(_nucleus(scaled, top_p, p_rule), k)
    else:
        scaled = _nucleus(_keep_top_k(scaled, k), top_p, p_rule)
    if renormalise:
        return torch.softmax(scaled, -1)
    return torch.softmax(logits / temperature, -1) * (scaled > float("-inf"))


def _with(**options) -> Callable:
    return lambda logits, temperature=1.0, top_k=None, top_p=None: _probs_variant(
        logits, temperature, top_k, top_p, **options)


PROBS_MISTAKES = [
    Misconception(
        lambda logits, temperature=1.0, top_k=None, top_p=None: _probs_variant(
            logits, 1.0, top_k, top_p),
        "The temperature had no effect on your distribution. Divide the LOGITS by the "
        "temperature before the softmax: softmax(logits / T). Dividing the probabilities "
        "after the softmax and renormalising gives back the same probabilities",
    ),
    Misconception(
        lambda logits, temperature=1.0, top_k=None, top_p=None: torch.softmax(logits, -1)
        / temperature,
        "You divided the probabilities by the temperature after the softmax, so the rows no "
        "longer sum to 1. The temperature divides the logits, before the softmax",
    ),
    Misconception(
        lambda logits, temperature=1.0, top_k=None, top_p=None: _probs_variant(
            logits, 1.0 / temperature, top_k, top_p),
        "You multiplied the logits by the temperature: divide them, so that T < 1 sharpens "
        "the distribution and T > 1 flattens it",
    ),
    Misconception(_with(skip_k=True), "Your distribution ignores top_k: keep only the top_k "
                                      "largest logits and give every other token probability 0"),
    Misconception(_with(skip_p=True), "Your distribution ignores top_p: after top-k, keep only "
                                      "the smallest set of most likely tokens whose "
                                      "probabilities add up to at least top_p"),
    Misconception(_with(k_offset=1), "Your top-k keeps k + 1 tokens: keep exactly the k "
                                     "largest logits (torch.topk(logits, k))"),
    Misconception(_with(k_offset=-1), "Your top-k keeps k - 1 tokens: keep the k largest "
                                      "logits, the k-th included"),
    Misconception(
        _with(p_rule="exclude_crossing"),
        "Your top-p set stops before the token that makes the mass reach p, so what it keeps "
        "adds up to less than p. Keep the smallest set of most likely tokens whose total is "
        "AT LEAST p: a token stays when the mass of the tokens ranked before it is still "
        "below p (cumsum minus the token's own probability < p)",
    ),
    Misconception(
        _with(p_rule="keep_tie"),
        "Your top-p keeps one token too many when the mass ranked before a token equals p "
        "exactly: that set already adds up to p, so it is complete. Drop a token as soon as "
        "the mass before it is >= p (not > p), as course_lib.generation does",
    ),
    Misconception(
        _with(p_rule="unsorted"),
        "Your top-p adds up probabilities in vocabulary order. Sort them from the most likely "
        "down first (torch.sort(probs, descending=True)), then scatter the decisions back",
    ),
    Misconception(
        _with(p_rule="ascending"),
        "Your top-p sorts the probabilities in ascending order, so it keeps the UNLIKELY "
        "tokens: sort with descending=True",
    ),
    Misconception(
        _with(renormalise=False),
        "Your distribution is right on the kept tokens' ratios but the rows do not sum to 1: "
        "after removing tokens, renormalise (set removed logits to -inf and take the softmax "
        "again, or divide by the row sums)",
    ),
    Misconception(
        _with(p_on_raw=True),
        "Your top-p set was chosen from the distribution before the temperature: apply the "
        "temperature first, then top-k, then top-p on what is left",
    ),
    Misconception(
        _with(p_first=True),
        "You applied top-p before top-k. The order is temperature, then top-k, then top-p on "
        "the renormalised top-k distribution (as in Hugging Face's generate)",
    ),
]


# probabilities (0.25, 0.5, 0.25) and (0.25, 0.25, 0.5), exact in float32: with top_p = 0.5
# the mass before the second most likely token is exactly 0.5, so only the first is kept
TIE_CASE = "a tie: probabilities 0.5, 0.25, 0.25 and top_p=0.5 (exactly 0.5 before the 2nd)"
TIE_LOGITS = torch.tensor([[0.0, math.log(2.0), 0.0], [-math.log(2.0), -math.log(2.0), 0.0]])


def _probs_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(902)

    def case(name: str, logits: torch.Tensor, temperature=1.0, top_k=None, top_p=None):
        return Case(name, (logits,), dict(temperature=temperature, top_k=top_k, top_p=top_p))

    return [
        case("no filter, T=1", rand(gen, 2, 6, scale=2.0)),
        case("temperature 0.5", rand(gen, 3, 8, scale=2.0), temperature=0.5),
        case("temperature 2", rand(gen, 2, 8, scale=2.0), temperature=2.0),
        case("top_k=3", rand(gen, 2, 9, scale=2.0), top_k=3),
        case("top_k=1 (greedy as a distribution)", rand(gen, 2, 7, scale=2.0), top_k=1),
        case("top_k=V (nothing removed)", rand(gen, 1, 5, scale=2.0), top_k=5),
        case("top_p=0.9", rand(gen, 3, 10, scale=2.0), top_p=0.9),
        case("top_p=0.5, temperature 0.7", rand(gen, 2, 10, scale=2.0), temperature=0.7,
             top_p=0.5),
        case("top_k=6, top_p=0.6, temperature 1.5", rand(gen, 2, 12, scale=2.0),
             temperature=1.5, top_k=6, top_p=0.6),
        case("top_p=1 (nothing removed)", rand(gen, 2, 6, scale=2.0), top_p=1.0),
        case("V=2, top_p=0.2", torch.tensor([[1.0, -1.0]]), top_p=0.2),
        case(TIE_CASE, TIE_LOGITS.clone(), top_p=0.5),
        case("top_k=4, temperature 0.5", rand(gen, 2, 8, scale=2.0), temperature=0.5, top_k=4),
    ]



def check_next_token_probs(next_token_probs_fn: Callable) -> None:
    """Check ``next_token_probs(logits, temperature=1.0, top_k=None, top_p=None)`` -> (B, V)
    probabilities: temperature, then top-k, then top-p, renormalised.

    Args:
        next_token_probs_fn: the learner's function.
    """

    cases = _probs_cases()
    results = [call_learner(next_token_probs_fn, case) for case in cases]
    expected = [next_token_probs(case.args[0], **case.kwargs) for case in cases]
    for got, want, case in zip(results, expected, cases, strict=True):
        if not isinstance(got, torch.Tensor):  # a clear message about the type first
            compare_tensors(got, want, case, what="Your probabilities")
    wrong = [i for i, (got, want) in enumerate(zip(results, expected, strict=True))
             if not _same(got, want)]
    if wrong:
        _diagnose_probs(results, expected, cases)
        i = wrong[0]  # no single mistake explains every case: the first case's evidence
        compare_tensors(results[i], expected[i], cases[i], what="Your probabilities",
                        misconceptions=PROBS_MISTAKES)
    labels = "; ".join(case.name for case in cases)
    print(f"\u2705 next_token_probs is correct on all {len(cases)} test cases ({labels})")


def _same(a: Any, b: torch.Tensor) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape
            and bool(torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-4)))


def _probs_mistake_outputs(mistake: Misconception, cases: Sequence[Case]) -> list:
    outputs = []
    for case in cases:
        try:
            outputs.append(mistake.wrong(*case.args, **case.kwargs))
        except Exception:  # this mistake cannot be computed for this case
            outputs.append(None)
    return outputs


def _diagnose_probs(results: list, expected: list, cases: Sequence[Case]) -> None:
    """Name the mistake that gives the learner's output on EVERY case (one case alone can
    fit several: with temperature 1, skipping top-k looks like dividing by T afterwards)."""
    for mistake in PROBS_MISTAKES:
        outputs = _probs_mistake_outputs(mistake, cases)
        fits = all(out is None or _same(got, out) for got, out in zip(results, outputs,
                                                                      strict=True))
        shown = [case.name for out, want, case in zip(outputs, expected, cases, strict=True)
                 if out is not None and not _same(out, want)]
        if fits and shown:
            raise CheckFailure(f"{mistake.message} (seen on the case '{shown[0]}')")


# --------------------------------------------------------------------------------------------
# Exercise 9.3: greedy_decode(model, src, bos_id, eos_id, max_new_tokens)

VOCAB, BOS, PAD = 12, 1, 0


@functools.cache
def _decoder_model() -> EncoderDecoder:
    """A small encoder-decoder with large random weights: its greedy outputs vary with the
    source and the position, so each decoding mistake gives different tokens."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(5)
        config = EncoderDecoderConfig.shared(VOCAB, VOCAB, d_model=32, n_heads=2,
                                             n_encoder_layers=1, n_decoder_layers=1,
                                             max_src_len=10, max_tgt_len=16, pad_id=PAD,
                                             tie_embeddings=False)
        model = EncoderDecoder(config).eval().requires_grad_(False)
        for p in model.parameters():
            if p.dim() == 2:  # std 2 / sqrt(fan-in): far from the small training init
                p.normal_(0.0, 2.0 / p.shape[1] ** 0.5)
    finally:
        torch.random.set_rng_state(state)  # leave the learner's random stream alone
    return model


def _greedy_variant(model, src, bos_id, eos_id, max_new_tokens, *, start=None, steps_delta=0,
                    read=-1, history=True, stop="all", fill=True, keep_bos=True):
    """Greedy decoding with one mistake (or none)."""
    tgt = torch.full((src.shape[0], 1), bos_id if start is None else start)
    finished = torch.zeros(src.shape[0], dtype=torch.bool)
    with torch.no_grad():
        for _ in range(max_new_tokens + steps_delta):
            context = tgt if history else tgt[:, -1:]
            next_id = model(src, context).logits[:, read].argmax(-1)  # (B,)
            if fill and eos_id is not None:
                next_id = torch.where(finished, torch.full_like(next_id, eos_id), next_id)
            finished |= next_id == eos_id
            tgt = torch.cat([tgt, next_id[:, None]], 1)
            if (stop == "all" and bool(finished.all())) or (stop == "any"
                                                            and bool(finished.any())):
                break
    return tgt if keep_bos else tgt[:, 1:]


def _greedy(**options) -> Callable:
    return lambda model, src, bos_id, eos_id, max_new_tokens: _greedy_variant(
        model, src, bos_id, eos_id, max_new_tokens, **options)


GREEDY_MISTAKES = [
    Misconception(
        _greedy(keep_bos=False),
        "Your output leaves out the start token: return the whole decoder sequence, "
        "beginning with bos_id, shape (B, 1 + n)",
    ),
    Misconception(
        _greedy(start=PAD),
        "Your decoder did not start from the start token bos_id: the first decoder input "
        "must be bos_id (the model was trained with <bos> in front of every target)",
    ),
    Misconception(
        _greedy(history=False),
        "You fed the decoder only the last token: it must see the whole target so far "
        "(bos_id and every token generated), model(src, tgt) with all of tgt",
    ),
    Misconception(
        _greedy(stop="never", fill=False),
        "Your loop ignores eos_id: once a sequence has produced eos_id it is finished. Stop "
        "when every sequence has finished",
    ),
    Misconception(
        _greedy(fill=False),
        "A finished sequence kept generating tokens after its eos_id: once a sequence has "
        "produced eos_id, fill its later positions with eos_id (e.g. torch.where(finished, "
        "eos_id, next_id)) until every sequence has finished",
    ),
    Misconception(
        _greedy(stop="any"),
        "Your loop stops as soon as ONE sequence has produced eos_id: continue until EVERY "
        "sequence has finished (finished.all(), not finished.any())",
    ),
    Misconception(
        _greedy(steps_delta=1),
        "Your loop adds one token too many: at most max_new_tokens tokens after bos_id",
    ),
    Misconception(
        _greedy(steps_delta=-1),
        "Your loop adds one token too few: up to max_new_tokens tokens after bos_id",
    ),
]


def _telling_eos(model: EncoderDecoder, src: torch.Tensor) -> int:
    """An end token that the sequences produce at different steps, chosen so that the
    mistakes about finished sequences (no filling, stopping at the first end) show."""
    mistakes = ({"fill": False}, {"stop": "any"}, {"stop": "never", "fill": False})
    for eos in range(2, VOCAB):
        outputs = [generate_seq2seq(model, src, bos_id=BOS, eos_id=eos, max_new_tokens=8)]
        outputs += [_greedy_variant(model, src, BOS, eos, 8, **options) for options in mistakes]
        if all(a.shape != b.shape or not torch.equal(a, b)
               for i, a in enumerate(outputs) for b in outputs[i + 1:]):
            return eos
    raise RuntimeError("no end token shows every mistake")  # never reached for this model


def _greedy_cases() -> list[Case]:
    model = _decoder_model()
    gen = torch.Generator().manual_seed(904)
    src = torch.randint(3, VOCAB, (4, 7), generator=gen)
    src[1, 5:] = PAD  # a shorter source, padded
    free = generate_seq2seq(model, src, bos_id=BOS, max_new_tokens=8)  # (4, 9), no eos
    eos = _telling_eos(model, src)
    never = next(t for t in range(3, VOCAB) if t not in free.flatten().tolist())
    one = src[2:3].clone()
    return [
        Case(f"batch of 4, eos_id={eos} reached at different steps",
             (model, src, BOS, eos, 8)),
        Case(f"one source, eos_id={eos}", (model, one, BOS, eos, 8),
             hint="a batch of one has shape (1, S); keep the batch dimension"),
        Case("max_new_tokens=1", (model, src, BOS, eos, 1)),
        Case(f"no sequence produces eos_id={never}: 6 tokens each", (model, src, BOS, never, 6)),
        Case(f"max_new_tokens=16 = the model's max_tgt_len, eos_id={never} never produced: "
             "16 tokens each (the last decoder input, <bos> and 15 tokens, fits)",
             (model, src, BOS, never, 16)),
    ]


# Reading the first position's logits at every step and calling the model once before the
# loop give the same tokens (a causal decoder's position 0 only ever sees bos_id): the number of
# model calls tells the two apart.
FIRST_POSITION = ("You took the argmax of the logits at the FIRST decoder position at every "
                  "step: the next token is predicted by the last position, logits[:, -1]")
HOISTED = ("Your model was called once, before the loop, and every step reused those logits, "
           "so each step repeats the token predicted after bos_id alone. Call the model inside "
           "the loop, on the target so far, and read its last position")
SAME_TOKEN = ("Every step produced the token predicted after bos_id alone: either the model "
              "runs once before the loop and its logits are reused (call it inside the loop, "
              "on the target so far), or you read the first position (logits[:, 0]) instead "
              "of the last (logits[:, -1])")


def _same_token_message(n_calls: int) -> str:
    if n_calls == 1:
        return HOISTED
    return FIRST_POSITION if n_calls > 1 else SAME_TOKEN


def check_greedy_decode(greedy_decode: Callable) -> None:
    """Check ``greedy_decode(model, src, bos_id, eos_id, max_new_tokens)`` -> (B, 1 + n)
    token ids, equal to :func:`course_lib.generation.generate_seq2seq`'s greedy output.

    Args:
        greedy_decode: the learner's function.
    """
    calls = [0]  # the learner's calls of model(...) since the last case

    def count(*_args: Any) -> None:
        calls[0] += 1

    def check_one(got: Any, case: Case) -> None:
        n_calls = calls[0]
        try:
            compare_one(got, case, n_calls)
        finally:
            calls[0] = 0  # the reference and the planted mistakes call the model too

    def compare_one(got: Any, case: Case, n_calls: int) -> None:
        model, src, bos_id, eos_id, max_new = case.args
        expected = generate_seq2seq(model, src, bos_id=bos_id, eos_id=eos_id,
                                    max_new_tokens=max_new)
        if isinstance(got, torch.Tensor) and got.dtype.is_floating_point:
            raise CheckFailure(f"Your output has dtype {got.dtype}: return token ids (a long "
                               f"tensor), e.g. from argmax (case '{case.name}')")
        same_token = Misconception(_greedy(read=0), _same_token_message(n_calls))
        compare_tensors(got, expected, case, what="Your decoded ids",
                        misconceptions=[same_token, *GREEDY_MISTAKES], atol=0.0, rtol=0.0)

    cases = _greedy_cases()  # the reference runs here, before the counting starts
    handle = _decoder_model().register_forward_pre_hook(count)
    try:
        run_cases("greedy_decode", greedy_decode, cases, check_one)
    finally:
        handle.remove()  # the model is shared by every run of the check


# --------------------------------------------------------------------------------------------
# Exercise 9.4: a planted bug in alignment_score, exposed by a batch, then fixed


def _hits(weights: torch.Tensor, alignment: torch.Tensor, peaks: torch.Tensor) -> torch.Tensor:
    return ((peaks == alignment) & (alignment != IGNORE_INDEX)).sum()


def _scored(alignment: torch.Tensor) -> torch.Tensor:
    return (alignment != IGNORE_INDEX).sum()


def _gold_weight(weights: torch.Tensor, alignment: torch.Tensor) -> torch.Tensor:
    index = alignment.clamp_min(0)[..., None]
    return weights.gather(-1, index)[..., 0]  # (..., T): the weight on the gold position


def buggy_alignment_score(weights: torch.Tensor, alignment: torch.Tensor) -> float:
    """The exercise's function, planted bug included: it averages each sentence's share, so
    every sentence weighs the same however many scored positions it has (and a sentence with
    none gives 0 / 0)."""
    scored = alignment != IGNORE_INDEX  # (..., T)
    hits = (weights.argmax(dim=-1) == alignment) & scored  # (..., T)
    return float((hits.sum(-1) / scored.sum(-1)).mean())


PLANTED_SCORE = (
    "Your function still averages each sentence's share: a sentence with 2 scored words "
    "then weighs as much as one with 8. The score is pooled over the batch: all the hits "
    "divided by all the scored positions"
)

ALIGNMENT_MISTAKES = [
    Misconception(buggy_alignment_score, PLANTED_SCORE),
    Misconception(
        lambda w, a: float(_hits(w, a, w.argmax(-1))),
        "You returned the number of target positions whose attention peaks on the gold source "
        "position; the score is their SHARE: divide by the number of scored positions",
    ),
    Misconception(
        lambda w, a: float(_hits(w, a, w.argmax(-1)) / a.numel()),
        "You divided by every target position, including the ones without a gold alignment "
        "(-100, e.g. <eos> and padding): divide by the scored positions only",
    ),
    Misconception(
        lambda w, a: float(((w.argmax(-1) == a) | (a == IGNORE_INDEX)).float().mean()),
        "You counted the positions without a gold alignment (-100) as correct: leave them "
        "out of both the hits and the total",
    ),
    Misconception(
        lambda w, a: float(_hits(w, a, w.argmin(-1)) / _scored(a)),
        "You used argmin: the peak of a row is its LARGEST weight (argmax)",
    ),
    Misconception(
        lambda w, a: float(_hits(w, a, w.argmax(-2)) / _scored(a)),
        "You took the argmax over the target positions (dim -2): for each target position "
        "(a row), find the source position (column, dim -1) with the largest weight",
    ),
    Misconception(
        lambda w, a: float(((_gold_weight(w, a) > 0.5) & (a != IGNORE_INDEX)).sum()
                           / _scored(a)),
        "You counted weights above 0.5 on the gold position. A position counts when its "
        "largest weight is on the gold source position, however large that weight is "
        "(argmax, not a threshold)",
    ),
    Misconception(
        lambda w, a: float((_gold_weight(w, a) * (a != IGNORE_INDEX)).sum() / _scored(a)),
        "You averaged the weight on the gold position (a soft score). The alignment score "
        "counts how often the argmax of the attention is the gold position",
    ),
]


PERFECT_HEAD = "a perfect head: the gold alignment itself as weights, with unscored positions"
EMPTY_ROW = "a batch padded with a sentence that has no scored position at all"
INSTRUMENT = ("A perfect head cannot find this (every sentence of it scores 1.0 however it "
              "is averaged): compare with course_lib.metrics.alignment_score on a head that "
              "is right on a short sentence and wrong on a long one")


def _alignment_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(905)

    def weights(*shape: int, sharp: float = 3.0) -> torch.Tensor:
        return torch.softmax(rand(gen, *shape, scale=sharp), -1)

    w1 = weights(3, 6, 6)  # T == S, so an argmax over the wrong axis has the right shape
    gold1 = torch.where(torch.rand(3, 6, generator=gen) < 0.6, w1.argmax(-1),
                        torch.randint(0, 6, (3, 6), generator=gen))
    gold1[:, -1] = IGNORE_INDEX  # <eos>
    gold1[2, 3:] = IGNORE_INDEX  # a short sentence, padded
    gold1[2, :3] = w1[2].argmax(-1)[:3]  # right on the short sentence: pooling matters
    w2 = weights(5, 7)
    gold2 = w2.argmax(-1).clone()
    gold2[1] = (gold2[1] + 1) % 7
    w3 = weights(2, 4, 5, sharp=0.5)  # flat attention: every peak is weak
    gold3 = w3.argmax(-1).clone()
    gold3[0, 0] = IGNORE_INDEX
    w4 = weights(3, 5, 6)
    gold4 = torch.where(torch.rand(3, 5, generator=gen) < 0.5, w4.argmax(-1),
                        (w4.argmax(-1) + 1) % 6)
    gold4[0, 1] = w4[0, 1].argmax()  # at least one hit
    gold4[1] = IGNORE_INDEX  # a padding sentence
    perfect_gold = gold1.clone()
    perfect = F.one_hot(perfect_gold.clamp_min(0), 6).float()  # the gold alignment as weights
    return [
        Case(PERFECT_HEAD, (perfect, perfect_gold)),
        Case("batch (3, T=6, S=6), sentences of 5, 5 and 3 scored words", (w1, gold1)),
        Case("one sentence (T=5, S=7), unbatched", (w2, gold2),
             hint="work with the last dimension (dim=-1) so that (T, S) and (B, T, S) both work"),
        Case("flat attention, every peak on the gold position", (w3, gold3)),
        Case("no peak on the gold position", (w2, (w2.argmax(-1) + 3) % 7)),
        Case(EMPTY_ROW, (w4, gold4)),
    ]


def _check_score(alignment_score_fn: Callable) -> None:
    def check_one(got: Any, case: Case) -> None:
        expected = alignment_score(*case.args)
        if isinstance(got, numbers.Integral) and not isinstance(got, bool):
            _name_alignment_mistake(float(got), expected, case)  # e.g. the count of hits
        got = require_real(got, "Your score", case)
        if math.isclose(got, expected, abs_tol=1e-6):
            return
        if math.isnan(got):
            raise CheckFailure(
                f"Your score is NaN on the case '{case.name}': a sentence without a scored "
                "position divides 0 by 0 when each sentence's share is computed on its own. "
                "Pool the batch: all the hits divided by all the scored positions")
        _name_alignment_mistake(got, expected, case)
        raise CheckFailure(f"Your score is {got:.4f} but course_lib.metrics.alignment_score "
                           f"gives {expected:.4f} (case '{case.name}'). {INSTRUMENT}")

    run_cases("alignment_score", alignment_score_fn, _alignment_cases(), check_one)


def _name_alignment_mistake(got: float, expected: float, case: Case) -> None:
    for m in ALIGNMENT_MISTAKES:
        try:
            wrong = m.wrong(*case.args)
        except Exception:  # this mistake cannot be computed for this case: not it
            continue
        if math.isclose(got, wrong, abs_tol=1e-6) and not math.isclose(wrong, expected,
                                                                       abs_tol=1e-6):
            raise CheckFailure(f"{m.message} (seen on the case '{case.name}')")


def _check_exposing_batch(exposing_batch: Callable) -> str:
    """The learner's batch must be valid input on which the given function and the definition
    disagree; returns the two scores, for the pass line."""
    got = call_learner(exposing_batch, Case("your batch"), fn_name="exposing_batch")
    if not (isinstance(got, tuple | list) and len(got) == 2
            and all(isinstance(t, torch.Tensor) for t in got)):
        raise CheckFailure(f"exposing_batch should return (weights, alignment), two tensors, "
                           f"but returned {describe(got)}")
    weights, alignment = got
    if weights.dim() != 3 or alignment.shape != weights.shape[:2]:
        raise CheckFailure(
            f"exposing_batch returned weights of shape {tuple(weights.shape)} and alignment of "
            f"shape {tuple(alignment.shape)}: return a batch, weights (B, T, S) and alignment "
            "(B, T) with the same B and T (a single sentence cannot expose this bug: with one "
            "sentence the given function is right)")
    if alignment.dtype.is_floating_point or alignment.dtype == torch.bool:
        raise CheckFailure(f"alignment has dtype {alignment.dtype}: it holds source positions, "
                           "a long tensor (torch.tensor of ints)")
    s = weights.shape[-1]
    valid = (alignment == IGNORE_INDEX) | ((alignment >= 0) & (alignment < s))
    if not bool(valid.all()) or not bool((alignment != IGNORE_INDEX).any()):
        raise CheckFailure(f"alignment must hold source positions 0 .. {s - 1} or -100, and at "
                           "least one scored position")
    right = alignment_score(weights, alignment)
    given = buggy_alignment_score(weights, alignment)
    if math.isclose(given, right, abs_tol=1e-6):
        raise CheckFailure(
            f"On your batch the given function and the definition agree (both {right:.4f}), so "
            "it does not expose the bug. They differ when the sentences have different numbers "
            "of scored positions AND different shares of hits")
    return f"on your batch the given function says {given:.4f}, the definition {right:.4f}"


def check_alignment_score(alignment_score_fn: Callable, exposing_batch: Callable) -> None:
    """Check the fixed ``alignment_score(weights, alignment)`` -> a float, the share of ALL the
    target positions with a gold source position (alignment != -100) whose largest attention
    weight is on that position, pooled over the batch (a tensor is refused); then
    ``exposing_batch()`` -> (weights (B, T, S), alignment (B, T)), a batch on which the given
    function's per-sentence average differs from the score.

    Args:
        alignment_score_fn: the learner's function of weights (..., T, S) and alignment (..., T).
        exposing_batch: the learner's function returning a batch that exposes the bug.
    """
    with contextlib.redirect_stdout(io.StringIO()):
        _check_score(alignment_score_fn)
    shown = _check_exposing_batch(exposing_batch)
    labels = "; ".join(case.name for case in _alignment_cases())
    print(f"\u2705 alignment_score is correct on all {len(_alignment_cases())} test cases "
          f"({labels}); {shown}")


# --------------------------------------------------------------------------------------------
# Exercise 9.5: attend_with_cache(q, k_new, v_new, k_cache, v_cache)


def _reference_step(q, k_new, v_new, k_cache, v_cache, *, diagonal_shift=0, mask_kind="lower",
                    order="old_first", use_new=True, scale=None):
    """One cached attention step, right (the defaults) or with one mistake."""
    pairs = [(k_cache, v_cache), (k_new, v_new)]
    if order == "new_first":
        pairs.reverse()
    k_all = torch.cat([p[0] for p in pairs], dim=-2)  # (..., S + T, Dh)
    v_all = torch.cat([p[1] for p in pairs], dim=-2)
    keys, values = (k_all, v_all) if use_new else (k_cache, v_cache)
    n_new, n_keys = q.shape[-2], keys.shape[-2]
    ones = torch.ones(n_new, n_keys, dtype=torch.bool)
    if mask_kind == "lower":
        mask = torch.tril(ones, diagonal=n_keys - n_new + diagonal_shift)
    elif mask_kind == "top_left":
        mask = torch.tril(ones)
    else:
        mask = ones
    out, _ = scaled_dot_product_attention(q, keys, values, mask=mask, scale=scale)
    return out, k_all, v_all


def _step(**options) -> Callable:
    return lambda q, k_new, v_new, k_cache, v_cache: _reference_step(
        q, k_new, v_new, k_cache, v_cache, **options)[0]


STEP_MISTAKES = [
    Misconception(
        _step(mask_kind="top_left"),
        "Your causal mask lines the new queries up with the FIRST keys, as "
        "F.scaled_dot_product_attention(is_causal=True) does when the query and key lengths "
        "differ. The new queries are the LAST T of the S + T positions: query t may see keys "
        "0 .. S + t, i.e. torch.tril(ones(T, S + T), diagonal=S) (or "
        "torch.nn.attention.bias.causal_lower_right)",
    ),
    Misconception(
        _step(diagonal_shift=-1),
        "Your mask is off by one: each new query misses its own key. Query t sits at position "
        "S + t and may see keys 0 .. S + t (diagonal=S in torch.tril, not S - 1)",
    ),
    Misconception(
        _step(diagonal_shift=1),
        "Your mask is off by one: each new query also sees the next new token. Query t sits "
        "at position S + t and may see keys 0 .. S + t only (diagonal=S in torch.tril)",
    ),
    Misconception(
        _step(mask_kind="none"),
        "Your new queries attend to every new key, including the ones after them: with more "
        "than one new token, mask the future (query t sees keys 0 .. S + t)",
    ),
    Misconception(
        _step(use_new=False, mask_kind="none"),
        "Your queries attend only to the cached keys: append the new keys and values to the "
        "cache FIRST, so each new token can also see itself, then attend",
    ),
    Misconception(
        _step(scale=1.0),
        "Your scores are not scaled: divide q k^T by sqrt(Dh), Dh = q.shape[-1]",
    ),
]


def _step_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(906)

    def tensors(b: int, h: int, s: int, t: int, d: int) -> tuple[torch.Tensor, ...]:
        return (rand(gen, b, h, t, d), rand(gen, b, h, t, d), rand(gen, b, h, t, d),
                rand(gen, b, h, s, d), rand(gen, b, h, s, d))

    return [
        Case("S=2 cached, T=4 new", tensors(1, 1, 2, 4, 4),
             hint="append along the positions axis: torch.cat([k_cache, k_new], dim=-2)"),
        Case("S=3 cached, T=2 new, batch 2, 3 heads", tensors(2, 3, 3, 2, 8)),
        Case("S=4 cached, one new token", tensors(2, 2, 4, 1, 4)),
        Case("S=1, T=1, one head", tensors(1, 1, 1, 1, 2)),
        Case("empty cache (S=0), a prompt of T=3", tensors(1, 2, 0, 3, 4),
             hint="torch.cat works with an empty (B, H, 0, Dh) cache"),
    ]


def check_attend_with_cache(attend_with_cache: Callable) -> None:
    """Check ``attend_with_cache(q, k_new, v_new, k_cache, v_cache)`` -> (out, k_all, v_all):
    append the new keys and values to the cache, then causal attention of the T new queries
    (the last T positions) over all S + T keys.

    Args:
        attend_with_cache: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        out, k_all, v_all = _reference_step(*case.args)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailure(f"attend_with_cache should return (out, k_all, v_all), but "
                               f"returned {describe(got)} (case '{case.name}')")
        got_out, got_k, got_v = got
        q, k_new, v_new, k_cache, v_cache = case.args
        order = [Misconception(
            lambda *args: torch.cat([args[1], args[3]], dim=-2),
            "Your cache has the new keys in front of the old ones: keep the positions in "
            "order, torch.cat([k_cache, k_new], dim=-2)")]
        compare_tensors(got_k, k_all, case, what="Your k_all", misconceptions=order)
        compare_tensors(got_v, v_all, case, what="Your v_all")
        compare_tensors(got_out, out, case, what="Your output", misconceptions=STEP_MISTAKES)

    run_cases("attend_with_cache", attend_with_cache, _step_cases(), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 9.6: predict the key/value cache's bytes after a generation

CACHE_CONFIG = DecoderConfig(vocab_size=65, d_model=96, n_heads=6, n_layers=3, max_len=128)
CACHE_DTYPE = torch.bfloat16
CACHE_BATCH, CACHE_PROMPT, CACHE_NEW = 4, 12, 8


def _cache_mistakes(c: DecoderConfig) -> dict[int, str]:
    """Wrong predictions, each from one slip in the count, and what to say about it."""
    per_position = 2 * c.n_layers * c.d_model * CACHE_DTYPE.itemsize  # one token, one sequence
    fed = CACHE_PROMPT + CACHE_NEW - 1
    right = per_position * CACHE_BATCH * fed
    return {
        per_position * CACHE_BATCH * (CACHE_PROMPT + CACHE_NEW):
            f"You counted all {CACHE_PROMPT + CACHE_NEW} tokens of the output. The last new "
            "token is sampled at the last step and the loop ends: it is never fed to the "
            "model, so its key and value are never computed",
        per_position * CACHE_BATCH * CACHE_PROMPT:
            "You counted the prompt only: every token fed to the model after it adds its key "
            "and value too",
        per_position * CACHE_BATCH * CACHE_NEW:
            "You counted the new tokens only: the prompt's keys and values are cached first",
        per_position * CACHE_BATCH * c.max_len:
            "You counted max_len positions: the cache grows with each token fed (course_lib "
            "concatenates), it reserves nothing in advance",
        per_position * fed: "You counted one sequence: each sequence of the batch has its own "
                            "keys and values",
        per_position: "You gave the bytes of one position of one sequence: the question asks "
                      "for the whole cache, every cached position of every sequence",
        right * 2: "You counted 4 bytes per number: a bfloat16 takes 2",
        right // 2: "You are off by a factor of 2: the cache keeps a key AND a value per "
                    "position and layer, and each bfloat16 number takes 2 bytes; one of the "
                    "two is missing from your count",
        right // c.n_layers: "You counted one layer: every self-attention layer keeps its own "
                             "keys and values",
        right // c.n_heads: "You counted one head: a layer caches H heads of Dh numbers, "
                            "H * Dh = d_model of them per key",
        right * c.n_heads: "You multiplied by the number of heads twice: the H heads of Dh "
                           "numbers together are d_model numbers",
        right * 8: "You counted bits: a byte is 8 bits",
    }


@functools.cache
def measure_generation_cache(config: DecoderConfig = CACHE_CONFIG) -> tuple[int, int]:
    """Generate CACHE_NEW tokens after a batch of prompts with course_lib's generate (greedy,
    with a KVCache) in CACHE_DTYPE, and return the bytes of every cached key and value tensor
    when it returns, and the number of cached positions."""
    made: list[KVCache] = []

    class RecordedCache(KVCache):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    with torch.random.fork_rng(devices=[]):  # leave the learner's random stream alone
        torch.manual_seed(0)
        model = DecoderLM(config).to(CACHE_DTYPE).eval()
        prompts = torch.randint(0, config.vocab_size, (CACHE_BATCH, CACHE_PROMPT))
    with mock.patch.object(generation, "KVCache", RecordedCache):
        generation.generate(model, prompts, CACHE_NEW, temperature=0, use_cache=True)
    cache = made[0]
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return total, cache.get_seq_length()


def check_kv_cache_bytes(predict_cache_bytes: Callable) -> None:
    """Check ``predict_cache_bytes()`` -> an int: the bytes the key/value cache of a bfloat16
    ``DecoderLM(CACHE_CONFIG)`` holds when ``generate(prompts, CACHE_NEW, use_cache=True)``
    returns, for CACHE_BATCH prompts of CACHE_PROMPT tokens; then show the measurement.

    Args:
        predict_cache_bytes: the learner's function, no arguments.
    """
    case = Case(f"bfloat16 DecoderConfig(d_model=96, n_heads=6, n_layers=3), {CACHE_BATCH} "
                f"prompts of {CACHE_PROMPT} tokens, {CACHE_NEW} new tokens")
    got = require_count(call_learner(predict_cache_bytes, case),
                        "Your prediction (a number of bytes)")
    measured, positions = measure_generation_cache()
    c = CACHE_CONFIG
    shown = (f"measured when generate returns: {measured:,} bytes = {c.n_layers} layers x 2 "
             f"(keys and values) x {CACHE_BATCH} sequences x {positions} positions "
             f"({CACHE_PROMPT} prompt tokens + {CACHE_NEW} new - 1, the last one never fed) x "
             f"{c.d_model} numbers ({c.n_heads} heads x {c.d_model // c.n_heads}) x "
             f"{CACHE_DTYPE.itemsize} bytes (bfloat16)")
    if got != measured:
        message = _cache_mistakes(c).get(
            got, "Count what one layer caches for one position of one sequence, how many "
                 "numbers and bytes that is, then how many positions the model was fed")
        raise CheckFailure(f"Your prediction is {got:,} bytes. {message}.\n{shown}")
    print(f"\u2705 your prediction, {got:,} bytes, is right; {shown}")


# --------------------------------------------------------------------------------------------
# Exercise 9.7 (capstone): your own GPT, MyGPT(...) and train_my_gpt(model, batches, ...)

# parity: a small model with large random weights, so that every mistake shows in the logits,
# at sizes where D_h = 12, H = 2 and sqrt(D) = 4.9 all differ: a head split as (D_h, H) or a
# division by sqrt(d_model) or by d_head computes something else, and each is told apart
GPT_PARITY_CONFIG = DecoderConfig(vocab_size=11, d_model=24, n_heads=2, n_layers=2, max_len=12,
                                  activation="gelu", tie_embeddings=False)
# training: what the check trains, and the bar its validation loss must clear. Over seeds 0-5
# (train_and_validate's seed) the book's solution reached 2.25 to 2.27, with 1 and 2 threads,
# with and without gradient clipping; the bigram model scores 2.51, a loop that never steps
# 4.2 to 4.4 and one that never clears the gradients 4.4 to 7.0
GPT_TRAIN_SIZES = dict(d_model=64, n_heads=4, n_layers=2, max_len=32)
GPT_TRAIN_UPDATES, GPT_TRAIN_LR, GPT_TRAIN_BATCH = 300, 3e-3, 16
GPT_LOSS_BAR = 2.45
GPT_BOOK_RANGE = (2.25, 2.27)
# course_lib's module names -> the learner's (the exercise's table)
GPT_RENAMES = (("embeddings.token", "tok_emb"), ("embeddings.position.embedding", "pos_emb"),
               ("attn_norm", "ln1"), ("self_attn.qkv_proj", "attn.qkv"),
               ("self_attn.out_proj", "attn.proj"), ("ff_norm", "ln2"), ("ff.fc1", "ff.0"),
               ("ff.fc2", "ff.2"), ("final_norm", "ln_f"), ("lm_head", "head"))


def gpt_name(course_name: str) -> str:
    """The learner's name of a course_lib DecoderLM parameter, e.g. blocks.0.ln1.weight for
    blocks.0.attn_norm.weight."""
    module, leaf = course_name.rsplit(".", 1)
    prefix = ""
    if module.startswith("blocks."):
        index, module = module.split(".", 2)[1:]
        prefix = f"blocks.{index}."
    return prefix + dict(GPT_RENAMES)[module] + "." + leaf


@functools.cache
def _course_gpt() -> DecoderLM:
    """course_lib's DecoderLM with large random weights (LayerNorms and biases too)."""
    with torch.random.fork_rng(devices=[]):  # leave the learner's random stream alone
        torch.manual_seed(7)
        model = DecoderLM(GPT_PARITY_CONFIG).eval().requires_grad_(False)
        for name, p in model.named_parameters():
            if "embeddings" in name:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:  # std 1.5 / sqrt(fan-in): sharp attention, large activations
                p.normal_(0.0, 1.5 / p.shape[1] ** 0.5)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
            else:
                p.normal_(0.0, 0.3)
    return model


def _run(fn: Callable, what: str, *args: Any) -> Any:
    """Call a piece of the learner's model; an error becomes a message naming the piece."""
    try:
        return fn(*args)
    except (NotImplementedError, CheckFailure):
        raise
    except Exception as exc:
        shapes = ", ".join(describe(a) for a in args)
        raise CheckFailure(f"{what} raised {type(exc).__name__} on {shapes}:\n    {exc}") from exc


def _near(a: Any, b: torch.Tensor, atol: float = 1e-4, *, nan: bool = False) -> bool:
    """a is a tensor close to b; with ``nan``, NaN in the same places counts as equal (a wrong
    answer whose mask leaves a row with nothing to attend to is NaN there)."""
    return isinstance(a, torch.Tensor) and _allclose(a, b, atol, 1e-4, nan=nan)


def _allclose(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float, *,
              nan: bool = False) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a.detach().double(), b.double(),
                                                      atol=atol, rtol=rtol, equal_nan=nan))


def _difference(got: Any, want: torch.Tensor, what: str, case: str) -> str:
    if not isinstance(got, torch.Tensor):
        return f"{what} should be a tensor of shape {tuple(want.shape)}, got {describe(got)}"
    if got.shape != want.shape:
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(want.shape)} ({case})"
    diff = (got.detach().double() - want.double()).abs()
    return (f"{what} differs from course_lib's by up to {float(diff.max()):.3g} ({case})")


def _load_course_weights(mine: torch.nn.Module, ref: DecoderLM) -> None:
    """Copy the reference's weights into the learner's model through the exercise's table."""
    theirs = dict(mine.named_parameters())
    wanted = {gpt_name(name): p for name, p in ref.named_parameters()}
    missing = [n for n in wanted if n not in theirs]
    extra = [n for n in theirs if n not in wanted]
    if missing or extra:
        raise CheckFailure(
            "Your model's parameter names do not follow the exercise's table (keep the "
            "given __init__ methods): "
            + (f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}; " if missing else "")
            + (f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}" if extra else ""))
    for name, p in wanted.items():
        if theirs[name].shape != p.shape:
            raise CheckFailure(f"Your parameter {name} has shape {tuple(theirs[name].shape)}, "
                               f"expected {tuple(p.shape)}")
    with torch.no_grad():
        for name, p in wanted.items():
            theirs[name].copy_(p)


def _attention_variant(attn: torch.nn.Module, x: torch.Tensor, *, mask: str = "causal",
                       dim: int = -1, scale: str = "head", split: str = "heads",
                       merge: bool = True, swap_qk: bool = False) -> torch.Tensor:
    """Causal multi-head self-attention from course_lib's weights, right or with one mistake.
    ``split``: "heads" (view (B, T, H, Dh)), "reshape" (straight to (B, H, T, Dh)), "dh_h"
    (view (B, T, Dh, H), transpose(1, 2): Dh 'heads' of H features) or "interleaved" (view
    (B, T, Dh, H), heads on the last axis: head h gets every H-th feature); merged back the
    mirror way (``merge=False``: reshaped straight to (B, T, D)). ``mask``: "causal", "none",
    "future" (the upper triangle: itself and the future), "inverted" (strictly the future),
    "no_self" (strictly the past). ``scale``: "head" (sqrt(Dh)), "model" (sqrt(D)), "d_head"
    (Dh itself), "width" (sqrt of the split's last axis), "none"."""
    (batch, seq_len, d_model), n_heads = x.shape, attn.n_heads
    d_head = d_model // n_heads
    q, k, v = attn.qkv_proj(x).split(d_model, dim=-1)  # 3 x (B, T, D)

    def heads(t: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, heads, T, width)
        if split == "reshape":
            return t.reshape(batch, n_heads, seq_len, d_head)
        if split == "dh_h":
            return t.view(batch, seq_len, d_head, n_heads).transpose(1, 2)  # (B, Dh, T, H)
        if split == "interleaved":
            return t.view(batch, seq_len, d_head, n_heads).permute(0, 3, 1, 2)  # (B, H, T, Dh)
        return t.view(batch, seq_len, n_heads, d_head).transpose(1, 2)

    def merged(out: torch.Tensor) -> torch.Tensor:  # the mirror image of heads()
        if split == "interleaved":
            return out.permute(0, 2, 3, 1).reshape(batch, seq_len, d_model)
        if not merge:
            return out.reshape(batch, seq_len, d_model)
        return out.transpose(1, 2).reshape(batch, seq_len, d_model)

    q, k, v = heads(q), heads(k), heads(v)
    if swap_qk:
        q, k = k, q
    scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
    divisor = {"head": math.sqrt(d_head), "model": math.sqrt(d_model), "d_head": d_head,
               "width": math.sqrt(q.shape[-1]), "none": 1.0}[scale]
    scores = scores / divisor
    ones = torch.ones(seq_len, seq_len, dtype=torch.bool)
    allowed = {"causal": ones.tril(), "none": ones, "future": ones.triu(),
               "inverted": ones.triu(1), "no_self": ones.tril(-1)}[mask]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return attn.out_proj(merged(torch.softmax(scores, dim=dim) @ v))  # (B, T, D)


ATTENTION_MISTAKES = (
    (dict(mask="none"), "lets every position attend to the positions after it: there is no "
     "causal mask. Before the softmax, fill the scores of keys after the query with "
     "float('-inf') (the allowed part is torch.tril of a (T, T) matrix of ones)"),
    (dict(mask="future"), "has its causal mask the wrong way round: each position attends to "
     "itself and the FUTURE only and never to the past (torch.triu where torch.tril belongs). "
     "Position t may see keys 0 .. t: keep the lower triangle"),
    (dict(mask="inverted"), "masks the past instead of the future: the scores that are "
     "filled with -inf are the ALLOWED ones (masked_fill(allowed, ...) where "
     "masked_fill(~allowed, ...) belongs), so each position sees only later positions and the "
     "last one sees nothing (NaN)"),
    (dict(mask="no_self"), "masks the diagonal too: a position may attend to itself "
     "(torch.tril with the default diagonal=0, not diagonal=-1), and position 0 now sees "
     "nothing (NaN)"),
    (dict(swap_qk=True), "swaps the queries and the keys: scores[t, s] is query t dotted "
     "with key s, q @ k.transpose(-2, -1) with q the FIRST D features of qkv(x), k the next D"),
    (dict(dim=-2), "takes the softmax over the wrong axis: each query's weights must sum to "
     "1 over the keys, the LAST axis of the (B, H, T, T) scores (dim=-1)"),
    (dict(scale="none"), "does not scale the scores: divide q k^T by sqrt(d_head) before "
     "the softmax"),
    (dict(scale="model"), "divides the scores by sqrt(d_model): each head's dot products have "
     "d_head terms, so divide by sqrt(d_head) = sqrt(d_model // n_heads)"),
    (dict(scale="d_head"), "divides the scores by d_head: the variance argument (chapter 02) "
     "asks for its square root, sqrt(d_head)"),
    (dict(merge=False), "merges the heads in the wrong order: reshaping (B, H, T, Dh) "
     "straight to (B, T, D) mixes positions and heads. Transpose to (B, T, H, Dh) first "
     "(.transpose(1, 2)), then reshape"),
    *((dict(split="reshape", merge=merge), "splits the heads in the wrong order: reshaping "
       "(B, T, D) straight to (B, H, T, Dh) hands each head a mixture of positions. View it as "
       "(B, T, H, Dh), then transpose(1, 2)") for merge in (True, False)),
    (dict(split="dh_h"), "splits D as (d_head, n_heads): view(B, T, d_head, n_heads) makes "
     "d_head 'heads' of n_heads features each. Head h owns the contiguous features "
     "h*d_head .. (h+1)*d_head - 1: view(B, T, n_heads, d_head), then transpose(1, 2)"),
    (dict(split="dh_h", scale="width"), "splits D as (d_head, n_heads): view(B, T, d_head, "
     "n_heads) makes d_head 'heads' of n_heads features each. Head h owns the contiguous "
     "features h*d_head .. (h+1)*d_head - 1: view(B, T, n_heads, d_head), then "
     "transpose(1, 2)"),
    (dict(split="interleaved"), "gives head h every n_heads-th feature (h, h + H, ...): the "
     "feature axis was split as (d_head, n_heads). Head h owns the contiguous features "
     "h*d_head .. (h+1)*d_head - 1: view(B, T, n_heads, d_head), then transpose(1, 2)"),
)


def _block_variants(block: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a block computes with one wiring mistake, from course_lib's sublayers."""
    def attn(z: torch.Tensor) -> torch.Tensor:
        return block.self_attn(z, is_causal=True)[0]

    ln1, ln2, ff = block.attn_norm, block.ff_norm, block.ff
    h = ln1(x + attn(x))
    post = ln2(h + ff(h))
    a = attn(ln1(x))
    return {
        "is post-norm, x = LN(x + attn(x)): this model is pre-norm, each sublayer reads a "
        "normalised copy and adds its output to the unnormalised stream, "
        "x = x + attn(ln1(x)), then x = x + ff(ln2(x))": post,
        "has no residual connections: add each sublayer's output to its input, "
        "x = x + attn(ln1(x)), then x = x + ff(ln2(x))": ff(ln2(a)),
        "has no residual connection around the attention: x = x + attn(ln1(x))":
            a + ff(ln2(a)),
        "has no residual connection around the feed-forward: x = x + ff(ln2(x))":
            ff(ln2(x + a)),
        "adds the sublayer's output to the NORMALISED input: the residual stream is the "
        "unnormalised x, x = x + attn(ln1(x))": ln1(x) + a + ff(ln2(ln1(x) + a)),
        "feeds the feed-forward the block's input instead of the stream after the attention: "
        "x = x + attn(ln1(x)), THEN x = x + ff(ln2(x))": x + a + ff(ln2(x)),
        "uses ln1 for both sublayers: the feed-forward reads ln2(x)":
            x + a + ff(ln1(x + a)),
    }


def _diagnose_block(i: int, mine: torch.nn.Module, ref: torch.nn.Module, x: torch.Tensor,
                    got: Any, case: str) -> None:
    """Raise with the first part of block i that differs, and the mistake where one fits."""
    normed = ref.attn_norm(x)
    want_attn = ref.self_attn(normed, is_causal=True)[0]
    got_attn = _run(mine.attn, f"blocks[{i}].attn", normed)
    if not _near(got_attn, want_attn):
        for options, message in ATTENTION_MISTAKES:
            wrong = _attention_variant(ref.self_attn, normed, **options)
            if _near(got_attn, wrong, nan=True) and not _near(wrong, want_attn, nan=True):
                raise CheckFailure(f"Block {i}'s attention {message} ({case}).")
        raise CheckFailure(_difference(got_attn, want_attn, f"Block {i}'s attention output",
                                       f"same input as course_lib's MultiHeadAttention, {case}")
                           + ". The attention is qkv -> split heads -> softmax(q k^T / "
                           "sqrt(d_head)) with a causal mask -> weights @ v -> merge heads "
                           "-> proj")
    for message, wrong in _block_variants(ref, x).items():
        if _near(got, wrong):
            raise CheckFailure(f"Block {i}'s attention is right, but the block {message} "
                               f"({case}).")
    raise CheckFailure(_difference(got, ref(x)[0], f"Block {i}'s output", case)
                       + ". Its attention agrees with course_lib's: look at the rest of "
                       "Block.forward, x = x + attn(ln1(x)), then x = x + ff(ln2(x))")


def _first_block_input(mine: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor | None:
    seen: list[torch.Tensor] = []
    hook = mine.blocks[0].register_forward_pre_hook(
        lambda module, args: seen.append(args[0]) if args else None)
    try:
        _run(mine, "Your model", ids)
    finally:
        hook.remove()
    return seen[0] if seen else None


def _locate_gpt_difference(mine: torch.nn.Module, ref: DecoderLM, ids: torch.Tensor,
                           got: Any, case: str) -> None:
    """Raise with the first part of the learner's model that differs from course_lib's:
    the embeddings, a block (its attention, its wiring), or the final norm and head."""
    x = ref.embeddings(ids)  # (B, T, D)
    seen = _first_block_input(mine, ids)
    if seen is None:
        raise CheckFailure("Your forward never calls self.blocks[0]: run the embeddings "
                           f"through every block of self.blocks in order ({case})")
    if not _near(seen, x):
        if _near(seen, ref.embeddings.token(ids)):
            raise CheckFailure("The input of your first block is the token embeddings alone: "
                               "the position embeddings are missing. Add "
                               "pos_emb(torch.arange(T)) to tok_emb(ids) "
                               f"({case}).")
        raise CheckFailure(_difference(seen, x, "The input of your first block (the "
                                       "embeddings)", case)
                           + ": it should be tok_emb(ids) + pos_emb(positions 0 .. T-1)")
    for i, (my_block, ref_block) in enumerate(zip(mine.blocks, ref.blocks, strict=True)):
        want = ref_block(x)[0]
        block_out = _run(my_block, f"blocks[{i}]", x)
        if not _near(block_out, want):
            _diagnose_block(i, my_block, ref_block, x, block_out, case)
        x = want
    if _near(got, ref.lm_head(x)):
        raise CheckFailure("Your blocks agree with course_lib's, but the final LayerNorm is "
                           f"missing: the logits are head(ln_f(x)) ({case}).")
    raise CheckFailure(_difference(got, ref.lm_head(ref.final_norm(x)), "Your logits", case)
                       + ". Each block agrees with course_lib's on the same input: look at "
                       "MyGPT.forward, which runs every block once, in order, then ln_f, "
                       "then head")


def _gpt_parity(my_gpt_class: Callable) -> str:
    """Part (a): course_lib's weights in the learner's model give course_lib's logits, and a
    later token never changes earlier logits. Returns what was shown, for the pass line."""
    c = GPT_PARITY_CONFIG
    ref = _course_gpt()
    case = Case("the parity model", kwargs=dict(vocab_size=c.vocab_size, d_model=c.d_model,
                                                n_heads=c.n_heads, n_layers=c.n_layers,
                                                max_len=c.max_len))
    with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten anyway
        mine = call_learner(my_gpt_class, case, fn_name="MyGPT")
    for module in mine.modules():
        if type(module).__module__.startswith("course_lib."):
            raise CheckFailure(f"Your model uses course_lib's {type(module).__name__}: build it "
                               "from your own modules and torch.nn pieces")
    _load_course_weights(mine, ref)
    mine.eval()
    gen = torch.Generator().manual_seed(907)
    worst = 0.0
    with torch.no_grad():
        for batch, seq_len in ((2, 10), (1, c.max_len), (3, 1)):
            ids = torch.randint(0, c.vocab_size, (batch, seq_len), generator=gen)
            where = f"ids of shape ({batch}, {seq_len})"
            got, want = _run(mine, "Your model", ids), ref(ids).logits
            if not _near(got, want):
                _locate_gpt_difference(mine, ref, ids, got, where)
            worst = max(worst, float((got.double() - want.double()).abs().max()))
        ids = torch.randint(0, c.vocab_size, (1, c.max_len), generator=gen)
        before = _run(mine, "Your model", ids)
        for t in (4, c.max_len - 1):
            changed = ids.clone()
            changed[0, t] = (changed[0, t] + 1) % c.vocab_size
            after = _run(mine, "Your model", changed)
            if not torch.allclose(after[:, :t], before[:, :t], atol=1e-6):
                raise CheckFailure(f"Changing the token at position {t} changed your logits at "
                                   f"earlier positions: the future leaks into the past")
    return (f"with course_lib's weights its logits equal DecoderLM's (to {worst:.1g}), and a "
            f"later token never changes earlier logits")


@functools.cache
def _char_data() -> tuple[int, torch.Tensor, torch.Tensor]:
    """The lecture's Shakespeare characters: vocabulary size, training and validation ids."""
    text = shakespeare_text()
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(tokenizer.encode_tensor(text), 0.1)
    return tokenizer.vocab_size, train_ids, val_ids


def bigram_val_loss(train_ids: torch.Tensor, val_ids: torch.Tensor, vocab_size: int) -> float:
    """The lecture's bigram baseline on the validation text (counts + 0.01), in nats."""
    pairs = torch.bincount(train_ids[:-1] * vocab_size + train_ids[1:],
                           minlength=vocab_size ** 2).double().view(vocab_size, vocab_size)
    p_next = (pairs + 0.01) / (pairs + 0.01).sum(1, keepdim=True)
    return float(-p_next.log()[val_ids[:-1], val_ids[1:]].mean())


class _GradientWatch:
    """Watches one parameter's gradients during training: how many backward passes reached
    it, their sum and the last one (to tell whether .grad was ever cleared)."""

    def __init__(self, param: torch.Tensor) -> None:
        self.count, self.total, self.last = 0, torch.zeros_like(param), None
        self.handle = param.register_hook(self)

    def __call__(self, grad: torch.Tensor) -> None:
        self.count += 1
        self.total += grad.detach()
        self.last = grad.detach().clone()


class _CountedBatches:
    """The check's batches, counting how often the learner's loop draws one."""

    def __init__(self, batches: Callable[[], dict]) -> None:
        self.batches, self.calls = batches, 0

    def __call__(self) -> dict:
        self.calls += 1
        return self.batches()


def _missed_bar_reason(calls: int, logits: torch.Tensor, val: dict, val_loss: float
                       ) -> str | None:
    """Why a loop that updates the weights still leaves a high validation loss, when the
    evidence names it: too few batches drawn, or a model that learned to predict another
    token than the next one (targets shifted twice, or not at all)."""
    if calls < GPT_TRAIN_UPDATES:
        many = "ONE batch" if calls == 1 else f"only {calls} batches"
        return (f"your loop trains on {many} for {GPT_TRAIN_UPDATES} updates: the model "
                "learns those windows by heart instead of the language. Draw a new batch "
                "every step: batch = batches() inside the loop")
    vocab_size, ids, targets = logits.shape[-1], val["ids"], val["targets"]
    after_next = float(F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size),
                                       targets[:, 1:].reshape(-1)))
    current = float(F.cross_entropy(logits.reshape(-1, vocab_size), ids.reshape(-1)))
    if after_next < val_loss - 0.2:
        return (f"your model learned to predict the token AFTER the next one (its validation "
                f"loss for that token is {after_next:.2f} nats, for the next one "
                f"{val_loss:.2f}): the targets were shifted twice. batch['targets'] is already "
                "shifted: compare the logits at every position t with targets at t, "
                "F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1)), with no "
                "[:, :-1] / [:, 1:]")
    if current < val_loss - 0.2:
        return (f"your model learned to predict the token it reads, at its own position (its "
                f"validation loss for that token is {current:.2f} nats, for the next one "
                f"{val_loss:.2f}): the loss compared the logits with the ids, or with targets "
                "shifted back. batch['targets'] holds the next tokens: compare the logits at "
                "every position t with targets at t")
    return None


def train_and_validate(my_gpt_class: Callable, train_fn: Callable, *,
                       seed: int = 0) -> tuple[float, str | None, str | None]:
    """Part (b): build the learner's model (seeded), train it with the learner's loop on the
    Shakespeare characters and return (validation loss, what is wrong with the loop or None,
    why the loss is high when the evidence names it or None).
    """
    vocab_size, train_ids, val_ids = _char_data()
    with torch.random.fork_rng(devices=[]):  # leave the learner's random stream alone
        torch.manual_seed(seed)
        case = Case("the training model", kwargs=dict(vocab_size=vocab_size, **GPT_TRAIN_SIZES))
        model = call_learner(my_gpt_class, case, fn_name="MyGPT")
        batches = _CountedBatches(lm_batches(
            train_ids, GPT_TRAIN_BATCH, GPT_TRAIN_SIZES["max_len"],
            generator=torch.Generator().manual_seed(100 + seed)))
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]
        watch = _GradientWatch(dict(model.named_parameters())["head.weight"])
        try:
            losses = _run(train_fn, "train_my_gpt", model, batches, GPT_TRAIN_UPDATES,
                          GPT_TRAIN_LR)
        finally:
            watch.handle.remove()
        val = lm_batches(val_ids, 128, GPT_TRAIN_SIZES["max_len"],
                         generator=torch.Generator().manual_seed(2))()
        model.eval()
        with torch.no_grad():
            logits = _run(model, "Your model", val["ids"])
            val_loss = float(F.cross_entropy(logits.reshape(-1, vocab_size),
                                             val["targets"].reshape(-1)))
    problem = None
    if watch.count == 0:
        problem = ("Your loop never calls loss.backward(): without it no gradient is "
                   "computed and the weights cannot learn")
    elif all(torch.equal(a, p.detach()) for a, p in zip(start, params, strict=True)):
        problem = ("Your loop never changed the weights: after loss.backward(), call "
                   "optimizer.step() (with an optimizer built on model.parameters())")
    elif (watch.count > 1 and model.head.weight.grad is not None
          and torch.allclose(model.head.weight.grad, watch.total, atol=1e-6, rtol=1e-4)
          and not torch.allclose(watch.total, watch.last, atol=1e-6, rtol=1e-4)):
        problem = (f"Your loop never clears the gradients: after {watch.count} updates each "
                   "parameter's .grad holds the SUM of every update's gradient, because "
                   "backward() adds to .grad. Call optimizer.zero_grad() before each "
                   "loss.backward()")
    elif not isinstance(losses, Sequence) or len(losses) != GPT_TRAIN_UPDATES:
        problem = (f"train_my_gpt returned {describe(losses)}"
                   + (f" of length {len(losses)}" if isinstance(losses, Sequence) else "")
                   + f": return the list of its {GPT_TRAIN_UPDATES} training losses, one "
                   "float per update (loss.item())")
    else:
        for loss in losses:
            require_real(loss, "Each training loss in the list")
    reason = None if val_loss < GPT_LOSS_BAR else _missed_bar_reason(batches.calls, logits,
                                                                     val, val_loss)
    return val_loss, problem, reason


def check_my_gpt(my_gpt_class: Callable, train_fn: Callable) -> None:
    """Check the capstone: ``MyGPT(vocab_size, d_model, n_heads, n_layers, max_len)`` (a GPT
    with the exercise's parameter names, logits (B, T, V) from ids (B, T)) and
    ``train_my_gpt(model, batches, n_updates, lr)`` (a training loop returning its losses).

    (a) course_lib's DecoderLM weights copied in give its logits, and the model is causal;
    a difference is located (embeddings, a block's attention or wiring, the final norm);
    (b) trained for GPT_TRAIN_UPDATES updates on Shakespeare's characters, the validation
    loss falls below GPT_LOSS_BAR; a loop that never steps or never clears the gradients is
    named, and so, when the bar is missed, is one that trains on one batch or whose model
    learned another token than the next (targets shifted twice, or not at all).

    Args:
        my_gpt_class: the learner's model class (or any function building the model).
        train_fn: the learner's training loop.
    """
    parity = _gpt_parity(my_gpt_class)
    val_loss, problem, reason = train_and_validate(my_gpt_class, train_fn)
    _, train_ids, val_ids = _char_data()
    bigram = bigram_val_loss(train_ids, val_ids, _char_data()[0])
    measured = (f"validation loss after {GPT_TRAIN_UPDATES} updates: {val_loss:.3f} (the bar: "
                f"{GPT_LOSS_BAR}; the bigram model: {bigram:.2f})")
    if problem is not None:
        raise CheckFailure(f"Your model is right ({parity}), but {problem[0].lower()}"
                           f"{problem[1:]}.\n{measured}")
    if not val_loss < GPT_LOSS_BAR and reason is not None:
        raise CheckFailure(f"Your model is right ({parity}) and your loop updates the weights "
                           f"and clears the gradients, but {reason}.\n{measured}")
    if not val_loss < GPT_LOSS_BAR:
        raise CheckFailure(
            f"Your model is right ({parity}) and your loop updates the weights and clears the "
            f"gradients, but the model did not learn enough: {measured}. Use "
            f"torch.optim.AdamW(model.parameters(), lr=lr) and the loss F.cross_entropy of "
            f"the (B * T, V) logits against the (B * T,) targets of each batch")
    low, high = GPT_BOOK_RANGE
    print(f"\u2705 MyGPT and train_my_gpt are correct: {parity}; {measured}, the book's "
          f"solution reached {low} to {high} over 6 seeds")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
