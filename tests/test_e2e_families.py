"""The new encoder families end to end: real Tulip processes behind one real Ivy.

Tiny random-weight models of each family (no registry ships such weights), saved with
`transformers` and given a word-level `tokenizer.json` (Ivy tokenizes them with HF
`tokenizers`):

* a Qwen3 embedder run bidirectionally with mean pooling (pplx-embed's shape) and an MPNet
  embedder: `/v1/embeddings` (and the OpenAI client) equals ROSE in this process on the
  same ids (ROSE's parity with `transformers` is tests/test_rose_qwen3.py and
  tests/test_rose_families.py);
* ModernBERT and DeBERTa-v3 cross-encoders: `/v1/rerank` (and the Cohere client) gives the
  order and scores of `transformers` `*ForSequenceClassification` + sigmoid on the pairs
  HF's tokenizer builds, within 1e-4;
* `/v1/contextualizedembeddings` on both embedders: the per-chunk means of one joint
  `transformers` pass over the document;
* EmbeddingGemma's shape (bidirectional Gemma 3 with sliding windows, mean pooling, two
  Dense projections, Normalize, task prompts), written by sentence-transformers, which is the
  reference for `/v1/embeddings` with `input_type` and `dimensions`;
* all-distilroberta-v1's shape (RoBERTa, byte-level BPE with RoBERTa's ``<s> … </s>``
  frame, mean pooling, Normalize), written by sentence-transformers, the reference for
  `/v1/embeddings`; a DistilBERT cross-encoder (ms-marco-distilbert's shape), whose
  `/v1/rerank` and TEI `/predict` scores equal `transformers`';
* sentence-t5's shape (a T5 encoder with its relative position bias, ``</s>`` after each
  text, mean pooling, a Dense projection, Normalize), written by sentence-transformers, the
  reference for `/v1/embeddings`;
* gte-Qwen2's shape (a ``Qwen2ForCausalLM``-named checkpoint with q/k/v biases, causal,
  last token, a task prompt), written by sentence-transformers, the reference for
  `/v1/embeddings`;
* Qwen3-Embedding's shape (causal, last token, a task prompt; byte-level BPE) and
  Qwen3-Reranker's (a causal LM whose chat template frames instruction, query and
  document; score P("yes")), both written by sentence-transformers, which is the reference
  for `/v1/embeddings` (with `input_type` and `instruction`) and `/v1/rerank`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers
from ivy_process import serve_dirs
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rose.assets.layout import write_pooling

VOCAB = 300
WORDS = [f"w{i}" for i in range(4, VOCAB)]
SPECIALS = {"[CLS]": 0, "[PAD]": 1, "[SEP]": 2, "[UNK]": 3}
TEXTS = [
    "w4 w5 w6",
    "w10 w11 w12 w13 w14 w15 w16 w17",
    "w99",
    " ".join(f"w{4 + (i * 7) % 290}" for i in range(40)),
    "w200 w201 w7 w7 w7",
]
QUERY = "w5 w6 w7 w8"


def _tokenizer(path: Path, *, specials: bool) -> None:
    vocab = {**SPECIALS, **{w: i for i, w in enumerate(WORDS, start=4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if specials:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 0), ("[SEP]", 2)],
        )
    tok.save(str(path / "tokenizer.json"))


def _spread(model: torch.nn.Module) -> None:
    """Larger random weights than HF's init: attention is far from uniform, scores apart."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, 0.3)


def _save(model: torch.nn.Module, path: Path) -> Path:
    _spread(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    torch.manual_seed(23)
    root = tmp_path_factory.mktemp("families")
    out: dict[str, Path] = {}

    qwen3 = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        use_bidirectional_attention=True,  # pplx-embed's flag
    )
    out["qwen3-bidir"] = _save(transformers.Qwen3Model(qwen3), root / "qwen3-bidir")
    _tokenizer(out["qwen3-bidir"], specials=False)
    write_pooling(out["qwen3-bidir"], 64)

    mpnet = transformers.MPNetConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=130,
        pad_token_id=1,
    )
    out["mpnet"] = _save(transformers.MPNetModel(mpnet, add_pooling_layer=False), root / "mpnet")
    _tokenizer(out["mpnet"], specials=True)
    write_pooling(out["mpnet"], 64)

    modernbert = transformers.ModernBertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=128,
        local_attention=8,
        global_attn_every_n_layers=3,
        pad_token_id=1,
        cls_token_id=0,
        sep_token_id=2,
        bos_token_id=0,
        eos_token_id=2,
        num_labels=1,
    )
    out["modernbert-rr"] = _save(
        transformers.ModernBertForSequenceClassification(modernbert), root / "modernbert-rr"
    )
    _tokenizer(out["modernbert-rr"], specials=True)

    deberta = transformers.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=64,
        type_vocab_size=0,
        relative_attention=True,
        pos_att_type="p2c|c2p",
        position_buckets=8,
        max_relative_positions=-1,
        position_biased_input=False,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        pad_token_id=1,
        num_labels=1,
    )
    out["deberta-rr"] = _save(
        transformers.DebertaV2ForSequenceClassification(deberta), root / "deberta-rr"
    )
    _tokenizer(out["deberta-rr"], specials=True)
    distilbert = transformers.DistilBertConfig(
        vocab_size=VOCAB,
        dim=64,
        n_layers=2,
        n_heads=4,
        hidden_dim=96,
        max_position_embeddings=64,
        pad_token_id=1,
        num_labels=1,
    )
    out["distilbert-rr"] = _save(
        transformers.DistilBertForSequenceClassification(distilbert), root / "distilbert-rr"
    )
    _tokenizer(out["distilbert-rr"], specials=True)
    out["roberta-embed"] = _roberta_embedder(root)
    out["t5-embed"] = _sentence_t5(root)
    out["qwen3-last"] = _qwen3_last_token_embedder(root)
    out["gte-qwen2"] = _gte_qwen2(root)
    out["qwen3-rr"] = _qwen3_logit_score_reranker(root)
    out["gemma3-embed"] = _embeddinggemma(root)
    return out


