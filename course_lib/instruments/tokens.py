"""Chapter 13's instruments: tokens made visible, and vocabularies compared fairly.

- :func:`show_tokens` and :func:`token_widget` colour a text's tokens, so a learner sees where a
  tokenizer cuts (spaces shown as ``·``, newlines as ``↵``, bytes that are not whole UTF-8
  characters as ``<0xE2>``).
- :func:`bits_per_character` scores a language model on raw text in a unit that does not
  depend on its vocabulary: loss per token is not comparable between a byte model (a token is
  a character) and a BPE model (a token is two to four), bits per character is.
- :func:`equal_compute_run` trains a fresh :class:`~course_lib.DecoderLM` on one tokenization
  of a text for a given number of updates and measures it (:class:`TokenRun`).

Shape legend: B batch, T block length in tokens, V vocabulary size, D d_model.
"""

from __future__ import annotations

import html
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .._validate import (
    check_bools,
    check_positive_ints,
    check_text,
    require_instance,
    require_int,
    require_positive_number,
)
from ..bpe import BPETokenizer
from ..configs import DecoderConfig
from ..device import get_device, seed_everything
from ..models import DecoderLM, Encoder, EncoderDecoder, MaskedLM, count_parameters
from ..train import TrainConfig, TrainHistory, lm_batches, train

SHOWN_AS = {" ": "·", "\n": "↵"}  # what show_tokens draws instead of invisible characters
PASTELS = ("#fde2e4", "#d7f0dd", "#dbe7fb", "#fff1c1", "#eadcf8")  # adjacent tokens differ


# --------------------------------------------------------------------------------------------
# Seeing tokens


def token_text(token: bytes) -> str:
    """A token's bytes as they are shown: UTF-8 characters, with ``·`` for a space, ``↵`` for
    a newline and ``<0xE2>`` for each byte that is not part of a whole character in the token
    (a character cut between two tokens)."""
    require_instance("token", token, bytes, "the bytes of one token",
                     "e.g. tokenizer.vocab[i]")
    # surrogateescape maps each undecodable byte b to the lone surrogate U+DC00 + b
    chars = token.decode("utf-8", errors="surrogateescape")
    return "".join(f"<0x{ord(c) - 0xDC00:02X}>" if 0xDC80 <= ord(c) <= 0xDCFF
                   else SHOWN_AS.get(c, c) for c in chars)


def show_tokens(tokenizer: BPETokenizer, text: str):
    """``text`` as coloured spans, one per token, in alternating pastel colours; hovering a
    token shows its id. Returns an ``IPython.display.HTML`` (its ``.data`` is the HTML)."""
    check_tokenizer(tokenizer)
    check_text("text", text)
    from IPython.display import HTML  # Jupyter's; imported here so the module needs no IPython

    return HTML(tokens_html(tokenizer, text))


def tokens_html(tokenizer: BPETokenizer, text: str) -> str:
    """The HTML of :func:`show_tokens`: a ``<div>`` holding one ``<span>`` per token (a line
    break follows a token that ends a line)."""
    check_tokenizer(tokenizer)
    check_text("text", text)
    spans = []
    for n, i in enumerate(tokenizer.encode(text)):
        token = tokenizer.vocab[i]
        spans.append(f'<span title="id {i}" style="background:{PASTELS[n % len(PASTELS)]};'
                     f'padding:1px 0;border-radius:3px">{html.escape(token_text(token))}</span>'
                     + ("<br>" if token.endswith(b"\n") else ""))
    return ('<div style="font-family:monospace;line-height:1.9;white-space:pre-wrap">'
            + "".join(spans) + "</div>")


def tokens_report(tokenizers: dict[str, BPETokenizer], text: str) -> str:
    """Each tokenizer's name, token count and coloured tokens, as one HTML string."""
    check_tokenizers(tokenizers)
    check_text("text", text)
    parts = [f"<p><b>{html.escape(name)}</b> (V = {tok.vocab_size:,}): "
             f"{len(tok.encode(text)):,} tokens for {len(text):,} characters</p>"
             + tokens_html(tok, text) for name, tok in tokenizers.items()]
    return "".join(parts)


