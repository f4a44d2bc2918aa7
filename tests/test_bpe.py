"""Byte-level BPE against Hugging Face ``tokenizers`` (a BpeTrainer with GPT-2's ByteLevel
pre-tokenizer, trained on the same text): the same pieces, merges, vocabulary and segmentation;
round trips on any Unicode text; special tokens kept whole; errors that name the argument.

How the two are set up to agree: see course_lib.instruments.hf_bpe. Ids are compared where
they are meant to agree: merged tokens keep their order (tokenizers puts the special tokens
first, ours last, so its ids are shifted by their number), and bytes are numbered by their
value here, by their printable character there.

The two regular-expression engines carry different Unicode versions: a character that only a
recent Unicode assigns (e.g. U+0558, an Armenian letter since Unicode 16) is a letter for
``regex`` and not for tokenizers' engine, so the pieces can differ on such characters. The
texts compared here use long-standing characters.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from course_lib.bpe import (
    BPETokenizer,
    merge_pair,
    most_frequent_pair,
    pretokenize,
    train_bpe,
)
from course_lib.corpus import shakespeare_text
from course_lib.instruments.hf_bpe import (
    BYTE_CHAR,
    hf_merges,
    hf_pieces,
    our_merges,
    printable,
)
from course_lib.instruments.hf_bpe import hf_byte_level_bpe as hf_tokenizer

EOT = "<|endoftext|>"
HAND_TEXT = (
    "It's 2024: naïve café-goers (and their 3 dogs) didn't pay £12.50 —\n"
    "they'll   pay 1,000,000 tomorrow!!  Ἀθῆναι, 北京市, Москва 🙂🙂 e\u0301tude\t\tend.\r\n"
    "  We've seen   it,\nI'm sure; you'd know.  \n\n"
) * 3


@pytest.fixture(scope="module")
def shakespeare():
    """A few KB of Shakespeare to train on and the next few KB, held out."""
    text = shakespeare_text()
    return text[:12_000], text[12_000:16_000]


@pytest.fixture(scope="module")
def trained(shakespeare):
    """Ours and tokenizers', trained on the same text to 700 tokens."""
    train_text, _ = shakespeare
    return train_bpe(train_text, 700), hf_tokenizer([train_text], 700)


# --------------------------------------------------------------------------------------------
# The same as tokenizers


@pytest.mark.parametrize("which", ["hand", "shakespeare"])
def test_pretokenization_matches_tokenizers(which, shakespeare):
    text = HAND_TEXT if which == "hand" else shakespeare[0]
    pieces = pretokenize(text)
    assert [printable(p.encode("utf-8")) for p in pieces] == hf_pieces(text)
    assert "".join(pieces) == text
    assert len(pieces) > len(text) / 8  # it cut the text into words, not a few big pieces


def test_pretokenization_of_a_known_sentence():
    # GPT-2's rule, written out: words take the space before them; a run of spaces leaves
    # its last space to the next word; contractions are pieces of their own
    assert pretokenize("Hello world's  end!") == ["Hello", " world", "'s", " ", " end", "!"]


def test_merges_and_vocabulary_match_tokenizers_on_shakespeare(trained):
    ours, hf = trained
    assert len(ours.merges) == 700 - 256
    assert our_merges(ours) == hf_merges(hf)  # the same merges in the same order
    hf_vocab = hf.get_vocab()
    ours_vocab = {printable(token): i for i, token in ours.vocab.items()}
    assert ours_vocab.keys() == hf_vocab.keys()
    # merged tokens: the same ids; bytes: by value here, by printable character there
    assert all(hf_vocab[s] == i for s, i in ours_vocab.items() if i >= 256)
    by_char = sorted(range(256), key=lambda b: BYTE_CHAR[b])
    assert [hf_vocab[BYTE_CHAR[b]] for b in by_char] == list(range(256))
    assert all(ours.vocab[256 + k] == a + b for k, (a, b) in enumerate(ours.merges))


def test_merges_match_tokenizers_on_a_hand_text():
    ours, hf = train_bpe(HAND_TEXT, 400), hf_tokenizer([HAND_TEXT], 400)
    assert our_merges(ours) == hf_merges(hf)
    assert ours.vocab_size == hf.get_vocab_size() < 400  # both ran out of pairs to merge
    assert {printable(t) for t in ours.vocab.values()} == set(hf.get_vocab())


