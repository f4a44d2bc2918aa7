"""The chapter 08 checks: each must accept every correct formulation, reject plausible wrong
answers with a message naming the mistake, and let an unsolved stub fail as itself."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import stub
from torch import nn

from course_lib.attention import MultiHeadAttention, causal_mask
from course_lib.blocks import EncoderBlock
from course_lib.course.checks import CheckFailure
from course_lib.course.checks.ch08 import (
    check_bert_layer,
    check_cross_attention,
    check_gpt2_parameter_count,
    check_masking_predictions,
    check_mean_pool,
    check_mlm_loss,
)
from course_lib.layers import FeedForward


@pytest.mark.parametrize("check", [check_mlm_loss, check_cross_attention, check_bert_layer,
                                   check_gpt2_parameter_count, check_mean_pool,
                                   check_masking_predictions])
def test_an_unsolved_stub_fails_as_itself(check):
    with pytest.raises(NotImplementedError, match="Exercise: write the body"):
        check(stub)


# ---------------------------------------------------------------------------- 8.1 mlm_loss


def mlm_cross_entropy(hidden, labels, embedding, dense, norm, bias):
    u = norm(F.gelu(dense(hidden)))
    return F.cross_entropy((u @ embedding.T + bias).transpose(1, 2), labels, ignore_index=-100)


def mlm_by_hand(hidden, labels, embedding, dense, norm, bias):
    """Another correct version: log-softmax, a boolean mask, a mean over the scored ones."""
    u = norm(0.5 * dense(hidden) * (1 + torch.erf(dense(hidden) / math.sqrt(2))))
    logp = torch.log_softmax(F.linear(u, embedding, bias), dim=-1)  # (B, T, V)
    scored = labels != -100
    return -logp[scored].gather(-1, labels[scored].unsqueeze(-1)).mean()


def mlm_loop(hidden, labels, embedding, dense, norm, bias):
    """A loop over the scored positions, summed and divided by their number."""
    total, count = torch.zeros(()), 0
    for b, t in zip(*torch.nonzero(labels != -100, as_tuple=True), strict=True):
        scores = norm(F.gelu(dense(hidden[b, t]))) @ embedding.T + bias  # (V,)
        total = total - torch.log_softmax(scores, -1)[labels[b, t]]
        count += 1
    return total / count


def mlm_reference_model(hidden, labels, embedding, dense, norm, bias):
    """The loss of a MaskedLM whose head holds these very pieces (course_lib's own code)."""
    from course_lib.configs import EncoderConfig
    from course_lib.models import MaskedLM, lm_loss

    model = MaskedLM(EncoderConfig(vocab_size=embedding.shape[0], d_model=embedding.shape[1],
                                   n_heads=1, n_layers=1))
    model.head_dense, model.head_norm = dense, norm
    with torch.no_grad():
        model.encoder.embeddings.token.weight.copy_(embedding)
        model.lm_head.bias.copy_(bias)
    u = model.head_norm(model.head_activation(model.head_dense(hidden)))
    return lm_loss(model.lm_head(u), labels)


@pytest.mark.parametrize("fn", [mlm_cross_entropy, mlm_by_hand, mlm_loop, mlm_reference_model])
def test_mlm_loss_accepts_correct_answers(fn, capsys):
    check_mlm_loss(fn)
    assert "mlm_loss equals course_lib's MaskedLM" in capsys.readouterr().out


def _mlm_wrong(*, act=F.gelu, norm_first=False, dense_on=True, norm_on=True, bias_on=True,
               reduce="scored", labels_as="skip", dim=-1):
    def fn(hidden, labels, embedding, dense, norm, bias):
        h = dense(hidden) if dense_on else hidden
        u = act(norm(h)) if norm_first else (norm(act(h)) if norm_on else act(h))
        logp = torch.log_softmax(u @ embedding.T + (bias if bias_on else 0), dim=dim)
        scored = labels != -100
        target = labels.clamp(min=0)
        nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)  # (B, T)
        if labels_as == "skip":
            nll = torch.where(scored, nll, torch.zeros(()))
        return {"scored": nll.sum() / scored.sum(), "all": nll.mean(), "sum": nll.sum()}[reduce]
    return fn


