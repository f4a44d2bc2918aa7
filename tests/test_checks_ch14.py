"""The chapter 14 checks: each must reject plausible wrong answers with a message naming the
mistake, accept every correct formulation, and let an unsolved stub fail as itself.

Exercise 14.3's check runs the learner's functions on 3 real gloo ranks. Starting processes is
its cost, so the tests start them twice: once through the public check, once for every other
variant together (run_data_parallel runs a list of variants in one start)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub

from course_lib.course.checks import CheckFailure, ch14
from course_lib.course.checks.ch14 import (
    check_accumulated_step,
    check_data_parallel,
    check_flash_backward,
    check_memory_prediction,
    check_mfu,
    check_shard_mlp,
)


def test_an_unsolved_stub_fails_as_itself(monkeypatch):
    """Without starting a process: 14.3's stubs are found in this process."""
    monkeypatch.setattr(ch14, "run_data_parallel", None)  # calling it would fail
    for check in (check_mfu, check_accumulated_step, check_memory_prediction, check_shard_mlp,
                  check_flash_backward):
        with pytest.raises(NotImplementedError, match="Exercise: write the body"):
            check(stub)
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_data_parallel(stub, average_gradients)
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check_data_parallel(sync_initial_weights, stub)


# ------------------------------------------------------------------------------ 14.1 the MFU


def mfu(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus, peak_flops):
    tokens_per_second = batch_size * context / step_seconds
    return tokens_per_second * (6 * n_params + 12 * n_layers * context * d_model) / (
        n_gpus * peak_flops)


def mfu_numpy(n_params, n_layers, d_model, context, batch_size, step_seconds, n_gpus,
              peak_flops):
    """Per GPU first, attention as 4 T D forward times 3, numpy's float out."""
    per_gpu = np.float64(batch_size) * context / step_seconds / n_gpus
    forward = 2 * n_params + n_layers * 4 * context * d_model
    return per_gpu * 3 * forward / peak_flops


@pytest.mark.parametrize("fn", [mfu, mfu_numpy, ch14.reference_mfu])
def test_mfu_accepts_every_correct_formulation(fn, capsys):
    check_mfu(fn)
    out = capsys.readouterr().out
    assert "✅ mfu is correct on all 4 runs" in out and "T = 32,768: 56%" in out


def test_the_mfu_reference_is_the_formula():
    # 1e9 parameters, 10 layers, D = 1,000, T = 100: 6e9 + 1.2e7 FLOPs per token
    assert ch14.model_flops_per_token(1e9, 10, 1000, 100) == 6e9 + 12 * 10 * 100 * 1000
    # 10 sequences of 100 tokens per 2 s on 2 GPUs of 1e12: 500 tokens/s
    assert ch14.reference_mfu(1e9, 10, 1000, 100, 10, 2.0, 2, 1e12) == pytest.approx(
        500 * (6e9 + 1.2e7) / 2e12, rel=1e-12)


@pytest.mark.parametrize("index, match", [
    (0, "percentage"), (1, r"forward pass only \(2N \+ 4LTD\)"), (2, "parameters' forward"),
    (3, "leave out attention"), (4, "half of the chapter's"), (5, r"times 3 for forward"),
    (6, "counts sequences, not tokens"), (7, "per step, not per second"),
    (8, "ONE GPU's peak"),
])
def test_mfu_names_the_mistake(index, match):
    with pytest.raises(CheckFailure, match=match):
        check_mfu(ch14.MFU_MISTAKES[index][0])


def test_mfu_reports_other_slips_and_refuses_tensors():
    with pytest.raises(CheckFailure, match=r"should be 0\.33.*6N \+ 12·L·T·D"):
        check_mfu(lambda *args: mfu(*args) * 1.1)
    with pytest.raises(CheckFailure, match=r"\.item\(\)"):
        check_mfu(lambda *args: torch.tensor(mfu(*args)))


# ---------------------------------------------------------------- 14.2 the accumulation bug


def step_sum(model, optimizer, inputs, targets, k):
    optimizer.zero_grad()
    n_real = (targets != -100).sum()
    for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100,
                        reduction="sum").div(n_real).backward()
    optimizer.step()


