"""Tulip end to end: real `python -m tulip` processes, real gRPC on loopback, real ROSE
engine and weights (multilingual-e5-small from `rose.assets`; a random-weight XLM-R
cross-encoder saved with `transformers` for Score).

Results are compared with ROSE run in this process on the same inputs: batching in the
server must not change any request's vectors beyond float32 rounding (ATOL).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.trellis.v1 import inference_pb2 as pb
from protos.wire import pack_token_batch
from rose import Engine
from tulip.client import TulipClient, embed_request, read_embed
from tulip.process import Samples, TulipProcess, free_port

ATOL = 1e-4  # batched vs single rows, float32
STATUS = health_pb2.HealthCheckResponse


# -- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def e5_server(e5_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TulipProcess]:
    log = tmp_path_factory.mktemp("tulip") / "e5.log"
    # Admission by queued tokens only: the time bound (--max-queue-seconds, 1 s by default)
    # refused the queued request of test_cancelled_request_is_not_computed whenever the
    # throughput estimate put its 1,024 tokens ahead over a second (CI, 2026-12-02).
    args = ["--model", str(e5_dir), "--max-batch-tokens", "256", "--max-queued-tokens", "1024"]
    args += ["--max-queue-seconds", "0"]
    with TulipProcess(args, log_path=log) as server:
        server.wait_serving()
        yield server
        assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(5)
    config = XLMRobertaConfig(  # type: ignore[call-arg]
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=66,
        type_vocab_size=2,
        num_labels=1,
    )
    model = XLMRobertaForSequenceClassification(config).eval()
    path = tmp_path_factory.mktemp("reranker") / "tiny-xlmr-reranker"
    model.save_pretrained(path)
    return path


def rose_embed(
    engine: Engine,
    rows: list[list[int]],
    pooling: str | None = None,
    normalize: bool | None = None,
) -> np.ndarray:
    from rose import RaggedBatch

    n = len(rows)
    batch = RaggedBatch.from_lists(rows, pooling=[pooling] * n, normalize=[normalize] * n)
    return engine.step(batch).wait().numpy()


def random_rows(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    return [
        [0, *(rng.randrange(5, 250_000) for _ in range(rng.randint(low, high) - 2)), 2]
        for _ in range(count)
    ]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def startup_statuses(server: TulipProcess, timeout: float = 300.0) -> list[int]:
    """Poll health from process start until SERVING; the distinct statuses seen, in order."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(server.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not seen or seen[-1] != STATUS.SERVING:
            assert server.poll() is None, server.log_tail()
            assert time.monotonic() < deadline, server.log_tail()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
            except grpc.RpcError:
                status = None  # not listening yet
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            time.sleep(0.02)
    return seen


async def wait_for_metric(
    server: TulipProcess, name: str, target: float, timeout: float = 60.0, **labels: str
) -> None:
    key = (name, tuple(sorted(labels.items())))
    deadline = time.monotonic() + timeout
    while server.metrics().get(key, 0.0) < target:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {target}"
        await asyncio.sleep(0.005)


# -- embedding server -------------------------------------------------------------------


def test_info_and_health_describe_the_served_model(
    e5_server: TulipProcess, e5_engine: Engine
) -> None:
    async def main() -> None:
        async with TulipClient(e5_server.target) as client:
            info = await client.info()
            assert await client.health() == "SERVING"
            assert await client.health("trellis.v1.Inference") == "SERVING"
            timed = await client.embed([[0, 35378, 4, 2], [0, 9, 2]])
        assert timed.prompt_tokens == 7
        assert timed.inference_us > 0 and timed.queue_us >= 0
        expected = e5_engine.info
        assert info.model_name == "multilingual-e5-small"
        assert info.kind == pb.MODEL_KIND_EMBEDDING
        assert (info.dimensions, info.vocab_size) == (expected.dimensions, expected.vocab_size)
        assert info.max_input_tokens == expected.max_input_tokens == 512
        assert info.default_pooling == pb.POOLING_MEAN and info.default_normalize
        assert (info.query_prompt, info.document_prompt) == ("query: ", "passage: ")
        assert (info.device, info.dtype) == ("cpu", "float32")

    asyncio.run(main())
    names = {name for name, _ in e5_server.metrics()}
    for family in (
        "tulip_queue_depth",
        "tulip_queued_tokens",
        "tulip_batch_rows_bucket",
        "tulip_batch_tokens_bucket",
        "tulip_batch_requests_bucket",
        "tulip_queue_seconds_bucket",
        "tulip_inference_seconds_bucket",
        "tulip_requests_total",
        "tulip_computed_tokens_total",
    ):
        assert family in names, family


