"""course_lib.course.claims: a lesson's claims checked on the learner's machine."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.course.claims import ClaimError, agree, claim, compare_to_book


def test_a_claim_that_holds_prints_it(capsys):
    claim("the loss falls below 1 nat", 0.4 < 1.0)
    assert capsys.readouterr().out == "✓ claim holds: the loss falls below 1 nat\n"


def test_a_claim_that_fails_stops_with_the_claim_and_what_was_measured(capsys):
    with pytest.raises(ClaimError, match=r"the loss falls below 1 nat.*final loss 1\.30"):
        claim("the loss falls below 1 nat", 1.3 < 1.0, "final loss 1.30")
    assert capsys.readouterr().out == ""
    assert issubclass(ClaimError, AssertionError)  # pytest and nbval report it as a failure


def test_a_claim_takes_a_one_element_bool_tensor():
    claim("all positive", (torch.arange(1, 4) > 0).all())
    with pytest.raises(ClaimError):
        claim("all positive", (torch.arange(-1, 2) > 0).all())


@pytest.mark.parametrize("holds", [torch.tensor([True, True]), "yes", 1, None])
def test_a_claim_needs_one_truth_value(holds):
    with pytest.raises((TypeError, ValueError), match="holds"):
        claim("something", holds)


@pytest.mark.parametrize("holds", [
    torch.tensor(1.7),  # a loss passed instead of ``loss < 1``
    torch.tensor(float("nan")),
    (torch.tensor([1, 2, 3]) == torch.tensor([1, 0, 0])).sum(),  # 1 of 3 right, a count
    torch.tensor([1]), 0.0, 1.0, np.float64(2.0), np.int64(1),
])
def test_a_number_is_not_a_truth_value(holds, capsys):
    with pytest.raises(TypeError, match=r"holds must be True or False.*loss < 1"):
        claim("every prediction is right", holds)
    assert capsys.readouterr().out == ""  # nothing claimed


def test_a_claim_takes_numpy_bools():
    claim("numpy compares", np.float64(0.3) < 1.0)
    with pytest.raises(ClaimError):
        claim("numpy compares", np.array([1.0, 2.0]).max() < 1.0)


def test_a_claim_needs_a_statement():
    with pytest.raises(TypeError, match="statement"):
        claim("", True)


def test_agree_prints_the_bound_not_the_noise(capsys):
    a = torch.randn(4, 5)
    agree(a, a + 3e-7, atol=1e-6, what="ours and torch's")
    assert capsys.readouterr().out == "ours and torch's agree to < 1e-06\n"


def test_agree_fails_past_the_bound_and_on_nan():
    a = torch.zeros(3)
    with pytest.raises(ClaimError, match=r"differ by up to 2\.00e-03"):
        agree(a, a + 2e-3, atol=1e-6)
    with pytest.raises(ClaimError):
        agree(a, torch.tensor([0.0, float("nan"), 0.0]), atol=1e-6)


def test_agree_takes_numbers_and_mixed_dtypes(capsys):
    agree(1.0, 1.0 + 1e-9, atol=1e-6)
    agree(torch.ones(2, dtype=torch.float64), torch.ones(2), atol=1e-6)
    assert capsys.readouterr().out.count("agree to < 1e-06") == 2


def test_agree_checks_its_arguments():
    with pytest.raises(ValueError, match="shape"):
        agree(torch.zeros(2), torch.zeros(3), atol=1e-6)
    with pytest.raises(ValueError, match="atol"):
        agree(torch.zeros(2), torch.zeros(2), atol=0)


def test_compare_to_book_shows_both_and_flags_a_value_outside(capsys):
    compare_to_book("validation loss", 1.97, 1.95, 2.01, over="5 seeds")
    inside = capsys.readouterr().out
    assert inside == ("validation loss: 1.97 on this run; the book measured 1.95 to 2.01 "
                      "over 5 seeds\n")
    compare_to_book("validation loss", torch.tensor(2.2), 1.95, 2.01, over="5 seeds")
    assert "outside the book's range" in capsys.readouterr().out
    with pytest.raises(ValueError, match="low and high"):
        compare_to_book("x", 1.0, 2.0, 1.0, over="5 seeds")


@pytest.mark.parametrize(("value", "fmt", "outside"), [
    (0.1243, ".3f", False),  # printed 0.124: the range's end, as printed
    (0.1246, ".3f", True),  # printed 0.125
    (0.10751, ".3f", False),  # printed 0.108, the range's start
    (0.10749, ".3f", True),  # printed 0.107
    (0.2485, ".1%", False),  # printed 24.9%, the range 10.8% to 24.9%
])
def test_compare_to_book_judges_the_value_as_printed(capsys, value, fmt, outside):
    compare_to_book("gap", value, 0.108, 0.249 if fmt.endswith("%") else 0.124, over="5 seeds",
                    fmt=fmt)
    assert ("outside the book's range" in capsys.readouterr().out) is outside


def test_compare_to_book_says_nan_is_nan(capsys):
    compare_to_book("gap", float("nan"), 0.108, 0.124, over="5 seeds", fmt=".3f")
    out = capsys.readouterr().out
    assert "NaN" in out and "your machine or seed" not in out


@pytest.mark.parametrize(("args", "kwargs", "error", "names"), [
    (("loss", [1.0, 2.0], 1.0, 2.0), {}, TypeError, "value"),
    (("loss", np.array([1.0, 2.0]), 1.0, 2.0), {}, TypeError, "value"),
    (("loss", torch.tensor([1.0, 2.0]), 1.0, 2.0), {}, ValueError, "value"),
    (("loss", None, 1.0, 2.0), {}, TypeError, "value"),
    ((1.97, "loss", 1.0, 2.0), {}, TypeError, "what"),  # what and value swapped
    (("loss", 1.5, 1.0, 2.0), {"fmt": "d"}, ValueError, "fmt"),
    (("loss", 1.5, "1", 2.0), {}, TypeError, "low"),
])
def test_compare_to_book_names_a_bad_argument(args, kwargs, error, names):
    with pytest.raises(error, match=names):
        compare_to_book(*args, over="5 seeds", **kwargs)


@pytest.mark.parametrize(("a", "b", "names"), [
    ([1.0, 2.0], torch.zeros(2), "a"), (torch.zeros(2), np.zeros(2), "b"),
    (None, 1.0, "a"), (torch.tensor([True]), torch.tensor([True]), "a"),
])
def test_agree_names_a_bad_argument(a, b, names):
    with pytest.raises(TypeError, match=names):
        agree(a, b, atol=1e-6)


def test_agree_says_which_side_holds_nan():
    with pytest.raises(ClaimError, match=r"NaN \(a: 0, b: 1 NaN"):
        agree(torch.zeros(3), torch.tensor([0.0, float("nan"), 0.0]), atol=1e-6)


def test_every_call_is_logged_when_asked(tmp_path, monkeypatch):
    import json

    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv("COURSE_CLAIMS_LOG", str(log))
    claim("holds", True)
    with pytest.raises(ClaimError):
        claim("fails", False, "x = 3")
    agree(1.0, 1.0, atol=1e-6, what="a and b")
    compare_to_book("loss", 2.0, 1.9, 2.1, over="5 seeds")
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["kind"] for r in records] == ["claim", "claim", "agree", "book"]
    assert records[1] == {"kind": "claim", "statement": "fails", "holds": False, "detail": "x = 3"}
    assert records[3]["value"] == 2.0 and records[3]["low"] == 1.9
