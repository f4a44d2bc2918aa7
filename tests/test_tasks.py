"""The synthetic tasks (tasks.py): copy and recall for decoder-only models and the word-order
translation with its gold alignment, checked against independent computations; their decoders
and the errors for bad arguments."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib.configs import DecoderConfig, EncoderDecoderConfig
from course_lib.metrics import alignment_score
from course_lib.models import DecoderLM, EncoderDecoder
from course_lib.tasks import copy_task, recall_task, repeated_segments, word_order_task
from course_lib.tokenizer import IGNORE_INDEX

# --------------------------------------------------------------------------------------------
# Copy and recall (LMTask)


def _answers(task, length):
    """The answer half of each example, read from the targets."""
    assert (task.targets[:, :length] == IGNORE_INDEX).all()
    return task.targets[:, length:]


def test_copy_task_answers():
    make, expected, length = copy_task, (lambda seq: seq), 6
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


LM_TASK_ERRORS = [
    (lambda: recall_task(4, -1), ValueError, r"distance.*>= 0.*-1"),
    (lambda: recall_task(4, 3.0), TypeError, r"distance.*3\.0"),
    (lambda: copy_task(4, 0), ValueError, r"length.*>= 1.*0"),
    (lambda: copy_task(4, generator=torch.Generator(), seed=1), ValueError,
     "either generator or seed"),
    (lambda: copy_task(4, seed=1.5), TypeError, r"seed.*integer.*1\.5"),
    (lambda: copy_task(4, generator=3), TypeError, r"generator.*torch\.Generator.*3"),
]


@pytest.mark.parametrize("call, error, match", LM_TASK_ERRORS,
                         ids=["distance<0", "distance-float", "length-0", "generator-and-seed",
                              "seed-float", "generator-int"])
def test_copy_and_recall_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------
# Word order (AlignedTranslationTask)

ENGLISH_TO_FRENCH = {
    "the": "le", "a": "un", "this": "ce", "my": "mon", "his": "son", "every": "chaque",
    "cat": "chat", "dog": "chien", "horse": "cheval", "king": "roi",
    "wolf": "loup", "fox": "renard", "boy": "garçon", "book": "livre", "red": "rouge",
    "black": "noir", "white": "blanc", "green": "vert", "blue": "bleu", "grey": "gris",
    "happy": "heureux", "fast": "rapide", "sees": "voit", "likes": "aime", "follows": "suit",
    "finds": "trouve", "calls": "appelle", "watches": "regarde",
}


def test_a_known_example():
    task = word_order_task(200, seed=3)
    i = next(i for i, s in enumerate(task.src_text) if len(s.split()) == 9)  # 2 + 2 adjectives
    english, french = task.src_text[i].split(), task.tgt_text[i].split()
    # det adj1 adj2 noun verb det adj3 adj4 noun  ->  det noun adj2 adj1 verb det noun adj4 adj3
    order = [0, 3, 2, 1, 4, 5, 8, 7, 6]
    assert french == [ENGLISH_TO_FRENCH[english[j]] for j in order]
    assert task.alignment[i].tolist() == [*order, IGNORE_INDEX]


@given(seed=st.integers(0, 2**16), max_adjectives=st.integers(0, 3))
def test_every_target_word_translates_its_gold_source_word(seed, max_adjectives):
    task = word_order_task(20, max_adjectives=max_adjectives, seed=seed)
    vocab = task.vocab
    for i in range(20):
        english = task.src_text[i].split()
        n = len(english)
        assert 5 <= n <= 5 + 2 * max_adjectives
        assert len(set(english)) == n  # no word twice: the alignment is unambiguous
        gold = task.alignment[i, :n].tolist()
        assert sorted(gold) == list(range(n))  # a permutation: one French word per English word
        assert gold[0] == 0  # the determiner comes first in both languages
        for t, j in enumerate(gold):
            assert vocab.tokens[task.tgt_out[i, t]] == ENGLISH_TO_FRENCH[english[j]]
            assert task.tgt_in[i, t + 1] == task.tgt_out[i, t]  # teacher forcing: shifted
        assert task.tgt_out[i, n] == vocab.eos_id and task.alignment[i, n] == IGNORE_INDEX
        assert (task.alignment[i, n:] == IGNORE_INDEX).all()
        assert (task.src[i, n:] == vocab.pad_id).all() and (task.tgt_in[i, n + 1:] == 0).all()
        assert task.tgt_in[i, 0] == vocab.bos_id
        assert task.words(task.src[i]) == task.src_text[i]
        assert task.words(task.tgt_out[i]) == task.tgt_text[i]


def test_the_task_is_deterministic_and_shaped_for_the_models():
    a, b = word_order_task(64, seed=1), word_order_task(64, generator=torch.Generator()
                                                        .manual_seed(1))
    assert torch.equal(a.src, b.src) and a.tgt_text == b.tgt_text
    assert not torch.equal(word_order_task(64, seed=2).src, a.src)
    assert a.src.shape == (64, 9) and a.tgt_in.shape == a.tgt_out.shape == a.alignment.shape
    assert a.tgt_in.shape == (64, 10)
    vocab = a.vocab
    assert vocab == word_order_task(1).vocab and vocab.tokens[:3] == ("<pad>", "<bos>", "<eos>")
    config = EncoderDecoderConfig.shared(vocab.vocab_size, vocab.vocab_size, d_model=16,
                                         n_heads=2, max_src_len=9, max_tgt_len=10, pad_id=0)
    out = EncoderDecoder(config)(a.src, a.tgt_in, targets=a.tgt_out, output_attentions=True)
    assert out.cross_attentions[0].shape == (64, 2, 10, 9) and torch.isfinite(out.loss)
    score = alignment_score(out.cross_attentions[-1][:, 0], a.alignment)
    assert 0.0 <= score <= 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    ({"n": 0}, ValueError, r"n.*>= 1.*0"),
    ({"n": 4, "max_adjectives": 4}, ValueError, r"max_adjectives.*0, 1, 2, 3.*4"),
    ({"n": 4, "max_adjectives": 1.0}, TypeError, r"max_adjectives.*1\.0"),
    ({"n": 4, "max_adjectives": True}, TypeError, r"max_adjectives.*True"),
    ({"n": 4, "seed": 1, "generator": torch.Generator()}, ValueError, "either generator or seed"),
])
def test_word_order_task_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        word_order_task(**kwargs)


# --------------------------------------------------------------------------------------------
# Decoding ids: LMTask.decode and AlignedTranslationTask.words

TASK = copy_task(4, 3, n_symbols=4)  # vocabulary: 4 symbols and "|"
WORDS = word_order_task(2)
def test_the_ignore_index_still_decodes_where_it_did():
    assert TASK.decode([IGNORE_INDEX, 0]) == ". 0"
    assert WORDS.words([WORDS.vocab.bos_id, IGNORE_INDEX]) == ""


# --------------------------------------------------------------------------------------------
# Tasks feed the models


def test_tasks_feed_the_models():
    task = copy_task(8, 5, seed=0)
    model = DecoderLM(DecoderConfig(vocab_size=task.vocab_size, d_model=16, n_heads=2,
                                             n_layers=1, max_len=16))
    out = model(task.inputs, targets=task.targets)
    assert out.logits.shape == (8, 10, task.vocab_size) and torch.isfinite(out.loss)

    words = word_order_task(8, seed=0)
    vocab = words.vocab
    seq2seq = EncoderDecoder(EncoderDecoderConfig.shared(
        src_vocab_size=vocab.vocab_size, tgt_vocab_size=vocab.vocab_size, d_model=16, n_heads=2,
        n_encoder_layers=1, n_decoder_layers=1, max_src_len=16, max_tgt_len=16,
        pad_id=vocab.pad_id,
    ))
    out = seq2seq(words.src, words.tgt_in, targets=words.tgt_out)
    assert out.logits.shape == (*words.tgt_in.shape, vocab.vocab_size) and torch.isfinite(out.loss)


# --- BERT's masking rule


def _binomial_ok(count: int, n: int, p: float, sigmas: float = 5.0) -> bool:
    """``count`` successes of ``n`` trials within ``sigmas`` standard deviations of n p."""
    return abs(count - n * p) <= sigmas * (n * p * (1 - p)) ** 0.5


def test_mask_tokens_follows_the_80_10_10_rule():
    from course_lib.tasks import mask_tokens

    V, mask_id = 40, 40
    ids = torch.randint(0, V, (400, 250), generator=torch.Generator().manual_seed(0))
    inputs, labels = mask_tokens(ids, mask_id=mask_id, vocab_size=V,
                                 generator=torch.Generator().manual_seed(1))
    selected = labels != IGNORE_INDEX
    n, n_sel = ids.numel(), int(selected.sum())
    assert _binomial_ok(n_sel, n, 0.15)
    shown_mask = int((inputs[selected] == mask_id).sum())
    kept = int((inputs[selected] == ids[selected]).sum())
    other = n_sel - shown_mask - kept
    assert _binomial_ok(shown_mask, n_sel, 0.8)
    assert _binomial_ok(other, n_sel, 0.1 * (1 - 1 / V))  # a random draw may hit the original
    assert _binomial_ok(kept, n_sel, 0.1 + 0.1 / V)
    assert torch.equal(labels[selected], ids[selected])  # the original token is the answer
    assert torch.equal(inputs[~selected], ids[~selected])  # nothing else changes
    assert int(inputs[selected].max()) <= mask_id and int(inputs[inputs != mask_id].max()) < V


def test_mask_tokens_never_selects_special_ids_and_is_repeatable():
    from course_lib.tasks import mask_tokens

    ids = torch.randint(0, 10, (50, 60), generator=torch.Generator().manual_seed(2))
    ids[:, -10:] = 0  # padding
    first = mask_tokens(ids, mask_id=10, vocab_size=10, p=0.5, special_ids=[0, 1],
                        generator=torch.Generator().manual_seed(3))
    again = mask_tokens(ids, mask_id=10, vocab_size=10, p=0.5, special_ids=[0, 1],
                        generator=torch.Generator().manual_seed(3))
    inputs, labels = first
    assert torch.equal(inputs, again[0]) and torch.equal(labels, again[1])
    special = (ids == 0) | (ids == 1)
    assert bool((labels[special] == IGNORE_INDEX).all())
    assert torch.equal(inputs[special], ids[special])
    assert _binomial_ok(int((labels != IGNORE_INDEX).sum()), int((~special).sum()), 0.5)
    none = mask_tokens(ids, mask_id=10, vocab_size=10, p=0.0)[1]
    assert bool((none == IGNORE_INDEX).all())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ids=torch.zeros(4, dtype=torch.long)), ValueError, "ids"),
    (dict(ids=torch.full((2, 3), 12)), ValueError, "ids"),
    (dict(ids=torch.zeros(2, 3)), ValueError, "ids must hold token ids"),
    (dict(mask_id=-1), ValueError, "mask_id"),
    (dict(p=1.5), ValueError, "p must"),
    (dict(special_ids=[99]), ValueError, "special_ids"),
    (dict(generator=3), TypeError, "generator"),
    (dict(vocab_size=0), ValueError, "vocab_size"),
])
def test_mask_tokens_bad_arguments(kwargs, error, match):
    from course_lib.tasks import mask_tokens

    args = dict(ids=torch.zeros(2, 3, dtype=torch.long), mask_id=10, vocab_size=10)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        mask_tokens(args.pop("ids"), **args)


# --------------------------------------------------------------------------------------------
# Repeated random segments (the induction-head task)


def test_repeated_segments_repeats_each_segment_and_targets_the_next_token():
    task = repeated_segments(40, 7, 13, seed=2)
    assert task.inputs.shape == task.targets.shape == (40, 14)
    assert torch.equal(task.inputs[:, :7], task.inputs[:, 7:])  # the same segment twice
    assert torch.equal(task.targets[:, :-1], task.inputs[:, 1:])  # the next token
    assert (task.targets[:, -1] == IGNORE_INDEX).all()
    assert int(task.inputs.min()) >= 0 and int(task.inputs.max()) < 13
    assert task.vocab_size == 13 and task.vocab[12] == "s12"
    assert repeated_segments(2, 3, 5, seed=0).vocab == ("0", "1", "2", "3", "4")


def test_repeated_segments_draw_uniform_tokens_from_the_generator():
    gen = torch.Generator().manual_seed(5)
    a = repeated_segments(300, 10, 8, generator=gen)
    b = repeated_segments(300, 10, 8, generator=gen)  # the stream moved on: new segments
    assert not torch.equal(a.inputs, b.inputs)
    assert torch.equal(a.inputs, repeated_segments(300, 10, 8, seed=5).inputs)
    counts = torch.bincount(a.inputs[:, :10].flatten(), minlength=8).float()  # 3,000 draws
    assert (counts / counts.sum() - 1 / 8).abs().max() < 0.03  # each token about 1/8


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: repeated_segments(0, 4, 8), ValueError, "n_sequences"),
    (lambda: repeated_segments(2, 0, 8), ValueError, "segment_len"),
    (lambda: repeated_segments(2, 4, 2.5), TypeError, "vocab_size"),
    (lambda: repeated_segments(2, 4, 8, seed=1, generator=torch.Generator()), ValueError,
     "either generator or seed"),
])
def test_repeated_segments_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
