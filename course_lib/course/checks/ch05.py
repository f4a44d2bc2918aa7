"""Checks for chapter 05, masking: the causal mask, masked attention, padding masks, a
future-leak probe, and the capstone: a small causal language model assembled from them."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from course_lib.attention import (
    MultiHeadAttention,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
)
from course_lib.attention import softmax as safe_softmax
from course_lib.instruments.probes import who_sees_whom as reference_who_sees_whom

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    describe,
    rand,
    run_cases,
    wrap_checks,
)

ATOL = 1e-5
RTOL = 1e-4

# --------------------------------------------------------------------------------------------
# Shared helpers


def _require_bool(
    got: Any, expected: torch.Tensor, case: Case, what: str, meaning: str = "'may attend'"
) -> None:
    """Fail with a specific message when a mask is returned with a non-boolean dtype."""
    if not isinstance(got, torch.Tensor) or got.dtype == torch.bool:
        return
    hint = ""
    if got.shape == expected.shape:
        values = got.detach().double().cpu()
        allowed = expected.cpu()
        if torch.equal(values, allowed.double()):
            hint = (
                " The True/False pattern is right, so only the dtype is wrong: create the "
                "tensor with dtype=torch.bool, or convert it with .bool(); comparisons such as "
                "a < b give booleans directly."
            )
        elif meaning == "'may attend'" and torch.equal(
            values, torch.where(allowed, 0.0, -math.inf).double()
        ):
            hint = (
                " You returned an additive float mask (0 where allowed, -inf where forbidden). "
                "That is a bias added to the scores; this course's masks are boolean, True = "
                "may attend (convert with mask == 0)."
            )
        elif torch.equal(values, (~allowed).double()):
            hint = f" Its values are also inverted: True must mean {meaning}."
    raise CheckFailure(
        f"{what} has dtype {got.dtype}, but it must be a boolean tensor (dtype=torch.bool) "
        f"where True means {meaning} (case '{case.name}').{hint}"
    )


def _close_nan(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """Equal within tolerance, NaN matching NaN (for recognising a mistake that makes NaN)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    return bool(torch.allclose(a.detach().double().cpu(), b.detach().double().cpu(),
                               atol=atol, rtol=rtol, equal_nan=True))


# --------------------------------------------------------------------------------------------
# Exercise 5.1: causal_mask(n_queries, n_keys), the queries being the last of the keys


def _ones(n_queries: int, n_keys: int) -> torch.Tensor:
    return torch.ones(n_queries, n_keys, dtype=torch.bool)


CAUSAL_MASK_MISTAKES = [
    Misconception(
        lambda t, s: ~causal_mask(t, s),
        "Your mask is inverted: True must mean 'may attend' (the convention of "
        "F.scaled_dot_product_attention). You marked the forbidden (future) keys instead; "
        "flip it with ~",
    ),
    Misconception(
        lambda t, s: torch.tril(_ones(t, s)),
        "Your mask treats the new queries as positions 0..T-1, the first keys: it is aligned "
        "to the top-left corner. The T new queries come AFTER the S - T cached keys, so query "
        "i sits at position S - T + i and may see every cached key and the new ones up to "
        "itself (this is the mistake F.scaled_dot_product_attention's is_causal=True makes "
        "when T differs from S)",
    ),
    Misconception(
        lambda t, s: causal_mask(t),
        "Your mask has one column per query, (T, T): it needs one column per key, (T, S), "
        "and the first S - T keys are the cached ones every new query may see",
    ),
    Misconception(
        lambda t, s: torch.tril(_ones(t, s), diagonal=s - t - 1),
        "Your mask leaves out each query's own position: query i (position S - T + i) may "
        "attend to itself. Without it the first new query of a prompt with no cache has no "
        "allowed key at all",
    ),
    Misconception(
        lambda t, s: torch.tril(_ones(t, s), diagonal=s - t + 1),
        "Your mask lets each query see one key into the future (the key right after its own "
        "position): the right edge is off by one",
    ),
    Misconception(
        lambda t, s: torch.triu(_ones(t, s), diagonal=s - t),
        "Your mask is the wrong triangle: each query may see its own position and the future, "
        "not the past. Row i is query i and column j is key j",
    ),
    Misconception(
        lambda t, s: _ones(t, s),
        "Your mask allows every key for every query: nothing is masked. Keys after a query's "
        "own position must be False",
    ),
]


