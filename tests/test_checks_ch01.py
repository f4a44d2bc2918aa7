"""The chapter 01 checks reject plausible wrong answers with the right message and accept
every correct formulation."""

from __future__ import annotations

import pytest
import torch

from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch01 import (
    check_elman_forward,
    check_elman_step,
    check_gradient_norms,
)

# --------------------------------------------------------------------------------- elman_step


def step_matmul(x_t, h_prev, W, U, b):
    return torch.tanh(h_prev @ W.T + x_t @ U.T + b)


def step_einsum(x_t, h_prev, W, U, b):
    return torch.tanh(
        torch.einsum("ij,...j->...i", W, h_prev) + torch.einsum("ij,...j->...i", U, x_t) + b
    )


def step_column_vectors(x_t, h_prev, W, U, b):
    # the textbook W h with h as a column vector, one example at a time
    if x_t.dim() == 1:
        return torch.tanh(W @ h_prev + U @ x_t + b)
    rows = [torch.tanh(W @ h + U @ x + b) for x, h in zip(x_t, h_prev, strict=True)]
    return torch.stack(rows)


def step_linear(x_t, h_prev, W, U, b):
    return torch.nn.functional.linear(h_prev, W).add(
        torch.nn.functional.linear(x_t, U, b)).tanh()


@pytest.mark.parametrize("fn", [step_matmul, step_einsum, step_column_vectors, step_linear])
def test_elman_step_accepts_correct_answers(fn, capsys):
    check_elman_step(fn)
    assert "elman_step is correct" in capsys.readouterr().out


def step_overwriting_h_prev(x_t, h_prev, W, U, b):
    h_prev[...] = torch.tanh(h_prev @ W.T + x_t @ U.T + b)  # right values, caller's tensor lost
    return h_prev


WRONG_STEPS = {
    "no nonlinearity": (lambda x, h, W, U, b: h @ W.T + x @ U.T + b, "without the nonlinearity"),
    "sigmoid": (lambda x, h, W, U, b: torch.sigmoid(h @ W.T + x @ U.T + b), "sigmoid"),
    "relu": (lambda x, h, W, U, b: torch.relu(h @ W.T + x @ U.T + b), "ReLU"),
    "no bias": (lambda x, h, W, U, b: torch.tanh(h @ W.T + x @ U.T), "missing the bias"),
    # swapping W and U only fits the shapes when Din = H; elsewhere it raises, with the hint
    "W and U swapped": (lambda x, h, W, U, b: torch.tanh(x @ W.T + h @ U.T + b),
                        r"raised RuntimeError.*Hint: W has shape \(H, H\) and multiplies the previous state"),
    "W and U swapped, shapes adjusted": (
        lambda x, h, W, U, b: torch.tanh(x @ W.T + h @ U.T + b) if x.shape[-1] == h.shape[-1]
        else torch.tanh(h @ W.T + x @ U.T + b),
        "W and U look swapped"),
    "nothing transposed": (lambda x, h, W, U, b: torch.tanh(h @ W + x @ U + b),
                           r"hint: W has shape \(H, H\)|without transposing"),
    "W not transposed": (lambda x, h, W, U, b: torch.tanh(h @ W + x @ U.T + b),
                         r"h_prev @ W, which is W\^T h"),
    "U not transposed, shapes adjusted": (
        lambda x, h, W, U, b: torch.tanh(h @ W.T + (x @ U if U.shape[0] == U.shape[1] else x @ U.T)
                                         + b),
        r"x_t @ U, which is U\^T x"),
    "W @ h with a batch": (
        lambda x, h, W, U, b: torch.tanh(W @ h + U @ x + b) if x.dim() == 1 or (
            h.shape[0] == W.shape[0] and x.shape[0] == U.shape[1])
        else torch.tanh(h @ W.T + x @ U.T + b),
        "mixes the examples of the batch"),
    "W @ h with a batch, unguarded": (lambda x, h, W, U, b: torch.tanh(W @ h + U @ x + b),
                                      "raised RuntimeError.*Hint: W has shape"),
    "tanh on the recurrent term only": (lambda x, h, W, U, b: torch.tanh(h @ W.T) + x @ U.T + b,
                                        "recurrent term only"),
    "returns h_prev": (lambda x, h, W, U, b: h, "wrong values|shape"),
    "returns None": (lambda x, h, W, U, b: None, "forget to return"),
    "overwrites h_prev": (step_overwriting_h_prev, "changed its input 'h_prev' in place"),
}


