"""What a learner gets wrong when training (TrainConfig, train, the batch functions) and when
loading a pretrained BERT (folders, config.json, checkpoints, tokenizing, pooling), and the
message each mistake must produce: the exception type, the argument's name, what was received
and what was expected."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import course_lib.train as train_module  # noqa: E402
from course_lib.configs import DecoderConfig, EncoderDecoderConfig  # noqa: E402
from course_lib.models import DecoderLM, Encoder, EncoderDecoder  # noqa: E402
from course_lib.pretrained import (  # noqa: E402
    bert_weight_map,
    config_from_bert,
    default_model_dir,
    load_bert_weights,
    load_pretrained_encoder,
    load_tokenizer,
    mean_pool,
)
from course_lib.train import (  # noqa: E402
    TrainConfig,
    estimate_loss,
    lm_batches,
    lr_schedule,
    param_groups,
    random_batches,
    train,
)


def _gpt() -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(DecoderConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1, max_len=6))


IDS = torch.zeros(2, 4, dtype=torch.long)
CONFIG = TrainConfig(max_iters=2, warmup_iters=1, eval_interval=1, eval_iters=1)


def _batches():
    return {"ids": IDS, "targets": IDS}


# --------------------------------------------------------------------------------------------
# TrainConfig: wrong types and out-of-range values


@pytest.mark.parametrize(("changes", "error", "message"), [
    (dict(lr="3e-4"), TypeError, r"lr must be a number > 0, got '3e-4' \(str\)"),
    (dict(lr=True), TypeError, r"lr must be a number > 0, got True \(bool\)"),
    (dict(lr=0.0), ValueError, r"lr must be a number > 0, got 0.0"),
    (dict(lr=float("inf")), ValueError, r"lr must be a number > 0, got inf"),
    (dict(min_lr="0"), TypeError, r"min_lr must be a number >= 0, got '0' \(str\)"),
    (dict(lr=1e-3, min_lr=1e-2), ValueError, r"min_lr must be between 0 and lr=0.001, got 0.01"),
    (dict(betas=0.9), TypeError, r"betas must be a pair of numbers .* got 0.9 \(float\)"),
    (dict(betas="ab"), TypeError, r"betas must be a pair of numbers .* got 'ab' \(str\)"),
    (dict(betas=(0.9,)), ValueError, r"betas must be two numbers .* got 1 value\(s\): \(0.9,\)"),
    (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be in \[0, 1\), got 1.0"),
    (dict(betas=(-0.1, 0.9)), ValueError, r"betas\[0\] must be in \[0, 1\), got -0.1"),
    (dict(betas=(0.9, "x")), TypeError, r"betas\[1\] must be a number in \[0, 1\), got 'x'"),
    (dict(max_iters=-1), ValueError, r"max_iters must be a positive integer, got -1"),
    (dict(max_iters=2.5), TypeError, r"max_iters must be a positive integer, got 2.5 \(float\)"),
    (dict(max_iters="100"), TypeError, r"max_iters must be a positive integer, got '100'"),
    (dict(warmup_iters=-1), ValueError, r"warmup_iters must be an integer >= 0, got -1"),
    (dict(warmup_iters=1.5), TypeError, r"warmup_iters must be an integer >= 0, got 1.5"),
    (dict(lr_decay_iters=0), ValueError, r"lr_decay_iters must be a positive integer, got 0"),
    (dict(eval_interval=0), ValueError, r"eval_interval must be a positive integer, got 0"),
    (dict(eval_interval=-5), ValueError, r"eval_interval must be a positive integer, got -5"),
    (dict(eval_iters=2.0), TypeError, r"eval_iters must be a positive integer, got 2.0.*write 2"),
    (dict(weight_decay="0.1"), TypeError, r"weight_decay must be a number >= 0, got '0.1' \(str\)"),
    (dict(weight_decay=None), TypeError, r"weight_decay must be a number >= 0, got None"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay must be a number >= 0, got -0.1"),
    (dict(grad_clip="1"), TypeError, r"grad_clip must be a number > 0 or None, got '1' \(str\)"),
    (dict(grad_clip=0.0), ValueError, r"grad_clip must be > 0 or None, got 0.0"),
    (dict(grad_clip=float("nan")), ValueError, r"grad_clip must be > 0 or None, got nan"),
    (dict(seed=1.5), TypeError, r"seed must be an integer, got 1.5 \(float\)"),
    (dict(seed="0"), TypeError, r"seed must be an integer, got '0' \(str\)"),
    (dict(time_budget=0), ValueError, r"time_budget must be > 0 seconds or None, got 0"),
    (dict(time_budget=-5.0), ValueError, r"time_budget must be > 0 seconds or None, got -5.0"),
    (dict(time_budget="10"), TypeError, r"time_budget must be a number > 0 seconds or None, got '10'"),
])
def test_train_config_rejects(changes, error, message):
    with pytest.raises(error, match=message):
        TrainConfig(**changes)


def test_train_config_accepts_the_valid_forms():
    config = TrainConfig(lr=1, min_lr=0, betas=[0.9, 0.95], grad_clip=None, seed=None,
                         time_budget=None, warmup_iters=0, weight_decay=0)
    assert config.betas == (0.9, 0.95) and isinstance(config.betas, tuple)
    assert TrainConfig(seed=np.int64(3), time_budget=2).seed == 3


def test_schedule_and_param_groups_reject_bad_arguments():
    with pytest.raises(TypeError, match=r"lr must be a number > 0, got '1e-3' \(str\)"):
        lr_schedule(0, lr="1e-3", min_lr=0.0, warmup_iters=1, decay_iters=10)
    with pytest.raises(ValueError, match=r"step must be an integer >= 0, got -1"):
        lr_schedule(-1, lr=1e-3, min_lr=0.0, warmup_iters=1, decay_iters=10)
    with pytest.raises(ValueError, match=r"decay_iters must be a positive integer, got 0"):
        lr_schedule(0, lr=1e-3, min_lr=0.0, warmup_iters=1, decay_iters=0)
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module.*got list"):
        param_groups([nn.Parameter(torch.zeros(2))], 0.1)
    with pytest.raises(TypeError, match=r"weight_decay must be a number >= 0, got '0.1'"):
        param_groups(_gpt(), "0.1")


# --------------------------------------------------------------------------------------------
# train(): the model, the config and the other arguments


class _NoParameters(nn.Module):
    def forward(self, ids, targets):
        return SimpleNamespace(loss=ids.float().mean())


@pytest.mark.parametrize(("model", "error", "message"), [
    ("gpt", TypeError, r"model must be a torch.nn.Module .*got str"),
    (lambda ids, targets: None, TypeError, r"model must be a torch.nn.Module .*got function"),
    (DecoderConfig(vocab_size=5), TypeError, r"model must be a torch.nn.Module .*got DecoderConfig"),
    (_NoParameters(), ValueError, r"model \(_NoParameters\) has no parameters to train"),
    (_gpt().requires_grad_(False), ValueError,
     r"model \(DecoderLM\) has no trainable parameters: every one has requires_grad=False"),
])
def test_train_rejects_what_is_not_a_trainable_model(model, error, message):
    with pytest.raises(error, match=message):
        train(model, _batches, CONFIG, progress=False)


def test_train_rejects_bad_config_and_options():
    model = _gpt()
    with pytest.raises(TypeError, match=r"config must be a TrainConfig, got dict.*TrainConfig\("):
        train(model, _batches, {"max_iters": 3}, progress=False)
    with pytest.raises(TypeError, match=r"progress must be True or False, got 'no' \(str\)"):
        train(model, _batches, CONFIG, progress="no")
    with pytest.raises(TypeError, match=r"desc must be a string .*got 3"):
        train(model, _batches, CONFIG, progress=False, desc=3)


def test_estimate_loss_rejects_bad_arguments():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module.*got str"):
        estimate_loss("model", _batches, 2)
    with pytest.raises(TypeError, match=r"batches must be a function that returns a batch.*dict"):
        estimate_loss(_gpt(), _batches(), 2)
    with pytest.raises(ValueError, match=r"iters must be a positive integer, got 0"):
        estimate_loss(_gpt(), _batches, 0)


# --------------------------------------------------------------------------------------------
# train(): batches of the wrong form


@pytest.mark.parametrize(("batches", "error", "message"), [
    ({"ids": IDS, "targets": IDS}, TypeError,
     r"train_batches must be a function that returns a batch \(a dict\), got dict"),
    (lambda n: _batches(), TypeError,
     r"train_batches must be a function taking no arguments.*takes \(n\)"),
    (lambda: (IDS, IDS), TypeError,
     r"train_batches\(\) must return a dict.*returned a tuple of 2 items.*lm_batches"),
    (lambda: {"ids": IDS}, ValueError, r"train_batches\(\) returned a dict with keys \['ids'\] but no 'targets'"),
    (lambda: {"inputs": IDS, "targets": IDS}, ValueError,
     r"train_batches\(\) returned keys \['inputs', 'targets'\], which do not match DecoderLM.forward"),
    (lambda: {"ids": IDS.float(), "targets": IDS}, ValueError,
     r"train_batches\(\)\['ids'\] must hold token ids \(an integer tensor\), got dtype torch.float32"),
    (lambda: {"ids": IDS, "targets": IDS.float()}, ValueError,
     r"train_batches\(\)\['targets'\] must hold class indices .*got dtype torch.float32"),
    (lambda: {"ids": IDS.bool(), "targets": IDS}, ValueError,
     r"train_batches\(\)\['ids'\] must hold token ids .*got dtype torch.bool"),
    (lambda: {"ids": IDS.numpy(), "targets": IDS}, TypeError,
     r"train_batches\(\) returned 'ids' as a ndarray, but DecoderLM needs a torch.Tensor"),
    (lambda: {"ids": IDS.tolist(), "targets": IDS}, TypeError,
     r"train_batches\(\) returned 'ids' as a list, but DecoderLM needs a torch.Tensor"),
])
def test_train_rejects_bad_batches(batches, error, message):
    with pytest.raises(error, match=message):
        train(_gpt(), batches, CONFIG, progress=False)


def test_train_rejects_bad_validation_batches():
    with pytest.raises(TypeError, match=r"val_batches must be a function .*got list"):
        train(_gpt(), _batches, CONFIG, val_batches=[_batches()], progress=False)
    with pytest.raises(ValueError, match=r"val_batches\(\)\['ids'\] must hold token ids"):
        train(_gpt(), _batches, CONFIG, val_batches=lambda: {"ids": IDS.half(), "targets": IDS},
              progress=False)


def test_encoder_decoder_batches_are_checked_too():
    torch.manual_seed(0)
    model = EncoderDecoder(EncoderDecoderConfig.shared(
        7, 7, d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, max_src_len=5,
        max_tgt_len=4))
    src = torch.ones(2, 5, dtype=torch.long)
    tgt = torch.ones(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"train_batches\(\)\['src'\] must hold token ids .*float32"):
        train(model, lambda: {"src": src.float(), "tgt": tgt, "targets": tgt}, CONFIG,
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
    history = train(Regression(), lambda: {"x": x, "targets": x.sum(-1)}, CONFIG, progress=False)
    assert len(history.steps) == 2


def test_batches_are_checked_once_not_every_step(monkeypatch):
    """The checks run before the loop (the first batch of each function), never in it."""
    calls = []
    original = train_module._check_batch
    monkeypatch.setattr(train_module, "_check_batch",
                        lambda *args: calls.append(args[1]) or original(*args))
    config = TrainConfig(max_iters=6, warmup_iters=1, eval_interval=3, eval_iters=2)
    history = train(_gpt(), _batches, config, val_batches=_batches, progress=False)
    assert len(history.steps) == 6
    assert calls == ["train_batches()", "val_batches()"]


# --------------------------------------------------------------------------------------------
# train(): a model that returns no loss


class _Returns(nn.Module):
    def __init__(self, make_output):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.make_output = make_output

    def forward(self, ids, targets):
        return self.make_output(self.weight * ids.float())


@pytest.mark.parametrize(("make_output", "error", "message"), [
    (lambda x: x, TypeError, r"\.loss is a scalar \(0-D\) tensor, but _Returns returned a Tensor that has no \.loss"),
    (lambda x: SimpleNamespace(logits=x, loss=None), TypeError,
     r"_Returns returned a SimpleNamespace that has \.loss = None"),
    (lambda x: SimpleNamespace(loss=float(x.mean())), TypeError, r"has \.loss = 0.0"),
    (lambda x: SimpleNamespace(loss=x), ValueError,
     r"\.loss is a scalar \(0-D\) tensor, but _Returns's \.loss has shape \(2, 4\); average it"),
])
def test_train_rejects_a_model_without_a_scalar_loss(make_output, error, message):
    with pytest.raises(error, match=message):
        train(_Returns(make_output), _batches, CONFIG, progress=False)


# --------------------------------------------------------------------------------------------
# Batch functions


def test_batch_functions_reject_bad_arguments():
    stream = torch.arange(50)
    with pytest.raises(ValueError, match=r"data must hold token ids \(an integer tensor\), got dtype torch.float32"):
        lm_batches(stream.float(), 4, 8)
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 0"):
        lm_batches(stream, 0, 8)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None, got 0 \(int\).*manual_seed"):
        lm_batches(stream, 4, 8, generator=0)
    with pytest.raises(TypeError, match=r"tensors must be a dict of name -> \(N, ...\) tensor.*got list"):
        random_batches([stream], 4)
    with pytest.raises(ValueError, match=r"tensors is an empty dict"):
        random_batches({}, 4)
    with pytest.raises(TypeError, match=r"tensors\['x'\] must be a torch.Tensor of shape \(N, ...\), got list"):
        random_batches({"x": [1, 2, 3]}, 2)
    with pytest.raises(ValueError, match=r"tensors\['x'\] should have shape \(N, ...\).*0-D"):
        random_batches({"x": torch.tensor(3)}, 1)
    with pytest.raises(TypeError, match=r"generator must be a torch.Generator or None, got 'seed'"):
        random_batches({"x": stream}, 4, generator="seed")


# --------------------------------------------------------------------------------------------
# Pretrained: folders and config.json


@pytest.fixture(scope="module")
def folder():
    return default_model_dir()


def _model_folder(tmp_path, source, config=None, skip=()):
    """A model folder whose big files link to ``source``'s, with ``config`` as config.json."""
    tmp_path.mkdir(exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json"):
        if name not in skip:
            (tmp_path / name).symlink_to(source / name)
    if "config.json" not in skip:
        text = (source / "config.json").read_text() if config is None else json.dumps(config)
        (tmp_path / "config.json").write_text(text)
    return tmp_path


def test_folder_missing_files(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match=r"path='.*nowhere': model folder .*nowhere does not exist"):
        load_pretrained_encoder(tmp_path / "nowhere")
    partial = _model_folder(tmp_path / "partial", folder, skip=("tokenizer.json",))
    with pytest.raises(FileNotFoundError, match=r"partial is missing tokenizer.json \(it holds: config.json"):
        load_pretrained_encoder(partial)
    no_config = _model_folder(tmp_path / "no_config", folder, skip=("config.json",))
    with pytest.raises(FileNotFoundError, match=r"no_config is missing config.json"):
        load_pretrained_encoder(no_config)


def test_load_pretrained_encoder_argument_types(folder):
    with pytest.raises(TypeError, match=r"path must be a folder path \(a str or pathlib.Path\), got 123 \(int\)"):
        load_pretrained_encoder(123)
    with pytest.raises(TypeError, match=r"max_length must be a positive integer, got '20' \(str\)"):
        load_pretrained_encoder(folder, max_length="20")
    with pytest.raises(ValueError, match=r"max_length must be a positive integer, got 0"):
        load_pretrained_encoder(folder, max_length=0)
    with pytest.raises(TypeError, match=r"pad_id must be an integer >= 0, got '0' \(str\)"):
        load_tokenizer(folder, max_length=8, pad_id="0")
    with pytest.raises(TypeError, match=r"token_types must be True or False, got 'yes'"):
        bert_weight_map(2, token_types="yes")


@pytest.mark.parametrize(("changes", "error", "message"), [
    (dict(hidden_size="384"), TypeError, r"'hidden_size' must be a positive integer, got '384' \(str\)"),
    (dict(hidden_size=384.0), TypeError, r"'hidden_size' must be a positive integer, got 384.0 \(float\)"),
    (dict(num_hidden_layers=0), ValueError, r"'num_hidden_layers' must be a positive integer, got 0"),
    (dict(type_vocab_size=-1), ValueError, r"'type_vocab_size' must be a non-negative integer, got -1"),
    (dict(layer_norm_eps="1e-12"), TypeError, r"'layer_norm_eps' must be a non-negative number, got '1e-12'"),
    (dict(layer_norm_eps=True), TypeError, r"'layer_norm_eps' must be a non-negative number, got True"),
    (dict(hidden_dropout_prob="0.1"), TypeError, r"'hidden_dropout_prob' must be a non-negative number, got '0.1'"),
    (dict(hidden_dropout_prob=1.5), ValueError, r"'hidden_dropout_prob' must be in \[0, 1\), got 1.5"),
    (dict(hidden_act=3), TypeError, r"'hidden_act' must be a str, got int 3"),
    (dict(model_type=None), TypeError, r"'model_type' must be a str, got NoneType None"),
    (dict(is_decoder="no"), TypeError, r"'is_decoder' must be a bool, got str 'no'"),
    (dict(position_embedding_type=3), TypeError, r"'position_embedding_type' must be a str, got int 3"),
])
def test_config_json_with_wrong_typed_fields(changes, error, message, folder):
    config = {**json.loads((folder / "config.json").read_text()), **changes}
    with pytest.raises(error, match=rf"config.json: {message}"):
        config_from_bert(config)


def test_config_json_with_wrong_types_through_the_loader(tmp_path, folder):
    config = {**json.loads((folder / "config.json").read_text()), "num_attention_heads": "12"}
    path = _model_folder(tmp_path / "model", folder, config)
    with pytest.raises(TypeError, match=rf"{path / 'config.json'}: 'num_attention_heads' must be a positive integer, got '12'"):
        load_pretrained_encoder(path)
    with pytest.raises(TypeError, match=r"config must be a dict \(the parsed config.json\), got list"):
        config_from_bert([("model_type", "bert")])


# --------------------------------------------------------------------------------------------
# Pretrained: checkpoints


TINY = dict(
    model_type="bert", vocab_size=50, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
    intermediate_size=12, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12,
    hidden_act="gelu",
)


def _tiny_checkpoint() -> tuple[Encoder, dict[str, torch.Tensor]]:
    """An Encoder and a checkpoint in BERT's names (split from a second Encoder's weights)."""
    config = config_from_bert(TINY)
    torch.manual_seed(0)
    params = dict(Encoder(config).named_parameters())
    tensors = {}
    for ours, theirs in bert_weight_map(config.n_layers).items():
        for name, part in zip(theirs, params[ours].detach().chunk(len(theirs)), strict=True):
            tensors[name] = part.clone()
    return Encoder(config), tensors


def test_the_tiny_checkpoint_loads():
    model, tensors = _tiny_checkpoint()
    assert load_bert_weights(model, tensors) == []
    torch.testing.assert_close(model.embeddings.token.weight,
                               tensors["embeddings.word_embeddings.weight"], rtol=0, atol=0)


@pytest.mark.parametrize(("name", "shape", "message"), [
    ("encoder.layer.0.output.dense.weight", (8, 11),
     r"'encoder.layer.0.output.dense.weight' has shape \(8, 11\), but blocks.0.ff.fc2.weight has shape \(8, 12\)"),
    ("encoder.layer.0.attention.self.key.weight", (4, 8),
     r"'encoder.layer.0.attention.self.key.weight' has shape \(4, 8\), but "
     r"blocks.0.self_attn.qkv_proj.weight has shape \(24, 8\) \(3 stacked parts of \(8, 8\)\)"),
    ("embeddings.LayerNorm.bias", (9,),
     r"'embeddings.LayerNorm.bias' has shape \(9,\), but embeddings.norm.bias has shape \(8,\)"),
])
def test_checkpoint_with_wrong_shapes(name, shape, message):
    model, tensors = _tiny_checkpoint()
    before = model.embeddings.token.weight.clone()
    tensors[name] = torch.zeros(shape)
    with pytest.raises(ValueError, match=rf"cannot load the checkpoint into the encoder: {message}"):
        load_bert_weights(model, tensors)
    assert torch.equal(model.embeddings.token.weight, before)  # nothing written


def test_checkpoint_of_the_wrong_kind():
    model, tensors = _tiny_checkpoint()
    with pytest.raises(TypeError, match=r"model must be a course_lib Encoder .*got DecoderLM"):
        load_bert_weights(_gpt(), tensors)
    with pytest.raises(TypeError, match=r"tensors must be a dict of checkpoint name -> tensor.*got list"):
        load_bert_weights(model, list(tensors.values()))
    tensors["embeddings.word_embeddings.weight"] = np.zeros((50, 8), dtype=np.float32)
    with pytest.raises(TypeError, match=r"maps 'embeddings.word_embeddings.weight' to a ndarray"):
        load_bert_weights(model, tensors)
    tensors["embeddings.word_embeddings.weight"] = torch.zeros(50, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'embeddings.word_embeddings.weight' has dtype torch.int64, but "
                                         r"embeddings.token.weight needs floating-point values"):
        load_bert_weights(model, tensors)


# --------------------------------------------------------------------------------------------
# Pretrained: tokenizing and pooling


@pytest.fixture(scope="module")
def bert(folder):
    return load_pretrained_encoder(folder)


@pytest.mark.parametrize(("sentences", "message"), [
    (123, r"sentences must be a string or a list of strings, got int 123"),
    (None, r"sentences must be a string or a list of strings, got NoneType None"),
    (b"bytes", r"sentences must be a string or a list of strings, got bytes b'bytes'"),
    (["fine", 3], r"sentences must be a string or a list of strings, got a list whose item 1 is 3 \(int\)"),
    ([["nested"]], r"got a list whose item 0 is \['nested'\] \(list\)"),
])
def test_tokenize_rejects_what_is_not_text(bert, sentences, message):
    with pytest.raises(TypeError, match=message):
        bert.tokenize(sentences)


def test_text_pair_and_embedding_options(bert):
    with pytest.raises(TypeError, match=r"text_pair must be a string or a list of strings, got int 5"):
        bert.tokenize("a", text_pair=5)
    with pytest.raises(TypeError, match=r"sentences must be a string or a list of strings, got int 7"):
        bert.sentence_embedding(7)
    with pytest.raises(TypeError, match=r"normalize must be True or False, got 'yes' \(str\)"):
        bert.sentence_embedding("a", normalize="yes")
    with pytest.raises(TypeError, match=r"output_attentions must be True or False, got 'no'"):
        bert.encode("a", output_attentions="no")
    out = bert.encode("Hi there")
    with pytest.raises(TypeError, match=r"head must be an integer, got 1.0 \(float\); write 1"):
        out.attention_map(0, 1.0)


HIDDEN = torch.randn(2, 3, 4)


@pytest.mark.parametrize(("hidden", "mask", "error", "message"), [
    (HIDDEN, torch.ones(2, 4, dtype=torch.bool), ValueError,
     r"attention_mask has shape \(2, 4\) but hidden has shape \(2, 3, 4\); expected \(B, T\) = \(2, 3\)"),
    (HIDDEN, torch.ones(2, 3, 1, dtype=torch.bool), ValueError,
     r"attention_mask has shape \(2, 3, 1\) but hidden has shape \(2, 3, 4\)"),
    (HIDDEN, torch.ones(2, 3), ValueError,  # a 0/1 integer mask is accepted, a float one is not
     r"attention_mask must be a boolean \(or 0/1 integer\) tensor.*got dtype torch.float32.*\.bool\(\)"),
    (HIDDEN, [[1, 1, 1], [1, 1, 0]], TypeError, r"attention_mask must be a torch.Tensor, got list"),
    (HIDDEN.long(), torch.ones(2, 3, dtype=torch.bool), ValueError,
     r"hidden must be a floating-point tensor, got dtype torch.int64"),
    (HIDDEN[0], torch.ones(3, dtype=torch.bool), ValueError,
     r"hidden should have shape \(B, T, D\), but got a 2-D tensor"),
])
def test_mean_pool_rejects_bad_masks(hidden, mask, error, message):
    with pytest.raises(error, match=message):
        mean_pool(hidden, mask)
