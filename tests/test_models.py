"""course_lib.models: the encoder, the decoder language model and the encoder-decoder (their
behaviour, parameter counts and properties: causality, permutation equivariance without
positions), and the arguments each model checks at its boundary, named as the learner wrote
them (src_attention_mask, max_src_len, ...)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.models import (
    DecoderLM,
    Encoder,
    EncoderDecoder,
    count_parameters,
    lm_loss,
    parameter_breakdown,
)


def _gpt(**overrides) -> DecoderLM:
    cfg = dict(vocab_size=20, d_model=16, n_heads=2, n_layers=2, max_len=12)
    cfg.update(overrides)
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**cfg)).eval()


def test_tied_embeddings_share_one_matrix():
    tied = _gpt()
    untied = _gpt(tie_embeddings=False)
    assert tied.lm_head.weight.data_ptr() == tied.embeddings.token.weight.data_ptr()
    assert count_parameters(untied) - count_parameters(tied) == 20 * 16


def test_parameter_count_matches_formula():
    model = _gpt(positions="learned", tie_embeddings=True)
    d, f, v, n, ctx = 16, 64, 20, 2, 12
    attn = 3 * d * d + 3 * d + d * d + d
    ff = d * f + f + f * d + d
    norms = 2 * 2 * d
    expected = v * d + ctx * d + n * (attn + ff + norms) + 2 * d
    assert count_parameters(model) == expected


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "alibi", "rope", "none"])
def test_decoder_loss_near_log_vocab_at_init(positions):
    # An untied output layer starts small, so every model starts near the uniform guess.
    # (Tied to a sinusoidal model's sqrt(D)-scaled token table, the output layer starts out
    # favouring the current token instead; that model is checked for a finite loss.)
    model = _gpt(positions=positions, tie_embeddings=False)
    ids = torch.randint(0, 20, (4, 12))
    out = model(ids, targets=ids)
    assert out.logits.shape == (4, 12, 20)
    assert abs(out.loss.item() - torch.log(torch.tensor(20.0)).item()) < 0.3
    tied = _gpt(positions=positions)(ids, targets=ids).loss
    assert torch.isfinite(tied)


def test_loss_ignores_minus_100_targets():
    model = _gpt()
    ids = torch.randint(0, 20, (2, 6))
    targets = ids.clone()
    targets[:, 3:] = -100
    full = model(ids[:, :3], targets=ids[:, :3]).loss
    partial = model(ids, targets=targets).loss
    torch.testing.assert_close(full, partial)


def test_encoder_returns_hidden_states_and_attentions():
    cfg = EncoderConfig(vocab_size=30, d_model=16, n_heads=4, n_layers=3, max_len=10, pad_id=0)
    enc = Encoder(cfg).eval()
    ids = torch.randint(1, 30, (2, 10))
    ids[1, 6:] = 0
    out = enc(ids, output_attentions=True, output_hidden_states=True)
    assert out.last_hidden_state.shape == (2, 10, 16)
    assert len(out.hidden_states) == 4 and len(out.attentions) == 3
    # padding is masked automatically from pad_id: no query looks at a pad key
    assert out.attentions[0][1, ..., 6:].abs().max() == 0
    # and real tokens do not depend on what the padding holds
    ids2 = ids.clone()
    ids2[1, 6:] = 7
    mask = ids != 0
    out2 = enc(ids2, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state[mask], out2.last_hidden_state[mask])


def test_encoder_token_types_and_embed_norm():
    cfg = EncoderConfig(vocab_size=30, d_model=16, n_heads=4, n_layers=1, max_len=10,
                        type_vocab_size=2, embed_norm=True, norm_first=False)
    enc = Encoder(cfg).eval()
    ids = torch.randint(0, 30, (1, 6))
    a = enc(ids).last_hidden_state
    b = enc(ids, token_type_ids=torch.ones_like(ids)).last_hidden_state
    assert not torch.allclose(a, b)
    assert enc.final_norm is None  # post-norm stacks end normalised already


def _seq2seq(**overrides) -> EncoderDecoder:
    cfg = dict(src_vocab_size=15, tgt_vocab_size=17, d_model=16, n_heads=2, max_src_len=10,
               max_tgt_len=10, pad_id=0)
    cfg.update(overrides)
    torch.manual_seed(0)
    return EncoderDecoder(EncoderDecoderConfig.shared(**cfg)).eval()


def test_encoder_decoder_shapes_and_cross_attention():
    model = _seq2seq()
    src = torch.randint(1, 15, (2, 8))
    src[1, 5:] = 0
    tgt = torch.randint(1, 17, (2, 6))
    out = model(src, tgt, targets=tgt, output_attentions=True)
    assert out.logits.shape == (2, 6, 17)
    assert len(out.cross_attentions) == 2 and out.cross_attentions[0].shape == (2, 2, 6, 8)
    assert len(out.encoder_attentions) == 2
    assert out.cross_attentions[0][1, ..., 5:].abs().max() == 0  # padded source never read
    assert out.loss is not None


def test_parameter_breakdown_adds_up_and_matches_the_formula():
    model = _gpt(tie_embeddings=False)
    parts = parameter_breakdown(model)
    assert sum(parts.values()) == count_parameters(model)
    d, f, n = 16, 64, 2
    assert parts["attention"] == n * (4 * d * d + 4 * d)
    assert parts["feed-forward"] == n * (2 * d * f + f + d)
    assert parts["layer norms"] == n * 4 * d + 2 * d
    assert parts["embeddings"] == 20 * d + 12 * d
    assert parts["output head"] == 20 * d
    assert "output head" not in parameter_breakdown(_gpt())  # tied: counted as embeddings
    seq2seq = _seq2seq()
    assert sum(parameter_breakdown(seq2seq).values()) == count_parameters(seq2seq)
    assert "other" not in parameter_breakdown(seq2seq)


def test_sinusoidal_models_scale_tokens_to_the_size_of_the_positions():
    model = _gpt(positions="sinusoidal", d_model=64, n_heads=4)
    ids = torch.randint(0, 20, (4, 12))
    with torch.no_grad():
        tokens = model.embeddings.token(ids) * model.embeddings.token_scale
    positions = model.embeddings.position(12)
    ratio = float(tokens.pow(2).mean().sqrt() / positions.pow(2).mean().sqrt())
    assert 0.5 < ratio < 3.0  # same order of magnitude, not 35x apart
    assert _gpt(positions="learned").embeddings.token_scale == 1.0


# ------------------------------------------------------------------------------ properties


@given(t=st.integers(2, 10), seed=st.integers(0, 2**16))
def test_encoder_without_positions_is_permutation_equivariant(t, seed):
    torch.manual_seed(seed)
    enc = Encoder(
        EncoderConfig(vocab_size=11, d_model=8, n_heads=2, n_layers=2, positions="none")
    ).eval()
    ids = torch.randint(0, 11, (1, t))
    perm = torch.randperm(t)
    out = enc(ids).last_hidden_state
    torch.testing.assert_close(enc(ids[:, perm]).last_hidden_state, out[:, perm],
                               atol=1e-5, rtol=1e-5)


@given(t=st.integers(3, 10), seed=st.integers(0, 2**16))
def test_encoder_with_positions_is_not_permutation_equivariant(t, seed):
    torch.manual_seed(seed)
    enc = Encoder(
        EncoderConfig(vocab_size=50, d_model=8, n_heads=2, n_layers=1, positions="learned")
    ).eval()
    ids = torch.arange(t)[None] + 1  # all tokens different
    perm = torch.roll(torch.arange(t), 1)
    out = enc(ids).last_hidden_state
    assert not torch.allclose(enc(ids[:, perm]).last_hidden_state, out[:, perm], atol=1e-4)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal", "alibi", "rope", "none"])
@given(t=st.integers(1, 12), cut=st.integers(0, 11), seed=st.integers(0, 2**16))
def test_whole_decoder_is_causal(positions, t, cut, seed):
    cut = min(cut, t - 1)
    torch.manual_seed(seed)
    model = DecoderLM(
        DecoderConfig(vocab_size=13, d_model=8, n_heads=2, n_layers=2, max_len=12,
                      positions=positions)
    ).eval()
    ids = torch.randint(0, 13, (2, t))
    changed = ids.clone()
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 1) % 13
    a = model(ids).logits
    b = model(changed).logits
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], atol=1e-5, rtol=1e-5)
    if cut + 1 < t:  # and the future is not ignored by everybody: the last position sees it
        assert not torch.allclose(a[:, -1], b[:, -1])


@given(t=st.integers(1, 8), cut=st.integers(0, 7), seed=st.integers(0, 2**16))
def test_encoder_decoder_target_side_is_causal(t, cut, seed):
    cut = min(cut, t - 1)
    torch.manual_seed(seed)
    model = EncoderDecoder(EncoderDecoderConfig.shared(
        src_vocab_size=9, tgt_vocab_size=9, d_model=8, n_heads=2, max_src_len=8, max_tgt_len=8
    )).eval()
    src = torch.randint(0, 9, (1, 5))
    tgt = torch.randint(0, 9, (1, t))
    changed = tgt.clone()
    changed[:, cut + 1:] = (changed[:, cut + 1:] + 1) % 9
    a = model(src, tgt).logits
    b = model(src, changed).logits
    torch.testing.assert_close(a[:, : cut + 1], b[:, : cut + 1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- masks: 0/1 integers, padding


def _small_gpt(**overrides) -> DecoderLM:
    config = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_len=6)
    config.update(overrides)
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(**config)).eval()


def _small_encoder(**overrides) -> Encoder:
    config = dict(vocab_size=11, d_model=8, n_heads=2, n_layers=1, max_len=6)
    config.update(overrides)
    torch.manual_seed(0)
    return Encoder(EncoderConfig(**config)).eval()


def _small_seq2seq() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder(EncoderDecoderConfig.shared(
        9, 7, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=5,
        max_tgt_len=4, pad_id=0)).eval()


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])  # (2, 4)
MEMORY = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))  # (B, S, D)
KEEP = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])  # (2, 5), 0/1 as a tokenizer gives
SRC = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 0]])  # padded with pad_id 0
TGT = torch.tensor([[1, 2, 3], [1, 4, 5]])


@pytest.mark.parametrize("mask", [KEEP, KEEP.bool()], ids=["0/1 integers", "booleans"])
def test_masked_source_positions_do_not_move_the_decoder(mask):
    decoder = _small_gpt(cross_attention=True)
    changed = MEMORY.clone()
    changed[0, 3:] = 100.0  # padding positions of the first source
    with torch.no_grad():
        a = decoder(IDS, encoder_hidden_states=MEMORY, encoder_attention_mask=mask).logits
        b = decoder(IDS, encoder_hidden_states=changed, encoder_attention_mask=mask).logits
    assert torch.equal(a, b)


def test_integer_masks_give_the_boolean_masks_results():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    encoder, decoder, model = _small_encoder(), _small_gpt(), _small_seq2seq()
    with torch.no_grad():
        torch.testing.assert_close(encoder(IDS, attention_mask=mask).last_hidden_state,
                                   encoder(IDS, attention_mask=mask.bool()).last_hidden_state)
        torch.testing.assert_close(decoder(IDS, attention_mask=mask).logits,
                                   decoder(IDS, attention_mask=mask.bool()).logits)
        src_mask, tgt_mask = (SRC != 0).long(), torch.tensor([[1, 1, 0], [1, 1, 1]])
        torch.testing.assert_close(
            model(SRC, TGT, src_attention_mask=src_mask, tgt_attention_mask=tgt_mask).logits,
            model(SRC, TGT, src_attention_mask=src_mask.bool(),
                  tgt_attention_mask=tgt_mask.bool()).logits)


def test_an_integer_mask_with_a_cache_gives_the_boolean_masks_results():
    model = _small_gpt(pad_id=0)
    ids = torch.tensor([[0, 5, 6]])
    outs = []
    for mask in (torch.tensor([[0, 1, 1, 1]]), torch.tensor([[False, True, True, True]])):
        cache = KVCache()
        with torch.no_grad():
            model(ids, past_key_values=cache)
            outs.append(model(torch.tensor([[7]]), past_key_values=cache,
                              attention_mask=mask).logits)
    torch.testing.assert_close(outs[0], outs[1])


def test_int32_targets_give_the_int64_loss():
    logits = torch.randn(2, 4, 11, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lm_loss(logits, IDS.int()), lm_loss(logits, IDS))
    with pytest.raises(ValueError, match=r"^targets .*token ids.*float32"):
        lm_loss(logits, IDS.float())


# ------------------------------------------------------------------------------ bad input


def _long_ids(n: int) -> torch.Tensor:
    return torch.ones(2, n, dtype=torch.long)


BAD_MODEL_CALLS = {
    # ids: too long, outside the vocabulary, not integers, not (B, T)
    "too long": (lambda: DecoderLM(DecoderConfig(vocab_size=7, d_model=8, n_heads=2, max_len=5))(
        torch.zeros(1, 6, dtype=torch.long)), ValueError, r"^ids has 6 tokens.*max_len=5"),
    "ids outside": (lambda: _small_encoder(vocab_size=7)(torch.tensor([[0, 9]])), ValueError,
                    r"^ids holds ids 0..9.*0\.\.6"),
    "float ids": (lambda: _small_encoder()(torch.zeros(1, 3)), ValueError,
                  r"^ids .*token ids.*float32.*ids\.long\(\)"),
    "1-D ids": (lambda: _small_encoder()(torch.zeros(3, dtype=torch.long)), ValueError,
                r"^ids .*\(B, T\).*ids\[None\].*\(3,\)"),
    "mask shape": (lambda: _small_encoder()(torch.zeros(1, 3, dtype=torch.long),
                                            attention_mask=torch.ones(1, 4, dtype=torch.bool)),
                   ValueError, r"^attention_mask has shape \(1, 4\).*\(1, 3\)"),
    "config type": (lambda: Encoder(DecoderConfig(vocab_size=5)), TypeError,
                    r"^config .*EncoderConfig.*got DecoderConfig"),
    # segments
    "no segments": (lambda: _small_encoder()(IDS, token_type_ids=torch.zeros_like(IDS)),
                    ValueError, r"^token_type_ids.*type_vocab_size=0"),
    "segment ids": (lambda: _small_encoder(type_vocab_size=2)(
        IDS[:, :3], token_type_ids=torch.tensor([[0, 1, 2], [0, 0, 0]])),
        ValueError, r"^token_type_ids holds ids 0..2.*0\.\.1"),
    # targets
    "float targets": (lambda: _small_gpt()(IDS, targets=torch.zeros(2, 4)), ValueError,
                      r"^targets .*token ids.*float32"),
    "targets outside": (lambda: _small_gpt()(IDS, targets=torch.full((2, 4), 11)), ValueError,
                        r"^targets.*11.*0\.\.10.*-100"),
    "targets shape": (lambda: _small_gpt()(IDS, targets=torch.zeros(2, 3, dtype=torch.long)),
                      ValueError, r"^targets has shape \(2, 3\).*\(2, 4\)"),
    # an encoder-decoder names src, tgt and their limits
    "src too long": (lambda: _small_seq2seq()(_long_ids(6), TGT), ValueError,
                     r"^src has 6 tokens.*max_src_len=5"),
    "tgt too long": (lambda: _small_seq2seq()(SRC, _long_ids(5)), ValueError,
                     r"^tgt has 5 tokens.*max_tgt_len=4"),
    "src outside": (lambda: _small_seq2seq()(torch.tensor([[1, 9]]), TGT[:1]), ValueError,
                    r"^src holds ids 1..9.*0\.\.8"),
    "tgt outside": (lambda: _small_seq2seq()(SRC[:1], torch.tensor([[1, 7]])), ValueError,
                    r"^tgt holds ids 1..7.*0\.\.6"),
    "batch sizes": (lambda: _small_seq2seq()(SRC, TGT[:1]), ValueError,
                    r"^tgt has shape \(1, 3\).*src's batch size=2"),
    "src mask": (lambda: _small_seq2seq()(
        SRC, TGT, src_attention_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
        r"^src_attention_mask has shape \(2, 4\).*\(2, 5\)"),
    "tgt mask": (lambda: _small_seq2seq()(
        SRC, TGT, tgt_attention_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
        r"^tgt_attention_mask has shape \(2, 4\).*\(2, 3\)"),
    "seq2seq targets": (lambda: _small_seq2seq()(
        SRC, TGT, targets=torch.ones(2, 2, dtype=torch.long)), ValueError,
        r"^targets has shape \(2, 2\).*\(2, 3\)"),
    # a decoder's cross-attention inputs
    "float encoder mask": (lambda: _small_gpt(cross_attention=True)(
        IDS, encoder_hidden_states=MEMORY, encoder_attention_mask=KEEP.float()), ValueError,
        r"^encoder_attention_mask .*float32.*encoder_attention_mask\.bool\(\)"),
    "encoder mask shape": (lambda: _small_gpt(cross_attention=True)(
        IDS, encoder_hidden_states=MEMORY,
        encoder_attention_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
        r"^encoder_attention_mask has shape \(2, 4\).*\(2, 5\)"),
    "float64 memory": (lambda: _small_gpt(cross_attention=True)(
        IDS, encoder_hidden_states=MEMORY.double()), ValueError,
        r"^encoder_hidden_states has dtype torch\.float64.*encoder_hidden_states\.float\(\)"),
    "memory batch": (lambda: _small_gpt(cross_attention=True)(
        IDS, encoder_hidden_states=MEMORY[:1]), ValueError,
        r"^encoder_hidden_states has shape \(1, 5, 8\).*batch size=2"),
    "memory width": (lambda: _small_gpt(cross_attention=True)(
        IDS, encoder_hidden_states=MEMORY[..., :6]), ValueError,
        r"^encoder_hidden_states has shape \(2, 5, 6\).*d_model=8"),
    "memory missing": (lambda: _small_gpt(cross_attention=True)(IDS), ValueError,
                       "needs encoder_hidden_states"),
}


@pytest.mark.parametrize("case", sorted(BAD_MODEL_CALLS))
def test_models_name_the_bad_argument(case):
    call, error, message = BAD_MODEL_CALLS[case]
    with pytest.raises(error, match=message):
        call()


def test_minus_100_targets_are_allowed():
    ignored = torch.full((2, 4), -100)
    ignored[:, 0] = 3
    assert torch.isfinite(_small_gpt()(IDS, targets=ignored).loss)


@pytest.mark.parametrize("call, name", [
    (lambda: _small_encoder()(IDS, attention_mask=torch.ones(2, 4)), "attention_mask"),
    (lambda: _small_gpt()(IDS, attention_mask=torch.ones(2, 4)), "attention_mask"),
    (lambda: _small_seq2seq()(SRC, TGT, src_attention_mask=torch.ones(2, 5)),
     "src_attention_mask"),
    (lambda: _small_seq2seq()(SRC, TGT, tgt_attention_mask=torch.ones(2, 3)),
     "tgt_attention_mask"),
    (lambda: _small_seq2seq().encode(SRC, torch.ones(2, 5)), "src_attention_mask"),
    (lambda: _small_gpt()(IDS, past_key_values=KVCache(), attention_mask=torch.ones(2, 4)),
     "attention_mask"),
], ids=["encoder", "decoder", "src", "tgt", "encode", "cached"])
def test_float_masks_are_refused_by_the_name_the_learner_wrote(call, name):
    with pytest.raises(ValueError, match=rf"^{name} .*float32.*{name}\.bool\(\)"):
        call()


@pytest.mark.parametrize("name, value", [
    ("encoder_hidden_states", MEMORY),
    ("encoder_attention_mask", KEEP.bool()),
])
def test_cross_attention_inputs_to_a_decoder_without_it_are_refused(name, value):
    with pytest.raises(ValueError, match="no cross-attention"):
        _small_gpt()(IDS, **{name: value})


def test_an_encoder_attention_mask_without_cross_attention_is_named():
    with pytest.raises(ValueError, match="no cross-attention.*encoder_attention_mask"):
        _small_gpt()(IDS, encoder_attention_mask=KEEP.bool())


@pytest.mark.parametrize("call, name", [
    (lambda: _small_encoder()(IDS, output_attentions=1), "output_attentions"),
    (lambda: _small_encoder()(IDS, output_hidden_states="yes"), "output_hidden_states"),
    (lambda: _small_gpt()(IDS, output_attentions="yes"), "output_attentions"),
    (lambda: _small_seq2seq()(SRC, TGT, output_attentions=1), "output_attentions"),
])
def test_output_flags_must_be_true_or_false(call, name):
    with pytest.raises(TypeError, match=rf"^{name} must be True or False"):
        call()


def test_count_parameters_refuses_a_truthy_string():
    with pytest.raises(TypeError, match=r"^trainable_only must be True or False"):
        count_parameters(torch.nn.Linear(2, 2), trainable_only="yes")


# ------------------------------------------- checks skipped inside a model, never for the caller


def test_checks_skipped_inside_a_model_are_back_for_the_next_call():
    model = _small_gpt()
    model(torch.zeros(1, 4, dtype=torch.long))  # runs its blocks with the inner checks off
    attention = model.blocks[0].self_attn
    with pytest.raises(ValueError, match=r"^x has dtype torch\.float64"):
        attention(torch.zeros(1, 4, 8, dtype=torch.float64))

    def fail(*_):
        raise RuntimeError("a failure inside the model")

    handle = model.blocks[0].ff.register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="a failure inside"):  # must not leave checks off
        model(torch.zeros(1, 4, dtype=torch.long))
    handle.remove()
    with pytest.raises(ValueError, match=r"^x has dtype torch\.float64"):
        attention(torch.zeros(1, 4, 8, dtype=torch.float64))


def test_the_inner_checks_are_back_after_an_encoder_decoder_call():
    model = _small_seq2seq()
    model(SRC, TGT)  # runs the encoder and the decoder with their checks off
    with pytest.raises(ValueError, match=r"^attention_mask .*float32"):
        model.encoder(SRC, attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match=r"^ids has 5 tokens.*max_len=4"):
        model.decoder(torch.ones(2, 5, dtype=torch.long), encoder_hidden_states=MEMORY)


def test_forward_hooks_still_see_every_inner_module():
    model = _small_gpt(n_layers=2)
    seen = []
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, i, o, name=name: seen.append(name))
    model(torch.zeros(1, 4, dtype=torch.long))
    for i in range(2):
        assert {f"blocks.{i}.self_attn", f"blocks.{i}.ff", f"blocks.{i}.attn_norm",
                f"blocks.{i}.ff_norm"} <= set(seen)


# --- the masked-language-model head (BERT's), against Hugging Face's BertForMaskedLM


def _hf_masked_lm():
    """A tiny random transformers.BertForMaskedLM, every weight moved off its initial value,
    and our MaskedLM holding the same tensors (the encoder through course_lib.pretrained's
    BERT weight map, the head's five tensors by name)."""
    transformers = pytest.importorskip("transformers")
    from course_lib.models import MaskedLM
    from course_lib.pretrained import config_from_bert, load_bert_weights

    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=53, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=16, type_vocab_size=2,
        layer_norm_eps=1e-7, hidden_act="gelu_new")).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    tensors = hf.state_dict()
    ours = MaskedLM(config_from_bert(hf.config.to_dict())).eval()
    load_bert_weights(ours.encoder, tensors)
    head = {"head_dense.weight": "cls.predictions.transform.dense.weight",
            "head_dense.bias": "cls.predictions.transform.dense.bias",
            "head_norm.weight": "cls.predictions.transform.LayerNorm.weight",
            "head_norm.bias": "cls.predictions.transform.LayerNorm.bias",
            "lm_head.bias": "cls.predictions.bias"}
    with torch.no_grad():
        for name, theirs in head.items():
            ours.get_parameter(name).copy_(tensors[theirs])
    return hf, ours


