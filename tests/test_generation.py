"""course_lib.generation: the sampling rules (temperature, top-k, top-p) against Hugging Face's
logits warpers and as properties, the generation loops, the key/value cache (cached generation
gives exactly the tokens of uncached generation), and the arguments they check."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from course_lib.cache import KVCache
from course_lib.configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from course_lib.generation import (
    generate,
    generate_seq2seq,
    next_token_probs,
    sample_next_token,
)
from course_lib.models import DecoderLM, Encoder, EncoderDecoder

POSITIONS = ["learned", "sinusoidal", "alibi", "rope", "none"]


def _gpt(positions="learned", max_len=16, pad_id=None, seed=0, **sizes):
    """A small decoder with large weights: its attention is far from uniform, so its tokens
    depend on positions and context, and any mismatch of a cache shows."""
    torch.manual_seed(seed)
    config = DecoderConfig(vocab_size=23, d_model=32, n_heads=4, n_layers=3, max_len=max_len,
                           positions=positions, pad_id=pad_id, **sizes)
    model = DecoderLM(config).eval()
    with torch.no_grad():
        for _name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


def _logits(seed, batch=3, vocab=12, scale=2.0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# -------------------------------------------------------------------------- sampling rules


@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 30),
       temperature=st.floats(0.2, 3.0), top_k=st.integers(1, 30),
       top_p=st.floats(0.05, 1.0))
def test_next_token_probs_equal_hugging_face_warpers(seed, vocab, temperature, top_k, top_p):
    """Temperature, then top-k, then top-p, as in Hugging Face's generate."""
    logits = _logits(seed, vocab=vocab, scale=3.0)
    ours = next_token_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    scores = TopKLogitsWarper(min(top_k, vocab))(None, scores)
    # a token whose preceding mass is within rounding of p could go either way: skip those
    probs = torch.softmax(scores, -1).sort(-1, descending=True).values
    before = probs.cumsum(-1) - probs
    assume(((before - top_p).abs() > 1e-5).all())
    scores = TopPLogitsWarper(top_p)(None, scores)
    torch.testing.assert_close(ours, torch.softmax(scores, -1))


@given(seed=st.integers(0, 2**16), vocab=st.integers(1, 30), top_p=st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_set_with_mass_at_least_p(seed, vocab, top_p):
    logits = _logits(seed, batch=2, vocab=vocab, scale=3.0)
    full = torch.softmax(logits, -1)
    kept = next_token_probs(logits, top_p=top_p) > 0  # (B, V)
    for row in range(2):
        mass = full[row][kept[row]].sum()
        assert mass >= top_p - 1e-6  # enough mass ...
        least = full[row][kept[row]].min()
        assert mass - least < top_p + 1e-6  # ... and no token more than needed
        # the kept tokens are the most likely ones
        if (~kept[row]).any():
            assert full[row][kept[row]].min() >= full[row][~kept[row]].max()


def test_top_p_keeps_the_token_that_crosses_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = next_token_probs(logits, top_p=0.7)  # 0.5 < 0.7 <= 0.5 + 0.3
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    exact = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))  # binary fractions: sums are exact
    torch.testing.assert_close(next_token_probs(exact, top_p=0.75),
                               torch.tensor([[2 / 3, 1 / 3, 0.0]]))
    tiny = next_token_probs(logits, top_p=1e-6)  # always at least the most likely token
    assert tiny.tolist() == [[1.0, 0.0, 0.0, 0.0]]
    assert (next_token_probs(logits, top_p=1.0) > 0).all()


@given(seed=st.integers(0, 2**16), vocab=st.integers(2, 25), top_k=st.integers(1, 6))
def test_top_k_never_samples_outside_the_k_best(seed, vocab, top_k):
    logits = _logits(seed, batch=4, vocab=vocab)
    best = torch.topk(logits, min(top_k, vocab), dim=-1).indices  # (B, k)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(20):
        ids = sample_next_token(logits, top_k=top_k, generator=gen, temperature=1.5)
        assert (best == ids[:, None]).any(-1).all()


