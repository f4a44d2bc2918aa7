"""The chapter 13 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
from helpers import stub

from course_lib.bpe import BPETokenizer, merge_pair, pretokenize, train_bpe
from course_lib.corpus import shakespeare_text
from course_lib.course.checks import CheckFailure, ch13
from course_lib.course.checks.ch13 import (
    COMPRESSION_TEXTS,
    ENCODE_WORDS,
    buggy_encode,
    check_bpe_step,
    check_compression_prediction,
    check_encode_prediction,
    check_fixed_encode,
    compression_tokenizer,
    measured_compression,
)


def test_an_unsolved_stub_fails_as_itself():
    for check in (check_encode_prediction, check_compression_prediction, check_fixed_encode):
        with pytest.raises(NotImplementedError, match="Exercise: write the body"):
            check(stub)
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_bpe_step(stub, merge_everywhere)
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_bpe_step(count_pairs, stub)


# ------------------------------------------------------------- 13.1 the pair count and the merge


def count_pairs(word_counts):
    counts = Counter()
    for word, count in word_counts.items():
        for pair in zip(word, word[1:], strict=False):
            counts[pair] += count
    return counts


def count_pairs_indices(word_counts):
    """A plain dict, index loops, numpy counts."""
    counts = {}
    for word, count in word_counts.items():
        for i in range(len(word) - 1):
            pair = (word[i], word[i + 1])
            counts[pair] = counts.get(pair, np.int64(0)) + np.int64(count)
    return counts


def count_pairs_defaultdict(word_counts):
    counts = defaultdict(int)
    for word, count in word_counts.items():
        for a, b in zip(word[:-1], word[1:], strict=True):
            counts[a, b] += count
    return counts


def merge_everywhere(word_counts, pair, new_id):
    return {tuple(merge_pair(word, pair, new_id)): count for word, count in word_counts.items()}


def merge_while(word_counts, pair, new_id):
    """A while loop by hand, a Counter out."""
    out = Counter()
    for word, count in word_counts.items():
        new, i = [], 0
        while i < len(word):
            if word[i:i + 2] == pair:
                new.append(new_id)
                i += 2
            else:
                new.append(word[i])
                i += 1
        out[tuple(new)] += count
    return out


@pytest.mark.parametrize("pairs_fn, merge_fn", [
    (count_pairs, merge_everywhere), (count_pairs_indices, merge_while),
    (count_pairs_defaultdict, merge_everywhere)])
def test_bpe_step_accepts_every_correct_formulation(pairs_fn, merge_fn, capsys):
    check_bpe_step(pairs_fn, merge_fn)
    out = capsys.readouterr().out
    assert "✅ count_pairs and merge_everywhere are correct" in out
    assert "train_bpe's first 40 merges exactly" in out


def test_the_training_loop_of_the_check_is_train_bpe():
    text = shakespeare_text()[ch13.TRAIN_TEXT_SLICE]
    assert ch13._train_with(count_pairs, merge_everywhere, text, 40) == train_bpe(
        text, 296).merges


@pytest.mark.parametrize("wrong, match", [
    (ch13._pairs_across_words, "straddle two words"),
    (ch13._pairs_once_per_word, "ignore how often each word occurs"),
    (ch13._pairs_distinct_per_word, "once per word"),
    (ch13._pairs_without_overlaps, "skip overlapping occurrences"),
    (lambda wc: {pair: count + 1 for pair, count in count_pairs(wc).items()},
     r"differs from the expected table \(case .*expected"),
])
def test_the_pair_count_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_bpe_step(wrong, merge_everywhere)


@pytest.mark.parametrize("wrong, match", [
    (ch13._merge_overlapping, r"'a a a' must become 'aa a'.*not 'aa aa'"),
    (ch13._merge_right_to_left, "scans from the right"),
    (ch13._merge_first_only, "only the first occurrence"),
    (ch13._merge_dropping_others, "lost the words that do not contain the pair"),
    (ch13._merge_forgetting_counts, "lost the words' counts"),
])
def test_the_merge_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_bpe_step(count_pairs, wrong)


def test_the_bpe_step_catches_a_changed_input():
    def popping_count(word_counts):
        counts = count_pairs(word_counts)
        word_counts.clear()
        return counts

    def merge_in_place(word_counts, pair, new_id):
        for word in list(word_counts):
            word_counts[tuple(merge_pair(word, pair, new_id))] = word_counts.pop(word)
        return word_counts

    with pytest.raises(CheckFailure, match="count_pairs changed the table"):
        check_bpe_step(popping_count, merge_everywhere)
    with pytest.raises(CheckFailure, match="merge_everywhere changed the table"):
        check_bpe_step(count_pairs, merge_in_place)


@pytest.mark.parametrize("wrong, match", [
    (lambda wc: list(count_pairs(wc).items()), "should return a dict"),
    (lambda wc: {f"{a},{b}": c for (a, b), c in count_pairs(wc).items()}, "a tuple of 2"),
    (lambda wc: {p: float(c) for p, c in count_pairs(wc).items()}, r"return an int.*int\("),
    (lambda wc: {p: torch.tensor(c) for p, c in count_pairs(wc).items()}, r"\.item\(\)"),
])
def test_the_pair_count_refuses_malformed_tables(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_bpe_step(wrong, merge_everywhere)


def test_the_merge_refuses_lists_of_words():
    with pytest.raises(CheckFailure, match="should return a dict"):
        check_bpe_step(count_pairs, lambda wc, pair, new_id: [
            merge_pair(w, pair, new_id) for w in wc])


# ------------------------------------------------------------------ 13.2 encode by hand

TRUTH = {word: ch13._tokens_by_rank(word) for word in ENCODE_WORDS}


def test_the_truth_is_course_libs_encoder_on_the_exercise_merges():
    tokenizer = BPETokenizer([(a.encode(), b.encode()) for a, b in ch13.ENCODE_MERGES])
    for word, tokens in TRUTH.items():
        assert [tokenizer.vocab[i].decode() for i in tokenizer.encode(word)] == tokens
    # the words tell the orders apart: by rank, leftmost first, longest first
    assert TRUTH["lower"] != ch13._tokens_leftmost_first("lower")
    assert TRUTH["newer"] != ch13._tokens_leftmost_first("newer")
    assert TRUTH[" lower"] != ch13._tokens_longest_first(" lower")


@pytest.mark.parametrize("answer", [TRUTH, {w: tuple(t) for w, t in TRUTH.items()},
                                    {w: [t.encode() for t in ts] for w, ts in TRUTH.items()},
                                    {**TRUTH, "notes": "by rank"}])
def test_the_encode_prediction_accepts_the_truth_and_shows_how_it_is_built(answer, capsys):
    check_encode_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "✅ all 3 predictions" in out and "l o w e r -> l o w er" in out


@pytest.mark.parametrize("change, match", [
    ({"lower": ch13._tokens_leftmost_first("lower")}, r"'lower'.*leftmost pair"),
    ({"newer": ch13._tokens_leftmost_first("newer")}, r"'newer'.*left to right \(or by taking"),
    ({" lower": ch13._tokens_longest_first(" lower")}, r"' lower'.*left to right"),
    ({" lower": ["lower"]}, "leading space is a byte of the word"),
    ({"newer": ["new", "e"]}, "give 'newe', not the word"),
    ({"newer": ["n", "ew", "er"]}, "replay the merges"),
    ({"newer": "ne wer"}, "should be a list of strings"),
    ({"newer": [110, 101]}, "should be a list of strings"),
])
def test_the_encode_prediction_names_the_mistake(change, match):
    with pytest.raises(CheckFailure, match=match):
        check_encode_prediction(lambda: {**TRUTH, **change})


def test_the_encode_prediction_wants_every_word():
    with pytest.raises(CheckFailure, match="lacks the key"):
        check_encode_prediction(lambda: {"lower": TRUTH["lower"]})
    with pytest.raises(CheckFailure, match="should return a dict"):
        check_encode_prediction(lambda: list(TRUTH.values()))


# ---------------------------------------------------------------- 13.3 compression, predicted

MEASURED = measured_compression()
NAMES = tuple(COMPRESSION_TEXTS)


def test_the_measurement_is_the_tokenizer_counted():
    tokenizer = train_bpe(shakespeare_text()[:200_000], 1024)
    assert tokenizer.merges == compression_tokenizer().merges
    for name, text in COMPRESSION_TEXTS.items():
        assert MEASURED[name] == len(text) / len(tokenizer.encode(text))


@pytest.mark.parametrize("scale", [1.0, 1.45, 1 / 1.45])
def test_the_compression_prediction_accepts_values_inside_the_band(scale, capsys):
    check_compression_prediction(lambda: {n: MEASURED[n] * scale for n in NAMES})
    out = capsys.readouterr().out
    assert "✅ all 4 predictions" in out and "held-out Shakespeare" in out


def test_the_compression_prediction_accepts_numpy_floats(capsys):
    check_compression_prediction(lambda: {n: np.float64(MEASURED[n]) for n in NAMES})
    assert "✅" in capsys.readouterr().out


def test_the_compression_prediction_accepts_whole_numbers(capsys):
    """The spec asks for numbers: a digit per token predicted as 1, not 1.0, is an answer."""
    check_compression_prediction(lambda: {**{n: MEASURED[n] for n in NAMES},
                                          "digits of 2**1000": 1, "modern prose": np.int64(3)})
    assert "✅" in capsys.readouterr().out


def _with(name, value):
    return lambda: {**{n: MEASURED[n] for n in NAMES}, name: value}


@pytest.mark.parametrize("answer, match", [
    (_with("the same in Russian", MEASURED["the same in Russian"] * 2), "2 bytes in UTF-8"),
    (_with("digits of 2**1000", MEASURED["digits of 2**1000"] * 2.5), "no digits at all"),
    (_with("Python code", MEASURED["Python code"] * 1.7), "code is not Shakespeare"),
    (_with("modern prose", MEASURED["modern prose"] / 2), "English is English"),
    (_with("modern prose", MEASURED["modern prose"] * 2), "think again"),
    (lambda: {n: 1 / MEASURED[n] for n in NAMES}, "tokens per character"),
    (_with("digits of 2**1000", 0.0), "cannot be"),
    (_with("digits of 2**1000", "1"), r"should be a number.*an int or a float"),
    (_with("digits of 2**1000", 3), "no digits at all"),
    (_with("digits of 2**1000", torch.tensor(1.0)), r"\.item\(\)"),
])
def test_the_compression_prediction_names_the_mistake(answer, match):
    with pytest.raises(CheckFailure, match=match):
        check_compression_prediction(answer)


def test_a_failed_compression_prediction_does_not_give_the_numbers_away():
    with pytest.raises(CheckFailure) as failure:
        check_compression_prediction(_with("the same in Russian", 1.0))
    assert f"{MEASURED['the same in Russian']:.2f}" not in str(failure.value)


# ---------------------------------------------------------------- 13.4 the encoder's bug


def encode_merge_pair(text, tokenizer):
    ids = []
    for piece in pretokenize(text):
        word = list(piece.encode("utf-8"))
        for a, b in tokenizer.merges:
            pair = (tokenizer.token_ids[a], tokenizer.token_ids[b])
            word = merge_pair(word, pair, tokenizer.token_ids[a + b])
        ids.extend(word)
    return ids


def encode_while(text, tokenizer):
    """The given loop with the break replaced by a scan that goes on after each merge."""
    ids = []
    for piece in pretokenize(text):
        word = list(piece.encode("utf-8"))
        for a, b in tokenizer.merges:
            pair = (tokenizer.token_ids[a], tokenizer.token_ids[b])
            i = 0
            while i < len(word) - 1:
                if (word[i], word[i + 1]) == pair:
                    word[i:i + 2] = [tokenizer.token_ids[a + b]]
                i += 1
        ids.extend(np.array(word, dtype=np.int64).tolist())
    return tuple(ids)


def encode_library(text, tokenizer):
    return [np.int64(i) for i in tokenizer.encode(text)]


def encode_numpy(text, tokenizer):
    return np.array(encode_merge_pair(text, tokenizer), dtype=np.int64)


@pytest.mark.parametrize("fn", [encode_merge_pair, encode_while, encode_library, encode_numpy])
def test_fixed_encode_accepts_every_correct_fix(fn, capsys):
    check_fixed_encode(fn)
    assert "✅ encode gives exactly BPETokenizer.encode's ids" in capsys.readouterr().out


def test_the_bug_is_one_break_and_shows_on_some_texts_only():
    tokenizer = compression_tokenizer()
    assert len({a + b for a, b in tokenizer.merges}) == len(tokenizer.merges)  # no token twice
    texts = ch13.fix_texts()
    differ = [t for t in texts if buggy_encode(t, tokenizer) != tokenizer.encode(t)]
    assert 0 < len(differ) < len(texts) / 2
    assert "I understand you not, my lord." in differ


@pytest.mark.parametrize("wrong, match", [
    (buggy_encode, r"(?s)planted bug is still there.*understand.*equality with "
                   r"BPETokenizer.encode"),
    (ch13._encode_leftmost_first, "leftmost pair that has a merge"),
    (ch13._encode_without_pieces, r"no longer cuts the text into pre-tokens.*knew'st"),
    (ch13._encode_overlapping, "not 'aa aa'"),
    (lambda text, tokenizer: tokenizer.encode(text)[::-1], "differs from BPETokenizer.encode"),
    (lambda text, tokenizer: tokenizer.encode_tensor(text), r"should return a list.*tolist"),
    (lambda text, tokenizer: [float(i) for i in tokenizer.encode(text)], r"int\(\.\.\.\)"),
])
def test_fixed_encode_names_the_mistake_and_the_instrument(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_fixed_encode(wrong)


def test_an_unknown_slip_is_not_blamed_on_the_planted_bug():
    def off_by_one_piece(text, tokenizer):
        ids = tokenizer.encode(text)
        return ids + [ids[-1]] if "purposes" in text else ids
    with pytest.raises(CheckFailure) as failure:
        check_fixed_encode(off_by_one_piece)
    assert "planted" not in str(failure.value) and "instrument" not in str(failure.value)


# ------------------------------------------------------------ 13.5 a unigram's bits per character


def bits_log2(tokenizer, train_text, val_text):
    """log2 directly, a plain dict, numpy's float out."""
    counts = {}
    for t in tokenizer.encode(train_text):
        counts[t] = counts.get(t, 0) + 1
    n, v = len(tokenizer.encode(train_text)), len(tokenizer)
    bits = sum(-np.log2((counts.get(t, 0) + 1) / (n + v)) for t in tokenizer.encode(val_text))
    return np.float64(bits / len(val_text))


