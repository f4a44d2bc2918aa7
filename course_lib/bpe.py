"""Byte-level byte-pair encoding (BPE), the tokenizer family of GPT-2 and most of today's LMs.

Text becomes tokens in four steps:

1. **Special tokens** such as ``<|endoftext|>`` are cut out first and kept whole: each is one
   id, never merged with its neighbours and never split.
2. **Pre-tokenization**: GPT-2's regular expression (:data:`GPT2_SPLIT_PATTERN`) cuts the rest
   into pieces: words with the space before them (``" the"``), numbers, runs of punctuation,
   runs of whitespace. Merges never cross a piece's boundary, so no token spans two words.
3. **Bytes**: each piece becomes its UTF-8 bytes, each byte a token (ids 0-255). Any text can
   be written this way, so nothing is ever out of the vocabulary.
4. **Merges**: the learned merges, in the order they were learned, join adjacent tokens into
   longer ones (``t`` + ``h`` -> ``th``, then ``th`` + ``e`` -> ``the``, ...).

Ids: 0-255 are the bytes, 256, 257, ... the merged tokens in the order they were made, then
the special tokens (GPT-2 also puts ``<|endoftext|>`` last). ``vocab[id]`` gives any token's
bytes. Read from GPT-2's ``vocab.json`` and ``merges.txt``, a tokenizer keeps their ids.

It learns the same merges as Hugging Face ``tokenizers``' BPE trainer with GPT-2's byte-level
pre-tokenizer and splits text into the same tokens (tests/test_bpe.py). What it leaves out:
speed (plain Python with a priority queue, as ``tokenizers`` has; training took 1.0 to 2.4
times its time on the Shakespeare corpus, benchmarks/tokenizer_speed.py).
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import regex
import torch

from ._validate import (
    check_text,
    require_choice,
    require_id_list,
    require_instance,
    require_int,
)

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


def printable(token: bytes) -> str:
    """A token as GPT-2's files write it, each byte as its character: ``b" a"`` -> ``"Ġa"``."""
    return "".join(_BYTE_CHAR[b] for b in token)


