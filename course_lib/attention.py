"""Attention: scores, softmax, scaled dot-product attention, masks and multi-head attention.

Shape legend: B batch, H heads, T query length, S key/value length, D d_model, Dh head dim;
``(...)`` stands for any leading dimensions, e.g. (B, H).

Masks are boolean, True = may attend (as in ``F.scaled_dot_product_attention``), and broadcast
against the scores (..., T, S): (T, S), (H, T, S), (B, 1, T, S) or (B, H, T, S). Masked scores
become -inf; a query whose every key is masked gets zero weights and a zero output, not NaN
(as PyTorch's fused attention does). Padding is ``attention_mask`` (B, S), True/1 = a real
token, as in Hugging Face; torch.nn's ``key_padding_mask`` is its negation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    check_bools,
    check_positive_ints,
    checks_wanted,
    require_bool_mask,
    require_broadcastable,
    require_dtype_of,
    require_features,
    require_floating,
    require_integer_tensor,
    require_ndim,
    require_non_negative_int,
    require_padding_mask,
    require_positive_int,
    require_positive_number,
    require_probability,
    require_same_dtype,
    require_size,
    require_tensor,
    shape_of,
)
from .cache import LayerKVCache, check_fits
from .positions import RotaryEmbedding


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax along ``dim``; a row that is all -inf gives zeros, not NaN.

    Args:
        x: scores of any shape, floating point.
        dim: the axis to normalise over (attention: the last one, over the keys).

    Returns:
        Same shape as ``x``: >= 0 and summing to 1 along ``dim`` (0 for a fully masked row).
    """
    _check_softmax(x)
    # softmax(x)_j = exp(x_j - m) / sum_i exp(x_i - m), m = max_i x_i: exp cannot overflow
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(x - row_max)  # an all -inf row shifts by 0 and gives exp = 0
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))  # 0 / 1 = 0, not NaN


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Query-key affinities, scores[..., t, s] = scale * q_t . k_s.

    Args:
        q: queries, (..., T, Dh).
        k: keys, (..., S, Dh).
        scale: > 0; defaults to 1/sqrt(Dh) (1.0 gives the unscaled scores of eq. 8).

    Returns:
        Scores (..., T, S), before any softmax.
    """
    check_qkv(q, k, scale=scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (q @ k.transpose(-2, -1)) * scale  # q k^T / sqrt(Dh): (..., T, S)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (out, weights): softmax(q k^T / sqrt(Dh) + attn_bias, masked) v and the weights
    -- unlike torch's ``F.scaled_dot_product_attention``, which returns out only.

    Args:
        q: queries, (..., T, Dh).
        k: keys, (..., S, Dh).
        v: values, (..., S, Dv).
        mask: boolean, True = may attend, broadcastable to (..., T, S).
        attn_bias: float, added to the scores (e.g. ALiBi), broadcastable to (..., T, S).
        scale: > 0; defaults to 1/sqrt(Dh).
        dropout_p: dropout on the weights (0 at evaluation).

    Returns:
        ``(out, weights)``: out (..., T, Dv) and weights (..., T, S).
    """
    _check_sdpa(q, k, v, mask, attn_bias, scale)
    scores = attention_scores(q, k, scale=scale)  # (..., T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    weights = softmax(scores, dim=-1)  # (..., T, S), each row sums to 1 over the keys
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights  # (..., T, Dv), (..., T, S)


