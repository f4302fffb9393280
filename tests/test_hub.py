"""Models by Hub id (`rose.hub.resolve_model`) against a loopback Hub, without the internet.

`FakeHub` is a threaded `http.server` speaking the endpoints huggingface_hub 2.4's
`snapshot_download` calls (read from the installed library):

* ``GET /api/models/{repo}/revision/{rev}`` (`HfApi.model_info` / `repo_info`): id, sha,
  siblings;
* ``GET /api/models/{repo}/tree/{rev}?recursive=...`` (`HfApi.list_repo_tree`);
* ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}`` (`hf_hub_download`): ``X-Repo-Commit``,
  ``ETag``, ``Content-Length``;
* errors as the Hub sends them: 404 + ``X-Error-Code: RepoNotFound | RevisionNotFound |
  EntryNotFound``, 401 without a valid ``Authorization: Bearer`` when a token is required.

It serves tiny random BERT embedders saved by `transformers` (branch ``main`` and branch
``v1``, different weights), plus files serving does not read (which must not be fetched).
huggingface_hub reads ``HF_ENDPOINT`` / ``HF_HOME`` / ``HF_TOKEN`` / ``HF_HUB_OFFLINE`` at
import time, so each resolution runs in its own Python process with its own environment.
The end-to-end tests start real Tulip and Ivy processes (and `trellis up`) with
``--model owner/name``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import transformers
from ivy_process import ivy_over
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from rose.assets.layout import write_pooling
from tulip.process import TulipProcess

REPO = "trellis-test/tiny-bert"
VOCAB = 120
SPECIALS = {"[CLS]": 0, "[PAD]": 1, "[SEP]": 2, "[UNK]": 3}
TEXTS = ["w4 w5 w6", "w10 w11 w12 w13 w14", "w99 w7"]
TOKEN = "hf_test_token_123"
# Files the repo holds that serving does not read: none may be downloaded.
UNSERVED = ("README.md", "pytorch_model.bin", "onnx/model.onnx", "notes/train.log")


# -- the model repos ---------------------------------------------------------------------


def _tiny_bert(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
        pad_token_id=1,
    )
    model = transformers.BertModel(config, add_pooling_layer=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {**SPECIALS, **{f"w{i}": i for i in range(4, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 0), ("[SEP]", 2)],
    )
    tok.save(str(path / "tokenizer.json"))
    write_pooling(path, 32)
    for name in UNSERVED:
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(f"not for serving: {name}\n".encode())
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hub-sources")
    return {"main": _tiny_bert(root / "main", 1), "v1": _tiny_bert(root / "v1", 2)}


# -- the loopback Hub --------------------------------------------------------------------


@dataclass
class FakeHub:
    """Repos -> branches -> commits -> files, served on 127.0.0.1 like the Hub."""

    repos: dict[str, dict[str, str]]  # repo id -> branch -> commit sha
    commits: dict[str, dict[str, bytes]]  # commit sha -> path -> content
    token: str | None = None  # when set, every request needs "Authorization: Bearer <token>"
    gated: bool = False  # when set, every request is refused as the Hub refuses a gated repo
    failing: bool = False  # when set, every request gets a 500 (the Hub is down)
    seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()

    def answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        auth = req.headers.get("Authorization")
        self.seen.append((req.command, req.path, auth))
        if self.token is not None and auth != f"Bearer {self.token}":
            return _send(req, 401, {"error": "Invalid username or password."}, body)
        if self.failing:
            return _send(req, 500, {"error": "Internal Error"}, body)
        if self.gated:
            return _send(
                req, 403, {"error": "Access to this model is restricted."}, body, "GatedRepo"
            )
        path = urllib.parse.urlsplit(req.path).path
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) == 4:  # no revision: the default
            return self._info(req, "/".join(parts[2:4]), "main", body)
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._info(req, "/".join(parts[2:4]), "/".join(parts[5:]), body)
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree(req, "/".join(parts[2:4]), parts[5], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(req, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        return _send(req, 404, {"error": f"no route {path}"}, body)

    def _commit(self, req: BaseHTTPRequestHandler, repo: str, rev: str, body: bool) -> str | None:
        if repo not in self.repos:
            _send(req, 404, {"error": "Repository not found"}, body, code="RepoNotFound")
            return None
        branches = self.repos[repo]
        if rev in branches:
            return branches[rev]
        if rev in branches.values():
            return rev
        _send(req, 404, {"error": f"Invalid rev id: {rev}"}, body, code="RevisionNotFound")
        return None

    def _info(self, req: BaseHTTPRequestHandler, repo: str, rev: str, body: bool) -> None:
        sha = self._commit(req, repo, rev, body)
        if sha is not None:
            siblings = [{"rfilename": name} for name in sorted(self.commits[sha])]
            info = {"id": repo, "modelId": repo, "sha": sha, "private": False}
            _send(req, 200, {**info, "siblings": siblings}, body)

    def _tree(self, req: BaseHTTPRequestHandler, repo: str, rev: str, body: bool) -> None:
        sha = self._commit(req, repo, rev, body)
        if sha is not None:
            entries = [
                {"type": "file", "path": name, "size": len(data), "oid": _sha1(data)}
                for name, data in sorted(self.commits[sha].items())
            ]
            _send(req, 200, entries, body)

    def _file(
        self, req: BaseHTTPRequestHandler, repo: str, rev: str, name: str, body: bool
    ) -> None:
        sha = self._commit(req, repo, rev, body)
        if sha is None:
            return
        data = self.commits[sha].get(name)
        if data is None:
            return _send(req, 404, {"error": "Entry not found"}, body, code="EntryNotFound")
        req.send_response(200)
        req.send_header("X-Repo-Commit", sha)
        req.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        req.send_header("Content-Length", str(len(data)))
        req.send_header("Content-Type", "application/octet-stream")
        req.end_headers()
        if body:
            req.wfile.write(data)


def _sha1(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()  # noqa: S324 - a git-style blob id, not security


def _send(
    req: BaseHTTPRequestHandler, status: int, payload: Any, body: bool, code: str | None = None
) -> None:
    data = json.dumps(payload).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    if code is not None:
        req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", payload["error"])
    req.end_headers()
    if body:
        req.wfile.write(data)


def _commit_sha(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()  # noqa: S324


@pytest.fixture
def hub(sources: dict[str, Path]) -> Iterator[FakeHub]:
    main, v1 = _commit_sha("main"), _commit_sha("v1")
    served = FakeHub(
        repos={REPO: {"main": main, "v1": v1}},
        commits={main: _files(sources["main"]), v1: _files(sources["v1"])},
    ).start()
    try:
        yield served
    finally:
        served.stop()


# -- resolution in a fresh process per case ----------------------------------------------

_RESOLVE = """
import json, sys
from rose.hub import ModelSpecError, resolve_model
try:
    model = resolve_model(sys.argv[1])