def test_masked_lm_equals_hugging_face_bert_for_masked_lm():
    hf, ours = _hf_masked_lm()
    torch.manual_seed(1)
    ids = torch.randint(0, 53, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 5:], mask[2, 2:] = False, False  # two padded rows
    types = torch.zeros_like(ids)
    types[0, 4:] = 1  # a sentence pair
    with torch.no_grad():
        theirs = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=types).logits
        mine = ours(ids, attention_mask=mask, token_type_ids=types).logits  # (B, T, V)
    assert mine.shape == (3, 9, 53)
    torch.testing.assert_close(mine[mask], theirs[mask], atol=1e-5, rtol=1e-5)


def test_masked_lm_loss_equals_hugging_face_loss_on_the_labelled_positions_only():
    hf, ours = _hf_masked_lm()
    torch.manual_seed(2)
    ids = torch.randint(0, 53, (2, 8))
    labels = torch.full_like(ids, -100)
    labels[0, 1], labels[1, 3], labels[1, 6] = 5, 7, 11
    with torch.no_grad():
        theirs = hf(input_ids=ids, labels=labels)
        mine = ours(ids, targets=labels)
    torch.testing.assert_close(mine.loss, theirs.loss, atol=1e-5, rtol=1e-5)
    picked = mine.logits[labels != -100]  # (3, V): only these three positions count
    torch.testing.assert_close(mine.loss, F.cross_entropy(picked, labels[labels != -100]))