def bits_torch(tokenizer, train_text, val_text):
    """Probabilities as a tensor over the whole vocabulary, cross-entropy style."""
    ids = torch.tensor(tokenizer.encode(train_text))
    probs = (torch.bincount(ids, minlength=tokenizer.vocab_size).double() + 1) / (
        len(ids) + tokenizer.vocab_size)
    val = torch.tensor(tokenizer.encode(val_text))
    return float(-probs.log()[val].sum() / len(val_text) / np.log(2))


@pytest.mark.parametrize("fn", [ch13.reference_bits_per_char, bits_log2, bits_torch])
def test_bits_per_char_accepts_every_correct_formulation(fn, capsys):
    ch13.check_bits_per_char(fn)
    out = capsys.readouterr().out
    assert "✅ unigram_bits_per_char is correct on all 4 cases" in out
    assert "V = 1024" in out and "bits per token" in out


def test_the_unigram_reference_is_the_formula():
    tokenizer = BPETokenizer([])
    p = {c: (("abracadabra".count(c)) + 1) / (11 + 256) for c in "ab "}  # add-one
    expected = -sum(np.log(p[c]) for c in "ab ab") / 5 / np.log(2)
    assert ch13.reference_bits_per_char(tokenizer, "abracadabra", "ab ab") == pytest.approx(
        expected, rel=1e-12)