def test_top_p_never_samples_outside_the_nucleus():
    logits = _logits(4, batch=2, vocab=10)
    allowed = next_token_probs(logits, top_p=0.6) > 0
    gen = torch.Generator().manual_seed(0)
    seen = torch.zeros_like(allowed)
    for _ in range(300):
        ids = sample_next_token(logits, top_p=0.6, generator=gen)
        seen[torch.arange(2), ids] = True
    assert torch.equal(seen, allowed)  # every allowed token appears, nothing else


def test_temperature_towards_zero_becomes_greedy():
    logits = _logits(1, batch=6, vocab=20)
    greedy = sample_next_token(logits, temperature=0)
    assert torch.equal(greedy, logits.argmax(-1))
    gen = torch.Generator().manual_seed(0)
    for temperature in (1e-2, 1e-3):
        for _ in range(10):
            assert torch.equal(sample_next_token(logits, temperature=temperature, generator=gen),
                               greedy)
    one_hot = next_token_probs(logits, temperature=0)
    assert torch.equal(one_hot, F.one_hot(greedy, 20).float())
    torch.testing.assert_close(next_token_probs(logits, temperature=1e-3), one_hot)


def test_temperature_sharpens_or_flattens_the_distribution():
    logits = _logits(2, batch=1, vocab=10)

    def entropy(p):
        return float(-(p * p.clamp_min(1e-30).log()).sum())

    cold, plain, hot = (next_token_probs(logits, temperature=t) for t in (0.5, 1.0, 2.0))
    assert entropy(cold) < entropy(plain) < entropy(hot) < math.log(10)
    torch.testing.assert_close(plain, torch.softmax(logits, -1))


def test_seeded_sampling_repeats_and_other_seeds_differ():
    model = _gpt()
    prompt = torch.tensor([[1, 2, 3]])
    runs = [generate(model, prompt, 12, top_p=0.9, top_k=8,
                     generator=torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_sampling_without_filters_is_unchanged_by_the_new_options():
    """top_p=None and top_p=1 draw exactly what plain temperature sampling draws."""
    logits = _logits(5, batch=4, vocab=30)
    draws = [sample_next_token(logits, temperature=0.7, generator=torch.Generator()
                               .manual_seed(9), **extra)
             for extra in ({}, {"top_p": None}, {"top_p": 1.0})]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[0], draws[2])


# ------------------------------------------------------------------ generating with the models


def _lm() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=20, d_model=16, n_heads=2, n_layers=2,
                                   max_len=12)).eval()


def _seq2seq() -> EncoderDecoder:
    torch.manual_seed(0)
    config = EncoderDecoderConfig.shared(15, 17, d_model=16, n_heads=2, max_src_len=10,
                                         max_tgt_len=10, pad_id=0)
    return EncoderDecoder(config).eval()


def test_generation_is_repeatable_and_respects_top_k():
    model = _lm()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    b = model.generate(prompt, 8, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b) and a.shape == (1, 11)
    assert torch.equal(a[:, :3], prompt)
    # generation past the context length keeps working (the model sees the last max_len)
    long = model.generate(prompt, 20, generator=torch.Generator().manual_seed(0))
    assert long.shape == (1, 23)
    assert model.generate(torch.tensor([4, 5]), 2).shape == (4,)

def test_greedy_and_top_k_sampling():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert sample_next_token(logits, temperature=0).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = {sample_next_token(logits, top_k=2, generator=gen).item() for _ in range(200)}
    assert draws == {1, 3}
    hot = {sample_next_token(logits, temperature=100.0, generator=gen).item() for _ in range(300)}
    assert hot == {0, 1, 2, 3}

def test_encoder_decoder_generation():
    model = _seq2seq()
    src = torch.randint(1, 15, (3, 7))
    out = model.generate(src, bos_id=1, max_new_tokens=5)
    assert out.shape == (3, 6) and (out[:, 0] == 1).all()
    # greedy decoding equals taking the argmax of a forward pass at each step
    step = model(src, out[:, :-1]).logits.argmax(-1)
    assert torch.equal(step, out[:, 1:])
    # learned target positions cap the new tokens at max_tgt_len (the last decoder input,
    # <bos> plus max_tgt_len - 1 tokens, fits the position table): 1 + 10 ids
    assert model.generate(src, bos_id=1, max_new_tokens=50).shape[1] == 11

