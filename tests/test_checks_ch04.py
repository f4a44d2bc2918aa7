"""The chapter 04 checks: they accept correct answers written in different ways, reject the
likely mistakes with a message naming them, and let an unsolved stub's NotImplementedError
through."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub
from torch import nn

from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch04 import (
    check_collapse,
    check_fixed_ffn,
    check_xor_experiment,
    reference_feed_forward,
)

# ------------------------------------------------------------------ references


def test_reference_feed_forward_matches_functional_form():
    torch.manual_seed(0)
    x, W1, b1 = torch.randn(2, 3, 4), torch.randn(10, 4), torch.randn(10)
    W2, b2 = torch.randn(4, 10), torch.randn(4)
    expected = F.linear(F.relu(F.linear(x, W1, b1)), W2, b2)
    torch.testing.assert_close(reference_feed_forward(x, W1, b1, W2, b2), expected)


# ------------------------------------------------------------------ 4.1 collapse with biases


def collapse_loop(alphas, Vs, cs):
    alpha_star, V_star, c_star = alphas[0], Vs[0], cs[0]
    for alpha, V, c in zip(alphas[1:], Vs[1:], cs[1:], strict=True):
        alpha_star = alpha @ alpha_star
        V_star = V @ V_star
        c_star = V @ c_star + c
    return alpha_star, V_star, c_star


def collapse_closed_form(alphas, Vs, cs):
    """c* = sum over layers l of (V_N ... V_{l+1}) c_l, each product built from the right."""
    n = len(Vs)
    alpha_star = torch.linalg.multi_dot(alphas[::-1]) if n > 1 else alphas[0]
    V_star = torch.linalg.multi_dot(Vs[::-1]) if n > 1 else Vs[0]
    c_star = torch.zeros(Vs[-1].shape[0], dtype=Vs[-1].dtype)
    for layer in range(n):
        carried = cs[layer]
        for V in Vs[layer + 1:]:
            carried = V @ carried
        c_star = c_star + carried
    return [alpha_star, V_star, c_star]  # a list is fine too


def collapse_through_the_stack(alphas, Vs, cs):
    """Read c* off the stack itself: push a zero input through the layers."""
    h = torch.zeros(alphas[0].shape[0], Vs[0].shape[1], dtype=Vs[0].dtype)
    for alpha, V, c in zip(alphas, Vs, cs, strict=True):
        h = alpha @ (h @ V.T + c)
    alpha_star = torch.eye(alphas[0].shape[0], dtype=alphas[0].dtype)
    V_star = torch.eye(Vs[0].shape[1], dtype=Vs[0].dtype)
    for alpha, V in zip(alphas, Vs, strict=True):
        alpha_star, V_star = alpha @ alpha_star, V @ V_star
    return alpha_star.float(), V_star.float(), h[0].float()  # float32 is close enough


@pytest.mark.parametrize("fn", [collapse_loop, collapse_closed_form, collapse_through_the_stack])
def test_collapse_accepts_correct_answers(fn, capsys):
    check_collapse(fn)
    out = capsys.readouterr().out
    assert "collapse is correct on all 6" in out and "differ by" in out


def _wrong_collapse(alpha_left=False, v_left=False, bias="right"):
    def fn(alphas, Vs, cs):
        alpha_star, V_star, c_star = alphas[0], Vs[0], cs[0]
        if bias == "own":
            c_star = Vs[0] @ cs[0]
        for alpha, V, c in zip(alphas[1:], Vs[1:], cs[1:], strict=True):
            alpha_star = alpha_star @ alpha if alpha_left else alpha @ alpha_star
            V_star = V_star @ V if v_left else V @ V_star
            if bias == "right":
                c_star = V @ c_star + c
            elif bias == "sum":
                c_star = c_star + c
            elif bias == "last":
                c_star = c
            else:  # "own"
                c_star = V @ c_star + V @ c
        return alpha_star, V_star, c_star
    return fn


def _bias_per_row(alphas, Vs, cs):
    alpha_star, V_star, c_star = collapse_loop(alphas, Vs, cs)
    return alpha_star, V_star, c_star.expand(alphas[0].shape[0], -1)


WRONG_COLLAPSE = {
    "alphas reversed": (_wrong_collapse(alpha_left=True), "alpha_star: your product is in the wrong"),
    "Vs reversed": (_wrong_collapse(v_left=True), "V_star: your product is in the wrong order"),
    "biases summed": (_wrong_collapse(bias="sum"), "added the biases as they are"),
    "last bias only": (_wrong_collapse(bias="last"), "kept only the last layer's bias"),
    "bias through its own V": (_wrong_collapse(bias="own"), "through its own value matrix"),
    "bias per row": (_bias_per_row, "one row per token, and its rows are all the right bias"),
    "two items": (lambda a, V, c: collapse_loop(a, V, c)[:2], "should return the three tensors"),
    "one tensor": (lambda a, V, c: collapse_loop(a, V, c)[1], "should return the three tensors"),
    "c* = 0": (lambda a, V, c: (*collapse_loop(a, V, c)[:2], torch.zeros(V[-1].shape[0])),
               "c_star has the right shape but wrong values"),
}


@pytest.mark.parametrize("name", list(WRONG_COLLAPSE))
def test_collapse_rejects_mistakes(name):
    fn, match = WRONG_COLLAPSE[name]
    with pytest.raises(CheckFailure, match=match):
        check_collapse(fn)


def test_collapse_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_collapse(stub)


def test_collapse_check_leaves_the_global_random_state_alone(capsys):
    torch.manual_seed(3)
    before = torch.random.get_rng_state()
    check_collapse(collapse_loop)
    assert torch.equal(before, torch.random.get_rng_state())


# ------------------------------------------------------------------ 4.2 experiment

CORNERS = torch.tensor([[-1.0, -1.0], [-1.0, 1.0], [1.0, -1.0], [1.0, 1.0]])
XOR = CORNERS[:, 0] * CORNERS[:, 1]


def make_fit(activation_fn=None, targets=XOR, width=None, train=True, steps=300, lr=0.05,
             as_tensor=False, zero_grad=True, reduction="mean", as_type=float):
    """A fit_xor; the keyword arguments plant one mistake each."""

    def fit_xor(activation, hidden_units, seed):
        torch.manual_seed(seed)
        h = width or hidden_units
        act = activation_fn(activation) if activation_fn else (
            nn.ReLU() if activation == "relu" else nn.Identity())
        net = nn.Sequential(nn.Linear(2, h), act, nn.Linear(h, 1))
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        losses = []
        for _ in range(steps):
            squared = (net(CORNERS).squeeze(-1) - targets).pow(2)
            loss = squared.mean() if reduction == "mean" else squared.sum()
            if train:
                if zero_grad:
                    opt.zero_grad()
                loss.backward()
                opt.step()
            losses.append(as_type(loss.item()) if as_type is not None else loss.detach())
        return torch.tensor(losses) if as_tensor else losses

    return fit_xor


def fit_with_explicit_parameters(activation, hidden_units, seed):
    # another correct formulation: explicit parameters, F.relu, F.mse_loss
    gen = torch.Generator().manual_seed(seed)
    W1 = (torch.randn(hidden_units, 2, generator=gen) * 0.7).requires_grad_()
    b1 = torch.zeros(hidden_units).requires_grad_()
    W2 = (torch.randn(1, hidden_units, generator=gen) / hidden_units ** 0.5).requires_grad_()
    b2 = torch.zeros(1).requires_grad_()
    opt = torch.optim.Adam([W1, b1, W2, b2], lr=0.05)
    losses = []
    for _ in range(300):
        hidden = F.linear(CORNERS, W1, b1)
        if activation == "relu":
            hidden = F.relu(hidden)
        loss = F.mse_loss(F.linear(hidden, W2, b2).squeeze(-1), XOR)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def fit_as_numpy(activation, hidden_units, seed):
    # losses collected as numpy float32 scalars in a numpy array
    return np.array(make_fit(as_type=np.float32)(activation, hidden_units, seed),
                    dtype=np.float32)


@pytest.mark.parametrize("fn", [make_fit(), make_fit(as_type=np.float32),
                                make_fit(as_type=np.float64), make_fit(lr=0.01),
                                fit_as_numpy, fit_with_explicit_parameters])
def test_xor_experiment_accepts_correct_answers(fn, capsys):
    check_xor_experiment(fn)
    assert "behaves as the theory says" in capsys.readouterr().out


XOR_WRONG = {
    "relu never applied": (make_fit(activation_fn=lambda a: nn.Identity()),
                           "ReLU applied between"),
    "activation also for none": (make_fit(activation_fn=lambda a: nn.ReLU()),
                                 "activation\\s+is still applied"),
    "0/1 targets": (make_fit(targets=(XOR > 0).float()), "targets are not x1 \\* x2"),
    "no training": (make_fit(train=False), "never change"),
    "width ignored": (make_fit(width=16), "hidden_units used"),
    "too few steps": (make_fit(steps=50), "should make 300 updates"),
    "summed loss": (make_fit(reduction="sum"), "summed over the 4"),
    "no zero_grad": (make_fit(zero_grad=False), "accumulate.*zero_grad"),
    "learning rate far too small": (make_fit(lr=1e-4), "floor, 1.0, well within"),
    "tensor of losses": (make_fit(as_tensor=True), "should return a list of 300"),
    "0-d tensors": (make_fit(as_type=None), "each loss should be a number.*\\.item\\(\\)"),
    "ints": (make_fit(as_type=round), "each loss should be a number.*float\\(\\.\\.\\.\\)"),
    "returns a number": (lambda a, h, s: 0.5, "list of 300 losses"),
}


@pytest.mark.parametrize("name", list(XOR_WRONG))
def test_xor_experiment_rejects_mistakes(name):
    fn, match = XOR_WRONG[name]
    with pytest.raises(CheckFailure, match=match):
        check_xor_experiment(fn)


def test_xor_experiment_crash_inside_learner_code_is_named():
    def crashes(activation, hidden_units, seed):
        return nn.Linear(3, hidden_units)(CORNERS)

    with pytest.raises(CheckFailure, match="raised RuntimeError"):
        check_xor_experiment(crashes)


def test_xor_experiment_stub_propagates():
    with pytest.raises(NotImplementedError):
        check_xor_experiment(stub)


# ------------------------------------------------------------------ 4.3 find the bug


class BuggyFFN(nn.Module):
    """The exercise's module: un-flattens its output the wrong way."""

    def __init__(self, d_model, d_ff):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        B, T, D = x.shape
        out = self.fc2(torch.relu(self.fc1(x.reshape(B * T, D))))
        return out.reshape(B, D, T).transpose(1, 2)