_BYTE_CHAR = bytes_to_unicode()
_CHAR_BYTE = {char: bytes([b]) for b, char in _BYTE_CHAR.items()}  # and back
# A token's place in the order that breaks ties (train_bpe): bytes by their printable character
# (so the printable bytes first, in byte order), then merged tokens by id: _ORDER.get(t, t).
_ORDER = {b: rank for rank, (b, _) in enumerate(sorted(_BYTE_CHAR.items(), key=lambda i: i[1]))}


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
    """A byte-level BPE tokenizer given its merges (from :func:`train_bpe` or GPT-2's files).

    Args:
        merges: the merges in the order learned, each a pair of tokens as bytes, e.g.
            ``[(b"t", b"h"), (b"th", b"e")]``; each part must be a byte or made by an earlier
            merge. A merge whose result is already a token reuses that token's id.
        special_tokens: strings kept whole, e.g. ``["<|endoftext|>"]``; their ids follow the
            merged tokens (or a dict string -> id, with ``token_ids``).
        token_ids: bytes -> id for the bytes and merged tokens, if not byte b -> id b, then
            the merged tokens in order (GPT-2 numbers bytes by their printable character).

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
                 special_tokens: Sequence[str] | Mapping[str, int] = (), *,
                 token_ids: Mapping[bytes, int] | None = None) -> None:
        check_tokenizer_parts(merges, special_tokens, token_ids)
        self.merges = [(bytes(a), bytes(b)) for a, b in merges]
        if token_ids is None:  # byte b is id b, then each new merged token in turn
            token_ids = {bytes([b]): b for b in range(256)}
            for a, b in self.merges:
                token_ids.setdefault(a + b, len(token_ids))  # made twice: one id
        self.token_ids = dict(token_ids)  # bytes -> id
        if not isinstance(special_tokens, Mapping):  # a list: ids after the merged tokens
            special_tokens = {s: len(self.token_ids) + i for i, s in enumerate(special_tokens)}
        self.special_tokens = dict(special_tokens)
        vocab = {i: t for t, i in self.token_ids.items()}  # id -> bytes, in id order
        vocab |= {i: s.encode("utf-8") for s, i in self.special_tokens.items()}
        self.vocab = dict(sorted(vocab.items()))
        self.ranks: dict[tuple[int, int], int] = {}
        for rank, (a, b) in enumerate(self.merges):
            self.ranks.setdefault((self.token_ids[a], self.token_ids[b]), rank)
        # longest first: of two specials starting at one place the longer wins
        alternatives = sorted(self.special_tokens, key=len, reverse=True)
        self._special_split = regex.compile(
            "(" + "|".join(regex.escape(s) for s in alternatives) + ")") if alternatives else None

    @classmethod
    def from_files(cls, vocab_path: str | os.PathLike,
                   merges_path: str | os.PathLike) -> BPETokenizer:
        """Read GPT-2's ``vocab.json`` (token -> id, tokens in the characters of
        :func:`bytes_to_unicode`) and ``merges.txt`` (a ``#version`` line, then one merge
        ``"a b"`` a line, in order), as Hugging Face's ``models.BPE.from_file`` does. An entry
        of ``vocab.json`` that no merge makes and no byte is (``<|endoftext|>``) is special."""
        vocab, merges = require_gpt2_files(vocab_path, merges_path)  # token -> id; (a, b) pairs
        made = set(_CHAR_BYTE) | {a + b for a, b in merges}  # bytes and merged tokens, printable

        def as_bytes(token: str) -> bytes:  # GPT-2's characters -> the bytes they stand for
            return b"".join(_CHAR_BYTE[char] for char in token)
        return cls([(as_bytes(a), as_bytes(b)) for a, b in merges],
                   {token: i for token, i in vocab.items() if token not in made},
                   token_ids={as_bytes(token): i for token, i in vocab.items() if token in made})

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``vocab.json`` and ``merges.txt`` in GPT-2's format (:meth:`from_files`)
        into ``directory`` (made if missing); :meth:`load` reads them back."""
        require_instance("directory", directory, (str, os.PathLike), "a folder (str or Path)")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        vocab = {printable(token): i for token, i in self.token_ids.items()} | self.special_tokens
        (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
        lines = ["#version: 0.2"] + [f"{printable(a)} {printable(b)}" for a, b in self.merges]
        (directory / "merges.txt").write_text("\n".join(lines) + "\n", "utf-8")

    @classmethod
    def load(cls, directory: str | os.PathLike) -> BPETokenizer:
        """The tokenizer in ``directory``'s ``vocab.json`` and ``merges.txt`` (:meth:`save`)."""
        require_instance("directory", directory, (str, os.PathLike), "a folder (str or Path)")
        return cls.from_files(Path(directory) / "vocab.json", Path(directory) / "merges.txt")

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

    def encode(self, text: str, *, allowed_special: str | Collection[str] = ()) -> list[int]:
        """The ids of ``text``: special tokens whole, every other piece merged by rank. As in
        tiktoken, a special token in ``text`` is refused unless ``allowed_special`` (a set of
        them, or ``"all"``) lets it in: a user's text must not end a document early."""
        check_text("text", text)
        check_allowed_special(allowed_special, self, text)
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

    def encode_iterable(self, lines: Iterable[str], *,
                        allowed_special: str | Collection[str] = ()) -> Iterator[int]:
        """``encode`` for text too large to hold: yields the ids of ``"".join(lines)`` one by
        one, e.g. ``tok.encode_iterable(open(path, encoding="utf-8", newline=""))`` (``""``:
        keep ``\r\n``), holding a chunk of about 2**18 characters at a time."""
        check_lines(lines, self.special_tokens)
        check_allowed_special(allowed_special, self)
        return itertools.chain.from_iterable(self.encode(chunk, allowed_special=allowed_special)
                                             for chunk in _chunks_between_pieces(lines))

    def encode_piece(self, piece: str) -> list[int]:
        """One pre-token's ids: start from its bytes, then again and again merge the adjacent
        pair with the lowest rank (every occurrence of it), until no pair has a merge."""
        word = [self.token_ids[bytes([b])] for b in piece.encode("utf-8")]  # the bytes' ids
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
        ids = require_id_list("ids", ids, self.vocab_size)
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"BPETokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={list(self.special_tokens)})")


