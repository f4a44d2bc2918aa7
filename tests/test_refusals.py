"""Calls that used to return a wrong result without a word, or a false all-clear: each now
stops with a message that names the problem (one test per kind of mistake)."""

from __future__ import annotations

import pytest
import torch

from course_lib import DecoderConfig, DecoderLM
from course_lib.attention import MultiHeadAttention, padding_mask
from course_lib.bpe import BPETokenizer
from course_lib.cache import KVCache
from course_lib.configs import EncoderConfig, EncoderDecoderConfig
from course_lib.efficient import online_softmax_stats
from course_lib.instruments import gym
from course_lib.instruments.divergence import first_divergence
from course_lib.instruments.induction import half_losses, induction_model, train_induction
from course_lib.instruments.measure import kernel_used, peak_memory
from course_lib.instruments.probes import (
    ablate_head_path,
    induction_score,
    logit_lens,
    previous_token_score,
)
from course_lib.instruments.tokens import bits_per_character
from course_lib.layers import LayerNorm, RMSNorm, make_norm
from course_lib.models import Encoder, MaskedLM
from course_lib.pretrained import config_from_llama, load_llama_weights, rope_half_to_interleaved
from course_lib.rnn import gradient_norms
from course_lib.tasks import mask_tokens
from course_lib.tokenizer import CharTokenizer
from course_lib.train import TrainConfig, lr_schedule, train


def decoder(n_layers=1, d_model=16, **kwargs):
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=10, d_model=d_model, n_heads=2, n_layers=n_layers,
                                   max_len=16, **kwargs)).eval()


def ids(b=1, t=4):
    return torch.zeros(b, t, dtype=torch.long)


def test_a_cache_filled_by_a_model_of_other_depth_is_refused():
    cache = KVCache()
    decoder(n_layers=2)(ids(), past_key_values=cache)
    with pytest.raises(ValueError, match="past_key_values holds 2 layers but this model has 1"):
        decoder(n_layers=1)(ids(t=1), past_key_values=cache)


def test_a_loss_with_nothing_to_predict_says_so_instead_of_nan():
    model = MaskedLM(EncoderConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, max_len=16))
    with pytest.raises(ValueError, match="nothing to predict"):
        model(ids(), targets=torch.full((1, 4), -100))
    with pytest.raises(ValueError, match="nothing to predict"):
        decoder()(ids(), targets=torch.full((1, 4), -100))


@pytest.mark.parametrize("eps", [0, -1e-5, float("nan"), "1e-5"])
@pytest.mark.parametrize("build", [lambda eps: LayerNorm(8, eps=eps),
                                   lambda eps: RMSNorm(8, eps=eps),
                                   lambda eps: make_norm("layer", 8, eps=eps),
                                   lambda eps: make_norm("rms", 8, eps=eps)])
def test_norms_refuse_an_eps_that_is_not_a_positive_number(build, eps):
    with pytest.raises((ValueError, TypeError), match="eps must be a number > 0"):
        build(eps)


def test_rope_theta_without_rope_and_a_negative_step_are_refused():
    with pytest.raises(ValueError, match="rope_theta=500000.0 is the RoPE base"):
        DecoderConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, max_len=16,
                      rope_theta=500000.0)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        lr_schedule(-1, lr=1e-3, min_lr=1e-4, warmup_iters=2, decay_iters=10)


@pytest.fixture(scope="module")
def llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    return config.to_dict(), transformers.LlamaForCausalLM(config).state_dict()


