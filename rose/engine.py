"""`Engine`: load a model directory once, then run ragged batches with `step`.

The model family (BERT, XLM-R, Qwen3, ...) is chosen once at load from config.json's
``model_type`` through `rose.models.FAMILIES`; everything the engine asks of a family is
the contract documented there.

`step` validates and lays out the batch on the host (positions, row ids, per-row pooling),
enqueues the pass and returns a `LazyTensor` at once. `step_outputs` is the same pass for
batches whose rows also ask for sparse, multi-vector or token-state outputs (`rose.heads`):
it returns `StepOutputs` (the dense rows lazy, the ragged extras on the host) and runs eager.

On CUDA with graphs on, the pass runs in the slot of its (row bucket, token bucket) graph
key: inputs padded into static buffers with one extra "padding row" that owns the padding
tokens, so padded tokens never mix with real rows.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rose.attention import AttentionBackend, AttentionInputs, select_backend
from rose.batch import RaggedBatch
from rose.config import EngineConfig
from rose.errors import EngineError
from rose.graphs import CaptureBackend, CudaCaptureBackend, GraphKey, GraphManager, graph_key
from rose.heads import (
    BgeM3Heads,
    colbert_vectors,
    read_bge_m3_heads,
    read_special_ids,
    sparse_max,
    splade_max,
    token_rows,
)
from rose.int8 import (
    calibrate,
    check_accuracy,
    check_batch,
    float_layer_dtype,
    per_sequence,
    quantize_int8,
    reduced_mode,
)
from rose.lazy import LazyTensor, RaggedRows, StepOutputs
from rose.loading import (
    ModelInfo,
    read_config,
    read_dense,
    read_logit_score,
    read_sentence_settings,
    read_splade,
    read_tensors,
)
from rose.models import EncoderConfig, Family, FamilyOptions, bert, family_for, qwen3
from rose.packed import bf16_speedup
from rose.pooling import POOL_CODES, dense_projection, pool_ragged

__all__ = ["Engine", "pass_groups"]

log = logging.getLogger("rose.engine")

# Families whose int8 path is tested against transformers fp32 (tests/test_cpu_precision.py).
_INT8_FAMILIES = (bert.FAMILY, qwen3.FAMILY)


@dataclass(frozen=True)
class _HostBatch:
    """A validated batch laid out for the device (all arrays on the host)."""

    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    types: np.ndarray | None  # [T] int64
    seg_ids: np.ndarray  # [T] int64, row of each token
    cu_seqlens: np.ndarray  # [B+1] int64
    modes: np.ndarray  # [O] int64 pooling codes, one per output (row, or span)
    normalize: np.ndarray  # [O] bool
    present: frozenset[int]  # pooling codes in `modes`
    # Late chunking: the pooled tokens' indices [P] into the batch, their spans' bounds
    # [O+1] within those P tokens and the span of each [P]; None pools whole rows.
    spans: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def rows(self) -> int:
        return int(self.cu_seqlens.size - 1)

    @property
    def tokens(self) -> int:
        return int(self.ids.size)


class _Slot:
    """Static device buffers of one graph key; rows R + 1 (the last owns padding tokens).

    One int64 buffer holds ids, positions, types, seg_ids [Tb each], cu_seqlens [R+2],
    modes [R+1] and normalize [R+1], so filling a slot is one host-to-device copy.
    """

    def __init__(self, key: GraphKey, device: torch.device) -> None:
        rows, tokens = key
        self.key = key
        self.rows = rows + 1
        self.tokens = tokens
        self.sizes = [tokens, tokens, tokens, tokens, self.rows + 1, self.rows, self.rows]
        self.pinned = device.type == "cuda"
        self.device_buffer = torch.zeros(sum(self.sizes), dtype=torch.int64, device=device)
        parts = torch.split(self.device_buffer, self.sizes)
        self.ids, self.positions, self.types, self.seg_ids, self.cu_seqlens, self.modes, norm = (
            parts
        )
        self.normalize_flags = norm
        self.plan: Any = None
        self.output: torch.Tensor | None = None


class Engine:
    """A loaded encoder or cross-encoder; see the package docstring for use."""

    def __init__(
        self,
        family: Family,
        model: Any,
        info: ModelInfo,
        config: EngineConfig,
        attention: AttentionBackend,
        capture: CaptureBackend | None = None,
        heads: BgeM3Heads | None = None,
        special_ids: frozenset[int] = frozenset(),
        projection: torch.nn.Module | None = None,
    ) -> None:
        self._family = family
        self._model = model  # the family's module: encoder / classify (`rose.models`)
        self._cfg: EncoderConfig = model.cfg
        self._info = info
        self._config = config
        self._device = next(model.parameters()).device
        self._attention = attention
        self._default_mode = POOL_CODES[info.default_pooling]
        self._heads = heads  # BGE-M3's sparse / ColBERT heads, on the model's device
        self._special = np.asarray(sorted(special_ids), dtype=np.int64)  # sparse drops these
        self._projection = projection  # sentence-transformers Dense layers after pooling
        self._graphs: GraphManager[_Slot] | None = None
        if (
            capture is None
            and config.cuda_graphs
            and self._device.type == "cuda"
            and attention.graph_safe
        ):
            capture = CudaCaptureBackend()
        if capture is not None:
            self._graphs = GraphManager(capture, config.max_graphs, on_evict=self._evict_slot)

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load a Hugging Face model directory; EngineError says what is missing or unsupported."""
        config = config or EngineConfig()
        path = Path(model_dir)
        raw = read_config(path)
        family = family_for(raw)
        options = FamilyOptions(config.attention_mode, read_logit_score(path), read_splade(path))
        cfg = family.config(raw, options)
        settings = read_sentence_settings(path, cfg.classifier)
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"EngineConfig.device is {config.device!r} but CUDA is not available")
        dtype = getattr(torch, config.resolved_dtype)
        state = family.load_weights(cfg, read_tensors(path))
        with torch.device("meta"):
            model = family.model(cfg)
        model.load_state_dict(state, strict=True, assign=True)
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        if options.lm_head and getattr(model, "mlm", None) is None:
            raise EngineError(
                f"{path}: SpladePooling needs a masked-LM head; the {raw.get('model_type')!r} "
                "family has none here"
            )
        heads = None if cfg.classifier else read_bge_m3_heads(path, cfg.hidden_size)
        special: frozenset[int] = frozenset()
        if heads is not None:
            if heads.sparse_linear is not None:
                if options.lm_head:
                    raise EngineError(f"{path}: both sparse_linear.pt and SpladePooling; pick one")
                special = read_special_ids(path)
            heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
        dense = () if cfg.classifier else read_dense(path, cfg.hidden_size)
        projection = dense_projection(dense, device)
        outputs: tuple[str, ...] = ()
        if not cfg.classifier:
            sparse = options.lm_head or (heads is not None and heads.sparse_linear is not None)
            colbert = heads is not None and heads.colbert_linear is not None
            outputs = ("dense",) + ("sparse",) * sparse + ("multi_vector",) * colbert
            outputs += ("token_states",)
        if config.quantize == "int8":
            if family not in _INT8_FAMILIES:
                raise EngineError(
                    f"{path}: EngineConfig.quantize='int8' serves BERT / XLM-R / Qwen3 encoders "
                    f"and cross-encoders; not model_type {raw.get('model_type')!r}"
                )
        elif config.packed_weights and device.type == "cpu":
            model.pack_weights()  # int8: after calibration (`_quantize_int8`)
        max_tokens = cfg.max_input_tokens
        if settings.max_seq_length is not None:
            max_tokens = min(max_tokens, settings.max_seq_length)
        info = ModelInfo(
            name=path.name or path.resolve().name,
            kind="cross-encoder" if cfg.classifier else "embedding",
            dimensions=int(dense[-1].weight.shape[0]) if dense else cfg.hidden_size,
            max_input_tokens=max_tokens,
            vocab_size=cfg.vocab_size,
            num_labels=cfg.num_labels,
            default_pooling=settings.pooling or cfg.default_pooling,
            default_normalize=settings.normalize,
            query_prompt=settings.query_prompt,
            document_prompt=settings.document_prompt,
            device=str(device),
            dtype=config.quantize or config.resolved_dtype,
            token_types=cfg.type_vocab_size,
            outputs=outputs,
        )
        choice = select_backend(
            config.attention,
            config.sdpa_strategy,
            device,
            dtype,
            cfg.num_heads,
            cfg.head_dim,
            num_kv_heads=cfg.num_kv_heads,
            causal=cfg.causal,
            # int8 keeps fp32 activations; where its float layers run in bf16, so may attention
            attend_dtype=(
                float_layer_dtype() if config.quantize == "int8" and config.packed_weights else None
            ),
        )
        engine = cls(
            family,
            model,
            info,
            config,
            choice.backend,
            heads=heads,
            special_ids=special,
            projection=projection,
        )
        if config.quantize == "int8":
            engine._quantize_int8(path)
        mode = reduced_mode(config)
        if mode == "bfloat16" and 0.0 < (speedup := bf16_speedup()) < 1.0:
            log.warning(
                "rose: --dtype bfloat16 on a CPU whose packed bf16 products run at %.2fx the "
                "float32 rate: this mode halves the weights' memory but is slower here than "
                "float32 (bf16 is fast on CPUs with AMX or AMD Zen 4's bf16 dot products)",
                speedup,
            )
        if mode is not None and config.accuracy_gate:
            worst = check_accuracy(engine, path, mode)  # EngineError below the mode's bound
            log.info("rose accuracy gate: %s min cosine to float32 %.6f", mode, worst)
        log.info("rose engine loaded: %r, cuda graphs %s", engine, "on" if engine.graphs else "off")
        return engine

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def attention(self) -> AttentionBackend:
        return self._attention

    @property
    def graphs(self) -> GraphManager[Any] | None:
        return self._graphs

    def use_capture_backend(self, capture: CaptureBackend) -> None:
        """Run graph-keyed passes through `capture` (e.g. a recorder, to test on CPU)."""
        if self._graphs is not None:
            self._graphs.clear()
        self._graphs = GraphManager(capture, self._config.max_graphs, on_evict=self._evict_slot)

    def _quantize_int8(self, path: Path) -> None:
        """Calibrate the fp32 encoder on the check set, swap in the int8 layers
        (`rose.int8`), then pack what stays float for oneDNN."""
        batch = check_batch(path, self._cfg.vocab_size, self._info.max_input_tokens)
        amax = calibrate(self._model.encoder, lambda: self.check_rows(batch))
        packed = self._config.packed_weights
        quantize_int8(self._model.encoder, amax, float_layer_dtype() if packed else torch.float32)
        if packed:
            self._model.pack_weights()  # skips the int8 layers; fuses the MLP's activation

    def check_rows(self, batch: RaggedBatch) -> np.ndarray:
        """What the accuracy gate compares (`rose.int8`), float32 [B, D] on the host: the
        pooled rows of an embedding model, the mean final hidden state of each row of a
        cross-encoder."""
        host = self._layout(batch)
        with torch.inference_mode():
            pooled, hidden = self._run_eager(host)
            if self._cfg.classifier:
                seg = torch.from_numpy(host.seg_ids).to(hidden.device)
                summed = torch.zeros(host.rows, hidden.shape[1], device=hidden.device)
                summed.index_add_(0, seg, hidden.float())  # [B, H]
                counts = torch.from_numpy(np.diff(host.cu_seqlens)).to(summed)
                pooled = summed / counts.clamp(min=1).unsqueeze(1)
            return pooled.float().cpu().numpy()  # type: ignore[no-any-return]

    # -- running ---------------------------------------------------------------------------

    def step(self, batch: RaggedBatch) -> LazyTensor:
        """Enqueue one pass over `batch`; returns at once with a `LazyTensor`:
        [B, dimensions] pooled embeddings ([S, dimensions], one per span, when the batch
        has spans), or [B, num_labels] raw logits for cross-encoders. Batches whose rows ask
        for more than dense vectors go through `step_outputs`."""
        if batch.extra_kinds:
            raise EngineError(
                f"rows ask for {sorted(batch.extra_kinds)}: run the batch with step_outputs"
            )
        host = self._layout(batch)
        with torch.inference_mode():
            if (
                self._graphs is not None
                and host.spans is None
                and host.tokens <= self._config.max_graph_tokens
            ):
                out = self._run_graph(host)
            else:
                out, _ = self._run_eager(host)
        return LazyTensor.from_device(out)

    def step_outputs(self, batch: RaggedBatch) -> StepOutputs:
        """One pass over `batch` giving every output kind its rows ask for (`batch.kinds`):
        the dense rows as `step` gives them, and per kind `RaggedRows` whose counts are 0
        for rows that did not ask. Without extra kinds this is `step` (graphs included);
        with them the pass runs eager and the extras are on the host when it returns."""
        extra = batch.extra_kinds
        if not extra:
            return StepOutputs(self.step(batch))
        offered = set(self._info.outputs)
        missing = sorted(extra - offered)
        if missing:
            raise EngineError(
                f"{self._info.name} cannot give {missing}; it offers {sorted(offered) or 'none'}"
            )
        assert batch.kinds is not None
        host = self._layout(batch)
        with torch.inference_mode():
            dense, hidden = self._run_eager(host)
            found = self._extras(host, hidden, batch.kinds)
            return StepOutputs(LazyTensor.from_device(dense), **found)

    def _extras(
        self, host: _HostBatch, hidden: torch.Tensor, kinds: tuple[frozenset[str], ...]
    ) -> dict[str, RaggedRows]:
        """The extra kinds `kinds` ask for, from the pass's hidden states [T, H]."""
        device, rows = hidden.device, host.rows
        first = np.zeros(host.tokens, dtype=bool)
        first[host.cu_seqlens[:-1]] = True  # each row's first token ([CLS] / <s>)
        out: dict[str, RaggedRows] = {}
        for kind in ("sparse", "multi_vector", "token_states"):
            asking = np.fromiter((kind in k for k in kinds), dtype=bool, count=rows)  # [B]
            if not asking.any():
                continue
            keep = asking[host.seg_ids]  # [T] tokens of the asking rows
            if kind == "multi_vector":
                keep &= ~first  # BGE-M3 drops [CLS]
            elif kind == "sparse" and self._heads is not None and self._special.size:
                keep &= ~np.isin(host.ids, self._special)
            picked = np.flatnonzero(keep)
            index = torch.from_numpy(picked).to(device)
            seg = torch.from_numpy(host.seg_ids[picked]).to(device)  # [P] row of each token
            states = hidden.index_select(0, index)  # [P, H]
            if kind == "token_states":
                out[kind] = token_rows(states, seg, rows)
            elif kind == "multi_vector":
                assert self._heads is not None
                out[kind] = token_rows(colbert_vectors(self._heads, states), seg, rows)
            elif self._heads is not None and self._heads.sparse_linear is not None:
                weights = torch.relu(self._heads.sparse_linear(states)).squeeze(-1)  # [P]
                ids = torch.from_numpy(host.ids[picked]).to(device)
                out[kind] = sparse_max(seg, ids, weights, self._cfg.vocab_size, rows)
            else:
                out[kind] = splade_max(states, seg, rows, self._model.mlm_logits)
        return out

    def _layout(self, batch: RaggedBatch) -> _HostBatch:
        cfg, info = self._cfg, self._info
        ids = batch.input_ids
        cu = batch.cu_seqlens.astype(np.int64)
        lengths = np.diff(cu)
        rows = lengths.size
        longest = int(lengths.max())
        if longest > info.max_input_tokens:
            raise EngineError(
                f"a row has {longest} tokens; {info.name} takes at most {info.max_input_tokens}"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= cfg.vocab_size:
            raise EngineError(
                f"token id {high if high >= cfg.vocab_size else low} is outside 0..{cfg.vocab_size - 1}"
            )
        types = batch.token_type_ids
        if types is not None:
            if int(types.min()) < 0 or int(types.max()) >= cfg.type_vocab_size:
                raise EngineError(f"token type ids must be in 0..{cfg.type_vocab_size - 1}")
            types = types.astype(np.int64, copy=False)
        if batch.pooling is None:
            modes = np.full(rows, self._default_mode, dtype=np.int64)
            present = frozenset((self._default_mode,))
        else:
            codes = [self._default_mode if m is None else POOL_CODES[m] for m in batch.pooling]
            modes = np.asarray(codes, dtype=np.int64)
            present = frozenset(codes)
        if batch.normalize is None:
            normalize = np.full(rows, info.default_normalize, dtype=bool)
        else:
            normalize = np.asarray(
                [info.default_normalize if n is None else bool(n) for n in batch.normalize],
                dtype=bool,
            )
        spans = None
        if batch.spans is not None and batch.span_counts is not None:
            if cfg.classifier:
                raise EngineError("spans are pooled by embedding models; this is a cross-encoder")
            spans = _span_layout(cu, batch.span_counts, batch.spans)
            modes = np.repeat(modes, batch.span_counts)
            normalize = np.repeat(normalize, batch.span_counts)
        return _HostBatch(
            ids=ids.astype(np.int64, copy=False),
            positions=self._family.position_ids(cfg, ids, cu),
            types=types,
            seg_ids=np.repeat(np.arange(rows, dtype=np.int64), lengths),
            cu_seqlens=cu,
            modes=modes,
            normalize=normalize,
            present=present,
            spans=spans,
        )

    def _forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        seg_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        modes: torch.Tensor,
        normalize: torch.Tensor,
        plan: Any,
        present: frozenset[int] | None,
        spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The device part of a pass (graph-capturable when `present` and `spans` are None)."""
        hidden = self._encode(ids, positions, types, seg_ids, cu_seqlens, plan)  # [T, H]
        return self._pool(hidden, cu_seqlens, seg_ids, modes, normalize, present, spans)

    def _encode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        types: torch.Tensor | None,
        seg_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        plan: Any,
    ) -> torch.Tensor:
        """Last hidden states [T, H] of the ragged batch."""
        inputs = AttentionInputs(cu_seqlens=cu_seqlens, seg_ids=seg_ids)
        state = self._attention.prepare(plan, inputs)
        # int8 (CPU only): one activation scale per sequence, not per batch (rose.int8)
        int8 = self._config.quantize == "int8"
        with per_sequence(cu_seqlens.tolist()) if int8 else contextlib.nullcontext():
            return self._model.encoder(ids, positions, types, self._attention, state)  # type: ignore[no-any-return]

    def _pool(
        self,
        hidden: torch.Tensor,
        cu_seqlens: torch.Tensor,
        seg_ids: torch.Tensor,
        modes: torch.Tensor,
        normalize: torch.Tensor,
        present: frozenset[int] | None,
        spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Hidden states [T, H] → pooled rows [B, D] ([S, D] spans; D = H unless Dense layers
        follow the pooling; logits for classifiers)."""
        if self._cfg.classifier:
            return self._model.classify(hidden, cu_seqlens, seg_ids).float()  # [B, labels]
        if spans is not None:
            index, cu_spans, span_ids = spans
            picked = hidden.index_select(0, index)  # [P, H]
            return pool_ragged(
                picked, cu_spans, span_ids, modes, normalize, present, self._projection
            )  # [S, D]
        return pool_ragged(
            hidden, cu_seqlens, seg_ids, modes, normalize, present, self._projection
        )  # [B, D]

    def _run_eager(self, host: _HostBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(pooled rows, hidden states [T, H]) of an eager pass. On CPU the encoder runs
        over groups of whole rows of at most ``config.resolved_cpu_pass_tokens`` tokens
        (`pass_groups`), whose hidden states are joined."""
        device = self._device

        def put(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device, non_blocking=True)

        cu = host.cu_seqlens
        ids, positions = put(host.ids), put(host.positions)
        types = None if host.types is None else put(host.types)
        seg_ids, cu_seqlens = put(host.seg_ids), put(cu)
        limit = self._config.resolved_cpu_pass_tokens if device.type == "cpu" else int(cu[-1])
        parts = []
        for first, end in pass_groups(cu, limit):  # rows [first, end)
            a, b = int(cu[first]), int(cu[end])  # their tokens [a, b)
            parts.append(
                self._encode(
                    ids[a:b],
                    positions[a:b],
                    None if types is None else types[a:b],
                    seg_ids[a:b] - first,
                    cu_seqlens[first : end + 1] - a,
                    self._attention.plan(cu[first : end + 1] - a),
                )
            )
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)  # [T, H]
        spans = None
        if host.spans is not None:
            spans = (put(host.spans[0]), put(host.spans[1]), put(host.spans[2]))
        pooled = self._pool(
            hidden,
            cu_seqlens,
            seg_ids,
            put(host.modes),
            put(host.normalize),
            host.present,
            spans,
        )
        return pooled, hidden

    def _run_graph(self, host: _HostBatch) -> torch.Tensor:
        assert self._graphs is not None
        key = graph_key(host.rows, host.tokens)
        slot = self._graphs.run(
            key,
            lambda: _Slot(key, self._device),
            lambda s: self._fill(s, host),
            self._forward_slot,
        )
        assert slot.output is not None
        return slot.output[: host.rows]

    def _fill(self, slot: _Slot, host: _HostBatch) -> None:
        t, b = host.tokens, host.rows
        # A fresh staging buffer per fill: torch's pinned-memory cache does not hand it out
        # again before the non-blocking copy below has run.
        staging = torch.empty(sum(slot.sizes), dtype=torch.int64, pin_memory=slot.pinned)
        ids, positions, types, seg, cu, modes, norm = torch.split(staging, slot.sizes)
        ids[:t] = torch.from_numpy(host.ids)
        ids[t:] = self._cfg.pad_token_id
        positions[:t] = torch.from_numpy(host.positions)
        positions[t:] = self._cfg.position_offset
        types.zero_()
        if host.types is not None:
            types[:t] = torch.from_numpy(host.types)
        seg[:t] = torch.from_numpy(host.seg_ids)
        seg[t:] = slot.rows - 1  # the padding row
        cu[: b + 1] = torch.from_numpy(host.cu_seqlens)
        cu[b + 1 : slot.rows] = t  # empty bucket rows
        cu[slot.rows] = slot.tokens  # the padding row ends the bucket
        modes.zero_()
        modes[:b] = torch.from_numpy(host.modes)
        norm.zero_()
        norm[:b] = torch.from_numpy(host.normalize.astype(np.int64))
        slot.plan = self._attention.plan(cu.numpy(), slot=slot.key)
        slot.device_buffer.copy_(staging, non_blocking=True)

    def _forward_slot(self, slot: _Slot) -> None:
        slot.output = self._forward(
            slot.ids,
            slot.positions,
            slot.types,
            slot.seg_ids,
            slot.cu_seqlens,
            slot.modes,
            slot.normalize_flags.bool(),
            slot.plan,
            None,
        )

    def _evict_slot(self, key: GraphKey, slot: _Slot) -> None:
        self._attention.release(key)

    def __repr__(self) -> str:
        i = self._info
        return f"Engine({i.name!r}, {i.kind}, {i.device}/{i.dtype}, attention={self._attention.describe()})"


def pass_groups(cu_seqlens: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Split rows (token offsets `cu_seqlens`, B + 1 of them) into runs of consecutive rows
    ``[first, end)`` of at most `limit` tokens each; a row longer than `limit` is a run of
    its own. Greedy, in order, so every row is in exactly one run."""
    groups: list[tuple[int, int]] = []
    first, rows = 0, len(cu_seqlens) - 1
    for row in range(1, rows + 1):
        if row == rows or int(cu_seqlens[row + 1]) - int(cu_seqlens[first]) > limit:
            groups.append((first, row))
            first = row
    return groups


def _span_layout(
    cu_seqlens: np.ndarray, counts: np.ndarray, spans: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host layout of late chunking: the batch positions [P] of every span's tokens, the
    spans' bounds [S+1] within those P tokens, and each picked token's span [P]."""
    starts = np.repeat(cu_seqlens[:-1], counts) + spans[:, 0]  # [S] absolute
    lengths = spans[:, 1] - spans[:, 0]  # [S]
    cu_spans = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=cu_spans[1:])
    span_ids = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)  # [P]
    index = np.repeat(starts, lengths) + (np.arange(int(cu_spans[-1])) - cu_spans[span_ids])
    return index.astype(np.int64), cu_spans, span_ids
