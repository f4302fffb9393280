"""Reduced-precision CPU modes (`rose.int8`): ``--dtype bfloat16`` and ``--quantize int8``.

Expected values come from the reference libraries in fp32: sentence-transformers on
multilingual-e5-small (real weights, real multilingual texts that are not the gate's check
set) and transformers on tiny random BERT / XLM-R encoders and cross-encoders. Bounds: per-row
cosine to fp32 >= 0.999 (bf16) and >= 0.99 (int8), the gate's own bounds; cross-encoder
logits within 5% of the fp32 logits' spread (int8) and 1% (bf16).

The gate is shown refusing a deliberately broken int8 calibration (weight scales 1/16 of the
right ones, so weights clip) both in process and as a real Tulip process that exits non-zero.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tiny_configs
import torch
import transformers

from rose import Engine, EngineConfig, EngineError, RaggedBatch
from rose.int8 import (
    CHECK_TEXTS,
    MIN_COSINE,
    Int8Linear,
    measure_modes,
    per_sequence,
    row_cosines,
)
from rose.packed import PackedLinear

TEXTS = [
    "query: which river flows through Vienna",
    "passage: The Danube flows through Vienna, Bratislava, Budapest and Belgrade.",
    "query: wie lange dauert die Fahrt nach Salzburg",
    "passage: Der Zug von Wien nach Salzburg braucht etwa zweieinhalb Stunden.",
    "passage: Les abeilles communiquent la position des fleurs par une danse en huit.",
    "passage: El volcán entró en erupción después de dos siglos de inactividad.",
    "passage: Программа обучения рассчитана на два года и включает летнюю практику.",
    "passage: 駅前の商店街では毎年七月に夏祭りが開かれる。",
    "passage: 这座桥全长三公里，是该地区最长的跨海大桥。",
    "passage: "
    + " ".join(
        [
            "The museum's new wing holds instruments used by eighteenth-century astronomers,",
            "including a brass telescope, several sextants and a clock that kept time for",
            "the city's observatory for more than a hundred years before it was replaced.",
        ]
        * 4
    ),
]
VOCAB = tiny_configs.VOCAB


def _sentence_transformers(path: Path, texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), device="cpu")
    return st.encode(texts, convert_to_numpy=True, normalize_embeddings=True)


@pytest.fixture(scope="module")
def e5_reference(e5_dir: Path) -> tuple[list[list[int]], np.ndarray]:
    tok = transformers.AutoTokenizer.from_pretrained(e5_dir)
    ids = tok(TEXTS, truncation=True, max_length=512)["input_ids"]
    return ids, _sentence_transformers(e5_dir, TEXTS)


@pytest.mark.parametrize(
    ("mode", "overrides"),
    [("bfloat16", {"dtype": "bfloat16"}), ("int8", {"quantize": "int8"})],
)
def test_e5_reduced_modes_match_sentence_transformers(
    e5_dir: Path, e5_reference: tuple[list[list[int]], np.ndarray], mode: str, overrides: dict
) -> None:
    ids, expected = e5_reference
    engine = Engine.load(e5_dir, EngineConfig(device="cpu", **overrides))
    assert engine.info.dtype == mode
    got = engine.step(RaggedBatch.from_lists(ids)).numpy()
    cos = row_cosines(got, expected)
    assert cos.min() >= MIN_COSINE[mode], cos
    # rows alone agree with the batch (int8 quantizes activations per sequence)
    alone = np.stack([engine.step(RaggedBatch.from_lists([r])).numpy()[0] for r in ids])
    assert row_cosines(alone, expected).min() >= MIN_COSINE[mode]


# The float layers' dtype under int8 (`rose.packed.bf16_speedup` decides it on the CPU at
# hand): fp32, whose packed products are the same sums whatever the row count, and bf16,
# whose AMX kernel (Intel Sapphire Rapids and later) splits the 1,536-wide down projection's
# sums by row count, so a row's last bits move with its batch (cosine 0.99993 on e5-small)
# as they do in any bf16 GEMM; with that the bound only tells per-sequence scales (0.99999+)
# from one scale over the batch (0.9995). Zen 4's bf16 kernel does not split: it meets both.
FLOAT_LAYERS = pytest.mark.parametrize(
    ("bf16_speedup", "min_cosine"), [(0.55, 0.999999), (1.8, 0.9999)], ids=["fp32", "bf16"]
)


@FLOAT_LAYERS
def test_int8_row_does_not_depend_on_its_batch(
    e5_dir: Path,
    e5_reference: tuple[list[list[int]], np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
    bf16_speedup: float,
    min_cosine: float,
) -> None:
    """Activations are quantized per sequence, so a short query batched with long passages
    gets the vector it gets alone (one scale over the batch gave cosine 0.9995)."""
    import rose.packed

    monkeypatch.setattr(rose.packed, "bf16_speedup", lambda: bf16_speedup)
    ids, _ = e5_reference
    engine = Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8"))
    queries = [r for r in ids if len(r) < 16]
    long_rows = [r for r in ids if len(r) > 100]
    assert queries and long_rows
    alone = np.stack([engine.step(RaggedBatch.from_lists([q])).numpy()[0] for q in queries])
    mixed = engine.step(RaggedBatch.from_lists(queries + long_rows * 3)).numpy()[: len(queries)]
    assert row_cosines(alone, mixed).min() >= min_cosine


def test_int8_linear_scales_each_sequence_on_its_own() -> None:
    """Inside `per_sequence`, each sequence's rows are one quantized call (their own
    activation scale): the result is the concatenation of the sequences run alone, and a
    small-valued sequence keeps its precision next to a large-valued one."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    layer = Int8Linear(linear)
    small = torch.randn(3, 64, generator=gen) * 0.01
    large = torch.randn(5, 64, generator=gen) * 100.0
    x = torch.cat([small, large])
    exact = (x.double() @ linear.weight.detach().double().T).numpy()  # bias left out

    def products(y: torch.Tensor) -> np.ndarray:
        return (y.double() - linear.bias.detach().double()).numpy()

    with per_sequence([0, 3, 8]):
        grouped = layer(x)
    alone = torch.cat([layer(small), layer(large)])
    assert torch.equal(grouped, alone)
    together = layer(x)  # one scale for both: the small rows drown in the large ones' range
    assert row_cosines(products(grouped), exact).min() > 0.999
    assert row_cosines(products(together)[:3], exact[:3]).min() < 0.99
    with per_sequence([0, 4]):  # not this input's rows: one call, as outside
        assert torch.equal(layer(x), together)


