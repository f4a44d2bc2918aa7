"""Chapter 14's timing program (course_lib/course/programs/overlap.py) under torchrun on 2 gloo
ranks, on a small decoder: every form is timed in every round, and every bucketed form leaves
exactly the gradients that backward, then all-reduce by hand leaves. No duration is asserted
(the deeper notebook checks the lesson's claims about the times, with their margins)."""

from __future__ import annotations

import pytest

from course_lib.course.ranks import torchrun

FORMS = ["backward", "all-reduce", "all-reduce, one message", "backward, then all-reduce",
         "overlapped, small buckets", "overlapped, one bucket", "DDP, small buckets",
         "DDP, 25 MB buckets"]


@pytest.fixture(scope="module")
def ranks():
    return torchrun("course_lib.course.programs.overlap", "--repeat", "2", "--d-model", "32",
                    "--layers", "1", "--batch", "4", "--small-bucket", "4096",
                    nproc=2, timeout_s=120)


def test_every_form_is_timed_in_every_round(ranks):
    for rank in ranks:
        assert list(rank["times"]) == FORMS
        for form, seconds in rank["times"].items():
            assert len(seconds) == 2, form
            assert all(s > 0 for s in seconds), form


def test_every_bucketed_form_leaves_the_by_hand_gradients(ranks):
    for rank in ranks:
        assert set(rank["gaps"]) == {f for f in FORMS if "bucket" in f}
        assert all(gap < 1e-6 for gap in rank["gaps"].values()), rank["gaps"]


def test_small_buckets_are_several_and_one_bucket_is_one(ranks):
    for rank in ranks:
        assert rank["buckets"]["small"] >= 3
        assert rank["buckets"]["one"] == 1
        assert rank["gradient bytes"] == 4 * rank["parameters"]  # float32