def test_masked_lm_output_layer_is_tied_to_the_token_embedding():
    from course_lib.models import MaskedLM

    model = MaskedLM(EncoderConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1,
                                   max_len=8))
    assert model.lm_head.weight is model.encoder.embeddings.token.weight  # one storage
    assert model.lm_head.bias.shape == (30,)
    # encoder + dense D->D + LayerNorm + output bias; the (V, D) matrix counted once
    head = 16 * 16 + 16 + 2 * 16 + 30
    assert count_parameters(model) == count_parameters(model.encoder) + head
    model(torch.randint(0, 30, (1, 5)), targets=torch.randint(0, 30, (1, 5))).loss.backward()
    assert model.encoder.embeddings.token.weight.grad is model.lm_head.weight.grad


def test_masked_lm_bad_arguments_name_the_argument():
    from course_lib.models import MaskedLM

    model = MaskedLM(EncoderConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1,
                                   max_len=8))
    with pytest.raises(TypeError, match="EncoderConfig"):
        MaskedLM(DecoderConfig(vocab_size=30, d_model=16, n_heads=2, n_layers=1, max_len=8))
    with pytest.raises(ValueError, match="targets"):
        model(torch.randint(0, 30, (2, 5)), targets=torch.randint(0, 30, (2, 4)))
    with pytest.raises(ValueError, match="ids"):
        model(torch.randint(0, 31, (2, 5)) + 30)


