"""Checks for chapter 08, full architectures: cross-attention, a post-norm BERT layer built
from course_lib parts, the parameter count of a GPT-2 configuration, mean pooling with a
padding mask (a find-the-bug exercise), and predictions of what BERT's masking rule does.

Conventions (as in the chapter): weights have ``nn.Linear``'s layout (out, in); the fused
projection ``w_qkv`` stacks the rows [W_q; W_k; W_v]; masks are boolean, True for real tokens.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from course_lib.attention import MultiHeadAttention, causal_mask, padding_mask
from course_lib.blocks import EncoderBlock
from course_lib.configs import DecoderConfig, EncoderConfig
from course_lib.instruments.bert_app import default_model_dir, load_pretrained_encoder
from course_lib.models import DecoderLM, MaskedLM, count_parameters, lm_loss
from course_lib.pretrained import mean_pool
from course_lib.tasks import mask_tokens

from ._core import (
    Case,
    CheckFailure,
    Misconception,
    call_learner,
    compare_tensors,
    prediction_dict,
    rand,
    require_count,
    require_number,
    run_cases,
    wrap_checks,
)

ATOL = 1e-5
RTOL = 1e-4


def _quietly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A wrong answer that cannot be computed for a case (shapes do not fit) is None."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ValueError, KeyError):
            return None

    return wrapped


# --------------------------------------------------------------------------------------------
# Exercise 8.1: cross_attention(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads)


def reference_cross_attention(
    x_dec: torch.Tensor, h_enc: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor,
    w_out: torch.Tensor, b_out: torch.Tensor, n_heads: int,
) -> torch.Tensor:
    """course_lib's MultiHeadAttention with these weights, queries from x_dec (B, T, D) and
    keys and values from h_enc (B, S, D): (B, T, D)."""
    d_model = x_dec.shape[-1]
    with torch.random.fork_rng(devices=[]):  # building the layer must not move the RNG
        attention = MultiHeadAttention(d_model, n_heads).to(x_dec.dtype)
    with torch.no_grad():
        attention.qkv_proj.weight.copy_(w_qkv)
        attention.qkv_proj.bias.copy_(b_qkv)
        attention.out_proj.weight.copy_(w_out)
        attention.out_proj.bias.copy_(b_out)
        return attention(x_dec, h_enc)[0]  # (B, T, D)


def _split(t: torch.Tensor, n_heads: int, transpose: bool = True) -> torch.Tensor:
    batch, length, d_model = t.shape
    if not transpose:  # the classic mistake: a plain view mixes positions into the heads
        return t.reshape(batch, n_heads, length, d_model // n_heads)
    return t.view(batch, length, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, L, Dh)


def _cross_variant(
    x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads, *, sources="dee", scale="head",
    causal=False, biases=True, project=True, order=(0, 1, 2), transpose=True,
    layout="out_in",
) -> torch.Tensor:
    """Cross-attention with one thing changed: ``sources`` says where q, k, v come from
    ('d' decoder, 'e' encoder), ``order`` which row block of w_qkv each uses, ..."""
    d_model = x_dec.shape[-1]
    blocks = w_qkv.chunk(3, dim=0)
    bias_blocks = b_qkv.chunk(3, dim=0) if biases else (None, None, None)
    inputs = {"d": x_dec, "e": h_enc}
    projected = []
    for src, i in zip(sources, order, strict=True):
        w = blocks[i] if layout == "out_in" else blocks[i].T
        projected.append(F.linear(inputs[src], w, bias_blocks[i]))  # (B, L, D)
    q, k, v = (_split(t, n_heads, transpose) for t in projected)  # (B, H, L, Dh)
    d_scale = {"head": d_model // n_heads, "model": d_model, "none": 1}[scale]
    scores = q @ k.transpose(-2, -1) / math.sqrt(d_scale)  # (B, H, T, S)
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # (B, H, T, Dh)
    out = out.transpose(1, 2).reshape(x_dec.shape[0], q.shape[2], d_model)  # (B, T, D)
    if not project:
        return out
    return F.linear(out, w_out if layout == "out_in" else w_out.T, b_out if biases else None)


def _cross(**changes) -> Callable[..., Any]:
    return _quietly(lambda *args: _cross_variant(*args, **changes))


CROSS_MISTAKES = [
    Misconception(
        _cross(sources="ddd"),
        "Your output is self-attention over the decoder: queries, keys and values all come "
        "from x_dec. In cross-attention only the queries come from the decoder (eq. 34); the "
        "keys and values come from the encoder's output h_enc (eqs. 35-36)",
    ),
    Misconception(
        _cross(sources="dde"),
        "Your keys come from the decoder: k = x_dec W_k. The keys must come from the encoder's "
        "output, k_j = K h_j (eq. 35), like the values: a decoder query asks which SOURCE "
        "tokens matter",
    ),
    Misconception(
        _cross(sources="ded"),
        "Your values come from the decoder: v = x_dec W_v. Both keys and values come from the "
        "encoder's output h_enc (eqs. 35-36); what a query collects is source information",
    ),
    Misconception(
        _cross(sources="edd"),
        "The roles are swapped: your queries come from h_enc and your keys and values from "
        "x_dec. The decoder asks (queries from x_dec), the encoder's output answers (keys and "
        "values from h_enc); the output has one row per decoder position, shape (B, T, D)",
    ),
    Misconception(
        _cross(causal=True),
        "You applied a causal mask. Cross-attention has no future mask: the whole source "
        "sentence is known before decoding starts, so every decoder position may look at every "
        "source position (the decoder's causal mask belongs to its self-attention)",
    ),
    Misconception(
        _cross(scale="none"),
        "Your scores are not scaled: divide q k^T by sqrt(d_head), d_head = D / n_heads",
    ),
    Misconception(
        _cross(scale="model"),
        "You divided the scores by sqrt(D), the model width; each head works in d_head = "
        "D / n_heads dimensions, so divide by sqrt(d_head)",
    ),
    Misconception(
        _cross(project=False),
        "You left out the output projection: after concatenating the heads, apply w_out and "
        "b_out (out @ w_out.T + b_out)",
    ),
    Misconception(
        _cross(biases=False),
        "You left out the biases: the projections are nn.Linear layers, y = x @ W.T + b, with "
        "b_qkv split like w_qkv into the query, key and value biases, and b_out at the end",
    ),
    Misconception(
        _cross(order=(1, 0, 2)),
        "Your queries use W_k and your keys W_q: the rows of w_qkv are stacked [W_q; W_k; "
        "W_v], so the first D rows make the queries",
    ),
    Misconception(
        _cross(transpose=False),
        "Your heads mix positions: reshaping (B, L, D) straight to (B, H, L, D/H) cuts the "
        "sequence, not the features. Split with .view(B, L, H, D // H).transpose(1, 2)",
    ),
    Misconception(
        _cross(layout="in_out"),
        "You multiplied by the weights without transposing them: w_qkv and w_out have "
        "nn.Linear's layout (out, in), so a projection is x @ W.T + b (or F.linear(x, W, b))",
    ),
]

CROSS_HINT = (
    "queries come from x_dec (B, T, D), keys and values from h_enc (B, S, D); with T != S "
    "the weights are (B, H, T, S) and multiply values of S positions"
)


def _cross_case(gen: torch.Generator, name: str, batch: int, tgt: int, src: int, d: int,
                heads: int) -> Case:
    scale = 1.0 / math.sqrt(d)
    args = (rand(gen, batch, tgt, d), rand(gen, batch, src, d), rand(gen, 3 * d, d, scale=scale),
            rand(gen, 3 * d, scale=0.1), rand(gen, d, d, scale=scale), rand(gen, d, scale=0.1),
            heads)
    return Case(name, args, hint=CROSS_HINT)


def check_cross_attention(cross_attention: Callable) -> None:
    """Check ``cross_attention(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads)`` -> (B, T, D):
    multi-head attention with queries from the decoder states x_dec (B, T, D) and keys and
    values from the encoder output h_enc (B, S, D), against course_lib's MultiHeadAttention.
    """

    def check_one(got, case: Case) -> None:
        compare_tensors(got, reference_cross_attention(*case.args), case,
                        what="Your cross-attention output", misconceptions=CROSS_MISTAKES,
                        atol=ATOL, rtol=RTOL)

    gen = torch.Generator().manual_seed(81)
    cases = [  # equal lengths first: there a decoder-side key or value does not crash
        _cross_case(gen, "T=S=4 (equal lengths), D=8, 4 heads", 2, 4, 4, 8, 4),
        _cross_case(gen, "B=2, T=3 target and S=5 source tokens, D=8, 2 heads", 2, 3, 5, 8, 2),
        _cross_case(gen, "one decoder step T=1, S=6, D=12, 3 heads", 3, 1, 6, 12, 3),
        _cross_case(gen, "one source token S=1, T=3, D=8, 2 heads", 1, 3, 1, 8, 2),
        _cross_case(gen, "one head, B=1, T=2, S=7, D=6", 1, 2, 7, 6, 1),
    ]
    run_cases("cross_attention", cross_attention, cases, check_one)


# --------------------------------------------------------------------------------------------
# Exercise 8.1: mlm_loss(hidden, labels, embedding, dense, norm, bias), BERT's masked-language-
# model head with its output layer tied to the token embedding, scored where labels != -100


def _mlm_variant(hidden, labels, embedding, dense, norm, bias, *, act="gelu", order="act_norm",
                 use_dense=True, use_norm=True, use_bias=True, reduce="scored",
                 labels_as="skip", softmax_dim=-1) -> torch.Tensor:
    """The head and its loss with one thing changed (the defaults give the right answer)."""
    h = dense(hidden) if use_dense else hidden  # (B, T, D)
    activation = {"gelu": F.gelu, "tanh": lambda t: F.gelu(t, approximate="tanh"),
                  "relu": F.relu, "none": lambda t: t}[act]
    if order == "act_norm":
        h = norm(activation(h)) if use_norm else activation(h)
    else:  # the LayerNorm before the activation
        h = activation(norm(h))
    logits = F.linear(h, embedding, bias if use_bias else None)  # (B, T, V): h E^T + b
    logp = torch.log_softmax(logits, dim=softmax_dim)  # (B, T, V)
    scored = labels != -100  # (B, T)
    targets = labels.clamp(min=0) if labels_as == "class 0" else labels.masked_fill(~scored, 0)
    nll = -logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)  # (B, T)
    if labels_as == "skip":
        nll = nll * scored
    return {"scored": nll.sum() / scored.sum(), "all": nll.sum() / labels.numel(),
            "sum": nll.sum()}[reduce]


def _mlm(**changes) -> Callable[..., Any]:
    return _quietly(lambda *args: _mlm_variant(*args, **changes))


MLM_MISTAKES = [
    Misconception(
        _mlm(reduce="all"),
        "You averaged over every position, the -100 ones counted as 0: the loss is the mean "
        "over the SCORED positions only, so divide by how many labels are not -100",
    ),
    Misconception(
        _mlm(labels_as="class 0", reduce="all"),
        "Your loss scores the -100 positions as if their label were token 0 (a clamp, or a "
        "replaced label): those positions must be left out of the loss altogether",
    ),
    Misconception(
        _mlm(labels_as="class 0", reduce="scored"),
        "Your loss adds the -100 positions as if their label were token 0 (a clamp, or a "
        "replaced label): those positions must be left out of the loss altogether",
    ),
    Misconception(
        _mlm(reduce="sum"),
        "Your loss is the SUM over the scored positions: take their mean, so that the loss "
        "does not depend on how many positions were selected",
    ),
    Misconception(
        _mlm(use_bias=False),
        "Your scores lack the per-token bias: the output layer is h @ embedding.T + bias",
    ),
    Misconception(
        _mlm(use_norm=False),
        "Your head skips its LayerNorm: dense, then GELU, then the LayerNorm, then the "
        "product with the embedding matrix",
    ),
    Misconception(
        _mlm(order="norm_act"),
        "Your head applies the LayerNorm before the GELU: BERT's head is dense, GELU, then "
        "LayerNorm",
    ),
    Misconception(
        _mlm(act="tanh"),
        "Your GELU is the tanh approximation: BERT's is the exact (erf) GELU, F.gelu's default",
    ),
    Misconception(
        _mlm(act="relu"),
        "Your head uses ReLU: BERT's head uses the (exact) GELU",
    ),
    Misconception(
        _mlm(act="none"),
        "Your head has no activation between the dense layer and the LayerNorm: BERT's "
        "applies the GELU there",
    ),
    Misconception(
        _mlm(use_dense=False),
        "Your head skips its dense layer: the final vectors go through dense, GELU and "
        "LayerNorm before they are scored against the embeddings",
    ),
    Misconception(
        _mlm(softmax_dim=1),
        "Your softmax runs over the positions (dim 1): each position's scores are normalised "
        "over the vocabulary, the last dimension",
    ),
]

MLM_HINT = ("labels hold -100 at the positions the loss skips: -100 is not a token id, so "
            "leave those positions out before you pick each position's log-probability (or let "
            "F.cross_entropy's ignore_index skip them)")


def _mlm_case(gen: torch.Generator, name: str, batch: int, length: int, d: int, vocab: int,
              scored: torch.Tensor, *, pad_scale: float = 1.0) -> tuple[Case, MaskedLM]:
    """A small MaskedLM with its head's parameters randomised, and its pieces as arguments."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 10_000, (1,), generator=gen)))
        mlm = MaskedLM(EncoderConfig(vocab_size=vocab, d_model=d, n_heads=1, n_layers=1))
    with torch.no_grad():
        for p in (mlm.head_norm.weight, mlm.head_norm.bias, mlm.lm_head.bias):
            p.copy_(rand(gen, *p.shape, scale=0.5) + (1.0 if p is mlm.head_norm.weight else 0.0))
        mlm.encoder.embeddings.token.weight.copy_(rand(gen, vocab, d))
        mlm.head_dense.weight.copy_(rand(gen, d, d, scale=3.0 / math.sqrt(d)))  # GELU's curve
    hidden = rand(gen, batch, length, d)
    hidden = torch.where(scored[..., None], hidden, hidden * pad_scale)  # (B, T, D)
    labels = torch.randint(0, vocab, (batch, length), generator=gen).masked_fill(~scored, -100)
    args = (hidden, labels, mlm.encoder.embeddings.token.weight.detach(), mlm.head_dense,
            mlm.head_norm, mlm.lm_head.bias.detach())
    return Case(name, args, hint=MLM_HINT), mlm


