"""The key/value cache: the keys and values each self-attention layer computed for the
positions seen so far, so that generating a token costs one position's, not all of them.
It lives below attention (``MultiHeadAttention`` takes one layer's cache as ``past_key_value``).

Shape legend: B batch, H heads (the key/value heads, Hkv, with grouped-query attention),
S cached positions, T new positions, Dh head dim.

The cache stores keys and values before grouped-query attention shares them among the query
heads, so it costs 2 * n_layers * Hkv * Dh * bytes_per_element per token and sequence: an
``n_kv_heads=1`` model (multi-query attention) caches H times less than a standard one.
"""

from __future__ import annotations

import torch

from ._validate import check_shapes, checks_wanted, require_ndim, require_non_negative_int


class LayerKVCache:
    """The keys and values one self-attention layer has computed so far (Hugging Face's
    ``DynamicLayer``): each call of :meth:`update` appends the new positions'.

    A cache holds one batch of one model: new keys must have its B, H and Dh.

    Attributes:
        keys, values: (B, H, S, Dh) for the S positions seen so far, or None while empty.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new keys and values, (B, H, T, Dh) each; return every position's,
        (B, H, S + T, Dh) each: what the new queries attend to."""
        check_update(self, key_states, value_states)
        if self.keys is None:  # the first positions
            self.keys, self.values = key_states, value_states
        else:  # on the sequence axis
            self.keys = torch.cat([self.keys, key_states], dim=-2)  # (B, H, S + T, Dh)
            self.values = torch.cat([self.values, value_states], dim=-2)  # (B, H, S + T, Dh)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """S, the number of positions cached."""
        return 0 if self.keys is None else self.keys.shape[-2]


class KVCache:
    """The keys and values of every self-attention layer of a decoder (Hugging Face's
    ``DynamicCache``, in miniature), filled in place.

    Pass one as ``past_key_values=`` to :class:`~course_lib.models.DecoderLM`: the model feeds
    only the new tokens through its layers, layer i appends their keys and values to
    ``layer(i)``, and the new queries attend to every cached position.

    Attributes:
        layers: one :class:`LayerKVCache` per layer, created as the layers first use them.
    """

    def __init__(self) -> None:
        self.layers: list[LayerKVCache] = []

    def layer(self, layer_idx: int) -> LayerKVCache:
        """The cache of layer ``layer_idx`` (created empty on first use)."""
        layer_idx = require_non_negative_int("layer_idx", layer_idx)
        while len(self.layers) <= layer_idx:
            self.layers.append(LayerKVCache())
        return self.layers[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of positions cached (in layer ``layer_idx``; 0 when empty)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    @property
    def nbytes(self) -> int:
        """The bytes of every cached key and value, measured from the tensors (as
        ``torch.Tensor.nbytes``): 2 * n_layers * B * S * Hkv * Dh * bytes_per_element."""
        tensors = [t for layer in self.layers for t in (layer.keys, layer.values) if t is not None]
        return sum(t.nbytes for t in tensors)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, seq_length={self.get_seq_length()})"


# --- argument checks


def check_update(cache: LayerKVCache, key_states: object, value_states: object) -> None:
    """New keys and values of one (B, H, T), each as wide as the cached ones."""
    if not checks_wanted():
        return
    for name, states in (("key_states", key_states), ("value_states", value_states)):
        require_ndim(name, states, (4,), "(B, H, T, Dh): split the heads before caching")
    check_shapes(key_states=(key_states, "B H T Dk"), value_states=(value_states, "B H T Dv"))
    if cache.keys is not None:
        check_fits("the cache", cache, *key_states.shape[:2], key_states.shape[3],
                   value_states.shape[3])


def check_fits(name: str, cache: LayerKVCache, batch: int, n_heads: int, d_key: int,
               d_value: int) -> None:
    """A cache that is not empty must hold keys and values of this batch and these heads
    (``name`` is the cache as the learner passed it, e.g. ``past_key_values``)."""
    if not checks_wanted() or cache.keys is None:
        return
    (b, h, _, dk), dv = cache.keys.shape, cache.values.shape[-1]
    if (batch, n_heads, d_key, d_value) != (b, h, dk, dv):
        other = "another batch" if batch != b else "a model with other heads or head widths"
        raise ValueError(f"{name} holds keys and values of (B, H, Dh, Dv) = {(b, h, dk, dv)}, "
                         f"this call's are {(batch, n_heads, d_key, d_value)}: start a new "
                         f"KVCache() for {other}")
