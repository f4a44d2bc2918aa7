"""course_lib: the tested building blocks behind the Self-Attention & Transformers course.

Every notebook imports its implementations from here; nothing is defined twice.

Modules, bottom-up:
    device      get_device, seed_everything
    rnn         the Elman RNN
    attention   scores, softmax, scaled dot-product attention, masks, MultiHeadAttention
    positions   learned, sinusoidal, ALiBi and rotary position representations
    layers      FeedForward, LayerNorm, residual and Add & Norm wrappers
    models      encoder and decoder blocks, TransformerEncoder, TransformerDecoder,
                EncoderDecoder, generation
"""

from .attention import (
    MultiHeadAttention,
    attention_scores,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
)
from .device import get_device, seed_everything
from .layers import AddNorm, FeedForward, LayerNorm, Residual, layer_norm
from .models import (
    DecoderBlock,
    DecoderConfig,
    EncoderBlock,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    TransformerDecoder,
    TransformerEncoder,
    count_parameters,
    parameter_breakdown,
)
from .positions import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    sinusoidal_encoding,
)
from .rnn import ElmanRNN, elman_forward, elman_step, gradient_norms, sequential_depth

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "DecoderBlock",
    "DecoderConfig",
    "ElmanRNN",
    "EncoderBlock",
    "EncoderConfig",
    "EncoderDecoder",
    "EncoderDecoderConfig",
    "FeedForward",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "Residual",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "TransformerDecoder",
    "TransformerEncoder",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_scores",
    "causal_mask",
    "count_parameters",
    "elman_forward",
    "elman_step",
    "get_device",
    "gradient_norms",
    "layer_norm",
    "padding_mask",
    "parameter_breakdown",
    "scaled_dot_product_attention",
    "seed_everything",
    "sequential_depth",
    "sinusoidal_encoding",
    "softmax",
]
