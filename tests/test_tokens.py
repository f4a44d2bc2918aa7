"""Chapter 13's instruments (course_lib.instruments.tokens) against independent computations:
bits per character of a model with equal logits is log2(V) x tokens scored / characters;
of a real model, F.cross_entropy summed by hand over the same blocks; the coloured spans give
back the text; attention FLOPs per character match torch's FlopCounterMode; and every
refusal names its argument."""

from __future__ import annotations

import html
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import DecoderConfig, DecoderLM
from course_lib.bpe import BPETokenizer, train_bpe
from course_lib.configs import EncoderConfig, EncoderDecoderConfig
from course_lib.corpus import shakespeare_text
from course_lib.instruments.tokens import (
    PASTELS,
    TokenRun,
    bits_per_character,
    equal_compute_run,
    show_tokens,
    token_text,
    token_widget,
    tokens_html,
    tokens_report,
)
from course_lib.models import Encoder, EncoderDecoder, MaskedLM
from course_lib.train import TrainHistory

BYTES = BPETokenizer([])
TEXT = "Hello  world's end!\nIt's 2024: café costs £3 🙂\n\n  ok"  # no · or ↵ in it


@pytest.fixture(scope="module")
def shakespeare():
    text = shakespeare_text()
    return text[:30_000], text[30_000:33_000]


@pytest.fixture(scope="module")
def bpe(shakespeare):
    return train_bpe(shakespeare[0], 400)


class EqualLogits(nn.Module):
    """A 'model' whose logits are all zero: every token has probability 1/V."""

    def __init__(self, vocab_size: int, max_len: int = 1000) -> None:
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_len=max_len)
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        return SimpleNamespace(logits=torch.zeros(*ids.shape, self.config.vocab_size))


def tiny_model(vocab_size: int, max_len: int = 16) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=vocab_size, d_model=16, n_heads=2, n_layers=1,
                                   max_len=max_len))


# --- show_tokens


def spans(html_text: str) -> list[tuple[str, str, str]]:
    """(title, background, shown text) of every span."""
    return re.findall(r'<span title="([^"]*)" style="background:([^;]*);[^"]*">(.*?)</span>',
                      html_text)


def undisplayed(shown: str) -> bytes:
    """The bytes a span shows: undo the HTML escaping, ·, ↵ and the <0xE2> hex bytes."""
    text = html.unescape(shown).replace("·", " ").replace("↵", "\n")
    parts = re.split(r"<0x([0-9A-F]{2})>", text)  # text, hex, text, hex, ...
    return b"".join(bytes.fromhex(p) if i % 2 else p.encode("utf-8") for i, p in enumerate(parts))


@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_show_tokens_has_one_span_per_token_and_gives_back_the_text(which, bpe):
    tok = BYTES if which == "bytes" else bpe
    ids = tok.encode(TEXT)
    found = spans(show_tokens(tok, TEXT).data)
    assert len(found) == len(ids) == show_tokens(tok, TEXT).data.count("<span")
    assert [title for title, _, _ in found] == [f"id {i}" for i in ids]
    assert b"".join(undisplayed(shown) for _, _, shown in found).decode("utf-8") == TEXT
    colours = [colour for _, colour, _ in found]
    assert all(a != b for a, b in zip(colours, colours[1:], strict=False))
    assert set(colours) <= set(PASTELS)


def test_token_text_shows_spaces_newlines_and_cut_characters():
    assert token_text(b" the") == "·the"
    assert token_text(b"\n\n") == "↵↵"
    assert token_text("é".encode()) == "é"
    assert token_text("é".encode()[:1]) == "<0xC3>"  # half a character
    assert token_text(b" \xe2\x80") == "·<0xE2><0x80>"
    assert [token_text(BYTES.vocab[i]) for i in BYTES.encode("é")] == ["<0xC3>", "<0xA9>"]


def test_show_tokens_escapes_html_and_shows_an_empty_text_as_nothing():
    data = show_tokens(BYTES, "<b>&").data
    assert "<b>" not in data and "&lt;" in data and "&amp;" in data
    assert spans(show_tokens(BYTES, "").data) == []


def test_token_widget_without_a_front_end_prints_each_tokenizers_tokens(capsys, bpe):
    token_widget({"bytes": BYTES, "bpe": bpe}, "To be")
    out = capsys.readouterr().out
    assert "bytes: ['T', 'o', '·', 'b', 'e']" in out
    assert f"bpe: {[token_text(bpe.vocab[i]) for i in bpe.encode('To be')]}" in out


def test_the_widgets_report_counts_each_tokenizers_tokens(bpe):
    report = tokens_report({"bytes": BYTES, "bpe": bpe}, TEXT)
    assert f"{len(TEXT.encode()):,} tokens for {len(TEXT):,} characters" in report  # bytes
    assert f"{len(bpe.encode(TEXT)):,} tokens for {len(TEXT):,} characters" in report
    assert len(spans(report)) == len(TEXT.encode()) + len(bpe.encode(TEXT))


