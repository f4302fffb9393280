"""Reduced-precision CPU encoders: int8 linear layers, and the accuracy gate every reduced
mode (``--quantize int8``, ``--dtype bfloat16`` / ``float16`` on CPU) passes at load.

int8 scheme: the encoder's attention projections that keep or widen their width (BERT: the
fused QKV and the attention output; Qwen3: q and o, its grouped-query k / v being narrower)
hold int8 weights with one symmetric scale per output channel (``scale = max|w_row| / 127``).
Activations are quantized to uint8 at run time by PyTorch's dynamic quantized linear
(``torch.ops.quantized.linear_dynamic``: FBGEMM's VNNI kernel or oneDNN's, AMX int8 tiles where
the CPU has them, whichever this CPU runs faster (`_engine`), quantization and dequantization
fused into the product), one scale and zero
point per call over its input. Inside `Engine` passes each sequence of the ragged batch is
its own call (`per_sequence`): a text's int8 vector does not change with the texts it is
batched with, and a short query is not quantized on a long passage's range. (Where the float
layers run in bf16 on AMX, the bf16 kernel's own summation order still follows the row count,
moving a row's last bits with its batch: cosine 0.99993 on e5-small, as in any bf16 GEMM.) (One call over
the whole batch, as ONNX Runtime's and PyTorch's dynamic quantization do, gave a query
batched with long passages cosine 0.99955 to the same query alone, and a retrieval top-10
overlap of 0.940 against 0.953; quantizing every token on its own through ``torch._int_mm``
did as well, 0.958, but its unfused scaling passes cost 1.4-2x the fused kernel.) On CPUs
without VNNI the activations use 7 bits (``reduce_range``) so the non-VNNI kernel's 16-bit
pair sums cannot saturate.

Input channels with large values (LayerNorm outputs have a few) still cost every row
precision, so each int8 layer is smoothed first (SmoothQuant, Xiao et al. 2023): input
channel j is divided by ``s_j = max|x_j|^a / max|W[:, j]|^(1 - a)`` at run time and the
weight's column j multiplied by it, moving part of the channel's range into the per-channel
weight scales; ``max|x_j|`` comes from one fp32 pass over the check set at load
(`calibrate`). ``a = SMOOTH_ALPHA = 0.65`` was chosen on the check set (`CHECK_TEXTS`, not the
benchmark's texts) for multilingual-e5-small, with the MLP up projection still int8: mean per-row cosine to fp32 0.999806 / 0.999838
/ 0.999845 / 0.999835 / 0.999841 / 0.999823 at a = 0.5 / 0.6 / 0.65 / 0.7 / 0.75 / 0.8.

The MLPs stay float (their modules declare ``float_under_int8``), as do narrowing attention
projections. Both MLP projections cost retrieval accuracy out of proportion to their share
of the products: measured with bench/engine.py's retrieval check (multilingual-e5-small,
query → passage top-10 overlap with fp32 over 1,000 real passages, seeds 25 / 26 / 27), the
down projection in int8 (inputs: the activation's outputs, a few outlier channels) took the
worst row on a long passage to cosine 0.989; with it float and the up projection int8 the
overlap was 0.954 / 0.950 / 0.955, on the 0.95 bound, and moved to 0.941 / 0.951 / 0.958 with
nothing but the attention kernel changed; with the up projection float too it is 0.969 /
0.966 / 0.966 (mean per-row cosine 0.99990 against 0.99983), and no slower (32 x 512 tokens: 5020
against 4905 tokens/s, bf16 products being as fast here as int8 ones with their activation
quantization). (SmoothQuant strengths 0.4-0.9 on the up projection alone did not recover it.) The
float layers run in bf16 on oneDNN-packed weights, the up projection with its activation
fused, where this CPU's packed bf16 products are faster than its fp32 ones
(`rose.packed.bf16_speedup`, measured once at the first load), else packed fp32. Norms and
residuals stay float32, and so does attention unless the float layers are bf16 and the CPU
has AMX, where PyTorch's CPU kernel in bf16, casts included, is faster than ONNX Runtime's
fp32 one (`rose.attention.reduced_attention_pays`). Forced on a Zen 4 (where it is not
faster), bf16 attention left accuracy where fp32 attention has it: min cosine 0.99982 against
0.99983, top-10 overlap 0.966 against 0.957 (bench/engine.py's retrieval task).

Accuracy gate: `check_accuracy` runs the model's check inputs (`CHECK_TEXTS`, real
multilingual sentences tokenized by the directory's tokenizer.json, alone and joined into
~70-420-token rows) through the reduced engine and an fp32 engine of the same directory and
compares them row by row: pooled embeddings for embedding models, the mean of the final
hidden states for cross-encoders (whose one or few logits have no direction to compare).
The mode is refused (EngineError naming the mode, the measured minimum cosine and the bound)
when any row's cosine falls below `MIN_COSINE`. int8 is calibrated on these same texts, so
its gate is a floor against broken modes, not an unbiased estimate: the benchmark
(``python -m bench engine``) and the tests measure on other texts. `measure_modes` gives every
mode's minimum cosine for ``trellis models verify``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from rose.errors import EngineError

if TYPE_CHECKING:
    from rose.batch import RaggedBatch
    from rose.config import EngineConfig
    from rose.engine import Engine

__all__ = [
    "CHECK_TEXTS",
    "MIN_COSINE",
    "MODES",
    "SMOOTH_ALPHA",
    "Int8Linear",
    "calibrate",
    "check_accuracy",
    "check_batch",
    "float_layer_dtype",
    "int8_available",
    "measure_modes",
    "per_sequence",
    "quantize_int8",
    "reduced_mode",
    "row_cosines",
    "smoothing",
]

# The lowest per-row cosine to fp32 each reduced mode may have on the check inputs.
MIN_COSINE: dict[str, float] = {"bfloat16": 0.999, "float16": 0.999, "int8": 0.99}
# Modes `measure_modes` reports, as (label, EngineConfig overrides).
MODES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("float32", {"dtype": "float32"}),
    ("bfloat16", {"dtype": "bfloat16"}),
    ("int8", {"dtype": "float32", "quantize": "int8"}),
)

# Real sentences in 14 languages (news, notices, science, everyday life): the gate's check
# set. Not the benchmark's texts, so a mode is not tuned on what it is measured on.
CHECK_TEXTS: tuple[str, ...] = (
    "The city council voted to extend the night bus service to the airport from next spring.",
    "Researchers found that the coral recovered faster in reefs where fishing had been limited.",
    "Please return all borrowed equipment to the front desk before the end of the month.",
    "query: how long does it take to boil an egg",
    "passage: A soft-boiled egg needs about six minutes in boiling water; a hard one ten.",
    "Le gouvernement a présenté un plan pour rénover les écoles construites avant 1970.",
    "Les pêcheurs du port signalent une baisse des prises de sardines depuis trois ans.",
    "Die Stadtwerke erhöhen die Strompreise ab Januar um durchschnittlich vier Prozent.",
    "Im Herbst sammeln die Kinder Kastanien und basteln daraus kleine Figuren.",
    "El hospital inauguró una unidad de cuidados paliativos con doce camas nuevas.",
    "Los agricultores esperan que las lluvias de marzo salven la cosecha de trigo.",
    "La mostra raccoglie oltre duecento fotografie scattate durante gli anni Cinquanta.",
    "O festival de cinema exibirá filmes restaurados do início do século passado.",
    "De gemeente plant duizend nieuwe bomen langs de drukste straten van het centrum.",
    "Власти города пообещали отремонтировать все детские площадки до конца лета.",
    "Врачи рекомендуют делать перерыв каждые полчаса при работе за компьютером.",
    "東京の美術館では、江戸時代の浮世絵を集めた特別展が開かれている。",
    "この地域では、冬になると多くの渡り鳥が湖に集まる。",
    "新的高速公路通车后，两座城市之间的行车时间缩短了一半。",
    "图书馆每周六上午为儿童举办免费的故事会。",
    "정부는 내년부터 대중교통 요금을 동결하기로 결정했다.",
    "يعمل الباحثون على تطوير لقاح جديد ضد الإنفلونزا الموسمية.",
    "नई रेल लाइन से गांवों के लोगों को शहर पहुंचने में आसानी होगी।",
    "Mahakama imeamuru serikali kulipa fidia kwa wakulima walioathirika na mafuriko.",
)


def reduced_mode(config: EngineConfig) -> str | None:
    """The reduced CPU mode `config` asks for ("int8", "bfloat16", "float16"), or None for
    fp32 and for GPUs (whose bf16 default is not gated)."""
    if config.is_cuda:
        return None
    if config.quantize is not None:
        return config.quantize
    dtype = config.resolved_dtype
    return None if dtype == "float32" else dtype


# -- int8 layers -----------------------------------------------------------------------------


def int8_available() -> bool:
    """True when this PyTorch has the dynamic quantized linear and an x86 int8 engine."""
    return hasattr(torch.ops.quantized, "linear_dynamic") and bool(_engine())


@functools.cache
def _engine() -> str:
    """The quantized engine whose dynamic int8 linear runs fastest on this CPU ("" for
    none): FBGEMM (under ``x86``) or oneDNN, measured once per process like
    `rose.packed.bf16_speedup`. oneDNN uses AMX's int8 tiles where the CPU has them (Intel
    Sapphire Rapids and later: 1,206 against FBGEMM's 474 GFLOP/s on 512 x 384 -> 1,152,
    one thread); elsewhere FBGEMM's VNNI kernel has been the one to beat."""
    engines = torch.backends.quantized.supported_engines
    fbgemm = next((e for e in ("x86", "fbgemm") if e in engines), "")
    if "onednn" not in engines or not fbgemm:
        return fbgemm or ("onednn" if "onednn" in engines else "")
    from rose.packed import PROBE_SHAPE, fastest

    rows, n_in, n_out = PROBE_SHAPE
    probe = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=probe)
    x = torch.randn(rows, n_in, generator=probe)
    runs = {}
    for engine in (fbgemm, "onednn"):
        with _quantized_engine(engine):
            packed = torch.ops.quantized.linear_prepack(_per_channel(weight), None)
        torch.ops.quantized.linear_dynamic(x, packed, False)  # first call builds the kernel
        runs[engine] = functools.partial(torch.ops.quantized.linear_dynamic, x, packed, False)
    best = fastest(runs, repeats=5)
    return min(best, key=best.__getitem__)