# ---- Qwen3-Embedding's and Qwen3-Reranker's shapes, saved by sentence-transformers itself ----
# Byte-level BPE (SmolLM2's tokenizer, a bundled asset, has ChatML's special tokens), random
# Qwen3 weights; sentence-transformers writes the model directories and is the reference.
QWEN3_TASK_PROMPT = (
    "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
)
RERANK_TEMPLATE = """<|im_start|>system
Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>
<|im_start|>user
<Instruct>: {{ messages | selectattr("role", "eq", "system") | map(attribute="content") | first | default("Given a web search query, retrieve relevant passages that answer the query") }}
<Query>: {{ messages | selectattr("role", "eq", "query") | map(attribute="content") | first }}
<Document>: {{ messages | selectattr("role", "eq", "document") | map(attribute="content") | first }}<|im_end|>
<|im_start|>assistant
<think>

</think>

"""
PASSAGES = [
    "Plants grow from seeds that need water, light and soil.",
    "Paris is the capital of France and sits on the Seine.",
    "The mitochondria is the powerhouse of the cell.",
    "Seeds sprout when the soil is warm and moist; roots come first.",
    "Stock markets fell sharply on Tuesday after the announcement.",
]
QUESTION = "how do plants grow from seeds?"


def _bpe_base(path: Path, model: torch.nn.Module) -> Path:
    """`model` saved with SmolLM2's tokenizer files, less its chat template (an embedder
    reads plain text; the reranker gets its own template)."""
    from rose.assets import ensure_model

    source = Path(ensure_model("smollm2-135m-instruct"))
    _save(model, path)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (path / name).write_bytes((source / name).read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _roberta_embedder(root: Path) -> Path:
    """all-distilroberta-v1's shape: a RoBERTa encoder, mean pooling, Normalize. SmolLM2's
    byte-level BPE numbers its specials as RoBERTa does (0 begins, 1 pads, 2 ends a text), so
    with RoBERTa's post-processor it frames texts as RoBERTa's tokenizer does."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    config = transformers.RobertaConfig(
        vocab_size=49_152,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=130,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    base = _bpe_base(
        root / "roberta-base", transformers.RobertaModel(config, add_pooling_layer=False)
    )
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    tok.post_processor = processors.RobertaProcessing(("<|im_end|>", 2), ("<|endoftext|>", 0))
    tok.save(str(base / "tokenizer.json"))
    st = SentenceTransformer(modules=[Transformer(str(base)), Pooling(64, "mean"), Normalize()])
    st.save_pretrained(str(root / "roberta-embed"))
    return root / "roberta-embed"


def _sentence_t5(root: Path) -> Path:
    """sentence-t5's shape: T5's encoder (relative position bias; ``</s>`` ends each text),
    mean pooling, a Dense projection without bias (768 -> 768 in the real model), Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=64,
        d_kv=16,
        d_ff=96,
        num_layers=2,
        num_heads=4,
        relative_attention_max_distance=16,  # the 40-word text reaches the far buckets
        feed_forward_proj="gated-gelu",
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    base = _save(transformers.T5EncoderModel(config), root / "t5-base")
    vocab = {**SPECIALS, **{w: i for i, w in enumerate(WORDS, start=4)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="$A [SEP]", pair="$A [SEP] $B [SEP]", special_tokens=[("[SEP]", 2)]
    )
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]"
    ).save_pretrained(base)
    identity = torch.nn.Identity()
    st = SentenceTransformer(
        modules=[
            Transformer(str(base)),
            Pooling(64, "mean"),
            Dense(64, 32, bias=False, activation_function=identity),
            Normalize(),
        ]
    )
    st.save_pretrained(str(root / "t5-embed"))
    return root / "t5-embed"


def _qwen3_config(**extra: Any) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=49_152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )


