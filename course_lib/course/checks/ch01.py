"""Checks for chapter 01, the limits of RNNs.

Conventions the exercises state: vectors are rows, so W h_{t-1} for a batch of states is
``h_prev @ W.T``; W (H, H) multiplies the previous state and U (H, Din) the input.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib.attention import MultiHeadAttention
from course_lib.rnn import ElmanRNN, RNNAttention, elman_forward, elman_step, gradient_norms

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

# --------------------------------------------------------------------------------------------
# Exercise 1.1: elman_step

STEP_HINT = (
    "W has shape (H, H) and multiplies the previous state h_prev; U has shape (H, Din) and "
    "multiplies the input x_t. With a batch, every row is one example, so W h becomes "
    "h_prev @ W.T and U x becomes x_t @ U.T (this also works for unbatched vectors)"
)


def _step_case(name: str, gen: torch.Generator, batch: int | None, d_in: int, hidden: int,
               scale: float = 1.0, zero_state: bool = False) -> Case:
    lead = () if batch is None else (batch,)
    x_t = rand(gen, *lead, d_in, scale=scale)
    h_prev = torch.zeros(*lead, hidden) if zero_state else torch.tanh(rand(gen, *lead, hidden))
    W = rand(gen, hidden, hidden, scale=scale / hidden**0.5)  # not symmetric
    U = rand(gen, hidden, d_in, scale=scale / d_in**0.5)
    b = rand(gen, hidden, scale=0.5 * scale)
    return Case(name, (x_t, h_prev, W, U, b), hint=STEP_HINT)


def _step_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        _step_case("one example, Din=3, H=5", gen, None, 3, 5),
        _step_case("batch of 4, Din=3, H=5", gen, 4, 3, 5),
        _step_case("Din = H = 4, batch of 2", gen, 2, 4, 4),
        _step_case("B = Din = H = 4", gen, 4, 4, 4),
        _step_case("one example, Din = H = 6", gen, None, 6, 6),
        _step_case("batch of 1, h_prev = 0", gen, 1, 2, 3, zero_state=True),
        _step_case("large inputs (tanh saturates)", gen, 3, 5, 4, scale=6.0),
    ]


STEP_MISTAKES = [
    Misconception(
        lambda x, h, W, U, b: h @ W.T + x @ U.T + b,
        "Your h_t equals W h_prev + U x_t + b without the nonlinearity: apply torch.tanh to "
        "the sum (values of h_t must stay between -1 and 1)",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.sigmoid(h @ W.T + x @ U.T + b),
        "You used a sigmoid; this RNN uses tanh, so h_t = torch.tanh(...)",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.relu(h @ W.T + x @ U.T + b),
        "You used a ReLU; this RNN uses tanh, so h_t = torch.tanh(...)",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(h @ W.T + x @ U.T),
        "Your h_t is missing the bias: add b inside the tanh",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(x @ W.T + h @ U.T + b),
        "W and U look swapped: W (H, H) multiplies the previous state h_prev and U (H, Din) "
        "multiplies the input x_t. (When Din = H the shapes cannot tell them apart, but the "
        "values can)",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(h @ W + x @ U + b),
        "You multiplied by W and U without transposing them: with vectors as rows, W h is "
        "h_prev @ W.T and U x is x_t @ U.T",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(h @ W + x @ U.T + b),
        "You multiplied h_prev @ W, which is W^T h: with vectors as rows, W h is h_prev @ W.T",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(h @ W.T + x @ U + b),
        "You multiplied x_t @ U, which is U^T x: with vectors as rows, U x is x_t @ U.T",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(W @ h + U @ x + b) if h.dim() == 2 else None,
        "With a batch, W @ h_prev multiplies W by the matrix of all states and mixes the "
        "examples of the batch. Each row of h_prev is one example's state: use h_prev @ W.T "
        "(and x_t @ U.T)",
    ),
    Misconception(
        lambda x, h, W, U, b: torch.tanh(h @ W.T) + x @ U.T + b,
        "You applied tanh to the recurrent term only: the whole sum W h_prev + U x_t + b goes "
        "through the tanh",
    ),
]


def check_elman_step(elman_step_fn: Callable) -> None:
    """Check ``elman_step(x_t, h_prev, W, U, b)`` = tanh(W h_prev + U x_t + b).

    Args:
        elman_step_fn: the learner's function; x_t (B, Din) or (Din,), h_prev (B, H) or
            (H,), W (H, H), U (H, Din), b (H,); returns h_t (B, H) or (H,).
    """

    def check_one(got, case: Case) -> None:
        expected = elman_step(*case.args)
        compare_tensors(got, expected, case, what="Your h_t", misconceptions=STEP_MISTAKES)

    run_cases("elman_step", elman_step_fn, _step_cases(seed=101), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 1.1: leaky_step, h_t = (1 - a) h_{t-1} + a tanh(W h_{t-1} + U x_t + b)
# (check_elman_step above serves the plain step, the exercise of an earlier edition)

LEAKY_HINT = (
    "the new state mixes two vectors of the shape of h_prev: the old state h_prev, weighted "
    "1 - a, and the Elman step's candidate tanh(W h_prev + U x_t + b), weighted a. " + STEP_HINT
)


def leaky_reference(x_t, h_prev, W, U, b, a) -> torch.Tensor:
    """The leaky step from course_lib's Elman step: (1 - a) h_prev + a elman_step(...)."""
    return (1 - a) * h_prev + a * elman_step(x_t, h_prev, W, U, b)


