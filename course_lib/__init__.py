"""course_lib: the tested building blocks behind the Self-Attention & Transformers course.

Every notebook imports its implementations from here; nothing is defined twice.

The model library, bottom-up:
    device      get_device, seed_everything, best_time, num_threads
    rnn         the Elman RNN, one step and a whole sequence, gradient norms by distance
    attention   scores, softmax, scaled dot-product attention, masks, split_heads /
                merge_heads, MultiHeadAttention (grouped-query with n_kv_heads)
    positions   learned, sinusoidal, ALiBi and rotary position representations
    layers      FeedForward, SwiGLU, LayerNorm and RMSNorm (from the equations); ffn="none"
                gives an attention-only block
    blocks      EncoderBlock, DecoderBlock (pre- or post-norm, optional cross-attention;
                Llama-style: RMSNorm, SwiGLU, grouped-query attention)
    configs     EncoderConfig, DecoderConfig, EncoderDecoderConfig, the models' outputs
    cache       the key/value cache (one layer's, and a whole decoder's; its bytes)
    models      Encoder, DecoderLM, EncoderDecoder, MaskedLM (BERT's masked-LM head), lm_loss,
                parameter counts
    generation  sampling (temperature, top-k, top-p), generation loops
    efficient   chunked (online-softmax), sliding-window and low-rank attention; the bytes of
                a score matrix
    flash       attention whose backward recomputes its tiles from the log-sum-exp (O(n) memory)
    parallel    data parallelism (with overlap), ZeRO-1 and tensor-parallel attention and MLP
                by hand from torch.distributed's collectives
    corpus      the Shakespeare corpus, train/validation split, language-model batches
    tokenizer   CharTokenizer, Seq2SeqVocab, IGNORE_INDEX
    bpe         byte-level BPE: GPT-2's pre-tokenization, train_bpe (the same merges as Hugging
                Face tokenizers), BPETokenizer
    tasks       synthetic tasks: copy, long-range recall, repeated random segments, word-order
                translation with a known alignment; BERT's masking rule (mask_tokens)
    metrics     token and sequence accuracy, the alignment score of cross-attention
    train       a small training loop (AdamW, warm-up and cosine decay, clipping, evaluation);
                checkpoints a run resumes from exactly (save_checkpoint, load_checkpoint)
    pretrained  a real BERT checkpoint in our own Encoder: config, weight map, loading,
                mean pooling; a Hugging Face Llama in our DecoderLM (RoPE pair order)

Three folders, imported one way only (course -> instruments -> the model library):
    (this folder)      the model library above: what the lessons build
    instruments/       tools that measure a model, not lessons (listed in its __init__)
    course/            the course machinery: checks, exercises, grader, Colab set-up, claims

The heavier modules (corpus, train, pretrained, the instruments) are imported on demand:
``from course_lib.instruments.bert_app import load_pretrained_encoder``.
"""

from .attention import (
    MultiHeadAttention,
    attention_scores,
    causal_mask,
    merge_heads,
    padding_mask,
    scaled_dot_product_attention,
    softmax,
    split_heads,
)
from .blocks import DecoderBlock, EncoderBlock
from .configs import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from .device import best_time, get_device, num_threads, seed_everything
from .efficient import chunked_attention, sliding_window_attention
from .layers import FeedForward, LayerNorm, RMSNorm, SwiGLU, layer_norm, rms_norm
from .models import (
    DecoderLM,
    Encoder,
    EncoderDecoder,
    MaskedLM,
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

__version__ = "2.0.0"

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
    "MaskedLM",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "SwiGLU",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "attention_scores",
    "best_time",
    "causal_mask",
    "chunked_attention",
    "count_parameters",
    "elman_forward",
    "elman_step",
    "get_device",
    "gradient_norms",
    "layer_norm",
    "merge_heads",
    "num_threads",
    "padding_mask",
    "parameter_breakdown",
    "rms_norm",
    "scaled_dot_product_attention",
    "seed_everything",
    "sequential_depth",
    "sinusoidal_encoding",
    "sliding_window_attention",
    "softmax",
    "split_heads",
]
