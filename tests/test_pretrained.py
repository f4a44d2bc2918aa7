"""course_lib.pretrained: our encoder with BERT's weights against Hugging Face's BertModel built
from the same weights (hidden states and attention maps), loaded offline from the same local
folder, also for a second, randomly initialised BERT of other sizes saved by transformers
itself; mean_pool (against sentence-transformers' pooling), config_from_bert, the weight map
and load_bert_weights with their error messages."""

from __future__ import annotations

import json
import os
import re

# Nothing may be downloaded: both libraries must read the local folder only.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from bert_helpers import LONG, SENTENCES, copy_folder, save_tiny_bert  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from course_lib.configs import DecoderConfig  # noqa: E402
from course_lib.course.bert_app import (  # noqa: E402
    PretrainedEncoder,
    default_model_dir,
    load_pretrained_encoder,
)
from course_lib.models import DecoderLM, Encoder  # noqa: E402
from course_lib.pretrained import (  # noqa: E402
    bert_weight_map,
    config_from_bert,
    load_bert_weights,
    mean_pool,
)

ATOL = 1e-4



@pytest.fixture(scope="module")
def folder():
    return default_model_dir()


@pytest.fixture(scope="module")
def bert(folder) -> PretrainedEncoder:
    return load_pretrained_encoder(folder)


@pytest.fixture(scope="module")
def hf_bert(folder):
    # eager attention, so the attention probabilities are returned
    model = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager")
    return model.eval()


def _hf_outputs(model, batch):
    with torch.no_grad():
        return model(
            input_ids=batch.ids,
            attention_mask=batch.attention_mask.long(),
            token_type_ids=batch.token_type_ids,
            output_attentions=True,
            output_hidden_states=True,
        )


def _compare_with_hf(ours, ref, keep: torch.Tensor) -> None:
    """Hidden states at real tokens and attention rows of real queries agree to ATOL; padded
    keys get exactly zero weight in ours."""
    assert len(ours.hidden_states) == len(ref.hidden_states)
    assert len(ours.attentions) == len(ref.attentions)
    torch.testing.assert_close(
        ours.last_hidden_state[keep], ref.last_hidden_state[keep], atol=ATOL, rtol=0
    )
    for layer, (h, h_ref) in enumerate(zip(ours.hidden_states, ref.hidden_states, strict=True)):
        torch.testing.assert_close(h[keep], h_ref[keep], atol=ATOL, rtol=0, msg=f"layer {layer}")
    for layer, (w, w_ref) in enumerate(zip(ours.attentions, ref.attentions, strict=True)):
        assert w.shape == w_ref.shape
        rows = keep[:, None, :, None].expand_as(w)  # (B, H, T, T), real queries
        padded_keys = ~keep[:, None, None, :].expand_as(w)
        torch.testing.assert_close(w[rows], w_ref[rows], atol=ATOL, rtol=0, msg=f"layer {layer}")
        assert torch.all(w[padded_keys] == 0), f"layer {layer}: a padded key got weight"


# --------------------------------------------------------------------------------------------
# The bundled all-MiniLM-L6-v2


def test_matches_hf_bert_on_a_padded_batch(bert, hf_bert):
    out = bert.encode(SENTENCES)
    keep = out.batch.attention_mask
    assert not keep.all(), "the batch should contain padding"
    assert out.attentions[0].shape == (len(SENTENCES), 12, keep.shape[1], keep.shape[1])
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), keep)


def test_matches_hf_bert_one_at_a_time_and_on_pairs(bert, hf_bert):
    for sentence in SENTENCES[:2]:
        out = bert.encode(sentence)
        assert out.batch.attention_mask.all()
        _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), out.batch.attention_mask)
    # sentence pairs use token type 1 for the second part
    out = bert.encode(SENTENCES[:2], text_pair=["It was tired.", "So is the reader."])
    assert out.batch.token_type_ids.max() == 1
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), out.batch.attention_mask)


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])  # (1, 3, 2)
    keep = torch.tensor([[True, True, False]])
    torch.testing.assert_close(mean_pool(hidden, keep), torch.tensor([[2.0, 3.0]]))
    with pytest.raises(ValueError, match=r"^attention_mask has shape \(1, 2\).*\(1, 3\)"):
        mean_pool(hidden, keep[:, :2])


def test_mean_pool_takes_a_0_1_integer_mask_like_the_models():
    hidden = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(mean_pool(hidden, mask), mean_pool(hidden, mask.bool()))


