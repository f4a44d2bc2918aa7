"""The pretrained BERT loader against references written elsewhere: Hugging Face's BertModel
(hidden states and attention maps), its tokenizer, and sentence-transformers (sentence
embeddings), all loaded offline from the same local folder. Plus a second, randomly initialised
BERT of other sizes saved by transformers itself, and the loader's error messages."""

from __future__ import annotations

import json
import os
import re
import shutil

# Nothing may be downloaded: both libraries must read the local folder only.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import sentence_transformers  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from course_lib.models import Encoder  # noqa: E402
from course_lib.pretrained import (  # noqa: E402
    REQUIRED_FILES,
    PretrainedEncoder,
    bert_weight_map,
    config_from_bert,
    default_model_dir,
    load_bert_weights,
    load_pretrained_encoder,
    mean_pool,
    semantic_search,
)

ATOL = 1e-4

SENTENCES = [
    "The cat sat on the mat.",
    "Attention lets every token look at every other token in one step, however far apart.",
    "Hi!",
    "The animal didn't cross the street because it was too tired.",
]
# Longer than all-MiniLM-L6-v2's 256-token limit, so truncation is exercised too.
LONG = " ".join(["attention is all you need"] * 70)


@pytest.fixture(scope="module")
def folder():
    return default_model_dir()


@pytest.fixture(scope="module")
def bert(folder) -> PretrainedEncoder:
    return load_pretrained_encoder(folder)


@pytest.fixture(scope="module")
def hf_bert(folder):
    # eager attention, so the attention probabilities are returned
    model = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager")
    return model.eval()


def _hf_outputs(model, batch):
    with torch.no_grad():
        return model(
            input_ids=batch.ids,
            attention_mask=batch.attention_mask.long(),
            token_type_ids=batch.token_type_ids,
            output_attentions=True,
            output_hidden_states=True,
        )


def _compare_with_hf(ours, ref, keep: torch.Tensor) -> None:
    """Hidden states at real tokens and attention rows of real queries agree to ATOL; padded
    keys get exactly zero weight in ours."""
    assert len(ours.hidden_states) == len(ref.hidden_states)
    assert len(ours.attentions) == len(ref.attentions)
    torch.testing.assert_close(
        ours.last_hidden_state[keep], ref.last_hidden_state[keep], atol=ATOL, rtol=0
    )
    for layer, (h, h_ref) in enumerate(zip(ours.hidden_states, ref.hidden_states, strict=True)):
        torch.testing.assert_close(h[keep], h_ref[keep], atol=ATOL, rtol=0, msg=f"layer {layer}")
    for layer, (w, w_ref) in enumerate(zip(ours.attentions, ref.attentions, strict=True)):
        assert w.shape == w_ref.shape
        rows = keep[:, None, :, None].expand_as(w)  # (B, H, T, T), real queries
        padded_keys = ~keep[:, None, None, :].expand_as(w)
        torch.testing.assert_close(w[rows], w_ref[rows], atol=ATOL, rtol=0, msg=f"layer {layer}")
        assert torch.all(w[padded_keys] == 0), f"layer {layer}: a padded key got weight"


# --------------------------------------------------------------------------------------------
# The bundled all-MiniLM-L6-v2


def test_default_folder_is_the_bundled_minilm(folder, bert):
    assert all((folder / name).is_file() for name in REQUIRED_FILES)
    config = bert.config
    assert (config.n_layers, config.n_heads, config.d_model, config.d_ff) == (6, 12, 384, 1536)
    assert (config.norm_first, config.activation, config.layer_norm_eps) == (False, "gelu", 1e-12)
    assert (config.max_len, config.type_vocab_size, config.embed_norm) == (512, 2, True)
    assert not bert.training
    # the pooler and the position_ids buffer are the only tensors left out
    assert bert.skipped == ["embeddings.position_ids", "pooler.dense.bias", "pooler.dense.weight"]