def causal_mask(
    n_queries: int, n_keys: int | None = None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean future mask, (T, S): query t may attend to key s only if s <= t + S - T.

    The queries are the last T of S positions (lower-right aligned, as when generating with a
    cache, and as Hugging Face does); for T == S the mask is lower-triangular.
    """
    n_keys = n_queries if n_keys is None else n_keys
    check_positive_ints(n_queries=n_queries, n_keys=n_keys)
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return torch.tril(ones, diagonal=n_keys - n_queries)  # (T, S)


def padding_mask(
    lengths: Sequence[int] | torch.Tensor,
    max_len: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """An ``attention_mask`` for right-padded sequences, (B, S): True marks a real token.

    Args:
        lengths: the true length of each sequence, B integers.
        max_len: the padded length S (defaults to the longest length).

    Returns:
        Boolean (B, S); ``mask[:, None, None, :]`` broadcasts against scores (B, H, T, S).
    """
    lengths = require_lengths(lengths, max_len, device)  # (B,) integers
    if max_len is None:
        max_len = int(lengths.max()) if lengths.numel() else 0
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, S)


def as_bool_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A padding mask as booleans, True = a real token: a bool mask as it is, the 0/1 integers
    that tokenizers return compared with 0; None stays None. The one place masks are converted."""
    if attention_mask is None or attention_mask.dtype == torch.bool:
        return attention_mask
    return attention_mask != 0


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, Dh): head h gets features h*Dh .. (h+1)*Dh - 1 of every position.

    The transpose matters: ``view(B, H, T, Dh)`` alone has the right shape but cuts the (T, D)
    block row-major and hands each head a mixture of positions.

    Args:
        x: (B, T, D), e.g. the queries of every head side by side, ``x @ W_q.T``.
        n_heads: H, which must divide D.

    Returns:
        (B, H, T, Dh), a view of ``x``: the heads as a batch axis.
    """
    _check_split_heads(x, n_heads)
    batch, seq_len, d_model = x.shape
    return x.view(batch, seq_len, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, T, Dh)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh): the heads' outputs concatenated (eq. 24), the inverse of
    :func:`split_heads`."""
    _check_merge_heads(x)
    batch, n_heads, seq_len, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, n_heads * d_head)  # (B, T, D)


def combine_masks(
    mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    n_queries: int,
    n_keys: int,
    device: torch.device,
) -> torch.Tensor | None:
    """AND of every mask that applies (True = may attend), broadcastable to (B, H, T, S); None
    when nothing is masked. ``attention_mask`` is (B, S) boolean, True for real keys."""
    combined = mask
    if attention_mask is not None:
        padding = attention_mask[:, None, None, :]  # (B, 1, 1, S)
        combined = padding if combined is None else combined & padding
    if is_causal:
        future = causal_mask(n_queries, n_keys, device=device)  # (T, S)
        combined = future if combined is None else combined & future
    return combined