def test_a_checkpoint_that_does_not_fit_is_not_loaded_in_part(llama):
    config, state = llama
    tied = DecoderLM(config_from_llama({**config, "tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens"):
        load_llama_weights(tied, state)
    model = DecoderLM(config_from_llama(config))
    before = model.final_norm.weight.clone()
    with pytest.raises(ValueError, match="not floating point: 'model.norm.weight'"):
        load_llama_weights(model, {**state, "model.norm.weight": torch.ones(16, dtype=torch.long)})
    assert torch.equal(model.final_norm.weight, before), "nothing is written before the checks"
    assert load_llama_weights(model, state) == []


def test_a_config_with_a_string_for_a_boolean_is_refused(llama):
    config, _ = llama
    with pytest.raises(TypeError, match="'tie_word_embeddings' must be True or False"):
        config_from_llama({**config, "tie_word_embeddings": "false"})


def test_instruments_refuse_what_they_cannot_measure():
    model = decoder(n_layers=2, dropout=0.1)
    with pytest.raises(ValueError, match="parts is empty"):
        with ablate_head_path(model, 0, 0, into_layer=1, parts=[]):
            pass
    with pytest.raises(ValueError, match="training mode and has dropout"):
        logit_lens(model.train(), ids())
    assert logit_lens(model.eval(), ids()).shape == (3, 1, 4, 10)
    with pytest.raises(ValueError, match="L >= 2"):
        half_losses(model, ids(b=2, t=2))  # segments of one token: no second half to score
    with pytest.raises(ValueError, match="B >= 1"):
        half_losses(model, ids(b=0, t=8))


def test_an_empty_batch_or_no_draws_is_refused_instead_of_giving_nan():
    for score in (previous_token_score, lambda w: induction_score(w, 2)):
        with pytest.raises(ValueError, match=r"weights has shape \(0, 2, 4, 4\): no example"):
            score(torch.rand(0, 2, 4, 4))  # (B=0, H, T, T): an empty score, NaN once averaged
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        gym.sample_frequencies(gym.sample_with_temperature, torch.randn(5), 1.0, n=0)


def test_a_string_for_a_flag_and_a_station_of_width_zero_are_refused():
    with pytest.raises(TypeError, match="progress must be True or False, got 'no'"):
        train_induction(induction_model(1, d_model=16), steps=1, progress="no")  # was True
    with pytest.raises(ValueError, match="d_model must be an integer >= 1, got 0"):
        gym.DisagreeingAttention(0, 2)  # built a layer of 0 features


def test_models_of_other_sizes_are_not_compared_module_by_module():
    small, large = decoder(d_model=16), decoder(d_model=32)
    with pytest.raises(ValueError, match="cannot be compared.*shapes"):
        first_divergence(small, large, lambda model: model(ids()))


@pytest.mark.parametrize(("x", "kwargs", "message"), [
    (torch.randn(5, 4), {}, r"\(B, T, D\): add a batch dimension"),  # would permute features
    (torch.randn(2, 1, 4), {}, "a permutation needs two or more"),  # nothing can move: gap 0
    (torch.tensor([[[float("nan")], [1.0]]]), {}, "NaN would hide any difference"),
    (torch.randn(1, 3, 4), {"seed": 1.5}, "seed must be an integer"),
])
def test_the_permutation_gap_refuses_inputs_it_cannot_judge(x, kwargs, message):
    from course_lib.instruments.gym import permutation_gap

    with pytest.raises((ValueError, TypeError), match=message):
        permutation_gap(lambda h: 2 * h, x, **kwargs)
    with pytest.raises(ValueError, match="fn must return a \\(B, T, ...\\) tensor"):
        permutation_gap(lambda h: h[:, :-1], torch.randn(1, 3, 4))  # drops a position


def test_attention_variants_and_metrics_refuse_what_they_would_get_wrong():
    from course_lib.efficient import low_rank_attention, online_softmax_stats
    from course_lib.metrics import alignment_score

    q = k = v = torch.randn(1, 1, 8, 4)  # (B, H, S, Dh)
    with pytest.raises(ValueError, match="needs R <= S"):
        low_rank_attention(q, k, v, torch.randn(32, 8), torch.randn(32, 8))
    with pytest.raises(TypeError, match="a list of tensors, got one tensor"):
        online_softmax_stats(torch.randn(3, 4))  # its rows would be taken for blocks
    weights = torch.softmax(torch.randn(2, 4), dim=-1)  # (T, S) with S = 4 keys
    with pytest.raises(ValueError, match="outside 0..3"):
        alignment_score(weights, torch.tensor([0, 4]))  # 4 is no key: it would score 0.0
    assert alignment_score(weights, weights.argmax(-1)) == 1.0


def test_a_layer_cache_refuses_keys_whose_heads_are_not_split():
    from course_lib.cache import LayerKVCache

    cache = LayerKVCache()
    with pytest.raises(ValueError, match="split the heads before caching"):
        cache.update(torch.randn(1, 3, 8), torch.randn(1, 3, 8))  # (B, T, D): stored as is before
    with pytest.raises(ValueError, match=r"value_states has shape \(1, 2, 5, 4\): T=5, but key_states has T=3"):
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4))
    keys, values = cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    assert keys.shape == values.shape == (1, 2, 3, 4) and cache.get_seq_length() == 3


