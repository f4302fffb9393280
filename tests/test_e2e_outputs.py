"""Output kinds end to end (#23): real Tulip processes behind one real Ivy.

A tiny random BGE-M3 (XLM-R + sparse_linear.pt + colbert_linear.pt) and a tiny random
SPLADE (BertForMaskedLM as a sentence-transformers SparseEncoder), from tests/output_models.py:

* `/embed_sparse` (both), `/embed_all` and `/v1/embeddings` with ``output: sparse`` return
  the references' values (FlagEmbedding's formulas on `transformers`, SparseEncoder);
* `/v1/rerank` on BGE-M3 scores by ColBERT MaxSim of the reference's multi-vectors;
* the TEI-shaped answers validate against the schemas of TEI's published OpenAPI document
  (huggingface/text-embeddings-inference, docs/openapi.json: EmbedSparseResponse,
  SparseValue, EmbedAllResponse), written out below.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import numpy as np
import pytest
import torch
import transformers
from ivy_process import serve_dirs
from output_models import (
    TEXTS,
    bge_m3_reference,
    encode,
    make_bge_m3,
    make_splade,
    maxsim,
    splade_reference,
)

TOL = 1e-4
# From TEI's docs/openapi.json (components.schemas), as published.
TEI_SPARSE_VALUE = {
    "type": "object",
    "required": ["index", "value"],
    "properties": {
        "index": {"type": "integer", "minimum": 0},
        "value": {"type": "number", "format": "float"},
    },
}
TEI_EMBED_SPARSE_RESPONSE = {"type": "array", "items": {"type": "array", "items": TEI_SPARSE_VALUE}}
TEI_EMBED_ALL_RESPONSE = {
    "type": "array",
    "items": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs-e2e")
    return {"bge-m3": make_bge_m3(root / "bge-m3"), "splade": make_splade(root / "splade")}


@pytest.fixture(scope="module")
def base(dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_dirs(dirs, tmp_path_factory.mktemp("outputs-logs")) as url:
        yield url


def _post(base: str, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _assert_sparse(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert [sorted(g) for g in got] == [sorted(w) for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose([g[k] for k in w], [w[k] for k in w], atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["bge-m3", "splade"])
def test_embed_sparse_equals_the_reference_in_tei_shape(
    base: str, dirs: dict[str, Path], name: str
) -> None:
    body = _post(base, "/embed_sparse", {"inputs": TEXTS, "model": name})
    jsonschema.validate(body, TEI_EMBED_SPARSE_RESPONSE)
    got = [{int(e["index"]): float(e["value"]) for e in row} for row in body]
    for row in body:
        assert [e["index"] for e in row] == sorted(e["index"] for e in row)
    if name == "bge-m3":
        want = bge_m3_reference(dirs[name], encode(dirs[name], TEXTS))[1]
        assert sum(len(w) for w in want) > 0
    else:
        want = splade_reference(dirs[name], TEXTS)
    _assert_sparse(got, want)


def test_openai_embeddings_sparse_extension(base: str, dirs: dict[str, Path]) -> None:
    body = _post(base, "/v1/embeddings", {"model": "splade", "input": TEXTS, "output": "sparse"})
    got = [
        dict(zip(d["embedding"]["indices"], d["embedding"]["values"], strict=True))
        for d in body["data"]
    ]
    _assert_sparse(got, splade_reference(dirs["splade"], TEXTS))
    refused = httpx.post(
        f"{base}/v1/embeddings",
        json={"model": "splade", "input": "w4", "output": "sparse", "dimensions": 8},
        timeout=60,
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"


def test_dense_of_bge_m3_is_its_normalized_cls(base: str, dirs: dict[str, Path]) -> None:
    body = _post(base, "/v1/embeddings", {"model": "bge-m3", "input": TEXTS})
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    want = bge_m3_reference(dirs["bge-m3"], encode(dirs["bge-m3"], TEXTS))[0]
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_embed_all_gives_transformers_last_hidden_states(base: str, dirs: dict[str, Path]) -> None:
    body = _post(base, "/embed_all", {"inputs": TEXTS[:3], "model": "bge-m3"})
    jsonschema.validate(body, TEI_EMBED_ALL_RESPONSE)
    path = dirs["bge-m3"]
    hf = transformers.XLMRobertaModel.from_pretrained(path, add_pooling_layer=False).eval()
    with torch.no_grad():
        for ids, got in zip(encode(path, TEXTS[:3]), body, strict=True):
            want = hf(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
            np.testing.assert_allclose(np.array(got, dtype=np.float32), want, atol=TOL, rtol=0)


def test_rerank_scores_by_colbert_maxsim_on_a_multi_vector_model(
    base: str, dirs: dict[str, Path]
) -> None:
    query, docs = TEXTS[0], TEXTS[1:]
    body = _post(base, "/v1/rerank", {"model": "bge-m3", "query": query, "documents": docs})
    path = dirs["bge-m3"]
    colbert = bge_m3_reference(path, encode(path, [query, *docs]))[2]
    want = np.array([maxsim(colbert[0], d) for d in colbert[1:]])
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    np.testing.assert_allclose([got[i] for i in range(len(docs))], want, atol=TOL, rtol=0)
    assert [r["index"] for r in body["results"]] == np.argsort(-want, kind="stable").tolist()


def test_sparse_embeddings_refuse_dense_only_options_by_name(base: str) -> None:
    r = httpx.post(
        f"{base}/v1/embeddings",
        json={"model": "bge-m3", "input": "w4", "output": "sparse", "encoding_format": "base64"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
