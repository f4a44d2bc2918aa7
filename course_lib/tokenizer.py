"""Tokenizers for the course's own data: characters for the language models, and a character
vocabulary with <pad>/<bos>/<eos> for the sequence-to-sequence tasks.

``IGNORE_INDEX`` (-100, the default ``ignore_index`` of ``F.cross_entropy``) marks target
positions where nothing is to be predicted.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ._validate import (
    check_id,
    check_id_list,
    require_bool,
)

IGNORE_INDEX = -100  # targets equal to this are left out of the loss (PyTorch's default)


# --------------------------------------------------------------------------------------------
# Character tokenizer


class CharTokenizer:
    """Maps each character to an integer id: id i is the i-th character of ``chars``.

    Args:
        chars: the vocabulary, distinct characters (``from_text`` sorts them).
        unknown: what to do with a character outside the vocabulary when encoding. ``None``
            (the default) raises ``ValueError`` naming it and its position; a character of the
            vocabulary (e.g. ``"?"`` or ``" "``) replaces every unknown character instead.

    Shapes:
        encode(text) -> list of len(text) ids; encode_tensor(text) -> (T,) long tensor;
        decode(ids (T,)) -> str
    """

    def __init__(self, chars: Sequence[str] | str, *, unknown: str | None = None) -> None:
        chars = tuple(chars)
        if not chars:
            raise ValueError("chars is empty; a tokenizer needs at least one character")
        bad = [c for c in chars if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"chars must be single characters, got {bad[:5]}")
        if len(set(chars)) != len(chars):
            repeated = sorted({c for c in chars if chars.count(c) > 1})
            raise ValueError(f"chars must be distinct, but {repeated} appear more than once")
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        if unknown is not None and unknown not in self.stoi:
            raise ValueError(
                f"unknown={unknown!r} must itself be in the vocabulary, which is "
                f"{''.join(chars)!r}"
            )
        self.unknown = unknown

    @classmethod
    def from_text(cls, text: str, *, unknown: str | None = None) -> CharTokenizer:
        """Build the vocabulary from the sorted distinct characters of ``text``."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty str, got {text!r:.40}")
        return cls(sorted(set(text)), unknown=unknown)

    @property
    def vocab_size(self) -> int:
        """V, the number of distinct ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """The id of every character of ``text``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        stoi = self.stoi
        try:
            return [stoi[c] for c in text]
        except KeyError:
            pass  # the slow path below finds every unknown character for the message
        if self.unknown is not None:
            fallback = stoi[self.unknown]
            return [stoi.get(c, fallback) for c in text]
        missing = [(i, c) for i, c in enumerate(text) if c not in stoi]
        shown = ", ".join(f"{c!r} at position {i}" for i, c in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(
            f"text contains {len(missing)} character(s) not in the vocabulary: {shown}{more}. "
            f"The vocabulary has {self.vocab_size} characters; build the tokenizer from text "
            f"that contains them, or pass unknown='?' (any vocabulary character) to replace them"
        )

    def encode_tensor(self, text: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """``encode`` as a (T,) long tensor."""
        return torch.tensor(self.encode(text), dtype=torch.long, device=device)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list or 1-D tensor of ids."""
        chars = self.chars
        return "".join(chars[i] for i in check_id_list("ids", ids, self.vocab_size))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        unknown = "" if self.unknown is None else f", unknown={self.unknown!r}"
        chars = "".join(self.chars)
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={chars!r}{unknown})"



@dataclass(frozen=True)
class Seq2SeqVocab:
    """A character vocabulary with the three special tokens of sequence-to-sequence models.

    Ids 0, 1, 2 are ``<pad>``, ``<bos>`` (begin: the decoder's first input) and ``<eos>``
    (end: the decoder's last target); characters follow.

    Attributes:
        tokens: the name of every id.
    """

    tokens: tuple[str, ...]
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        for name in ("pad_id", "bos_id", "eos_id"):
            check_id(name, getattr(self, name), len(self.tokens))

    @classmethod
    def from_chars(cls, chars: Iterable[str]) -> Seq2SeqVocab:
        """Specials first, then the sorted distinct characters."""
        return cls(("<pad>", "<bos>", "<eos>", *sorted(set(chars))))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text`` (no specials added)."""
        index = self._index
        for i, c in enumerate(text):
            if c not in index:
                raise ValueError(
                    f"character {c!r} at position {i} of {text!r} is not in the vocabulary "
                    f"{''.join(self.tokens[3:])!r}"
                )
        return [index[c] for c in text]

    def decode(self, ids: Sequence[int] | torch.Tensor, *, strip: bool = True) -> str:
        """Text of a 1-D sequence of ids. With ``strip``, stops at ``<eos>`` and leaves out
        ``<bos>`` and ``<pad>``; otherwise every token is shown (-100 as ``·``)."""
        ids = check_id_list("ids", ids, self.vocab_size, also=(IGNORE_INDEX,))
        require_bool("strip", strip)
        out = []
        for i in ids:
            if strip and i == self.eos_id:
                break
            if strip and i in (self.pad_id, self.bos_id, IGNORE_INDEX):
                continue
            out.append("·" if i == IGNORE_INDEX else self.tokens[i])
        return "".join(out)

    def labels(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        """One label per position (for heatmap axes), specials included, padding (and -100)
        as ``""``."""
        ids = check_id_list("ids", ids, self.vocab_size, also=(IGNORE_INDEX,))
        return ["" if i in (self.pad_id, IGNORE_INDEX) else self.tokens[i] for i in ids]
