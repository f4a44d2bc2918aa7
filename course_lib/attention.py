"""Attention: scores, softmax, scaled dot-product attention, masks and multi-head attention.

Shape legend: B batch, H heads, T query length, S key/value length, D d_model, Dh head dim.
``(...)`` stands for any leading batch-like dimensions, e.g. (B, H).

Conventions:
    * Masks are boolean and True means "may attend" (the convention of
      ``torch.nn.functional.scaled_dot_product_attention``). Masked scores are filled with -inf.
    * Masks and additive biases broadcast against the scores (..., T, S) with the usual
      broadcasting rules: (T, S) applies to every example and head, (H, T, S) per head,
      (B, 1, T, S) per example, (B, H, T, S) per example and head.
    * A query whose every key is masked gets all-zero weights and a zero output instead of NaN,
      the same choice PyTorch's fused attention makes.
    * Padding is given as ``attention_mask`` of shape (B, S), True for real tokens, as in
      Hugging Face. torch.nn's ``key_padding_mask`` means the opposite (True = ignore this key):
      convert with ``attention_mask = ~key_padding_mask``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    WrongTypeError,
    checks_wanted,
    require_bool,
    require_bool_mask,
    require_broadcastable,
    require_dtype_of,
    require_features,
    require_floating,
    require_ndim,
    require_non_negative_int,
    require_positive_int,
    require_positive_number,
    require_probability,
    require_tensor,
    shape_of,
)
from .cache import LayerKVCache
from .positions import RotaryEmbedding

_MASK_SHAPES = "(T, S), (H, T, S), (B, 1, T, S) or (B, H, T, S), broadcastable to the scores"


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Numerically stable softmax along ``dim``.

    Subtracting the row maximum before ``exp`` changes nothing mathematically (it cancels in
    the ratio) but keeps ``exp`` from overflowing for large scores. A row that is entirely
    -inf (every key masked) returns zeros rather than NaN.

    Args:
        x: scores of any shape.
        dim: the axis to normalise over; attention always uses the last one (over keys).

    Returns:
        Tensor of the same shape whose entries along ``dim`` are >= 0 and sum to 1 (or are all
        0 for a fully masked row).
    """
    require_tensor("x", x)
    require_floating("x", x)
    return _softmax(x, dim)


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(x - row_max)
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
    """q, k (and v) must be floating tensors of one dtype whose shapes fit together."""
    require_ndim("q", q, (2, 3, 4, 5), "(..., T, Dh)")
    require_ndim("k", k, (2, 3, 4, 5), "(..., S, Dh)")
    pairs = [("k", k)]
    if v is not None:
        require_ndim("v", v, (2, 3, 4, 5), "(..., S, Dv)")
        pairs.append(("v", v))
    require_floating("q", q)
    for name, t in pairs:
        require_floating(name, t)
        if t.dtype != q.dtype:
            raise ValueError(
                f"q has dtype {q.dtype} but {name} has dtype {t.dtype}; give them one dtype, "
                f"e.g. {name}.to(q.dtype)"
            )
        if t.shape[:-2] != q.shape[:-2]:
            raise ValueError(
                f"q has shape {shape_of(q)} and {name} has shape {shape_of(t)}: their leading "
                f"(batch, head) dimensions {tuple(q.shape[:-2])} and {tuple(t.shape[:-2])} "
                f"must match"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension (the query/key size Dh), but q has shape "
            f"{shape_of(q)} and k has shape {shape_of(k)}"
        )
    if v is not None and v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of positions S, but k has shape {shape_of(k)} "
            f"and v has shape {shape_of(v)}"
        )


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Query-key affinities, scores[..., t, s] = scale * q_t . k_s.

    Args:
        q: queries, shape (..., T, Dh).
        k: keys, shape (..., S, Dh).
        scale: multiplier for the dot products, > 0; defaults to 1/sqrt(Dh) (pass 1.0 for
            the unscaled scores of eq. 8 in the notes).

    Returns:
        Scores of shape (..., T, S), before any softmax.
    """
    _check_qkv(q, k)
    _check_scale(scale)
    return _scores(q, k, scale)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return (q @ k.transpose(-2, -1)) * scale  # q k^T / sqrt(Dh): (..., T, S)


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(Dh) + bias, masked) v, written out so the weights can be inspected.

    Args:
        q: queries, shape (..., T, Dh).
        k: keys, shape (..., S, Dh).
        v: values, shape (..., S, Dv).
        mask: boolean, True = may attend, broadcastable to (..., T, S).
        bias: float, added to the scores (e.g. ALiBi), broadcastable to (..., T, S).
        scale: multiplier for the dot products, > 0; defaults to 1/sqrt(Dh).
        dropout_p: dropout probability applied to the weights (0 at evaluation).

    Returns:
        ``(out, weights)``: out of shape (..., T, Dv) and weights of shape (..., T, S).
    """
    _check_qkv(q, k, v)
    scores_shape = (*q.shape[:-1], k.shape[-2])
    if mask is not None:
        require_bool_mask("mask", mask)
        require_broadcastable("mask", mask, scores_shape, _MASK_SHAPES)
    if bias is not None:
        require_tensor("bias", bias)
        require_floating("bias", bias)
        require_broadcastable("bias", bias, scores_shape, _MASK_SHAPES)
    _check_scale(scale)
    require_probability("dropout_p", dropout_p)
    return _attention(q, k, v, mask, bias, scale, dropout_p)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float | None,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(q, k, scale)  # (..., T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if bias is not None:
        scores = scores + bias
    weights = _softmax(scores, dim=-1)  # (..., T, S), each row sums to 1 over the keys
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p, training=True)
    return weights @ v, weights  # (..., T, Dv), (..., T, S)


