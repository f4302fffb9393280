"""Prometheus metrics of one Ivy worker, in a registry owned by the app (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    request_seconds: Histogram
    tokenize_seconds: Histogram
    inference_seconds: Histogram
    chunks_per_request: Histogram
    input_tokens: Counter
    replica_healthy: Gauge
    replica_outstanding_tokens: Gauge
    replica_chunks: Counter
    replica_tokens: Counter
    retries: Counter
    hedges: Counter
    shed: Counter

    @classmethod
    def create(cls) -> Metrics:
        reg = CollectorRegistry(auto_describe=True)
        return cls(
            registry=reg,
            requests=Counter(
                "ivy_requests",
                "HTTP requests by route and status",
                ["route", "status"],
                registry=reg,
            ),
            request_seconds=Histogram(
                "ivy_request_duration_seconds",
                "Total request latency",
                ["route"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            tokenize_seconds=Histogram(
                "ivy_tokenize_duration_seconds",
                "Time spent validating, templating and tokenizing",
                ["route"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            inference_seconds=Histogram(
                "ivy_inference_duration_seconds",
                "Time waiting for replicas (queue + inference + transfer)",
                ["route"],
                buckets=_LATENCY_BUCKETS,
                registry=reg,
            ),
            chunks_per_request=Histogram(
                "ivy_chunks_per_request",
                "Chunks a request was split into",
                ["route"],
                buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128),
                registry=reg,
            ),
            input_tokens=Counter(
                "ivy_input_tokens", "Tokens sent to replicas", ["model"], registry=reg
            ),
            replica_healthy=Gauge(
                "ivy_replica_healthy",
                "1 when the replica reports SERVING through gRPC health",
                ["model", "replica"],
                registry=reg,
            ),
            replica_outstanding_tokens=Gauge(
                "ivy_replica_outstanding_tokens",
                "Tokens sent to the replica and not yet answered",
                ["model", "replica"],
                registry=reg,
            ),
            replica_chunks=Counter(
                "ivy_replica_chunks",
                "Chunks sent to a replica by outcome (gRPC status code name)",
                ["model", "replica", "outcome"],
                registry=reg,
            ),
            replica_tokens=Counter(
                "ivy_replica_tokens",
                "Tokens answered by a replica",
                ["model", "replica"],
                registry=reg,
            ),
            retries=Counter(
                "ivy_retries",
                "Chunks retried on another replica",
                ["model", "reason"],
                registry=reg,
            ),
            hedges=Counter(
                "ivy_hedges",
                "Chunks also sent to a second replica because the first was slow to answer",
                ["model"],
                registry=reg,
            ),
            shed=Counter(
                "ivy_shed_requests",
                "Requests refused before tokenizing because every replica was at capacity",
                ["model"],
                registry=reg,
            ),
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
