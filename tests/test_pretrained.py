"""course_lib.pretrained: our encoder with BERT's weights against Hugging Face's BertModel built
from the same weights (hidden states and attention maps), loaded offline from the same local
folder, also for a second, randomly initialised BERT of other sizes saved by transformers
itself; mean_pool (against sentence-transformers' pooling), config_from_bert, the weight map
and load_bert_weights with their error messages. A tiny random Llama (transformers'
LlamaForCausalLM, grouped-query attention) in our DecoderLM: logits, an incremental cached step
and greedy generation equal Hugging Face's; copying without reordering the RoPE pairs gives
other logits; config_from_llama, llama_weight_map and load_llama_weights with their errors."""

from __future__ import annotations

import inspect
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

from course_lib.cache import KVCache  # noqa: E402
from course_lib.configs import DecoderConfig, EncoderConfig  # noqa: E402
from course_lib.instruments.bert_app import (  # noqa: E402
    PretrainedEncoder,
    default_model_dir,
    load_pretrained_encoder,
)
from course_lib.models import DecoderLM, Encoder  # noqa: E402
from course_lib.pretrained import (  # noqa: E402
    bert_weight_map,
    config_from_bert,
    config_from_llama,
    llama_weight_map,
    load_bert_weights,
    load_llama_weights,
    mean_pool,
    rope_half_to_interleaved,
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
    # copies: older safetensors releases map the file, which is rewritten below (a bus error)
    tensors = {name: t.clone() for name, t in load_file(str(weights)).items()}

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


# ----------------------------------------------------------------------------------- Llama

LLAMA = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=96, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False, max_position_embeddings=64, bos_token_id=None,
             eos_token_id=None, initializer_range=0.2)  # large weights: far from uniform
LLAMA_TOL = dict(atol=1e-5, rtol=1e-5)


def _llama_pair(seed: int = 0, **overrides):
    """transformers' LlamaForCausalLM with seeded random weights, and our DecoderLM built from
    its config with its weights copied in."""
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(LLAMA | overrides))).eval()
    ours = DecoderLM(config_from_llama(hf.config.to_dict())).eval()
    skipped = load_llama_weights(ours, hf.state_dict())
    assert skipped == (["lm_head.weight"] if hf.config.tie_word_embeddings else [])
    return hf, ours


def _ids(batch=2, length=12, seed=1):
    return torch.randint(0, LLAMA["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("overrides", [{}, {"num_key_value_heads": 4},
                                       {"num_key_value_heads": 1},
                                       {"tie_word_embeddings": True, "rope_theta": 500.0}],
                         ids=["gqa", "mha", "mqa", "tied-theta500"])
def test_our_decoder_with_llama_weights_gives_hugging_faces_logits(overrides):
    hf, ours = _llama_pair(**overrides)
    ids = _ids()
    with torch.no_grad():
        expected = hf(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, **LLAMA_TOL)
    assert expected.std() > 0.5  # logits far from constant: a wrong model shows


def test_a_cached_step_and_the_cache_itself_match_hugging_faces():
    hf, ours = _llama_pair()
    ids = _ids(length=11)
    cache = KVCache()
    # transformers 5.x renamed the argument and the output field past_key_values to cache
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.no_grad():
        theirs = hf(ids[:, :8], use_cache=True)
        hf_cache = getattr(theirs, name)
        step = hf(ids[:, 8:], **{name: hf_cache}, use_cache=True).logits
        ours(ids[:, :8], past_key_values=cache)
        torch.testing.assert_close(ours(ids[:, 8:], past_key_values=cache).logits, step,
                                   **LLAMA_TOL)
    for layer, hf_layer in zip(cache.layers, hf_cache.layers, strict=True):
        assert layer.values.shape == (2, 2, 11, 16)  # (B, Hkv, S, Dh), before the repeat
        torch.testing.assert_close(layer.values, hf_layer.values, **LLAMA_TOL)
        # keys: the same numbers, with each head's dimensions in our RoPE pair order
        hf_keys = rope_half_to_interleaved(hf_layer.keys.movedim(-1, 0), 1).movedim(0, -1)
        torch.testing.assert_close(layer.keys, hf_keys, **LLAMA_TOL)


@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_greedy_generation_gives_hugging_faces_tokens(n_kv_heads):
    hf, ours = _llama_pair(seed=3, num_key_value_heads=n_kv_heads)
    prompt = _ids(length=5, seed=4)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    for use_cache in (True, False):
        assert torch.equal(ours.generate(prompt, 10, temperature=0, use_cache=use_cache),
                           expected)