def _mlm_cases() -> list[tuple[Case, MaskedLM]]:
    gen = torch.Generator().manual_seed(81)
    some = torch.rand(2, 5, generator=gen) < 0.5
    some[0, 0], some[1, 4] = True, False  # at least one scored and one skipped position
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[1, 2] = True
    return [
        _mlm_case(gen, f"B=2, T=5, D=8, V=11, {int(some.sum())} of 10 positions scored",
                  2, 5, 8, 11, some),
        _mlm_case(gen, "one scored position of 12, D=6, V=9", 3, 4, 6, 9, one),
        _mlm_case(gen, "every position scored, B=1, T=4, D=8, V=13", 1, 4, 8, 13,
                  torch.ones(1, 4, dtype=torch.bool)),
        _mlm_case(gen, "large vectors at the skipped positions, D=8, V=10", 2, 6, 8, 10,
                  torch.tensor([[1, 0, 1, 0, 0, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.bool),
                  pad_scale=30.0),
        _mlm_case(gen, "fewer tokens than features, V=5, D=16", 2, 3, 16, 5,
                  torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)),
    ]


def reference_mlm_loss(mlm: MaskedLM, hidden: torch.Tensor, labels: torch.Tensor
                       ) -> torch.Tensor:
    """course_lib's MaskedLM head on final vectors ``hidden`` (B, T, D), and its loss."""
    h = mlm.head_norm(mlm.head_activation(mlm.head_dense(hidden)))  # (B, T, D)
    return lm_loss(mlm.lm_head(h), labels)  # mean over the labels that are not -100


def check_mlm_loss(mlm_loss: Callable) -> None:
    """Check ``mlm_loss(hidden, labels, embedding, dense, norm, bias)`` -> a 0-d tensor: BERT's
    masked-language-model head (dense, exact GELU, LayerNorm, then scores against the token
    embedding matrix plus a bias) and the mean cross-entropy over the positions whose label is
    not -100, against course_lib's MaskedLM."""
    for case, mlm in _mlm_cases():
        got = call_learner(mlm_loss, case)
        with torch.no_grad():
            expected = reference_mlm_loss(mlm, *case.args[:2])
        compare_tensors(got.detach() if isinstance(got, torch.Tensor) else got, expected, case,
                        what="Your loss", misconceptions=MLM_MISTAKES, atol=ATOL, rtol=RTOL)
    print("\u2705 mlm_loss equals course_lib's MaskedLM head and loss on all 5 test cases "
          "(some positions scored; one; all; large vectors where the label is -100; V < D)")


# --------------------------------------------------------------------------------------------
# Exercise 8.2: bert_layer(x, attention_mask, tensors, config)

ACTIVATION_OF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                 "relu": "relu"}
QKV_NAMES = ("query", "key", "value")


