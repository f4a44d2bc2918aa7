"""The training loop: it learns, its schedule and clipping do what they say, it is repeatable,
and it explains bad input."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import on_devices
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from course_lib.configs import DecoderConfig, EncoderDecoderConfig, LMOutput
from course_lib.device import num_threads
from course_lib.models import DecoderLM, EncoderDecoder, count_parameters
from course_lib.tasks import copy_task, recall_task, word_order_task
from course_lib.train import (
    TrainConfig,
    check_batch_form,
    estimate_loss,
    lm_batches,
    load_checkpoint,
    lr_schedule,
    make_optimizer,
    param_groups,
    random_batches,
    save_checkpoint,
    train,
)


def _load_timed_train():
    """benchmarks/timed_train.py (training under a time budget), loaded from its file."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "timed_train.py"
    spec = importlib.util.spec_from_file_location("timed_train", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


timed_train = _load_timed_train()
planned_updates, train_for = timed_train.planned_updates, timed_train.train_for

def _tiny_decoder(vocab_size: int, max_len: int = 32, seed: int = 0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    return DecoderLM(DecoderConfig(
        vocab_size=vocab_size, d_model=32, n_heads=2, n_layers=1, max_len=max_len, **kw
    ))


def _copy_setup(seed: int = 0, **config):
    task = copy_task(256, 4, n_symbols=4, seed=1)
    model = _tiny_decoder(task.vocab_size, seed=seed)
    tensors = {"ids": task.inputs, "targets": task.targets}
    batches = random_batches(tensors, 32, generator=torch.Generator().manual_seed(seed))
    val = random_batches(tensors, 32, generator=torch.Generator().manual_seed(seed + 1))
    defaults = dict(max_iters=60, lr=3e-3, warmup_iters=5, eval_interval=20, eval_iters=2)
    config = {**defaults, **config}
    config["warmup_iters"] = min(config["warmup_iters"], config["max_iters"])  # short runs
    return model, batches, val, TrainConfig(**config)


# --------------------------------------------------------------------------------------------
# Learning-rate schedule and parameter groups


def test_lr_schedule_shape():
    lr, min_lr, warmup, decay = 1e-3, 1e-4, 10, 110
    lrs = [lr_schedule(s, lr=lr, min_lr=min_lr, warmup_iters=warmup, decay_iters=decay)
           for s in range(150)]
    assert lrs[0] == pytest.approx(lr / warmup)
    assert lrs[warmup - 1] == pytest.approx(lr) and max(lrs) == pytest.approx(lr)
    assert all(a < b for a, b in zip(lrs[:warmup - 1], lrs[1:warmup], strict=True))  # rising
    assert all(a > b for a, b in zip(lrs[warmup:decay - 1], lrs[warmup + 1:decay], strict=True))
    assert lrs[decay - 1] == min_lr and set(lrs[decay - 1:]) == {min_lr}  # min at the last update
    # the cosine is half-way down half-way through the decay
    assert lrs[warmup - 1 + (decay - warmup) // 2] == pytest.approx((lr + min_lr) / 2)
    config = TrainConfig(max_iters=110, lr=lr, min_lr=min_lr, warmup_iters=warmup)
    assert [config.lr_at(s) for s in range(150)] == lrs


def test_param_groups_decay_only_matrices():
    model = _tiny_decoder(10)  # tied embeddings: lm_head.weight is the token embedding
    decayed, rest = param_groups(model, 0.1)
    assert decayed["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    rest_names = {names[id(p)] for p in rest["params"]}
    assert decayed_names == {n for n, p in model.named_parameters()
                             if p.dim() == 2 and "embedding" not in n}
    assert "embeddings.token.weight" in rest_names
    assert any(n.endswith("norm.weight") for n in rest_names)
    assert any(n.endswith("qkv_proj.weight") for n in decayed_names)
    n_params = sum(p.numel() for group in (decayed, rest) for p in group["params"])
    assert n_params == count_parameters(model)  # every parameter once


# --------------------------------------------------------------------------------------------
# The loop learns and is repeatable


def test_training_reduces_loss_on_copy_task():
    model, batches, val, config = _copy_setup()
    before = estimate_loss(model, val, 4)
    history = train(model, batches, config, val_batches=val, progress=False)
    assert history.val_losses[0] == pytest.approx(math.log(5), abs=0.3)  # uniform guess at init
    assert history.final_val_loss < 0.6 * before
    assert sum(history.train_losses[-10:]) < 0.6 * sum(history.train_losses[:10])


def test_history_layout():
    model, batches, val, config = _copy_setup(max_iters=45, eval_interval=20)
    history = train(model, batches, config, val_batches=val, progress=False)
    assert history.steps == list(range(1, 46))
    assert len(history.train_losses) == len(history.lrs) == len(history.grad_norms) == 45
    assert len(history.step_times) == 45 and min(history.step_times) > 0
    assert sum(history.step_times) == pytest.approx(history.train_time_s)
    assert history.eval_steps == [0, 20, 40, 45]
    assert len(history.val_losses) == len(history.eval_train_losses) == 4
    assert history.lrs == [config.lr_at(s) for s in range(45)]
    assert history.lrs[-1] == config.min_lr
    assert 0 < history.train_time_s < history.elapsed_s
    assert history.ms_per_iter == pytest.approx(1000 * history.train_time_s / 45)


def test_callback_sees_every_evaluation():
    model, batches, val, config = _copy_setup(max_iters=45, eval_interval=20)
    calls = []

    def callback(step, history):
        # called once the evaluation is recorded, with the model in eval mode
        calls.append((step, list(history.eval_steps), history.val_losses[-1], model.training))

    history = train(model, batches, config, val_batches=val, progress=False, callback=callback)
    assert [c[0] for c in calls] == history.eval_steps == [0, 20, 40, 45]
    assert all(seen[-1] == step for step, seen, _, _ in calls)
    assert [c[2] for c in calls] == history.val_losses
    assert not any(c[3] for c in calls) and model.training  # eval during the call, then back


def test_callback_does_not_change_training():
    runs = []
    for callback in (None, lambda step, history: None):
        model, batches, val, config = _copy_setup(max_iters=25)
        runs.append(train(model, batches, config, val_batches=val, progress=False,
                          callback=callback).train_losses)
    assert runs[0] == runs[1]


def test_same_seed_same_history():
    runs = []
    for _ in range(2):
        model, batches, val, config = _copy_setup(max_iters=25, seed=7)
        runs.append(train(model, batches, config, val_batches=val, progress=False))
    assert runs[0].train_losses == runs[1].train_losses
    assert runs[0].val_losses == runs[1].val_losses
    model, batches, val, config = _copy_setup(max_iters=25, seed=8)
    other = train(model, batches, config, val_batches=val, progress=False)
    assert other.train_losses != runs[0].train_losses


def test_seed_controls_dropout():
    task = copy_task(64, 4, n_symbols=4, seed=1)

    def run(seed):
        model = _tiny_decoder(task.vocab_size, seed=0, dropout=0.3)
        batches = random_batches({"ids": task.inputs, "targets": task.targets}, 16,
                                 generator=torch.Generator().manual_seed(0))
        config = TrainConfig(max_iters=5, warmup_iters=1, eval_iters=1, seed=seed)
        return train(model, batches, config, progress=False).train_losses

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_encoder_decoder_trains_on_a_translation_task():
    task = word_order_task(512, seed=0)
    vocab = task.vocab
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig.shared(
        src_vocab_size=vocab.vocab_size, tgt_vocab_size=vocab.vocab_size, d_model=32,
        n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=16, max_tgt_len=16,
        pad_id=vocab.pad_id,
    ))
    batches = random_batches({"src": task.src, "tgt": task.tgt_in, "targets": task.tgt_out}, 32,
                             generator=torch.Generator().manual_seed(0))
    config = TrainConfig(max_iters=60, lr=3e-3, warmup_iters=5, eval_interval=30, eval_iters=2)
    history = train(model, batches, config, progress=False)
    assert history.eval_train_losses[-1] < 0.6 * history.eval_train_losses[0]


@on_devices
def test_follows_the_model_device(device):
    model, batches, val, config = _copy_setup(max_iters=3, eval_interval=2)
    model.to(device)
    history = train(model, batches, config, val_batches=val, progress=False)
    assert len(history.steps) == 3
    assert next(model.parameters()).device.type == device.type


def test_lm_batches():
    data = torch.arange(50)
    batch = lm_batches(data, 4, 8, generator=torch.Generator().manual_seed(0))()
    assert set(batch) == {"ids", "targets"}
    assert batch["ids"].shape == batch["targets"].shape == (4, 8)
    assert torch.equal(batch["targets"], batch["ids"] + 1)
    with pytest.raises(ValueError, match="block_size=8"):
        lm_batches(torch.arange(8), 4, 8)


def test_lm_batches_checks_the_data_without_drawing_a_random_number():
    data = torch.arange(50)
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    lm_batches(data, 4, 8)
    assert torch.equal(torch.rand(3), expected)  # torch's stream is where it was
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    torch.manual_seed(0)
    lm_batches(data, 4, 8, generator=generator)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(generator.get_state(), state)  # and so is the batches' own


def test_building_the_batches_first_gives_the_same_model():
    def build():
        return DecoderLM(DecoderConfig(vocab_size=50, d_model=16, n_heads=2, n_layers=1,
                                       max_len=8))

    torch.manual_seed(0)
    plain = build()
    torch.manual_seed(0)
    lm_batches(torch.arange(50), 4, 8)
    random_batches({"ids": torch.zeros(10, 8, dtype=torch.long)}, 4)
    after_batches = build()
    for (name, a), b in zip(plain.state_dict().items(), after_batches.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name


def test_random_batches_keeps_rows_together():
    a = torch.arange(20)
    batch = random_batches({"x": a, "y": a * 10}, 20, generator=torch.Generator().manual_seed(0))()
    assert sorted(batch["x"].tolist()) == list(range(20))  # distinct examples
    assert torch.equal(batch["y"], batch["x"] * 10)
    with pytest.raises(ValueError, match=r"^tensors .*batch_size.*\(5,\)"):
        random_batches({"x": a, "y": a[:5]}, 4)
    with pytest.raises(ValueError, match=r"^tensors .*batch_size.*\(20,\)"):
        random_batches({"x": a}, 30)


# --------------------------------------------------------------------------------------------
# Clipping, evaluation mode, progress bar, time budget


def test_gradient_clipping_clips():
    model, batches, _, config = _copy_setup(max_iters=8, lr=1e-2, grad_clip=0.05, eval_iters=1)
    norms_at_step = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        norms_at_step.append(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads])).item())

    handle = register_optimizer_step_pre_hook(record)
    try:
        history = train(model, batches, config, progress=False)
    finally:
        handle.remove()
    assert len(norms_at_step) == 8
    assert min(history.grad_norms) > 0.05  # the raw gradients were larger than the limit ...
    assert max(norms_at_step) == pytest.approx(0.05, rel=1e-3)  # ... and the step saw them clipped

    model, batches, _, config = _copy_setup(max_iters=3, grad_clip=None, eval_iters=1)
    norms_at_step.clear()
    handle = register_optimizer_step_pre_hook(record)
    try:
        history = train(model, batches, config, progress=False)
    finally:
        handle.remove()
    assert norms_at_step == pytest.approx(history.grad_norms, rel=1e-4)  # unclipped


class _Recorder(nn.Module):
    """A model that records the mode and grad state of every forward call."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(3))
        self.calls: list[tuple[bool, bool]] = []

    def forward(self, ids: torch.Tensor, *, targets: torch.Tensor) -> LMOutput:
        self.calls.append((self.training, torch.is_grad_enabled()))
        logits = self.weight.expand(*ids.shape, 3)  # (B, T, 3)
        loss = nn.functional.cross_entropy(logits.reshape(-1, 3), targets.reshape(-1))
        return LMOutput(logits=logits, loss=loss)


def test_evaluation_uses_eval_mode_without_grad():
    model = _Recorder().eval()  # train() must leave it as it found it
    ids = torch.zeros(4, 2, dtype=torch.long)

    def batches():
        return {"ids": ids, "targets": ids}

    config = TrainConfig(max_iters=4, warmup_iters=1, eval_interval=2, eval_iters=3)
    train(model, batches, config, val_batches=batches, progress=False)
    updates = [c for c in model.calls if c == (True, True)]
    evals = [c for c in model.calls if c == (False, False)]
    assert len(updates) == 4
    assert len(evals) == 3 * 2 * 3  # 3 evaluations x (train + val) x eval_iters
    assert len(model.calls) == len(updates) + len(evals)
    assert model.training is False


def test_progress_bar_can_be_disabled(capsys):
    model, batches, _, config = _copy_setup(max_iters=3, eval_iters=1)
    train(model, batches, config, progress=False)
    assert capsys.readouterr().err == ""
    train(model, batches, config, progress=True, desc="copying")
    err = capsys.readouterr().err
    assert "copying" in err and "loss=" in err


def test_planned_updates_fill_the_time_left():
    config = TrainConfig(max_iters=10_000, eval_interval=50)
    # 9.5 s left after the final evaluation; each update costs 0.01 s plus 1/50 of a 0.5 s
    # evaluation, so 475 more updates fit
    assert planned_updates(100, 0.0, 10.0, step_s=0.01, eval_s=0.5, config=config) == 575
    assert planned_updates(100, 9.9, 10.0, step_s=0.01, eval_s=0.5, config=config) == 100
    assert planned_updates(100, 0.0, 1e9, step_s=0.01, eval_s=0.5, config=config) == 10_000


def test_time_budget_fits_the_cosine_to_the_clock(monkeypatch):
    # A fake clock that only moves when the model runs: 0.01 s per forward pass.
    now = [0.0]
    monkeypatch.setattr(timed_train, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Ticking(_Recorder):
        def forward(self, ids, *, targets):
            now[0] += 0.01
            return super().forward(ids, targets=targets)

    ids = torch.zeros(4, 2, dtype=torch.long)

    def batches():
        return {"ids": ids, "targets": ids}

    config = TrainConfig(max_iters=10_000, warmup_iters=5, eval_interval=20, eval_iters=2)
    history, stopped_by = train_for(Ticking(), batches, config, time_budget=1.0,
                                    val_batches=batches, progress=False)
    # 1 s holds about 80 updates (0.8 s) and 5 evaluations of 2 x 2 batches (0.2 s)
    assert stopped_by == "time_budget"
    assert 70 <= len(history.steps) <= 80
    assert history.elapsed_s <= 1.0 + 1e-9
    assert history.lrs[-1] == config.min_lr  # the cosine ended with the budget
    assert max(history.lrs) == config.lr


def test_time_budget_with_a_real_clock():
    task = recall_task(256, 6, seed=0)
    model = _tiny_decoder(task.vocab_size)
    batches = random_batches({"ids": task.inputs, "targets": task.targets}, 32)
    config = TrainConfig(max_iters=1_000_000, warmup_iters=5, eval_interval=50, eval_iters=2)
    history, stopped_by = train_for(model, batches, config, time_budget=1.0, progress=False)
    assert stopped_by == "time_budget" and len(history.steps) < 1_000_000
    assert 0.5 < history.elapsed_s < 5.0  # a busy machine can overshoot by a step or two


# --------------------------------------------------------------------------------------------
# Bad input: TrainConfig and the schedule


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(lr="3e-4"), TypeError, r"^lr .*> 0.*'3e-4'"),
    (dict(lr=True), TypeError, r"^lr .*> 0.*True"),
    (dict(lr=0.0), ValueError, r"^lr .*> 0.*0\.0"),
    (dict(lr=float("inf")), ValueError, r"^lr .*> 0.*inf"),
    (dict(min_lr="0"), TypeError, r"^min_lr .*>= 0"),
    (dict(lr=1e-3, min_lr=1e-2), ValueError, r"^min_lr .*lr=0\.001.*0\.01"),
    (dict(betas=0.9), TypeError, r"^betas .*pair"),
    (dict(betas="ab"), TypeError, r"^betas"),
    pytest.param(dict(betas=(0.9,)), ValueError, r"^betas .*two"),
    (dict(betas=(0.9, 1.0)), ValueError, r"^betas\[1\] .*\[0, 1\).*1\.0"),
    (dict(betas=(-0.1, 0.9)), ValueError, r"^betas\[0\] .*\[0, 1\).*-0\.1"),
    (dict(betas=(0.9, "x")), TypeError, r"^betas\[1\] .*\[0, 1\)"),
    (dict(max_iters=0), ValueError, r"^max_iters .*>= 1.*0"),
    (dict(max_iters=-1), ValueError, r"^max_iters .*>= 1.*-1"),
    (dict(max_iters=2.5), TypeError, r"^max_iters .*2\.5"),
    (dict(max_iters="100"), TypeError, r"^max_iters .*'100'"),
    (dict(warmup_iters=-1), ValueError, r"^warmup_iters .*>= 0.*-1"),
    (dict(warmup_iters=1.5), TypeError, r"^warmup_iters .*>= 0.*1\.5"),
    pytest.param(dict(lr_decay_iters=0), ValueError, r"^lr_decay_iters .*>= 1"),
    (dict(eval_interval=0), ValueError, r"^eval_interval .*>= 1.*0"),
    (dict(eval_interval=-5), ValueError, r"^eval_interval .*-5"),
    (dict(eval_iters=2.0), TypeError, r"^eval_iters .*write 2"),
    pytest.param(dict(weight_decay="0.1"), TypeError, r"^weight_decay .*>= 0"),
    pytest.param(dict(weight_decay=None), TypeError, r"^weight_decay .*>= 0"),
    pytest.param(dict(weight_decay=-0.1), ValueError, r"^weight_decay .*>= 0"),
    (dict(grad_clip="1"), TypeError, r"^grad_clip .*> 0.*None"),
    (dict(grad_clip=0.0), ValueError, r"^grad_clip .*> 0.*0\.0.*None"),
    (dict(grad_clip=float("nan")), ValueError, r"^grad_clip .*> 0.*nan"),
    (dict(seed=1.5), TypeError, r"^seed .*integer.*1\.5"),
    (dict(seed="0"), TypeError, r"^seed .*integer.*'0'"),
], ids=lambda v: None)
def test_train_config_rejects(changes, error, match):
    with pytest.raises(error, match=match):
        TrainConfig(**changes)


def test_train_config_accepts_the_valid_forms():
    config = TrainConfig(lr=1, min_lr=0, betas=[0.9, 0.95], grad_clip=None, seed=None,
                         warmup_iters=0, weight_decay=0)
    assert config.betas == (0.9, 0.95) and isinstance(config.betas, tuple)
    assert TrainConfig(seed=np.int64(3)).seed == 3


def test_a_warm_up_longer_than_the_run_is_refused():
    with pytest.raises(ValueError, match=r"warmup_iters=500 .*max_iters=100"):
        TrainConfig(max_iters=100, warmup_iters=500)
    with pytest.raises(ValueError, match=r"warmup_iters=100 .*max_iters=50"):  # its default
        TrainConfig(max_iters=50)


def test_a_decay_that_ends_before_the_warm_up_is_refused():
    with pytest.raises(ValueError, match=r"warmup_iters=500 .*lr_decay_iters=200"):
        TrainConfig(max_iters=1000, warmup_iters=500, lr_decay_iters=200)
    with pytest.raises(ValueError, match=r"warmup_iters=10 .*decay_iters=5"):
        lr_schedule(0, lr=1e-3, min_lr=1e-4, warmup_iters=10, decay_iters=5)
    with pytest.raises(ValueError, match=r"min_lr .*lr=0\.001.*0\.01"):
        lr_schedule(0, lr=1e-3, min_lr=1e-2, warmup_iters=1, decay_iters=5)


def test_consistent_edge_cases_of_the_schedule_are_accepted():
    # evaluating only at the end, a warm-up as long as the run, a decay beyond the run
    TrainConfig(max_iters=10, warmup_iters=1, eval_interval=250)
    config = TrainConfig(max_iters=10, warmup_iters=10, lr=1e-3)
    assert config.lr_at(9) == pytest.approx(1e-3)  # the peak is reached at the last update
    TrainConfig(max_iters=100, warmup_iters=10, lr_decay_iters=500)
    TrainConfig(max_iters=100, warmup_iters=10, lr_decay_iters=10)


def test_schedule_and_param_groups_reject_bad_arguments():
    with pytest.raises(TypeError, match=r"^lr .*> 0.*'1e-3'"):
        lr_schedule(0, lr="1e-3", min_lr=0.0, warmup_iters=1, decay_iters=10)
    with pytest.raises(ValueError, match=r"^decay_iters .*>= 1.*0"):
        lr_schedule(0, lr=1e-3, min_lr=0.0, warmup_iters=1, decay_iters=0)
    with pytest.raises(TypeError, match=r"^model .*nn\.Module.*Parameter"):
        param_groups([nn.Parameter(torch.zeros(2))], 0.1)


def test_param_groups_rejects_a_weight_decay_that_is_not_a_number():
    with pytest.raises(TypeError, match=r"^weight_decay .*>= 0"):
        param_groups(_tiny_decoder(5), "0.1")


@pytest.mark.parametrize("time_budget, error", [
    (0, ValueError), (-5.0, ValueError), ("10", TypeError), (None, TypeError),
])
def test_train_for_rejects_a_time_budget_that_is_not_a_positive_number(time_budget, error):
    model, batches, _, config = _copy_setup(max_iters=2)
    with pytest.raises(error, match=r"^time_budget .*> 0"):
        train_for(model, batches, config, time_budget=time_budget, progress=False)


# --------------------------------------------------------------------------------------------
# Bad input: train() and estimate_loss()


class _NoParameters(nn.Module):
    def forward(self, ids, targets):
        return SimpleNamespace(loss=ids.float().mean())



@pytest.mark.parametrize(("model", "error", "match"), [
    ("gpt", TypeError, r"^model .*nn\.Module.*'gpt'"),
    (lambda ids, targets: None, TypeError, r"^model .*nn\.Module.*function"),
    (DecoderConfig(vocab_size=5), TypeError, r"^model .*nn\.Module.*DecoderConfig"),
    pytest.param(_NoParameters(), ValueError, r"^model .*parameters"),
    pytest.param(_tiny_decoder(5).requires_grad_(False), ValueError,
                 r"^model .*trainable parameters"),
], ids=["str", "function", "config", "no-parameters", "frozen"])
def test_train_rejects_what_is_not_a_trainable_model(model, error, match):
    ids = torch.zeros(2, 4, dtype=torch.long)
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    with pytest.raises(error, match=match):
        train(model, lambda: {"ids": ids, "targets": ids}, config, progress=False)


def test_bad_config_and_options():
    model = _tiny_decoder(5)
    with pytest.raises(TypeError, match=r"^config .*TrainConfig.*dict"):
        train(model, lambda: {}, {"max_iters": 3}, progress=False)
    with pytest.raises(TypeError, match=r"^progress .*True or False.*'no'"):
        train(model, lambda: {}, TrainConfig(max_iters=2, warmup_iters=1), progress="no")
    with pytest.raises(TypeError, match=r"^desc .*str.*3"):
        train(model, lambda: {}, TrainConfig(max_iters=2, warmup_iters=1), desc=3)


def test_bad_callback():
    model, batches, _, config = _copy_setup(max_iters=2)
    with pytest.raises(TypeError, match=r"^callback .*function.*str"):
        train(model, batches, config, progress=False, callback="plot")


def test_estimate_loss_rejects_bad_arguments():
    ids = torch.zeros(2, 4, dtype=torch.long)
    batch = {"ids": ids, "targets": ids}
    with pytest.raises(TypeError, match=r"^model .*nn\.Module.*'model'"):
        estimate_loss("model", lambda: batch, 2)
    with pytest.raises(TypeError, match=r"^batches .*function.*dict"):
        estimate_loss(_tiny_decoder(5), batch, 2)
    with pytest.raises(ValueError, match=r"^iters .*>= 1.*0"):
        estimate_loss(_tiny_decoder(5), lambda: batch, 0)


# --------------------------------------------------------------------------------------------
# Bad input: batches of the wrong form

IDS = torch.zeros(2, 4, dtype=torch.long)

@pytest.mark.parametrize(("batches", "error", "match"), [
    ({"ids": IDS, "targets": IDS}, TypeError, r"^train_batches .*function.*dict"),
    (lambda: (IDS, IDS), TypeError, r"^train_batches\(\) .*dict.*'targets'.*\(tensor"),
    (lambda: {"ids": IDS}, TypeError, r"^train_batches\(\) .*'targets'.*\{'ids'"),
    (lambda: {"inputs": IDS, "targets": IDS}, TypeError, r"inputs"),
    pytest.param(lambda: {"ids": IDS.float(), "targets": IDS}, ValueError,
                 r"ids.*token ids.*float32"),
    (lambda: {"ids": IDS, "targets": IDS.float()}, ValueError, r"targets.*float32"),
    pytest.param(lambda: {"ids": IDS.bool(), "targets": IDS}, ValueError,
                 r"ids.*token ids.*torch\.bool"),
    pytest.param(lambda: {"ids": IDS.numpy(), "targets": IDS}, TypeError,
                 r"ids.*torch\.Tensor.*ndarray"),
    pytest.param(lambda: {"ids": IDS.tolist(), "targets": IDS}, TypeError,
                 r"ids.*torch\.Tensor.*list"),
], ids=["dict", "tuple", "no-targets", "wrong-key", "float-ids",
        "float-targets", "bool-ids", "ndarray", "list"])
def test_train_rejects_bad_batches(batches, error, match):
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    with pytest.raises(error, match=match):
        train(_tiny_decoder(5), batches, config, progress=False)


def test_train_rejects_bad_validation_batches():
    model = _tiny_decoder(5)
    with pytest.raises(TypeError, match=r"^val_batches .*function.*list"):
        train(model, lambda: {"ids": IDS, "targets": IDS}, val_batches=[IDS], progress=False)
    with pytest.raises(TypeError, match=r"^val_batches\(\) .*dict.*'targets'"):
        train(model, lambda: {"ids": IDS, "targets": IDS}, val_batches=lambda: [IDS, IDS],
              progress=False)


def test_train_rejects_float_ids_in_validation_batches():
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    with pytest.raises(ValueError, match=r"ids.*token ids.*float16"):
        train(_tiny_decoder(5), lambda: {"ids": IDS, "targets": IDS}, config,
              val_batches=lambda: {"ids": IDS.half(), "targets": IDS}, progress=False)


def test_encoder_decoder_batches_are_checked_too():
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig.shared(
        7, 7, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=5,
        max_tgt_len=4))
    src, tgt = torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long)
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    with pytest.raises(ValueError, match=r"src.*token ids.*float32"):
        train(model, lambda: {"src": src.float(), "tgt": tgt, "targets": tgt}, config,
              progress=False)


def test_own_models_may_take_float_targets():
    """A regression (float targets, as notebook 04 trains) is not a mistake."""

    class Regression(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(2, 1)

        def forward(self, x, targets):
            return SimpleNamespace(loss=nn.functional.mse_loss(self.linear(x).squeeze(-1), targets))

    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    history = train(Regression(), lambda: {"x": x, "targets": x.sum(-1)}, config, progress=False)
    assert len(history.steps) == 2


def test_train_draws_only_the_batches_it_uses():
    """No check draws a batch: every batch drawn feeds an update or an evaluation."""
    drawn = {"train": 0, "val": 0}

    def counting(name):
        def batches():
            drawn[name] += 1
            return {"ids": IDS, "targets": IDS}
        return batches

    config = TrainConfig(max_iters=6, warmup_iters=1, eval_interval=3, eval_iters=2)
    train(_tiny_decoder(5), counting("train"), config, val_batches=counting("val"),
          progress=False)
    evaluations = 3  # before the first update, after the 3rd and after the 6th
    assert drawn == {"train": 6 + 2 * evaluations, "val": 2 * evaluations}


def test_every_batch_is_checked_where_it_is_used():
    """Not only the first: the fourth batch, of the wrong form, is refused by name."""
    calls = []

    def batches():
        calls.append(len(calls))
        return {"ids": IDS, "targets": IDS} if len(calls) < 4 else (IDS, IDS)

    config = TrainConfig(max_iters=6, warmup_iters=1, eval_interval=6, eval_iters=1)
    with pytest.raises(TypeError, match=r"^train_batches\(\) .*dict.*'targets'"):
        train(_tiny_decoder(5), batches, config, progress=False)
    assert len(calls) == 4  # evaluation, updates 1 and 2, then the bad one


def test_the_batch_form_check_reads_no_values():
    """Meta tensors have shapes and dtypes but no values: reading one would raise."""
    ids = torch.zeros(2, 4, dtype=torch.long, device="meta")
    check_batch_form("train_batches", {"ids": ids, "targets": ids})
    with pytest.raises(ValueError, match=r"^train_batches\(\)\['targets'\] .*0-D"):
        check_batch_form("train_batches", {"ids": ids, "targets": ids[0, 0]})


class _Returns(nn.Module):
    def __init__(self, make_output):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.make_output = make_output

    def forward(self, ids, targets):
        return self.make_output(self.weight * ids.float())


@pytest.mark.parametrize(("make_output", "error", "match"), [
    (lambda x: x, TypeError, r"loss .*0-D tensor.*None"),
    (lambda x: SimpleNamespace(logits=x, loss=None), TypeError, r"loss .*0-D tensor.*None"),
    (lambda x: SimpleNamespace(loss=float(x.mean())), TypeError, r"loss .*0-D tensor.*0\.0"),
    pytest.param(lambda x: SimpleNamespace(loss=x), ValueError, r"loss .*0-D.*\(2, 4\)"),
], ids=["tensor", "none", "float", "not-averaged"])
def test_train_rejects_a_model_without_a_scalar_loss(make_output, error, match):
    config = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)
    with pytest.raises(error, match=match):
        train(_Returns(make_output), lambda: {"ids": IDS, "targets": IDS}, config,
              progress=False)


# --------------------------------------------------------------------------------------------
# Bad input: the batch functions


def test_batch_functions_reject_bad_arguments():
    stream = torch.arange(50)
    with pytest.raises(ValueError, match=r"^data .*token ids.*float32"):
        lm_batches(stream.float(), 4, 8)
    with pytest.raises(ValueError, match=r"^data .*token ids"):
        lm_batches(torch.rand(100), 2, 4)  # cast to long, every id would be 0
    with pytest.raises(ValueError, match=r"^batch_size .*>= 1.*0"):
        lm_batches(stream, 0, 8)
    with pytest.raises(TypeError, match=r"^block_size .*4\.0"):
        lm_batches(stream, 2, 4.0)
    with pytest.raises(TypeError, match=r"^tensors .*dict.*\(N, \.\.\.\)"):
        random_batches([stream], 4)
    with pytest.raises(TypeError, match=r"^tensors .*dict.*\(N, \.\.\.\)"):
        random_batches({"x": [1, 2, 3]}, 2)


@pytest.mark.parametrize("tensors", [{}, {"x": torch.tensor(3)}], ids=["empty", "0-D"])
def test_random_batches_refuses_nothing_to_draw_from_with_a_value_error(tensors):
    with pytest.raises(ValueError, match=r"tensors"):
        random_batches(tensors, 1)


@pytest.mark.parametrize("make", [
    lambda: lm_batches(torch.arange(50), 4, 8, generator=0),
    lambda: random_batches({"x": torch.arange(50)}, 4, generator="seed"),
], ids=["lm_batches", "random_batches"])
def test_a_seed_instead_of_a_generator_is_refused_by_name(make):
    with pytest.raises(TypeError, match=r"^generator .*torch\.Generator or None"):
        make()


def test_divergence_is_reported():
    model = _Recorder()
    ids = torch.zeros(4, 2, dtype=torch.long)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    config = TrainConfig(max_iters=3, warmup_iters=1, eval_iters=1)
    with pytest.raises(FloatingPointError, match=r"loss.*nan.*update 1.*lr"):
        train(model, lambda: {"ids": ids, "targets": ids}, config, progress=False)


def test_the_fused_optimizer_computes_the_default_adamw_update():
    """train() uses fused AdamW on the CPU; it must follow the same trajectory as the default
    (for-loop) implementation."""
    from course_lib.train import make_optimizer, param_groups

    torch.manual_seed(0)
    config = TrainConfig(lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    # no biases: the key bias gets a gradient of pure rounding noise (softmax ignores a shift
    # shared by a whole row of scores), which Adam scales up to a full-size step either way
    fused_model = DecoderLM(DecoderConfig(vocab_size=13, d_model=16, n_heads=2, n_layers=2,
                                          max_len=8, bias=False))
    plain_model = copy.deepcopy(fused_model)
    fused = make_optimizer(fused_model, config)
    assert fused.defaults["fused"]
    plain = torch.optim.AdamW(param_groups(plain_model, config.weight_decay), lr=config.lr,
                              betas=config.betas, foreach=False)
    for step in range(5):
        ids = torch.randint(0, 13, (4, 8), generator=torch.Generator().manual_seed(step))
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            opt.zero_grad()
            model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()
            opt.step()
    for (name, a), b in zip(fused_model.named_parameters(), plain_model.parameters(),
                            strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_live_plot_draws_the_curves_so_far():
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.instruments.viz import LivePlot, draw_losses

    live = LivePlot({"bigram": 2.5}, ylim=(1.0, 4.5))
    live.update([0, 10, 20], {"train": [4.0, 3.0], "validation": [4.1, 3.2]}, best=(10, 3.2))
    lines = live.ax.get_lines()
    train_line = next(line for line in lines if line.get_label() == "train")
    assert list(train_line.get_xdata()) == [0, 10] and list(train_line.get_ydata()) == [4.0, 3.0]
    assert any(line.get_label() == "best checkpoint" for line in lines)
    assert live.ax.get_ylim() == (1.0, 4.5)
    live.update([0], {"train": [4.0]})  # redrawn from scratch
    assert [line.get_label() for line in live.ax.get_lines() if line.get_label() == "train"]
    assert len(live.ax.get_lines()) == 2  # the curve and the baseline
    with pytest.raises(TypeError, match="curves must be a dict"):
        draw_losses(live.ax, [0], [4.0])


# --------------------------------------------------------------------------------------------
# Checkpoints: a run stopped and resumed takes the same steps as one that never stopped


def _dropout_setup(init_seed: int = 0, batch_seed: int = 0):
    """A tiny decoder with dropout (torch's global generator) and seeded train and validation
    batches (two more generators): every random state a run draws from."""
    task = copy_task(256, 4, n_symbols=4, seed=1)
    model = _tiny_decoder(task.vocab_size, seed=init_seed, dropout=0.2)
    tensors = {"ids": task.inputs, "targets": task.targets}
    batches = random_batches(tensors, 16, generator=torch.Generator().manual_seed(batch_seed))
    val = random_batches(tensors, 16, generator=torch.Generator().manual_seed(batch_seed + 1))
    config = TrainConfig(max_iters=40, lr=3e-3, warmup_iters=5, eval_interval=10, eval_iters=2)
    return model, batches, val, config


def _same_run(a, b) -> None:
    for name in ("steps", "train_losses", "lrs", "grad_norms", "eval_steps",
                 "eval_train_losses", "val_losses"):
        assert getattr(a, name) == getattr(b, name), name


def _stop_at(stop: int):
    """A callback that stops the run (as Ctrl-C would) at the evaluation after ``stop``."""
    def callback(step, history):
        if step == stop:
            raise KeyboardInterrupt
    return callback


def test_a_resumed_run_takes_the_same_steps_as_an_uninterrupted_one(tmp_path):
    path = tmp_path / "run.pt"
    with num_threads(1):
        model, batches, val, config = _dropout_setup()
        straight = train(model, batches, config, val_batches=val, progress=False)
        # the same run, stopped after update 20's evaluation: the file holds update 10
        first, batches, val, _ = _dropout_setup()
        with pytest.raises(KeyboardInterrupt):
            train(first, batches, config, val_batches=val, progress=False, checkpoint=path,
                  resume=True, callback=_stop_at(20))
        assert load_checkpoint(path, _dropout_setup()[0]).step == 10
        # a fresh start: other initial weights, other batch seeds; the file restores them all
        resumed_model, batches, val, _ = _dropout_setup(init_seed=5, batch_seed=9)
        resumed = train(resumed_model, batches, config, val_batches=val, progress=False,
                        checkpoint=path, resume=True)
    _same_run(resumed, straight)
    assert len(resumed.train_losses) == 40 and resumed.eval_steps == [0, 10, 20, 30, 40]
    for (name, p), q in zip(model.state_dict().items(), resumed_model.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name
    assert load_checkpoint(path, _dropout_setup()[0]).step == 40  # saved after the last update
    assert not (tmp_path / "run.pt.partial").exists()


def test_without_the_random_states_the_continued_run_would_differ(tmp_path):
    path = tmp_path / "run.pt"
    with num_threads(1):
        model, batches, val, config = _dropout_setup()
        straight = train(model, batches, config, val_batches=val, progress=False)
        model, batches, val, _ = _dropout_setup()
        with pytest.raises(KeyboardInterrupt):
            train(model, batches, config, val_batches=val, progress=False, checkpoint=path,
                  callback=_stop_at(20))
        # weights and optimizer restored, but torch's generator and the batches' are not
        model, batches, val, _ = _dropout_setup(batch_seed=9)
        optimizer = make_optimizer(model, config)
        done = load_checkpoint(path, model, optimizer)
        torch.manual_seed(0)
        losses = [model(**batches()).loss.item() for _ in range(3)]
    assert done.step == 10 and done.history.train_losses == straight.train_losses[:10]
    assert losses[0] != straight.train_losses[10]  # another batch and other dropout masks


def test_resume_without_a_file_starts_afresh_and_a_finished_run_stays_finished(tmp_path):
    path = tmp_path / "run.pt"
    with num_threads(1):
        model, batches, val, config = _dropout_setup()
        straight = train(model, batches, config, val_batches=val, progress=False)
        model, batches, val, _ = _dropout_setup()
        fresh = train(model, batches, config, val_batches=val, progress=False,
                      checkpoint=path, resume=True)
        again = train(model, batches, config, val_batches=val, progress=False,
                      checkpoint=path, resume=True)
    _same_run(fresh, straight)
    _same_run(again, straight)  # nothing left to do: the saved history comes back


def test_save_and_load_checkpoint_in_a_hand_written_loop(tmp_path):
    path = tmp_path / "own.pt"
    generator = torch.Generator().manual_seed(3)

    def step(model, optimizer):
        ids = torch.randint(0, 5, (4, 6), generator=generator)
        loss = model(ids=ids, targets=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    with num_threads(1):
        torch.manual_seed(0)
        model = _tiny_decoder(5, dropout=0.2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = [step(model, optimizer) for _ in range(3)]
        save_checkpoint(path, model, optimizer, step=3, generators=[generator])
        losses += [step(model, optimizer) for _ in range(3)]
        model = _tiny_decoder(5, seed=1, dropout=0.2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        generator.manual_seed(99)
        done = load_checkpoint(path, model, optimizer, generators=[generator])
        resumed = [step(model, optimizer) for _ in range(3)]
    assert done.step == 3 and done.history is None and done.config is None
    assert resumed == losses[3:]


def test_batch_functions_expose_their_generator():
    generator = torch.Generator().manual_seed(0)
    assert lm_batches(torch.arange(50), 2, 4, generator=generator).generator is generator
    assert random_batches({"x": torch.arange(8)}, 2, generator=generator).generator is generator
    assert lm_batches(torch.arange(50), 2, 4).generator is None


def test_checkpoint_arguments_are_checked(tmp_path):
    path = tmp_path / "run.pt"
    model, batches, val, config = _dropout_setup()
    short = TrainConfig(max_iters=10, warmup_iters=2, eval_interval=5, eval_iters=1)
    with pytest.raises(ValueError, match=r"resume=True needs .*checkpoint="):
        train(model, batches, short, progress=False, resume=True)
    with pytest.raises(TypeError, match=r"^checkpoint must be a file path"):
        train(model, batches, short, progress=False, checkpoint=3)
    with pytest.raises(TypeError, match=r"^resume must be True or False"):
        train(model, batches, short, progress=False, checkpoint=path, resume="yes")
    train(model, batches, short, val_batches=val, progress=False, checkpoint=path)
    other = dataclasses.replace(short, lr=1e-2)
    with pytest.raises(ValueError, match=r"another config: lr=0\.001 \(now 0\.01\).*resume=False"):
        train(model, batches, other, val_batches=val, progress=False, checkpoint=path,
              resume=True)
    with pytest.raises(ValueError, match=r"2 batch generator\(s\), but 1 were given"):
        train(model, batches, short, progress=False, checkpoint=path, resume=True)
    optimizer = make_optimizer(model, short)
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer"):
        save_checkpoint(path, model, "adam", step=1)
    with pytest.raises(ValueError, match=r"^step must be an integer >= 0"):
        save_checkpoint(path, model, optimizer, step=-1)
    with pytest.raises(TypeError, match=r"^generators must be a list"):
        save_checkpoint(path, model, optimizer, step=1, generators=torch.Generator())
    with pytest.raises(TypeError, match=r"^generators\[0\] must be a torch.Generator"):
        load_checkpoint(path, model, optimizer, generators=[0])
    with pytest.raises(TypeError, match=r"^path must be a file path"):
        load_checkpoint(None, model)


@on_devices
def test_a_checkpoint_restores_the_random_state_of_the_model_device(device, tmp_path):
    path = tmp_path / "run.pt"
    model = _tiny_decoder(5, dropout=0.2).to(device)
    optimizer = make_optimizer(model, TrainConfig(max_iters=2, warmup_iters=1))
    save_checkpoint(path, model, optimizer, step=0)
    drawn = torch.rand(4, device=device)  # what dropout would draw next
    weights = {name: p.clone() for name, p in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    load_checkpoint(path, model, optimizer)
    assert torch.equal(torch.rand(4, device=device), drawn)
    assert all(torch.equal(p, weights[name]) for name, p in model.state_dict().items())
    assert next(model.parameters()).device.type == device.type


# --------------------------------------------------------------------------------------------
# Checkpoints: a refused file changes nothing, a stopped save damages nothing

SHORT = TrainConfig(max_iters=4, warmup_iters=1, eval_interval=2, eval_iters=1)


def _decoder(vocab_size=5, seed=0, **kw) -> DecoderLM:
    torch.manual_seed(seed)
    sizes = {"d_model": 32, "n_heads": 2, "n_layers": 1, "max_len": 16, **kw}
    return DecoderLM(DecoderConfig(vocab_size=vocab_size, **sizes))


@pytest.fixture
def saved_run(tmp_path):
    """A checkpoint of a tiny decoder after one AdamW update (so it holds moments), with one
    batch generator and a config."""
    model = _decoder()
    optimizer = make_optimizer(model, SHORT)
    ids = torch.randint(0, 5, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids, targets=ids).loss.backward()
    optimizer.step()
    path = tmp_path / "run.pt"
    save_checkpoint(path, model, optimizer, step=1, generators=[torch.Generator()],
                    config=SHORT)
    return path, model


def _snapshot(model, optimizer, generators=()) -> dict:
    """Copies of everything load_checkpoint may change."""
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optimizer": copy.deepcopy(optimizer.state_dict()) if optimizer else None,
            "rng": torch.get_rng_state(), "generators": [g.get_state() for g in generators]}


def _same(a, b, where="") -> None:
    """Equal to the bit: every tensor by torch.equal (and dtype), the rest by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            _same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _adamw(model):
    return make_optimizer(model, SHORT)


# what to load the saved run into: (model, optimizer, generators, config), and the error
REFUSED = {
    "another vocabulary": (lambda: _decoder(7, seed=1), _adamw, 1, None,
                           r"another config: vocab_size=5 \(now 7\)"),
    "two layers": (lambda: _decoder(seed=1, n_layers=2), _adamw, 1, None,
                   r"another config: n_layers=1 \(now 2\)"),
    "other heads, same shapes": (lambda: _decoder(seed=1, n_heads=4), _adamw, 1, None,
                                 r"another config: n_heads=2 \(now 4\)"),
    "float64 weights": (lambda: _decoder(seed=1).double(), _adamw, 1, None,
                        r"float32 weights where model has torch\.float64.*model\.to"),
    "AdamW over a third": (lambda: _decoder(seed=1),
                           lambda m: torch.optim.AdamW(list(m.parameters())[::3]), 1, None,
                           r"parameter groups of \[\d+, \d+\] tensors, .* has \[\d+\]"),
    "SGD": (lambda: _decoder(seed=1),
            lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), 1, None,
            r"optimizer class AdamW, but optimizer is SGD"),
    "another model's AdamW": (lambda: _decoder(seed=1), lambda m: _adamw(_decoder(7)), 1, None,
                              r"moments of other shapes.*\(5, 32\).*\(7, 32\)"),
    "two generators": (lambda: _decoder(seed=1), _adamw, 2, None,
                       r"1 batch generator\(s\), but 2 were given"),
    "another config": (lambda: _decoder(seed=1), _adamw, 1, dataclasses.replace(SHORT, lr=0.1),
                       r"another config: lr=0\.001 \(now 0\.1\)"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_a_refused_checkpoint_changes_nothing(saved_run, case):
    path, _ = saved_run
    make_model, make_optimizer_for, n_generators, config, match = REFUSED[case]
    model = make_model()
    optimizer = make_optimizer_for(model)
    generators = [torch.Generator().manual_seed(i + 10) for i in range(n_generators)]
    before = _snapshot(model, optimizer, generators)
    with pytest.raises(ValueError, match=match) as refused:
        load_checkpoint(path, model, optimizer, generators=generators, config=config)
    assert str(path) in str(refused.value)  # the message names the file
    _same(_snapshot(model, optimizer, generators), before)


def test_the_snapshot_comparison_sees_a_load(saved_run):
    """The comparison above can fail: a load that works changes all it compares."""
    path, saved_model = saved_run
    model = _decoder(seed=1)
    optimizer = _adamw(model)
    generators = [torch.Generator().manual_seed(10)]
    before = _snapshot(model, optimizer, generators)
    load_checkpoint(path, model, optimizer, generators=generators, config=SHORT)
    after = _snapshot(model, optimizer, generators)
    for part in ("model", "optimizer", "generators"):
        with pytest.raises(AssertionError):
            _same(after[part], before[part])
    _same(after["model"], _snapshot(saved_model, None)["model"])


def _layers(width=4, depth=2, tied=False) -> nn.Sequential:
    torch.manual_seed(1)
    layers = [nn.Linear(width, width) for _ in range(depth)]
    if tied:
        layers[1].weight = layers[0].weight
    return nn.Sequential(*layers)


@pytest.mark.parametrize(("model", "match"), [
    (lambda: _layers(width=6), r"does not fit model: 0\.weight \(4, 4\) \(model: \(6, 6\)\)"),
    (lambda: _layers(depth=3), r"does not fit model: the model's \['2\.bias', '2\.weight'\]"),
    (lambda: _layers(tied=True), r"ties weights \[\], model ties \[\['0\.weight', '1\.weight'\]\]"),
], ids=["wider", "deeper", "tied"])
def test_a_module_without_a_config_is_checked_by_its_weights(tmp_path, model, match):
    path = tmp_path / "layers.pt"
    saved = _layers()
    save_checkpoint(path, saved, torch.optim.AdamW(saved.parameters()), step=0)
    target = model()
    optimizer = torch.optim.AdamW(target.parameters())
    before = _snapshot(target, optimizer)
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path, target, optimizer)
    _same(_snapshot(target, optimizer), before)


def _truncated(path, good):
    path.write_bytes(good.read_bytes()[: good.stat().st_size // 2])


@pytest.mark.parametrize(("write", "match"), [
    (_truncated, r"cannot be read as a checkpoint.*truncated"),
    (lambda path, good: path.write_bytes(b""), r"cannot be read as a checkpoint"),
    (lambda path, good: path.write_text("step: 10\nweights: ...\n"),
     r"cannot be read as a checkpoint.*another kind of file"),
    (lambda path, good: torch.save(_decoder().state_dict(), path),
     r"bare state_dict.*model\.load_state_dict\(torch\.load\(path\)\)"),
    (lambda path, good: torch.save({"weights": 1}, path),
     r"not a save_checkpoint file: it holds dict \['weights'\]"),
], ids=["truncated", "empty", "text", "state_dict", "another dict"])
def test_a_file_that_is_no_checkpoint_is_refused_by_name(saved_run, write, match):
    good, _ = saved_run
    path = good.with_name("other.pt")
    write(path, good)
    model = _decoder(seed=1)
    optimizer = _adamw(model)
    before = _snapshot(model, optimizer)
    with pytest.raises(ValueError, match=match) as refused:
        load_checkpoint(path, model, optimizer)
    assert str(path) in str(refused.value)
    _same(_snapshot(model, optimizer), before)


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^path .*nope\.pt.*not a file"):
        load_checkpoint(tmp_path / "nope.pt", _decoder())


def test_a_config_with_numpy_numbers_is_saved_as_plain_numbers(tmp_path):
    """A weights_only load reads no numpy scalars: the saved config holds Python ones."""
    path = tmp_path / "run.pt"
    model = _decoder()
    config = dataclasses.replace(SHORT, seed=np.int64(3))
    save_checkpoint(path, model, _adamw(model), step=0, config=config)
    done = load_checkpoint(path, model, config=config)
    assert done.config["seed"] == 3 and type(done.config["seed"]) is int


@pytest.mark.parametrize(("changes", "error", "match"), [
    (dict(history=[1.0, 0.5]), TypeError, r"^history must be a TrainHistory or None.*list"),
    (dict(config={"lr": 1e-3}), TypeError, r"^config must be a TrainConfig or None.*dict"),
    (dict(optimizer=None), TypeError, r"^optimizer must be a torch\.optim\.Optimizer.*None"),
    (dict(path="FOLDER/missing/run.pt"), ValueError, r"^path .*no folder .*missing"),
    (dict(path="FOLDER"), ValueError, r"^path .*got the folder"),
], ids=["history list", "config dict", "no optimizer", "missing folder", "a folder"])
def test_save_checkpoint_checks_before_writing_anything(tmp_path, changes, error, match):
    model = _decoder()
    arguments = {"path": tmp_path / "run.pt", "optimizer": _adamw(model), **changes}
    if isinstance(arguments["path"], str):
        arguments["path"] = arguments["path"].replace("FOLDER", str(tmp_path))
    with pytest.raises(error, match=match):
        save_checkpoint(arguments.pop("path"), model, arguments.pop("optimizer"), step=1,
                        **arguments)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing folder", "a folder"])
def test_train_checks_the_checkpoint_path_before_the_first_update(tmp_path, where):
    path = tmp_path / "no_such_folder" / "run.pt" if where == "missing folder" else tmp_path
    model = _decoder()
    before = _snapshot(model, None)
    drawn = []
    with pytest.raises(ValueError, match=r"^checkpoint .*(no folder|got the folder)"):
        train(model, lambda: drawn.append(1) or {"ids": IDS, "targets": IDS}, SHORT,
              progress=False, checkpoint=path)
    assert drawn == []
    _same(_snapshot(model, None), before)


def test_a_failed_save_removes_its_partial_file_and_keeps_the_old_one(saved_run, monkeypatch):
    path, model = saved_run
    good = path.read_bytes()

    def disk_full(obj, file, **kwargs):
        file.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(path, model, _adamw(model), step=2)
    assert not path.with_name("run.pt.partial").exists()
    assert path.read_bytes() == good


def test_a_save_reaches_the_disk_before_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append("fsync") or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append("replace") or replace(a, b))
    model = _decoder()
    save_checkpoint(tmp_path / "run.pt", model, _adamw(model), step=0)
    # the file's bytes, the rename, then (on POSIX) the folder's entry
    assert events == ["fsync", "replace"] + ["fsync"] * (os.name == "posix")
    assert load_checkpoint(tmp_path / "run.pt", model).step == 0


# A child process that saves a larger checkpoint over the good one, stalls once it has written
# part of the file (its torch.save writes through a file that waits on stdin) and says so.
_SAVE_AND_STALL = r"""
import sys
import torch
import course_lib.train as train_module
from course_lib.configs import DecoderConfig
from course_lib.models import DecoderLM

save = torch.save


class Stalling:
    def __init__(self, file):
        self.file, self.written = file, 0

    def write(self, data):
        if self.written > 100_000:
            self.file.flush()
            print("part written", flush=True)
            sys.stdin.read()  # the parent never writes: it kills this process
        self.written += len(data)
        return self.file.write(data)

    def flush(self):
        self.file.flush()


train_module.torch.save = lambda obj, file, **kwargs: save(obj, Stalling(file), **kwargs)
torch.manual_seed(1)
model = DecoderLM(DecoderConfig(vocab_size=5, d_model=128, n_heads=2, n_layers=2, max_len=16))
optimizer = torch.optim.AdamW(model.parameters())
train_module.save_checkpoint(sys.argv[1], model, optimizer, step=2)
print("saved", flush=True)
"""


@pytest.mark.skipif(os.name != "posix", reason="kills the saving process with SIGKILL")
def test_a_save_killed_half_way_leaves_the_old_checkpoint_whole(saved_run):
    path, model = saved_run
    good, partial = path.read_bytes(), path.with_name("run.pt.partial")
    child = subprocess.Popen([sys.executable, "-c", _SAVE_AND_STALL, str(path)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        said = child.stdout.readline()
        written = partial.stat().st_size if partial.exists() else 0
    finally:
        child.kill()
        _, errors = child.communicate()
    assert said == "part written\n", errors
    assert child.returncode == -signal.SIGKILL
    assert written > 100_000  # killed while the new file was half written
    assert path.read_bytes() == good
    restored = _decoder(seed=1)
    optimizer = _adamw(restored)
    assert load_checkpoint(path, restored, optimizer, generators=[torch.Generator()],
                           config=SHORT).step == 1
    _same(_snapshot(restored, None)["model"], _snapshot(model, None)["model"])
    save_checkpoint(path, restored, optimizer, step=1)  # the next save writes over the rest
    assert not partial.exists()


def test_checkpointed_blocks_keep_less_for_the_same_gradients():
    """checkpoint_blocks: the same loss and gradients, a fraction of the activations kept."""
    from course_lib.instruments.measure import saved_bytes
    from course_lib.train import checkpoint_blocks

    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=32, d_model=32, n_heads=4, n_layers=3, max_len=16)
    plain = DecoderLM(config).double()
    lean = DecoderLM(config).double()
    lean.load_state_dict(plain.state_dict())
    assert checkpoint_blocks(lean) is lean
    ids = torch.randint(0, 32, (4, 17), generator=torch.Generator().manual_seed(1))
    kept = {}
    for name, model in (("plain", plain), ("lean", lean)):
        kept[name] = saved_bytes(lambda m=model: m(ids[:, :-1], targets=ids[:, 1:]).loss.backward())
    for p, q in zip(plain.parameters(), lean.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    assert kept["lean"] - weights < (kept["plain"] - weights) / 3
    with pytest.raises(TypeError, match="model.blocks"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