def step_by_hand(model, optimizer, inputs, targets, k):
    """Token losses by log_softmax and a mask, micro-batches by index, a float count."""
    optimizer.zero_grad()
    real = targets != -100
    n_real = float(real.sum())
    size = len(inputs) // k
    for i in range(k):
        x, y, m = (t[i * size:(i + 1) * size] for t in (inputs, targets, real))
        log_probs = model(x).log_softmax(-1)  # (b, T, V)
        picked = log_probs.gather(-1, y.clamp(min=0)[..., None]).squeeze(-1)  # (b, T)
        (-(picked * m).sum() / n_real).backward()
    optimizer.step()


def step_scaled_mean(model, optimizer, inputs, targets, k):
    """Each micro-batch's mean, reweighted by its share of the real tokens, skipping a
    micro-batch without any (whose mean would be NaN)."""
    optimizer.zero_grad()
    n_real = (targets != -100).sum()
    for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True):
        mine = (y != -100).sum()
        if mine:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
            (loss * mine / n_real).backward()
    optimizer.step()


def step_mean_reweighted(model, optimizer, inputs, targets, k):
    """F.cross_entropy's mean times the micro-batch's share, even where the mean is NaN (a
    micro-batch of padding only): its gradient is still 0 there."""
    optimizer.zero_grad()
    n_real = (targets != -100).sum()
    for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        (loss * (y != -100).sum() / n_real).backward()
    optimizer.step()


@pytest.mark.parametrize("fn", [step_sum, step_by_hand, step_scaled_mean, step_mean_reweighted])
def test_accumulated_step_accepts_every_correct_fix(fn, capsys):
    check_accumulated_step(fn)
    assert "✅ accumulated_step takes exactly the whole batch's step on all 7" in \
        capsys.readouterr().out


def test_the_planted_bug_hides_on_unpadded_batches():
    batches = ch14.accumulation_batches()
    agree = []
    for inputs, targets in batches:
        case = ch14.Case("", (inputs, targets, 4))
        buggy, _ = ch14._weights_after(ch14.buggy_accumulated_step, case)
        whole, _ = ch14._weights_after(
            lambda m, o, x, y, k: ch14.whole_batch_step(m, o, x, y), case)
        agree.append(ch14._same(buggy, whole))
    padded = [bool((targets == -100).any()) for _, targets in batches]
    assert agree == [not p for p in padded] and 0 < sum(agree) < len(batches)


@pytest.mark.parametrize("index, match", [
    (0, r"(?s)planted bug is still there.*padded batches"),
    (1, "without dividing"),
    (2, r"reduction='sum'\) but never divides"),
    (3, "padding included"),
    (4, "planted bug is still there"),
    (5, "zeroes the gradients inside the loop"),
    (6, r"optimizer\.step\(\) inside the loop"),
])
def test_accumulated_step_names_the_mistake(index, match):
    with pytest.raises(CheckFailure, match=match):
        check_accumulated_step(ch14.ACCUMULATION_MISTAKES[index][0])


def test_accumulated_step_catches_nan_whole_batches_and_missing_steps():
    def mean_by_hand_reweighted(model, optimizer, inputs, targets, k):
        """Each micro-batch's mean by hand, times its share: 0 / 0 on a padding-only one."""
        optimizer.zero_grad()
        n_real = (targets != -100).sum()
        for x, y in zip(inputs.chunk(k), targets.chunk(k), strict=True):
            real = y != -100
            picked = model(x).log_softmax(-1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
            mean = -(picked * real).sum() / real.sum()
            (mean * real.sum() / n_real).backward()
        optimizer.step()

    with pytest.raises(CheckFailure, match=r"NaN on the case 'k=4 with a micro-batch of "
                                           r"padding only.*0 / 0"):
        check_accumulated_step(mean_by_hand_reweighted)
    with pytest.raises(CheckFailure, match="ran the model on 8 sequences at once"):
        check_accumulated_step(lambda m, o, x, y, k: ch14.whole_batch_step(m, o, x, y))
    with pytest.raises(CheckFailure, match="did not change"):
        check_accumulated_step(lambda m, o, x, y, k: None)

    def lr_too_big(model, optimizer, inputs, targets, k):
        step_sum(model, optimizer, inputs, targets, k)
        step_sum(model, optimizer, inputs, targets, k)

    with pytest.raises(CheckFailure) as failure:
        check_accumulated_step(lr_too_big)
    assert "differ from one step on the whole batch" in str(failure.value)
    assert "planted" not in str(failure.value)


def test_accumulated_step_catches_changed_targets():
    def masking_in_place(model, optimizer, inputs, targets, k):
        targets[targets == -100] = 0  # the caller's targets lose their padding marks
        step_sum(model, optimizer, inputs, targets, k)

    with pytest.raises(CheckFailure, match="changed its input 'targets' in place"):
        check_accumulated_step(masking_in_place)


def test_accumulated_step_leaves_the_global_random_state_alone():
    before = torch.random.get_rng_state()
    check_accumulated_step(step_sum)
    assert torch.equal(before, torch.random.get_rng_state())


# ------------------------------------------------------------ 14.3 data parallelism by hand


def sync_initial_weights(model):
    import torch.distributed as dist

    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)