class FixedDirect(BuggyFFN):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FixedReshape(BuggyFFN):
    def forward(self, x):
        B, T, D = x.shape
        out = self.fc2(F.relu(self.fc1(x.reshape(B * T, D))))
        return out.reshape(B, T, D)


class FixedLoop(BuggyFFN):
    def forward(self, x):
        rows = [[self.fc2(self.fc1(x[b, t]).clamp(min=0)) for t in range(x.shape[1])]
                for b in range(x.shape[0])]
        return torch.stack([torch.stack(r) for r in rows])


@pytest.mark.parametrize("cls", [FixedDirect, FixedReshape, FixedLoop])
def test_fixed_ffn_accepts_correct_fixes(cls, capsys):
    check_fixed_ffn(cls)
    assert "keeps positions apart" in capsys.readouterr().out


class NoActivation(BuggyFFN):
    def forward(self, x):
        return self.fc2(self.fc1(x))


class MeanOverPositions(BuggyFFN):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) + 0.1 * x.mean(1, keepdim=True)


class Gelu(BuggyFFN):
    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class WrongShape(BuggyFFN):
    def forward(self, x):
        return self.fc1(x)


class Flattened(BuggyFFN):
    def forward(self, x):
        B, T, D = x.shape
        return self.fc2(torch.relu(self.fc1(x.reshape(B * T, D))))


