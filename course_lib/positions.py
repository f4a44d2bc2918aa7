"""Position representations: learned absolute, sinusoidal, ALiBi biases and rotary (RoPE).

Self-attention treats its input as a set, so order has to be put in from outside: either by
adding a position vector to each token (learned, sinusoidal) or by changing the attention
scores themselves (ALiBi adds a distance penalty; RoPE rotates q and k by position).

Shape legend: T query length, S key length, D d_model, H heads, Dh head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validate import require_ndim, require_positive_int, shape_of


def _require_even(name: str, value: int) -> None:
    if value % 2:
        raise ValueError(
            f"{name} must be even (dimensions come in sin/cos or rotation pairs), got {value}"
        )


class LearnedPositionalEmbedding(nn.Module):
    """A trainable table P with one row per position, P in R^{max_len x D}.

    It can only describe positions it has a row for: asking for more than ``max_len`` positions
    is an error, which is the hard length limit of learned absolute positions.

    Shapes:
        forward(seq_len) -> (T, D), the rows P_0 .. P_{T-1} to add to the token embeddings.
    """

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        require_positive_int("max_len", max_len)
        require_positive_int("d_model", d_model)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, seq_len: int, *, offset: int = 0) -> torch.Tensor:
        if offset + seq_len > self.max_len:
            raise ValueError(
                f"seq_len={seq_len} (from position {offset}) needs positions up to "
                f"{offset + seq_len - 1}, but this learned position table only has "
                f"max_len={self.max_len} rows; use a shorter sequence or a model with a larger "
                "max_len"
            )
        positions = torch.arange(offset, offset + seq_len, device=self.embedding.weight.device)
        return self.embedding(positions)  # (T, D)


def sinusoidal_encoding(
    n_positions: int,
    d_model: int,
    *,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The fixed sinusoidal position vectors of "Attention Is All You Need".

    PE[p, 2i] = sin(p / base^(2i/D)) and PE[p, 2i+1] = cos(p / base^(2i/D)).

    Args:
        n_positions: number of positions T.
        d_model: D, must be even.
        base: the wavelength scale, 10000 in the original paper.

    Returns:
        Tensor of shape (T, D).
    """
    require_positive_int("n_positions", n_positions)
    require_positive_int("d_model", d_model)
    _require_even("d_model", d_model)
    positions = torch.arange(n_positions, device=device, dtype=torch.float64)  # (T,)
    i = torch.arange(0, d_model, 2, device=device, dtype=torch.float64)  # (D/2,): the 2i
    angles = positions[:, None] / base ** (i / d_model)  # (T, D/2)
    pe = torch.empty(n_positions, d_model, device=device, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe.to(dtype)  # (T, D)


class SinusoidalPositionalEncoding(nn.Module):
    """Sinusoidal positions as a module: no parameters, works for any length.

    Shapes:
        forward(seq_len) -> (T, D)
    """

    def __init__(self, d_model: int, *, base: float = 10000.0) -> None:
        super().__init__()
        _require_even("d_model", d_model)
        self.d_model = d_model
        self.base = base
        # A device anchor so the encoding follows .to(device); not saved in state_dict.
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)

    def forward(self, seq_len: int, *, offset: int = 0) -> torch.Tensor:
        pe = sinusoidal_encoding(
            offset + seq_len, self.d_model, base=self.base, device=self._anchor.device
        )
        return pe[offset:]  # (T, D)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes m_h from Press et al. (2022).

    For a power of two H the slopes are the geometric sequence 2^(-8/H), 2^(-16/H), ...,
    2^(-8). For other H the paper takes the slopes of the closest smaller power of two and
    fills in with every other slope of the next power of two.

    Returns:
        Tensor of shape (H,).
    """
    require_positive_int("n_heads", n_heads)

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (h + 1) for h in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = power_of_two_slopes(closest)
    if closest != n_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes)


def alibi_bias(
    n_queries: int,
    n_keys: int | None = None,
    *,
    n_heads: int | None = None,
    slopes: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """ALiBi attention biases: -m_h * |i - j| added to the score of query i and key j.

    With one head and slope 1 this is exactly eq. 13 of the notes: a row
    [-i, ..., -1, 0, -1, ..., -(n-i)] added to each query's scores. Queries are aligned with
    the last keys (query i sits at key position i + S - T), which matters only when S != T.

    Args:
        n_queries: T.
        n_keys: S (defaults to T).
        n_heads: H; slopes from :func:`alibi_slopes`. Give either this or ``slopes``.
        slopes: custom slopes, shape (H,).

    Returns:
        Float tensor of shape (H, T, S), to pass as ``bias=`` to attention.
    """
    require_positive_int("n_queries", n_queries)
    n_keys = n_queries if n_keys is None else require_positive_int("n_keys", n_keys)
    if (n_heads is None) == (slopes is None):
        raise ValueError("give exactly one of n_heads= or slopes=")
    if slopes is None:
        slopes = alibi_slopes(n_heads)
    require_ndim("slopes", slopes, (1,), "(H,)")
    slopes = slopes.to(device=device, dtype=torch.float32)
    query_pos = torch.arange(n_queries, device=device) + (n_keys - n_queries)  # (T,)
    key_pos = torch.arange(n_keys, device=device)  # (S,)
    distance = (query_pos[:, None] - key_pos[None, :]).abs().float()  # (T, S)
    return -slopes[:, None, None] * distance  # (H, T, S)


def rope_frequencies(
    d_head: int, *, base: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rotation speeds theta_i = base^(-2i/Dh) for the Dh/2 pairs of dimensions, shape (Dh/2,)."""
    require_positive_int("d_head", d_head)
    _require_even("d_head", d_head)
    i = torch.arange(0, d_head, 2, device=device, dtype=torch.float32)
    return base ** (-i / d_head)


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    base: float = 10000.0,
) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021): rotate each pair of dimensions by an angle
    proportional to the token's position.

    Dimensions (2i, 2i+1) of the vector at position p are rotated by the angle p * theta_i.
    Because rotations compose, (R_p q) . (R_r k) = q . R_{r-p} k: after rotating queries and
    keys, their dot product depends on positions only through the offset r - p.

    Args:
        x: queries or keys, shape (..., T, Dh) with Dh even.
        positions: positions of the T vectors, shape (T,); defaults to 0..T-1.
        base: the same wavelength scale as sinusoidal encodings.

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    require_ndim("x", x, (2, 3, 4, 5), "(..., T, Dh)")
    seq_len, d_head = x.shape[-2], x.shape[-1]
    _require_even("the last dimension of x (Dh)", d_head)
    if positions is None:
        positions = torch.arange(seq_len, device=x.device)
    require_ndim("positions", positions, (1,), "(T,)")
    if positions.shape[0] != seq_len:
        raise ValueError(
            f"positions has shape {shape_of(positions)} but x has T={seq_len} vectors "
            f"(shape {shape_of(x)})"
        )
    theta = rope_frequencies(d_head, base=base, device=x.device)  # (Dh/2,)
    angles = positions.to(device=x.device, dtype=torch.float32)[:, None] * theta  # (T, Dh/2)
    return _rotate_pairs(x, angles.cos(), angles.sin())


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) by the angle whose cos/sin are given.

    Shapes: x (..., T, Dh); cos, sin (T, Dh/2). Returns (..., T, Dh) in x's dtype.
    """
    x_even = x[..., 0::2].float()  # (..., T, Dh/2)
    x_odd = x[..., 1::2].float()
    rotated = torch.stack(
        (x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1
    )  # (..., T, Dh/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., T, Dh)


class RotaryEmbedding(nn.Module):
    """RoPE as a module (no parameters), applied to q and k after the heads are split.

    Shapes:
        forward(x: (..., T, Dh), positions: (T,) or None) -> (..., T, Dh)
    """

    def __init__(self, d_head: int, *, base: float = 10000.0) -> None:
        super().__init__()
        _require_even("d_head", d_head)
        self.d_head = d_head
        self.base = base
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[-1] != self.d_head:
            raise ValueError(
                f"x has last dimension {x.shape[-1]} but this RotaryEmbedding was built for "
                f"d_head={self.d_head}"
            )
        if positions is not None:
            return apply_rope(x, positions, base=self.base)
        cos, sin = self._tables(x.shape[-2], x.device)
        return _rotate_pairs(x, cos, sin)

    def _tables(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles for positions 0..seq_len-1, kept between calls: a model
        applies the same rotation to q and k in every layer at every step."""
        cached = self._cache
        if cached is None or cached[0].shape[0] < seq_len or cached[0].device != device:
            length = max(seq_len, 0 if cached is None else cached[0].shape[0])
            theta = rope_frequencies(self.d_head, base=self.base, device=device)  # (Dh/2,)
            angles = torch.arange(length, device=device, dtype=torch.float32)[:, None] * theta
            self._cache = cached = (angles.cos(), angles.sin())  # 2 x (length, Dh/2)
        return cached[0][:seq_len], cached[1][:seq_len]

    def extra_repr(self) -> str:
        return f"d_head={self.d_head}, base={self.base}"