def reference_bert_block(
    tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], *, norm_first: bool = False,
    eps: float | None = None, activation: str | None = None, order: tuple[int, ...] = (0, 1, 2),
) -> EncoderBlock:
    """course_lib's EncoderBlock holding one BERT layer's weights (names as in the checkpoint,
    without the ``encoder.layer.N.`` prefix). The keyword arguments build wrong variants."""
    d_model = config["hidden_size"]
    with torch.random.fork_rng(devices=[]):
        block = EncoderBlock(
            d_model, config["num_attention_heads"], config["intermediate_size"],
            activation=activation or ACTIVATION_OF[config["hidden_act"]],
            norm_first=norm_first, eps=config["layer_norm_eps"] if eps is None else eps,
        )
    source = {
        "attn_norm": "attention.output.LayerNorm", "ff.fc1": "intermediate.dense",
        "ff.fc2": "output.dense", "ff_norm": "output.LayerNorm",
        "self_attn.out_proj": "attention.output.dense",
    }
    with torch.no_grad():
        for kind in ("weight", "bias"):
            parts = [tensors[f"attention.self.{QKV_NAMES[i]}.{kind}"] for i in order]
            block.get_parameter(f"self_attn.qkv_proj.{kind}").copy_(torch.cat(parts))
            for ours, theirs in source.items():
                block.get_parameter(f"{ours}.{kind}").copy_(tensors[f"{theirs}.{kind}"])
    return block.eval()


