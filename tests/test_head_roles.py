"""course_lib.probes.head_role_scores: what a head does, measured over many sentences. Checked
on attention maps whose roles are known by construction, against a plain loop over the real
model's maps, with a property test (an even spread scores its own baseline), and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.pretrained import load_pretrained_encoder
from course_lib.probes import HEAD_ROLES, head_role_scores

SENTENCE = ["[CLS]", "the", "cat", "saw", "the", "cat", ",", "a", "dog", ",", "[SEP]"]


def built_heads(tokens: list[str]) -> torch.Tensor:
    """(1, 6, n, n): heads that do one thing each, for one sentence."""
    n = len(tokens)
    w = torch.zeros(6, n, n)
    for i in range(n):
        w[0, i, max(i - 1, 0)] = 1.0  # previous token
        w[1, i, min(i + 1, n - 1)] = 1.0  # next token
        w[2, i, 0] = 1.0  # [CLS]
        w[3, i, n - 1] = 1.0  # [SEP]
        w[4, i, 1:n - 1] = 1.0 / (n - 2)  # even over the words
        same = [j for j in range(1, n - 1) if j != i and tokens[j] == tokens[i]]
        w[5, i, same or [i]] = 1.0 / max(len(same), 1)  # the same word, else itself
    return w[None]


def test_heads_built_for_one_role_score_1_on_it():
    roles = head_role_scores([built_heads(SENTENCE)], [SENTENCE])
    assert roles.n_queries["previous token"] == len(SENTENCE) - 2
    expected_best = {"previous token": 0, "next token": 1, "[CLS]": 2, "[SEP]": 3,
                     "same word": 5}
    for role, head in expected_best.items():
        assert roles.scores[role].shape == (1, 6)
        assert roles.scores[role][0, head] == pytest.approx(1.0)
        assert roles.top(role, k=1) == [(0, head, pytest.approx(1.0))]
    # "cat" repeats; "the" is a stop word and "," punctuation: not counted
    assert roles.repeated == ["cat"] and roles.n_queries["same word"] == 2
    # an even spread over the words scores exactly the baseline of the word roles
    for role in ("previous token", "next token", "same word"):
        assert roles.scores[role][0, 4] == pytest.approx(roles.baseline[role])
    assert roles.baseline["same word"] == pytest.approx(1 / 9)  # one other "cat" of 9 words
    assert roles.baseline["[CLS]"] == pytest.approx(1 / len(SENTENCE))


def test_stop_words_and_word_pieces_are_chosen_by_the_caller():
    tokens = ["[CLS]", "the", "play", "##s", "the", "play", "##s", "[SEP]"]
    roles = head_role_scores([built_heads(tokens)], [tokens])
    assert roles.repeated == ["play"]  # "##s" is a word piece, "the" a stop word
    roles = head_role_scores([built_heads(tokens)], [tokens], stop_words=())
    assert roles.repeated == ["play", "the"]


def test_no_repeated_word_gives_nan_not_a_number_to_read():
    tokens = ["[CLS]", "one", "two", "[SEP]"]
    roles = head_role_scores([built_heads(tokens)], [tokens])
    assert roles.n_queries["same word"] == 0
    assert torch.isnan(roles.scores["same word"]).all()


def test_padding_is_never_read():
    a = ["[CLS]", "the", "cat", "sat", "on", "the", "mat", "[SEP]"]
    b = ["[CLS]", "hi", "[SEP]"]
    padded = torch.full((2, 6, 8, 8), 123.0)  # junk everywhere ...
    padded[0] = built_heads(a)[0]
    padded[1, :, :3, :3] = built_heads(b)[0]  # ... except the real tokens
    together = head_role_scores([padded, padded], [a, b])
    alone_a = head_role_scores([built_heads(a)] * 2, [a])
    alone_b = head_role_scores([built_heads(b)] * 2, [b])
    n_a, n_b = len(a) - 2, len(b) - 2
    for role in ("previous token", "[SEP]"):
        mixed = (alone_a.scores[role] * n_a + alone_b.scores[role] * n_b) / (n_a + n_b)
        torch.testing.assert_close(together.scores[role], mixed)
        assert together.scores[role].shape == (2, 6)


@pytest.fixture(scope="module")
def probed():
    bert = load_pretrained_encoder()
    return bert.encode(["The cat chased the mouse around the kitchen.",
                        "The oven cooked the bread so quickly that the bread burned.",
                        "Zuko made his uncle tea."])


def test_matches_a_plain_loop_on_the_real_model(probed):
    roles = head_role_scores(probed.attentions, probed.tokens)
    L, H = len(probed.attentions), probed.attentions[0].shape[1]
    previous = torch.zeros(L, H, dtype=torch.float64)
    cls = torch.zeros(L, H, dtype=torch.float64)
    count = 0
    for b, tokens in enumerate(probed.tokens):
        for i in range(1, len(tokens) - 1):
            for layer in range(L):
                for head in range(H):
                    row = probed.attentions[layer][b, head, i].double()
                    previous[layer, head] += row[i - 1]
                    cls[layer, head] += row[0]
            count += 1
    torch.testing.assert_close(roles.scores["previous token"], (previous / count).float())
    torch.testing.assert_close(roles.scores["[CLS]"], (cls / count).float())
    assert roles.repeated == ["bread"]
    # all-MiniLM-L6-v2's layer 0, head 2 looks at the previous token
    layer, head, score = roles.top("previous token", k=1)[0]
    assert (layer, head) == (0, 2) and score > 0.9
    stacked = head_role_scores(torch.stack(list(probed.attentions)), probed.tokens)
    torch.testing.assert_close(stacked.scores["same word"], roles.scores["same word"])


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(3, 9), min_size=1, max_size=4),
       n_heads=st.integers(1, 3), seed=st.integers(0, 1000))
def test_scores_are_weights_and_an_even_spread_scores_the_baseline(lengths, n_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    words = ["cat", "dog", "the", "cat", "sun", "dog", "ran", "."]
    tokens = [["[CLS]", *[words[int(j)] for j in torch.randint(0, 8, (n - 2,), generator=gen)],
               "[SEP]"] for n in lengths]
    t = max(lengths)
    random = torch.softmax(torch.randn(len(lengths), n_heads, t, t, generator=gen), dim=-1)
    roles = head_role_scores([random], tokens)
    for role in HEAD_ROLES:
        if roles.n_queries[role]:
            assert ((roles.scores[role] >= 0) & (roles.scores[role] <= 1 + 1e-6)).all()
    even_words = torch.zeros(len(lengths), 1, t, t)
    even_all = torch.zeros(len(lengths), 1, t, t)
    for b, n in enumerate(lengths):
        even_words[b, :, :n, 1:n - 1] = 1.0 / (n - 2)
        even_all[b, :, :n, :n] = 1.0 / n
    by_words = head_role_scores([even_words], tokens)
    by_all = head_role_scores([even_all], tokens)
    for role in HEAD_ROLES:
        if roles.n_queries[role]:
            even = by_all if role in ("[CLS]", "[SEP]") else by_words
            assert float(even.scores[role]) == pytest.approx(roles.baseline[role], abs=1e-6)


def test_bad_input():
    w = built_heads(SENTENCE)
    with pytest.raises(ValueError, match=r"expected B = 1 sequences of at most T = 11 tokens"):
        head_role_scores([w], [SENTENCE, SENTENCE])
    with pytest.raises(ValueError, match=r"expected B = 1 sequences of at most T = 11"):
        head_role_scores([w], [SENTENCE + ["extra"]])
    with pytest.raises(TypeError, match="tokens must be a list of B token lists"):
        head_role_scores([w], "the cat")
    with pytest.raises(ValueError, match=r"L tensors of one shape \(B, H, T, T\)"):
        head_role_scores([w, w[:, :2]], [SENTENCE])
    with pytest.raises(ValueError, match=r"L tensors of one shape \(B, H, T, T\)"):
        head_role_scores([w[0]], [SENTENCE])
    with pytest.raises(ValueError, match=r"attentions should have shape \(L, B, H, T, T\)"):
        head_role_scores(w, [SENTENCE])
    with pytest.raises(TypeError, match="attentions must be a non-empty list"):
        head_role_scores([], [SENTENCE])
    with pytest.raises(ValueError, match="float weights"):
        head_role_scores([w.long()], [SENTENCE])
    with pytest.raises(TypeError, match="stop_words must be a collection of words"):
        head_role_scores([w], [SENTENCE], stop_words="the")
    roles = head_role_scores([w], [SENTENCE])
    with pytest.raises(ValueError, match="role must be one of 'previous token'"):
        roles.top("first token")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        roles.top("[CLS]", k=0)
