"""`python -m ivy`: run the gateway (flags or IVY_* environment, see ivy.config).

Exit status: 0 after a clean drain on SIGTERM/SIGINT, 1 when the drain ran out of time,
2 for an invalid configuration (the message names the key), 3 when the app cannot start.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ivy.config import ConfigError, parse_config
from ivy.serve import DrainingServer, serve

__all__ = ["DrainingServer", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(argv)
    except ConfigError as exc:
        print(f"ivy: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