@pytest.mark.parametrize("name", list(WRONG_STEPS))
def test_elman_step_rejects_wrong_answers(name):
    fn, message = WRONG_STEPS[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_elman_step(fn)


def test_elman_step_stub_propagates():
    def stub(x_t, h_prev, W, U, b):
        raise NotImplementedError("Exercise 1.1: write the body of elman_step")

    with pytest.raises(NotImplementedError, match="Exercise 1.1"):
        check_elman_step(stub)


# ------------------------------------------------------------------------------ elman_forward


def forward_with_steps(x, h0, W, U, b):
    h, states = h0, []
    for t in range(x.shape[-2]):
        h = step_matmul(x[..., t, :], h, W, U, b)
        states.append(h)
    return torch.stack(states, dim=-2)


def forward_precomputed(x, h0, W, U, b):
    inputs = x @ U.T + b  # the input part of every step at once
    out = x.new_empty(*x.shape[:-1], W.shape[0])
    h = h0
    for t in range(x.shape[-2]):
        h = torch.tanh(h @ W.T + inputs[..., t, :])
        out[..., t, :] = h  # writing into a new tensor is fine
    return out


def forward_unbind(x, h0, W, U, b):
    states, h = [], h0
    for x_t in x.unbind(dim=-2):
        h = torch.tanh(torch.nn.functional.linear(h, W) + torch.nn.functional.linear(x_t, U, b))
        states.append(h)
    return torch.stack(states, dim=-2)


@pytest.mark.parametrize("fn", [forward_with_steps, forward_precomputed, forward_unbind])
def test_elman_forward_accepts_correct_answers(fn, capsys):
    check_elman_forward(fn)
    assert "elman_forward is correct" in capsys.readouterr().out


def _loop(x, h0, step, *, carry=True, backwards=False, store_before=False, include_h0=False):
    h, states = h0, [h0] if include_h0 else []
    order = range(x.shape[-2])
    for t in reversed(order) if backwards else order:
        new = step(x[..., t, :], h if carry else h0)
        states.append(h if store_before else new)
        h = new
    return torch.stack(states, dim=-2)


def _wrong_forward(**how):
    def fn(x, h0, W, U, b):
        return _loop(x, h0, lambda x_t, h: step_matmul(x_t, h, W, U, b), **how)

    return fn


def _forward_with(step):
    def fn(x, h0, W, U, b):
        return _loop(x, h0, lambda x_t, h: step(x_t, h, W, U, b))

    return fn


WRONG_FORWARDS = {
    "includes h0": (_wrong_forward(include_h0=True), r"starts with h0 and so has T \+ 1"),
    "stores before updating": (_wrong_forward(store_before=True), "shifted by one step"),
    "only the final state": (lambda x, h0, W, U, b: forward_with_steps(x, h0, W, U, b)[..., -1, :],
                             "returned a single state"),
    "h0 at every step": (_wrong_forward(carry=False), "not carried forward"),
    "backwards in time": (_wrong_forward(backwards=True), "backwards"),
    "time-major batch": (lambda x, h0, W, U, b: torch.stack(
        [s for s in forward_with_steps(x, h0, W, U, b).unbind(-2)], dim=0),
        r"time-major, \(T, B, H\)"),
    "no nonlinearity": (_forward_with(lambda x, h, W, U, b: h @ W.T + x @ U.T + b),
                        "no nonlinearity"),
    "no bias": (_forward_with(lambda x, h, W, U, b: torch.tanh(h @ W.T + x @ U.T)), "bias"),
    "W and U swapped where shapes allow": (
        _forward_with(lambda x, h, W, U, b: torch.tanh(x @ W.T + h @ U.T + b)
                      if x.shape[-1] == h.shape[-1] else step_matmul(x, h, W, U, b)),
        "W and U look swapped"),
    "nothing transposed where shapes allow": (
        _forward_with(lambda x, h, W, U, b: torch.tanh(h @ W + x @ U + b)
                      if x.shape[-1] == h.shape[-1] else torch.tanh(h @ W + x @ U.T + b)),
        r"without transposing|h @ W, which is W\^T h"),
    "W not transposed": (_forward_with(lambda x, h, W, U, b: torch.tanh(h @ W + x @ U.T + b)),
                         r"h @ W, which is W\^T h"),
    "modifies h0 in place": (
        lambda x, h0, W, U, b: torch.stack(
            [h0.copy_(step_matmul(x[..., t, :], h0, W, U, b)).clone()
             for t in range(x.shape[-2])], dim=-2),
        "in place"),
}


@pytest.mark.parametrize("name", list(WRONG_FORWARDS))
def test_elman_forward_rejects_wrong_answers(name):
    fn, message = WRONG_FORWARDS[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_elman_forward(fn)


def test_elman_forward_stub_propagates():
    def stub(x, h0, W, U, b):
        raise NotImplementedError("Exercise 1.2: write the body of elman_forward")

    with pytest.raises(NotImplementedError, match="Exercise 1.2"):
        check_elman_forward(stub)


# ----------------------------------------------------------------------------- gradient_norms


def norms_autograd(fn, x):
    x = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(x)[-1].sum(), x)
    return grad.norm(dim=-1)


def norms_func(fn, x):
    grad = torch.func.grad(lambda v: fn(v)[-1].sum())(x)
    return torch.linalg.vector_norm(grad, dim=-1)


def norms_one_leaf_per_position(fn, x):
    rows = [row.detach().clone().requires_grad_(True) for row in x]
    grads = torch.autograd.grad(fn(torch.stack(rows))[-1].sum(), rows)
    return torch.stack([g.pow(2).sum().sqrt() for g in grads])


def norms_with_graph(fn, x):
    # correct numbers that still carry an autograd graph: accepted
    x = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(x)[-1].sum(), x, create_graph=True)
    return grad.norm(dim=-1)


