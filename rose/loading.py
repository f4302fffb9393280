"""Reading a Hugging Face model directory: config.json, the sentence-transformers settings
(modules.json, pooling, prompts, max_seq_length) and the weights (safetensors, sharded
safetensors or pytorch_model.bin)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rose.errors import EngineError

__all__ = [
    "DenseLayer",
    "ModelInfo",
    "SentenceSettings",
    "read_config",
    "read_dense",
    "read_logit_score",
    "read_sentence_settings",
    "read_splade",
    "read_tensors",
]

_ST_POOLING_LEGACY = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
_ST_POOLING_SUPPORTED = {"mean": "mean", "cls": "cls", "lasttoken": "last"}
# sentence-transformers module classes (last component of "type" in modules.json);
# MLMTransformer is a Transformer whose output is the masked-LM logits (SparseEncoder).
_ST_MODULES_SUPPORTED = {
    "Transformer",
    "Pooling",
    "Dense",
    "Normalize",
    "MLMTransformer",
    "SpladePooling",
}
# Dense activation_function (its class path in the module's config.json) → `DenseLayer.activation`
_DENSE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.modules.activation.Tanh": "tanh",
}
# SpladePooling settings served: max over tokens of log(1 + relu(logits)).
_SPLADE_SUPPORTED = {"pooling_strategy": "max", "activation_function": "relu"}


@dataclass(frozen=True)
class ModelInfo:
    """What a loaded model is and how it is used by default."""

    name: str
    kind: str  # "embedding" | "cross-encoder"
    dimensions: int
    max_input_tokens: int
    vocab_size: int
    num_labels: int
    default_pooling: str  # "mean" | "cls" | "last"
    default_normalize: bool
    query_prompt: str
    document_prompt: str
    device: str
    dtype: str
    token_types: int = 2  # token type ids the model takes (0..token_types-1); 1: none
    # output kinds an embedding model offers (`rose.heads.OUTPUT_KINDS`); () for others
    outputs: tuple[str, ...] = ("dense",)


@dataclass(frozen=True)
class SentenceSettings:
    """The sentence-transformers side of a model directory (defaults when absent; pooling
    None: no Pooling module, the model family's default applies)."""

    pooling: str | None = None
    normalize: bool = False
    query_prompt: str = ""
    document_prompt: str = ""
    max_seq_length: int | None = None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EngineError(f"{path}: file is missing") from None
    except (OSError, ValueError) as exc:
        raise EngineError(f"{path}: cannot read JSON ({exc})") from None


def read_config(model_dir: Path) -> dict[str, Any]:
    """config.json as a dict (the model family reads it: `rose.models.FAMILIES`)."""
    if not model_dir.is_dir():
        raise EngineError(f"model directory {model_dir} does not exist")
    raw = _read_json(model_dir / "config.json")
    if not isinstance(raw, dict):
        raise EngineError(f"{model_dir / 'config.json'}: expected a JSON object")
    return raw


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers ``Dense`` module: ``activation(x @ weight.T + bias)`` on each
    pooled vector (EmbeddingGemma's 768 -> 3072 -> 768 projections, LaBSE's tanh layer)."""

    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None  # [out] float32
    activation: str  # "identity" | "tanh"


def _st_modules(model_dir: Path) -> list[dict[str, Any]]:
    """modules.json's entries in order ([] without the file)."""
    modules_path = model_dir / "modules.json"
    if not modules_path.exists():
        return []
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise EngineError(f"{modules_path}: expected a JSON list of objects")
    return modules


def _kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def read_dense(model_dir: Path, width: int) -> tuple[DenseLayer, ...]:
    """The ``Dense`` modules between Pooling and Normalize, in order, their shapes chained from
    the pooled `width` (EngineError for a Dense elsewhere, a misfit shape or an activation
    other than Identity / Tanh)."""
    modules = _st_modules(model_dir)
    kinds = [_kind(m) for m in modules]
    layers: list[DenseLayer] = []
    for i, (module, kind) in enumerate(zip(modules, kinds, strict=True)):
        if kind != "Dense":
            continue
        if "Pooling" not in kinds[:i] or "Normalize" in kinds[:i]:
            raise EngineError(
                f"{model_dir / 'modules.json'}: a Dense module is served only between Pooling "
                "and Normalize"
            )
        folder = model_dir / str(module.get("path", ""))
        raw = _read_json(folder / "config.json")
        names = {raw.get("module_input_name"), raw.get("module_output_name")} - {None}
        if raw.get("use_residual") or names - {"sentence_embedding"}:
            raise EngineError(
                f"{folder / 'config.json'}: a Dense module is served on the sentence embedding "
                "only, without use_residual"
            )
        name = str(raw.get("activation_function", "torch.nn.modules.linear.Identity"))
        if name not in _DENSE_ACTIVATIONS:
            raise EngineError(
                f"{folder / 'config.json'}: Dense activation_function {name!r} is not supported "
                f"(supported: {sorted(_DENSE_ACTIVATIONS)})"
            )
        tensors = read_tensors(folder)
        weight = tensors.get("linear.weight")
        bias = tensors.get("linear.bias") if raw.get("bias", True) else None
        want = (int(raw.get("out_features", -1)), width)
        if weight is None or tuple(weight.shape) != want:
            got = None if weight is None else tuple(weight.shape)
            raise EngineError(f"{folder}: Dense linear.weight has shape {got}, expected {want}")
        if raw.get("bias", True) and (bias is None or tuple(bias.shape) != (want[0],)):
            raise EngineError(f"{folder}: Dense linear.bias is missing or not [{want[0]}]")
        layers.append(
            DenseLayer(
                weight.float(),
                None if bias is None else bias.float(),
                _DENSE_ACTIVATIONS[name],
            )
        )
        width = want[0]
    return tuple(layers)


def read_logit_score(model_dir: Path) -> tuple[int, int | None] | None:
    """(true_token_id, false_token_id or None) of a sentence-transformers ``LogitScore``
    module (a causal LM served as a reranker: Qwen3-Reranker in sentence-transformers >= 5.4),
    or None when modules.json has none."""
    for module in _st_modules(model_dir):
        if _kind(module) != "LogitScore":
            continue
        path = model_dir / str(module.get("path", "")) / "config.json"
        raw = _read_json(path)
        try:
            true_id = int(raw["true_token_id"])
            false_id = raw.get("false_token_id")
            return true_id, None if false_id is None else int(false_id)
        except (KeyError, TypeError, ValueError):
            raise EngineError(f"{path}: expected an integer true_token_id") from None
    return None


def read_splade(model_dir: Path) -> bool:
    """Whether modules.json ends in sentence-transformers' ``SpladePooling`` (a SparseEncoder:
    SPLADE's sparse output from the masked-LM head)."""
    return any(_kind(module) == "SpladePooling" for module in _st_modules(model_dir))


def read_sentence_settings(model_dir: Path, classifier: bool) -> SentenceSettings:
    """Pooling from the Pooling module's config, normalize from a Normalize module, prompts
    from config_sentence_transformers.json, max_seq_length from sentence_bert_config.json."""
    if classifier:
        return SentenceSettings(pooling="cls", normalize=False)
    pooling: str | None = None
    normalize = False
    for module in _st_modules(model_dir):
        kind = _kind(module)
        if kind not in _ST_MODULES_SUPPORTED:
            raise EngineError(
                f"{model_dir / 'modules.json'}: sentence-transformers module {kind!r} is not "
                "supported"
            )
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            pooling = _read_pooling(model_dir / str(module.get("path", "")) / "config.json")
        elif kind == "SpladePooling":
            _check_splade(model_dir / str(module.get("path", "")) / "config.json")
    prompts: dict[str, str] = {}
    st_config = model_dir / "config_sentence_transformers.json"
    if st_config.exists():
        prompts = dict(_read_json(st_config).get("prompts") or {})
    max_seq_length = None
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.exists():
        value = _read_json(bert_config).get("max_seq_length")
        max_seq_length = int(value) if value is not None else None
    return SentenceSettings(
        pooling=pooling,
        normalize=normalize,
        query_prompt=str(prompts.get("query", "")),
        document_prompt=str(prompts.get("passage", prompts.get("document", ""))),
        max_seq_length=max_seq_length,
    )


def _check_splade(path: Path) -> None:
    raw = _read_json(path) if path.exists() else {}
    for key, served in _SPLADE_SUPPORTED.items():
        value = raw.get(key, served)
        if value != served:
            raise EngineError(
                f"{path}: SpladePooling {key} {value!r} is not supported ({served!r})"
            )


def _read_pooling(path: Path) -> str:
    raw = _read_json(path)
    if raw.get("include_prompt", True) is not True:
        raise EngineError(f"{path}: include_prompt=false is not supported")
    mode = raw.get("pooling_mode")
    if mode is None:
        active = [name for key, name in _ST_POOLING_LEGACY.items() if raw.get(key)]
        mode = active if len(active) != 1 else active[0]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in _ST_POOLING_SUPPORTED:
        raise EngineError(
            f"{path}: pooling mode {mode!r} is not supported (supported: {sorted(_ST_POOLING_SUPPORTED)})"
        )
    return _ST_POOLING_SUPPORTED[mode]


def read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All checkpoint tensors on the CPU, from the first weight layout found:
    model.safetensors, model.safetensors.index.json (shards), pytorch_model.bin."""
    from safetensors.torch import load_file

    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    legacy = model_dir / "pytorch_model.bin"
    try:
        if single.exists():
            return load_file(str(single))
        if index.exists():
            shards = sorted(set(_read_json(index)["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                tensors.update(load_file(str(model_dir / shard)))
            return tensors
        if legacy.exists():
            loaded = torch.load(str(legacy), map_location="cpu", weights_only=True)
            return dict(loaded)
    except EngineError:
        raise
    except Exception as exc:
        raise EngineError(
            f"{model_dir}: cannot read weights ({type(exc).__name__}: {exc})"
        ) from None
    raise EngineError(
        f"{model_dir}: no weights (model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )
