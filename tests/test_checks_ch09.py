"""The chapter 09 checks: each must accept every correct formulation, reject plausible wrong
answers with a message naming the mistake, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub
from torch import nn

from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch09 import (
    CACHE_CONFIG,
    PROBS_MISTAKES,
    TIE_CASE,
    _probs_cases,
    check_alignment_score,
    check_attend_with_cache,
    check_greedy_decode,
    check_kv_cache_bytes,
    check_my_gpt,
    check_next_token_loss,
    check_next_token_probs,
    gpt_name,
    measure_generation_cache,
)
from course_lib.generation import next_token_probs


@pytest.mark.parametrize("check", [check_next_token_loss, check_next_token_probs,
                                   check_greedy_decode, check_alignment_score,
                                   check_attend_with_cache, check_kv_cache_bytes])
def test_an_unsolved_stub_fails_as_itself(check):
    stubs = (stub, stub) if check is check_alignment_score else (stub,)
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(*stubs)


# --------------------------------------------------------------------- 9.1 next_token_loss


def loss_ignore_index(logits, ids, pad_id):
    vocab = logits.shape[-1]
    targets = ids[:, 1:].reshape(-1)
    targets = targets.masked_fill(targets == pad_id, -100)
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets)  # -100 is the default


def loss_selected(logits, ids, pad_id):
    keep = ids[:, 1:] != pad_id  # (B, T-1)
    return F.cross_entropy(logits[:, :-1][keep], ids[:, 1:][keep])  # (N, V) and (N,)


def loss_masked_mean(logits, ids, pad_id):
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    keep = (ids[:, 1:] != pad_id).float()
    return (losses * keep).sum() / keep.sum()


def loss_loop(logits, ids, pad_id):
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(ids.shape[1] - 1):
            if ids[b, t + 1] != pad_id:
                total = total - torch.log_softmax(logits[b, t], -1)[ids[b, t + 1]]
                count += 1
    return total / count


def loss_float(logits, ids, pad_id):
    return loss_selected(logits, ids, pad_id).item()


@pytest.mark.parametrize("fn", [loss_ignore_index, loss_selected, loss_masked_mean, loss_loop,
                                loss_float])
def test_next_token_loss_accepts_correct_answers(fn, capsys):
    check_next_token_loss(fn)
    assert "next_token_loss is correct" in capsys.readouterr().out


def _flat(logits, ids, **kw):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1), **kw)


def _real(ids, pad_id):
    return ids.masked_fill(ids == pad_id, -100)


def _kept_losses(lg, ids, keep):
    return F.cross_entropy(lg.transpose(1, 2), ids, reduction="none") * keep


WRONG_LOSS = {
    "not shifted": (lambda lg, ids, p: _flat(lg, _real(ids, p)), "own input token"),
    "shifted backwards": (lambda lg, ids, p: _flat(lg[:, 1:], _real(ids[:, :-1], p)),
                          "the wrong way"),
    "rolled": (lambda lg, ids, p: _flat(lg, _real(torch.roll(ids, -1, 1), p)),
               "wraps around"),
    "padding scored": (lambda lg, ids, p: _flat(lg[:, :-1], ids[:, 1:]),
                       "target is padding"),
    "input mask": (lambda lg, ids, p: _kept_losses(lg[:, :-1], ids[:, 1:], ids[:, :-1] != p)
                   .sum() / (ids[:, :-1] != p).sum(), "INPUT is a real token"),
    "divided by every position": (lambda lg, ids, p: _kept_losses(
        lg[:, :-1], ids[:, 1:], ids[:, 1:] != p).mean(), "divided by every position"),
    "mean of sequence means": (lambda lg, ids, p: torch.stack([
        loss_masked_mean(lg[b:b + 1], ids[b:b + 1], p) for b in range(len(ids))]).mean(),
        "averaged each sequence"),
    "sum": (lambda lg, ids, p: _flat(lg[:, :-1], _real(ids[:, 1:], p), reduction="sum"),
            "sum over the scored"),
    "batch mean of sums": (lambda lg, ids, p: _flat(lg[:, :-1], _real(ids[:, 1:], p),
                                                    reduction="sum") / lg.shape[0],
                           "averaged over the batch only"),
    "softmax first": (lambda lg, ids, p: _flat(torch.softmax(lg[:, :-1], -1),
                                               _real(ids[:, 1:], p)),
                      "applies log-softmax itself"),
    "3-D cross_entropy": (lambda lg, ids, p: F.cross_entropy(lg[:, :-1], _real(ids[:, 1:], p)),
                          "raised"),
    "per-position losses": (lambda lg, ids, p: _flat(lg[:, :-1], ids[:, 1:], reduction="none"),
                            "should have shape \\(\\)"),
    "a list": (lambda lg, ids, p: [1.0], "should be a tensor"),
}


@pytest.mark.parametrize("name", list(WRONG_LOSS))
def test_next_token_loss_rejects_wrong_answers(name):
    fn, message = WRONG_LOSS[name]
    with pytest.raises(CheckFailure, match=message):
        check_next_token_loss(fn)


def test_a_sequence_without_a_scored_position_is_named():
    from course_lib.course.checks.ch09 import ONE_TOKEN, _loss_cases
    case = next(c for c in _loss_cases() if c.name == ONE_TOKEN)

    def nan_on_that_case(lg, ids, p):
        if lg.shape == case.args[0].shape and torch.equal(ids, case.args[1]):
            return torch.tensor(float("nan"))
        return loss_selected(lg, ids, p)

    with pytest.raises(CheckFailure, match="divides 0 by 0"):
        check_next_token_loss(nan_on_that_case)


# --------------------------------------------------------------------- 9.2 next_token_probs


def probs_sort_scatter(logits, temperature=1.0, top_k=None, top_p=None):
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def probs_loops(logits, temperature=1.0, top_k=None, top_p=None):
    out = torch.zeros_like(logits)
    for b in range(logits.shape[0]):
        row = [float(x) / temperature for x in logits[b]]
        ranked = sorted(range(len(row)), key=lambda i: -row[i])
        kept = ranked if top_k is None else ranked[:top_k]
        z = sum(math.exp(row[i]) for i in kept)
        if top_p is not None:
            chosen, mass = [], 0.0
            for i in kept:
                chosen.append(i)
                mass += math.exp(row[i]) / z
                if mass >= top_p:
                    break
            kept = chosen
        total = sum(math.exp(row[i]) for i in kept)
        for i in kept:
            out[b, i] = math.exp(row[i]) / total
    return out


def probs_power(logits, temperature=1.0, top_k=None, top_p=None):
    """Raising softmax probabilities to 1/T and renormalising equals softmax(logits / T)."""
    probs = torch.softmax(logits, -1) ** (1.0 / temperature)
    probs = probs / probs.sum(-1, keepdim=True)
    if top_k is not None:
        kth = torch.topk(probs, top_k, -1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p is not None:  # Hugging Face's rule: drop the least likely while their mass <= 1 - p
        sorted_probs, order = probs.sort(-1, descending=False)
        remove = sorted_probs.cumsum(-1) <= 1 - top_p
        remove[:, -1] = False  # the most likely token always stays
        probs = probs.masked_fill(remove.scatter(-1, order, remove), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


@pytest.mark.parametrize("fn", [probs_sort_scatter, probs_loops, probs_power])
def test_next_token_probs_accepts_correct_answers(fn, capsys):
    check_next_token_probs(fn)
    assert "next_token_probs is correct" in capsys.readouterr().out


def test_the_top_p_cases_stay_clear_of_rounding_ties_except_the_exact_one():
    for case in _probs_cases():
        top_p = case.kwargs["top_p"]
        if top_p is None or top_p >= 1:
            continue
        if case.name == TIE_CASE:  # exact in binary: the mass before the 2nd token IS top_p
            probs = torch.softmax(case.args[0], -1).sort(-1, descending=True).values
            assert (probs[:, 0] == top_p).all() and (probs[:, 1:] == 0.25).all()
            assert (next_token_probs(case.args[0], top_p=top_p).max(-1).values == 1).all()
            continue
        probs = torch.softmax(case.args[0] / case.kwargs["temperature"], -1)
        sorted_probs = probs.sort(-1, descending=True).values
        before = sorted_probs.cumsum(-1) - sorted_probs
        assert ((before - top_p).abs() > 1e-3).all(), case.name


def _top_p_exclusive(logits, temperature=1.0, top_k=None, top_p=None):
    probs = probs_sort_scatter(logits, temperature, top_k, None)
    if top_p is None:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)
    keep = sorted_probs.cumsum(-1) <= top_p
    keep[:, 0] = True
    probs = probs * torch.zeros_like(keep).scatter(-1, order, keep)
    return probs / probs.sum(-1, keepdim=True)


def _top_p_keeps_tie(logits, temperature=1.0, top_k=None, top_p=None):
    """Keeps a token while the mass before it is <= p: one token too many at an exact tie."""
    probs = probs_sort_scatter(logits, temperature, top_k, None)
    if top_p is None:
        return probs
    sorted_probs, order = probs.sort(-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs <= top_p
    probs = probs * torch.zeros_like(keep).scatter(-1, order, keep)
    return probs / probs.sum(-1, keepdim=True)


def _top_p_unnormalised(logits, temperature=1.0, top_k=None, top_p=None):
    kept = probs_sort_scatter(logits, temperature, top_k, top_p) > 0
    return torch.softmax(logits / temperature, -1) * kept


WRONG_PROBS = {
    "softmax before temperature": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: probs_sort_scatter(
            logits, 1.0, top_k, top_p), "temperature had no effect"),
    "probabilities divided by T": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: torch.softmax(logits, -1)
        / temperature, "divided the probabilities"),
    "logits times T": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: probs_sort_scatter(
            logits * temperature, 1.0, top_k, top_p), "multiplied the logits"),
    "top-k keeps k + 1": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: probs_sort_scatter(
            logits, temperature, None if top_k is None else min(top_k + 1, logits.shape[-1]),
            top_p), "k \\+ 1 tokens"),
    "top-p drops the crossing token": (_top_p_exclusive, "stops before the token"),
    "top-p keeps the token after an exact tie": (_top_p_keeps_tie, "equals p exactly"),
    "top-k skipped": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: probs_sort_scatter(
            logits, temperature, None, top_p), "ignores top_k"),
    "top-p skipped": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: probs_sort_scatter(
            logits, temperature, top_k, None), "ignores top_p"),
    "not renormalised": (_top_p_unnormalised, "do not sum to 1"),
    "top-p before top-k": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: _then_top_k(
            probs_sort_scatter(logits, temperature, None, top_p), top_k),
        "top-p before top-k"),
    "unsorted cumsum": (
        lambda logits, temperature=1.0, top_k=None, top_p=None: _unsorted(
            logits, temperature, top_k, top_p), "vocabulary order"),
    "logits returned": (lambda logits, temperature=1.0, top_k=None, top_p=None:
                        logits / temperature, "wrong values"),
}


def _then_top_k(probs, top_k):
    if top_k is None:
        return probs
    kth = torch.topk(probs, top_k, -1).values[:, -1:]
    probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    return probs / probs.sum(-1, keepdim=True)


def _unsorted(logits, temperature, top_k, top_p):
    probs = probs_sort_scatter(logits, temperature, top_k, None)
    if top_p is None:
        return probs
    before = probs.cumsum(-1) - probs
    keep = before < top_p
    probs = probs * keep
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("name", list(WRONG_PROBS))
def test_next_token_probs_rejects_wrong_answers(name):
    fn, message = WRONG_PROBS[name]
    with pytest.raises(CheckFailure, match=message):
        check_next_token_probs(fn)


@pytest.mark.parametrize("index", range(len(PROBS_MISTAKES)))
def test_each_sampling_mistake_gets_its_own_message(index):
    mistake = PROBS_MISTAKES[index]
    with pytest.raises(CheckFailure) as failure:
        check_next_token_probs(mistake.wrong)
    assert str(failure.value).startswith(mistake.message)


def test_the_cases_tell_every_pair_of_sampling_mistakes_apart():
    cases = _probs_cases()

    def outputs(fn):
        return [fn(*case.args, **case.kwargs) for case in cases]

    def same(a, b):
        return all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5, rtol=1e-4)
                   for x, y in zip(a, b, strict=True))

    right = outputs(lambda logits, **kw: next_token_probs(logits, **kw))
    wrong = [outputs(m.wrong) for m in PROBS_MISTAKES]
    for i, a in enumerate(wrong):
        assert not same(a, right), PROBS_MISTAKES[i].message
        for j in range(i + 1, len(wrong)):
            assert not same(a, wrong[j]), (PROBS_MISTAKES[i].message, PROBS_MISTAKES[j].message)


# ----------------------------------------------------------------------- 9.3 greedy_decode


def greedy_plain(model, src, bos_id, eos_id, max_new_tokens):
    tgt = torch.full((src.shape[0], 1), bos_id)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    for _ in range(max_new_tokens):
        with torch.no_grad():
            next_id = model(src, tgt).logits[:, -1].argmax(-1)
        next_id[done] = eos_id
        done = done | (next_id == eos_id)
        tgt = torch.cat([tgt, next_id[:, None]], dim=1)
        if done.all():
            break
    return tgt


def greedy_lists(model, src, bos_id, eos_id, max_new_tokens):
    """Python lists, one sequence tracked at a time for the end test."""
    rows = [[bos_id] for _ in range(src.shape[0])]
    for _ in range(max_new_tokens):
        if all(eos_id in row[1:] for row in rows):
            break
        logits = model(src, torch.tensor(rows)).logits.detach()
        for b, row in enumerate(rows):
            row.append(eos_id if eos_id in row[1:] else int(logits[b, -1].argmax()))
    return torch.tensor(rows)


def greedy_library(model, src, bos_id, eos_id, max_new_tokens):
    return model.generate(src, bos_id=bos_id, eos_id=eos_id, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("fn", [greedy_plain, greedy_lists, greedy_library])
def test_greedy_decode_accepts_correct_answers(fn, capsys):
    check_greedy_decode(fn)
    assert "greedy_decode is correct" in capsys.readouterr().out


def _greedy_wrong(*, start=None, read=-1, history=True, stop="all", fill=True, keep_bos=True,
                  extra=0):
    def fn(model, src, bos_id, eos_id, max_new_tokens):
        tgt = torch.full((src.shape[0], 1), bos_id if start is None else start)
        done = torch.zeros(src.shape[0], dtype=torch.bool)
        for _ in range(max_new_tokens + extra):
            with torch.no_grad():
                logits = model(src, tgt if history else tgt[:, -1:]).logits
            next_id = logits[:, read].argmax(-1)
            if fill:
                next_id[done] = eos_id
            done = done | (next_id == eos_id)
            tgt = torch.cat([tgt, next_id[:, None]], dim=1)
            if (stop == "all" and done.all()) or (stop == "any" and done.any()):
                break
        return tgt if keep_bos else tgt[:, 1:]
    return fn


WRONG_GREEDY = {
    "no start token in the output": (_greedy_wrong(keep_bos=False), "leaves out the start"),
    "starts from padding": (_greedy_wrong(start=0), "did not start from the start token"),
    "first position's logits": (_greedy_wrong(read=0), "FIRST decoder position"),
    "only the last token": (_greedy_wrong(history=False), "only the last token"),
    "ignores eos": (_greedy_wrong(stop="never", fill=False), "ignores eos_id"),
    "no eos filling": (_greedy_wrong(fill=False), "kept generating tokens after its eos_id"),
    "stops at the first eos": (_greedy_wrong(stop="any"), "ONE sequence"),
    "one step too many": (_greedy_wrong(extra=1), "one token too many"),
    "one step too few": (_greedy_wrong(extra=-1), "one token too few"),
    "float ids": (lambda *a: greedy_plain(*a).float(), "return token ids"),
}


def greedy_hoisted(model, src, bos_id, eos_id, max_new_tokens):
    """The model called once, before the loop: every step reuses the first logits."""
    tgt = torch.full((src.shape[0], 1), bos_id)
    done = torch.zeros(src.shape[0], dtype=torch.bool)
    with torch.no_grad():
        logits = model(src, tgt).logits
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1)
        next_id[done] = eos_id
        done = done | (next_id == eos_id)
        tgt = torch.cat([tgt, next_id[:, None]], dim=1)
        if done.all():
            break
    return tgt


def test_greedy_decode_names_a_model_call_hoisted_out_of_the_loop():
    """Its tokens are those of reading logits[:, 0] at every step: the number of model calls
    tells the two apart, and neither is blamed for the other."""
    with pytest.raises(CheckFailure, match="called once, before the loop") as caught:
        check_greedy_decode(greedy_hoisted)
    assert "FIRST decoder position" not in str(caught.value)
    with pytest.raises(CheckFailure, match="FIRST decoder position") as caught:
        check_greedy_decode(_greedy_wrong(read=0))
    assert "before the loop" not in str(caught.value)


@pytest.mark.parametrize("name", list(WRONG_GREEDY))
def test_greedy_decode_rejects_wrong_answers(name):
    fn, message = WRONG_GREEDY[name]
    with pytest.raises(CheckFailure, match=message):
        check_greedy_decode(fn)


def test_greedy_decode_leaves_the_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_greedy_decode(greedy_plain)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------- 9.4 alignment_score


def score_masks(weights, alignment):
    scored = alignment != -100
    return ((weights.argmax(-1) == alignment) & scored).sum().item() / scored.sum().item()


def score_loop(weights, alignment):
    w, a = weights.reshape(-1, weights.shape[-1]), alignment.reshape(-1)
    hits = total = 0
    for row, gold in zip(w, a.tolist(), strict=True):
        if gold == -100:
            continue
        total += 1
        hits += int(row.argmax()) == gold
    return hits / total


def score_selected(weights, alignment):
    keep = alignment != -100
    return (weights.argmax(dim=-1)[keep] == alignment[keep]).float().mean().item()


def score_numpy(weights, alignment):
    peaks, gold = weights.argmax(-1).numpy(), alignment.numpy()
    scored = gold != -100
    return np.float32((peaks == gold)[scored].mean())  # a numpy floating


def batch_one_hot():
    alignment = torch.tensor([[0, 1, -100, -100], [0, 1, 2, 3]])  # 2 and 4 scored words
    peaks = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0]])  # right on the short one: 2 + 1 hits
    return F.one_hot(peaks, 4).float(), alignment


def batch_softmax():
    weights = torch.softmax(torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0)), -1)
    alignment = weights.argmax(-1).clone()  # every position a hit ...
    alignment[0, 2:] = -100  # ... a short sentence of 2
    alignment[1, 1:] = (alignment[1, 1:] + 1) % 6  # ... a long one with 1 hit of 5
    return weights, alignment


def buggy_alignment_score(weights, alignment):  # the planted bug of the exercise
    scored = alignment != -100
    hits = (weights.argmax(dim=-1) == alignment) & scored
    return (hits.sum(-1) / scored.sum(-1)).mean().item()


@pytest.mark.parametrize("fn", [score_masks, score_loop, score_selected, score_numpy])
@pytest.mark.parametrize("batch", [batch_one_hot, batch_softmax])
def test_alignment_score_accepts_correct_answers(fn, batch, capsys):
    check_alignment_score(fn, batch)
    out = capsys.readouterr().out
    assert "alignment_score is correct" in out and "the given function says" in out


def _gold_weight(w, a):
    return w.gather(-1, a.clamp_min(0)[..., None])[..., 0]


def _nan_mean(w, a):
    scored = a != -100
    shares = ((w.argmax(-1) == a) & scored).sum(-1) / scored.sum(-1)
    return float(shares.nanmean())


WRONG_SCORE = {
    "the planted bug, not fixed": (buggy_alignment_score, "averages each sentence's share"),
    "per-sentence shares, empty ones skipped": (_nan_mean, "averages each sentence's share"),
    "count": (lambda w, a: int(((w.argmax(-1) == a) & (a != -100)).sum()), "SHARE"),
    "all positions": (lambda w, a: float(((w.argmax(-1) == a) & (a != -100)).sum() / a.numel()),
                      "including the ones without"),
    "unscored count as hits": (lambda w, a: float(((w.argmax(-1) == a) | (a == -100))
                                                  .float().mean()), "counted the positions"),
    "argmin": (lambda w, a: score_masks(-w, a), "argmin"),
    "wrong axis": (lambda w, a: score_masks(w.transpose(-2, -1), a), "over the target positions"),
    "threshold": (lambda w, a: float(((_gold_weight(w, a) > 0.5) & (a != -100)).sum()
                                     / (a != -100).sum()), "above 0.5"),
    "soft score": (lambda w, a: float((_gold_weight(w, a) * (a != -100)).sum()
                                      / (a != -100).sum()), "averaged the weight"),
    "per-row scores": (lambda w, a: (w.argmax(-1) == a).float().mean(-1), "return a float"),
    "a 0-D tensor": (lambda w, a: torch.tensor(score_masks(w, a)), "return a float.*item"),
    "an int": (lambda w, a: int(score_masks(w, a) > 0.5), "return a float"),
    "wrong without a known mistake": (lambda w, a: score_masks(w, a) * 0.9,
                                      "course_lib.metrics.alignment_score gives.*short sentence"),
}


@pytest.mark.parametrize("name", list(WRONG_SCORE))
def test_alignment_score_rejects_wrong_answers(name):
    fn, message = WRONG_SCORE[name]
    with pytest.raises(CheckFailure, match=message):
        check_alignment_score(fn, batch_one_hot)


def test_nan_from_an_empty_sentence_is_named():
    def nan_when_a_sentence_is_empty(w, a):
        scored = a != -100
        if scored.dim() == 2 and not bool(scored.any(-1).all()):
            return float("nan")
        return score_masks(w, a)

    with pytest.raises(CheckFailure, match="divides 0 by 0"):
        check_alignment_score(nan_when_a_sentence_is_empty, batch_one_hot)


def _equal_lengths():  # every sentence has 2 scored words: both averages agree
    alignment = torch.tensor([[0, 1, -100], [0, 1, -100]])
    return F.one_hot(torch.tensor([[0, 1, 0], [0, 0, 0]]), 3).float(), alignment


WRONG_BATCH = {
    "equal lengths": (_equal_lengths, "agree"),
    "one sentence": (lambda: (batch_one_hot()[0][1], batch_one_hot()[1][1]), "single sentence"),
    "shapes differ": (lambda: (batch_one_hot()[0], batch_one_hot()[1][:, :3]), "same B and T"),
    "float alignment": (lambda: (batch_one_hot()[0], batch_one_hot()[1].float()), "long tensor"),
    "position outside the source": (lambda: (batch_one_hot()[0], batch_one_hot()[1] * 2),
                                     "source positions 0 .. 3"),
    "nothing scored": (lambda: (batch_one_hot()[0], torch.full((2, 4), -100)),
                       "at least one scored"),
    "one tensor": (lambda: batch_one_hot()[0], "two tensors"),
}


@pytest.mark.parametrize("name", list(WRONG_BATCH))
def test_exposing_batch_rejects_batches_that_expose_nothing(name):
    fn, message = WRONG_BATCH[name]
    with pytest.raises(CheckFailure, match=message):
        check_alignment_score(score_masks, fn)


def test_an_unsolved_exposing_batch_fails_as_itself():
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_alignment_score(score_masks, stub)


# -------------------------------------------------------------------- 9.5 attend_with_cache


def step_tril(q, k_new, v_new, k_cache, v_cache):
    k_all = torch.cat([k_cache, k_new], dim=-2)
    v_all = torch.cat([v_cache, v_new], dim=-2)
    n_new, n_keys = q.shape[-2], k_all.shape[-2]
    mask = torch.tril(torch.ones(n_new, n_keys, dtype=torch.bool), diagonal=n_keys - n_new)
    scores = q @ k_all.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return weights @ v_all, k_all, v_all


def step_sdpa(q, k_new, v_new, k_cache, v_cache):
    from torch.nn.attention.bias import causal_lower_right

    k_all = torch.cat([k_cache, k_new], dim=-2)
    v_all = torch.cat([v_cache, v_new], dim=-2)
    mask = causal_lower_right(q.shape[-2], k_all.shape[-2])
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask), k_all, v_all


def step_positions(q, k_new, v_new, k_cache, v_cache):
    past = k_cache.shape[-2]
    k_all, v_all = torch.cat([k_cache, k_new], -2), torch.cat([v_cache, v_new], -2)
    query_pos = past + torch.arange(q.shape[-2])
    allowed = torch.arange(k_all.shape[-2])[None, :] <= query_pos[:, None]
    out, _ = torch.nn.functional.scaled_dot_product_attention(
        q, k_all, v_all, attn_mask=allowed), None
    return out, k_all, v_all


@pytest.mark.parametrize("fn", [step_tril, step_sdpa, step_positions])
def test_attend_with_cache_accepts_correct_answers(fn, capsys):
    check_attend_with_cache(fn)
    assert "attend_with_cache is correct" in capsys.readouterr().out


def _step_wrong(mask="lower", shift=0, order="old", use_new=True, scaled=True):
    def fn(q, k_new, v_new, k_cache, v_cache):
        pairs = [(k_cache, v_cache), (k_new, v_new)]
        if order == "new":
            pairs.reverse()
        k_all = torch.cat([p[0] for p in pairs], -2)
        v_all = torch.cat([p[1] for p in pairs], -2)
        keys, values = (k_all, v_all) if use_new else (k_cache, v_cache)
        t, s = q.shape[-2], keys.shape[-2]
        ones = torch.ones(t, s, dtype=torch.bool)
        if not use_new:  # the cached keys are all in the past: nothing to mask
            return torch.softmax(q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                                 -1) @ values, k_all, v_all
        allowed = {"lower": torch.tril(ones, s - t + shift), "top_left": torch.tril(ones),
                   "none": ones}[mask]
        scale = 1 / math.sqrt(q.shape[-1]) if scaled else 1.0
        scores = (q @ keys.transpose(-2, -1) * scale).masked_fill(~allowed, float("-inf"))
        return torch.softmax(scores, -1) @ values, k_all, v_all
    return fn


def step_is_causal(q, k_new, v_new, k_cache, v_cache):
    k_all, v_all = torch.cat([k_cache, k_new], -2), torch.cat([v_cache, v_new], -2)
    return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True), k_all, v_all


WRONG_STEP = {
    "is_causal=True (top-left)": (step_is_causal, "FIRST keys"),
    "tril without diagonal": (_step_wrong(mask="top_left"), "FIRST keys"),
    "misses itself": (_step_wrong(shift=-1), "misses its own key"),
    "sees the next token": (_step_wrong(shift=1), "also sees the next new token"),
    "no mask": (_step_wrong(mask="none"), "including the ones after them"),
    "attends before appending": (_step_wrong(use_new=False), "only to the cached keys"),
    "unscaled": (_step_wrong(scaled=False), "not scaled"),
    "new keys first": (_step_wrong(order="new"), "new keys in front"),
    "returns only out": (lambda *a: step_tril(*a)[0], "should return \\(out, k_all, v_all\\)"),
    "concatenated on the feature axis": (
        lambda q, kn, vn, kc, vc: (step_tril(q, kn, vn, kc, vc)[0], torch.cat([kc, kn], -1),
                                   torch.cat([vc, vn], -1)), "dim=-2"),
}


@pytest.mark.parametrize("name", list(WRONG_STEP))
def test_attend_with_cache_rejects_wrong_answers(name):
    fn, message = WRONG_STEP[name]
    with pytest.raises(CheckFailure, match=message):
        check_attend_with_cache(fn)


def test_checks_do_not_touch_the_learners_inputs():
    def in_place(q, k_new, v_new, k_cache, v_cache):
        q /= 2
        return step_tril(q * 2, k_new, v_new, k_cache, v_cache)

    with pytest.raises(CheckFailure, match="changed its input 'q' in place"):
        check_attend_with_cache(in_place)



# ------------------------------------------------------------ 9.6 predict the cache's bytes


def bytes_from_config():
    c = CACHE_CONFIG
    positions = 12 + 8 - 1  # the last new token is never fed
    return 2 * c.n_layers * c.d_model * 2 * 4 * positions  # keys and values, bfloat16, batch 4


def bytes_per_head():
    c = CACHE_CONFIG
    bytes_per_number = torch.finfo(torch.bfloat16).bits // 8
    per_layer = 2 * 4 * c.n_heads * (c.d_model // c.n_heads) * bytes_per_number  # (B, H, ., Dh)
    return c.n_layers * per_layer * (12 + 7)


@pytest.mark.parametrize("fn", [bytes_from_config, bytes_per_head, lambda: np.int64(87552)])
def test_kv_cache_bytes_accepts_correct_answers(fn, capsys):
    check_kv_cache_bytes(fn)
    out = capsys.readouterr().out
    assert "is right" in out and "measured when generate returns: 87,552 bytes" in out
    assert "19 positions" in out


def test_the_measurement_is_the_cache_of_course_libs_generate():
    total, positions = measure_generation_cache()
    assert positions == 12 + 8 - 1
    c = CACHE_CONFIG
    assert total == 2 * c.n_layers * 4 * positions * c.d_model * 2


RIGHT_BYTES = 87552
PER_POSITION = RIGHT_BYTES // (4 * 19)
WRONG_BYTES = {
    "every output token": (lambda: PER_POSITION * 4 * 20, "never fed to the model"),
    "prompt only": (lambda: PER_POSITION * 4 * 12, "prompt only"),
    "new tokens only": (lambda: PER_POSITION * 4 * 8, "new tokens only"),
    "max_len": (lambda: PER_POSITION * 4 * 128, "reserves nothing"),
    "one sequence": (lambda: PER_POSITION * 19, "one sequence"),
    "one position": (lambda: PER_POSITION, "one position of one sequence"),
    "float32": (lambda: RIGHT_BYTES * 2, "4 bytes per number"),
    "keys only": (lambda: RIGHT_BYTES // 2, "factor of 2"),
    "one layer": (lambda: RIGHT_BYTES // 3, "one layer"),
    "one head": (lambda: RIGHT_BYTES // 6, "one head"),
    "heads twice": (lambda: RIGHT_BYTES * 6, "heads twice"),
    "bits": (lambda: RIGHT_BYTES * 8, "bits"),
    "unknown": (lambda: 1000, "(?s)how many positions.*measured when generate returns: 87,552"),
    "a float": (lambda: float(RIGHT_BYTES), "return an int"),
    "a tensor": (lambda: torch.tensor(RIGHT_BYTES), "return an int"),
    "a bool": (lambda: True, "return an int"),
}


@pytest.mark.parametrize("name", list(WRONG_BYTES))
def test_kv_cache_bytes_rejects_wrong_answers(name):
    fn, message = WRONG_BYTES[name]
    with pytest.raises(CheckFailure, match=message):
        check_kv_cache_bytes(fn)


def test_the_cache_measurement_leaves_the_random_stream_alone():
    measure_generation_cache.cache_clear()
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    measure_generation_cache()
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------- 9.7 the capstone: your own GPT


def make_gpt(*, causal=True, softmax_dim=-1, scale="head", merge="transpose", split="view",
             block="pre-norm", positions=True, final_norm=True, attention="matmul",
             mask="tril", swap_qk=False, heads="loop"):
    """The capstone's MyGPT class, right (the defaults) or with one planted mistake."""

    class CausalSelfAttention(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.n_heads = n_heads
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)

        def forward(self, x):
            B, T, D = x.shape
            H, Dh = self.n_heads, D // self.n_heads
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            if attention == "per-head loop":  # one head at a time, its slice of the features
                outs = []
                causal_mask = torch.ones(T, T, dtype=torch.bool).tril()
                for h in range(H):
                    part = slice(h * Dh, (h + 1) * Dh)
                    scores = q[..., part] @ k[..., part].transpose(-2, -1) / math.sqrt(Dh)
                    scores = scores.masked_fill(~causal_mask, float("-inf"))
                    outs.append(torch.softmax(scores, dim=-1) @ v[..., part])  # (B, T, Dh)
                return self.proj(torch.cat(outs, dim=-1))
            if split == "view":
                q, k, v = (t.view(B, T, H, Dh).transpose(1, 2) for t in (q, k, v))
            elif split == "dh_h":  # (B, Dh, T, H): Dh 'heads' of H features
                q, k, v = (t.view(B, T, Dh, H).transpose(1, 2) for t in (q, k, v))
            elif split == "interleaved":  # head h gets features h, h + H, ...
                q, k, v = (t.view(B, T, Dh, H).permute(0, 3, 1, 2) for t in (q, k, v))
            else:
                q, k, v = (t.reshape(B, H, T, Dh) for t in (q, k, v))
            if swap_qk:
                q, k = k, q
            if attention == "sdpa":
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                if attention == "einsum":
                    scores = torch.einsum("bhtd,bhsd->bhts", q, k)
                else:
                    scores = q @ k.transpose(-2, -1)
                if scale != "none":
                    scores = scores / {"head": math.sqrt(Dh), "model": math.sqrt(D),
                                       "d_head": Dh, "width": math.sqrt(q.shape[-1])}[scale]
                if causal:
                    ones = torch.ones(T, T, dtype=torch.bool)
                    future = {"tril": ones.triu(1), "future": ~ones.triu(),
                              "inverted": ~ones.triu(1), "no_self": ones.triu()}[mask]
                    scores = scores.masked_fill(future, float("-inf"))
                out = torch.softmax(scores, dim=softmax_dim) @ v  # (B, H, T, Dh)
            if split == "interleaved":
                out = out.permute(0, 2, 3, 1).reshape(B, T, D)
            elif merge == "transpose":
                out = out.transpose(1, 2).reshape(B, T, D)
            else:
                out = out.reshape(B, T, D)
            return self.proj(out)

    class Block(nn.Module):
        def __init__(self, d_model, n_heads):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model)
            self.attn = CausalSelfAttention(d_model, n_heads)
            self.ln2 = nn.LayerNorm(d_model)
            self.ff = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                    nn.Linear(4 * d_model, d_model))

        def forward(self, x):
            if block == "post-norm":
                x = self.ln1(x + self.attn(x))
                return self.ln2(x + self.ff(x))
            if block == "no residual":
                x = self.attn(self.ln1(x))
                return self.ff(self.ln2(x))
            if block == "relu":
                x = x + self.attn(self.ln1(x))
                hidden = F.relu(self.ff[0](self.ln2(x)))
                return x + self.ff[2](hidden)
            x = x + self.attn(self.ln1(x))
            return x + self.ff(self.ln2(x))

    class MyGPT(nn.Module):
        def __init__(self, vocab_size, d_model, n_heads, n_layers, max_len):
            super().__init__()
            self.tok_emb = nn.Embedding(vocab_size, d_model)
            self.pos_emb = nn.Embedding(max_len, d_model)
            self.blocks = nn.ModuleList([Block(d_model, n_heads) for _ in range(n_layers)])
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab_size, bias=False)

        def forward(self, ids):
            x = self.tok_emb(ids)
            if positions:
                x = x + self.pos_emb.weight[: ids.shape[1]]
            for layer in self.blocks:
                x = layer(x)
            return self.head(self.ln_f(x) if final_norm else x)

    return MyGPT


