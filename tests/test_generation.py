"""Generation: the sampling rules (temperature, top-k, top-p) against Hugging Face's logits
warpers and as properties, and the key/value cache: cached generation gives exactly the tokens
of uncached generation (tests/test_models.py covers the plain generation loops)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import on_devices
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.nn.attention.bias import causal_lower_right
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from course_lib.attention import MultiHeadAttention
from course_lib.cache import KVCache, LayerKVCache
from course_lib.configs import DecoderConfig, EncoderDecoderConfig
from course_lib.generation import (
    generate,
    next_token_probs,
    sample_next_token,
)
from course_lib.models import DecoderLM, EncoderDecoder

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


# ------------------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("positions", POSITIONS)
def test_cached_logits_equal_the_full_forward_pass(positions):
    """A 4-token prompt, then 1 token, then 5 at once: the same logits as one pass."""
    model = _gpt(positions)
    ids = torch.randint(0, 23, (3, 10), generator=torch.Generator().manual_seed(1))
    cache = KVCache()
    pieces = [model(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 4), (4, 5),
                                                                             (5, 10))]
    torch.testing.assert_close(torch.cat(pieces, 1), model(ids).logits, atol=2e-6, rtol=1e-5)
    assert cache.get_seq_length() == 10 and len(cache) == 3
    assert cache.layers[2].keys.shape == (3, 4, 10, 8)  # (B, H, S, Dh)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("prompt_len", [1, 5])
def test_cached_generation_gives_exactly_the_uncached_tokens(positions, prompt_len):
    model = _gpt(positions)  # max_len 16: 30 new tokens run past the context
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


@on_devices
@pytest.mark.parametrize("t_new", [1, 3])
def test_attention_with_a_cache_equals_sdpa_with_a_lower_right_causal_mask(device, t_new):
    """The new queries sit at the end: PyTorch's causal_lower_right, not is_causal=True."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4).to(device).eval()
    x = torch.randn(2, 5 + t_new, 16, device=device)
    cache = LayerKVCache()
    layer(x[:, :5], is_causal=True, past_key_value=cache)
    out, _ = layer(x[:, 5:], is_causal=True, past_key_value=cache)
    q, k, v = layer.qkv_proj(x).chunk(3, dim=-1)
    q, k, v = (t.view(2, -1, 4, 4).transpose(1, 2) for t in (q, k, v))  # (B, H, S, Dh)
    mask = causal_lower_right(t_new, 5 + t_new)
    expected = F.scaled_dot_product_attention(q[:, :, 5:], k, v, attn_mask=mask)
    expected = layer.out_proj(expected.transpose(1, 2).reshape(2, t_new, 16))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    top_left = F.scaled_dot_product_attention(q[:, :, 5:], k, v, is_causal=True)
    if t_new > 1:  # the top-left mask hides keys the new queries must see
        assert not torch.allclose(layer.out_proj(top_left.transpose(1, 2).reshape(2, t_new, 16)),
                                  expected, atol=1e-4)


def test_attention_weights_with_a_cache_follow_the_lower_right_mask():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).eval()
    cache = LayerKVCache()
    layer(torch.randn(1, 3, 8), is_causal=True, past_key_value=cache)
    _, weights = layer(torch.randn(1, 2, 8), is_causal=True, past_key_value=cache,
                       return_weights=True)
    assert weights.shape == (1, 2, 2, 5)
    assert (weights[0, :, 0, 4] == 0).all() and (weights[0, :, 0, :4] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(1, 2, 2))


def test_kv_cache_update_crop_and_length():
    cache = KVCache()
    assert cache.get_seq_length() == 0 and len(cache) == 0
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    keys, values = cache.update(k, v, 1)
    assert len(cache) == 2 and cache.get_seq_length() == 0 and cache.get_seq_length(1) == 4
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 1)
    assert keys.shape == (2, 3, 5, 5) and torch.equal(values[:, :, 4], v[:, :, 0])
    cache.crop(-2)
    assert cache.get_seq_length(1) == 3 and torch.equal(cache.layers[1].keys, k[:, :, :3])
    cache.crop(1)
    assert cache.get_seq_length(1) == 1
    assert "KVCache(layers=2" in repr(cache)