def check_causal_mask(causal_mask_fn: Callable) -> None:
    """Check ``causal_mask(n_queries, n_keys)`` -> (T, S) bool: the T queries are the last T
    of S positions, and query i may attend to key j when j <= S - T + i.

    Args:
        causal_mask_fn: the learner's function taking two ints, T and S (T <= S).
    """

    def check_one(got, case: Case) -> None:
        expected = causal_mask(*case.args)
        _require_bool(got, expected, case, "Your mask")
        compare_tensors(got, expected, case, what="Your mask",
                        misconceptions=CAUSAL_MASK_MISTAKES, atol=0.0, rtol=0.0)

    cases = [Case(f"T={t}, S={s}", (t, s)) for t, s in
             ((4, 4), (2, 6), (1, 5), (3, 7), (1, 1), (5, 5))]
    run_cases("causal_mask", causal_mask_fn, cases, check_one)


# --------------------------------------------------------------------------------------------
# Exercise 5.2: masked_attention(q, k, v, mask)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (..., T, S)


WEIGHT_MISTAKES = [
    Misconception(
        lambda q, k, v, mask: torch.softmax(_scores(q, k).masked_fill(~mask, 0.0), dim=-1),
        "You filled the masked scores with 0. A score of 0 is an ordinary score: e^0 = 1, so "
        "the masked keys still get weight. Fill with float('-inf') so that exp(-inf) = 0",
    ),
    Misconception(
        lambda q, k, v, mask: torch.softmax(_scores(q, k), dim=-1) * mask,
        "Your weights are the unmasked softmax with the masked entries zeroed afterwards, so "
        "the rows no longer sum to 1. Mask the scores before the softmax (fill them with "
        "float('-inf')), or renormalise each row after zeroing",
    ),
    Misconception(
        lambda q, k, v, mask: torch.softmax(_scores(q, k).masked_fill(mask, -math.inf), dim=-1),
        "Your mask is applied the wrong way round: True means 'may attend', so fill the scores "
        "where the mask is False: scores.masked_fill(~mask, float('-inf'))",
    ),
    Misconception(
        lambda q, k, v, mask: safe_softmax(_scores(q, k).masked_fill(mask, -math.inf)),
        "Your mask is applied the wrong way round: True means 'may attend', so fill the scores "
        "where the mask is False: scores.masked_fill(~mask, float('-inf'))",
    ),
    Misconception(
        lambda q, k, v, mask: safe_softmax((q @ k.transpose(-2, -1)).masked_fill(~mask,
                                                                                 -math.inf)),
        "Your weights are softmax(q k^T) without scaling: divide the scores by sqrt(d), "
        "d = q.shape[-1], before masking and the softmax",
    ),
    Misconception(
        lambda q, k, v, mask: torch.softmax(_scores(q, k).masked_fill(~mask, -1e9), dim=-1),
        "A query whose keys are all masked got uniform weights (1/S each) instead of zeros: "
        "that is what filling with a large negative number such as -1e9 does when a whole row "
        "is masked, and it lets that query attend to every key. Give such rows all-zero "
        "weights, e.g. weights.masked_fill(~mask.any(-1, keepdim=True), 0.0)",
    ),
]


def _attention_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    random_mask = torch.rand(3, 5, generator=gen) > 0.5
    random_mask[:, 0] = True  # every query keeps at least one key
    empty_row = torch.tensor([[True, False, False, False],
                              [False, False, False, False],
                              [True, True, True, False]])
    left_padded = causal_mask(5)[None] & torch.tensor(
        [[True] * 5, [False, False, True, True, True]])[:, None, :]  # (B, T, S)
    return [
        Case("T=S=4, causal mask", (rand(gen, 4, 8), rand(gen, 4, 8), rand(gen, 4, 8),
                                    causal_mask(4))),
        Case("3 queries, 5 keys, random mask", (rand(gen, 3, 4), rand(gen, 5, 4),
                                                rand(gen, 5, 6), random_mask)),
        Case("batch and heads (2, 3, 5, 8) with a (T, S) causal mask",
             (rand(gen, 2, 3, 5, 8), rand(gen, 2, 3, 5, 8), rand(gen, 2, 3, 5, 8),
              causal_mask(5)),
             hint="the mask (T, S) broadcasts against scores (B, H, T, S); transpose only the "
                  "last two dimensions of k: k.transpose(-2, -1)"),
        Case("padding mask (B, 1, 1, S), lengths 6 and 3",
             (rand(gen, 2, 2, 6, 4), rand(gen, 2, 2, 6, 4), rand(gen, 2, 2, 6, 4),
              padding_mask([6, 3])[:, None, None, :])),
        Case("T=1", (rand(gen, 1, 8), rand(gen, 1, 8), rand(gen, 1, 8), causal_mask(1))),
        Case("large scores, causal", (rand(gen, 4, 8, scale=30.0), rand(gen, 4, 8, scale=30.0),
                                      rand(gen, 4, 8), causal_mask(4))),
        Case("a query with no allowed key", (rand(gen, 3, 4), rand(gen, 4, 4), rand(gen, 4, 2),
                                             empty_row)),
        Case("left padding + causal (B=2): two fully masked rows",
             (rand(gen, 2, 5, 4), rand(gen, 2, 5, 4), rand(gen, 2, 5, 4), left_padded)),
    ]