# Where a chunk may end: after a non-space character followed by whitespace. No GPT-2 piece
# goes on from a non-space into whitespace, and none looks back, so the pieces stay the same.
_LAST_CUT = regex.compile(r"(?r)\S(?=\s)")  # (?r): search from the end, find the last place


def _chunks_between_pieces(lines: Iterable[str], size: int = 2**18) -> Iterator[str]:
    """The text of ``lines`` again, in chunks of ``size`` characters or more, each ending
    where pre-tokenization cuts anyway (one enormous word is held whole)."""
    buffer = ""
    for n, line in enumerate(lines):
        check_text(f"lines[{n}]", line)
        buffer += line
        if len(buffer) >= size and (cut := _LAST_CUT.search(buffer)):
            yield buffer[:cut.end()]
            buffer = buffer[cut.end():]
    if buffer:
        yield buffer


def train_bpe(text: str, vocab_size: int, special_tokens: Sequence[str] = (), *,
              tie_break: str = "tokenizers") -> BPETokenizer:
    """Learn byte-level BPE merges from ``text`` until the vocabulary has ``vocab_size`` tokens.

    Start from the 256 bytes. Count every adjacent pair of tokens inside each pre-token
    (:func:`pretokenize`; a piece seen n times counts n times), merge the most frequent pair
    into a new token everywhere, and repeat. Special tokens are taken out of ``text`` first:
    they are boundaries, never counted, never merged. The counts wait in a priority queue
    (a heap), so finding the most frequent pair does not look through all of them.

    Ties (``tie_break``) between equally frequent pairs:

    - ``"tokenizers"`` (default): the pair (a, b) first by a's place in the vocabulary order,
      then b's: the 188 printable bytes (``!`` to ``~``, ``¡`` to ``¬``, ``®`` to ``ÿ``) in
      byte order, the 68 others (space, newline, ...) in byte order, then the merged tokens
      in the order made. It is Hugging Face ``tokenizers``' rule (its vocabulary lists bytes
      by their printable character, :func:`bytes_to_unicode`; the smallest pair of ids wins).
    - ``"lexicographic"``: the greatest (bytes of a, bytes of b) as Python compares tuples,
      the rule of other courses (Stanford's CS336, for one).

    Args:
        text: the training text; it must hold something besides special tokens.
        vocab_size: the number of tokens wanted, the 256 bytes and the special tokens
            included. Training stops earlier when no pair is left to merge (every piece is
            one token).
        special_tokens: strings to keep whole (ids after the merged tokens).
        tie_break: ``"tokenizers"`` or ``"lexicographic"``, as above.

    Returns:
        A :class:`BPETokenizer`; its ``merges`` list the merges in the order learned.
    """
    check_special_tokens(special_tokens)
    check_vocab_size(vocab_size, len(special_tokens))
    check_training_text(text, special_tokens)
    require_choice("tie_break", tie_break, ("tokenizers", "lexicographic"))
    splitter = BPETokenizer([], special_tokens)
    pieces = Counter(piece.encode("utf-8") for part in splitter.split_special(text)
                     if part not in splitter.special_tokens for piece in _SPLIT.findall(part))
    words = [list(piece) for piece in pieces]  # each distinct piece as token ids, counted
    counts = list(pieces.values())             # once with its number of occurrences
    pair_counts: defaultdict[tuple[int, int], int] = defaultdict(int)  # pair -> count
    where = defaultdict(set)  # pair -> the words that have (or had) it
    for i, word in enumerate(words):
        for pair in zip(word, word[1:], strict=False):
            pair_counts[pair] += counts[i]
            where[pair].add(i)
    vocab = {i: bytes([i]) for i in range(256)}
    token_ids = {token: i for i, token in vocab.items()}
    # the heap's smallest entry (-count, tie key, pair) is the most frequent pair; an entry
    # goes stale when a merge lowers its pair's count, and is put back when it comes up
    heap = [(-n, _tie_key(pair, vocab, tie_break), pair) for pair, n in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    while len(vocab) + len(special_tokens) < vocab_size and heap:
        minus_count, key, (a, b) = heapq.heappop(heap)
        if pair_counts.get((a, b)) != -minus_count:  # stale (or gone): lazy invalidation
            if (a, b) in pair_counts:
                heapq.heappush(heap, (-pair_counts[a, b], key, (a, b)))
            continue
        new_id = token_ids.setdefault(vocab[a] + vocab[b], len(vocab))  # made twice: one id
        vocab[new_id] = vocab[a] + vocab[b]
        merges.append((vocab[a], vocab[b]))
        for pair in _merge_everywhere((a, b), new_id, words, counts, pair_counts, where):
            heapq.heappush(heap, (-pair_counts[pair], _tie_key(pair, vocab, tie_break), pair))
    return BPETokenizer(merges, special_tokens)


def most_frequent_pair(pair_counts: Mapping[tuple[int, int], int]) -> tuple[int, int]:
    """The pair with the highest count; ties go to the pair first in the vocabulary order
    (:func:`train_bpe`'s rule ``"tokenizers"``)."""
    return min(pair_counts, key=lambda p: (-pair_counts[p], _tie_key(p, {}, "tokenizers")))


def _tie_key(pair: tuple[int, int], vocab: Mapping[int, bytes], tie_break: str) -> tuple:
    """Of two equally frequent pairs, the one with the smaller key is merged first."""
    a, b = pair
    if tie_break == "tokenizers":
        return _ORDER.get(a, a), _ORDER.get(b, b)
    # "lexicographic": the greatest pair must have the smallest key, so negate every byte and
    # end each token with 1 (above any negated byte): a token then sorts after its extensions
    return tuple(-x for x in vocab[a]) + (1,), tuple(-x for x in vocab[b]) + (1,)


def _merge_everywhere(pair: tuple[int, int], new_id: int, words: list[list[int]],
                      counts: list[int], pair_counts: defaultdict, where: defaultdict) -> set:
    """Merge ``pair`` into ``new_id`` in the words that have it and count again: a changed
    word's old pairs out, its new pairs in (times the word's count). Returns the pairs with
    the new token, the only ones whose counts grew."""
    grown = set()
    for i in where.pop(pair):
        old, new = words[i], merge_pair(words[i], pair, new_id)
        for old_pair in zip(old, old[1:], strict=False):
            pair_counts[old_pair] -= counts[i]
            if pair_counts[old_pair] == 0:
                del pair_counts[old_pair]
        for new_pair in zip(new, new[1:], strict=False):
            pair_counts[new_pair] += counts[i]
            if new_id in new_pair:  # the other pairs were in the word already
                where[new_pair].add(i)
                grown.add(new_pair)
        words[i] = new
    return grown


# --- argument checks


def check_training_text(text: object, special_tokens: Sequence[str]) -> None:
    """A str with something to learn from besides its special tokens."""
    check_text("text", text)
    if all(part in special_tokens for part in BPETokenizer([], special_tokens).split_special(text)):
        what = "special tokens only" if text else "empty"
        raise ValueError(f"text is {what}: train_bpe needs text to learn merges from")


def check_special_tokens(special_tokens: object) -> None:
    """A list of distinct non-empty strings (a bare str would be read as its characters)."""
    if isinstance(special_tokens, str) or not isinstance(special_tokens, Sequence | Mapping):
        raise TypeError(f"special_tokens must be a list of strings such as ['<|endoftext|>'], "
                        f"got {special_tokens!r:.40}")
    for i, token in enumerate(special_tokens):
        if not isinstance(token, str) or not token:
            raise ValueError(f"special_tokens[{i}] must be a non-empty str, got {token!r:.40}")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"special_tokens has duplicates: {list(special_tokens)!r:.80}")


