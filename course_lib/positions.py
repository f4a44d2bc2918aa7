"""Position representations: learned absolute, sinusoidal, ALiBi biases and rotary (RoPE).

Self-attention treats its input as a set, so order has to be put in from outside: by adding a
position vector to each token (learned, sinusoidal) or by changing the attention scores
(ALiBi adds a distance penalty; RoPE rotates q and k by position).

Shape legend: T query length, S key length, D d_model, H heads, Dh head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validate import (
    check_positive_ints,
    checks_wanted,
    require_features,
    require_float_dtype,
    require_floating,
    require_ndim,
    require_non_negative_int,
    require_positive_int,
    require_positive_number,
    require_size,
)


class LearnedPositionalEmbedding(nn.Module):
    """A trainable table P with one row per position, P in R^{max_len x D}.

    It only knows the positions it has a row for: more than ``max_len`` positions is an error,
    the hard length limit of learned absolute positions.

    Shapes:
        forward(seq_len, offset=0) -> (T, D), the rows P_offset .. P_{offset+T-1}.
    """

    def __init__(self, max_len: int, d_model: int) -> None:
        super().__init__()
        check_positive_ints(max_len=max_len, d_model=d_model)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)

    def forward(self, seq_len: int, *, offset: int = 0) -> torch.Tensor:
        _check_span(seq_len, offset, self.max_len)
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
    """The fixed sinusoidal position vectors of "Attention Is All You Need", (T, D).

    PE[p, 2i] = sin(p / base^(2i/D)) and PE[p, 2i+1] = cos(p / base^(2i/D)).

    Args:
        n_positions: T.
        d_model: D, even.
        base: the wavelength scale, 10000 in the paper.
        device, dtype: of the result; it is computed on the CPU in float64 (accurate for
            large p; MPS has no float64), then converted.
    """
    _check_sinusoids(n_positions, d_model, base, dtype)
    p = torch.arange(n_positions, dtype=torch.float64)[:, None]  # (T, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angles = p / base ** (two_i / d_model)  # (T, D/2): p / base^(2i/D)
    pe = torch.empty(n_positions, d_model, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(angles)
    pe[:, 1::2] = torch.cos(angles)
    return pe.to(dtype).to(device=device)  # (T, D)


class SinusoidalPositionalEncoding(nn.Module):
    """Sinusoidal positions as a module (:func:`sinusoidal_encoding`): no parameters, any length.

    Shapes:
        forward(seq_len, offset=0) -> (T, D), float32, on the module's device.
    """

    def __init__(self, d_model: int, *, base: float = 10000.0) -> None:
        super().__init__()
        _check_sinusoids(1, d_model, base, torch.float32)
        self.d_model = d_model
        self.base = base
        # follows .to(device), not saved in the state_dict
        self.register_buffer("_anchor", torch.zeros(0), persistent=False)

    def forward(self, seq_len: int, *, offset: int = 0) -> torch.Tensor:
        _check_span(seq_len, offset)
        table = sinusoidal_encoding(offset + seq_len, self.d_model, base=self.base,
                                    device=self._anchor.device)  # (offset + T, D)
        return table[offset:]  # (T, D)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes m_h (Press et al., 2022), (H,).

    For a power of two H: the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8). Otherwise
    the slopes of the closest smaller power of two, then every other slope of the next one.
    """
    check_positive_ints(n_heads=n_heads)

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
    """ALiBi attention biases, (H, T, S): -m_h * |i - j| added to the score of query i, key j.

    With one head and slope 1 this is eq. 13 of the notes: the row [-i, ..., -1, 0, -1, ...]
    added to query i's scores. Queries are the last T of S keys (query i sits at key position
    i + S - T).

    Args:
        n_queries, n_keys: T and S (defaults to T).
        n_heads: H, slopes from :func:`alibi_slopes`; or
        slopes: custom slopes, (H,) (give exactly one of the two).

    Returns:
        Float (H, T, S), to pass as ``attn_bias=`` to attention.
    """
    n_keys = n_queries if n_keys is None else n_keys
    _check_alibi(n_queries, n_keys, n_heads, slopes)
    slopes = alibi_slopes(n_heads) if slopes is None else slopes  # (H,)
    slopes = slopes.to(device=device, dtype=torch.float32)
    query_pos = torch.arange(n_queries, device=device) + (n_keys - n_queries)  # (T,)
    key_pos = torch.arange(n_keys, device=device)  # (S,)
    distance = (query_pos[:, None] - key_pos[None, :]).abs().float()  # (T, S): |i - j|
    return -slopes[:, None, None] * distance  # (H, T, S): -m_h |i - j|


