"""Ivy's logprobs shaping (`ivy.logprobs`) without a server: token texts and bytes
against Hugging Face `tokenizers` decoding the same ids (byte-level BPE: SmolLM2;
SentencePiece Unigram: XLM-R; a byte-fallback BPE built here), the legacy shape's offsets
and chosen-token rule, and Tulip's mapping of the wire field onto `SamplingParams`."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from ivy.logprobs import CompletionLogprobsBuilder, TokenPieces, chat_logprobs
from protos.trellis.v1 import inference_pb2 as pb
from tulip.errors import InvalidInput
from tulip.inputs import ModelLimits, generate_work

TEXTS = [
    "The capital of France is Paris.",
    "  two spaces, tabs\tand\nnewlines",
    "Ünïcödé: 東京は日本の首都です。 Привет, мир! 🙂👍🏽",
    "def add(a, b):\n    return a + b",
]


def _asset(name: str) -> Path:
    from rose.assets import ensure_model

    return Path(ensure_model(name)) / "tokenizer.json"


@pytest.mark.parametrize("asset", ["smollm2-135m-instruct", "xlmr-tokenizer"])
def test_token_bytes_rebuild_the_decoded_text(asset: str) -> None:
    path = _asset(asset)
    tok = tokenizers.Tokenizer.from_file(str(path))
    pieces = TokenPieces.from_file(path)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        joined = b"".join(pieces.bytes_of(i) for i in ids).decode("utf-8")
        want = tok.decode(ids)
        # SentencePiece's decoder drops the space it put before the first word
        assert joined == want or joined.removeprefix(" ") == want, (joined, want)
        for i in ids:
            raw = pieces.bytes_of(i)
            try:
                alone = raw.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: OpenAI's bytes: form
                assert pieces.text_of(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            else:
                assert pieces.text_of(i) == alone
                assert alone.strip() == tok.decode([i]).strip()


def test_byte_level_splits_rare_characters_over_tokens() -> None:
    path = _asset("smollm2-135m-instruct")
    tok = tokenizers.Tokenizer.from_file(str(path))
    pieces = TokenPieces.from_file(path)
    ids = tok.encode("👍🏽", add_special_tokens=False).ids
    texts = [pieces.text_of(i) for i in ids]
    assert any(t.startswith("bytes:") for t in texts), texts
    assert b"".join(pieces.bytes_of(i) for i in ids) == "👍🏽".encode()
    special = tok.token_to_id("<|im_end|>")
    assert pieces.text_of(special) == "<|im_end|>"


def test_byte_fallback_pieces_are_their_byte(tmp_path: Path) -> None:
    """A SentencePiece-style BPE with byte fallback (Llama / Gemma tokenizers)."""
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁a": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    tok = tokenizers.Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    pieces = TokenPieces.from_file(path)
    text = "a aé 東"
    ids = tok.encode(text).ids
    assert 4 + 0xC3 in ids  # é went through byte fallback
    assert b"".join(pieces.bytes_of(i) for i in ids).decode() == " " + tok.decode(ids)
    assert pieces.bytes_of(4 + 0xC3) == b"\xc3"
    assert pieces.text_of(4 + 0xC3) == "bytes:\\xc3"
    assert pieces.text_of(3) == " a"


def _entry(logprob: float, top: list[tuple[int, float]]) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        logprob=logprob, top_ids=[i for i, _ in top], top_logprobs=[v for _, v in top]
    )


def test_chat_and_legacy_shapes() -> None:
    path = _asset("smollm2-135m-instruct")
    tok = tokenizers.Tokenizer.from_file(str(path))
    pieces = TokenPieces.from_file(path)
    ids = tok.encode("Hé 👍 ok", add_special_tokens=False).ids
    other = tok.token_to_id("the")
    entries = [_entry(-0.5 - i, [(i_, -0.25), (other, -1.5)]) for i, i_ in enumerate(ids)]

    chat = chat_logprobs(pieces, ids, entries)
    assert chat.content is not None and len(chat.content) == len(ids)
    first = chat.content[0]
    assert (first.token, first.bytes) == (pieces.text_of(ids[0]), list(pieces.bytes_of(ids[0])))
    assert first.logprob == pytest.approx(-0.5)
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [
        (pieces.text_of(ids[0]), -0.25),
        ("the", -1.5),
    ]

    # legacy, in two chunks: offsets run on; the chosen token is always in top_logprobs
    builder = CompletionLogprobsBuilder(pieces)
    a = builder.add(ids[:2], entries[:2])
    b = builder.add(ids[2:], [_entry(-3.0, [(other, -0.1)]) for _ in ids[2:]])
    tokens = a.tokens + b.tokens
    offsets = a.text_offset + b.text_offset
    text = "Hé 👍 ok"
    assert offsets[0] == 0
    # every complete token starts at its text's offset in the decoded output
    for t, o in zip(tokens, offsets, strict=True):
        if not t.startswith("bytes:"):
            assert text[o : o + len(t)] == t, (t, o)
    assert b.top_logprobs[0] == {"the": pytest.approx(-0.1), b.tokens[0]: -3.0}
    assert a.token_logprobs == [pytest.approx(-0.5), pytest.approx(-1.5)]

    with pytest.raises(ValueError, match="logprobs for"):
        chat_logprobs(pieces, ids, entries[:-1])


LIMITS = ModelLimits(
    kind="generator", vocab_size=100, max_input_tokens=64, dimensions=0, default_normalize=False
)


def _request(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt_ids=(1).to_bytes(4, "little"), sampling=pb.SamplingOptions(**sampling)
    )


def test_tulip_maps_top_logprobs_onto_sampling() -> None:
    assert generate_work(_request(), LIMITS).sampling_kwargs(4)["logprobs"] is None
    assert generate_work(_request(top_logprobs=0), LIMITS).sampling_kwargs(4)["logprobs"] == 0
    assert generate_work(_request(top_logprobs=20), LIMITS).sampling_kwargs(4)["logprobs"] == 20
    with pytest.raises(InvalidInput, match="sampling.top_logprobs"):
        generate_work(_request(top_logprobs=21), LIMITS)
    work = generate_work(_request(prompt_logprobs=3), LIMITS).sampling_kwargs(4)
    assert (work["prompt_logprobs"], work["logprobs"]) == (3, None)
    assert generate_work(_request(), LIMITS).sampling_kwargs(4)["prompt_logprobs"] is None
    with pytest.raises(InvalidInput, match="sampling.prompt_logprobs: 21 alternatives"):
        generate_work(_request(prompt_logprobs=21), LIMITS)
