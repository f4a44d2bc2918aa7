"""course_lib: the tested building blocks behind the Self-Attention & Transformers course.

Every notebook imports its implementations from here; nothing is defined twice.

The model library, bottom-up:
    device      get_device, seed_everything, best_time, num_threads
    rnn         the Elman RNN, one step and a whole sequence, gradient norms by distance
    attention   scores, softmax, scaled dot-product attention, masks, MultiHeadAttention
    positions   learned, sinusoidal, ALiBi and rotary position representations
    layers      FeedForward, LayerNorm (from the equations)
    blocks      EncoderBlock, DecoderBlock (pre- or post-norm, optional cross-attention)
    configs     EncoderConfig, DecoderConfig, EncoderDecoderConfig, the models' outputs
    models      Encoder, DecoderLM, EncoderDecoder, lm_loss, parameter counts
    generation  sampling (temperature, top-k) and generation loops
    corpus      the Shakespeare corpus, train/validation split, language-model batches
    tokenizer   CharTokenizer, Seq2SeqVocab, IGNORE_INDEX
    tasks       synthetic tasks: copy, reverse, sort, long-range recall, date translation
    metrics     token and sequence accuracy
    train       a small training loop (AdamW, warm-up and cosine decay, clipping, evaluation)
    pretrained  a real pretrained BERT encoder (all-MiniLM-L6-v2) in our own Encoder
    probes      black-box tests of which outputs depend on which inputs (future leaks)
    viz         attention heatmaps, the course's plot style, widgets

The course's tooling (graded checks, the exercise generator, the grader, the Colab set-up) is
in ``course_lib.course``; it imports the model library, never the other way round.

The heavier modules (corpus, train, pretrained, probes, viz) are imported on demand:
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
from .blocks import DecoderBlock, EncoderBlock
from .configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from .device import best_time, get_device, num_threads, seed_everything
from .layers import FeedForward, LayerNorm, layer_norm
from .models import DecoderLM, Encoder, EncoderDecoder, count_parameters, parameter_breakdown
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

__version__ = "1.0.0"

__all__ = [
    "DecoderBlock",
    "DecoderConfig",
    "DecoderLM",
    "ElmanRNN",
    "Encoder",
    "EncoderBlock",
    "EncoderConfig",
    "EncoderDecoder",
    "EncoderDecoderConfig",
    "FeedForward",
    "LayerNorm",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
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
