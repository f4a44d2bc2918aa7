"""What the tests of course_lib.pretrained and course_lib.instruments.bert_app share: example
sentences, a tiny BERT saved by transformers itself, and a copy of a model folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import torch  # noqa: E402
import transformers  # noqa: E402

from course_lib.instruments.bert_app import REQUIRED_FILES  # noqa: E402

SENTENCES = [
    "The cat sat on the mat.",
    "Attention lets every token look at every other token in one step, however far apart.",
    "Hi!",
    "The animal didn't cross the street because it was too tired.",
]
# Longer than all-MiniLM-L6-v2's 256-token limit, so truncation is exercised too.
LONG = " ".join(["attention is all you need"] * 70)

TINY = dict(
    vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=72, max_position_embeddings=40, type_vocab_size=3, layer_norm_eps=1e-7,
    hidden_act="gelu_new",
)


def save_tiny_bert(path: Path, folder: Path) -> tuple[Path, transformers.BertModel]:
    """A BertForMaskedLM (tensor names 'bert.*' plus 'cls.*' heads) with every weight, LayerNorm
    gains and biases included, moved away from its initial value so each one matters, saved in
    ``path`` with ``folder``'s tokenizer; returns the path and Hugging Face's BertModel of it."""
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(transformers.BertConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    shutil.copy(folder / "tokenizer.json", path / "tokenizer.json")
    reference = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager")
    return path, reference.eval()


def copy_folder(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A copy of model folder ``src`` in ``dst`` without the files named in ``skip``."""
    dst.mkdir()
    for name in REQUIRED_FILES:
        if name not in skip:
            shutil.copy(src / name, dst / name)
    return dst