def check_tokenizer_parts(merges: object, special_tokens: object, token_ids: object) -> None:
    """BPETokenizer's arguments; with ``token_ids``, it must hold every byte and merged
    token, and its ids with the special tokens' must be 0..V-1, each once."""
    check_special_tokens(special_tokens)
    check_merges(merges)
    if token_ids is None:
        if isinstance(special_tokens, Mapping):
            raise TypeError("special_tokens must be a list unless token_ids gives the ids")
        return
    require_instance("token_ids", token_ids, Mapping, "a dict bytes -> id")
    needed = [bytes([b]) for b in range(256)] + [bytes(a) + bytes(b) for a, b in merges]
    if missing := [token for token in needed if token not in token_ids]:
        raise ValueError(f"token_ids has no id for the token {missing[0]!r}; it needs every "
                         "byte and every merge's result")
    specials = special_tokens if isinstance(special_tokens, Mapping) else {
        s: len(token_ids) + n for n, s in enumerate(special_tokens)}  # a list: ids after
    for token, i in (given := [*token_ids.items(), *specials.items()]):
        require_int(f"the id of {token!r:.30}", i)
    ids = sorted(i for _, i in given)
    if ids != list(range(len(ids))):
        raise ValueError(f"the ids of token_ids and special_tokens must be 0..V-1, each once; "
                         f"got {len(ids)} ids from {ids[0]} to {ids[-1]}")