def _leaky_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    rates = (0.3, 0.1, 0.5, 0.25, 0.8, 0.6, 1.0)
    steps = _step_cases(seed)
    return [Case(f"{c.name}, a={a}", (*c.args, a), hint=LEAKY_HINT)
            for c, a in zip(steps, rates, strict=True)] + [
        Case("batch of 3, Din=2, H=3, a=0.05 (a slow state)",
             (*_step_case("", gen, 3, 2, 3).args, 0.05), hint=LEAKY_HINT)]


def _elman(x, h, W, U, b) -> torch.Tensor:
    return elman_step(x, h, W, U, b)


LEAKY_MISTAKES = [
    Misconception(
        lambda x, h, W, U, b, a: a * h + (1 - a) * _elman(x, h, W, U, b),
        "Your weights look swapped: the old state gets 1 - a and the candidate a, so that "
        "a = 1 gives the plain Elman step and a small a keeps most of the old state",
    ),
    Misconception(
        lambda x, h, W, U, b, a: _elman(x, h, W, U, b),
        "Your h_t is the plain Elman step: the old state must be kept in part, "
        "h_t = (1 - a) h_prev + a tanh(...)",
    ),
    Misconception(
        lambda x, h, W, U, b, a: torch.tanh((1 - a) * h + a * (h @ W.T + x @ U.T + b)),
        "You mixed the old state into the tanh's argument: the mix comes after the tanh, "
        "(1 - a) h_prev + a tanh(W h_prev + U x_t + b), so the old state passes through "
        "unsquashed",
    ),
    Misconception(
        lambda x, h, W, U, b, a: (1 - a) * h + a * (h @ W.T + x @ U.T + b),
        "Your candidate has no nonlinearity: apply torch.tanh to W h_prev + U x_t + b",
    ),
    Misconception(
        lambda x, h, W, U, b, a: (1 - a) * h + a * torch.tanh(x @ U.T + b),
        "Your candidate leaves out the recurrent term W h_prev: the candidate is the whole "
        "Elman step, tanh(W h_prev + U x_t + b)",
    ),
    Misconception(
        lambda x, h, W, U, b, a: (1 - a) * h + _elman(x, h, W, U, b),
        "You did not weight the candidate by a: h_t = (1 - a) h_prev + a tanh(...)",
    ),
    Misconception(
        lambda x, h, W, U, b, a: h + a * _elman(x, h, W, U, b),
        "You kept all of the old state: weight it by 1 - a, so the two weights add up to 1",
    ),
    *(Misconception(lambda x, h, W, U, b, a, _w=m.wrong: None if _w(x, h, W, U, b) is None
                    else (1 - a) * h + a * _w(x, h, W, U, b), m.message)
      for m in STEP_MISTAKES[3:9]),  # the Elman step's bias, swap and transpose mistakes
]


def check_leaky_step(leaky_step_fn: Callable) -> None:
    """Check ``leaky_step(x_t, h_prev, W, U, b, a)`` = (1 - a) h_prev + a tanh(W h_prev +
    U x_t + b) against course_lib's elman_step.

    Args:
        leaky_step_fn: the learner's function; x_t (B, Din) or (Din,), h_prev (B, H) or (H,),
            W (H, H), U (H, Din), b (H,), a a float in (0, 1]; returns h_t (B, H) or (H,).
    """

    def check_one(got, case: Case) -> None:
        expected = leaky_reference(*case.args)
        compare_tensors(got, expected, case, what="Your h_t", misconceptions=LEAKY_MISTAKES)

    run_cases("leaky_step", leaky_step_fn, _leaky_cases(seed=101), check_one)


