"""Serving benchmark: Ivy + Tulip as `make run` lays them out vs in-process ROSE, in-process
sentence-transformers (the floor without serving) and Infinity (`infinity-emb`, run from
its own virtual environment so it never pins this project's dependencies).

    python -m bench serving [--quick] [--infinity-venv DIR] [--skip-infinity]
    python -m bench serving --latency-only [--threads N]   # only the equal-threads table
    python -m bench serving --replicas N   # another layout than `make run`'s

Tables (CPU, multilingual-e5-small, one run): (1) latency at batch 1 x 128/512 tokens;
(2) rerank of 5/25/50 documents x 512 tokens; (3) embeddings/s with request batch 100 x 512
tokens and 4 concurrent clients; (4) latency with 1..16 concurrent single-input clients;
(5) Ivy's added latency at equal torch threads: one Tulip replica with N threads against
in-process ROSE with N threads, requests interleaved, plus Ivy's own share of each request
(wall time minus the replica-reported queue + inference time from ``Server-Timing``).
Every served answer is checked against the in-process ROSE embedding (cosine >= 0.999),
so a fast but wrong run fails. Results: bench/results/serving.md (+ serving_*.png), or
``--results PATH`` (+ its .json and plots beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.report import machine, percentile

__all__ = ["main"]

RESULTS = Path(__file__).resolve().parents[1] / "results"
MODEL = "multilingual-e5-small"
_WORDS = (
    "search engines rank documents by relevance to a query using embeddings "
    "Die Suchmaschine ordnet Dokumente nach Relevanz la recherche sémantique "
    "поиск документов 検索エンジンは文書を並べ替える motor de búsqueda"
).split()


@dataclass(frozen=True)
class Plan:
    latency_requests: int
    rerank_requests: int
    throughput_requests_per_client: int
    concurrency_requests_per_client: int
    concurrency_levels: tuple[int, ...] = (1, 2, 4, 8, 16)


FULL = Plan(60, 5, 3, 10)
_FAIR_REQUESTS = 200  # table (5): pairs of interleaved requests (~30 s)
QUICK = Plan(15, 2, 1, 4)


@dataclass
class Row:
    system: str
    values: dict[str, float | str] = field(default_factory=dict)


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1e3
    return {
        "p50 ms": percentile(ms, 50),
        "p90 ms": percentile(ms, 90),
        "p99 ms": percentile(ms, 99),
        "max ms": float(ms.max()),
        "n": float(len(samples)),
    }


def text_of(tokenizer: object, n_tokens: int, seed: int) -> str:
    """A text that tokenizes to at most (and about) ``n_tokens`` tokens, specials included."""
    rng = np.random.default_rng(seed)
    words = list(rng.choice(_WORDS, size=n_tokens * 2))
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False).ids  # type: ignore[attr-defined]
    keep = n_tokens - 2
    while True:
        text = tokenizer.decode(ids[:keep])  # type: ignore[attr-defined]
        if len(tokenizer.encode(text).ids) <= n_tokens:  # type: ignore[attr-defined]
            return text
        keep -= 2


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class Http:
    """A small synchronous client per thread (httpx, keep-alive)."""

    def __init__(self, base: str, embed_path: str, model: str) -> None:
        import httpx

        self.base = base
        self.embed_path = embed_path
        self.model = model
        self._local = threading.local()
        self._httpx = httpx

    def client(self) -> object:
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._httpx.Client(base_url=self.base, timeout=600)
            self._local.client = c
        return c

    def post(self, path: str, body: dict) -> object:
        """POST, retrying a 429 after its Retry-After as the OpenAI and Cohere clients do
        (the wait counts in the request's latency)."""
        for _ in range(100):
            r = self.client().post(path, json=body)  # type: ignore[attr-defined]
            if r.status_code != 429:
                break
            time.sleep(float(r.headers.get("retry-after", "1")))
        r.raise_for_status()
        return r

    def embed(self, texts: list[str]) -> np.ndarray:
        r = self.post(
            self.embed_path, {"model": self.model, "input": texts, "encoding_format": "float"}
        )
        return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)  # type: ignore[attr-defined]

    def rerank(self, query: str, docs: list[str]) -> list[float]:
        r = self.post("/v1/rerank", {"model": self.model, "query": query, "documents": docs})
        results = r.json()["results"]  # type: ignore[attr-defined]
        return [x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])]


