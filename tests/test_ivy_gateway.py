"""Ivy over real HTTP and real gRPC, against stand-in replicas.

The stand-in replicas are small gRPC servers defined here whose "embedding" is a fixed
function of the token ids, so the expected vectors are computed independently of Ivy
(from HF `tokenizers` output). They let these tests force what real Tulip processes only
do under stress: refusing work (RESOURCE_EXHAUSTED), going away (UNAVAILABLE), slow calls.
End-to-end tests with real Tulip processes and real weights are in test_e2e_ivy.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import openapi_spec_validator
import pytest
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from schemathesis_run import assert_no_server_error
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from ivy.app import create_app
from ivy.calls import CallFailed, CallMux
from ivy.config import IvyConfig
from ivy.replicas import SATURATED_SECONDS
from ivy.serve import uvicorn_config
from protos.trellis.v1 import inference_pb2 as pb
from protos.trellis.v1 import inference_pb2_grpc as pb_grpc
from protos.wire import pack_tensor, pack_token_batch, unpack_tensor, unpack_token_batch
from tulip.process import free_port

DIMS = 8
MAX_TOKENS = 32
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "query:", "passage:"] + [f"w{i}" for i in range(200)]


def fake_embedding(ids: np.ndarray) -> np.ndarray:
    """The stand-in model: a normalized sum of per-id sinusoids."""
    d = np.arange(1, DIMS + 1, dtype=np.float64)
    v = np.sin(np.outer(ids.astype(np.float64) + 1.0, d) * 0.37).sum(axis=0)
    return (v / np.linalg.norm(v)).astype(np.float32)


def truncate_renorm(v: np.ndarray, dims: int) -> np.ndarray:
    v = v[:dims]
    return v / np.linalg.norm(v)


@dataclass
class StandIn(pb_grpc.InferenceServicer):
    mode: str = "ok"  # ok | exhausted | unavailable | slow | stall | broken
    calls: list[int] = field(default_factory=list)  # inputs per call
    received: int = 0  # calls that reached this replica, answered or refused
    cancels: list[int] = field(default_factory=list)  # ids of `cancel` messages on Calls
    traceparents: list[str] = field(default_factory=list)  # of the Calls requests, in order
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _refusal(self) -> tuple[grpc.StatusCode, str] | None:
        with self.lock:
            self.received += 1
        if self.mode == "exhausted":
            return grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"
        if self.mode == "unavailable":
            return grpc.StatusCode.UNAVAILABLE, "draining"
        if self.mode == "broken":
            return grpc.StatusCode.INTERNAL, "engine crashed in /srv/secret/path.py"
        if self.mode == "slow":
            time.sleep(0.3)
        if self.mode == "stall":  # a frozen replica, as far as its callers can tell
            time.sleep(3.0)
        return None

    def _embed(self, request: pb.EmbedRequest) -> pb.EmbedResponse:
        ids, lengths = unpack_token_batch(request.inputs)
        with self.lock:
            self.calls.append(len(lengths))
        rows, start = [], 0
        for n in lengths.tolist():
            v = fake_embedding(ids[start : start + n])
            rows.append(truncate_renorm(v, request.dimensions) if request.dimensions else v)
            start += n
        return pb.EmbedResponse(
            embeddings=pack_tensor(np.stack(rows)),
            prompt_tokens=ids.size,
            timing=pb.Timing(queue_us=250, inference_us=1500 * len(lengths)),
        )

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        refusal = self._refusal()
        if refusal is not None:
            context.abort(*refusal)
        return self._embed(request)

    def Score(self, request: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResponse:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "embedding model")

    def Calls(
        self, requests: Iterator[pb.CallRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.CallResponse]:
        """The multiplexed stream Ivy uses: each request answered from its own thread,
        with the status the unary method would have failed with as a `CallError`."""
        answers: queue.Queue[pb.CallResponse | None] = queue.Queue()

        def error(call_id: int, code: grpc.StatusCode, message: str) -> pb.CallResponse:
            return pb.CallResponse(
                id=call_id, error=pb.CallError(code=code.value[0], message=message)
            )

        def answer(call: pb.CallRequest) -> None:
            if call.WhichOneof("call") != "embed":
                answers.put(error(call.id, grpc.StatusCode.UNIMPLEMENTED, "embedding model"))
                return
            refusal = self._refusal()
            if refusal is not None:
                answers.put(error(call.id, *refusal))
                return
            answers.put(pb.CallResponse(id=call.id, embed=self._embed(call.embed)))

        def read() -> None:
            workers = []
            try:
                for call in requests:
                    if call.WhichOneof("call") == "cancel":
                        with self.lock:
                            self.cancels.append(call.id)
                        continue
                    with self.lock:
                        self.traceparents.append(call.traceparent)
                    worker = threading.Thread(target=answer, args=(call,), daemon=True)
                    worker.start()
                    workers.append(worker)
            except grpc.RpcError:  # the caller cancelled the stream
                pass
            for worker in workers:
                worker.join()
            answers.put(None)

        threading.Thread(target=read, daemon=True).start()
        while (response := answers.get()) is not None:
            yield response

    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        return pb.InfoResponse(
            model_name="fake",
            kind=pb.MODEL_KIND_EMBEDDING,
            dimensions=DIMS,
            max_input_tokens=MAX_TOKENS,
            vocab_size=len(WORDS),
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fake-model")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "query: ", "passage": "passage: "}})
    )
    return path


@pytest.fixture(scope="module")
def oracle_tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[tuple[StandIn, str]]]:
    out, servers = [], []
    for _ in range(2):
        servicer = StandIn()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_InferenceServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        out.append((servicer, f"127.0.0.1:{port}"))
    yield out
    for server in servers:
        server.stop(0)


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # runs in a thread
        pass


def _serve(config: IvyConfig) -> tuple[_Server, threading.Thread, str]:
    server = _Server(uvicorn_config(config, app=create_app(config)))  # as `python -m ivy`
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{config.port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                return server, thread, base
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("ivy did not become ready")


@pytest.fixture(scope="module")
def ivy(model_dir: Path, replicas: list[tuple[StandIn, str]]) -> Iterator[str]:
    config = IvyConfig(
        port=free_port(),
        models={"fake": str(model_dir)},
        replicas={"fake": tuple(addr for _, addr in replicas)},
        chunk_tokens=64,
        max_body_bytes=64 * 1024,
        health_interval_seconds=0.2,
    )
    server, thread, base = _serve(config)
    yield base
    server.should_exit = True
    thread.join(10)


@pytest.fixture()
def client(ivy: str, replicas: list[tuple[StandIn, str]]) -> Iterator[httpx.Client]:
    for servicer, _ in replicas:
        servicer.mode = "ok"
    with httpx.Client(base_url=ivy, timeout=30) as c:
        yield c
    for servicer, _ in replicas:
        servicer.mode = "ok"
    time.sleep(SATURATED_SECONDS)  # refusals a test provoked no longer steer the next one


def expected(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    return np.stack([fake_embedding(np.array(tok.encode(t).ids)) for t in texts])


def words(i: int, n: int = 5) -> str:
    return " ".join(f"w{(i * 7 + k) % 200}" for k in range(n))


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param
    return body["error"]


def test_every_input_form_and_encoding(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    texts = [words(i) for i in range(5)]
    want = expected(oracle_tok, texts)
    ids = [oracle_tok.encode(t).ids for t in texts]
    cases = [(texts[0], want[:1]), (texts, want), (ids[0], want[:1]), (ids, want)]
    for value, vectors in cases:
        for fmt in ("float", "base64"):
            r = client.post(
                "/v1/embeddings", json={"input": value, "model": "fake", "encoding_format": fmt}
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["object"] == "list" and body["model"] == "fake"
            assert [d["index"] for d in body["data"]] == list(range(len(vectors)))
            assert all(d["object"] == "embedding" for d in body["data"])
            if fmt == "float":
                got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
            else:
                got = np.stack(
                    [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]]
                )
            np.testing.assert_allclose(got, vectors, rtol=0, atol=1e-6)
            tokens = sum(len(oracle_tok.encode(t).ids) for t in texts[: len(vectors)])
            assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_server_timing_relays_the_slowest_replica_time(client: httpx.Client) -> None:
    def replica_ms(body: dict) -> float:
        r = client.post("/v1/embeddings", json={"model": "fake", **body})
        assert r.status_code == 200, r.text
        parts = dict(p.strip().split(";dur=") for p in r.headers["server-timing"].split(","))
        assert set(parts) == {"tokenize", "inference", "replica"}
        assert float(parts["inference"]) >= 0
        return float(parts["replica"])

    # One input: queue 0.25 ms + 1.5 ms. Many inputs in several chunks (64-token
    # chunks here): the slowest chunk, not the sum.
    assert replica_ms({"input": words(0)}) == pytest.approx(1.75)
    many = [[5] * 30 for _ in range(8)]  # 240 tokens: chunks of 2 rows each
    assert replica_ms({"input": many}) == pytest.approx(0.25 + 1.5 * 2)


def test_input_type_applies_prompts(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    for input_type, prompt in (("search_query", "query: "), ("search_document", "passage: ")):
        r = client.post(
            "/v1/embeddings", json={"input": ["w1 w2"], "model": "fake", "input_type": input_type}
        )
        assert r.status_code == 200, r.text
        got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
        np.testing.assert_allclose(got, expected(oracle_tok, [prompt + "w1 w2"])[0], atol=1e-6)


def test_a_default_prompt_name_must_name_a_prompt(model_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers refuses a `default_prompt_name` that is not one of the
    prompts; Ivy refuses to serve the directory rather than embed without it."""
    from ivy.models import read_model_spec

    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "q: "}, "default_prompt_name": "passage"})
    )
    with pytest.raises(ValueError, match="default_prompt_name 'passage'"):
        read_model_spec(tmp_path, 10)
    (tmp_path / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"query": "q: "}, "default_prompt_name": "query"})
    )
    spec = read_model_spec(tmp_path, 10)
    assert (spec.prompts, spec.default_prompt) == ((("query", "q: "),), "q: ")
    assert read_model_spec(model_dir, 10).default_prompt == ""


