"""Checks for chapter 13, tokens: one step of BPE training as a fast trainer does it (the merge
and the pair counts it changes, without counting again), a word encoded by hand from a list of
merges (predicted, then verified), how well a Shakespeare vocabulary compresses other kinds of
text (predicted, then measured), a streaming decoder with a planted bug to find, and bits per
character of a unigram model.

The references are course_lib's :func:`~course_lib.bpe.merge_pair`,
:func:`~course_lib.bpe.most_frequent_pair`, :func:`~course_lib.bpe.train_bpe` and
:class:`~course_lib.bpe.BPETokenizer`.
"""

from __future__ import annotations

import codecs
import copy
import inspect
import math
import numbers
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

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
# Exercise 13.1: merge_and_count(word_counts, pair, new_id) -> (merged table, count changes)


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


def reference_changes(word_counts: Mapping[tuple[int, ...], int], pair: tuple[int, int],
                      new_id: int) -> dict[tuple[int, int], int]:
    """How each pair count changes with the merge: the counts of the merged table minus those
    of ``word_counts``, computed as a full recount (zero changes left out)."""
    before, after = reference_pairs(word_counts), reference_pairs(
        reference_merge(word_counts, pair, new_id))
    changes = {p: after.get(p, 0) - before.get(p, 0) for p in before.keys() | after.keys()}
    return {p: change for p, change in changes.items() if change}


def _changed_words(word_counts, pair, new_id):
    """(old word, new word, count) for the words that hold ``pair``."""
    for word, count in word_counts.items():
        new = tuple(merge_pair(word, pair, new_id))
        if new != tuple(word):
            yield tuple(word), new, count


def _changes_only_the_pair(word_counts, pair, new_id):
    return {pair: -reference_pairs(word_counts).get(pair, 0)}


def _changes_keeping_broken_neighbours(word_counts, pair, new_id):
    """The pair taken away and the pairs with the new token added; the neighbours the merge
    broke, (x, a) and (b, y), left as they were."""
    changes: Counter = Counter({pair: -reference_pairs(word_counts).get(pair, 0)})
    for _, new, count in _changed_words(word_counts, pair, new_id):
        for p in zip(new, new[1:], strict=False):
            if new_id in p:
                changes[p] += count
    return dict(changes)


def _changes_once_per_word(word_counts, pair, new_id):
    changes: Counter = Counter()
    for old, new, _ in _changed_words(word_counts, pair, new_id):
        changes.subtract(zip(old, old[1:], strict=False))
        changes.update(zip(new, new[1:], strict=False))
    return dict(changes)


def _changes_reversed(word_counts, pair, new_id):
    return {p: -change for p, change in reference_changes(word_counts, pair, new_id).items()}


def _changes_as_new_counts(word_counts, pair, new_id):
    return reference_pairs(reference_merge(word_counts, pair, new_id))


