"""Asset ``xlmr-tokenizer``: the XLM-R Unigram tokenizer.json, built from a GGUF vocab.

The source is ``vendor/llama.cpp/models/ggml-vocab-nomic-bert-moe.gguf`` inside the
llama-cpp-python sdist (read straight out of the tar; nothing is built). It holds the
XLM-R SentencePiece vocabulary (pieces, scores, token types), the SentencePiece
``precompiled_charsmap`` and padding entries that round the table up; the padding is
dropped so the vocabulary has exactly 250,002 pieces.

Two files are written, in the two shapes XLM-R tokenizer.json files exist in:
``tokenizer.json`` mirrors what ``transformers``' ``XLMRobertaConverter`` emits today,
``tokenizer-legacy.json`` the older shape (``Precompiled`` normalizer, WhitespaceSplit +
Metaspace(add_prefix_space) pre-tokenizer); ``to_legacy`` rewrites one into the other.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

from rose.assets.errors import AssetError
from rose.assets.registry import Log

__all__ = [
    "GGUF_MEMBER",
    "LEGACY_FILE",
    "VOCAB_SIZE",
    "build_tokenizer_json",
    "convert",
    "to_legacy",
    "verify",
    "write_tokenizer_configs",
]

GGUF_MEMBER = "vendor/llama.cpp/models/ggml-vocab-nomic-bert-moe.gguf"
LEGACY_FILE = "tokenizer-legacy.json"
VOCAB_SIZE = 250_002
_MASK_ID = 250_001
# llama.cpp token types (llama_token_type): 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused (the padding entries), 6 byte.
_NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED = 1, 2, 3, 4, 5
_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3, "<mask>": _MASK_ID}
_SPACE = "\u2581"

# (text, ids) pairs whose ids come from the published XLM-R tokenizer; both shapes must match.
REFERENCE_CASES: tuple[tuple[str, list[int]], ...] = (
    ("Hello, my dog is cute", [0, 35378, 4, 759, 10269, 83, 99942, 2]),
    ("Hello world", [0, 35378, 8999, 2]),
)
# Multilingual texts: both shapes must agree, no piece may be <unk>, and decoding must
# give back the text (these scripts are all in XLM-R's training languages).
MULTILINGUAL_TEXTS: tuple[str, ...] = (
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "我喜欢在周末读书和散步。",
    "東京は日本の首都です。",
    "서울은 대한민국의 수도입니다.",
    "القاهرة هي عاصمة مصر.",
    "हिन्दी भारत की एक आधिकारिक भाषा है।",
    "Ο Όλυμπος είναι το ψηλότερο βουνό της Ελλάδας.",
    "query: how much protein should a female eat",
)


def convert(package_file: Path, out_dir: Path, log: Log) -> None:
    log(f"xlmr-tokenizer: reading {GGUF_MEMBER} from {package_file.name}")
    gguf_path = out_dir / ".vocab.gguf"
    _extract_member(package_file, GGUF_MEMBER, gguf_path)
    try:
        log("xlmr-tokenizer: building tokenizer.json (transformers' XLM-R shape)")
        data = build_tokenizer_json(gguf_path)
    finally:
        gguf_path.unlink(missing_ok=True)
    _write_json(out_dir / "tokenizer.json", data)
    log(f"xlmr-tokenizer: writing {LEGACY_FILE} (older shape)")
    _write_json(out_dir / LEGACY_FILE, to_legacy(data))
    write_tokenizer_configs(out_dir)


def _extract_member(archive: Path, suffix: str, dest: Path) -> None:
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                if member.isfile() and member.name.endswith("/" + suffix):
                    src = tar.extractfile(member)
                    if src is None:
                        break
                    with src, dest.open("wb") as out:
                        while block := src.read(1 << 20):
                            out.write(block)
                    return
    except (tarfile.TarError, OSError) as exc:
        raise AssetError(f"xlmr-tokenizer: cannot read {archive.name}: {exc}") from exc
    raise AssetError(f"xlmr-tokenizer: {archive.name} has no member */{suffix}")


def _read_gguf_vocab(path: Path) -> tuple[list[str], list[float], list[int], bytes, int]:
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None:
            raise AssetError(f"xlmr-tokenizer: GGUF has no {key}")
        return f.contents()

    if field("tokenizer.ggml.model") != "t5":
        raise AssetError("xlmr-tokenizer: GGUF tokenizer.ggml.model is not a Unigram ('t5') vocab")
    pieces = list(field("tokenizer.ggml.tokens"))
    scores = [float(s) for s in field("tokenizer.ggml.scores")]
    types = [int(t) for t in field("tokenizer.ggml.token_type")]
    charsmap = bytes(field("tokenizer.ggml.precompiled_charsmap"))
    unk_id = int(field("tokenizer.ggml.unknown_token_id"))
    return pieces, scores, types, charsmap, unk_id


def build_tokenizer_json(gguf_path: Path) -> dict[str, Any]:
    """The tokenizer.json (as a dict) in the shape ``XLMRobertaConverter`` produces."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import Unigram

    pieces, scores, types, charsmap, unk_id = _read_gguf_vocab(gguf_path)
    if not (len(pieces) == len(scores) == len(types)):
        raise AssetError("xlmr-tokenizer: GGUF tokens, scores and token types differ in length")
    # Drop the padding entries (type "unused") that round the table up past the real vocab.
    keep = [i for i, t in enumerate(types) if t != _UNUSED]
    if keep != list(range(len(keep))):
        raise AssetError("xlmr-tokenizer: GGUF padding entries are not all at the end")
    pieces, scores, types = pieces[: len(keep)], scores[: len(keep)], types[: len(keep)]
    if len(pieces) != VOCAB_SIZE:
        raise AssetError(f"xlmr-tokenizer: expected {VOCAB_SIZE} pieces, GGUF has {len(pieces)}")
    for piece, expected in _SPECIALS.items():
        if pieces[expected] != piece or types[expected] not in (_CONTROL, _UNKNOWN):
            raise AssetError(f"xlmr-tokenizer: expected special {piece} at id {expected}")
    if unk_id != _SPECIALS["<unk>"]:
        raise AssetError(f"xlmr-tokenizer: GGUF unknown_token_id is {unk_id}, expected 3")
    if any(t not in (_NORMAL, _CONTROL, _UNKNOWN) for t in types):
        raise AssetError("xlmr-tokenizer: unexpected token types (user-defined or byte pieces)")

    tok = Tokenizer(
        Unigram(list(zip(pieces, scores, strict=True)), unk_id=unk_id, byte_fallback=False)
    )
    # transformers' SpmConverter: charsmap, strip the right end, runs of spaces -> one "▁".
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Precompiled(charsmap),
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), _SPACE),
        ]
    )
    # XLM-R has add_prefix_space and no `legacy` attribute -> prepend_scheme "always".
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPACE, prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement=_SPACE, prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tok.add_special_tokens(
        [
            AddedToken(piece, normalized=False, special=True, lstrip=piece == "<mask>")
            for piece in _SPECIALS
        ]
    )
    data: dict[str, Any] = json.loads(tok.to_str())
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    if ids != _SPECIALS:
        raise AssetError(f"xlmr-tokenizer: added tokens landed at {ids}, expected {_SPECIALS}")
    return data


