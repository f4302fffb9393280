"""Ivy's configuration: one frozen dataclass read once from flags and `IVY_*` environment.

Every flag ``--some-flag`` can also be given as ``IVY_SOME_FLAG``; a flag on the command
line wins over the environment. Repeatable flags (``--model``, ``--replicas``,
``--replicas-dns``) take semicolon-separated entries in the environment, e.g.
``IVY_MODEL="e5=/models/e5;minilm=/models/minilm"``.

A ``--model [NAME=]MODEL`` names a model directory, a bundled asset or a Hub id
``owner/name[@revision]``; it is resolved (and downloaded) once, here, by
`rose.hub.resolve_model`, so `IvyConfig.models` and the workers hold directories only.
Without ``NAME=`` the model is served under the name it resolves to (a Hub id without its
revision, an asset's name, a directory's basename).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "SHUTDOWN_MARGIN_SECONDS",
    "WORKER_CONFIG_ENV",
    "ConfigError",
    "PERPLEXITY_LIMITS",
    "ContextLimits",
    "IvyConfig",
    "add_arguments",
    "config_from_args",
    "context_limits",
    "parse_config",
]

# Environment variable holding a serialized IvyConfig for uvicorn worker processes.
WORKER_CONFIG_ENV = "IVY_WORKER_CONFIG_JSON"

# Added to the longest request lifetime to give SIGTERM's drain: the last response's bytes
# and the app's shutdown (closing the replica pools) fit in it.
SHUTDOWN_MARGIN_SECONDS = 5.0

_ORIGIN = re.compile(r"^https?://[^/\s]+$")


class ConfigError(ValueError):
    """An invalid configuration value; the message names the offending key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True)
class ContextLimits:
    """Limits of /v1/contextualizedembeddings (IvyConfig's ``max_documents`` ...)."""

    documents: int
    chunks: int  # all documents together
    document_tokens: int  # or the model's own limit, when lower
    request_tokens: int


# Perplexity's API limits: the defaults.
PERPLEXITY_LIMITS = ContextLimits(
    documents=512, chunks=16_000, document_tokens=32_768, request_tokens=120_000
)