def test_dimensions_truncate_and_renormalize(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    r = client.post("/v1/embeddings", json={"input": "w3 w4", "model": "fake", "dimensions": 3})
    assert r.status_code == 200, r.text
    got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(
        got, truncate_renorm(expected(oracle_tok, ["w3 w4"])[0], 3), atol=1e-6
    )
    err = assert_error(
        client.post("/v1/embeddings", json={"input": "w1", "model": "fake", "dimensions": 9}),
        400,
        "dimensions",
    )
    assert "8" in err["message"]


def test_large_request_is_chunked_over_both_replicas_in_order(
    client: httpx.Client, replicas: list[tuple[StandIn, str]], oracle_tok: Tokenizer
) -> None:
    texts = [words(i, 1 + i % 9) for i in range(300)]
    for servicer, _ in replicas:
        servicer.calls.clear()
    r = client.post("/v1/embeddings", json={"input": texts, "model": "fake"})
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)
    np.testing.assert_allclose(got, expected(oracle_tok, texts), atol=1e-6)
    per_replica = [sum(s.calls) for s, _ in replicas]
    assert sum(per_replica) == 300
    assert all(n > 0 for n in per_replica), per_replica
    # chunk_tokens=64 and every input has <= 11 tokens: no call carries more than 64 tokens.
    assert max(max(s.calls) for s, _ in replicas) <= 64 // 3
    metrics = client.get("/metrics").text
    for _, address in replicas:
        assert (
            f'ivy_replica_chunks_total{{model="fake",outcome="OK",replica="{address}"}}' in metrics
        )