# --------------------------------------------------------------------------------------------
# Exercise 1.2: elman_forward

FORWARD_HINT = (
    "loop over time: x[..., t, :] is the input at step t for both (T, Din) and (B, T, Din); "
    "keep the current state in a variable, update it with one step, and collect every new "
    "state. " + STEP_HINT
)


def _forward_case(name: str, gen: torch.Generator, batch: int | None, steps: int, d_in: int,
                  hidden: int, zero_state: bool = False) -> Case:
    lead = () if batch is None else (batch,)
    x = rand(gen, *lead, steps, d_in)
    h0 = torch.zeros(*lead, hidden) if zero_state else torch.tanh(rand(gen, *lead, hidden))
    W = rand(gen, hidden, hidden, scale=1.2 / hidden**0.5)
    U = rand(gen, hidden, d_in, scale=1.0 / d_in**0.5)
    b = rand(gen, hidden, scale=0.5)
    return Case(name, (x, h0, W, U, b), hint=FORWARD_HINT)


def _forward_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        _forward_case("one sequence, T=5, Din=3, H=4", gen, None, 5, 3, 4),
        _forward_case("batch of 4, T=4 (B = T), Din=3, H=5", gen, 4, 4, 3, 5),
        _forward_case("batch of 2, T=6, Din=3, H=4", gen, 2, 6, 3, 4),
        _forward_case("Din = H = 4, T=5", gen, None, 5, 4, 4),
        _forward_case("batch of 3, Din = H = 5, T=7", gen, 3, 7, 5, 5),
        _forward_case("a single step, T=1", gen, None, 1, 3, 4),
        _forward_case("batch of 2, T=4, h0 = 0", gen, 2, 4, 2, 3, zero_state=True),
    ]


def _loop(x, h0, step: Callable, *, carry: bool = True, backwards: bool = False,
          store_before: bool = False) -> torch.Tensor:
    """An RNN loop with a configurable step and a few ways of getting the loop wrong."""
    h = h0
    steps = range(x.shape[-2])
    states = []
    for t in reversed(steps) if backwards else steps:
        new = step(x[..., t, :], h if carry else h0)
        states.append(h if store_before else new)
        h = new
    return torch.stack(states, dim=-2)  # (B, T, H) or (T, H)


def _tanh_step(W, U, b, *, act=torch.tanh, swap=False, bias=True, transpose=True):
    def step(x_t, h):
        A, B = (U, W) if swap else (W, U)
        if transpose:
            A, B = A.T, B.T
        pre = h @ A + x_t @ B
        return act(pre + b if bias else pre)

    return step


def _first_axis_loop(x, h0, W, U, b) -> torch.Tensor:
    """The planted bug of exercise 1.2: ``x[t]`` for ``t in range(len(x))`` steps over the
    first axis, which is time for one sequence (T, Din) but the batch for (B, T, Din)."""
    h, states = h0, []
    for t in range(len(x)):
        h = torch.tanh(h @ W.T + x[t] @ U.T + b)
        states.append(h)
    return torch.stack(states, dim=-2)


FORWARD_MISTAKES = [
    Misconception(
        lambda x, h0, W, U, b: _first_axis_loop(x, h0, W, U, b) if x.dim() == 3 else None,
        "Your loop steps over the first axis of x. For one sequence (T, Din) that is time, but "
        "for a batch (B, T, Din) x[t] is example t, not the inputs at step t. Index the time "
        "axis, the second-to-last one, in both cases",
    ),
    Misconception(
        lambda x, h0, W, U, b: torch.cat(
            [h0.unsqueeze(-2), elman_forward(x, h0, W, U, b)], dim=-2),
        "Your output starts with h0 and so has T + 1 states. Return the T new states "
        "h_1, ..., h_T only: shape (T, H), or (B, T, H) for a batch",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b), store_before=True),
        "Your states are shifted by one step: you stored h before updating it, so the output "
        "holds h_0, ..., h_{T-1}. Store the new state h_t after computing it",
    ),
    Misconception(
        lambda x, h0, W, U, b: elman_forward(x, h0, W, U, b)[..., -1, :],
        "You returned only the last state h_T. Return every state h_1, ..., h_T stacked along "
        "the time axis: shape (T, H), or (B, T, H) for a batch (torch.stack(states, dim=-2))",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b), carry=False),
        "Every one of your states is computed from h0: the state is not carried forward. "
        "Step t must use the previous step's result h_{t-1} (assign the new state to the "
        "variable you pass to the next step)",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b), backwards=True),
        "You ran over the sequence backwards (from t = T down to 1): read the inputs in order, "
        "t = 1, ..., T",
    ),
    Misconception(
        lambda x, h0, W, U, b: elman_forward(x, h0, W, U, b).transpose(0, 1)
              if x.dim() == 3 else None,
        "With a batch, your states are stacked time-major, (T, B, H). Stack them along the "
        "time axis of a batch-first tensor, (B, T, H): torch.stack(states, dim=-2)",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b, act=lambda z: z)),
        "Your states have no nonlinearity: apply torch.tanh at every step",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b, bias=False)),
        "Your states are missing the bias b: add it inside the tanh at every step",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b, swap=True)),
        "W and U look swapped: W (H, H) multiplies the previous state and U (H, Din) the "
        "input. (When Din = H the shapes cannot tell them apart, but the values can)",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(x, h0, _tanh_step(W, U, b, transpose=False)),
        "You multiplied by W and U without transposing them: with vectors as rows, W h is "
        "h @ W.T and U x is x_t @ U.T",
    ),
    Misconception(
        lambda x, h0, W, U, b: _loop(
            x, h0, lambda x_t, h: torch.tanh(h @ W + x_t @ U.T + b)),
        "You multiplied h @ W, which is W^T h: with vectors as rows, W h is h @ W.T",
    ),
]


