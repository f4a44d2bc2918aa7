"""The chapter 13 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import codecs
import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import stub

from course_lib.bpe import BPETokenizer, merge_pair, train_bpe
from course_lib.corpus import shakespeare_text
from course_lib.course.checks import CheckFailure, ch13
from course_lib.course.checks.ch13 import (
    COMPRESSION_TEXTS,
    ENCODE_WORDS,
    buggy_stream,
    check_compression_prediction,
    check_encode_prediction,
    check_merge_and_count,
    check_stream_decode,
    compression_tokenizer,
    measured_compression,
)


def test_an_unsolved_stub_fails_as_itself():
    for check in (check_encode_prediction, check_compression_prediction, check_stream_decode,
                  check_merge_and_count):
        with pytest.raises(NotImplementedError, match="Exercise: write the body"):
            check(stub)


# ------------------------------------------------------------- 13.1 a merge and the counts it changes


def merge_and_count(word_counts, pair, new_id):
    """Only the words that hold the pair: their old pairs out, their new pairs in."""
    merged, changes = {}, Counter()
    for word, count in word_counts.items():
        new = tuple(merge_pair(word, pair, new_id))
        merged[new] = count
        if new != word:
            for old_pair in zip(word, word[1:], strict=False):
                changes[old_pair] -= count
            for new_pair in zip(new, new[1:], strict=False):
                changes[new_pair] += count
    return merged, changes


def merge_and_count_by_hand(word_counts, pair, new_id):
    """A while loop for the merge, changes in a plain dict with numpy ints, zeros kept, a
    list out."""
    merged, changes = Counter(), {}
    for word, count in word_counts.items():
        new, i = [], 0
        while i < len(word):
            if word[i:i + 2] == pair:
                new.append(new_id)
                i += 2
            else:
                new.append(word[i])
                i += 1
        merged[tuple(new)] += count
        for sign, w in ((-1, word), (1, new)):
            for k in range(len(w) - 1):
                key = (w[k], w[k + 1])
                changes[key] = changes.get(key, np.int64(0)) + np.int64(sign * count)
    return [merged, changes]


def merge_and_recount(word_counts, pair, new_id):
    """The slow way, every pair of the table counted before and after: right too."""
    def pairs(table):
        return Counter(p for word, count in table.items()
                       for p in zip(word, word[1:], strict=False) for _ in range(count))
    merged = {tuple(merge_pair(word, pair, new_id)): c for word, c in word_counts.items()}
    after, before = pairs(merged), pairs(word_counts)
    return merged, {p: after[p] - before[p] for p in after | before}


@pytest.mark.parametrize("fn", [merge_and_count, merge_and_count_by_hand, merge_and_recount])
def test_merge_and_count_accepts_every_correct_formulation(fn, capsys):
    check_merge_and_count(fn)
    out = capsys.readouterr().out
    assert "✅ merge_and_count is correct" in out
    assert "train_bpe's first 40 merges exactly" in out


def test_the_training_loop_of_the_check_is_train_bpe():
    text = shakespeare_text()[ch13.TRAIN_TEXT_SLICE]
    assert ch13._train_with(merge_and_count, text, 40) == train_bpe(text, 296).merges


def test_the_reference_changes_are_a_recount_and_banana_loses_its_neighbours():
    a, b, n, x = 97, 98, 110, 256
    table = {(b, a, n, a, n, a): 3, (a, a, a): 2, (b,): 4}
    assert ch13.reference_changes(table, (a, n), x) == {
        (b, a): -3, (a, n): -6, (n, a): -6, (b, x): 3, (x, x): 3, (x, a): 3}
    assert ch13.reference_changes(table, (a, a), x) == {(a, a): -4, (x, a): 2}


def _with_changes(wrong_changes):
    return lambda wc, pair, new_id: (ch13.reference_merge(wc, pair, new_id),
                                     wrong_changes(wc, pair, new_id))


@pytest.mark.parametrize("wrong, match", [
    (ch13._changes_as_new_counts, "pair counts of the merged table, not how they changed"),
    (ch13._changes_reversed, "wrong sign"),
    (ch13._changes_only_the_pair, "only take the merged pair away"),
    (ch13._changes_keeping_broken_neighbours, "pairs the merge broke are still counted"),
    (ch13._changes_once_per_word, "ignore how often each word occurs"),
    (lambda wc, p, n: {**ch13.reference_changes(wc, p, n), (1, 2): 1},
     r"table of changes differs from the expected one \(case .*expected none"),
])
def test_the_changes_name_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_merge_and_count(_with_changes(wrong))


@pytest.mark.parametrize("wrong, match", [
    (ch13._merge_overlapping, r"'a a a' must become 'aa a'.*not 'aa aa'"),
    (ch13._merge_right_to_left, "scans from the right"),
    (ch13._merge_first_only, "only the first occurrence"),
    (ch13._merge_dropping_others, "lost the words that do not contain the pair"),
    (ch13._merge_forgetting_counts, "lost the words' counts"),
])
def test_the_merge_names_the_mistake(wrong, match):
    def fn(wc, pair, new_id):
        return wrong(wc, pair, new_id), ch13.reference_changes(wc, pair, new_id)
    with pytest.raises(CheckFailure, match=match):
        check_merge_and_count(fn)


def test_merge_and_count_catches_a_changed_input():
    def merge_in_place(word_counts, pair, new_id):
        merged, changes = merge_and_count(word_counts, pair, new_id)
        word_counts.clear()
        word_counts.update(merged)
        return word_counts, changes

    with pytest.raises(CheckFailure, match="merge_and_count changed the table"):
        check_merge_and_count(merge_in_place)


def test_a_count_driven_below_zero_is_named():
    calls = []

    def late_slip(wc, pair, new_id):  # right on the small tables, wrong while training
        calls.append(1)
        merged, changes = merge_and_count(wc, pair, new_id)
        if len(calls) > 8:
            changes[pair] -= 1000
        return merged, changes
    with pytest.raises(CheckFailure, match="cannot go below 0"):
        check_merge_and_count(late_slip)


@pytest.mark.parametrize("wrong, match", [
    (lambda wc, p, n: merge_and_count(wc, p, n)[0], "should return two dicts"),
    (lambda wc, p, n: (merge_and_count(wc, p, n)[0], list(merge_and_count(wc, p, n)[1].items())),
     "the changes should be a dict"),
    (lambda wc, p, n: (merge_and_count(wc, p, n)[0],
                       {f"{a},{b}": c for (a, b), c in merge_and_count(wc, p, n)[1].items()}),
     "a tuple of 2"),
    (lambda wc, p, n: (merge_and_count(wc, p, n)[0],
                       {k: float(c) for k, c in merge_and_count(wc, p, n)[1].items()}),
     r"return an int.*int\("),
    (lambda wc, p, n: (merge_and_count(wc, p, n)[0],
                       {k: torch.tensor(c) for k, c in merge_and_count(wc, p, n)[1].items()}),
     r"\.item\(\)"),
    (lambda wc, p, n: ([merge_pair(w, p, n) for w in wc], merge_and_count(wc, p, n)[1]),
     "the merged table should be a dict"),
])
def test_merge_and_count_refuses_malformed_answers(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_merge_and_count(wrong)


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


# ---------------------------------------------------------------- 13.4 the streaming decoder's bug


def stream_incremental(ids, tokenizer):
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [decoder.decode(tokenizer.vocab[i], final=k == len(ids) - 1)
            for k, i in enumerate(ids)]


def stream_by_hand(ids, tokenizer):
    """Hold back the bytes of an unfinished character found from its lead byte; a generator."""
    pending = b""
    for k, i in enumerate(ids):
        pending += tokenizer.vocab[i]
        cut = len(pending)
        for back in range(1, min(4, len(pending)) + 1):
            byte = pending[-back]
            if byte & 0xC0 == 0x80:  # a continuation byte: look further back
                continue
            need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
            if need > back:
                cut = len(pending) - back
            break
        if k == len(ids) - 1:
            cut = len(pending)
        yield pending[:cut].decode("utf-8", errors="replace")
        pending = pending[cut:]


def stream_by_trying(ids, tokenizer):
    """Decode what is waiting; an error at its very end means a character still coming, any
    other error bytes to write as U+FFFD and go on after; a tuple."""
    out, pending = [], b""
    for k, i in enumerate(ids):
        pending, text = pending + tokenizer.vocab[i], ""
        while pending:
            try:
                text, pending = text + pending.decode("utf-8"), b""
            except UnicodeDecodeError as err:
                if err.reason == "unexpected end of data" and k < len(ids) - 1:
                    text += pending[:err.start].decode("utf-8")
                    pending = pending[err.start:]
                    break
                text += pending[:err.end].decode("utf-8", errors="replace")
                pending = pending[err.end:]
        out.append(text)
    return tuple(out)


@pytest.mark.parametrize("fn", [stream_incremental, stream_by_hand, stream_by_trying])
def test_stream_decode_accepts_every_correct_fix(fn, capsys):
    check_stream_decode(fn)
    assert "✅ stream_decode gives tokenizer.decode's text" in capsys.readouterr().out


def test_the_bug_shows_on_characters_split_between_tokens_only():
    tokenizer = compression_tokenizer()
    cases = ch13.stream_cases()
    differ = {name for name, ids, _ in cases
              if "".join(buggy_stream(ids, tokenizer)) != tokenizer.decode(ids)}
    assert "lines of the plays" not in differ and "no ids at all" not in differ
    assert {"accents, a dash and emoji", "Russian (exercise 13.3)",
            "a sequence cut halfway through an emoji"} <= differ
    for name, ids, valid in cases:  # the reference's pieces join to decode's text
        assert "".join(ch13.reference_stream(ids, tokenizer)) == tokenizer.decode(ids), name
        if valid:
            assert all(p.isprintable() or p.strip() == "" or "\n" in p
                       for p in ch13.reference_stream(ids, tokenizer)), name


def _strict(ids, tokenizer):
    return [tokenizer.vocab[i].decode("utf-8") for i in ids]


@pytest.mark.parametrize("wrong, match", [
    (buggy_stream, r"(?s)planted mistake is still there.*round trip"),
    (ch13._stream_ignoring, "errors='ignore'"),
    (ch13._stream_without_flush, "ids run out"),
    (ch13._stream_at_the_end, "holds everything back until the last id"),
    (_strict, "UnicodeDecodeError.*errors='replace'"),
    (lambda ids, tok: [tok.decode(ids[:k + 1]) for k in range(len(ids))],
     "differ from tokenizer.decode"),
    (lambda ids, tok: [""] + stream_incremental(ids, tok)[:-1] + (
        [stream_incremental(ids, tok)[-1]] if len(ids) > 1 else []) if ids else [],
     r"one string per id|after id 0 .* not earlier and not later"),
    (lambda ids, tok: "".join(stream_incremental(ids, tok)), "a list of strings"),
    (lambda ids, tok: stream_incremental(ids, tok)[:-1], "one string per id"),
])
def test_stream_decode_names_the_mistake(wrong, match):
    with pytest.raises(CheckFailure, match=match):
        check_stream_decode(wrong)


def test_a_late_piece_is_named_with_the_id_and_the_text_due():
    def one_late(ids, tok):  # every piece one id late, the last one with the rest
        pieces = stream_incremental(ids, tok)
        return ([""] + pieces[:-2] + [pieces[-2] + pieces[-1]]) if len(ids) > 1 else pieces
    with pytest.raises(CheckFailure, match=r"after id 0 of the case 'lines of the plays'"):
        check_stream_decode(one_late)


def test_an_unknown_slip_is_not_blamed_on_the_planted_bug():
    def extra_space(ids, tokenizer):
        pieces = stream_incremental(ids, tokenizer)
        return [p.replace("é", "e") for p in pieces]
    with pytest.raises(CheckFailure) as failure:
        check_stream_decode(extra_space)
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
