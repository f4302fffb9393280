"""Parity of Trellis' Unigram tokenizer with Hugging Face `tokenizers` (the oracle).

Both XLM-R tokenizer.json shapes, over a >= 50,000-line multilingual corpus plus
hand-written edge cases, through `encode` and `encode_batch`; truncation, pairs,
offsets and decoding on subsets. Expected values always come from HF.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizer_corpus import corpus_lines, edge_cases, long_document

from rose.assets import ensure_model
from tokenizer import Tokenizer

HF_VERSION = "0.23.3"
SHAPES = ("tokenizer.json", "tokenizer-legacy.json")


@pytest.fixture(scope="session")
def xlmr_dir() -> Path:
    return Path(ensure_model("xlmr-tokenizer"))


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return corpus_lines()


@pytest.fixture(scope="session")
def edges(corpus: list[str]) -> list[str]:
    # ~16k tokens: corpus text averages ~4 characters per XLM-R token.
    return edge_cases(long_document(corpus, target_chars=64_000))


@pytest.fixture(scope="session", params=SHAPES)
def shape(request: pytest.FixtureRequest, xlmr_dir: Path) -> dict:
    path = str(xlmr_dir / request.param)
    hf = tokenizers.Tokenizer.from_file(path)
    hf.no_truncation()
    hf.no_padding()
    return {"name": request.param, "path": path, "ours": Tokenizer.from_file(path), "hf": hf}


@pytest.fixture(scope="session")
def hf_ids(shape: dict, corpus: list[str], edges: list[str]) -> dict[str, list[list[int]]]:
    hf = shape["hf"]
    return {
        "corpus": [e.ids for e in hf.encode_batch(corpus)],
        "edges": [e.ids for e in hf.encode_batch(edges)],
    }


def _first_mismatch(texts: list[str], got: list[list[int]], want: list[list[int]]) -> str:
    assert len(got) == len(want)
    bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    if not bad:
        return ""
    i = bad[0]
    return f"{len(bad)}/{len(texts)} differ; first {texts[i]!r}: ours {got[i]} hf {want[i]}"


def test_oracle_version_is_pinned() -> None:
    assert tokenizers.__version__ == HF_VERSION


def test_files_have_the_two_xlmr_shapes(xlmr_dir: Path) -> None:
    new = json.loads((xlmr_dir / "tokenizer.json").read_text(encoding="utf-8"))
    old = json.loads((xlmr_dir / "tokenizer-legacy.json").read_text(encoding="utf-8"))
    assert [n["type"] for n in new["normalizer"]["normalizers"]][0] == "Precompiled"
    assert "Replace" in [n["type"] for n in new["normalizer"]["normalizers"]]
    assert new["pre_tokenizer"]["type"] == "Metaspace" and "prepend_scheme" in new["pre_tokenizer"]
    assert old["normalizer"]["type"] == "Precompiled"
    pre = [p["type"] for p in old["pre_tokenizer"]["pretokenizers"]]
    assert pre == ["WhitespaceSplit", "Metaspace"]
    assert "add_prefix_space" in old["pre_tokenizer"]["pretokenizers"][1]


def test_corpus_is_large_and_multilingual(corpus: list[str]) -> None:
    assert len(corpus) >= 50_000
    scripts = {
        "cjk": "\u4e00",
        "cyrillic": "\u0400",
        "arabic": "\u0600",
        "kana": "\u3040",
        "devanagari": "\u0900",
    }
    for name, lo in scripts.items():
        hi = chr(ord(lo) + 0xFF)
        assert sum(any(lo <= c <= hi for c in line) for line in corpus) > 100, name


def test_known_ids(shape: dict) -> None:
    assert shape["ours"].encode("Hello, my dog is cute") == [0, 35378, 4, 759, 10269, 83, 99942, 2]


def test_corpus_encode_batch(shape: dict, corpus: list[str], hf_ids: dict) -> None:
    got = shape["ours"].encode_batch(corpus)
    assert not _first_mismatch(corpus, got, hf_ids["corpus"])


def test_corpus_encode(shape: dict, corpus: list[str], hf_ids: dict) -> None:
    ours = shape["ours"]
    got = [ours.encode(t) for t in corpus]
    assert not _first_mismatch(corpus, got, hf_ids["corpus"])


def test_edge_cases_encode_and_batch(shape: dict, edges: list[str], hf_ids: dict) -> None:
    ours = shape["ours"]
    assert len(hf_ids["edges"][-1]) > 15_000, "the long document should be ~16k tokens"
    assert not _first_mismatch(edges, [ours.encode(t) for t in edges], hf_ids["edges"])
    assert not _first_mismatch(edges, ours.encode_batch(edges), hf_ids["edges"])


def test_packed_batch_matches_hf(shape: dict, corpus: list[str], hf_ids: dict) -> None:
    texts = corpus[:5000]
    ids, lengths = shape["ours"].encode_batch_packed(texts)
    want = hf_ids["corpus"][:5000]
    assert lengths.tolist() == [len(w) for w in want]
    assert ids.tolist() == [i for w in want for i in w]


def test_without_special_tokens(shape: dict, corpus: list[str], edges: list[str]) -> None:
    texts = corpus[:3000] + edges[:200]
    want = [e.ids for e in shape["hf"].encode_batch(texts, add_special_tokens=False)]
    got = shape["ours"].encode_batch(texts, add_special_tokens=False)
    assert not _first_mismatch(texts, got, want)


@pytest.mark.parametrize("max_length", [2, 3, 8, 64, 512])
def test_truncation(shape: dict, corpus: list[str], edges: list[str], max_length: int) -> None:
    hf = tokenizers.Tokenizer.from_str(shape["hf"].to_str())
    hf.enable_truncation(max_length)
    texts = corpus[:1500] + edges[:100] + edges[-1:]
    want = [e.ids for e in hf.encode_batch(texts)]
    ours = shape["ours"]
    assert not _first_mismatch(texts, ours.encode_batch(texts, max_length=max_length), want)
    assert not _first_mismatch(texts, [ours.encode(t, max_length=max_length) for t in texts], want)
    want_plain = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    got_plain = ours.encode_batch(texts, add_special_tokens=False, max_length=max_length)
    assert not _first_mismatch(texts, got_plain, want_plain)


def test_offsets(shape: dict, corpus: list[str], edges: list[str]) -> None:
    texts = corpus[:2000] + edges[:-1]
    ours = shape["ours"]
    for t, e in zip(texts, shape["hf"].encode_batch(texts), strict=True):
        ids, offsets = ours.encode_with_offsets(t)
        assert ids == e.ids, t
        assert offsets == e.offsets, t


def test_decode(shape: dict, corpus: list[str], edges: list[str], hf_ids: dict) -> None:
    hf, ours = shape["hf"], shape["ours"]
    ids_list = hf_ids["corpus"][:2000] + hf_ids["edges"][:300]
    for ids in ids_list:
        assert ours.decode(ids) == hf.decode(ids), ids
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(
            ids, skip_special_tokens=False
        )


@pytest.mark.parametrize("max_length", [None, 24, 25, 64])
@pytest.mark.parametrize("query", ["short", "long"])
def test_pairs(shape: dict, corpus: list[str], max_length: int | None, query: str) -> None:
    """Pairs as HF builds them, cut to `max_length` by its default `longest_first`
    strategy: a short query keeps its tokens and the document gives up its own; a query
    longer than half the room is cut too (odd and even rooms)."""
    hf = tokenizers.Tokenizer.from_str(shape["hf"].to_str())
    if max_length is not None:
        hf.enable_truncation(max_length)  # strategy longest_first
    ours = shape["ours"]
    query = "what is the boiling point of water?" if query == "short" else " ".join(corpus[7:27])
    n_query = len(ours.encode(query, add_special_tokens=False))
    docs = corpus[100:1100]
    encodings = [hf.encode(query, d) for d in docs]
    want = [e.ids for e in encodings]
    got = [ours.encode_pair(query, d, max_length=max_length) for d in docs]
    assert not _first_mismatch(docs, got, want)
    ids, lengths, first = ours.encode_pairs_packed(query, docs, max_length=max_length)
    assert lengths.tolist() == [len(w) for w in want]
    assert ids.tolist() == [i for w in want for i in w]
    # everything before the document's first token belongs to the first segment
    cut = [e.sequence_ids.index(1) for e in encodings if 1 in e.sequence_ids]
    assert len(cut) == len(docs)
    assert first.tolist() == cut
    if max_length is not None and n_query > max_length:
        assert max(e.sequence_ids.count(0) for e in encodings) < n_query  # the query was cut
