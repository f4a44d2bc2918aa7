"""The chapter 02 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib import attention
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch02 import (
    SUSPECT_ANSWERS,
    attention_layer,
    buggy_attention,
    check_attention_weights,
    check_equivariance_study,
    check_fixed_attention,
    check_is_permutation_equivariant,
    check_scaled_dot_product_attention,
    check_score_std_predictions,
    check_scores_gradient,
    check_self_attention,
    check_weight_predictions,
    equivariance_suspects,
    measure_score_stds,
    measure_weight_changes,
)

# --------------------------------------------------------------------------- 2.1 attention_weights


def weights_matmul(q, k):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)


def weights_einsum(q, k):
    scores = torch.einsum("...td,...sd->...ts", q, k) / q.shape[-1] ** 0.5
    return attention.softmax(scores)


def weights_loop(q, k):
    """One query and one key at a time (batch dimensions flattened)."""
    d = q.shape[-1]
    qs, ks = q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:])
    rows = []
    for b in range(qs.shape[0]):
        for t in range(qs.shape[1]):
            scores = torch.stack([qs[b, t] @ ks[b, s] / math.sqrt(d) for s in range(ks.shape[1])])
            rows.append(torch.softmax(scores, dim=0))
    return torch.stack(rows).reshape(*q.shape[:-1], k.shape[-2])


@pytest.mark.parametrize("fn", [weights_matmul, weights_einsum, weights_loop])
def test_attention_weights_accepts_correct_answers(fn, capsys):
    check_attention_weights(fn)
    assert "attention_weights is correct" in capsys.readouterr().out


WRONG_WEIGHTS = {
    "softmax over the queries": (
        lambda q, k: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-2),
        "columns"),
    "no scaling": (lambda q, k: torch.softmax(q @ k.transpose(-2, -1), dim=-1), "sqrt"),
    "divided by d": (lambda q, k: torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1], dim=-1),
                     "divided the scores by d"),
    "k q^T": (lambda q, k: torch.softmax(k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                                         dim=-1), "transposed"),
    "exp only": (lambda q, k: torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])),
                 "row's sum"),
    "scores only": (lambda q, k: q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                    "scaled scores themselves"),
    "k.T on a batch": (lambda q, k: torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1),
                       r"k\.transpose\(-2, -1\)"),
    "naive softmax overflows": (
        lambda q, k: (lambda e: e / e.sum(-1, keepdim=True))(
            torch.exp(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]))),
        "overflows"),
}


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", list(WRONG_WEIGHTS))
def test_attention_weights_rejects_misconceptions(name):
    fn, message = WRONG_WEIGHTS[name]
    with pytest.raises(CheckFailure, match=message):
        check_attention_weights(fn)


def test_attention_weights_rejects_changing_the_input_in_place():
    def in_place(q, k):
        q /= math.sqrt(q.shape[-1])
        return torch.softmax(q @ k.transpose(-2, -1), dim=-1)

    with pytest.raises(CheckFailure, match="in place"):
        check_attention_weights(in_place)


def test_attention_weightsstub_propagates():
    with pytest.raises(NotImplementedError):
        check_attention_weights(stub)


# --------------------------------------------------------------------------- 2.2 self_attention


def self_attention_matmul(X, W_q, W_k, W_v):
    Q, K, V = X @ W_q.T, X @ W_k.T, X @ W_v.T
    A = torch.softmax(Q @ K.T / math.sqrt(K.shape[-1]), dim=-1)
    return A @ V


def self_attention_loop(X, W_q, W_k, W_v):
    """Eqs 7-8 of the notes, one query at a time, with the notes' column form q = W_q x."""
    d_k = W_k.shape[0]
    keys = [W_k @ x for x in X]
    values = [W_v @ x for x in X]
    outputs = []
    for x in X:
        q = W_q @ x
        scores = torch.stack([q @ k for k in keys]) / math.sqrt(d_k)
        weights = torch.softmax(scores, dim=0)
        outputs.append(sum(w * v for w, v in zip(weights, values, strict=True)))
    return torch.stack(outputs)


def self_attention_einsum(X, W_q, W_k, W_v):
    Q = torch.einsum("ti,ki->tk", X, W_q)
    K = torch.einsum("ti,ki->tk", X, W_k)
    V = torch.einsum("ti,vi->tv", X, W_v)
    A = attention.softmax(torch.einsum("tk,sk->ts", Q, K) / W_q.shape[0] ** 0.5)
    return torch.einsum("ts,sv->tv", A, V)


