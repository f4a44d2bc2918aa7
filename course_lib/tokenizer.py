"""Tokenizers for the course's own data: characters for the language models, and a vocabulary
with <pad>/<bos>/<eos> for the sequence-to-sequence tasks.

``IGNORE_INDEX`` (-100, the default ``ignore_index`` of ``F.cross_entropy``) marks target
positions where nothing is to be predicted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from ._validate import check_text, require_id, require_id_list

IGNORE_INDEX = -100  # targets equal to this are left out of the loss (PyTorch's default)


class CharTokenizer:
    """Maps each character to an integer id: id i is the i-th character of ``chars``.

    Args:
        chars: the vocabulary, distinct characters (``from_text`` sorts them).

    Shapes:
        encode(text) -> list of len(text) ids; encode_tensor(text) -> (T,) long tensor;
        decode(ids (T,)) -> str
    """

    def __init__(self, chars: Sequence[str] | str) -> None:
        check_chars(chars)
        self.chars = tuple(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Build the vocabulary from the sorted distinct characters of ``text``."""
        check_vocabulary_text(text)
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        """V, the number of distinct ids."""
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """The id of every character of ``text``."""
        check_in_vocabulary("text", text, self.stoi)
        return [self.stoi[c] for c in text]

    def encode_tensor(self, text: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """``encode`` as a (T,) long tensor."""
        return torch.tensor(self.encode(text), dtype=torch.long, device=device)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of a list or 1-D tensor of ids."""
        return "".join(self.chars[i] for i in require_id_list("ids", ids, self.vocab_size))

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={''.join(self.chars)!r})"


@dataclass(frozen=True)
class Seq2SeqVocab:
    """A vocabulary with the three special tokens of sequence-to-sequence models: ids 0, 1, 2
    are ``<pad>``, ``<bos>`` (the decoder's first input) and ``<eos>`` (its last target), then
    the words (or characters). ``tokens`` holds the name of every id."""

    tokens: tuple[str, ...]
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2

    def __post_init__(self) -> None:
        for name in ("pad_id", "bos_id", "eos_id"):
            require_id(name, getattr(self, name), len(self.tokens))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """The ids of a list of tokens (the characters of a str), no specials added."""
        check_in_vocabulary("tokens", tokens, self.tokens)
        return [self.tokens.index(token) for token in tokens]

    def labels(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        """One label per position (for heatmap axes), specials included, padding (and -100)
        as ``""``."""
        ids = require_id_list("ids", ids, self.vocab_size, also=(IGNORE_INDEX,))
        return ["" if i in (self.pad_id, IGNORE_INDEX) else self.tokens[i] for i in ids]


# --- argument checks


def check_chars(chars: object) -> None:
    """Raise unless ``chars`` is a non-empty sequence of distinct single characters."""
    chars = tuple(chars) if isinstance(chars, str | Sequence) else ()
    singles = all(isinstance(c, str) and len(c) == 1 for c in chars)
    if not chars or not singles or len(set(chars)) != len(chars):
        raise ValueError(f"chars must be distinct single characters, non-empty, got {chars!r:.40}")


def check_vocabulary_text(text: object) -> None:
    """Raise unless ``text`` is a non-empty str (the characters a vocabulary is built from)."""
    check_text("text", text)
    if not text:
        raise ValueError("text is empty: a vocabulary needs at least one character")


def check_in_vocabulary(name: str, tokens: object, index: Collection[str]) -> None:
    """Raise unless ``tokens`` is a str (or a list of tokens) whose every token is in ``index``,
    naming the first few that are not."""
    if not isinstance(tokens, str | list | tuple):
        raise TypeError(f"{name} must be a str, got {type(tokens).__name__}")
    missing = [(i, t) for i, t in enumerate(tokens) if t not in index]
    shown = ", ".join(f"{t!r} at position {i}" for i, t in missing[:5])
    if missing:
        raise ValueError(f"{name} has {len(missing)} token(s) not in the vocabulary of "
                         f"{len(index)}: {shown}; build the vocabulary from text that has them")