def test_concurrent_clients_get_their_own_correct_results_in_shared_batches(
    e5_server: TulipProcess,
    e5_engine: Engine,
) -> None:
    rng = random.Random(1)
    clients, rounds = 16, 3
    work = [
        [random_rows(rng, rng.randint(1, 2), 3, 16) for _ in range(rounds)] for _ in range(clients)
    ]
    before = e5_server.metrics()

    async def client(requests: list[list[list[int]]]) -> list[tuple[list[list[int]], np.ndarray]]:
        out = []
        async with TulipClient(e5_server.target) as tulip:
            for rows in requests:
                result = await tulip.embed(rows)
                assert result.prompt_tokens == sum(len(r) for r in rows)
                out.append((rows, result.embeddings))
        return out

    async def main() -> list[list[tuple[list[list[int]], np.ndarray]]]:
        return await asyncio.gather(*(client(requests) for requests in work))

    answers = [answer for per_client in asyncio.run(main()) for answer in per_client]
    # ROSE in-process on every request's rows (one ragged batch; rows are independent).
    expected = rose_embed(e5_engine, [row for rows, _ in answers for row in rows])
    offset = 0
    for rows, vectors in answers:
        np.testing.assert_allclose(vectors, expected[offset : offset + len(rows)], atol=ATOL)
        offset += len(rows)
    after = e5_server.metrics()
    batches = delta(after, before, "tulip_batch_requests_count")
    requests = delta(after, before, "tulip_batch_requests_sum")
    single = delta(after, before, "tulip_batch_requests_bucket", le="1.0")
    assert requests == clients * rounds
    assert batches - single > 0, "no batch held more than one request"
    assert batches < requests
    assert delta(after, before, "tulip_requests_total", method="Embed", status="OK") == requests


def test_embedding_options_match_rose(e5_server: TulipProcess, e5_engine: Engine) -> None:
    from rose.pooling import truncate_dimensions

    rows = random_rows(random.Random(2), 3, 4, 12)

    async def main() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        async with TulipClient(e5_server.target) as client:
            cls_raw = await client.embed(rows, pooling="cls", normalize=False)
            short = await client.embed(rows, dimensions=64)
            half = await client.embed(rows, dtype="float16")
            return cls_raw.embeddings, short.embeddings, half.embeddings

    cls_raw, short, half = asyncio.run(main())
    expected_cls = rose_embed(e5_engine, rows, pooling="cls", normalize=False)
    np.testing.assert_allclose(cls_raw, expected_cls, atol=ATOL)
    assert not np.allclose(np.linalg.norm(cls_raw, axis=1), 1.0)
    mean = rose_embed(e5_engine, rows)
    assert short.shape == (3, 64)
    np.testing.assert_allclose(short, truncate_dimensions(mean, 64, True), atol=ATOL)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(half, mean, atol=2e-3)


def test_every_invalid_input_class_is_rejected_and_serving_continues(
    e5_server: TulipProcess,
    e5_engine: Engine,
) -> None:
    vocab = e5_engine.info.vocab_size
    cases: list[tuple[str, object, str]] = [
        ("Embed", pb.EmbedRequest(inputs=pb.TokenBatch()), "inputs: no inputs"),
        ("Embed", pb.EmbedRequest(inputs=pack_token_batch([[0, 2], []])), "inputs[1]: empty"),
        (
            "Embed",
            pb.EmbedRequest(inputs=pack_token_batch([[0, 2], [0, vocab, 2]])),
            f"inputs[1]: token id {vocab} at position 1 is outside the vocabulary",
        ),
        (
            "Embed",
            pb.EmbedRequest(inputs=pack_token_batch([[0, 2], [5] * 513])),
            "inputs[1]: 513 tokens is longer than the model's maximum of 512",
        ),
        (
            "Embed",
            pb.EmbedRequest(inputs=pb.TokenBatch(ids=b"\x00" * 12, lengths=[2, 2])),
            "inputs: lengths sum to 4 but ids holds 3 tokens",
        ),
        (
            "Embed",
            pb.EmbedRequest(inputs=pb.TokenBatch(ids=b"\x00" * 6, lengths=[1])),
            "inputs: ids holds 6 bytes, not a multiple of 4",
        ),
        (
            "Embed",
            pb.EmbedRequest(inputs=pack_token_batch([[0, 2]]), dimensions=385),
            "dimensions: 385 is more than the model's 384",
        ),
        (
            "Score",
            pb.ScoreRequest(pairs=pack_token_batch([[0, 2, 2, 2]])),
            "Score needs a cross-encoder model",
        ),
    ]
    good = [[0, 35378, 4, 759, 10269, 83, 99942, 2]]

    async def main() -> None:
        async with TulipClient(e5_server.target) as client:
            for method, request, message in cases:
                call = getattr(client.stub, method)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call(request, timeout=30)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                assert message in (caught.value.details() or ""), caught.value.details()
                # The server keeps serving after each rejection.
                result = read_embed(await client.stub.Embed(embed_request(good), timeout=60))
                np.testing.assert_allclose(
                    result.embeddings, rose_embed(e5_engine, good), atol=ATOL
                )

    asyncio.run(main())