def make_loop(*, zero_grad="before", step=True, clip=False, returns="list", batch_once=False,
              targets="targets"):
    """The capstone's train_my_gpt, right (the defaults) or with one planted mistake."""

    def loss_of(logits, batch):
        if targets == "ids shifted":  # right too: ids[:, 1:] are targets[:, :-1]
            return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["ids"][:, 1:])
        if targets == "shifted twice":
            return F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["targets"][:, 1:])
        if targets == "ids":
            return F.cross_entropy(logits.transpose(1, 2), batch["ids"])
        return F.cross_entropy(logits.transpose(1, 2), batch["targets"])  # (B, V, T)

    def train_my_gpt(model, batches, n_updates, lr):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        losses = []
        once = batches() if batch_once else None
        for _ in range(n_updates):
            batch = once if batch_once else batches()
            logits = model(batch["ids"])
            loss = loss_of(logits, batch)
            if zero_grad == "before":
                optimizer.zero_grad()
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if step:
                optimizer.step()
            if zero_grad == "after":
                model.zero_grad(set_to_none=False)  # zeros, not None, at the end
            losses.append(np.float32(loss.item()) if returns == "numpy" else loss.item())
        if returns == "none":
            return None
        return tuple(losses) if returns == "tuple" else losses

    return train_my_gpt