def self_attention_library(X, W_q, W_k, W_v):
    out, _ = attention.scaled_dot_product_attention(X @ W_q.T, X @ W_k.T, X @ W_v.T)
    return out


def self_attention_linear(X, W_q, W_k, W_v):
    """nn.functional.linear(X, W) is X @ W.T: the layout of the exercise."""
    out, _ = attention.scaled_dot_product_attention(F.linear(X, W_q), F.linear(X, W_k),
                                                    F.linear(X, W_v))
    return out


def self_attention_nn_linear(X, W_q, W_k, W_v):
    """Weights copied into nn.Linear layers, as a checkpoint would be loaded."""
    layers = []
    for W in (W_q, W_k, W_v):
        layer = torch.nn.Linear(W.shape[1], W.shape[0], bias=False)
        with torch.no_grad():
            layer.weight.copy_(W)
        layers.append(layer)
    with torch.no_grad():
        Q, K, V = (layer(X) for layer in layers)
    return torch.softmax(Q @ K.T / math.sqrt(Q.shape[-1]), dim=-1) @ V


@pytest.mark.parametrize("fn", [self_attention_matmul, self_attention_loop,
                                self_attention_einsum, self_attention_library,
                                self_attention_linear, self_attention_nn_linear])
def test_self_attention_accepts_correct_answers(fn, capsys):
    check_self_attention(fn)
    assert "self_attention is correct" in capsys.readouterr().out


def _sa(X, W_q, W_k, W_v, *, scale=None, dim=-1):
    Q, K, V = X @ W_q.T, X @ W_k.T, X @ W_v.T
    scale = 1 / math.sqrt(K.shape[-1]) if scale is None else scale
    return torch.softmax(Q @ K.T * scale, dim=dim), V


WRONG_SELF_ATTENTION = {
    "returns the weights": (lambda X, W_q, W_k, W_v: _sa(X, W_q, W_k, W_v)[0],
                            "returned the attention weights"),
    "returns (out, weights)": (
        lambda X, W_q, W_k, W_v: (lambda A, V: (A @ V, A))(*_sa(X, W_q, W_k, W_v)),
        "not a tuple"),
    "X @ W (untransposed)": (
        lambda X, W_q, W_k, W_v: self_attention_matmul(X, W_q.T, W_k.T, W_v.T),
        r"without transposing them \(X @ W\).*nn\.Linear\.weight"),
    "X @ W, through the library": (
        lambda X, W_q, W_k, W_v: attention.scaled_dot_product_attention(
            X @ W_q, X @ W_k, X @ W_v)[0],
        r"without transposing them \(X @ W\)"),
    "X as the values": (lambda X, W_q, W_k, W_v: _sa(X, W_q, W_k, W_v)[0] @ X,
                        "averaged the inputs X"),
    "no scaling": (lambda X, W_q, W_k, W_v: (lambda A, V: A @ V)(*_sa(X, W_q, W_k, W_v,
                                                                       scale=1.0)),
                   "without scaling"),
    "scaled by sqrt(d_in)": (
        lambda X, W_q, W_k, W_v: (lambda A, V: A @ V)(*_sa(X, W_q, W_k, W_v,
                                                           scale=X.shape[-1] ** -0.5)),
        r"sqrt\(d_in\)"),
    "softmax over the queries": (
        lambda X, W_q, W_k, W_v: (lambda A, V: A @ V)(*_sa(X, W_q, W_k, W_v, dim=0)),
        "columns"),
    "K Q^T": (lambda X, W_q, W_k, W_v: self_attention_matmul(X, W_k, W_q, W_v),
              "transposed"),
    "naive softmax overflows": (
        lambda X, W_q, W_k, W_v: (lambda e, V: e / e.sum(-1, keepdim=True) @ V)(
            torch.exp((X @ W_q.T) @ (X @ W_k.T).T / math.sqrt(W_k.shape[0])), X @ W_v.T),
        "NaN or inf"),
}


@pytest.mark.parametrize("name", list(WRONG_SELF_ATTENTION))
def test_self_attention_rejects_misconceptions(name):
    fn, message = WRONG_SELF_ATTENTION[name]
    with pytest.raises(CheckFailure, match=message):
        check_self_attention(fn)