@pytest.mark.parametrize(
    "fn", [norms_autograd, norms_func, norms_one_leaf_per_position, norms_with_graph]
)
def test_gradient_norms_accepts_correct_answers(fn, capsys):
    check_gradient_norms(fn)
    assert "gradient_norms is correct" in capsys.readouterr().out


def _grad(fn, x, scalar):
    x = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(scalar(fn(x)), x)
    return grad


def norms_backward_leaks(fn, x):
    x = x.detach().clone().requires_grad_(True)
    fn(x)[-1].sum().backward()
    return x.grad.norm(dim=-1)


def norms_on_the_callers_x(fn, x):
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(x)[-1].sum(), x)
    return grad.norm(dim=-1)


def norms_and_a_training_step(fn, x):
    result = norms_autograd(fn, x)
    for cell in fn.__closure__ or ():
        if isinstance(cell.cell_contents, torch.nn.Module):
            with torch.no_grad():
                for p in cell.cell_contents.parameters():
                    p.mul_(0.99)
    return result


WRONG_NORMS = {
    "reversed (distances)": (lambda fn, x: norms_autograd(fn, x).flip(0), "reverse order"),
    "all outputs": (lambda fn, x: _grad(fn, x, lambda o: o.sum()).norm(dim=-1),
                    "sum of the outputs at every position"),
    "first output": (lambda fn, x: _grad(fn, x, lambda o: o[0].sum()).norm(dim=-1),
                     "first position"),
    "squared norms": (lambda fn, x: _grad(fn, x, lambda o: o[-1].sum()).pow(2).sum(-1),
                      "squared norms"),
    "L1 norms": (lambda fn, x: _grad(fn, x, lambda o: o[-1].sum()).abs().sum(-1), "L1"),
    "max norm": (lambda fn, x: _grad(fn, x, lambda o: o[-1].sum()).abs().amax(-1),
                 "largest absolute entry"),
    "norm over positions": (lambda fn, x: _grad(fn, x, lambda o: o[-1].sum()).norm(dim=0),
                            "over the positions"),
    "Jacobian norms": (lambda fn, x: torch.autograd.functional.jacobian(
        lambda v: fn(v)[-1], x).pow(2).sum(dim=(0, 2)).sqrt(), "whole Jacobian"),
    "output norms": (lambda fn, x: fn(x).detach().norm(dim=-1), "norms of the outputs"),
    "one norm": (lambda fn, x: _grad(fn, x, lambda o: o[-1].sum()).norm(), "one norm"),
    "backward leaks into parameters": (norms_backward_leaks, r"\.grad of the parameters"),
    "requires_grad on the caller's x": (norms_on_the_callers_x, "caller's x"),
    "updates the parameters": (norms_and_a_training_step, "changed the parameters"),
    "returns a list": (lambda fn, x: norms_autograd(fn, x).tolist(), "should be a tensor"),
}


@pytest.mark.parametrize("name", list(WRONG_NORMS))
def test_gradient_norms_rejects_wrong_answers(name):
    fn, message = WRONG_NORMS[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_gradient_norms(fn)


def test_gradient_norms_stub_propagates():
    def stub(fn, x):
        raise NotImplementedError("Exercise 1.3: write the body of gradient_norms")

    with pytest.raises(NotImplementedError, match="Exercise 1.3"):
        check_gradient_norms(stub)


def test_gradient_norms_check_leaves_the_global_random_stream_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    check_gradient_norms(norms_autograd)
    torch.testing.assert_close(torch.rand(3), expected)