# --------------------------------------------------------- the Llama-style decoder switches


def test_default_switches_build_the_same_decoder_bit_for_bit():
    """Spelling out the defaults (norm, ffn, n_kv_heads, rope_theta) changes nothing: the same
    parameters from the same seed, the same logits exactly."""
    kw = dict(vocab_size=13, d_model=16, n_heads=4, n_layers=2, positions="rope")
    torch.manual_seed(0)
    plain = DecoderLM(DecoderConfig(**kw)).eval()
    torch.manual_seed(0)
    spelled = DecoderLM(DecoderConfig(**kw, norm="layer", ffn="mlp", n_kv_heads=4,
                                      rope_theta=10000.0)).eval()
    assert plain.state_dict().keys() == spelled.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(),
                                                  spelled.state_dict().values(), strict=True))
    ids = torch.randint(0, 13, (2, 7))
    assert torch.equal(plain(ids).logits, spelled(ids).logits)
    assert type(plain.final_norm) is torch.nn.LayerNorm


def test_a_llama_style_decoder_picks_its_norms_and_feed_forward_from_the_config():
    config = DecoderConfig(vocab_size=13, d_model=16, n_heads=4, n_layers=2, positions="rope",
                           norm="rms", ffn="swiglu", n_kv_heads=2, rope_theta=500.0, bias=False)
    model = DecoderLM(config)
    block = model.blocks[0]
    assert type(block.attn_norm) is type(block.ff_norm) is type(model.final_norm) \
        is torch.nn.RMSNorm
    assert type(block.ff).__name__ == "SwiGLU" and block.self_attn.n_kv_heads == 2
    assert block.self_attn.rotary.base == 500.0
    parts = parameter_breakdown(model)
    assert sum(parts.values()) == count_parameters(model) and parts["feed-forward"] == \
        2 * 3 * 16 * 64


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_llama_style_parameter_counts_on_meta_equal_hugging_face_llama(n_kv_heads):
    """count_parameters works without allocating (device "meta"), and a Llama-style DecoderLM
    has exactly as many parameters as transformers' LlamaForCausalLM of the same sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=n_kv_heads, intermediate_size=96, tie_word_embeddings=False)
    config = DecoderConfig(vocab_size=97, d_model=64, n_heads=4, n_layers=2, d_ff=96,
                           positions="rope", bias=False, tie_embeddings=False, norm="rms",
                           ffn="swiglu", n_kv_heads=n_kv_heads)
    with torch.device("meta"):
        ours = DecoderLM(config)
        theirs = LlamaForCausalLM(LlamaConfig(**sizes))
    assert ours.lm_head.weight.is_meta
    assert count_parameters(ours) == count_parameters(theirs)
    d_head = 16  # W_k and W_v shrink with the key/value heads
    attention = 2 * (2 * 64 * 64 + 2 * n_kv_heads * d_head * 64)  # 2 layers: W_q, W_o, W_k, W_v
    assert parameter_breakdown(ours)["attention"] == attention


# --------------------------------------------------------------------------------------------
# An attention-only decoder (ffn="none", chapter 11)


def test_an_attention_only_decoder_has_no_feed_forward_weights():
    sizes = dict(vocab_size=13, d_model=16, n_heads=2, n_layers=2, max_len=12)
    full = DecoderLM(DecoderConfig(**sizes))
    attn_only = DecoderLM(DecoderConfig(**sizes, ffn="none"))
    ffn = sum(p.numel() for b in full.blocks for m in (b.ff, b.ff_norm) for p in m.parameters())
    assert count_parameters(attn_only) == count_parameters(full) - ffn
    assert all(b.ff is None and b.ff_norm is None for b in attn_only.blocks)
    assert not any(".ff" in name for name, _ in attn_only.named_parameters())


@pytest.mark.parametrize("norm_first", [True, False])
def test_an_attention_only_decoder_adds_only_attention_to_the_stream(norm_first):
    config = DecoderConfig(vocab_size=13, d_model=16, n_heads=2, n_layers=2, max_len=12,
                           ffn="none", norm_first=norm_first)
    model = DecoderLM(config).eval()
    ids = torch.randint(13, (3, 9), generator=torch.Generator().manual_seed(0))
    x = model.embeddings(ids)  # (B, T, D)
    for block in model.blocks:  # by hand: the attention sublayer, and nothing after it
        if norm_first:
            x = x + block.self_attn(block.attn_norm(x), is_causal=True)[0]
        else:
            x = block.attn_norm(x + block.self_attn(x, is_causal=True)[0])
    if model.final_norm is not None:
        x = model.final_norm(x)
    torch.testing.assert_close(model(ids).logits, model.lm_head(x))


# ----------------------------------------------------------------- torch.compile, whole graphs

def _compiled_graph_breaks(model: torch.nn.Module, *args, **kwargs) -> tuple[int, object]:
    """Compile ``model`` (dynamo only, the eager backend: no code generation) and count the
    graph breaks of one call; return the count and the compiled call's output."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(model, backend="eager", fullgraph=False)(*args, **kwargs)
    return sum(counters["graph_break"].values()), out