def reference_bert_layer(
    x: torch.Tensor, attention_mask: torch.Tensor, tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any], **variant,
) -> torch.Tensor:
    """One post-norm BERT layer applied to x (B, T, D), padded keys masked: (B, T, D).
    ``residual=("attn", "ff")`` says which residual connections there are (a wrong variant
    leaves one out); the other keyword arguments go to :func:`reference_bert_block`."""
    use_mask = variant.pop("use_mask", True)
    residual = variant.pop("residual", ("attn", "ff"))
    block = reference_bert_block(tensors, config, **variant)
    mask = attention_mask if use_mask else None
    with torch.no_grad():
        if residual == ("attn", "ff"):
            return block(x, attention_mask=mask)[0]
        a = block.self_attn(x, attention_mask=mask)[0]  # (B, T, D)
        x = block.attn_norm(x + a if "attn" in residual else a)
        f = block.ff(x)  # (B, T, D)
        return block.ff_norm(x + f if "ff" in residual else f)


def _bert(**variant) -> Callable[..., Any]:
    return _quietly(lambda x, keep, tensors, config: reference_bert_layer(
        x, keep, tensors, config, **variant))


def _other_gelu(config: Mapping[str, Any]) -> str:
    return "gelu_tanh" if ACTIVATION_OF[config["hidden_act"]] == "gelu" else "gelu"


BERT_LAYER_MISTAKES = [
    Misconception(
        _bert(norm_first=True),
        "Your layer is pre-norm, x + f(LN(x)). BERT is post-norm: each sublayer reads the raw "
        "stream and the LayerNorm comes after the residual sum, x = LN(x + Attention(x)), then "
        "x = LN(x + FFN(x))",
    ),
    Misconception(
        _bert(eps=1e-5),
        "Your LayerNorms use eps=1e-5, PyTorch's default. BERT uses config['layer_norm_eps'] "
        "(1e-12): pass eps= to nn.LayerNorm",
    ),
    Misconception(
        _bert(eps=1e-12),
        "Your LayerNorms use eps=1e-12 whatever the config says: this layer's config has "
        "another layer_norm_eps. Read eps from the config, config['layer_norm_eps']",
    ),
    Misconception(
        _bert(residual=("ff",)),
        "Your layer has no residual connection around the attention: the first LayerNorm "
        "must normalise x + Attention(x), the sublayer's output added to its input",
    ),
    Misconception(
        _bert(residual=("attn",)),
        "Your layer has no residual connection around the feed-forward network: the second "
        "LayerNorm must normalise x + FFN(x), the sublayer's output added to its input",
    ),
    Misconception(
        _bert(residual=()),
        "Your layer has no residual connections: each LayerNorm must normalise the "
        "sublayer's output added to its input, LN(x + Attention(x)) and LN(x + FFN(x))",
    ),
    Misconception(
        _bert(use_mask=False),
        "Your real tokens attend to the padding: pass the attention_mask to the attention "
        "layer (attention_mask=...) so padded keys get weight 0",
    ),
    Misconception(
        _bert(order=(1, 0, 2)),
        "Your queries and keys are swapped: the fused qkv_proj weight stacks the checkpoint's "
        "query, key and value tensors in that order, [W_q; W_k; W_v]",
    ),
    Misconception(
        _bert(activation="relu"),
        "Your feed-forward network uses ReLU; BERT's hidden_act is a GELU: read it from the "
        "config ('gelu' is the exact erf form, 'gelu_new' the tanh approximation)",
    ),
]


def _activation_mistake(x, keep, tensors, config):
    return reference_bert_layer(x, keep, tensors, config, activation=_other_gelu(config))


BERT_LAYER_MISTAKES.append(Misconception(
    _quietly(_activation_mistake),
    "Your GELU is the wrong one: config['hidden_act'] 'gelu' is the exact erf form "
    "(F.gelu(x), activation='gelu' in course_lib), 'gelu_new' the tanh approximation "
    "(activation='gelu_tanh'). The two differ by at most about 4.7e-4, and only where the "
    "pre-activations are large, but that is enough to fail at 1e-5",
))


