"""Fetching and extracting the multilingual corpus (see the package docstring)."""

from __future__ import annotations

import bz2
import gettext
import gzip
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tokenizer_corpus.msgpack import unpack

__all__ = ["CorpusConfig", "corpus_lines", "long_document"]

DEBIAN_PACKAGES = (
    "unicode-data",
    "unicode-cldr-core",
    "iso-codes",
    "fortunes-zh",
    "fortunes-ru",
    "fortunes-de",
    "manpages-ja",
    "wukrainian",
)
PYPI_PACKAGES = ("bge-m3-lite==0.6.2", "wordfreq==3.1.1")
# Bump when the extraction changes, so cached line files are rebuilt.
CORPUS_VERSION = 1
MAX_LINE_CHARS = 2000


@dataclass(frozen=True)
class CorpusConfig:
    """Where the corpus is cached and how many lines to keep."""

    cache_dir: Path
    min_lines: int = 50_000
    max_lines: int = 60_000
    seed: int = 20_251_129

    def __post_init__(self) -> None:
        if self.min_lines < 1:
            raise ValueError(f"min_lines must be >= 1, got {self.min_lines}")
        if self.max_lines < self.min_lines:
            raise ValueError(
                f"max_lines ({self.max_lines}) must be >= min_lines ({self.min_lines})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CorpusConfig:
        env = os.environ if env is None else env
        root = env.get("TRELLIS_CORPORA_DIR") or str(Path.home() / ".cache" / "trellis" / "corpora")
        return cls(cache_dir=Path(root))


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")


def _fetch_debian(cfg: CorpusConfig) -> Path:
    root = cfg.cache_dir / "debian"
    done = root / ".extracted"
    if done.exists():
        return root / "x"
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in DEBIAN_PACKAGES if not list(debs.glob(f"{p}_*.deb"))]
    if missing:
        try:
            _run(["apt-get", "download", *missing], debs)
        except RuntimeError:
            _run(["apt-get", "update"], debs)
            _run(["apt-get", "download", *missing], debs)
    for deb in sorted(debs.glob("*.deb")):
        _run(["dpkg", "-x", str(deb), str(root / "x")], root)
    done.touch()
    return root / "x"


def _fetch_pypi(cfg: CorpusConfig) -> Path:
    root = cfg.cache_dir / "pypi"
    root.mkdir(parents=True, exist_ok=True)
    for spec in PYPI_PACKAGES:
        name = spec.split("==")[0].replace("-", "_")
        if not list(root.glob(f"{name}-*.whl")):
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                spec,
                "-d",
                str(root),
            ]
            _run(cmd, root)
    return root


def _clean(line: str) -> str | None:
    line = line.strip("\n")
    if not line.strip():
        return None
    return line[:MAX_LINE_CHARS]


def _normalization_test(x: Path) -> Iterator[str]:
    path = x / "usr/share/unicode/NormalizationTest.txt.bz2"
    for raw in bz2.open(path, "rt", encoding="utf-8"):
        if raw.startswith(("#", "@")):
            continue
        cols = raw.split(";")[:5]
        for col in (cols[0], cols[2], cols[4]):
            yield "".join(chr(int(h, 16)) for h in col.split())


def _cldr(x: Path) -> Iterator[str]:
    base = x / "usr/share/unicode/cldr/common"
    text_re = re.compile(r">([^<>]{2,})</")
    cp_re = re.compile(r'cp="([^"]+)"')
    for sub in ("main", "annotations"):
        for path in sorted((base / sub).glob("*.xml")):
            for raw in path.read_text(encoding="utf-8").splitlines():
                for m in text_re.finditer(raw):
                    yield m.group(1)
                for m in cp_re.finditer(raw):
                    yield m.group(1)


def _iso_codes(x: Path) -> Iterator[str]:
    for mo in sorted((x / "usr/share/locale").glob("*/LC_MESSAGES/iso_*.mo")):
        with mo.open("rb") as f:
            catalog = gettext.GNUTranslations(f)._catalog  # noqa: SLF001 - the parsed .mo
        for key, value in catalog.items():
            if key and isinstance(value, str):
                yield value


def _fortunes(x: Path) -> Iterator[str]:
    for path in sorted((x / "usr/share/games/fortunes").rglob("*")):
        if not path.is_file() or path.suffix in (".dat",) or path.is_symlink():
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        for fortune in text.split("\n%\n"):
            yield fortune.replace("\n%", "")