CHANGE_MISTAKES = [
    (_changes_as_new_counts,
     "Your changes are the pair counts of the merged table, not how they changed: give each "
     "pair's count after the merge minus its count before (most are 0 and can be left out)"),
    (_changes_reversed,
     "Your changes have the wrong sign: they are the counts before the merge minus after. A "
     "pair the merge breaks goes down (negative), a pair with the new token goes up"),
    (_changes_only_the_pair,
     "Your changes only take the merged pair away. The words that held it also lose the pairs "
     "on either side of each occurrence ('b a n a n a' with (a, n) loses (b, a) and (n, a)), "
     "and gain the pairs with the new token"),
    (_changes_keeping_broken_neighbours,
     "You added the pairs with the new token, but the pairs the merge broke are still "
     "counted: in 'b a n a n a' with (a, n), (b, a) and (n, a) are gone after the merge"),
    (_changes_once_per_word,
     "Your changes ignore how often each word occurs: a word seen 5 times changes each of its "
     "pairs' counts by 5 (multiply by the word's count)"),
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
    """(word_counts, pair, new_id) cases, the pair one that occurs in the table."""
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
    words = {(300, 97, 300): 4, (97, 300): 1, (98, 98): 2}  # ids of earlier merges appear too
    cases.append(Case("words holding a merged token (id 300), pair (300, 97)",
                      (words, (300, 97), 301)))
    return cases


def _keys_and_counts(got: Any, what: str, fn_name: str, case: Case, length: int | None,
                     signed: bool = False):
    """A learner's table as {tuple of ints: int}, zero counts dropped, or a clear failure;
    ``signed``: the values are changes and may be negative."""
    if not isinstance(got, Mapping):
        raise CheckFailure(f"{what} should be a dict, got {describe(got)} (case "
                           f"'{case.name}')")
    table = {}
    for key, value in got.items():
        if not isinstance(key, tuple) or (length is not None and len(key) != length):
            shape = "a tuple of 2 token ids, like (116, 104)" if length else \
                "a tuple of token ids"
            raise CheckFailure(f"each key of {what} should be {shape}; got the key "
                               f"{key!r:.60} (case '{case.name}')")
        ids = tuple(require_count(token, f"a token id in {what}", case) for token in key)
        label = f"the {'change' if signed else 'count'} of {key!r:.40}"
        if signed:  # an int, negative allowed: require_count's rule on its absolute value
            require_count(abs(value) if isinstance(value, numbers.Integral) else value,
                          label, case)
            count = int(value)
        else:
            count = require_count(value, label, case)
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
    raise CheckFailure(f"{what} differs from the expected one (case '{case.name}'): "
                       f"{_differences(got, expected)}")


def _learner_step(fn: Callable, case: Case) -> tuple[dict, dict]:
    """The learner's (merged table, changes) on one case, validated, zeros dropped; the
    caller's table must come back unchanged."""
    changed = []

    def watched(word_counts, *rest):  # call_learner passes a copy: watch the copy
        before = copy.deepcopy(word_counts)
        result = fn(word_counts, *rest)
        changed.append(word_counts != before)
        return result

    watched.__signature__ = inspect.signature(fn) if callable(fn) else None
    got = call_learner(watched if callable(fn) else fn, case, fn_name="merge_and_count")
    if any(changed):
        raise CheckFailure("merge_and_count changed the table it was given (words or counts): "
                           "build a new dict and leave the caller's as it was; a trainer "
                           "still needs the old words to know which pairs they held")
    if not isinstance(got, tuple | list) or len(got) != 2:
        raise CheckFailure(f"merge_and_count should return two dicts, (merged, changes), got "
                           f"{describe(got)} (case '{case.name}')")
    merged = _keys_and_counts(got[0], "the merged table", "merge_and_count", case, None)
    changes = _keys_and_counts(got[1], "the changes", "merge_and_count", case, 2, signed=True)
    return merged, changes


def _train_with(fn: Callable, text: str, n_merges: int):
    """The merges learned from ``text`` when the pairs are counted once and then only
    updated with the learner's changes (most_frequent_pair picks each merge)."""
    table = word_table(text)
    counts = reference_pairs(table)
    vocab = {i: bytes([i]) for i in range(256)}
    merges = []
    for new_id in range(256, 256 + n_merges):
        if not counts:
            break
        a, b = most_frequent_pair(counts)
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        case = Case(f"training merge {new_id - 256 + 1} on the opening of Shakespeare",
                    (table, (a, b), new_id))
        table, changes = _learner_step(fn, case)
        for pair, change in changes.items():
            counts[pair] = counts.get(pair, 0) + change
            if counts[pair] < 0:
                raise CheckFailure(f"after your changes of {case.name} the pair {pair} has a "
                                   f"count of {counts[pair]}: a count cannot go below 0")
            if counts[pair] == 0:
                del counts[pair]
    return merges


TRAIN_TEXT_SLICE = slice(0, 3000)  # the opening of shakespeare_text()
TRAIN_MERGES = 40


def check_merge_and_count(fn: Callable) -> None:
    """Check ``merge_and_count(word_counts, pair, new_id)`` -> ``(merged, changes)``: the new
    {word: count} table with every occurrence of ``pair`` merged, and {pair: change}, how
    each pair count changes (zeros may be left out). Then train 40 merges counting the pairs
    once and adding only the learner's changes, and compare with ``train_bpe``'s merges.

    Args:
        fn: the learner's function.
    """
    cases = _table_cases(seed=131)
    for case in cases:
        merged, changes = _learner_step(fn, case)
        _diagnose(merged, reference_merge(*case.args), MERGE_MISTAKES, case.args, case,
                  "Your merged table")
        _diagnose(changes, reference_changes(*case.args), CHANGE_MISTAKES, case.args, case,
                  "Your table of changes")
    text = shakespeare_text()[TRAIN_TEXT_SLICE]
    learned = _train_with(fn, text, TRAIN_MERGES)
    expected = train_bpe(text, 256 + TRAIN_MERGES).merges
    if learned != expected:
        k = next(i for i, (m, e) in enumerate(zip(learned + [None] * len(expected), expected,
                                                   strict=False)) if m != e)
        raise CheckFailure(f"Trained with your changes, merge {k + 1} is "
                           f"{learned[k] if k < len(learned) else 'missing'} where train_bpe "
                           f"learns {expected[k]} (the first {TRAIN_MERGES} merges on the "
                           f"first {len(text):,} characters of Shakespeare)")
    print(f"\u2705 merge_and_count is correct on all {len(cases)} tables (repeated pairs, "
          f"'a a a', one-letter words, merged tokens), and counting the pairs once, then only "
          f"adding your changes, learns train_bpe's first {TRAIN_MERGES} merges exactly "
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
# Exercise 13.4: find the bug in a streaming decoder


def buggy_stream(ids: list[int], tokenizer: BPETokenizer) -> list[str]:
    """The exercise's streaming decoder, planted bug included: each token's bytes are decoded
    on their own, so a character whose bytes two tokens share comes out as U+FFFD twice."""
    return [tokenizer.vocab[i].decode("utf-8", errors="replace") for i in ids]


def reference_stream(ids: list[int], tokenizer: BPETokenizer, *, final: bool = True
                     ) -> list[str]:
    """The text each id adds, each character given out as soon as its last byte has arrived:
    Python's incremental UTF-8 decoder, which keeps an unfinished character's bytes between
    calls; at the end (``final``) what is left comes out as U+FFFD, as in ``decode``."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pieces = [decoder.decode(tokenizer.vocab[i]) for i in ids]
    if pieces and final:
        pieces[-1] += decoder.decode(b"", final=True)
    return pieces


def _stream_ignoring(ids, tokenizer):
    return [tokenizer.vocab[i].decode("utf-8", errors="ignore") for i in ids]


def _stream_without_flush(ids, tokenizer):
    return reference_stream(ids, tokenizer, final=False)


def _stream_at_the_end(ids, tokenizer):
    return [""] * (len(ids) - 1) + [tokenizer.decode(ids)] if ids else []


STREAM_MISTAKES = [
    (buggy_stream,
     "Your decoder gives what the given one gives: the planted mistake is still there"),
    (_stream_without_flush,
     "Your decoder loses the bytes still waiting when the ids run out: a sampled sequence "
     "can end halfway through a character, and decode writes what is left as U+FFFD"),
    (_stream_ignoring,
     "Your decoder drops the characters whose bytes are shared by two tokens: each token's "
     "bytes decoded on their own with errors='ignore' lose them instead of waiting for the "
     "rest of the character"),
]
TIMING_MISTAKES = [
    (_stream_at_the_end,
     "Your decoder holds everything back until the last id: the text is right, but a chat "
     "window would show nothing while the model generates. Give out each character as soon "
     "as its last byte has arrived"),
]

STREAM_INSTRUMENT = (
    "The instrument that finds this: the round trip, the pieces joined against "
    "tokenizer.decode(ids) on many texts; the first text that differs, read token by token "
    "(tokenizer.vocab[i] for each id), points at the character")


def stream_cases() -> list[tuple[str, list[int], bool]]:
    """(name, ids, whether the ids' bytes are valid UTF-8) for the 1024-token Shakespeare
    vocabulary of exercise 13.3: lines of the plays, texts of other scripts, and id lists
    that a model could sample: cut halfway through a character, or random bytes."""
    tok = compression_tokenizer()
    lines = [line for line in shakespeare_text()[200_000:203_000].split("\n") if line.strip()]
    texts = {
        "lines of the plays": "\n".join(lines),
        "accents, a dash and emoji": "naïve café — 🙂🙂 déjà vu",
        "Russian (exercise 13.3)": COMPRESSION_TEXTS["the same in Russian"],
        "Japanese, three bytes a character": "日本語のテキスト",
    }
    cases = [(name, tok.encode(text), True) for name, text in texts.items()]
    emoji = tok.encode("Good night 🙂")
    cases.append(("a sequence cut halfway through an emoji", emoji[:-1], False))
    lone = [tok.token_ids[bytes([0x80])]]
    cases.append(("a lone continuation byte between words",
                  tok.encode("so ") + lone + tok.encode(" be it"), False))
    rng = random.Random(134)
    cases.append(("40 random byte tokens", [rng.choice(range(97, 256)) for _ in range(40)],
                  False))
    cases.append(("no ids at all", [], True))
    return cases


def _stream_tokens(tokenizer: BPETokenizer, ids: list[int], limit: int = 12) -> str:
    return " ".join(str(tokenizer.vocab[i]) for i in ids[:limit]) + (
        " ..." if len(ids) > limit else "")


def _learner_pieces(stream_fn: Callable, name: str, ids: list[int],
                    tokenizer: BPETokenizer) -> list[str]:
    case = Case(name, (list(ids), tokenizer))
    try:
        got = stream_fn(*case.args)
        got = list(got) if not isinstance(got, str) and hasattr(got, "__iter__") else got
    except UnicodeDecodeError as exc:
        raise CheckFailure(
            f"stream_decode raised UnicodeDecodeError on the case '{name}' ({exc}). A model "
            "can sample ids whose bytes are not valid UTF-8; tokenizer.decode writes U+FFFD "
            "for them (errors='replace'), and so must a streaming decoder") from None
    except (NotImplementedError, CheckFailure):
        raise
    except Exception:  # noqa: BLE001 (reported by call_learner with the inputs)
        got = call_learner(stream_fn, case, fn_name="stream_decode")
    if not isinstance(got, list) or not all(isinstance(p, str) for p in got):
        raise CheckFailure(f"stream_decode should return a list of strings, one per id, got "
                           f"{describe(got)} (case '{name}')")
    if len(got) != len(ids):
        raise CheckFailure(f"stream_decode should give one string per id (\"\" while a "
                           f"character is unfinished): {len(ids)} ids, {len(got)} strings "
                           f"(case '{name}')")
    return got


def check_stream_decode(stream_fn: Callable) -> None:
    """Check ``stream_decode(ids, tokenizer)`` -> one string per id: joined, exactly
    ``tokenizer.decode(ids)`` for any ids; for ids whose bytes are valid UTF-8, each
    character given out with the id that brings its last byte. The 1024-token Shakespeare
    vocabulary of exercise 13.3.

    Args:
        stream_fn: the learner's function.
    """
    tokenizer = compression_tokenizer()
    cases = stream_cases()
    for name, ids, valid in cases:
        got = _learner_pieces(stream_fn, name, ids, tokenizer)
        expected = tokenizer.decode(ids)
        if "".join(got) != expected:
            for wrong_fn, message in STREAM_MISTAKES:
                wrong = wrong_fn(ids, tokenizer)
                if "".join(wrong) == "".join(got) != expected:
                    raise CheckFailure(
                        f"{message} (case '{name}': joined, yours is {''.join(got)[:60]!r}, "
                        f"decode gives {expected[:60]!r}; the tokens' bytes: "
                        f"{_stream_tokens(tokenizer, ids)}). {STREAM_INSTRUMENT}")
            raise CheckFailure(f"your pieces, joined, differ from tokenizer.decode(ids) on the "
                               f"case '{name}': yours {''.join(got)[:80]!r}, decode "
                               f"{expected[:80]!r}")
        if not valid:
            continue
        right = reference_stream(ids, tokenizer)
        shown, due = "", ""
        for k, (mine, theirs) in enumerate(zip(got, right, strict=True)):
            shown, due = shown + mine, due + theirs
            if shown == due:
                continue
            for wrong_fn, message in TIMING_MISTAKES:
                if wrong_fn(ids, tokenizer) == got:
                    raise CheckFailure(f"{message} (case '{name}')")
            raise CheckFailure(
                f"after id {k} of the case '{name}' your pieces show {shown[-40:]!r}, but the "
                f"characters whose bytes have all arrived are {due[-40:]!r}: each character "
                "comes out with the id that brings its last byte, not earlier and not later")
    print(f"\u2705 stream_decode gives tokenizer.decode's text on all {len(cases)} cases (the "
          "plays, accents, emoji, Russian, Japanese, a sequence cut inside a character, invalid "
          "bytes), each character as soon as its last byte has arrived")

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


__all__ = ["buggy_stream", "check_bits_per_char", "check_merge_and_count",
           "check_compression_prediction", "check_encode_prediction", "check_stream_decode",
           "compression_tokenizer", "measured_compression", "word_table", "COMPRESSION_TEXTS",
           "ENCODE_MERGES", "ENCODE_WORDS"]


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
