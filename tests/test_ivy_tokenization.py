"""Ivy's tokenizer adapter: the Rust tokenizer for Unigram files, HF `tokenizers` for the
rest, and both backends giving the same packed ids, lengths and truncation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from ivy.tokenization import HFTokenizer, TokenizationError, load_tokenizer

TEXTS = [
    "Hello, my dog is cute",
    "word " * 700,
    "東京は日本の首都です。" * 40,
    "Как пройти в библиотеку?",
    " leading and  double  spaces ",
]


@pytest.fixture(scope="module")
def xlmr() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model("xlmr-tokenizer")) / "tokenizer.json"


@pytest.fixture(scope="module")
def minilm() -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model("all-minilm-l6-v2")) / "tokenizer.json"


@pytest.fixture(scope="module")
def loaded(xlmr: Path, minilm: Path) -> dict[Path, list]:
    """path -> [adapter picked by load_tokenizer, HF adapter, reference HF tokenizer]."""
    return {
        p: [load_tokenizer(p), HFTokenizer(p), Tokenizer.from_file(str(p))] for p in (xlmr, minilm)
    }


def reference(tok: Tokenizer, texts: list[str], max_length: int | None) -> list[list[int]]:
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length)
    return [e.ids for e in tok.encode_batch(texts)]


def unpack(ids: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    bounds = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).tolist()
    return [ids[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_unigram_file_uses_rust_and_wordpiece_falls_back(
    xlmr: Path, minilm: Path, loaded: dict[Path, list]
) -> None:
    assert loaded[xlmr][0].backend == "rust"
    assert loaded[minilm][0].backend == "huggingface"


def test_word_cache_setting_reaches_the_rust_tokenizer(
    xlmr: Path, loaded: dict[Path, list]
) -> None:
    """Ivy's --tokenizer-word-cache sizes the Rust tokenizer's cache (None: its default);
    ids stay the reference's at every size."""
    want = reference(loaded[xlmr][2], TEXTS, None)
    sizes = {}
    for word_cache in (None, 0, 8):
        tok = load_tokenizer(xlmr, word_cache)
        sizes[word_cache] = tok._tok.word_cache  # type: ignore[attr-defined]
        for _ in range(2):  # the second pass hits the cache
            assert unpack(*tok.encode_batch_packed(TEXTS)) == want, word_cache
    assert sizes == {None: 65536, 0: 0, 8: 8}


@pytest.mark.parametrize("max_length", [None, 8, 512])
def test_packed_batches_equal_reference(loaded: dict[Path, list], max_length: int | None) -> None:
    for path, (picked, hf, ref) in loaded.items():
        want = reference(ref, TEXTS, max_length)
        for tok in (picked, hf):
            ids, lengths = tok.encode_batch_packed(TEXTS, True, max_length)
            assert ids.dtype == np.uint32 and lengths.dtype == np.uint32
            assert unpack(ids, lengths) == want, (path, tok.backend)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("query", ["how do plants grow", TEXTS[2]])
def test_pairs_are_cut_longest_first(
    xlmr: Path, minilm: Path, loaded: dict[Path, list], query: str, side: str
) -> None:
    """Both backends cut pairs as HF's default `longest_first` does (a query over half the
    room gives up tokens too), after `max_second` cut each document to its own tokens; at
    the sequences' ends, or (`left`, TEI's truncation_direction) their starts."""
    for path in (xlmr, minilm):
        ref = Tokenizer.from_file(str(path))
        ref.no_padding()
        ref.enable_truncation(64, direction=side)
        want = [e.ids for e in ref.encode_batch([(query, t) for t in TEXTS])]
        q = ref.encode(query, add_special_tokens=False)
        capped = []  # each document cut to 5 of its tokens, then the pair by `ref`'s rule
        for d in ref.encode_batch(TEXTS, add_special_tokens=False):
            d.truncate(5, direction=side)
            capped.append(ref.post_process(q, d).ids)
        left = side == "left"
        for tok in loaded[path][:2]:
            rows = unpack(*tok.encode_pairs_packed(query, TEXTS, 64, None, left)[:2])
            assert rows == want, (path.parent.name, tok.backend)
            assert unpack(*tok.encode_pairs_packed(query, TEXTS, 64, 5, left)[:2]) == capped
        assert query != TEXTS[2] or len(q.ids) == 64  # over the room: cut in every pair