def token_widget(tokenizers: dict[str, BPETokenizer], text: str = "Hello world's  end!") -> None:
    """A text box; below it, for each tokenizer, its coloured tokens and their count, updated
    as the learner types. Without a live front end (or ipywidgets) it shows the tokens of
    ``text`` once.

    Args:
        tokenizers: name -> tokenizer, e.g. ``{"bytes": BPETokenizer([]), "BPE 4096": tok}``.
        text: the text the box starts with.
    """
    check_tokenizers(tokenizers)
    check_text("text", text)
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        get_ipython = None
    try:
        import ipywidgets
    except ImportError:
        ipywidgets = None
    if get_ipython is None or get_ipython() is None:  # a plain Python run: print the tokens
        for name, tok in tokenizers.items():
            print(f"{name}: {[token_text(tok.vocab[i]) for i in tok.encode(text)]}")
        return
    if ipywidgets is None:  # a notebook without widgets: the tokens of the first text
        display(HTML(tokens_report(tokenizers, text)))
        return
    box = ipywidgets.Textarea(value=text, description="text", continuous_update=True,
                              layout=ipywidgets.Layout(width="95%", height="5em"))
    shown = ipywidgets.HTML(value=tokens_report(tokenizers, text))

    def update(change: dict) -> None:
        shown.value = tokens_report(tokenizers, change["new"])

    box.observe(update, names="value")
    display(ipywidgets.VBox([box, shown]))


# --------------------------------------------------------------------------------------------
# Bits per character


@torch.no_grad()
def bits_per_character(model: nn.Module, tokenizer: BPETokenizer, text: str, *,
                       block_size: int, batch_size: int = 32) -> float:
    """The model's mean next-token loss on ``text``, in bits per character of ``text``.

    The ids of ``text`` are cut into windows of ``block_size + 1`` tokens that overlap by one
    (the last may be shorter): each window's first ``block_size`` tokens are the input, its
    last ``block_size`` the targets. So every token but the very first is scored exactly once,
    with the tokens before it in its block as context; the first token has nothing to be
    predicted from and is not scored, and the characters wholly inside it are not counted:

        bits/char = (sum over scored tokens of -ln p(token | context)) / (chars covered * ln 2)

    Args:
        model: a DecoderLM (any model whose ``model(ids).logits`` is (B, T, V) with V at least
            the tokenizer's), run in eval mode without gradients on its own device.
        tokenizer: the tokenizer the model was trained with.
        text: the text to score (at least two tokens).
        block_size: T, the context length in tokens (at most the model's ``max_len``).
        batch_size: windows per forward pass (only speed and memory depend on it).

    Returns:
        Bits per character, a float.
    """
    ids, block_size, batch_size = check_scoring(model, tokenizer, text, block_size, batch_size)
    # characters wholly inside the first token (a character it cuts counts as covered)
    first_chars = len(tokenizer.vocab[ids[0]].decode("utf-8", errors="ignore"))
    chars = len(text) - first_chars
    data = torch.tensor(ids, dtype=torch.long)
    n_full = (len(ids) - 1) // block_size
    full = data[: n_full * block_size + 1]
    windows = [full.unfold(0, block_size + 1, block_size)] if n_full else []  # (n, T + 1)
    if len(ids) - 1 > n_full * block_size:  # the shorter last window
        windows.append(data[n_full * block_size:][None])  # (1, T' + 1)
    device = next(model.parameters(), torch.empty(0)).device  # a model without parameters: CPU
    was_training = model.training
    model.eval()
    nats = 0.0
    try:
        for group in windows:
            for batch in group.split(batch_size):  # (B, T + 1)
                batch = batch.to(device)
                logits = model(batch[:, :-1]).logits  # (B, T, V)
                nats += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(),
                                        reduction="sum").item()
    finally:
        model.train(was_training)
    return nats / (chars * math.log(2))


# --------------------------------------------------------------------------------------------
# One run of the equal-compute comparison