@pytest.mark.parametrize("bf16_speedup", [1.8, 0.55])
def test_int8_swaps_only_the_encoder_linears(
    e5_dir: Path, monkeypatch: pytest.MonkeyPatch, bf16_speedup: float
) -> None:
    """int8 for the attention's projections; the MLP's in packed bf16 on a CPU whose bf16
    products are faster than fp32 ones (AMD Zen 4: 1.5-2x), else packed fp32 (Intel
    without AMX: 0.55x), the up projection with GELU fused."""
    import rose.packed

    monkeypatch.setattr(rose.packed, "bf16_speedup", lambda: bf16_speedup)
    engine = Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8", accuracy_gate=False))
    model = engine._model
    for layer in model.encoder.layers:
        for linear in (layer.attention.qkv, layer.attention.out):
            assert isinstance(linear, Int8Linear)
            assert linear.inv_smooth is not None  # calibrated on the check set
        want = torch.bfloat16 if bf16_speedup > 1 else torch.float32
        for linear in (layer.mlp.up, layer.mlp.down):
            assert isinstance(linear, PackedLinear)
            assert linear.weight.dtype == want
        assert layer.mlp.act_fused  # GELU runs inside the packed up projection


@pytest.mark.parametrize("bf16_speedup", [1.8, 0.55])
def test_bf16_mode_warns_on_a_cpu_where_bf16_is_slower(
    e5_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    bf16_speedup: float,
) -> None:
    import rose.engine

    monkeypatch.setattr(rose.engine, "bf16_speedup", lambda: bf16_speedup)
    with caplog.at_level("WARNING", logger="rose.engine"):
        Engine.load(e5_dir, EngineConfig(device="cpu", dtype="bfloat16", accuracy_gate=False))
        Engine.load(e5_dir, EngineConfig(device="cpu", accuracy_gate=False))  # fp32: never
    warned = [r.getMessage() for r in caplog.records if "bfloat16" in r.getMessage()]
    if bf16_speedup < 1:
        assert len(warned) == 1 and "0.55x the float32 rate" in warned[0], warned
    else:
        assert warned == []


