"""Small synthetic tasks generated in code: copy, long-range recall and repeated random
segments for decoder-only models, a toy translation with a known word alignment for
encoder-decoders, and BERT's masking rule for a masked language model.

Shape legend: N examples, T sequence (or target) length, S source length.

Every task is deterministic given its ``generator`` or ``seed``. Targets hold -100
(``IGNORE_INDEX``, the value ``F.cross_entropy`` skips) wherever nothing is to be predicted, so
the tensors go straight into course_lib's models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._validate import (
    check_positive_ints,
    check_token_ids,
    checks_wanted,
    require_choice,
    require_generator,
    require_id_list,
    require_int,
    require_non_negative_int,
    require_probability,
)
from .tokenizer import IGNORE_INDEX, Seq2SeqVocab


class LMTask(NamedTuple):
    """A synthetic task for a decoder-only (language) model: ``inputs`` (N, T) token ids,
    ``targets`` (N, T), the next token where it is to be predicted and -100 elsewhere, and
    ``vocab``, the name of every id (for printing and plot labels)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    vocab: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def decode(self, ids: Sequence[int] | torch.Tensor, sep: str = " ") -> str:
        """Token names of a 1-D sequence of ids, joined by ``sep`` (-100 shows as ``.``)."""
        ids = require_id_list("ids", ids, self.vocab_size, also=(IGNORE_INDEX,))
        return sep.join("." if i == IGNORE_INDEX else self.vocab[i] for i in ids)


def _generator(generator: torch.Generator | None, seed: int | None) -> torch.Generator:
    """The task's random stream: ``generator``, or a new one from ``seed`` (0 if neither)."""
    check_randomness(generator, seed)
    return generator if generator is not None else torch.Generator().manual_seed(int(seed or 0))


def _digit_vocab(n_symbols: int, extra: str) -> tuple[str, ...]:
    return (*(str(i) if n_symbols <= 10 else f"s{i}" for i in range(n_symbols)), extra)