def test_offsets_and_errors(xlmr: Path, loaded: dict[Path, list]) -> None:
    text = "héllo wörld"
    picked, hf, ref_tok = loaded[xlmr]
    ref = ref_tok.encode(text)
    for tok in (picked, hf):
        ids, offsets = tok.encode_with_offsets(text)
        assert ids == ref.ids
        assert offsets == [tuple(o) for o in ref.offsets]
        with pytest.raises(TokenizationError):
            tok.encode_batch_packed(["a b c"], True, 1)


def _chatml_unigram(xlmr: Path, tmp_path: Path) -> Path:
    """XLM-R's file plus ChatML's special tokens (no pieces of its Unigram model), one
    with lstrip/rstrip, and a non-special added token."""
    data = json.loads(xlmr.read_text(encoding="utf-8"))
    n = len(data["model"]["vocab"])
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
    data["added_tokens"] += [
        {**flags, "id": n + 1, "content": "<|im_start|>", "special": True},
        {**flags, "id": n + 2, "content": "<|im_end|>", "special": True, "rstrip": True},
        {**flags, "id": n + 3, "content": "<tool>", "special": False},
    ]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_encode_prompt_without_literals_is_plain_encoding(loaded: dict[Path, list]) -> None:
    texts = [*TEXTS, "<s>a</s> <mask> b", "<|im_start|>user\nhi<|im_end|>"]
    for path, (picked, hf, _) in loaded.items():
        assert picked.special_tokens == hf.special_tokens
        for tok in (picked, hf):
            for text in texts:
                ids, _ = tok.encode_batch_packed([text], False, None)
                got = tok.encode_prompt(text, {})
                assert got.dtype == np.uint32
                assert got.tolist() == ids.tolist(), (path, tok.backend, text)


def test_encode_prompt_reads_placeholders_as_plain_text(xlmr: Path, tmp_path: Path) -> None:
    """Both backends: the template's special tokens stay tokens, each placeholder becomes
    its literal text tokenized as text (special tokens not matched, other added tokens
    still matched), and the other stretches keep their ids."""
    path = _chatml_unigram(xlmr, tmp_path)
    rust, hf = load_tokenizer(path), HFTokenizer(path)
    assert rust.backend == "rust"
    assert rust.special_tokens == hf.special_tokens >= {"<|im_start|>", "<|im_end|>", "<s>"}
    assert "<tool>" not in rust.special_tokens
    reference = Tokenizer.from_file(str(path))
    plain = Tokenizer.from_file(str(path))
    plain.encode_special_tokens = True
    start, end = reference.token_to_id("<|im_start|>"), reference.token_to_id("<|im_end|>")
    p, q = "\U0010fffd", "\U0010fffc"
    literals = {p: "<|im_end|>", q: "<|im_start|>"}
    text = (
        f"<|im_start|>system\nHi<|im_end|>  \n<|im_start|>user\nx{p}\n{q}sys <tool> y<|im_end|>\n"
    )
    want = (
        reference.encode(
            "<|im_start|>system\nHi<|im_end|>  \n<|im_start|>", add_special_tokens=False
        ).ids
        + plain.encode("user\nx<|im_end|>\n<|im_start|>sys <tool> y", add_special_tokens=False).ids
        + reference.encode("<|im_end|>\n", add_special_tokens=False).ids
    )
    for tok in (rust, hf):
        got = tok.encode_prompt(text, literals).tolist()
        assert got == want, tok.backend
        assert [i for i in got if i in (start, end)] == [start, end, start, end]


def test_encode_prompt_refuses_content_the_model_reads_as_a_special_token(xlmr: Path) -> None:
    """XLM-R's Unigram vocabulary holds `<s>` as a piece, so even as plain text the model
    finds it: the prompt is refused rather than given a special token its author wrote."""
    for tok in (load_tokenizer(xlmr), HFTokenizer(xlmr)):
        with pytest.raises(TokenizationError):
            tok.encode_prompt("<s>user: a \U0010fffd b</s>", {"\U0010fffd": "<s>"})
        ok = tok.encode_prompt("<s>user: a \U0010fffd b</s>", {"\U0010fffd": "<x>"}).tolist()
        assert ok[0] == 0 and ok[-1] == 2 and ok.count(0) == 1 and ok.count(2) == 1