@functools.cache
def _minilm() -> tuple[dict[str, torch.Tensor], dict[str, Any], tuple[torch.Tensor, ...],
                       torch.Tensor]:
    """The bundled all-MiniLM-L6-v2: its tensors, its config.json, and the hidden states of
    a padded batch of sentences (embeddings and every layer's output) with their mask."""
    folder = default_model_dir()
    config = json.loads((folder / "config.json").read_text())
    encoder = load_pretrained_encoder(folder)
    tensors = {name: t.detach().clone() for name, t in _checkpoint(folder).items()}
    out = encoder.encode(["The chef cooked the bread.", "Hi!",
                          "Cross-attention reads the encoder's output."],
                         output_attentions=False)
    return tensors, config, out.hidden_states, out.batch.attention_mask


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def layer_tensors(tensors: Mapping[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """One layer's tensors, named without the ``encoder.layer.<index>.`` prefix."""
    prefix = f"encoder.layer.{index}."
    return {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}


def _random_layer(gen: torch.Generator, d: int, ffn: int) -> dict[str, torch.Tensor]:
    """A BERT layer's tensors with random values (every gain and bias away from 1 and 0)."""
    shapes = {"attention.self.query": (d, d), "attention.self.key": (d, d),
              "attention.self.value": (d, d), "attention.output.dense": (d, d),
              "intermediate.dense": (ffn, d), "output.dense": (d, ffn)}
    tensors = {}
    for name, shape in shapes.items():
        tensors[f"{name}.weight"] = rand(gen, *shape, scale=1.0 / math.sqrt(shape[1]))
        tensors[f"{name}.bias"] = rand(gen, shape[0], scale=0.1)
    for name in ("attention.output.LayerNorm", "output.LayerNorm"):
        tensors[f"{name}.weight"] = 1.0 + rand(gen, d, scale=0.2)
        tensors[f"{name}.bias"] = rand(gen, d, scale=0.2)
    return tensors


def _tiny_config(d: int, heads: int, ffn: int, act: str, eps: float) -> dict[str, Any]:
    return {"hidden_size": d, "num_attention_heads": heads, "intermediate_size": ffn,
            "hidden_act": act, "layer_norm_eps": eps, "model_type": "bert"}


def _bert_cases() -> list[Case]:
    tensors, config, hidden, keep = _minilm()
    gen = torch.Generator().manual_seed(82)
    # inputs of small variance, where eps matters as it does in the real model
    tiny_x = rand(gen, 2, 5, 16, scale=0.05)
    tiny_keep = padding_mask([5, 3])
    return [
        Case("all-MiniLM-L6-v2 layer 0 on a padded batch of 3 sentences",
             (hidden[0], keep, layer_tensors(tensors, 0), config)),
        Case("all-MiniLM-L6-v2 layer 3", (hidden[3], keep, layer_tensors(tensors, 3), config)),
        Case("layer 0 on one sentence without padding",
             (hidden[0][:1, :int(keep[0].sum())], keep[:1, :int(keep[0].sum())],
              layer_tensors(tensors, 0), config)),
        Case("a random tiny BERT layer: D=16, 4 heads, d_ff=24, 'gelu', eps=1e-12",
             (tiny_x, tiny_keep, _random_layer(gen, 16, 24),
              _tiny_config(16, 4, 24, "gelu", 1e-12))),
        Case("a random tiny layer with hidden_act='gelu_new' (tanh GELU), eps=1e-12",
             (tiny_x, tiny_keep, _random_layer(gen, 16, 40),
              _tiny_config(16, 2, 40, "gelu_new", 1e-12))),
        Case("a random tiny layer with layer_norm_eps=1e-6",
             (rand(gen, 2, 4, 8, scale=0.01), padding_mask([4, 2]), _quiet_layer(gen, 8, 16),
              _tiny_config(8, 2, 16, "gelu", 1e-6))),
    ]


def _quiet_layer(gen: torch.Generator, d: int, ffn: int) -> dict[str, torch.Tensor]:
    """A random layer whose attention adds little to small inputs: the first LayerNorm sees a
    variance near 1e-4, where eps=1e-6 and eps=1e-12 give visibly different outputs."""
    tensors = _random_layer(gen, d, ffn)
    for name in ("attention.self.value.bias", "attention.output.dense.bias"):
        tensors[name] = tensors[name] * 0.05
    return tensors


def check_bert_layer(bert_layer: Callable) -> None:
    """Check ``bert_layer(x, attention_mask, tensors, config)`` -> (B, T, D): one post-norm
    BERT layer built from course_lib parts and the checkpoint's tensors, compared at the real
    tokens with course_lib's EncoderBlock loaded with the same tensors, to 1e-5.
    """

    def check_one(got, case: Case) -> None:
        x, keep, tensors, config = case.args
        expected = reference_bert_layer(*case.args)
        if isinstance(got, tuple) and got and isinstance(got[0], torch.Tensor):
            raise CheckFailure(
                f"bert_layer returned a tuple; return only the layer's output tensor (B, T, D) "
                f"(an EncoderBlock or MultiHeadAttention returns (out, weights): take [0]) "
                f"(case '{case.name}')"
            )
        if isinstance(got, torch.Tensor) and got.shape == expected.shape:
            got = got.detach()  # built from modules with trainable parameters
            got, expected_real = got[keep], expected[keep]  # (real tokens, D)
            masked_case = Case(case.name, (x, keep, tensors, config))
            mistakes = [Misconception(_real(m.wrong, keep), m.message)
                        for m in BERT_LAYER_MISTAKES]
            compare_tensors(got, expected_real, masked_case, what="Your layer's output",
                            misconceptions=mistakes, atol=1e-5, rtol=1e-5)
            return
        compare_tensors(got, expected, case, what="Your layer's output", atol=1e-5, rtol=1e-5)

    run_cases("bert_layer", bert_layer, _bert_cases(), check_one)


def _real(wrong: Callable[..., Any], keep: torch.Tensor) -> Callable[..., Any]:
    def at_real_tokens(*args):
        out = wrong(*args)
        return None if out is None else out[keep]
    return at_real_tokens


# --------------------------------------------------------------------------------------------
# Exercise 8.3: gpt2_parameter_count(config)


def _fields(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, bool]:
    """(V, context, D, L, d_ff, tied) of a GPT-2 config dict."""
    d = config["n_embd"]
    d_ff = config.get("n_inner") or 4 * d
    return (config["vocab_size"], config["n_positions"], d, config["n_layer"], d_ff,
            config.get("tie_word_embeddings", True))


def reference_gpt2_parameter_count(config: Mapping[str, Any]) -> int:
    """Build the GPT-2 configuration as a course_lib DecoderLM on the meta device (no memory)
    and count its parameters (a tied output layer counts once)."""
    vocab, context, d, layers, d_ff, tied = _fields(config)
    with torch.device("meta"):
        model = DecoderLM(DecoderConfig(
            vocab_size=vocab, d_model=d, n_heads=config["n_head"], n_layers=layers,
            d_ff=d_ff, max_len=context, activation="gelu_tanh", tie_embeddings=tied))
    return count_parameters(model)


def _gpt2_mistakes(config: Mapping[str, Any]) -> list[tuple[int, str]]:
    """(wrong count, message) for plausible mistakes on one config."""
    vocab, context, d, layers, d_ff, tied = _fields(config)
    right = reference_gpt2_parameter_count(config)
    biases = layers * (4 * d + d_ff + d)  # qkv (3D) + out (D) + fc1 (d_ff) + fc2 (D)
    norm_params = (2 * layers + 1) * 2 * d  # two per block and the final one, gain and bias
    head = vocab * d
    return [
        (right - biases, "You left out the biases of the linear layers: per block 3D for the "
         "fused q/k/v projection, D for the attention output, d_ff and D for the MLP"),
        (right - context * d, "You left out the position embeddings: GPT-2 learns one vector "
         "of n_embd numbers for each of its n_positions positions"),
        (right + (head if tied else 0), "You counted the output layer as a matrix of its own, "
         "but GPT-2 ties it to the token embedding (tie_word_embeddings=True): the same "
         "vocab_size x n_embd matrix is used twice and counted once"),
        (right - (0 if tied else head), "With tie_word_embeddings=False the output layer has "
         "its own vocab_size x n_embd matrix: count it as well"),
        (right - norm_params, "You left out the LayerNorms: two per block and a final one, "
         "each with a gain and a bias of n_embd numbers"),
        (right - norm_params // 2, "Your LayerNorms have only a gain: each also has a bias "
         "(beta), n_embd numbers"),
        (right - 2 * d, "You left out the final LayerNorm (ln_f): a pre-norm model "
         "normalises once more before the output layer"),
        (right - layers * (d * d + d), "You counted three attention matrices (q, k, v); there "
         "is a fourth, the output projection (n_embd x n_embd plus its bias)"),
        (right - layers * (d_ff * d + d_ff), "You counted one MLP matrix; the MLP has two, "
         "n_embd -> d_ff and d_ff -> n_embd, each with a bias"),
        (right + layers * 2 * d * (4 * d - d_ff) + layers * (4 * d - d_ff),
         "You used an MLP width of 4 x n_embd although n_inner is set: the width is n_inner "
         "when it is not None"),
        (right + vocab, "You gave the output layer a bias: GPT-2's lm_head has "
         "none"),
    ]


GPT2_CONFIGS = [
    ("GPT-2 small", dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12,
                         n_head=12, n_inner=None, tie_word_embeddings=True)),
    ("GPT-2 medium", dict(vocab_size=50257, n_positions=1024, n_embd=1024, n_layer=24,
                          n_head=16, n_inner=None, tie_word_embeddings=True)),
    ("GPT-2 XL", dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25,
                      n_inner=None, tie_word_embeddings=True)),
    ("tiny, n_inner=40, untied", dict(vocab_size=100, n_positions=16, n_embd=8, n_layer=2,
                                      n_head=2, n_inner=40, tie_word_embeddings=False)),
    ("one layer, n_embd=4, n_inner=6", dict(vocab_size=7, n_positions=5, n_embd=4, n_layer=1,
                                            n_head=1, n_inner=6, tie_word_embeddings=True)),
]