def _manpages_ja(x: Path) -> Iterator[str]:
    for path in sorted((x / "usr/share/man/ja").rglob("*.gz")):
        try:
            text = gzip.open(path, "rt", encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for raw in text.splitlines():
            if raw and not raw.startswith((".", "'", '\\"')):
                yield raw


def _ukrainian(x: Path) -> Iterator[str]:
    words = (x / "usr/share/dict/ukrainian").read_text(encoding="utf-8").split()
    rng = random.Random(7)
    for _ in range(len(words) // 10):
        yield " ".join(rng.sample(words, 8))


def _miracl(pypi: Path) -> Iterator[str]:
    (whl,) = sorted(pypi.glob("bge_m3_lite-*.whl"))[-1:]
    with zipfile.ZipFile(whl) as z:
        for name in ("bge_m3_lite/calibration_miracl.txt", "bge_m3_lite/calibration.txt"):
            yield from z.read(name).decode("utf-8").splitlines()


def _wordfreq(pypi: Path) -> Iterator[str]:
    (whl,) = sorted(pypi.glob("wordfreq-*.whl"))[-1:]
    rng = random.Random(11)
    with zipfile.ZipFile(whl) as z:
        for name in sorted(z.namelist()):
            if not re.fullmatch(r"wordfreq/data/small_[a-z_]+\.msgpack\.gz", name):
                continue
            data = unpack(gzip.decompress(z.read(name)))
            words = [w for bucket in data[1:] for w in bucket if isinstance(w, str)]
            for _ in range(min(400, len(words) // 8)):
                yield " ".join(rng.sample(words, 8))


def _all_sources(cfg: CorpusConfig) -> dict[str, list[str]]:
    x = _fetch_debian(cfg)
    pypi = _fetch_pypi(cfg)
    sources = {
        "unicode-data": _normalization_test(x),
        "unicode-cldr-core": _cldr(x),
        "iso-codes": _iso_codes(x),
        "fortunes": _fortunes(x),
        "manpages-ja": _manpages_ja(x),
        "wukrainian": _ukrainian(x),
        "bge-m3-lite": _miracl(pypi),
        "wordfreq": _wordfreq(pypi),
    }
    out: dict[str, list[str]] = {}
    for name, it in sources.items():
        seen: set[str] = set()
        lines = []
        for raw in it:
            line = _clean(raw)
            if line is not None and line not in seen:
                seen.add(line)
                lines.append(line)
        out[name] = lines
    return out


def _build(cfg: CorpusConfig) -> list[str]:
    sources = _all_sources(cfg)
    rng = random.Random(cfg.seed)
    # An equal share per source (small sources give everything), topped up round-robin.
    share = cfg.max_lines // len(sources)
    picked: list[str] = []
    rest: list[str] = []
    for name in sorted(sources):
        lines = sources[name]
        rng.shuffle(lines)
        picked += lines[:share]
        rest += lines[share:]
    rng.shuffle(rest)
    picked += rest[: cfg.max_lines - len(picked)]
    unique = list(dict.fromkeys(picked))
    if len(unique) < cfg.min_lines:
        raise RuntimeError(f"corpus has {len(unique)} lines, fewer than {cfg.min_lines}")
    return unique


def corpus_lines(cfg: CorpusConfig | None = None) -> list[str]:
    """The parity corpus (built on first use, then read from the cache)."""
    cfg = cfg or CorpusConfig.from_env()
    key = hashlib.sha256(
        json.dumps([CORPUS_VERSION, cfg.max_lines, cfg.seed]).encode()
    ).hexdigest()[:12]
    path = cfg.cache_dir / f"tokenizer-parity-{key}.jsonl"
    if path.exists():
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    cfg.cache_dir.mkdir(parents=True, exist_ok=True)
    lines = _build(cfg)
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=cfg.cache_dir, delete=False) as f:
        for line in lines:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    os.replace(f.name, path)
    return lines


def long_document(lines: list[str], target_chars: int, seed: int = 3) -> str:
    """A document of about `target_chars` characters glued from distinct corpus lines."""
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < target_chars:
        line = lines[rng.randrange(len(lines))]
        parts.append(line)
        total += len(line) + 1
    return " ".join(parts)
