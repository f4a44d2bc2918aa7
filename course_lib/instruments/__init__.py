"""Instruments: tools that measure a model rather than lessons that build one (probes,
induction, divergence, the debugging gym, plots and widgets, the pretrained BERT application).
They import the model library; the model library never imports them, and neither do they import
the course machinery in ``course_lib.course``."""
