"""Hugging Face ``tokenizers``' byte-level BPE, set up as :func:`course_lib.bpe.train_bpe` is,
to compare the two: the same pieces, merges, vocabulary and segmentation.

How they are made to agree: tokenizers' ByteLevel is built with ``add_prefix_space=False``
(GPT-2 adds no space before the first word; the default True would), and its trainer gets
``initial_alphabet=ByteLevel.alphabet()`` (all 256 bytes, as ours starts from; by default it
would start from the bytes seen in the text), ``min_frequency`` 0 and no ``limit_alphabet``
(its defaults). Tokens are compared as strings through GPT-2's byte-to-character table.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..bpe import BPETokenizer, bytes_to_unicode

BYTE_CHAR = bytes_to_unicode()  # byte -> the printable character tokenizers writes for it


def printable(token: bytes) -> str:
    """A token as tokenizers writes it (GPT-2's printable characters)."""
    return "".join(BYTE_CHAR[b] for b in token)


def hf_byte_level_bpe(texts: Iterable[str], vocab_size: int,
                      special_tokens: Iterable[str] = ()) -> Tokenizer:
    """tokenizers' byte-level BPE trained on ``texts`` (each a separate sequence)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def hf_merges(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    """The merges a tokenizers BPE learned, in order, as pairs of printable strings."""
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in merges]


def our_merges(tokenizer: BPETokenizer) -> list[tuple[str, str]]:
    """Our merges as tokenizers writes them."""
    return [(printable(a), printable(b)) for a, b in tokenizer.merges]


def hf_pieces(text: str) -> list[str]:
    """The pieces tokenizers' GPT-2 pre-tokenizer cuts ``text`` into (printable strings)."""
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False)
    return [piece for piece, _ in pre.pre_tokenize_str(text)]