def test_matches_hf_bert_on_a_padded_batch(bert, hf_bert):
    out = bert.encode(SENTENCES)
    keep = out.batch.attention_mask
    assert not keep.all(), "the batch should contain padding"
    assert out.attentions[0].shape == (len(SENTENCES), 12, keep.shape[1], keep.shape[1])
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), keep)


def test_matches_hf_bert_one_at_a_time_and_on_pairs(bert, hf_bert):
    for sentence in SENTENCES[:2]:
        out = bert.encode(sentence)
        assert out.batch.attention_mask.all()
        _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), out.batch.attention_mask)
    # sentence pairs use token type 1 for the second part
    out = bert.encode(SENTENCES[:2], text_pair=["It was tired.", "So is the reader."])
    assert out.batch.token_type_ids.max() == 1
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), out.batch.attention_mask)


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
    with pytest.raises(ValueError, match=r"head=12 is out of range: there are 12"):
        out.attention_map(layer=0, head=12)
    with pytest.raises(ValueError, match="output_attentions=True"):
        bert.encode("Hi", output_attentions=False).attention_map(0, 0)


def test_mean_pool_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])  # (1, 3, 2)
    keep = torch.tensor([[True, True, False]])
    torch.testing.assert_close(mean_pool(hidden, keep), torch.tensor([[2.0, 3.0]]))
    with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\).*\(1, 3\)"):
        mean_pool(hidden, keep[:, :2])


def test_matches_hf_bert_on_a_heavily_padded_truncated_batch(bert, hf_bert):
    # one input cut at the 256-token limit next to sentences of 4 to 20 tokens: most of the
    # batch is padding, in the hidden states and in every attention map
    out = bert.encode([LONG, "Hi!", SENTENCES[1]])
    keep = out.batch.attention_mask
    assert out.batch.lengths[0] == 256 and out.batch.lengths[1] == 4
    _compare_with_hf(out, _hf_outputs(hf_bert, out.batch), keep)


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


def test_mean_pool_matches_sentence_transformers_pooling(bert):
    pooling = sentence_transformers.models.Pooling(384, pooling_mode="mean")
    out = bert.encode(SENTENCES, output_attentions=False)
    keep = out.batch.attention_mask
    expected = pooling({"token_embeddings": out.last_hidden_state,
                        "attention_mask": keep.long()})["sentence_embedding"]
    torch.testing.assert_close(mean_pool(out.last_hidden_state, keep), expected)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=4),
       extra=st.integers(0, 3), d=st.integers(1, 5), seed=st.integers(0, 1000))
def test_mean_pool_never_sees_the_padding(lengths, extra, d, seed):
    """Whatever the padding holds and however long it is, each row is the mean of its real
    tokens (zeros when it has none)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) + extra
    hidden = torch.randn(len(lengths), width, d, generator=gen)
    keep = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    junk = hidden.masked_fill(~keep[..., None], 1e6)
    pooled = mean_pool(hidden, keep)
    torch.testing.assert_close(mean_pool(junk, keep), pooled)
    for row, n in enumerate(lengths):
        expected = hidden[row, :n].mean(0) if n else torch.zeros(d)
        torch.testing.assert_close(pooled[row], expected)


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
    with pytest.raises(ValueError, match=r"queries has 4 features .* but corpus has 8"):
        semantic_search(torch.randn(2, 4), corpus)
    with pytest.raises(ValueError, match=r"corpus should have shape \(N, D\)"):
        semantic_search(torch.randn(2, 8), torch.randn(8))
    with pytest.raises(ValueError, match="top_k must be a positive integer, got 0"):
        semantic_search(torch.randn(2, 8), corpus, top_k=0)
    with pytest.raises(ValueError, match="queries must be a floating-point tensor"):
        semantic_search(torch.ones(2, 8, dtype=torch.long), corpus)
    with pytest.raises(ValueError, match="queries has dtype torch.float64 but corpus"):
        semantic_search(torch.randn(2, 8, dtype=torch.float64), corpus)


def test_full_size_models_match_hugging_face_counts():
    """GPT-2 small, BERT-base and BERT-large from their published configurations, ours and
    Hugging Face's, both on the meta device (no memory): the same number of parameters, up to
    BERT's pooler (a D x D layer on [CLS] that our encoder leaves out)."""
    from course_lib.configs import DecoderConfig
    from course_lib.models import DecoderLM, count_parameters

    bert_base = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072)
    bert_large = dict(bert_base, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096)
    with torch.device("meta"):
        for sizes, released in ((bert_base, 109_482_240), (bert_large, 335_141_888)):
            config = transformers.BertConfig(**sizes)
            theirs = transformers.BertModel(config)
            ours = Encoder(config_from_bert(config.to_dict()))
            d = sizes["hidden_size"]
            assert theirs.num_parameters() == released
            assert count_parameters(ours) + d * d + d == released
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config())
        ours = DecoderLM(DecoderConfig(vocab_size=50257, d_model=768, n_heads=12, n_layers=12,
                                       max_len=1024, activation="gelu_tanh"))
        assert theirs.num_parameters() == count_parameters(ours) == 124_439_808


