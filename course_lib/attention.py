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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ._validate import (
    require_bool_mask,
    require_broadcastable,
    require_floating,
    require_ndim,
    require_positive_int,
    require_tensor,
    shape_of,
)
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
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(x - row_max)
    total = exp.sum(dim=dim, keepdim=True)
    return exp / torch.where(total > 0, total, torch.ones_like(total))


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    require_ndim("q", q, (2, 3, 4, 5), "(..., T, Dh)")
    require_ndim("k", k, (2, 3, 4, 5), "(..., S, Dh)")
    require_floating("q", q)
    require_floating("k", k)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same last dimension (the query/key size Dh), but q has shape "
            f"{shape_of(q)} and k has shape {shape_of(k)}"
        )


def attention_scores(
    q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None
) -> torch.Tensor:
    """Query-key affinities, scores[..., t, s] = scale * q_t . k_s.

    Args:
        q: queries, shape (..., T, Dh).
        k: keys, shape (..., S, Dh).
        scale: multiplier for the dot products; defaults to 1/sqrt(Dh) (pass 1.0 for the
            unscaled scores of eq. 8 in the notes).

    Returns:
        Scores of shape (..., T, S), before any softmax.
    """
    _check_qk(q, k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return (q @ k.transpose(-2, -1)) * scale  # (..., T, S)


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
        scale: defaults to 1/sqrt(Dh).
        dropout_p: dropout probability applied to the weights (0 at evaluation).

    Returns:
        ``(out, weights)``: out of shape (..., T, Dv) and weights of shape (..., T, S).
    """
    scores = attention_scores(q, k, scale=scale)  # (..., T, S)
    require_ndim("v", v, (2, 3, 4, 5), "(..., S, Dv)")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"k and v must have the same number of positions S, but k has shape {shape_of(k)} "
            f"and v has shape {shape_of(v)}"
        )
    if mask is not None:
        require_bool_mask("mask", mask)
        require_broadcastable("mask", mask, scores.shape, _MASK_SHAPES)
        scores = scores.masked_fill(~mask, float("-inf"))
    if bias is not None:
        require_tensor("bias", bias)
        require_floating("bias", bias)
        require_broadcastable("bias", bias, scores.shape, _MASK_SHAPES)
        scores = scores + bias
    weights = softmax(scores, dim=-1)  # (..., T, S), each row sums to 1 over the keys
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
    """Key padding mask for a batch of right-padded sequences: True marks a real token.

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
    elif longest > max_len:
        raise ValueError(f"lengths has a sequence of length {longest} > max_len={max_len}")
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]  # (B, S)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, T, D) -> (B, H, T, D/H): give each head its own slice of the model dimension."""
    batch, seq_len, d_model = x.shape
    return x.view(batch, seq_len, n_heads, d_model // n_heads).transpose(1, 2)  # (B, H, T, Dh)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (B, T, H*Dh): concatenate the heads' outputs again."""
    batch, n_heads, seq_len, d_head = x.shape
    return x.transpose(1, 2).reshape(batch, seq_len, n_heads * d_head)  # (B, T, D)


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self-attention (keys from ``x``) and cross-attention (keys from
    ``context``).

    The projections for queries, keys and values live in one fused linear layer whose weight
    stacks the rows [W_q; W_k; W_v], shape (3D, D), so it maps one to one onto
    ``nn.MultiheadAttention.in_proj_weight``.

    Two paths compute the same function:
        * the math path (course_lib's :func:`scaled_dot_product_attention`), which can return
          the attention weights;
        * the fused path (``torch.nn.functional.scaled_dot_product_attention``), which is faster
          and lighter on memory but never materialises the weights.
    ``need_weights=True`` always uses the math path; ``impl="math"`` forces it.

    Args:
        d_model: D, must be divisible by n_heads.
        n_heads: H; each head works in Dh = D / H dimensions.
        dropout: dropout on the attention weights during training.
        bias: whether the projections have biases.
        rope: apply rotary position embeddings to q and k (self-attention only).
        rope_base: RoPE's wavelength scale.
        impl: ``"auto"`` (fused unless weights are requested) or ``"math"``.

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
        rope_base: float = 10000.0,
        impl: str = "auto",
    ) -> None:
        super().__init__()
        require_positive_int("d_model", d_model)
        require_positive_int("n_heads", n_heads)
        if d_model % n_heads:
            options = [h for h in range(1, d_model + 1) if d_model % h == 0]
            raise ValueError(
                f"d_model={d_model} is not divisible by n_heads={n_heads}: each head gets "
                f"d_model // n_heads dimensions, so n_heads must divide d_model "
                f"(it could be one of {options})"
            )
        if impl not in ("auto", "math"):
            raise ValueError(f"impl must be 'auto' or 'math', got {impl!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.dropout = dropout
        self.impl = impl
        self.qkv_proj = nn.Linear(d_model, 3 * d_model, bias=bias)  # rows [W_q; W_k; W_v]
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        self.rotary = RotaryEmbedding(self.d_head, base=rope_base) if rope else None

    def _project(
        self, x: torch.Tensor, context: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if context is None:
            return self.qkv_proj(x).chunk(3, dim=-1)  # 3 x (B, T, D)
        weight, bias = self.qkv_proj.weight, self.qkv_proj.bias
        d = self.d_model
        q = F.linear(x, weight[:d], None if bias is None else bias[:d])  # (B, T, D)
        kv = F.linear(context, weight[d:], None if bias is None else bias[d:])  # (B, S, 2D)
        k, v = kv.chunk(2, dim=-1)  # 2 x (B, S, D)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``x`` to ``context`` (or to ``x`` itself).

        Args:
            x: queries' source, (B, T, D) or unbatched (T, D).
            context: keys' and values' source for cross-attention, (B, S, D) or (S, D).
            mask: boolean, True = may attend, broadcastable to (B, H, T, S).
            key_padding_mask: boolean (B, S), True marks real (non-padding) keys.
            bias: float added to the scores, broadcastable to (B, H, T, S) (e.g. ALiBi).
            is_causal: also apply the future mask (query t sees keys s <= t).
            need_weights: return the attention weights (uses the math path).

        Returns:
            ``(out, weights)`` with out (B, T, D) and weights (B, H, T, S) or None.
        """
        require_ndim("x", x, (2, 3), "(B, T, D) or (T, D)")
        require_floating("x", x)
        unbatched = x.dim() == 2
        if x.shape[-1] != self.d_model:
            raise ValueError(
                f"x has last dimension {x.shape[-1]} (shape {shape_of(x)}) but this attention "
                f"layer has d_model={self.d_model}"
            )
        if context is not None:
            require_ndim("context", context, (x.dim(),), "the same number of dims as x: "
                         + ("(S, D)" if unbatched else "(B, S, D)"))
            if context.shape[-1] != self.d_model:
                raise ValueError(
                    f"context has last dimension {context.shape[-1]} (shape {shape_of(context)}) "
                    f"but this attention layer has d_model={self.d_model}"
                )
            if not unbatched and context.shape[0] != x.shape[0]:
                raise ValueError(
                    f"context has batch size {context.shape[0]} but x has batch size {x.shape[0]}"
                )
        if unbatched:
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
            if key_padding_mask is not None and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        batch, seq_len, _ = x.shape
        src_len = seq_len if context is None else context.shape[1]

        q, k, v = self._project(x, context)
        q = split_heads(q, self.n_heads)  # (B, H, T, Dh)
        k = split_heads(k, self.n_heads)  # (B, H, S, Dh)
        v = split_heads(v, self.n_heads)  # (B, H, S, Dh)
        if self.rotary is not None and context is None:
            q, k = self.rotary(q), self.rotary(k)

        fused = not (need_weights or self.impl == "math")
        # The fused kernel has a fast built-in causal mode; use it when nothing else is masked.
        causal_flag = (
            fused and is_causal and mask is None and key_padding_mask is None and bias is None
            and seq_len == src_len
        )
        scores_shape = (batch, self.n_heads, seq_len, src_len)
        full_mask = self._combine_masks(
            mask, key_padding_mask, is_causal and not causal_flag, scores_shape, x.device
        )
        if bias is not None:
            require_tensor("bias", bias)
            require_floating("bias", bias)
            require_broadcastable("bias", bias, scores_shape, _MASK_SHAPES)
        dropout_p = self.dropout if self.training else 0.0

        if not fused:
            out, weights = scaled_dot_product_attention(
                q, k, v, mask=full_mask, bias=bias, dropout_p=dropout_p
            )  # (B, H, T, Dh), (B, H, T, S)
        else:
            weights = None
            attn_mask = full_mask
            if bias is not None:  # fold the boolean mask into the float bias
                bias = bias.to(q.dtype)
                attn_mask = bias if full_mask is None else bias.masked_fill(
                    ~full_mask, float("-inf")
                )
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=causal_flag
            )  # (B, H, T, Dh)

        out = self.out_proj(merge_heads(out))  # (B, T, D)
        if unbatched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _combine_masks(
        self,
        mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        is_causal: bool,
        scores_shape: tuple[int, int, int, int],
        device: torch.device,
    ) -> torch.Tensor | None:
        """AND together every mask that applies; None when nothing is masked."""
        batch, _, seq_len, src_len = scores_shape
        combined = None
        if mask is not None:
            require_bool_mask("mask", mask)
            require_broadcastable("mask", mask, scores_shape, _MASK_SHAPES)
            combined = mask
        if key_padding_mask is not None:
            require_bool_mask("key_padding_mask", key_padding_mask)
            if tuple(key_padding_mask.shape) != (batch, src_len):
                raise ValueError(
                    f"key_padding_mask has shape {shape_of(key_padding_mask)} but should be "
                    f"(B, S) = ({batch}, {src_len}), with True marking real tokens"
                )
            padding = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
            combined = padding if combined is None else combined & padding
        if is_causal:
            future = causal_mask(seq_len, src_len, device=device)  # (T, S)
            combined = future if combined is None else combined & future
        return combined

    def extra_repr(self) -> str:
        rope = ", rope=True" if self.rotary is not None else ""
        return f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}{rope}"
