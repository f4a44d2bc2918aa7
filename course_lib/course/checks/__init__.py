"""Graded-exercise checks, one module per chapter (``course_lib.course.checks.ch02`` and so on).

Each ``check_<name>(learner_fn)`` runs the learner's function on random and edge-case inputs
against course_lib's reference, prints one line on success and raises an ``AssertionError``
(:class:`CheckFailure`) that names the likely mistake otherwise.

Each chapter module ends by wrapping its public ``check_*`` functions with
:func:`graded_check` (``wrap_checks``): in a notebook, an exercise that is still a stub prints
one not-done line instead of stopping Run All, and an error shows as its message and the
learner's own lines.
"""

from ._core import Case, CheckFailure, Misconception, graded_check

__all__ = ["Case", "CheckFailure", "Misconception", "graded_check"]
