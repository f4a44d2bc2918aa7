"""Small synthetic tasks generated in code: copy, reverse, sort and long-range recall for
decoder-only models, and date translation for encoder-decoders.

Shape legend: N examples, T sequence (or target) length, S source length.

Every task is deterministic given its ``generator`` or ``seed``. Targets hold -100
(``IGNORE_INDEX``, the value ``F.cross_entropy`` skips) wherever nothing is to be predicted, so
the tensors go straight into course_lib's models.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from ._validate import (
    check_id_list,
    require_generator,
    require_int,
    require_non_negative_int,
    require_positive_int,
)
from .tokenizer import IGNORE_INDEX, Seq2SeqVocab

# --------------------------------------------------------------------------------------------
# Synthetic decoder-only tasks


class LMTask(NamedTuple):
    """A synthetic task for a decoder-only (language) model.

    Attributes:
        inputs: (N, T) long token ids.
        targets: (N, T) long, the next token where it is to be predicted and -100 elsewhere.
        vocab: the name of every token id, for printing and plot labels.
    """

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Sequence[int] | torch.Tensor, sep: str = " ") -> str:
        """Token names of a 1-D sequence of ids, joined by ``sep`` (-100 shows as ``.``)."""
        ids = check_id_list("ids", ids, self.vocab_size, also=(IGNORE_INDEX,))
        return sep.join("." if i == IGNORE_INDEX else self.vocab[i] for i in ids)


def _generator(generator: torch.Generator | None, seed: int | None) -> torch.Generator:
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if require_generator("generator", generator) is not None:
        return generator
    return torch.Generator().manual_seed(0 if seed is None else require_int("seed", seed))


def _digit_vocab(n_symbols: int, *extra: str) -> tuple[str, ...]:
    symbols = tuple(str(i) if n_symbols <= 10 else f"s{i}" for i in range(n_symbols))
    return symbols + extra


def _answer_task(
    transform: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    length: int,
    n_symbols: int,
    generator: torch.Generator | None,
    seed: int | None,
) -> LMTask:
    """Shared layout of copy/reverse/sort: ``x_1..x_L SEP y_1..y_L``, loss on the y's only."""
    require_positive_int("n", n)
    require_positive_int("length", length)
    require_positive_int("n_symbols", n_symbols)
    gen = _generator(generator, seed)
    sep = n_symbols
    x = torch.randint(n_symbols, (n, length), generator=gen)  # (N, L)
    y = transform(x)  # (N, L)
    seq = torch.cat([x, torch.full((n, 1), sep), y], dim=1)  # (N, 2L + 1)
    inputs = seq[:, :-1].clone()  # (N, 2L)
    targets = seq[:, 1:].clone()  # (N, 2L), targets[:, t] is the token after inputs[:, t]
    targets[:, : length] = IGNORE_INDEX  # predicting the random x's (or SEP) is not the task
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "|"))


def copy_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Copy a random sequence: ``3 1 4 1 | 3 1 4 1``.

    Tests whether a model can look back a fixed distance (``length + 1`` tokens): attention
    does this in one step; an RNN must carry every symbol in its state.

    Args:
        n: N, the number of examples.
        length: L, symbols per sequence (inputs and targets are 2L long).
        n_symbols: how many distinct symbols; the separator ``|`` is id ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, 2L); only the L answer positions have
        targets.
    """
    return _answer_task(lambda x: x.clone(), n, length, n_symbols, generator, seed)


def reverse_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Reverse a random sequence: ``3 1 4 2 | 2 4 1 3``.

    Tests look-ups whose distance changes with the position (the first answer symbol is the
    last input symbol): the model must use positions, not a fixed offset.

    Args and Returns: as :func:`copy_task`.
    """
    return _answer_task(lambda x: x.flip(1), n, length, n_symbols, generator, seed)