except ModelSpecError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"name": model.name, "path": str(model.path)}))
"""


def _hub_env(home: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.pop("TRANSFORMERS_OFFLINE", None)
    env.update(HF_HOME=str(home), HF_ENDPOINT=endpoint, HF_HUB_DISABLE_TELEMETRY="1")
    env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_ETAG_TIMEOUT="5")
    env.update(extra)
    return env


def _resolve(spec: str, env: dict[str, str]) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE, spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def _embed(path: Path) -> np.ndarray:
    from rose import Engine, EngineConfig, RaggedBatch

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    engine = Engine.load(path, EngineConfig(device="cpu"))
    rows = [e.ids for e in tok.encode_batch(TEXTS)]
    return np.asarray(engine.step(RaggedBatch.from_lists(rows)).wait(), dtype=np.float32)


def _downloaded(path: Path) -> set[str]:
    return {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}


def test_hub_id_downloads_what_serving_needs(
    hub: FakeHub, sources: dict[str, Path], tmp_path: Path
) -> None:
    got = _resolve(REPO, _hub_env(tmp_path, hub.url))
    assert got.get("name") == REPO, got
    path = Path(got["path"])
    assert path.is_relative_to(tmp_path / "hub")  # the standard cache under HF_HOME
    assert _downloaded(path) == set(_files(sources["main"])) - set(UNSERVED)
    np.testing.assert_array_equal(_embed(path), _embed(sources["main"]))


@pytest.mark.parametrize("revision", ["v1", _commit_sha("v1")])
def test_revision_by_branch_or_commit(
    hub: FakeHub, sources: dict[str, Path], tmp_path: Path, revision: str
) -> None:
    got = _resolve(f"{REPO}@{revision}", _hub_env(tmp_path, hub.url))
    assert got.get("name") == REPO, got  # served without the revision
    assert Path(got["path"]).name == _commit_sha("v1")
    np.testing.assert_array_equal(_embed(Path(got["path"])), _embed(sources["v1"]))


def test_wrong_revision_is_named(hub: FakeHub, tmp_path: Path) -> None:
    got = _resolve(f"{REPO}@no-such-branch", _hub_env(tmp_path, hub.url))
    assert got["error"] == (
        f"{REPO}@no-such-branch: revision 'no-such-branch' not found in {REPO} on {hub.url}"
    )


def test_missing_repo_is_named(hub: FakeHub, tmp_path: Path) -> None:
    got = _resolve("trellis-test/nope", _hub_env(tmp_path, hub.url))
    assert got["error"].startswith(
        f"trellis-test/nope: repository trellis-test/nope not found on {hub.url}"
    )
    assert "\n" not in got["error"]


def test_token_required_says_set_hf_token_and_hf_token_passes(hub: FakeHub, tmp_path: Path) -> None:
    hub.token = TOKEN
    refused = _resolve(REPO, _hub_env(tmp_path, hub.url))
    assert refused["error"].startswith(f"{REPO}: {hub.url} answered 401 for {REPO} without")
    assert "set HF_TOKEN" in refused["error"] and "\n" not in refused["error"]
    wrong = _resolve(REPO, _hub_env(tmp_path, hub.url, HF_TOKEN="hf_wrong"))
    assert wrong["error"].startswith(f"{REPO}: {hub.url} answered 401 for {REPO} with the token")
    hub.seen.clear()
    got = _resolve(REPO, _hub_env(tmp_path, hub.url, HF_TOKEN=TOKEN))
    assert got.get("name") == REPO, got
    assert hub.seen and all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.seen)


def test_gated_repo_says_accept_and_set_hf_token(hub: FakeHub, tmp_path: Path) -> None:
    hub.gated = True
    got = _resolve(REPO, _hub_env(tmp_path, hub.url, HF_TOKEN=TOKEN))
    assert got["error"] == (
        f"{REPO}: {REPO} is a gated repository on {hub.url}: accept its conditions on the Hub "
        "and set HF_TOKEN to a token of an account with access"
    )


def test_offline_uses_the_cache_without_the_server(
    hub: FakeHub, sources: dict[str, Path], tmp_path: Path
) -> None:
    online = _resolve(REPO, _hub_env(tmp_path, hub.url))
    pinned = _resolve(f"{REPO}@v1", _hub_env(tmp_path, hub.url))
    hub.stop()
    hub.seen.clear()
    offline = _resolve(REPO, _hub_env(tmp_path, hub.url, HF_HUB_OFFLINE="1"))
    assert offline == online
    assert _resolve(f"{REPO}@v1", _hub_env(tmp_path, hub.url, HF_HUB_OFFLINE="1")) == pinned
    assert hub.seen == []
    np.testing.assert_array_equal(_embed(Path(offline["path"])), _embed(sources["main"]))


def test_a_failing_hub_falls_back_to_the_cache(hub: FakeHub, tmp_path: Path) -> None:
    online = _resolve(REPO, _hub_env(tmp_path, hub.url))
    hub.failing = True
    assert _resolve(REPO, _hub_env(tmp_path, hub.url)) == online
    empty = _resolve(REPO, _hub_env(tmp_path / "empty", hub.url))
    assert empty["error"] == (
        f"{REPO}: cannot reach {hub.url} and the model is not in the cache at "
        f"{tmp_path / 'empty' / 'hub'}"
    )


def test_offline_with_an_empty_cache_says_so(tmp_path: Path) -> None:
    got = _resolve(REPO, _hub_env(tmp_path, "http://127.0.0.1:9", HF_HUB_OFFLINE="1"))
    assert got["error"] == (
        f"{REPO}: HF_HUB_OFFLINE is set and the model is not in the cache at {tmp_path / 'hub'}"
    )


def test_directories_and_specs_that_are_nothing(tmp_path: Path) -> None:
    from rose.hub import ModelSpecError, parse_hub_id, resolve_model

    assert resolve_model(str(tmp_path)).path == tmp_path.resolve()
    assert resolve_model(str(tmp_path)).name == tmp_path.name
    assert parse_hub_id("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    assert parse_hub_id("org/name") == ("org/name", None)
    assert parse_hub_id("name") is None
    with pytest.raises(ModelSpecError, match="^/no/such/dir: directory does not exist$"):
        resolve_model("/no/such/dir")
    with pytest.raises(ModelSpecError, match="^e5: not a model directory, a bundled asset"):
        resolve_model("e5")


# -- end to end: Tulip, Ivy and `trellis up` given a Hub id -------------------------------


def _embeddings(url: str) -> np.ndarray:
    r = httpx.post(f"{url}/v1/embeddings", json={"model": REPO, "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == REPO
    return np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32)


def test_tulip_and_ivy_serve_a_hub_id(
    hub: FakeHub, sources: dict[str, Path], tmp_path: Path
) -> None:
    env = _hub_env(tmp_path / "hf", hub.url, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tulip = TulipProcess(
        ["--model", REPO, "--device", "cpu", "--threads", "1"],
        log_path=tmp_path / "tulip.log",
        env=env,
    )
    with tulip:
        tulip.wait_serving()
        with ivy_over({REPO: (REPO, tulip.target)}, tmp_path / "ivy.log", env) as url:
            got = _embeddings(url)
    np.testing.assert_allclose(got, _embed(sources["main"]), atol=1e-5)


def test_trellis_up_with_a_hub_id(hub: FakeHub, sources: dict[str, Path], tmp_path: Path) -> None:
    from up_cluster import start_up, stop_up

    cluster = start_up(Path(REPO), env=_hub_env(tmp_path / "hf", hub.url))
    try:
        assert f"model `{REPO}`" in cluster.text
        got = _embeddings(cluster.base_url)
    finally:
        assert stop_up(cluster) == 0, cluster.text[-4000:]
    np.testing.assert_allclose(got, _embed(sources["main"]), atol=1e-5)


def test_tulip_says_in_one_line_when_a_model_cannot_be_found(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "tulip", "--model", "nobody/nothing-here", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tulip: --model nobody/nothing-here:") and "HF_HUB_OFFLINE" in last
