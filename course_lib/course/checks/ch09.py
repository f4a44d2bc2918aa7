"""Checks for chapter 09, training Transformers: the language-model loss with shifted targets,
the sampling distribution (temperature, top-k, top-p), a greedy decoding loop for an
encoder-decoder, a planted bug in the alignment score of cross-attention, one step of attention
with a key/value cache, and a prediction of the cache's bytes per token."""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from course_lib.attention import scaled_dot_product_attention
from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig, EncoderDecoderConfig
from course_lib.generation import generate_seq2seq, next_token_probs
from course_lib.metrics import alignment_score
from course_lib.models import DecoderLM, EncoderDecoder, lm_loss
from course_lib.tokenizer import IGNORE_INDEX

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
)

# --------------------------------------------------------------------------------------------
# Exercise 9.1: next_token_loss(logits, ids)


def _flat_ce(logits: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **kwargs)


def _reference_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return lm_loss(logits[:, :-1], ids[:, 1:])  # position t predicts token t + 1


LOSS_MISTAKES = [
    Misconception(
        lambda logits, ids: _flat_ce(logits, ids),
        "Your loss scores each position against its own input token, so the model would learn "
        "to copy its input. The target of position t is the NEXT token, ids[:, t + 1]: use "
        "logits[:, :-1] (the last position has no next token) against ids[:, 1:]",
    ),
    Misconception(
        lambda logits, ids: _flat_ce(logits[:, 1:], ids[:, :-1]),
        "Your targets are shifted the wrong way: logits[:, 1:] against ids[:, :-1] asks "
        "position t + 1 to predict token t, the past. Use logits[:, :-1] against ids[:, 1:]",
    ),
    Misconception(
        lambda logits, ids: _flat_ce(logits, torch.roll(ids, -1, dims=1)),
        "Your targets are ids rolled by one: the last position's target wraps around to the "
        "first token of the sequence, which does not follow it. Drop the last position "
        "instead: logits[:, :-1] against ids[:, 1:]",
    ),
    Misconception(
        lambda logits, ids: _flat_ce(logits[:, :-1], ids[:, 1:], reduction="sum"),
        "Your loss is the sum over all positions, not the mean: its size would grow with the "
        "batch and the sequence length (and so would the gradients). Average it "
        "(F.cross_entropy's default reduction='mean')",
    ),
    Misconception(
        lambda logits, ids: _flat_ce(logits[:, :-1], ids[:, 1:], reduction="sum")
        / logits.shape[0],
        "Your loss is the sum over positions averaged over the batch only: average over "
        "every scored position (batch and time)",
    ),
    Misconception(
        lambda logits, ids: _flat_ce(torch.softmax(logits[:, :-1], -1), ids[:, 1:]),
        "You applied a softmax before F.cross_entropy, which applies log-softmax itself: "
        "pass the raw logits",
    ),
    Misconception(
        lambda logits, ids: F.nll_loss(torch.softmax(logits[:, :-1], -1).reshape(
            -1, logits.shape[-1]), ids[:, 1:].reshape(-1)),
        "You passed probabilities to F.nll_loss, which expects log-probabilities (its loss "
        "is minus the value at the target): use F.cross_entropy on the logits, or "
        "F.nll_loss on F.log_softmax(logits, -1)",
    ),
]


def _loss_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(901)

    def ids(b: int, t: int, v: int) -> torch.Tensor:
        return torch.randint(0, v, (b, t), generator=gen)

    return [
        Case("B=2, T=6, V=7", (rand(gen, 2, 6, 7, scale=2.0), ids(2, 6, 7))),
        Case("one sequence, T=2 (a single prediction)", (rand(gen, 1, 2, 5, scale=2.0),
                                                         ids(1, 2, 5))),
        Case("B=3, T=10, V=30, confident logits", (rand(gen, 3, 10, 30, scale=4.0),
                                                   ids(3, 10, 30)),
             hint="F.cross_entropy wants (N, V) logits and (N,) targets: flatten the batch and "
                  "time dimensions with .reshape(-1, V) and .reshape(-1)"),
        Case("B=4, T=3, V=2", (rand(gen, 4, 3, 2, scale=2.0), ids(4, 3, 2))),
    ]