def test_retry_on_other_replica_then_429_then_503(
    client: httpx.Client, replicas: list[tuple[StandIn, str]]
) -> None:
    (a, _), (b, _) = replicas
    a.mode = "exhausted"
    for _ in range(6):  # whichever replica is picked first, the other one answers
        assert (
            client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}).status_code == 200
        )
    b.mode = "exhausted"
    r = client.post("/v1/embeddings", json={"input": "w1", "model": "fake"})
    assert_error(r, 429)
    assert r.headers["retry-after"].isdigit()
    # Both just refused for capacity: for a moment Ivy sheds new requests itself ...
    seen = a.received + b.received
    assert_error(client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}), 429)
    assert a.received + b.received == seen  # ... without asking them
    # A query with no room for a document is a 400 however busy the replicas are (it is
    # checked before admission; CI once saw this 429 after a busy test).
    long_query = {"model": "fake", "query": " ".join(["w1"] * 40), "documents": ["w2"]}
    assert_error(client.post("/v1/rerank", json=long_query), 400, "query")
    time.sleep(SATURATED_SECONDS + 0.05)
    a.mode = b.mode = "unavailable"
    assert_error(client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}), 503)
    a.mode = b.mode = "ok"
    time.sleep(1.1)  # the replicas were marked suspect after UNAVAILABLE
    assert client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": 5, "model": "fake"}, 400, "input"),
        ({"input": [1.5], "model": "fake"}, 400, "input"),
        ({"input": [True], "model": "fake"}, 400, "input"),
        ({"input": ["w1", 2], "model": "fake"}, 400, "input"),
        ({"input": "w1", "model": 3}, 400, "model"),
        ({"model": "fake"}, 400, "input"),
        ({"input": "", "model": "fake"}, 400, "input"),
        ({"input": [], "model": "fake"}, 400, "input"),
        ({"input": [""], "model": "fake"}, 400, "input"),
        ({"input": [[]], "model": "fake"}, 400, "input"),
        ({"input": ["w1"] * 2049, "model": "fake"}, 400, "input"),
        ({"input": " ".join(["w1"] * 40), "model": "fake"}, 400, "input"),
        ({"input": [[5] * 40], "model": "fake"}, 400, "input"),
        ({"input": [[100000]], "model": "fake"}, 400, "input"),
        ({"input": "w1", "model": "fake", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "w1", "model": "fake", "dimensions": 0}, 400, "dimensions"),
        ({"input": "w1", "model": "fake", "dimensions": "4"}, 400, "dimensions"),
        ({"input": "w1", "model": "nope"}, 404, "model"),
    ],
)
def test_bad_inputs(client: httpx.Client, body: dict, status: int, param: str) -> None:
    err = assert_error(client.post("/v1/embeddings", json=body), status, param)
    if status == 404:
        assert err["code"] == "model_not_found"
    assert client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}).status_code == 200


