"""The first-divergence locator against a reference nobody here wrote: Hugging Face's BertModel
(the bundled all-MiniLM-L6-v2, and a small random BERT with other settings). Every injected
mistake must be found at the right module and named correctly; a correct port must agree
everywhere; bad arguments get clear messages."""

from __future__ import annotations

import copy
import itertools
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

from course_lib.instruments.bert_app import default_model_dir, load_pretrained_encoder  # noqa: E402
from course_lib.instruments.divergence import (  # noqa: E402
    MISTAKES,
    first_divergence,
    inject_mistake,
    record_calls,
)
from course_lib.models import Encoder, EncoderConfig  # noqa: E402
from course_lib.pretrained import bert_module_pairs, config_from_bert, load_bert_weights  # noqa: E402

SENTENCES = ["The cat sat on the mat.", "Hi!",
             "Attention lets every token look at every other token, however far apart."]

# where each mistake first shows up, in our names (with Hugging Face as the reference)
FIRST_SEEN = {
    "layer_norm_eps": "embeddings.norm",
    "activation": "blocks.0.ff.fc2",
    "norm_order": "blocks.0.self_attn.out_proj",
    "token_types": "embeddings.norm",
    "qkv_layout": "blocks.0.self_attn.out_proj",
    "transposed_weight": "blocks.0.self_attn.out_proj",
}


@pytest.fixture(scope="module")
def bert():
    return load_pretrained_encoder()