def check_elman_forward(elman_forward_fn: Callable) -> None:
    """Check ``elman_forward(x, h0, W, U, b)`` returns every hidden state h_1..h_T.

    Args:
        elman_forward_fn: the learner's function; x (T, Din) or (B, T, Din), h0 (H,) or
            (B, H), W (H, H), U (H, Din), b (H,); returns (T, H) or (B, T, H).
    """

    def check_one(got, case: Case) -> None:
        x, h0 = case.args[:2]
        expected = elman_forward(*case.args)
        if isinstance(got, torch.Tensor) and got.shape == h0.shape and x.shape[-2] > 1:
            raise CheckFailure(
                f"Your function returned a single state, shape {tuple(got.shape)}, but it "
                f"should return all {x.shape[-2]} states h_1, ..., h_T stacked along the time "
                f"axis: shape {tuple(expected.shape)} (case '{case.name}'). Collect every new "
                "state in a list and torch.stack(states, dim=-2)"
            )
        compare_tensors(got, expected, case, what="Your hidden states",
                        misconceptions=FORWARD_MISTAKES)

    cases = _forward_cases(seed=102)
    try:
        run_cases("elman_forward", elman_forward_fn, cases, check_one)
    except CheckFailure as failure:
        if not str(failure).startswith(FORWARD_MISTAKES[0].message):
            raise  # the instrument's note belongs to the planted bug only
        raise CheckFailure(f"{failure}\n{FORWARD_INSTRUMENT.format(n=len(cases))}") from None


FORWARD_INSTRUMENT = (
    "(Found by equality with the reference: your states were compared with course_lib's "
    "elman_forward on {n} inputs, one sequence and batches, one of them with B = T. A bug "
    "that only shows on some shapes needs a test on each of them.)"
)


# --------------------------------------------------------------------------------------------
# Exercise 1.3: gradient_norms


@dataclass
class _GradCase(Case):
    """A case whose function has parameters that must come out untouched."""

    modules: list[nn.Module] = field(default_factory=list)


def _rnn_fn(gen_seed: int, d_in: int, hidden: int, gain: float) -> tuple[Callable, nn.Module]:
    torch.manual_seed(gen_seed)  # only the module's initialisation; restored by the caller
    rnn = ElmanRNN(d_in, hidden)
    with torch.no_grad():
        rnn.W.mul_(gain / torch.linalg.eigvals(rnn.W).abs().max())

    def rnn_outputs(x: torch.Tensor) -> torch.Tensor:
        return rnn(x)[0]  # (T, H)

    return rnn_outputs, rnn


def _attention_fn(gen_seed: int, d_model: int) -> tuple[Callable, nn.Module]:
    torch.manual_seed(gen_seed)
    attention = MultiHeadAttention(d_model, 2)

    def attention_outputs(x: torch.Tensor) -> torch.Tensor:
        return attention(x)[0]  # (T, D)

    return attention_outputs, attention


def _running_sum_fn(gen: torch.Generator, d_in: int, d_out: int) -> Callable:
    M = rand(gen, d_in, d_out)

    def running_sum(x: torch.Tensor) -> torch.Tensor:
        # position t sees x_1..x_t, weighted more the later they come: no parameters at all
        weights = torch.arange(1, x.shape[-2] + 1, dtype=x.dtype)[:, None]  # (T, 1)
        return torch.tanh(torch.cumsum(weights * x, dim=-2) @ M)  # (T, Dout)

    return running_sum