def test_truncate_flag(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    long_text = " ".join(f"w{i}" for i in range(40))
    r = client.post("/v1/embeddings", json={"input": long_text, "model": "fake", "truncate": True})
    assert r.status_code == 200, r.text
    ids = oracle_tok.encode(long_text).ids
    want_ids = ids[: MAX_TOKENS - 1] + [3]  # cut, then the closing [SEP] is kept
    got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(got, fake_embedding(np.array(want_ids)), atol=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == MAX_TOKENS


def test_invalid_json_and_body_limit(client: httpx.Client) -> None:
    bad = client.post(
        "/v1/embeddings", content=b'{"input": "w1", ', headers={"content-type": "application/json"}
    )
    assert_error(bad, 400)
    assert_error(client.post("/v1/embeddings", content=b"[1, 2]"), 400)
    huge = {"input": ["w1 " * 1000] * 30, "model": "fake"}
    assert_error(client.post("/v1/embeddings", json=huge), 413)
    assert client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}).status_code == 200


def _count(metrics: str, route: str, status: int) -> float:
    line = f'ivy_requests_total{{route="{route}",status="{status}"}} '
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


def test_hot_routes_are_counted_like_the_others(client: httpx.Client) -> None:
    # POSTs to the hot routes are answered outside FastAPI's stack (ivy.hot_routes);
    # they must still be counted by route and status, like every other request.
    before = client.get("/metrics").text
    assert client.post("/v1/embeddings", json={"input": "w1", "model": "fake"}).status_code == 200
    assert_error(client.post("/v1/embeddings", json={"input": "", "model": "fake"}), 400)
    assert_error(
        client.post("/v1/rerank", json={"query": "w1", "model": "nope", "documents": ["w2"]}), 404
    )
    after = client.get("/metrics").text
    assert _count(after, "/v1/embeddings", 200) == _count(before, "/v1/embeddings", 200) + 1
    assert _count(after, "/v1/embeddings", 400) == _count(before, "/v1/embeddings", 400) + 1
    assert _count(after, "/v1/rerank", 404) == _count(before, "/v1/rerank", 404) + 1
    # A GET on a POST route: 405 in the same envelope, naming the method to use.
    r = client.get("/v1/embeddings")
    assert_error(r, 405)
    assert r.headers["allow"] == "POST"


