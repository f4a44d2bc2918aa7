"""The head view (course_lib.instruments.viz): static plots of one head or one layer, and the widget whose
sentence box and sliders redraw it. Plain ipywidgets and matplotlib, nothing fetched."""

from __future__ import annotations

import ipywidgets
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_lib.instruments.bert_app import load_pretrained_encoder  # noqa: E402
from course_lib.instruments.viz import head_view, head_view_widget, plot_head, plot_layer_heads  # noqa: E402


@pytest.fixture(scope="module")
def bert():
    return load_pretrained_encoder()


def toy_model(sentence: str):
    """A stand-in with 2 layers and 3 heads: one token per word, uniform attention."""
    tokens = sentence.split() or ["<empty>"]
    n = len(tokens)
    return [torch.full((1, 3, n, n), 1.0 / n), torch.eye(n).expand(1, 3, n, n)], tokens


def test_plot_head_puts_the_tokens_on_both_axes(bert):
    out = bert.encode("The cat sat.")
    ax = plot_head(out.attentions, out.tokens[0], layer=2, head=7)
    tokens = ["[CLS]", "the", "cat", "sat", ".", "[SEP]"]
    assert [t.get_text() for t in ax.get_xticklabels()] == tokens
    assert [t.get_text() for t in ax.get_yticklabels()] == tokens
    assert ax.get_title() == "layer 2, head 7"
    shown = torch.tensor(ax.images[0].get_array())
    torch.testing.assert_close(shown, out.attentions[2][0, 7])
    plt.close("all")


def test_plot_layer_heads_draws_every_head(bert):
    out = bert.encode("Attention is all you need.")
    fig = plot_layer_heads(out.attentions, out.tokens[0], layer=-1)
    drawn = [ax for ax in fig.axes if ax.images]
    assert len(drawn) == 12
    assert "layer 5" in fig._suptitle.get_text()
    plt.close("all")


def test_the_widget_redraws_for_each_layer_head_and_sentence(bert):
    widget = head_view_widget(bert, "The cat sat.", layer=1, head=2)
    text, layer, head, output = widget.children
    assert isinstance(text, ipywidgets.Text) and text.continuous_update is False
    assert (layer.min, layer.max, head.min, head.max) == (0, 5, 0, 11)
    assert isinstance(output, ipywidgets.Output)
    out = bert.encode("The cat sat.")
    torch.testing.assert_close(widget.result, out.attentions[1][0, 2])
    layer.value = 4
    torch.testing.assert_close(widget.result, out.attentions[4][0, 2])
    head.value = 9
    torch.testing.assert_close(widget.result, out.attentions[4][0, 9])
    text.value = "A longer sentence typed by the learner."
    other = bert.encode("A longer sentence typed by the learner.")
    assert widget.result.shape == (other.batch.lengths[0],) * 2
    torch.testing.assert_close(widget.result, other.attentions[4][0, 9])
    plt.close("all")


def test_the_widget_takes_a_plain_function():
    widget = head_view_widget(toy_model, "one two three", layer=1, head=0)
    torch.testing.assert_close(widget.result, torch.eye(3))
    widget.children[1].value = 0
    torch.testing.assert_close(widget.result, torch.full((3, 3), 1 / 3))
    assert widget.children[2].max == 2
    plt.close("all")


def test_head_view_without_a_front_end_draws_once():
    plt.close("all")
    head_view(toy_model, "a b c d", layer=0, head=1)  # not inside IPython: one static figure
    assert plt.get_fignums()
    plt.close("all")


def test_bad_input():
    attentions, tokens = toy_model("a b c")
    with pytest.raises(ValueError, match=r"head must be an integer in 0..2, got 3"):
        plot_head(attentions, tokens, layer=0, head=3)
    with pytest.raises(ValueError, match=r"layer must be an integer in 0..1, got 2"):
        plot_layer_heads(attentions, tokens, layer=2)
    with pytest.raises(ValueError, match=r"attentions\[0\] has shape \(3, 3\), expected"):
        plot_head([torch.eye(3)], tokens, layer=0, head=0)
    with pytest.raises(ValueError, match="attentions is empty"):
        plot_head([], tokens, layer=0, head=0)
    with pytest.raises(TypeError, match=r"model must have an .encode\(sentence\) method"):
        head_view_widget(42)
    with pytest.raises(TypeError, match="sentence must be a string, got int"):
        head_view_widget(toy_model, 7)


def test_layer_and_head_are_checked_at_the_boundary():
    for view in (head_view_widget, head_view):
        with pytest.raises(ValueError, match=r"layer must be an integer in 0..1, got 2"):
            view(toy_model, "a b c", layer=2)
        with pytest.raises(ValueError, match=r"head must be an integer in 0..2, got -4"):
            view(toy_model, "a b c", head=-4)
        with pytest.raises(TypeError, match=r"head must be an integer, got 1.0 \(float\)"):
            view(toy_model, "a b c", head=1.0)
    head_view(toy_model, "a b c", layer=np.int64(1), head=np.int64(0))  # numpy ints accepted
    plt.close("all")
    widget = head_view_widget(toy_model, "a b c", layer=-1, head=-1)  # from the end
    assert (widget.children[1].value, widget.children[2].value) == (1, 2)
    plt.close("all")


def test_a_wrong_type_of_layer_or_head_is_refused_before_the_model_runs():
    sentences = []

    def counting_model(sentence):
        sentences.append(sentence)
        return toy_model(sentence)

    for view in (head_view_widget, head_view):
        with pytest.raises(TypeError, match=r"layer must be an integer, got '0' \(str\)"):
            view(counting_model, "a b c", layer="0")
        with pytest.raises(TypeError, match=r"head must be an integer, got 1.0 \(float\)"):
            view(counting_model, "a b c", head=1.0)
    assert sentences == []  # the model never ran: the checks come first


def test_plot_layer_heads_refuses_zero_columns():
    attentions, tokens = toy_model("a b c")
    with pytest.raises(ValueError, match="columns must be an integer >= 1, got 0"):
        plot_layer_heads(attentions, tokens, layer=0, columns=0)  # was a ZeroDivisionError
    plt.close("all")


def test_a_batch_of_several_sequences_is_refused(bert):
    out = bert.encode(["The cat sat.", "A dog barked loudly."])
    with pytest.raises(ValueError, match=r"attentions\[0\] has shape \(2, 12, 7, 7\): a batch "
                                         r"of 2 sequences, but one sequence is drawn"):
        plot_head(out.attentions, out.tokens[0], layer=0, head=0)
    one = [a[1:2] for a in out.attentions]  # the second sentence alone
    ax = plot_head(one, out.tokens[1], layer=0, head=0)
    n = len(out.tokens[1])
    torch.testing.assert_close(torch.tensor(ax.images[0].get_array()),
                               out.attentions[0][1, 0, :n, :n])
    plt.close("all")
