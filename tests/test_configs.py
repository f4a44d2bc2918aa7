"""course_lib.configs: the models' frozen config dataclasses check their fields when created:
the exception type, the field's name and the value received or expected."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.configs import (
    DecoderConfig,
    EncoderConfig,
    EncoderDecoderConfig,
    TransformerConfig,
)

BAD_CONFIGS = [
    # d_model not divisible by n_heads
    (lambda: DecoderConfig(vocab_size=5, d_model=10, n_heads=4), ValueError,
     r"d_model=10.*n_heads=4"),
    # sizes <= 0, and sizes of the wrong type
    (lambda: DecoderConfig(vocab_size=0), ValueError, r"^vocab_size .*>= 1.*got 0"),
    (lambda: DecoderConfig(vocab_size=5, n_layers=0), ValueError, r"^n_layers .*>= 1.*got 0"),
    (lambda: EncoderConfig(vocab_size=5, d_ff=-1), ValueError, r"^d_ff .*>= 1.*got -1"),
    (lambda: DecoderConfig(vocab_size=5, max_len=64.0), TypeError, r"^max_len .*64\.0.*write 64"),
    (lambda: DecoderConfig(vocab_size=5, max_len="64"), TypeError, r"^max_len .*'64'"),
    (lambda: EncoderConfig(vocab_size=5, type_vocab_size=-1), ValueError,
     r"^type_vocab_size .*>= 0.*got -1"),
    # numbers and choices
    (lambda: EncoderConfig(vocab_size=5, dropout=1.5), ValueError, r"^dropout .*\[0, 1\).*1\.5"),
    (lambda: DecoderConfig(vocab_size=5, dropout="0.1"), TypeError, r"^dropout .*\[0, 1\).*'0\.1'"),
    (lambda: EncoderConfig(vocab_size=5, layer_norm_eps=0), ValueError,
     r"^layer_norm_eps .*> 0.*got 0"),
    (lambda: EncoderConfig(vocab_size=5, activation="swish"), ValueError,
     r"^activation .*'gelu'.*'swish'"),
    (lambda: DecoderConfig(vocab_size=5, positions="relative"), ValueError,
     r"^positions .*'rope'.*'relative'"),
    # the Llama-style switches of a decoder
    (lambda: DecoderConfig(vocab_size=5, norm="batch"), ValueError, r"^norm .*'rms'.*'batch'"),
    (lambda: DecoderConfig(vocab_size=5, ffn="geglu"), ValueError, r"^ffn .*'swiglu'.*'geglu'"),
    (lambda: DecoderConfig(vocab_size=5, n_heads=4, n_kv_heads=3), ValueError,
     r"^n_heads=4 is not divisible by n_kv_heads=3"),
    (lambda: DecoderConfig(vocab_size=5, n_kv_heads=0), ValueError, r"^n_kv_heads .*>= 1"),
    (lambda: DecoderConfig(vocab_size=5, rope_theta=0.0), ValueError, r"^rope_theta .*> 0"),
    (lambda: EncoderConfig(vocab_size=5, norm_first="yes"), TypeError,
     r"^norm_first must be True or False.*'yes'"),
    # a pad_id outside the vocabulary
    (lambda: DecoderConfig(vocab_size=5, pad_id=5), ValueError, r"^pad_id .*5.*0\.\.4"),
    (lambda: EncoderDecoderConfig.shared(5, 6, pad_id=-1), ValueError, r"^pad_id .*-1.*0\.\.4"),
    # the two halves of an encoder-decoder
    (lambda: EncoderDecoderConfig(DecoderConfig(vocab_size=5), DecoderConfig(vocab_size=5)),
     TypeError, r"^encoder .*EncoderConfig.*got DecoderConfig"),
    (lambda: EncoderDecoderConfig(EncoderConfig(vocab_size=5, d_model=8, n_heads=2),
                                  DecoderConfig(vocab_size=5, d_model=16, n_heads=2)),
     ValueError, r"encoder\.d_model=8.*decoder\.d_model=16"),
]


@pytest.mark.parametrize("call, error, message", BAD_CONFIGS,
                         ids=[m.lstrip("^").split(" ")[0].split("=")[0] + f"-{i}"
                              for i, (_, _, m) in enumerate(BAD_CONFIGS)])
def test_bad_config_values_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()


BOOLEAN_OPTIONS = {
    "TransformerConfig norm_first": (lambda v: TransformerConfig(vocab_size=5, norm_first=v),
                                     "norm_first"),
    "EncoderConfig embed_norm": (lambda v: EncoderConfig(vocab_size=5, embed_norm=v),
                                 "embed_norm"),
    "DecoderConfig tie_embeddings": (lambda v: DecoderConfig(vocab_size=5, tie_embeddings=v),
                                     "tie_embeddings"),
}


@pytest.mark.parametrize("value", ["post", "False", 0, None])
@pytest.mark.parametrize("option", sorted(BOOLEAN_OPTIONS))
def test_boolean_options_refuse_anything_but_true_and_false(option, value):
    build, name = BOOLEAN_OPTIONS[option]
    with pytest.raises(TypeError, match=rf"^{name} must be True or False, got {value!r}"):
        build(value)


def test_a_wrong_type_is_a_plain_type_error():
    with pytest.raises(TypeError, match="max_len") as info:
        DecoderConfig(vocab_size=5, max_len=64.0)
    assert not isinstance(info.value, ValueError)


def test_numpy_integers_are_sizes_and_ids_too():
    config = DecoderConfig(vocab_size=np.int64(7), d_model=np.int64(8), n_heads=np.int64(2),
                           pad_id=np.int64(0))
    assert config.pad_id == 0 and config.d_model % config.n_heads == 0


def test_the_llama_switches_default_to_the_gpt_style_decoder():
    config = DecoderConfig(vocab_size=5)
    assert (config.norm, config.ffn, config.n_kv_heads, config.rope_theta) == \
        ("layer", "mlp", None, 10000.0)
    llama = DecoderConfig(vocab_size=5, norm="rms", ffn="swiglu", n_kv_heads=1, rope_theta=5e5,
                          positions="rope", bias=False)
    assert "norm='rms', ffn='swiglu', n_kv_heads=1, rope_theta=500000.0" in repr(llama)
    assert not hasattr(EncoderConfig(vocab_size=5), "norm")  # the encoder's repr is unchanged