def check_gpt2_parameter_count(gpt2_parameter_count: Callable) -> None:
    """Check ``gpt2_parameter_count(config)`` -> int for GPT-2 configurations given as dicts
    (vocab_size, n_positions, n_embd, n_layer, n_head, n_inner, tie_word_embeddings), against
    course_lib's DecoderLM built on the meta device."""
    cases = [Case(name, (config,)) for name, config in GPT2_CONFIGS]
    counts = []
    for case in cases:  # every answer first: a mistake must explain all of them
        got = call_learner(gpt2_parameter_count, case)
        count = require_count(got, "gpt2_parameter_count's result", case)
        counts.append(count)
    expected = [reference_gpt2_parameter_count(c.args[0]) for c in cases]
    if counts == expected:
        labels = "; ".join(c.name for c in cases)
        print(f"\u2705 gpt2_parameter_count is correct on all {len(cases)} test cases "
              f"({labels})")
        return
    first = next(i for i, (c, e) in enumerate(zip(counts, expected, strict=True)) if c != e)
    per_case = [_gpt2_mistakes(c.args[0]) for c in cases]
    for m, (_, message) in enumerate(per_case[first]):
        if all(count == mistakes[m][0] for count, mistakes in zip(counts, per_case, strict=True)):
            raise CheckFailure(f"{message} (seen on the case '{cases[first].name}')")
    raise CheckFailure(
        f"Your count {counts[first]:,} is off by {counts[first] - expected[first]:+,d} (case "
        f"'{cases[first].name}'). Count each part: token and position embeddings; per block "
        "two LayerNorms, the attention (fused q/k/v and output projection, with biases) and "
        "the MLP (two layers with biases); the final LayerNorm; the output layer only if "
        "it is not tied"
    )