def test_tokenize_rejects_bad_input(bert):
    with pytest.raises(TypeError, match="sentences must be a string or a list of strings"):
        bert.tokenize(123)
    with pytest.raises(ValueError, match="sentences is empty"):
        bert.tokenize([])
    with pytest.raises(ValueError, match="text_pair has 1 sentences but sentences has 2"):
        bert.tokenize(["a", "b"], text_pair=["c"])


# --------------------------------------------------------------------------------------------
# Another BERT: random weights, other sizes, saved by transformers with a task head


TINY = dict(
    vocab_size=30522, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=72, max_position_embeddings=40, type_vocab_size=3, layer_norm_eps=1e-7,
    hidden_act="gelu_new",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, folder):
    """A BertForMaskedLM (tensor names 'bert.*' plus 'cls.*' heads) with every weight, LayerNorm
    gains and biases included, moved away from its initial value so each one matters."""
    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY)
    model = transformers.BertForMaskedLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(str(path))
    shutil.copy(folder / "tokenizer.json", path / "tokenizer.json")
    reference = transformers.BertModel.from_pretrained(str(path), attn_implementation="eager")
    return path, reference.eval()


def test_other_bert_checkpoint_matches_hf(tiny):
    path, ref = tiny
    ours = load_pretrained_encoder(path)
    assert ours.config.activation == "gelu_tanh" and ours.config.layer_norm_eps == 1e-7
    assert ours.max_length == 40  # no sentence-transformers config: max_position_embeddings
    assert any(name.startswith("cls.") for name in ours.skipped)
    out = ours.encode(SENTENCES, text_pair=["One.", "Two two.", "Three three three.", "Four"])
    assert out.batch.token_type_ids.max() == 1
    _compare_with_hf(out, _hf_outputs(ref, out.batch), out.batch.attention_mask)
    assert ours.tokenize(LONG).lengths == [40]


def _copy_folder(src, dst, skip=()):
    dst.mkdir()
    for name in REQUIRED_FILES:
        if name not in skip:
            shutil.copy(src / name, dst / name)
    return dst


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


# --------------------------------------------------------------------------------------------
# Errors


def test_missing_folder_or_file(tmp_path, tiny):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=rf"model folder {re.escape(str(missing))} does not exist"):
        load_pretrained_encoder(missing)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("hi")
    with pytest.raises(FileNotFoundError, match=rf"path {re.escape(str(a_file))} is a file"):
        load_pretrained_encoder(a_file)
    partial = _copy_folder(tiny[0], tmp_path / "partial", skip=("tokenizer.json",))
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(partial))} is missing tokenizer.json"):
        load_pretrained_encoder(partial)
    no_weights = _copy_folder(tiny[0], tmp_path / "bin_only", skip=("model.safetensors",))
    (no_weights / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"missing model.safetensors.*safetensors only"):
        load_pretrained_encoder(no_weights)