def sort_task(
    n: int,
    length: int = 8,
    *,
    n_symbols: int = 10,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Sort a random sequence in ascending order: ``3 1 4 1 | 1 1 3 4``.

    Tests content-based attention: which input comes next depends on the values, not on where
    they sit, so the model must compare symbols (and count repeats).

    Args and Returns: as :func:`copy_task`.
    """
    return _answer_task(
        lambda x: x.sort(dim=1).values, n, length, n_symbols, generator, seed
    )


def recall_task(
    n: int,
    distance: int,
    *,
    n_symbols: int = 8,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Long-range recall: remember the first symbol through ``distance`` distractors.

    Layout: ``v d_1 ... d_distance ?  ->  v``: the model reads a symbol ``v``, then
    ``distance`` random symbols from the same alphabet, then the query token ``?``, and must
    answer ``v``. Only that last prediction counts. An RNN must keep ``v`` in its hidden state
    through ``distance`` updates (and its gradient must survive as many steps back), so it
    fails as ``distance`` grows; self-attention looks straight back at position 0, whatever
    the distance. Chance accuracy is ``1 / n_symbols``.

    Args:
        n: N, the number of examples.
        distance: number of distractors between the symbol and the query (>= 0).
        n_symbols: size of the alphabet for the symbol and the distractors; ``?`` is id
            ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, distance + 2); targets are -100 except
        the last column, which holds the first input symbol.
    """
    require_positive_int("n", n)
    require_positive_int("n_symbols", n_symbols)
    require_non_negative_int("distance", distance)
    gen = _generator(generator, seed)
    query = n_symbols
    seq = torch.randint(n_symbols, (n, distance + 1), generator=gen)  # (N, distance + 1)
    inputs = torch.cat([seq, torch.full((n, 1), query)], dim=1)  # (N, T), T = distance + 2
    targets = torch.full_like(inputs, IGNORE_INDEX)  # (N, T)
    targets[:, -1] = seq[:, 0]
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "?"))



# --------------------------------------------------------------------------------------------
# Synthetic encoder-decoder task: date translation

_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")



