"""Write the sentence-transformers files that say how a model directory pools.

Tools that build model directories (asset conversion, test fixtures, benchmarks) describe
pooling the way sentence-transformers saves it, so ROSE and the reference library read the
same files: ``modules.json`` (Transformer, Pooling, optionally Normalize) and
``1_Pooling/config.json`` with every mode key spelled out (a missing key takes the library's
default, and ``pooling_mode_mean_tokens`` defaults to true).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["POOLING_MODES", "write_pooling"]

# pooling name -> the key of 1_Pooling/config.json that turns it on
POOLING_MODES = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
    "weightedmean": "pooling_mode_weightedmean_tokens",
    "lasttoken": "pooling_mode_lasttoken",
}

_MODULE = "sentence_transformers.models."


def write_pooling(path: Path, dims: int, pooling: str = "mean", *, normalize: bool = False) -> None:
    """Make ``path`` pool its ``dims``-wide token states by ``pooling`` (a POOLING_MODES name),
    then L2-normalize when ``normalize``."""
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling: one of {', '.join(POOLING_MODES)}, not {pooling!r}")
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": _MODULE + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": _MODULE + "Pooling"},
    ]
    if normalize:
        modules.append(
            {"idx": 2, "name": "2", "path": "2_Normalize", "type": _MODULE + "Normalize"}
        )
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    config = {"word_embedding_dimension": dims}
    config.update({key: name == pooling for name, key in POOLING_MODES.items()})
    config["include_prompt"] = True
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