WRONG_MLM = {
    "mean over every position": (_mlm_wrong(reduce="all"), "averaged over every position"),
    "-100 clamped to token 0": (_mlm_wrong(labels_as="class 0", reduce="all"), "token 0"),
    "-100 clamped, mean over scored": (_mlm_wrong(labels_as="class 0"), "token 0"),
    "sum, not mean": (_mlm_wrong(reduce="sum"), "SUM over the scored"),
    "no bias": (_mlm_wrong(bias_on=False), "per-token bias"),
    "no LayerNorm": (_mlm_wrong(norm_on=False), "skips its LayerNorm"),
    "LayerNorm before GELU": (_mlm_wrong(norm_first=True), "LayerNorm before the GELU"),
    "tanh GELU": (_mlm_wrong(act=lambda t: F.gelu(t, approximate="tanh")), "tanh"),
    "ReLU": (_mlm_wrong(act=F.relu), "ReLU"),
    "no activation": (_mlm_wrong(act=lambda t: t), "no activation"),
    "no dense layer": (_mlm_wrong(dense_on=False), "skips its dense layer"),
    "softmax over positions": (_mlm_wrong(dim=1), r"over the positions \(dim 1\)"),
    "a float, not a tensor": (lambda *a: mlm_cross_entropy(*a).item(), "should be a tensor"),
    "-100 used as an index": (lambda h, lab, e, d, n, b: -torch.log_softmax(
        n(F.gelu(d(h))) @ e.T + b, -1).gather(-1, lab.unsqueeze(-1)).mean(),
        r"(?s)raised .*-100 is not a token id"),
}


@pytest.mark.parametrize("name", list(WRONG_MLM))
def test_mlm_loss_rejects_wrong_answers(name):
    fn, message = WRONG_MLM[name]
    with pytest.raises(CheckFailure, match=message):
        check_mlm_loss(fn)


def test_mlm_loss_names_no_mistake_it_did_not_recognise():
    def off_a_little(*args):
        return mlm_cross_entropy(*args) * 1.01

    with pytest.raises(CheckFailure, match="right shape but wrong values") as info:
        check_mlm_loss(off_a_little)
    assert "seen on the case" not in str(info.value)


# ------------------------------------------------------------------------- 8.1 cross_attention


def cross_by_hand(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads, *, sources="dee",
                  scale=None, causal=False, biases=True, project=True, order=(0, 1, 2),
                  transpose=True, layout="out_in"):
    """A straightforward correct version, with switches that make it wrong."""
    batch, _, d = x_dec.shape
    dh = d // n_heads
    ws, bs = w_qkv.chunk(3), b_qkv.chunk(3)
    inputs = {"d": x_dec, "e": h_enc}
    heads = []
    for src, i in zip(sources, order, strict=False):
        w = ws[i] if layout == "out_in" else ws[i].T
        t = inputs[src] @ w.T + (bs[i] if biases else 0)  # (B, L, D)
        if transpose:
            heads.append(t.view(batch, t.shape[1], n_heads, dh).transpose(1, 2))
        else:
            heads.append(t.reshape(batch, n_heads, t.shape[1], dh))
    q, k, v = heads
    scores = q @ k.transpose(-2, -1) / math.sqrt(dh if scale is None else scale(d, dh))
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2]), float("-inf"))
    out = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(batch, q.shape[2], d)
    if not project:
        return out
    w_o = w_out if layout == "out_in" else w_out.T
    return out @ w_o.T + (b_out if biases else 0)


def cross_einsum(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads):
    d = x_dec.shape[-1]
    dh = d // n_heads
    w_q, w_k, w_v = (w.reshape(n_heads, dh, d) for w in w_qkv.chunk(3))
    b_q, b_k, b_v = (b.reshape(n_heads, 1, dh) for b in b_qkv.chunk(3))
    q = torch.einsum("btd,hed->bhte", x_dec, w_q) + b_q
    k = torch.einsum("bsd,hed->bhse", h_enc, w_k) + b_k
    v = torch.einsum("bsd,hed->bhse", h_enc, w_v) + b_v
    weights = torch.softmax(torch.einsum("bhte,bhse->bhts", q, k) / dh ** 0.5, dim=-1)
    out = torch.einsum("bhts,bhse->bthe", weights, v).reshape(*x_dec.shape[:2], d)
    return F.linear(out, w_out, b_out)