def copy_task(
    n: int, length: int = 8, *, n_symbols: int = 10, generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Copy a random sequence: ``3 1 4 1 | 3 1 4 1``, the loss on the copy only.

    Tests whether a model can look back a fixed distance (``length + 1`` tokens): attention
    does this in one step; an RNN must carry every symbol in its state.

    Args:
        n: N, the number of examples. length: L, symbols per sequence.
        n_symbols: how many distinct symbols; the separator ``|`` is id ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, 2L); only the L answers have targets.
    """
    check_positive_ints(n=n, length=length, n_symbols=n_symbols)
    gen = _generator(generator, seed)
    x = torch.randint(n_symbols, (n, length), generator=gen)  # (N, L)
    seq = torch.cat([x, torch.full((n, 1), n_symbols), x.clone()], dim=1)  # (N, 2L + 1)
    inputs = seq[:, :-1].clone()  # (N, 2L)
    targets = seq[:, 1:].clone()  # (N, 2L), targets[:, t] is the token after inputs[:, t]
    targets[:, :length] = IGNORE_INDEX  # predicting the random x's (or SEP) is not the task
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "|"))


def recall_task(
    n: int, distance: int, *, n_symbols: int = 8, generator: torch.Generator | None = None,
    seed: int | None = None,
) -> LMTask:
    """Long-range recall: ``v d_1 ... d_distance ?  ->  v``, remember the first symbol through
    ``distance`` random distractors of the same alphabet; only the answer after ``?`` counts.

    An RNN must keep ``v`` in its state (and its gradient must survive) through ``distance``
    updates, so it fails as ``distance`` grows; self-attention looks straight back at
    position 0. Chance accuracy is ``1 / n_symbols``.

    Args:
        n: N. distance: distractors between the symbol and the query (>= 0).
        n_symbols: the alphabet's size; ``?`` is id ``n_symbols``.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, distance + 2); targets are -100 except the
        last column, which holds the first input symbol.
    """
    check_positive_ints(n=n, n_symbols=n_symbols)
    require_non_negative_int("distance", distance)
    gen = _generator(generator, seed)
    seq = torch.randint(n_symbols, (n, distance + 1), generator=gen)  # (N, distance + 1)
    inputs = torch.cat([seq, torch.full((n, 1), n_symbols)], dim=1)  # (N, T), T = distance + 2
    targets = torch.full_like(inputs, IGNORE_INDEX)  # (N, T)
    targets[:, -1] = seq[:, 0]
    return LMTask(inputs, targets, _digit_vocab(n_symbols, "?"))


def repeated_segments(
    n_sequences: int, segment_len: int, vocab_size: int, *,
    generator: torch.Generator | None = None, seed: int | None = None,
) -> LMTask:
    """Random segments shown twice: ``7 2 9 4 | 7 2 9 4`` (no separator), loss everywhere.

    The first half is uniform noise, so nothing predicts it better than chance (loss
    log V). In the second half every next token is written earlier in the sequence: a model
    that finds the earlier copy of the current token and reads the token after it (an
    *induction head*, chapter 11) predicts it exactly.

    Args:
        n_sequences: N. segment_len: L, the random segment's length.
        vocab_size: V; tokens are drawn uniformly from 0..V-1.
        generator, seed: randomness (one or the other; seed 0 if neither).

    Returns:
        :class:`LMTask` with inputs and targets (N, 2L): targets[:, t] = inputs[:, t + 1],
        and -100 at the last position (nothing follows it).
    """
    check_positive_ints(n_sequences=n_sequences, segment_len=segment_len, vocab_size=vocab_size)
    gen = _generator(generator, seed)
    segment = torch.randint(vocab_size, (n_sequences, segment_len), generator=gen)  # (N, L)
    inputs = torch.cat([segment, segment], dim=1)  # (N, 2L)
    targets = torch.full_like(inputs, IGNORE_INDEX)  # (N, 2L)
    targets[:, :-1] = inputs[:, 1:]  # the next token; the last one has none
    vocab = tuple(str(i) if vocab_size <= 10 else f"s{i}" for i in range(vocab_size))
    return LMTask(inputs, targets, vocab)


def _pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


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
        ids = require_id_list("ids", ids, self.vocab.vocab_size, also=(IGNORE_INDEX,))
        out = []
        for i in ids:
            if i == self.vocab.eos_id:
                break
            if i not in (self.vocab.pad_id, self.vocab.bos_id, IGNORE_INDEX):
                out.append(self.vocab.tokens[i])
        return " ".join(out)


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
    check_positive_ints(n=n)
    require_choice("max_adjectives", require_int("max_adjectives", max_adjectives), range(4))
    gen = _generator(generator, seed)
    both = sorted({w for kind in _LEXICON.values() for pair in kind.items() for w in pair})
    vocab = Seq2SeqVocab(("<pad>", "<bos>", "<eos>", *both))  # English and French words
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
        rows["src"].append(vocab.encode(english))
        rows["tgt"].append(vocab.encode(french))
        rows["align"].append([*al1, verb_at, *al2, IGNORE_INDEX])  # <eos> translates nothing
        rows["src_text"].append(" ".join(english))
        rows["tgt_text"].append(" ".join(french))
    src = _pad_rows(rows["src"], vocab.pad_id)  # (N, S)
    tgt_in = _pad_rows([[vocab.bos_id, *t] for t in rows["tgt"]], vocab.pad_id)  # (N, T)
    tgt_out = _pad_rows([[*t, vocab.eos_id] for t in rows["tgt"]], IGNORE_INDEX)  # (N, T)
    alignment = _pad_rows(rows["align"], IGNORE_INDEX)  # (N, T)
    return AlignedTranslationTask(src, tgt_in, tgt_out, alignment, vocab, rows["src_text"],
                                  rows["tgt_text"])


def mask_tokens(
    ids: torch.Tensor, *, mask_id: int, vocab_size: int, p: float = 0.15,
    special_ids: Sequence[int] = (), generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking rule: select each position with probability ``p``; of the selected,
    80% show ``mask_id``, 10% a random token, 10% stay as they are. The model must predict
    the original token at every selected position, so it cannot tell from the input which
    positions count, nor trust that an unmasked token is right.

    Args:
        ids: (B, T) token ids below ``vocab_size``.
        mask_id: the [MASK] token's id (it may lie outside ``0..vocab_size-1``).
        vocab_size: random replacements are drawn uniformly from ``0..vocab_size-1``.
        p: the probability of selecting a position.
        special_ids: ids never selected (padding, [CLS], [SEP]).
        generator: a CPU torch.Generator, for a repeatable masking.

    Returns:
        ``(inputs, labels)``, both (B, T): the ids with the replacements, and the original id
        at the selected positions, -100 elsewhere (what ``F.cross_entropy`` skips).
    """
    check_masking(ids, mask_id, vocab_size, p, special_ids, generator)
    draw = torch.rand((3, *ids.shape), generator=generator).to(ids.device)  # (3, B, T)
    keep = torch.isin(ids, torch.tensor(list(special_ids), dtype=ids.dtype, device=ids.device))
    selected = (draw[0] < p) & ~keep  # (B, T)
    labels = torch.where(selected, ids, IGNORE_INDEX)
    random = torch.randint(vocab_size, ids.shape, generator=generator).to(ids.device)
    inputs = torch.where(selected & (draw[1] < 0.8), mask_id, ids)  # 80%: [MASK]
    inputs = torch.where(selected & (draw[1] >= 0.8) & (draw[2] < 0.5), random, inputs)  # 10%
    return inputs, labels


# --- argument checks


def check_randomness(generator: object, seed: object) -> None:
    """Raise unless at most one of ``generator`` (a torch.Generator) and ``seed`` (an int)."""
    if not checks_wanted():
        return
    if generator is not None and seed is not None:
        raise ValueError(f"pass either generator or seed, not both (got seed={seed!r})")
    require_generator("generator", generator)
    if seed is not None:
        require_int("seed", seed)


def check_masking(ids: object, mask_id: object, vocab_size: object, p: object,
                  special_ids: object, generator: object) -> None:
    """What :func:`mask_tokens` takes."""
    if not checks_wanted():
        return
    vocab_size = require_int("vocab_size", vocab_size, minimum=1)
    check_token_ids("ids", ids, vocab_size)
    require_non_negative_int("mask_id", mask_id)
    require_probability("p", p)
    require_id_list("special_ids", special_ids, vocab_size)
    require_generator("generator", generator)