@contextlib.contextmanager
def _quantized_engine(engine: str | None = None) -> Iterator[None]:
    """Prepack under `engine` (default: `_engine`'s choice; packed weights remember their
    kernel), then restore the process's setting."""
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = engine or _engine()
    try:
        with warnings.catch_warnings():
            # quantize_per_channel's qint8 tensors are deprecated as a user-facing type;
            # here one only feeds linear_prepack, which still takes nothing else.
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        torch.backends.quantized.engine = before


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` for fp32 x ``[..., in_features]``: W int8 per output channel,
    x quantized per call, or per sequence inside `per_sequence` (see the module docstring);
    returns fp32 ``[..., out_features]``.

    input_amax: ``max|x_j|`` per input channel ``[in]`` from calibration; when given the
    layer is smoothed (x / s, W * s). None: no smoothing."""

    activation = "none"  # no fused activation: the model applies its own (`MLP.act_fused`)

    def __init__(self, linear: nn.Module, input_amax: torch.Tensor | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [out, in]
        if weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"Int8Linear needs a 2-d CPU weight, got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.inv_smooth: torch.Tensor | None = None
        if input_amax is not None:
            smooth = smoothing(input_amax.float(), weight)  # [in]
            weight = weight * smooth  # column j times s_j
            self.inv_smooth = 1.0 / smooth
        scales = weight_scales(weight)  # [out]
        bias = None if linear.bias is None else linear.bias.detach().float()
        with _quantized_engine():
            self._packed = torch.ops.quantized.linear_prepack(_per_channel(weight, scales), bias)
        self.scales = scales
        self.bias = bias
        self.reduce_range = not getattr(torch.cpu, "_is_vnni_supported", lambda: False)()

    def dequantized(self) -> torch.Tensor:
        """The weight ``[out, in]`` the products use, smoothing undone (fp32)."""
        q, _ = torch.ops.quantized.linear_unpack(self._packed)
        w = q.dequantize()
        return w if self.inv_smooth is None else w * self.inv_smooth

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features).float()  # [rows, in]
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        bounds = _SEQUENCES.get()
        if bounds is None or len(bounds) <= 2 or bounds[-1] != x.shape[0]:
            y = self._product(x)  # [rows, out]
        else:  # one call, so one activation scale, per sequence
            spans = zip(bounds[:-1], bounds[1:], strict=True)
            y = torch.cat([self._product(x[a:b]) for a, b in spans if b > a])
        return y.view(*shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x, self._packed, self.reduce_range)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


_SEQUENCES: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar(
    "rose_int8_sequences", default=None
)


@contextlib.contextmanager
def per_sequence(cu_seqlens: Sequence[int]) -> Iterator[None]:
    """Inside the block, `Int8Linear` layers given the ragged batch's tokens (``cu_seqlens[-1]``
    rows) quantize each sequence's activations with their own scale (token offsets
    ``cu_seqlens``, B + 1 of them); other inputs stay one call."""
    token = _SEQUENCES.set(tuple(int(c) for c in cu_seqlens))
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


# SmoothQuant's migration strength (module docstring: chosen on the check set)
SMOOTH_ALPHA = 0.65


def smoothing(input_amax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's factors ``max|x_j|^a / max|W[:, j]|^(1 - a)`` per input channel,
    ``a = SMOOTH_ALPHA``."""
    w_amax = weight.abs().amax(dim=0).clamp(min=1e-5)  # [in]
    return input_amax.clamp(min=1e-5).pow(SMOOTH_ALPHA) / w_amax.pow(1 - SMOOTH_ALPHA)


def _linears(module: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear, bool]]:
    """Every ``nn.Linear`` under `module` as (parent, attribute, layer, int8?): int8 when it
    keeps or widens its width and its parent does not declare ``float_under_int8`` (the
    families' MLPs: module docstring)."""
    for parent in list(module.modules()):
        stays_float = getattr(parent, "float_under_int8", False)
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                widening = child.in_features <= child.out_features
                yield parent, name, child, widening and not stays_float


def calibrate(module: nn.Module, run: Callable[[], object]) -> dict[nn.Module, torch.Tensor]:
    """``max|x_j|`` per input channel of every layer under `module` the scheme makes int8,
    over whatever `run` passes through it (the fp32 model on the check set)."""
    found: dict[nn.Module, torch.Tensor] = {}

    def record(layer: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        amax = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(0).float()
        found[layer] = amax if layer not in found else torch.maximum(found[layer], amax)

    hooks = [
        layer.register_forward_pre_hook(record) for _, _, layer, int8 in _linears(module) if int8
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return found


def weight_scales(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel scales ``max|w_row| / 127`` ([out] fp32)."""
    return (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)


def _per_channel(weight: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` ``[out, in]`` as a qint8 tensor, symmetric per output channel (`scales`,
    default `weight_scales`), for ``linear_prepack``. Call it under `_quantized_engine`."""
    scales = weight_scales(weight) if scales is None else scales
    zero = torch.zeros(weight.shape[0], dtype=torch.long)
    return torch.quantize_per_channel(weight, scales.double(), zero, 0, torch.qint8)


def float_layer_dtype() -> torch.dtype:
    """The dtype the int8 scheme gives the layers it keeps float, packed, on this CPU: bf16
    where its packed bf16 products are faster than fp32 ones (`rose.packed.bf16_speedup`),
    else fp32."""
    from rose.packed import bf16_speedup

    return torch.bfloat16 if bf16_speedup() > 1.0 else torch.float32


def quantize_int8(
    module: nn.Module,
    input_amax: dict[nn.Module, torch.Tensor] | None = None,
    float_dtype: torch.dtype = torch.float32,
) -> int:
    """Apply the int8 scheme (module docstring) to every ``nn.Linear`` under `module`, in
    place: `Int8Linear` for the layers it makes int8 (smoothed by their entry in
    `input_amax`, from `calibrate`, when there is one); the others are cast to `float_dtype`
    (bf16 only for a caller that then packs them: `rose.packed.PackedLinear` takes fp32
    inputs on bf16 weights, a plain ``nn.Linear`` does not). Returns how many became int8
    (EngineError when this PyTorch has no int8 CPU kernel)."""
    if not int8_available():
        raise EngineError(
            "EngineConfig.quantize='int8' needs PyTorch's dynamic quantized linear with an "
            f"x86/fbgemm/onednn engine; this build has {torch.backends.quantized.supported_engines}"
        )
    swapped = 0
    for parent, name, child, int8 in list(_linears(module)):
        if int8:
            amax = None if input_amax is None else input_amax.get(child)
            setattr(parent, name, Int8Linear(child, amax))
            swapped += 1
        else:
            child.to(float_dtype)
    return swapped


# -- accuracy gate ---------------------------------------------------------------------------


def check_batch(model_dir: Path, vocab_size: int, max_tokens: int) -> RaggedBatch:
    """The check inputs as one batch: each of `CHECK_TEXTS` alone, then groups of them joined
    into longer rows (~70-420 tokens for XLM-R), tokenized by ``model_dir/tokenizer.json``
    and cut to `max_tokens`. A directory without a tokenizer (or whose ids exceed the
    vocabulary: tiny test models) gets seeded random ids of the same lengths instead."""
    from rose.batch import RaggedBatch

    texts = list(CHECK_TEXTS)
    for size in (4, 8, len(CHECK_TEXTS)):
        texts += [" ".join(CHECK_TEXTS[i : i + size]) for i in range(0, len(CHECK_TEXTS), size)]
    rows: list[list[int]] = []
    path = model_dir / "tokenizer.json"
    if path.exists():
        import tokenizers

        tok = tokenizers.Tokenizer.from_file(str(path))
        tok.no_truncation()
        tok.no_padding()
        rows = [e.ids for e in tok.encode_batch(texts)]
    if not rows or max(max(r) for r in rows) >= vocab_size:
        rng = np.random.default_rng(0)
        lengths = [len(t.encode()) // 4 + 2 for t in texts]
        rows = [rng.integers(0, vocab_size, n).tolist() for n in lengths]
    rows = [r[: max(1, max_tokens)] for r in rows]
    return RaggedBatch.from_lists(rows)


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row of `a` [N, D] with the same row of `b` (float64)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return (a * b).sum(-1) / np.maximum(norms, 1e-30)


def _compare(engine: Engine, reference: Engine, model_dir: Path) -> float:
    info = reference.info
    batch = check_batch(model_dir, info.vocab_size, info.max_input_tokens)
    return float(row_cosines(engine.check_rows(batch), reference.check_rows(batch)).min())


def check_accuracy(engine: Engine, model_dir: Path, mode: str) -> float:
    """Refuse `engine` (loaded in reduced `mode`) unless every check row's cosine to an fp32
    engine of the same directory is at least ``MIN_COSINE[mode]``; returns the minimum."""
    from rose.engine import Engine

    reference = Engine.load(model_dir, _fp32(engine.config))
    worst = _compare(engine, reference, model_dir)
    bound = MIN_COSINE[mode]
    if not worst >= bound:
        raise EngineError(
            f"{model_dir.name}: {mode} mode refused by the accuracy gate: minimum per-row "
            f"cosine to float32 on the check set is {worst:.6f}, below the bound {bound}"
        )
    return worst


def _fp32(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(config, dtype="float32", quantize=None, accuracy_gate=False)


def measure_modes(
    model_dir: Path, config: EngineConfig | None = None
) -> dict[str, float | EngineError]:
    """Every mode of `MODES` → its minimum per-row cosine to fp32 on the check set (CPU,
    gate off, so a failing mode is measured rather than refused), or the EngineError of a
    mode the model cannot run in (int8 outside BERT / XLM-R / Qwen3)."""
    from rose.config import EngineConfig
    from rose.engine import Engine

    base = _fp32(config or EngineConfig(device="cpu"))
    reference = Engine.load(model_dir, base)
    found: dict[str, float | EngineError] = {}
    for label, overrides in MODES:
        try:
            engine = Engine.load(model_dir, dataclasses.replace(base, **overrides))
        except EngineError as exc:
            found[label] = exc
            continue
        found[label] = _compare(engine, reference, model_dir)
    return found