class MultiHeadAttention(nn.Module):
    """Multi-head attention, eqs. 22-26: self-attention (keys from ``x``) or cross-attention
    (keys from ``context``); with ``n_kv_heads < n_heads``, grouped-query attention (GQA;
    multi-query attention, MQA, for ``n_kv_heads=1``).

    One fused projection holds the rows [W_q; W_k; W_v], shape (3D, D), like
    ``nn.MultiheadAttention.in_proj_weight`` (with GQA, (D + 2 Hkv Dh, D): W_k and W_v have
    Hkv Dh rows each). ``return_weights=True`` runs course_lib's
    :func:`scaled_dot_product_attention` (the weights can be returned); otherwise PyTorch's
    fused kernel computes the same function.

    Args:
        d_model: D, divisible by n_heads.
        n_heads: H; each head works in Dh = D / H dimensions.
        dropout: dropout on the attention weights during training.
        bias: whether the projections have biases (as in nn.Linear).
        rope: rotary position embeddings on q and k (self-attention only).
        n_kv_heads: Hkv key/value heads (Hugging Face's ``num_key_value_heads``), dividing H;
            each is shared by H / Hkv query heads, and a cache stores only Hkv heads.
            None = H (standard multi-head attention).
        rope_theta: the RoPE base (Hugging Face's name), 10000 as in the RoPE paper.

    Shapes:
        forward(x (B, T, D) or (T, D), context (B, S, D) or None, ...) ->
        (out (B, T, D), weights (B, H, T, S) or None)
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        rope: bool = False,
        n_kv_heads: int | None = None,
        rope_theta: float = 10000.0,
    ) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        check_heads(d_model, n_heads, n_kv_heads)
        require_probability("dropout", dropout)
        check_bools(bias=bias, rope=rope)
        require_positive_number("rope_theta", rope_theta)
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        kv_dim = n_kv_heads * self.d_head  # Hkv Dh: D without GQA
        # rows [W_q; W_k; W_v]: (D + 2 Hkv Dh, D)
        self.qkv_proj = nn.Linear(d_model, d_model + 2 * kv_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.rotary = RotaryEmbedding(self.d_head, base=rope_theta) if rope else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        is_causal: bool = False,
        return_weights: bool = False,
        past_key_value: LayerKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x: the queries' source, (B, T, D) or unbatched (T, D).
            context: the keys' and values' source for cross-attention, (B, S, D) or (S, D).
            mask: boolean, True = may attend, broadcastable to (B, H, T, S).
            attention_mask: (B, S) bool or 0/1 integers, True/1 for real keys (Hugging Face's
                convention; torch's ``key_padding_mask`` is its negation).
            attn_bias: float added to the scores, broadcastable to (B, H, T, S) (e.g. ALiBi).
            is_causal: also apply the future mask, lower-right aligned (query t sees keys
                s <= t + S - T).
            return_weights: also return the weights (runs the math path).
            past_key_value: self-attention only: one layer's
                :class:`~course_lib.cache.LayerKVCache` with the keys and values of the S - T
                earlier positions; ours are appended and the T queries attend to all S (masks,
                attn_bias and attention_mask then cover all S keys).

        Returns:
            ``(out, weights)``: out (B, T, D), weights (B, H, T, S) or None.
        """
        check_attention_inputs(self, x, context, mask, attention_mask, attn_bias, past_key_value,
                               is_causal=is_causal, return_weights=return_weights)
        attention_mask = as_bool_mask(attention_mask)  # 0/1 integers, as tokenizers return them
        unbatched = x.dim() == 2
        if unbatched:  # (T, D) -> (1, T, D)
            x, context = x[None], None if context is None else context[None]
            attention_mask = None if attention_mask is None else attention_mask[None]
        q, k, v = self._project(x, context)  # (B, T, D), (B, S, Hkv Dh), (B, S, Hkv Dh)
        q = split_heads(q, self.n_heads)  # (B, H, T, Dh)
        k = split_heads(k, self.n_kv_heads)  # (B, Hkv, S, Dh)
        v = split_heads(v, self.n_kv_heads)  # (B, Hkv, S, Dh)
        n_past = 0 if past_key_value is None else past_key_value.get_seq_length()
        if self.rotary is not None and context is None:  # positions after the cached ones
            positions = torch.arange(n_past, n_past + q.shape[2], device=q.device)  # (T,)
            q = self.rotary(q, positions=positions)
            k = self.rotary(k, positions=positions)
        if past_key_value is not None:  # the earlier positions' keys and values, then ours
            k, v = past_key_value.update(k, v)  # (B, Hkv, S, Dh) each, cached before sharing
        if self.n_kv_heads != self.n_heads:  # GQA: query head h reads kv head h // (H/Hkv)
            group = self.n_heads // self.n_kv_heads  # query heads per key/value head
            k = k.repeat_interleave(group, dim=1)  # (B, Hkv, S, Dh) -> (B, H, S, Dh)
            v = v.repeat_interleave(group, dim=1)  # (B, Hkv, S, Dh) -> (B, H, S, Dh)
        dropout_p = self.dropout if self.training else 0.0
        if return_weights:  # softmax(q k^T / sqrt(Dh) + attn_bias) v, per head
            keep = combine_masks(mask, attention_mask, is_causal, q.shape[2], k.shape[2],
                                 x.device)
            out, weights = scaled_dot_product_attention(
                q, k, v, mask=keep, attn_bias=attn_bias, dropout_p=dropout_p
            )  # (B, H, T, Dh), (B, H, T, S)
        else:
            out, weights = _fused_attention(q, k, v, mask, attention_mask, attn_bias,
                                            is_causal, dropout_p), None  # (B, H, T, Dh)
        out = self.out_proj(merge_heads(out))  # (B, T, D)
        if unbatched:
            return out[0], None if weights is None else weights[0]
        return out, weights

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q = x W_q^T, k = c W_k^T, v = c W_v^T with c = x (self) or context (cross)."""
        d, kv_dim = self.d_model, self.n_kv_heads * self.d_head  # D, Hkv Dh
        if context is None:
            # (B, T, D), (B, T, Hkv Dh), (B, T, Hkv Dh)
            return self.qkv_proj(x).split([d, kv_dim, kv_dim], dim=-1)
        weight, bias = self.qkv_proj.weight, self.qkv_proj.bias
        q = F.linear(x, weight[:d], None if bias is None else bias[:d])  # (B, T, D)
        kv = F.linear(context, weight[d:], None if bias is None else bias[d:])  # (B, S, 2 Hkv Dh)
        return (q, *kv.split(kv_dim, dim=-1))  # (B, T, D), (B, S, Hkv Dh), (B, S, Hkv Dh)

    def extra_repr(self) -> str:
        rope = ", rope=True" if self.rotary is not None else ""
        kv = f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}{kv}, dropout={self.dropout}{rope}"


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
) -> torch.Tensor:
    """The same function through PyTorch's fused kernel (which never returns the weights)."""
    seq_len, src_len = q.shape[2], k.shape[2]
    # The kernel's own causal mode is fastest, but it aligns the mask top-left: right only
    # when T == S and nothing else is masked.
    if is_causal and mask is None and attention_mask is None and attn_bias is None \
            and seq_len == src_len:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    keep = combine_masks(mask, attention_mask, is_causal, seq_len, src_len, q.device)
    attn_mask = keep
    if attn_bias is not None:  # one float mask: the bias, -inf where attending is forbidden
        attn_bias = attn_bias.to(q.dtype)
        attn_mask = attn_bias if keep is None else attn_bias.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