def to_legacy(data: dict[str, Any]) -> dict[str, Any]:
    """Rewrite an XLM-R tokenizer.json (as a dict) into the older shape: normalizer
    ``Precompiled`` only, pre-tokenizer ``Sequence[WhitespaceSplit, Metaspace]`` and a
    Metaspace decoder, both written with ``add_prefix_space: true``."""
    out = json.loads(json.dumps(data))
    normalizer = out.get("normalizer") or {}
    if normalizer.get("type") == "Sequence":
        found = [n for n in normalizer.get("normalizers", []) if n.get("type") == "Precompiled"]
        normalizer = found[0] if found else {}
    if normalizer.get("type") != "Precompiled":
        raise AssetError("to_legacy: the tokenizer.json has no Precompiled normalizer")
    out["normalizer"] = normalizer
    metaspace = {"type": "Metaspace", "replacement": _SPACE, "add_prefix_space": True}
    out["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [{"type": "WhitespaceSplit"}, dict(metaspace)],
    }
    out["decoder"] = dict(metaspace)
    return out


def write_tokenizer_configs(out_dir: Path) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` as XLM-R ships them."""
    tokens = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "cls_token": "<s>",
        "mask_token": {
            "content": "<mask>",
            "lstrip": True,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
    }
    _write_json(out_dir / "special_tokens_map.json", tokens)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            **tokens,
            "tokenizer_class": "XLMRobertaTokenizer",
            "model_max_length": 512,
            "add_prefix_space": True,
            "clean_up_tokenization_spaces": True,
        },
    )


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def verify(model_dir: Path, log: Log) -> None:
    """Check both shapes with HF ``tokenizers``; raise ``AssetError`` on any mismatch."""
    from tokenizers import Tokenizer

    new = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    old = Tokenizer.from_file(str(model_dir / LEGACY_FILE))
    for label, tok in (("tokenizer.json", new), (LEGACY_FILE, old)):
        size = tok.get_vocab_size(with_added_tokens=True)
        if size != VOCAB_SIZE:
            raise AssetError(f"xlmr-tokenizer: {label} has {size} pieces, expected {VOCAB_SIZE}")
        for text, expected in REFERENCE_CASES:
            got = tok.encode(text).ids
            if got != expected:
                raise AssetError(
                    f"xlmr-tokenizer: {label} encodes {text!r} as {got}, expected {expected}"
                )
        for piece, expected_id in _SPECIALS.items():
            if tok.token_to_id(piece) != expected_id:
                raise AssetError(
                    f"xlmr-tokenizer: {label} maps {piece} to {tok.token_to_id(piece)}"
                )
    for text in MULTILINGUAL_TEXTS:
        a, b = new.encode(text).ids, old.encode(text).ids
        if a != b:
            raise AssetError(f"xlmr-tokenizer: the two shapes disagree on {text!r}: {a} vs {b}")
        if _SPECIALS["<unk>"] in a:
            raise AssetError(f"xlmr-tokenizer: {text!r} produced <unk>: {a}")
        decoded = new.decode(a, skip_special_tokens=True)
        if decoded != text:
            raise AssetError(f"xlmr-tokenizer: decode(encode({text!r})) gave {decoded!r}")
    log(
        f"xlmr-tokenizer: {VOCAB_SIZE} pieces; {len(REFERENCE_CASES)} reference encodings and "
        f"{len(MULTILINGUAL_TEXTS)} multilingual round trips pass in both shapes"
    )
