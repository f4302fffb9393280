"""Tulip: the gRPC inference server (one model per process) in front of the ROSE engine.

Run it with ``python -m tulip --model multilingual-e5-small`` (an encoder: Embed/Score) or
``python -m tulip --model smollm2-135m-instruct`` (a decoder: streaming Generate); talk to
it with `tulip.client`. Modules: `config` (flags/env), `inputs` (validation), `scheduler`
(token-budget batching), `backend` (the ROSE engine), `generation` (the ROSE generation
engine on its own thread), `textstream` (incremental detokenization), `service` (the gRPC
service), `metrics` (Prometheus), `server` (process lifecycle), `client` (a small client),
`process` (start/stop a server process and wait for SERVING).
"""

from __future__ import annotations

from tulip.config import ConfigError, TulipConfig

__all__ = ["ConfigError", "TulipConfig"]
