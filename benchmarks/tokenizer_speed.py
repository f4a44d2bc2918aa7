"""course_lib's byte-level BPE against Hugging Face ``tokenizers`` on the same text: training
and encoding times, their ratio, and whether the two learned the same merges and segment the
text the same way.

    python -m benchmarks.tokenizer_speed                      # 8 plays (987,264 chars), V = 4096
    python -m benchmarks.tokenizer_speed --vocab 8192 --plays all
    python -m benchmarks.tokenizer_speed --parallel           # let tokenizers use every core

Both learn from the whole text at once (``tokenizers``: one sequence; GPT-2's ByteLevel
pre-tokenizer without a prefix space, all 256 bytes as the initial alphabet, so the two are set
up to agree, as in tests/test_bpe.py). Times are the fastest of ``--repeat`` runs of the wall
clock (``course_lib.best_time``). ``tokenizers`` runs on one thread unless ``--parallel``
(``TOKENIZERS_PARALLELISM``, read when it is imported). Encoding is of the whole text as one
string; ours merges each distinct pre-token once per call, ``tokenizers`` keeps a cache of
words across calls (the warm-up call fills it).

Measured on a 2-core CPU shared with other programs (load average 5 to 7; tokenizers 0.23.3,
one thread, best of 3; the last row ``--vocab 8192 --plays all --repeat 1``). Ratios, ours over
``tokenizers``, lowest to highest over five runs of each row (2026-11-28); before: one run each
of the earlier trainer, which looked through every pair count at each merge::

    text             vocab   train: before   now         encode: now   training, one run
    987,264 chars     4096           7.3x    1.9-2.3x            0.6-0.8x   1.31 s vs 0.67 s
    987,264 chars     8192          10.4x    2.0-2.4x            0.6-0.7x   1.39 s vs 0.70 s
    4,782,492 chars   8192           6.1x    1.0-1.5x            0.3-0.4x   3.00 s vs 2.25 s

(The last row's "before" was 8.6x on 2026-11-27.)

Both learned the same merges and gave the same tokens in every run. Training keeps the pair
counts in a priority queue (``heapq``, with lazy invalidation: a popped entry whose count is
out of date goes back with the current one), as ``tokenizers`` does in Rust; before, finding
the most frequent pair by looking through every count took about three quarters of the time.
Encoding one long string is faster here (not measured for short strings, nor with
``encode_batch``): ours returns only ids and merges each distinct word once per call, while
``tokenizers``' ``encode`` returns an Encoding that also holds every token's string, offsets
and masks.
"""

from __future__ import annotations

import argparse
import os
import sys


def agreement(ours, hf, text: str) -> tuple[bool, bool]:
    """(same merges in the same order, same tokens for ``text``)."""
    from course_lib.instruments.hf_bpe import hf_merges, our_merges, printable

    same_merges = our_merges(ours) == hf_merges(hf)
    same_tokens = [printable(ours.vocab[i]) for i in ours.encode(text)] == hf.encode(text).tokens
    return same_merges, same_tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=4096, help="vocabulary size")
    parser.add_argument("--plays", default="default", help='"default" (8 plays) or "all"')
    parser.add_argument("--repeat", type=int, default=3, help="timed runs (the fastest counts)")
    parser.add_argument("--parallel", action="store_true", help="tokenizers on every core")
    args = parser.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.parallel else "false"
    import tokenizers

    from course_lib.bpe import train_bpe
    from course_lib.corpus import shakespeare_text
    from course_lib.device import best_time
    from course_lib.instruments.hf_bpe import hf_byte_level_bpe

    text = shakespeare_text(args.plays)
    ours, hf = train_bpe(text, args.vocab), hf_byte_level_bpe([text], args.vocab)
    times = {
        "train": (best_time(lambda: train_bpe(text, args.vocab), repeat=args.repeat),
                  best_time(lambda: hf_byte_level_bpe([text], args.vocab), repeat=args.repeat)),
        "encode": (best_time(lambda: ours.encode(text), repeat=args.repeat),
                   best_time(lambda: hf.encode(text), repeat=args.repeat)),
    }
    same_merges, same_tokens = agreement(ours, hf, text)
    threads = "every core" if args.parallel else "one thread"
    print(f"text: {len(text):,} characters ({args.plays}), vocab_size {args.vocab}; "
          f"tokenizers {tokenizers.__version__} on {threads}; python {sys.version.split()[0]}")
    print(f"{'':8} {'course_lib':>12} {'tokenizers':>12} {'ratio':>8}")
    for name, (mine, theirs) in times.items():
        print(f"{name:8} {mine:11.3f}s {theirs:11.3f}s {mine / theirs:7.1f}x")
    print(f"tokens: {len(ours.encode(text)):,} ({len(text) / len(ours.encode(text)):.2f} "
          f"characters a token); same merges: {same_merges}; same tokens: {same_tokens}")


if __name__ == "__main__":
    main()