@dataclass
class TokenRun:
    """What :func:`equal_compute_run` measured.

    Attributes:
        vocab_size: V.
        parameters: the model's parameters (the tied embedding and head once).
        embedding_and_head_parameters: the token embedding, shared with the output head: V x D.
        chars_per_token: characters per token of the validation text.
        bits_per_char: :func:`bits_per_character` on the validation text.
        seconds: wall-clock seconds of training (evaluations included, scoring not).
        block_size, d_model, n_layers: the run's sizes (T in tokens, D, layers).
        train_chars_per_update: characters of training text per update,
            batch_size x block_size x (characters per token of the training text).
        history: the training run's :class:`~course_lib.train.TrainHistory`.
    """

    vocab_size: int
    parameters: int
    embedding_and_head_parameters: int
    chars_per_token: float
    bits_per_char: float
    seconds: float
    block_size: int
    d_model: int
    n_layers: int
    train_chars_per_update: float
    history: TrainHistory = field(repr=False)

    @property
    def attention_flops_per_char(self) -> float:
        """Forward FLOPs of the attention products per character of text: for a block of T
        tokens, QK^T and the weights times V are each T x T x D multiply-adds (2 T^2 D FLOPs)
        per layer, 4 T D per token, so 4 T D L / (characters per token) per character."""
        return 4 * self.block_size * self.d_model * self.n_layers / self.chars_per_token