# ------------------------------------------------------------------------------ argument checks

_QKV_SHAPES = {"q": "(..., T, Dh)", "k": "(..., S, Dh)", "v": "(..., S, Dv)"}
_MASK_SHAPES = "(T, S), (H, T, S), (B, 1, T, S) or (B, H, T, S)"
_LIKE_X = "(B, S, D) or (S, D), batched like x"


def _check_softmax(x: object) -> None:
    if not checks_wanted():
        return
    require_floating("x", require_tensor("x", x))


def check_qkv(q: object, k: object, v: object = None, *, scale: object = None) -> None:
    """q (..., T, Dh), k (..., S, Dh) and v (..., S, Dv): floating, one dtype, shapes that fit;
    scale None or > 0. Shared by every attention function (course_lib.efficient too)."""
    if not checks_wanted():
        return
    named = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, t in named.items():
        require_floating(name, require_ndim(name, t, (2, 3, 4, 5), _QKV_SHAPES[name]))
    require_same_dtype(named)
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1] \
            or (v is not None and v.shape[:-1] != k.shape[:-1]):
        raise ValueError(" and ".join(f"{n} has shape {shape_of(t)}" for n, t in named.items())
                         + f"; expected {', '.join(map(_QKV_SHAPES.get, named))}, same (...)")
    if scale is not None:  # 1 // math.sqrt(d) is 0.0: a uniform average
        require_positive_number("scale", scale, "the usual scale is 1 / math.sqrt(d_head)")


def _check_masks(scores_shape: Sequence[int], mask: object, attn_bias: object) -> None:
    """mask boolean and attn_bias floating, each broadcastable to the scores' shape."""
    if mask is not None:
        require_broadcastable("mask", require_bool_mask("mask", mask), scores_shape, _MASK_SHAPES)
    if attn_bias is not None:
        require_floating("attn_bias", require_tensor("attn_bias", attn_bias))
        require_broadcastable("attn_bias", attn_bias, scores_shape, _MASK_SHAPES)


def _check_sdpa(q, k, v, mask, attn_bias, scale) -> None:
    if not checks_wanted():
        return
    check_qkv(q, k, v, scale=scale)
    _check_masks((*q.shape[:-1], k.shape[-2]), mask, attn_bias)