HIDDEN = torch.randn(2, 3, 4)


@pytest.mark.parametrize(("hidden", "mask", "error", "match"), [
    (HIDDEN, torch.ones(2, 4, dtype=torch.bool), ValueError,
     r"^attention_mask has shape \(2, 4\).*\(B, T\) = \(2, 3\)"),
    (HIDDEN, torch.ones(2, 3, 1, dtype=torch.bool), ValueError,
     r"^attention_mask has shape \(2, 3, 1\).*\(2, 3\)"),
    (HIDDEN, torch.ones(2, 3), ValueError,  # a 0/1 integer mask is accepted, a float one is not
     r"^attention_mask .*bool.*float32.*\.bool\(\)"),
    (HIDDEN, [[1, 1, 1], [1, 1, 0]], TypeError, r"^attention_mask .*torch\.Tensor.*list"),
    (HIDDEN.long(), torch.ones(2, 3, dtype=torch.bool), ValueError,
     r"^hidden .*floating-point.*int64"),
    (HIDDEN[0], torch.ones(3, dtype=torch.bool), ValueError,
     r"^hidden should have shape \(B, T, D\).*\(3, 4\)"),
], ids=["mask-too-long", "mask-3-D", "float-mask", "list-mask", "integer-hidden", "2-D-hidden"])
def test_mean_pool_rejects_bad_input(hidden, mask, error, match):
    with pytest.raises(error, match=match):
        mean_pool(hidden, mask)


def test_matches_hf_bert_on_a_heavily_padded_truncated_batch(bert, hf_bert):
    # one input cut at the 256-token limit next to sentences of 4 to 20 tokens: most of the
    # batch is padding, in the hidden states and in every attention map
    out = bert.encode([LONG, "Hi!", SENTENCES[1]])
    keep = out.batch.attention_mask
    assert out.batch.lengths[0] == 256 and out.batch.lengths[1] == 4
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), keep)


def test_mean_pool_matches_sentence_transformers_pooling(bert):
    try:  # not loaded by the package itself; its home since sentence-transformers 5
        from sentence_transformers.sentence_transformer.modules import Pooling
    except ImportError:
        from sentence_transformers.models import Pooling

    pooling = Pooling(384, pooling_mode="mean")
    out = bert.encode(SENTENCES, output_attentions=False)
    keep = out.batch.attention_mask
    expected = pooling({"token_embeddings": out.last_hidden_state,
                        "attention_mask": keep.long()})["sentence_embedding"]
    torch.testing.assert_close(mean_pool(out.last_hidden_state, keep), expected)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       extra=st.integers(0, 3), d=st.integers(1, 5), seed=st.integers(0, 1000))
def test_mean_pool_never_sees_the_padding(lengths, extra, d, seed):
    """Whatever the padding holds and however long it is, each row is the mean of its real
    tokens (zeros when it has none)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + extra
    hidden = torch.randn(len(lengths), width, d, generator=gen)
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    junk = hidden.masked_fill(~keep[..., None], 1e6)
    pooled = mean_pool(hidden, keep)
    torch.testing.assert_close(mean_pool(junk, keep), pooled)
    for row, n in enumerate(lengths):
        expected = hidden[row, :n].mean(0) if n else torch.zeros(d)
        torch.testing.assert_close(pooled[row], expected)


def test_full_size_models_match_hugging_face_counts():
    """GPT-2 small, BERT-base and BERT-large from their published configurations, ours and
    Hugging Face's, both on the meta device (no memory): the same number of parameters, up to
    BERT's pooler (a D x D layer on [CLS] that our encoder leaves out)."""
    from course_lib.configs import DecoderConfig
    from course_lib.models import DecoderLM, count_parameters

    bert_base = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072)
    bert_large = dict(bert_base, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096)
    with torch.device("meta"):
        for sizes, released in ((bert_base, 109_482_240), (bert_large, 335_141_888)):
            config = transformers.BertConfig(**sizes)
            theirs = transformers.BertModel(config)
            ours = Encoder(config_from_bert(config.to_dict()))
            d = sizes["hidden_size"]
            assert theirs.num_parameters() == released
            assert count_parameters(ours) + d * d + d == released
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        ours = DecoderLM(DecoderConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12,
                                       max_len=1024, activation="gelu_tanh"))
        assert theirs.num_parameters() == count_parameters(ours) == 124_439_808