def test_copying_without_reordering_the_rope_pairs_gives_other_logits():
    """The classic bug: every tensor has the right shape, the model loads and runs, and
    computes something else, because Hugging Face's Llama pairs dimension i with i + Dh/2
    and course_lib's RoPE pairs 2i with 2i + 1."""
    hf, ours = _llama_pair()
    naive = DecoderLM(ours.config).eval()
    state, params = hf.state_dict(), dict(naive.named_parameters())
    with torch.no_grad():
        for name, theirs in llama_weight_map(2).items():
            params[name].copy_(torch.cat([state[n] for n in theirs]))  # no reordering
        ids = _ids()
        expected, wrong = hf(ids).logits, naive(ids).logits
    assert (wrong - expected).abs().max() > 0.1
    torch.testing.assert_close(ours(ids).logits, expected, **LLAMA_TOL)


def test_the_reordering_undoes_hugging_faces_conversion_from_metas_layout():
    """``permute`` of transformers' convert_llama_weights_to_hf.py takes Meta's interleaved
    pairs to Hugging Face's halves; ours takes them back, for weights and biases alike."""
    def hf_permute(w, n_heads, dim1, dim2):  # as in the conversion script
        return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)

    meta = torch.randn(4 * 16, 64)
    assert torch.equal(rope_half_to_interleaved(hf_permute(meta, 4, 64, 64), 4), meta)
    bias = torch.arange(8.0)  # one head of Dh = 8: halves [0..3], [4..7] -> pairs (0, 4), ...
    assert rope_half_to_interleaved(bias, 1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]


def test_config_from_llama_builds_a_llama_style_decoder_config():
    config = config_from_llama(transformers.LlamaConfig(**LLAMA).to_dict())
    assert (config.d_model, config.n_heads, config.n_kv_heads, config.n_layers, config.d_ff,
            config.max_len) == (64, 4, 2, 2, 96, 64)
    assert (config.norm, config.ffn, config.positions, config.bias, config.norm_first,
            config.tie_embeddings) == ("rms", "swiglu", "rope", False, True, False)
    assert config.layer_norm_eps == 1e-6 and config.rope_theta == 10000.0
    old_style = {k: v for k, v in LLAMA.items() if k != "rope_theta"} | {"rope_theta": 5e5}
    assert config_from_llama(old_style | {"hidden_act": "silu"}).rope_theta == 5e5


LLAMA_DICT = transformers.LlamaConfig(**LLAMA).to_dict()


@pytest.mark.parametrize(("config", "error", "match"), [
    ("not a dict", TypeError, r"config must be a dict"),
    ({k: v for k, v in LLAMA_DICT.items() if k != "num_key_value_heads"}, TypeError,
     r"config\.json: 'num_key_value_heads' .*integer.*None"),
    (LLAMA_DICT | {"hidden_act": "gelu"}, ValueError, r"'hidden_act' is 'gelu'.*'silu'"),
    (LLAMA_DICT | {"attention_bias": True}, ValueError, r"'attention_bias' is True.*False"),
    (LLAMA_DICT | {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, ValueError,
     r"'rope_type' is 'linear'.*'default'"),
    (LLAMA_DICT | {"head_dim": 32}, ValueError, r"'head_dim' is 32.*16"),
    (LLAMA_DICT | {"num_key_value_heads": 3}, ValueError, r"n_kv_heads=3"),
])
def test_config_from_llama_names_what_it_cannot_build(config, error, match):
    with pytest.raises(error, match=match):
        config_from_llama(config)


def test_load_llama_weights_checks_everything_before_writing():
    hf, ours = _llama_pair()
    state = dict(hf.state_dict())
    before = {n: p.clone() for n, p in ours.named_parameters()}
    broken = {k: v for k, v in state.items() if k != "model.norm.weight"}
    broken["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    broken["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"(?s)missing tensors: 'model\.norm\.weight'.*"
                       r"unexpected tensors: 'model\.extra\.weight'.*k_proj.*\(64, 64\).*"
                       r"\(32, 64\)"):
        load_llama_weights(ours, broken, source="ckpt")
    assert all(torch.equal(p, before[n]) for n, p in ours.named_parameters())  # untouched
    gpt = DecoderLM(DecoderConfig(vocab_size=97, d_model=64, n_heads=4, n_layers=2))
    with pytest.raises(ValueError, match=r"parameters with no Llama counterpart.*"
                       r"'blocks\.0\.ff\.fc1\.weight'.*weight-map names the model lacks"):
        load_llama_weights(gpt, state)
    with pytest.raises(TypeError, match=r"model must be a course_lib DecoderLM, got Encoder"):
        load_llama_weights(Encoder(EncoderConfig(vocab_size=97)), state)
    with pytest.raises(TypeError, match=r"tensors must be a dict of name -> tensor"):
        load_llama_weights(ours, list(state.values()))


def test_the_llama_weight_map_names_its_options():
    assert "lm_head.weight" not in llama_weight_map(1, tie_embeddings=True)
    assert llama_weight_map(1)["blocks.0.self_attn.qkv_proj.weight"] == tuple(
        f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv")
    with pytest.raises(ValueError, match=r"n_layers .*>= 1"):
        llama_weight_map(0)
    with pytest.raises(TypeError, match=r"tie_embeddings must be True or False"):
        llama_weight_map(2, tie_embeddings="no")
