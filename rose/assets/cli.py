"""`trellis models pull|list|verify`: the command-line face of the asset pipeline."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rose.assets.config import AssetsConfig
from rose.assets.errors import AssetError
from rose.assets.heads import BUNDLED, install_head
from rose.assets.registry import REGISTRY
from rose.assets.store import (
    PrecisionReport,
    ensure_model,
    read_manifest,
    status,
    verify_model,
)

__all__ = ["add_parser"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="pull, list and verify model assets")
    commands = parser.add_subparsers(dest="models_command", required=True)

    pull = commands.add_parser(
        "pull", help="download, convert and verify assets (a bundled MTP head: its target too)"
    )
    pull.add_argument("names", nargs="+", metavar="NAME", choices=[*REGISTRY, *BUNDLED])
    pull.add_argument("--force", action="store_true", help="convert again even if present")
    pull.set_defaults(handler=_pull)

    listing = commands.add_parser("list", help="show the known assets and their state")
    listing.set_defaults(handler=_list)

    verify = commands.add_parser(
        "verify",
        help="re-run the verification of pulled assets; for encoders, also each CPU mode's "
        "accuracy (float32 / bfloat16 / int8 min cosine to float32)",
    )
    verify.add_argument("names", nargs="+", metavar="NAME", choices=list(REGISTRY))
    verify.set_defaults(handler=_verify)


def _log(line: str) -> None:
    print(f"[trellis models] {line}", file=sys.stderr, flush=True)


def _pull(args: argparse.Namespace) -> int:
    def action(config: AssetsConfig, name: str) -> None:
        head = BUNDLED.get(name)
        if head is None:
            print(ensure_model(name, config, _log, force=args.force))
            return
        ensure_model(head.target, config, _log, force=args.force)
        print(install_head(name))

    return _each(args.names, action)


def _verify(args: argparse.Namespace) -> int:
    def action(config: AssetsConfig, name: str) -> None:
        path = verify_model(name, config, _log)
        print(path)
        manifest = read_manifest(path) or {}
        for mode, found in manifest.get("precision", {}).items():
            report = PrecisionReport(mode, found["min_cosine"], found["bound"], found["error"])
            print(f"  {report.line()}")
        if (speedup := manifest.get("cpu", {}).get("bf16_speedup")) is not None:
            verdict = "faster" if speedup > 1 else "not faster"
            print(
                f"  this CPU runs packed bf16 products at {speedup:.2f}x the float32 rate "
                f"(bfloat16 is {verdict} than float32 here)"
            )

    return _each(args.names, action)


def _each(names: list[str], action: Callable[[AssetsConfig, str], None]) -> int:
    try:
        config = AssetsConfig.from_env()
        for name in names:
            action(config, name)
    except AssetError as exc:
        print(f"trellis models: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _list(args: argparse.Namespace) -> int:
    try:
        config = AssetsConfig.from_env()
    except AssetError as exc:
        print(f"trellis models: error: {exc}", file=sys.stderr)
        return 1
    print(f"cache root: {config.models_dir}")
    for name, asset in REGISTRY.items():
        st = status(name, config)
        print(f"{name:24} {st.state:10} {asset.requirement:28} {asset.description}")
    for name, head in BUNDLED.items():
        print(f"{name:24} {'bundled':10} {'(ships with Trellis)':28} {head.description}")
    return 0