@dataclass(frozen=True)
class IvyConfig:
    """Everything an Ivy worker needs; validated in ``__post_init__``."""

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    # served model name -> Hugging Face model directory (tokenizer and prompts are read here)
    models: Mapping[str, str] = field(default_factory=dict)
    # served model name -> static replica addresses "host:port"
    replicas: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # served model name -> "dns-name:port", re-resolved every dns_refresh_seconds
    replicas_dns: Mapping[str, str] = field(default_factory=dict)
    dns_refresh_seconds: float = 10.0
    chunk_tokens: int = 8192
    api_keys_file: str | None = None
    api_keys: tuple[str, ...] = ()
    # refuse to start without any key (api_keys or api_keys_file): deployments set it so a
    # missing Secret cannot leave the API open
    require_api_keys: bool = False
    request_timeout_seconds: float = 60.0
    # whole-request limit of /v1/chat/completions and /v1/completions (streamed or not)
    generation_timeout_seconds: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    max_inputs: int = 2048
    # /v1/contextualizedembeddings: documents, chunks, tokens per document and per request
    # (the defaults are Perplexity's API limits)
    max_documents: int = PERPLEXITY_LIMITS.documents
    max_chunks: int = PERPLEXITY_LIMITS.chunks
    max_document_tokens: int = PERPLEXITY_LIMITS.document_tokens
    max_request_tokens: int = PERPLEXITY_LIMITS.request_tokens
    # characters of one /tokenize input or one rerank query (their work grows with size,
    # and neither is truncated on the way)
    max_input_chars: int = 262_144
    # a chunk unanswered this long (or 4x what such chunks took lately, if longer) is also
    # sent to a second replica; the first answer wins
    hedge_after_seconds: float = 2.0
    # open connections per worker beyond which new requests are answered 503 at once
    max_connections: int = 2048
    # a client must send a request's headers within this, and its body within this of
    # the headers; else the connection is closed
    read_timeout_seconds: float = 30.0
    health_interval_seconds: float = 1.0
    # entries (64 bytes each) of the Rust tokenizer's word cache, one cache per encoding
    # thread; None: the tokenizer's default (65,536: 4 MiB), 0: off
    tokenizer_word_cache: int | None = None
    # log lines as text or as one JSON object per line (both carry the request id)
    log_format: str = "text"
    # inputs over a model's limit are cut (instead of refused with a 400) unless a request
    # says otherwise (`truncate`)
    auto_truncate: bool = False
    # browser origins allowed to call the API (CORS); "*" allows any; empty: CORS off
    cors_allow_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.host:
            raise ConfigError("host", "must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if self.workers < 1:
            raise ConfigError("workers", f"must be >= 1, got {self.workers}")
        if not self.models:
            raise ConfigError("model", "at least one --model [NAME=]MODEL is required")
        for name, directory in self.models.items():
            if not name:
                raise ConfigError("model", "model name must not be empty")
            if not Path(directory, "tokenizer.json").is_file():
                raise ConfigError("model", f"{name}: {directory} has no tokenizer.json")
        served = set(self.models)
        routed = set(self.replicas) | set(self.replicas_dns)
        for name in routed - served:
            raise ConfigError("replicas", f"replicas given for {name!r}, which no --model names")
        for name in served - routed:
            raise ConfigError("replicas", f"model {name!r} has no --replicas or --replicas-dns")
        for name in set(self.replicas) & set(self.replicas_dns):
            raise ConfigError("replicas-dns", f"{name!r} has both a static list and a DNS name")
        for name, addresses in self.replicas.items():
            if not addresses:
                raise ConfigError("replicas", f"{name!r} has an empty replica list")
            for address in addresses:
                _check_address("replicas", address)
        for address in self.replicas_dns.values():
            _check_address("replicas-dns", address)
        if self.dns_refresh_seconds <= 0:
            raise ConfigError("dns-refresh-seconds", "must be > 0")
        if self.chunk_tokens < 1:
            raise ConfigError("chunk-tokens", f"must be >= 1, got {self.chunk_tokens}")
        if self.request_timeout_seconds <= 0:
            raise ConfigError("request-timeout-seconds", "must be > 0")
        if self.generation_timeout_seconds <= 0:
            raise ConfigError("generation-timeout-seconds", "must be > 0")
        if self.max_body_bytes < 1024:
            raise ConfigError("max-body-bytes", f"must be >= 1024, got {self.max_body_bytes}")
        if self.max_inputs < 1:
            raise ConfigError("max-inputs", "must be >= 1")
        for key in ("max_documents", "max_chunks", "max_document_tokens", "max_request_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key.replace("_", "-"), f"must be >= 1, got {getattr(self, key)}")
        if self.max_input_chars < 1:
            raise ConfigError("max-input-chars", f"must be >= 1, got {self.max_input_chars}")
        if self.hedge_after_seconds <= 0:
            raise ConfigError("hedge-after-seconds", "must be > 0")
        if self.max_connections < 1:
            raise ConfigError("max-connections", f"must be >= 1, got {self.max_connections}")
        if self.read_timeout_seconds <= 0:
            raise ConfigError("read-timeout-seconds", "must be > 0")
        if self.health_interval_seconds <= 0:
            raise ConfigError("health-interval-seconds", "must be > 0")
        if self.tokenizer_word_cache is not None and self.tokenizer_word_cache < 0:
            raise ConfigError(
                "tokenizer-word-cache", f"must be >= 0, got {self.tokenizer_word_cache}"
            )
        if self.log_format not in ("text", "json"):
            raise ConfigError("log-format", f"must be text or json, got {self.log_format!r}")
        for origin in self.cors_allow_origins:
            if origin != "*" and not _ORIGIN.match(origin):
                raise ConfigError(
                    "cors-allow-origin", f"{origin!r} is not an origin (scheme://host[:port]) or *"
                )
        if self.api_keys_file is not None and not Path(self.api_keys_file).is_file():
            raise ConfigError("api-keys-file", f"{self.api_keys_file} is not a file")
        if any(not key for key in self.api_keys):
            raise ConfigError("api-keys", "keys must not be empty")
        if self.require_api_keys and not self.all_api_keys():
            raise ConfigError(
                "require-api-keys",
                "no API key is configured (set IVY_API_KEYS or --api-keys-file), "
                "and requests would be served without authentication",
            )

    @property
    def shutdown_seconds(self) -> float:
        """How long SIGTERM waits for in-flight requests before cutting them: the longest
        a request may live (request or generation timeout) plus `SHUTDOWN_MARGIN_SECONDS`."""
        longest = max(self.request_timeout_seconds, self.generation_timeout_seconds)
        return longest + SHUTDOWN_MARGIN_SECONDS

    def all_api_keys(self) -> frozenset[str]:
        """Keys from the environment list and the keys file (one per line, # comments)."""
        keys = set(self.api_keys)
        if self.api_keys_file is not None:
            for line in Path(self.api_keys_file).read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.add(line)
        return frozenset(keys)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> IvyConfig:
        raw = json.loads(text)
        raw["replicas"] = {k: tuple(v) for k, v in raw["replicas"].items()}
        raw["api_keys"] = tuple(raw["api_keys"])
        raw["cors_allow_origins"] = tuple(raw["cors_allow_origins"])
        return cls(**raw)


def _check_address(key: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(key, f"{address!r} is not host:port")


def _pairs(key: str, entries: Sequence[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(key, f"{entry!r} is not NAME=VALUE")
        if name.strip() in out:
            raise ConfigError(key, f"{name.strip()!r} given twice")
        out[name.strip()] = value.strip()
    return out


def _models(entries: Sequence[str]) -> dict[str, str]:
    """``[NAME=]MODEL`` entries -> served name -> model directory (`rose.hub`)."""
    from rose.hub import ModelSpecError, resolve_model

    out: dict[str, str] = {}
    for entry in entries:
        name, sep, spec = entry.partition("=")
        if not sep:
            name, spec = "", entry
        elif not name.strip():
            raise ConfigError("model", f"{entry!r}: model name must not be empty")
        if not spec.strip():
            raise ConfigError("model", f"{entry!r} is not [NAME=]MODEL")
        try:
            model = resolve_model(spec.strip())
        except ModelSpecError as exc:
            raise ConfigError("model", str(exc)) from None
        name = name.strip() or model.name
        if name in out:
            raise ConfigError("model", f"{name!r} given twice")
        out[name] = str(model.path)
    return out


def context_limits(config: IvyConfig) -> ContextLimits:
    return ContextLimits(
        config.max_documents,
        config.max_chunks,
        config.max_document_tokens,
        config.max_request_tokens,
    )


def _boolean(key: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(key, f"must be a boolean (true/false/1/0), got {raw!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register Ivy's flags (defaults None so the environment can fill them)."""
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--workers", type=int, help="uvicorn worker processes")
    parser.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]MODEL",
        help="served model: a directory, an asset name or a Hub id owner/name[@revision]",
    )
    parser.add_argument("--replicas", action="append", metavar="NAME=HOST:PORT,...")
    parser.add_argument("--replicas-dns", action="append", metavar="NAME=DNS:PORT")
    parser.add_argument("--dns-refresh-seconds", type=float)
    parser.add_argument("--chunk-tokens", type=int)
    parser.add_argument("--api-keys-file")
    parser.add_argument(
        "--require-api-keys",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refuse to start when no API key is configured (IVY_API_KEYS, --api-keys-file)",
    )
    parser.add_argument(
        "--auto-truncate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="cut over-long inputs to the model's limit unless a request sets `truncate`",
    )
    parser.add_argument("--request-timeout-seconds", type=float)
    parser.add_argument(
        "--generation-timeout-seconds", type=float, help="limit of one generation request"
    )
    parser.add_argument("--max-body-bytes", type=int)
    parser.add_argument("--max-inputs", type=int)
    context = "/v1/contextualizedembeddings"
    parser.add_argument("--max-documents", type=int, help=f"{context}: documents per request")
    parser.add_argument("--max-chunks", type=int, help=f"{context}: chunks per request")
    parser.add_argument("--max-document-tokens", type=int, help=f"{context}: tokens per document")
    parser.add_argument("--max-request-tokens", type=int, help=f"{context}: tokens per request")
    parser.add_argument(
        "--max-input-chars", type=int, help="characters of a /tokenize input or rerank query"
    )
    parser.add_argument(
        "--hedge-after-seconds",
        type=float,
        help="also send a chunk to a second replica after this long without an answer",
    )
    parser.add_argument(
        "--max-connections", type=int, help="open connections per worker (beyond: 503)"
    )
    parser.add_argument(
        "--read-timeout-seconds",
        type=float,
        help="time a client has to send its request's headers, and then its body",
    )
    parser.add_argument("--health-interval-seconds", type=float)
    parser.add_argument("--log-format", choices=("text", "json"), help="log lines (default text)")
    parser.add_argument(
        "--cors-allow-origin",
        action="append",
        metavar="ORIGIN",
        help="allow browser calls from this origin (repeatable; * for any); default: none",
    )
    parser.add_argument(
        "--tokenizer-word-cache",
        type=int,
        help="word-cache entries per tokenizing thread (64 bytes each; 0: off)",
    )


_SCALARS: dict[str, type] = {
    "host": str,
    "port": int,
    "workers": int,
    "dns_refresh_seconds": float,
    "chunk_tokens": int,
    "api_keys_file": str,
    "request_timeout_seconds": float,
    "generation_timeout_seconds": float,
    "max_body_bytes": int,
    "max_inputs": int,
    "max_documents": int,
    "max_chunks": int,
    "max_document_tokens": int,
    "max_request_tokens": int,
    "max_input_chars": int,
    "hedge_after_seconds": float,
    "max_connections": int,
    "read_timeout_seconds": float,
    "health_interval_seconds": float,
    "tokenizer_word_cache": int,
    "log_format": str,
}
_LISTS = ("model", "replicas", "replicas_dns")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> IvyConfig:
    """Build the config from parsed flags, falling back to ``IVY_*`` variables."""
    values: dict[str, object] = {}
    for key, kind in _SCALARS.items():
        value = getattr(args, key, None)
        if value is None and f"IVY_{key.upper()}" in environ:
            raw = environ[f"IVY_{key.upper()}"]
            try:
                value = kind(raw)
            except ValueError:
                raise ConfigError(key.replace("_", "-"), f"cannot parse {raw!r}") from None
        if value is not None:
            values[key] = value
    lists: dict[str, list[str]] = {}
    for key in _LISTS:
        entries = getattr(args, key, None)
        if not entries and environ.get(f"IVY_{key.upper()}"):
            entries = [e for e in environ[f"IVY_{key.upper()}"].split(";") if e.strip()]
        lists[key] = list(entries or [])
    values["models"] = _models(lists["model"])
    values["replicas"] = {
        name: tuple(a.strip() for a in value.split(",") if a.strip())
        for name, value in _pairs("replicas", lists["replicas"]).items()
    }
    values["replicas_dns"] = _pairs("replicas-dns", lists["replicas_dns"])
    keys = environ.get("IVY_API_KEYS", "")
    values["api_keys"] = tuple(k.strip() for k in keys.split(",") if k.strip())
    origins = getattr(args, "cors_allow_origin", None)
    if not origins and environ.get("IVY_CORS_ALLOW_ORIGIN"):
        origins = environ["IVY_CORS_ALLOW_ORIGIN"].split(",")
    values["cors_allow_origins"] = tuple(o.strip() for o in origins or () if o.strip())
    for key in ("require_api_keys", "auto_truncate"):
        flag = getattr(args, key, None)
        if flag is None and f"IVY_{key.upper()}" in environ:
            flag = _boolean(key.replace("_", "-"), environ[f"IVY_{key.upper()}"])
        if flag is not None:
            values[key] = flag
    return IvyConfig(**values)  # type: ignore[arg-type]


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> IvyConfig:
    parser = argparse.ArgumentParser(prog="ivy", description="Trellis HTTP gateway")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return config_from_args(args, os.environ if environ is None else environ)