# --------------------------------------------------------------------------------------------
# Another BERT: random weights, other sizes, saved by transformers with a task head


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, folder):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), folder)


def test_other_bert_checkpoint_matches_hf(tiny):
    path, ref = tiny
    ours = load_pretrained_encoder(path)
    assert ours.config.activation == "gelu_tanh" and ours.config.layer_norm_eps == 1e-7
    assert ours.max_length == 40  # no sentence-transformers config: max_position_embeddings
    assert any(name.startswith("cls.") for name in ours.skipped)
    out = ours.encode(SENTENCES, text_pair=["One.", "Two two.", "Three three three.", "Four"])
    assert out.batch.token_type_ids.max() == 1
    _compare_with_hf(out, _hf_outputs(ref, out.batch), out.batch.attention_mask)
    assert ours.tokenize(LONG).lengths == [40]




# --------------------------------------------------------------------------------------------
# Errors


def test_checkpoint_with_missing_wrong_or_extra_tensors(tmp_path, tiny):
    path = copy_folder(tiny[0], tmp_path / "model")
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))

    broken = dict(tensors)
    del broken["bert.encoder.layer.1.attention.self.key.weight"]
    save_file(broken, str(weights))
    with pytest.raises(ValueError, match=(
        rf"cannot load {re.escape(str(weights))} .*missing tensors: 'encoder.layer.1.attention.self.key.weight' "
        r"\(for blocks.1.self_attn.qkv_proj.weight\)"
    )):
        load_pretrained_encoder(path)

    broken = dict(tensors)
    broken["bert.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(72, 47)
    broken["bert.encoder.layer.2.output.dense.weight"] = torch.zeros(48, 72)
    save_file(broken, str(weights))
    with pytest.raises(ValueError, match=(
        r"'bert.encoder.layer.0.intermediate.dense.weight' has shape \(72, 47\), but "
        r"blocks.0.ff.fc1.weight has shape \(72, 48\).*unexpected tensors.*"
        r"'bert.encoder.layer.2.output.dense.weight'"
    )):
        load_pretrained_encoder(path)

    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(str(weights))}"):
        load_pretrained_encoder(path)


def test_every_parameter_has_a_source(tiny):
    config = config_from_bert(json.loads((tiny[0] / "config.json").read_text()))
    model = Encoder(config)
    table = bert_weight_map(config.n_layers)
    assert set(table) == {name for name, _ in model.named_parameters()}
    # the fused projection stacks query, key, value in that order
    assert table["blocks.0.self_attn.qkv_proj.weight"] == (
        "encoder.layer.0.attention.self.query.weight",
        "encoder.layer.0.attention.self.key.weight",
        "encoder.layer.0.attention.self.value.weight",
    )
    # nothing is written when a check fails
    before = model.embeddings.token.weight.clone()
    tensors = {k.removeprefix("bert."): v for k, v in load_file(str(tiny[0] / "model.safetensors")).items()}
    del tensors["embeddings.LayerNorm.bias"]
    with pytest.raises(ValueError, match=r"'embeddings.LayerNorm.bias' \(for embeddings.norm.bias\)"):
        load_bert_weights(model, tensors)
    assert torch.equal(model.embeddings.token.weight, before)


# --------------------------------------------------------------------------------------------
# config.json's fields, the weight map and checkpoints given as dicts


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(hidden_size="384"), TypeError, r"config\.json: 'hidden_size' .*>= 1.*'384'"),
    (dict(hidden_size=384.0), TypeError, r"config\.json: 'hidden_size' .*>= 1.*384\.0"),
    (dict(num_hidden_layers=0), ValueError, r"config\.json: 'num_hidden_layers' .*>= 1.*0"),
    (dict(type_vocab_size=-1), ValueError, r"config\.json: 'type_vocab_size' .*>= 0.*-1"),
    (dict(layer_norm_eps="1e-12"), TypeError, r"config\.json: 'layer_norm_eps' .*> 0.*'1e-12'"),
    (dict(layer_norm_eps=True), TypeError, r"config\.json: 'layer_norm_eps' .*> 0.*True"),
    # hidden_dropout_prob becomes EncoderConfig's dropout, whose check names it so
    (dict(hidden_dropout_prob="0.1"), TypeError, r"config\.json.*dropout .*\[0, 1\).*'0\.1'"),
    (dict(hidden_dropout_prob=1.5), ValueError, r"config\.json.*dropout .*\[0, 1\).*1\.5"),
    # a value outside the supported choices is a ValueError whatever its type (require_choice)
    (dict(hidden_act=3), ValueError, r"config\.json: 'hidden_act' is 3, .*'gelu'"),
    (dict(model_type=None), ValueError, r"config\.json: 'model_type' is None, .*'bert'"),
    (dict(is_decoder="no"), ValueError, r"config\.json: 'is_decoder' is 'no', .*False"),
    (dict(position_embedding_type=3), ValueError,
     r"config\.json: 'position_embedding_type' is 3, .*'absolute'"),
], ids=lambda v: None)
def test_config_json_with_wrong_typed_fields(changes, error, match, folder):
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    with pytest.raises(error, match=match):
        config_from_bert(config)


