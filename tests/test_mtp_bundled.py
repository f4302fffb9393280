"""The MTP head that ships with Trellis (`rose.assets.heads`): `--spec mtp` works out of the
box for smollm2-135m-instruct, through `trellis up` (real Tulip replicas and Ivy), with
greedy output equal to `transformers` greedy and drafts the target mostly keeps; the head's
bytes are checked, and `trellis models pull` installs it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from up_cluster import start_up, stop_up

from rose.assets.errors import AssetError
from rose.assets.heads import BUNDLED, bundled_head_for
from tulip.config import ConfigError, TulipConfig

MODEL = "smollm2-135m-instruct"
HEAD = "smollm2-135m-instruct-mtp"
QUESTIONS = [  # held out from the head's training prompts
    "Explain how a rainbow forms.",
    "Give two reasons to drink water.",
]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model(MODEL))


def test_the_head_is_offered_for_its_target_only(model_dir: Path, tmp_path: Path) -> None:
    head = BUNDLED[HEAD]
    assert bundled_head_for(MODEL) is head and bundled_head_for(str(model_dir)) is head
    assert bundled_head_for(str(tmp_path)) is None  # any other model: no head
    config = TulipConfig.from_args(["--model", MODEL, "--spec", "mtp"], {})
    assert config.bundled_mtp_head is head
    with pytest.raises(ConfigError, match="--mtp-head"):
        TulipConfig.from_args(["--model", str(tmp_path), "--spec", "mtp"], {})


def test_the_heads_bytes_are_checked() -> None:
    head = BUNDLED[HEAD]
    assert head.verified() == head.path
    with pytest.raises(AssetError, match="sha256"):
        dataclasses.replace(head, sha256="1" * 64).verified()


def test_models_pull_installs_the_head(model_dir: Path, tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path), "TRELLIS_MODELS_DIR": str(model_dir.parent)}
    run = [sys.executable, "-m", "ivy.cli", "models"]
    pulled = subprocess.run([*run, "pull", HEAD], env=env, capture_output=True, text=True)
    assert pulled.returncode == 0, pulled.stderr
    where = Path(pulled.stdout.strip())
    assert where == tmp_path / ".cache" / "trellis" / "heads" / HEAD
    shipped = BUNDLED[HEAD].path
    for name in ("config.json", "model.safetensors"):
        assert (where / name).read_bytes() == (shipped / name).read_bytes()
    listed = subprocess.run([*run, "list"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0 and HEAD in listed.stdout


def test_spec_mtp_out_of_the_box_keeps_greedy_output(model_dir: Path) -> None:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = int(hf.generation_config.eos_token_id)
    want = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        ids = torch.tensor([list(ids if isinstance(ids, list) else ids["input_ids"])])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=eos,
            )[0, ids.shape[1] :].tolist()
        want.append(tok.decode([t for t in out if t != eos], skip_special_tokens=True))
    c = start_up(model_dir, args=["--spec", "mtp"])  # no --mtp-head: the bundled one
    try:
        assert any("bundled head " + HEAD in line for line in c.output), "".join(c.output[-40:])
        with httpx.Client(base_url=c.base_url, timeout=120) as client:
            for q, text in zip(QUESTIONS, want, strict=True):
                r = client.post(
                    "/v1/chat/completions",
                    json={
                        "model": c.name,
                        "messages": [{"role": "user", "content": q}],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                    },
                )
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == text
        drafted = accepted = 0.0
        for text in c.replica_metrics().values():
            for line in text.splitlines():
                if line.startswith('tulip_spec_drafted_tokens_total{method="mtp"}'):
                    drafted += float(line.rsplit(" ", 1)[1])
                if line.startswith('tulip_spec_accepted_tokens_total{method="mtp"}'):
                    accepted += float(line.rsplit(" ", 1)[1])
        # A trained head: drafts are kept (in process, these answers keep 13 % of 4-token
        # chains; an untrained head's 4,096-token draft vocabulary keeps next to none).
        assert drafted > 0 and accepted / drafted > 0.08, (accepted, drafted)
    finally:
        assert stop_up(c) == 0, "".join(c.output[-40:])


def test_the_shipped_head_records_how_it_was_made() -> None:
    meta = json.loads((BUNDLED[HEAD].path / "config.json").read_text())
    assert meta["command"].startswith("python -m rose.spec.train_mtp")
    assert len(meta["rounded_from_sha256"]) == 64