@pytest.mark.parametrize("index, match", [
    (0, "bits per TOKEN"), (1, "nats per character"), (2, "ln 2 twice"), (3, "log10"),
    (4, r"per BYTE.*two-byte characters"), (5, "only for the tokens seen"),
    (6, "divide by N only"), (7, "from the validation text"),
])
def test_bits_per_char_names_the_mistake(index, match):
    with pytest.raises(CheckFailure, match=match):
        ch13.check_bits_per_char(ch13.BITS_MISTAKES[index][0])


def _unsmoothed_math_log(tokenizer, train_text, val_text):
    counts, n = Counter(tokenizer.encode(train_text)), len(tokenizer.encode(train_text))
    return -sum(math.log(counts[t] / n) for t in tokenizer.encode(val_text)) / len(
        val_text) / math.log(2)


def _unsmoothed_plain_dict(tokenizer, train_text, val_text):
    counts = {}
    for t in tokenizer.encode(train_text):
        counts[t] = counts.get(t, 0) + 1
    n, v = sum(counts.values()), tokenizer.vocab_size
    return -sum(math.log2((counts[t] + 1) / (n + v)) for t in tokenizer.encode(val_text)) / len(
        val_text)


def _unsmoothed_ratio(tokenizer, train_text, val_text):
    counts, n = Counter(tokenizer.encode(train_text)), len(tokenizer.encode(train_text))
    return sum(math.log2(n / counts[t]) for t in tokenizer.encode(val_text)) / len(val_text)