class TranslationTask(NamedTuple):
    """A synthetic sequence-to-sequence task, ready for :class:`EncoderDecoder`.

    Attributes:
        src: (N, S) source ids, right-padded with ``vocab.pad_id``.
        tgt_in: (N, T) decoder inputs: ``<bos>`` then the target, padded with ``pad_id``.
        tgt_out: (N, T) what to predict: the target then ``<eos>``, padded with -100.
        vocab: one :class:`Seq2SeqVocab` shared by source and target.
        src_text, tgt_text: the examples as strings.
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    vocab: Seq2SeqVocab
    src_text: list[str]
    tgt_text: list[str]


def _pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def date_vocab() -> Seq2SeqVocab:
    """The vocabulary of :func:`date_task`: specials, space, ``-``, digits and month letters."""
    return Seq2SeqVocab.from_chars(" -0123456789" + "".join(_MONTHS))


def date_task(
    n: int,
    *,
    first_year: int = 1950,
    last_year: int = 2049,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> TranslationTask:
    """Translate a written date into ISO format: ``"7 Mar 2024"  ->  "2024-03-07"``.

    The target is a permutation of the source's parts (year, month, day), so each target
    character has one source span it should read: a trained model's cross-attention shows a
    permuted block pattern (year digits attend to the end of the source, the month to the
    month name, the day to the start), clearest with one encoder and one decoder layer (a
    64-wide model of that size learns the task exactly in a few hundred updates on a CPU).
    The month name must be mapped to its number, and days below 10 have no leading zero in
    the source, so sources have two lengths and are padded.

    Args:
        n: N, the number of examples.
        first_year, last_year: range of years; dates are uniform over the days in it.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`TranslationTask` with src (N, 11) and tgt_in, tgt_out (N, 11).
    """
    require_positive_int("n", n)
    require_int("first_year", first_year)
    require_int("last_year", last_year)
    if not 1 <= first_year <= last_year <= 9999:
        raise ValueError(
            f"need 1 <= first_year <= last_year <= 9999, got first_year={first_year}, "
            f"last_year={last_year}"
        )
    gen = _generator(generator, seed)
    vocab = date_vocab()
    start = datetime.date(first_year, 1, 1).toordinal()
    n_days = datetime.date(last_year, 12, 31).toordinal() - start + 1
    days = torch.randint(n_days, (n,), generator=gen).tolist()
    src_text, tgt_text = [], []
    for offset in days:
        date = datetime.date.fromordinal(start + offset)
        src_text.append(f"{date.day} {_MONTHS[date.month - 1]} {date.year:04d}")
        tgt_text.append(f"{date.year:04d}-{date.month:02d}-{date.day:02d}")
    src = _pad_rows([vocab.encode(s) for s in src_text], vocab.pad_id)  # (N, S)
    tgt = [vocab.encode(t) for t in tgt_text]
    tgt_in = _pad_rows([[vocab.bos_id, *t] for t in tgt], vocab.pad_id)  # (N, T)
    tgt_out = _pad_rows([[*t, vocab.eos_id] for t in tgt], IGNORE_INDEX)  # (N, T)
    return TranslationTask(src, tgt_in, tgt_out, vocab, src_text, tgt_text)


# --------------------------------------------------------------------------------------------
# Synthetic encoder-decoder task with a known alignment: word order

_LEXICON = {  # masculine nouns and adjectives that follow the noun, so the toy French reads well
    "det": {"the": "le", "a": "un", "this": "ce", "my": "mon", "his": "son",
            "every": "chaque"},
    "noun": {"cat": "chat", "dog": "chien", "horse": "cheval", "king": "roi",
             "wolf": "loup", "fox": "renard", "boy": "garçon", "book": "livre"},
    "adj": {"red": "rouge", "black": "noir", "white": "blanc", "green": "vert",
            "blue": "bleu", "grey": "gris", "happy": "heureux", "fast": "rapide"},
    "verb": {"sees": "voit", "likes": "aime", "follows": "suit", "finds": "trouve",
             "calls": "appelle", "watches": "regarde"},
}


class AlignedTranslationTask(NamedTuple):
    """A synthetic translation task whose word alignment is known, for :class:`EncoderDecoder`.

    Attributes:
        src: (N, S) source word ids, right-padded with ``vocab.pad_id``.
        tgt_in: (N, T) decoder inputs: ``<bos>`` then the target words, padded with pad_id.
        tgt_out: (N, T) what to predict: the target words then ``<eos>``, padded with -100.
        alignment: (N, T) for each position of ``tgt_out``, the index of the source word it
            translates, and -100 where there is none (``<eos>``, padding).
        vocab: one :class:`Seq2SeqVocab` of words shared by source and target.
        src_text, tgt_text: the sentences as strings (words separated by spaces).
    """

    src: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    alignment: torch.Tensor
    vocab: Seq2SeqVocab
    src_text: list[str]
    tgt_text: list[str]

    def words(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The words of a 1-D sequence of ids, separated by spaces: stops at ``<eos>`` and
        leaves out ``<bos>`` and padding."""
        ids = check_id_list("ids", ids, self.vocab.vocab_size, also=(IGNORE_INDEX,))
        out = []
        for i in ids:
            if i == self.vocab.eos_id:
                break
            if i not in (self.vocab.pad_id, self.vocab.bos_id, IGNORE_INDEX):
                out.append(self.vocab.tokens[i])
        return " ".join(out)


def word_order_vocab() -> Seq2SeqVocab:
    """The vocabulary of :func:`word_order_task`: specials, then every English and French word."""
    words = [w for kind in _LEXICON.values() for pair in kind.items() for w in pair]
    return Seq2SeqVocab(("<pad>", "<bos>", "<eos>", *sorted(set(words))))


