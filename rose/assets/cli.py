"""`trellis models ...` (placeholder until the asset pipeline lands)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="pull and list model assets")
    parser.set_defaults(handler=lambda args: print("models: not implemented yet") or 1)