def test_a_cropped_cache_continues_like_a_fresh_pass():
    model = _gpt()
    ids = torch.randint(0, 23, (1, 9), generator=torch.Generator().manual_seed(4))
    cache = KVCache()
    model(ids, past_key_values=cache)
    cache.crop(6)  # take back the last three tokens
    logits = model(ids[:, 6:], past_key_values=cache).logits
    torch.testing.assert_close(logits, model(ids).logits[:, 6:], atol=2e-6, rtol=1e-5)


# ------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("top_p, error, message", [
    (0.0, ValueError, r"top_p must be in \(0, 1\].*got 0.0"),
    (1.5, ValueError, r"top_p must be in \(0, 1\].*got 1.5"),
    (-0.1, ValueError, "top_p must be in"),
    ("0.9", TypeError, "top_p must be a number in \\(0, 1\\] or None, got '0.9'"),
    (True, TypeError, "top_p must be a number"),
])
def test_bad_top_p_is_refused_with_its_value(top_p, error, message):
    model = _gpt()
    with pytest.raises(error, match=message):
        model.generate(torch.tensor([[1]]), 2, top_p=top_p)
    with pytest.raises(error, match=message):
        next_token_probs(torch.zeros(1, 3), top_p=top_p)


def test_bad_sampling_arguments_name_themselves():
    with pytest.raises(ValueError, match=r"temperature must be >= 0 and finite .*got inf"):
        sample_next_token(torch.zeros(1, 3), temperature=float("inf"))
    with pytest.raises(ValueError, match=r"temperature must be >= 0.*got nan"):
        next_token_probs(torch.zeros(1, 3), temperature=float("nan"))
    with pytest.raises(ValueError, match=r"logits .*\(B, V\)"):
        next_token_probs(torch.zeros(3))
    with pytest.raises(TypeError, match="use_cache must be True or False, got 1"):
        _gpt().generate(torch.tensor([[1]]), 2, use_cache=1)


def test_bad_caches_are_refused_with_clear_messages():
    model = _gpt()  # learned positions, max_len 16, 3 layers
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(TypeError, match="past_key_values must be a course_lib.cache."
                                        "KVCache .*got tuple"):
        model(ids, past_key_values=(torch.zeros(1), torch.zeros(1)))
    cache = KVCache()
    model(torch.randint(0, 23, (1, 14)), past_key_values=cache)
    with pytest.raises(ValueError, match="holds 14 tokens and ids adds 3, more than this "
                                         "model's context of max_len=16"):
        model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="filled with a batch of 1 sequences but ids has "
                                         "batch size 2"):
        model(torch.tensor([[1], [2]]), past_key_values=cache)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 1\) but with 14 "
                                         r"cached tokens .*\(1, 15\)"):
        model(torch.tensor([[1]]), past_key_values=cache,
              attention_mask=torch.ones(1, 1, dtype=torch.bool))
    deeper = KVCache()
    for i in range(4):
        deeper.layer(i)
    with pytest.raises(ValueError, match="holds 4 layers but this model has 3"):
        model(ids, past_key_values=deeper)


def test_padding_with_a_cache_needs_the_full_attention_mask():
    model = _gpt(pad_id=0)
    cache = KVCache()
    model(torch.tensor([[0, 5, 6]]), past_key_values=cache)  # an empty cache: derived as usual
    with pytest.raises(ValueError, match=r"pad_id is set.*pass attention_mask of shape \(1, 4\)"):
        model(torch.tensor([[7]]), past_key_values=cache)
    mask = torch.tensor([[False, True, True, True]])
    out = model(torch.tensor([[7]]), past_key_values=cache, attention_mask=mask).logits
    expected = model(torch.tensor([[0, 5, 6, 7]])).logits[:, -1:]
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_cross_attention_takes_no_cache():
    layer = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match="cross-attention \\(context=...\\) takes none"):
        layer(torch.randn(1, 2, 8), torch.randn(1, 3, 8), past_key_value=LayerKVCache())


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