def test_config_from_bert_and_the_weight_map_check_their_arguments():
    with pytest.raises(TypeError, match=r"^config .*dict.*config\.json.*list"):
        config_from_bert([("model_type", "bert")])
    with pytest.raises(TypeError, match=r"^token_types .*True or False.*'yes'"):
        bert_weight_map(2, token_types="yes")


TINY_CONFIG = dict(
    model_type="bert", vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=12, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12,
    hidden_act="gelu",
)


def _tiny_checkpoint() -> tuple[Encoder, dict[str, torch.Tensor]]:
    """An Encoder and a checkpoint in BERT's names (split from a second Encoder's weights)."""
    config = config_from_bert(TINY_CONFIG)
    torch.manual_seed(0)
    params = dict(Encoder(config).named_parameters())
    tensors = {}
    for ours, theirs in bert_weight_map(config.n_layers).items():
        for name, part in zip(theirs, params[ours].detach().chunk(len(theirs)), strict=True):
            tensors[name] = part.clone()
    return Encoder(config), tensors


def test_the_tiny_checkpoint_loads():
    model, tensors = _tiny_checkpoint()
    assert load_bert_weights(model, tensors) == []
    torch.testing.assert_close(model.embeddings.token.weight,
                               tensors["embeddings.word_embeddings.weight"], rtol=0, atol=0)


@pytest.mark.parametrize(("name", "shape", "match"), [
    ("encoder.layer.0.output.dense.weight", (8, 11),
     r"'encoder\.layer\.0\.output\.dense\.weight' has shape \(8, 11\), but "
     r"blocks\.0\.ff\.fc2\.weight has shape \(8, 12\)"),
    ("encoder.layer.0.attention.self.key.weight", (4, 8),
     r"'encoder\.layer\.0\.attention\.self\.key\.weight' has shape \(4, 8\), but "
     r"blocks\.0\.self_attn\.qkv_proj\.weight has shape \(24, 8\) \(3 stacked parts of \(8, 8\)\)"),
    ("embeddings.LayerNorm.bias", (9,),
     r"'embeddings\.LayerNorm\.bias' has shape \(9,\), but embeddings\.norm\.bias has shape "
     r"\(8,\)"),
], ids=["fc2", "stacked-key", "norm-bias"])
def test_checkpoint_with_wrong_shapes(name, shape, match):
    model, tensors = _tiny_checkpoint()
    before = model.embeddings.token.weight.clone()
    tensors[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"^cannot load the checkpoint .*{match}"):
        load_bert_weights(model, tensors)
    assert torch.equal(model.embeddings.token.weight, before)  # nothing written


def test_checkpoint_of_the_wrong_kind():
    model, tensors = _tiny_checkpoint()
    torch.manual_seed(0)
    gpt = DecoderLM(DecoderConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1, max_len=6))
    with pytest.raises(TypeError, match=r"^model .*Encoder.*DecoderLM"):
        load_bert_weights(gpt, tensors)
    with pytest.raises(TypeError, match=r"^tensors .*dict of name -> tensor.*\[tensor"):
        load_bert_weights(model, list(tensors.values()))
    tensors["embeddings.word_embeddings.weight"] = np.zeros((50, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^tensors .*dict of name -> tensor"):
        load_bert_weights(model, tensors)
    tensors["embeddings.word_embeddings.weight"] = torch.zeros(50, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'embeddings\.word_embeddings\.weight' has dtype "
                                         r"torch\.int64, but embeddings\.token\.weight .*"
                                         r"floating-point"):
        load_bert_weights(model, tensors)