def cross_with_course_lib(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads):
    layer = MultiHeadAttention(x_dec.shape[-1], n_heads)
    with torch.no_grad():
        layer.qkv_proj.weight.copy_(w_qkv)
        layer.qkv_proj.bias.copy_(b_qkv)
        layer.out_proj.weight.copy_(w_out)
        layer.out_proj.bias.copy_(b_out)
    return layer(x_dec, h_enc)[0]


def cross_with_sdpa_loop(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads):
    d = x_dec.shape[-1]
    dh = d // n_heads
    q = F.linear(x_dec, w_qkv[:d], b_qkv[:d])
    k = F.linear(h_enc, w_qkv[d:2 * d], b_qkv[d:2 * d])
    v = F.linear(h_enc, w_qkv[2 * d:], b_qkv[2 * d:])
    heads = [F.scaled_dot_product_attention(q[..., i * dh:(i + 1) * dh],
                                            k[..., i * dh:(i + 1) * dh],
                                            v[..., i * dh:(i + 1) * dh])
             for i in range(n_heads)]
    return F.linear(torch.cat(heads, dim=-1), w_out, b_out)


@pytest.mark.parametrize("fn", [cross_by_hand, cross_einsum, cross_with_course_lib,
                                cross_with_sdpa_loop])
def test_cross_attention_accepts_correct_answers(fn, capsys):
    check_cross_attention(fn)
    assert "cross_attention is correct" in capsys.readouterr().out


def _cross_wrong(**changes):
    return lambda *args: cross_by_hand(*args, **changes)


def _keys_from_decoder(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads):
    # crashes when T != S: the check's hint explains where keys and values come from
    return cross_by_hand(x_dec, h_enc, w_qkv, b_qkv, w_out, b_out, n_heads, sources="dde")


WRONG_CROSS = {
    "self-attention": (_cross_wrong(sources="ddd"), "self-attention over the decoder"),
    "keys from the decoder": (_keys_from_decoder, "keys come from the decoder"),
    "values from the decoder": (_cross_wrong(sources="ded"), "values come from the decoder"),
    "roles swapped": (_cross_wrong(sources="edd"), "roles are swapped"),
    "causal mask": (_cross_wrong(causal=True), "causal mask"),
    "unscaled": (_cross_wrong(scale=lambda d, dh: 1), "not scaled"),
    "sqrt(D)": (_cross_wrong(scale=lambda d, dh: d), r"sqrt\(D\), the model width"),
    "no output projection": (_cross_wrong(project=False), "output projection"),
    "no biases": (_cross_wrong(biases=False), "left out the biases"),
    "q and k rows swapped": (_cross_wrong(order=(1, 0, 2)), r"queries use W_k"),
    "heads without transpose": (_cross_wrong(transpose=False), "heads mix positions"),
    "weights not transposed": (_cross_wrong(layout="in_out"), "without transposing"),
    "returns a tuple": (lambda *a: (cross_by_hand(*a), None), "not a tuple"),
    "in place": (lambda x, *rest: cross_by_hand(x.mul_(2.0), *rest), "in place"),
}


@pytest.mark.parametrize("name", list(WRONG_CROSS))
def test_cross_attention_rejects_wrong_answers(name):
    fn, message = WRONG_CROSS[name]
    with pytest.raises(CheckFailure, match=message):
        check_cross_attention(fn)


def test_a_crash_on_unequal_lengths_explains_where_keys_and_values_come_from():
    def keys_from_decoder_only_when_the_lengths_differ(x_dec, h_enc, *rest):
        if x_dec.shape[1] == h_enc.shape[1]:
            return cross_by_hand(x_dec, h_enc, *rest)
        return cross_by_hand(x_dec, h_enc, *rest, sources="dde")  # (B,H,T,T) @ (B,H,S,Dh)

    with pytest.raises(CheckFailure, match=r"raised RuntimeError(.|\n)*keys and values from "
                                           r"h_enc"):
        check_cross_attention(keys_from_decoder_only_when_the_lengths_differ)


# ----------------------------------------------------------------------------- 8.2 bert_layer

QKV = ("query", "key", "value")
ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh"}


