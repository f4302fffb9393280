"""End to end: cross-encoder reranking through `trellis up` (2 Tulip processes + Ivy, real
gRPC and HTTP) on tiny random-weight rerankers, checked against sentence-transformers'
`CrossEncoder` on the same directories and driven by `httpx` and the official `cohere`
client.

Two shapes, one cluster each (both started at once for the module):

- ``xlmr``: `XLMRobertaForSequenceClassification` with one token type, the shape of
  bge-reranker-base/-large/-v2-m3. Every token is type 0 (Hugging Face's XLM-R pair
  template); Tulip once refused to start on it because its warm-up sent type 1.
- ``bert``: `BertForSequenceClassification` with two token types (ms-marco MiniLM
  style): the document and its closing [SEP] are type 1.

Both have 64 positions, so the model limit cuts long documents cheaply; their tokenizers
are the bundled XLM-R Unigram (Trellis' Rust tokenizer) and MiniLM's WordPiece (Hugging
Face `tokenizers` behind Ivy). Weights are drawn wide enough (initializer_range 0.3) that
scores are well apart and the expected order is unambiguous.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from up_cluster import UpCluster, start_up, stop_up

FAMILIES = ("xlmr", "bert")
CLASSIFIER = "classifier"  # a three-label BertForSequenceClassification (TEI's /predict)
LABELS = ("negative", "neutral", "positive")
POSITIONS = 64  # tokens per pair, specials included (XLM-R: 66 position ids)
ATOL = 1e-4
QUERY = "how do plants grow?"
DOCS = [
    "Plants grow from seeds that need water, light and warm soil.",
    "Paris is the capital of France.",
    "東京は日本の首都です。",
    "Как пройти в библиотеку?",
    "Die Straße führt über die Brücke zum Café — naïve Grüße!",
    "a",
    # Longer than the model: cut to fit, as CrossEncoder cuts it.
    "Photosynthesis turns light, water and carbon dioxide into sugar in the leaves of green "
    "plants, while roots take up minerals from the soil. " * 3,
    "🌱 Seedlings need light.",
]


# ---- model directories -----------------------------------------------------------------


def build_reranker(
    family: str,
    out: Path,
    assets: Path,
    *,
    num_labels: int = 1,
    type_vocab_size: int | None = None,
    vocab_size: int | None = None,
) -> Path:
    """A tiny random `*ForSequenceClassification` directory with a real tokenizer.

    ``assets``: the directory of the tokenizer's asset (xlmr-tokenizer, all-minilm-l6-v2).
    ``vocab_size`` defaults to the tokenizer's, so every id it produces is embedded.
    """
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    torch.manual_seed(11)
    common: dict[str, Any] = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "num_labels": num_labels,
        "initializer_range": 0.3,
    }
    model: Any
    if family == "xlmr":
        config = XLMRobertaConfig(  # type: ignore[call-arg]
            vocab_size=vocab_size or 250_002,
            max_position_embeddings=POSITIONS + 2,  # position ids start after padding (1)
            type_vocab_size=type_vocab_size or 1,
            **common,
        )
        model = XLMRobertaForSequenceClassification(config)
        files = ("tokenizer.json", "special_tokens_map.json")
    else:
        config = BertConfig(  # type: ignore[call-arg]
            vocab_size=vocab_size or 30_522,
            max_position_embeddings=POSITIONS,
            type_vocab_size=type_vocab_size or 2,
            **common,
        )
        model = BertForSequenceClassification(config)
        files = ("tokenizer.json", "special_tokens_map.json", "vocab.txt")
    model.eval().save_pretrained(out)
    for name in files:
        shutil.copy(assets / name, out / name)
    # The tokenizer's limit is the model's, as in a published reranker: CrossEncoder
    # truncates to it.
    tokenizer_config = json.loads((assets / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokenizer_config["model_max_length"] = POSITIONS
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return out


def build_classifier(out: Path, assets: Path) -> Path:
    """A tiny random three-label classifier with named labels (config.json's id2label)."""
    build_reranker("bert", out, assets, num_labels=3)
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config["id2label"] = {str(i): name for i, name in enumerate(LABELS)}
    config["label2id"] = {name: i for i, name in enumerate(LABELS)}
    (out / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return out


def asset_for(family: str) -> str:
    return "xlmr-tokenizer" if family == "xlmr" else "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def booting(
    tmp_path_factory: pytest.TempPathFactory,
    model_path: Callable[[str], Path],
) -> Iterator[tuple[dict[str, Path], dict[str, Future[UpCluster]]]]:
    """The model directories, and one `trellis up` per family started in the background
    at once: the in-process checks run while the clusters load. Ctrl-C'd at the end."""
    root = tmp_path_factory.mktemp("rerankers")
    dirs = {
        f: build_reranker(f, root / f"tiny-{f}-reranker", model_path(asset_for(f)))
        for f in FAMILIES
    }
    dirs[CLASSIFIER] = build_classifier(root / "tiny-classifier", model_path(asset_for("bert")))
    pool = ThreadPoolExecutor(len(dirs))
    futures = {f: pool.submit(start_up, dirs[f]) for f in dirs}
    codes: dict[str, int] = {}
    try:
        yield dirs, futures
    finally:
        # Wait for every start (a failed one is gone), then stop the started ones at once.
        started = {f: fut.result() for f, fut in futures.items() if fut.exception() is None}
        codes = dict(zip(started, pool.map(stop_up, started.values()), strict=True))
        pool.shutdown()
    for family, code in codes.items():
        assert code == 0, "".join(futures[family].result().output[-40:])


@pytest.fixture(scope="module")
def model_dirs(booting: tuple[dict[str, Path], dict[str, Future[UpCluster]]]) -> dict[str, Path]:
    return booting[0]


@pytest.fixture(scope="module")
def clusters(
    booting: tuple[dict[str, Path], dict[str, Future[UpCluster]]],
) -> dict[str, UpCluster]:
    return {f: future.result() for f, future in booting[1].items()}


@pytest.fixture(scope="module")
def oracles(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """sentence-transformers' `CrossEncoder` on each directory (its tokenizer is the
    `transformers` one: `.tokenizer`)."""
    from sentence_transformers import CrossEncoder

    return {f: CrossEncoder(str(model_dirs[f]), device="cpu") for f in FAMILIES}


def predict(encoder: Any, query: str, docs: list[str], max_length: int | None = None) -> np.ndarray:
    """CrossEncoder's default scores (sigmoid of the one logit); ``max_length``: cut pairs
    to that many tokens (its longest_first truncation) instead of to the model's limit."""
    kwargs: dict[str, Any] = {}
    if max_length is not None:
        kwargs["processing_kwargs"] = {"text": {"max_length": max_length, "truncation": True}}
    scores = encoder.predict([(query, d) for d in docs], batch_size=64, **kwargs)
    return np.asarray(scores, dtype=np.float64)


def predict_single(encoder: Any, texts: list[str]) -> np.ndarray:
    """Scores of texts alone (sigmoid of the one logit), cut as the encoder's tokenizer is
    set to cut them."""
    tok = encoder.tokenizer
    batch = tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        logits = encoder.model(**batch).logits[:, 0]
    return torch.sigmoid(logits).double().numpy()


def expected_order(scores: np.ndarray) -> list[int]:
    order = np.argsort(-scores, kind="stable")
    # The tiny models' weights are wide enough that the order is unambiguous.
    assert np.diff(scores[order]).max() < -1e-3, scores[order]
    return order.tolist()


# ---- tokenization (in process) ---------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_pair_ids_are_transformers_pair_ids(
    family: str, model_dirs: dict[str, Path], oracles: dict[str, Any]
) -> None:
    """Ivy's pairs are `tokenizer(query, doc)`'s ids; its first segments are the type-0
    tokens of a two-type model; its truncation is CrossEncoder's when the query is short."""
    from ivy.models import ServedModel

    directory = model_dirs[family]
    ours = ServedModel.load(family, directory).tokenizer
    theirs = oracles[family].tokenizer
    assert ours.backend == ("rust" if family == "xlmr" else "huggingface")
    fits = [d for d in DOCS if len(theirs(QUERY, d)["input_ids"]) <= POSITIONS]
    assert len(fits) == len(DOCS) - 1
    ids, lengths, first = ours.encode_pairs_packed(QUERY, fits, None)
    rows = np.split(ids, np.cumsum(lengths)[:-1])
    for doc, row, n_first in zip(fits, rows, first.tolist(), strict=True):
        want = theirs(QUERY, doc)
        assert row.tolist() == want["input_ids"], doc
        if family == "bert":
            assert n_first == want["token_type_ids"].count(0), doc
    # Cut to the model (the gateway's `max_length` when max_tokens_per_doc is large) and
    # to a few document tokens: CrossEncoder's longest_first cuts the same tokens.
    n_query = len(theirs(QUERY, add_special_tokens=False)["input_ids"])
    specials = theirs.num_special_tokens_to_add(pair=True)
    for max_length in (POSITIONS, n_query + specials + 8):
        ids, lengths, _ = ours.encode_pairs_packed(QUERY, DOCS, max_length)
        rows = np.split(ids, np.cumsum(lengths)[:-1])
        for doc, row in zip(DOCS, rows, strict=True):
            want = theirs(QUERY, doc, truncation=True, max_length=max_length)["input_ids"]
            assert row.tolist() == want, (max_length, doc)


# ---- Tulip start-up (in process) -------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "type_vocab_size", "num_labels"),
    [("xlmr", 1, 1), ("xlmr", 1, 3), ("xlmr", 2, 1), ("bert", 2, 3)],
)
def test_tulip_warms_up_and_scores_every_cross_encoder_shape(
    family: str,
    type_vocab_size: int,
    num_labels: int,
    tmp_path: Path,
    model_path: Callable[[str], Path],
) -> None:
    """Regression: warm-up sent token type 1 to one-type XLM-R rerankers (bge-reranker),
    which the engine refuses, so Tulip never started. Checked for one and several labels;
    scores of a pair equal Hugging Face's logits with the model's own token types."""
    from transformers import AutoModelForSequenceClassification

    from protos.trellis.v1 import inference_pb2 as pb
    from protos.wire import pack_token_batch
    from tulip.backend import RoseBackend
    from tulip.config import TulipConfig
    from tulip.inputs import score_work
    from tulip.scheduler import BatchInputs

    directory = build_reranker(
        family,
        tmp_path / "tiny",
        model_path(asset_for(family)),
        num_labels=num_labels,
        type_vocab_size=type_vocab_size,
        vocab_size=1000,
    )
    backend = RoseBackend.load(TulipConfig(model=str(directory), device="cpu"))
    try:
        asyncio.run(backend.warm_up())
        query, doc = [0, 17, 450, 2], [2, 33, 999, 5, 2]
        work, _ = score_work(
            pb.ScoreRequest(pairs=pack_token_batch([query + doc]), first_segment_lengths=[4]),
            backend.served.limits,
        )
        batch = BatchInputs(
            ids=work.ids,
            lengths=work.lengths,
            first_segment_lengths=work.first_segment_lengths,
            pooling=None,
            normalize=None,
        )
        got = asyncio.run(_step(backend, batch))
    finally:
        backend.close()
    assert backend.served.info.num_labels == num_labels
    types = [0] * len(query) + [0 if type_vocab_size == 1 else 1] * len(doc)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.inference_mode():
        want = model(
            input_ids=torch.tensor([query + doc]), token_type_ids=torch.tensor([types])
        ).logits.numpy()
    assert got.shape == want.shape == (1, num_labels)
    np.testing.assert_allclose(got, want, atol=ATOL)


