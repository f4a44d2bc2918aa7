"""Checks for chapter 13, tokens: one step of BPE training written out (the pair count and the
merge), a word encoded by hand from a list of merges (predicted, then verified), how well a
Shakespeare vocabulary compresses other kinds of text (predicted, then measured), and an
encoder with a planted bug to find.

The references are course_lib's :func:`~course_lib.bpe.merge_pair`,
:func:`~course_lib.bpe.most_frequent_pair`, :func:`~course_lib.bpe.train_bpe` and
:class:`~course_lib.bpe.BPETokenizer`.
"""

from __future__ import annotations

import copy
import inspect
import math
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from course_lib.bpe import (
    BPETokenizer,
    merge_pair,
    most_frequent_pair,
    pretokenize,
    train_bpe,
)
from course_lib.corpus import shakespeare_text

from ._core import (
    Case,
    CheckFailure,
    call_learner,
    describe,
    prediction_dict,
    require_count,
    require_number,
    require_real,
    wrap_checks,
)

# --------------------------------------------------------------------------------------------
# Exercise 13.1: count_pairs(word_counts) and merge_everywhere(word_counts, pair, new_id)


def word_table(text: str) -> dict[tuple[int, ...], int]:
    """The table train_bpe starts from: each distinct pre-token as a tuple of byte ids -> how
    often it occurs in ``text``."""
    return dict(Counter(tuple(piece.encode("utf-8")) for piece in pretokenize(text)))


def reference_pairs(word_counts: Mapping[tuple[int, ...], int]) -> dict[tuple[int, int], int]:
    """Every adjacent pair inside each word, counted as often as the word occurs."""
    counts: Counter[tuple[int, int]] = Counter()
    for word, count in word_counts.items():
        for pair in zip(word, word[1:], strict=False):
            counts[pair] += count
    return dict(counts)


def reference_merge(word_counts: Mapping[tuple[int, ...], int], pair: tuple[int, int],
                    new_id: int) -> dict[tuple[int, ...], int]:
    """Every word with each occurrence of ``pair`` (left to right, no overlaps) replaced."""
    out: Counter[tuple[int, ...]] = Counter()
    for word, count in word_counts.items():
        out[tuple(merge_pair(word, pair, new_id))] += count
    return dict(out)


def _pairs_across_words(word_counts):
    """All words written one after the other, pairs counted over the joins too."""
    stream = [token for word, count in word_counts.items() for _ in range(count)
              for token in word]
    return dict(Counter(zip(stream, stream[1:], strict=False)))


def _pairs_once_per_word(word_counts):
    return dict(Counter(pair for word in word_counts for pair in zip(word, word[1:],
                                                                      strict=False)))


def _pairs_distinct_per_word(word_counts):
    counts: Counter = Counter()
    for word, count in word_counts.items():
        for pair in set(zip(word, word[1:], strict=False)):
            counts[pair] += count
    return dict(counts)


def _pairs_without_overlaps(word_counts):
    """(a, a) counted once in a a a: each pair's occurrences counted as merge_pair finds them."""
    counts: Counter = Counter()
    for word, count in word_counts.items():
        for pair in set(zip(word, word[1:], strict=False)):
            counts[pair] += count * (len(word) - len(merge_pair(word, pair, -1)))
    return dict(counts)


PAIR_MISTAKES = [
    (_pairs_across_words,
     "Your counts include pairs that straddle two words (the last token of one word and the "
     "first of the next). Pairs are counted inside each word only: merges never cross a "
     "pre-token's boundary"),
    (_pairs_once_per_word,
     "Your counts ignore how often each word occurs: a word seen 5 times contributes each of "
     "its pairs 5 times (multiply by the word's count)"),
    (_pairs_distinct_per_word,
     "Your counts take each pair once per word: a word that holds a pair twice (like 'b a n "
     "a n a' with (a, n)) contributes it twice, times the word's count"),
    (_pairs_without_overlaps,
     "Your counts skip overlapping occurrences: in 'a a a' the pair (a, a) is counted twice "
     "(positions 0-1 and 1-2), as train_bpe counts every adjacent pair; only the merge itself "
     "is non-overlapping"),
]


def _merge_overlapping(word_counts, pair, new_id):
    """Every position where the pair starts gets the new token: a a a -> X X."""
    out: Counter = Counter()
    for word, count in word_counts.items():
        starts = [i for i in range(len(word) - 1) if (word[i], word[i + 1]) == pair]
        covered = {j for i in starts for j in (i, i + 1)}
        new, i = [], 0
        while i < len(word):
            if i in starts:
                new.append(new_id)
                i += 1 if i + 1 in starts else 2
            elif i in covered:
                i += 1  # the second half of a pair already written
            else:
                new.append(word[i])
                i += 1
        out[tuple(new)] += count
    return dict(out)


