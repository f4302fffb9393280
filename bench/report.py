"""What every bench report shares: one percentile definition (numpy's linear interpolation
between closest ranks, ``np.percentile``'s default, ``q`` in percent) and the machine line."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["machine", "percentile"]


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def machine() -> str:
    """The CPU's model name and how many logical CPUs this process sees."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}; {os.cpu_count()} logical CPUs"