def average_gradients(model):
    import torch.distributed as dist

    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


SYNC = "def sync_initial_weights(model):\n"
AVERAGE = "def average_gradients(model):\n"
RIGHT_SYNC = SYNC + ("    for p in model.parameters():\n"
                     "        dist.broadcast(p.data, src=0)\n")
RIGHT_AVERAGE = AVERAGE + ("    for p in model.parameters():\n"
                           "        dist.all_reduce(p.grad)\n"
                           "        p.grad /= dist.get_world_size()\n")
LOOP = "    for p in model.parameters():\n"

VARIANTS = {  # name: (sync source, average source, None if right else the message's words)
    "right": (RIGHT_SYNC, RIGHT_AVERAGE, None),
    "one flat tensor": (
        SYNC + "    vector = nn.utils.parameters_to_vector(model.parameters())\n"
               "    dist.broadcast(vector, src=0)\n"
               "    nn.utils.vector_to_parameters(vector, model.parameters())\n",
        AVERAGE + "    grads = [p.grad for p in model.parameters()]\n"
                  "    flat = torch.cat([g.flatten() for g in grads])\n"
                  "    dist.all_reduce(flat)\n"
                  "    flat /= dist.get_world_size()\n"
                  "    torch.nn.utils.vector_to_parameters(flat, grads)\n", None),
    "decorated": ("@torch.no_grad()\n" + SYNC + LOOP + "        dist.broadcast(p, src=0)\n",
                  RIGHT_AVERAGE, None),
    "divide first, tied weight twice": (
        RIGHT_SYNC,
        AVERAGE + "    for module in model.modules():\n"
                  "        for p in module.parameters(recurse=False):\n"
                  "            p.grad /= dist.get_world_size()\n"
                  "            dist.all_reduce(p.grad)\n", None),
    "no sync": (SYNC + "    pass\n", RIGHT_AVERAGE, "left rank 1's weights as they were"),
    "sync into a copy": (SYNC + LOOP + "        dist.broadcast(p.detach().clone(), src=0)\n",
                         RIGHT_AVERAGE, "not a copy"),
    "sync by averaging": (
        SYNC + "    with torch.no_grad():\n"
               "        for p in model.parameters():\n"
               "            dist.all_reduce(p)\n"
               "            p /= dist.get_world_size()\n", RIGHT_AVERAGE, "AVERAGE of their"),
    "sync from rank 2": (SYNC + LOOP + "        dist.broadcast(p.data, src=2)\n",
                         RIGHT_AVERAGE, "rank 2's starting weights"),
    "sum": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.grad)\n",
            "SUM over the 3 ranks"),
    "divided twice": (RIGHT_SYNC, AVERAGE + LOOP + "        p.grad /= dist.get_world_size()\n"
                      "        dist.all_reduce(p.grad)\n        p.grad /= dist.get_world_size()\n",
                      "divided by 3 once more"),
    "divided by 2": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.grad)\n"
                     "        p.grad /= 2\n", "not a fixed number"),
    "parameters reduced": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.data)\n"
                           "        p.data /= dist.get_world_size()\n",
                           "still holds the gradient of its own shard"),
    "parameters summed": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.data)\n",
                          "changed the parameters themselves"),
    "a copy reduced": (RIGHT_SYNC, AVERAGE + LOOP + "        g = p.grad.clone()\n"
                       "        dist.all_reduce(g)\n        p.grad /= dist.get_world_size()\n",
                       "all_reduce that adds them up is missing"),
    "reduce": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.reduce(p.grad, dst=0)\n"
               "        p.grad /= dist.get_world_size()\n", "dist.reduce sends the sum"),
    "linear layers only": (
        RIGHT_SYNC,
        AVERAGE + "    for m in model.modules():\n        if isinstance(m, nn.Linear):\n"
                  "            for p in m.parameters():\n"
                  "                dist.all_reduce(p.grad)\n"
                  "                p.grad /= dist.get_world_size()\n",
        r"gradients of embeddings\.position\.embedding\.weight, .* were not averaged"),
    "the embeddings skipped": (
        RIGHT_SYNC,
        AVERAGE + "    for name, p in model.named_parameters():\n"
                  "        if 'embeddings' not in name:\n"
                  "            dist.all_reduce(p.grad)\n"
                  "            p.grad /= dist.get_world_size()\n",
        r"(?s)not averaged.*embeddings\.token\.weight is the token embedding and also the "
        r"output layer's weight \(tied\)"),
    "gradients dropped": (RIGHT_SYNC, AVERAGE + LOOP + "        p.grad = None\n",
                          r"has no gradient for .* and \d+ more"),
    "a notebook global": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.grad)\n"
                          "        p.grad /= WORLD_SIZE\n",
                          r"(?s)uses a name the ranks do not have.*p\.grad /= WORLD_SIZE"),
    "an error": (RIGHT_SYNC, AVERAGE + LOOP + "        dist.all_reduce(p.grad, op='mean')\n",
                 r"average_gradients raised \w+ on the ranks"),
    "unsolved": (RIGHT_SYNC, AVERAGE + "    raise NotImplementedError('Exercise 14.3: write "
                 "the body of average_gradients')\n", "Exercise 14.3: write the body"),
    "different every call": (
        RIGHT_SYNC,
        AVERAGE + "    calls = getattr(average_gradients, 'calls', 0)\n"
                  "    average_gradients.calls = calls + 1\n" + LOOP +
                  "        dist.all_reduce(p.grad)\n"
                  "        p.grad /= dist.get_world_size() + calls\n",
        "The first step was right, but after 2 steps"),
}