_COMPILE_CASES = {
    "decoder": lambda: (_gpt(pad_id=0), dict(targets=_IDS, attention_mask=_MASK)),
    "llama-style decoder": lambda: (
        _gpt(positions="rope", norm="rms", ffn="swiglu", n_kv_heads=1, bias=False),
        dict(targets=_IDS)),
    "alibi decoder with attentions": lambda: (_gpt(positions="alibi"),
                                              dict(output_attentions=True)),
    "encoder": lambda: (_small_encoder(pad_id=0), dict(attention_mask=_MASK)),
    "masked LM": lambda: (_masked_lm(), dict(targets=torch.where(_IDS % 2 == 0, _IDS, -100))),
}
_IDS = torch.tensor([[3, 5, 7, 2, 9, 4], [1, 8, 6, 2, 0, 0]])
_MASK = _IDS != 0


def _masked_lm():
    from course_lib.models import MaskedLM
    torch.manual_seed(0)
    return MaskedLM(EncoderConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2,
                                  max_len=12)).eval()


@pytest.mark.parametrize("case", list(_COMPILE_CASES))
def test_the_models_compile_without_graph_breaks(case):
    """The argument checks run in eager calls and stay out of the compiled graph: a check that
    read a value (``.item()``) or the checks' context variable would split the graph."""
    model, kwargs = _COMPILE_CASES[case]()
    breaks, out = _compiled_graph_breaks(model, _IDS, **kwargs)
    assert breaks == 0
    eager = model(_IDS, **kwargs)
    first = out.logits if hasattr(out, "logits") else out.last_hidden_state
    reference = eager.logits if hasattr(eager, "logits") else eager.last_hidden_state
    torch.testing.assert_close(first, reference)


def test_the_encoder_decoder_compiles_without_graph_breaks():
    model = _seq2seq().eval()
    src, tgt = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[1, 2, 3]])
    breaks, out = _compiled_graph_breaks(model, src, tgt, targets=tgt)
    assert breaks == 0
    torch.testing.assert_close(out.loss, model(src, tgt, targets=tgt).loss)


def test_the_graph_break_counter_can_fail():
    def reads_a_value(x):
        return x * int(x.sum().item())

    breaks, _ = _compiled_graph_breaks(reads_a_value, torch.ones(3))
    assert breaks >= 1


def test_eager_calls_still_check_after_a_compiled_call():
    model = _gpt()
    _compiled_graph_breaks(model, _IDS)
    with pytest.raises(ValueError, match="ids"):
        model(torch.tensor([[3, 99]]))  # 99 is outside the vocabulary of 20