def test_encoder_decoder_stops_at_eos():
    model = _seq2seq()
    src = torch.randint(1, 15, (2, 5))
    first = model.generate(src, bos_id=1, max_new_tokens=1)[:, 1]
    eos = int(first[0])
    out = model.generate(src, bos_id=1, max_new_tokens=9, eos_id=eos)
    assert out[0, 1] == eos
    assert (out[0, 1:] == eos).all()  # finished rows are filled with eos

def test_a_model_of_ones_own_can_generate():
    """generate reads the model's .config and the .logits of its output, nothing else."""

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(11, 11)
            self.config = DecoderConfig(vocab_size=11, d_model=8, n_heads=2, max_len=6)

        def forward(self, ids):
            return SimpleNamespace(logits=self.table(ids))

    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    out = generate(Bigram(), ids, 2, temperature=0)
    assert out.shape == (2, 6) and torch.equal(out[:, :4], ids)
    # a model whose forward takes no cache fails at once, naming what it does not take
    with pytest.raises(TypeError, match="attention_mask|past_key_values"):
        generate(Bigram(), ids, 2, use_cache=True)


def test_integer_source_masks_give_the_boolean_masks_tokens():
    model = _seq2seq()
    src = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 0]])  # padded with pad_id 0
    mask = (src != 0).long()
    assert torch.equal(
        generate_seq2seq(model, src, bos_id=1, max_new_tokens=3, src_attention_mask=mask),
        generate_seq2seq(model, src, bos_id=1, max_new_tokens=3, src_attention_mask=mask.bool()))


# ------------------------------------------------------------------------- the KV cache


# grouped-query attention: 2 key/value heads for 4 query heads; 1 (multi-query) with RoPE
GQA = [("rope", 2), ("rope", 1), ("learned", 2), ("alibi", 1)]
LLAMA_STYLE = dict(norm="rms", ffn="swiglu", bias=False)


@pytest.mark.parametrize("positions, n_kv_heads",
                         [(p, None) for p in POSITIONS] + GQA)
def test_cached_logits_equal_the_full_forward_pass(positions, n_kv_heads):
    """A 4-token prompt, then 1 token, then 5 at once: the same logits as one pass."""
    model = _gpt(positions, n_kv_heads=n_kv_heads)
    ids = torch.randint(0, 23, (3, 10), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    pieces = [model(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 4), (4, 5),
                                                                             (5, 10))]
    torch.testing.assert_close(torch.cat(pieces, 1), model(ids).logits, atol=2e-6, rtol=1e-5)
    assert cache.get_seq_length() == 10 and len(cache) == 3
    assert cache.layers[2].keys.shape == (3, n_kv_heads or 4, 10, 8)  # (B, Hkv, S, Dh)


@pytest.mark.parametrize("positions, n_kv_heads, style",
                         [(p, None, {}) for p in POSITIONS]
                         + [("rope", 2, {}), ("rope", 1, {}), ("rope", 2, LLAMA_STYLE)])
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_cached_generation_gives_exactly_the_uncached_tokens(positions, n_kv_heads, style,
                                                             prompt_len):
    model = _gpt(positions, n_kv_heads=n_kv_heads, **style)  # max_len 16: 30 tokens run past it
    prompt = torch.randint(0, 23, (2, prompt_len), generator=torch.Generator().manual_seed(2))
    for sampling in ({"temperature": 0}, {"temperature": 1.0}, {"top_k": 5, "top_p": 0.8}):
        runs = [generate(model, prompt, 30, use_cache=use_cache,
                         generator=torch.Generator().manual_seed(7), **sampling)
                for use_cache in (False, True)]
        assert torch.equal(runs[0], runs[1]), (positions, sampling)