# --- bits_per_character


@pytest.mark.parametrize(("which", "block_size"), [("bytes", 7), ("bpe", 5), ("bpe", 1000)])
def test_bits_per_character_of_equal_logits_is_log2_v_per_token(which, block_size, bpe):
    tok = BYTES if which == "bytes" else bpe
    ids = tok.encode(TEXT)
    first_chars = len(tok.decode(ids[:1]))  # ASCII first token: its characters are not counted
    expected = math.log2(tok.vocab_size) * (len(ids) - 1) / (len(TEXT) - first_chars)
    got = bits_per_character(EqualLogits(tok.vocab_size), tok, TEXT, block_size=block_size)
    assert got == pytest.approx(expected, rel=1e-6)


def test_bits_per_character_of_bytes_with_equal_logits_on_ascii_is_8():
    text = "To be, or not to be, that is the question."
    assert bits_per_character(EqualLogits(256), BYTES, text, block_size=4) == pytest.approx(8.0)


@pytest.mark.parametrize("batch_size", [1, 3, np.int64(64)])
def test_bits_per_character_is_cross_entropy_summed_by_hand_over_the_blocks(batch_size, bpe,
                                                                            shakespeare):
    text, block = shakespeare[1][:700], 16
    model, ids = tiny_model(bpe.vocab_size, block), bpe.encode(shakespeare[1][:700])
    model.eval()
    nats = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, block):  # overlapping by one token
            window = torch.tensor(ids[start: start + block + 1])
            logits = model(window[None, :-1]).logits[0]
            nats += F.cross_entropy(logits, window[1:], reduction="sum").item()
    chars = len(text) - len(bpe.decode(ids[:1]))
    got = bits_per_character(model, bpe, text, block_size=block, batch_size=batch_size)
    assert got == pytest.approx(nats / chars / math.log(2), rel=1e-5)


def test_bits_per_character_in_one_block_is_the_models_own_loss(bpe, shakespeare):
    text = shakespeare[1][:200]
    ids = bpe.encode_tensor(text)
    model = tiny_model(bpe.vocab_size, len(ids))
    with torch.no_grad():
        loss = model(ids[None, :-1], targets=ids[None, 1:]).loss.item()  # mean nats per token
    chars = len(text) - len(bpe.decode(ids[:1]))
    expected = loss * (len(ids) - 1) / chars / math.log(2)
    got = bits_per_character(model, bpe, text, block_size=len(ids))
    assert got == pytest.approx(expected, rel=1e-5)
    assert model.training  # the mode it came in


# --- equal_compute_run


def run(tok, texts, **changes):
    sizes = dict(updates=30, batch_size=4, block_size=16, d_model=16, n_layers=1, n_heads=2,
                 lr=1e-2, seed=0)
    return equal_compute_run(tok, texts[0], texts[1][:600], **{**sizes, **changes})


def test_equal_compute_run_learns_and_is_deterministic_per_seed(bpe, shakespeare):
    first, again, other = run(bpe, shakespeare), run(bpe, shakespeare), run(bpe, shakespeare,
                                                                             seed=1)
    assert first.bits_per_char == again.bits_per_char != other.bits_per_char
    uniform = math.log2(bpe.vocab_size) / first.chars_per_token
    assert first.bits_per_char < 0.9 * uniform  # 30 updates beat guessing (0.84 measured)
    assert first.vocab_size == bpe.vocab_size
    assert first.embedding_and_head_parameters == bpe.vocab_size * 16  # tied: one V x D matrix
    assert first.chars_per_token == len(shakespeare[1][:600]) / len(bpe.encode(
        shakespeare[1][:600]))
    assert len(first.history.steps) == 30


def test_a_run_measures_parameters_as_the_model_counts_them(bpe, shakespeare):
    result = run(bpe, shakespeare, updates=1)
    model = DecoderLM(DecoderConfig(vocab_size=bpe.vocab_size, d_model=16, n_heads=2,
                                    n_layers=1, max_len=16))
    assert result.parameters == sum(p.numel() for p in model.parameters())


def test_attention_flops_per_char_match_flop_counter_mode():
    """4 T D L per token, over characters per token, as FlopCounterMode counts the attention
    products (scaled_dot_product_attention) of one block."""
    T, D, L, cpt = 32, 16, 3, 2.5
    model = DecoderLM(DecoderConfig(vocab_size=50, d_model=D, n_heads=2, n_layers=L, max_len=T))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        # the equation-level path (it returns the weights): QK^T and weights @ V are bmm's
        model(torch.zeros(1, T, dtype=torch.long), output_attentions=True)
    attention = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                    if "bmm" in str(op))
    made = TokenRun(vocab_size=50, parameters=0, embedding_and_head_parameters=0,
                    chars_per_token=cpt, bits_per_char=0.0, seconds=0.0, block_size=T,
                    d_model=D, n_layers=L, train_chars_per_update=0.0, history=TrainHistory())
    assert attention > 0
    assert made.attention_flops_per_char == pytest.approx(attention / T / cpt)


