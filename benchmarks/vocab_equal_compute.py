"""Vocabularies compared at equal compute: the same small decoder trained on the same
Shakespeare with bytes (V = 256) and byte-level BPE of 512, 1024, 2048 and 4096 tokens, scored
in bits per character of the held-out text, over seeds.

    python -m benchmarks.vocab_equal_compute                    # the table below
    python -m benchmarks.vocab_equal_compute --fair chars       # equal characters instead
    python -m benchmarks.vocab_equal_compute --seeds 0 --vocabs 256 4096   # a quick look

Text: ``shakespeare_text()`` (8 plays, 987,264 characters), the first 90% to train on (and to
learn the BPE merges from: once at the largest vocabulary, the smaller ones are its prefixes),
the last 10% held out. Every run is ``course_lib.instruments.tokens.equal_compute_run``: a fresh
GPT-2-style DecoderLM (tied embedding and head, learned positions, no dropout) trained with
AdamW on random windows, then scored with ``bits_per_character`` on the held-out text.

What "equal" means (``--fair compute``, the default): the same updates, batch size, block size
IN TOKENS and body (d_model, layers, heads), so every vocabulary does the same work in the
blocks per update. Left out: the output head's V x D multiply-adds per token (0.14x the
blocks' work at V = 256, 2.3x at V = 4096 here: the ``head`` column, forward FLOPs per token;
it shows in the seconds) and the embedding lookup (free). A bigger vocabulary then sees more
characters per update and a longer context in characters: that is what it buys.
``--fair chars`` instead gives every vocabulary the bytes' block in CHARACTERS (block in
tokens = bytes' block x the bytes' characters per token / its own), so every model sees the
same characters per update and the same context in characters, and the bigger vocabularies
do less work in the blocks.

Attention FLOPs per character (``attn/c``): for a block of T tokens, QK^T and the weights
times V are each T x T x D multiply-adds per layer, 2 T^2 D FLOPs each, so 4 T^2 D per layer
per block, 4 T D per token, and 4 T D L / (characters per token) per character (forward, the
whole T x T square as the kernels compute it; the backward pass costs about twice as much).

Measured on a 2-core CPU (2026-11-28, torch 2.13.0, one thread, OMP_NUM_THREADS=1; the two
rules ran side by side, so the seconds are those of a busy machine and not comparable between
rows; the bits per character do not depend on it), ``python -m benchmarks.vocab_equal_compute``::

    5 seeds; 500 updates x batch 16; d_model 64, 2 layers, 4 heads, lr 0.003
        V   params        emb+head c/tok   T  c/upd  head  attn/c   bits/char s/run
      256  120,576   16,384 ( 14%)  1.00  64  1,024  0.14  32,768 3.246-3.273   9.3
      512  136,960   32,768 ( 24%)  1.91  64  1,976  0.29  17,164 2.856-2.891  11.5
     1024  169,728   65,536 ( 39%)  2.30  64  2,470  0.57  14,275 2.794-2.827  14.1
     2048  235,264  131,072 ( 56%)  2.60  64  2,897  1.14  12,579 2.735-2.777  12.1
     4096  366,336  262,144 ( 72%)  2.86  64  3,255  2.29  11,476 2.691-2.701  19.2

(``params``: the tied embedding and head counted once; ``emb+head``: V x D and its share;
``c/tok``: characters per token of the held-out text; ``T``: block in tokens; ``c/upd``:
training characters per update; ``head``: the head's forward FLOPs per token over the blocks';
``attn/c``: attention FLOPs per character, the formula above; ``bits/char``: min-max over the
seeds; ``s/run``: seconds of training, mean over the seeds.)

What it shows: at equal compute every step up in vocabulary lowered bits per character, with
no overlap between the seeds' ranges of neighbouring rows: bytes 3.25-3.27, BPE 512
2.86-2.89 (the largest step, 0.38 bits: the first 256 merges already pack 1.9 characters into
a token), then 2.79-2.83, 2.74-2.78 and 2.69-2.70 at 4096. Each model sees chars/token times
more text per update and as much longer a context, and spends fewer attention FLOPs per
character. The price is outside the rule: from 2048 on the embedding and head hold more
than half the parameters, and at 4096 the head costs 2.3x the blocks' forward FLOPs (on a
quiet CPU a run took 3.3x the bytes' time, 2026-11-27). These are short runs of a tiny model
(500 updates, 0.5 to 1.6 M characters seen): it measures what a vocabulary buys early in
training at a fixed budget of block work, not where each would converge.

The other rule, ``--fair chars`` (the block in tokens is ``T``, about 1,020 training
characters per update for every row)::

        V   params        emb+head c/tok   T  c/upd  head  attn/c   bits/char s/run
      256  120,576   16,384 ( 14%)  1.00  64  1,024  0.14  32,768 3.246-3.273   9.2
      512  134,976   32,768 ( 24%)  1.91  33  1,019  0.31   8,850 2.904-2.958   6.5
     1024  167,360   65,536 ( 39%)  2.30  27  1,042  0.62   6,022 2.894-2.964   8.5
     2048  232,640  131,072 ( 56%)  2.60  23  1,041  1.26   4,521 2.795-2.885   6.3
     4096  363,520  262,144 ( 72%)  2.86  20  1,017  2.53   3,586 2.795-2.864   6.5

With the same characters per update and the same 64-character context, and a quarter to a
ninth of the bytes' attention FLOPs per character, every BPE vocabulary still beat bytes on
every seed (by 0.28 bits or more), but by less than at equal compute, and the middle rows
overlap (seeds spread by up to 0.09 bits). Most of the gain is not the extra text per update.

Equal wall time, a third rule: the byte model given 1,650 updates (on a quiet CPU, 2026-11-27,
24.3 s a run against 24.7 s for BPE 4096's 500 updates; ``--vocabs 256 --updates 1650``)
reached 2.805-2.811 bits per character, still above BPE 4096's 2.691-2.701, by about 0.1
bits, having seen about as many characters (1.69 M against 1.63 M).

On a GPU (one H200, torch 2.11.0+cu130) the default command gave the same ranges to within
0.02 bits (BPE 4096: 2.681-2.698) in about 2-3 s a run, and a seed's run repeated there gave
the same bits per character to the last digit.
"""