IVY = "ivy (trellis up)"


def layout(replicas: int | None, threads: int = 0) -> tuple[int, int]:
    """(replicas, threads each) of the benchmarked cluster: `make run`'s unless given."""
    from ivy.cluster import ClusterConfig

    config = ClusterConfig(threads_per_replica=threads)
    if replicas is not None:
        config = ClusterConfig(replicas=replicas, threads_per_replica=threads)
    return config.replicas, config.threads()


@contextlib.contextmanager
def ivy_cluster(model: str, replicas: int | None = None, threads: int = 0) -> Iterator[Http]:
    from ivy.cluster import Cluster, ClusterConfig
    from tulip.process import free_port

    # CPU batches of 100 x 512 tokens from 4 clients take minutes here: lift the deadline.
    config = ClusterConfig(
        model=model,
        replicas=layout(replicas)[0],
        threads_per_replica=threads,
        port=free_port(),
        drain_seconds=2,
        extra_ivy_args=("--request-timeout-seconds", "1800"),
    )
    cluster = Cluster(config)
    cluster.start()
    try:
        cluster.wait_ready()
        yield Http(cluster.base_url, "/v1/embeddings", cluster.name)
    finally:
        cluster.stop()


def _server_timing(header: str, name: str) -> float:
    """Seconds of metric ``name`` in a ``Server-Timing`` header (0 when absent)."""
    for part in header.split(","):
        key, _, rest = part.strip().partition(";dur=")
        if key == name:
            return float(rest) / 1e3
    return 0.0


def fair_latency(
    model_dir: Path,
    rose_embed: Callable[[list[str]], np.ndarray],
    text: str,
    threads: int,
    n: int,
) -> list[Row]:
    """Ivy + 1 replica x ``threads`` vs in-process ROSE x ``threads``, interleaved requests."""
    import torch

    from ivy.cluster import Cluster, ClusterConfig
    from tulip.process import free_port

    torch.set_num_threads(threads)
    config = ClusterConfig(
        model=str(model_dir),
        replicas=1,
        threads_per_replica=threads,
        port=free_port(),
        drain_seconds=1,
    )
    cluster = Cluster(config)
    cluster.start()
    rose_s: list[float] = []
    ivy_s: list[float] = []
    replica_s: list[float] = []
    try:
        cluster.wait_ready()
        body = json.dumps({"model": cluster.name, "input": [text], "encoding_format": "float"})
        headers = {"content-type": "application/json"}
        want = rose_embed([text])[0]
        # The stdlib client on one keep-alive connection: the lightest client there is, so
        # the difference measures Ivy, not the client library.
        conn = http.client.HTTPConnection(config.host, config.port, timeout=600)
        try:
            for i in range(n + 5):  # the first 5 of each are warm-up
                t0 = time.perf_counter()
                conn.request("POST", "/v1/embeddings", body, headers)
                r = conn.getresponse()
                payload = r.read()
                t1 = time.perf_counter()
                if r.status != 200:
                    raise RuntimeError(f"ivy: HTTP {r.status}: {payload[:200]!r}")
                rose_embed([text])
                t2 = time.perf_counter()
                got = np.array(json.loads(payload)["data"][0]["embedding"], dtype=np.float32)
                if cos(got, want) < 0.999:
                    raise RuntimeError(f"ivy: wrong embedding (cosine {cos(got, want):.5f})")
                if i >= 5:
                    ivy_s.append(t1 - t0)
                    rose_s.append(t2 - t1)
                    replica_s.append(_server_timing(r.getheader("server-timing", ""), "replica"))
        finally:
            conn.close()
    finally:
        cluster.stop()
    own = [a - b for a, b in zip(ivy_s, replica_s, strict=True)]
    # Each Ivy request is followed at once by its in-process twin: their difference cancels
    # the slow drifts of a shared machine that the difference of two p50s keeps.
    paired = [a - b for a, b in zip(ivy_s, rose_s, strict=True)]
    tag = f"{threads} thread{'s' if threads > 1 else ''}"
    return [
        Row(f"rose in-process ({tag})", {"tokens": 128, **percentiles(rose_s)}),
        Row(f"ivy, 1 tulip replica ({tag})", {"tokens": 128, **percentiles(ivy_s)}),
        Row(
            "of which tulip-reported queue + inference",
            {"tokens": 128, **percentiles(replica_s)},
        ),
        Row("ivy wall - tulip-reported (per request)", {"tokens": 128, **percentiles(own)}),
        Row("ivy wall - in-process (paired, per request)", {"tokens": 128, **percentiles(paired)}),
    ]