def test_gpt_names_cover_every_decoder_parameter_once():
    from course_lib.course.checks.ch09 import GPT_PARITY_CONFIG
    from course_lib.models import DecoderLM

    c = GPT_PARITY_CONFIG
    names = [n for n, _ in DecoderLM(c).named_parameters()]
    mine = dict(make_gpt()(c.vocab_size, c.d_model, c.n_heads, c.n_layers,
                           c.max_len).named_parameters())
    assert sorted(gpt_name(n) for n in names) == sorted(mine)


@pytest.mark.parametrize("model, loop", [
    (make_gpt(), make_loop()),
    (make_gpt(attention="sdpa"), make_loop(zero_grad="after", clip=True, returns="tuple")),
    (make_gpt(attention="einsum"), make_loop(returns="numpy")),
    (make_gpt(attention="per-head loop"), make_loop(targets="ids shifted")),
], ids=["solution", "sdpa, zero_grad after the step, clipping", "einsum, numpy losses",
        "a loop over heads, targets taken from the ids"])
def test_my_gpt_accepts_correct_answers(model, loop, capsys):
    check_my_gpt(model, loop)
    out = capsys.readouterr().out
    assert out.startswith("\u2705") and "validation loss" in out


WRONG_GPT = {
    "no causal mask": (dict(causal=False), "no causal mask"),
    "softmax over the wrong axis": (dict(softmax_dim=-2), "softmax over the wrong axis"),
    "no 1/sqrt(d)": (dict(scale="none"), "does not scale the scores"),
    "1/sqrt(d_model)": (dict(scale="model"), r"divides the scores by sqrt\(d_model\)"),
    "1/d_head": (dict(scale="d_head"), r"divides the scores by d_head: .*sqrt\(d_head\)"),
    "mask the wrong way round (triu)": (dict(mask="future"), "itself and the FUTURE only"),
    "mask inverted (fills the allowed)": (dict(mask="inverted"), "masks the past instead"),
    "mask without the diagonal": (dict(mask="no_self"), "masks the diagonal too"),
    "queries and keys swapped": (dict(swap_qk=True), "swaps the queries and the keys"),
    "heads split as (Dh, H)": (dict(split="dh_h"), r"splits D as \(d_head, n_heads\)"),
    "heads split as (Dh, H), scaled by its width": (dict(split="dh_h", scale="width"),
                                                    r"splits D as \(d_head, n_heads\)"),
    "heads interleaved": (dict(split="interleaved"), "every n_heads-th feature"),
    "post-norm": (dict(block="post-norm"), "is post-norm"),
    "heads merged in the wrong order": (dict(merge="reshape"), "merges the heads in the wrong"),
    "heads split in the wrong order": (dict(split="reshape"), "splits the heads in the wrong"),
    "heads split and merged by reshape": (dict(split="reshape", merge="reshape"),
                                          "splits the heads in the wrong"),
    "no residual": (dict(block="no residual"), "no residual connections"),
    "no position embeddings": (dict(positions=False), "position embeddings are missing"),
    "no final norm": (dict(final_norm=False), "final LayerNorm is missing"),
    "ReLU instead of GELU": (dict(block="relu"), r"Block 0's output differs .* attention "
                                                 r"agrees"),
}


