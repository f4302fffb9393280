"""`EngineConfig`: every knob of the engine, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from rose.errors import EngineError

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_MODES",
    "DTYPES",
    "QUANTIZATIONS",
    "SDPA_STRATEGIES",
    "EngineConfig",
]

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("sdpa", "flashinfer", "onnxruntime")
SDPA_STRATEGIES = ("auto", "per-sequence", "block-diagonal")
ATTENTION_MODES = ("auto", "causal", "bidirectional")
QUANTIZATIONS = ("int8",)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model.

    device: "cpu", "cuda" or "cuda:N".
    dtype: None picks float32 on CPU and bfloat16 on CUDA; else one of `DTYPES`.
    cuda_graphs: capture and replay CUDA graphs (ignored on CPU).
    max_graphs: how many captured graphs are kept (least recently used are evicted).
    max_graph_tokens: batches with more tokens than this always run eagerly.
    attention: None picks FlashInfer on CUDA when importable, ONNX Runtime's attention kernel
        for bidirectional passes on CPU, else SDPA; or one of `ATTENTION_BACKENDS` to insist
        (FlashInfer and ONNX Runtime still fall back, with a log line, when absent).
    sdpa_strategy: how SDPA avoids padding on ragged batches: one call per sequence, one call
        with a block-diagonal mask, or "auto" (a cost model picks per batch).
    packed_weights: on CPU, run linear layers on weights packed once for oneDNN, with the
        MLP activation fused (`rose.packed`); False keeps PyTorch's default ``F.linear``.
    attention_mode: "auto" takes what the model directory says (decoder-based embedders such
        as Qwen3-Embedding attend causally, pplx-embed's Qwen3 bidirectionally; BERT-like
        encoders always bidirectionally); "causal" or "bidirectional" insists, and a family
        that cannot run that way refuses to load.
    quantize: None, or "int8" (CPU, float32 activations, BERT / XLM-R / Qwen3 encoders and
        cross-encoders): the encoder's linear layers on int8 weights (`rose.int8`).
    cpu_pass_tokens: on CPU an eager pass over more tokens than this runs the encoder over
        groups of consecutive whole rows of at most this many tokens (a longer row alone) and
        joins their hidden states: the activations of a group stay in the CPU's caches (a
        32 x 512-token batch ran 1.3x faster in fp32 and 1.45x in int8 in groups of 2,048;
        bench/results/engine.md). Rows are independent, so the result is the same. None (the
        default): 2,048 tokens, 512 for int8, whose products run one call per sequence
        whatever the group (`rose.int8.per_sequence`), so a larger group only adds the joins
        of those calls' outputs: int8 at 32 x 512 / 32 x 128, one thread, groups of 512 vs
        2,048 tokens, 3123 vs 2748 / 3191 vs 2799 tok/s on an Intel Xeon, 2270 vs 2256 at
        32 x 512 on AMD Zen 4 (`resolved_cpu_pass_tokens`).
    accuracy_gate: a reduced CPU mode (int8, or a bfloat16 / float16 dtype on CPU) is compared
        with float32 at load on `rose.int8`'s check set and refused (EngineError) below its
        bound; False skips the check (for measurements that want the number, not a verdict).
    """

    device: str = "cpu"
    dtype: str | None = None
    cuda_graphs: bool = True
    max_graphs: int = 64
    max_graph_tokens: int = 8192
    attention: str | None = None
    sdpa_strategy: str = "auto"
    packed_weights: bool = True
    attention_mode: str = "auto"
    quantize: str | None = None
    accuracy_gate: bool = True
    cpu_pass_tokens: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not (
            self.device == "cpu"
            or self.device == "cuda"
            or (self.device.startswith("cuda:") and self.device[5:].isdigit())
        ):
            raise EngineError(
                f"EngineConfig.device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.dtype is not None and self.dtype not in DTYPES:
            raise EngineError(
                f"EngineConfig.dtype must be None or one of {DTYPES}, got {self.dtype!r}"
            )
        if not isinstance(self.max_graphs, int) or self.max_graphs < 1:
            raise EngineError(
                f"EngineConfig.max_graphs must be an integer >= 1, got {self.max_graphs!r}"
            )
        if not isinstance(self.max_graph_tokens, int) or self.max_graph_tokens < 1:
            raise EngineError(
                f"EngineConfig.max_graph_tokens must be an integer >= 1, got {self.max_graph_tokens!r}"
            )
        if self.attention is not None and self.attention not in ATTENTION_BACKENDS:
            raise EngineError(
                f"EngineConfig.attention must be None or one of {ATTENTION_BACKENDS}, got {self.attention!r}"
            )
        if self.sdpa_strategy not in SDPA_STRATEGIES:
            raise EngineError(
                f"EngineConfig.sdpa_strategy must be one of {SDPA_STRATEGIES}, got {self.sdpa_strategy!r}"
            )
        if self.attention_mode not in ATTENTION_MODES:
            raise EngineError(
                f"EngineConfig.attention_mode must be one of {ATTENTION_MODES}, got {self.attention_mode!r}"
            )
        if self.quantize is not None:
            if self.quantize not in QUANTIZATIONS:
                raise EngineError(
                    f"EngineConfig.quantize must be None or one of {QUANTIZATIONS}, got {self.quantize!r}"
                )
            if self.is_cuda:
                raise EngineError("EngineConfig.quantize='int8' runs on the CPU only")
            if self.resolved_dtype != "float32":
                raise EngineError(
                    f"EngineConfig.quantize='int8' computes in float32 between its int8 products; "
                    f"dtype {self.dtype!r} cannot be combined with it"
                )
        if self.cpu_pass_tokens is not None and (
            not isinstance(self.cpu_pass_tokens, int) or self.cpu_pass_tokens < 1
        ):
            raise EngineError(
                f"EngineConfig.cpu_pass_tokens must be None or an integer >= 1, got "
                f"{self.cpu_pass_tokens!r}"
            )
        if not isinstance(self.accuracy_gate, bool):
            raise EngineError(
                f"EngineConfig.accuracy_gate must be a boolean, got {self.accuracy_gate!r}"
            )
        if not isinstance(self.packed_weights, bool):
            raise EngineError(
                f"EngineConfig.packed_weights must be a boolean, got {self.packed_weights!r}"
            )

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def resolved_cpu_pass_tokens(self) -> int:
        """The most tokens one CPU encoder pass takes (`cpu_pass_tokens`; None: by mode)."""
        if self.cpu_pass_tokens is not None:
            return self.cpu_pass_tokens
        return 512 if self.quantize == "int8" else 2048

    @property
    def resolved_dtype(self) -> str:
        """The dtype weights and activations use: the explicit one, else by device."""
        if self.dtype is not None:
            return self.dtype
        return "bfloat16" if self.is_cuda else "float32"