def _qwen3_last_token_embedder(root: Path) -> Path:
    """Qwen3-Embedding's shape: causal, last-token pooling, normalized, a task prompt."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    base = _bpe_base(root / "qwen3-last-base", transformers.Qwen3Model(_qwen3_config()))
    st = SentenceTransformer(
        modules=[Transformer(str(base)), Pooling(64, "lasttoken"), Normalize()],
        prompts={"query": QWEN3_TASK_PROMPT, "document": ""},
    )
    st.save_pretrained(str(root / "qwen3-last"))
    return root / "qwen3-last"


def _gte_qwen2(root: Path) -> Path:
    """gte-Qwen2-instruct's shape: Qwen2 base weights (q/k/v biases) under the
    ``Qwen2ForCausalLM`` name in config.json, causal, last-token pooling,
    normalized, a task prompt. The name alone would make it a chat model; its
    modules.json makes it an embedder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    config = transformers.Qwen2Config(
        vocab_size=49_152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    base = _bpe_base(root / "gte-qwen2-base", transformers.Qwen2Model(config))
    st = SentenceTransformer(
        modules=[Transformer(str(base)), Pooling(64, "lasttoken"), Normalize()],
        prompts={"query": QWEN3_TASK_PROMPT, "document": ""},
    )
    st.save_pretrained(str(root / "gte-qwen2"))
    # sentence-transformers saves the base model it loaded (Qwen2Model's weights and name);
    # gte-Qwen2's config.json names the causal LM over those same weights.
    config_path = root / "gte-qwen2" / "config.json"
    raw = json.loads(config_path.read_text())
    assert raw["architectures"] == ["Qwen2Model"], raw["architectures"]
    config_path.write_text(json.dumps({**raw, "architectures": ["Qwen2ForCausalLM"]}))
    return root / "gte-qwen2"


def _qwen3_logit_score_reranker(root: Path) -> Path:
    """Qwen3-Reranker's shape as sentence-transformers ships it: a causal LM, its chat
    template around (instruction, query, document), score = P("yes") from the last token."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.cross_encoder.modules import LogitScore

    base = _bpe_base(
        root / "qwen3-rr-base",
        transformers.Qwen3ForCausalLM(_qwen3_config(tie_word_embeddings=True)),
    )
    (base / "chat_template.jinja").write_text(RERANK_TEMPLATE)
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    yes, no = tok.token_to_id("yes"), tok.token_to_id("no")
    module = Transformer(
        str(base),
        transformer_task="text-generation",
        processing_kwargs={"chat_template": {"add_generation_prompt": True}},
    )
    CrossEncoder(modules=[module, LogitScore(yes, no)]).save_pretrained(str(root / "qwen3-rr"))
    return root / "qwen3-rr"


# EmbeddingGemma's shape: bidirectional Gemma 3 with sliding-window layers, mean pooling, two
# Dense projections (768 -> 3072 -> 768 in the real model), Normalize, its task prompts.
# its task prompts (some of them), one of them the default here (the real model has none)
GEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "STS": "task: sentence similarity | query: ",
    "Clustering": "task: clustering | query: ",
}


def _embeddinggemma(root: Path) -> Path:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    config = transformers.Gemma3TextConfig(
        vocab_size=49_152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=8,  # sliding layers see 4 tokens either side; the passages are longer
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=256,
        use_bidirectional_attention=True,
    )
    base = _bpe_base(root / "gemma3-base", transformers.Gemma3TextModel(config))
    identity = torch.nn.Identity()
    st = SentenceTransformer(
        modules=[
            Transformer(str(base)),
            Pooling(64, "mean"),
            Dense(64, 256, bias=False, activation_function=identity),
            Dense(256, 64, bias=False, activation_function=identity),
            Normalize(),
        ],
        prompts=GEMMA_PROMPTS,
        default_prompt_name="Clustering",
    )
    st.save_pretrained(str(root / "gemma3-embed"))
    return root / "gemma3-embed"


@pytest.fixture(scope="module")
def base(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_dirs(dirs, tmp_path_factory.mktemp("families-logs")) as url:
        yield url


def _rose(path: Path, texts: list[str]) -> np.ndarray:
    from rose import Engine, EngineConfig, RaggedBatch

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    engine = Engine.load(path, EngineConfig(device="cpu"))
    rows = [e.ids for e in tok.encode_batch(texts)]
    return np.asarray(engine.step(RaggedBatch.from_lists(rows)).wait(), dtype=np.float32)


def _reference_scores(
    path: Path, query: str, docs: list[str], max_length: int | None = None
) -> np.ndarray:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if max_length is not None:
        tok.enable_truncation(max_length)  # longest_first, HF's default
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    scores = []
    with torch.no_grad():
        for doc in docs:
            ids = torch.tensor([tok.encode(query, doc).ids])
            scores.append(torch.sigmoid(model(input_ids=ids).logits[0, 0]).item())
    return np.array(scores)


@pytest.mark.parametrize("name", ["qwen3-bidir", "mpnet"])
def test_embeddings_equal_rose_in_process(base: str, dirs: dict[str, Path], name: str) -> None:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    want = _rose(dirs[name], TEXTS)
    assert got.shape == (len(TEXTS), 64)
    np.testing.assert_allclose(got, want, atol=1e-5)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= 0.9999


def test_openai_client_on_a_qwen3_embedder(base: str, dirs: dict[str, Path]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    got = client.embeddings.create(model="qwen3-bidir", input=TEXTS[:2])
    vectors = np.array([d.embedding for d in got.data], dtype=np.float32)
    np.testing.assert_allclose(vectors, _rose(dirs["qwen3-bidir"], TEXTS[:2]), atol=1e-5)


@pytest.mark.parametrize("name", ["modernbert-rr", "deberta-rr", "distilbert-rr"])
def test_rerank_equals_transformers(base: str, dirs: dict[str, Path], name: str) -> None:
    body: dict[str, Any] = {"model": name, "query": QUERY, "documents": TEXTS}
    r = httpx.post(f"{base}/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    want = _reference_scores(dirs[name], QUERY, TEXTS)
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    got = np.array([x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.ptp(want) > 1e-2  # the scores really are apart: the order means something


# ---- vLLM's /score -------------------------------------------------------------------------
SCORE_FIELDS = [
    ("queries", "documents"),
    ("queries", "items"),
    ("data_1", "data_2"),
    ("text_1", "text_2"),
]


def _scores(base: str, path: str = "/score", **body: Any) -> tuple[np.ndarray, dict]:
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "list" and data["id"].startswith("score-")
    assert [d["index"] for d in data["data"]] == list(range(len(data["data"])))
    assert {d["object"] for d in data["data"]} == {"score"}
    return np.array([d["score"] for d in data["data"]]), data


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_vllm_score_on_a_cross_encoder_equals_transformers(
    base: str, dirs: dict[str, Path], path: str
) -> None:
    """vLLM's /score on a DeBERTa-v2 cross-encoder: 1:N under each of vLLM's pairs of
    field names, N:N in order and 1:1, each pair's sigmoid as transformers computes it (the
    logit with `use_activation: false`), usage counting the pairs' tokens."""
    tok = Tokenizer.from_file(str(dirs["deberta-rr"] / "tokenizer.json"))
    want = _reference_scores(dirs["deberta-rr"], QUERY, TEXTS)
    assert np.ptp(want) > 1e-2
    for a, b in SCORE_FIELDS:
        got, data = _scores(base, path, model="deberta-rr", **{a: QUERY, b: TEXTS})
        np.testing.assert_allclose(got, want, atol=1e-4)
        tokens = sum(len(tok.encode(QUERY, t).ids) for t in TEXTS)
        assert data["model"] == "deberta-rr"
        assert data["usage"] == {
            "prompt_tokens": tokens,
            "total_tokens": tokens,
            "completion_tokens": 0,
        }
    queries, docs = [QUERY, TEXTS[1], TEXTS[2]], [TEXTS[0], TEXTS[3], QUERY]
    got, _ = _scores(base, path, model="deberta-rr", text_1=queries, text_2=docs)
    pairwise = [
        _reference_scores(dirs["deberta-rr"], q, [d])[0] for q, d in zip(queries, docs, strict=True)
    ]
    np.testing.assert_allclose(got, pairwise, atol=1e-4)
    got, _ = _scores(base, path, model="deberta-rr", text_1=QUERY, text_2=TEXTS[1])
    np.testing.assert_allclose(got, want[1:2], atol=1e-4)
    body = {"model": "deberta-rr", "text_1": QUERY, "text_2": TEXTS, "use_activation": False}
    got, _ = _scores(base, path, **body)
    np.testing.assert_allclose(got, np.log(want / (1 - want)), atol=1e-3)
    # vLLM's older names of use_activation win over it, as vLLM reads them
    for older in ({"activation": False}, {"softmax": False, "use_activation": True}):
        got, _ = _scores(base, path, **{**body, "use_activation": None, **older})
        np.testing.assert_allclose(got, np.log(want / (1 - want)), atol=1e-3)


