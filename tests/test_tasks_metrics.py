"""The word-order translation task (its gold alignment) and the alignment score."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from course_lib.configs import EncoderDecoderConfig
from course_lib.metrics import alignment_score
from course_lib.models import EncoderDecoder
from course_lib.tasks import word_order_task, word_order_vocab
from course_lib.tokenizer import IGNORE_INDEX

# ------------------------------------------------------------------------ word_order_task

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
    vocab = word_order_vocab()
    assert vocab == a.vocab and vocab.tokens[:3] == ("<pad>", "<bos>", "<eos>")
    config = EncoderDecoderConfig.shared(vocab.vocab_size, vocab.vocab_size, d_model=16,
                                         n_heads=2, max_src_len=9, max_tgt_len=10, pad_id=0)
    out = EncoderDecoder(config)(a.src, a.tgt_in, targets=a.tgt_out, output_attentions=True)
    assert out.cross_attentions[0].shape == (64, 2, 10, 9) and torch.isfinite(out.loss)
    score = alignment_score(out.cross_attentions[-1][:, 0], a.alignment)
    assert 0.0 <= score <= 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    ({"n": 0}, ValueError, "n must be a positive integer, got 0"),
    ({"n": 4, "max_adjectives": 4}, ValueError, "max_adjectives must be an integer from 0 to "
                                                 "3, got 4"),
    ({"n": 4, "max_adjectives": 1.0}, ValueError, "max_adjectives .* got 1.0"),
    ({"n": 4, "seed": 1, "generator": torch.Generator()}, ValueError, "either generator or seed"),
])
def test_bad_task_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        word_order_task(**kwargs)


# ------------------------------------------------------------------------ alignment_score


def test_alignment_score_counts_peaks_on_the_gold_position():
    weights = torch.tensor([[[0.7, 0.2, 0.1],   # peak 0, gold 0: right
                             [0.1, 0.3, 0.6],   # peak 2, gold 1: wrong
                             [0.2, 0.5, 0.3],   # peak 1, gold 1: right
                             [0.9, 0.05, 0.05]]])  # not scored
    gold = torch.tensor([[0, 1, 1, IGNORE_INDEX]])
    assert alignment_score(weights, gold) == pytest.approx(2 / 3)
    assert alignment_score(weights[0], gold[0]) == pytest.approx(2 / 3)  # unbatched
    assert alignment_score(weights[:, :, :], torch.tensor([[0, 2, 1, 0]])) == 1.0


@given(seed=st.integers(0, 2**16), b=st.integers(1, 4), t=st.integers(1, 6),
       s=st.integers(1, 7))
def test_alignment_score_against_a_loop(seed, b, t, s):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.softmax(torch.randn(b, t, s, generator=gen), -1)
    gold = torch.randint(0, s, (b, t), generator=gen)
    gold[torch.rand(b, t, generator=gen) < 0.3] = IGNORE_INDEX
    gold[0, 0] = 0
    hits = total = 0
    for i in range(b):
        for j in range(t):
            if gold[i, j] != IGNORE_INDEX:
                total += 1
                hits += int(max(range(s), key=lambda k: weights[i, j, k]) == gold[i, j])
    assert alignment_score(weights, gold) == pytest.approx(hits / total)


def test_the_alignment_score_of_uniform_attention_is_chance_level_at_most():
    weights = torch.full((2, 5, 4), 0.25)  # every peak falls on position 0 (argmax ties)
    gold = torch.tensor([[0, 1, 2, 3, 0], [1, 1, 2, 3, 0]])
    assert alignment_score(weights, gold) == pytest.approx(3 / 10)


@pytest.mark.parametrize("weights, gold, message", [
    (torch.rand(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), r"weights has shape \(2, 3, 4\) "
                                                               r"and alignment \(2, 4\)"),
    (torch.rand(2, 2, 3, 4), torch.zeros(2, 3, dtype=torch.long), "pick one layer and head"),
    (torch.rand(3, 4), torch.zeros(3), "alignment must hold integer source positions"),
    (torch.rand(3, 4), torch.full((3,), IGNORE_INDEX), "no scored position"),
    (torch.rand(3, 4), torch.tensor([0, 4, 1]), r"outside 0..3 \(weights has S=4"),
    ([[0.5, 0.5]], torch.tensor([0]), "weights must be a torch.Tensor"),
])
def test_bad_alignment_arguments(weights, gold, message):
    with pytest.raises((ValueError, TypeError), match=message):
        alignment_score(weights, gold)