def test_ties_are_broken_like_tokenizers():
    # "ab" and " y" are each seen once. By byte value " y" (32, 121) would come first; in the
    # vocabulary order (printable bytes first) "ab" does, and tokenizers merges it first too.
    text = "ab y"
    assert our_merges(train_bpe(text, 257)) == hf_merges(hf_tokenizer([text], 257))
    assert train_bpe(text, 257).merges == [(b"a", b"b")]
    assert most_frequent_pair({(32, 121): 1, (97, 98): 1}) == (97, 98)
    assert most_frequent_pair({(32, 121): 2, (97, 98): 1}) == (32, 121)  # counts come first


def test_overlapping_pairs_and_running_out_of_pairs_like_tokenizers():
    text = "aaaaa aaa a"  # "aaa" holds (a, a) twice but can merge it only once
    ours = train_bpe(text, 300)
    assert our_merges(ours) == hf_merges(hf_tokenizer([text], 300))
    assert ours.merges[0] == (b"a", b"a") and ours.vocab_size < 300


def test_same_segmentation_as_tokenizers_on_held_out_text(trained, shakespeare):
    ours, hf = trained
    for text in (shakespeare[1], HAND_TEXT):
        ids = ours.encode(text)
        assert [printable(ours.vocab[i]) for i in ids] == hf.encode(text).tokens
        assert [i for i in ids if i >= 256] == [i for i in hf.encode(text).ids if i >= 256]
    held_out = shakespeare[1]
    assert len(ours.encode(held_out)) < 0.6 * len(held_out.encode())  # merges shorten it


def test_special_tokens_are_boundaries_like_separate_documents():
    documents = ["the cat sat", "the mat", "on the hat"] * 5
    ours = train_bpe(EOT.join(documents), 280, special_tokens=[EOT])
    hf = hf_tokenizer(documents, 280, special_tokens=[EOT])
    assert our_merges(ours) == hf_merges(hf)
    eot = ours.vocab_size - 1  # after the merged tokens (both ran out of pairs before 280)
    assert ours.special_tokens == {EOT: eot} and ours.vocab[eot] == EOT.encode()
    assert hf.token_to_id(EOT) == 0  # tokenizers puts special tokens first
    text = f"{EOT}the cat{EOT}{EOT} on the hat {EOT}"
    ids = ours.encode(text)
    assert ids.count(eot) == 4
    assert [printable(ours.vocab[i]) if i != eot else EOT for i in ids] == hf.encode(text).tokens


# --------------------------------------------------------------------------------------------
# Special tokens


def test_special_tokens_are_never_merged_from_training_text():
    text = (EOT + "ab ") * 50
    tokenizer = train_bpe(text, 300, special_tokens=[EOT, "<pad>"])
    assert all(b"<" not in a + b and b"|" not in a + b for a, b in tokenizer.merges)
    assert tokenizer.special_tokens == {EOT: tokenizer.vocab_size - 2,
                                        "<pad>": tokenizer.vocab_size - 1}


def test_the_longer_of_two_special_tokens_wins():
    tokenizer = BPETokenizer([], special_tokens=["<a>", "<a><b>"])
    assert tokenizer.encode("<a><b><a>") == [257, 256]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_a_special_token_is_one_id_between_its_neighbours(left, right):
    tokenizer = BPETokenizer([(b"a", b"b"), (b"e", b">")], special_tokens=[EOT, "<ab>"])
    # cutting the text around the special token is exactly what encoding does, provided the
    # neighbours do not complete a special token themselves
    assume(not any(s in left + "<" or s in ">" + right for s in ("<ab>", EOT)))
    assume((left + EOT + right).count(EOT) == 1)
    ids = tokenizer.encode(left + EOT + right)
    assert ids == tokenizer.encode(left) + [tokenizer.special_tokens[EOT]] + tokenizer.encode(right)
    assert tokenizer.decode(ids) == left + EOT + right


