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


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, family / model numbers, the vector features that pick the kernels
    (AVX-512, bf16, VNNI, AMX) and how many logical CPUs this process sees.

    The family and model tell CPU generations apart that share a model name ("AMD EPYC" is
    Zen 4 at family 25 and Zen 5 at family 26, and their fp32 peak differs by 2x per core)."""
    cpu, family, model, flags = platform.processor() or "unknown", "?", "?", set()
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                cpu = value
            elif key == "cpu family":
                family = value
            elif key == "model":
                model = value
            elif key == "flags":
                flags = set(value.split())
                break  # the first processor's block says it all
    except OSError:
        pass
    wanted = ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    features = " ".join(f for f in wanted if f in flags) or "no AVX-512"
    return f"{cpu} (family {family} model {model}; {features}); {os.cpu_count()} logical CPUs"