def test_overload_is_refused_at_once_while_accepted_requests_complete(
    e5_server: TulipProcess,
    e5_engine: Engine,
) -> None:
    rng = random.Random(3)
    requests = [random_rows(rng, 1, 128, 128) for _ in range(32)]
    before = e5_server.metrics()

    async def one(client: TulipClient, rows: list[list[int]]) -> np.ndarray | grpc.StatusCode:
        try:
            return (await client.embed(rows, timeout=600)).embeddings
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            return error.code()

    async def main() -> list[np.ndarray | grpc.StatusCode]:
        async with TulipClient(e5_server.target) as client:
            return await asyncio.gather(*(one(client, rows) for rows in requests))

    outcomes = asyncio.run(main())
    accepted = [
        (rows, out)
        for rows, out in zip(requests, outcomes, strict=True)
        if isinstance(out, np.ndarray)
    ]
    refused = len(requests) - len(accepted)
    assert accepted and refused, f"{len(accepted)} accepted, {refused} refused"
    for rows, vectors in accepted:
        np.testing.assert_allclose(vectors, rose_embed(e5_engine, rows), atol=ATOL)
    after = e5_server.metrics()
    status = "RESOURCE_EXHAUSTED"
    assert delta(after, before, "tulip_requests_total", method="Embed", status=status) == refused
    assert delta(after, before, "tulip_computed_tokens_total") == 128 * len(accepted)
    assert after[("tulip_queued_tokens", ())] == 0


def test_cancelled_request_is_not_computed(e5_server: TulipProcess, e5_engine: Engine) -> None:
    rng = random.Random(4)
    blockers = [random_rows(rng, 4, 128, 128) for _ in range(2)]  # each over the 256 budget
    doomed = random_rows(rng, 1, 7, 7)
    kept = random_rows(rng, 1, 9, 9)
    before = e5_server.metrics()
    base_tokens = before.get(("tulip_computed_tokens_total", ()), 0.0)
    base_dropped = before.get(("tulip_dropped_requests_total", (("reason", "cancelled"),)), 0.0)

    async def main() -> None:
        async with TulipClient(e5_server.target) as client:
            running = [asyncio.ensure_future(client.embed(rows, timeout=600)) for rows in blockers]
            # Both blockers are with the engine (one running, one prefetched) ...
            await wait_for_metric(e5_server, "tulip_computed_tokens_total", base_tokens + 1024)
            # ... so the next request waits in the queue, where it is cancelled.
            call = client.stub.Embed(embed_request(doomed), timeout=600)
            await wait_for_metric(e5_server, "tulip_queue_depth", 1)
            call.cancel()
            await wait_for_metric(
                e5_server, "tulip_dropped_requests_total", base_dropped + 1, reason="cancelled"
            )
            with pytest.raises(asyncio.CancelledError):
                await call
            survivor = await client.embed(kept, timeout=600)
            for rows, task in zip(blockers, running, strict=True):
                np.testing.assert_allclose(
                    (await task).embeddings, rose_embed(e5_engine, rows), atol=ATOL
                )
            np.testing.assert_allclose(survivor.embeddings, rose_embed(e5_engine, kept), atol=ATOL)

    asyncio.run(main())
    after = e5_server.metrics()
    # Exactly the blockers and the survivor were computed: the cancelled 7 tokens never were.
    assert delta(after, before, "tulip_computed_tokens_total") == 1024 + 9
    assert delta(after, before, "tulip_dropped_requests_total", reason="cancelled") == 1
    assert after[("tulip_queue_depth", ())] == 0


