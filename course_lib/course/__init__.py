"""The course's tooling, kept apart from the model library.

``checks`` (graded checks, one module per chapter), ``exercises`` (the exercise generator),
``grade`` (``python -m course_lib.course.grade``: score exercise notebooks) and ``colab`` (the
notebooks' shared set-up cell). These modules import the model library; the model library never
imports them.
"""