def test_self_attention_cases_include_square_weights():
    """X @ W only runs on square weights: there the mistake must be caught by its values."""
    from course_lib.course.checks import ch02

    square = [c for c in ch02._self_attention_cases(seed=22)
              if all(w.shape[0] == w.shape[1] for w in c.args[1:])]
    assert len(square) >= 2
    for case in square:
        x, w_q, w_k, w_v = case.args
        right = self_attention_matmul(x, w_q, w_k, w_v)
        wrong = self_attention_matmul(x, w_q.T, w_k.T, w_v.T)
        assert (right - wrong).abs().max() > 1e-2


def test_self_attention_untransposed_weights_get_the_layout_hint_on_non_square_weights(
        monkeypatch):
    """On non-square weights alone, X @ W crashes; the message states the layout."""
    from course_lib.course.checks import ch02

    non_square = [c for c in ch02._self_attention_cases(seed=22)
                  if any(w.shape[0] != w.shape[1] for w in c.args[1:])]
    monkeypatch.setattr(ch02, "_self_attention_cases", lambda seed: non_square)
    with pytest.raises(CheckFailure, match=r"(?s)raised RuntimeError.*nn\.Linear\.weight.*"
                                           r"W_q is \(d_k, d_in\).*Q = X @ W_q\.T"):
        check_self_attention(WRONG_SELF_ATTENTION["X @ W (untransposed)"][0])


def test_self_attentionstub_propagates():
    with pytest.raises(NotImplementedError):
        check_self_attention(stub)


# ------------------------------ scaled_dot_product_attention (exercise 2.3 of the first edition)


def sdpa_matmul(q, k, v):
    weights = torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v, weights


def sdpa_einsum(q, k, v):
    scores = torch.einsum("...td,...sd->...ts", q, k) / q.shape[-1] ** 0.5
    weights = attention.softmax(scores)
    return torch.einsum("...ts,...sv->...tv", weights, v), weights


def sdpa_library(q, k, v):
    return attention.scaled_dot_product_attention(q, k, v)


def sdpa_loop(q, k, v):
    """Flatten the batch dimensions and attend one matrix at a time."""
    qs, ks, vs = (x.reshape(-1, *x.shape[-2:]) for x in (q, k, v))
    outs, weights = [], []
    for qb, kb, vb in zip(qs, ks, vs, strict=True):
        w = torch.softmax(qb @ kb.T / math.sqrt(qb.shape[-1]), dim=-1)
        outs.append(w @ vb)
        weights.append(w)
    return (torch.stack(outs).reshape(*q.shape[:-1], v.shape[-1]),
            torch.stack(weights).reshape(*q.shape[:-1], k.shape[-2]))


@pytest.mark.parametrize("fn", [sdpa_matmul, sdpa_einsum, sdpa_library, sdpa_loop])
def test_sdpa_accepts_correct_answers(fn, capsys):
    check_scaled_dot_product_attention(fn)
    assert "scaled_dot_product_attention is correct" in capsys.readouterr().out


def _weights_then(fn_weights):
    def sdpa(q, k, v):
        w = fn_weights(q, k, v)
        return w @ v, w
    return sdpa


WRONG_SDPA = {
    "k.T on a batch": (
        lambda q, k, v: (lambda w: (w @ v, w))(
            torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1)),
        r"k\.transpose\(-2, -1\)"),
    "returns (weights, out)": (lambda q, k, v: sdpa_matmul(q, k, v)[::-1], "swap"),
    "returns only out": (lambda q, k, v: sdpa_matmul(q, k, v)[0], r"tuple \(out, weights\)"),
    "scaled by sqrt(d_v)": (
        _weights_then(lambda q, k, v: torch.softmax(q @ k.mT / math.sqrt(v.shape[-1]), dim=-1)),
        r"sqrt\(d_v\)"),
    "not normalised": (_weights_then(lambda q, k, v: torch.exp(q @ k.mT / math.sqrt(q.shape[-1]))),
                       "not normalised"),
    "softmax over the queries": (
        _weights_then(lambda q, k, v: torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-2)),
        "columns"),
    "no scaling": (_weights_then(lambda q, k, v: torch.softmax(q @ k.mT, dim=-1)),
                   "without scaling"),
    "divided by d_k": (_weights_then(lambda q, k, v: torch.softmax(q @ k.mT / q.shape[-1], dim=-1)),
                       "divided the scores by d_k"),
    "correct weights, output from unscaled weights": (
        lambda q, k, v: (torch.softmax(q @ k.mT, dim=-1) @ v,
                         torch.softmax(q @ k.mT / math.sqrt(q.shape[-1]), dim=-1)),
        "weights are right but your output is wrong.*without scaling"),
}


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", list(WRONG_SDPA))
def test_sdpa_rejects_misconceptions(name):
    fn, message = WRONG_SDPA[name]
    with pytest.raises(CheckFailure, match=message):
        check_scaled_dot_product_attention(fn)