# -- cross-encoder server ---------------------------------------------------------------


def test_score_matches_rose_and_transformers(reranker_dir: Path, tmp_path: Path) -> None:
    from transformers import XLMRobertaForSequenceClassification

    from rose import EngineConfig, RaggedBatch

    rng = random.Random(6)
    pairs, firsts = [], []
    for _ in range(5):
        query = [0, *(rng.randrange(5, 1000) for _ in range(rng.randint(2, 8))), 2]
        doc = [2, *(rng.randrange(5, 1000) for _ in range(rng.randint(3, 30))), 2]
        pairs.append(query + doc)
        firsts.append(len(query))

    with TulipProcess(["--model", str(reranker_dir)], log_path=tmp_path / "rr.log") as server:
        server.wait_serving()

        async def main() -> tuple[pb.InfoResponse, np.ndarray, np.ndarray]:
            async with TulipClient(server.target) as client:
                info = await client.info()
                scored = await asyncio.gather(
                    *(client.score([p], [f]) for p, f in zip(pairs, firsts, strict=True))
                )
                raw = await client.score(pairs, firsts, activation="none")
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await client.embed([[0, 2]])
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                return info, np.concatenate([s.scores for s in scored]), raw.scores

        info, scores, logits = asyncio.run(main())
        assert server.stop() == 0, server.log_tail()
    assert info.kind == pb.MODEL_KIND_CROSS_ENCODER and info.num_labels == 1
    assert info.model_name == "tiny-xlmr-reranker"
    ids = np.array([t for p in pairs for t in p], dtype=np.uint32)
    lengths = np.array([len(p) for p in pairs], dtype=np.uint32)
    engine = Engine.load(reranker_dir, EngineConfig(device="cpu"))
    batch = RaggedBatch.from_packed(ids, lengths, np.array(firsts, dtype=np.uint32))
    expected = engine.step(batch).wait().numpy()
    assert logits.shape == scores.shape == (5, 1)
    np.testing.assert_allclose(logits, expected, atol=ATOL)
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-expected)), atol=ATOL)
    model = XLMRobertaForSequenceClassification.from_pretrained(reranker_dir).eval()
    with torch.inference_mode():
        for i, (pair, first) in enumerate(zip(pairs, firsts, strict=True)):
            types = torch.tensor([[0] * first + [1] * (len(pair) - first)])
            hf = model(input_ids=torch.tensor([pair]), token_type_ids=types).logits
            np.testing.assert_allclose(logits[i], hf[0].numpy(), atol=ATOL)


# -- loading ----------------------------------------------------------------------------


def test_the_model_loads_on_a_thread_whose_openmp_team_ends_with_it() -> None:
    """Loading runs parallel torch ops, which make the loading thread master of an OpenMP
    thread team; that thread and its team must be gone before serving, or the engine
    thread's passes run with libgomp's throttled spin-waits (`_on_a_thread_that_ends`; at 2
    threads a replica's passes took ~1.5x the in-process time that way)."""
    from tulip.server import _on_a_thread_that_ends

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    def settled() -> int:
        """The thread count once it has held for 0.3 s (a team's workers exit once woken
        by its end, not at once)."""
        deadline = time.monotonic() + 5
        count, since = threads(), time.monotonic()
        while time.monotonic() - since < 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)
            if threads() != count:
                count, since = threads(), time.monotonic()
        return count

    during: list[int] = []

    def load() -> threading.Thread:
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            x = torch.randn(512, 512)
            (x @ x).exp_()  # parallel regions: this thread now masters a team
            during.append(threads())
        finally:
            torch.set_num_threads(before)
        return threading.current_thread()

    torch.set_num_threads(torch.get_num_threads())  # threads torch starts once per process
    start = settled()
    loader = _on_a_thread_that_ends(load)
    assert during[-1] >= start + 2, "no loader thread + OpenMP worker: this proves nothing"
    assert loader is not threading.current_thread()
    assert not loader.is_alive()
    assert settled() == start

    def fail() -> None:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        _on_a_thread_that_ends(fail)