@FLOAT_LAYERS
def test_int8_passes_default_to_groups_of_512_tokens(
    e5_dir: Path, monkeypatch: pytest.MonkeyPatch, bf16_speedup: float, min_cosine: float
) -> None:
    """int8 runs CPU passes in groups of at most 512 tokens unless told otherwise (its
    products are per sequence, so larger groups only add joins), fp32 in 2,048; the
    grouping changes no output."""
    import rose.packed

    monkeypatch.setattr(rose.packed, "bf16_speedup", lambda: bf16_speedup)
    assert EngineConfig(quantize="int8").resolved_cpu_pass_tokens == 512
    assert EngineConfig().resolved_cpu_pass_tokens == 2048
    assert EngineConfig(quantize="int8", cpu_pass_tokens=100).resolved_cpu_pass_tokens == 100
    with pytest.raises(EngineError, match="cpu_pass_tokens must be None or an integer >= 1"):
        EngineConfig(cpu_pass_tokens=0)
    rng = np.random.default_rng(5)
    rows = [rng.integers(5, 1000, n).tolist() for n in (300, 200, 100, 500, 40, 30)]
    grouped = Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8"))
    whole = Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8", cpu_pass_tokens=10**6))
    calls: list[int] = []
    grouped._model.encoder.register_forward_hook(lambda m, args, out: calls.append(out.shape[0]))
    batch = RaggedBatch.from_lists(rows)
    got, want = grouped.step(batch).numpy(), whole.step(batch).numpy()
    assert calls == [500, 100, 500, 70], calls  # 300 + 200 | 100 | 500 | 40 + 30
    assert row_cosines(got, want).min() >= min_cosine


def test_measure_modes_reports_every_mode(e5_dir: Path) -> None:
    found = measure_modes(e5_dir)
    assert set(found) == {"float32", "bfloat16", "int8"}
    assert found["float32"] >= 0.99999
    assert found["bfloat16"] >= MIN_COSINE["bfloat16"]
    assert MIN_COSINE["int8"] <= found["int8"] < found["bfloat16"]


def _broken_scales(weight: torch.Tensor) -> torch.Tensor:
    """A wrong calibration: scales 16x too small, so most large weights clip at +-127."""
    return (weight.abs().amax(dim=1) / 127 / 16).clamp(min=1e-12)


