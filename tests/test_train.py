"""The training loop: it learns, its schedule and clipping do what they say, it is repeatable,
and it explains bad input."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import on_devices
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

import course_lib.train as train_module
from course_lib.configs import DecoderConfig, EncoderDecoderConfig, LMOutput
from course_lib.models import DecoderLM, EncoderDecoder, count_parameters
from course_lib.tasks import copy_task, date_task, recall_task
from course_lib.train import (
    TrainConfig,
    _planned_updates,
    estimate_loss,
    lm_batches,
    lr_schedule,
    param_groups,
    random_batches,
    train,
)


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
    assert history.stopped_by == "max_iters"


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


def test_bad_callback():
    model, batches, _, config = _copy_setup(max_iters=2)
    with pytest.raises(TypeError, match="callback must be a function"):
        train(model, batches, config, progress=False, callback="plot")


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


def test_encoder_decoder_trains_on_dates():
    task = date_task(512, seed=0)
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


def test_random_batches_keeps_rows_together():
    a = torch.arange(20)
    batch = random_batches({"x": a, "y": a * 10}, 20, generator=torch.Generator().manual_seed(0))()
    assert sorted(batch["x"].tolist()) == list(range(20))  # distinct examples
    assert torch.equal(batch["y"], batch["x"] * 10)
    with pytest.raises(ValueError, match="same number of examples N"):
        random_batches({"x": a, "y": a[:5]}, 4)
    with pytest.raises(ValueError, match="batch_size=30 is larger than the 20 examples"):
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
    assert _planned_updates(100, 0.0, 10.0, step_s=0.01, eval_s=0.5, config=config) == 575
    assert _planned_updates(100, 9.9, 10.0, step_s=0.01, eval_s=0.5, config=config) == 100
    assert _planned_updates(100, 0.0, 1e9, step_s=0.01, eval_s=0.5, config=config) == 10_000


def test_time_budget_fits_the_cosine_to_the_clock(monkeypatch):
    # A fake clock that only moves when the model runs: 0.01 s per forward pass.
    now = [0.0]
    monkeypatch.setattr(train_module, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Ticking(_Recorder):
        def forward(self, ids, *, targets):
            now[0] += 0.01
            return super().forward(ids, targets=targets)

    ids = torch.zeros(4, 2, dtype=torch.long)

    def batches():
        return {"ids": ids, "targets": ids}

    config = TrainConfig(max_iters=10_000, warmup_iters=5, eval_interval=20, eval_iters=2,
                         time_budget=1.0)
    history = train(Ticking(), batches, config, val_batches=batches, progress=False)
    # 1 s holds about 80 updates (0.8 s) and 5 evaluations of 2 x 2 batches (0.2 s)
    assert history.stopped_by == "time_budget"
    assert 70 <= len(history.steps) <= 80
    assert history.elapsed_s <= 1.0 + 1e-9
    assert history.lrs[-1] == config.min_lr  # the cosine ended with the budget
    assert max(history.lrs) == config.lr


def test_time_budget_with_a_real_clock():
    task = recall_task(256, 6, seed=0)
    model = _tiny_decoder(task.vocab_size)
    batches = random_batches({"ids": task.inputs, "targets": task.targets}, 32)
    config = TrainConfig(max_iters=1_000_000, warmup_iters=5, eval_interval=50, eval_iters=2,
                         time_budget=1.0)
    history = train(model, batches, config, progress=False)
    assert history.stopped_by == "time_budget" and len(history.steps) < 1_000_000
    assert 0.5 < history.elapsed_s < 5.0  # a busy machine can overshoot by a step or two


# --------------------------------------------------------------------------------------------
# Bad input


def test_bad_batches():
    model = _tiny_decoder(5)
    x = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"must return a dict of keyword arguments.*returned a tuple of 2 items.*lm_batches"):
        train(model, lambda: (x, x), progress=False)
    with pytest.raises(ValueError, match=r"keys \['ids'\] but no 'targets'"):
        train(model, lambda: {"ids": x}, progress=False)
    with pytest.raises(ValueError, match=r"keys \['inputs', 'targets'\], which do not match DecoderLM.forward"):
        train(model, lambda: {"inputs": x, "targets": x}, progress=False)
    with pytest.raises(ValueError, match=r"val_batches\(\) must return a dict"):
        train(model, lambda: {"ids": x, "targets": x}, val_batches=lambda: [x, x], progress=False)
    with pytest.raises(ValueError, match="train_batches must be a function"):
        train(model, {"ids": x, "targets": x}, progress=False)


def test_bad_config():
    with pytest.raises(ValueError, match=r"min_lr must be between 0 and lr=0.001, got 0.01"):
        TrainConfig(lr=1e-3, min_lr=1e-2)
    with pytest.raises(ValueError, match="max_iters must be a positive integer, got 0"):
        TrainConfig(max_iters=0)
    with pytest.raises(ValueError, match="grad_clip must be > 0 or None"):
        TrainConfig(grad_clip=0.0)
    with pytest.raises(TypeError, match="config must be a TrainConfig, got dict"):
        train(_tiny_decoder(5), lambda: {}, {"max_iters": 3}, progress=False)


def test_divergence_is_reported():
    model = _Recorder()
    ids = torch.zeros(4, 2, dtype=torch.long)
    with torch.no_grad():
        model.weight.fill_(float("nan"))
    config = TrainConfig(max_iters=3, warmup_iters=1, eval_iters=1)
    with pytest.raises(FloatingPointError, match="the loss became nan at update 1.*lower lr"):
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
    from course_lib.viz import LivePlot, draw_losses

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
