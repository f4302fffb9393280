"""The `trellis` command: one entry point whose subcommands live with their packages.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser
and sets ``handler`` (a callable taking the parsed namespace and returning an exit code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trellis", description="Trellis search inference stack")
    subparsers = parser.add_subparsers(dest="command", required=True)
    from rose.assets import cli as models_cli

    models_cli.add_parser(subparsers)
    try:
        from ivy import cluster
    except ImportError:  # the local cluster lands with the Ivy gateway
        pass
    else:
        cluster.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