class NewInit(BuggyFFN):
    def __init__(self, d_model):
        super().__init__(d_model, 4 * d_model)


FIXED_WRONG = {
    "the buggy module": (BuggyFFN, "who_sees_whom finds that output 0"),
    "mixes by a mean": (MeanOverPositions, "still mixes positions"),
    "no activation": (NoActivation, "without the ReLU"),
    "gelu": (Gelu, "differs from course_lib's FeedForward"),
    "wrong shape": (WrongShape, "should return a tensor of shape"),
    "forgets to un-flatten": (Flattened, "shape \\(2, 5, 4\\)"),
    "changed __init__": (NewInit, "Keep BuggyFFN's __init__"),
}


@pytest.mark.parametrize("name", list(FIXED_WRONG))
def test_fixed_ffn_rejects_mistakes(name):
    cls, match = FIXED_WRONG[name]
    with pytest.raises(CheckFailure, match=match):
        check_fixed_ffn(cls)


def test_fixed_ffn_without_linear_layers_is_named():
    class Bare(nn.Module):
        def __init__(self, d_model, d_ff):
            super().__init__()

        def forward(self, x):
            return x

    with pytest.raises(CheckFailure, match="no nn.Linear 'fc1'"):
        check_fixed_ffn(Bare)


def test_fixed_ffn_stub_propagates():
    class Stub(BuggyFFN):
        def forward(self, x):
            raise NotImplementedError("Exercise 4.3: fix forward")

    with pytest.raises(NotImplementedError):
        check_fixed_ffn(Stub)