def test_gate_refuses_a_broken_int8_calibration(
    e5_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("rose.int8.weight_scales", _broken_scales)
    with pytest.raises(EngineError) as err:
        Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8"))
    message = str(err.value)
    assert "int8 mode refused by the accuracy gate" in message
    assert f"below the bound {MIN_COSINE['int8']}" in message
    measured = float(message.split("is ", 1)[1].split(",")[0])
    assert measured < MIN_COSINE["int8"]
    # the same broken mode loads with the gate off, and is measurably wrong
    engine = Engine.load(e5_dir, EngineConfig(device="cpu", quantize="int8", accuracy_gate=False))
    reference = Engine.load(e5_dir, EngineConfig(device="cpu"))
    batch = RaggedBatch.from_lists([[0, 6, 7, 8, 2]] * 2)
    assert row_cosines(engine.check_rows(batch), reference.check_rows(batch)).min() < 0.99


def test_tulip_exits_naming_the_refused_mode(e5_dir: Path, tmp_path: Path) -> None:
    """A real Tulip process with the broken calibration injected exits non-zero and says
    which mode, what cosine and which bound."""
    script = textwrap.dedent(
        f"""
        import sys
        import rose.int8
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_cpu_precision import _broken_scales
        rose.int8.weight_scales = _broken_scales
        from tulip.__main__ import main
        sys.exit(main(["--model", {str(e5_dir)!r}, "--device", "cpu", "--quantize", "int8",
                       "--threads", "1", "--port", "0", "--metrics-port", "0"]))
        """
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode != 0
    assert "int8 mode refused by the accuracy gate" in done.stderr, done.stderr[-3000:]
    assert "below the bound 0.99" in done.stderr


def test_check_set_is_real_text_and_tokenized(e5_dir: Path) -> None:
    from rose.int8 import check_batch

    batch = check_batch(e5_dir, 250002, 512)
    tok = transformers.AutoTokenizer.from_pretrained(e5_dir)
    first = batch.input_ids[: batch.cu_seqlens[1]].tolist()
    assert first == tok(CHECK_TEXTS[0])["input_ids"]
    lengths = np.diff(batch.cu_seqlens)
    assert lengths.max() >= 400 and lengths.min() >= 5  # the joined rows are long


# -- tiny random BERT / XLM-R against transformers fp32 ---------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    torch.manual_seed(25)
    root = tmp_path_factory.mktemp("tiny-precision")
    built = {
        "bert": transformers.BertModel(tiny_configs.bert(), add_pooling_layer=False),
        "xlmr": transformers.XLMRobertaModel(tiny_configs.xlmr(), add_pooling_layer=False),
        "bert-ce": transformers.BertForSequenceClassification(tiny_configs.bert(num_labels=3)),
        "xlmr-ce": transformers.XLMRobertaForSequenceClassification(
            tiny_configs.xlmr(num_labels=1)
        ),
    }
    out = {}
    for name, model in built.items():
        model.eval().save_pretrained(root / name)
        out[name] = (model, root / name)
    return out


def _rows(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[0, *rng.integers(3, VOCAB, n).tolist(), 2] for n in (3, 17, 40, 60, 9)]


def _transformers(model: torch.nn.Module, rows: list[list[int]]) -> np.ndarray:
    """Logits of a classifier, else the mean last hidden state, one row at a time."""
    out = []
    with torch.inference_mode():
        for r in rows:
            ids = torch.tensor([r])
            result = model(input_ids=ids)
            if hasattr(result, "logits"):
                out.append(result.logits[0].numpy())
            else:
                out.append(result.last_hidden_state[0].mean(0).numpy())
    return np.stack(out)


@pytest.mark.parametrize("name", ["bert", "xlmr", "bert-ce", "xlmr-ce"])
@pytest.mark.parametrize(
    ("mode", "overrides"), [("bfloat16", {"dtype": "bfloat16"}), ("int8", {"quantize": "int8"})]
)
def test_tiny_models_match_transformers(tiny, name: str, mode: str, overrides: dict) -> None:
    model, path = tiny[name]
    rows = _rows(7)
    expected = _transformers(model, rows)
    engine = Engine.load(path, EngineConfig(device="cpu", **overrides))
    got = engine.step(RaggedBatch.from_lists(rows)).numpy()  # mean pooling: no modules.json
    if name.endswith("ce"):
        spread = expected.std() + np.abs(expected).mean()
        # bf16: activations rounded to 2^-8 through every layer; the worst logit of these
        # 15 sat just over 1% of the spread once attention ran in fp32 (ONNX Runtime's
        # kernel, bf16 operands widened) instead of bf16
        tol = 0.05 if mode == "int8" else 0.015
        np.testing.assert_allclose(got, expected, atol=tol * spread, rtol=0)
    else:
        assert row_cosines(got, expected).min() >= MIN_COSINE[mode]


def test_config_validation() -> None:
    with pytest.raises(EngineError, match="quantize must be None or one of"):
        EngineConfig(quantize="int4")
    with pytest.raises(EngineError, match="cannot be combined"):
        EngineConfig(quantize="int8", dtype="bfloat16")
    with pytest.raises(EngineError, match="CPU only"):
        EngineConfig(device="cuda", quantize="int8")
    with pytest.raises(EngineError, match="accuracy_gate must be a boolean"):
        EngineConfig(accuracy_gate="yes")  # type: ignore[arg-type]


def test_tulip_quantize_flag() -> None:
    from tulip.config import ConfigError, TulipConfig

    assert TulipConfig.from_args(["--model", "m"]).quantize == "none"
    assert TulipConfig.from_args(["--model", "m", "--quantize", "int8"]).quantize == "int8"
    assert TulipConfig.from_args(["--model", "m"], {"TULIP_QUANTIZE": "int8"}).quantize == "int8"
    with pytest.raises(ConfigError, match="--quantize must be one of none, int8"):
        TulipConfig.from_args(["--model", "m", "--quantize", "int4"])
    with pytest.raises(ConfigError, match="--dtype bfloat16 cannot be combined"):
        TulipConfig.from_args(["--model", "m", "--quantize", "int8", "--dtype", "bfloat16"])
    with pytest.raises(ConfigError, match="runs on the CPU"):
        TulipConfig.from_args(["--model", "m", "--quantize", "int8", "--device", "cuda"])


def test_models_verify_reports_each_mode(model_path, tmp_path: Path) -> None:  # noqa: ANN001
    """`trellis models verify` on a copy of a pulled encoder asset prints and records every
    CPU mode's accuracy; a tokenizer-only asset gets no precision report."""
    import json
    import shutil

    from rose.assets.store import MANIFEST, measure_precision

    assert measure_precision(model_path("xlmr-tokenizer")) == []
    name = "all-minilm-l6-v2"
    shutil.copytree(model_path(name), tmp_path / name)
    env = dict(os.environ, TRELLIS_MODELS_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    trellis = Path(sys.executable).parent / "trellis"
    done = subprocess.run(
        [str(trellis), "models", "verify", name],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "float32: min cosine to float32 1.0000" in out or "0.99999" in out, out
    assert "bfloat16: min cosine to float32 0.999" in out and "(bound 0.999: ok)" in out, out
    assert "int8: min cosine to float32 0.99" in out and "(bound 0.99: ok)" in out, out
    assert "this CPU runs packed bf16 products at " in out, out
    manifest = json.loads((tmp_path / name / MANIFEST).read_text())
    recorded = manifest["precision"]
    assert set(recorded) == {"float32", "bfloat16", "int8"}
    assert recorded["int8"]["ok"] and recorded["int8"]["min_cosine"] >= MIN_COSINE["int8"]
    assert manifest["cpu"]["bf16_speedup"] > 0


# -- tiny random Qwen3 encoders (Qwen3-Embedding shape) and a Qwen3 classifier ---------------


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    from rose.assets.layout import write_pooling

    def config(**extra: object) -> transformers.Qwen3Config:
        return transformers.Qwen3Config(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            **extra,
        )

    torch.manual_seed(25)
    root = tmp_path_factory.mktemp("tiny-qwen3-precision")
    embedder = transformers.Qwen3Model(config()).eval()
    embedder.save_pretrained(root / "embedding")
    write_pooling(root / "embedding", 64, "lasttoken", normalize=True)
    ce = transformers.Qwen3ForSequenceClassification(config(num_labels=1, pad_token_id=0))
    ce.eval().save_pretrained(root / "ce")
    return {"embedding": (embedder, root / "embedding"), "ce": (ce, root / "ce")}


@pytest.mark.parametrize("name", ["embedding", "ce"])
@pytest.mark.parametrize(
    ("mode", "overrides"), [("bfloat16", {"dtype": "bfloat16"}), ("int8", {"quantize": "int8"})]
)
def test_tiny_qwen3_matches_transformers(tiny_qwen3, name: str, mode: str, overrides: dict) -> None:
    model, path = tiny_qwen3[name]
    rng = np.random.default_rng(3)
    rows = [rng.integers(1, 1000, n).tolist() for n in (3, 17, 40, 9, 64)]
    expected = []
    with torch.inference_mode():
        for r in rows:
            result = model(input_ids=torch.tensor([r]))
            if name == "ce":
                expected.append(result.logits[0].numpy())
            else:  # causal, pooled at the last token, normalized
                last = result.last_hidden_state[0, -1]
                expected.append(torch.nn.functional.normalize(last, dim=-1).numpy())
    want = np.stack(expected)
    engine = Engine.load(path, EngineConfig(device="cpu", **overrides))
    if mode == "int8":  # q and o int8; the GQA k / v (narrower) and the MLP float
        layer = engine._model.encoder.layers[0]
        assert isinstance(layer.attention.wq, Int8Linear)
        assert isinstance(layer.attention.wo, Int8Linear)
        assert not isinstance(layer.attention.wk, Int8Linear)
        for linear in (layer.mlp.w_gate, layer.mlp.w_up, layer.mlp.w_down):
            assert not isinstance(linear, Int8Linear)
    got = engine.step(RaggedBatch.from_lists(rows)).numpy()
    if name == "ce":
        spread = want.std() + np.abs(want).mean()
        tol = 0.05 if mode == "int8" else 0.01
        np.testing.assert_allclose(got, want, atol=tol * spread, rtol=0)
    else:
        assert row_cosines(got, want).min() >= MIN_COSINE[mode]


def test_int8_refuses_families_it_was_not_tested_on(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = transformers.MPNetConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    transformers.MPNetModel(config).eval().save_pretrained(tmp_path / "mpnet")
    with pytest.raises(EngineError, match="quantize='int8' serves BERT / XLM-R / Qwen3"):
        Engine.load(tmp_path / "mpnet", EngineConfig(device="cpu", quantize="int8"))
    found = measure_modes(tmp_path / "mpnet")
    assert isinstance(found["int8"], EngineError) and found["bfloat16"] >= 0.999