def test_a_prompt_longer_than_the_context_is_cropped_with_or_without_the_cache():
    model = _gpt(max_len=8)
    prompt = torch.randint(0, 23, (1, 20), generator=torch.Generator().manual_seed(3))
    cached = generate(model, prompt, 5, temperature=0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 5, temperature=0))
    assert cached[0, 20] == model(prompt[:, -8:]).logits[0, -1].argmax()


def test_the_cache_fills_up_to_max_len_then_generation_slides_the_window():
    model = _gpt(max_len=8)
    calls = []
    hook = model.register_forward_pre_hook(
        lambda m, args, kwargs: calls.append((args[0].shape[1], kwargs.get("past_key_values")
                                              is not None)), with_kwargs=True)
    try:
        generate(model, torch.tensor([[1, 2, 3]]), 8, temperature=0, use_cache=True)
    finally:
        hook.remove()
    # the 3-token prompt, then one token per step until 8 tokens are in view, then the window
    assert calls == [(3, True), (1, True), (1, True), (1, True), (1, True), (1, True),
                     (8, False), (8, False)]


def test_cached_generation_with_padding_matches_uncached():
    model = _gpt(pad_id=0)
    prompt = torch.tensor([[5, 0, 7, 8], [0, 0, 3, 4]])  # pad tokens are masked as keys
    uncached, cached = (generate(model, prompt, 10, use_cache=use_cache,
                                 generator=torch.Generator().manual_seed(0))
                        for use_cache in (False, True))
    assert torch.equal(uncached, cached)


def test_cached_seq2seq_decoding_gives_exactly_the_uncached_tokens():
    torch.manual_seed(0)
    config = EncoderDecoderConfig.shared(20, 20, d_model=32, n_heads=2, max_src_len=12,
                                         max_tgt_len=12, pad_id=0)
    model = EncoderDecoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # large weights: varied tokens, so a mismatch would show
    src = torch.randint(3, 20, (4, 9), generator=torch.Generator().manual_seed(1))
    src[0, 6:] = 0
    for sampling in ({}, {"temperature": 1.0, "generator": None}):
        runs = []
        for use_cache in (False, True):
            if "generator" in sampling:
                sampling["generator"] = torch.Generator().manual_seed(5)
            runs.append(model.generate(src, bos_id=1, max_new_tokens=20, eos_id=2,
                                       use_cache=use_cache, **sampling))
        assert torch.equal(runs[0], runs[1])
        assert len(set(runs[0][:, 1:].flatten().tolist())) > 2


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("top_p, error, message", [
    (0.0, ValueError, r"^top_p .*> 0.*got 0\.0"),
    (1.5, ValueError, r"^top_p .*\(0, 1\].*1\.5"),
    (-0.1, ValueError, r"^top_p .*> 0.*-0\.1"),
    ("0.9", TypeError, r"^top_p .*'0\.9'"),
    (True, TypeError, r"^top_p .*True"),
])
def test_bad_top_p_is_refused_with_its_value(top_p, error, message):
    model = _gpt()
    with pytest.raises(error, match=message):
        model.generate(torch.tensor([[1]]), 2, top_p=top_p)
    with pytest.raises(error, match=message):
        next_token_probs(torch.zeros(1, 3), top_p=top_p)


@pytest.mark.parametrize("call, error, message", [
    (lambda: sample_next_token(torch.zeros(1, 3), temperature=-1), ValueError,
     r"^temperature .*>= 0.*-1"),
    (lambda: sample_next_token(torch.zeros(1, 3), temperature=float("inf")), ValueError,
     r"^temperature .*>= 0.*inf"),
    (lambda: next_token_probs(torch.zeros(1, 3), temperature=float("nan")), ValueError,
     r"^temperature .*>= 0.*nan"),
    (lambda: sample_next_token(torch.zeros(1, 3), temperature="hot"), TypeError,
     r"^temperature .*'hot'"),
    (lambda: next_token_probs(torch.zeros(3)), ValueError, r"^logits .*\(B, V\).*\(3,\)"),
    (lambda: _lm().generate(torch.tensor([[1]]), 2, use_cache=1), TypeError,
     r"^use_cache must be True or False, got 1"),
    (lambda: _lm().generate(torch.zeros(1, 2, dtype=torch.long), 3, temperature=None), TypeError,
     r"^temperature .*None"),
    (lambda: _lm().generate(torch.zeros(1, 2, dtype=torch.long), 3, top_k=0), ValueError,
     r"^top_k .*>= 1.*got 0"),
    (lambda: _lm().generate(torch.zeros(1, 2, dtype=torch.long), 2.5), TypeError,
     r"^max_new_tokens .*2\.5"),
    (lambda: _lm().generate(torch.zeros(1, 2, dtype=torch.long), 0), ValueError,
     r"^max_new_tokens .*>= 1.*got 0"),
], ids=["temperature-negative", "temperature-inf", "temperature-nan", "temperature-str",
        "logits-1d", "use_cache", "temperature-None", "top_k", "max_new_tokens-float",
        "max_new_tokens-0"])
