"""course_lib.course.gym: each buggy module has its reference's parameters, differs from it
only through its planted mistake, and the instrument the case names finds that mistake (and
finds nothing on the reference)."""

from __future__ import annotations

import pytest
import torch

from course_lib.attention import MultiHeadAttention
from course_lib.course import gym
from course_lib.course.divergence import first_divergence
from course_lib.course.probes import future_leaks, who_sees_whom

D, H = 16, 4


def _pair(name, d_model=D, n_heads=H):
    """(buggy, reference) with the same weights, in eval mode."""
    case = gym.CASES[name]
    torch.manual_seed(3)
    ref = case.reference(d_model, n_heads).eval()
    kwargs = {"dropout": ref.dropout} if name == "dropout" else {}
    buggy = case.buggy(d_model, n_heads, **kwargs)
    buggy.load_state_dict(ref.state_dict())
    return buggy.eval(), ref


def _x(seq_len=6):
    return torch.randn(2, seq_len, D, generator=torch.Generator().manual_seed(4))


def _out(module, x):
    out = module(x, is_causal=True) if isinstance(module, MultiHeadAttention) else module(x)
    return out[0] if isinstance(out, tuple) else out


def test_there_are_six_cases_each_with_its_reference_parameters():
    assert len(gym.CASES) == 6
    for name in gym.CASES:
        buggy, ref = _pair(name)
        assert set(buggy.state_dict()) == set(ref.state_dict()), name
        assert gym.CASES[name].instrument


def test_show_prints_the_buggy_source(capsys):
    gym.show("mask")
    out = capsys.readouterr().out
    assert "class MaskAttention" in out and "tril(diagonal=1)" in out
    with pytest.raises(ValueError, match="name must be one of"):
        gym.show("nope")


def test_future_leaks_finds_the_mask_off_by_one():
    buggy, ref = _pair("mask")
    x = _x()
    report = future_leaks(lambda h: buggy(h), x)
    assert not report.is_causal and report.lookahead == 1
    assert future_leaks(lambda h: ref(h, is_causal=True)[0], x).is_causal


def test_the_scale_bug_vanishes_with_one_head_and_first_divergence_locates_it():
    buggy, ref = _pair("scale")
    x = _x()
    report = first_divergence(ref, buggy, lambda m: _out(m, x) if m is buggy else m(x)[0])
    assert report.divergence.candidate == "out_proj" and not report.divergence.input_agreed
    one, one_ref = _pair("scale", D, 1)
    torch.testing.assert_close(one(x), one_ref(x)[0])


def test_the_permutation_test_finds_the_merge_by_reshape():
    buggy, ref = _pair("merge")
    x = _x()
    assert gym.permutation_gap(lambda h: buggy(h), x) > 0.1
    assert gym.permutation_gap(lambda h: ref(h)[0], x) < 1e-5
    one, _ = _pair("merge", D, 1)  # one head: a reshape is all a merge needs
    assert gym.permutation_gap(lambda h: one(h), x) < 1e-5


def test_who_sees_whom_refuses_the_layer_with_dropout_left_on():
    buggy, ref = _pair("dropout")
    x = _x()
    with pytest.raises(ValueError, match="is dropout on"):
        who_sees_whom(lambda h: buggy(h), x)
    assert who_sees_whom(lambda h: ref(h)[0], x).all()


def test_cached_differs_from_uncached_only_for_the_buggy_cache():
    buggy, ref = _pair("cache")
    x = _x()
    full = ref(x, is_causal=True)[0]
    torch.testing.assert_close(buggy(x), full)  # without a cache the bug does not show
    torch.testing.assert_close(gym.run_cached(ref, x, 3, is_causal=True), full)
    gap = (gym.run_cached(buggy, x, 3) - full).abs().amax(dim=(0, 2))  # (T,)
    assert gap[:3].max() < 1e-5 and (gap[3:] > 1e-3).all()


def test_first_divergence_locates_the_post_norm():
    buggy, ref = _pair("prenorm")
    x = _x()
    report = first_divergence(ref, buggy, lambda m: m(x)[0] if m is ref else m(x))
    assert report.divergence.candidate == "attn_norm"
    assert not report.divergence.input_agreed


@pytest.mark.parametrize("name", sorted(gym.CASES))
def test_every_buggy_module_differs_from_its_reference(name):
    buggy, ref = _pair(name)
    x = _x()
    got = gym.run_cached(buggy, x, 2) if name == "cache" else buggy(x)
    assert (got - _out(ref, x)).abs().max() > 1e-3
