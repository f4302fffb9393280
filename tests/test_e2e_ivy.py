"""End to end: `trellis up`'s cluster (2 Tulip processes + Ivy) with the real
multilingual-e5-small weights, checked against ROSE run in this process and driven by
the official `openai` and `cohere` clients.

The cluster starts once for the module; the replica-kill test runs last because it
changes the cluster.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from schemathesis_run import assert_no_server_error
from tokenizers import Tokenizer
from up_cluster import UpCluster, start_up, stop_up

MODEL = "multilingual-e5-small"
TEXTS = [
    "how much protein should a female eat",
    "summit define",
    "Die Katze sitzt auf der Matte.",
    "東京は日本の首都です。",
    "Как пройти в библиотеку?",
    "El rápido zorro marrón salta sobre el perro perezoso.",
]
COSINE = 0.99999
MAX_BODY = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model(MODEL))


@pytest.fixture(scope="module")
def cluster(model_dir: Path) -> Iterator[UpCluster]:
    """`trellis up` exactly as `make run` starts it (other model directory, free port)."""
    c = start_up(model_dir, env={"IVY_MAX_BODY_BYTES": str(MAX_BODY)})
    assert f"curl -s {c.base_url}/v1/embeddings" in c.text
    assert f"curl -s {c.base_url}/v1/rerank" in c.text
    children = c.children()
    assert sum(" -m tulip " in cmd for cmd in children.values()) == 2, children
    assert sum(" -m ivy " in cmd for cmd in children.values()) == 1, children
    yield c
    # Ctrl-C: everything drains and stops, and `trellis up` exits cleanly.
    code = stop_up(c)
    for pid in children:
        assert (
            not Path(f"/proc/{pid}").exists()
            or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
        ), f"child {pid} still running"
    assert code == 0, "".join(c.output[-40:])


@pytest.fixture(scope="module")
def base(cluster: UpCluster) -> str:
    return cluster.base_url


@pytest.fixture(scope="module")
def name(cluster: UpCluster) -> str:
    return cluster.name


@pytest.fixture(scope="module")
def oracle(model_dir: Path):  # noqa: ANN201 - returns a closure
    """Texts -> ROSE embeddings in this process, tokenized by HF `tokenizers`."""
    from rose import Engine, EngineConfig, RaggedBatch

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    engine = Engine.load(model_dir, EngineConfig(device="cpu"))

    def embed_ids(rows: list[list[int]]) -> np.ndarray:
        out = []
        for start in range(0, len(rows), 256):
            batch = RaggedBatch.from_lists(rows[start : start + 256])
            out.append(np.asarray(engine.step(batch).wait(), dtype=np.float32))
        return np.concatenate(out)

    def embed(texts: list[str]) -> np.ndarray:
        return embed_ids([e.ids for e in tok.encode_batch(texts)])

    embed.ids = lambda texts: [e.ids for e in tok.encode_batch(texts)]  # type: ignore[attr-defined]
    embed.embed_ids = embed_ids  # type: ignore[attr-defined]
    return embed


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def decode(data: list[dict], fmt: str) -> np.ndarray:
    if fmt == "float":
        return np.array([d["embedding"] for d in data], dtype=np.float32)
    return np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in data])


def test_every_input_form_and_format_matches_rose(base: str, name: str, oracle) -> None:  # noqa: ANN001
    want = oracle(TEXTS)
    ids = oracle.ids(TEXTS)
    forms = [(TEXTS[3], want[3:4]), (TEXTS, want), (ids[2], want[2:3]), (ids, want)]
    with httpx.Client(base_url=base, timeout=60) as client:
        for value, expected in forms:
            for fmt in ("float", "base64"):
                r = client.post(
                    "/v1/embeddings", json={"model": name, "input": value, "encoding_format": fmt}
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert [d["index"] for d in body["data"]] == list(range(len(expected)))
                got = decode(body["data"], fmt)
                assert got.shape == expected.shape == (len(expected), 384)
                assert cosines(got, expected).min() >= COSINE
                np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)


def test_prompts_and_dimensions(base: str, name: str, oracle) -> None:  # noqa: ANN001
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(
            "/v1/embeddings",
            json={"model": name, "input": TEXTS[:2], "input_type": "search_query"},
        )
        assert r.status_code == 200, r.text
        want = oracle(["query: " + t for t in TEXTS[:2]])
        assert cosines(decode(r.json()["data"], "float"), want).min() >= COSINE
        r = client.post(
            "/v1/embeddings", json={"model": name, "input": TEXTS[:2], "dimensions": 64}
        )
        assert r.status_code == 200, r.text
        got = decode(r.json()["data"], "float")
        full = oracle(TEXTS[:2])[:, :64]
        assert got.shape == (2, 64)
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-4)
        assert cosines(got, full).min() >= COSINE


def test_openai_client(base: str, name: str, oracle) -> None:  # noqa: ANN001
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    want = oracle(TEXTS)
    default = client.embeddings.create(model=name, input=TEXTS)  # base64 on the wire
    as_float = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    for response in (default, as_float):
        got = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert cosines(got, want).min() >= COSINE
        assert response.usage.prompt_tokens == sum(len(i) for i in oracle.ids(TEXTS))
    # TEI and Infinity serve the same at /embeddings: a base URL without /v1 works too
    bare = OpenAI(base_url=base, api_key="unused", max_retries=0)
    got = np.array([d.embedding for d in bare.embeddings.create(model=name, input=TEXTS).data])
    assert cosines(got, want).min() >= COSINE
    single = client.embeddings.create(model=name, input=TEXTS[0])
    assert cosines(np.array([single.data[0].embedding]), want[:1]).min() >= COSINE
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as info:
        client.embeddings.create(model="no-such-model", input="x")
    assert info.value.code == "model_not_found"
    # models.list and models.retrieve (GET /v1/models/{model})
    assert [m.id for m in client.models.list()] == [name]
    card = client.models.retrieve(name)
    assert (card.id, card.object, card.owned_by) == (name, "model", "trellis")
    with pytest.raises(NotFoundError) as info:
        client.models.retrieve("no-such/model")  # a Hub-style id: the slash is the name's
    assert info.value.code == "model_not_found"


def test_cohere_client_rerank(base: str, name: str, oracle) -> None:  # noqa: ANN001
    import cohere

    docs = [
        "Protein needs depend on body weight; adult women need about 46 grams a day.",
        "Summit: the highest point of a hill or mountain.",
        "Berlin ist die Hauptstadt von Deutschland.",
    ]
    query = "how much protein should a female eat"
    client = cohere.ClientV2(api_key="unused", base_url=base)
    response = client.rerank(model=name, query=query, documents=docs, top_n=2)
    q = oracle(["query: " + query])
    d = oracle(["passage: " + t for t in docs])
    scores = cosines(d, np.repeat(q, len(docs), axis=0))
    order = list(np.argsort(-scores))
    assert [r.index for r in response.results] == order[:2]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results], scores[order[:2]], atol=1e-4
    )
    with httpx.Client(base_url=base, timeout=60) as http:  # Jina's shape
        jina = http.post(
            "/v1/rerank",
            json={"model": name, "query": query, "documents": [{"text": t} for t in docs]},
        ).json()
    assert [r["index"] for r in jina["results"]] == order
    assert [r["document"]["text"] for r in jina["results"]] == [docs[i] for i in order]
    assert jina["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(
    ("content", "status", "param"),
    [
        (b'{"model": "M", "input": ', 400, None),
        (b'{"model": "M", "input": 12.5}', 400, "input"),
        (b'{"model": "M", "input": ""}', 400, "input"),
        (b'{"model": "M", "input": []}', 400, "input"),
        (b'{"model": "M", "input": [' + b",".join([b'"a"'] * 2049) + b"]}", 400, "input"),
        (b'{"model": "M", "input": "' + b"word " * 2000 + b'"}', 400, "input"),
        (b'{"model": "nope", "input": "a"}', 404, "model"),
        (b'{"model": "M", "input": "a", "dimensions": 385}', 400, "dimensions"),
        (b'{"model": "M", "input": "a", "dimensions": -1}', 400, "dimensions"),
        (b'{"model": "M", "input": "' + b"a" * (MAX_BODY + 1) + b'"}', 413, None),
    ],
)
def test_bad_inputs_keep_the_worker_serving(
    base: str, name: str, content: bytes, status: int, param: str | None
) -> None:
    content = content.replace(b'"M"', f'"{name}"'.encode())
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(
            "/v1/embeddings", content=content, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, r.text[:500]
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param
        ok = client.post("/v1/embeddings", json={"model": name, "input": "still serving"})
        assert ok.status_code == 200


def test_truncate_flag(base: str, name: str, oracle) -> None:  # noqa: ANN001
    long_text = "word " * 2000
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post(
            "/v1/embeddings", json={"model": name, "input": long_text, "truncate": True}
        )
    assert r.status_code == 200, r.text
    ids = oracle.ids([long_text])[0]
    cut = ids[:511] + [ids[-1]]
    assert r.json()["usage"]["prompt_tokens"] == 512
    want = oracle.embed_ids([cut])
    assert cosines(decode(r.json()["data"], "float"), want).min() >= COSINE


def test_truncation_from_the_left_keeps_the_end_of_the_text(
    base: str, name: str, oracle, model_dir: Path
) -> None:  # noqa: ANN001
    # Different words at each end, so a cut from the wrong side changes the vector.
    long_text = "beginning " * 600 + "middle " * 600 + "the very end of it"
    reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reference.enable_truncation(512, direction="left")  # HF's own left truncation
    want = oracle.embed_ids([reference.encode(long_text).ids])
    right = oracle.ids([long_text])[0]
    not_want = oracle.embed_ids([right[:511] + [right[-1]]])
    with httpx.Client(base_url=base, timeout=60) as client:
        for body, path in (
            (
                {
                    "model": name,
                    "input": long_text,
                    "truncate": True,
                    "truncation_direction": "left",
                },
                "/v1/embeddings",
            ),
            ({"inputs": long_text, "truncate": True, "truncation_direction": "Left"}, "/embed"),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            got = (
                decode(r.json()["data"], "float")
                if path == "/v1/embeddings"
                else np.array(r.json(), dtype=np.float32)
            )
            assert cosines(got, want).min() >= COSINE
            assert cosines(got, not_want).max() < 0.99
        # Without truncate (and no --auto-truncate): a 400 naming the limit, the route's own
        # field and the route's own way to ask for a cut.
        for path, body, param, fix in (
            ("/embed", {"inputs": long_text}, "inputs", "`truncate: true`"),
            ("/v1/embeddings", {"model": name, "input": long_text}, "input", "`truncate: true`"),
            (
                "/v2/embed",
                {
                    "model": name,
                    "texts": [long_text],
                    "input_type": "search_query",
                    "truncate": "NONE",
                },
                "texts",
                '`truncate: "END"`',
            ),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert "512" in error["message"] and fix in error["message"], (path, error)
            assert error["param"] == param and error["code"] == "context_length_exceeded", error


def test_a_flat_list_of_token_ids_is_one_input_whatever_its_length(
    base: str, name: str, oracle
) -> None:  # noqa: ANN001
    """3000 ids in one flat list are one input (cut to 512 with truncate), not 3000 inputs
    over the 2048-input limit; the nested form gives the same vector."""
    ids = [100] * 2999 + [2]
    want = oracle.embed_ids([ids[:512]])
    with httpx.Client(base_url=base, timeout=60) as client:
        for path, body in (
            ("/v1/embeddings", {"model": name, "input": ids, "truncate": True}),
            ("/v1/embeddings", {"model": name, "input": [ids], "truncate": True}),
            ("/embed", {"inputs": ids, "truncate": True}),
        ):
            r = client.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            got = (
                decode(r.json()["data"], "float")
                if path == "/v1/embeddings"
                else np.array(r.json(), dtype=np.float32)
            )
            assert got.shape[0] == 1 and cosines(got, want).min() >= COSINE


def test_tei_embed_and_info(base: str, name: str, oracle, model_dir: Path) -> None:  # noqa: ANN001
    from rose import Engine, EngineConfig, RaggedBatch

    with httpx.Client(base_url=base, timeout=60) as client:
        # TEI clients send no model: the first embedding model serves them.
        normalized = np.array(
            client.post("/embed", json={"inputs": TEXTS}).json(), dtype=np.float32
        )
        assert cosines(normalized, oracle(TEXTS)).min() >= COSINE
        np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1.0, atol=1e-5)
        raw = client.post("/embed", json={"inputs": TEXTS, "normalize": False, "model": name})
        raw_vectors = np.array(raw.json(), dtype=np.float32)
        engine = Engine.load(model_dir, EngineConfig(device="cpu"))
        rows = oracle.ids(TEXTS)
        batch = RaggedBatch.from_lists(rows, normalize=[False] * len(rows))
        unnormalized = np.asarray(engine.step(batch).wait(), dtype=np.float32)
        np.testing.assert_allclose(raw_vectors, unnormalized, atol=2e-4, rtol=1e-4)
        assert np.abs(np.linalg.norm(raw_vectors, axis=1) - 1.0).min() > 1e-2
        one = client.post(
            "/embed", json={"inputs": TEXTS[0], "prompt_name": "query", "dimensions": 64}
        ).json()
        want = oracle(["query: " + TEXTS[0]])[:, :64]
        assert len(one) == 1 and len(one[0]) == 64
        assert cosines(np.array(one, dtype=np.float32), want).min() >= COSINE
        bad = client.post("/embed", json={"inputs": "x", "prompt_name": "nope"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt_name"
        sims = client.post(
            "/similarity",
            json={
                "inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]},
                "parameters": {"prompt_name": "query", "truncation_direction": "Right"},
            },
        ).json()
        q = oracle(["query: " + t for t in TEXTS])
        np.testing.assert_allclose(sims, cosines(q[1:], np.repeat(q[:1], 5, axis=0)), atol=1e-4)
        # /decode: the ids of a text give the text back (special tokens skipped unless
        # asked for); an id outside the vocabulary is a 400.
        ids = oracle.ids(TEXTS[:2])
        assert client.post("/decode", json={"ids": ids}).json() == TEXTS[:2]
        with_specials = client.post(
            "/decode", json={"ids": ids[0], "skip_special_tokens": False}
        ).json()
        (text,) = with_specials
        assert text.startswith("<s>") and text.endswith("</s>") and TEXTS[0] in text
        bad = client.post("/decode", json={"ids": [1, 10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "ids"
        # /tokenize in TEI's shape: what `tokenizers` encodes, shown by TEI's rules
        # (special tokens: their string, no offsets; others: the text they cover, with
        # offsets in UTF-8 bytes, as TEI's Rust tokenizer counts them).
        reference = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        got = client.post("/tokenize", json={"inputs": TEXTS[2:4]}).json()
        assert len(got) == 2
        for text, tokens in zip(TEXTS[2:4], got, strict=True):
            enc = reference.encode(text)
            raw = text.encode()
            want = []
            for i, tok, special, (a, b) in zip(
                enc.ids, enc.tokens, enc.special_tokens_mask, enc.offsets, strict=True
            ):
                if special:
                    want.append(
                        {"id": i, "text": tok, "special": True, "start": None, "stop": None}
                    )
                    continue
                start, stop = len(text[:a].encode()), len(text[:b].encode())
                assert raw[start:stop].decode() == text[a:b]
                want.append(
                    {"id": i, "text": text[a:b], "special": False, "start": start, "stop": stop}
                )
            assert tokens == want
        assert any(t["stop"] - t["start"] > len(t["text"]) for t in got[1] if not t["special"])
        plain = client.post(
            "/tokenize", json={"inputs": TEXTS[0], "add_special_tokens": False}
        ).json()
        assert [t["id"] for t in plain[0]] == reference.encode(
            TEXTS[0], add_special_tokens=False
        ).ids
        info = client.get("/info").json()
    assert info["model_id"] == name and info["max_input_length"] == 512
    assert info["auto_truncate"] is False and info["max_client_batch_size"] == 2048


def test_cohere_client_embed_by_type(base: str, name: str, oracle) -> None:  # noqa: ANN001
    import cohere
    from sentence_transformers.util.quantization import quantize_embeddings

    client = cohere.ClientV2(api_key="unused", base_url=base)
    kinds = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    response = client.embed(
        model=name, texts=TEXTS, input_type="search_document", embedding_types=kinds
    )
    want = oracle(["passage: " + t for t in TEXTS])
    got = np.array(response.embeddings.float_, dtype=np.float32)
    assert cosines(got, want).min() >= COSINE
    assert response.texts == TEXTS and response.meta.billed_units.input_tokens > 0
    # int8: each vector scaled by 127 / its largest magnitude, rounded half to even.
    int8 = np.array(response.embeddings.int8)
    np.testing.assert_array_equal(
        int8, np.rint(127 * got.astype(np.float64) / np.abs(got).max(axis=1, keepdims=True))
    )
    np.testing.assert_array_equal(np.array(response.embeddings.uint8), int8 + 128)
    # The binary types are sentence-transformers' scheme, checked with its own function.
    for kind in ("binary", "ubinary"):
        np.testing.assert_array_equal(
            np.array(getattr(response.embeddings, kind)), quantize_embeddings(got, kind)
        )
    b64 = np.array(
        [np.frombuffer(base64.b64decode(v), dtype="<f4") for v in response.embeddings.base64]
    )
    np.testing.assert_array_equal(b64, got)
    query = client.embed(
        model=name,
        texts=TEXTS[:1],
        input_type="search_query",
        embedding_types=["float"],
        output_dimension=128,
        truncate="NONE",
    )
    assert (
        cosines(
            np.array(query.embeddings.float_, dtype=np.float32),
            oracle(["query: " + TEXTS[0]])[:, :128],
        ).min()
        >= COSINE
    )
    assert query.embeddings.int8 is None
    with httpx.Client(base_url=base, timeout=60) as http:
        r = http.post(
            "/v2/embed",
            json={"model": name, "texts": ["a"], "input_type": "search_query", "images": ["x"]},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "images"


def _replica_ok_chunks(metrics: str) -> dict[str, float]:
    out = {}
    for m in re.finditer(
        r'ivy_replica_chunks_total\{model="[^"]+",outcome="OK",replica="([^"]+)"\} ([0-9.e+]+)',
        metrics,
    ):
        out[m.group(1)] = float(m.group(2))
    return out


def test_2048_inputs_split_over_both_replicas_in_order(
    base: str, name: str, cluster: UpCluster, oracle
) -> None:  # noqa: ANN001
    # About 6 tokens each: ~12k tokens, more than one default chunk (8192).
    texts = [f"doc {i} {TEXTS[i % len(TEXTS)].split()[0]}" for i in range(2048)]
    with httpx.Client(base_url=base, timeout=300) as client:
        before = _replica_ok_chunks(client.get("/metrics").text)
        r = client.post(
            "/v1/embeddings", json={"model": name, "input": texts, "encoding_format": "base64"}
        )
        assert r.status_code == 200, r.text[:500]
        after = _replica_ok_chunks(client.get("/metrics").text)
    data = r.json()["data"]
    assert [d["index"] for d in data] == list(range(2048))
    got = decode(data, "base64")
    sample = sorted({0, 1, 2047, *range(3, 2048, 37)})
    assert cosines(got[sample], oracle([texts[i] for i in sample])).min() >= COSINE
    for address in cluster.replica_addresses:
        assert after.get(address, 0) > before.get(address, 0), (before, after)


def test_schemathesis_finds_no_server_error(base: str, tmp_path: Path) -> None:
    assert_no_server_error(base, tmp_path, max_examples=8, seed=11, timeout=600)


def test_killing_a_replica_under_load_loses_no_request(
    base: str, name: str, cluster: UpCluster
) -> None:
    stop = threading.Event()
    statuses: list[int] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client_loop(seed: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as client:
            i = 0
            while not stop.is_set():
                batch = [f"client {seed} request {i} item {k}" for k in range(1 + (i % 16))]
                r = client.post("/v1/embeddings", json={"model": name, "input": batch})
                with lock:
                    statuses.append(r.status_code)
                    if r.status_code != 200 or len(r.json()["data"]) != len(batch):
                        failures.append(f"{r.status_code} {r.headers} {r.text[:300]}")
                i += 1

    with ThreadPoolExecutor(max_workers=6) as pool:
        futures = [pool.submit(client_loop, s) for s in range(6)]
        time.sleep(2.0)
        os.kill(cluster.replica_pid(cluster.replica_addresses[0]), signal.SIGKILL)
        time.sleep(3.0)
        stop.set()
        for f in futures:
            f.result()
    assert len(statuses) > 20
    assert not failures, failures
    with httpx.Client(base_url=base, timeout=60) as client:
        ready = client.get("/health/ready").json()
        assert ready["healthy_replicas"][name] >= 1
        health = client.get("/health")  # TEI's, vLLM's and Infinity's probe path
        assert health.status_code == 200 and health.json()["status"] == "ready"
        assert (
            client.post("/v1/embeddings", json={"model": name, "input": "after"}).status_code == 200
        )


def test_vllms_truncation_and_activation_fields(base: str, name: str, model_dir: Path) -> None:
    """vLLM's /v1/embeddings fields: `truncate_prompt_tokens` cuts each input to that many
    tokens, special tokens included, as sentence-transformers cuts at `max_seq_length`;
    `use_activation: false` gives the vectors before the model's Normalize. Both were once
    ignored (inputs cut at the model's limit, vectors normalized)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    st.max_seq_length = 16
    texts = [" ".join(TEXTS), TEXTS[1]]
    want = st.encode(texts)
    tokens = [min(len(ids), 16) for ids in st.tokenizer(texts)["input_ids"]]
    assert tokens[0] == 16 and tokens[1] < 16
    with httpx.Client(base_url=base, timeout=60) as client:
        body = {"model": name, "input": texts, "truncate_prompt_tokens": 16}
        r = client.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        assert cosines(decode(r.json()["data"], "float"), want).min() >= COSINE
        assert r.json()["usage"]["prompt_tokens"] == sum(tokens)
        r = client.post("/v1/embeddings", json={**body, "use_activation": False})
        assert r.status_code == 200, r.text
        raw = decode(r.json()["data"], "float")
        assert np.abs(np.linalg.norm(raw, axis=1) - 1.0).min() > 1e-2
        assert cosines(raw, want).min() >= COSINE
        r = client.post("/v1/embeddings", json={**body, "truncate_prompt_tokens": 513})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
        # vLLM's truncation_side: left keeps each text's end (it was ignored: cut right)
        st.tokenizer.truncation_side = "left"
        want_left = st.encode(texts)
        assert cosines(want_left, want).min() < 0.99  # the side matters for texts[0]
        r = client.post("/v1/embeddings", json={**body, "truncation_side": "left"})
        assert r.status_code == 200, r.text
        assert cosines(decode(r.json()["data"], "float"), want_left).min() >= COSINE


def test_vllm_tokenize_and_detokenize(base: str, name: str, model_dir: Path) -> None:
    """vLLM's /tokenize (`prompt`) and /detokenize: the ids, count and token strings
    `tokenizers` gives, the model's limit, and ids back to text with special tokens kept."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = TEXTS[3]
    enc = tok.encode(text)
    with httpx.Client(base_url=base, timeout=60) as client:
        body = {"model": name, "prompt": text, "return_token_strs": True}
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        want = {"count": len(enc.ids), "max_model_len": 512, "tokens": enc.ids}
        assert r.json() == {**want, "token_strs": enc.tokens}
        r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        bare = tok.encode(text, add_special_tokens=False).ids
        assert r.json()["tokens"] == bare and r.json()["token_strs"] is None
        r = client.post("/detokenize", json={"model": name, "tokens": enc.ids})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": tok.decode(enc.ids, skip_special_tokens=False)}
        assert "<s>" in r.json()["prompt"]
        r = client.post("/detokenize", json={"tokens": [tok.get_vocab_size()]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text
        r = client.post("/tokenize", json={"model": name, "prompt": text, "input": text})
        assert r.status_code == 400, r.text


def test_cohere_max_tokens_cuts_each_text(base: str, name: str, model_dir: Path) -> None:
    """Cohere's v2 `max_tokens` (once a 400, "not supported"): each text, prompt included,
    cut to that many tokens as sentence-transformers cuts at `max_seq_length`; with
    `truncate: NONE` a longer text is a 400 naming the count asked for."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu")
    st.max_seq_length = 16
    texts = [" ".join(TEXTS), TEXTS[1]]
    want = st.encode(texts, prompt="query: ")
    body = {"model": name, "texts": texts, "input_type": "search_query", "max_tokens": 16}
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/v2/embed", json=body)
        assert r.status_code == 200, r.text
        got = np.array(r.json()["embeddings"]["float"], dtype=np.float32)
        assert cosines(got, want).min() >= COSINE
        r = client.post("/v2/embed", json={**body, "truncate": "NONE"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "texts", r.text
        assert "over the 16 asked for" in r.json()["error"]["message"]
        r = client.post("/v2/embed", json={**body, "max_tokens": 1})  # below <s> ... </s>
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_int8_embeddings_keep_the_float_direction_on_real_texts(base: str, name: str) -> None:
    body = {"model": name, "input": TEXTS}
    floats = decode(
        httpx.post(f"{base}/v1/embeddings", json=body, timeout=60).json()["data"], "float"
    )
    r = httpx.post(
        f"{base}/v1/embeddings", json={**body, "encoding_format": "base64_int8"}, timeout=60
    )
    assert r.status_code == 200, r.text
    q = np.stack(
        [np.frombuffer(base64.b64decode(d["embedding"]), np.int8) for d in r.json()["data"]]
    )
    assert q.shape == floats.shape and q.dtype == np.int8
    assert cosines(q.astype(np.float32), floats).min() >= 0.99
    # Rankings survive too: query-to-text cosines computed on int8 stay within 0.01.
    qn = q / np.linalg.norm(q.astype(np.float32), axis=1, keepdims=True)
    fn = floats / np.linalg.norm(floats, axis=1, keepdims=True)
    assert np.abs(qn @ qn.T - fn @ fn.T).max() < 0.01
    r = httpx.post(
        f"{base}/v1/embeddings",
        json={**body, "encoding_format": "base64_binary", "dimensions": 128},
        timeout=60,
    )
    bits = np.stack(
        [
            np.unpackbits(
                np.frombuffer(base64.b64decode(d["embedding"]), np.uint8), bitorder="little"
            )
            for d in r.json()["data"]
        ]
    )
    assert bits.shape == (len(TEXTS), 128)
    assert (bits == (floats[:, :128] > 0)).all()