def test_bad_sampling_arguments_name_themselves(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("prompt", [torch.zeros(1, 0, dtype=torch.long),
                                    torch.tensor([], dtype=torch.long)], ids=["2-D", "1-D"])
def test_generate_refuses_an_empty_prompt(prompt):
    with pytest.raises(ValueError, match=r"^ids is empty.*\(1, 0\)"):
        _lm().generate(prompt, 3)


@pytest.mark.parametrize("make, error, message", [
    (_seq2seq, TypeError, r"^model .*DecoderLM.*got EncoderDecoder.*generate_seq2seq"),
    (lambda: Encoder(EncoderConfig(vocab_size=20, d_model=16, n_heads=2)), TypeError,
     r"^model .*DecoderLM.*got Encoder"),
    (lambda: torch.nn.Linear(2, 2), TypeError, r"^model .*DecoderLM.*got Linear"),
    (lambda: _seq2seq().decoder, ValueError, r"^model needs an encoder.*EncoderDecoder\.generate"),
], ids=["EncoderDecoder", "Encoder", "Linear", "decoder-with-cross-attention"])
def test_generate_says_which_models_it_serves(make, error, message):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(error, match=message):
        generate(make(), ids, 2)
    if isinstance(make(), DecoderLM):  # the method says the same
        with pytest.raises(error, match=message):
            make().generate(ids, 2)


@pytest.mark.parametrize("call", [
    lambda: generate(_lm(), torch.tensor([[1, 2]]), 2, generator=42),
    lambda: _lm().generate(torch.tensor([[1, 2]]), 2, generator=42),
    lambda: generate_seq2seq(_seq2seq(), torch.tensor([[3, 4]]), bos_id=1, max_new_tokens=2,
                             temperature=1.0, generator=42),
    lambda: sample_next_token(torch.zeros(1, 3), generator=42),
], ids=["generate", "DecoderLM.generate", "generate_seq2seq", "sample_next_token"])
def test_a_seed_instead_of_a_generator_is_refused_by_name(call):
    with pytest.raises(TypeError, match=r"^generator .*torch\.Generator.*got 42.*manual_seed"):
        call()


SRC = torch.tensor([[3, 4, 5, 0, 0], [3, 4, 5, 6, 0]])  # (2, 5), padded with pad_id 0


@pytest.mark.parametrize("call, error, message", [
    (lambda: generate_seq2seq(_lm(), SRC, bos_id=1, max_new_tokens=2), TypeError,
     r"^model .*EncoderDecoder.*got DecoderLM.*generate"),
    (lambda: generate_seq2seq(_seq2seq(), SRC.float(), bos_id=1, max_new_tokens=2), ValueError,
     r"^src .*token ids.*float32"),
    (lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1.0, max_new_tokens=2), TypeError,
     r"^bos_id .*1\.0.*write 1"),
    (lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1, eos_id=17, max_new_tokens=2),
     ValueError, r"^eos_id is 17.*0\.\.16"),
    (lambda: _seq2seq().generate(SRC, bos_id=17, max_new_tokens=2), ValueError,
     r"^bos_id is 17.*0\.\.16"),
    (lambda: _seq2seq().generate(torch.ones(2, 11, dtype=torch.long), bos_id=1,
                                 max_new_tokens=2), ValueError,
     r"^src has 11 tokens.*max_src_len=10"),
    (lambda: generate_seq2seq(_seq2seq(), SRC, bos_id=1, max_new_tokens=2,
                              src_attention_mask=torch.ones(2, 5)), ValueError,
     r"^src_attention_mask .*float32.*src_attention_mask\.bool\(\)"),
], ids=["model", "float-src", "bos_id-type", "eos_id", "bos_id", "src-too-long", "float-mask"])
def test_generate_seq2seq_checks_its_model_src_and_ids(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_generate_seq2seq_takes_numpy_integer_ids():
    out = generate_seq2seq(_seq2seq(), SRC, bos_id=np.int64(1), max_new_tokens=2)
    assert out.shape == (2, 3) and (out[:, 0] == 1).all()


def test_bad_caches_are_refused_with_clear_messages():
    model = _gpt()  # learned positions, max_len 16, 3 layers
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match=r"^past_key_values .*KVCache.*got tuple"):
        model(ids, past_key_values=(torch.zeros(1), torch.zeros(1)))
    cache = KVCache()
    model(torch.randint(0, 23, (1, 14)), past_key_values=cache)
    with pytest.raises(ValueError, match=r"^ids has 3 tokens after 14 cached ones.*max_len=16"):
        model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match=r"^past_key_values holds .*\(1, 4, 8, 8\).*\(2, .*another batch"):
        model(torch.tensor([[1], [2]]), past_key_values=cache)
    with pytest.raises(ValueError, match=r"^attention_mask has shape \(1, 1\).*\(1, 15\)"):
        model(torch.tensor([[1]]), past_key_values=cache,
              attention_mask=torch.ones(1, 1, dtype=torch.bool))