# --- refusals, each naming its argument


@pytest.mark.parametrize(("call", "error", "named"), [
    (lambda tok: show_tokens("bytes", "a"), TypeError, "tokenizer"),
    (lambda tok: show_tokens(tok, b"a"), TypeError, "text"),
    (lambda tok: token_widget([tok], "a"), TypeError, "tokenizers"),
    (lambda tok: token_widget({}, "a"), ValueError, "tokenizers"),
    (lambda tok: token_widget({"mine": "x"}, "a"), TypeError, "tokenizers['mine']"),
    (lambda tok: token_widget({"b": tok}, 3), TypeError, "text"),
    (lambda tok: bits_per_character("model", tok, "abc", block_size=4), TypeError, "model"),
    (lambda tok: bits_per_character(EqualLogits(256), tok, "abc", block_size=0), ValueError,
     "block_size"),
    (lambda tok: bits_per_character(EqualLogits(256), tok, "abc", block_size=2.0), TypeError,
     "block_size"),
    (lambda tok: bits_per_character(EqualLogits(256), tok, "abc", block_size=2, batch_size=0),
     ValueError, "batch_size"),
    (lambda tok: bits_per_character(EqualLogits(256), tok, "a", block_size=4), ValueError,
     "text"),
    (lambda tok: bits_per_character(EqualLogits(256), tok, "", block_size=4), ValueError, "text"),
    (lambda tok: bits_per_character(EqualLogits(100), tok, "abc", block_size=4), ValueError,
     "vocab_size"),
    (lambda tok: bits_per_character(EqualLogits(256, 8), tok, "abc", block_size=9), ValueError,
     "max_len"),
    (lambda tok: token_text("ab"), TypeError, "token must be the bytes of one token"),
    (lambda tok: tokens_html("bytes", "a"), TypeError, "tokenizer must be a BPETokenizer"),
    (lambda tok: tokens_report([tok], "a"), TypeError, "tokenizers must be a dict"),
])
def test_refusals_name_the_argument(call, error, named):
    with pytest.raises(error, match=re.escape(named)):
        call(BYTES)


@pytest.mark.parametrize(("changes", "error", "named"), [
    ({"updates": 0}, ValueError, "updates"),
    ({"batch_size": 1.5}, TypeError, "batch_size"),
    ({"block_size": -1}, ValueError, "block_size"),
    ({"d_model": 15}, ValueError, "d_model"),
    ({"n_heads": 0}, ValueError, "n_heads"),
    ({"lr": 0.0}, ValueError, "lr"),
    ({"seed": "0"}, TypeError, "seed"),
    ({"progress": 1}, TypeError, "progress"),
    ({"tokenizer": "bytes"}, TypeError, "tokenizer"),
    ({"train_text": "short"}, ValueError, "train_text"),
    ({"val_text": ""}, ValueError, "val_text"),
])
def test_equal_compute_run_refusals_name_the_argument(changes, error, named):
    arguments = dict(tokenizer=BYTES, train_text="x" * 100, val_text="abc", updates=2,
                     batch_size=2, block_size=8, d_model=16, n_layers=1, n_heads=2, lr=1e-3,
                     seed=0)
    with pytest.raises(error, match=re.escape(named)):
        equal_compute_run(**{**arguments, **changes})


def _not_a_decoder(kind):
    config = EncoderConfig(vocab_size=256, d_model=16, n_heads=2, n_layers=1, max_len=16)
    if kind == "EncoderDecoder":
        return EncoderDecoder(EncoderDecoderConfig.shared(256, 256, d_model=16, n_heads=2))
    return {"Encoder": Encoder, "MaskedLM": MaskedLM}[kind](config)


@pytest.mark.parametrize("kind", ["Encoder", "MaskedLM", "EncoderDecoder"])
def test_a_model_that_does_not_predict_the_next_token_is_refused_naming_model(kind):
    """An Encoder died with an AttributeError (no .logits) and an EncoderDecoder without its
    target; a MaskedLM, which sees the tokens it predicts, gave a number that meant nothing."""
    with pytest.raises(TypeError, match=f"model must be a decoder-only language model such as "
                                        f"a DecoderLM.*got {kind}"):
        bits_per_character(_not_a_decoder(kind), BYTES, "hello world", block_size=8)


class EqualLogitsWithoutParameters(EqualLogits):
    def __init__(self) -> None:
        super().__init__(256)
        del self.dummy


def test_a_model_without_parameters_is_scored_on_the_cpu():
    text = "To be, or not to be."
    got = bits_per_character(EqualLogitsWithoutParameters(), BYTES, text, block_size=4)
    assert got == pytest.approx(8.0)  # was a StopIteration from next(model.parameters())


def test_numpy_integers_are_accepted():
    text = "To be, or not to be."
    got = bits_per_character(EqualLogits(256), BYTES, text, block_size=np.int64(4),
                             batch_size=np.int32(2))
    assert got == pytest.approx(8.0)
