"""The chapter 01 checks reject plausible wrong answers with the right message and accept
every correct formulation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch01 import (
    check_additive_attention,
    check_elman_forward,
    check_elman_step,
    check_gradient_norms,
    check_gradient_ratio_prediction,
    check_leaky_step,
)
from course_lib.rnn import elman_forward as elman_forward_library
from course_lib.rnn import elman_step as elman_step_library

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
                        r"raised RuntimeError.*Hint: W has shape \(H, H\) "
                        r"and multiplies the previous state"),
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


def forward_first_axis(x, h0, W, U, b):
    # the planted bug of exercise 1.2: right for one sequence, wrong for a batch
    h, states = h0, []
    for t in range(len(x)):
        h = torch.tanh(h @ W.T + x[t] @ U.T + b)
        states.append(h)
    return torch.stack(states, dim=-2)


WRONG_FORWARDS = {
    "the planted bug: x[t] steps over the batch": (forward_first_axis, "first axis of x"),
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


def test_elman_forward_failure_names_the_instrument():
    with pytest.raises(CheckFailure, match="(?s)first axis of x.*equality with the "
                                           "reference.*elman_forward"):
        check_elman_forward(forward_first_axis)


@pytest.mark.parametrize("name", ["no bias", "backwards", "returns h0 too"])
def test_elman_forward_names_the_instrument_only_for_the_planted_bug(name):
    wrong = {
        "no bias": lambda x, h0, W, U, b: elman_forward_library(x, h0, W, U, 0 * b),
        "backwards": lambda x, h0, W, U, b: elman_forward_library(
            x.flip(-2), h0, W, U, b),
        "returns h0 too": lambda x, h0, W, U, b: torch.cat(
            [h0.unsqueeze(-2), elman_forward_library(x, h0, W, U, b)], dim=-2),
    }[name]
    with pytest.raises(CheckFailure) as failure:
        check_elman_forward(wrong)
    assert "equality with the reference" not in str(failure.value)


# ------------------------------------------------------------- gradient ratio (predict, verify)

RIGHT = {0.5: "vanishes", 1.0: "vanishes", 3.0: "explodes"}


@pytest.mark.parametrize("answer", [
    RIGHT,
    {0.5: "Vanishes", 1: " vanishes", 3: "EXPLODES"},  # int keys, other spellings
    {3.0: "explodes", 1.0: "vanishes", 0.5: "vanishes", 2.0: "explodes"},  # extra entry
])
def test_gradient_ratio_prediction_accepts_the_right_prediction(answer, capsys):
    check_gradient_ratio_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "match the measurement" in out
    assert "measured ratio" in out  # the measurement is shown


WRONG_PREDICTIONS = {
    "gain 1 keeps it": ({**RIGHT, 1.0: "about the same"}, "tanh's slope"),
    "gain 3 vanishes too": ({**RIGHT, 3.0: "vanishes"}, "explodes"),
    "gain 0.5 survives": ({**RIGHT, 0.5: "about the same"}, "shrinks it by about half"),
    "a list": (["vanishes", "vanishes", "explodes"], "should return a dict"),
    "a gain missing": ({0.5: "vanishes", 1.0: "vanishes"}, "no entry for the gain 3.0"),
    "not a choice": ({**RIGHT, 1.0: "shrinks"}, "choose one of"),
    "None": ({**RIGHT, 0.5: None}, "choose one of"),
}


@pytest.mark.parametrize("name", list(WRONG_PREDICTIONS))
def test_gradient_ratio_prediction_rejects_wrong_predictions(name, capsys):
    answer, message = WRONG_PREDICTIONS[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_gradient_ratio_prediction(lambda: answer)


def test_gradient_ratio_prediction_shows_the_measurement_when_wrong(capsys):
    with pytest.raises(CheckFailure):
        check_gradient_ratio_prediction(lambda: {**RIGHT, 1.0: "about the same"})
    assert "measured ratio" in capsys.readouterr().out


def test_gradient_ratio_prediction_stub_propagates():
    def stub():
        raise NotImplementedError("Exercise 1.4: write the body of predict_gradient_ratios")

    with pytest.raises(NotImplementedError, match="Exercise 1.4"):
        check_gradient_ratio_prediction(stub)


def test_gradient_ratio_check_leaves_the_global_random_stream_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    check_gradient_ratio_prediction(lambda: RIGHT)
    torch.testing.assert_close(torch.rand(3), expected)


# -------------------------------------------------------------------------- additive attention


def additive_broadcast(s, h, W_s, W_h, v):
    scores = torch.tanh((s @ W_s.T)[:, None, :] + h @ W_h.T) @ v  # (B, S)
    weights = torch.softmax(scores, dim=-1)
    return (weights[:, :, None] * h).sum(1), weights


def additive_einsum(s, h, W_s, W_h, v):
    hidden = torch.tanh(torch.einsum("ad,bd->ba", W_s, s)[:, None]
                        + torch.einsum("ak,bsk->bsa", W_h, h))
    weights = torch.einsum("bsa,a->bs", hidden, v).softmax(-1)
    return torch.einsum("bs,bsk->bk", weights, h), weights


def additive_loops(s, h, W_s, W_h, v):
    contexts, all_weights = [], []
    for b in range(s.shape[0]):
        scores = torch.stack([v @ torch.tanh(W_s @ s[b] + W_h @ h_j) for h_j in h[b]])
        weights = torch.exp(scores - scores.max()) / torch.exp(scores - scores.max()).sum()
        contexts.append(weights @ h[b])
        all_weights.append(weights)
    return torch.stack(contexts), torch.stack(all_weights)


def additive_linear(s, h, W_s, W_h, v):
    F = torch.nn.functional
    scores = F.linear(torch.tanh(F.linear(s, W_s).unsqueeze(1) + F.linear(h, W_h)), v[None])
    weights = scores.squeeze(-1).softmax(dim=1)
    return torch.bmm(weights.unsqueeze(1), h).squeeze(1), weights


@pytest.mark.parametrize("fn", [additive_broadcast, additive_einsum, additive_loops,
                                additive_linear])
def test_additive_attention_accepts_correct_answers(fn, capsys):
    check_additive_attention(fn)
    assert "additive_attention is correct" in capsys.readouterr().out


def _additive_with(scores_fn, *, weights_fn=lambda e: torch.softmax(e, dim=-1),
                   context_fn=lambda w, h, e, hp: (w[:, :, None] * h).sum(1)):
    def fn(s, h, W_s, W_h, v):
        scores = scores_fn(s, h, W_s, W_h, v)
        weights = weights_fn(scores)
        return context_fn(weights, h, scores, h @ W_h.T), weights

    return fn


def _scores(s, h, W_s, W_h, v):
    return torch.tanh((s @ W_s.T)[:, None, :] + h @ W_h.T) @ v


WRONG_ADDITIVE = {
    "softmax over the batch": (_additive_with(_scores, weights_fn=lambda e: e.softmax(0)),
                               "over the batch, not over the source words"),
    "softmax over everything": (
        _additive_with(_scores, weights_fn=lambda e: e.flatten().softmax(0).view(e.shape)),
        "whole batch at once"),
    "no softmax": (_additive_with(_scores, weights_fn=lambda e: e), "raw scores"),
    "no tanh": (_additive_with(lambda s, h, W_s, W_h, v: ((s @ W_s.T)[:, None] + h @ W_h.T) @ v),
                "no tanh"),
    "tanh after v": (_additive_with(
        lambda s, h, W_s, W_h, v: torch.tanh(((s @ W_s.T)[:, None] + h @ W_h.T) @ v)),
        "tanh after the product with v"),
    "W_s and W_h swapped where shapes allow": (_additive_with(
        lambda s, h, W_s, W_h, v: _scores(s, h, W_h, W_s, v) if s.shape[-1] == h.shape[-1]
        else _scores(s, h, W_s, W_h, v)), "W_s and W_h look swapped"),
    "W_s and W_h swapped, unguarded": (_additive_with(
        lambda s, h, W_s, W_h, v: _scores(s, h, W_h, W_s, v)),
        r"raised RuntimeError.*Hint: s holds one decoder state per row"),
    "context from scores": (_additive_with(
        _scores, context_fn=lambda w, h, e, hp: (e[:, :, None] * h).sum(1)), "raw scores e_j"),
    "context from projected states": (_additive_with(
        _scores, context_fn=lambda w, h, e, hp: (w[:, :, None] * hp).sum(1)),
        "projected states"),
    "context is the mean": (_additive_with(
        _scores, context_fn=lambda w, h, e, hp: h.mean(1)), "plain mean"),
    "weights only": (lambda s, h, W_s, W_h, v: additive_broadcast(s, h, W_s, W_h, v)[1],
                     r"should return a tuple \(context, weights\)"),
    "order swapped": (lambda s, h, W_s, W_h, v: additive_broadcast(s, h, W_s, W_h, v)[::-1],
                      "shape"),
}


@pytest.mark.parametrize("name", list(WRONG_ADDITIVE))
def test_additive_attention_rejects_wrong_answers(name):
    fn, message = WRONG_ADDITIVE[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_additive_attention(fn)


def test_additive_attention_stub_propagates():
    def stub(s, h, W_s, W_h, v):
        raise NotImplementedError("Exercise 1.5: write the body of additive_attention")

    with pytest.raises(NotImplementedError, match="Exercise 1.5"):
        check_additive_attention(stub)


def test_additive_attention_check_leaves_the_global_random_stream_alone():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    check_additive_attention(additive_broadcast)
    torch.testing.assert_close(torch.rand(3), expected)


# --------------------------------------------------------------------------------- leaky_step


def leaky_matmul(x_t, h_prev, W, U, b, a):
    return (1 - a) * h_prev + a * torch.tanh(h_prev @ W.T + x_t @ U.T + b)


def leaky_library(x_t, h_prev, W, U, b, a):
    return torch.lerp(h_prev, elman_step_library(x_t, h_prev, W, U, b), a)


def leaky_linear(x_t, h_prev, W, U, b, a):
    candidate = torch.nn.functional.linear(x_t, U, b).add(
        torch.nn.functional.linear(h_prev, W)).tanh()
    return h_prev - a * (h_prev - candidate)


def leaky_column_vectors(x_t, h_prev, W, U, b, a):
    return torch.stack([leaky_column_vectors(x, h, W, U, b, a) for x, h in
                        zip(x_t, h_prev, strict=True)]) if x_t.dim() == 2 else (
        (1 - a) * h_prev + a * torch.tanh(W @ h_prev + U @ x_t + b))


def leaky_numpy_rate(x_t, h_prev, W, U, b, a):
    rate = np.float32(a)
    return (1 - rate) * h_prev + rate * torch.tanh(h_prev @ W.T + x_t @ U.T + b)


@pytest.mark.parametrize("fn", [leaky_matmul, leaky_library, leaky_linear,
                                leaky_column_vectors, leaky_numpy_rate])
def test_leaky_step_accepts_correct_answers(fn, capsys):
    check_leaky_step(fn)
    assert "leaky_step is correct" in capsys.readouterr().out


def _candidate(x, h, W, U, b):
    return torch.tanh(h @ W.T + x @ U.T + b)


WRONG_LEAKY = {
    "weights swapped": (lambda x, h, W, U, b, a: a * h + (1 - a) * _candidate(x, h, W, U, b),
                        "weights look swapped"),
    "plain Elman step": (lambda x, h, W, U, b, a: _candidate(x, h, W, U, b),
                         "plain Elman step"),
    "mix inside the tanh": (
        lambda x, h, W, U, b, a: torch.tanh((1 - a) * h + a * (h @ W.T + x @ U.T + b)),
        "into the tanh's argument"),
    "no tanh": (lambda x, h, W, U, b, a: (1 - a) * h + a * (h @ W.T + x @ U.T + b),
                "no nonlinearity"),
    "no recurrent term": (lambda x, h, W, U, b, a: (1 - a) * h + a * torch.tanh(x @ U.T + b),
                          "leaves out the recurrent term"),
    "candidate not weighted": (lambda x, h, W, U, b, a: (1 - a) * h + _candidate(x, h, W, U, b),
                               "did not weight the candidate"),
    "old state not weighted": (lambda x, h, W, U, b, a: h + a * _candidate(x, h, W, U, b),
                               "kept all of the old state"),
    "no bias": (lambda x, h, W, U, b, a: (1 - a) * h + a * torch.tanh(h @ W.T + x @ U.T),
                "missing the bias"),
    "W not transposed": (lambda x, h, W, U, b, a: (1 - a) * h + a * torch.tanh(
        h @ W + x @ U.T + b), r"h_prev @ W, which is W\^T h"),
    "W @ h with a batch": (
        lambda x, h, W, U, b, a: (1 - a) * h + a * (
            torch.tanh(W @ h + U @ x + b) if x.dim() == 1 or (
                h.shape[0] == W.shape[0] and x.shape[0] == U.shape[1])
            else _candidate(x, h, W, U, b)),
        "mixes the examples of the batch"),
    "a wrong constant": (lambda x, h, W, U, b, a: 0.5 * h + 0.5 * _candidate(x, h, W, U, b),
                         r"wrong values \(case"),
    "overwrites h_prev": (
        lambda x, h, W, U, b, a: h.mul_(1 - a).add_(a * _candidate(x, h, W, U, b)),
        "changed its input 'h' in place"),
    "returns None": (lambda x, h, W, U, b, a: None, "forget to return"),
}


@pytest.mark.parametrize("name", list(WRONG_LEAKY))
def test_leaky_step_rejects_wrong_answers(name):
    fn, message = WRONG_LEAKY[name]
    with pytest.raises(CheckFailure, match=f"(?s){message}"):
        check_leaky_step(fn)


def test_leaky_step_stub_propagates():
    def stub(x_t, h_prev, W, U, b, a):
        raise NotImplementedError("Exercise 1.1: write the body of leaky_step")

    with pytest.raises(NotImplementedError, match="Exercise 1.1"):
        check_leaky_step(stub)