def causal_mask(
    n_queries: int, n_keys: int | None = None, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """Boolean future mask: query t may attend to key s only if s <= t.

    With S > T (queries are the last T of S positions, as when generating with a cache) the
    mask is shifted so query t sits at key position t + S - T.

    Returns:
        Boolean tensor of shape (T, S), lower-triangular when T == S.
    """
    require_positive_int("n_queries", n_queries)
    n_keys = n_queries if n_keys is None else require_positive_int("n_keys", n_keys)
    ones = torch.ones(n_queries, n_keys, dtype=torch.bool, device=device)
    return torch.tril(ones, diagonal=n_keys - n_queries)  # (T, S)


def padding_mask(
    lengths: Sequence[int] | torch.Tensor,
    max_len: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Padding mask (an ``attention_mask``) for right-padded sequences: True marks a real token.

    Args:
        lengths: the true length of each sequence, B integers.
        max_len: padded length S (defaults to the longest length).

    Returns:
        Boolean tensor of shape (B, S). Use ``mask[:, None, None, :]`` to broadcast it against
        scores of shape (B, H, T, S).
    """
    lengths = torch.as_tensor(lengths, device=device)
    require_ndim("lengths", lengths, (1,), "(B,)")
    if lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}")
    if lengths.numel() and int(lengths.min()) < 0:
        raise ValueError(f"lengths must be >= 0, got {lengths.tolist()}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if max_len is None:
        max_len = longest
    elif require_non_negative_int("max_len", max_len) < longest:
        raise ValueError(f"lengths has a sequence of length {longest} > max_len={max_len}")
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, S)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, D/H): give each head its own slice of the model dimension.

    Head h gets features ``h*Dh .. (h+1)*Dh - 1`` of every position. The transpose matters: a
    plain ``view(B, H, T, Dh)`` would also have the right shape, but it would cut the (T, D)
    block row-major and hand each head a mixture of positions.

    Args:
        x: (B, T, D), e.g. the queries of every head side by side, ``x @ W_q.T``.
        n_heads: H, which must divide D.

    Returns:
        (B, H, T, Dh), a view of ``x`` (no copy): the heads as a batch axis.
    """
    require_ndim("x", x, (3,), "(B, T, D)")
    _check_heads(x.shape[-1], n_heads)
    return _split_heads(x, n_heads)


def _split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    batch, seq_len, d_model = x.shape
    return x.view(batch, seq_len, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, T, Dh)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh): concatenate the heads' outputs again, the inverse of
    :func:`split_heads` (head h fills features ``h*Dh .. (h+1)*Dh - 1`` of each position).

    Args:
        x: (B, H, T, Dh), one output per head and position.

    Returns:
        (B, T, D) with D = H * Dh, the concatenation of eq. 24 before the output projection.
    """
    require_ndim("x", x, (4,), "(B, H, T, Dh)")
    return _merge_heads(x)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
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
    """AND together every mask that applies (True = may attend); None when nothing is masked.

    Args:
        mask: boolean, broadcastable to (B, H, T, S).
        attention_mask: (B, S) boolean, True for real (non-padding) keys.
        is_causal: also apply the future mask.

    Returns:
        A boolean mask broadcastable to (B, H, T, S), or None.
    """
    combined = mask
    if attention_mask is not None:
        padding = attention_mask[:, None, None, :]  # (B, 1, 1, S)
        combined = padding if combined is None else combined & padding
    if is_causal:
        future = causal_mask(n_queries, n_keys, device=device)  # (T, S)
        combined = future if combined is None else combined & future
    return combined


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention (keys from ``x``) and cross-attention (keys from
    ``context``), eqs. 22-26 of the notes.

    Written out, rather than wrapping ``nn.MultiheadAttention``, so that every step is visible
    and the per-head weights can be returned; a test proves both compute the same function.
    The projections for queries, keys and values live in one fused linear layer whose weight
    stacks the rows [W_q; W_k; W_v], shape (3D, D), as ``nn.MultiheadAttention.in_proj_weight``
    does.

    Two paths compute the same function:
        * the math path (course_lib's :func:`scaled_dot_product_attention`), which can return
          the attention weights;
        * the fused path (``torch.nn.functional.scaled_dot_product_attention``), faster and
          lighter on memory, which never materialises the weights.
    ``return_weights=True`` uses the math path, otherwise the fused one runs.

    Args:
        d_model: D, must be divisible by n_heads.
        n_heads: H; each head works in Dh = D / H dimensions.
        dropout: dropout on the attention weights during training.
        bias: whether the projections have biases.
        rope: apply rotary position embeddings to q and k (self-attention only).

    Shapes:
        forward(x: (B, T, D) or (T, D), context: (B, S, D) or None, ...) ->
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
    ) -> None:
        super().__init__()
        _check_heads(d_model, n_heads)
        require_probability("dropout", dropout)
        require_bool("bias", bias)
        require_bool("rope", rope)
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)  # rows [W_q; W_k; W_v]
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.rotary = RotaryEmbedding(self.d_head) if rope else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        is_causal: bool = False,
        return_weights: bool = False,
        past_key_value: LayerKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x: the queries' source, (B, T, D) or unbatched (T, D).
            context: the keys' and values' source for cross-attention, (B, S, D) or (S, D).
            mask: boolean, True = may attend, broadcastable to (B, H, T, S).
            attention_mask: (B, S) boolean, True for real keys and False for padding (Hugging
                Face's ``attention_mask``; the opposite of torch's ``key_padding_mask``).
            bias: float added to the scores, broadcastable to (B, H, T, S) (e.g. ALiBi).
            is_causal: also apply the future mask (query t sees keys s <= t).
            return_weights: also return the attention weights (uses the math path).
            past_key_value: self-attention only: a :class:`~course_lib.cache.LayerKVCache`
                holding the keys and values of the S - T positions before ``x``; the new ones
                are appended and the T queries attend to all S (masks, biases and
                ``attention_mask`` then cover all S keys; the causal mask aligns the queries
                with the last T keys). One layer's cache: Hugging Face's layers instead receive
                the whole cache and their ``layer_idx``.

        Returns:
            ``(out, weights)`` with out (B, T, D) and weights (B, H, T, S) or None.
        """
        if checks_wanted():
            if past_key_value is not None:
                if not isinstance(past_key_value, LayerKVCache):
                    raise WrongTypeError(
                        "past_key_value must be one layer's cache (a LayerKVCache, e.g. "
                        f"cache.layer(i) of a KVCache), got {type(past_key_value).__name__}")
            n_past = 0 if past_key_value is None else past_key_value.get_seq_length()
            check_attention_inputs(self, x, context, mask, attention_mask, bias, n_past=n_past)
            require_bool("is_causal", is_causal)
            require_bool("return_weights", return_weights)
            if past_key_value is not None and context is not None:
                raise ValueError("past_key_value caches self-attention keys and values; "
                                 "cross-attention (context=...) takes none")
        unbatched = x.dim() == 2
        if unbatched:
            x = x[None]
            context = None if context is None else context[None]
            attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)

        q, k, v = self._project(x, context)  # (B, T, D), (B, S, D), (B, S, D)
        q, k, v = (_split_heads(t, self.n_heads) for t in (q, k, v))  # (B, H, T|S, Dh)
        offset = 0 if past_key_value is None else past_key_value.get_seq_length()
        if self.rotary is not None and context is None:
            positions = None if offset == 0 else torch.arange(
                offset, offset + q.shape[2], device=q.device)  # (T,): after the cached ones
            q, k = self.rotary(q, positions), self.rotary(k, positions)
        if past_key_value is not None:  # keys and values of the earlier positions, then ours
            k, v = past_key_value.update(k, v)  # (B, H, S, Dh) each
        dropout_p = self.dropout if self.training else 0.0
        if return_weights:
            keep = combine_masks(mask, attention_mask, is_causal, q.shape[2], k.shape[2], x.device)
            # softmax(q k^T / sqrt(Dh) + bias) v, per head
            out, weights = _attention(q, k, v, keep, bias, None, dropout_p)
            # (B, H, T, Dh), (B, H, T, S)
        else:
            out, weights = _fused_attention(q, k, v, mask, attention_mask, bias, is_causal,
                                            dropout_p), None  # (B, H, T, Dh)
        out = self.out_proj(_merge_heads(out))  # (B, T, D)
        if unbatched:
            return out[0], None if weights is None else weights[0]
        return out, weights

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q = x W_q^T, k = c W_k^T, v = c W_v^T with c = x (self) or context (cross)."""
        if context is None:
            return self.qkv_proj(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        weight, bias = self.qkv_proj.weight, self.qkv_proj.bias
        d = self.d_model
        q = F.linear(x, weight[:d], None if bias is None else bias[:d])  # (B, T, D)
        kv = F.linear(context, weight[d:], None if bias is None else bias[d:])  # (B, S, 2D)
        return (q, *kv.chunk(2, dim=-1))  # (B, T, D), (B, S, D), (B, S, D)

    def extra_repr(self) -> str:
        rope = ", rope=True" if self.rotary is not None else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}{rope}"


def _fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    is_causal: bool,
    dropout_p: float,
) -> torch.Tensor:
    """The same function through PyTorch's fused kernel (which never returns the weights)."""
    seq_len, src_len = q.shape[2], k.shape[2]
    # The kernel's built-in causal mode is fastest, but it aligns the mask top-left, which is
    # right only when T == S and nothing else is masked.
    if is_causal and mask is None and attention_mask is None and bias is None \
            and seq_len == src_len:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    keep = combine_masks(mask, attention_mask, is_causal, seq_len, src_len, q.device)
    attn_mask = keep
    if bias is not None:  # one float mask: the bias, with -inf where attending is forbidden
        bias = bias.to(q.dtype)
        attn_mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p)