from __future__ import annotations

import argparse
import statistics
import time


def body_flops_per_token(d_model: int, n_layers: int, block_size: int) -> float:
    """Forward FLOPs per token of the blocks: the four D x D projections and the 4D-wide
    feed-forward (12 D^2 multiply-adds) plus the attention products (2 T D), per layer."""
    return 2 * n_layers * (12 * d_model**2 + 2 * block_size * d_model)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=64, help="tokens (with --fair chars: "
                        "the bytes' block, the others get as many characters)")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fair", choices=["compute", "chars"], default="compute")
    parser.add_argument("--val-chars", type=int, default=None,
                        help="score only the first this many held-out characters")
    args = parser.parse_args(argv)
    import torch

    from course_lib.bpe import BPETokenizer, train_bpe
    from course_lib.corpus import shakespeare_text
    from course_lib.instruments.tokens import equal_compute_run

    text = shakespeare_text()
    cut = int(0.9 * len(text))
    train_text, val_text = text[:cut], text[cut:][: args.val_chars]
    started = time.perf_counter()
    largest = train_bpe(train_text, max(args.vocabs))
    print(f"BPE {max(args.vocabs)} learned from {len(train_text):,} characters in "
          f"{time.perf_counter() - started:.1f} s; scored on {len(val_text):,} held-out "
          f"characters; torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"fair = {args.fair}")
    bytes_cpt = len(train_text) / len(BPETokenizer([]).encode(train_text))
    rows = []
    for vocab in args.vocabs:
        tok = BPETokenizer(largest.merges[: vocab - 256])
        block = args.block_size
        if args.fair == "chars":  # the bytes' block in characters
            block = round(args.block_size * bytes_cpt * len(tok.encode(train_text))
                          / len(train_text))
        runs = [equal_compute_run(tok, train_text, val_text, updates=args.updates,
                                  batch_size=args.batch_size, block_size=block,
                                  d_model=args.d_model, n_layers=args.layers,
                                  n_heads=args.heads, lr=args.lr, seed=seed)
                for seed in args.seeds]
        rows.append((tok, block, runs))
        print_row(rows[-1], args)
    print_table(rows, args)


def print_row(row: tuple, args: argparse.Namespace) -> None:
    tok, block, runs = row
    bpc = [r.bits_per_char for r in runs]
    print(f"  V = {tok.vocab_size}: block {block} tokens, bits/char "
          f"{' '.join(f'{b:.4f}' for b in bpc)}, {statistics.mean(r.seconds for r in runs):.1f} "
          "s a run", flush=True)


def print_table(rows: list[tuple], args: argparse.Namespace) -> None:
    print(f"\n{len(args.seeds)} seeds; {args.updates} updates x batch {args.batch_size}; "
          f"d_model {args.d_model}, {args.layers} layers, {args.heads} heads, lr {args.lr}")
    print(f"{'V':>5} {'params':>8} {'emb+head':>15} {'c/tok':>5} {'T':>3} {'c/upd':>6} "
          f"{'head':>5} {'attn/c':>7} {'bits/char':>11} {'s/run':>5}")
    for tok, block, runs in rows:
        r, bpc = runs[0], [run.bits_per_char for run in runs]
        share = r.embedding_and_head_parameters / r.parameters
        head = 2 * tok.vocab_size * args.d_model / body_flops_per_token(
            args.d_model, args.layers, block)
        print(f"{tok.vocab_size:>5} {r.parameters:>8,} {r.embedding_and_head_parameters:>8,} "
              f"({share:4.0%}) {r.chars_per_token:>5.2f} {block:>3} "
              f"{r.train_chars_per_update:>6,.0f} {head:>5.2f} "
              f"{r.attention_flops_per_char:>7,.0f} {min(bpc):.3f}-{max(bpc):.3f} "
              f"{statistics.mean(x.seconds for x in runs):>5.1f}")


if __name__ == "__main__":
    main()