def _merge_right_to_left(word_counts, pair, new_id):
    return {tuple(reversed(merge_pair(list(reversed(word)), pair[::-1], new_id))): count
            for word, count in word_counts.items()}


def _merge_first_only(word_counts, pair, new_id):
    out = {}
    for word, count in word_counts.items():
        word = list(word)
        for i in range(len(word) - 1):
            if (word[i], word[i + 1]) == pair:
                word[i:i + 2] = [new_id]
                break
        out[tuple(word)] = count
    return out


def _merge_dropping_others(word_counts, pair, new_id):
    return {tuple(merge_pair(word, pair, new_id)): count for word, count in word_counts.items()
            if pair in zip(word, word[1:], strict=False)}


def _merge_forgetting_counts(word_counts, pair, new_id):
    return {tuple(merge_pair(word, pair, new_id)): 1 for word in word_counts}


MERGE_MISTAKES = [
    (_merge_overlapping,
     "Your merge lets occurrences overlap: with the pair (a, a), 'a a a' must become "
     "'aa a' (scan left to right; after a merge, jump past both tokens), not 'aa aa'"),
    (_merge_right_to_left,
     "Your merge scans from the right: 'a a a' with the pair (a, a) must become 'aa a', "
     "scanning left to right, not 'a aa'"),
    (_merge_first_only,
     "Your merge replaces only the first occurrence in each word: every occurrence of the "
     "pair is replaced (left to right, no overlaps)"),
    (_merge_dropping_others,
     "Your new table lost the words that do not contain the pair: they stay, unchanged, with "
     "their counts"),
    (_merge_forgetting_counts,
     "Your new table lost the words' counts: each word keeps the count it had"),
]


def _random_table(rng: random.Random, n_words: int, alphabet: int, longest: int,
                  first: int = 97) -> dict[tuple[int, ...], int]:
    table = {}
    while len(table) < n_words:
        word = tuple(first + rng.randrange(alphabet) for _ in range(rng.randint(1, longest)))
        table[word] = rng.randint(1, 20)
    return table


def _table_cases(seed: int) -> list[Case]:
    """(word_counts, pair, new_id) cases: the pair argument is ignored by count_pairs."""
    rng = random.Random(seed)
    a, b, n = 97, 98, 110  # 'a', 'b', 'n'
    cases = [
        Case("{'banana': 3, 'a a a': 2, 'b': 4}, pair (a, n)",
             ({(b, a, n, a, n, a): 3, (a, a, a): 2, (b,): 4}, (a, n), 256)),
        Case("{'a a a': 2, 'a a a a a': 1, 'b a a b': 5}, pair (a, a)",
             ({(a, a, a): 2, (a, a, a, a, a): 1, (b, a, a, b): 5}, (a, a), 256)),
    ]
    for k, (n_words, alphabet, longest) in enumerate(((6, 3, 6), (12, 2, 8), (20, 5, 7))):
        table = _random_table(rng, n_words, alphabet, longest)
        pair = most_frequent_pair(reference_pairs(table))
        cases.append(Case(f"random table {k + 1}: {n_words} words over {alphabet} letters, "
                          f"the most frequent pair", (table, pair, 300 + k)))
    words = {(300, 97, 300): 4, (97, 300): 1}  # ids made by earlier merges appear too
    cases.append(Case("words holding a merged token (id 300), pair (300, 97)",
                      (words, (300, 97), 301)))
    return cases


def _keys_and_counts(got: Any, what: str, fn_name: str, case: Case, length: int | None):
    """A learner's table as {tuple of ints: int}, zero counts dropped, or a clear failure."""
    if not isinstance(got, Mapping):
        raise CheckFailure(f"{fn_name} should return a dict, got {describe(got)} (case "
                           f"'{case.name}')")
    table = {}
    for key, value in got.items():
        if not isinstance(key, tuple) or (length is not None and len(key) != length):
            shape = "a tuple of 2 token ids, like (116, 104)" if length else \
                "a tuple of token ids"
            raise CheckFailure(f"each key of {fn_name}'s dict should be {shape}; got the key "
                               f"{key!r:.60} (case '{case.name}')")
        ids = tuple(require_count(token, f"a token id in {what}", case) for token in key)
        count = require_count(value, f"the count of {key!r:.40}", case)
        if count:
            table[ids] = table.get(ids, 0) + count
    return table


def _differences(got: dict, expected: dict, limit: int = 3) -> str:
    wrong = [k for k in expected if got.get(k) != expected[k]]
    extra = [k for k in got if k not in expected]
    parts = [f"{k}: {got.get(k, 'missing')} (expected {expected[k]})" for k in wrong[:limit]]
    parts += [f"{k}: {got[k]} (expected none)" for k in extra[:limit]]
    return "; ".join(parts)


