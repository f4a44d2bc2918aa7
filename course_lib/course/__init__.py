"""The course machinery, kept apart from the model library and the instruments.

``checks`` (graded checks, one module per chapter), ``exercises`` (the exercise generator),
``grade`` (``python -m course_lib.course.grade``: score exercise notebooks), ``colab`` (the
notebooks' shared set-up cell), ``claims`` (a lesson's claims checked on the learner's run) and
``pytest_plugin``. These modules import the instruments and the model library; neither imports
them.
"""
