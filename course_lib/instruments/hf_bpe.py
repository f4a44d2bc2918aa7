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
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ..bpe import BPETokenizer, bytes_to_unicode, printable

BYTE_CHAR = bytes_to_unicode()  # byte -> the printable character tokenizers writes for it


def _byte_level(model: models.BPE) -> Tokenizer:
    """A tokenizers Tokenizer around ``model`` with GPT-2's byte-level pieces (no prefix space)."""
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def hf_from_files(directory: str | os.PathLike, special_tokens: Iterable[str] = ()) -> Tokenizer:
    """tokenizers' byte-level BPE read from GPT-2's ``vocab.json`` and ``merges.txt`` in
    ``directory``, with ``special_tokens`` (entries of vocab.json) split out whole."""
    folder = Path(directory)
    tokenizer = _byte_level(models.BPE.from_file(str(folder / "vocab.json"),
                                                 str(folder / "merges.txt")))
    tokenizer.add_special_tokens(list(special_tokens))
    return tokenizer


def hf_byte_level_bpe(texts: Iterable[str], vocab_size: int,
                      special_tokens: Iterable[str] = ()) -> Tokenizer:
    """tokenizers' byte-level BPE trained on ``texts`` (each a separate sequence)."""
    tokenizer = _byte_level(models.BPE())
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
