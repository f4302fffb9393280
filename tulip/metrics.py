"""Prometheus metrics of one Tulip server, in a registry owned by that server.

Nothing is registered globally: every `Metrics` has its own `CollectorRegistry`, so two
servers (or a server and a test) in one process never share counters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["Metrics", "MetricsEndpoint"]

_TIME_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_ROW_BUCKETS = tuple(float(2**i) for i in range(0, 11))  # 1 .. 1024
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 18))  # 16 .. 131072


class Metrics:
    """The server's instruments; `registry` is what the endpoint exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_depth = Gauge("tulip_queue_depth", "Requests waiting in the queue", registry=r)
        self.queued_tokens = Gauge(
            "tulip_queued_tokens", "Tokens of the requests waiting in the queue", registry=r
        )
        self.batch_rows = Histogram(
            "tulip_batch_rows", "Inputs (rows) per engine batch", buckets=_ROW_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "tulip_batch_tokens", "Tokens per engine batch", buckets=_TOKEN_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "tulip_batch_requests",
            "Requests per engine batch",
            buckets=_ROW_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "tulip_queue_seconds",
            "Time from admission until the request's batch starts on the engine",
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.inference_seconds = Histogram(
            "tulip_inference_seconds",
            "Engine time of the batch holding the request",
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "tulip_requests",
            "Finished requests by RPC method and gRPC status",
            ["method", "status"],
            registry=r,
        )
        self.dropped = Counter(
            "tulip_dropped_requests",
            "Admitted requests removed before reaching the engine, by reason",
            ["reason"],
            registry=r,
        )
        self.isolated = Counter(
            "tulip_isolated_requests",
            "Requests retried in a batch of their own after their shared batch failed",
            registry=r,
        )
        self.computed_rows = Counter("tulip_computed_rows", "Inputs sent to the engine", registry=r)
        self.computed_tokens = Counter(
            "tulip_computed_tokens", "Tokens sent to the engine", registry=r
        )

        # -- generation (decoder models) ------------------------------------------------
        self.generated_tokens = Counter(
            "tulip_generated_tokens", "Tokens generated (streamed to clients)", registry=r
        )
        self.active_sequences = Gauge(
            "tulip_active_sequences",
            "Generate requests the engine holds (running or waiting for pages)",
            registry=r,
        )
        self.kv_pages_free = Gauge("tulip_kv_pages_free", "Free pages of the KV cache", registry=r)
        self.kv_pages = Gauge("tulip_kv_pages", "Pages of the KV cache pool", registry=r)
        self.prefix_queried_tokens = Counter(
            "tulip_prefix_cache_queried_tokens",
            "Prompt tokens of admitted Generate requests, looked up in the prefix cache",
            registry=r,
        )
        self.prefix_hit_tokens = Counter(
            "tulip_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache (their prefill skipped)",
            registry=r,
        )
        self.prefix_evicted_pages = Counter(
            "tulip_prefix_cache_evicted_pages",
            "Cached KV pages evicted (least recently used) to make room",
            registry=r,
        )
        self.prefix_cached_pages = Gauge(
            "tulip_prefix_cache_pages", "KV pages registered in the prefix cache", registry=r
        )
        self.time_to_first_token = Histogram(
            "tulip_time_to_first_token_seconds",
            "Time from admission until a Generate request's first token",
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.generate_step_seconds = Histogram(
            "tulip_generate_step_seconds",
            "Wall time of one generation engine step (all running sequences)",
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.spec_drafted = Counter(
            "tulip_spec_drafted_tokens", "Draft tokens proposed", ["method"], registry=r
        )
        self.spec_accepted = Counter(
            "tulip_spec_accepted_tokens",
            "Draft tokens accepted by the target",
            ["method"],
            registry=r,
        )
        self.spec_steps = Counter(
            "tulip_spec_verify_steps",
            "Verification steps that carried drafts",
            ["method"],
            registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "tulip_spec_acceptance_rate",
            "Fraction of draft tokens accepted since the server started",
            ["method"],
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            "tulip_spec_mean_accepted_length",
            "Draft tokens accepted per verification step since the server started",
            ["method"],
            registry=r,
        )

    def serve(self, host: str, port: int) -> MetricsEndpoint:
        """Expose the registry over HTTP on (host, port) from a daemon thread."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        return MetricsEndpoint(server=server, thread=thread)


@dataclass(frozen=True)
class MetricsEndpoint:
    """A running metrics HTTP server."""

    server: WSGIServer
    thread: threading.Thread

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