def _diagnose(got: dict, expected: dict, mistakes, args: tuple, case: Case, what: str) -> None:
    if got == expected:
        return
    for wrong_fn, message in mistakes:
        wrong = wrong_fn(*args)
        if wrong != expected and got == {k: v for k, v in wrong.items() if v}:
            raise CheckFailure(f"{message} (seen on the case '{case.name}')")
    raise CheckFailure(f"{what} differs from the expected table (case '{case.name}'): "
                       f"{_differences(got, expected)}")


def _unchanged(fn: Callable, fn_name: str) -> Callable:
    """``fn``, failing if it changes the table it is given."""
    def watched(word_counts, *rest):
        before = copy.deepcopy(word_counts)
        result = fn(word_counts, *rest)
        if word_counts != before:
            raise CheckFailure(f"{fn_name} changed the table it was given (words or counts): "
                               "build a new dict and leave the caller's as it was; train_bpe "
                               "still needs the old table's words to update its counts")
        return result
    watched.__signature__ = inspect.signature(fn)
    return watched


def _train_with(count_pairs_fn: Callable, merge_fn: Callable, text: str, n_merges: int):
    """The merges learned from ``text`` with the learner's two functions and
    most_frequent_pair, new ids 256, 257, ..."""
    table = word_table(text)
    vocab = {i: bytes([i]) for i in range(256)}
    merges = []
    for new_id in range(256, 256 + n_merges):
        case = Case(f"training merge {new_id - 256 + 1} on the opening of Shakespeare", (table,))
        counts = _keys_and_counts(call_learner(count_pairs_fn, case, fn_name="count_pairs"),
                                  "the pair counts", "count_pairs", case, 2)
        if not counts:
            break
        a, b = most_frequent_pair(counts)
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        merged = call_learner(merge_fn, Case(case.name, (table, (a, b), new_id)),
                              fn_name="merge_everywhere")
        table = _keys_and_counts(merged, "the new table", "merge_everywhere", case, None)
    return merges


TRAIN_TEXT_SLICE = slice(0, 3000)  # the opening of shakespeare_text()
TRAIN_MERGES = 40


def check_bpe_step(count_pairs_fn: Callable, merge_fn: Callable) -> None:
    """Check ``count_pairs(word_counts)`` -> {pair: count} and ``merge_everywhere(word_counts,
    pair, new_id)`` -> a new {word: count} table, then train 40 merges with them (and
    course_lib's most_frequent_pair) and compare with ``train_bpe``'s first 40 merges.

    Args:
        count_pairs_fn: the learner's pair count.
        merge_fn: the learner's merge.
    """
    count_pairs = _unchanged(count_pairs_fn, "count_pairs")
    merge = _unchanged(merge_fn, "merge_everywhere")
    cases = _table_cases(seed=131)
    for case in cases:
        table, pair, new_id = case.args
        got = call_learner(count_pairs, Case(case.name, (table,)), fn_name="count_pairs")
        _diagnose(_keys_and_counts(got, "the pair counts", "count_pairs", case, 2),
                  reference_pairs(table), PAIR_MISTAKES, (table,), case, "Your pair count")
    for case in cases:
        got = call_learner(merge, case, fn_name="merge_everywhere")
        _diagnose(_keys_and_counts(got, "the new table", "merge_everywhere", case, None),
                  reference_merge(*case.args), MERGE_MISTAKES, case.args, case,
                  "Your merged table")
    text = shakespeare_text()[TRAIN_TEXT_SLICE]
    learned = _train_with(count_pairs, merge, text, TRAIN_MERGES)
    expected = train_bpe(text, 256 + TRAIN_MERGES).merges
    if learned != expected:
        k = next(i for i, (m, e) in enumerate(zip(learned + [None] * len(expected), expected,
                                                   strict=False)) if m != e)
        raise CheckFailure(f"Trained with your two functions, merge {k + 1} is "
                           f"{learned[k] if k < len(learned) else 'missing'} where train_bpe "
                           f"learns {expected[k]} (the first {TRAIN_MERGES} merges on the "
                           f"first {len(text):,} characters of Shakespeare)")
    print(f"\u2705 count_pairs and merge_everywhere are correct on all {len(cases)} tables "
          f"(edge cases: repeated pairs, 'a a a', one-letter words, merged tokens), and with "
          f"them the training loop learns train_bpe's first {TRAIN_MERGES} merges exactly "
          f"(first: {expected[0]!r}, last: {expected[-1]!r})")


# --------------------------------------------------------------------------------------------
# Exercise 13.2: encode three words by hand, given a list of merges

ENCODE_MERGES = [("e", "r"), ("l", "o"), ("w", "er"), ("n", "e"), ("lo", "w"), ("ne", "w"),
                 ("lo", "wer"), (" ", "lo")]