def _grad_cases(seed: int) -> list[_GradCase]:
    gen = torch.Generator().manual_seed(seed)
    state = torch.get_rng_state()
    try:
        rnn, rnn_module = _rnn_fn(seed, 3, 6, gain=1.3)
        square, square_module = _rnn_fn(seed + 1, 5, 4, gain=0.9)
        attention, attention_module = _attention_fn(seed + 2, 8)
        short, short_module = _rnn_fn(seed + 3, 2, 3, gain=1.0)
    finally:
        torch.set_rng_state(state)  # the learner's global random stream is left alone
    running = _running_sum_fn(gen, 4, 3)
    return [
        _GradCase("Elman RNN, T=12, Din=3, H=6", (rnn, rand(gen, 12, 3)),
                  modules=[rnn_module]),
        _GradCase("self-attention layer, T=7, D=8", (attention, rand(gen, 7, 8)),
                  modules=[attention_module]),
        _GradCase("Elman RNN with T = Din = 5", (square, rand(gen, 5, 5)),
                  modules=[square_module]),
        _GradCase("a weighted running sum, T=6, Din=4", (running, rand(gen, 6, 4))),
        _GradCase("one position, T=1", (short, rand(gen, 1, 2)), modules=[short_module]),
    ]


def _grad_of(scalar_of: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        (grad,) = torch.autograd.grad(scalar_of(leaf), leaf)
    return grad  # (T, Din)


def _jacobian_norms(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    jac = torch.autograd.functional.jacobian(lambda v: fn(v)[-1], x)  # (H, T, Din)
    return jac.pow(2).sum(dim=(0, 2)).sqrt()  # (T,)


GRAD_MISTAKES = [
    Misconception(
        lambda fn, x: gradient_norms(fn, x).flip(0),
        "Your norms are in reverse order. Entry t must belong to input position t (entry 0 to "
        "x_1, the last entry to x_T, which is at distance 0 from h_T); keep the positions' "
        "order and turn it into distances only when plotting",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v).sum(), x).norm(dim=-1),
        "You differentiated the sum of the outputs at every position. The exercise asks how "
        "each input reaches the last output only: differentiate fn(x)[-1].sum()",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[0].sum(), x).norm(dim=-1),
        "You differentiated the output at the first position, fn(x)[0]. h_T is the output at "
        "the last position: fn(x)[-1].sum()",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[-1].sum(), x).pow(2).sum(-1),
        "You returned squared norms: take the square root (torch.linalg.vector_norm(g, dim=-1) "
        "or g.norm(dim=-1))",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[-1].sum(), x).abs().sum(-1),
        "You summed absolute values (the L1 norm); use the L2 norm, sqrt(sum of squares): "
        "g.norm(dim=-1)",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[-1].sum(), x).abs().amax(-1),
        "You took the largest absolute entry of each gradient; use the L2 norm, "
        "g.norm(dim=-1)",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[-1].sum(), x).norm(dim=0),
        "You took the norm over the positions (dim 0), which gives one number per feature. "
        "Take it over the features of each position instead: g.norm(dim=-1), one number per t",
    ),
    Misconception(
        _jacobian_norms,
        "You computed the norm of the whole Jacobian d h_T / d x_t. The exercise asks for the "
        "gradient of one scalar, fn(x)[-1].sum(), with respect to x_t",
    ),
    Misconception(
        lambda fn, x: fn(x).detach().norm(dim=-1),
        "You returned the norms of the outputs themselves. Differentiate fn(x)[-1].sum() with "
        "respect to x (torch.autograd.grad) and return the norm of each row of that gradient",
    ),
    Misconception(
        lambda fn, x: _grad_of(lambda v: fn(v)[-1].sum(), x).norm(),
        "You returned one norm for the whole gradient; return one per position, the norm of "
        "each row: g.norm(dim=-1), shape (T,)",
    ),
]

GRAD_LEAK = (
    "Your function left gradients in the .grad of the parameters behind fn ({names}). That is "
    "what .backward() does, and in a training loop those gradients would be added to the next "
    "update's. Use torch.autograd.grad(scalar, x), which returns the gradient with respect to "
    "x only and leaves every .grad alone"
)


def _parameter_state(modules: list[nn.Module]) -> list[tuple[str, torch.Tensor]]:
    return [(name, p.detach().clone()) for m in modules for name, p in m.named_parameters()]