@pytest.fixture(scope="module")
def data_parallel_runs():
    """Every variant's records from one start of the ranks, and the one-process reference.
    The last variant is this module's two functions, sent as the check sends them."""
    variants = [("sync_initial_weights", sync, "average_gradients", average)
                for sync, average, _ in VARIANTS.values()]
    variants.append(SENT)
    records = ch14.run_data_parallel(variants)
    return dict(zip([*VARIANTS, "sent"], records, strict=True)), ch14.data_parallel_reference()


SENT = ("sync_initial_weights", ch14._source_of(sync_initial_weights, "sync_initial_weights"),
        "average_gradients", ch14._source_of(average_gradients, "average_gradients"))


def test_data_parallel_passes_on_real_ranks(data_parallel_runs, monkeypatch, capsys):
    """The public check sends the functions' source to the ranks (run once, in the fixture)."""
    records, _ = data_parallel_runs
    sent = []

    def run_once(variants, timeout_s=ch14.DP_TIMEOUT_S):
        sent.extend(variants)
        return [records["sent"]]

    monkeypatch.setattr(ch14, "run_data_parallel", run_once)
    check_data_parallel(sync_initial_weights, average_gradients)
    assert sent == [SENT] and SENT[3].startswith("def average_gradients(model):")
    out = capsys.readouterr().out
    assert "✅ On 3 gloo ranks" in out and "equal one process" in out


def test_data_parallel_explains_ranks_that_wait_for_each_other(monkeypatch):
    def waiting(*args, **kwargs):
        raise TimeoutError("the ranks did not finish")

    monkeypatch.setattr("course_lib.course.ranks.run_ranks", waiting)
    with pytest.raises(CheckFailure, match=r"still waiting for each other after 60 s.*same "
                                           r"collectives, in the same order"):
        check_data_parallel(sync_initial_weights, average_gradients)


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v[2] is None])
def test_data_parallel_accepts_every_correct_formulation(name, data_parallel_runs):
    records, reference = data_parallel_runs
    ch14.judge_data_parallel(records[name], reference)


@pytest.mark.parametrize("name", [n for n, v in VARIANTS.items() if v[2] is not None])
def test_data_parallel_names_the_mistake(name, data_parallel_runs):
    records, reference = data_parallel_runs
    expected = NotImplementedError if name == "unsolved" else CheckFailure
    with pytest.raises(expected, match=VARIANTS[name][2]):
        ch14.judge_data_parallel(records[name], reference)