def test_sdpastub_propagates():
    with pytest.raises(NotImplementedError):
        check_scaled_dot_product_attention(stub)


# --------------------------------------------------------------------------- 2.4 scores_gradient


def gradient_formula(weights, v, grad_out):
    grad_weights = grad_out @ v.transpose(-2, -1)  # (..., T, S)
    return weights * (grad_weights - (weights * grad_weights).sum(-1, keepdim=True))


def gradient_jacobian(weights, v, grad_out):
    """Row by row: J = diag(p) - p p^T, then J @ g (J is symmetric)."""
    jac = torch.diag_embed(weights) - weights[..., :, None] * weights[..., None, :]
    grad_weights = torch.einsum("...td,...sd->...ts", grad_out, v)
    return (jac @ grad_weights[..., None])[..., 0]


def gradient_autograd(weights, v, grad_out):
    """Let autograd do it: softmax(log p) = p."""
    scores = weights.log().detach().requires_grad_(True)
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(grad_out)
    return scores.grad


@pytest.mark.parametrize("fn", [gradient_formula, gradient_jacobian, gradient_autograd])
def test_scores_gradient_accepts_correct_answers(fn, capsys):
    check_scores_gradient(fn)
    assert "scores_gradient is correct" in capsys.readouterr().out


def _gw(w, v, g):
    return g @ v.transpose(-2, -1)


WRONG_GRADIENTS = {
    "gradient of the weights": (_gw, "with respect to the weights"),
    "transposed": (lambda w, v, g: v @ g.transpose(-2, -1), "transposed"),
    "diagonal only": (lambda w, v, g: w * _gw(w, v, g), "only the diagonal"),
    "plain sum": (lambda w, v, g: w * (_gw(w, v, g) - _gw(w, v, g).sum(-1, keepdim=True)),
                  "plain sum"),
    "sum over the queries": (
        lambda w, v, g: w * (_gw(w, v, g) - (w * _gw(w, v, g)).sum(-2, keepdim=True)),
        "over the keys"),
    "not multiplied by p": (
        lambda w, v, g: _gw(w, v, g) - (w * _gw(w, v, g)).sum(-1, keepdim=True),
        "did not multiply by the weights"),
    "v.T on a batch": (
        lambda w, v, g: w * (g @ v.T - (w * (g @ v.T)).sum(-1, keepdim=True)),
        "v.transpose"),
    "an extra 1/sqrt(d)": (lambda w, v, g: gradient_formula(w, v, g) / math.sqrt(v.shape[-1]),
                           "wrong values"),
}


@pytest.mark.parametrize("name", list(WRONG_GRADIENTS))
def test_scores_gradient_rejects_misconceptions(name):
    wrong, message = WRONG_GRADIENTS[name]
    with pytest.raises(CheckFailure, match=message):
        check_scores_gradient(wrong)


def test_scores_gradient_rejects_changing_the_input_in_place():
    def in_place(weights, v, grad_out):
        grad_weights = grad_out @ v.transpose(-2, -1)
        weights *= grad_weights - (weights * grad_weights).sum(-1, keepdim=True)
        return weights

    with pytest.raises(CheckFailure, match="in place"):
        check_scores_gradient(in_place)


def test_scores_gradientstub_propagates():
    with pytest.raises(NotImplementedError):
        check_scores_gradient(stub)

# ------------------------------------------------------------- 2.5 is_permutation_equivariant


def equivariant_allclose(f, X, perm):
    return torch.allclose(f(X[..., perm, :]), f(X)[..., perm, :], atol=1e-5)


def equivariant_index_select(f, X, perm):
    left = f(torch.index_select(X, -2, perm))
    right = torch.index_select(f(X), -2, perm)
    return bool((left - right).abs().max() < 1e-4)


def equivariant_assert_close(f, X, perm):
    try:
        torch.testing.assert_close(f(X[..., perm, :]), f(X)[..., perm, :])
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("fn", [equivariant_allclose, equivariant_index_select,
                                equivariant_assert_close])
def test_equivariance_accepts_correct_answers(fn, capsys):
    check_is_permutation_equivariant(fn)
    assert "is_permutation_equivariant is correct" in capsys.readouterr().out


