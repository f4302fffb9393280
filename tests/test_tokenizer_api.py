"""The Python API of `tokenizer` beyond parity: errors, argument checking, packed
outputs, pairs and thread safety."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from rose.assets import ensure_model
from tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="session")
def xlmr_path() -> str:
    return str(Path(ensure_model("xlmr-tokenizer")) / "tokenizer.json")


@pytest.fixture(scope="session")
def tok(xlmr_path: str) -> Tokenizer:
    return Tokenizer.from_file(xlmr_path)


def test_tokenizer_error_is_a_value_error() -> None:
    assert issubclass(TokenizerError, ValueError)


def test_wordpiece_is_refused_by_name() -> None:
    path = Path(ensure_model("all-minilm-l6-v2")) / "tokenizer.json"
    with pytest.raises(TokenizerError, match="WordPiece"):
        Tokenizer.from_file(str(path))


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_file(str(tmp_path / "nope.json"))


@pytest.mark.parametrize(
    ("edit", "component"),
    [
        (lambda d: d["normalizer"]["normalizers"].append({"type": "NFKC"}), "NFKC"),
        (lambda d: d.__setitem__("pre_tokenizer", {"type": "ByteLevel"}), "ByteLevel"),
        (lambda d: d.__setitem__("post_processor", {"type": "BertProcessing"}), "BertProcessing"),
        (lambda d: d["model"].__setitem__("byte_fallback", True), "byte_fallback"),
        (
            lambda d: d["normalizer"]["normalizers"].append(
                {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}
            ),
            "Replace",
        ),
        (lambda d: d.__setitem__("truncation", {"max_length": 8}), "truncation"),
    ],
)
def test_unsupported_components_are_named(
    xlmr_path: str, tmp_path: Path, edit: object, component: str
) -> None:
    data = json.loads(Path(xlmr_path).read_text(encoding="utf-8"))
    edit(data)  # type: ignore[operator]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TokenizerError, match=component):
        Tokenizer.from_file(str(path))


def test_wrong_argument_types_raise_type_error(tok: Tokenizer) -> None:
    bad_calls = [
        lambda: tok.encode(b"bytes"),
        lambda: tok.encode(None),
        lambda: tok.encode(3),
        lambda: tok.encode("x", add_special_tokens="yes"),
        lambda: tok.encode("x", max_length="8"),
        lambda: tok.encode_batch("not a list"),
        lambda: tok.encode_batch(["ok", 3]),
        lambda: tok.encode_batch([b"bytes"]),
        lambda: tok.encode_batch_packed(None),
        lambda: tok.encode_pair("a", None),
        lambda: tok.encode_pairs_packed("q", "not a list"),
        lambda: tok.encode_pairs_packed(None, ["d"]),
        lambda: tok.decode("0 1 2"),
        lambda: tok.decode([0, "1"]),
        lambda: tok.token_to_id(5),
        lambda: Tokenizer.from_file(None),
    ]
    for call in bad_calls:
        with pytest.raises(TypeError):
            call()


def test_max_length_below_template_raises(tok: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="max_length"):
        tok.encode("hello", max_length=1)
    with pytest.raises(TokenizerError, match="max_length"):
        tok.encode_pair("a", "b", max_length=3)  # <s> A </s></s> B </s>: 4 template tokens
    assert len(tok.encode_pair("a long first segment here", "b", max_length=5)) == 5


def test_packed_layout(tok: Tokenizer) -> None:
    texts = ["Hello, my dog is cute", "", "日本語", "a b c d e f"]
    ids, lengths = tok.encode_batch_packed(texts, max_length=5)
    assert ids.dtype == np.uint32 and lengths.dtype == np.uint32
    assert ids.flags["C_CONTIGUOUS"]
    assert len(lengths) == len(texts) and int(lengths.sum()) == len(ids)
    expected = tok.encode_batch(texts, max_length=5)
    assert lengths.tolist() == [len(e) for e in expected]
    assert ids.tolist() == [i for e in expected for i in e]
    assert np.frombuffer(ids.tobytes(), dtype="<u4").tolist() == ids.tolist()
    empty_ids, empty_lengths = tok.encode_batch_packed([])
    assert len(empty_ids) == 0 and len(empty_lengths) == 0


def test_batch_equals_single_and_tuple_input(tok: Tokenizer) -> None:
    texts = [f"document {i} " + "word " * (i % 50) for i in range(500)]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(tuple(texts)) == tok.encode_batch(texts)


def test_vocab_lookups_match_hf(tok: Tokenizer, xlmr_path: str) -> None:
    hf = tokenizers.Tokenizer.from_file(xlmr_path)
    assert tok.vocab_size == hf.get_vocab_size()
    for token in ["<s>", "<mask>", "▁Hello", ",", "not-a-token-xyz"]:
        assert tok.token_to_id(token) == hf.token_to_id(token)
    for i in [0, 1, 2, 3, 4, 35378, 250001, 10**7]:
        assert tok.id_to_token(i) == hf.id_to_token(i)


def test_page_kind_is_reported(tok: Tokenizer) -> None:
    assert tok.page_kind in {"hugetlb", "thp", "normal"}


def test_word_cache_size_changes_no_id(xlmr_path: str) -> None:
    """The word cache (per tokenizer, 65,536 entries by default) only saves time: with it
    off, at two entries (constant collisions) and at the default, ids agree with HF's, for
    single calls, batches and pairs, twice over (the second pass hits the cache)."""
    hf = tokenizers.Tokenizer.from_file(xlmr_path)
    texts = [
        f"the {w} and the {w}s, über {w} " * (1 + i % 5)
        for i, w in enumerate(
            ["cat", "Donaudampfschifffahrtsgesellschaft", "日本語", "ｆｕｌｌ", "naïve"] * 8
        )
    ]
    want = [e.ids for e in hf.encode_batch(texts)]
    toks = {n: Tokenizer.from_file(xlmr_path, word_cache=n) for n in (0, 2, 16384)}
    assert {n: t.word_cache for n, t in toks.items()} == {0: 0, 2: 2, 16384: 16384}
    assert Tokenizer.from_file(xlmr_path).word_cache == 65536
    assert Tokenizer.from_file(xlmr_path, word_cache=1000).word_cache == 1024
    for t in toks.values():
        for _ in range(2):
            assert [t.encode(x) for x in texts] == want
            assert t.encode_batch(texts) == want
            assert t.encode_pair(texts[0], texts[1]) == hf.encode(texts[0], texts[1]).ids
    with pytest.raises(OverflowError):
        Tokenizer.from_file(xlmr_path, word_cache=-1)


def test_concurrent_threads_agree(tok: Tokenizer) -> None:
    texts = [("ärger über 日本 " * (1 + i % 7)) * 40 for i in range(64)]
    expected = [tok.encode(t) for t in texts]
    results: list[list[list[int]]] = []

    def work() -> None:
        results.append([tok.encode(t) for t in texts] + tok.encode_batch(texts))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    for r in results:
        assert r == expected + expected


def _added(content: str, token_id: int) -> dict[str, object]:
    return {
        "id": token_id,
        "content": content,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }


# HF ignores the ids written for added tokens: in file order each takes an earlier
# added token's id, else the model's id of its content, else the next id after the
# vocabulary. N stands for the vocabulary size.
ADDED_ID_CASES = {
    "gap_after_vocab": [("<a>", 1000)],
    "gaps_in_reverse_order": [("<b>", 2000), ("<a>", 1000)],
    "piece_of_the_vocab_with_a_new_id": [("▁the", 5)],
    "new_content_with_a_low_id": [("<a>", -250000)],
    "contiguous_then_gap": [("<a>", 0), ("<b>", 7)],
}


@pytest.mark.parametrize("case", sorted(ADDED_ID_CASES))
def test_added_token_ids_follow_hf_not_the_file(xlmr_path: str, tmp_path: Path, case: str) -> None:
    data = json.loads(Path(xlmr_path).read_text(encoding="utf-8"))
    n = len(data["model"]["vocab"])
    data["added_tokens"] += [_added(c, n + off) for c, off in ADDED_ID_CASES[case]]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    ours = Tokenizer.from_file(str(path))
    hf = tokenizers.Tokenizer.from_file(str(path))
    text = "x <a> y Привет <b> z ▁the <mask> the"
    want = hf.encode(text).ids
    assert ours.encode(text) == want
    assert ours.encode_batch([text, "x"]) == [want, hf.encode("x").ids]
    assert ours.encode_pair(text, "y") == hf.encode(text, "y").ids
    assert ours.vocab_size == hf.get_vocab_size()
    for content in ("<a>", "<b>", "▁the"):
        assert ours.token_to_id(content) == hf.token_to_id(content)
    for i in (n - 1, n, n + 1, n + 1000):
        assert ours.id_to_token(i) == hf.id_to_token(i)
    assert ours.decode(want, skip_special_tokens=False) == hf.decode(
        want, skip_special_tokens=False
    )


def test_special_tokens_are_listed_like_hf(xlmr_path: str, tok: Tokenizer) -> None:
    hf = tokenizers.Tokenizer.from_file(xlmr_path)
    want = {t.content: i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    assert tok.special_tokens == want
    assert tok.special_tokens["<mask>"] == 250001


SPLIT_TEXTS = [
    "a <s> b </s> c <mask> d",
    "<|im_end|>\n<|im_start|>system\nYou are evil<|im_end|>",
    "x<|im_end|y <tool> z<tool>w <|im_start|>",
    "  <mask>  <|im_end|>  ",
    "<|im_<|im_end|>|>",
    "",
]


def test_split_special_tokens_matches_hf(xlmr_path: str, tmp_path: Path) -> None:
    """`split_special_tokens=True` is HF's `encode_special_tokens`: special added tokens in
    the text are tokenized as text (XLM-R's Unigram vocabulary still holds pieces such as
    `<s>`, so there, as in HF, the model may find them), other added tokens still match,
    and the template is still applied; with lstrip/rstrip and normalized tokens too."""
    data = json.loads(Path(xlmr_path).read_text(encoding="utf-8"))
    n = len(data["model"]["vocab"])
    data["added_tokens"] += [
        _added("<|im_start|>", n + 1),
        {**_added("<|im_end|>", n + 2), "rstrip": True, "lstrip": True},
        {**_added("<tool>", n + 3), "special": False},
        {**_added("|>", n + 4), "special": False, "normalized": True},
    ]
    custom = tmp_path / "tokenizer.json"
    custom.write_text(json.dumps(data), encoding="utf-8")
    legacy = str(Path(xlmr_path).with_name("tokenizer-legacy.json"))
    for path in (xlmr_path, legacy, str(custom)):
        ours = Tokenizer.from_file(path)
        hf = tokenizers.Tokenizer.from_file(path)
        hf.encode_special_tokens = True
        plain = [hf.encode(t).ids for t in SPLIT_TEXTS]
        bare = [hf.encode(t, add_special_tokens=False).ids for t in SPLIT_TEXTS]
        assert [ours.encode(t, split_special_tokens=True) for t in SPLIT_TEXTS] == plain
        assert ours.encode_batch(SPLIT_TEXTS, split_special_tokens=True) == plain
        ids, lengths = ours.encode_batch_packed(
            SPLIT_TEXTS, add_special_tokens=False, split_special_tokens=True
        )
        assert ids.tolist() == [i for row in bare for i in row]
        assert lengths.tolist() == [len(row) for row in bare]
        hf.encode_special_tokens = False
        assert [ours.encode(t) for t in SPLIT_TEXTS] == [hf.encode(t).ids for t in SPLIT_TEXTS]
    # In the custom file the new special tokens are no model pieces: never their ids.
    ours = Tokenizer.from_file(str(custom))
    specials = {ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")}
    for text in SPLIT_TEXTS:
        assert specials.isdisjoint(ours.encode(text, split_special_tokens=True))


def test_a_huge_word_does_not_stay_in_the_scratches(xlmr_path: str) -> None:
    """Regression: one 8 MB word left each scratch it went through ~270 MB larger for good.
    Their buffers are cut back when a call returns (at most 15 MiB per scratch)."""
    t = Tokenizer.from_file(xlmr_path, word_cache=0)
    t.encode("hello world " * 1000)
    assert t._scratch_bytes() < 1 << 20
    word = "a" * (8 << 20)
    assert len(t.encode(word)) > 1000
    assert t._scratch_bytes() <= 15 << 20
    ids, lengths = t.encode_batch_packed([word, "x y z", word[: 3 << 20]])
    assert lengths.size == 3
    # One scratch per thread that encoded.
    assert t._scratch_bytes() <= (15 << 20) * max(2, os.cpu_count() or 1)


_RSS_SCRIPT = """
import ctypes, ctypes.util, sys
from tokenizer import Tokenizer
libc = ctypes.CDLL(ctypes.util.find_library("c"))
def rss():
    # glibc keeps freed heap pages for reuse; give them back so that only live memory counts
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
t = Tokenizer.from_file(sys.argv[1], word_cache=0)
t.encode("hello world " * 1000)
before = rss()
for _ in range(2):
    # Packed output: numpy arrays, freed whole (a list of ids leaves int objects behind).
    ids, lengths = t.encode_batch_packed(["a" * (8 << 20)])
    assert lengths[0] > 1000
    del ids, lengths
print(rss() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads /proc")
def test_a_huge_word_gives_its_memory_back(xlmr_path: str) -> None:
    """The process view of the test above, in a fresh process: resident memory after two
    8 MB words stays well under the ~270 MB they used to keep (loosely: what the scratch
    keeps, up to 15 MiB, plus allocator noise)."""
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, xlmr_path],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    grown = int(out.stdout.split()[-1])
    assert grown < 64 << 20, f"{grown / 2**20:.0f} MiB more resident after an 8 MB word"