def test_the_reference_is_one_process_on_rank_0s_start():
    reference = ch14.data_parallel_reference()
    model = ch14._dp_model(seed=0)
    assert not ch14._differing(ch14._params(model), reference["start"])
    assert ch14._differing(ch14._params(ch14._dp_model(seed=1)), reference["start"])
    assert ch14._differing(reference["final"], reference["start"])  # it trained
    assert ch14.TIED in reference["grads"] and model.lm_head.weight is \
        model.embeddings.token.weight


@torch.no_grad()
def sync_decorated(model):
    import torch.distributed as dist

    for param in model.parameters():
        dist.broadcast(param, src=0)


def test_a_decorated_function_is_sent_with_its_decorator():
    assert ch14._source_of(sync_decorated, "sync_initial_weights").startswith(
        "@torch.no_grad()\ndef sync_decorated(model):")


def test_data_parallel_refuses_functions_it_cannot_send(monkeypatch):
    monkeypatch.setattr(ch14, "run_data_parallel", None)
    with pytest.raises(CheckFailure, match="could not read sync_initial_weights's source"):
        check_data_parallel(lambda model: None, average_gradients)
    with pytest.raises(CheckFailure, match="average_gradients should be a function"):
        check_data_parallel(sync_initial_weights, "average_gradients")


# ------------------------------------------------------------------- 14.4 ZeRO's memory


P, N = 7e9, 8
TRUTH = {"ddp": 16 * P, "zero1": 4 * P + 12 * P / N, "zero2": 2 * P + 14 * P / N,
         "zero3": 16 * P / N}


@pytest.mark.parametrize("answer", [
    TRUTH,
    {"ddp": 112e9, "zero1": 38e9, "zero2": 26e9, "zero3": 14e9},  # rounded, within 2%
    {"ddp": int(112e9), "zero1": np.int64(385 * 10**8), "zero2": np.float64(26.25e9),
     "zero3": 14 * 10**9, "notes": "bytes"},
])
def test_memory_prediction_accepts_the_truth_and_shows_the_measurement(answer, capsys):
    check_memory_prediction(lambda: answer)
    out = capsys.readouterr().out
    assert "✅ All four predictions are within 2%" in out
    assert "= 16.00" in out and "70B on 8 GPUs" in out and "at least 14 GPUs" in out


def test_the_measured_bytes_are_16_per_parameter():
    measured = ch14.measured_bytes_per_parameter()
    parts = list(measured.values())[1:5]
    assert parts == [2.0, 2.0, 4.0, 8.0]


def _with(**change):
    return lambda: {**TRUTH, **change}


@pytest.mark.parametrize("answer, match", [
    (lambda: ch14.zero_bytes_per_gpu(P, N, states=8), "fp32 master copy"),
    (lambda: ch14.zero_bytes_per_gpu(P, N, weights=4, grads=4, states=8), "fp32 training"),
    (lambda: {key: 16 * P / N for key in TRUTH}, "divided everything by the 8 GPUs"),
    (_with(ddp=4 * P + 12 * P / N), "DDP figure shards the optimizer state"),
    (_with(zero1=2 * P + 14 * P / N), "ZeRO-1 shards more than the optimizer state"),
    (_with(zero1=16 * P), "ZeRO-1 shards nothing"),
    (_with(zero1=14 * P + 2 * P / N), "ZeRO-1 shards the gradients"),
    (_with(zero2=4 * P + 12 * P / N), "ZeRO-2 is ZeRO-1's figure"),
    (_with(zero2=16 * P / N), "that is stage 3"),
    (_with(zero2=14 * P + 2 * P / N), "cumulative"),
    (_with(zero3=2 * P + 14 * P / N), "ZeRO-3 is ZeRO-2's figure"),
    (_with(zero3=14 * P + 2 * P / N), "ZeRO-3 shards only the weights"),
    (_with(zero1=38.5), "in GB"),
    (_with(zero2=26.25e9 / 2**30), "in GiB"),
    (_with(zero3=20e9), r"'zero3' is 2e\+10 bytes"),
    (lambda: {"ddp": 1, "zero1": 2}, "lacks the key"),
    (_with(ddp=torch.tensor(112e9)), r"\.item\(\)"),
])
def test_memory_prediction_names_the_mistake(answer, match):
    with pytest.raises(CheckFailure, match=match):
        check_memory_prediction(answer)