# ------------------------------------------------------------------------------ argument checks


def _check_scale(scale: object) -> None:
    """None (1/sqrt(Dh)) or a number > 0: scale 0 makes every weight equal (a uniform average)."""
    if scale is not None:
        require_positive_number("scale", scale, "the usual scale is 1 / math.sqrt(d_head) "
                                "(mind the /: 1 // math.sqrt(d_head) is 0.0)")


def _check_heads(d_model: int, n_heads: int) -> None:
    require_positive_int("d_model", d_model)
    require_positive_int("n_heads", n_heads)
    if d_model % n_heads:
        options = [h for h in range(1, d_model + 1) if d_model % h == 0]
        raise ValueError(
            f"d_model={d_model} is not divisible by n_heads={n_heads}: each head gets "
            f"d_model // n_heads dimensions, so n_heads must divide d_model "
            f"(it could be one of {options})"
        )


def check_attention_inputs(
    layer: MultiHeadAttention,
    x: torch.Tensor,
    context: torch.Tensor | None,
    mask: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    bias: torch.Tensor | None,
    *,
    n_past: int = 0,
) -> None:
    """Shapes and dtypes only (no value is read, so this costs nothing on a GPU). ``n_past``
    cached keys come before the ones computed from ``x`` (self-attention with a cache)."""
    require_ndim("x", x, (2, 3), "(B, T, D) or (T, D)")
    require_features("x", x, layer.d_model, "d_model")
    require_dtype_of("x", x, layer.out_proj.weight, "this attention layer's weights")
    batched = x.dim() == 3
    src = x
    if context is not None:
        require_ndim("context", context, (x.dim(),),
                     "(B, S, D), like x" if batched else "(S, D), like x")
        require_features("context", context, layer.d_model, "d_model")
        require_dtype_of("context", context, layer.out_proj.weight,
                         "this attention layer's weights")
        if batched and context.shape[0] != x.shape[0]:
            raise ValueError(
                f"context has batch size {context.shape[0]} (shape {shape_of(context)}) but x "
                f"has batch size {x.shape[0]} (shape {shape_of(x)}); they must match"
            )
        src = context
    batch = x.shape[0] if batched else 1
    n_keys = src.shape[-2] + n_past
    scores_shape = (batch, layer.n_heads, x.shape[-2], n_keys)
    if mask is not None:
        require_bool_mask("mask", mask)
        require_broadcastable("mask", mask, scores_shape, _MASK_SHAPES)
    if attention_mask is not None:
        require_bool_mask("attention_mask", attention_mask)
        expected = (batch, n_keys) if batched else (n_keys,)
        if tuple(attention_mask.shape) != expected:
            raise ValueError(
                f"attention_mask has shape {shape_of(attention_mask)} but should be "
                f"{'(B, S)' if batched else '(S,)'} = {expected}, with True marking real keys "
                f"(and False padding)"
            )
    if bias is not None:
        require_tensor("bias", bias)
        require_floating("bias", bias)
        require_broadcastable("bias", bias, scores_shape, _MASK_SHAPES)