# --------------------------------------------------------------------------------------------
# Round trips and decoding


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_unicode_text_round_trips(trained, text):
    ours, _ = trained
    assert ours.decode(ours.encode(text)) == text
    assert "".join(pretokenize(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(["🙂", "e\u0301", "\u200d", " ", "  ", "\t", "\n", "\r\n",
                                 "a", "ß", "北", "'s", "1", "!", EOT]), max_size=40))
def test_emoji_combining_marks_and_whitespace_runs_round_trip(shakespeare, parts):
    tokenizer = train_bpe(shakespeare[0][:2000], 300, special_tokens=[EOT])
    text = "".join(parts)
    assert tokenizer.decode(tokenizer.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=20))
def test_byte_ids_decode_as_python_decodes_with_replacement(trained, ids):
    ours, _ = trained
    assert ours.decode(ids) == bytes(ids).decode("utf-8", errors="replace")


def test_half_a_character_decodes_to_the_replacement_character(trained):
    ours, _ = trained
    euro = ours.encode("€")  # three bytes; no merge in Shakespeare joins them
    assert [ours.vocab[i] for i in euro] == [b"\xe2", b"\x82", b"\xac"]
    assert ours.decode(euro[:2]) == "\ufffd"
    assert ours.decode(euro[:2] + ours.encode(" ok")) == "\ufffd ok"


def test_encode_tensor_and_tensor_ids(trained):
    ours, _ = trained
    ids = ours.encode_tensor("To be, or not to be")
    assert ids.dtype == torch.long and ids.shape == (len(ours.encode("To be, or not to be")),)
    assert ours.decode(ids) == "To be, or not to be"


def test_a_token_made_by_two_merges_keeps_one_id():
    tokenizer = BPETokenizer([(b"a", b"b"), (b"ab", b"c"), (b"b", b"c"), (b"a", b"bc")])
    assert tokenizer.vocab_size == 256 + 3  # ab, abc, bc
    assert tokenizer.encode("abc") == [257] and tokenizer.encode("bca") == [258, 97]


def test_merge_pair_scans_left_to_right():
    assert merge_pair([1, 1, 1], (1, 1), 9) == [9, 1]
    assert merge_pair([1, 1, 1, 1, 2], (1, 1), 9) == [9, 9, 2]
    assert merge_pair([], (1, 1), 9) == []


# --------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("call, error, match", [
    (lambda: train_bpe(b"bytes", 300), TypeError, r"text must be a str.*decode"),
    (lambda: train_bpe(None, 300), TypeError, "text must be a str"),
    (lambda: train_bpe("abc", 100), ValueError, r"vocab_size must be at least 256 .*got 100"),
    (lambda: train_bpe("abc", 256, [EOT]), ValueError, r"vocab_size.*= 257, got 256"),
    (lambda: train_bpe("abc", 300.0), TypeError, r"vocab_size must be an integer.*300"),
    (lambda: train_bpe("abc", 300, EOT), TypeError, r"special_tokens must be a list"),
    (lambda: train_bpe("abc", 300, [EOT, EOT]), ValueError, "special_tokens has duplicates"),
    (lambda: train_bpe("abc", 300, [""]), ValueError, r"special_tokens\[0\] must be a non-empty"),
    (lambda: BPETokenizer([(b"th", b"e")]), ValueError, r"merges\[0\].*b'th'.*earlier merge"),
    (lambda: BPETokenizer([("t", "h")]), TypeError, r"merges\[0\] must be a pair \(bytes"),
    (lambda: BPETokenizer("th"), TypeError, "merges must be a list"),
    (lambda: BPETokenizer([]).encode(["a"]), TypeError, "text must be a str"),
    (lambda: pretokenize(3), TypeError, "text must be a str"),
    (lambda: BPETokenizer([]).decode([300]), ValueError, r"ids\[0\] is 300.*0\.\.255"),
    (lambda: BPETokenizer([]).decode([5, -1]), ValueError, r"ids\[1\] is -1"),
    (lambda: BPETokenizer([]).decode("ab"), TypeError, "ids must be a list"),
    (lambda: BPETokenizer([]).decode([1.0]), TypeError, r"ids\[0\] must be an integer"),
])
def test_bad_input_is_explained(call, error, match):
    with pytest.raises(error, match=match):
        call()