def test_a_failed_memory_prediction_does_not_give_the_numbers_away():
    with pytest.raises(CheckFailure) as failure:
        check_memory_prediction(_with(zero2=20e9))
    assert "26.25" not in str(failure.value) and "2.625e" not in str(failure.value)


# -------------------------------------------------------------------- 14.5 the MLP split


def shard_blocks(fc1, fc2, rank, world_size):
    share = fc1.out_features // world_size
    units = slice(rank * share, (rank + 1) * share)
    b2 = fc2.bias if rank == 0 else torch.zeros_like(fc2.bias)
    return fc1.weight[units], fc1.bias[units], fc2.weight[:, units], b2


def shard_chunks(fc1, fc2, rank, world_size):
    """chunk, the bias shared out evenly, a list, detached copies."""
    return [fc1.weight.detach().chunk(world_size)[rank].clone(),
            fc1.bias.detach().chunk(world_size)[rank].clone(),
            fc2.weight.detach().chunk(world_size, dim=1)[rank].clone(),
            fc2.bias.detach() / world_size]


def shard_strided(fc1, fc2, rank, world_size):
    """Units r, r + N, ...: a different split, as correct; the bias on the last rank."""
    units = torch.arange(rank, fc1.out_features, world_size)
    b2 = fc2.bias if rank == world_size - 1 else torch.zeros_like(fc2.bias)
    return fc1.weight[units], fc1.bias[units], fc2.weight[:, units], b2


@pytest.mark.parametrize("fn, strided", [(shard_blocks, False), (shard_chunks, False),
                                         (shard_strided, True)])
def test_shard_mlp_accepts_every_correct_split(fn, strided, capsys):
    check_shard_mlp(fn)
    out = capsys.readouterr().out
    assert "✅ shard_mlp is correct on all 5 cases" in out
    assert ("not in contiguous blocks" in out) == strided


def _blocks(w1_dim=0, w2_dim=1, b2=lambda bias, rank, n: bias / n, block=lambda r, n: r,
            b1_block=None):
    def fn(fc1, fc2, rank, n):
        mine, bias_block = block(rank, n), (b1_block or block)(rank, n)
        return (fc1.weight.chunk(n, w1_dim)[mine], fc1.bias.chunk(n)[bias_block],
                fc2.weight.chunk(n, w2_dim)[mine], b2(fc2.bias, rank, n))
    return fn


@pytest.mark.parametrize("fn, match", [
    (_blocks(w1_dim=1), r"w1 has shape \(F, D/N\): you split fc1\.weight's COLUMNS"),
    (_blocks(w2_dim=0), r"w2 has shape \(D/N, F\): you split fc2\.weight's ROWS"),
    (lambda fc1, fc2, r, n: (fc1.weight.chunk(n)[r].T, fc1.bias.chunk(n)[r],
                             fc2.weight.chunk(n, 1)[r], fc2.bias / n), r"\(a transpose\?\)"),
    (lambda fc1, fc2, r, n: (fc1.weight.chunk(n)[r], fc1.bias, fc2.weight.chunk(n, 1)[r],
                             fc2.bias / n), "only the biases of its own"),
    (_blocks(b2=lambda bias, rank, n: bias), "every rank adds fc2's whole bias"),
    (_blocks(b2=lambda bias, rank, n: 0 * bias), "do not add up to fc2.bias"),
    (_blocks(block=lambda r, n: 0), r"units 0-15 more than once and 16-31 on no rank"),
    (_blocks(b1_block=lambda r, n: n - 1 - r), "b1 is not the bias of its hidden units"),
    (lambda fc1, fc2, r, n: (fc1.weight.chunk(n)[r], fc1.bias.chunk(n)[r], fc2.weight[:, r::n],
                             fc2.bias / n), "in the same order"),
    (lambda fc1, fc2, r, n: (2 * fc1.weight.chunk(n)[r], fc1.bias.chunk(n)[r],
                             fc2.weight.chunk(n, 1)[r], fc2.bias / n),
     "not rows of fc1.weight"),
    (lambda fc1, fc2, r, n: (fc1.weight.chunk(n)[r], fc1.bias.chunk(n)[r],
                             fc2.weight.chunk(n, 1)[r]), "should return four tensors"),
    (lambda fc1, fc2, r, n: (fc1.weight.data.mul_(1.5), fc1.bias, fc2.weight, fc2.bias),
     "changed fc1 or fc2 in place"),
])
def test_shard_mlp_names_the_mistake(fn, match):
    with pytest.raises(CheckFailure, match=match):
        check_shard_mlp(fn)