ENCODE_WORDS = ("lower", " lower", "newer")


def encode_tokenizer() -> BPETokenizer:
    """The exercise's tokenizer: the 256 bytes and ENCODE_MERGES."""
    return BPETokenizer([(a.encode(), b.encode()) for a, b in ENCODE_MERGES])


def _tokens_by_rank(word: str) -> list[str]:
    tokenizer = encode_tokenizer()
    return [tokenizer.vocab[i].decode() for i in tokenizer.encode(word)]


def _tokens_leftmost_first(word: str) -> list[str]:
    """Merge the leftmost pair that has a merge, again and again (the rank ignored)."""
    known, tokens = set(ENCODE_MERGES), list(word)
    while True:
        for i in range(len(tokens) - 1):
            if (tokens[i], tokens[i + 1]) in known:
                tokens[i:i + 2] = [tokens[i] + tokens[i + 1]]
                break
        else:
            return tokens


def _tokens_longest_first(word: str) -> list[str]:
    """Greedy longest match: from the left, the longest vocabulary token that fits."""
    vocab = {a + b for a, b in ENCODE_MERGES}
    tokens, i = [], 0
    while i < len(word):
        j = next(j for j in range(len(word), i, -1) if word[i:j] in vocab or j == i + 1)
        tokens.append(word[i:j])
        i = j
    return tokens


def _merge_trace(word: str) -> str:
    """How BPE builds the word, step by step: 'l o w e r -> l o w er -> ...'."""
    known = {pair: rank for rank, pair in enumerate(ENCODE_MERGES)}
    tokens, steps = list(word), []
    while True:
        steps.append(" ".join(repr(t) if t.isspace() else t for t in tokens))
        pairs = [(known[p], p) for p in zip(tokens, tokens[1:], strict=False) if p in known]
        if not pairs:
            return " -> ".join(steps)
        rank, best = min(pairs)
        i, merged = 0, []
        while i < len(tokens):
            if i + 1 < len(tokens) and (tokens[i], tokens[i + 1]) == best:
                merged.append(tokens[i] + tokens[i + 1])
                i += 2
            else:
                merged.append(tokens[i])
                i += 1
        tokens = merged


def _token_list(value: Any, word: str) -> list[str]:
    """A prediction as a list of str: a list or tuple of strings (bytes are decoded)."""
    if isinstance(value, list | tuple):
        value = [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t
                 for t in value]
    if isinstance(value, str) or not isinstance(value, list | tuple) or not all(
            isinstance(t, str) for t in value):
        raise CheckFailure(f"the prediction for {word!r} should be a list of strings, one per "
                           f"token, like ['lo', 'w'], got {value!r:.60}")
    return list(value)


def check_encode_prediction(encode_prediction_fn: Callable) -> None:
    """Check ``encode_prediction()`` -> {word: [token strings]} for ENCODE_WORDS against
    ``BPETokenizer(ENCODE_MERGES).encode``, then show how each word is built.

    Args:
        encode_prediction_fn: the learner's function (no arguments).
    """
    got = prediction_dict(call_learner(encode_prediction_fn, Case("the three words")),
                          ENCODE_WORDS, "encode_prediction")
    problems = []
    for word in ENCODE_WORDS:
        tokens, truth = _token_list(got[word], word), _tokens_by_rank(word)
        if tokens == truth:
            continue
        if "".join(tokens) != word:
            why = ("the tokens do not spell the word: the leading space is a byte of the word "
                   "too, and becomes a token or part of one" if "".join(tokens) == word.strip()
                   else f"joined, the tokens give {''.join(tokens)!r}, not the word")
        elif tokens == _tokens_leftmost_first(word) == _tokens_longest_first(word):
            why = ("that is what you get by merging from left to right (or by taking the "
                   "longest token first); BPE applies the merge with the lowest rank (earliest "
                   "in the list) among all adjacent pairs, wherever it is in the word")
        elif tokens == _tokens_leftmost_first(word):
            why = ("that is what you get by merging the leftmost pair that has a merge; BPE "
                   "applies the merge with the lowest rank (earliest in the list) among all "
                   "adjacent pairs, wherever it is in the word")
        elif tokens == _tokens_longest_first(word):
            why = ("that is greedy longest match (the longest token in the vocabulary first); "
                   "BPE never looks for long tokens: it replays the merges by rank, and a "
                   "token exists only if its merges happen in that order")
        else:
            why = ("replay the merges: at each step take the adjacent pair whose merge comes "
                   "earliest in the list, merge it, and look again")
        problems.append(f"{word!r}: your tokens {tokens}: {why}")
    if problems:
        raise CheckFailure(f"{len(problems)} of {len(ENCODE_WORDS)} predictions are wrong:\n  "
                           + "\n  ".join(problems))
    lines = "\n".join(f"   {word!r:9} {_merge_trace(word)}" for word in ENCODE_WORDS)
    print(f"\u2705 all {len(ENCODE_WORDS)} predictions are what BPETokenizer(merges).encode "
          f"gives. How BPE builds them (lowest rank first):\n{lines}")


