"""OpenTelemetry traces for both sides of the contract, and the W3C ``traceparent`` that
joins them.

Ivy opens a server span per HTTP request (continuing the client's ``traceparent``) with
``tokenize`` and ``inference`` children; the inference span's context travels to Tulip in
`CallRequest.traceparent` (one `Calls` stream carries many requests, so per-call gRPC
metadata cannot) or in the ``traceparent`` metadata of a `Generate` call; Tulip records the
request's ``queue`` and ``inference`` spans under it.

Configuration is OpenTelemetry's standard environment: tracing is on when
``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``) or an OTLP endpoint is set
(``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``), and off when
``OTEL_SDK_DISABLED=true`` or the exporter is ``none``; the OTLP exporter reads its own
``OTEL_EXPORTER_OTLP_*`` settings, the batch processor its ``OTEL_BSP_*``, the resource
``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``.

Invariant: when tracing is off nothing here allocates a span or touches the context
(`span` is a shared null context, `traceparent` is ""), so the hot path pays one branch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "attached",
    "configure",
    "configure_from_env",
    "enabled",
    "error_status",
    "extract",
    "record",
    "server_span",
    "shutdown",
    "span",
    "traceparent",
]

_PROPAGATOR = TraceContextTextMapPropagator()
_NULL = contextlib.nullcontext()
_tracer: trace.Tracer | None = None
_provider: Any = None


def enabled() -> bool:
    return _tracer is not None


def configure(service: str, exporter: Any, *, batch: bool = True) -> Any:
    """Trace to `exporter` (an SDK `SpanExporter`); returns the SDK tracer provider
    (`force_flush` / `shutdown` it). Tests pass an in-memory exporter with ``batch=False``."""
    global _tracer, _provider
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer(f"trellis.{service}")
    return provider


def configure_from_env(service: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Turn tracing on when the standard ``OTEL_*`` variables ask for it; True when on."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not names:
        names = "otlp" if endpoint else "none"
    exporters = [n.strip() for n in names.split(",") if n.strip() not in ("", "none")]
    if not exporters:
        return False
    provider = None
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter: Any = OTLPSpanExporter()
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter()
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r}")
        if provider is None:
            provider = configure(service, exporter)
        else:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider.add_span_processor(BatchSpanProcessor(exporter))
    return True


def shutdown() -> None:
    """Flush and stop (at process exit); tracing is off afterwards."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def span(name: str, **attributes: Any) -> Any:
    """A context manager: a child span of the current one (a null context when off)."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=attributes or None)


def server_span(name: str, parent: str, **attributes: Any) -> Any:
    """A server span continuing the W3C `parent` (``traceparent`` value; "": a new trace)."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(
        name, context=extract(parent), kind=trace.SpanKind.SERVER, attributes=attributes or None
    )


def error_status() -> trace.Status:
    return trace.Status(trace.StatusCode.ERROR)


def traceparent() -> str:
    """The current span's W3C ``traceparent`` ("" when off or outside a span)."""
    if _tracer is None:
        return ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent", "")


def extract(value: str) -> otel_context.Context | None:
    """The context a ``traceparent`` value names (None: none given)."""
    if not value:
        return None
    return _PROPAGATOR.extract({"traceparent": value})


def record(name: str, parent: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished span under `parent`, from times measured elsewhere (Tulip's scheduler
    reports a request's queue and inference durations once it is answered)."""
    if _tracer is None:
        return
    s = _tracer.start_span(
        name, context=extract(parent), start_time=start_ns, attributes=attributes or None
    )
    s.end(end_time=end_ns)


@contextlib.contextmanager
def attached(value: str) -> Iterator[None]:
    """Make the W3C `value` the current context for the block (no-op when off/empty)."""
    ctx = extract(value) if _tracer is not None else None
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
