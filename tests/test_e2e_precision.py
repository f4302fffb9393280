"""Reduced CPU modes end to end: two real Tulip processes serving multilingual-e5-small, one
with ``--quantize int8`` and one with ``--dtype bfloat16``, behind one real Ivy process;
``/v1/embeddings`` answers against sentence-transformers fp32 on the same directory.

Bounds: per-row cosine >= 0.99 (int8) and >= 0.999 (bf16), what each mode's accuracy gate
demands at load. Tulip's `Info` reports the mode as the served dtype.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from ivy_process import ivy_over

from tulip.process import TulipProcess

MODES = {"e5-int8": ("--quantize", "int8", 0.99), "e5-bf16": ("--dtype", "bfloat16", 0.999)}
TEXTS = [
    "query: what do bees eat",
    "passage: Bees feed on nectar for energy and on pollen for protein.",
    "query: ¿cuándo abre el museo?",
    "passage: El museo abre de martes a domingo, de diez de la mañana a seis de la tarde.",
    "passage: Die Fähre fährt im Sommer stündlich zwischen den beiden Inseln.",
    "passage: Этот сорт яблок хорошо хранится до весны в прохладном подвале.",
    "passage: 彼は毎朝六時に起きて、公園を一時間走っている。",
    "passage: 这种茶叶产自云南的高山地区，味道浓郁。",
    "passage: "
    + "Long documents cross many batches of the scheduler and exercise the longer rows. " * 20,
]


@pytest.fixture(scope="module")
def base(e5_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("precision-e2e")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tulips = {
        name: TulipProcess(
            ["--model", str(e5_dir), "--model-name", name, "--device", "cpu", "--threads", "1"]
            + [flag, value],
            log_path=logs / f"{name}.log",
            env=env,
        )
        for name, (flag, value, _) in MODES.items()
    }
    with contextlib.ExitStack() as stack:
        for tulip in tulips.values():
            stack.enter_context(tulip)  # started; stopped on the way out
        for tulip in tulips.values():
            tulip.wait_serving()
        served = {name: (e5_dir, tulip.target) for name, tulip in tulips.items()}
        yield stack.enter_context(ivy_over(served, logs / "ivy.log", env))


@pytest.fixture(scope="module")
def expected(e5_dir: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(e5_dir), device="cpu")
    return st.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)


@pytest.mark.parametrize("name", list(MODES))
def test_embeddings_match_sentence_transformers_fp32(
    base: str, expected: np.ndarray, name: str
) -> None:
    r = httpx.post(f"{base}/v1/embeddings", json={"model": name, "input": TEXTS}, timeout=120)
    assert r.status_code == 200, r.text
    got = np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float64)
    assert got.shape == expected.shape
    cos = (got * expected).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
    assert cos.min() >= MODES[name][2], cos
    # one text at a time (its own batch) meets the same bound
    single = httpx.post(
        f"{base}/v1/embeddings", json={"model": name, "input": TEXTS[1]}, timeout=60
    )
    one = np.array(single.json()["data"][0]["embedding"])
    assert one @ expected[1] / np.linalg.norm(one) >= MODES[name][2]


def test_int8_is_refused_for_a_generator() -> None:
    # --quantize covers encoders and cross-encoders: a decoder served for generation must not
    # start as if it were quantized.
    import subprocess
    import sys

    from rose.assets import ensure_model
    from tulip.process import free_port

    done = subprocess.run(
        [sys.executable, "-m", "tulip", "--model", str(ensure_model("smollm2-135m-instruct"))]
        + ["--device", "cpu", "--quantize", "int8", "--port", str(free_port())]
        + ["--metrics-port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0
    assert "--quantize int8" in done.stderr and "generation" in done.stderr, done.stderr[-2000:]