@pytest.mark.parametrize("name", list(WRONG_GPT))
def test_my_gpt_names_the_first_wrong_part(name):
    options, message = WRONG_GPT[name]
    with pytest.raises(CheckFailure, match=message) as info:
        check_my_gpt(make_gpt(**options), make_loop())
    if name != "1/sqrt(d_model)":  # sqrt(d_model) is named for that mistake only
        assert "sqrt(d_model)" not in str(info.value)


def test_the_parity_sizes_tell_every_head_size_apart():
    """D_h, H and sqrt(D) all differ, so that no confusion of them computes the right thing."""
    from course_lib.course.checks.ch09 import GPT_PARITY_CONFIG as c

    d_head = c.d_model // c.n_heads
    assert len({d_head, c.n_heads, math.sqrt(c.d_model), math.sqrt(d_head)}) == 4


WRONG_LOOPS = {
    "never calls zero_grad": (dict(zero_grad="never"), "never clears the gradients"),
    "never steps": (dict(step=False), r"never changed the weights: .*optimizer\.step\(\)"),
    "returns nothing": (dict(returns="none"), "return the list of its 300 training losses"),
    "one batch for every update": (dict(batch_once=True), r"trains on ONE batch.*Draw a new "
                                                          r"batch every step"),
    "targets shifted twice": (dict(targets="shifted twice"), r"AFTER the next one.*shifted "
                                                             r"twice"),
    "the ids as targets": (dict(targets="ids"), "predict the token it reads"),
}


