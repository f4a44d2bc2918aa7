"""Pretrained checkpoints in course_lib's own models: BERT in :class:`Encoder`, Llama in
:class:`DecoderLM`.

Nothing here re-implements the network. :func:`config_from_bert` translates Hugging Face's
``config.json`` into an :class:`EncoderConfig` (post-norm, GELU, learned absolute positions,
token types, LayerNorm on the embeddings); :func:`bert_weight_map` names the checkpoint tensors
that fill each of our parameters and :func:`load_bert_weights` copies them in;
:func:`bert_module_pairs` pairs our submodules with ``BertModel``'s for the divergence locator.
:func:`mean_pool` turns token vectors into a sentence vector.

:func:`config_from_llama`, :func:`llama_weight_map` and :func:`load_llama_weights` do the same
for a Hugging Face Llama (``LlamaForCausalLM``): RMSNorm, SwiGLU, grouped-query attention and
RoPE, whose pairs of dimensions Hugging Face and course_lib order differently
(:func:`rope_half_to_interleaved`).

Reading a model folder, the tokenizer and the sentence-embedding wrapper are tooling:
``course_lib.instruments.bert_app`` (``load_pretrained_encoder()``).

Shape legend: B batch, T tokens (padded to the longest in the batch), D d_model (BERT's
hidden_size), L layers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_bool,
    require_floating,
    require_instance,
    require_int,
    require_ndim,
    require_padding_mask,
    require_positive_number,
    require_tensor,
    shape_of,
)
from .attention import as_bool_mask
from .models import DecoderConfig, DecoderLM, Encoder, EncoderConfig

# Hugging Face's names for BERT's activations -> course_lib's. HF's "gelu" is the exact erf form.
HIDDEN_ACTS = {"gelu": "gelu", "relu": "relu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh"}

# config.json's sizes, each an integer >= this minimum (type_vocab_size 0: no segments)
BERT_SIZES = {"vocab_size": 1, "hidden_size": 1, "num_hidden_layers": 1,
              "num_attention_heads": 1, "intermediate_size": 1, "max_position_embeddings": 1,
              "type_vocab_size": 0}

# Checkpoint tensors that are not part of the encoder, left out on purpose: the pooler (a dense
# layer on [CLS] for next-sentence prediction), task heads, and index buffers (position_ids is
# arange(max_len), token_type_ids zeros).
SKIPPED_PREFIXES = ("pooler.", "cls.", "classifier.", "qa_outputs.")
SKIPPED_SUFFIXES = ("position_ids", "token_type_ids")


def config_from_bert(config: Mapping[str, Any], *, source: str = "config.json") -> EncoderConfig:
    """Translate a Hugging Face BERT ``config.json`` (as a dict) into an :class:`EncoderConfig`.

    BERT is a post-norm encoder (``norm_first=False``) with learned absolute positions, segment
    (token type) embeddings and a LayerNorm on the summed embeddings. (In training mode the
    two differ slightly: course_lib's FeedForward also drops out after its activation.)

    Args:
        config: the parsed config.json.
        source: how to name the config in error messages (usually its path).

    Returns:
        The matching EncoderConfig (max_len = max_position_embeddings, dropout =
        hidden_dropout_prob).
    """
    check_bert_config(config, source)
    try:
        return EncoderConfig(
            vocab_size=config["vocab_size"],
            d_model=config["hidden_size"],
            n_heads=config["num_attention_heads"],
            n_layers=config["num_hidden_layers"],
            d_ff=config["intermediate_size"],
            max_len=config["max_position_embeddings"],
            dropout=config.get("hidden_dropout_prob") or 0.0,
            activation=HIDDEN_ACTS[config["hidden_act"]],
            norm_first=False,
            positions="learned",
            layer_norm_eps=float(config["layer_norm_eps"]),
            bias=True,
            type_vocab_size=config["type_vocab_size"],
            embed_norm=True,
        )
    except (TypeError, ValueError) as err:  # e.g. hidden_size not divisible by the heads
        raise type(err)(f"{source} describes a model course_lib cannot build: {err}") from None


def bert_weight_map(n_layers: int, *, token_types: bool = True) -> dict[str, tuple[str, ...]]:
    """Which checkpoint tensors fill each parameter of our :class:`Encoder`.

    Only the fused ``qkv_proj`` takes three tensors, stacked along dim 0 as [W_q; W_k; W_v]
    (the order of ``nn.MultiheadAttention.in_proj_weight``); everything else is one to one.
    Both libraries store ``nn.Linear`` weights as (out, in), so nothing is transposed.

    Args:
        n_layers: L, the number of encoder blocks.
        token_types: the model has segment embeddings (type_vocab_size > 0).

    Returns:
        ``{our_name: (checkpoint_name, ...)}`` covering every parameter of the encoder.
    """
    check_layer_table(n_layers, token_types)
    table = {
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
                f"{theirs}attention.self.{name}.{kind}" for name in ("query", "key", "value"))
            table[f"{ours}self_attn.out_proj.{kind}"] = (f"{theirs}attention.output.dense.{kind}",)
            table[f"{ours}attn_norm.{kind}"] = (f"{theirs}attention.output.LayerNorm.{kind}",)
            table[f"{ours}ff.fc1.{kind}"] = (f"{theirs}intermediate.dense.{kind}",)
            table[f"{ours}ff.fc2.{kind}"] = (f"{theirs}output.dense.{kind}",)
            table[f"{ours}ff_norm.{kind}"] = (f"{theirs}output.LayerNorm.{kind}",)
    return table


def bert_module_pairs(n_layers: int, *, token_types: bool = True) -> dict[str, str]:
    """Which submodule of Hugging Face's ``BertModel`` computes the same output as each
    submodule of our :class:`Encoder` (for ``course_lib.instruments.divergence.first_divergence``).

    Only modules that receive the same input in both models are listed (our position table is
    called with a length, BERT's with position ids, so it is left out).

    Args:
        n_layers: L, the number of encoder blocks.
        token_types: the model has segment embeddings (type_vocab_size > 0).

    Returns:
        ``{our module name: BertModel module name}`` in the order the modules run.
    """
    check_layer_table(n_layers, token_types)
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


def load_bert_weights(
    model: Encoder, tensors: Mapping[str, torch.Tensor], *, source: str = "the checkpoint"
) -> list[str]:
    """Copy a BERT checkpoint's tensors into ``model``, checking everything before writing.

    Every checkpoint tensor must be used or deliberately skipped (pooler, task heads,
    position_ids), every parameter filled, every shape exact. Nothing is written unless all
    checks pass; the ValueError lists every problem.

    Args:
        model: an Encoder built from the checkpoint's config (:func:`config_from_bert`).
        tensors: checkpoint name -> tensor (e.g. ``safetensors.torch.load_file(...)``).
        source: how to name the checkpoint in error messages (usually its path).

    Returns:
        The names of the checkpoint tensors that were skipped on purpose.
    """
    check_bert_checkpoint(model, tensors, source)
    by_name = {_standard_name(name): name for name in tensors}  # BERT's name -> the file's
    table = bert_weight_map(model.config.n_layers, token_types=model.config.type_vocab_size > 0)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, theirs in table.items():  # [W_q; W_k; W_v] or one tensor
            # copy_ also converts e.g. float16 checkpoints to our dtype
            params[ours].copy_(torch.cat([tensors[by_name[name]] for name in theirs]))
    return sorted(name for std, name in by_name.items() if _is_skipped(std))


# A Llama config.json's sizes (integers >= 1), and the options course_lib's DecoderLM has
LLAMA_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "max_position_embeddings")
LLAMA_SUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                   "rope_type": "default"}


def config_from_llama(config: Mapping[str, Any], *, source: str = "config.json") -> DecoderConfig:
    """Translate a Hugging Face Llama ``config.json`` (as a dict, e.g.
    ``LlamaConfig.to_dict()``) into a :class:`DecoderConfig`.

    Llama is a pre-norm decoder with RMSNorm, the SwiGLU feed-forward network, grouped-query
    attention, RoPE and no biases; plain RoPE only (no ``rope_scaling``).

    Returns:
        The matching DecoderConfig (max_len = max_position_embeddings, layer_norm_eps =
        rms_norm_eps, rope_theta from ``rope_parameters`` or the older top-level key).
    """
    check_llama_config(config, source)
    rope = {**config, **(config.get("rope_parameters") or {})}  # rope_theta moved there in v5
    return DecoderConfig(
        vocab_size=config["vocab_size"], d_model=config["hidden_size"],
        n_heads=config["num_attention_heads"], n_layers=config["num_hidden_layers"],
        d_ff=config["intermediate_size"], max_len=config["max_position_embeddings"],
        dropout=float(config.get("attention_dropout") or 0.0), norm_first=True,
        positions="rope", layer_norm_eps=float(config["rms_norm_eps"]), bias=False,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), norm="rms",
        ffn="swiglu", n_kv_heads=config["num_key_value_heads"],
        rope_theta=float(rope.get("rope_theta", 10000.0)),
    )


def llama_weight_map(n_layers: int, *, tie_embeddings: bool = False) -> dict[str, tuple[str, ...]]:
    """Which ``LlamaForCausalLM`` tensors fill each parameter of a Llama-style
    :class:`DecoderLM` (built by :func:`config_from_llama`).

    ``qkv_proj`` takes q_proj, k_proj and v_proj stacked as [W_q; W_k; W_v] (with GQA, W_k
    and W_v have n_kv_heads * Dh rows each), and :func:`load_llama_weights` reorders the rows
    of W_q and W_k for course_lib's RoPE; everything else is one to one, nothing transposed.

    Args:
        n_layers: L, the number of decoder blocks.
        tie_embeddings: the output layer is the token embedding (no ``lm_head.weight`` of
            its own).

    Returns:
        ``{our_name: (checkpoint_name, ...)}`` covering every parameter of the decoder.
    """
    check_positive_ints(n_layers=n_layers)
    check_bools(tie_embeddings=tie_embeddings)
    table = {"embeddings.token.weight": ("model.embed_tokens.weight",),
             "final_norm.weight": ("model.norm.weight",)}
    if not tie_embeddings:
        table["lm_head.weight"] = ("lm_head.weight",)
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        table |= {
            f"{ours}attn_norm.weight": (f"{theirs}input_layernorm.weight",),
            f"{ours}self_attn.qkv_proj.weight": tuple(
                f"{theirs}self_attn.{name}_proj.weight" for name in ("q", "k", "v")),
            f"{ours}self_attn.out_proj.weight": (f"{theirs}self_attn.o_proj.weight",),
            f"{ours}ff_norm.weight": (f"{theirs}post_attention_layernorm.weight",),
        }
        table |= {f"{ours}ff.{name}_proj.weight": (f"{theirs}mlp.{name}_proj.weight",)
                  for name in ("gate", "up", "down")}
    return table


def rope_half_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of a query or key projection, (H Dh, D), from Hugging Face Llama's
    RoPE layout to course_lib's.

    The classic bug of porting RoPE weights: Hugging Face's Llama rotates dimension i of each
    head together with dimension i + Dh/2 (``rotate_half``); course_lib's
    :func:`~course_lib.positions.apply_rope` rotates 2i with 2i + 1 (the RoPE paper's pairs,
    as in GPT-J and Meta's original Llama code). Both turn pair i by p * theta_i, so moving
    row i of every head to 2i and row i + Dh/2 to 2i + 1 makes our rotation compute theirs.
    It is the inverse of the permutation in Hugging Face's ``convert_llama_weights_to_hf.py``
    (Meta's layout to theirs). q and k move alike, so every q . k is unchanged; without it
    the model loads without an error and computes something else. (Permuting the weights
    once, rather than giving RoPE a second layout, keeps one rotation in course_lib.)

    Args:
        weight: W_q (H Dh, D) or W_k (Hkv Dh, D), or a bias (H Dh,), in Hugging Face's order.
        n_heads: the heads it holds (H for W_q, Hkv for W_k).

    Returns:
        The same rows, course_lib's order.
    """
    check_rope_rows(weight, n_heads)
    halves = weight.unflatten(0, (n_heads, 2, -1))  # (H, 2, Dh/2, ...): [first; second] halves
    return halves.transpose(1, 2).flatten(0, 2)  # (H, Dh/2, 2, ...) -> (H Dh, ...): interleaved


def load_llama_weights(model: DecoderLM, tensors: Mapping[str, torch.Tensor], *,
                       source: str = "the checkpoint") -> list[str]:
    """Copy a ``LlamaForCausalLM`` state dict (or safetensors file) into a Llama-style
    :class:`DecoderLM`, checking everything before writing: every tensor used (or skipped on
    purpose: RoPE's inv_freq buffer, a tied ``lm_head.weight``), every parameter filled,
    every shape exact. W_q and W_k go through :func:`rope_half_to_interleaved`.

    Args:
        model: a DecoderLM built from the checkpoint's config (:func:`config_from_llama`).
        tensors: checkpoint name -> tensor.
        source: how to name the checkpoint in error messages.

    Returns:
        The names of the checkpoint tensors that were skipped on purpose.
    """
    check_llama_checkpoint(model, tensors, source)
    config = model.config
    table = llama_weight_map(config.n_layers, tie_embeddings=config.tie_embeddings)
    params = dict(model.named_parameters())
    n_kv_heads = config.n_kv_heads or config.n_heads
    with torch.no_grad():
        for ours, theirs in table.items():
            parts = [tensors[name] for name in theirs]
            if len(parts) == 3:  # [W_q; W_k; W_v], the rows of W_q and W_k in our RoPE pairs
                parts[:2] = (rope_half_to_interleaved(parts[0], config.n_heads),
                             rope_half_to_interleaved(parts[1], n_kv_heads))
            params[ours].copy_(torch.cat(parts))  # (rows, D) or (D,)
    return _llama_skipped(config, tensors)


def _llama_problems(params: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor],
                    table: Mapping[str, tuple[str, ...]], skipped: Sequence[str]) -> list[str]:
    """What keeps a checkpoint from filling these parameters: tensors missing, left over or
    of the wrong shape, and parameters on either side that the table does not pair."""
    used = {name for theirs in table.values() for name in theirs}
    problems = [f"{what}: {_list(sorted(names))}" for what, names in (
        ("missing tensors", used - set(tensors)),
        ("unexpected tensors", set(tensors) - used - set(skipped)),
        ("parameters with no Llama counterpart (not built by config_from_llama?)",
         set(params) - set(table)),
        ("weight-map names the model lacks", set(table) - set(params))) if names]
    for ours, theirs in table.items():
        if ours in params and all(name in tensors for name in theirs):
            shape = tuple(params[ours].shape)
            d, kv = shape[-1], (shape[0] - shape[-1]) // 2  # qkv_proj: D + 2 Hkv Dh rows
            expected = [shape] if len(theirs) == 1 else [(d, d), (kv, d), (kv, d)]
            got = [tuple(tensors[name].shape) for name in theirs]
            if got != expected:
                problems.append(f"{_list(theirs)} have shapes {got}; {ours} needs {expected}")
    not_float = sorted(name for name in used & set(tensors)
                       if not tensors[name].is_floating_point())
    if not_float:
        problems.append(f"tensors that are not floating point: {_list(not_float)}")
    return problems


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average each sequence's vectors over its real tokens (padding left out).

    Args:
        hidden: (B, T, D) token vectors.
        attention_mask: (B, T) bool or 0/1 integers (what tokenizers return), True/1 for real
            tokens.

    Returns:
        (B, D) sentence vectors.
    """
    check_mean_pool(hidden, attention_mask)
    # mean over real tokens: sum_t m_t h_t / sum_t m_t
    weights = as_bool_mask(attention_mask).to(hidden.dtype).unsqueeze(-1)  # (B, T, 1), 1 = real
    total = (hidden * weights).sum(dim=1)  # (B, D)
    count = weights.sum(dim=1).clamp(min=1e-9)  # (B, 1); clamp keeps an all-padding row finite
    return total / count  # (B, D)


def _standard_name(name: str) -> str:
    """Undo two naming variants of saved BERT checkpoints: a 'bert.' prefix (saved with a task
    head, e.g. BertForMaskedLM) and LayerNorm.gamma/beta (the original TF port)."""
    name = name.removeprefix("bert.")
    if name.endswith("LayerNorm.gamma") or name.endswith("LayerNorm.beta"):
        name = name.rsplit(".", 1)[0] + (".weight" if name.endswith("gamma") else ".bias")
    return name


def _is_skipped(name: str) -> bool:
    return name.startswith(SKIPPED_PREFIXES) or name.endswith(SKIPPED_SUFFIXES)


def _list(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(n if n.endswith(")") else repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _part_problems(ours: str, param: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> list:
    """What is wrong with the tensors that fill ``ours``: each must be floating point with the
    parameter's shape (a 1/len(parts) slice of it along dim 0 when stacked)."""
    expected = (param.shape[0] // len(parts), *param.shape[1:])
    bad = [f"{n!r} has shape {shape_of(p)}" for n, p in parts.items() if p.shape != expected]
    bad += [f"{n!r} has dtype {p.dtype}" for n, p in parts.items() if not p.is_floating_point()]
    stacked = f" ({len(parts)} stacked parts of {expected})" if len(parts) > 1 else ""
    return [f"{'; '.join(bad)}, but {ours} has shape {shape_of(param)}{stacked} and needs "
            "floating-point values"] if bad else []


# --- argument checks


def check_bert_config(config: object, source: str) -> None:
    """config.json must describe a BERT encoder: every size an integer, known activation."""
    if not checks_wanted():
        return
    require_instance("config", config, Mapping, "a dict (parsed config.json)")
    missing = [k for k in [*BERT_SIZES, "model_type", "hidden_act", "layer_norm_eps"]
               if k not in config]
    if missing:
        raise ValueError(f"{source} has no key {missing[0]!r}, which every BERT config needs")
    for key, low in BERT_SIZES.items():
        require_int(f"{source}: {key!r}", config[key], minimum=low)
    require_positive_number(f"{source}: 'layer_norm_eps'", config["layer_norm_eps"])
    supported = {"model_type": ["bert"], "hidden_act": sorted(HIDDEN_ACTS),
                 "position_embedding_type": ["absolute"], "is_decoder": [False],
                 "add_cross_attention": [False]}
    wrong = [(k, config.get(k, ok[0]), ok) for k, ok in supported.items()
             if config.get(k, ok[0]) not in ok]
    for key, value, allowed in wrong:
        raise ValueError(f"{source}: {key!r} is {value!r}, expected one of {allowed} (BERT only)")


def check_layer_table(n_layers: object, token_types: object) -> None:
    check_positive_ints(n_layers=n_layers)
    check_bools(token_types=token_types)


def check_weights(model: object, tensors: object, expected: type) -> None:
    """model a course_lib ``expected`` (Encoder for BERT, DecoderLM for Llama); tensors a
    dict of name -> tensor."""
    if not checks_wanted():
        return
    if not isinstance(model, expected):
        got = type(model).__name__
        raise TypeError(f"model must be a course_lib {expected.__name__}, got {got}")
    ok = isinstance(tensors, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in tensors.items())
    if not ok:
        raise TypeError(f"tensors must be a dict of name -> tensor, got {tensors!r:.60}")


def check_llama_config(config: object, source: str) -> None:
    """config.json must describe a Llama that course_lib's DecoderLM can be: integer sizes,
    SiLU, no biases, plain RoPE, head_dim = hidden_size / num_attention_heads."""
    if not checks_wanted():
        return
    require_instance("config", config, Mapping, "a dict (parsed config.json)")
    for key in LLAMA_SIZES:
        require_int(f"{source}: {key!r}", config.get(key), minimum=1)
    require_positive_number(f"{source}: 'rms_norm_eps'", config.get("rms_norm_eps"))
    require_bool(f"{source}: 'tie_word_embeddings'", config.get("tie_word_embeddings", False))
    given = {**config, **(config.get("rope_scaling") or {}),
             **(config.get("rope_parameters") or {})}  # rope_type and rope_theta, as in v5
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    given["head_dim"] = given.get("head_dim") or head_dim
    for key, value in {**LLAMA_SUPPORTED, "head_dim": head_dim}.items():
        if given.get(key, value) != value:
            raise ValueError(f"{source}: {key!r} is {given[key]!r}, course_lib's Llama-style "
                             f"DecoderLM needs {value!r}")


def check_mean_pool(hidden: object, attention_mask: object) -> None:
    """Check mean_pool's arguments."""
    if not checks_wanted():
        return
    require_ndim("hidden", hidden, (3,), "(B, T, D)")
    require_floating("hidden", hidden)
    expected = f"expected (B, T) = {tuple(hidden.shape[:2])}, as hidden {shape_of(hidden)}"
    require_padding_mask("attention_mask", attention_mask, hidden.shape[:2], expected)


def check_bert_checkpoint(model: object, tensors: object, source: str) -> None:
    """Raise, listing every problem, unless ``tensors`` fill every parameter of the Encoder
    ``model`` with tensors of the right shapes, each used or skipped on purpose."""
    check_weights(model, tensors, Encoder)
    by_name = {_standard_name(name): name for name in tensors}  # BERT's name -> the file's
    table = bert_weight_map(model.config.n_layers, token_types=model.config.type_vocab_size > 0)
    params = dict(model.named_parameters())
    missing, problems = [], []
    for ours, theirs in table.items():
        missing += [f"{name!r} (for {ours})" for name in theirs if name not in by_name]
        parts = [by_name[name] for name in theirs if name in by_name]
        if len(parts) == len(theirs) and ours in params:
            problems += _part_problems(ours, params[ours], {n: tensors[n] for n in parts})
    used = {name for theirs in table.values() for name in theirs}
    unexpected = sorted(name for std, name in by_name.items()
                        if std not in used and not _is_skipped(std))
    for what, names in (
        ("missing tensors", missing),
        ("tensors that name the same parameter", [] if len(by_name) == len(tensors) else
         sorted(n for n in tensors if by_name[_standard_name(n)] != n)),
        ("parameters with no BERT counterpart", sorted(set(params) - set(table))),
        ("weight-map names the model lacks (not built by config_from_bert?)",
         sorted(set(table) - set(params))),
        ("unexpected tensors that belong to no part of a BERT encoder", unexpected),
    ):
        problems += [f"{what}: {_list(names)}"] if names else []
    if problems:
        raise ValueError(f"cannot load {source} into the encoder: {'; '.join(problems)}")


def _llama_skipped(config: DecoderConfig, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The checkpoint tensors left out on purpose: RoPE's inv_freq, a tied lm_head.weight."""
    return sorted(n for n in tensors if n.endswith("rotary_emb.inv_freq")
                  or (config.tie_embeddings and n == "lm_head.weight"))


def check_llama_checkpoint(model: object, tensors: object, source: str) -> None:
    """Raise, listing every problem, unless ``tensors`` fill every parameter of the DecoderLM
    ``model`` with tensors of the right shapes (and a tied head equal to the embeddings)."""
    check_weights(model, tensors, DecoderLM)
    config = model.config
    table = llama_weight_map(config.n_layers, tie_embeddings=config.tie_embeddings)
    params = dict(model.named_parameters())
    problems = _llama_problems(params, tensors, table, _llama_skipped(config, tensors))
    head, embedding = tensors.get("lm_head.weight"), tensors.get("model.embed_tokens.weight")
    if config.tie_embeddings and head is not None and embedding is not None and not (
            head.shape == embedding.shape and torch.equal(head, embedding)):
        problems.append("the model ties its output layer to the token embeddings, but the "
                        "checkpoint's lm_head.weight differs from model.embed_tokens.weight: build "
                        "the model with tie_embeddings=False (config.json: tie_word_embeddings)")
    if problems:
        raise ValueError(f"cannot load {source} into the decoder: {'; '.join(problems)}")


def check_rope_rows(weight: object, n_heads: object) -> None:
    """weight's rows split into n_heads heads of an even width."""
    check_positive_ints(n_heads=n_heads)
    require_tensor("weight", weight)
    rows = weight.shape[0] if weight.dim() else 0
    if rows == 0 or rows % (2 * n_heads):
        raise ValueError(f"weight has {rows} rows, which n_heads={n_heads} heads cannot share as "
                         f"heads of an even width (H * Dh rows, Dh even): is n_heads the number "
                         f"of heads this projection holds (H for W_q, Hkv for W_k)?")