def check_vocab_size(vocab_size: object, n_special: int) -> None:
    """At least one token per byte plus one per special token."""
    require_int("vocab_size", vocab_size)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size must be at least 256 (one token per byte) + {n_special} "
                         f"special token(s) = {256 + n_special}, got {vocab_size}")


def check_merges(merges: object) -> None:
    """Pairs of bytes, each part a byte or the result of an earlier merge."""
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


def check_allowed_special(allowed_special: object, tokenizer: BPETokenizer,
                          text: str | None = None) -> None:
    """``"all"`` or a collection of special tokens; ``text`` (if given) holds no other."""
    specials = tokenizer.special_tokens
    allowed = specials if allowed_special == "all" else allowed_special
    if isinstance(allowed, str) or not isinstance(allowed, Collection):
        raise TypeError(f"allowed_special must be 'all' or a set of special tokens such as "
                        f"{{'<|endoftext|>'}}, got {allowed_special!r:.40}")
    if unknown := [s for s in allowed if s not in specials]:
        raise ValueError(f"allowed_special holds {unknown[0]!r:.40}, which is not one of the "
                         f"special tokens {list(specials)!r:.80}")
    parts = tokenizer.split_special(text) if text and specials else ()
    if refused := [p for p in parts if p in specials and p not in allowed]:
        raise ValueError(f"text holds the special token {refused[0]!r}, refused by default; "
                         f"to encode it as its id {specials[refused[0]]}, pass "
                         f"allowed_special={{{refused[0]!r}}} or allowed_special='all'")


def check_lines(lines: object, special_tokens: Mapping[str, int]) -> None:
    """An iterable of str, not one str; no whitespace in a special token (chunks end there)."""
    if isinstance(lines, str | bytes) or not isinstance(lines, Iterable):
        raise TypeError(f"lines must be an iterable of str such as an open text file, got "
                        f"{type(lines).__name__}; for one string use encode(text)")
    if spaced := [s for s in special_tokens if regex.search(r"\s", s)]:
        raise ValueError(f"the special token {spaced[0]!r} holds whitespace, where "
                         "encode_iterable cuts the text; use encode on the whole text")


def require_gpt2_files(vocab_path: object, merges_path: object) -> tuple[dict, list]:
    """vocab.json's object token -> id and merges.txt's merges after its ``#version`` line, if
    both files exist and each merge is two tokens in GPT-2's printable characters."""
    for name, path in (("vocab_path", vocab_path), ("merges_path", merges_path)):
        require_instance(name, path, (str, os.PathLike), "a file path (str or Path)")
        if not Path(path).is_file():
            raise FileNotFoundError(f"{name} {str(path)!r} is not a file")
    vocab = json.loads(Path(vocab_path).read_text(encoding="utf-8"))
    if not isinstance(vocab, dict):
        raise ValueError(f"vocab_path must hold a JSON object token -> id, got {vocab!r:.60}")
    lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
    merges = [tuple(m.split(" ")) for m in lines if m and not m.startswith("#version")]
    for n, merge in enumerate(merges):
        if len(merge) != 2 or not set(merge[0] + merge[1]) <= _CHAR_BYTE.keys():
            raise ValueError(f"merges_path's merge {n} is {' '.join(merge)!r:.40}: it must be "
                             "two tokens in GPT-2's printable characters, e.g. 'Ġ t'")
    return vocab, merges