def rope_frequencies(
    d_head: int,
    *,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rotation speeds theta_i = base^(-2i/Dh) of the Dh/2 pairs of dimensions, (Dh/2,)."""
    _check_pairs("d_head", d_head, base=base)
    two_i = torch.arange(0, d_head, 2, device=device, dtype=dtype)  # (Dh/2,)
    return base ** (-two_i / d_head)  # (Dh/2,): theta_i = base^(-2i/Dh)


def ntk_scaled_base(d_head: int, scaling_factor: float, *, base: float = 10000.0) -> float:
    """The RoPE base for "NTK-aware" scaling to ``scaling_factor`` times the trained length.

    base' = base * factor^(Dh / (Dh - 2)): the fastest pair (i = 0) keeps its speed, so nearby
    tokens look as in training, and the slowest (i = Dh/2 - 1) turns ``factor`` times more
    slowly, so the longest distances map onto angles training saw. Dh must be >= 4.
    """
    _check_pairs("d_head", d_head, base=base, scaling_factor=scaling_factor)
    if d_head < 4:
        raise ValueError(f"d_head must be at least 4 for NTK-aware scaling, got {d_head}")
    return base * scaling_factor ** (d_head / (d_head - 2))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """RoPE's angles run in float32 (float64 for float64 x): half precision would round the
    angles of far positions."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def apply_rope(
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    *,
    base: float = 10000.0,
) -> torch.Tensor:
    """Rotary position embedding (Su et al., 2021): rotate dimensions (2i, 2i+1) of the vector
    at position p by the angle p * theta_i.

    Rotations compose, so (R_p q) . (R_r k) = q . R_{r-p} k: the score of a rotated query and
    key depends on their positions only through the offset r - p.

    Args:
        x: queries or keys, (..., T, Dh), Dh even, floating point.
        positions: (T,) integer (or float) positions; defaults to 0..T-1.
        base: the wavelength scale, as for sinusoidal encodings.

    Returns:
        The rotated x, same shape and dtype (computed in float32, float64 for float64 x).
    """
    _check_rope(x, positions, base=base)
    dtype = _compute_dtype(x)
    if positions is None:
        positions = torch.arange(x.shape[-2], device=x.device)
    theta = rope_frequencies(x.shape[-1], base=base, device=x.device, dtype=dtype)  # (Dh/2,)
    angles = positions.to(device=x.device, dtype=dtype)[:, None] * theta  # (T, Dh/2): p theta_i
    cos, sin = angles.cos(), angles.sin()
    x_even = x[..., 0::2].to(dtype)  # (..., T, Dh/2)
    x_odd = x[..., 1::2].to(dtype)
    # [x_2i, x_2i+1] -> [x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos]
    rotated = torch.stack(
        (x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1
    )  # (..., T, Dh/2, 2)
    return rotated.flatten(-2).to(x.dtype)  # (..., T, Dh)


class RotaryEmbedding(nn.Module):
    """RoPE as a module (no parameters), applied to q and k after the heads are split; cos and
    sin are recomputed at every call, as Hugging Face's Llama does.

    Two ways to stretch a model trained on length L to ``factor * L`` without retraining:
    ``scaling_factor=factor`` divides every position by the factor (*position interpolation*,
    Hugging Face's "linear" scaling), or ``base=ntk_scaled_base(d_head, factor)`` (*NTK-aware*).

    Args:
        d_head: Dh, even.
        base: the wavelength scale (10000 as in sinusoidal encodings).
        scaling_factor: positions are divided by it (1 = plain RoPE).

    Shapes:
        forward(x: (..., T, Dh), positions: (T,) or None) -> (..., T, Dh), x's dtype
    """

    def __init__(
        self, d_head: int, *, base: float = 10000.0, scaling_factor: float = 1.0
    ) -> None:
        super().__init__()
        _check_pairs("d_head", d_head, base=base, scaling_factor=scaling_factor)
        self.d_head = d_head
        self.base = base
        self.scaling_factor = float(scaling_factor)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        _check_rope(x, positions, d_head=self.d_head)
        if positions is None:
            positions = torch.arange(x.shape[-2], device=x.device)  # (T,)
        positions = positions.to(_compute_dtype(x)) / self.scaling_factor  # p / factor
        return apply_rope(x, positions=positions, base=self.base)

    def extra_repr(self) -> str:
        factor = "" if self.scaling_factor == 1.0 else f", scaling_factor={self.scaling_factor}"
        return f"d_head={self.d_head}, base={self.base}{factor}"


# ------------------------------------------------------------------------------ argument checks


def _check_pairs(name: str, size: object, **numbers: object) -> None:
    """``size`` dimensions that come in sin/cos or rotation pairs: an even int >= 2; the
    ``numbers`` (base, scaling_factor) > 0."""
    if not checks_wanted():
        return
    if require_positive_int(name, size) % 2:
        raise ValueError(f"{name} must be even (its dimensions come in pairs), got {size}")
    for number_name, value in numbers.items():
        require_positive_number(number_name, value)


def _check_span(seq_len: object, offset: object, max_len: int | None = None) -> None:
    """forward(seq_len, offset=...): ints >= 0, ending by ``max_len`` (a learned table)."""
    if not checks_wanted():
        return
    require_non_negative_int("offset", offset)
    if require_non_negative_int("seq_len", seq_len) + offset > (max_len or math.inf):
        raise ValueError(f"seq_len={seq_len} from position {offset} needs {seq_len + offset} "
                         f"positions, but max_len={max_len}: shorten it or raise max_len")


def _check_sinusoids(n_positions: object, d_model: object, base: object, dtype: object) -> None:
    if not checks_wanted():
        return
    check_positive_ints(n_positions=n_positions)
    _check_pairs("d_model", d_model, base=base)
    require_float_dtype("dtype", dtype)


def _check_alibi(n_queries, n_keys, n_heads, slopes) -> None:
    if not checks_wanted():
        return
    check_positive_ints(n_queries=n_queries, n_keys=n_keys)
    if (n_heads is None) == (slopes is None):
        raise ValueError("give exactly one of n_heads= or slopes=")
    if slopes is not None:
        require_ndim("slopes", slopes, (1,), "(H,)")


def _check_rope(x: object, positions: object, *, base: object = None,
                d_head: int | None = None) -> None:
    """x floating (..., T, Dh), Dh even (a module's d_head); positions (T,); base > 0."""
    if not checks_wanted():
        return
    require_floating("x", require_ndim("x", x, (2, 3, 4, 5), "(..., T, Dh)"))
    if d_head is None:
        _check_pairs("x.shape[-1] (Dh)", x.shape[-1], base=base)
    else:
        require_features("x", x, d_head, "this RotaryEmbedding's d_head")
    if positions is not None:
        require_ndim("positions", positions, (1,), "(T,)")
        require_size("positions", positions, 0, x.shape[-2], "x's number of positions T")
        if positions.dtype == torch.bool:
            raise ValueError("positions must hold integer (or float) positions, got torch.bool")