# --------------------------------------------------------------------------------------------
# Exercise 13.3: characters per token of a Shakespeare vocabulary on other kinds of text

COMPRESSION_VOCAB = 1024
COMPRESSION_SLICE = slice(0, 200_000)  # the first 200,000 characters of shakespeare_text()
FACTOR = 1.5  # a prediction passes within a factor 1.5 of the measurement, either way

COMPRESSION_TEXTS = {
    "modern prose": (
        "The train was late again, so Maria opened her laptop and answered the emails she had "
        "been putting off all week. By the time the doors closed behind her, the inbox was "
        "empty and her coffee was cold. Nobody on the platform seemed to notice the rain."),
    "the same in Russian": (
        "Поезд снова опоздал, поэтому Мария открыла ноутбук и ответила на письма, которые "
        "откладывала всю неделю. Когда двери закрылись, почтовый ящик был пуст, а кофе остыл. "
        "Никто на платформе не замечал дождя."),
    "Python code": (
        "def moving_average(values: list[float], window: int = 3) -> list[float]:\n"
        "    \"\"\"The mean of each run of `window` neighbours.\"\"\"\n"
        "    if window <= 0:\n"
        "        raise ValueError(f\"window must be positive, got {window}\")\n"
        "    out = []\n"
        "    for i in range(len(values) - window + 1):\n"
        "        out.append(sum(values[i:i + window]) / window)\n"
        "    return out\n"),
    "digits of 2**1000": str(2 ** 1000),
}

COMPRESSION_REASONS = {
    ("the same in Russian", "high"):
        "a Cyrillic letter takes 2 bytes in UTF-8, and a vocabulary trained on English "
        "text has no merge for them: each token is at most one byte, so below one character "
        "per token",
    ("digits of 2**1000", "high"):
        "the training text has no digits at all, so no merge joins two of them: each digit "
        "stays one byte, one token",
    ("Python code", "high"):
        "code is not Shakespeare: identifiers, brackets, underscores and indentation were "
        "rare or absent in training, so fewer merges apply than to English prose",
    ("modern prose", "low"):
        "English is English: common words (the, was, her, and) and word pieces were learned "
        "from the plays, so modern prose compresses about as well as held-out Shakespeare",
}


@lru_cache(maxsize=1)
def compression_tokenizer() -> BPETokenizer:
    """The exercise's vocabulary: 1024 tokens trained on the first 200,000 characters of
    shakespeare_text() (deterministic, under a second)."""
    return train_bpe(shakespeare_text()[COMPRESSION_SLICE], COMPRESSION_VOCAB)


def measured_compression() -> dict[str, float]:
    """Characters per token of each text under compression_tokenizer(), and of held-out
    Shakespeare (the 10,000 characters after the training slice)."""
    tokenizer = compression_tokenizer()
    held_out = shakespeare_text()[COMPRESSION_SLICE.stop:COMPRESSION_SLICE.stop + 10_000]
    texts = {"held-out Shakespeare": held_out, **COMPRESSION_TEXTS}
    return {name: len(text) / len(tokenizer.encode(text)) for name, text in texts.items()}


def check_compression_prediction(compression_prediction_fn: Callable) -> None:
    """Check ``compression_prediction()`` -> {text name: predicted characters per token} for
    the four COMPRESSION_TEXTS: each within a factor 1.5 of what the check measures with a
    1024-token vocabulary trained on Shakespeare; then show the measurements.

    Args:
        compression_prediction_fn: the learner's function (no arguments).
    """
    names = tuple(COMPRESSION_TEXTS)
    got = prediction_dict(call_learner(compression_prediction_fn, Case("four texts")), names,
                          "compression_prediction")
    measured = measured_compression()
    values = {name: require_number(got[name], f"the prediction for {name!r}") for name in names}

    def close(value: float, truth: float) -> bool:
        return truth / FACTOR <= value <= truth * FACTOR

    if any(value <= 0 for value in values.values()):
        raise CheckFailure("a prediction of 0 or fewer characters per token cannot be: every "
                           "token covers at least one byte of the text")
    wrong = [name for name in names if not close(values[name], measured[name])]
    if wrong and all(close(1 / values[name], measured[name]) for name in names):
        raise CheckFailure("your numbers look like tokens per character; the question asks "
                           "characters per token (characters / tokens, above 1 when a token "
                           "covers several characters)")
    problems = []
    for name in wrong:
        value, truth = values[name], measured[name]
        side = "high" if value > truth else "low"
        why = COMPRESSION_REASONS.get((name, side), "think again about which merges a "
                                      "vocabulary trained on the plays has for this text")
        problems.append(f"{name!r}: {value:g} is too {side}: {why}")
    if problems:
        raise CheckFailure(f"{len(problems)} of {len(names)} predictions are more than a factor "
                           f"{FACTOR} away from the measurement:\n  " + "\n  ".join(problems))
    table = "\n".join(f"   {name:22} {measured[name]:5.2f}"
                      + (f"   (you said {values[name]:g})" if name in values else "")
                      for name in measured)
    print(f"\u2705 all {len(names)} predictions are within a factor {FACTOR} of the "
          f"measurement. Characters per token, {COMPRESSION_VOCAB}-token vocabulary trained on "
          f"Shakespeare:\n{table}")