def check_masked_attention(masked_attention: Callable) -> None:
    """Check ``masked_attention(q, k, v, mask)`` -> (out, weights), scaled dot-product attention
    where ``mask`` (bool, True = may attend) is applied with -inf before the softmax and a
    query with no allowed key gets zero weights and a zero output.

    Args:
        masked_attention: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        q, k, v, mask = case.args
        expected_out, expected_w = scaled_dot_product_attention(q, k, v, mask=mask)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailure(
                f"masked_attention should return a pair (out, weights), but returned "
                f"{describe(got)} (case '{case.name}')"
            )
        out, weights = got
        if _close_nan(out, expected_w) and _close_nan(weights, expected_out):
            raise CheckFailure(
                f"You returned (weights, out); return them in the order (out, weights) "
                f"(case '{case.name}')"
            )
        if not isinstance(weights, torch.Tensor):
            raise CheckFailure(f"The weights should be a tensor, got {describe(weights)} "
                               f"(case '{case.name}')")
        for m in WEIGHT_MISTAKES:
            wrong = m.wrong(q, k, v, mask)
            if (_close_nan(weights, wrong) or _close_nan(weights, wrong.nan_to_num(0.0))) and (
                not _close_nan(wrong, expected_w)
            ):
                raise CheckFailure(f"{m.message} (seen on the case '{case.name}')")
        if weights.shape == expected_w.shape and torch.isnan(weights).any():
            nan_rows = torch.isnan(weights).any(-1)  # (..., T)
            empty = ~mask.expand(expected_w.shape).any(-1)  # (..., T) no allowed key
            if bool(empty.any()) and bool((nan_rows <= empty).all()):
                raise CheckFailure(
                    "Your weights are NaN in the rows of queries whose keys are all masked "
                    f"(case '{case.name}'): a row of -inf scores makes the softmax compute "
                    "0 / 0. Such a query should get all-zero weights and a zero output, e.g. "
                    "weights = weights.masked_fill(~mask.any(-1, keepdim=True), 0.0) or "
                    "torch.nan_to_num(weights). A NaN left there spreads to the whole batch "
                    "in the next layer"
                )
        compare_tensors(weights, expected_w, case, what="Your weights")
        if isinstance(out, torch.Tensor) and out.shape == expected_out.shape and bool(
            torch.isnan(out).any()
        ):
            raise CheckFailure(
                f"Your weights are right but the output contains NaN (case '{case.name}'): "
                "compute it from the cleaned weights (NaN replaced by 0), out = weights @ v"
            )
        compare_tensors(out, expected_out, case, what="Your output", misconceptions=[
            Misconception(
                lambda q, k, v, mask: expected_w @ k,
                "Your output is weights @ k: the weights average the values, out = weights @ v",
            ),
        ])

    run_cases("masked_attention", masked_attention, _attention_cases(seed=5), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 5.3: padding_mask(lengths, max_len)


def _positions(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    return torch.arange(max_len)[None, :]  # (1, S)


PADDING_MISTAKES = [
    Misconception(
        lambda lengths, max_len: ~padding_mask(lengths, max_len),
        "Your mask is inverted: True must mark the real tokens (the keys that may be attended "
        "to) and False the padding",
    ),
    Misconception(
        lambda lengths, max_len: _positions(lengths, max_len) <= lengths[:, None],
        "Your mask marks one position too many: a sequence of length L has its real tokens at "
        "positions 0 .. L-1, so use position < L, not position <= L",
    ),
    Misconception(
        lambda lengths, max_len: _positions(lengths, max_len) < lengths[:, None] - 1,
        "Your mask marks one position too few: a sequence of length L has its real tokens at "
        "positions 0 .. L-1, so use position < L (the last real token is at L - 1)",
    ),
    Misconception(
        lambda lengths, max_len: padding_mask(lengths),
        "Your mask has max(lengths) columns instead of max_len: the batch is padded to "
        "max_len, which can be longer than its longest sequence. Build the positions with "
        "torch.arange(max_len)",
    ),
    Misconception(
        lambda lengths, max_len: padding_mask(lengths, max_len).T,
        "Your mask is transposed: it should have shape (B, max_len), one row per sequence",
    ),
]


def check_padding_mask(padding_mask_fn: Callable) -> None:
    """Check ``padding_mask(lengths, max_len)`` -> (B, max_len) bool, True for real tokens.

    Args:
        padding_mask_fn: the learner's function taking a (B,) integer tensor and an int.
    """

    def check_one(got, case: Case) -> None:
        lengths, max_len = case.args
        expected = padding_mask(lengths, max_len)
        _require_bool(got, expected, case, "Your padding mask",
                      meaning="'real token' (a key that may be attended to)")
        compare_tensors(got, expected, case, what="Your padding mask",
                        misconceptions=PADDING_MISTAKES, atol=0.0, rtol=0.0)

    cases = [
        Case("lengths [3, 5, 2], max_len 5", (torch.tensor([3, 5, 2]), 5)),
        Case("lengths [2, 2], max_len 4 (longer than every sequence)",
             (torch.tensor([2, 2]), 4)),
        Case("an empty sequence: lengths [0, 4, 1], max_len 6", (torch.tensor([0, 4, 1]), 6)),
        Case("one sequence of length 1", (torch.tensor([1]), 1)),
        Case("lengths [7, 3, 5, 4], max_len 9", (torch.tensor([7, 3, 5, 4]), 9)),
    ]
    run_cases("padding_mask", padding_mask_fn, cases, check_one)


# --------------------------------------------------------------------------------------------
# Exercise 5.4: who_sees_whom(f, x)

D_PROBE = 8


@functools.cache
def _probe_layers() -> tuple[MultiHeadAttention, torch.nn.Linear]:
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(505)
        attention = MultiHeadAttention(D_PROBE, 2).eval().requires_grad_(False)
        head = torch.nn.Linear(D_PROBE, 3).requires_grad_(False)
    finally:
        torch.random.set_rng_state(gen_state)  # leave the learner's random stream alone
    return attention, head


def causal_layer(x: torch.Tensor) -> torch.Tensor:
    """A causal self-attention layer: output i depends on inputs 0..i."""
    return _probe_layers()[0](x, is_causal=True)[0]


def bidirectional_layer(x: torch.Tensor) -> torch.Tensor:
    """An unmasked self-attention layer: every output depends on every input."""
    return _probe_layers()[0](x)[0]


def off_by_one_layer(x: torch.Tensor) -> torch.Tensor:
    """A self-attention layer with a buggy mask: output i also sees input i + 1."""
    seq_len = x.shape[1]
    mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    return _probe_layers()[0](x, mask=mask)[0]


def previous_token(x: torch.Tensor) -> torch.Tensor:
    """Output i is input i - 1 (output 0 is zeros): it depends on the past only, not on i."""
    return torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)


def causal_with_rounding_noise(x: torch.Tensor) -> torch.Tensor:
    """A causal layer whose outputs also wobble by ~1e-6 with every input, like float
    rounding noise: not a real dependence at atol=1e-5."""
    return causal_layer(x) + 5e-7 * x.sum(dim=1, keepdim=True)


def causal_logits(x: torch.Tensor) -> torch.Tensor:
    """A causal layer followed by a linear map to 3 outputs per position: (B, T, 3)."""
    return _probe_layers()[1](causal_layer(x))


def bidirectional_in_example_0(x: torch.Tensor) -> torch.Tensor:
    """Example 0 goes through an unmasked layer, the others through a causal one: output i
    sees the later inputs in example 0 only."""
    return torch.cat([bidirectional_layer(x[:1]), causal_layer(x[1:])], dim=0)


def feature_0_sees_next(x: torch.Tensor) -> torch.Tensor:
    """A causal layer whose feature 0 also reads the next input: output i sees input i + 1
    through one of its D numbers only."""
    out = causal_layer(x)
    ahead = torch.cat([x[:, 1:, :1], torch.zeros_like(x[:, :1, :1])], dim=1)  # (B, T, 1)
    return torch.cat([out[..., :1] + ahead, out[..., 1:]], dim=-1)


def _who_reference(f: Callable, x: torch.Tensor, atol: float = 1e-5) -> torch.Tensor:
    return reference_who_sees_whom(f, x, atol=atol, rtol=0.0, n_trials=2)


def _who_every_example(f: Callable, x: torch.Tensor, atol: float = 1e-5) -> torch.Tensor:
    per_example = reference_who_sees_whom(f, x, atol=atol, rtol=0.0, n_trials=2,
                                          per_example=True)  # (B, T, T)
    return per_example.all(0)


def _who_every_feature(f: Callable, x: torch.Tensor, atol: float = 1e-5) -> torch.Tensor:
    """The mistake of reducing over the features with min: a dependence must move them all."""
    gen = torch.Generator().manual_seed(0)
    base = f(x)
    batch, seq_len = base.shape[:2]
    sees = torch.zeros(seq_len, seq_len, dtype=torch.bool)
    for j in range(seq_len):
        y = x.clone()
        y[:, j] = torch.randn(y[:, j].shape, generator=gen, dtype=y.dtype)
        moved = (f(y) - base).abs().reshape(batch, seq_len, -1)  # (B, T, features)
        sees[:, j] = (moved.amin(-1) > atol).any(0)
    return sees


WHO_MISTAKES = [
    Misconception(
        lambda f, x, atol=1e-5: _who_reference(f, x, atol).T,
        "Your matrix is transposed: entry [i, j] should say whether OUTPUT i changed when "
        "INPUT j was replaced (rows are outputs, columns are the replaced inputs), so a causal "
        "layer gives a lower-triangular matrix",
    ),
    Misconception(
        lambda f, x, atol=1e-5: torch.diag(torch.diagonal(_who_reference(f, x, atol))),
        "Your matrix has entries on the diagonal only: after replacing input j you seem to "
        "look at output j alone. Compare every output position i (a whole column [:, j]) "
        "after each replacement",
    ),
    Misconception(
        lambda f, x, atol=1e-5: reference_who_sees_whom(f, x, atol=0.0, rtol=0.0),
        "Your matrix counts changes of about 1e-6 as dependences: that is float rounding "
        "noise, not information flowing. Count output i as changed only if it moved by more "
        "than atol, e.g. (new - old).abs().amax() > atol (or use torch.allclose with atol)",
    ),
    Misconception(
        lambda f, x, atol=1e-5: torch.flip(
            torch.cummax(torch.flip(_who_reference(f, x, atol).int(), [1]), dim=1).values,
            [1]).bool(),
        "Your matrix looks as if input j and every input after it were replaced together: "
        "replace one position at a time, leaving all the others as they were",
    ),
    Misconception(
        lambda f, x, atol=1e-5: torch.cummax(_who_reference(f, x, atol).int(),
                                             dim=1).values.bool(),
        "Your matrix looks as if inputs 0..j were replaced together: replace one position at "
        "a time, starting again from the original x for each j",
    ),
    Misconception(
        _who_every_example,
        "Your matrix marks a dependence only when output i changed in EVERY example of the "
        "batch. A dependence that shows up in one example is still a dependence (a future leak "
        "in one sequence is a leak): combine the examples with any(), not all()",
    ),
    Misconception(
        _who_every_feature,
        "Your matrix misses dependences that move only some of output i's numbers: you seem "
        "to require every feature to change (a min, or all(), over the features). Output i "
        "sees input j when ANY of its numbers moves by more than atol: reduce the features "
        "with a max (amax)",
    ),
    Misconception(
        lambda f, x, atol=1e-5: ~_who_reference(f, x, atol),
        "Your matrix is inverted: True should mean 'output i changed when input j was "
        "replaced'",
    ),
]


def _who_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Case("causal attention, T=5", (causal_layer, rand(gen, 2, 5, D_PROBE))),
        Case("an unmasked (bidirectional) layer, T=4", (bidirectional_layer,
                                                         rand(gen, 2, 4, D_PROBE))),
        Case("a mask off by one, T=6", (off_by_one_layer, rand(gen, 2, 6, D_PROBE))),
        Case("output i = input i - 1, T=5", (previous_token, rand(gen, 3, 5, D_PROBE))),
        Case("causal layer with ~1e-6 rounding noise, T=5",
             (causal_with_rounding_noise, rand(gen, 2, 5, D_PROBE))),
        Case("causal layer then 3 outputs per position, T=4",
             (causal_logits, rand(gen, 1, 4, D_PROBE))),
        Case("unmasked in example 0, causal in example 1, T=4",
             (bidirectional_in_example_0, rand(gen, 2, 4, D_PROBE))),
        Case("causal, but feature 0 also reads the next input, T=5",
             (feature_0_sees_next, rand(gen, 2, 5, D_PROBE))),
        Case("T=1", (causal_layer, rand(gen, 2, 1, D_PROBE))),
    ]


def check_who_sees_whom(who_sees_whom: Callable) -> None:
    """Check ``who_sees_whom(f, x, atol=1e-5)`` -> (T, T) bool, entry [i, j] True when output i
    of ``f`` changes by more than atol after input j of ``x`` (B, T, D) is replaced.

    The functions probed: causal, unmasked and off-by-one attention layers, a "previous token"
    function (the diagonal is not seen), a causal layer with rounding noise, a layer with a
    different output size, a batch whose examples differ (a dependence in one example only)
    and a layer with a dependence in one feature only.

    Args:
        who_sees_whom: the learner's function.
    """

    def check_one(got, case: Case) -> None:
        f, x = case.args
        expected = _who_reference(f, x)
        seq_len = x.shape[1]
        if isinstance(got, torch.Tensor) and got.dim() == 3 and tuple(got.shape[1:]) == (
            seq_len, seq_len
        ):
            raise CheckFailure(
                f"Your result has shape {tuple(got.shape)}, one matrix per example. Return one "
                f"(T, T) = ({seq_len}, {seq_len}) matrix for the whole batch: output i counts as "
                f"changed if it changed in any example (case '{case.name}')"
            )
        _require_bool(got, expected, case, "Your matrix",
                      meaning="'output i changed when input j was replaced'")
        compare_tensors(got, expected, case, what="Your who-sees-whom matrix",
                        misconceptions=WHO_MISTAKES, atol=0.0, rtol=0.0)

    run_cases("who_sees_whom", who_sees_whom, _who_cases(seed=54), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 5.5 (find the bug): attention over a padded batch, with the mask on the wrong axis


def reference_padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """Attention over right-padded sequences: no query attends to a padding key. (B, T, d_v)."""
    keep = padding_mask(lengths, k.shape[-2])  # (B, S): True = a real key
    return scaled_dot_product_attention(q, k, v, mask=keep[:, None, :])[0]  # (B, T, d_v)


def _padded_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    cases = []
    for lengths, d in (([5, 3], 4), ([6, 6, 2], 8), ([4, 1, 3], 5), ([2, 7], 3)):
        B, T = len(lengths), max(lengths)
        x = rand(gen, B, T, d)
        cases.append(Case(f"lengths {lengths}, d={d}", (x, x, x, torch.tensor(lengths))))
    q, k, v = rand(gen, 2, 5, 4), rand(gen, 2, 5, 4), rand(gen, 2, 5, 6)
    cases.append(Case("distinct q, k, v, lengths [5, 2], d_v=6", (q, k, v, torch.tensor([5, 2]))))
    return cases


def _pad_leak(fixed: Callable, case: Case) -> tuple[int, int, int] | None:
    """(b, i, j): real output i of example b moves when the pad input j changes; or None."""
    x, _, _, lengths = case.args
    sees = reference_who_sees_whom(lambda y: fixed(y, y, y, lengths), x,
                                   per_example=True)  # (B, T, T)
    keep = padding_mask(lengths, x.shape[1])  # (B, T)
    leak = sees & keep[:, :, None] & ~keep[:, None, :]  # real output i sees pad input j
    if not bool(leak.any()):
        return None
    b, i, j = (int(v) for v in torch.nonzero(leak)[0])
    return b, i, j


def check_fixed_padded_attention(fixed_padded_attention: Callable) -> None:
    """Grade the fixed ``padded_attention(q, k, v, lengths)``: course_lib's who_sees_whom must
    find no real output that depends on a padding position, and the real positions must equal
    attention with a key padding mask (outputs at padding positions only need to be finite).
    """
    cases = _padded_cases(seed=11)
    for case in cases:
        got = call_learner(fixed_padded_attention, case)
        expected = reference_padded_attention(*case.args)  # (B, T, d_v)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            raise CheckFailure(f"padded_attention should return a tensor of shape "
                               f"{tuple(expected.shape)}, got {describe(got)} (case "
                               f"'{case.name}'); return only the output, not the weights")
        if not torch.isfinite(got).all():
            raise CheckFailure(
                f"your output contains NaN or inf (case '{case.name}'). A query whose keys "
                "are all masked must give zeros, not NaN: mask the keys only, or use "
                "course_lib's scaled_dot_product_attention, which handles such rows")
        if case.args[0] is case.args[1]:  # q = k = v = x: probe it as a function of x
            leak = _pad_leak(fixed_padded_attention, case)
            if leak is not None:
                b, i, j = leak
                raise CheckFailure(
                    f"course_lib's who_sees_whom finds that the real output {i} of example {b} "
                    f"changes when the padding at position {j} changes (case '{case.name}'): "
                    "real tokens still attend to padding keys. The padding mask must act on "
                    "the key axis, the last axis of the scores (B, T, S)")
        keep = padding_mask(case.args[3], got.shape[1])  # (B, T): compare real positions
        if not _close_nan(got[keep], expected[keep]):
            raise CheckFailure(
                f"no real output depends on padding, but the real outputs differ from attention "
                f"with a key padding mask by up to "
                f"{float((got - expected)[keep].abs().max()):.3g} (case '{case.name}'): "
                "change only the mask, keep the attention as it was")
    print(f"\u2705 padded_attention: who_sees_whom finds no real output reading the padding, and "
          f"the real outputs equal the reference on all {len(cases)} test cases")


# --------------------------------------------------------------------------------------------
# Exercise 5.6 (capstone): a causal self-attention language model
# The steps fix the architecture, so the check compares the learner's logits with a reference
# forward built from the same model's layers. It first measures the properties every correct
# language model has (their failures say more than "wrong values"), then names the step a
# wrong forward skipped (a residual, queries and keys swapped) when it recognises it.

_LM_VOCAB, _LM_WIDTH, _LM_LEN = 11, 16, 12


def _lm_output(model: torch.nn.Module, ids: torch.Tensor, what: str) -> torch.Tensor:
    """Run the learner's model; return its logits or fail with a message about the output."""
    try:
        with torch.no_grad():
            out = model(ids)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise CheckFailure(
            f"your model raised {type(exc).__name__} on {what} (ids of shape "
            f"{tuple(ids.shape)}):\n    {exc}"
        ) from exc
    logits = getattr(out, "logits", None)
    expected = (*ids.shape, _LM_VOCAB)
    if not isinstance(logits, torch.Tensor):
        raise CheckFailure(f"model(ids).logits should be a tensor of shape {expected}, got "
                           f"{describe(logits)}")
    if tuple(logits.shape) != expected:
        raise CheckFailure(
            f"model(ids).logits has shape {tuple(logits.shape)} but should have shape "
            f"{expected}: one score per vocabulary entry at every position (did you apply the "
            "read-out layer, self.head, to every position?)"
        )
    if not torch.isfinite(logits).all():
        raise CheckFailure(f"the logits contain NaN or inf on {what}: look at the masked "
                           "attention (a fully masked row?) and at the causal mask")
    return logits


