"""`python -m tulip`: serve one model over gRPC (see `tulip.config` for the flags)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from tulip.config import ConfigError, TulipConfig
from tulip.server import serve


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        config = TulipConfig.from_args(sys.argv[1:] if argv is None else argv, os.environ)
    except ConfigError as error:
        print(f"tulip: {error}", file=sys.stderr)
        return 2
    return asyncio.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())