@pytest.fixture(scope="module")
def hf_bert():
    return transformers.BertModel.from_pretrained(
        str(default_model_dir()), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def batch(bert):
    return bert.tokenize(SENTENCES)


def _runners(batch):
    def run_hf(model):
        return model(input_ids=batch.ids, attention_mask=batch.attention_mask.long(),
                     token_type_ids=batch.token_type_ids)

    def run_ours(model):
        return model(batch.ids, attention_mask=batch.attention_mask,
                     token_type_ids=batch.token_type_ids)

    return run_hf, run_ours


def test_a_correct_port_agrees_with_hf_everywhere(bert, hf_bert, batch):
    run_hf, run_ours = _runners(batch)
    pairs = bert_module_pairs(6)
    report = first_divergence(hf_bert, bert.model, run_hf, run_ours, pairs=pairs,
                              attention_mask=batch.attention_mask)
    assert report.agree and report.cause is None
    assert [c for c, _, _ in report.compared] == list(pairs)  # every pair, in running order
    assert max(d for _, _, d in report.compared) < 1e-4
    assert "agree" in str(report)
    assert report.unmatched == []


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_injected_mistake_is_named_against_hf(mistake, bert, hf_bert, batch):
    run_hf, run_ours = _runners(batch)
    broken = inject_mistake(bert.model, mistake)
    report = first_divergence(hf_bert, broken, run_hf, run_ours, pairs=bert_module_pairs(6),
                              attention_mask=batch.attention_mask)
    assert not report.agree
    assert report.cause == mistake, str(report)
    expected = FIRST_SEEN[mistake]
    assert report.divergence.candidate in ((expected,) if isinstance(expected, str) else expected)
    assert report.divergence.difference > report.divergence.tolerance
    assert f"[{mistake}]" in str(report)


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_injected_mistake_is_named_against_our_correct_model(mistake, bert, batch):
    _, run_ours = _runners(batch)
    broken = inject_mistake(bert.model, mistake)
    report = first_divergence(bert.model, broken, run_ours, attention_mask=batch.attention_mask)
    assert report.cause == mistake, str(report)


def test_a_weight_loaded_wrongly_is_called_a_weight_problem(bert, hf_bert, batch):
    run_hf, run_ours = _runners(batch)
    broken = inject_mistake(bert.model, "layer_norm_eps")  # then undo: only the weight differs
    for module in broken.modules():
        if isinstance(module, nn.LayerNorm):
            module.eps = 1e-12
    with torch.no_grad():
        broken.blocks[2].ff.fc1.weight[0, :5] += 0.5
    report = first_divergence(hf_bert, broken, run_hf, run_ours, pairs=bert_module_pairs(6),
                              attention_mask=batch.attention_mask)
    assert report.divergence.candidate == "blocks.2.ff.fc1"
    assert report.divergence.input_agreed is True
    assert report.cause == "weights"


@pytest.fixture(scope="module")
def tiny_bert():
    """A random BERT with other sizes, the tanh GELU and eps 1e-7: ours loads its weights."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=32, hidden_act="gelu_new",
        layer_norm_eps=1e-7, attn_implementation="eager")
    reference = transformers.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ours = Encoder(config_from_bert(config.to_dict())).eval()
    load_bert_weights(ours, reference.state_dict())
    ids = torch.randint(0, 99, (3, 9))
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1, 6:] = False
    return reference, ours, ids, keep


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistakes_are_named_on_another_bert(mistake, tiny_bert):
    reference, ours, ids, keep = tiny_bert

    def run_hf(model):
        return model(input_ids=ids, attention_mask=keep.long())

    def run_ours(model):
        return model(ids, attention_mask=keep)

    pairs = bert_module_pairs(2)
    assert first_divergence(reference, ours, run_hf, run_ours, pairs=pairs,
                            attention_mask=keep).agree
    broken = inject_mistake(ours, mistake)
    report = first_divergence(reference, broken, run_hf, run_ours, pairs=pairs,
                              attention_mask=keep)
    assert report.cause == mistake, str(report)


@pytest.fixture(scope="module")
def loud_encoder():
    """A 2-layer encoder whose embeddings are 20 times larger than usual: every LayerNorm
    input has a large variance, so an eps of 1e-5 instead of 1e-12 changes nothing visible."""
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=2, d_ff=32,
                           max_len=16, activation="gelu", norm_first=False,
                           layer_norm_eps=1e-12, type_vocab_size=2, embed_norm=True)
    model = Encoder(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("embeddings.") and "norm" not in name:
                p.mul_(20.0)
    ids = torch.randint(0, 50, (2, 7))
    return model, lambda m: m(ids)


@pytest.mark.parametrize("second", ["qkv_layout", "transposed_weight", "norm_order",
                                    "token_types"])
def test_a_wrong_eps_is_not_blamed_for_another_mistake(second, loud_encoder):
    model, run = loud_encoder
    wrong_eps = inject_mistake(model, "layer_norm_eps")
    assert first_divergence(model, wrong_eps, run).agree  # invisible here
    report = first_divergence(model, inject_mistake(wrong_eps, second), run)
    assert report.cause == second, str(report)
    alone = first_divergence(model, inject_mistake(model, second), run)
    assert report.divergence.candidate == alone.divergence.candidate


@pytest.mark.parametrize("pair", list(itertools.combinations(MISTAKES, 2)),
                         ids="+".join)
def test_of_two_mistakes_the_one_that_shows_first_is_named(pair, bert, batch):
    _, run_ours = _runners(batch)
    alone = {m: first_divergence(bert.model, inject_mistake(bert.model, m), run_ours,
                                 attention_mask=batch.attention_mask) for m in pair}
    broken = inject_mistake(inject_mistake(bert.model, pair[0]), pair[1])
    report = first_divergence(bert.model, broken, run_ours, attention_mask=batch.attention_mask)
    steps = {m: len(r.compared) for m, r in alone.items()}  # where each one shows alone
    earliest = [m for m in pair if steps[m] == min(steps.values())]
    assert report.cause in earliest, str(report)  # both, when they show at the same module
    assert report.divergence.candidate == alone[report.cause].divergence.candidate


def test_a_model_in_training_mode_is_rejected(bert, batch):
    _, run_ours = _runners(batch)
    training = copy.deepcopy(bert.model).train()
    with pytest.raises(ValueError, match=r"^candidate \(Encoder\) .*training mode.*"
                                         r"embeddings\.dropout(.|\n)*candidate\.eval\(\)"):
        first_divergence(bert.model, training, run_ours)
    with pytest.raises(ValueError, match=r"^reference \(Encoder\) .*training mode"):
        first_divergence(training, bert.model, run_ours)
    no_dropout = Encoder(EncoderConfig(vocab_size=10, d_model=8, n_heads=2, n_layers=1,
                                       d_ff=16, max_len=8, dropout=0.0)).train()
    ids = torch.randint(0, 10, (1, 5))
    assert first_divergence(no_dropout, copy.deepcopy(no_dropout), lambda m: m(ids)).agree


def test_padded_positions_are_not_compared():
    class Layer(nn.Module):
        def __init__(self, junk: float):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.junk = junk

        def forward(self, x, keep):
            return self.linear(x).masked_fill(~keep[..., None], self.junk)

    torch.manual_seed(0)
    reference = nn.Sequential()
    reference.add_module("layer", Layer(0.0))
    candidate = nn.Sequential()
    candidate.add_module("layer", Layer(123.0))
    candidate.layer.linear.load_state_dict(reference.layer.linear.state_dict())
    x, keep = torch.randn(2, 5, 4), torch.tensor([[True] * 5, [True, True, False, False, False]])

    def run(model):
        return model.layer(x, keep)

    assert first_divergence(reference, candidate, run, attention_mask=keep).agree
    report = first_divergence(reference, candidate, run)
    assert report.divergence.candidate == "layer"
    assert report.divergence.difference == pytest.approx(123.0, abs=5.0)


def test_record_calls_lists_inner_modules_before_outer_ones(bert, batch):
    _, run_ours = _runners(batch)
    with record_calls(bert.model) as calls:
        run_ours(bert.model)
    order = sorted(calls, key=lambda n: calls[n].order)
    assert order.index("blocks.0.ff.fc1") < order.index("blocks.0.ff") < order.index("blocks.0")
    assert order.index("blocks.0") < order.index("blocks.1.self_attn.qkv_proj")
    assert calls["blocks.0"].input.shape == (3, batch.ids.shape[1], 384)
    # the hooks are gone afterwards
    assert all(not m._forward_hooks for m in bert.model.modules())
    with record_calls(bert.model, {"blocks.1.ff"}) as calls:
        run_ours(bert.model)
    assert list(calls) == ["blocks.1.ff"]


def test_record_calls_rejects_bad_arguments(bert):
    with pytest.raises(TypeError, match=r"^model .*nn\.Module.*str"):
        with record_calls("bert"):
            pass
    with pytest.raises(TypeError, match=r"^names .*set of submodule names"):
        with record_calls(bert.model, "blocks.0"):
            pass
    with pytest.raises(ValueError, match=r"^names .*Encoder does not have.*"
                                         r"\['blocks\.9'\]"):
        with record_calls(bert.model, {"blocks.9", "blocks.0"}):
            pass


def test_inject_mistake_leaves_the_model_alone(bert):
    before = {k: v.clone() for k, v in bert.model.state_dict().items()}
    for mistake in MISTAKES:
        broken = inject_mistake(bert.model, mistake)
        assert broken is not bert.model
    after = bert.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert bert.model.embeddings.norm.eps == 1e-12
    assert bert.model.blocks[0].norm_first is False
    assert bert.model.embeddings.token_type is not None


def test_bad_arguments(bert, hf_bert, batch):
    _, run_ours = _runners(batch)
    with pytest.raises(TypeError, match=r"^candidate .*nn\.Module.*str"):
        first_divergence(bert.model, "model", run_ours)
    with pytest.raises(TypeError, match=r"^run_reference .*function"):
        first_divergence(bert.model, bert.model, batch)
    with pytest.raises(ValueError, match=r"^pairs .*reference modules.*"
                                         r"\['encoder\.layer\.9'\]"):
        first_divergence(hf_bert, bert.model, run_ours, pairs={"blocks.0": "encoder.layer.9"})
    with pytest.raises(TypeError, match=r"^pairs .*dict"):
        first_divergence(bert.model, bert.model, run_ours, pairs=[("a", "b")])
    with pytest.raises(ValueError, match=r"^attention_mask .*bool"):
        first_divergence(bert.model, bert.model, run_ours,
                         attention_mask=batch.attention_mask.long())
    with pytest.raises(ValueError, match=r"^attention_mask should have shape \(B, T\)"):
        first_divergence(bert.model, bert.model, run_ours,
                         attention_mask=batch.attention_mask[0])
    with pytest.raises(ValueError, match=r"^atol .*>= 0.*-1"):
        first_divergence(bert.model, bert.model, run_ours, atol=-1)
    with pytest.raises(ValueError, match=r"^mistake .*one of 'layer_norm_eps'"):
        inject_mistake(bert.model, "eps")
    with pytest.raises(TypeError, match=r"^model .*nn\.Module.*str"):
        inject_mistake("bert", "activation")
    no_segments = inject_mistake(bert.model, "token_types")
    with pytest.raises(ValueError, match=r"token_types.*does not apply.*no token-type"):
        inject_mistake(no_segments, "token_types")


def test_bert_module_pairs_name_real_modules(hf_bert, bert):
    pairs = bert_module_pairs(6)
    ours, theirs = dict(bert.model.named_modules()), dict(hf_bert.named_modules())
    assert set(pairs) <= set(ours) and set(pairs.values()) <= set(theirs)
    assert "embeddings.token_type" not in bert_module_pairs(6, token_types=False)
    with pytest.raises(ValueError, match=r"^n_layers .*>= 1.*0"):
        bert_module_pairs(0)


# --------------------------------------------------------------------------------------------
# Property: on random small BERT-like encoders, every mistake that changes the output is found
# and named (never misnamed)


@settings(max_examples=8, deadline=None)
@given(
    d_head=st.sampled_from([4, 8]),
    n_heads=st.integers(1, 4),
    n_layers=st.integers(1, 3),
    seq_len=st.integers(2, 9),
    seed=st.integers(0, 10_000),
)
def test_every_mistake_is_named_on_random_encoders(d_head, n_heads, n_layers, seq_len, seed):
    torch.manual_seed(seed)
    config = EncoderConfig(vocab_size=50, d_model=d_head * n_heads, n_heads=n_heads,
                           n_layers=n_layers, d_ff=3 * d_head * n_heads, max_len=16,
                           activation="gelu", norm_first=False, layer_norm_eps=1e-12,
                           type_vocab_size=2, embed_norm=True)
    model = Encoder(config).eval()
    with torch.no_grad():  # sizes as in a trained BERT: small embeddings, larger weights
        for name, p in model.named_parameters():
            scale = 0.05 if name.startswith("embeddings.") and "norm" not in name else 0.3
            p.copy_(scale * torch.randn_like(p) + (1.0 if name.endswith("norm.weight") else 0))
    ids = torch.randint(0, 50, (2, seq_len))
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[1, seq_len // 2 + 1:] = False

    def run(m):
        return m(ids, attention_mask=keep)

    assert first_divergence(model, copy.deepcopy(model), run, attention_mask=keep).agree
    for mistake in MISTAKES:
        broken = inject_mistake(model, mistake)
        report = first_divergence(model, broken, run, attention_mask=keep)
        if report.agree:  # too small to see at this size (an eps or a GELU form can be):
            # then the final outputs agree too, and the big mistakes are always seen
            assert mistake in ("layer_norm_eps", "activation"), str(report)
            with torch.no_grad():
                gap = (run(broken).last_hidden_state - run(model).last_hidden_state)[keep]
            assert float(gap.abs().max()) < 1e-3
        else:
            assert report.cause == mistake, f"{mistake}: {report}"


# --------------------------------------------------------------------------------------------
# Never a false all-clear: NaN / inf and runs that compare nothing are refused

BAD = [float("nan"), float("inf")]


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
    with pytest.raises(ValueError, match=r"^x \(the input that run_reference gives the reference"):
        first_divergence(model, copy.deepcopy(model), lambda m: m.blocks[0](bad))
    with pytest.raises(ValueError, match=r"^x \(the input that run_candidate gives the candidate"):
        first_divergence(model, copy.deepcopy(model), lambda m: m.blocks[0](x),
                         lambda m: m.blocks[0](bad))


def test_a_run_function_that_never_calls_its_model_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match=r"nothing was compared: run_candidate never called"):
        first_divergence(model, copy.deepcopy(model), run, lambda m: None)
    with pytest.raises(ValueError, match=r"nothing was compared: run_reference never called"):
        first_divergence(copy.deepcopy(model), model, lambda m: run(model), run)  # not m


def test_no_pair_that_ran_in_both_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match=r"nothing was compared.*pairs="):
        first_divergence(model, copy.deepcopy(model), run, pairs={})
    with pytest.raises(ValueError, match=r"nothing was compared"):  # no submodules to hook
        first_divergence(nn.Linear(3, 3), nn.Linear(3, 3), lambda m: m(torch.ones(1, 3)))


def test_an_attention_mask_that_fits_nothing_is_refused(encoder):
    model, run = encoder
    with pytest.raises(ValueError, match=r"^attention_mask has shape \(3, 9\).*\(2, 6\)"):
        first_divergence(model, copy.deepcopy(model), run,
                         attention_mask=torch.ones(3, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^attention_mask .*no True entry"):
        first_divergence(model, copy.deepcopy(model), run,
                         attention_mask=torch.zeros(2, 6, dtype=torch.bool))
    keep = torch.ones(2, 6, dtype=torch.bool)
    assert first_divergence(model, copy.deepcopy(model), run, attention_mask=keep).agree