def check_next_token_loss(next_token_loss: Callable) -> None:
    """Check ``next_token_loss(logits, ids)`` -> the mean cross-entropy of predicting
    ``ids[:, t + 1]`` from ``logits[:, t]`` (a 0-D tensor).

    Args:
        next_token_loss: the learner's function of logits (B, T, V) and ids (B, T).
    """

    def check_one(got: Any, case: Case) -> None:
        logits, ids = case.args
        if isinstance(got, float):
            got = torch.tensor(got)
        compare_tensors(got, _reference_loss(logits, ids), case, what="Your loss",
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
        _greedy(read=0),
        "You took the argmax of the logits at the FIRST decoder position at every step: the "
        "next token is predicted by the last position, logits[:, -1]",
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


def check_greedy_decode(greedy_decode: Callable) -> None:
    """Check ``greedy_decode(model, src, bos_id, eos_id, max_new_tokens)`` -> (B, 1 + n)
    token ids, equal to :func:`course_lib.generation.generate_seq2seq`'s greedy output.

    Args:
        greedy_decode: the learner's function.
    """

    def check_one(got: Any, case: Case) -> None:
        model, src, bos_id, eos_id, max_new = case.args
        expected = generate_seq2seq(model, src, bos_id=bos_id, eos_id=eos_id,
                                    max_new_tokens=max_new)
        if isinstance(got, torch.Tensor) and got.dtype.is_floating_point:
            raise CheckFailure(f"Your output has dtype {got.dtype}: return token ids (a long "
                               f"tensor), e.g. from argmax (case '{case.name}')")
        compare_tensors(got, expected, case, what="Your decoded ids",
                        misconceptions=GREEDY_MISTAKES, atol=0.0, rtol=0.0)

    run_cases("greedy_decode", greedy_decode, _greedy_cases(), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 9.4: alignment_score(weights, alignment), a planted bug fixed


def _hits(weights: torch.Tensor, alignment: torch.Tensor, peaks: torch.Tensor) -> torch.Tensor:
    return ((peaks == alignment) & (alignment != IGNORE_INDEX)).sum()


def _scored(alignment: torch.Tensor) -> torch.Tensor:
    return (alignment != IGNORE_INDEX).sum()


def _gold_weight(weights: torch.Tensor, alignment: torch.Tensor) -> torch.Tensor:
    index = alignment.clamp_min(0)[..., None]
    return weights.gather(-1, index)[..., 0]  # (..., T): the weight on the gold position


ALIGNMENT_MISTAKES = [
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
INSTRUMENT = ("The instrument that finds this: score a perfect head (the gold alignment as "
              "one-hot weights, <eos> and padding included), which must get exactly 1.0, and "
              "compare with course_lib.metrics.alignment_score on a few batches")


def _alignment_cases() -> list[Case]:
    gen = torch.Generator().manual_seed(905)

    def weights(*shape: int, sharp: float = 3.0) -> torch.Tensor:
        return torch.softmax(rand(gen, *shape, scale=sharp), -1)

    w1 = weights(3, 6, 6)  # T == S, so an argmax over the wrong axis has the right shape
    gold1 = torch.where(torch.rand(3, 6, generator=gen) < 0.6, w1.argmax(-1),
                        torch.randint(0, 6, (3, 6), generator=gen))
    gold1[:, -1] = IGNORE_INDEX  # <eos>
    gold1[2, 3:] = IGNORE_INDEX  # a short sentence, padded
    w2 = weights(5, 7)
    gold2 = w2.argmax(-1).clone()
    gold2[1] = (gold2[1] + 1) % 7
    w3 = weights(2, 4, 5, sharp=0.5)  # flat attention: every peak is weak
    gold3 = w3.argmax(-1).clone()
    gold3[0, 0] = IGNORE_INDEX
    perfect_gold = gold1.clone()
    perfect = F.one_hot(perfect_gold.clamp_min(0), 6).float()  # the gold alignment as weights
    return [
        Case(PERFECT_HEAD, (perfect, perfect_gold)),
        Case("batch (3, T=6, S=6) with unscored positions", (w1, gold1)),
        Case("one sentence (T=5, S=7), unbatched", (w2, gold2),
             hint="work with the last dimension (dim=-1) so that (T, S) and (B, T, S) both work"),
        Case("flat attention, every peak on the gold position", (w3, gold3)),
        Case("no peak on the gold position", (w2, (w2.argmax(-1) + 3) % 7)),
    ]


def check_alignment_score(alignment_score_fn: Callable) -> None:
    """Check ``alignment_score(weights, alignment)`` -> a float: the share of the target
    positions with a gold source position (alignment != -100) whose largest attention weight
    is on that position. Any correct fix of the planted bug passes; a tensor is refused.

    Args:
        alignment_score_fn: the learner's function of weights (..., T, S) and alignment (..., T).
    """

    def check_one(got: Any, case: Case) -> None:
        expected = alignment_score(*case.args)
        if isinstance(got, numbers.Integral) and not isinstance(got, bool):
            _name_alignment_mistake(float(got), expected, case)  # e.g. the count of hits
        got = require_real(got, "Your score", case)
        if math.isclose(got, expected, abs_tol=1e-6):
            return
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
            raise CheckFailure(f"{m.message} (seen on the case '{case.name}'). {INSTRUMENT}")


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
# Exercise 9.6: predict the key/value cache's bytes per token

CACHE_CONFIG = DecoderConfig(vocab_size=65, d_model=96, n_heads=6, n_layers=3, max_len=128)


def _cache_mistakes(c: DecoderConfig) -> dict[int, str]:
    d_head, n = c.d_model // c.n_heads, c.n_layers
    return {
        n * c.d_model * 4: "You counted the keys only (or the values only): the cache keeps both, "
                           "one key and one value vector per token, per layer",
        2 * c.d_model * 4: "You counted one layer: every self-attention layer keeps its own keys "
                           "and values",
        2 * n * c.d_model: "You counted numbers, not bytes: each float32 takes 4 bytes",
        2 * n * d_head * 4: "You counted one head: a layer caches H heads of Dh numbers, "
                            "H * Dh = d_model of them per key",
        2 * n * c.d_model * c.n_heads * 4: "You multiplied by the number of heads twice: the "
                                           "H heads of Dh numbers together are d_model numbers",
        2 * n * c.d_model * 32: "You counted bits: a byte is 8 bits, a float32 4 bytes",
    }


def measure_cache_bytes_per_token(config: DecoderConfig = CACHE_CONFIG,
                                  n_tokens: int = 16) -> int:
    """Run a prompt through a DecoderLM with a KVCache and divide the bytes of every cached
    key and value tensor by the number of tokens (batch 1)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = DecoderLM(config).eval()
    finally:
        torch.random.set_rng_state(state)  # leave the learner's random stream alone
    cache = KVCache()
    with torch.no_grad():
        model(torch.zeros(1, n_tokens, dtype=torch.long), past_key_values=cache)
    total = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    return total // n_tokens


def check_kv_cache_bytes(predict_bytes_per_token: Callable) -> None:
    """Check ``predict_bytes_per_token()`` -> an int: the bytes the key/value cache of a
    float32 ``DecoderLM(CACHE_CONFIG)`` grows by per token (batch 1); then show the
    measurement.

    Args:
        predict_bytes_per_token: the learner's function, no arguments.
    """
    case = Case("DecoderConfig(d_model=96, n_heads=6, n_layers=3), float32, batch 1")
    got = require_count(call_learner(predict_bytes_per_token, case),
                         "Your prediction (a number of bytes)")
    measured = measure_cache_bytes_per_token()
    c = CACHE_CONFIG
    shown = (f"measured: {measured:,} bytes per token = {c.n_layers} layers x 2 (keys and "
             f"values) x {c.n_heads} heads x {c.d_model // c.n_heads} numbers x 4 bytes")
    if got != measured:
        message = _cache_mistakes(c).get(got, "Count the tensors a layer caches for one token, "
                                              "how many numbers each holds, and their size")
        raise CheckFailure(f"Your prediction is {got:,} bytes per token. {message}.\n{shown}")
    print(f"\u2705 your prediction, {got:,} bytes per token, is right; {shown}")