def _noun_phrase(det: str, adjectives: list[str], noun: str, start: int
                 ) -> tuple[list[str], list[str], list[int]]:
    """English ``det adj_1 .. adj_k noun`` and its toy French ``det' noun' adj_k' .. adj_1'``,
    with the index (from ``start``) of the English word each French word translates."""
    english = [det, *adjectives, noun]
    k = len(adjectives)
    order = [0, k + 1, *range(k, 0, -1)]  # det, noun, then the adjectives mirrored
    french = [_translate(english[i]) for i in order]
    return english, french, [start + i for i in order]


def _translate(word: str) -> str:
    return next(kind[word] for kind in _LEXICON.values() if word in kind)


def word_order_task(
    n: int,
    *,
    max_adjectives: int = 2,
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> AlignedTranslationTask:
    """Translate toy English into toy French, word for word but with French word order.

    ``the happy black cat sees a fox  ->  le chat noir heureux voit un renard``: every English
    word has exactly one French word (no genders, no agreement), and in each noun phrase the
    adjectives move after the noun in mirrored order, as in the English-French alignment
    pictures of Bahdanau et al. (2015) ("European Economic Area" -> "zone économique
    européenne"). So the gold alignment is known: a permutation with crossings inside each
    noun phrase. Sentences are ``det adj* noun verb det adj* noun`` with 0 to
    ``max_adjectives`` adjectives per noun phrase and no word used twice in a sentence, so
    every position of the source holds a different word and the gold alignment is the only
    right one.

    Args:
        n: N, the number of examples.
        max_adjectives: at most this many adjectives per noun phrase, 0 to 3.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`AlignedTranslationTask` with src (N, S) and tgt_in, tgt_out, alignment (N, T),
        S = 5 + 2 * max_adjectives and T = S + 1 (for the longest sentences).
    """
    require_positive_int("n", n)
    if not 0 <= require_int("max_adjectives", max_adjectives) <= 3:
        raise ValueError(f"max_adjectives must be an integer from 0 to 3, got {max_adjectives!r}")
    gen = _generator(generator, seed)
    vocab = word_order_vocab()
    words = {kind: list(table) for kind, table in _LEXICON.items()}
    rows: dict[str, list] = {"src": [], "tgt": [], "align": [], "src_text": [], "tgt_text": []}
    for _ in range(n):
        dets = [words["det"][int(i)] for i in torch.randperm(6, generator=gen)[:2]]
        nouns = [words["noun"][int(i)] for i in torch.randperm(8, generator=gen)[:2]]
        adjectives = [words["adj"][int(i)] for i in torch.randperm(8, generator=gen)]
        counts = torch.randint(max_adjectives + 1, (2,), generator=gen).tolist()
        verb = words["verb"][int(torch.randint(6, (1,), generator=gen))]
        en1, fr1, al1 = _noun_phrase(dets[0], adjectives[:counts[0]], nouns[0], 0)
        verb_at = len(en1)
        en2, fr2, al2 = _noun_phrase(dets[1], adjectives[counts[0]:counts[0] + counts[1]],
                                     nouns[1], verb_at + 1)
        english, french = [*en1, verb, *en2], [*fr1, _translate(verb), *fr2]
        rows["src"].append([vocab._index[w] for w in english])
        rows["tgt"].append([vocab._index[w] for w in french])
        rows["align"].append([*al1, verb_at, *al2, IGNORE_INDEX])  # <eos> translates nothing
        rows["src_text"].append(" ".join(english))
        rows["tgt_text"].append(" ".join(french))
    src = _pad_rows(rows["src"], vocab.pad_id)  # (N, S)
    tgt_in = _pad_rows([[vocab.bos_id, *t] for t in rows["tgt"]], vocab.pad_id)  # (N, T)
    tgt_out = _pad_rows([[*t, vocab.eos_id] for t in rows["tgt"]], IGNORE_INDEX)  # (N, T)
    alignment = _pad_rows(rows["align"], IGNORE_INDEX)  # (N, T)
    return AlignedTranslationTask(src, tgt_in, tgt_out, alignment, vocab, rows["src_text"],
                                  rows["tgt_text"])
