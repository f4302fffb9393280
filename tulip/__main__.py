"""`python -m tulip`: serve one model over gRPC (see `tulip.config` for the flags)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from protos import tracing
from rose.hub import ModelSpecError
from tulip.config import ConfigError, TulipConfig
from tulip.server import serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = TulipConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as error:
        print(f"tulip: {error}", file=sys.stderr)
        return 2
    tracing.configure_from_env("tulip", os.environ)  # OTEL_* variables; off by default
    try:
        return asyncio.run(serve(config))
    except ModelSpecError as error:  # a model that cannot be found: one line, no traceback
        print(f"tulip: --model {error}", file=sys.stderr)
        return 2
    finally:
        tracing.shutdown()  # flush the last spans


if __name__ == "__main__":
    sys.exit(main())
