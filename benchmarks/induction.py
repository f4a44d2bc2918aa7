"""Chapter 11's heavier measurements, too slow for the notebooks (a few minutes on one core).

    python -m benchmarks.induction              # both studies
    python -m benchmarks.induction --seeds 10   # the phase change over more seeds only

1. The recipe of ``course_lib.instruments.induction`` over many seeds: where the repeated half's
   loss falls below 1 nat, the final losses and the best head scores, two layers and one.
2. Chapter 09's char GPT (one recipe on every device) trained for its full 1,500 updates
   (about 90 s): its heads' previous-token and induction scores, and its losses on repeated text.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from course_lib import DecoderConfig, DecoderLM, seed_everything
from course_lib.corpus import shakespeare_text, train_val_split
from course_lib.instruments.induction import half_losses, induction_model, train_induction
from course_lib.instruments.probes import induction_score, previous_token_score
from course_lib.tasks import repeated_segments
from course_lib.tokenizer import CharTokenizer
from course_lib.train import TrainConfig, estimate_loss, lm_batches, train


def seeds_study(n_seeds: int, steps: int = 800) -> None:
    print(f"{'layers':>6} {'seed':>5} {'drop at':>8} {'first':>7} {'repeated':>9} "
          f"{'prev L0':>8} {'ind last':>9} {'s':>6}")
    for n_layers in (2, 1):
        for seed in range(n_seeds):
            started = time.perf_counter()
            model = induction_model(n_layers, seed=seed)
            log = train_induction(model, steps=steps, seed=seed, eval_every=50, progress=False)
            print(f"{n_layers:>6} {seed:>5} {log.drop_step()!s:>8} {log.first[-1]:7.2f} "
                  f"{log.second[-1]:9.2f} {float(log.prev[-1][0].max()):8.2f} "
                  f"{float(log.induction[-1][-1].max()):9.2f} "
                  f"{time.perf_counter() - started:6.1f}", flush=True)


def char_gpt_study() -> None:
    text = shakespeare_text()
    tokenizer = CharTokenizer.from_text(text)
    train_ids, val_ids = train_val_split(tokenizer.encode_tensor(text), 0.1)
    config = DecoderConfig(vocab_size=tokenizer.vocab_size, d_model=64, n_heads=4, n_layers=2,
                           max_len=64, bias=False)
    for updates in (500, 1500):
        seed_everything(0)
        gpt = DecoderLM(config)
        run = TrainConfig(max_iters=updates, lr=3e-3, min_lr=3e-4, warmup_iters=50,
                          eval_interval=updates, eval_iters=1)
        train(gpt, lm_batches(train_ids, 16, 64, generator=torch.Generator().manual_seed(0)),
              run, progress=False)
        gpt.eval()
        val = lm_batches(val_ids, 128, 64, generator=torch.Generator().manual_seed(2))()
        print(f"\nchar GPT, {updates} updates: validation loss "
              f"{estimate_loss(gpt, lambda v=val: v, 1):.3f}")
        letters = torch.tensor(tokenizer.encode("abcdefghijklmnopqrstuvwxyz"))
        pick = repeated_segments(64, 24, 26, seed=5).inputs
        for name, ids in (("random characters", repeated_segments(64, 24, config.vocab_size,
                                                                   seed=5).inputs),
                          ("random letters", letters[pick]),
                          ("validation text", _repeated_text(val_ids, 64, 24))):
            with torch.no_grad():
                attentions = gpt(ids, output_attentions=True).attentions
            first, second = half_losses(gpt, ids)
            print(f"  {name:17}: first half {first:.2f}, repeated half {second:.2f} nats")
            for layer, w in enumerate(attentions):
                prev = previous_token_score(w).mean(0)
                ind = induction_score(w, 24).mean(0)
                print(f"    layer {layer}: previous-token {[round(float(x), 2) for x in prev]}, "
                      f"induction {[round(float(x), 2) for x in ind]}")
    print(f"(log V = {math.log(config.vocab_size):.2f})")


def _repeated_text(stream: torch.Tensor, n: int, seg: int) -> torch.Tensor:
    """n windows of seg characters of real text, each written twice: (n, 2 seg)."""
    starts = torch.randint(len(stream) - seg, (n,), generator=torch.Generator().manual_seed(7))
    windows = torch.stack([stream[s:s + seg] for s in starts.tolist()])  # (n, seg)
    return torch.cat([windows, windows], dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None,
                        help="only the seeds study, with this many seeds")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds_study(args.seeds or 10)
    if args.seeds is None:
        char_gpt_study()


if __name__ == "__main__":
    main()