# --------------------------------------------------------------------------------------------
# Exercise 8.4 (find the bug): mean_pool(hidden, attention_mask)


def _masked(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return hidden * keep[..., None].to(hidden.dtype)  # (B, T, D), padding zeroed


POOL_INSTRUMENT = (
    "The instrument that finds this bug: compare with a reference on padded batches, padded "
    "on the right AND on the left (here course_lib's mean_pool), or embed one sentence alone "
    "and inside a padded batch: the two vectors must be equal"
)

def _first_n(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The mean of each sequence's first n positions, n its number of real tokens: right only
    when the padding is on the right."""
    lengths = keep.sum(dim=1)  # (B,)
    first = torch.arange(keep.shape[1]) < lengths[:, None]  # (B, T): the first n positions
    return mean_pool(hidden, first)  # (B, D)


def _last_n(hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The same mistake the other way round: the last n positions."""
    return _first_n(hidden.flip(1), keep.flip(1))


POOL_MISTAKES = [
    Misconception(
        _first_n,
        "You averaged the FIRST n positions of each sequence (n = its number of real tokens): "
        "that is right only when the padding is on the right. In a left-padded batch the "
        "first positions are pads. Let the mask itself say which positions are real",
    ),
    Misconception(
        _last_n,
        "You averaged the LAST n positions of each sequence (n = its number of real tokens): "
        "that is right only when the padding is on the left. Let the mask itself say which "
        "positions are real",
    ),
    Misconception(
        lambda hidden, keep: hidden.sum(dim=1) / keep.sum(dim=1, keepdim=True).clamp(min=1),
        "Your sum still includes the pad vectors (you divide by the number of real tokens, but "
        "add up every position): zero the padded positions, or select the real ones, before "
        "summing",
    ),
    Misconception(
        lambda hidden, keep: hidden.mean(dim=1),
        "You averaged over every position, padding included: the pad vectors are junk, so the "
        "embedding of a short sentence depends on how long the batch is. Average over the real "
        "tokens only (where attention_mask is True)",
    ),
    Misconception(
        lambda hidden, keep: _masked(hidden, keep).sum(dim=1) / hidden.shape[1],
        "You zeroed the padding but divided by T, the padded length: divide each sum by that "
        "sentence's number of real tokens, attention_mask.sum(dim=1)",
    ),
    Misconception(
        lambda hidden, keep: _masked(hidden, keep).sum(dim=1) / keep.sum(),
        "You divided by the number of real tokens in the whole batch: each sentence needs its "
        "own count, attention_mask.sum(dim=1, keepdim=True)",
    ),
    Misconception(
        lambda hidden, keep: _masked(hidden, keep).sum(dim=1),
        "You summed the real token vectors but did not divide by their number: the mean is "
        "the sum / the sentence's number of real tokens",
    ),
    Misconception(
        lambda hidden, keep: _masked(hidden, ~keep).sum(dim=1) / (~keep).sum(
            dim=1, keepdim=True).clamp(min=1),
        "You averaged the padding positions: True in attention_mask marks the REAL tokens",
    ),
    Misconception(
        lambda hidden, keep: hidden[:, 0],
        "You returned the first token's vector ([CLS] pooling). The exercise asks for the "
        "mean over the real tokens",
    ),
    Misconception(
        lambda hidden, keep: hidden.masked_fill(~keep[..., None], float("-inf")).amax(dim=1),
        "You took the maximum over the tokens; the exercise asks for the mean",
    ),
    Misconception(
        lambda hidden, keep: F.normalize(mean_pool(hidden, keep), dim=-1),
        "Your vectors are scaled to length 1: that is a separate step (sentence_embedding "
        "does it after pooling); return the plain mean",
    ),
]


def check_mean_pool(mean_pool_fn: Callable) -> None:
    """Check ``mean_pool(hidden, attention_mask)`` -> (B, D): each sequence's mean over its real
    tokens, wherever the mask puts them (batches padded on the right and on the left), a
    sequence without real tokens giving zeros; against course_lib.pretrained."""

    def check_one(got, case: Case) -> None:
        hidden, keep = case.args
        expected = mean_pool(hidden, keep)
        empty = ~keep.any(dim=1)  # (B,) sequences without a real token
        if isinstance(got, torch.Tensor) and got.shape == expected.shape and bool(
                empty.any()) and bool(torch.isnan(got[empty]).any()) and bool(
                torch.isfinite(got[~empty]).all()):
            raise CheckFailure(
                "Your vector is NaN for a sequence with no real tokens: its sum is 0 and its "
                "count is 0, and 0 / 0 is NaN. Keep the count at least 1 (or 1e-9), e.g. "
                f".clamp(min=1e-9), so such a row gives zeros (case '{case.name}')"
            )
        try:
            compare_tensors(got, expected, case, what="Your pooled vectors",
                            misconceptions=POOL_MISTAKES)
        except CheckFailure as failure:
            raise CheckFailure(f"{failure}\n{POOL_INSTRUMENT}") from None

    gen = torch.Generator().manual_seed(84)
    cases = [
        Case("B=3, T=5, D=4, lengths 5, 2, 3", (rand(gen, 3, 5, 4), padding_mask([5, 2, 3]))),
        Case("no padding, B=2, T=3", (rand(gen, 2, 3, 6), padding_mask([3, 3]))),
        Case("one sequence of one token, padded to T=4",
             (rand(gen, 1, 4, 3), padding_mask([1], 4))),
        Case("large pad vectors (junk at padded positions)",
             (torch.cat([rand(gen, 2, 3, 5), rand(gen, 2, 4, 5, scale=100.0)], dim=1),
              padding_mask([3, 2], 7))),
        Case("T=1, B=4", (rand(gen, 4, 1, 8), padding_mask([1, 1, 1, 1]))),
        Case("a sequence with no real tokens (lengths 3, 0)",
             (rand(gen, 2, 3, 4), padding_mask([3, 0]))),
        Case("padded on the LEFT, lengths 2, 5, 3",
             (rand(gen, 3, 5, 4), padding_mask([2, 5, 3]).flip(1))),
        Case("padded on the left, large pad vectors",
             (torch.cat([rand(gen, 2, 4, 5, scale=100.0), rand(gen, 2, 3, 5)], dim=1),
              padding_mask([3, 2], 7).flip(1))),
    ]
    run_cases("mean_pool", mean_pool_fn, cases, check_one)


# --------------------------------------------------------------------------------------------
# Exercise 8.5 (predict, then verify): what BERT's masking rule does to a batch

MASKING_KEYS = ("mask_share", "changed_share", "scored_share")
N_CHARS = 63  # the chapter's Shakespeare characters
MASKING_TOL = 0.005


def measured_masking(n_rows: int = 1000, n_cols: int = 200) -> dict[str, float]:
    """The three shares, measured with course_lib's mask_tokens (p = 0.15) on random ids."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, N_CHARS, (n_rows, n_cols), generator=gen)
    inputs, labels = mask_tokens(ids, mask_id=N_CHARS, vocab_size=N_CHARS, generator=gen)
    return {"mask_share": float((inputs == N_CHARS).float().mean()),
            "changed_share": float((inputs != ids).float().mean()),
            "scored_share": float((labels != -100).float().mean())}


def _as_share(key: str, value: object) -> float:
    value = require_number(value, f"{key} (a share between 0 and 1, e.g. 0.25)")
    if not 0.0 <= value <= 1.0:
        hint = " (a percentage? write 25% as 0.25)" if 1.0 < value <= 100.0 else ""
        raise CheckFailure(f"{key} should be a share between 0 and 1, got {value}{hint}")
    return value


def _near(value: float, target: float) -> bool:
    return abs(value - target) <= MASKING_TOL


MASKING_MISTAKES = {
    "mask_share": [
        (0.15, "mask_share: 0.15 positions are *selected*, but only 80% of those show [MASK]"),
        (0.8, "mask_share: 0.8 is the share among the selected positions; as a share of all "
              "positions it is smaller"),
        (0.135, "mask_share: that is the share of changed tokens; [MASK] is only 80% of the "
                "selected ones"),
    ],
    "changed_share": [
        (0.15, "changed_share: 10% of the selected positions keep their own token, so fewer "
               "than 15% of the tokens change"),
        (0.12, "changed_share: the 10% of selected positions that get a random token change "
               "too (unless the draw happens to hit the original, 1 time in 63)"),
        (0.8, "changed_share: that is a share among the selected positions; as a share of all "
              "positions?"),
    ],
    "scored_share": [
        (0.12, "scored_share: the loss counts every selected position, not only the [MASK] "
               "ones: the model cannot tell which visible tokens are the random or unchanged "
               "10% and 10%, and must predict the original there too"),
        (0.135, "scored_share: the loss counts every selected position, the unchanged ones "
                "too"),
        (1.0, "scored_share: unselected positions carry the label -100, which the loss skips; "
              "predicting a token the model can see would only teach it to copy"),
    ],
}


def check_masking_predictions(predict_masking: Callable) -> None:
    """Grade exercise 8.5's three predictions, then print the measured shares.

    Args:
        predict_masking: takes no argument and returns a dict with the keys ``mask_share``,
            ``changed_share`` and ``scored_share`` (numbers in [0, 1]).
    """
    got = prediction_dict(call_learner(predict_masking, Case("your predictions")),
                          MASKING_KEYS, "predict_masking")
    shares = {key: _as_share(key, got[key]) for key in MASKING_KEYS}
    # p = 0.15; 80% [MASK], 10% a random token (the same one with chance 1/63), 10% unchanged
    expected = {"mask_share": 0.15 * 0.8, "scored_share": 0.15,
                "changed_share": 0.15 * (0.8 + 0.1 * (1 - 1 / N_CHARS))}
    for key in MASKING_KEYS:
        if _near(shares[key], expected[key]):
            continue
        for wrong, message in MASKING_MISTAKES[key]:
            if _near(shares[key], wrong):
                raise CheckFailure(message)
        raise CheckFailure(f"{key}: {shares[key]:.3f} is not it. Follow one position through "
                           "the rule: selected with probability 0.15, then 80/10/10")
    measured = measured_masking()
    print("\u2705 all three predictions are right. Measured with course_lib's mask_tokens on "
          "200,000 positions:")
    for key in MASKING_KEYS:
        print(f"    {key:14s} predicted {shares[key]:.3f}   measured {measured[key]:.3f}")


# in a notebook: a stub's check prints one not-done line, a failure only its message
wrap_checks(sys.modules[__name__])