# ------------------------------------------------------------- 14.6 the flash backward


def flash_backward(q, k, v, out, d_out, lse, scale):
    weights = torch.exp(q @ k.T * scale - lse[:, None])
    d_weights = d_out @ v.T
    d_scores = weights * (d_weights - (d_out * out).sum(-1, keepdim=True))
    return d_scores @ k * scale, d_scores.T @ q * scale, weights.T @ d_out


def flash_backward_einsum(q, k, v, out, d_out, lse, scale):
    """einsum, and D as the weighted row sum of dP (equal to rowsum(dO ∘ O))."""
    weights = torch.einsum("td,sd->ts", q, k).mul(scale).sub(lse.unsqueeze(-1)).exp()
    d_weights = torch.einsum("te,se->ts", d_out, v)
    d_scores = weights * (d_weights - (weights * d_weights).sum(-1, keepdim=True))
    return (scale * torch.einsum("ts,sd->td", d_scores, k),
            scale * torch.einsum("ts,td->sd", d_scores, q), torch.einsum("ts,te->se", weights,
                                                                         d_out))


def flash_backward_softmax(q, k, v, out, d_out, lse, scale):
    """P by softmax (stable without lse), a list out."""
    weights = torch.softmax(q @ k.T * scale, dim=-1)
    d_scores = weights * (d_out @ v.T - (d_out * out).sum(-1, keepdim=True))
    return [scale * d_scores @ k, scale * d_scores.T @ q, weights.T @ d_out]


@pytest.mark.parametrize("fn", [flash_backward, flash_backward_einsum, flash_backward_softmax])
def test_flash_backward_accepts_every_correct_formulation(fn, capsys):
    check_flash_backward(fn)
    out = capsys.readouterr().out
    assert "✅ flash_backward equals autograd" in out and "256 MiB per head" in out


def test_the_flash_reference_is_sdpa_and_the_library():
    from course_lib.flash import flash_attention
    for case in ch14._flash_cases():
        q, k, v, out, d_out, lse, scale = case.args
        expected = ch14.attention_gradients(q, k, v, d_out, scale)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*leaves, scale=scale).backward(d_out)
        torch.testing.assert_close([t.grad for t in leaves], list(expected))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        flash_attention(*leaves, block_size=2, scale=scale).backward(d_out)
        torch.testing.assert_close([t.grad for t in leaves], list(expected))


def _variant(**options):
    return lambda *args: ch14._flash_variant(*args, **options)


@pytest.mark.parametrize("fn, match", [
    (_variant(delta="none"), "leaves out the softmax's correction"),
    (_variant(delta="dp"), r"subtracts rowsum\(dP\), an unweighted sum"),
    (_variant(sign=-1.0), "wrong sign"),
    (_variant(grad_scale=False), "dq and dk leave out the scale"),
    (_variant(p_scale=False), "without the scale"),
    (_variant(dv_transposed=True), r"dv is P dO; it must be Pᵀ dO"),
    (lambda q, k, v, out, d_out, lse, scale: flash_backward(q, k, v, out, d_out, lse, scale)
     [::-1], r"Your dq is what dv should be .* in that order"),
    (lambda *args: flash_backward(*args)[:2], r"should return \(dq, dk, dv\)"),
])
def test_flash_backward_names_the_mistake(fn, match):
    with pytest.raises(CheckFailure, match=match):
        check_flash_backward(fn)


def test_flash_backward_explains_an_overflow():
    def exp_then_divide(q, k, v, out, d_out, lse, scale):
        weights = torch.exp(q @ k.T * scale) / torch.exp(lse)[:, None]
        d_scores = weights * (d_out @ v.T - (d_out * out).sum(-1, keepdim=True))
        return d_scores @ k * scale, d_scores.T @ q * scale, weights.T @ d_out

    with pytest.raises(CheckFailure, match=r"NaN or inf \(case 'T=4, S=6, large scores.*"
                                           r"subtract before exponentiating"):
        check_flash_backward(exp_then_divide)