def check_gradient_norms(gradient_norms_fn: Callable) -> None:
    """Check ``gradient_norms(fn, x)``: entry t is ||d fn(x)[-1].sum() / d x_t||_2.

    Besides the values, the check makes sure the function has no side effects: the result is
    detached, the parameters behind ``fn`` keep their values and get no ``.grad``, and the
    caller's ``x`` does not start requiring gradients.

    Args:
        gradient_norms_fn: the learner's function; fn maps x (T, Din) to outputs (T, H),
            x is (T, Din); returns a (T,) tensor.
    """

    cases = _grad_cases(seed=103)
    for case in cases:
        fn, x = case.args
        expected = gradient_norms(fn, x)
        for module in case.modules:
            module.zero_grad(set_to_none=True)
        before = _parameter_state(case.modules)
        # the modules are shared by the case and its function, so call_learner's copies of
        # the arguments still reach the same parameters
        with torch.enable_grad():
            got = call_learner(gradient_norms_fn, case)
        if isinstance(got, torch.Tensor):
            got = got.detach()  # a result that still carries a graph has the right numbers
        compare_tensors(got, expected, case, what="Your gradient norms",
                        misconceptions=GRAD_MISTAKES)
        leaked = [name for m in case.modules for name, p in m.named_parameters()
                  if p.grad is not None]
        if leaked:
            raise CheckFailure(GRAD_LEAK.format(names=", ".join(leaked))
                               + f" (case '{case.name}')")
        after = _parameter_state(case.modules)
        changed = [name for (name, old), (_, new) in zip(before, after, strict=True)
                   if not torch.equal(old, new)]
        if changed:
            raise CheckFailure(
                f"Your function changed the parameters behind fn ({', '.join(changed)}) on "
                f"the case '{case.name}'. Measuring a gradient must not update the model"
            )

    # The checks above call the function on copies of x; one more call on a tensor we keep
    # shows whether the caller's x was switched to requires_grad or given a .grad.
    fn, x = cases[0].args
    probe = x.clone()
    gradient_norms_fn(fn, probe)
    for module in cases[0].modules:
        module.zero_grad(set_to_none=True)
    if probe.requires_grad or probe.grad is not None:
        raise CheckFailure(
            "Your function changed the caller's x: it now requires grad"
            + (" and has a .grad" if probe.grad is not None else "")
            + ". Work on a copy, x = x.detach().clone().requires_grad_(True), so the "
            "caller's tensor is left as it was"
        )
    labels = "; ".join(c.name for c in cases)
    print(f"\u2705 gradient_norms is correct on all {len(cases)} test cases ({labels})")


# --------------------------------------------------------------------------------------------
# Exercise 1.4: predict how the gradient's reach depends on the scale of W

RATIO_GAINS = (0.5, 1.0, 3.0)
RATIO_CHOICES = ("vanishes", "about the same", "explodes")
NEAR, FAR = 5, 50  # the two distances T - t compared


def _category(ratio: float) -> str:
    """A measured ratio ||grad at distance 50|| / ||grad at distance 5|| in words."""
    if ratio < 1e-2:
        return "vanishes"
    return "explodes" if ratio > 1e2 else "about the same"


