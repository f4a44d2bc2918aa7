"""The key/value cache: what each self-attention layer has computed for the positions seen so
far, so that generating the next token costs one position's keys and values, not all of them.

Shape legend: B batch, H heads, S cached positions, T new positions, Dh head dim.

It lives below attention (``MultiHeadAttention`` takes one layer's cache as
``past_key_value``); the generation loops in :mod:`course_lib.generation` fill it.
"""

from __future__ import annotations

import torch

from ._validate import require_int, require_non_negative_int


class LayerKVCache:
    """The keys and values one self-attention layer has computed so far (what Hugging Face
    calls a ``DynamicLayer``): each call appends the new positions' keys and values.

    This is what :class:`~course_lib.attention.MultiHeadAttention` takes as
    ``past_key_value``: one layer's cache. (Hugging Face's attention layers instead receive
    the whole cache together with their ``layer_idx`` and call ``cache.update(k, v,
    layer_idx)``; course_lib's models pick the layer's entry, ``KVCache.layer(i)``, for it.)

    A cache holds one batch of one model: new keys must have its batch size B, its H heads
    and its head size Dh (once emptied, e.g. by ``crop(0)``, it takes any).

    Attributes:
        keys, values: (B, H, S, Dh) for the S positions seen so far, or None while empty.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' keys and values, (B, H, T, Dh) each, and return every
        position's, (B, H, S + T, Dh) each: what the new queries attend to."""
        if self.keys is not None and (key_states.shape[:2] != self.keys.shape[:2]
                                      or key_states.shape[-1] != self.keys.shape[-1]):
            b, h, _, d = self.keys.shape
            raise ValueError(
                f"past_key_value holds keys of {b} sequences with {h} heads of size {d}, (B, H, "
                f"S, Dh) = {tuple(self.keys.shape)}, but the new keys have shape "
                f"{tuple(key_states.shape)}: a cache serves one batch of one model; start a new "
                "KVCache() (or crop(0) this one) for another batch or model"
            )
        if self.keys is None:
            self.keys, self.values = key_states, value_states
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)  # (B, H, S + T, Dh)
            self.values = torch.cat([self.values, value_states], dim=-2)  # (B, H, S + T, Dh)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """S, the number of positions cached."""
        return 0 if self.keys is None else self.keys.shape[-2]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (a negative value drops that many from the
        end), e.g. to take back tokens that were rejected. Cropped to 0 it is empty again."""
        max_length = require_int("max_length", max_length)
        if self.keys is not None:
            keep = max_length if max_length >= 0 else max(self.get_seq_length() + max_length, 0)
            self.keys = self.keys[..., :keep, :] if keep else None
            self.values = self.values[..., :keep, :] if keep else None


class KVCache:
    """The keys and values of every self-attention layer of a decoder, for the positions it
    has processed (Hugging Face's ``DynamicCache``, in miniature).

    Pass one as ``past_key_values=`` to :class:`~course_lib.models.DecoderLM`: the model feeds
    only the new tokens through its layers, each layer appends their keys and values here,
    and the new queries attend to every cached position. The cache is filled in place.

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

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys and values (B, H, T, Dh) to layer ``layer_idx``; return all of them."""
        return self.layer(layer_idx).update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The number of positions cached (in layer ``layer_idx``; 0 when empty)."""
        return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions in every layer (negative: drop from the end)."""
        max_length = require_int("max_length", max_length)
        for layer in self.layers:
            layer.crop(max_length)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"KVCache(layers={len(self.layers)}, seq_length={self.get_seq_length()})"
