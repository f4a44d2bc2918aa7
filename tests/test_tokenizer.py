"""The character tokenizer and the sequence-to-sequence vocabulary (tokenizer.py): round trips on
real text, and the errors for characters and ids outside the vocabulary."""

from __future__ import annotations

import pytest
import torch

from course_lib.corpus import shakespeare_text
from course_lib.tokenizer import IGNORE_INDEX, CharTokenizer, Seq2SeqVocab

VOCAB = Seq2SeqVocab(("<pad>", "<bos>", "<eos>", "a", "b", "c"))

# --------------------------------------------------------------------------------------------
# CharTokenizer


def test_char_tokenizer_round_trip():
    text = shakespeare_text(["macbeth"])
    tok = CharTokenizer.from_text(text)
    assert list(tok.chars) == sorted(set(text)) and tok.vocab_size == len(set(text))
    ids = tok.encode(text[:5000])
    assert tok.decode(ids) == text[:5000]
    tensor = tok.encode_tensor(text[:100])
    assert tensor.dtype == torch.long and tensor.shape == (100,)
    assert tok.decode(tensor) == text[:100]
    assert tok.encode("\n") == [0]  # sorted: newline is the smallest character


def test_char_tokenizer_unknown_characters():
    tok = CharTokenizer.from_text("hello world")
    with pytest.raises(ValueError, match=r"text.*'X' at position 0.*'!' at position 6"):
        tok.encode("Xhell !")
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(3)
    with pytest.raises(ValueError, match=r"chars.*distinct"):
        CharTokenizer("abca")


# --------------------------------------------------------------------------------------------
# Decoding ids: CharTokenizer.decode and Seq2SeqVocab.labels

def test_the_ignore_index_still_decodes_where_it_did():
    assert VOCAB.labels([IGNORE_INDEX, 0, 3]) == ["", "", "a"]
    with pytest.raises(ValueError, match=r"ids\[0\] is -100.*0\.\.2"):
        CharTokenizer("abc").decode([IGNORE_INDEX])  # no -100 in a plain tokenizer


# --------------------------------------------------------------------------------------------
# Seq2SeqVocab


def test_special_ids_must_lie_in_their_vocabulary():
    with pytest.raises(ValueError, match=r"eos_id is 2.*0\.\.1"):
        Seq2SeqVocab(("<pad>", "<bos>"))
