"""Byte-level byte-pair encoding (BPE), the tokenizer family of GPT-2 and most of today's LMs.

Text becomes tokens in four steps:

1. **Special tokens** such as ``<|endoftext|>`` are cut out first and kept whole: each is one
   id, never merged with its neighbours and never split.
2. **Pre-tokenization**: GPT-2's regular expression (:data:`GPT2_SPLIT_PATTERN`) cuts the rest
   into pieces: words with the space before them (``" the"``), numbers, runs of punctuation,
   runs of whitespace. Merges never cross a piece's boundary, so no token spans two words.
3. **Bytes**: each piece becomes its UTF-8 bytes; byte ``b`` is token ``b`` (ids 0-255). Any
   text can be written this way, so nothing is ever out of the vocabulary.
4. **Merges**: the learned merges, in the order they were learned, join adjacent tokens into
   longer ones (``t`` + ``h`` -> ``th``, then ``th`` + ``e`` -> ``the``, ...).

Ids: 0-255 are the bytes, 256, 257, ... the merged tokens in the order they were made, then
the special tokens (GPT-2 also puts ``<|endoftext|>`` last). ``vocab[id]`` gives any token's
bytes.

It learns the same merges as Hugging Face ``tokenizers``' BPE trainer with GPT-2's byte-level
pre-tokenizer and splits text into the same tokens (tests/test_bpe.py). What it leaves out:
speed (plain Python; training looks through every pair count for the most frequent one at each
merge where ``tokenizers`` keeps them in a priority queue, about 7-9x slower on the
Shakespeare corpus, benchmarks/tokenizer_speed.py), and GPT-2's printable-character alphabet,
which only exists to store bytes in a JSON file: :func:`bytes_to_unicode` gives it for
comparisons.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

import regex
import torch

from ._validate import check_id_list, require_int

# GPT-2's pre-tokenizer: English contractions, then a letter run, a digit run or a run of other
# symbols (each with at most one space before it), then whitespace. \p{L} (any letter) and
# \p{N} (any digit) need the ``regex`` package; Python's ``re`` has no Unicode classes.
# ``\s+(?!\S)`` leaves the last space of a run to start the next word: "a   b" -> "a", "  ", " b".
GPT2_SPLIT_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
_SPLIT = regex.compile(GPT2_SPLIT_PATTERN)


def pretokenize(text: str) -> list[str]:
    """Cut ``text`` into GPT-2's pieces; joined again they give back ``text`` exactly.

    Example: ``pretokenize("Hello world's  end!")`` is
    ``["Hello", " world", "'s", " ", " end", "!"]``.
    """
    check_text("text", text)
    return _SPLIT.findall(text)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table from each byte to a printable character, as Hugging Face ``tokenizers``
    and GPT-2's ``vocab.json`` write tokens: the 188 printable bytes (``!`` to ``~``, ``¡`` to
    ``¬``, ``®`` to ``ÿ``) stand for themselves, the 68 others (space, newline, control bytes,
    ...) become the characters from U+0100 on in byte order (space -> ``Ġ``, newline -> ``Ċ``).

    Returns:
        A dict byte (0-255) -> one-character str.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + n) for n, b in enumerate(others)})
    return dict(sorted(table.items()))


# Where each byte stands in the vocabulary order used to break ties between equally frequent
# pairs: sorted by its printable character (so the printable bytes first, in byte order).
_BYTE_RANK = {b: rank for rank, (b, _) in enumerate(sorted(bytes_to_unicode().items(),
                                                           key=lambda item: item[1]))}


def merge_pair(word: Sequence[int], pair: tuple[int, int], new_id: int) -> list[int]:
    """Replace every occurrence of ``pair`` in ``word``, scanning left to right, by ``new_id``
    (``a a a`` with the pair ``(a, a)`` becomes ``aa a``).

    Shapes:
        word: n ids -> a list of n - (number of occurrences) ids.
    """
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(new_id)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


class BPETokenizer:
    """A byte-level BPE tokenizer given its merges (learn them with :func:`train_bpe`).

    Args:
        merges: the merges in the order learned, each a pair of tokens as bytes, e.g.
            ``[(b"t", b"h"), (b"th", b"e")]``; each part must be a byte or made by an earlier
            merge. A merge whose result is already a token reuses that token's id.
        special_tokens: strings kept whole, e.g. ``["<|endoftext|>"]``; their ids follow the
            merged tokens.

    Attributes:
        merges: the merges as given, a list of (bytes, bytes).
        vocab: id -> the token's bytes, for every id (a special token's are its UTF-8 bytes).
        special_tokens: special token -> its id.
        token_ids: bytes -> id, for the bytes and the merged tokens.
        ranks: (left id, right id) -> the merge's position in ``merges``: lower merges first.

    Shapes:
        encode(text) -> list of T ids; encode_tensor(text) -> (T,) long tensor;
        decode(ids (T,)) -> str
    """

    def __init__(self, merges: Sequence[tuple[bytes, bytes]],
                 special_tokens: Sequence[str] = ()) -> None:
        check_special_tokens(special_tokens)
        self.merges = [(bytes(a), bytes(b)) for a, b in check_merges(merges)]
        self.vocab = {i: bytes([i]) for i in range(256)}
        self.token_ids = {token: i for i, token in self.vocab.items()}  # bytes -> id
        self.ranks: dict[tuple[int, int], int] = {}
        for rank, (a, b) in enumerate(self.merges):
            merged = self.token_ids.setdefault(a + b, len(self.vocab))  # made twice: one id
            self.vocab[merged] = a + b
            self.ranks.setdefault((self.token_ids[a], self.token_ids[b]), rank)
        self.special_tokens = {token: len(self.vocab) + i for i, token in enumerate(special_tokens)}
        self.vocab.update({i: token.encode("utf-8") for token, i in self.special_tokens.items()})
        # longest first: of two specials starting at one place the longer wins
        alternatives = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = regex.compile(
            "(" + "|".join(regex.escape(s) for s in alternatives) + ")") if alternatives else None

    @property
    def vocab_size(self) -> int:
        """V: bytes, merged tokens and special tokens."""
        return len(self.vocab)

    def split_special(self, text: str) -> list[str]:
        """``text`` cut around its special tokens: ``"a<|endoftext|>b"`` -> ``["a",
        "<|endoftext|>", "b"]`` (empty pieces dropped)."""
        check_text("text", text)
        parts = self._special_split.split(text) if self._special_split else [text]
        return [part for part in parts if part]

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: special tokens whole, every other piece merged by rank."""
        ids, seen = [], {}  # a piece always gives the same ids: merge each distinct one once
        for part in self.split_special(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
                continue
            for piece in _SPLIT.findall(part):
                if piece not in seen:
                    seen[piece] = self.encode_piece(piece)
                ids.extend(seen[piece])
        return ids

    def encode_piece(self, piece: str) -> list[int]:
        """One pre-token's ids: start from its bytes, then again and again merge the adjacent
        pair with the lowest rank (every occurrence of it), until no pair has a merge."""
        word = list(piece.encode("utf-8"))  # byte b is token b
        while len(word) > 1:
            pairs = set(zip(word, word[1:], strict=False))
            best = min(pairs, key=lambda pair: self.ranks.get(pair, len(self.ranks)))
            if best not in self.ranks:
                break
            a, b = best
            word = merge_pair(word, best, self.token_ids[self.vocab[a] + self.vocab[b]])
        return word

    def encode_tensor(self, text: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """``encode`` as a (T,) long tensor."""
        return torch.tensor(self.encode(text), dtype=torch.long, device=device)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list or 1-D tensor of ids: the tokens' bytes joined, then decoded as
        UTF-8 with ``errors="replace"``: bytes that are not valid UTF-8 (half a character, as
        a sampled sequence can end) become U+FFFD, ``"\ufffd"``, instead of raising."""
        ids = check_id_list("ids", ids, self.vocab_size)
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")


def train_bpe(text: str, vocab_size: int, special_tokens: Sequence[str] = ()) -> BPETokenizer:
    """Learn byte-level BPE merges from ``text`` until the vocabulary has ``vocab_size`` tokens.

    Start from the 256 bytes. Count every adjacent pair of tokens inside each pre-token
    (:func:`pretokenize`; a piece seen n times counts n times), merge the most frequent pair
    into a new token everywhere, and repeat. Special tokens are taken out of ``text`` first:
    they are boundaries, never counted, never merged.

    Ties: of equally frequent pairs, the merge is the pair (a, b) that comes first when pairs
    are compared by a's place in the vocabulary order, then b's. That order is: the 188
    printable bytes (``!`` to ``~``, ``¡`` to ``¬``, ``®`` to ``ÿ``) in byte order, then the
    68 others (space, newline, ...) in byte order, then the merged tokens in the order they
    were made. It is the rule of Hugging Face ``tokenizers``' ``BpeTrainer`` (its vocabulary
    lists the bytes by GPT-2's printable characters, :func:`bytes_to_unicode`, and it takes
    the smallest pair of ids), so both learn the same merges from the same text.

    Args:
        text: the training text.
        vocab_size: the number of tokens wanted, the 256 bytes and the special tokens
            included. Training stops earlier when no pair is left to merge (every piece is
            one token).
        special_tokens: strings to keep whole (ids after the merged tokens).

    Returns:
        A :class:`BPETokenizer`; its ``merges`` list the merges in the order learned.
    """
    check_special_tokens(special_tokens)
    check_vocab_size(vocab_size, len(special_tokens))
    check_text("text", text)
    splitter = BPETokenizer([], special_tokens)
    pieces = Counter(piece.encode("utf-8") for part in splitter.split_special(text)
                     if part not in splitter.special_tokens for piece in _SPLIT.findall(part))
    words = [list(piece) for piece in pieces]  # each distinct piece as token ids, counted
    counts = list(pieces.values())             # once with its number of occurrences
    pair_counts: Counter[tuple[int, int]] = Counter()
    where = defaultdict(set)  # pair -> the words that have (or had) it
    for i, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            pair_counts[pair] += counts[i]
            where[pair].add(i)
    vocab = {i: bytes([i]) for i in range(256)}
    token_ids = {token: i for i, token in vocab.items()}
    merges = []
    while len(vocab) + len(special_tokens) < vocab_size and pair_counts:
        a, b = most_frequent_pair(pair_counts)
        new_id = token_ids.setdefault(vocab[a] + vocab[b], len(vocab))  # made twice: one id
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        for i in where.pop((a, b)):  # only the words with the pair change
            merged = merge_pair(words[i], (a, b), new_id)
            _recount(pair_counts, where, i, words[i], merged, counts[i])
            words[i] = merged
    return BPETokenizer(merges, special_tokens)


def most_frequent_pair(pair_counts: Mapping[tuple[int, int], int]) -> tuple[int, int]:
    """The pair with the highest count; ties go to the pair first in the vocabulary order
    (:func:`train_bpe` says which order)."""
    top = max(pair_counts.values())
    tied = [pair for pair, count in pair_counts.items() if count == top]
    return min(tied, key=lambda pair: (_order(pair[0]), _order(pair[1])))


def _order(token: int) -> int:
    """A token's place in the tie-breaking order: bytes by GPT-2's printable character, then
    merged tokens by id."""
    return _BYTE_RANK[token] if token < 256 else token


def _recount(pair_counts: Counter, where: defaultdict, i: int, old: list[int],
             new: list[int], count: int) -> None:
    """Word ``i`` changed from ``old`` to ``new``: take its old pairs out of the counts, put
    its new pairs in, and drop pairs that no word has any more."""
    for pair in zip(old, old[1:], strict=False):
        pair_counts[pair] -= count
        if pair_counts[pair] == 0:
            del pair_counts[pair]
    for pair in zip(new, new[1:], strict=False):
        pair_counts[pair] += count
        where[pair].add(i)


# --- argument checks


def check_text(name: str, text: object) -> None:
    if not isinstance(text, str):
        fix = f"; decode bytes first: {name}.decode('utf-8')" if isinstance(text, bytes) else ""
        raise TypeError(f"{name} must be a str, got {type(text).__name__}{fix}")


def check_special_tokens(special_tokens: object) -> None:
    """A list of distinct non-empty strings (a bare str would be read as its characters)."""
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Sequence):
        raise TypeError(f"special_tokens must be a list of strings such as ['<|endoftext|>'], "
                        f"got {special_tokens!r:.40}")
    for i, token in enumerate(special_tokens):
        if not isinstance(token, str) or not token:
            raise ValueError(f"special_tokens[{i}] must be a non-empty str, got {token!r:.40}")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens has duplicates: {list(special_tokens)!r:.80}")


def check_vocab_size(vocab_size: object, n_special: int) -> None:
    """At least one token per byte plus one per special token."""
    require_int("vocab_size", vocab_size)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size must be at least 256 (one token per byte) + {n_special} "
                         f"special token(s) = {256 + n_special}, got {vocab_size}")


def check_merges(merges: object) -> list:
    """Pairs of bytes, each part a byte or the result of an earlier merge; returns them."""
    if isinstance(merges, str | bytes) or not isinstance(merges, Sequence):
        raise TypeError(f"merges must be a list of (bytes, bytes) pairs, got {merges!r:.40}")
    known = {bytes([b]) for b in range(256)}
    for i, merge in enumerate(merges):
        if not (isinstance(merge, tuple | list) and len(merge) == 2
                and all(isinstance(part, bytes) for part in merge)):
            raise TypeError(f"merges[{i}] must be a pair (bytes, bytes) such as (b't', b'h'), "
                            f"got {merge!r:.40}")
        for part in merge:
            if part not in known:
                raise ValueError(f"merges[{i}] = {tuple(merge)!r:.60} uses {part!r}, which is "
                                 "neither a byte nor made by an earlier merge; list the merges "
                                 "in the order they were learned")
        known.add(merge[0] + merge[1])
    return list(merges)
