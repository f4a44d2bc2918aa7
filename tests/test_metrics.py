"""Accuracies over scored positions and the alignment score (metrics.py), against counting by
hand; an instrument never gives a false all-clear: NaN weights, float ids and nothing to score
are refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib.metrics import alignment_score, sequence_accuracy, token_accuracy
from course_lib.tokenizer import IGNORE_INDEX

BAD = [float("nan"), float("inf")]

# --------------------------------------------------------------------------------------------
# token_accuracy and sequence_accuracy


def test_sequence_accuracy():
    targets = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, 3, 4]])
    predictions = torch.tensor([[9, 1, 2], [9, 3, 0]])  # position 0 is not scored
    assert sequence_accuracy(predictions, targets) == 0.5
    with pytest.raises(ValueError, match=r"predictions.*\(2, 2\).*targets.*\(2, 3\)"):
        sequence_accuracy(predictions[:, :2], targets)


def test_token_accuracy_counts_scored_positions_only():
    targets = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, 3, 4]])
    predictions = torch.tensor([[9, 1, 2], [9, 3, 0]])  # 3 of the 4 scored positions right
    assert token_accuracy(predictions, targets) == 0.75
    assert token_accuracy(predictions[:, -1], targets[:, -1]) == 0.5  # 1-D works too
    with pytest.raises(ValueError, match=r"predictions.*\(2, 2\).*targets.*\(2, 3\)"):
        token_accuracy(predictions[:, :2], targets)


def test_token_accuracy_matches_counting_by_hand():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        targets = torch.randint(0, 4, (5, 7), generator=gen)
        targets[torch.rand(5, 7, generator=gen) < 0.4] = IGNORE_INDEX
        targets[0, 0] = 1  # at least one scored position
        predictions = torch.randint(0, 4, (5, 7), generator=gen)
        pairs = [(p, t) for p, t in zip(predictions.flatten().tolist(),
                                        targets.flatten().tolist(), strict=True)
                 if t != IGNORE_INDEX]
        expected = sum(p == t for p, t in pairs) / len(pairs)
        assert token_accuracy(predictions, targets) == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("metric", [token_accuracy, sequence_accuracy])
@pytest.mark.parametrize("shape", [(2, 3), (0, 3), (2, 0)])
def test_accuracies_refuse_when_nothing_is_scored(metric, shape):
    predictions = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match="targets.*no scored position"):
        metric(predictions, torch.full(shape, IGNORE_INDEX))


@pytest.mark.parametrize("metric", [token_accuracy, sequence_accuracy])
def test_accuracies_refuse_float_predictions(metric):
    with pytest.raises(ValueError, match=r"predictions.*integer.*predictions\.long\(\)"):
        metric(torch.tensor([[float("nan"), 1.0]]), torch.tensor([[1, 1]]))


def test_sequence_accuracy_leaves_out_sequences_with_nothing_scored():
    targets = torch.tensor([[1, 2], [IGNORE_INDEX, IGNORE_INDEX]])
    assert sequence_accuracy(torch.tensor([[0, 0], [0, 0]]), targets) == 0.0
    assert sequence_accuracy(torch.tensor([[1, 2], [0, 0]]), targets) == 1.0
    with pytest.raises(ValueError, match=r"targets.*\(N, T\).*\(1,\)"):
        sequence_accuracy(torch.tensor([1]), torch.tensor([1]))


# --------------------------------------------------------------------------------------------
# alignment_score


def test_alignment_score_counts_peaks_on_the_gold_position():
    weights = torch.tensor([[[0.7, 0.2, 0.1],   # peak 0, gold 0: right
                             [0.1, 0.3, 0.6],   # peak 2, gold 1: wrong
                             [0.2, 0.5, 0.3],   # peak 1, gold 1: right
                             [0.9, 0.05, 0.05]]])  # not scored
    gold = torch.tensor([[0, 1, 1, IGNORE_INDEX]])
    assert alignment_score(weights, gold) == pytest.approx(2 / 3)
    assert alignment_score(weights[0], gold[0]) == pytest.approx(2 / 3)  # unbatched
    assert alignment_score(weights[:, :, :], torch.tensor([[0, 2, 1, 0]])) == 1.0


@given(seed=st.integers(0, 2**16), b=st.integers(1, 4), t=st.integers(1, 6),
       s=st.integers(1, 7))
def test_alignment_score_against_a_loop(seed, b, t, s):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(b, t, s, generator=gen), -1)
    gold = torch.randint(0, s, (b, t), generator=gen)
    gold[torch.rand(b, t, generator=gen) < 0.3] = IGNORE_INDEX
    gold[0, 0] = 0
    hits = total = 0
    for i in range(b):
        for j in range(t):
            if gold[i, j] != IGNORE_INDEX:
                total += 1
                hits += int(max(range(s), key=lambda k: weights[i, j, k]) == gold[i, j])
    assert alignment_score(weights, gold) == pytest.approx(hits / total)


def test_the_alignment_score_of_uniform_attention_is_chance_level_at_most():
    weights = torch.full((2, 5, 4), 0.25)  # every peak falls on position 0 (argmax ties)
    gold = torch.tensor([[0, 1, 2, 3, 0], [1, 1, 2, 3, 0]])
    assert alignment_score(weights, gold) == pytest.approx(3 / 10)


@pytest.mark.parametrize("weights, gold, error, message", [
    (torch.rand(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), ValueError,
     r"weights\.argmax\(-1\).*\(2, 3\).*alignment.*\(2, 4\)"),
    (torch.rand(2, 2, 3, 4), torch.zeros(2, 3, dtype=torch.long), ValueError,
     r"weights\.argmax\(-1\).*\(2, 2, 3\)"),
    (torch.rand(3, 4), torch.zeros(3), ValueError, r"alignment.*integer.*alignment\.long\(\)"),
    (torch.rand(3, 4), torch.full((3,), IGNORE_INDEX), ValueError,
     r"alignment.*\(3,\).*no scored position"),
    ([[0.5, 0.5]], torch.tensor([0]), TypeError, r"weights.*torch\.Tensor.*list"),
])
def test_bad_alignment_arguments(weights, gold, error, message):
    with pytest.raises(error, match=message):
        alignment_score(weights, gold)


@pytest.mark.parametrize("value", BAD)
def test_alignment_score_refuses_non_finite_weights(value):
    weights = torch.softmax(torch.randn(1, 6, 6), -1)
    weights[0, 2, 4] = value
    with pytest.raises(ValueError, match=r"weights.*1 NaN or inf.*\(0, 2, 4\)"):
        alignment_score(weights, torch.arange(6)[None])