@contextlib.contextmanager
def infinity_server(venv: Path, model_dir: Path) -> Iterator[Http]:
    from tulip.process import free_port

    port = free_port()
    exe = venv / "bin" / "infinity_emb"
    proc = subprocess.Popen(
        [str(exe), "v2", "--model-id", str(model_dir), "--port", str(port), "--engine", "torch"]
        + ["--device", "cpu", "--served-model-name", MODEL, "--no-model-warmup"]
        # BetterTransformer needs optimum < 2 (removed there); transformers runs SDPA itself.
        + ["--no-bettertransformer"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=dict(os.environ, INFINITY_ANONYMOUS_USAGE_STATS="0", HF_HUB_OFFLINE="1"),
    )
    try:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"infinity exited with {proc.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        else:
            raise TimeoutError("infinity did not start")
        yield Http(f"http://127.0.0.1:{port}", "/embeddings", MODEL)
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def concurrent(
    fn: Callable[[int], object], clients: int, per_client: int
) -> tuple[list[float], float]:
    """Per-request latencies and wall time of ``clients`` threads each sending ``per_client``."""
    samples: list[float] = []
    lock = threading.Lock()

    def loop(c: int) -> None:
        for i in range(per_client):
            t0 = time.perf_counter()
            fn(c * 1000 + i)
            dt = time.perf_counter() - t0
            with lock:
                samples.append(dt)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(loop, range(clients)))
    return samples, time.perf_counter() - t0


@dataclass(frozen=True)
class Texts:
    t128: list[str]
    t512: list[str]
    query: str


def measure(
    system: str,
    embed: Callable[[list[str]], np.ndarray],
    rerank: Callable[[str, list[str]], list[float]] | None,
    is_server: bool,
    texts: Texts,
    reference: dict[str, np.ndarray],
    plan: Plan,
    tables: dict[str, list[Row]],
) -> bool:
    """Fill the four tables for one system; False when its answers are wrong."""
    for t, want in reference.items():
        got = embed([t])[0]
        if cos(got, want) < 0.999:
            print(f"{system}: wrong embedding (cosine {cos(got, want):.5f})")
            return False
    embed(texts.t128[:2])  # warm-up
    for n_tokens, pool in ((128, texts.t128), (512, texts.t512)):
        first = pool[0]
        samples = timed(lambda first=first: embed([first]), plan.latency_requests)
        tables["latency"].append(Row(system, {"tokens": n_tokens, **percentiles(samples)}))
    for n_docs in (5, 25, 50):
        docs = texts.t512[:n_docs]
        prompted = ["query: " + texts.query] + ["passage: " + d for d in docs]

        def one(docs: list[str] = docs, prompted: list[str] = prompted) -> object:
            return rerank(texts.query, docs) if rerank is not None else embed(prompted)

        samples = timed(one, plan.rerank_requests)
        tables["rerank"].append(Row(system, {"docs": n_docs, **percentiles(samples)}))
    batch = texts.t512[:100]
    # In-process engines are not shared across threads: they run the same requests one
    # after another (their natural floor); servers get 4 concurrent clients.
    clients = 4 if is_server else 1
    per_client = plan.throughput_requests_per_client * 4 // clients
    samples, wall = concurrent(lambda i: embed(batch), clients, per_client)
    n = clients * per_client * 100
    tables["throughput"].append(Row(system, {"embeddings/s": n / wall, **percentiles(samples)}))
    if is_server:
        for c in plan.concurrency_levels:
            samples, wall = concurrent(
                lambda i: embed([texts.t128[i % len(texts.t128)]]),
                c,
                plan.concurrency_requests_per_client,
            )
            tables["concurrency"].append(
                Row(system, {"clients": c, "req/s": len(samples) / wall, **percentiles(samples)})
            )
    return True