def _copy_layer(tensors, attn, n1, ff, n2, order=(0, 1, 2)):
    with torch.no_grad():
        for kind in ("weight", "bias"):
            attn.qkv_proj.get_parameter(kind).copy_(
                torch.cat([tensors[f"attention.self.{QKV[i]}.{kind}"] for i in order]))
            attn.out_proj.get_parameter(kind).copy_(tensors[f"attention.output.dense.{kind}"])
            n1.get_parameter(kind).copy_(tensors[f"attention.output.LayerNorm.{kind}"])
            ff.fc1.get_parameter(kind).copy_(tensors[f"intermediate.dense.{kind}"])
            ff.fc2.get_parameter(kind).copy_(tensors[f"output.dense.{kind}"])
            n2.get_parameter(kind).copy_(tensors[f"output.LayerNorm.{kind}"])


def bert_layer_parts(x, attention_mask, tensors, config, *, pre_norm=False, eps=None,
                     act=None, use_mask=True, order=(0, 1, 2), residual=("attn", "ff")):
    """Correct by default: course_lib's attention and feed-forward, nn.LayerNorm."""
    d, h = config["hidden_size"], config["num_attention_heads"]
    eps = config["layer_norm_eps"] if eps is None else eps
    attn = MultiHeadAttention(d, h)
    ff = FeedForward(d, config["intermediate_size"], activation=act or ACT[config["hidden_act"]])
    n1, n2 = nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps)
    _copy_layer(tensors, attn, n1, ff, n2, order)
    mask = attention_mask if use_mask else None
    if pre_norm:
        x = x + attn(n1(x), attention_mask=mask)[0]
        return x + ff(n2(x))
    a = attn(x, attention_mask=mask)[0]
    x = n1(x + a) if "attn" in residual else n1(a)
    return n2(x + ff(x)) if "ff" in residual else n2(ff(x))