WRONG_EQUIVARIANCE = {
    "no permutation of f(X)": (
        lambda f, X, perm: torch.allclose(f(X[..., perm, :]), f(X), atol=1e-5),
        r"compare f\(X\[perm\]\) with f\(X\)\[perm\]"),
    "exact equality": (lambda f, X, perm: torch.equal(f(X[..., perm, :]), f(X)[..., perm, :]),
                       "float rounding"),
    "== then all": (lambda f, X, perm: bool((f(X[..., perm, :]) == f(X)[..., perm, :]).all()),
                    "float rounding"),
    "allclose with its default atol": (
        lambda f, X, perm: torch.allclose(f(X[..., perm, :]), f(X)[..., perm, :]),
        r"atol=1e-8\) is too strict"),
    "inverse permutation": (
        lambda f, X, perm: torch.allclose(f(X[..., perm, :]),
                                          f(X)[..., torch.argsort(perm), :], atol=1e-5),
        "inverse permutation"),
    "permutes the features": (
        lambda f, X, perm: torch.allclose(f(X[..., perm]), f(X)[..., perm], atol=1e-5),
        r"dim -2"),
    "permutes the first axis": (lambda f, X, perm: torch.allclose(f(X[perm]), f(X)[perm],
                                                                  atol=1e-5),
                                r"dim -2"),
    "always True": (lambda f, X, perm: True, "adds a position vector"),
    "element-wise answer": (lambda f, X, perm: torch.isclose(f(X[..., perm, :]),
                                                             f(X)[..., perm, :]),
                            r"True or False.*\.all\(\)"),
}


@pytest.mark.parametrize("name", list(WRONG_EQUIVARIANCE))
def test_equivariance_rejects_misconceptions(name):
    fn, message = WRONG_EQUIVARIANCE[name]
    if name == "allclose with its default atol":
        case = _rounding_case()
        if torch.allclose(case.f(case.x[case.perm]), case.f(case.x)[case.perm]):
            pytest.skip("on this machine the rounding errors happen to fit atol=1e-8")
    with pytest.raises(CheckFailure, match=message):
        check_is_permutation_equivariant(fn)


def test_equivariancestub_propagates():
    with pytest.raises(NotImplementedError):
        check_is_permutation_equivariant(stub)


def _rounding_case():
    from course_lib.course.checks.ch02 import _equivariance_cases

    return next(c for c in _equivariance_cases(seed=24) if "rounding" in c.name)


def test_rounding_case_really_differs_bit_for_bit():
    """The exact-equality mistake is only caught if some case differs by rounding alone."""
    case = _rounding_case()
    left, right = case.f(case.x[case.perm]), case.f(case.x)[case.perm]
    assert not torch.equal(left, right)
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)