# --------------------------------------------------------------------------------------------
# Exercise 13.4: find the bug in an encoder


def buggy_encode(text: str, tokenizer: BPETokenizer) -> list[int]:
    """The exercise's encoder, planted bug included: each merge replaces only the FIRST
    occurrence of its pair in a word (the ``break``), so a word holding a pair twice when that
    merge comes ('understand': n d ... n d) keeps the second one apart."""
    ids = []
    for piece in pretokenize(text):
        word = list(piece.encode("utf-8"))
        for a, b in tokenizer.merges:
            pair = (tokenizer.token_ids[a], tokenizer.token_ids[b])
            for i in range(len(word) - 1):
                if (word[i], word[i + 1]) == pair:
                    word[i:i + 2] = [tokenizer.token_ids[a + b]]
                    break
        ids.extend(word)
    return ids


def _encode_leftmost_first(text: str, tokenizer: BPETokenizer) -> list[int]:
    ids = []
    for piece in pretokenize(text):
        word = list(piece.encode("utf-8"))
        merged = True
        while merged:
            merged = False
            for i in range(len(word) - 1):
                if (word[i], word[i + 1]) in tokenizer.ranks:
                    new = tokenizer.token_ids[tokenizer.vocab[word[i]]
                                              + tokenizer.vocab[word[i + 1]]]
                    word[i:i + 2] = [new]
                    merged = True
                    break
        ids.extend(word)
    return ids


def _encode_without_pieces(text: str, tokenizer: BPETokenizer) -> list[int]:
    return BPETokenizer(tokenizer.merges).encode_piece(text)


def _encode_overlapping(text: str, tokenizer: BPETokenizer) -> list[int]:
    """Every occurrence merged, but a a a with (a, a) becomes aa aa."""
    ids = []
    for piece in pretokenize(text):
        word = tuple(piece.encode("utf-8"))
        for a, b in tokenizer.merges:
            pair = (tokenizer.token_ids[a], tokenizer.token_ids[b])
            word = next(iter(_merge_overlapping({word: 1}, pair, tokenizer.token_ids[a + b])))
        ids.extend(word)
    return ids


FIX_MISTAKES = [
    (buggy_encode,
     "Your encoder gives what the given one gives: the planted bug is still there. Compare "
     "it with BPETokenizer.encode on the text below, token by token (show_tokens): one word "
     "keeps a pair apart"),
    (_encode_leftmost_first,
     "Your encoder merges the leftmost pair that has a merge, whatever its rank: the given "
     "encoder's order (the merges in the order learned, each applied to the whole word) was "
     "right; the bug is elsewhere"),
    (_encode_without_pieces,
     "Your encoder no longer cuts the text into pre-tokens: merges then run across word "
     "boundaries. pretokenize was right; the bug is elsewhere"),
    (_encode_overlapping,
     "Your encoder lets occurrences overlap: 'a a a' with the pair (a, a) must become 'aa a', "
     "not 'aa aa'"),
]

INSTRUMENT = (
    "The instrument that finds this: equality with BPETokenizer.encode on many texts; the "
    "first text that differs, shown token by token (show_tokens), points at the word"
)


def fix_texts() -> list[str]:
    """Texts the fixed encoder is compared on: lines of Shakespeare after the training slice
    (some with a pair twice in a word), and a few made to show repeated pairs and overlaps."""
    lines = [line for line in shakespeare_text()[200_000:230_000].split("\n") if line.strip()]
    made = ["I understand you not, my lord.", "Mississippi banana", "aaaa aaaaa -- ----- !!!!",
            "So is it, if thou knew'st our purposes.", "Hello world's  end!  \n\n",
            "1234567 12 3"]
    return made + lines[::4]


def _tokens(tokenizer: BPETokenizer, ids: list[int]) -> str:
    return " ".join(repr(tokenizer.vocab[i].decode("utf-8", errors="replace")) for i in ids)


