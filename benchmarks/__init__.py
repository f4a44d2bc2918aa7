"""Benchmarks of course_lib, run as modules, e.g. ``python -m benchmarks.train_char_lm``."""
