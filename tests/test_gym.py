"""course_lib.instruments.gym: each buggy module has its reference's parameters, differs from it
only through its planted mistake (the sampler: draws at temperature 1 whatever T), and the instrument the case names finds that mistake (and
finds nothing on the reference)."""

from __future__ import annotations

import pytest
import torch

from course_lib.attention import MultiHeadAttention
from course_lib.generation import next_token_probs, sample_next_token
from course_lib.instruments import gym
from course_lib.instruments.divergence import first_divergence
from course_lib.instruments.probes import future_leaks

D, H = 16, 4


def _pair(name, d_model=D, n_heads=H):
    """(buggy, reference) with the same weights, in eval mode."""
    return gym.suspect(name, d_model, n_heads, seed=3)


def _x(seq_len=6):
    return torch.randn(2, seq_len, D, generator=torch.Generator().manual_seed(4))


def _out(module, x, causal=False):
    out = module(x, is_causal=causal) if isinstance(module, MultiHeadAttention) else module(x)
    return out[0] if isinstance(out, tuple) else out


def test_there_are_four_module_cases_each_with_its_reference_parameters():
    assert sorted(gym.CASES) == ["cache", "disagrees", "rope", "too_fast"]
    for name in gym.CASES:
        buggy, ref = _pair(name)
        assert set(buggy.state_dict()) == set(ref.state_dict()), name
        assert gym.CASES[name].instrument
    with pytest.raises(ValueError, match="name must be one of"):
        gym.suspect("nope", D, H)


def test_show_prints_the_buggy_source(capsys):
    gym.show("too_fast")
    out = capsys.readouterr().out
    assert "class TooFastAttention" in out and "dim=-2" in out
    gym.show("temperature")
    assert "probs / temperature" in capsys.readouterr().out
    with pytest.raises(ValueError, match="name must be one of"):
        gym.show("nope")


def test_future_leaks_finds_the_softmax_over_the_queries():
    buggy, ref = _pair("too_fast")
    x = _x()
    assert not future_leaks(lambda h: buggy(h), x).is_causal
    assert future_leaks(lambda h: ref(h, is_causal=True)[0], x).is_causal


def test_the_scale_bug_vanishes_with_one_head_and_first_divergence_locates_it():
    buggy, ref = _pair("disagrees")
    x = _x()
    report = first_divergence(ref, buggy, lambda m: _out(m, x))
    assert report.divergence.candidate == "out_proj"
    one, one_ref = _pair("disagrees", n_heads=1)
    torch.testing.assert_close(one(x), one_ref(x)[0])


def test_the_repeated_token_test_finds_rope_on_the_values():
    buggy, ref = _pair("rope")
    assert gym.repeated_token_spread(lambda h: buggy(h), D) > 1e-2
    assert gym.repeated_token_spread(lambda h: ref(h)[0], D) < 1e-5
    x = _x()  # on other inputs the two differ too
    assert (buggy(x) - ref(x)[0]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="seq_len"):
        gym.repeated_token_spread(lambda h: ref(h)[0], D, seq_len=1)


def test_sample_frequencies_shows_the_temperature_does_nothing():
    logits = torch.randn(6, generator=torch.Generator().manual_seed(0)) * 1.5
    cold = gym.sample_frequencies(gym.sample_with_temperature, logits, 0.5)
    hot = gym.sample_frequencies(gym.sample_with_temperature, logits, 2.0)
    untouched = next_token_probs(logits[None])[0]
    assert (cold - untouched).abs().max() < 0.02 and (hot - untouched).abs().max() < 0.02

    def right(lo, t, g):
        return sample_next_token(lo, temperature=t, generator=g)

    cold = gym.sample_frequencies(right, logits, 0.5)
    torch.testing.assert_close(cold, next_token_probs(logits[None], temperature=0.5)[0],
                               atol=0.02, rtol=0)
    with pytest.raises(ValueError, match="logits"):
        gym.sample_frequencies(right, logits[None], 0.5)


def test_cached_differs_from_uncached_only_for_the_buggy_cache():
    buggy, ref = _pair("cache")
    x = _x()
    full = ref(x, is_causal=True)[0]
    torch.testing.assert_close(buggy(x), full)  # without a cache the bug does not show
    torch.testing.assert_close(gym.run_cached(ref, x, 3, is_causal=True), full)
    gap = (gym.run_cached(buggy, x, 3) - full).abs().amax(dim=(0, 2))  # (T,)
    assert gap[:3].max() < 1e-5 and (gap[3:] > 1e-3).all()


@pytest.mark.parametrize("name", sorted(gym.CASES))
def test_every_buggy_module_differs_from_its_reference(name):
    buggy, ref = _pair(name)
    x = _x()
    causal = gym.CASES[name].causal
    got = gym.run_cached(buggy, x, 2) if name == "cache" else buggy(x)
    assert (got - _out(ref, x, causal)).abs().max() > 1e-3


# --- refusals, each naming the argument the learner passed


@pytest.mark.parametrize(("build", "error", "match"), [
    (lambda: gym.DisagreeingAttention(16, 0), ValueError, "n_heads must be an integer >= 1, got 0"),
    (lambda: gym.DisagreeingAttention(16.0, 4), TypeError, "d_model must be an integer"),
    (lambda: gym.CacheAttention(16, 4, dropout=1.5), ValueError, "dropout must be a number in"),
    (lambda: gym.RotaryAttention(6, 2), ValueError, r"d_model / n_heads = 6 / 2 = 3 .* even"),
    (lambda: gym.show(["too_fast"]), ValueError, "name must be one of"),
])
def test_a_station_built_or_shown_with_a_bad_argument_names_it(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_a_station_subclassed_by_the_learner_is_checked_too():
    class Fixed(gym.DisagreeingAttention):
        pass

    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4"):
        Fixed(10, 4)
    assert Fixed(16, 4).d_head == 4


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda s, lo: gym.sample_frequencies("sampler", lo, 1.0), TypeError,
     "sample must be a sampler"),
    (lambda s, lo: gym.sample_frequencies(lambda lo, t: lo, lo, 1.0), TypeError,
     r"sample\(logits, temperature, generator\): it is called with 3 arguments"),
    (lambda s, lo: gym.sample_frequencies(s, lo[:0], 1.0), ValueError, r"logits has shape \(0,\)"),
    (lambda s, lo: gym.repeated_token_spread("layer", 16), TypeError, "fn must be a function"),
    (lambda s, lo: gym.permutation_gap(None, torch.randn(1, 3, 4)), TypeError,
     "fn must be a function"),
    (lambda s, lo: gym.run_cached("layer", torch.randn(1, 3, 16), 1), TypeError,
     "layer must be an attention layer"),
])
def test_the_instruments_name_what_the_learner_passed(call, error, match):
    with pytest.raises(error, match=match):
        call(gym.sample_with_temperature, torch.randn(5))