def test_padding_with_a_cache_needs_the_full_attention_mask():
    model = _gpt(pad_id=0)
    cache = KVCache()
    model(torch.tensor([[0, 5, 6]]), past_key_values=cache)  # an empty cache: derived as usual
    with pytest.raises(ValueError, match=r"pad_id.*attention_mask \(1, 4\)"):
        model(torch.tensor([[7]]), past_key_values=cache)
    mask = torch.tensor([[False, True, True, True]])
    out = model(torch.tensor([[7]]), past_key_values=cache, attention_mask=mask).logits
    expected = model(torch.tensor([[0, 5, 6, 7]])).logits[:, -1:]
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_seq2seq_decoding_fills_every_target_position():
    """A decoder with max_tgt_len == tgt_in's length decodes max_len tokens: the longest
    target, its final <eos> included (the last decoder input has length max_len, which the
    model accepts, as it does in teacher forcing)."""
    from course_lib.tasks import word_order_task
    from course_lib.train import TrainConfig, random_batches, train

    task = word_order_task(600, seed=0)
    torch.manual_seed(0)
    config = EncoderDecoderConfig.shared(
        task.vocab.vocab_size, task.vocab.vocab_size, d_model=48, n_heads=2,
        n_encoder_layers=1, n_decoder_layers=1, max_src_len=task.src.shape[1],
        max_tgt_len=task.tgt_in.shape[1], pad_id=task.vocab.pad_id)
    model = EncoderDecoder(config)
    batches = random_batches({"src": task.src, "tgt": task.tgt_in, "targets": task.tgt_out}, 32,
                             generator=torch.Generator().manual_seed(0))
    train(model, batches, TrainConfig(max_iters=250, lr=3e-3, warmup_iters=10,
                                      eval_interval=250, eval_iters=1), progress=False)
    lengths = (task.tgt_out != -100).sum(1)  # words + <eos>
    longest = lengths == config.decoder.max_len  # targets that fill every position
    assert longest.any()
    src, gold = task.src[longest][:8], task.tgt_out[longest][:8]
    for use_cache in (False, True):
        out = model.generate(src, bos_id=task.vocab.bos_id, eos_id=task.vocab.eos_id,
                             max_new_tokens=50, use_cache=use_cache)
        assert out.shape == (len(src), 1 + config.decoder.max_len)
        assert (out[:, -1] == task.vocab.eos_id).all()
        assert torch.equal(out[:, 1:], gold)
