"""The programs of chapter 14: each runs on several processes at once, started by PyTorch's
launcher, ``torchrun --standalone --nproc-per-node 2 -m course_lib.course.programs.<name>``
(course_lib.course.ranks.torchrun does that from a notebook and collects the results)."""
