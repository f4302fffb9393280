"""The `trellis` command: one entry point whose subcommands live with their packages.

Each subcommand module exposes ``add_parser(subparsers)``, which registers its parser
and sets ``handler`` (a callable taking the parsed namespace and returning an exit code).
A subcommand that sets ``forwards_unknown`` gets the options it does not know itself as
``args.forwarded`` (`trellis up` hands them to its Tulip replicas) and checks them itself.
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
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "forwards_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.forwarded = tuple(unknown)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