def measure_gradient_ratios(gains: tuple[float, ...] = RATIO_GAINS) -> dict[float, float]:
    """For an Elman RNN (Din 8, H 32) whose W is scaled to spectral radius ``gain``: the mean
    gradient norm reaching the last state from distance 50 divided by that from distance 5,
    over 16 random sequences (float64, seeded; the global random stream is left alone)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rnn = ElmanRNN(8, 32).double()
        W_unit = rnn.W.detach() / torch.linalg.eigvals(rnn.W.detach()).abs().max()  # (H, H)
        x = torch.randn(16, FAR + 1, 8, dtype=torch.float64)  # (B, T, Din)
    ratios = {}
    for gain in gains:
        with torch.no_grad():
            rnn.W.copy_(gain * W_unit)
        norms = gradient_norms(lambda v: rnn(v)[0], x).mean(0)  # (T,), entry t at T-1-t
        ratios[gain] = (norms[-1 - FAR] / norms[-1 - NEAR]).item()
    return ratios


RATIO_WHY = {
    0.5: "At gain 0.5 every step back multiplies the gradient by W (which shrinks it by about "
         "half) and by tanh's slope (at most 1): 45 such factors leave almost nothing",
    1.0: "At gain 1, W alone would keep the gradient's size in the long run, but every step "
         "also multiplies it by tanh's slope, 1 - h^2, which is below 1 wherever the state "
         "is not 0: the product of 45 factors below 1 still vanishes",
    3.0: "At gain 3, W stretches the gradient by about 3 per step, much more than tanh's slope "
         "takes away while the state is not saturated: the product grows geometrically, and "
         "the gradient explodes",
}


def _read_prediction(prediction: object) -> dict[float, str]:
    if not isinstance(prediction, dict):
        raise CheckFailure(
            f"predict_gradient_ratios() should return a dict mapping each gain {RATIO_GAINS} "
            f"to one of {RATIO_CHOICES}, but it returned {describe(prediction)}")
    read = {}
    for gain in RATIO_GAINS:
        if gain not in prediction:
            raise CheckFailure(f"Your prediction has no entry for the gain {gain}: give one for "
                               f"each of {RATIO_GAINS}")
        answer = prediction[gain]
        choice = answer.strip().lower() if isinstance(answer, str) else None
        if choice not in RATIO_CHOICES:
            raise CheckFailure(f"Your prediction for the gain {gain} is {answer!r}; choose one "
                               f"of {RATIO_CHOICES}")
        read[gain] = choice
    return read


def check_gradient_ratio_prediction(predict_fn: Callable[[], dict]) -> None:
    """Grade the prediction ``predict_fn()`` (gain -> "vanishes", "about the same" or
    "explodes": how the gradient reaching h_T from distance 50 compares with that from
    distance 5, below 1/100, between, above 100 times), then print the measurement.

    Args:
        predict_fn: the learner's function, no arguments, returning a dict over RATIO_GAINS.
    """
    prediction = _read_prediction(predict_fn())
    ratios = measure_gradient_ratios()
    print(f"{'gain':>5} | {'you predicted':>14} | {'measured ratio':>14} | {'which is':>14}")
    for gain, ratio in ratios.items():
        print(f"{gain:>5} | {prediction[gain]:>14} | {ratio:>14.1e} | {_category(ratio):>14}")
    wrong = [gain for gain, ratio in ratios.items() if prediction[gain] != _category(ratio)]
    if wrong:
        raise CheckFailure(
            "Not quite: " + " ".join(f"{RATIO_WHY[g]} (measured ratio {ratios[g]:.1e})."
                                     for g in wrong))
    print("\u2705 your predictions match the measurement: below gain 1 the gradient vanishes, "
          "and even at gain 1 tanh's slope makes it vanish; a large gain makes it explode")


# --------------------------------------------------------------------------------------------
# Exercise 1.5: additive (Bahdanau) attention

ADDITIVE_HINT = (
    "s holds one decoder state per row (B, Dq) and h the encoder states (B, S, Dk). W_s s for "
    "every row is s @ W_s.T, shape (B, A); W_h h_j for every j at once is h @ W_h.T, shape "
    "(B, S, A); give the first one an axis of size 1 for S before adding them"
)


def _additive_case(name: str, gen: torch.Generator, batch: int, src: int, d_q: int, d_k: int,
                   d_a: int) -> Case:
    s = rand(gen, batch, d_q)
    h = rand(gen, batch, src, d_k)
    W_s = rand(gen, d_a, d_q, scale=1.5 / d_q**0.5)  # scores spread, tanh not saturated
    W_h = rand(gen, d_a, d_k, scale=1.5 / d_k**0.5)
    v = rand(gen, d_a, scale=2.0 / d_a**0.5)
    return Case(name, (s, h, W_s, W_h, v), hint=ADDITIVE_HINT)


def _additive_cases(seed: int) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    return [
        _additive_case("B=2, S=5, Dq=4, Dk=6, A=3", gen, 2, 5, 4, 6, 3),
        _additive_case("B=3, S=4, Dq = Dk = A = 5", gen, 3, 4, 5, 5, 5),
        _additive_case("B=4, S=7, Dq=3, Dk=3, A=8", gen, 4, 7, 3, 3, 8),
        _additive_case("B=3, S=3 (B = S), Dq=2, Dk=4, A=4", gen, 3, 3, 2, 4, 4),
        _additive_case("one source word, S=1", gen, 2, 1, 3, 4, 2),
        _additive_case("one example, B=1, S=6", gen, 1, 6, 5, 3, 4),
    ]


def additive_reference(s, h, W_s, W_h, v) -> tuple[torch.Tensor, torch.Tensor]:
    """course_lib's RNNAttention (additive score) with the case's weights copied in."""
    with torch.random.fork_rng(devices=[]):  # building the module must not move the RNG
        attention = RNNAttention(W_s.shape[1], W_h.shape[1], attention_size=W_s.shape[0])
    with torch.no_grad():
        attention.query_proj.weight.copy_(W_s)
        attention.key_proj.weight.copy_(W_h)
        attention.v.weight.copy_(v[None])
    with torch.no_grad():
        return attention(s, h)  # (B, Dk), (B, S)


def _raw_scores(s, h, W_s, W_h, v, *, act=torch.tanh) -> torch.Tensor:
    return act((s @ W_s.T)[:, None, :] + h @ W_h.T) @ v  # (B, S)


ADDITIVE_WEIGHT_MISTAKES = [
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(_raw_scores(s, h, W_s, W_h, v), dim=0),
        "Your weights sum to 1 over the batch, not over the source words: the softmax runs over "
        "the S scores of each example (the last axis)",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(_raw_scores(s, h, W_s, W_h, v).flatten(), 0)
        .view(s.shape[0], -1),
        "Your weights sum to 1 over the whole batch at once: the softmax runs over the S scores "
        "of each example separately",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: _raw_scores(s, h, W_s, W_h, v),
        "Your weights are the raw scores e_j: turn them into weights that sum to 1 over the "
        "source words with a softmax",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(
            _raw_scores(s, h, W_s, W_h, v, act=lambda z: z), dim=-1),
        "Your scores have no tanh: e_j = v^T tanh(W_s s + W_h h_j). Without it the score is "
        "linear, and its part v^T W_s s, the same for every j, cancels in the softmax: the "
        "decoder state would not change the weights at all",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(
            torch.tanh(((s @ W_s.T)[:, None, :] + h @ W_h.T) @ v), dim=-1),
        "You applied tanh after the product with v: the tanh acts on W_s s + W_h h_j, a vector "
        "of A numbers, and v^T turns its result into one score",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(
            torch.tanh((s @ W_h.T)[:, None, :] + h @ W_s.T) @ v, dim=-1),
        "W_s and W_h look swapped: W_s (A, Dq) maps the decoder state s, W_h (A, Dk) every "
        "encoder state h_j. (When Dq = Dk the shapes cannot tell them apart, but the values "
        "can)",
    ),
    Misconception(
        lambda s, h, W_s, W_h, v: torch.softmax(
            torch.tanh((s @ W_s)[:, None, :] + h @ W_h) @ v, dim=-1),
        "You multiplied by W_s and W_h without transposing them: with vectors as rows, W_s s is "
        "s @ W_s.T and W_h h_j is h @ W_h.T",
    ),
]


def _context_mistakes(weights: torch.Tensor) -> list[Misconception]:
    return [
        Misconception(
            lambda s, h, W_s, W_h, v: (_raw_scores(s, h, W_s, W_h, v)[:, :, None] * h).sum(1),
            "Your context averages h_j with the raw scores e_j; use the weights alpha_j, after "
            "the softmax",
        ),
        Misconception(
            lambda s, h, W_s, W_h, v: (weights[:, :, None] * (h @ W_h.T)).sum(1),
            "Your context averages the projected states W_h h_j; c = sum_j alpha_j h_j averages "
            "the encoder states themselves",
        ),
        Misconception(
            lambda s, h, W_s, W_h, v: h.mean(1),
            "Your context is the plain mean of the h_j: weight each h_j by its alpha_j",
        ),
    ]


def check_additive_attention(additive_attention: Callable) -> None:
    """Check ``additive_attention(s, h, W_s, W_h, v)`` -> (context (B, Dk), weights (B, S)),
    e_j = v^T tanh(W_s s + W_h h_j), alpha = softmax(e), c = sum_j alpha_j h_j, against
    course_lib's RNNAttention with the same weights.

    Args:
        additive_attention: the learner's function; s (B, Dq), h (B, S, Dk), W_s (A, Dq),
            W_h (A, Dk), v (A,).
    """

    def check_one(got, case: Case) -> None:
        context, weights = additive_reference(*case.args)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailure(
                f"additive_attention should return a tuple (context, weights), shapes "
                f"{tuple(context.shape)} and {tuple(weights.shape)}, but it returned "
                f"{describe(got)} (case '{case.name}')")
        compare_tensors(got[1], weights, case, what="Your weights",
                        misconceptions=ADDITIVE_WEIGHT_MISTAKES)
        compare_tensors(got[0], context, case, what="Your context",
                        misconceptions=_context_mistakes(weights))

    run_cases("additive_attention", additive_attention, _additive_cases(seed=105), check_one)


__all__ = [
    "check_additive_attention",
    "check_leaky_step",
    "check_elman_forward",
    "check_elman_step",
    "check_gradient_norms",
    "check_gradient_ratio_prediction",
]


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