@pytest.mark.parametrize("fn, crash", [
    (_unsmoothed_math_log, r"math\.log of 0"),
    (_unsmoothed_plain_dict, "KeyError.*not in your dict of counts"),
    (_unsmoothed_ratio, "division by zero"),
], ids=["math.log(0)", "a plain dict", "n / count"])
def test_bits_per_char_answers_an_unseen_token_crash_with_add_one(fn, crash):
    """The learner's own exception is caught and answered with the idea: add-one smoothing."""
    with pytest.raises(CheckFailure, match=rf"(?s){crash}.*'bytes \(V=256\).*count 0.*"
                                           r"add-one smoothing.*\(count\(t\) \+ 1\)") as info:
        ch13.check_bits_per_char(fn)
    assert "raised" not in str(info.value)


def test_bits_per_char_reports_other_crashes_as_they_are():
    def typo(tokenizer, train_text, val_text):
        return len(val_text) / tokenizer.size

    with pytest.raises(CheckFailure, match="raised AttributeError") as info:
        ch13.check_bits_per_char(typo)
    assert "add-one" not in str(info.value)


def test_bits_per_char_explains_an_infinite_result_and_refuses_non_floats():
    def unsmoothed(tokenizer, train_text, val_text):
        counts, n = Counter(tokenizer.encode(train_text)), len(tokenizer.encode(train_text))
        return sum(-np.log2(counts[t] / n) if counts[t] else float("inf")
                   for t in tokenizer.encode(val_text)) / len(val_text)
    with pytest.raises(CheckFailure, match="probability 0 without smoothing"):
        ch13.check_bits_per_char(unsmoothed)
    with pytest.raises(CheckFailure, match=r"\.item\(\)"):
        ch13.check_bits_per_char(lambda *args: torch.tensor(ch13.reference_bits_per_char(*args)))
    with pytest.raises(CheckFailure, match="differs from the expected"):
        ch13.check_bits_per_char(lambda *args: ch13.reference_bits_per_char(*args) * 1.01)
    with pytest.raises(NotImplementedError):
        ch13.check_bits_per_char(stub)
