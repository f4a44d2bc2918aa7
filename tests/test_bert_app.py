"""course_lib.instruments.bert_app: reading a model folder (config.json, the tokenizer) into a
PretrainedEncoder, its tokenizer (against Hugging Face's), encode and attention maps, sentence
embeddings and semantic search (against sentence-transformers), and the errors of the loader,
the tokenizer and the embedding options. (The comparisons of the encoder itself with Hugging
Face's BertModel, and mean_pool, are in test_pretrained.py.)"""

from __future__ import annotations

import json
import os
import re

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be downloaded
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from bert_helpers import LONG, SENTENCES, copy_folder, save_tiny_bert  # noqa: E402

from course_lib.instruments.bert_app import (  # noqa: E402
    REQUIRED_FILES,
    default_model_dir,
    load_pretrained_encoder,
    load_tokenizer,
    semantic_search,
)

ATOL = 1e-4



@pytest.fixture(scope="module")
def folder():
    return default_model_dir()


@pytest.fixture(scope="module")
def bert(folder):
    return load_pretrained_encoder(folder)


def _model_folder(tmp_path, source, config=None, skip=()):
    """A model folder whose big files link to ``source``'s, with ``config`` as config.json."""
    tmp_path.mkdir(exist_ok=True)
    for name in ("model.safetensors", "tokenizer.json"):
        if name not in skip:
            (tmp_path / name).symlink_to(source / name)
    if "config.json" not in skip:
        text = (source / "config.json").read_text() if config is None else json.dumps(config)
        (tmp_path / "config.json").write_text(text)
    return tmp_path


# --------------------------------------------------------------------------------------------
# Folders and config.json


def test_folder_missing_files(tmp_path, folder):
    with pytest.raises(FileNotFoundError, match=r"^path='.*nowhere'.*does not exist"):
        load_pretrained_encoder(tmp_path / "nowhere")
    partial = _model_folder(tmp_path / "partial", folder, skip=("tokenizer.json",))
    with pytest.raises(FileNotFoundError, match=r"partial is missing tokenizer\.json.*config\.json"):
        load_pretrained_encoder(partial)
    no_config = _model_folder(tmp_path / "no_config", folder, skip=("config.json",))
    with pytest.raises(FileNotFoundError, match=r"no_config is missing config\.json"):
        load_pretrained_encoder(no_config)


def test_load_pretrained_encoder_argument_types(folder):
    with pytest.raises(TypeError, match=r"^path .*folder path.*123"):
        load_pretrained_encoder(123)
    with pytest.raises(TypeError, match=r"^max_length .*>= 1.*'20'"):
        load_pretrained_encoder(folder, max_length="20")
    with pytest.raises(ValueError, match=r"^max_length .*>= 1.*0"):
        load_pretrained_encoder(folder, max_length=0)
    with pytest.raises(TypeError, match=r"^pad_id .*>= 0.*'0'"):
        load_tokenizer(folder, max_length=8, pad_id="0")


def test_config_json_with_wrong_types_through_the_loader(tmp_path, folder):
    config = {**json.loads((folder / "config.json").read_text()), "num_attention_heads": "12"}
    path = _model_folder(tmp_path / "model", folder, config)
    with pytest.raises(TypeError, match=r"config\.json: 'num_attention_heads' .*>= 1.*'12'"):
        load_pretrained_encoder(path)


# --------------------------------------------------------------------------------------------
# Tokenizing and the embedding options


@pytest.mark.parametrize(("sentences", "match"), [
    (123, r"^sentences .*string or a list of strings.*123"),
    (None, r"^sentences .*string or a list of strings.*None"),
    (b"bytes", r"^sentences .*string or a list of strings.*b'bytes'"),
    (["fine", 3], r"^sentences .*string or a list of strings.*item 1 is 3"),
    ([["nested"]], r"^sentences .*item 0 is \['nested'\]"),
], ids=["int", "None", "bytes", "list-with-int", "nested-list"])
def test_tokenize_rejects_what_is_not_text(bert, sentences, match):
    with pytest.raises(TypeError, match=match):
        bert.tokenize(sentences)


def test_text_pair_and_embedding_options(bert):
    with pytest.raises(TypeError, match=r"^text_pair .*string or a list of strings.*5"):
        bert.tokenize("a", text_pair=5)
    with pytest.raises(TypeError, match=r"^sentences .*string or a list of strings.*7"):
        bert.sentence_embedding(7)
    with pytest.raises(TypeError, match=r"^normalize .*True or False.*'yes'"):
        bert.sentence_embedding("a", normalize="yes")
    with pytest.raises(TypeError, match=r"^output_attentions .*True or False.*'no'"):
        bert.encode("a", output_attentions="no")
    out = bert.encode("Hi there")
    with pytest.raises(TypeError, match=r"^head .*integer.*1\.0.*write 1"):
        out.attention_map(0, 1.0)


# --------------------------------------------------------------------------------------------
# The bundled all-MiniLM-L6-v2: tokenizing, encoding, attention maps, sentence embeddings


