"""Run benchmarks: `python -m bench` runs all, `python -m bench NAME ...` the named ones.

Each benchmark is a module `bench/NAME.py` (or package `bench/NAME/`) exposing
``main(argv: list[str]) -> int`` that writes its results under bench/results/.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    # Leading words name benchmarks; everything from the first flag on is passed through.
    split = next((i for i, a in enumerate(argv) if a.startswith("-")), len(argv))
    names, flags = argv[:split] or available(), argv[split:]
    status = 0
    for name in names:
        if name not in available():
            print(f"unknown benchmark {name!r}; available: {', '.join(available())}")
            return 2
        print(f"== bench {name}", flush=True)
        status |= importlib.import_module(f"bench.{name}").main(flags)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
