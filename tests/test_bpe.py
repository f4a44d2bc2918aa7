"""Byte-level BPE against Hugging Face ``tokenizers`` (a BpeTrainer with GPT-2's ByteLevel
pre-tokenizer, trained on the same text): the same pieces, merges, vocabulary and segmentation;
GPT-2's vocab.json and merges.txt read and written, with the ids tokenizers gives from the same
files; the lexicographic tie rule against brute force; streaming that gives the ids of the
whole text; round trips on any Unicode text; special tokens kept whole, and refused in text
unless allowed; errors that name the argument.

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

import json
import random
import shutil
import tracemalloc
from collections import Counter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from course_lib.bpe import (
    BPETokenizer,
    _chunks_between_pieces,
    _tie_key,
    merge_pair,
    most_frequent_pair,
    pretokenize,
    train_bpe,
)
from course_lib.corpus import shakespeare_text
from course_lib.instruments.hf_bpe import (
    BYTE_CHAR,
    hf_from_files,
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
VARIED = ("Numbers: 3.14159, 2024-11-28, 1,000,000 and 007; x=y+1 (ok?)\r\n"
          "    indented\t\ttabs   and   runs of spaces   \n\n\nÀ la carte, Straße, ĳ ǅ\n")


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
    ids = ours.encode(text, allowed_special="all")
    assert ids.count(eot) == 4
    assert [printable(ours.vocab[i]) if i != eot else EOT for i in ids] == hf.encode(text).tokens


def test_the_training_loop_matches_tokenizers_on_random_texts():
    # the heap with lazy invalidation must find the same most frequent pair at every merge
    draw = random.Random(0)
    for _ in range(20):
        text = "".join(draw.choice(["a", "b", "ab", " ", "ba", "\n", "aa", "é", "1", "!"])
                       for _ in range(draw.randint(1, 200)))
        assert our_merges(train_bpe(text, 300)) == hf_merges(hf_tokenizer([text], 300)), text


# --------------------------------------------------------------------------------------------
# Ties: the lexicographic rule


def _brute_force_merges(text: str, n_merges: int) -> list[tuple[bytes, bytes]]:
    """Train by counting every pair again at each merge and taking the greatest (count, (bytes
    of a, bytes of b)): the lexicographic rule, written as plainly as possible."""
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in pretokenize(text))
    merges = []
    for _ in range(n_merges):
        counts = Counter()
        for word, n in words.items():
            for pair in zip(word, word[1:], strict=False):
                counts[pair] += n
        if not counts:
            break
        best = max(counts, key=lambda pair: (counts[pair], pair))
        merges.append(best)
        merged = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i:i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


def test_the_lexicographic_rule_takes_the_greatest_pair_where_tokenizers_takes_another():
    text = "ab yz"  # (a, b), (space, y) and (y, z), once each
    assert train_bpe(text, 257).merges == [(b"a", b"b")]  # first in the vocabulary order
    lexicographic = train_bpe(text, 257, tie_break="lexicographic").merges
    assert lexicographic == _brute_force_merges(text, 1) == [(b"y", b"z")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=3), st.binary(min_size=1, max_size=3)),
                min_size=2, max_size=12, unique=True))
def test_the_lexicographic_key_puts_the_greatest_pair_first(pairs):
    # the heap pops the smallest key: it must order pairs as Python orders tuples of bytes,
    # reversed, prefixes included (b"a" < b"ab")
    tokens = sorted({token for pair in pairs for token in pair})
    vocab, ids = dict(enumerate(tokens)), {token: i for i, token in enumerate(tokens)}
    by_key = sorted(pairs, key=lambda p: _tie_key((ids[p[0]], ids[p[1]]), vocab, "lexicographic"))
    assert by_key == sorted(pairs, reverse=True)


def test_the_lexicographic_rule_on_the_cs336_handouts_example():
    # "if the pairs ("A", "B"), ("A", "C"), ("B", "ZZ"), and ("BA", "A") all have the highest
    # frequency, we'd merge ("BA", "A")" (Stanford CS336, assignment 1, section 2.4)
    pairs = [(b"A", b"B"), (b"A", b"C"), (b"B", b"ZZ"), (b"BA", b"A")]
    vocab = {0: b"A", 1: b"B", 2: b"C", 3: b"ZZ", 4: b"BA"}
    ids = {token: i for i, token in vocab.items()}
    keys = {pair: _tie_key((ids[pair[0]], ids[pair[1]]), vocab, "lexicographic") for pair in pairs}
    assert min(pairs, key=keys.get) == (b"BA", b"A")


@pytest.mark.parametrize("text", [HAND_TEXT, "ab ba ab ba xy yx", "aaaa bbbb aaab abbb " * 3])
def test_the_lexicographic_rule_matches_brute_force(text, shakespeare):
    merges = train_bpe(text, 300, tie_break="lexicographic").merges
    assert merges == _brute_force_merges(text, 300 - 256)
    if text == HAND_TEXT:
        assert merges != train_bpe(text, 300).merges  # the rules really differ on this text


# --------------------------------------------------------------------------------------------
# GPT-2's files: read, written, and the same ids as tokenizers reading them


@pytest.fixture(scope="module")
def hf_files(shakespeare, tmp_path_factory):
    """tokenizers trained on Shakespeare, saved as GPT-2's vocab.json and merges.txt: its
    special token first, the bytes by printable character, then the merged tokens."""
    folder = tmp_path_factory.mktemp("hf_bpe")
    hf_tokenizer([shakespeare[0], HAND_TEXT], 600, special_tokens=[EOT]).model.save(str(folder))
    return folder


def _same_ids(ours, theirs, texts):
    for text in texts:
        ids = ours.encode(text, allowed_special="all")
        assert ids == theirs.encode(text).ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False) == text


def test_gpt2_files_give_the_ids_tokenizers_gives(hf_files, shakespeare):
    ours = BPETokenizer.from_files(hf_files / "vocab.json", str(hf_files / "merges.txt"))
    theirs = hf_from_files(hf_files, [EOT])
    assert ours.special_tokens == {EOT: 0} and ours.vocab_size == theirs.get_vocab_size() == 600
    assert ours.token_ids[b"!"] == 1 and ours.token_ids[b" "] == theirs.token_to_id("Ġ") != 32
    _same_ids(ours, theirs, [shakespeare[1], HAND_TEXT, VARIED, f"Exeunt.{EOT}ACT II{EOT}"])


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["🙂", "e\u0301", " ", "  ", "\t", "\n", "\r\n", "北京", "'s",
                                 "'ll", "1", "2024", "!!", "—", EOT, " the", "Ἀθῆναι"])
                | st.text(st.characters(max_codepoint=0x24F), max_size=6), max_size=30))
def test_any_text_gets_the_ids_tokenizers_gives_from_the_same_files(hf_files, parts):
    ours = BPETokenizer.from_files(hf_files / "vocab.json", hf_files / "merges.txt")
    _same_ids(ours, hf_from_files(hf_files, [EOT]), ["".join(parts)])


@pytest.mark.parametrize("seed", [0, 1])
def test_any_numbering_of_the_vocabulary_gives_the_ids_tokenizers_gives(hf_files, tmp_path, seed):
    vocab = json.loads((hf_files / "vocab.json").read_text(encoding="utf-8"))
    ids = list(vocab.values())
    random.Random(seed).shuffle(ids)
    shuffled = dict(zip(vocab, ids, strict=True))
    (tmp_path / "vocab.json").write_text(json.dumps(shuffled, ensure_ascii=False), encoding="utf-8")
    shutil.copy(hf_files / "merges.txt", tmp_path)
    ours = BPETokenizer.load(tmp_path)
    assert ours.special_tokens == {EOT: shuffled[EOT]}
    _same_ids(ours, hf_from_files(tmp_path, [EOT]), [HAND_TEXT, VARIED, f"a{EOT}b"])


def test_save_and_load_round_trip_and_tokenizers_reads_the_files(shakespeare, tmp_path):
    ours = train_bpe(shakespeare[0], 500, special_tokens=[EOT, "<fin de página>"])
    ours.save(tmp_path / "new_folder")
    back = BPETokenizer.load(tmp_path / "new_folder")
    assert (back.merges, back.vocab, back.special_tokens) == (ours.merges, ours.vocab,
                                                             ours.special_tokens)
    assert (tmp_path / "new_folder" / "merges.txt").read_text().startswith("#version")
    texts = [shakespeare[1], HAND_TEXT, VARIED, f"<fin de página>{EOT} ok"]
    for text in texts:
        ids = ours.encode(text, allowed_special="all")
        assert back.encode(text, allowed_special="all") == ids and back.decode(ids) == text
    _same_ids(back, hf_from_files(tmp_path / "new_folder", [EOT, "<fin de página>"]), texts)


def test_malformed_gpt2_files_are_explained(hf_files, tmp_path):
    shutil.copy(hf_files / "merges.txt", tmp_path)
    (tmp_path / "vocab.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="vocab_path must hold a JSON object"):
        BPETokenizer.load(tmp_path)
    shutil.copy(hf_files / "vocab.json", tmp_path)
    for merges, match in [("Ġ t\nh e x\n", r"merges_path's merge 1 is 'h e x'"),
                          ("Ġ t\nh\te\n", r"merge 1 is 'h\\te'.*printable characters"),
                          ("Ġ t\nhe Ġ\n", r"merges\[1\].*b'he'.*neither a byte nor made"),
                          ("Ġ t\nĠt Ġt\n", r"token_ids has no id for the token b' t t'")]:
        (tmp_path / "merges.txt").write_text("#version: 0.2\n" + merges, encoding="utf-8")
        with pytest.raises(ValueError, match=match):
            BPETokenizer.load(tmp_path)


# --------------------------------------------------------------------------------------------
# Streaming a large text


def test_streaming_a_file_gives_the_ids_of_the_whole_text(trained, tmp_path):
    ours, _ = trained
    text = shakespeare_text()[:600_000] + VARIED
    path = tmp_path / "plays.txt"
    path.write_text(text, encoding="utf-8", newline="")
    with open(path, encoding="utf-8", newline="") as file:  # newline="": keep "\r\n"
        streamed = ours.encode_iterable(file)
        assert not isinstance(streamed, list)
        assert list(streamed) == ours.encode(text)
    assert len(list(_chunks_between_pieces(text.splitlines(keepends=True)))) == 3  # 2**18 each


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from([*" \t\n\r\x0b\x1c\x85\xa0\u3000ab1'!é🙂", EOT]),
                         max_size=25).map("".join), max_size=8))
def test_chunks_end_only_where_pieces_end(parts):
    tokenizer = BPETokenizer([(b" ", b" "), (b"a", b"b"), (b" ", b"ab")], special_tokens=[EOT])
    text = "".join(parts)
    chunks = list(_chunks_between_pieces(parts, size=1))  # cut wherever allowed
    assert "".join(chunks) == text
    assert [piece for chunk in chunks for piece in pretokenize(chunk)] == pretokenize(text)
    streamed = [i for chunk in chunks for i in tokenizer.encode(chunk, allowed_special="all")]
    assert streamed == tokenizer.encode(text, allowed_special="all")


def test_a_chunk_never_ends_after_whitespace():
    # a cut after the newline would change the pieces: at the end of a text a whitespace run
    # is one piece, in the middle it leaves its last character to what follows
    assert pretokenize("foo  \n") + pretokenize("bar") != pretokenize("foo  \nbar")
    assert list(_chunks_between_pieces(["foo  \n", "bar"], size=1)) == ["foo", "  \nbar"]


def test_streaming_memory_does_not_grow_with_the_text(trained):
    ours, _ = trained
    text = shakespeare_text()[:900_000]

    def peak(encode, text_or_lines):  # bytes allocated at the peak, beyond what was there
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        n_ids = sum(1 for _ in encode(text_or_lines))
        return tracemalloc.get_traced_memory()[1] - before, n_ids

    tracemalloc.start()
    try:  # one chunk of 2**18 characters (and a bit), then three (and a bit)
        one, _ = peak(ours.encode_iterable, text[:300_000].splitlines(keepends=True))
        three, n_streamed = peak(ours.encode_iterable, text.splitlines(keepends=True))
        whole, n_ids = peak(ours.encode, text)
    finally:
        tracemalloc.stop()
    assert n_streamed == n_ids and three < 1.25 * one and three < whole / 2


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
    assert tokenizer.encode("<a><b><a>", allowed_special="all") == [257, 256]


def test_special_token_strings_in_text_are_refused_unless_allowed():
    tokenizer = BPETokenizer([], special_tokens=[EOT, "<pad>"])
    text = f"hi{EOT}there<pad>"
    with pytest.raises(ValueError, match=r"special token '<\|endoftext\|>'.*allowed_special="):
        tokenizer.encode(text)
    with pytest.raises(ValueError, match=r"'<pad>'.*allowed_special=\{'<pad>'\}"):
        tokenizer.encode(text, allowed_special={EOT})  # only the one allowed
    eot, pad = tokenizer.special_tokens[EOT], tokenizer.special_tokens["<pad>"]
    assert tokenizer.encode(text, allowed_special="all") == [104, 105, eot, *b"there", pad]
    assert tokenizer.encode(text, allowed_special=[EOT, "<pad>"]) == \
        tokenizer.encode(text, allowed_special="all")
    assert tokenizer.encode("<|endoftext") == list(b"<|endoftext")  # not a special token
    assert BPETokenizer([]).encode(text) == list(text.encode())  # no special tokens: plain text
    with pytest.raises(ValueError, match="endoftext"):
        list(tokenizer.encode_iterable(["a b", f" c{EOT}"]))


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_a_special_token_is_one_id_between_its_neighbours(left, right):
    tokenizer = BPETokenizer([(b"a", b"b"), (b"e", b">")], special_tokens=[EOT, "<ab>"])
    # cutting the text around the special token is exactly what encoding does, provided the
    # neighbours do not complete a special token themselves
    assume(not any(s in left + "<" or s in ">" + right for s in ("<ab>", EOT)))
    assume((left + EOT + right).count(EOT) == 1)
    ids = tokenizer.encode(left + EOT + right, allowed_special={EOT})
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
    assert tokenizer.decode(tokenizer.encode(text, allowed_special="all")) == text


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
    (lambda: train_bpe("", 300), ValueError, r"text is empty"),
    (lambda: train_bpe(EOT * 3, 300, [EOT]), ValueError, r"text is special tokens only"),
    (lambda: train_bpe("abc", 300, tie_break="alphabetical"), ValueError, r"tie_break.*'lexicographic'"),
    (lambda: BPETokenizer([], [EOT]).encode("a", allowed_special="none"), TypeError, r"allowed_special must be 'all' or a set"),
    (lambda: BPETokenizer([], [EOT]).encode("a", allowed_special={"<s>"}), ValueError, r"allowed_special holds '<s>'"),
    (lambda: BPETokenizer([]).encode_iterable("a text"), TypeError, r"lines must be an iterable of str.*encode\(text\)"),
    (lambda: list(BPETokenizer([]).encode_iterable(["a", b"b"])), TypeError, r"lines\[1\] must be a str.*decode"),
    (lambda: BPETokenizer([], ["<a b>"]).encode_iterable(["a"]), ValueError, r"'<a b>' holds whitespace"),
    (lambda: BPETokenizer([], {EOT: 256}), TypeError, r"special_tokens must be a list unless token_ids"),
    (lambda: BPETokenizer([], token_ids={bytes([b]): b for b in range(255)}), ValueError, r"token_ids has no id for the token b'\\xff'"),
    (lambda: BPETokenizer([], token_ids={bytes([b]): 2 * b for b in range(256)}), ValueError, r"ids of token_ids and special_tokens must be 0..V-1"),
    (lambda: BPETokenizer([], token_ids={bytes([b]): float(b) for b in range(256)}), TypeError, r"id of b'\\x00' must be an integer"),
    (lambda: BPETokenizer.from_files("no/such/vocab.json", "merges.txt"), FileNotFoundError, r"vocab_path 'no/such/vocab.json' is not a file"),
    (lambda: BPETokenizer.from_files(3, "merges.txt"), TypeError, r"vocab_path must be a file path"),
    (lambda: BPETokenizer.load(None), TypeError, r"directory must be a folder"),
])
def test_bad_input_is_explained(call, error, match):
    with pytest.raises(error, match=match):
        call()