def bert_layer_functional(x, attention_mask, tensors, config):
    """Everything with torch.nn.functional, straight from the checkpoint's names."""
    t, d, h = tensors, config["hidden_size"], config["num_attention_heads"]
    eps = config["layer_norm_eps"]
    approximate = "tanh" if config["hidden_act"] == "gelu_new" else "none"
    batch, length, _ = x.shape

    def heads(name):
        y = F.linear(x, t[f"attention.self.{name}.weight"], t[f"attention.self.{name}.bias"])
        return y.view(batch, length, h, d // h).transpose(1, 2)

    keep = attention_mask[:, None, None, :]  # (B, 1, 1, S)
    ctx = F.scaled_dot_product_attention(heads("query"), heads("key"), heads("value"),
                                         attn_mask=keep)
    ctx = ctx.transpose(1, 2).reshape(batch, length, d)
    a = F.linear(ctx, t["attention.output.dense.weight"], t["attention.output.dense.bias"])
    x = F.layer_norm(x + a, (d,), t["attention.output.LayerNorm.weight"],
                     t["attention.output.LayerNorm.bias"], eps)
    hidden = F.gelu(F.linear(x, t["intermediate.dense.weight"], t["intermediate.dense.bias"]),
                    approximate=approximate)
    y = F.linear(hidden, t["output.dense.weight"], t["output.dense.bias"])
    return F.layer_norm(x + y, (d,), t["output.LayerNorm.weight"], t["output.LayerNorm.bias"],
                        eps)


def bert_layer_block(x, attention_mask, tensors, config):
    """course_lib's EncoderBlock, post-norm."""
    block = EncoderBlock(config["hidden_size"], config["num_attention_heads"],
                         config["intermediate_size"], activation=ACT[config["hidden_act"]],
                         norm_first=False, eps=config["layer_norm_eps"])
    _copy_layer(tensors, block.self_attn, block.attn_norm, block.ff, block.ff_norm)
    return block(x, attention_mask=attention_mask)[0]


@pytest.mark.parametrize("fn", [bert_layer_parts, bert_layer_functional, bert_layer_block])
def test_bert_layer_accepts_correct_answers(fn, capsys):
    check_bert_layer(fn)
    assert "bert_layer is correct" in capsys.readouterr().out


def _bert_wrong(**changes):
    return lambda *args: bert_layer_parts(*args, **changes)


def _always_exact_gelu(x, attention_mask, tensors, config):
    return bert_layer_parts(x, attention_mask, tensors, config, act="gelu")


def _always_tanh_gelu(x, attention_mask, tensors, config):
    return bert_layer_parts(x, attention_mask, tensors, config, act="gelu_tanh")


WRONG_BERT = {
    "pre-norm": (_bert_wrong(pre_norm=True), "pre-norm"),
    "eps 1e-5": (_bert_wrong(eps=1e-5), "eps=1e-5"),
    "no padding mask": (_bert_wrong(use_mask=False), "attend to the padding"),
    "q and k swapped": (_bert_wrong(order=(1, 0, 2)), "queries and keys are swapped"),
    "relu": (_bert_wrong(act="relu"), "uses ReLU"),
    "tanh GELU always": (_always_tanh_gelu, "GELU is the wrong one"),
    "exact GELU always (config says gelu_new)": (_always_exact_gelu, "GELU is the wrong one"),
    "eps 1e-12 hard-coded": (_bert_wrong(eps=1e-12), r"eps=1e-12 whatever the config says"
                                                      r"(.|\n)*Read eps from the config"),
    "no residual around attention": (_bert_wrong(residual=("ff",)),
                                     "no residual connection around the attention"),
    "no residual around the FFN": (_bert_wrong(residual=("attn",)),
                                   "no residual connection around the feed-forward"),
    "no residuals at all": (_bert_wrong(residual=()), "no residual connections"),
    "returns (out, weights)": (lambda *a: (bert_layer_parts(*a), None), "return only"),
}


@pytest.mark.parametrize("name", list(WRONG_BERT))
def test_bert_layer_rejects_wrong_answers(name):
    fn, message = WRONG_BERT[name]
    with pytest.raises(CheckFailure, match=message):
        check_bert_layer(fn)


def test_bert_layer_check_leaves_the_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(2)
    torch.manual_seed(3)
    check_bert_layer(bert_layer_functional)
    assert torch.equal(torch.rand(2), expected)


# -------------------------------------------------------------------- 8.3 gpt2_parameter_count


def count_by_formula(config, *, biases=True, positions=True, tie_twice=False, norms=2,
                     final_norm=True, attention_mats=4, mlp_mats=2, use_inner=True,
                     untie=True, head_bias=False):
    v, p, d, layers = (config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer"))
    f = (config["n_inner"] or 4 * d) if use_inner else 4 * d
    attn = (3 * d * d + (3 * d if biases else 0)) + (d * d + (d if biases else 0))
    if attention_mats == 3:
        attn -= d * d + (d if biases else 0)
    mlp = d * f + (f if biases else 0) + (f * d + (d if biases else 0))
    if mlp_mats == 1:
        mlp -= f * d + f if biases else f * d
    ln = norms * d
    total = v * d + (p * d if positions else 0) + layers * (2 * ln + attn + mlp)
    total += ln if final_norm else 0
    tied = config["tie_word_embeddings"]
    if tie_twice or (not tied and untie):
        total += v * d
    return total + (v if head_bias else 0)


def count_with_modules(config):
    """Count a model built from torch.nn layers (not course_lib's)."""
    d = config["n_embd"]
    f = config["n_inner"] or 4 * d
    block = nn.ModuleList([nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d),
                           nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(f, d)])
    per_block = sum(p.numel() for p in block.parameters())
    total = (config["vocab_size"] + config["n_positions"]) * d
    total += config["n_layer"] * per_block + 2 * d
    if not config["tie_word_embeddings"]:
        total += config["vocab_size"] * d
    return total


@pytest.mark.parametrize("fn", [count_by_formula, count_with_modules,
                                lambda c: np.int64(count_by_formula(c))])  # numpy integers too
def test_gpt2_parameter_count_accepts_correct_answers(fn, capsys):
    check_gpt2_parameter_count(fn)
    assert "gpt2_parameter_count is correct" in capsys.readouterr().out


@pytest.mark.parametrize("fn, match", [
    (lambda c: float(count_by_formula(c)), r"return an int.*int\(\.\.\.\) makes it an int"),
    (lambda c: torch.tensor(count_by_formula(c)), r"return an int.*\.item\(\)"),
])  # the one rule for counts in every check: a whole float or a tensor is not an int
def test_gpt2_parameter_count_refuses_a_count_that_is_not_an_int(fn, match):
    with pytest.raises(CheckFailure, match=match):
        check_gpt2_parameter_count(fn)


def _count_wrong(**changes):
    return lambda config: count_by_formula(config, **changes)


WRONG_COUNT = {
    "no biases": (_count_wrong(biases=False), "left out the biases"),
    "no positions": (_count_wrong(positions=False), "position embeddings"),
    "tied head counted twice": (_count_wrong(tie_twice=True), "counted once"),
    "untied head forgotten": (_count_wrong(untie=False), "its own vocab_size x n_embd"),
    "no LayerNorms": (_count_wrong(norms=0), "left out the LayerNorms"),
    "LayerNorm gains only": (_count_wrong(norms=1), "only a gain"),
    "no final LayerNorm": (_count_wrong(final_norm=False), "final LayerNorm"),
    "three attention matrices": (_count_wrong(attention_mats=3), "fourth"),
    "one MLP matrix": (_count_wrong(mlp_mats=1), "one MLP matrix"),
    "n_inner ignored": (_count_wrong(use_inner=False), "n_inner"),
    "lm_head bias": (_count_wrong(head_bias=True), "bias"),
    "off by one": (lambda c: count_by_formula(c) + 1, r"off by \+1"),
    "a float": (lambda c: count_by_formula(c) + 0.5, "whole number"),
    "None": (lambda c: None, "whole number"),
}


@pytest.mark.parametrize("name", list(WRONG_COUNT))
def test_gpt2_parameter_count_rejects_wrong_answers(name):
    fn, message = WRONG_COUNT[name]
    with pytest.raises(CheckFailure, match=message):
        check_gpt2_parameter_count(fn)


def test_gpt2_small_is_124m():
    from course_lib.course.checks.ch08 import GPT2_CONFIGS, reference_gpt2_parameter_count

    counts = {name: reference_gpt2_parameter_count(c) for name, c in GPT2_CONFIGS}
    # the released checkpoints' sizes (Hugging Face's GPT2LMHeadModel counts the tied head once)
    assert counts["GPT-2 small"] == 124_439_808
    assert counts["GPT-2 medium"] == 354_823_168
    assert counts["GPT-2 XL"] == 1_557_611_200


# ------------------------------------------------------------------------------ 8.4 mean_pool


def pool_masked_sum(hidden, attention_mask):
    m = attention_mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


def pool_loop(hidden, attention_mask):
    rows = []
    for h, keep in zip(hidden, attention_mask, strict=False):
        rows.append(h[keep].mean(0) if keep.any() else torch.zeros(h.shape[-1]))
    return torch.stack(rows)


def pool_einsum(hidden, attention_mask):
    m = attention_mask.float()
    return torch.einsum("btd,bt->bd", hidden, m) / m.sum(1, keepdim=True).clamp(min=1)


@pytest.mark.parametrize("fn", [pool_masked_sum, pool_loop, pool_einsum])
def test_mean_pool_accepts_correct_answers(fn, capsys):
    check_mean_pool(fn)
    assert "mean_pool is correct" in capsys.readouterr().out


def _sum(hidden, keep):
    return (hidden * keep[..., None]).sum(1)


WRONG_POOL = {
    "pads included": (lambda h, k: h.mean(1), "padding included"),
    "divided by T": (lambda h, k: _sum(h, k) / h.shape[1], "divided by T"),
    "divided by the batch's count": (lambda h, k: _sum(h, k) / k.sum(), "whole batch"),
    "no division": (lambda h, k: _sum(h, k), "did not divide"),
    "mask inverted": (lambda h, k: pool_masked_sum(h, ~k), "REAL tokens"),
    "CLS": (lambda h, k: h[:, 0], r"\[CLS\] pooling"),
    "max": (lambda h, k: h.masked_fill(~k[..., None], -1e9).amax(1), "maximum"),
    "normalised": (lambda h, k: F.normalize(pool_masked_sum(h, k), dim=-1), "length 1"),
    "0 / 0": (lambda h, k: _sum(h, k) / k.sum(1, keepdim=True), "0 / 0 is NaN"),
    "keepdim forgotten": (lambda h, k: _sum(h, k) / k.sum(1), "shape|raised"),
    "pads summed": (lambda h, k: h.sum(1) / k.sum(1, keepdim=True).clamp(min=1e-9),
                    "still includes the pad vectors"),
    # the planted bug of the exercise: the first n positions, right only for right padding
    "planted: the first n positions": (lambda h, k: torch.stack([
        h[i, :n].mean(0) if n else h.new_zeros(h.shape[-1])
        for i, n in enumerate(k.sum(1).tolist())]), "FIRST n positions"),
    "the last n positions": (lambda h, k: torch.stack([
        h[i, h.shape[1] - n:].mean(0) if n else h.new_zeros(h.shape[-1])
        for i, n in enumerate(k.sum(1).tolist())]), "LAST n positions"),
}


@pytest.mark.parametrize("name", list(WRONG_POOL))
def test_mean_pool_rejects_wrong_answers(name):
    fn, message = WRONG_POOL[name]
    with pytest.raises(CheckFailure, match=message):
        check_mean_pool(fn)


def test_mean_pool_failures_name_the_instrument_that_finds_the_bug():
    with pytest.raises(CheckFailure, match="instrument that finds this bug.*padded batch"):
        check_mean_pool(WRONG_POOL["planted: the first n positions"][0])


def test_the_planted_bug_is_not_named_on_a_failure_that_is_not_it():
    with pytest.raises(CheckFailure) as info:
        check_mean_pool(WRONG_POOL["pads summed"][0])
    assert "FIRST n" not in str(info.value)


def test_the_planted_bug_of_exercise_8_4_really_changes_a_left_padded_sentence():
    from course_lib.pretrained import mean_pool

    hidden = torch.randn(2, 5, 4)
    keep = torch.tensor([[True, True, False, False, False], [True] * 5])
    buggy = WRONG_POOL["planted: the first n positions"][0]
    alone = mean_pool(hidden[:1, :2], keep[:1, :2])
    assert torch.allclose(buggy(hidden, keep)[:1], alone)  # right padding: no symptom
    left_h, left_k = hidden.flip(1), keep.flip(1)
    assert not torch.allclose(buggy(left_h, left_k)[:1], alone)
    assert torch.allclose(pool_masked_sum(left_h, left_k)[:1], alone)


# ------------------------------------------------------------ 8.5 what the masking rule does


def predict_exact():
    return {"mask_share": 0.15 * 0.8, "changed_share": 0.15 * (0.8 + 0.1 * 62 / 63),
            "scored_share": 0.15}


def predict_rounded():  # 0.12 + 0.015, forgetting that a random draw may hit the original
    return {"scored_share": 0.15, "mask_share": 0.12, "changed_share": 0.135}


def predict_other_types():
    return {"mask_share": np.float64(0.12), "changed_share": np.float32(0.1348),
            "scored_share": 3 / 20}


@pytest.mark.parametrize("fn", [predict_exact, predict_rounded, predict_other_types])
def test_masking_predictions_accept_correct_answers(fn, capsys):
    check_masking_predictions(fn)
    out = capsys.readouterr().out
    assert "all three predictions are right" in out and "measured" in out


def _with(**changes):
    return lambda: {**predict_exact(), **changes}


WRONG_MASKING = {
    "selected, not masked": (_with(mask_share=0.15), "only 80% of those show"),
    "share among the selected": (_with(mask_share=0.8), "among the selected"),
    "every selected token changes": (_with(changed_share=0.15), "keep their own token"),
    "random replacements forgotten": (_with(changed_share=0.12), "random token change too"),
    "only [MASK] scored": (_with(scored_share=0.12), "counts every selected position"),
    "every position scored": (_with(scored_share=1.0), "-100"),
    "a percentage": (_with(mask_share=12.0), "percentage"),
    "every position scored, as an int": (_with(scored_share=1), "-100"),  # a number all the same
    "a tensor": (_with(changed_share=torch.tensor(0.1348)), r"\.item\(\)"),
    "far off": (_with(scored_share=0.3), "Follow one position"),
    "not a number": (_with(scored_share="15%"), "should be a number"),
    "a key missing": (lambda: {"mask_share": 0.12, "changed_share": 0.135}, "lacks the key"),
    "not a dict": (lambda: [0.12, 0.135, 0.15], "should return a dict"),
}


@pytest.mark.parametrize("name", list(WRONG_MASKING))
def test_masking_predictions_reject_wrong_answers(name):
    fn, message = WRONG_MASKING[name]
    with pytest.raises(CheckFailure, match=message):
        check_masking_predictions(fn)


def test_the_measured_shares_agree_with_the_rule():
    from course_lib.course.checks.ch08 import measured_masking

    measured = measured_masking()
    expected = predict_exact()
    for key, value in measured.items():
        assert abs(value - expected[key]) < 0.004, key  # 200,000 positions: a few std