def test_default_folder_is_the_bundled_minilm(folder, bert):
    assert all((folder / name).is_file() for name in REQUIRED_FILES)
    config = bert.config
    assert (config.n_layers, config.n_heads, config.d_model, config.d_ff) == (6, 12, 384, 1536)
    assert (config.norm_first, config.activation, config.layer_norm_eps) == (False, "gelu", 1e-12)
    assert (config.max_len, config.type_vocab_size, config.embed_norm) == (512, 2, True)
    assert not bert.training
    # the pooler and the position_ids buffer are the only tensors left out
    assert bert.skipped == ["embeddings.position_ids", "pooler.dense.bias", "pooler.dense.weight"]


def test_tokenization_matches_hf_tokenizer(bert, folder):
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    pairs = ["It was tired.", "", "Hello there", "No."]
    ours = bert.tokenize(SENTENCES + [LONG], text_pair=None)
    theirs = ref(SENTENCES + [LONG], padding=True, truncation=True, max_length=256,
                 return_tensors="pt")
    assert torch.equal(ours.ids, theirs["input_ids"])
    assert torch.equal(ours.attention_mask, theirs["attention_mask"].bool())
    assert torch.equal(ours.token_type_ids, theirs["token_type_ids"])
    assert ours.lengths[-1] == 256 and ours.tokens[-1][-1] == "[SEP]"
    assert ours.tokens[0] == ref.convert_ids_to_tokens(theirs["input_ids"][0][: ours.lengths[0]])

    ours = bert.tokenize(SENTENCES, text_pair=pairs)
    theirs = ref(SENTENCES, pairs, padding=True, return_tensors="pt")
    assert torch.equal(ours.ids, theirs["input_ids"])
    assert torch.equal(ours.attention_mask, theirs["attention_mask"].bool())
    assert torch.equal(ours.token_type_ids, theirs["token_type_ids"])


def test_bundled_pipeline_is_mean_pooling_then_normalize(folder):
    modules = json.loads((folder / "modules.json").read_text())
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
    assert kinds == ["Transformer", "Pooling", "Normalize"]
    pooling = json.loads((folder / "1_Pooling" / "config.json").read_text())
    modes = [key for key, on in pooling.items() if key.startswith("pooling_mode") and on]
    assert modes == ["pooling_mode_mean_tokens"]


def test_sentence_embedding_matches_sentence_transformers(bert, folder):
    reference = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    sentences = SENTENCES + [LONG, ""]
    expected = reference.encode(sentences, convert_to_tensor=True, batch_size=8)
    ours = bert.sentence_embedding(sentences, batch_size=3)  # several batches, other padding
    assert ours.shape == (len(sentences), 384)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(sentences)))
    # meaning, not just numbers: the paraphrase is the closest sentence
    query = bert.sentence_embedding("A cat was sitting on a rug.")
    assert (query @ ours[:4].T).argmax().item() == 0


def test_attention_map_for_heatmaps(bert):
    out = bert.encode(SENTENCES[:3])
    weights, tokens = out.attention_map(layer=-1, head=5, index=2)
    n = out.batch.lengths[2]
    assert tokens == out.tokens[2] == ["[CLS]", "hi", "!", "[SEP]"]
    assert weights.shape == (n, n)
    torch.testing.assert_close(weights.sum(-1), torch.ones(n))
    with pytest.raises(ValueError, match=r"^head=12 .*12"):
        out.attention_map(layer=0, head=12)
    with pytest.raises(ValueError, match="output_attentions=True"):
        bert.encode("Hi", output_attentions=False).attention_map(0, 0)


def test_padding_does_not_change_any_real_output(bert):
    """A padded batch gives what each sentence gives alone: hidden states at real tokens,
    attention maps of real tokens, and sentence embeddings."""
    batch_out = bert.encode(SENTENCES)
    for i, sentence in enumerate(SENTENCES):
        alone = bert.encode(sentence)
        n = alone.batch.lengths[0]
        assert batch_out.batch.lengths[i] == n and batch_out.tokens[i] == alone.tokens[0]
        for h_batch, h_alone in zip(batch_out.hidden_states, alone.hidden_states, strict=True):
            torch.testing.assert_close(h_batch[i, :n], h_alone[0], atol=1e-5, rtol=1e-5)
        for w_batch, w_alone in zip(batch_out.attentions, alone.attentions, strict=True):
            torch.testing.assert_close(w_batch[i, :, :n, :n], w_alone[0], atol=1e-5, rtol=1e-5)
    together = bert.sentence_embedding(SENTENCES)
    one_by_one = torch.cat([bert.sentence_embedding(s) for s in SENTENCES])
    torch.testing.assert_close(together, one_by_one, atol=1e-5, rtol=1e-5)
    # the same sentences in another order and batch size: the same vectors, reordered
    shuffled = bert.sentence_embedding(SENTENCES[::-1] + ["filler"], batch_size=2)
    torch.testing.assert_close(shuffled[:-1].flip(0), together, atol=1e-5, rtol=1e-5)