def check_fixed_encode(encode_fn: Callable) -> None:
    """Check ``encode(text, tokenizer)`` -> list of ids: the given encoder with its one bug
    fixed, i.e. equal to ``tokenizer.encode(text)`` on many texts, with the 1024-token
    Shakespeare vocabulary of exercise 13.3.

    Args:
        encode_fn: the learner's function.
    """
    tokenizer = compression_tokenizer()
    texts = fix_texts()
    for text in texts:
        case = Case(f"{text[:40]!r}", (text, tokenizer))
        got = call_learner(encode_fn, case, fn_name="encode")
        if isinstance(got, np.ndarray) and got.ndim == 1:
            got = got.tolist()
        if isinstance(got, str) or not isinstance(got, list | tuple):
            fix = " (a tensor: .tolist() makes it a list)" if isinstance(got, torch.Tensor) \
                else ""
            raise CheckFailure(f"encode should return a list of token ids, got {describe(got)}"
                               f"{fix} (text {text!r:.60})")
        got = [require_count(i, "a token id", case) for i in got]
        expected = tokenizer.encode(text)
        if got == expected:
            continue
        for wrong_fn, message in FIX_MISTAKES:
            wrong = wrong_fn(text, tokenizer)
            if got == wrong != expected:
                raise CheckFailure(f"{message} (text {text!r:.60}: yours {_tokens(tokenizer, got)}"
                                   f"; BPETokenizer.encode {_tokens(tokenizer, expected)}). "
                                   f"{INSTRUMENT}")
        raise CheckFailure(f"encode differs from BPETokenizer.encode on the text {text!r:.60}: "
                           f"yours {_tokens(tokenizer, got)[:300]}; expected "
                           f"{_tokens(tokenizer, expected)[:300]}")
    print(f"\u2705 encode gives exactly BPETokenizer.encode's ids on all {len(texts)} texts "
          f"(lines of Shakespeare, repeated pairs, runs of one letter, spaces, digits)")



# --------------------------------------------------------------------------------------------
# Exercise 13.5: bits per character of a unigram model


def unigram_nll(tokenizer: BPETokenizer, train_text: str, val_text: str, *, smoothing=1.0,
                vocab: str = "all", counts_from: str = "train") -> tuple[float, int]:
    """Total NLL in nats of val_text's tokens under token frequencies counted on train_text,
    add-``smoothing`` over the whole vocabulary; and the number of validation tokens. The
    keywords make the wrong answers the check recognises."""
    counts = Counter(tokenizer.encode(train_text if counts_from == "train" else val_text))
    size = tokenizer.vocab_size if vocab == "all" else len(counts)
    total = sum(counts.values())
    val_ids = tokenizer.encode(val_text)
    nll = 0.0
    for i in val_ids:
        p = (counts[i] + smoothing) / (total + (smoothing * size if vocab != "none" else 0))
        nll -= math.log(p) if p > 0 else -math.inf
    return nll, len(val_ids)


def reference_bits_per_char(tokenizer: BPETokenizer, train_text: str, val_text: str) -> float:
    """Bits per character of val_text under an add-one unigram model of train_text's tokens."""
    nll, _ = unigram_nll(tokenizer, train_text, val_text)
    return nll / len(val_text) / math.log(2)


def _bits(per: str = "char", unit: float = math.log(2), **change) -> Callable[..., float]:
    def wrong(tokenizer, train_text, val_text):
        nll, n_tokens = unigram_nll(tokenizer, train_text, val_text, **change)
        length = {"char": len(val_text), "token": n_tokens,
                  "byte": len(val_text.encode("utf-8"))}[per]
        return nll / length / unit
    return wrong


BITS_MISTAKES = [
    (_bits(per="token"),
     "Your number is bits per TOKEN: divide the total by the number of characters of the "
     "validation text, not by its number of tokens"),
    (_bits(unit=1.0),
     "Your number is in nats per character: divide by ln 2 (natural log) to get bits"),
    (_bits(unit=math.log(2) ** 2),
     "Your number is divided by ln 2 twice: with math.log2 the result is already in bits"),
    (_bits(unit=math.log(10)),
     "Your number comes from log10: bits are log base 2 (math.log2, or math.log / ln 2)"),
    (_bits(per="byte"),
     "Your number is per BYTE of UTF-8: divide by the characters, len(val_text); they differ "
     "once a character takes more than one byte"),
    (_bits(vocab="seen"),
     "Your smoothing adds one only for the tokens seen in training: add one to the count of "
     "EVERY token of the vocabulary (tokenizer.vocab_size of them), so that the denominator "
     "is N + V"),
    (_bits(vocab="none"),
     "Your probabilities add one to each count but divide by N only: the denominator must be "
     "N + V, or the probabilities sum to more than 1"),
    (_bits(counts_from="val"),
     "Your counts come from the validation text: count on train_text only, as a model only "
     "learns from its training data"),
]