def test_models_tokenize_health_and_openapi(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["fake"]
    assert client.get("/v1/models/fake").json() == models["data"][0]
    assert assert_error(client.get("/v1/models/fak"), 404, "model")["code"] == "model_not_found"
    assert_error(client.get("/v1/models/"), 404)  # no name: no route
    r = client.post("/tokenize", json={"model": "fake", "input": ["w1 w22", "w3"]})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    enc = oracle_tok.encode("w1 w22")
    assert data[0]["ids"] == enc.ids
    assert [tuple(o) for o in data[0]["offsets"]] == list(enc.offsets)
    assert client.get("/health/live").status_code == 200
    assert client.get("/health/ready").json()["status"] == "ready"
    spec = client.get("/openapi.json").json()
    body = spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/EmbeddingRequest"
    fields = spec["components"]["schemas"]["EmbeddingRequest"]["properties"]
    assert {"input", "model", "encoding_format", "dimensions", "user", "input_type"} <= set(fields)
    assert "/v1/rerank" in spec["paths"]
    assert_error(client.get("/nope"), 404)


def test_rerank_with_embedding_model(client: httpx.Client, oracle_tok: Tokenizer) -> None:
    docs = ["w1 w2", "w5 w6 w7", "w1"]
    r = client.post(
        "/v1/rerank",
        json={
            "model": "fake",
            "query": "w1 w2",
            "documents": [docs[0], {"text": docs[1]}, docs[2]],
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    q = expected(oracle_tok, ["query: w1 w2"])[0]
    d = expected(oracle_tok, ["passage: " + t for t in docs])
    scores = d @ q
    assert [x["index"] for x in body["results"]] == list(np.argsort(-scores))
    np.testing.assert_allclose(
        [x["relevance_score"] for x in body["results"]], np.sort(scores)[::-1], atol=1e-5
    )
    assert body["results"][0]["document"] == {"text": docs[int(np.argmax(scores))]}
    top = client.post(
        "/v2/rerank",
        json={
            "model": "fake",
            "query": "w1",
            "documents": docs,
            "top_n": 1,
            "return_documents": False,
        },
    ).json()
    assert len(top["results"]) == 1 and "document" not in top["results"][0]
    # max_tokens_per_doc counts document tokens only (regression: 1 used to fail with 500).
    one = client.post(
        "/rerank",
        json={"model": "fake", "query": "w1", "documents": ["w5 w6 w7"], "max_tokens_per_doc": 1},
    )
    assert one.status_code == 200, one.text
    cut = expected(oracle_tok, ["passage: w5"])[0] @ expected(oracle_tok, ["query: w1"])[0]
    assert one.json()["results"][0]["relevance_score"] == pytest.approx(float(cut), abs=1e-5)


def test_api_keys(model_dir: Path, replicas: list[tuple[StandIn, str]]) -> None:
    keys = model_dir / "keys.txt"
    keys.write_text("# keys\nsecret-one\n")
    config = IvyConfig(
        port=free_port(),
        models={"fake": str(model_dir)},
        replicas={"fake": tuple(a for _, a in replicas)},
        api_keys_file=str(keys),
        api_keys=("secret-two",),
    )
    server, thread, base = _serve(config)
    try:
        body = {"input": "w1", "model": "fake"}
        err = assert_error(httpx.post(f"{base}/v1/embeddings", json=body), 401)
        assert err["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert_error(httpx.post(f"{base}/v1/embeddings", json=body, headers=wrong), 401)
        for key in ("secret-one", "secret-two"):
            ok = httpx.post(
                f"{base}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert ok.status_code == 200, ok.text
        assert httpx.get(f"{base}/health/ready").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)


def test_openapi_is_the_route_table(
    client: httpx.Client, model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    """/openapi.json is valid OpenAPI, and documents exactly the routes the app serves:
    each route's method, request model (with the served names) and 200 shape."""
    spec = client.get("/openapi.json").json()
    openapi_spec_validator.validate(spec)
    config = IvyConfig(models={"fake": str(model_dir)}, replicas={"fake": (replicas[0][1],)})
    table = create_app(config).routes
    documented = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert documented == {(r.method, r.path) for r in table}
    schemas = spec["components"]["schemas"]
    for route in table:
        op = spec["paths"][route.path][route.method.lower()]
        if route.request is not None:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/" + route.request.__name__)
            served = schemas[route.request.__name__]["properties"]["model"]["enum"]
            assert served in (["fake"], ["fake", None])
        else:
            assert "requestBody" not in op
        if isinstance(route.response, type) and route.path != "/openapi.json":
            ok = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
            assert ok.endswith("/" + route.response.__name__)
        # Each route is served: an unknown method answers 405, never 404.
        wrong = "PUT"
        assert_error(client.request(wrong, route.path), 405)
    assert {"security": [{"bearer": []}, {}]}.items() <= spec["paths"]["/v1/models"]["get"].items()
    assert "security" not in spec["paths"]["/health/ready"]["get"]
    assert client.get("/docs").headers["content-type"].startswith("text/html")


def test_ivy_runs_on_no_web_framework() -> None:
    """One pipeline: no FastAPI/Starlette twin app is imported by the served app."""
    code = "import sys, ivy.app, ivy.serve; print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette')))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_cors_is_off_by_default_and_answers_allowed_origins(
    client: httpx.Client, model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    origin = {"Origin": "https://app.example"}
    body = {"input": "w1", "model": "fake"}
    r = client.post("/v1/embeddings", json=body, headers=origin)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    config = IvyConfig(
        port=free_port(),
        models={"fake": str(model_dir)},
        replicas={"fake": tuple(a for _, a in replicas)},
        cors_allow_origins=("https://app.example",),
        api_keys=("k",),
    )
    server, thread, base = _serve(config)
    try:
        preflight = {
            **origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        # Preflights carry no key: answered before authentication.
        r = httpx.options(f"{base}/v1/embeddings", headers=preflight)
        assert r.status_code == 204, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(f"{base}/v1/embeddings", json=body, headers={**origin, **auth})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        # A refusal still names the origin, so the browser shows the error to the page.
        r = httpx.post(f"{base}/v1/embeddings", json=body, headers=origin)
        assert r.status_code == 401
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(f"{base}/v1/embeddings", headers=other)
        assert "access-control-allow-origin" not in r.headers
        assert r.status_code == 401  # not a preflight of ours: treated as any request
    finally:
        server.should_exit = True
        thread.join(10)


def test_traces_continue_the_clients_traceparent_down_to_the_replica(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from protos import tracing

    exporter = InMemorySpanExporter()
    tracing.configure("ivy", exporter, batch=False)
    try:
        with ivy_with(model_dir, replicas) as base:
            for servicer, _ in replicas:
                servicer.traceparents.clear()
            trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
            r = httpx.post(
                f"{base}/v1/embeddings",
                json={"input": ["w1 w2", "w3"], "model": "fake"},
                headers={"traceparent": f"00-{trace_id}-{client_span}-01"},
            )
            assert r.status_code == 200, r.text
            untraced = httpx.post(f"{base}/v1/embeddings", json={"input": "w1", "model": "fake"})
            assert untraced.status_code == 200
    finally:
        tracing.shutdown()
    spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == trace_id]
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/embeddings", "tokenize", "inference"}, by_name
    server = by_name["POST /v1/embeddings"]
    assert f"{server.parent.span_id:016x}" == client_span
    assert server.attributes["http.response.status_code"] == 200
    for child in ("tokenize", "inference"):
        assert by_name[child].parent.span_id == server.context.span_id
    # The replica got the inference span's context on the Calls stream; the untraced
    # request started a trace of its own.
    sent = [t for servicer, _ in replicas for t in servicer.traceparents]
    inference = by_name["inference"].context
    assert f"00-{trace_id}-{inference.span_id:016x}-01" in sent
    assert len(sent) == 2 and all(t.startswith("00-") for t in sent)
    assert len({t.split("-")[1] for t in sent}) == 2


def test_schemathesis_finds_no_server_error(ivy: str, tmp_path: Path) -> None:
    assert_no_server_error(ivy, tmp_path, max_examples=40, seed=7, timeout=300)


def python_m_ivy(
    model_dir: Path, replicas: list[tuple[StandIn, str]], *flags: str
) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m ivy` with `flags` on a free port, once ready; its output is piped."""
    port = free_port()
    env = dict(os.environ, IVY_REPLICAS="fake=" + ",".join(a for _, a in replicas))
    proc = subprocess.Popen(
        [sys.executable, "-m", "ivy", "--port", str(port), *flags]
        + ["--model", f"fake={model_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
        try:
            if httpx.get(f"{base}/health/ready", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return proc, base


def test_python_m_ivy_with_two_workers_serves_and_stops_on_sigterm(
    model_dir: Path, replicas: list[tuple[StandIn, str]], oracle_tok: Tokenizer
) -> None:
    proc, base = python_m_ivy(model_dir, replicas, "--workers", "2")
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            for i in range(20):
                r = client.post("/v1/embeddings", json={"input": words(i), "model": "fake"})
                assert r.status_code == 200, r.text
                got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
                np.testing.assert_allclose(got, expected(oracle_tok, [words(i)])[0], atol=1e-6)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0, proc.stdout.read().decode()  # type: ignore[union-attr]


def test_json_logs_name_the_request(model_dir: Path, replicas: list[tuple[StandIn, str]]) -> None:
    """`--log-format json`: one JSON object per line, carrying the request's id."""
    proc, base = python_m_ivy(model_dir, replicas, "--log-format", "json")
    try:
        for servicer, _ in replicas:
            servicer.mode = "broken"
        try:
            r = httpx.post(
                f"{base}/v1/embeddings",
                json={"input": "w1", "model": "fake"},
                headers={"X-Request-Id": "json-log-1"},
            )
        finally:
            for servicer, _ in replicas:
                servicer.mode = "ok"
        assert r.status_code == 502
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    lines = [json.loads(line) for line in out.decode().splitlines() if line.strip()]
    failed = [e for e in lines if "failed a call" in e["message"]]
    assert failed, out.decode()
    assert all(e["request_id"] == "json-log-1" and e["level"] == "WARNING" for e in failed)
    assert all({"time", "level", "logger", "message"} <= set(e) for e in lines)


def test_replicas_from_dns_name(
    model_dir: Path, replicas: list[tuple[StandIn, str]], oracle_tok: Tokenizer
) -> None:
    """`--replicas-dns`: the name is resolved (and re-resolved) into replica addresses."""
    port = replicas[0][1].rpartition(":")[2]
    config = IvyConfig(
        port=free_port(),
        models={"fake": str(model_dir)},
        replicas_dns={"fake": f"localhost:{port}"},
        dns_refresh_seconds=0.2,
    )
    server, thread, base = _serve(config)
    try:
        r = httpx.post(f"{base}/v1/embeddings", json={"input": "w9", "model": "fake"})
        assert r.status_code == 200, r.text
        got = np.array(r.json()["data"][0]["embedding"], dtype=np.float32)
        np.testing.assert_allclose(got, expected(oracle_tok, ["w9"])[0], atol=1e-6)
        metrics = httpx.get(f"{base}/metrics").text
        assert f'replica="127.0.0.1:{port}"' in metrics
    finally:
        server.should_exit = True
        thread.join(10)


# -- reliability: the Calls stream, hedging, disconnects, errors ---------------------------


def test_a_cancelled_caller_never_cancels_the_shared_stream(
    replicas: list[tuple[StandIn, str]],
) -> None:
    """grpc.aio cancels a whole RPC when an awaited write is cancelled: callers must
    never await the shared stream's writes (ivy/calls.py)."""
    (a, address), _ = replicas
    a.mode = "slow"

    async def main() -> None:
        channel = grpc.aio.insecure_channel(address)
        mux = CallMux(pb_grpc.InferenceStub(channel))
        request = pb.EmbedRequest(
            inputs=pack_token_batch(np.array([2, 5, 3], np.uint32), np.array([3], np.uint32))
        )
        try:
            for _ in range(20):  # callers cancelled at every stage of their call
                doomed = asyncio.ensure_future(mux.embed(request, 10.0))
                kept = asyncio.ensure_future(mux.embed(request, 10.0))
                await asyncio.sleep(random.choice((0, 0, 0.001, 0.01)))
                doomed.cancel()
                answer = await kept  # same stream, unharmed
                assert unpack_tensor(answer.embeddings).shape == (1, DIMS)
        finally:
            await mux.close()
            await channel.close()

    try:
        asyncio.run(main())
    finally:
        a.mode = "ok"
    assert a.cancels, "the cancelled callers' requests were not withdrawn from the replica"


def test_each_waiter_of_a_broken_stream_gets_its_own_error() -> None:
    servicer = StandIn(mode="stall")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    async def main() -> list[BaseException]:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = CallMux(pb_grpc.InferenceStub(channel))
        request = pb.EmbedRequest(
            inputs=pack_token_batch(np.array([2], np.uint32), np.array([1], np.uint32))
        )
        calls = [asyncio.ensure_future(mux.embed(request, 10.0)) for _ in range(3)]
        await asyncio.sleep(0.3)
        server.stop(0)
        errors = await asyncio.gather(*calls, return_exceptions=True)
        await mux.close()
        await channel.close()
        return errors

    errors = asyncio.run(main())
    assert all(isinstance(e, CallFailed) for e in errors), errors
    assert {e.code() for e in errors} == {grpc.StatusCode.UNAVAILABLE}  # type: ignore[attr-defined]
    assert len({id(e) for e in errors}) == 3  # one instance each: no shared traceback


@contextlib.contextmanager
def ivy_with(
    model_dir: Path, replicas: list[tuple[StandIn, str]], **settings: Any
) -> Iterator[str]:
    """An Ivy of its own, with `settings` on top of the defaults, for one test."""
    config = IvyConfig(
        port=free_port(),
        models={"fake": str(model_dir)},
        replicas={"fake": tuple(a for _, a in replicas)},
        health_interval_seconds=0.2,
        **settings,
    )
    server, thread, base = _serve(config)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_stalled_replica_is_hedged_and_marked_suspect(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    (a, _), (b, _) = replicas
    with ivy_with(model_dir, replicas, hedge_after_seconds=0.3) as base:
        try:
            a.mode = "stall"
            with httpx.Client(base_url=base, timeout=30) as http:

                def embed(i: int) -> None:
                    start = time.monotonic()
                    r = http.post("/v1/embeddings", json={"input": f"w{i}", "model": "fake"})
                    assert r.status_code == 200, r.text
                    assert time.monotonic() - start < 2.0  # not the stalled replica's 3 s

                # The balancer picks at random between idle replicas: send until one
                # request meets `a` (all of 40 missing it: odds 2**-40).
                before, sent = a.received, 0
                while a.received == before and sent < 40:
                    sent += 1
                    embed(sent)
                assert a.received == before + 1, sent
                # That request was hedged, and `a` is now suspect: the next few (well
                # within its suspect second) all go to `b` alone.
                for i in range(3):
                    embed(sent + 1 + i)
                assert a.received == before + 1
                metrics = http.get("/metrics").text
            assert 'ivy_hedges_total{model="fake"} ' in metrics
            hedges = float(metrics.split('ivy_hedges_total{model="fake"} ')[1].split()[0])
            assert hedges == 1, hedges
            deadline = time.monotonic() + 5
            while not a.cancels and time.monotonic() < deadline:
                time.sleep(0.05)
            assert a.cancels, "the losing call was not cancelled on the stalled replica"
        finally:
            a.mode = b.mode = "ok"


def test_a_client_that_disconnects_cancels_its_chunks(
    ivy: str, replicas: list[tuple[StandIn, str]]
) -> None:
    (a, _), (b, _) = replicas
    before = len(a.cancels) + len(b.cancels)
    a.mode = b.mode = "stall"
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{ivy}/v1/embeddings", json={"input": "w1", "model": "fake"}, timeout=0.5)
        deadline = time.monotonic() + 5
        while len(a.cancels) + len(b.cancels) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(a.cancels) + len(b.cancels) > before, "the replica kept the orphaned work"
    finally:
        a.mode = b.mode = "ok"


def test_replica_failures_reach_clients_as_a_generic_message_with_a_request_id(
    client: httpx.Client, replicas: list[tuple[StandIn, str]]
) -> None:
    for servicer, _ in replicas:
        servicer.mode = "broken"
    r = client.post(
        "/v1/embeddings", json={"input": "w1", "model": "fake"}, headers={"X-Request-Id": "abc-1"}
    )
    err = assert_error(r, 502)
    assert r.headers["x-request-id"] == "abc-1"
    assert "abc-1" in err["message"]
    assert "secret" not in r.text and "crashed" not in r.text
    ok = client.post("/v1/embeddings", json={"input": "w1", "model": "fake"})
    assert ok.status_code == 502 and len(ok.headers["x-request-id"]) == 32  # ids are made


def test_auth_is_checked_before_the_body_is_read(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    with ivy_with(model_dir, replicas, api_keys=("k1",)) as base:
        port = int(base.rpartition(":")[2])
        for auth in (b"", b"Authorization: Bearer wrong\r\n", b"Authorization: \xff\xfe\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                # Declares 20 MB and sends none of it: the answer must not wait for it.
                sock.sendall(
                    b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                    + auth
                    + b"Content-Type: application/json\r\nContent-Length: 20000000\r\n\r\n"
                )
                start = time.monotonic()
                head = sock.recv(4096)
                assert time.monotonic() - start < 1.0
                assert head.startswith(b"HTTP/1.1 401"), head
                assert b"invalid_api_key" in head or b"www-authenticate" in head.lower()


def test_tokenize_and_rerank_query_have_a_character_cap(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    with ivy_with(model_dir, replicas, max_input_chars=100) as base:
        long = " ".join(["w1"] * 60)  # 179 characters
        r = httpx.post(f"{base}/tokenize", json={"model": "fake", "input": ["w2", long]})
        err = assert_error(r, 400, "input")
        assert "Input 1 has 179 characters" in err["message"]
        r = httpx.post(
            f"{base}/v1/rerank", json={"model": "fake", "query": long, "documents": ["w2"]}
        )
        assert_error(r, 400, "query")
        # vLLM's /score names the side whose text is over the cap
        for sides, param in (
            ({"text_1": long, "text_2": "w2"}, "text_1"),
            ({"text_1": "w2", "text_2": ["w2", long]}, "text_2"),
        ):
            r = httpx.post(f"{base}/score", json={"model": "fake", **sides})
            err = assert_error(r, 400, param)
            assert "179 characters" in err["message"]
        r = httpx.post(f"{base}/tokenize", json={"model": "fake", "input": "w2 w3"})
        assert r.status_code == 200


def test_slow_clients_are_cut_off_after_the_read_timeout(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    with ivy_with(model_dir, replicas, read_timeout_seconds=1.0) as base:
        port = int(base.rpartition(":")[2])
        # Headers a byte at a time, never finished: 408 and closed after ~1 s.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n")
            for _ in range(4):
                time.sleep(0.1)
                sock.sendall(b"X")
            answer = sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert sock.recv(4096) == b""  # closed
            assert 0.9 < time.monotonic() - start < 3.0
        # A body that stops halfway: the connection is closed after ~1 s, and the
        # request is dropped (counted as a client that left), not left waiting.
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b'\r\nContent-Length: 100\r\n\r\n{"model": '
            )
            assert sock.recv(4096) == b""
            assert 0.9 < time.monotonic() - start < 3.0
        # Patient clients are unaffected.
        r = httpx.post(f"{base}/v1/embeddings", json={"input": "w1", "model": "fake"})
        assert r.status_code == 200


def test_max_inputs_is_the_one_limit_on_inputs(
    model_dir: Path, replicas: list[tuple[StandIn, str]]
) -> None:
    with ivy_with(model_dir, replicas, max_inputs=3000, chunk_tokens=8192) as base:
        r = httpx.post(
            f"{base}/v1/embeddings", json={"model": "fake", "input": ["w1"] * 2500}, timeout=60
        )
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 2500
        r = httpx.post(f"{base}/v1/embeddings", json={"model": "fake", "input": ["w1"] * 3001})
        err = assert_error(r, 400, "input")
        assert "At most 3000 inputs" in err["message"]


def test_int8_and_binary_encodings_follow_the_documented_scheme(client: httpx.Client) -> None:
    texts = ["w1 w2", "w3", "w4 w5 w6 w7"]
    for dims in (None, 5):  # Matryoshka truncation happens before quantizing
        body: dict[str, Any] = {"input": texts, "model": "fake"}
        if dims:
            body["dimensions"] = dims
        floats = np.array(
            [d["embedding"] for d in client.post("/v1/embeddings", json=body).json()["data"]],
            dtype=np.float32,
        )
        width = dims or DIMS
        assert floats.shape == (3, width)
        r = client.post("/v1/embeddings", json={**body, "encoding_format": "base64_int8"})
        assert r.status_code == 200, r.text
        got = [np.frombuffer(base64.b64decode(d["embedding"]), np.int8) for d in r.json()["data"]]
        for row, f in zip(got, floats, strict=True):
            # The README's scheme, written out independently: round half to even of
            # 127 * x / max|x|, per vector.
            want = [int(round(127 * x / max(abs(v) for v in f))) for x in f]
            assert row.tolist() == want
        r = client.post("/v1/embeddings", json={**body, "encoding_format": "base64_binary"})
        got_bits = [base64.b64decode(d["embedding"]) for d in r.json()["data"]]
        for packed, f in zip(got_bits, floats, strict=True):
            assert len(packed) == (width + 7) // 8
            bits = [(packed[d // 8] >> (d % 8)) & 1 for d in range(width)]  # LSB first
            assert bits == [int(x > 0) for x in f]