def test_corrupt_or_incomplete_config(tmp_path, tiny):
    path = _copy_folder(tiny[0], tmp_path / "model")
    text = (path / "config.json").read_text()
    (path / "config.json").write_text(text[: len(text) // 2])  # cut off mid-file
    with pytest.raises(ValueError, match=rf"{re.escape(str(path / 'config.json'))} is not valid JSON"):
        load_pretrained_encoder(path)
    (path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json should hold a JSON object"):
        load_pretrained_encoder(path)

    cases = [
        (dict(num_attention_heads=None), r"config.json has no key 'num_attention_heads'"),
        (dict(model_type="gpt2"), r"'model_type' is 'gpt2'.*BERT checkpoints only"),
        (dict(hidden_act="swish"), r"'hidden_act' is 'swish', expected one of"),
        (dict(hidden_size="48"), r"'hidden_size' must be a positive integer, got '48' \(str\)"),
        (dict(position_embedding_type="relative_key"), r"'position_embedding_type'"),
        (dict(num_attention_heads=5), r"cannot build: d_model=48 is not divisible by n_heads=5"),
    ]
    for changes, message in cases:
        (path / "config.json").write_text(text)
        _edit_config(path, **changes)
        with pytest.raises(ValueError, match=message):
            load_pretrained_encoder(path)


def test_checkpoint_with_missing_wrong_or_extra_tensors(tmp_path, tiny):
    path = _copy_folder(tiny[0], tmp_path / "model")
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))

    broken = dict(tensors)
    del broken["bert.encoder.layer.1.attention.self.key.weight"]
    save_file(broken, str(weights))
    with pytest.raises(ValueError, match=(
        rf"cannot load {re.escape(str(weights))} .*missing tensors: 'encoder.layer.1.attention.self.key.weight' "
        r"\(for blocks.1.self_attn.qkv_proj.weight\)"
    )):
        load_pretrained_encoder(path)

    broken = dict(tensors)
    broken["bert.encoder.layer.0.intermediate.dense.weight"] = torch.zeros(72, 47)
    broken["bert.encoder.layer.2.output.dense.weight"] = torch.zeros(48, 72)
    save_file(broken, str(weights))
    with pytest.raises(ValueError, match=(
        r"'bert.encoder.layer.0.intermediate.dense.weight' has shape \(72, 47\), but "
        r"blocks.0.ff.fc1.weight has shape \(72, 48\).*unexpected tensors.*"
        r"'bert.encoder.layer.2.output.dense.weight'"
    )):
        load_pretrained_encoder(path)

    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(str(weights))}"):
        load_pretrained_encoder(path)


def test_corrupt_tokenizer_and_bad_max_length(tmp_path, tiny):
    path = _copy_folder(tiny[0], tmp_path / "model")
    with pytest.raises(ValueError, match=r"max_length=41 is longer than the model's 40"):
        load_pretrained_encoder(path, max_length=41)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=rf"cannot read {re.escape(str(path / 'tokenizer.json'))} as a tokenizer"):
        load_pretrained_encoder(path)


def test_every_parameter_has_a_source(tiny):
    config = config_from_bert(json.loads((tiny[0] / "config.json").read_text()))
    model = Encoder(config)
    table = bert_weight_map(config.n_layers)
    assert set(table) == {name for name, _ in model.named_parameters()}
    # the fused projection stacks query, key, value in that order
    assert table["blocks.0.self_attn.qkv_proj.weight"] == (
        "encoder.layer.0.attention.self.query.weight",
        "encoder.layer.0.attention.self.key.weight",
        "encoder.layer.0.attention.self.value.weight",
    )
    # nothing is written when a check fails
    before = model.embeddings.token.weight.clone()
    tensors = {k.removeprefix("bert."): v for k, v in load_file(str(tiny[0] / "model.safetensors")).items()}
    del tensors["embeddings.LayerNorm.bias"]
    with pytest.raises(ValueError, match=r"'embeddings.LayerNorm.bias' \(for embeddings.norm.bias\)"):
        load_bert_weights(model, tensors)
    assert torch.equal(model.embeddings.token.weight, before)
