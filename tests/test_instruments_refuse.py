"""Instruments never give a false all-clear: the divergence locator, the probes and the metrics
refuse (or flag) NaN / inf in what they read, and refuse to report when nothing was measured."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from course_lib.attention import MultiHeadAttention
from course_lib.divergence import first_divergence
from course_lib.metrics import alignment_score, sequence_accuracy, token_accuracy
from course_lib.models import Encoder, EncoderConfig
from course_lib.probes import (
    ablate_heads,
    future_leaks,
    head_role_scores,
    influence,
    layer_grad_norms,
    who_sees_whom,
)
from course_lib.tokenizer import IGNORE_INDEX

BAD = [float("nan"), float("inf")]

# -------------------------------------------------------------------- the divergence locator


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    model = Encoder(EncoderConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1, d_ff=32,
                                  max_len=16, dropout=0.0)).eval()
    ids = torch.randint(0, 50, (2, 6))
    return model, lambda m: m(ids)


def _with_bad_weight(model: nn.Module, value: float) -> nn.Module:
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.blocks[0].ff.fc1.weight[0, 0] = value
    return broken


@pytest.mark.parametrize("value", BAD)
def test_a_non_finite_candidate_is_the_first_divergence_not_agreement(encoder, value):
    model, run = encoder
    report = first_divergence(model, _with_bad_weight(model, value), run)
    assert not report.agree
    assert report.cause == "non_finite"
    assert report.divergence.candidate == "blocks.0.ff.fc1"
    assert "blocks.0.ff.fc1.weight" in report.divergence.hint


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("both", [False, True])
def test_a_non_finite_reference_is_refused_naming_the_module(encoder, value, both):
    model, run = encoder
    broken = _with_bad_weight(model, value)
    candidate = copy.deepcopy(broken) if both else model
    with pytest.raises(ValueError, match=r"reference's blocks\.0\.ff\.fc1 .*NaN or inf"):
        first_divergence(broken, candidate, run)


@pytest.mark.parametrize("value", BAD)
def test_a_non_finite_input_is_refused_naming_the_run_function(encoder, value):
    model, _ = encoder
    x = torch.randn(2, 6, 16)
    bad = x.clone()
    bad[1, 2, 3] = value
    with pytest.raises(ValueError, match=r"x \(the input that run_reference gives the reference"):
        first_divergence(model, copy.deepcopy(model), lambda m: m.blocks[0](bad))
    with pytest.raises(ValueError, match=r"x \(the input that run_candidate gives the candidate"):
        first_divergence(model, copy.deepcopy(model), lambda m: m.blocks[0](x),
                         lambda m: m.blocks[0](bad))


def test_a_run_function_that_never_calls_its_model_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match="nothing was compared: run_candidate never called"):
        first_divergence(model, copy.deepcopy(model), run, lambda m: None)
    with pytest.raises(ValueError, match="nothing was compared: run_reference never called"):
        first_divergence(copy.deepcopy(model), model, lambda m: run(model), run)  # not m


def test_no_pair_that_ran_in_both_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match="nothing was compared.*pairs="):
        first_divergence(model, copy.deepcopy(model), run, pairs={})
    with pytest.raises(ValueError, match="nothing was compared"):  # no submodules to hook
        first_divergence(nn.Linear(3, 3), nn.Linear(3, 3), lambda m: m(torch.ones(1, 3)))


def test_an_attention_mask_that_fits_nothing_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 9\).*\(2, 6\)"):
        first_divergence(model, copy.deepcopy(model), run,
                         attention_mask=torch.ones(3, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention_mask .*no True entry"):
        first_divergence(model, copy.deepcopy(model), run,
                         attention_mask=torch.zeros(2, 6, dtype=torch.bool))
    keep = torch.ones(2, 6, dtype=torch.bool)
    assert first_divergence(model, copy.deepcopy(model), run, attention_mask=keep).agree


# ---------------------------------------------------------------------------------- probes

SENTENCE = ["[CLS]", "the", "cat", "sat", "[SEP]"]


def _weights(n_layers: int = 2, n_heads: int = 3, t: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.softmax(torch.randn(n_layers, 1, n_heads, t, t, generator=gen), -1)


@pytest.mark.parametrize("value", BAD)
def test_a_non_finite_head_is_refused_naming_layer_and_head(value):
    weights = _weights()
    weights[1, 0, 2, 3, 1] = value
    with pytest.raises(ValueError, match="attentions holds NaN or inf for layer 1, head 2"):
        head_role_scores(weights, [SENTENCE])


def test_junk_in_padding_is_not_refused():
    weights = _weights(t=7)
    weights[..., 5:, :] = float("nan")  # padded queries
    weights[..., :, 5:] = float("nan")  # padded keys
    assert head_role_scores(weights, [SENTENCE]).n_queries["previous token"] == 3


def test_top_never_ranks_nan():
    roles = head_role_scores(_weights(), [SENTENCE])  # no repeated word: 'same word' is NaN
    assert roles.n_queries["same word"] == 0
    with pytest.raises(ValueError, match="'same word' hold NaN"):
        roles.top("same word")
    assert all(score == score for _, _, score in roles.top("previous token", k=6))


@pytest.mark.parametrize("weights, tokens", [
    (_weights(t=2), [["[CLS]", "[SEP]"]]),  # no word token
    (_weights()[:0], [SENTENCE]),  # no layer
    (_weights()[:, :, :0], [SENTENCE]),  # no head
])
def test_head_roles_with_nothing_to_score_are_refused(weights, tokens):
    with pytest.raises(ValueError, match="nothing to score"):
        head_role_scores(weights, tokens)


PROBES = [influence, who_sees_whom, future_leaks]


@pytest.mark.parametrize("probe", PROBES)
def test_probes_refuse_an_output_without_values(probe):
    with pytest.raises(ValueError, match=r"fn returned shape \(1, 4, 0\)"):
        probe(lambda x: x[..., :0], torch.randn(1, 4, 3))


@pytest.mark.parametrize("probe", PROBES)
@pytest.mark.parametrize("value", BAD)
def test_probes_refuse_non_finite_inputs_and_outputs(probe, value):
    x = torch.randn(1, 4, 3)
    bad = x.clone()
    bad[0, 1, 2] = value
    with pytest.raises(ValueError, match="x contains 1 NaN or inf"):
        probe(lambda x: x.cumsum(1), bad)
    with pytest.raises(ValueError, match="fn's output contains NaN or inf"):
        probe(lambda x: x.cumsum(1) * value, x)


def test_an_ablation_block_that_never_runs_the_layer_is_refused():
    torch.manual_seed(0)
    layer, other = MultiHeadAttention(8, 2).eval(), MultiHeadAttention(8, 2).eval()
    with pytest.raises(ValueError, match="never ran attention"):
        with ablate_heads(layer, 0):
            other(torch.randn(1, 3, 8))  # another layer: nothing was ablated
    assert not layer.out_proj._forward_pre_hooks
    with ablate_heads(layer, 0):
        layer(torch.randn(1, 3, 8))  # the layer itself: fine


def _stack_after_backward(scale: float | None) -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
    if scale is not None:
        (layers[1](layers[0](torch.ones(1, 3))).sum() * scale).backward()
    return layers


@pytest.mark.parametrize("value", BAD)
def test_layer_grad_norms_refuses_non_finite_gradients(value):
    layers = _stack_after_backward(1.0)
    layers[1].bias.grad[0] = value
    with pytest.raises(ValueError, match=r"layers\[1\]\.bias\.grad contains"):
        layer_grad_norms(layers)


def test_layer_grad_norms_refuses_when_nothing_was_measured():
    with pytest.raises(ValueError, match="call loss.backward"):
        layer_grad_norms(_stack_after_backward(None))
    with pytest.raises(ValueError, match="layers is empty"):
        layer_grad_norms([])
    assert torch.isfinite(layer_grad_norms(_stack_after_backward(1.0))).all()


# --------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("value", BAD)
def test_alignment_score_refuses_non_finite_weights(value):
    weights = torch.softmax(torch.randn(1, 6, 6), -1)
    weights[0, 2, 4] = value
    with pytest.raises(ValueError, match="weights contains 1 NaN or inf"):
        alignment_score(weights, torch.arange(6)[None])


@pytest.mark.parametrize("metric", [token_accuracy, sequence_accuracy])
@pytest.mark.parametrize("shape", [(2, 3), (0, 3), (2, 0)])
def test_accuracies_refuse_when_nothing_is_scored(metric, shape):
    predictions = torch.zeros(shape, dtype=torch.long)
    with pytest.raises(ValueError, match="targets .* has no scored position"):
        metric(predictions, torch.full(shape, IGNORE_INDEX))


@pytest.mark.parametrize("metric", [token_accuracy, sequence_accuracy])
def test_accuracies_refuse_float_predictions(metric):
    with pytest.raises(ValueError, match="predictions must hold predicted token ids"):
        metric(torch.tensor([[float("nan"), 1.0]]), torch.tensor([[1, 1]]))


def test_sequence_accuracy_leaves_out_sequences_with_nothing_scored():
    targets = torch.tensor([[1, 2], [IGNORE_INDEX, IGNORE_INDEX]])
    assert sequence_accuracy(torch.tensor([[0, 0], [0, 0]]), targets) == 0.0
    assert sequence_accuracy(torch.tensor([[1, 2], [0, 0]]), targets) == 1.0
    with pytest.raises(ValueError, match="targets should have shape"):
        sequence_accuracy(torch.tensor([1]), torch.tensor([1]))
