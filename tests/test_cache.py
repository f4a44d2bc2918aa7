"""The key/value cache: LayerKVCache appends each call's keys and values, KVCache holds one per
layer; a cache refuses keys of another batch or model, naming past_key_value; its bytes, measured
from its tensors, follow 2 * n_layers * n_kv_heads * Dh * bytes per element per token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from course_lib.attention import MultiHeadAttention
from course_lib.cache import KVCache, LayerKVCache
from course_lib.configs import DecoderConfig
from course_lib.models import DecoderLM


def test_a_layer_cache_appends_along_the_positions():
    gen = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 3, 4, 5, generator=gen)
    k2, v2 = torch.randn(2, 3, 1, 5, generator=gen), torch.randn(2, 3, 1, 5, generator=gen)
    cache = LayerKVCache()
    assert cache.get_seq_length() == 0
    cache.update(k1, v1)
    keys, values = cache.update(k2, v2)
    assert torch.equal(keys, torch.cat([k1, k2], dim=-2))
    assert torch.equal(values, torch.cat([v1, v2], dim=-2))
    assert cache.get_seq_length() == 5


def test_a_cache_creates_its_layers_on_first_use():
    cache = KVCache()
    assert len(cache) == 0 and cache.get_seq_length() == 0
    layer = cache.layer(np.int64(1))  # numpy integers are layer indices too
    assert len(cache) == 2 and cache.layer(1) is layer
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    assert cache.get_seq_length(1) == 3 and cache.get_seq_length(0) == 0


def test_a_layer_cache_refuses_keys_of_another_shape():
    cache = LayerKVCache()
    cache.update(torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4))
    with pytest.raises(ValueError, match=r"the cache holds .*\(2, 2, 4, 4\).*\(3, 2, 4, 4\)"):
        cache.update(torch.randn(3, 2, 1, 4), torch.randn(3, 2, 1, 4))
    with pytest.raises(ValueError, match=r"the cache holds .*\(2, 2, 4, 4\).*\(2, 2, 4, 6\)"):
        cache.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 6))  # values of another width
    layer = MultiHeadAttention(12, 3)  # 3 heads of size 4
    with pytest.raises(ValueError, match=r"^past_key_value holds .*\(2, 2, 4, 4\).*\(2, 3, 4, 4\)"):
        layer(torch.randn(2, 1, 12), is_causal=True, past_key_value=cache)
    assert cache.get_seq_length() == 3  # nothing appended


@pytest.mark.parametrize("layer_idx, error", [(1.0, TypeError), ("1", TypeError),
                                              (True, TypeError), (-1, ValueError)])
def test_a_cache_layer_index_must_be_an_integer(layer_idx, error):
    with pytest.raises(error, match=r"layer_idx.*integer >= 0"):
        KVCache().layer(layer_idx)


def test_kv_cache_layers_append_and_count():
    cache = KVCache()
    assert cache.get_seq_length() == 0 and len(cache) == 0
    k, v = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    keys, values = cache.layer(1).update(k, v)
    assert len(cache) == 2 and cache.get_seq_length() == 0 and cache.get_seq_length(1) == 4
    keys, values = cache.layer(1).update(k[:, :, :1], v[:, :, :1])
    assert keys.shape == (2, 3, 5, 5) and torch.equal(values[:, :, 4], v[:, :, 0])
    assert "KVCache(layers=2" in repr(cache)


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])  # n_heads, n_heads / 2, 1 (multi-query)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cache_bytes_per_token_are_two_layers_kv_heads_head_dim_and_element_size(n_kv_heads,
                                                                               dtype):
    """Measured from the cached tensors: 2 (keys and values) * n_layers * Hkv * Dh * bytes
    per element, per token and sequence; grouped-query attention divides it by H / Hkv."""
    config = DecoderConfig(vocab_size=11, d_model=32, n_heads=4, n_layers=3, max_len=32,
                           positions="rope", n_kv_heads=n_kv_heads)
    model = DecoderLM(config).to(dtype).eval()
    cache, batch, seq_len = KVCache(), 2, 9
    assert cache.nbytes == 0
    model(torch.randint(0, 11, (batch, 5)), past_key_values=cache)
    model(torch.randint(0, 11, (batch, 4)), past_key_values=cache)
    per_token = 2 * config.n_layers * n_kv_heads * (32 // 4) * torch.finfo(dtype).bits // 8
    assert cache.nbytes == per_token * batch * seq_len
    assert cache.layers[0].keys.shape == (batch, n_kv_heads, seq_len, 8)  # before the repeat