def _bits_cases() -> list[Case]:
    made = BPETokenizer([(a.encode(), b.encode()) for a, b in ENCODE_MERGES])
    plays = shakespeare_text()
    return [
        Case("bytes (V=256), 'abracadabra' -> 'abra cadabra'",
             (BPETokenizer([]), "abracadabra", "abra cadabra")),
        Case("the merges of exercise 13.2, a token in validation never seen in training",
             (made, "lower lower newer lowly", " newer, lower!")),
        Case("the merges of exercise 13.2, two-byte characters in validation ('café', "
             "Cyrillic)", (made, "the cafe and the tea, lower", "café lower, чай")),
        Case("the 1024-token Shakespeare vocabulary, 20,000 / 5,000 characters of the plays",
             (compression_tokenizer(), plays[300_000:320_000], plays[320_000:325_000])),
    ]


UNSEEN = ("a token of the validation text that never occurs in the training text has count 0, "
          "so it has probability 0 without smoothing (and log(0) is undefined). That is what "
          "add-one smoothing is for: p(t) = (count(t) + 1) / (N + V), with V = "
          "tokenizer.vocab_size, for EVERY token, seen or not")


def _learner_bits(bits_fn: Callable, case: Case) -> float:
    """The learner's result; a crash that an unseen token causes (math.log(0), a division by
    its count of 0, a plain dict without it) is answered with the idea it misses."""
    try:
        got = call_learner(bits_fn, case, fn_name="unigram_bits_per_char")
    except CheckFailure as failure:
        cause = failure.__cause__
        if isinstance(cause, ValueError) and "math domain error" in str(cause):
            what = "math.log of 0 (ValueError: math domain error)"
        elif isinstance(cause, ZeroDivisionError):
            what = "a division by zero (ZeroDivisionError)"
        elif isinstance(cause, KeyError):
            what = (f"a KeyError ({cause}): that token is not in your dict of counts; "
                    "collections.Counter (or counts.get(t, 0)) gives it a count of 0,")
        else:
            raise
        raise CheckFailure(f"your function failed with {what} on the case '{case.name}': "
                           f"{UNSEEN}") from cause
    return require_real(got, "unigram_bits_per_char's result", case)


def check_bits_per_char(bits_fn: Callable) -> None:
    """Check ``unigram_bits_per_char(tokenizer, train_text, val_text)`` -> float: the total
    NLL (nats) of val_text's tokens under add-one unigram frequencies counted on train_text,
    divided by len(val_text) and by ln 2; then show bits per token and per character for
    vocabularies of 256, 512 and 1024 tokens.

    Args:
        bits_fn: the learner's function.
    """
    cases = _bits_cases()
    for case in cases:
        got = _learner_bits(bits_fn, case)
        expected = reference_bits_per_char(*case.args)
        if math.isclose(got, expected, rel_tol=1e-6):
            continue
        if not math.isfinite(got):
            raise CheckFailure(f"your result is {got} (case '{case.name}'): {UNSEEN}")
        for wrong_fn, message in BITS_MISTAKES:
            wrong = wrong_fn(*case.args)
            if math.isclose(got, wrong, rel_tol=1e-6) and not math.isclose(wrong, expected,
                                                                            rel_tol=1e-6):
                raise CheckFailure(f"{message} (seen on the case '{case.name}')")
        raise CheckFailure(f"your result {got:.6g} differs from the expected {expected:.6g} "
                           f"(case '{case.name}')")
    tokenizer, plays = compression_tokenizer(), shakespeare_text()
    train, val = plays[:200_000], plays[200_000:230_000]
    rows = []
    for size in (256, 512, 1024):
        prefix = BPETokenizer(tokenizer.merges[:size - 256])
        per_char = float(bits_fn(prefix, train, val))
        per_token = per_char * len(val) / len(prefix.encode(val))
        rows.append(f"   V = {size:4}: {per_token:5.2f} bits per token, {per_char:5.2f} bits per "
                    "character")
    print(f"\u2705 unigram_bits_per_char is correct on all {len(cases)} cases ("
          + "; ".join(c.name for c in cases) + "). With your function, trained on the first "
          "200,000 characters of the plays, measured on the next 30,000:\n" + "\n".join(rows))


__all__ = ["buggy_encode", "check_bits_per_char", "check_bpe_step",
           "check_compression_prediction", "check_encode_prediction", "check_fixed_encode",
           "compression_tokenizer", "measured_compression", "word_table", "COMPRESSION_TEXTS",
           "ENCODE_MERGES", "ENCODE_WORDS"]


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
