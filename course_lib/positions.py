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

from ._validate import (
    require_float_dtype,
    require_floating,
    require_ndim,
    require_non_negative_int,
    require_positive_int,
    require_positive_number,
    shape_of,
)


def _require_even(name: str, value: int) -> None:
    if value % 2:
        raise ValueError(
            f"{name} must be even (dimensions come in sin/cos or rotation pairs), got {value}"
        )


def _require_even_size(name: str, value: object) -> int:
    value = require_positive_int(name, value)
    _require_even(name, value)
    return value


def _require_span(seq_len: object, offset: object) -> None:
    """seq_len and offset of a forward(seq_len, offset=...) call: ints >= 0 (free to check)."""
    require_non_negative_int("seq_len", seq_len)
    require_non_negative_int("offset", offset)


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
        _require_span(seq_len, offset)
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
        device: where to put the result. It is computed on the CPU in float64 (accurate for
            large p, and MPS has no float64), then converted to ``dtype`` and moved.
        dtype: a floating-point dtype for the result.

    Returns:
        Tensor of shape (T, D).
    """
    require_positive_int("n_positions", n_positions)
    _require_even_size("d_model", d_model)
    require_positive_number("base", base)
    require_float_dtype("dtype", dtype)
    return _sinusoids(n_positions, d_model, base).to(dtype).to(device=device)  # (T, D)


def _sinusoids(n_positions: int, d_model: int, base: float) -> torch.Tensor:
    """The (T, D) table in float64 on the CPU, for checked arguments."""
    p = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (T, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angles = p / base ** (two_i / d_model)  # (T, D/2): p / base^(2i/D)
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe  # (T, D)


class SinusoidalPositionalEncoding(nn.Module):
    """Sinusoidal positions as a module: no parameters, works for any length.

    The table is computed once (see :func:`sinusoidal_encoding`) and kept, on the device of
    the module, until a longer one is needed.

    Shapes:
        forward(seq_len) -> (T, D), float32
    """

    def __init__(self, d_model: int, *, base: float = 10000.0) -> None:
        super().__init__()
        _require_even_size("d_model", d_model)
        require_positive_number("base", base)
        self.d_model = d_model
        self.base = base
        # A device anchor so the encoding follows .to(device); not saved in state_dict.
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)
        self._cache: torch.Tensor | None = None

    def forward(self, seq_len: int, *, offset: int = 0) -> torch.Tensor:
        _require_span(seq_len, offset)
        return self._table(offset + seq_len, self._anchor.device)[offset:]  # (T, D)

    def _table(self, length: int, device: torch.device) -> torch.Tensor:
        """The first ``length`` rows, kept between calls (a model asks every step)."""
        cached = self._cache
        if cached is None or cached.shape[0] < length or cached.device != device:
            rows = max(length, 1 if cached is None else cached.shape[0])
            with torch.inference_mode(False):  # usable later in training, too
                table = _sinusoids(rows, self.d_model, self.base)  # (rows, D) float64, CPU
                self._cache = cached = table.float().to(device)
        return cached[:length]  # (length, D)


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
    slopes = _check_alibi(n_queries, n_keys, n_heads, slopes)
    n_keys = n_queries if n_keys is None else n_keys
    slopes = slopes.to(device=device, dtype=torch.float32)
    query_pos = torch.arange(n_queries, device=device) + (n_keys - n_queries)  # (T,)
    key_pos = torch.arange(n_keys, device=device)  # (S,)
    distance = (query_pos[:, None] - key_pos[None, :]).abs().float()  # (T, S): |i - j|
    return -slopes[:, None, None] * distance  # (H, T, S): -m_h |i - j|


def _check_alibi(n_queries, n_keys, n_heads, slopes) -> torch.Tensor:
    """Check the arguments of :func:`alibi_bias`; return the slopes to use."""
    require_positive_int("n_queries", n_queries)
    if n_keys is not None:
        require_positive_int("n_keys", n_keys)
    if (n_heads is None) == (slopes is None):
        raise ValueError("give exactly one of n_heads= or slopes=")
    if slopes is None:
        return alibi_slopes(n_heads)
    require_ndim("slopes", slopes, (1,), "(H,)")
    if slopes.dtype == torch.bool or slopes.is_complex():
        raise ValueError(f"slopes must hold real numbers, got dtype {slopes.dtype}")
    return slopes


def rope_frequencies(
    d_head: int, *, base: float = 10000.0, device: torch.device | str | None = None
) -> torch.Tensor:
    """Rotation speeds theta_i = base^(-2i/Dh) for the Dh/2 pairs of dimensions, shape (Dh/2,)."""
    _require_even_size("d_head", d_head)
    require_positive_number("base", base)
    return _frequencies(d_head, base, device, torch.float32)


def ntk_scaled_base(d_head: int, scaling_factor: float, *, base: float = 10000.0) -> float:
    """The RoPE base for "NTK-aware" scaling to ``scaling_factor`` times the trained length.

    base' = base * factor^(Dh / (Dh - 2)). With theta_i = base'^(-2i/Dh), the fastest pair
    (i = 0) keeps its speed of 1 radian per position, so nearby tokens look exactly as in
    training, while the slowest pair (i = Dh/2 - 1) turns ``factor`` times more slowly, so
    the longest distances map onto angles that training did see. The pairs in between are
    slowed by factors in between (geometrically).

    Args:
        d_head: Dh, even and at least 4 (with one pair there is nothing to interpolate).
        scaling_factor: how many times longer the inputs are than in training (>= 1 usually).
        base: the base the model was trained with.

    Returns:
        The new base, a float.
    """
    _require_even_size("d_head", d_head)
    if d_head < 4:
        raise ValueError(f"d_head must be at least 4 for NTK-aware scaling, got {d_head}")
    require_positive_number("scaling_factor", scaling_factor)
    require_positive_number("base", base)
    return base * scaling_factor ** (d_head / (d_head - 2))


def _frequencies(d_head: int, base: float, device, dtype: torch.dtype) -> torch.Tensor:
    two_i = torch.arange(0, d_head, 2, device=device, dtype=dtype)  # (Dh/2,)
    return base ** (-two_i / d_head)  # (Dh/2,): theta_i = base^(-2i/Dh)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """RoPE's angles and products run in float32 (float64 for float64 input): half precision
    would round the angles of far positions, and float64 input deserves float64 accuracy."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


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
        x: queries or keys, shape (..., T, Dh) with Dh even, floating point. The rotation is
            computed in float32 (float64 for float64 x) and returned in x's dtype.
        positions: positions of the T vectors, shape (T,), integer (or float) tensor;
            defaults to 0..T-1.
        base: the same wavelength scale as sinusoidal encodings.

    Returns:
        The rotated tensor, same shape and dtype as ``x``.
    """
    _check_rope_input(x, positions)
    require_positive_number("base", base)
    return _apply_rope(x, positions, base)


def _check_rope_input(x: torch.Tensor, positions: torch.Tensor | None) -> None:
    """Shapes and dtypes of a RoPE call (no values read: cheap at every step)."""
    require_ndim("x", x, (2, 3, 4, 5), "(..., T, Dh)")
    require_floating("x", x)  # integer vectors would come back truncated
    _require_even("the last dimension of x (Dh)", x.shape[-1])
    if positions is None:
        return
    require_ndim("positions", positions, (1,), "(T,)")
    if positions.dtype == torch.bool or positions.is_complex():
        raise ValueError(
            f"positions must hold integer positions, got dtype {positions.dtype}; "
            "use torch.arange(T) or positions.long()"
        )
    if positions.shape[0] != x.shape[-2]:
        raise ValueError(
            f"positions has shape {shape_of(positions)} but x has T={x.shape[-2]} vectors "
            f"(shape {shape_of(x)})"
        )


def _apply_rope(x: torch.Tensor, positions: torch.Tensor | None, base: float) -> torch.Tensor:
    dtype = _compute_dtype(x)
    if positions is None:
        positions = torch.arange(x.shape[-2], device=x.device)
    theta = _frequencies(x.shape[-1], base, x.device, dtype)  # (Dh/2,)
    angles = positions.to(device=x.device, dtype=dtype)[:, None] * theta  # (T, Dh/2): p theta_i
    return _rotate_pairs(x, angles.cos(), angles.sin())


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) by the angle whose cos/sin are given.

    Shapes: x (..., T, Dh); cos, sin (T, Dh/2). Computes in cos's dtype and returns
    (..., T, Dh) in x's dtype.
    """
    x_even = x[..., 0::2].to(cos.dtype)  # (..., T, Dh/2)
    x_odd = x[..., 1::2].to(cos.dtype)
    # [x_2i, x_2i+1] -> [x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos]
    rotated = torch.stack(
        (x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1
    )  # (..., T, Dh/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., T, Dh)


class RotaryEmbedding(nn.Module):
    """RoPE as a module (no parameters), applied to q and k after the heads are split.

    Float16/bfloat16/float32 inputs are rotated in float32, float64 inputs in float64; the
    result has the input's dtype.

    Two ways to stretch a model trained on length L to length ``factor * L`` without
    retraining: ``scaling_factor=factor`` divides every position by the factor (*position
    interpolation*, Chen et al. 2023; Hugging Face's "linear" RoPE scaling), so no angle
    exceeds those seen in training but neighbours move closer together; or
    ``base=ntk_scaled_base(d_head, factor)`` (*NTK-aware* scaling), which keeps the fastest
    pairs as they were and slows the slowest ones by the factor.

    Args:
        d_head: Dh, even.
        base: the wavelength scale (10000 as in sinusoidal encodings).
        scaling_factor: positions are divided by it (1 = plain RoPE).

    Shapes:
        forward(x: (..., T, Dh), positions: (T,) or None) -> (..., T, Dh)
    """

    def __init__(
        self, d_head: int, *, base: float = 10000.0, scaling_factor: float = 1.0
    ) -> None:
        super().__init__()
        _require_even_size("d_head", d_head)
        require_positive_number("base", base)
        require_positive_number("scaling_factor", scaling_factor)
        self.d_head = d_head
        self.base = base
        self.scaling_factor = float(scaling_factor)
        self._cache: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        _check_rope_input(x, positions)  # shapes and dtypes only: cheap in every step
        if x.shape[-1] != self.d_head:
            raise ValueError(
                f"x has last dimension {x.shape[-1]} but this RotaryEmbedding was built for "
                f"d_head={self.d_head}"
            )
        if positions is not None:
            if self.scaling_factor != 1.0:  # position interpolation: p -> p / factor
                positions = positions.to(_compute_dtype(x)) / self.scaling_factor
            return _apply_rope(x, positions, self.base)
        cos, sin = self._tables(x.shape[-2], x.device, _compute_dtype(x))
        return _rotate_pairs(x, cos, sin)

    def _tables(
        self, seq_len: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the angles for positions 0..seq_len-1, kept between calls: a model
        applies the same rotation to q and k in every layer at every step."""
        cached = self._cache
        if (cached is None or cached[0].shape[0] < seq_len or cached[0].device != device
                or cached[0].dtype != dtype):
            old = 0 if cached is None or cached[0].dtype != dtype else cached[0].shape[0]
            length = max(seq_len, old)
            with torch.inference_mode(False):  # usable later in training, too
                theta = _frequencies(self.d_head, self.base, device, dtype)  # (Dh/2,)
                p = torch.arange(length, device=device, dtype=dtype)[:, None]  # (T, 1)
                angles = p / self.scaling_factor * theta  # (T, Dh/2): p theta_i (p / factor)
                self._cache = cached = (angles.cos(), angles.sin())  # 2 x (length, Dh/2)
        return cached[0][:seq_len], cached[1][:seq_len]

    def extra_repr(self) -> str:
        factor = "" if self.scaling_factor == 1.0 else f", scaling_factor={self.scaling_factor}"
        return f"d_head={self.d_head}, base={self.base}{factor}"