def test_semantic_search_matches_sentence_transformers(bert):
    corpus = bert.sentence_embedding(SENTENCES + ["A kitten rested on a rug.", "Good morning."])
    queries = bert.sentence_embedding(["a cat on a mat", "hello", "how attention works"])
    scores, indices = semantic_search(queries, corpus * 3.0, top_k=3)  # any length: cosine
    hits = sentence_transformers.util.semantic_search(queries, corpus, top_k=3)
    assert indices.tolist() == [[h["corpus_id"] for h in hit] for hit in hits]
    torch.testing.assert_close(scores, torch.tensor([[h["score"] for h in hit] for hit in hits]))
    assert indices[0, 0] == 0 and indices[1, 0] in (2, 5)
    scores, indices = semantic_search(queries[0], corpus, top_k=100)  # one query, k > N
    assert scores.shape == indices.shape == (1, len(corpus))
    assert torch.all(scores[0, :-1] >= scores[0, 1:])


def test_semantic_search_rejects_bad_input():
    corpus = torch.randn(5, 8)
    with pytest.raises(ValueError, match=r"^queries .*4.*corpus .*8"):
        semantic_search(torch.randn(2, 4), corpus)
    with pytest.raises(ValueError, match=r"^corpus .*\(N, D\)"):
        semantic_search(torch.randn(2, 8), torch.randn(8))
    with pytest.raises(ValueError, match=r"^top_k .*>= 1.*0"):
        semantic_search(torch.randn(2, 8), corpus, top_k=0)
    with pytest.raises(ValueError, match=r"^queries .*floating-point"):
        semantic_search(torch.ones(2, 8, dtype=torch.long), corpus)
    with pytest.raises(ValueError, match=r"^queries .*float64.*corpus"):
        semantic_search(torch.randn(2, 8, dtype=torch.float64), corpus)


def test_tokenize_rejects_bad_input(bert):
    with pytest.raises(TypeError, match=r"^sentences .*string"):
        bert.tokenize(123)
    with pytest.raises(ValueError, match=r"^sentences is empty"):
        bert.tokenize([])
    with pytest.raises(ValueError, match=r"^text_pair .*1.*sentences .*2"):
        bert.tokenize(["a", "b"], text_pair=["c"])


# --------------------------------------------------------------------------------------------
# Another BERT (random weights, other sizes, saved by transformers) and the loader's errors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, folder):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny_bert"), folder)




def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_missing_folder_or_file(tmp_path, tiny):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=rf"model folder {re.escape(str(missing))} does not exist"):
        load_pretrained_encoder(missing)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hi")
    with pytest.raises(FileNotFoundError, match=rf"path {re.escape(str(a_file))} is a file"):
        load_pretrained_encoder(a_file)
    partial = copy_folder(tiny[0], tmp_path / "partial", skip=("tokenizer.json",))
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(partial))} is missing tokenizer.json"):
        load_pretrained_encoder(partial)
    no_weights = copy_folder(tiny[0], tmp_path / "bin_only", skip=("model.safetensors",))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"missing model.safetensors.*safetensors only"):
        load_pretrained_encoder(no_weights)


def test_corrupt_or_incomplete_config(tmp_path, tiny):
    path = copy_folder(tiny[0], tmp_path / "model")
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])  # cut off mid-file
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'config.json'))} is not valid JSON"):
        load_pretrained_encoder(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json should hold a JSON object"):
        load_pretrained_encoder(path)

    cases = [
        (dict(num_attention_heads=None), ValueError, r"config.json has no key 'num_attention_heads'"),
        (dict(model_type="gpt2"), ValueError, r"'model_type' is 'gpt2', expected one of \['bert'\]"),
        (dict(hidden_act="swish"), ValueError, r"'hidden_act' is 'swish', expected one of \['gelu'"),
        (dict(hidden_size="48"), TypeError, r"'hidden_size' must be an integer >= 1, got '48'"),
        (dict(type_vocab_size=-1), ValueError, r"'type_vocab_size' must be an integer >= 0, got -1"),
        (dict(position_embedding_type="relative_key"), ValueError, r"'position_embedding_type'"),
        (dict(is_decoder=True), ValueError, r"'is_decoder' is True, expected one of \[False\]"),
        (dict(num_attention_heads=5), ValueError, r"cannot build: d_model=48 .*divisible by n_heads=5"),
    ]
    for changes, error, message in cases:
        (path / "config.json").write_text(text)
        _edit_config(path, **changes)
        with pytest.raises(error, match=message):
            load_pretrained_encoder(path)


def test_corrupt_tokenizer_and_bad_max_length(tmp_path, tiny):
    path = copy_folder(tiny[0], tmp_path / "model")
    with pytest.raises(ValueError, match=r"max_length=41 .*40"):
        load_pretrained_encoder(path, max_length=41)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(str(path / 'tokenizer.json'))} as a tokenizer"):
        load_pretrained_encoder(path)