# Calls that used to die deep inside torch or Python with a message that named something else.

def _train(model, callback):
    batch = {"ids": ids(2, 8), "targets": ids(2, 8)}
    train(model, lambda: batch, TrainConfig(max_iters=2, eval_interval=1, eval_iters=1,
                                            warmup_iters=0),
          val_batches=lambda: batch, callback=callback, progress=False)


def _block_with_narrow_ffn():
    model = decoder()
    model.blocks[0].ff = torch.nn.Linear(16, 8)  # a learner's replacement of the wrong width
    return model


@pytest.mark.parametrize("call, error, message", [
    (lambda: decoder()(ids(b=0)), ValueError, r"ids is empty \(shape \(0, 4\)\)"),
    (lambda: logit_lens(decoder(), ids(b=0)), ValueError, "ids is empty"),
    (lambda: mask_tokens(
        ids(b=0), mask_id=1, vocab_size=10), ValueError, "ids is empty"),
    (lambda: rope_half_to_interleaved(
        torch.randn(16, 16), 3), ValueError, "16 rows, which n_heads=3 heads cannot share"),
    (lambda: half_losses(
        Encoder(EncoderConfig(vocab_size=10, d_model=16, n_heads=2, n_layers=1, max_len=16)),
        ids(t=8)), TypeError, "model must be a course_lib DecoderLM.*got Encoder"),
    (lambda: train_induction(
        torch.nn.Linear(3, 3), steps=1), TypeError, "must be a course_lib DecoderLM.*got Linear"),
    (lambda: train_induction(
        decoder(), steps=1, callback=lambda step: None, progress=False), TypeError,
     r"callback must be a function callback\(step, log\): it is called with 2 arguments"),
    (lambda: _train(decoder(), lambda: None), TypeError,
     r"callback\(step, history\): it is called with 2 arguments, but its signature is \(\)"),
    (lambda: EncoderDecoderConfig.shared(
        10, 10, d_model=16, n_heads=2, max_src_len=0), ValueError, "max_src_len must be"),
    (lambda: _block_with_narrow_ffn()(ids()), ValueError,
     r"block.ff maps 16 features to 8.*residual x \+ ff\(x\)"),
    (lambda: bits_per_character(  # an AttributeError: no .logits
        Encoder(EncoderConfig(vocab_size=300, d_model=16, n_heads=2, n_layers=1, max_len=16)),
        BPETokenizer([]), "hello world", block_size=8), TypeError,
     "model must be a decoder-only language model such as a DecoderLM.*got Encoder"),
    (lambda: train_induction(  # died inside autograd: no tensor requires grad
        induction_model(1, d_model=16).requires_grad_(False), steps=1, progress=False),
     ValueError, "model has no parameter that requires grad"),
    (lambda: ablate_head_path(decoder(n_layers=2), 0, 5, into_layer=1).__enter__(), ValueError,
     r"^head must be a head of block 0, 0..1 \(n_heads=2\), got 5"),  # said "heads contains 5"
    (lambda: peak_memory(lambda x: x + 1), TypeError,
     r"fn must be a function with no arguments, called as fn\(\): it is called with 0 "
     r"arguments, but its signature is \(x\)"),
    (lambda: kernel_used(lambda q, k, v: None), TypeError, r"fn\(\).*signature is \(q, k, v\)"),
])
def test_cryptic_errors_now_name_the_problem(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_cache_of_another_batch_or_other_heads_says_which():
    cache = KVCache()
    decoder(n_layers=1)(ids(b=2), past_key_values=cache)
    with pytest.raises(ValueError, match="^past_key_values holds.*for another batch"):
        decoder(n_layers=1)(ids(b=3, t=1), past_key_values=cache)
    torch.manual_seed(0)
    four_heads = DecoderLM(DecoderConfig(vocab_size=10, d_model=16, n_heads=4, n_layers=1,
                                         max_len=16)).eval()
    with pytest.raises(ValueError, match="^past_key_values holds.*other heads or head widths"):
        four_heads(ids(b=2, t=1), past_key_values=cache)


@pytest.mark.parametrize("call, error, message", [
    (lambda: gym.run_cached(MultiHeadAttention(16, 4), torch.randn(1, 6, 16), 2.0), TypeError,
     "split must be an integer"),
    (lambda: gym.run_cached(MultiHeadAttention(16, 4), torch.randn(1, 6, 16), -1), ValueError,
     r"split must be 1..T = 1..6"),
    (lambda: gym.repeated_token_spread(lambda h: h, 0), ValueError, "d_model must be"),
    (lambda: gym.sample_frequencies(gym.sample_with_temperature, torch.randn(5), 1.0, n=-5),
     ValueError, "n must be an integer >= 1, got -5"),  # torch: integer multiplication overflow
    (lambda: gym.TooFastAttention(10, 3)(torch.randn(1, 3, 10)), ValueError,
     "d_model=10 is not divisible by n_heads=3"),  # RuntimeError: shape '[1, 3, 3, 3]' is invalid
    (lambda: gym.DisagreeingAttention(16, 0), ValueError,
     "n_heads must be an integer >= 1, got 0"),  # ZeroDivisionError
    (lambda: gym.sample_frequencies(gym.sample_with_temperature, torch.randn(5), "1"), TypeError,
     "temperature must be a number"),
])
def test_the_gym_instruments_name_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call()


# Messages that named a neighbouring word instead of the argument the learner passed, and
# calls that died deep inside torch or Python.

@pytest.mark.parametrize("call, error, message", [
    (lambda: MultiHeadAttention(16, 2, rope=True, rope_theta=0.0), ValueError,
     r"^rope_theta must be a number > 0"),  # said "base", RotaryEmbedding's word
    (lambda: CharTokenizer.from_text(""), ValueError, r"^text is empty"),  # said "chars"
    (lambda: CharTokenizer.from_text(None), TypeError, r"^text must be a str"),
    (lambda: gradient_norms("rnn", torch.randn(3, 2)), TypeError,
     r"^fn must be a function"),  # 'str' object is not callable
    (lambda: gradient_norms(lambda a, b: a, torch.randn(3, 2)), TypeError,
     r"^fn must be a function.*called with 1 arguments"),
    (lambda: make_norm("rms", "16"), TypeError, r"^d_model must be an integer.*16 without quotes"),
    (lambda: padding_mask("ab"), TypeError, r"^lengths must be B integers"),
    (lambda: online_softmax_stats(iter([])), ValueError, r"^blocks is empty"),
    (lambda: online_softmax_stats([torch.zeros(2, 3), torch.zeros(3, 3)]), ValueError,
     r"^blocks\[1\] has shape \(3, 3\)"),
])
def test_messages_name_the_argument_the_learner_passed(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_cache_names_the_argument_it_was_passed_as():
    cache = KVCache()
    decoder(n_layers=1)(ids(b=2), past_key_values=cache)
    with pytest.raises(ValueError, match=r"^past_key_values holds"):
        decoder(n_layers=1)(ids(b=3, t=1), past_key_values=cache)
    with pytest.raises(ValueError, match=r"^past_key_value holds"):
        MultiHeadAttention(16, 2)(torch.randn(3, 1, 16), past_key_value=cache.layer(0))
    keys = cache.layer(0).keys
    with pytest.raises(ValueError, match=r"^the cache holds .*Dv"):  # values of another width
        cache.layer(0).update(keys[:, :, :1], torch.zeros(*keys.shape[:2], 1, 5))