# -- graceful drain ---------------------------------------------------------------------


def test_sigterm_under_load_completes_accepted_work_and_exits_zero(
    e5_dir: Path,
    e5_engine: Engine,
    tmp_path: Path,
) -> None:
    rng = random.Random(7)
    clients = 8
    inputs = [random_rows(rng, 2, 32, 64) for _ in range(clients)]
    expected = [rose_embed(e5_engine, rows) for rows in inputs]
    args = ["--model", str(e5_dir), "--max-batch-tokens", "256", "--drain-seconds", "120"]
    server = TulipProcess(args, log_path=tmp_path / "drain.log").start()
    try:
        # Health answers NOT_SERVING while the model loads (torch alone takes seconds to
        # import), and SERVING only once it is loaded and warmed up.
        assert startup_statuses(server)[0] == STATUS.NOT_SERVING
        outcomes: list[tuple[str, float, str]] = []  # (status, when it came back, details)
        health: list[int] = []
        not_serving = asyncio.Event()
        signalled = asyncio.Event()

        async def watch() -> None:
            async with grpc.aio.insecure_channel(server.target) as channel:
                stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
                try:
                    async for update in stream:
                        health.append(update.status)
                        if update.status == STATUS.NOT_SERVING:
                            not_serving.set()
                except grpc.aio.AioRpcError:
                    pass  # the server closed the stream on exit

        async def client(index: int) -> None:
            # Keeps one request in the server until SIGTERM is sent, then stops sending.
            async with TulipClient(server.target) as tulip:
                while not signalled.is_set():
                    try:
                        result = await tulip.embed(inputs[index], timeout=600)
                    except grpc.aio.AioRpcError as error:
                        outcomes.append(
                            (error.code().name, time.monotonic(), error.details() or "")
                        )
                        return
                    np.testing.assert_allclose(result.embeddings, expected[index], atol=ATOL)
                    outcomes.append(("OK", time.monotonic(), ""))

        async def main() -> tuple[float, grpc.aio.AioRpcError]:
            watcher = asyncio.ensure_future(watch())
            running = [asyncio.ensure_future(client(i)) for i in range(clients)]
            while sum(1 for outcome in outcomes if outcome[0] == "OK") < clients:
                await asyncio.sleep(0.01)
            sent = time.monotonic()
            server.terminate()
            signalled.set()
            await asyncio.wait_for(not_serving.wait(), 60)
            # Once health says NOT_SERVING, new work is refused while the old completes.
            async with TulipClient(server.target) as late:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await late.embed(inputs[0], timeout=60)
            await asyncio.gather(*running)
            await asyncio.wait_for(watcher, 60)
            return sent, refused.value

        sent, refused = asyncio.run(main())
        code = server.process.wait(timeout=120) if server.process else None
    finally:
        server.stop()
    assert code == 0, server.log_tail()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused.details()
    assert "shutting down" in (refused.details() or "")
    report = [(status, round(at - sent, 3), details) for status, at, details in outcomes]
    # Requests sent before SIGTERM were either answered correctly or refused (never admitted).
    assert {status for status, _, _ in report} <= {"OK", "UNAVAILABLE"}, report
    # Requests in the server when SIGTERM arrived were still answered, correctly.
    assert any(status == "OK" and after > 0 for status, after, _ in report), report
    assert health[0] == STATUS.SERVING and STATUS.NOT_SERVING in health[1:], health


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port handed out but not bound yet (trellis up picks all replicas' ports first) is
    still free to bind, so only free_port's own memory keeps it from coming up again."""
    first = free_port()
    draw = random.SystemRandom.randrange
    repeats = iter([first, first])

    def randrange(self: random.SystemRandom, *args: int) -> int:
        return next(repeats, None) or draw(self, *args)

    monkeypatch.setattr(random.SystemRandom, "randrange", randrange)
    second = free_port()
    assert second != first
    assert next(repeats, None) is None  # the repeated draws were offered, and passed over


def test_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    # Outgoing connections take their source ports from the ephemeral range, so a port picked
    # there can be gone by the time a child process binds it (trellis up failed so in CI).
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picked = [free_port() for _ in range(32)]
    ports = set(picked)
    assert len(ports) == len(picked)  # never one port twice: each call's port is its own
    for port in ports:
        assert 10_000 <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
