"""course_lib: the tested building blocks behind the Self-Attention & Transformers course.

Every notebook imports its implementations from here; nothing is defined twice.

Modules, bottom-up:
    device      get_device, seed_everything, best_time, num_threads
    rnn         the Elman RNN, one step and a whole sequence, gradient norms by distance
    attention   scores, softmax, scaled dot-product attention, masks, MultiHeadAttention
    positions   learned, sinusoidal, ALiBi and rotary position representations
    layers      FeedForward, LayerNorm, residual and Add & Norm wrappers
    models      encoder and decoder blocks, TransformerEncoder, TransformerDecoder,
                EncoderDecoder, generation, parameter counts
    data        the Shakespeare corpus, a character tokenizer, synthetic tasks
    train       a small training loop (AdamW, warm-up and cosine decay, clipping, evaluation)
    pretrained  a real pretrained BERT encoder (all-MiniLM-L6-v2) in our own model
    probes      black-box tests of which outputs depend on which inputs (future leaks)
    viz         attention heatmaps, the course's plot style, widgets
    checks      graded-exercise checks, one module per chapter
    exercises   generate exercise notebooks from solution notebooks
    grade       python -m course_lib.grade: score exercise notebooks
    colab       the notebooks' shared set-up cell

The heavier modules (data, train, pretrained, probes, checks, grade) are imported on demand:
``from course_lib.pretrained import load_pretrained_encoder``.
"""

from .attention import (
    MultiHeadAttention,
    attention_scores,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
)
from .device import best_time, get_device, num_threads, seed_everything
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
    "best_time",
    "causal_mask",
    "count_parameters",
    "elman_forward",
    "elman_step",
    "get_device",
    "gradient_norms",
    "layer_norm",
    "num_threads",
    "padding_mask",
    "parameter_breakdown",
    "scaled_dot_product_attention",
    "seed_everything",
    "sequential_depth",
    "sinusoidal_encoding",
    "softmax",
]
