"""Graded-exercise checks, one module per chapter (``course_lib.course.checks.ch02`` and so on).

Each ``check_<name>(learner_fn)`` runs the learner's function on random and edge-case inputs
against course_lib's reference, prints one line on success and raises an ``AssertionError``
(:class:`CheckFailure`) that names the likely mistake otherwise.
"""

from ._core import Case, CheckFailure, Misconception

__all__ = ["Case", "CheckFailure", "Misconception"]