def equal_compute_run(tokenizer: BPETokenizer, train_text: str, val_text: str, *,
                      updates: int, batch_size: int, block_size: int, d_model: int,
                      n_layers: int, n_heads: int, lr: float, seed: int,
                      progress: bool = False) -> TokenRun:
    """Train a fresh DecoderLM on ``tokenizer``'s ids of ``train_text`` and score it.

    Every run with the same ``updates``, ``batch_size``, ``block_size`` (in tokens) and body
    (``d_model``, ``n_layers``, ``n_heads``) does the same work in the blocks whatever the
    vocabulary: that is what "equal compute" means here. What differs: the embedding lookup
    (free) and the output head, V x D multiply-adds per token, and how much text a token holds.

    The model: GPT-2-style (pre-norm, learned positions, GELU, tied embedding and head, no
    dropout), ``max_len = block_size``. Training: :func:`course_lib.train.train` on random
    windows (``lm_batches`` with a generator seeded by ``seed``), AdamW, warm-up over a tenth
    of the updates (at most 100) then cosine decay to lr / 10. On ``get_device()``'s device.

    Returns:
        A :class:`TokenRun`; deterministic per ``seed`` on one machine.
    """
    check_run(tokenizer, updates, batch_size, block_size, d_model, n_layers, n_heads, lr, seed,
              progress)
    updates, batch_size, block_size, d_model, n_layers, n_heads, seed = map(
        int, (updates, batch_size, block_size, d_model, n_layers, n_heads, seed))  # numpy ints
    train_ids = torch.tensor(check_enough_text("train_text", train_text, tokenizer,
                                               block_size + 1), dtype=torch.long)  # (N,)
    check_enough_text("val_text", val_text, tokenizer, 2)
    device = get_device()
    seed_everything(seed)
    model = DecoderLM(DecoderConfig(vocab_size=tokenizer.vocab_size, d_model=d_model,
                                    n_heads=n_heads, n_layers=n_layers, max_len=block_size,
                                    dropout=0.0)).to(device)
    batches = lm_batches(train_ids, batch_size, block_size,
                         generator=torch.Generator().manual_seed(seed))
    config = TrainConfig(max_iters=updates, lr=lr, min_lr=lr / 10,
                         warmup_iters=min(100, updates // 10), eval_interval=updates,
                         eval_iters=1, seed=seed)
    started = time.perf_counter()
    history = train(model, batches, config, progress=progress, desc=f"V = {tokenizer.vocab_size}")
    seconds = time.perf_counter() - started
    val_tokens = len(tokenizer.encode(val_text))
    return TokenRun(
        vocab_size=tokenizer.vocab_size, parameters=count_parameters(model),
        embedding_and_head_parameters=count_parameters(
            nn.ModuleList([model.embeddings.token, model.lm_head])),
        chars_per_token=len(val_text) / val_tokens,
        bits_per_char=bits_per_character(model, tokenizer, val_text, block_size=block_size),
        seconds=seconds, block_size=block_size, d_model=d_model, n_layers=n_layers,
        train_chars_per_update=batch_size * block_size * len(train_text) / len(train_ids),
        history=history)


# --------------------------------------------------------------------------------------------
# Argument checks


def check_tokenizer(tokenizer: object, name: str = "tokenizer") -> None:
    if not isinstance(tokenizer, BPETokenizer):
        raise TypeError(f"{name} must be a BPETokenizer (train_bpe(...), or BPETokenizer([]) "
                        f"for plain bytes), got {type(tokenizer).__name__}")


def check_tokenizers(tokenizers: object) -> None:
    """A non-empty dict name -> BPETokenizer."""
    if not isinstance(tokenizers, dict):
        raise TypeError("tokenizers must be a dict name -> BPETokenizer, such as {'bytes': "
                        f"BPETokenizer([])}}, got {type(tokenizers).__name__}")
    if not tokenizers:
        raise ValueError("tokenizers is empty: give at least one name -> BPETokenizer")
    for name, tok in tokenizers.items():
        check_tokenizer(tok, f"tokenizers[{name!r}]")


def check_enough_text(name: str, text: object, tokenizer: BPETokenizer, needed: int) -> list[int]:
    """``text`` is a str of at least ``needed`` tokens; returns its ids."""
    check_text(name, text)
    ids = tokenizer.encode(text)
    if len(ids) < needed:
        raise ValueError(f"{name} gives {len(ids)} token(s) but at least {needed} are needed "
                         "(the first token is never scored); give a longer text")
    return ids


_NOT_AN_LM = {  # why bits_per_character cannot score these course_lib models
    Encoder: "which returns hidden states, not next-token logits",
    MaskedLM: "which sees every token, those it would predict included, so its score would "
              "mean nothing",
    EncoderDecoder: "which needs a source sequence as well",
}


def check_scoring(model: object, tokenizer: object, text: object, block_size: object,
                  batch_size: object) -> tuple[list[int], int, int]:
    """bits_per_character's arguments; returns the ids of ``text``, block_size, batch_size."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module such as a DecoderLM, got "
                        f"{type(model).__name__}")
    why = next((why for kind, why in _NOT_AN_LM.items() if isinstance(model, kind)), None)
    if why is not None:
        raise TypeError(f"model must be a decoder-only language model such as a DecoderLM, "
                        f"whose model(ids).logits at position t predict token t + 1 from tokens "
                        f"0..t; got {type(model).__name__}, {why}")
    check_tokenizer(tokenizer)
    check_positive_ints(block_size=block_size, batch_size=batch_size)
    config = getattr(model, "config", None)
    vocab, max_len = getattr(config, "vocab_size", None), getattr(config, "max_len", None)
    if vocab is not None and vocab < tokenizer.vocab_size:
        raise ValueError(f"the model's vocab_size is {vocab} but the tokenizer's is "
                         f"{tokenizer.vocab_size}: score a model with its own tokenizer")
    if max_len is not None and block_size > max_len:
        raise ValueError(f"block_size={block_size} is longer than the model's max_len="
                         f"{max_len}; use block_size <= {max_len}")
    return check_enough_text("text", text, tokenizer, 2), int(block_size), int(batch_size)


def check_run(tokenizer: object, updates: object, batch_size: object, block_size: object,
              d_model: object, n_layers: object, n_heads: object, lr: object, seed: object,
              progress: object) -> None:
    """equal_compute_run's arguments besides the texts."""
    check_tokenizer(tokenizer)
    check_positive_ints(updates=updates, batch_size=batch_size, block_size=block_size,
                        d_model=d_model, n_layers=n_layers, n_heads=n_heads)
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} must be divisible by n_heads={n_heads}")
    require_positive_number("lr", lr)
    require_int("seed", seed)
    check_bools(progress=progress)