@pytest.mark.parametrize("name", list(WRONG_LOOPS))
def test_my_gpt_names_a_broken_training_loop(name):
    options, message = WRONG_LOOPS[name]
    with pytest.raises(CheckFailure, match=message) as caught:
        check_my_gpt(make_gpt(), make_loop(**options))
    assert "AdamW" not in str(caught.value)  # the named mistake, not the generic advice
    if name != "returns nothing":  # the loss bar is missed too, and the message shows it
        assert re.search(r"validation loss after 300 updates: (\d+\.\d+)", str(caught.value))
        loss = float(re.search(r"validation loss after 300 updates: (\d+\.\d+)",
                               str(caught.value)).group(1))
        assert loss > 2.45


def test_my_gpt_lets_unsolved_stubs_fail_as_themselves():
    with pytest.raises(NotImplementedError):
        check_my_gpt(stub, stub)

    class StubForward(make_gpt()):
        def forward(self, ids):
            return stub(ids)

    with pytest.raises(NotImplementedError):
        check_my_gpt(StubForward, make_loop())
    with pytest.raises(NotImplementedError):
        check_my_gpt(make_gpt(), stub)


def test_my_gpt_refuses_wrong_names_and_course_lib_modules():
    class Renamed(make_gpt()):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lm_head = self.head
            del self.head

    with pytest.raises(CheckFailure, match=r"missing \['head.weight'\]"):
        check_my_gpt(Renamed, make_loop())

    from course_lib.attention import MultiHeadAttention

    class Borrowed(make_gpt()):
        def __init__(self, vocab_size, d_model, n_heads, n_layers, max_len):
            super().__init__(vocab_size, d_model, n_heads, n_layers, max_len)
            self.extra = MultiHeadAttention(d_model, n_heads)

    with pytest.raises(CheckFailure, match="uses course_lib's MultiHeadAttention"):
        check_my_gpt(Borrowed, make_loop())


def test_my_gpt_leaves_the_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    with pytest.raises(CheckFailure):
        check_my_gpt(make_gpt(causal=False), make_loop())
    assert torch.equal(torch.rand(3), expected)