def run(args: argparse.Namespace) -> int:
    import torch
    from tokenizers import Tokenizer

    from rose import Engine, EngineConfig, RaggedBatch
    from rose.assets import ensure_model
    from tokenizer import Tokenizer as RustTokenizer

    plan = QUICK if args.quick else FULL
    model_dir = Path(ensure_model(MODEL))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    t128 = [text_of(tok, 128, s) for s in range(64)]
    t512 = [text_of(tok, 512, 100 + s) for s in range(128)]
    query = "how do search engines rank documents"

    engine = Engine.load(model_dir, EngineConfig(device="cpu"))

    native = RustTokenizer.from_file(str(model_dir / "tokenizer.json"))

    def rose_embed(texts: list[str]) -> np.ndarray:
        # The project's own tokenizer, cutting to the model's 512 tokens as Ivy does.
        ids, lengths = native.encode_batch_packed(texts, True, 512)
        ids = np.asarray(ids, dtype=np.uint32)
        lengths = np.asarray(lengths, dtype=np.uint32)
        ends = np.cumsum(lengths, dtype=np.int64)
        starts = ends - lengths
        # Batches of at most 16 rows (<= 8192 tokens), like Tulip's token-budget batching.
        out = []
        for i in range(0, len(lengths), 16):
            j = min(i + 16, len(lengths))
            batch = RaggedBatch.from_packed(ids[starts[i] : ends[j - 1]], lengths[i:j])
            out.append(np.asarray(engine.step(batch).wait(), np.float32))
        return np.concatenate(out)

    reference = {
        t: v for t, v in zip(t128[:4] + t512[:4], rose_embed(t128[:4] + t512[:4]), strict=True)
    }

    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(str(model_dir), device="cpu")

    def st_embed(texts: list[str]) -> np.ndarray:
        return np.asarray(st_model.encode(texts, batch_size=len(texts), normalize_embeddings=True))

    systems: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {}
    systems["rose in-process"] = lambda: contextlib.nullcontext(rose_embed)
    systems["sentence-transformers in-process"] = lambda: contextlib.nullcontext(st_embed)
    systems[IVY] = lambda: ivy_cluster(str(model_dir), args.replicas, args.replica_threads)
    venv = Path(args.infinity_venv).expanduser()
    infinity_note = ""
    if args.skip_infinity:
        infinity_note = "Infinity skipped (--skip-infinity)."
    elif not (venv / "bin" / "infinity_emb").exists():
        infinity_note = f"Infinity not run: no virtual environment at {venv}."
    else:
        systems["infinity"] = lambda: infinity_server(venv, model_dir)

    tables: dict[str, list[Row]] = {
        k: [] for k in ("latency", "rerank", "throughput", "concurrency", "fair_latency")
    }
    write = functools.partial(
        write_results,
        tables,
        infinity_note,
        plan,
        torch.__version__,
        args.replicas,
        ivy_threads=args.replica_threads,
        report=args.results,
    )
    previous = args.results.with_suffix(".json")
    if args.latency_only:
        # Only table (5); every other table is kept from the previous run.
        if previous.exists():
            for key, rows in json.loads(previous.read_text()).items():
                tables[key] = [Row(r["system"], r["values"]) for r in rows]
        tables["fair_latency"] = fair_latency(
            model_dir, rose_embed, t128[0], args.threads, _FAIR_REQUESTS
        )
        # Keep the previous run's header (its machine notes describe tables 1-4).
        md_path = args.results
        header = None
        if md_path.exists():
            old = md_path.read_text(encoding="utf-8").splitlines()
            cut = next((i for i, line in enumerate(old) if line.startswith("## ")), len(old))
            header = [line for line in old[:cut] if not line.startswith("Table (5):")]
            while header and not header[-1]:
                header.pop()
            load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
            header += [
                "",
                f"Table (5): re-run alone (`--latency-only`, {_FAIR_REQUESTS} requests "
                f"per side) at {stamp} UTC, load average at end {load}; the other tables "
                "are from the run described above.",
                "",
            ]
        write(header=header)
        return 0
    if args.only:
        # Re-run some systems, keeping the other systems' rows of the previous run.
        unknown = set(args.only) - set(systems)
        if unknown:
            print(f"unknown systems {sorted(unknown)}; known: {sorted(systems)}")
            return 2
        if previous.exists():
            for key, rows in json.loads(previous.read_text()).items():
                tables[key] = [
                    Row(r["system"], r["values"]) for r in rows if r["system"] not in args.only
                ]
        systems = {k: v for k, v in systems.items() if k in args.only}
    texts = Texts(t128, t512, query)
    for system, factory in systems.items():
        print(f"-- {system}", flush=True)
        with factory() as handle:
            if isinstance(handle, Http):
                # Infinity reranks only with cross-encoder models: embed + cosine there too.
                rerank = handle.rerank if system != "infinity" else None
                ok = measure(system, handle.embed, rerank, True, texts, reference, plan, tables)
            else:
                ok = measure(system, handle, None, False, texts, reference, plan, tables)  # type: ignore[arg-type]
            if not ok:
                return 1
        # Rewritten after each system so a long run leaves its finished tables behind.
        write(quiet=True)
    if not args.only:
        print(f"-- equal threads ({args.threads})", flush=True)
        tables["fair_latency"] = fair_latency(
            model_dir, rose_embed, t128[0], args.threads, _FAIR_REQUESTS
        )
    write()
    return 0