def test_vllm_score_cuts_only_when_asked(base: str, dirs: dict[str, Path]) -> None:
    """A pair over the model's 64 tokens is vLLM's 400 unless `truncate_prompt_tokens`
    asks for a cut, longest first as `tokenizers` cuts (-1: to the model's limit); a count
    over the limit, mismatched sides, or a side without its partner are 400s naming the
    field."""
    long = " ".join(f"w{4 + i % 290}" for i in range(100))
    body = {"model": "deberta-rr", "queries": QUERY, "documents": [long, TEXTS[0]]}
    r = httpx.post(f"{base}/score", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "documents" and "truncate_prompt_tokens" in r.text
    for k, limit in [(-1, 64), (40, 40)]:
        got, _ = _scores(base, **body, truncate_prompt_tokens=k)
        want = _reference_scores(dirs["deberta-rr"], QUERY, [long, TEXTS[0]], max_length=limit)
        np.testing.assert_allclose(got, want, atol=1e-4)
    for extra, param in [
        ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ({"queries": [QUERY, QUERY, QUERY]}, "documents"),
        ({"documents": None}, "documents"),
        ({"documents": None, "queries": None, "text_1": "x"}, "text_2"),
        ({"documents": None, "queries": None}, "queries"),
        ({"items": TEXTS[:2]}, "items"),
    ]:
        r = httpx.post(f"{base}/score", json={**body, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())


def test_rerank_reads_vllms_truncation_and_activation(base: str, dirs: dict[str, Path]) -> None:
    """vLLM's /rerank fields on Jina's shape: `truncate_prompt_tokens` cuts each pair to
    that many tokens, longest first, and `use_activation: false` gives the logits (both
    were once ignored: sigmoids of pairs cut to the model's limit)."""
    long = " ".join(f"w{4 + i % 290}" for i in range(100))
    docs = [long, TEXTS[1]]
    body: dict[str, Any] = {"model": "deberta-rr", "query": QUERY, "documents": docs}
    want = _reference_scores(dirs["deberta-rr"], QUERY, docs, max_length=24)
    for extra, expect in [
        ({"truncate_prompt_tokens": 24}, want),
        ({"truncate_prompt_tokens": 24, "use_activation": False}, np.log(want / (1 - want))),
    ]:
        r = httpx.post(f"{base}/rerank", json={**body, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        got = sorted(r.json()["results"], key=lambda x: x["index"])
        np.testing.assert_allclose([x["relevance_score"] for x in got], expect, atol=1e-3)
    full = _reference_scores(dirs["deberta-rr"], QUERY, docs, max_length=64)
    assert np.abs(full - want).max() > 1e-3  # the cut did change the scores


def test_vllm_cuts_reach_every_text_and_errors_name_their_side(base: str) -> None:
    """`truncate_prompt_tokens` cuts an embedder's rerank query too (it once cut only the
    documents: a query equal to a document scored below 1); an over-long text on an
    embedder's /score is a 400 naming its own side and index (it once named `documents`
    and an index into both sides); a cut below the special tokens names the field that
    asked for it (it was a 400 with no param)."""
    long = " ".join(f"w{10 + i % 250}" for i in range(300))
    body = {"model": "mpnet", "query": long, "documents": ["w10 w11 w12", long], "top_n": 2}
    r = httpx.post(f"{base}/rerank", json={**body, "truncate_prompt_tokens": 5}, timeout=60)
    assert r.status_code == 200, r.text
    by_index = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert by_index[1] == pytest.approx(1.0, abs=1e-5)  # the same 5 tokens
    assert by_index[0] == pytest.approx(1.0, abs=1e-5)  # [CLS] w10 w11 w12 [SEP]: the cut query
    r = httpx.post(f"{base}/rerank", json={**body, "truncate_prompt_tokens": -1}, timeout=60)
    assert r.status_code == 200, r.text
    for queries, docs, param, index in [
        ("w4", ["w5", long], "documents", 1),
        ([long, "w4"], ["w5", "w6"], "queries", 0),
    ]:
        r = httpx.post(
            f"{base}/score",
            json={"model": "mpnet", "queries": queries, "documents": docs},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and f"Input {index} has" in error["message"], error
    for model in ("deberta-rr", "mpnet"):
        body = {"model": model, "queries": "w4", "documents": "w5", "truncate_prompt_tokens": 1}
        r = httpx.post(f"{base}/score", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


def test_vllm_score_on_a_chat_template_reranker_and_an_embedder(
    base: str, dirs: dict[str, Path]
) -> None:
    """/score on Qwen3-Reranker reads each pair through its chat template, as
    `CrossEncoder.predict`; on an embedder a pair's score is the cosine of the two texts'
    sentence-transformers vectors (each with the model's default prompt, as `encode`)."""
    from sentence_transformers import CrossEncoder

    got, _ = _scores(base, model="qwen3-rr", queries=QUESTION, documents=PASSAGES)
    reference = CrossEncoder(str(dirs["qwen3-rr"]), device="cpu")
    want = reference.predict([(QUESTION, p) for p in PASSAGES])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.ptp(want) > 1e-3
    queries = [QUESTION, PASSAGES[2]]
    got, _ = _scores(base, model="gemma3-embed", queries=queries, documents=PASSAGES[:2])
    q, d = _st_embed(dirs["gemma3-embed"], queries), _st_embed(dirs["gemma3-embed"], PASSAGES[:2])
    np.testing.assert_allclose(got, (q * d).sum(1), atol=1e-4)  # the vectors are normalized
    got, _ = _scores(base, model="gemma3-embed", queries=QUESTION, documents=PASSAGES)
    np.testing.assert_allclose(got, _st_embed(dirs["gemma3-embed"], PASSAGES) @ q[0], atol=1e-4)


def test_cohere_client_on_a_deberta_reranker(base: str, dirs: dict[str, Path]) -> None:
    import cohere

    client = cohere.ClientV2(base_url=base, api_key="unused")
    got = client.rerank(model="deberta-rr", query=QUERY, documents=TEXTS, top_n=2)
    want = _reference_scores(dirs["deberta-rr"], QUERY, TEXTS)
    assert [x.index for x in got.results] == list(np.argsort(-want, kind="stable")[:2])
    for x in got.results:
        assert x.relevance_score == pytest.approx(want[x.index], abs=1e-4)


# ---- /v1/contextualizedembeddings (late chunking) ------------------------------------------
DOCUMENT = ["w4 w5 w6 w7", "w30 w31", "w99 w98 w97 w96 w95"]
# The special tokens each model's tokenizer puts around a text (see `_tokenizer`).
FRAMES = {"qwen3-bidir": ([], []), "mpnet": ([SPECIALS["[CLS]"]], [SPECIALS["[SEP]"]])}


def _joint_span_means(path: Path, name: str, chunks: list[str]) -> np.ndarray:
    """The reference: one forward pass of `transformers` over the whole document (the
    model's specials around the chunks' own ids, back to back), each chunk's vector the
    mean of its own tokens' last hidden states. [chunks, H]"""
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    head, tail = FRAMES[name]
    pieces = [tok.encode(c, add_special_tokens=False).ids for c in chunks]
    ids = head + [t for p in pieces for t in p] + tail
    model = transformers.AutoModel.from_pretrained(path).eval()
    n = len(ids)
    kwargs: dict[str, Any] = {}
    if name == "qwen3-bidir":
        kwargs["attention_mask"] = torch.zeros(1, 1, n, n)  # bidirectional: attend everywhere
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), **kwargs).last_hidden_state[0]
    out, at = [], len(head)
    for p in pieces:
        out.append(hidden[at : at + len(p)].mean(0).numpy())
        at += len(p)
    return np.stack(out)


def _contextualized(base: str, name: str, docs: list[list[str]], **extra: Any) -> httpx.Response:
    body = {"model": name, "input": docs, **extra}
    return httpx.post(f"{base}/v1/contextualizedembeddings", json=body, timeout=60)


@pytest.mark.parametrize("name", ["qwen3-bidir", "mpnet"])
def test_contextualized_embeddings_are_span_means_of_one_pass(
    base: str, dirs: dict[str, Path], name: str
) -> None:
    r = _contextualized(base, name, [DOCUMENT, ["w200 w201"]], encoding_format="float")
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    first = body["data"][0]["data"]
    assert [c["index"] for c in first] == [0, 1, 2]
    got = np.array([c["embedding"] for c in first], dtype=np.float32)
    want = _joint_span_means(dirs[name], name, DOCUMENT)
    np.testing.assert_allclose(got, want, atol=1e-4)
    tokens = sum(len(c.split()) for c in DOCUMENT) + 2 + 2 * len(FRAMES[name][0] + FRAMES[name][1])
    assert body["usage"]["prompt_tokens"] == tokens
    # Not what the chunks give alone: each chunk saw its neighbours.
    alone = httpx.post(
        f"{base}/v1/embeddings", json={"model": name, "input": DOCUMENT}, timeout=60
    ).json()["data"]
    alone_vectors = np.array([d["embedding"] for d in alone], dtype=np.float32)
    cos = (
        (got * alone_vectors).sum(1)
        / np.linalg.norm(got, axis=1)
        / np.linalg.norm(alone_vectors, axis=1)
    )
    assert cos.max() < 0.999


def test_contextualized_int8_by_default_matches_the_float_vectors(base: str) -> None:
    import base64

    floats = _contextualized(base, "qwen3-bidir", [DOCUMENT], encoding_format="float").json()
    packed = _contextualized(base, "qwen3-bidir", [DOCUMENT], dimensions=16).json()
    for f, p in zip(floats["data"][0]["data"], packed["data"][0]["data"], strict=True):
        v = np.array(f["embedding"][:16], dtype=np.float64)
        want = np.round(127 * v / np.abs(v).max()).astype(np.int8)
        got = np.frombuffer(base64.b64decode(p["embedding"]), dtype=np.int8)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    ("docs", "says"),
    [
        ([["w4"]] * 513, "512 documents"),
        ([["w4"] * 16_001], "16000 chunks"),
        ([["w4", ""]], "input"),
        ([[" ".join(["w5"] * 130)]], "over the limit of 128 tokens per document"),
        ([], "input"),
        ([[]], "input"),
        # token ids are not a chunk form here (unlike /v1/embeddings' input)
        ([[1, 2]], "each a non-empty array of non-empty strings"),
    ],
)
def test_contextualized_limits_are_400s_naming_them(
    base: str, docs: list[list[str]], says: str
) -> None:
    r = _contextualized(base, "qwen3-bidir", docs)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]


# ---- Qwen3-Embedding (causal, last token, instructions) and Qwen3-Reranker ------------------
def _st_embed(path: Path, texts: list[str], **kwargs: Any) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, **kwargs)


def _embed(base: str, model: str = "qwen3-last", **body: Any) -> np.ndarray:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": model, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_qwen3_last_token_embedder_equals_sentence_transformers(
    base: str, dirs: dict[str, Path]
) -> None:
    path = dirs["qwen3-last"]
    documents = _embed(base, input=PASSAGES, input_type="document")
    np.testing.assert_allclose(documents, _st_embed(path, PASSAGES), atol=1e-4)
    queries = _embed(base, input=[QUESTION], input_type="query")
    want = _st_embed(path, [QUESTION], prompt_name="query")
    np.testing.assert_allclose(queries, want, atol=1e-4)
    assert float((queries * want).sum()) >= 0.9999


