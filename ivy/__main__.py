"""`python -m ivy`: run the gateway (flags or IVY_* environment, see ivy.config)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from ivy.config import WORKER_CONFIG_ENV, ConfigError, parse_config

__all__ = ["DrainingServer", "main"]


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT first mark the gateway draining (/health/ready answers 503 and
    new work is refused), then let uvicorn finish in-flight requests and stop."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = getattr(self.config, "loaded_app", None)
        while app is not None:
            gateway = getattr(getattr(app, "state", None), "ivy_gateway", None)
            if gateway is not None:
                gateway.draining = True
                break
            app = getattr(app, "app", None)
        super().handle_exit(sig, frame)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"ivy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    # Workers are separate processes created by uvicorn; they rebuild the app from this.
    os.environ[WORKER_CONFIG_ENV] = config.to_json()
    uv_config = uvicorn.Config(
        "ivy.app:create_app_from_env",
        factory=True,
        host=config.host,
        port=config.port,
        workers=config.workers,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=30,
        http="httptools",
        proxy_headers=False,  # Ivy reads no client address; skip the per-request rewrite
    )
    if config.workers > 1:
        # uvicorn's supervisor builds plain servers in the workers: there the gateway is
        # marked draining when its lifespan shuts down, after in-flight requests finish.
        from uvicorn.supervisors import Multiprocess

        Multiprocess(uv_config, sockets=[uv_config.bind_socket()]).run()
    else:
        DrainingServer(uv_config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