def require_lengths(lengths: object, max_len: object, device: object) -> torch.Tensor:
    """``lengths`` as a (B,) integer tensor on ``device``, if every length is in 0..max_len."""
    try:
        lengths = torch.as_tensor(lengths, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"lengths must be B integers (a list or a tensor), got "
                        f"{lengths!r}") from None
    if not checks_wanted():
        return lengths
    require_integer_tensor("lengths", require_ndim("lengths", lengths, (1,), "(B,)"), "lengths")
    limit = math.inf if max_len is None else require_non_negative_int("max_len", max_len)
    if lengths.numel() and not 0 <= int(lengths.min()) <= int(lengths.max()) <= limit:
        raise ValueError(f"lengths must be >= 0 and <= max_len={max_len}, got {lengths.tolist()}")
    return lengths


def check_heads(d_model: object, n_heads: object, n_kv_heads: object = None) -> None:
    """Sizes >= 1, H divides D (each head gets D // H features) and Hkv divides H (each
    key/value head serves a group of H // Hkv query heads); configs use it too."""
    check_positive_ints(d_model=d_model, n_heads=n_heads)
    if d_model % n_heads:
        options = [h for h in range(1, d_model + 1) if d_model % h == 0]
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}: try {options}")
    if n_kv_heads is not None and n_heads % require_positive_int("n_kv_heads", n_kv_heads):
        options = [h for h in range(1, n_heads + 1) if n_heads % h == 0]
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}: "
                         f"try n_kv_heads in {options}")


def _check_split_heads(x: object, n_heads: object) -> None:
    if not checks_wanted():
        return
    check_heads(require_ndim("x", x, (3,), "(B, T, D)").shape[-1], n_heads)


def _check_merge_heads(x: object) -> None:
    if not checks_wanted():
        return
    require_ndim("x", x, (4,), "(B, H, T, Dh)")


def check_attention_inputs(
    layer: MultiHeadAttention,
    x: object,
    context: object = None,
    mask: object = None,
    attention_mask: object = None,
    attn_bias: object = None,
    past_key_value: object = None,
    *,
    is_causal: object = False,
    return_weights: object = False,
    context_name: str = "context",
) -> None:
    """The arguments of ``layer.forward``: shapes and dtypes only (no value is read, so this
    costs nothing on a GPU). Blocks call it at their boundary too (naming ``context`` as their
    caller wrote it, ``context_name``); inside a model's
    :func:`~course_lib._validate.inputs_checked` it returns at once."""
    if not checks_wanted():
        return
    check_bools(is_causal=is_causal, return_weights=return_weights)
    require_ndim("x", x, (2, 3), "(B, T, D) or (T, D)")
    named = {"x": x} if context is None else {"x": x, context_name: context}
    for name, t in named.items():  # context: (B, S, D) or (S, D), batched like x
        require_features(name, require_ndim(name, t, (x.dim(),), _LIKE_X), layer.d_model, "d_model")
        require_dtype_of(name, t, layer.out_proj.weight, "this attention layer's weights")
    if context is not None and x.dim() == 3:
        require_size(context_name, context, 0, x.shape[0], "x's batch size")
    if past_key_value is not None and not isinstance(past_key_value, LayerKVCache):
        got = type(past_key_value).__name__
        raise TypeError(f"past_key_value must be one layer's cache (cache.layer(i)), got {got}")
    if past_key_value is not None and context is not None:
        raise ValueError("past_key_value caches self-attention; cross-attention takes none")
    batch = x.shape[0] if x.dim() == 3 else 1
    if past_key_value is not None:
        check_fits("past_key_value", past_key_value, batch, layer.n_kv_heads, layer.d_head,
                   layer.d_head)
    n_past = 0 if past_key_value is None else past_key_value.get_seq_length()
    n_keys = (x if context is None else context).shape[-2] + n_past
    _check_masks((batch, layer.n_heads, x.shape[-2], n_keys), mask, attn_bias)
    expected = (batch, n_keys) if x.dim() == 3 else (n_keys,)
    require_padding_mask("attention_mask", attention_mask, expected, f"should be {expected}")