def test_gte_qwen2_embedder_equals_sentence_transformers(base: str, dirs: dict[str, Path]) -> None:
    path = dirs["gte-qwen2"]
    documents = _embed(base, "gte-qwen2", input=PASSAGES)
    np.testing.assert_allclose(documents, _st_embed(path, PASSAGES), atol=1e-4)
    queries = _embed(base, "gte-qwen2", input=[QUESTION], input_type="query")
    np.testing.assert_allclose(queries, _st_embed(path, [QUESTION], prompt_name="query"), atol=1e-4)


def test_roberta_embedder_equals_sentence_transformers(base: str, dirs: dict[str, Path]) -> None:
    path = dirs["roberta-embed"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.encode(PASSAGES[0]).ids[0] == 0 and tok.encode(PASSAGES[0]).ids[-1] == 2
    got = _embed(base, "roberta-embed", input=PASSAGES)
    want = _st_embed(path, PASSAGES)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert float((got * want).sum(1).min()) >= 0.9999


def test_sentence_t5_equals_sentence_transformers(base: str, dirs: dict[str, Path]) -> None:
    got = _embed(base, "t5-embed", input=TEXTS)
    want = _st_embed(dirs["t5-embed"], TEXTS)
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert float((got * want).sum(1).min()) >= 0.9999


def test_tei_predict_on_a_distilbert_cross_encoder(base: str, dirs: dict[str, Path]) -> None:
    """TEI's /predict on a pair: the one-label classifier's sigmoid, as transformers has it."""
    r = httpx.post(
        f"{base}/predict", json={"model": "distilbert-rr", "inputs": [QUERY, TEXTS[1]]}, timeout=60
    )
    assert r.status_code == 200, r.text
    want = _reference_scores(dirs["distilbert-rr"], QUERY, [TEXTS[1]])[0]
    assert r.json()[0]["score"] == pytest.approx(want, abs=1e-4)


def test_tei_predict_cuts_a_long_pair_longest_first(base: str, dirs: dict[str, Path]) -> None:
    """TEI's /predict with `truncate` on a DeBERTa-v2 cross-encoder (64 tokens): a first
    text over the limit is cut with its pair, longest first, as `tokenizers` cuts it (it
    was once a 400), either way round and with both texts long."""
    long = " ".join(f"w{4 + i % 290}" for i in range(100))
    other = " ".join(f"w{9 + i % 200}" for i in range(45))
    pairs = [[long, "w4"], ["w4", long], [long, other]]
    body = {"model": "deberta-rr", "inputs": pairs, "truncate": True}
    r = httpx.post(f"{base}/predict", json=body, timeout=60)
    assert r.status_code == 200, r.text
    want = [_reference_scores(dirs["deberta-rr"], a, [b], max_length=64)[0] for a, b in pairs]
    np.testing.assert_allclose([row[0]["score"] for row in r.json()], want, atol=1e-4)


def test_embeddinggemma_equals_sentence_transformers(base: str, dirs: dict[str, Path]) -> None:
    """Gemma 3's sliding-window stack, the Dense projections after the pooling and the task
    prompts, as sentence-transformers runs the directory it wrote."""
    path = dirs["gemma3-embed"]
    documents = _embed(base, "gemma3-embed", input=PASSAGES, input_type="document")
    np.testing.assert_allclose(
        documents, _st_embed(path, PASSAGES, prompt_name="document"), atol=1e-4
    )
    queries = _embed(base, "gemma3-embed", input=[QUESTION], input_type="query")
    want = _st_embed(path, [QUESTION], prompt_name="query")
    np.testing.assert_allclose(queries, want, atol=1e-4)
    plain = _embed(base, "gemma3-embed", input=[QUESTION])  # the default prompt
    np.testing.assert_allclose(plain, _st_embed(path, [QUESTION]), atol=1e-4)
    bare = _embed(base, "gemma3-embed", input=[QUESTION], input_type="none")  # no prompt
    np.testing.assert_allclose(bare, _st_embed(path, [QUESTION], prompt=""), atol=1e-4)
    assert float((bare * plain).sum()) < 0.9999
    assert float((plain * want).sum()) < 0.9999  # the prompts did change the input
    # Matryoshka: the first 16 of the projected 64 dimensions, renormalized
    cut = _embed(base, "gemma3-embed", input=[QUESTION], input_type="query", dimensions=16)
    np.testing.assert_allclose(cut[0], want[0, :16] / np.linalg.norm(want[0, :16]), atol=1e-4)
    r = httpx.post(
        f"{base}/v1/embeddings",
        json={"model": "gemma3-embed", "input": ["x"], "dimensions": 65},
        timeout=60,
    )
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"], r.text


def test_tei_prompt_name_picks_any_prompt_of_the_model(base: str, dirs: dict[str, Path]) -> None:
    """TEI's `prompt_name` selects any prompt of config_sentence_transformers.json (once
    only `query` and `document`: EmbeddingGemma's `STS` was a 400), on /embed, /similarity
    and /tokenize; with none, the model's `default_prompt_name` applies, as in
    `SentenceTransformer.encode`. A name the model lacks, or any name on a model without
    prompts, is TEI's 400 naming `prompt_name`."""
    path = dirs["gemma3-embed"]
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    for name in ("STS", "query", None):
        body = {"model": "gemma3-embed", "inputs": [QUESTION, PASSAGES[0]], "prompt_name": name}
        r = httpx.post(f"{base}/embed", json=body, timeout=60)
        assert r.status_code == 200, r.text
        want = _st_embed(path, [QUESTION, PASSAGES[0]], prompt_name=name)
        np.testing.assert_allclose(np.array(r.json()), want, atol=1e-4)
        r = httpx.post(
            f"{base}/similarity",
            json={
                "model": "gemma3-embed",
                "inputs": {"source_sentence": QUESTION, "sentences": [PASSAGES[0]]},
                "parameters": {"prompt_name": name},
            },
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()[0] == pytest.approx(float(want[0] @ want[1]), abs=1e-4)
        r = httpx.post(
            f"{base}/tokenize",
            json={"model": "gemma3-embed", "inputs": QUESTION, "prompt_name": name},
        )
        prompt = GEMMA_PROMPTS[name or "Clustering"]
        assert [t["id"] for t in r.json()[0]] == tok.encode(prompt + QUESTION).ids
    for model, name, says in [
        ("gemma3-embed", "Retrieval-query", "STS"),
        ("mpnet", "query", "has no prompts"),
    ]:
        body = {"model": model, "inputs": QUESTION, "prompt_name": name}
        r = httpx.post(f"{base}/embed", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt_name" and says in error["message"], error


def test_an_instruction_takes_the_models_prompt_format(base: str, dirs: dict[str, Path]) -> None:
    task = "Find passages about gardening"
    got = _embed(base, input=[QUESTION], instruction=task)
    want = _st_embed(dirs["qwen3-last"], [QUESTION], prompt=f"Instruct: {task}\nQuery:")
    np.testing.assert_allclose(got, want, atol=1e-4)
    default = _embed(base, input=[QUESTION], input_type="query")
    assert float((got * default).sum()) < 0.9999  # the instruction did change the input


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("mpnet", {}),
        ("qwen3-last", {"input_type": "document"}),
    ],
)
def test_instructions_refused_where_they_do_not_fit(base: str, name: str, extra: dict) -> None:
    body = {"model": name, "input": ["w4"], "instruction": "find it", **extra}
    r = httpx.post(f"{base}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "instruction"
    assert (
        httpx.post(f"{base}/v1/embeddings", json={**body, "instruction": None}).status_code == 200
    )


@pytest.mark.parametrize(
    ("name", "path", "extra", "field", "flat"),
    [
        ("gemma3-embed", "/v1/embeddings", {"input_type": "query"}, "input", True),
        ("gemma3-embed", "/v1/embeddings", {"input_type": "document"}, "input", False),
        ("qwen3-last", "/v1/embeddings", {"instruction": "find it"}, "input", False),
        ("gemma3-embed", "/embed", {"prompt_name": "query"}, "inputs", False),
    ],
)
def test_a_prompt_with_token_ids_applies_to_their_text(
    base: str, dirs: dict[str, Path], name: str, path: str, extra: dict, field: str, flat: bool
) -> None:
    """A prompt asked for with token ids (input_type, instruction, TEI's prompt_name) was
    dropped unseen, the vector the unprompted one. Now the ids are read as TEI reads them:
    decoded without special tokens, the prompt put before the text: the vectors equal
    those of the same request in text (ids with their special tokens or without)."""
    tok = Tokenizer.from_file(str(dirs[name] / "tokenizer.json"))
    texts = ["w5 w6 w7", "w8"][: 1 if flat else 2]
    ids = [tok.encode(t, add_special_tokens=i == 0).ids for i, t in enumerate(texts)]
    assert tok.decode_batch(ids, skip_special_tokens=True) == texts
    body = {"model": name, field: ids[0] if flat else ids}

    def vectors(payload: dict) -> np.ndarray:
        r = httpx.post(f"{base}{path}", json=payload, timeout=60)
        assert r.status_code == 200, r.text
        data = r.json()
        rows = [d["embedding"] for d in data["data"]] if isinstance(data, dict) else data
        return np.array(rows, dtype=np.float64)

    got = vectors({**body, **extra})
    np.testing.assert_allclose(got, vectors({**body, **extra, field: texts}), atol=1e-6)
    assert np.abs(got - vectors(body)).max() > 1e-3  # the prompt changed them


@pytest.mark.parametrize("instruction", [None, "Find passages about gardening"])
def test_qwen3_reranker_equals_sentence_transformers(
    base: str, dirs: dict[str, Path], instruction: str | None
) -> None:
    from sentence_transformers import CrossEncoder

    body: dict[str, Any] = {"model": "qwen3-rr", "query": QUESTION, "documents": PASSAGES}
    if instruction:
        body["instruction"] = instruction
    r = httpx.post(f"{base}/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    reference = CrossEncoder(str(dirs["qwen3-rr"]), device="cpu")
    want = reference.predict([(QUESTION, p) for p in PASSAGES], prompt=instruction)
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    got = np.array([x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])])
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.ptp(want) > 1e-3


def test_qwen3_reranker_cuts_as_sentence_transformers_does(
    base: str, dirs: dict[str, Path]
) -> None:
    """Over-long prompts (256 tokens here), even with a query over the limit by itself, are
    cut as CrossEncoder cuts them: to the limit, the template's tail written back over the
    last ids (a prompt was once cut one id short, and a long query refused); Cohere's
    max_tokens_per_doc first cuts each document to that many of its own tokens (a document
    of one token more was once left whole); TEI's /rerank and /predict read pairs through
    the chat template too (/predict once scored the bare pair)."""
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(dirs["qwen3-rr"]), device="cpu")
    tok = Tokenizer.from_file(str(dirs["qwen3-rr"] / "tokenizer.json"))
    long_doc = " ".join(PASSAGES * 8)
    docs = [long_doc, " ".join(PASSAGES * 5), PASSAGES[1], "Paris is"]
    long_query = " ".join([QUESTION] * 40)
    assert len(tok.encode(long_doc).ids) > 256 and len(tok.encode(long_query).ids) > 256

    def scores(path: str, body: dict) -> np.ndarray:
        r = httpx.post(f"{base}{path}", json={"model": "qwen3-rr", **body}, timeout=60)
        assert r.status_code == 200, r.text
        rows = r.json()["results"] if path == "/v1/rerank" else r.json()
        if path == "/predict":
            return np.array([row[0]["score"] for row in rows])
        key = "relevance_score" if path == "/v1/rerank" else "score"
        return np.array([x[key] for x in sorted(rows, key=lambda x: x["index"])])

    for query in (QUESTION, long_query):
        want = reference.predict([(query, d) for d in docs])
        np.testing.assert_allclose(
            scores("/v1/rerank", {"query": query, "documents": docs}), want, atol=1e-4
        )
        tei = {"query": query, "texts": docs, "truncate": True}
        np.testing.assert_allclose(scores("/rerank", tei), want, atol=1e-4)
        pairs = {"inputs": [[query, d] for d in docs], "truncate": True}
        np.testing.assert_allclose(scores("/predict", pairs), want, atol=1e-4)
    for k in (1, 2, 12):  # "Paris is": two tokens
        cut = []
        for d in docs:
            offsets = tok.encode(d, add_special_tokens=False).offsets
            cut.append(d[: offsets[k - 1][1]] if len(offsets) > k else d)
        body = {"query": QUESTION, "documents": docs, "max_tokens_per_doc": k}
        want = reference.predict([(QUESTION, d) for d in cut])
        np.testing.assert_allclose(scores("/v1/rerank", body), want, atol=1e-4)
    one = httpx.post(f"{base}/predict", json={"model": "qwen3-rr", "inputs": QUESTION}, timeout=60)
    assert one.status_code == 400 and one.json()["error"]["param"] == "inputs", one.text


@pytest.mark.parametrize("name", ["mpnet", "distilbert-rr"])
def test_tei_tokenize_marks_the_templates_tokens_special(
    base: str, dirs: dict[str, Path], name: str
) -> None:
    """TEI's /tokenize takes `special` from the encoding's special-tokens mask: the [CLS] /
    [SEP] the template adds are special even where the tokenizer's added tokens do not say
    so (they were once answered as empty ordinary tokens); /tokenize names only the forms it
    takes when sent token ids."""
    r = httpx.post(f"{base}/tokenize", json={"model": name, "inputs": "w4 w5"}, timeout=60)
    assert r.status_code == 200, r.text
    enc = Tokenizer.from_file(str(dirs[name] / "tokenizer.json")).encode("w4 w5")
    assert sum(enc.special_tokens_mask) == 2
    want = [
        {"id": i, "text": t, "special": True, "start": None, "stop": None}
        if m
        else {"id": i, "text": "w4 w5"[a:b], "special": False, "start": a, "stop": b}
        for i, t, m, (a, b) in zip(
            enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
        )
    ]
    assert r.json() == [want]
    bad = httpx.post(f"{base}/tokenize", json={"model": name, "input": [4, 5]}, timeout=60)
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "input" and "token ids" not in error["message"], error