def _fmt(v: float | str) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def write_results(
    tables: dict[str, list[Row]],
    note: str,
    plan: Plan,
    torch_version: str,
    ivy_replicas: int | None,
    quiet: bool = False,
    header: list[str] | None = None,
    ivy_threads: int = 0,
    report: Path = RESULTS / "serving.md",
) -> None:
    """Write ``report`` and, beside it, the tables as JSON (``.json``) and the plots
    (``<stem>_concurrency.png``, ``<stem>_throughput.png``)."""
    import importlib.metadata as md

    replicas, threads = layout(ivy_replicas, ivy_threads)
    report.parent.mkdir(parents=True, exist_ok=True)
    versions = []
    for pkg in ("torch", "sentence-transformers", "transformers", "uvicorn", "grpcio"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions.append(f"{pkg} {md.version(pkg)}")
    lines = [
        "# Serving benchmark (bench/serving)",
        "",
        f"Model {MODEL}, CPU. Machine: {machine()}, "
        f"Python {platform.python_version()}, load average at end "
        f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}. {'; '.join(versions)}.",
        f"Plan: {plan}. {note}",
        "",
        f"Ivy runs as `make run` starts it (`trellis up`): {replicas} Tulip replica(s) x "
        f"{threads} torch thread(s); the in-process rows use every core in one process. The",
        "machine is shared with other jobs: compare rows of one run only.",
        "",
    ]
    if header is not None:
        lines = header
    titles = {
        "latency": "(1) Latency, batch 1",
        "rerank": "(2) Rerank, documents x 512 tokens (in-process rows: embed query + documents)",
        "throughput": "(3) Throughput, request batch 100 x 512 tokens, 4 concurrent clients",
        "concurrency": "(4) Latency with concurrent single-input clients (128 tokens)",
        "fair_latency": "(5) Ivy added latency at equal torch threads, batch 1 x 128 tokens "
        "(requests interleaved with the in-process ones)",
    }
    for key, rows in tables.items():
        if not rows:
            continue
        cols = list(rows[0].values)
        lines += [f"## {titles[key]}", "", "| system | " + " | ".join(cols) + " |"]
        lines.append("|" + "---|" * (len(cols) + 1))
        for row in rows:
            lines.append(
                f"| {row.system} | " + " | ".join(_fmt(row.values[c]) for c in cols) + " |"
            )
        lines.append("")
    lines += ratios(tables)
    report.write_text("\n".join(lines) + "\n", encoding="utf-8")
    raw = {
        k: [{"system": r.system, "values": r.values} for r in rows] for k, rows in tables.items()
    }
    report.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    plot(tables, report)
    if not quiet:
        print("\n".join(lines))