async def _step(backend: Any, batch: Any) -> np.ndarray:
    return np.asarray(await backend.step(batch))


# ---- end to end ------------------------------------------------------------------------


def test_banner_offers_rerank_only(clusters: dict[str, UpCluster]) -> None:
    for cluster in clusters.values():
        assert f"curl -s {cluster.base_url}/v1/rerank" in cluster.text
        assert "/v1/embeddings" not in cluster.text


@pytest.mark.parametrize("family", FAMILIES)
def test_rerank_matches_cross_encoder(
    family: str, clusters: dict[str, UpCluster], oracles: dict[str, Any]
) -> None:
    cluster = clusters[family]
    want = predict(oracles[family], QUERY, DOCS)
    order = expected_order(want)
    tok = oracles[family].tokenizer
    tokens = sum(len(tok(QUERY, d, truncation=True)["input_ids"]) for d in DOCS)
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        body = _rerank(client, cluster.name, QUERY, DOCS)
        assert [r["index"] for r in body["results"]] == order
        np.testing.assert_allclose(
            [r["relevance_score"] for r in body["results"]], want[order], atol=ATOL
        )
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
        assert body["usage"]["total_tokens"] == tokens
        # top_n, no documents, Jina's document objects.
        body = _rerank(
            client,
            cluster.name,
            QUERY,
            [{"text": d} for d in DOCS],
            top_n=3,
            return_documents=False,
        )
        assert [r["index"] for r in body["results"]] == order[:3]
        assert all("document" not in r for r in body["results"])
        np.testing.assert_allclose(
            [r["relevance_score"] for r in body["results"]], want[order[:3]], atol=ATOL
        )
        # One document alone scores as it does among others.
        body = _rerank(client, cluster.name, QUERY, [DOCS[2]])
        np.testing.assert_allclose(body["results"][0]["relevance_score"], want[2], atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_tei_rerank_shape_matches_cross_encoder(
    family: str, clusters: dict[str, UpCluster], oracles: dict[str, Any]
) -> None:
    """TEI's /rerank (`texts`): a list of {index, score[, text]}, sigmoid scores unless
    `raw_scores` (then the logits), over-long pairs refused unless `truncate`."""
    cluster = clusters[family]
    want = predict(oracles[family], QUERY, DOCS)
    order = expected_order(want)
    logits = np.asarray(
        oracles[family].predict(
            [(QUERY, d) for d in DOCS], batch_size=64, activation_fn=torch.nn.Identity()
        ),
        dtype=np.float64,
    )
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        body = {"query": QUERY, "texts": DOCS, "truncate": True, "return_text": True}
        ranks = client.post("/rerank", json=body).json()
        assert [r["index"] for r in ranks] == order
        np.testing.assert_allclose([r["score"] for r in ranks], want[order], atol=ATOL)
        assert [r["text"] for r in ranks] == [DOCS[i] for i in order]
        raw = client.post("/rerank", json={**body, "raw_scores": True, "return_text": False})
        raw_ranks = raw.json()
        assert all(set(r) == {"index", "score"} for r in raw_ranks)
        assert [r["index"] for r in raw_ranks] == order  # sigmoid keeps the order
        np.testing.assert_allclose([r["score"] for r in raw_ranks], logits[order], atol=ATOL)
        # Without truncate the long document is refused, naming the model's limit.
        refused = client.post("/rerank", json={"query": QUERY, "texts": DOCS})
        assert refused.status_code == 400, refused.text
        assert str(POSITIONS) in refused.json()["error"]["message"]


def test_tei_predict_matches_transformers(
    clusters: dict[str, UpCluster], model_dirs: dict[str, Path], oracles: dict[str, Any]
) -> None:
    """TEI's /predict: softmax over a classifier's labels (named by id2label), highest
    first, logits with `raw_scores`; a single text, a pair, a batch of both; sigmoid for
    a one-label model."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = model_dirs[CLASSIFIER]
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()

    def logits(*texts: str) -> np.ndarray:
        with torch.no_grad():
            batch = tok(*texts, return_tensors="pt", truncation=True)
            return model(**batch).logits[0].double().numpy()

    def check(got: list[dict], want_logits: np.ndarray, raw: bool) -> None:
        want = want_logits if raw else np.exp(want_logits) / np.exp(want_logits).sum()
        order = np.argsort(-want)
        assert [p["label"] for p in got] == [LABELS[i] for i in order]
        np.testing.assert_allclose([p["score"] for p in got], want[order], atol=ATOL)

    with httpx.Client(base_url=clusters[CLASSIFIER].base_url, timeout=60) as client:
        check(client.post("/predict", json={"inputs": DOCS[0]}).json(), logits(DOCS[0]), False)
        pair = client.post("/predict", json={"inputs": [QUERY, DOCS[1]], "raw_scores": True})
        check(pair.json(), logits(QUERY, DOCS[1]), True)
        batch = [[d] for d in DOCS[:3]] + [[QUERY, DOCS[3]]]
        got = client.post("/predict", json={"inputs": batch, "truncate": True}).json()
        assert len(got) == 4
        for row, item in zip(got, batch, strict=True):
            check(row, logits(*item), False)
        # as TEI reads them: a list of one text is that text, three texts are refused
        one = client.post("/predict", json={"inputs": ["only one"]})
        check(one.json(), logits("only one"), False)
        three = client.post("/predict", json={"inputs": ["a", "b", "c"]})
        assert three.status_code == 400, three.text
        assert three.json()["error"]["param"] == "inputs"
    # A one-label reranker classifies too: sigmoid of its logit, as CrossEncoder scores.
    with httpx.Client(base_url=clusters["bert"].base_url, timeout=60) as client:
        (got,) = client.post("/predict", json={"inputs": [QUERY, DOCS[0]]}).json()
    assert got["label"] == "LABEL_0"
    np.testing.assert_allclose(
        got["score"], predict(oracles["bert"], QUERY, DOCS[:1])[0], atol=ATOL
    )


def test_vllm_classify_matches_transformers(
    clusters: dict[str, UpCluster], model_dirs: dict[str, Path], oracles: dict[str, Any]
) -> None:
    """vLLM's /classify: each text's softmax over the labels in label order, the likeliest
    label by name, the logits with `use_activation: false`; `truncate_prompt_tokens` cuts
    a long text as transformers' tokenizer does (else a 400); a one-label model's sigmoid."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = model_dirs[CLASSIFIER]
    tok = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForSequenceClassification.from_pretrained(directory).eval()

    def logits(texts: list[str], max_length: int | None = None) -> np.ndarray:
        with torch.no_grad():
            cut = {"truncation": True, "max_length": max_length} if max_length else {}
            batch = tok(texts, return_tensors="pt", padding=True, **cut)
            return model(**batch).logits.double().numpy()

    texts = DOCS[:3]
    want = logits(texts)
    probs = np.exp(want) / np.exp(want).sum(axis=1, keepdims=True)
    with httpx.Client(base_url=clusters[CLASSIFIER].base_url, timeout=60) as client:
        r = client.post("/classify", json={"input": texts})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["label"] for d in body["data"]] == [LABELS[i] for i in want.argmax(1)]
        assert {d["num_classes"] for d in body["data"]} == {len(LABELS)}
        np.testing.assert_allclose([d["probs"] for d in body["data"]], probs, atol=ATOL)
        tokens = sum(len(tok(t)["input_ids"]) for t in texts)
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        for off in ({"use_activation": False}, {"activation": False}, {"softmax": False}):
            raw = client.post("/classify", json={"input": texts[0], **off})
            np.testing.assert_allclose(raw.json()["data"][0]["probs"], want[0], atol=ATOL)
        long = " ".join(DOCS) * 20
        refused = client.post("/classify", json={"input": [long]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
        cut = client.post("/classify", json={"input": [long], "truncate_prompt_tokens": 16})
        np.testing.assert_allclose(
            cut.json()["data"][0]["probs"],
            np.exp(logits([long], 16)[0]) / np.exp(logits([long], 16)[0]).sum(),
            atol=ATOL,
        )
    with httpx.Client(base_url=clusters["bert"].base_url, timeout=60) as client:
        (got,) = client.post("/classify", json={"input": QUERY}).json()["data"]
    assert (got["label"], got["num_classes"]) == ("LABEL_0", 1)
    np.testing.assert_allclose(got["probs"], predict_single(oracles["bert"], [QUERY]), atol=ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_cohere_client_matches_cross_encoder(
    family: str, clusters: dict[str, UpCluster], oracles: dict[str, Any]
) -> None:
    import cohere

    cluster = clusters[family]
    client = cohere.ClientV2(api_key="unused", base_url=cluster.base_url)
    want = predict(oracles[family], QUERY, DOCS)
    order = expected_order(want)
    response = client.rerank(model=cluster.name, query=QUERY, documents=DOCS, top_n=4)
    assert [r.index for r in response.results] == order[:4]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], want[order[:4]], atol=ATOL
    )
    # max_tokens_per_doc keeps that many document tokens: CrossEncoder with room for the
    # query, the specials and as many document tokens (the query is the shorter side).
    per_doc = 8
    tok = oracles[family].tokenizer
    n_query = len(tok(QUERY, add_special_tokens=False)["input_ids"])
    assert n_query <= per_doc
    max_length = n_query + tok.num_special_tokens_to_add(pair=True) + per_doc
    want = predict(oracles[family], QUERY, DOCS, max_length)
    order = expected_order(want)
    response = client.rerank(
        model=cluster.name, query=QUERY, documents=DOCS, max_tokens_per_doc=per_doc
    )
    assert [r.index for r in response.results] == order
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], want[order], atol=ATOL
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_batch_split_over_replicas_matches_cross_encoder(
    family: str, clusters: dict[str, UpCluster], oracles: dict[str, Any]
) -> None:
    """Over `trellis up`'s 8192-token chunks: the chunks' scores come back in place."""
    cluster = clusters[family]
    docs = [f"{i} " + DOCS[i % len(DOCS)] + " plants" * (i % 50) for i in range(200)]
    want = predict(oracles[family], QUERY, docs)
    before = _score_calls(cluster)
    with httpx.Client(base_url=cluster.base_url, timeout=120) as client:
        body = _rerank(client, cluster.name, QUERY, docs, return_documents=False)
    assert body["usage"]["total_tokens"] > 8192
    deadline = time.monotonic() + 10  # a replica counts a call just after answering it
    while _score_calls(cluster) - before < 2:
        assert time.monotonic() < deadline, "the batch was not split into chunks"
        time.sleep(0.1)
    got = np.zeros(len(docs))
    got[[r["index"] for r in body["results"]]] = [r["relevance_score"] for r in body["results"]]
    np.testing.assert_allclose(got, want, atol=ATOL)
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_long_query_is_cut_with_its_documents_as_cross_encoder_cuts_them(
    family: str, clusters: dict[str, UpCluster], oracles: dict[str, Any]
) -> None:
    """A query over half the model's room is cut too, longest first, as CrossEncoder, TEI
    and vLLM cut pairs: /v1/rerank, TEI's /rerank and /predict score what CrossEncoder
    scores (they once refused it, 400); max_tokens_per_doc cuts each document to its own
    tokens before the pair is fitted."""
    cluster = clusters[family]
    encoder = oracles[family]
    tok = encoder.tokenizer
    query = "how do plants grow from seeds in warm and wet soil? " * 3
    n_query = len(tok(query, add_special_tokens=False)["input_ids"])
    assert POSITIONS // 2 < n_query < POSITIONS  # cut with a long document, not a short
    want = predict(encoder, query, DOCS)
    per_doc = 3

    fit = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    fit.no_padding()
    fit.enable_truncation(POSITIONS)  # longest_first: `post_process` cuts the pair

    def capped(doc: str) -> float:  # the document's first 3 tokens, then the pair fitted
        d = fit.encode(doc, add_special_tokens=False)
        d.truncate(per_doc)
        pair = fit.post_process(fit.encode(query, add_special_tokens=False), d)
        inputs = {"input_ids": torch.tensor([pair.ids])}
        if family == "bert":
            inputs["token_type_ids"] = torch.tensor([pair.type_ids])
        with torch.no_grad():
            return torch.sigmoid(encoder.model(**inputs).logits[0, 0]).item()

    want_capped = np.array([capped(d) for d in DOCS])
    with httpx.Client(base_url=cluster.base_url, timeout=60) as client:
        for extra, expected in (({}, want), ({"max_tokens_per_doc": per_doc}, want_capped)):
            body = _rerank(client, cluster.name, query, DOCS, return_documents=False, **extra)
            got = np.zeros(len(DOCS))
            got[[r["index"] for r in body["results"]]] = [
                r["relevance_score"] for r in body["results"]
            ]
            np.testing.assert_allclose(got, expected, atol=ATOL)
        tei = client.post("/rerank", json={"query": query, "texts": DOCS, "truncate": True})
        assert tei.status_code == 200, tei.text
        got = np.zeros(len(DOCS))
        got[[r["index"] for r in tei.json()]] = [r["score"] for r in tei.json()]
        np.testing.assert_allclose(got, want, atol=ATOL)
        inputs = [[query, d] for d in DOCS]
        r = client.post("/predict", json={"inputs": inputs, "truncate": True})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose([row[0]["score"] for row in r.json()], want, atol=ATOL)
        # swapped: the long text second, the documents first
        r = client.post("/predict", json={"inputs": [[d, query] for d in DOCS], "truncate": True})
        assert r.status_code == 200, r.text
        swapped = np.array([predict(encoder, d, [query])[0] for d in DOCS])
        np.testing.assert_allclose([row[0]["score"] for row in r.json()], swapped, atol=ATOL)
        # without truncate, an over-long pair is refused
        refused = client.post("/predict", json={"inputs": inputs})
        assert refused.status_code == 400, refused.text
        # TEI's truncation_direction `left`: each sequence keeps its end, as the
        # tokenizer's truncation_side "left" keeps it
        tok.truncation_side = "left"
        try:
            want_left = predict(encoder, query, DOCS)
            alone = predict_single(encoder, list(DOCS))
        finally:
            tok.truncation_side = "right"
        assert np.abs(want_left - want).max() > 1e-3  # the long pairs lost other tokens
        body = {"query": query, "texts": DOCS, "truncate": True, "truncation_direction": "left"}
        tei = client.post("/rerank", json=body)
        assert tei.status_code == 200, tei.text
        got = np.zeros(len(DOCS))
        got[[r["index"] for r in tei.json()]] = [r["score"] for r in tei.json()]
        np.testing.assert_allclose(got, want_left, atol=ATOL)
        singles = [[d] for d in DOCS]
        body = {"inputs": inputs + singles, "truncate": True, "truncation_direction": "left"}
        r = client.post("/predict", json=body)
        assert r.status_code == 200, r.text
        scores = [row[0]["score"] for row in r.json()]
        np.testing.assert_allclose(scores, np.concatenate((want_left, alone)), atol=ATOL)


def _rerank(client: httpx.Client, model: str, query: str, documents: list, **extra: Any) -> dict:
    r = client.post(
        "/v1/rerank", json={"model": model, "query": query, "documents": documents, **extra}
    )
    assert r.status_code == 200, r.text
    return r.json()


def _score_calls(cluster: UpCluster) -> float:
    """Score RPCs the cluster's replicas have answered, all together."""
    pattern = re.compile(r'^tulip_requests_total\{method="Score",status="OK"\} (\S+)$', re.M)
    return sum(
        float(m.group(1))
        for text in cluster.replica_metrics().values()
        for m in pattern.finditer(text)
    )