def _build_lm(model_class: Callable) -> torch.nn.Module:
    if not callable(model_class):
        raise CheckFailure(f"expected the model class, got {describe(model_class)}")
    with torch.random.fork_rng(devices=[]):  # leave the learner's random state alone
        torch.manual_seed(0)
        try:
            model = model_class(_LM_VOCAB, d_model=_LM_WIDTH, max_len=_LM_LEN)
        except Exception as exc:
            raise CheckFailure(
                f"could not build the model with {getattr(model_class, '__name__', 'it')}"
                f"(vocab_size={_LM_VOCAB}, d_model={_LM_WIDTH}, max_len={_LM_LEN}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    return model.eval()


def _check_lm_causal(model: torch.nn.Module, ids: torch.Tensor) -> None:
    sees = reference_who_sees_whom(lambda x: _lm_output(model, x, "the probe's inputs"), ids,
                                   vocab_size=_LM_VOCAB)  # (T, T)
    future = torch.triu(torch.ones_like(sees), diagonal=1)
    if (sees & future).any():
        ahead = int(max(j - i for i, j in torch.nonzero(sees & future).tolist()))
        extra = (" Only one position ahead: is the mask off by one?"
                 if ahead == 1 else "")
        raise CheckFailure(
            f"your model leaks the future: the output at some position changes when a later "
            f"token changes (up to {ahead} position(s) ahead). Pass causal_mask(T, T) to "
            f"masked_attention so that position i attends only to positions j <= i.{extra}"
        )
    past = torch.tril(torch.ones_like(sees), diagonal=-1)
    if (past & ~sees).any():
        i, j = torch.nonzero(past & ~sees)[0].tolist()
        raise CheckFailure(
            f"the output at position {i} does not depend on the token at position {j}, which "
            "it should be allowed to read: attend to every earlier position, not only to the "
            "current one (is the mask the lower triangle, with the diagonal?)"
        )


def check_tiny_lm(model_class: Callable) -> None:
    """Check the capstone language model's ``forward``: its properties, then its equations.

    The class is built as ``model_class(vocab_size, d_model=16, max_len=12)`` and must return
    an output whose ``.logits`` has shape (B, T, vocab_size). Checked: the shape, that no
    output depends on a later token and every output depends on every earlier one, that word
    order matters (positions are used), that the examples of a batch do not mix, and finally
    that the logits equal the exercise's equations applied to the model's own layers.
    """
    model = _build_lm(model_class)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(_LM_VOCAB, (3, 10), generator=gen)  # (B, T)
    logits = _lm_output(model, ids, "a batch of 3 sequences of 10 tokens")
    alone = _lm_output(model, ids[1:2], "one sequence of the batch on its own")
    if not torch.allclose(alone[0], logits[1], atol=1e-5, rtol=1e-4):
        raise CheckFailure(
            "the output for a sequence changes when other sequences are in the batch: the "
            "examples mix. Attention must run within each sequence (over the last two "
            "dimensions), never across the batch dimension"
        )
    _lm_output(model, ids[:, :1], "sequences of a single token")
    _check_lm_causal(model, ids[:1])
    swapped = ids.clone()
    swapped[:, 0], swapped[:, 1] = ids[:, 1], ids[:, 0]
    differ = ids[:, 0] != ids[:, 1]  # (B,): examples where the swap changes something
    last = _lm_output(model, swapped, "the batch with its first two tokens swapped")[:, -1]
    if differ.any() and torch.allclose(last[differ], logits[differ, -1], atol=1e-5, rtol=1e-4):
        raise CheckFailure(
            "swapping the first two tokens leaves the last output unchanged: your model does "
            "not see word order. Add the position embeddings, self.position(positions), to "
            "the token embeddings before the attention"
        )
    _check_lm_steps(model, ids, logits)
    print("\u2705 your language model follows the equations (equal to a reference built from "
          "its own layers), is causal, reads every earlier token, uses word order and keeps "
          "the examples of a batch apart (probed with random weights, a batch of 3 sequences "
          "of 10 tokens)")


_LM_PARTS = ("token", "position", "qkv", "out", "ffn", "head")


def _reference_lm_logits(model: torch.nn.Module, ids: torch.Tensor, *, attn_residual: bool = True,
                         ffn_residual: bool = True, order: str = "qkv") -> torch.Tensor:
    """The exercise's equations with the model's own layers (variants: an addition left out,
    the slices of the fused projection taken in another order)."""
    T = ids.shape[1]
    x = model.token(ids) + model.position(torch.arange(T))  # (B, T, D)
    parts = dict(zip(order, model.qkv(x).chunk(3, dim=-1), strict=True))  # (B, T, D) each
    attended, _ = scaled_dot_product_attention(parts["q"], parts["k"], parts["v"],
                                               mask=causal_mask(T))  # (B, T, D)
    x = (x if attn_residual else 0) + model.out(attended)  # (B, T, D)
    x = (x if ffn_residual else 0) + model.ffn(x)  # (B, T, D)
    return model.head(x)  # (B, T, V)


_LM_STEP_MISTAKES = (
    ({"attn_residual": False, "ffn_residual": False},
     "you replaced x instead of adding to it, twice: x1 = x0 + out(attention) and "
     "x2 = x1 + ffn(x1) both add to what was there (residual connections)"),
    ({"attn_residual": False},
     "you replaced x by the attention output instead of adding it: the equations say "
     "x1 = x0 + out(attention)"),
    ({"ffn_residual": False},
     "you replaced x by self.ffn(x) instead of adding it: the equations say "
     "x2 = x1 + ffn(x1)"),
    ({"order": "kqv"},
     "you swapped queries and keys: the first slice of self.qkv(x) holds the queries, the "
     "second the keys"),
    ({"order": "vkq"},
     "you swapped queries and values: the slices of self.qkv(x) are queries, keys, values, "
     "in that order"),
    ({"order": "qvk"},
     "you swapped keys and values: the slices of self.qkv(x) are queries, keys, values, in "
     "that order"),
)


def _check_lm_steps(model: torch.nn.Module, ids: torch.Tensor, logits: torch.Tensor) -> None:
    """Compare with the reference built from the model's own layers; name a skipped step."""
    missing = [name for name in _LM_PARTS if not isinstance(getattr(model, name, None),
                                                           torch.nn.Module)]
    if missing:
        raise CheckFailure(f"your model has no layer(s) {missing}: keep the __init__ given in "
                           "the exercise and write only forward")
    with torch.no_grad():
        expected = _reference_lm_logits(model, ids)  # (B, T, V)
        if _close_nan(logits, expected):
            return
        for variant, message in _LM_STEP_MISTAKES:
            if _close_nan(logits, _reference_lm_logits(model, ids, **variant)):
                raise CheckFailure(f"your model has the right properties, but {message}")
    raise CheckFailure(
        "your model has the right properties, but its logits differ from the exercise's "
        "equations applied to its own layers by up to "
        f"{float((logits - expected).abs().max()):.3g}: compare each of your lines with one "
        "equation")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