def ratios(tables: dict[str, list[Row]]) -> list[str]:
    out = ["## Bars", ""]
    fair = {r.system: float(r.values["p50 ms"]) for r in tables.get("fair_latency", [])}
    rose_fair = [v for k, v in fair.items() if k.startswith("rose in-process")]
    ivy_fair = [v for k, v in fair.items() if k.startswith("ivy, 1 tulip")]
    own = [v for k, v in fair.items() if "ivy wall - tulip" in k]
    paired = [v for k, v in fair.items() if "(paired" in k]
    if paired:
        out.append(
            "- Ivy added latency at batch 1 x 128 tokens, equal threads (p50 of the paired "
            f"per-request difference): {paired[0]:.2f} ms (bar: <= 2 ms)"
        )
    if rose_fair and ivy_fair:
        out.append(
            "- The same as a difference of p50s (p50 Ivy - p50 in-process; noisier): "
            f"{ivy_fair[0] - rose_fair[0]:.2f} ms"
        )
    if own:
        out.append(
            f"- Ivy's own share per request (p50 of wall - Tulip-reported time): {own[0]:.2f} ms"
        )
    st = "sentence-transformers in-process"
    lat = {(r.system, r.values["tokens"]): float(r.values["p50 ms"]) for r in tables["latency"]}
    ivy = lat.get((IVY, 128))
    if ivy is not None:
        for peer, bar in (("infinity", 1.0), (st, 1.15), ("rose in-process", None)):
            if (peer, 128) in lat:
                ratio = ivy / lat[(peer, 128)]
                judged = f" (bar: <= {bar:.2f}x)" if bar else ""
                out.append(
                    f"- Batch-1 p50 at 128 tokens, Ivy / {peer}: {ratio:.2f}x "
                    f"({ivy:.1f} vs {lat[(peer, 128)]:.1f} ms){judged}"
                )
    rr = {(r.system, r.values["docs"]): float(r.values["p50 ms"]) for r in tables["rerank"]}
    if (IVY, 5) in rr:
        for peer, bar in ((st, 1.15), ("infinity", None)):
            if (peer, 5) in rr:
                judged = f" (bar: <= {bar:.2f}x)" if bar else ""
                out.append(
                    f"- Rerank 5 x 512 tokens p50, Ivy / {peer}: "
                    f"{rr[(IVY, 5)] / rr[(peer, 5)]:.2f}x{judged}"
                )
    thr = {r.system: float(r.values["embeddings/s"]) for r in tables["throughput"]}
    if IVY in thr:
        i = thr[IVY]
        if st in thr:
            out.append(f"- Ivy / sentence-transformers throughput: {i / thr[st]:.2f}x")
        if "infinity" in thr:
            out.append(f"- Ivy / Infinity throughput: {i / thr['infinity']:.2f}x (bar: >= 1.1x)")
    conc = {
        (r.system, r.values["clients"]): float(r.values["req/s"]) for r in tables["concurrency"]
    }
    if (IVY, 16) in conc and ("infinity", 16) in conc:
        out.append(
            "- 16 concurrent single-input clients, Ivy / Infinity req/s: "
            f"{conc[(IVY, 16)] / conc[('infinity', 16)]:.2f}x (bar: >= 1.3x)"
        )
    return out + [""]


def plot(tables: dict[str, list[Row]], report: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = tables["concurrency"]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 4))
        for system in dict.fromkeys(r.system for r in rows):
            pts = [r for r in rows if r.system == system]
            ax.plot(
                [r.values["clients"] for r in pts],
                [r.values["p50 ms"] for r in pts],
                "o-",
                label=system,
            )
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("p50 latency (ms)")
        ax.set_xscale("log", base=2)
        ax.legend()
        fig.tight_layout()
        fig.savefig(report.with_name(f"{report.stem}_concurrency.png"), dpi=100)
    rows = tables["throughput"]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh([r.system for r in rows], [float(r.values["embeddings/s"]) for r in rows])
        ax.set_xlabel("embeddings/s (batch 100 x 512 tokens, 4 clients)")
        fig.tight_layout()
        fig.savefig(report.with_name(f"{report.stem}_throughput.png"), dpi=100)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench serving")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--results",
        type=Path,
        default=RESULTS / "serving.md",
        help="the report to write (JSON and plots beside it), e.g. one per machine",
    )
    parser.add_argument("--infinity-venv", default="~/.cache/trellis/bench-venvs/infinity")
    parser.add_argument("--skip-infinity", action="store_true")
    parser.add_argument(
        "--latency-only",
        action="store_true",
        help="re-run only table (5), keeping the other tables of the previous run",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on both sides of table (5)"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="Tulip replicas of the Ivy rows (default: `make run`'s; threads: cores / replicas)",
    )
    parser.add_argument(
        "--replica-threads", type=int, default=0, help="torch threads per replica (0: default)"
    )
    parser.add_argument(
        "--only", action="append", metavar="SYSTEM", help="re-run only this system (repeatable)"
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