def test_attention_layer_is_equivariant_and_batched():
    f = attention_layer(8, seed=0)
    x = torch.randn(3, 5, 8)
    perm = torch.tensor([4, 2, 0, 1, 3])
    assert f(x).shape == (3, 5, 8)
    torch.testing.assert_close(f(x[:, perm]), f(x)[:, perm], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------ 2.2 fixed_attention (find the bug)


def fixed_matmul(q, k, v):
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    return weights @ v


def fixed_last_dim_counted(q, k, v):
    """softmax over dim=scores.dim() - 1: the last axis, counted from the front."""
    scores = q @ k.mT / q.shape[-1] ** 0.5
    return F.softmax(scores, dim=scores.dim() - 1) @ v


def fixed_einsum(q, k, v):
    scores = torch.einsum("...td,...sd->...ts", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("...ts,...sv->...tv", attention.softmax(scores), v)


def fixed_torch_sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def fixed_library(q, k, v):
    return attention.scaled_dot_product_attention(q, k, v)[0]


@pytest.mark.parametrize("fn", [fixed_matmul, fixed_last_dim_counted, fixed_einsum,
                                fixed_torch_sdpa, fixed_library])
def test_fixed_attention_accepts_any_correct_fix(fn, capsys):
    check_fixed_attention(fn)
    assert "fixed_attention is correct" in capsys.readouterr().out


def test_buggy_attention_hides_on_one_sentence_and_fails_on_a_batch():
    """The planted mistake: right on (T, d) inputs, wrong as soon as a batch stands in front."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 4, generator=gen) for _ in range(3))
    torch.testing.assert_close(buggy_attention(q, k, v), fixed_matmul(q, k, v))
    qb, kb, vb = (torch.randn(2, 5, 4, generator=gen) for _ in range(3))
    assert not torch.allclose(buggy_attention(qb, kb, vb), fixed_matmul(qb, kb, vb))


def _softmax_dim(dim, *, scale=True):
    def attend(q, k, v):
        scores = q @ k.transpose(-2, -1) / (math.sqrt(q.shape[-1]) if scale else 1.0)
        return torch.softmax(scores, dim=dim) @ v
    return attend


WRONG_FIXES = {
    "unchanged (dim=1)": (buggy_attention, r"planted bug.*dim=1"),
    "dim=0": (_softmax_dim(0), r"dim=0, the batch axis"),
    "dim=-2 (over the queries)": (_softmax_dim(-2), "columns"),
    "dim=2 (fixed for 3-D only)": (_softmax_dim(2), "columns"),
    "fixed the axis, dropped the scale": (_softmax_dim(-1, scale=False), "without scaling"),
    "k.T on a batch": (
        lambda q, k, v: torch.softmax(q @ k.T / math.sqrt(q.shape[-1]), dim=-1) @ v,
        r"raised RuntimeError.*k\.transpose\(-2, -1\)"),
    "returns (out, weights)": (
        lambda q, k, v: attention.scaled_dot_product_attention(q, k, v),
        "return only the output"),
    "an extra 1/2": (lambda q, k, v: fixed_matmul(q, k, v) / 2, "wrong values"),
}


@pytest.mark.filterwarnings("ignore:The use of `x.T`")
@pytest.mark.parametrize("name", list(WRONG_FIXES))
def test_fixed_attention_rejects_wrong_fixes(name):
    fn, message = WRONG_FIXES[name]
    with pytest.raises(CheckFailure, match=f"(?s){message}") as failure:
        check_fixed_attention(fn)
    # the instrument that finds the planted bug is named only when the output is that bug's
    planted = name == "unchanged (dim=1)"
    assert ("Instrument that finds it" in str(failure.value)) == planted


def test_fixed_attention_names_the_instrument_for_the_planted_bug_rewritten():
    def planted_with_einsum(q, k, v):
        scores = torch.einsum("...td,...sd->...ts", q, k) / math.sqrt(q.shape[-1])
        return torch.einsum("...ts,...sd->...td", scores.softmax(dim=1), v)

    with pytest.raises(CheckFailure, match=r"(?s)planted bug.*Instrument that finds it: the "
                                           r"rows of attention weights sum to 1"):
        check_fixed_attention(planted_with_einsum)


def test_fixed_attentionstub_propagates():
    with pytest.raises(NotImplementedError):
        check_fixed_attention(stub)


# --------------------------------------------------------- 2.3 my_predictions (predict, verify)


def test_measured_stds_are_close_to_the_exact_values():
    """The check grades against the exact 8 and 4; the measurement it prints must agree."""
    std_dot, std_wide = measure_score_stds()
    assert abs(std_dot - 8.0) < 0.1
    assert abs(std_wide - 4.0) < 0.05


@pytest.mark.parametrize("answer", [
    (8.0, 4.0),
    [8.0, 4.0],
    (math.sqrt(64), 2 * 2 * math.sqrt(64) / math.sqrt(64)),
    (np.float64(8.0), np.float32(4.0)),
    (7.5, 4.3),  # within 15%: a prediction, not a measurement to three digits
])
def test_score_std_predictions_accept_right_predictions_in_any_form(answer, capsys):
    check_score_std_predictions(lambda: answer)
    out = capsys.readouterr().out
    assert "both predictions are within 15%" in out
    assert "Measured over 100,000 random pairs" in out


@pytest.mark.parametrize("answer", [(8, 4), (8.0, np.int64(4)), (np.float32(8.0), 4)])
def test_score_std_predictions_take_whole_numbers_as_numbers(answer, capsys):
    check_score_std_predictions(lambda: answer)  # the spec asks for two numbers: 8 is one
    assert "both predictions are within 15%" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    (("8", 4), r"should be a number: return an int or a float"),
    ((torch.tensor(8.0), 4.0), r"first prediction.*a tensor: turn it into a Python number"),
    ((True, 4.0), "should be a number"),
    ((8.0, None), "should be a number"),
])
def test_score_std_predictions_follow_the_one_rule_for_numbers(answer, message):
    with pytest.raises(CheckFailure, match=f"(?is){message}"):
        check_score_std_predictions(lambda: answer)


WRONG_PREDICTIONS = {
    "the variance": ((64.0, 4.0), r"64 is the variance of q \. k"),
    "the scaled spread": ((1.0, 4.0), "spread after dividing by sqrt"),
    "the mean": ((0.0, 4.0), "the mean of q"),
    "scaling also fixes the entries": ((8.0, 1.0), "not the size of the entries"),
    "std 2 per product": ((8.0, 2.0), "variances multiply"),
    "variance of the scaled score": ((8.0, 16.0), "16 is the variance of the scaled score"),
    "forgot the scaling": ((8.0, 32.0), "before the scaling"),
    "something else": ((8.0, 6.0), r"measured: 4\.00.*variance of a product"),
}


@pytest.mark.parametrize("name", list(WRONG_PREDICTIONS))
def test_score_std_predictions_reject_misconceptions_and_show_the_measurement(name):
    answer, message = WRONG_PREDICTIONS[name]
    with pytest.raises(CheckFailure, match=f"(?is){message}.*"):
        check_score_std_predictions(lambda: answer)
    with pytest.raises(CheckFailure, match=r"(?i)measured: \d"):
        check_score_std_predictions(lambda: answer)


@pytest.mark.parametrize("answer", [8.0, "8, 4", (8.0,), (8.0, 4.0, 2.0), {8.0, 4.0}])
def test_score_std_predictions_want_two_numbers(answer):
    with pytest.raises(CheckFailure, match="should return two numbers"):
        check_score_std_predictions(lambda: answer)


def test_score_std_predictionsstub_propagates():
    with pytest.raises(NotImplementedError):
        check_score_std_predictions(stub)


# ------------------------------------- 2.1 my_weight_predictions (predict, then verify)

RIGHT_WEIGHT_PREDICTIONS = {"zero queries": 0.2, "shift keys": False, "shift queries": True,
                            "double inputs": "sharper"}


def test_weight_measurement_agrees_with_torch():
    """The truths the check grades against, recomputed with torch.softmax on the same data."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(5, 8, generator=gen)
    w_q, w_k = torch.randn(4, 8, generator=gen) * 0.5, torch.randn(4, 8, generator=gen) * 0.5
    c = torch.randn(4, generator=gen) * 2.0

    def weights(q, k):
        return torch.softmax(q @ k.T / 2.0, dim=-1)  # d_k = 4

    base = weights(x @ w_q.T, x @ w_k.T)
    m = measure_weight_changes()
    assert m["zero queries"] == pytest.approx(1 / 5)
    assert m["shift keys"] == pytest.approx(
        float((weights(x @ w_q.T, x @ w_k.T + c) - base).abs().max()), abs=1e-6)
    assert m["shift keys"] < 1e-4
    assert m["shift queries"] == pytest.approx(
        float((weights(x @ w_q.T + c, x @ w_k.T) - base).abs().max()), abs=1e-5)
    assert m["shift queries"] > 0.1
    before, after = m["double inputs"]
    assert after < before - 0.1


@pytest.mark.parametrize("answer", [
    RIGHT_WEIGHT_PREDICTIONS,
    {**RIGHT_WEIGHT_PREDICTIONS, "zero queries": 1 / 5},
    {**RIGHT_WEIGHT_PREDICTIONS, "zero queries": np.float64(0.2), "shift keys": np.bool_(False)},
    {**RIGHT_WEIGHT_PREDICTIONS, "zero queries": 0.205, "double inputs": " Sharper "},
])
def test_weight_predictions_accept_right_answers(answer, capsys):
    check_weight_predictions(lambda: answer)
    out = capsys.readouterr().out
    assert "your predictions match the measurement" in out
    assert "row entropy" in out


WRONG_WEIGHT_PREDICTIONS = {
    "zero weights": ({"zero queries": 0.0}, r"'zero queries'.*1/T"),
    "one-hot": ({"zero queries": 1.0}, r"'zero queries'.*1/T"),
    "keys matter": ({"shift keys": True}, r"'shift keys'.*ignores a constant"),
    "queries do not": ({"shift queries": False}, r"'shift queries'.*different number"),
    "unchanged": ({"double inputs": "unchanged"}, r"'double inputs'.*multiplied by 4"),
    "flatter": ({"double inputs": "flatter"}, r"'double inputs'.*sharper"),
}


@pytest.mark.parametrize("name", list(WRONG_WEIGHT_PREDICTIONS))
def test_weight_predictions_reject_wrong_answers_and_explain_only_those(name, capsys):
    change, message = WRONG_WEIGHT_PREDICTIONS[name]
    with pytest.raises(CheckFailure, match=f"(?s){message}") as failure:
        check_weight_predictions(lambda: {**RIGHT_WEIGHT_PREDICTIONS, **change})
    for key in RIGHT_WEIGHT_PREDICTIONS:  # a right prediction gets no explanation
        assert (f"{key!r}:" in str(failure.value)) == (key in change)
    assert "measured" in capsys.readouterr().out


@pytest.mark.parametrize("answer, message", [
    ({**RIGHT_WEIGHT_PREDICTIONS, "zero queries": "0.2"}, r"should be a number"),
    ({**RIGHT_WEIGHT_PREDICTIONS, "zero queries": torch.tensor(0.2)}, r"\.item\(\)"),
    ({**RIGHT_WEIGHT_PREDICTIONS, "shift keys": "no"}, "True .* or False"),
    ({**RIGHT_WEIGHT_PREDICTIONS, "shift queries": 1}, "True .* or False"),
    ({**RIGHT_WEIGHT_PREDICTIONS, "double inputs": "more peaked"}, "choose one of"),
    ({"zero queries": 0.2}, "lacks the key"),
    ([0.2, False, True, "sharper"], "should return a dict"),
])
def test_weight_predictions_refuse_answers_of_the_wrong_form(answer, message):
    with pytest.raises(CheckFailure, match=message):
        check_weight_predictions(lambda: answer)


def test_weight_predictions_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_weight_predictions(stub)


# ------------------------------ 2.5 predict_equivariant + is_permutation_equivariant (study)


def test_the_suspects_answers_are_what_a_direct_test_finds():
    gen = torch.Generator().manual_seed(0)
    for name, f in equivariance_suspects().items():
        x = torch.randn(3, 7, 8, generator=gen)
        perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
        found = torch.allclose(f(x[:, perm]), f(x)[:, perm], atol=1e-5)
        assert found == SUSPECT_ANSWERS[name], name
        if name == "causal attention":  # it is causal: changing token 6 leaves 0..5 alone
            y = x.clone()
            y[:, 6] += 1.0
            torch.testing.assert_close(f(y)[:, :6], f(x)[:, :6])


@pytest.mark.parametrize("tester", [equivariant_allclose, equivariant_index_select,
                                    equivariant_assert_close])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_equivariance_study_accepts_right_answers(tester, as_numpy, capsys):
    answers = {k: np.bool_(v) if as_numpy else v for k, v in SUSPECT_ANSWERS.items()}
    check_equivariance_study(lambda: answers, tester)
    out = capsys.readouterr().out
    assert "your predictions match it" in out
    assert "your tester says" in out


@pytest.mark.parametrize("name", list(SUSPECT_ANSWERS))
def test_equivariance_study_rejects_each_wrong_prediction_by_name(name):
    answers = {**SUSPECT_ANSWERS, name: not SUSPECT_ANSWERS[name]}
    verdict = "is equivariant" if SUSPECT_ANSWERS[name] else "is not equivariant"
    with pytest.raises(CheckFailure, match=f"'{name}' {verdict}") as failure:
        check_equivariance_study(lambda: answers, equivariant_allclose)
    others = [n for n in SUSPECT_ANSWERS if n != name]
    assert not any(f"'{n}'" in str(failure.value) for n in others)


@pytest.mark.parametrize("name", ["no permutation of f(X)", "inverse permutation",
                                  "permutes the first axis", "always True"])
def test_equivariance_study_grades_the_tester_before_using_it(name):
    tester, message = WRONG_EQUIVARIANCE[name]
    with pytest.raises(CheckFailure, match=message):
        check_equivariance_study(lambda: dict(SUSPECT_ANSWERS), tester)


@pytest.mark.parametrize("answer, message", [
    ({**SUSPECT_ANSWERS, "attention": "yes"}, r"'attention' should be True"),
    ({**SUSPECT_ANSWERS, "per-token MLP": 1}, r"'per-token MLP' should be True"),
    ({"attention": True}, "lacks the key"),
    ({True, False}, "should return a dict"),
])
def test_equivariance_study_refuses_predictions_of_the_wrong_form(answer, message):
    with pytest.raises(CheckFailure, match=message):
        check_equivariance_study(lambda: answer, equivariant_allclose)


def test_equivariance_study_stubs_propagate():
    with pytest.raises(NotImplementedError):
        check_equivariance_study(stub, equivariant_allclose)
    with pytest.raises(NotImplementedError):
        check_equivariance_study(lambda: dict(SUSPECT_ANSWERS), stub)
