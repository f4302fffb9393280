"""ROSE's BERT-layout encoders (BERT, XLM-R, RoBERTa, CamemBERT, DistilBERT) and their
cross-encoder heads against `transformers` on tiny random-weight models (fp32, CPU).

Tolerances: pooled embeddings and logits within 1e-4 of transformers (observed ~1e-6); a row in
a mixed-length ragged batch within 1e-5 of the same row run alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tiny_configs
import torch
import transformers

from rose import Engine, EngineConfig, EngineError, RaggedBatch

VOCAB = tiny_configs.VOCAB
LENGTHS = (1, 2, 5, 17, 33, 64, 3, 40)


def _save(model: torch.nn.Module, where: Path, bin_format: bool = False) -> Path:
    model.save_pretrained(where, safe_serialization=not bin_format)
    return where


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    torch.manual_seed(1234)
    root = tmp_path_factory.mktemp("tiny")
    built = {
        "bert": transformers.BertModel(tiny_configs.bert(layer_norm_eps=1e-7)),
        "xlmr": transformers.XLMRobertaModel(tiny_configs.xlmr(), add_pooling_layer=False),
        "bert-ce": transformers.BertForSequenceClassification(
            tiny_configs.bert(num_labels=3, layer_norm_eps=1e-7)
        ),
        "xlmr-ce": transformers.XLMRobertaForSequenceClassification(
            tiny_configs.xlmr(num_labels=1)
        ),
        "roberta": transformers.RobertaModel(tiny_configs.roberta(), add_pooling_layer=False),
        "roberta-ce": transformers.RobertaForSequenceClassification(
            tiny_configs.roberta(num_labels=2)
        ),
        "camembert-ce": transformers.CamembertForSequenceClassification(
            transformers.CamembertConfig(**tiny_configs.roberta(num_labels=1).to_dict())
        ),
        "distilbert": transformers.DistilBertModel(tiny_configs.distilbert()),
        "distilbert-ce": transformers.DistilBertForSequenceClassification(
            tiny_configs.distilbert(num_labels=3)
        ),
    }
    out = {}
    for name, model in built.items():
        model.eval()
        out[name] = (model, _save(model, root / name))
    bin_model = built["bert-ce"]
    out["bert-ce-bin"] = (bin_model, _save(bin_model, root / "bert-ce-bin", bin_format=True))
    return out


def _rows(rng: np.random.Generator, lengths: tuple[int, ...], family: str) -> list[list[int]]:
    roberta_layout = family.startswith(("xlmr", "roberta", "camembert"))
    bos, eos = (0, 2) if roberta_layout else (101 % VOCAB, 102 % VOCAB)
    rows = []
    for n in lengths:
        body = rng.integers(3, VOCAB, size=max(n - 2, 0)).tolist()
        rows.append(([bos] + body + [eos])[:n] if n >= 2 else [bos])
    return rows


def _reference_hidden(
    model: torch.nn.Module, row: list[int], types: list[int] | None = None
) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if types is None else {"token_type_ids": torch.tensor([types])}
        return model(input_ids=torch.tensor([row]), **kwargs).last_hidden_state[0]  # [L, H]


@pytest.mark.parametrize("name", ["bert", "xlmr", "roberta", "distilbert"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_encoder_pooling_matches_transformers(models, name: str, pooling: str) -> None:
    model, path = models[name]
    engine = Engine.load(path, EngineConfig())
    rows = _rows(np.random.default_rng(0), LENGTHS, name)
    batch = RaggedBatch.from_lists(
        rows, pooling=[pooling] * len(rows), normalize=[False] * len(rows)
    )
    got = engine.step(batch).wait()
    assert got.shape == (len(rows), engine.info.dimensions) and got.dtype == torch.float32
    for i, row in enumerate(rows):
        hidden = _reference_hidden(model, row)
        want = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)


def test_normalize_per_row_and_default(models) -> None:
    model, path = models["bert"]
    engine = Engine.load(path)
    assert engine.info.default_normalize is False and engine.info.default_pooling == "mean"
    rows = _rows(np.random.default_rng(1), (9, 12), "bert")
    got = engine.step(RaggedBatch.from_lists(rows, normalize=[True, None])).wait()
    means = [_reference_hidden(model, r).mean(0) for r in rows]
    torch.testing.assert_close(got[0], means[0] / means[0].norm(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1], means[1], atol=1e-4, rtol=0)
    assert abs(got[0].norm().item() - 1.0) < 1e-5


def test_token_types_are_used(models) -> None:
    model, path = models["bert"]
    engine = Engine.load(path)
    rows = _rows(np.random.default_rng(2), (10, 7), "bert")
    types = [[0] * 4 + [1] * 6, [0] * 7]
    got = engine.step(RaggedBatch.from_lists(rows, token_type_ids=types)).wait()
    for i in range(2):
        want = _reference_hidden(model, rows[i], types[i]).mean(0)
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)
    plain = engine.step(RaggedBatch.from_lists(rows[:1])).wait()
    assert (plain[0] - got[0]).abs().max().item() > 1e-3  # type 1 changed the first row


def test_from_packed_pairs_match_lists(models) -> None:
    _, path = models["bert-ce"]
    engine = Engine.load(path)
    rows = _rows(np.random.default_rng(3), (12, 5), "bert")
    ids = np.array([t for r in rows for t in r], dtype=np.uint32)
    packed = RaggedBatch.from_packed(
        ids, np.array([12, 5], dtype=np.uint32), first_segment_lengths=[4, 5]
    )
    listed = RaggedBatch.from_lists(rows, token_type_ids=[[0] * 4 + [1] * 8, [0] * 5])
    np.testing.assert_array_equal(packed.token_type_ids, listed.token_type_ids)
    torch.testing.assert_close(
        engine.step(packed).wait(), engine.step(listed).wait(), atol=0, rtol=0
    )


def test_xlmr_positions_skip_padding_tokens(models) -> None:
    """fairseq numbering: a padding id inside a row keeps position padding_idx and does not count."""
    model, path = models["xlmr"]
    engine = Engine.load(path)
    row = [0, 5, 6, 1, 1, 7, 8, 2]
    got = engine.step(RaggedBatch.from_lists([[0, 9, 2], row], normalize=[False, False])).wait()
    torch.testing.assert_close(got[1], _reference_hidden(model, row).mean(0), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "name", ["bert-ce", "xlmr-ce", "bert-ce-bin", "roberta-ce", "camembert-ce", "distilbert-ce"]
)
def test_cross_encoder_logits_match_transformers(models, name: str) -> None:
    model, path = models[name]
    engine = Engine.load(path)
    assert engine.info.kind == "cross-encoder"
    assert engine.info.num_labels == model.config.num_labels
    rows = _rows(np.random.default_rng(4), LENGTHS, name)
    types = None
    if name.startswith("bert"):
        types = [[0] * (len(r) // 2) + [1] * (len(r) - len(r) // 2) for r in rows]
    got = engine.step(RaggedBatch.from_lists(rows, token_type_ids=types)).wait()
    assert got.shape == (len(rows), model.config.num_labels)
    with torch.no_grad():
        for i, row in enumerate(rows):
            kwargs = {} if types is None else {"token_type_ids": torch.tensor([types[i]])}
            want = model(input_ids=torch.tensor([row]), **kwargs).logits[0]
            torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("strategy", ["auto", "per-sequence", "block-diagonal"])
@pytest.mark.parametrize("name", ["bert", "xlmr-ce", "distilbert-ce"])
def test_ragged_batch_equals_rows_alone(models, name: str, strategy: str) -> None:
    _, path = models[name]
    engine = Engine.load(path, EngineConfig(sdpa_strategy=strategy))
    rows = _rows(np.random.default_rng(5), LENGTHS, name)
    together = engine.step(RaggedBatch.from_lists(rows)).wait()
    for i, row in enumerate(rows):
        alone = engine.step(RaggedBatch.from_lists([row])).wait()
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=0)


def test_roberta_positions_skip_padding_tokens(models) -> None:
    """RoBERTa numbers positions as XLM-R does (fairseq's make_positions from pad + 1)."""
    model, path = models["roberta"]
    row = [0, 5, 6, 1, 7, 8, 2]
    got = Engine.load(path).step(RaggedBatch.from_lists([row], normalize=[False])).wait()
    torch.testing.assert_close(got[0], _reference_hidden(model, row).mean(0), atol=1e-4, rtol=0)


def test_distilbert_takes_pair_types_and_ignores_them(models) -> None:
    """DistilBERT embeds no token types; BERT-style pair ids (types 0 and 1, as its
    tokenizer builds pairs) are accepted and change nothing, as in transformers."""
    model, path = models["distilbert-ce"]
    engine = Engine.load(path)
    assert engine.info.kind == "cross-encoder" and engine.info.token_types == 2
    rows = _rows(np.random.default_rng(7), (12, 6), "distilbert-ce")
    typed = engine.step(RaggedBatch.from_lists(rows, token_type_ids=[[0] * 5 + [1] * 7, [0] * 6]))
    plain = engine.step(RaggedBatch.from_lists(rows))
    torch.testing.assert_close(typed.wait(), plain.wait(), atol=0, rtol=0)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([rows[0]])).logits[0]
    torch.testing.assert_close(plain.wait()[0], want, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("model_type", "architecture"),
    [("roberta", "XLMRobertaModel"), ("distilbert", "BertModel"), ("bert", "RobertaModel")],
)
def test_an_architecture_of_another_model_type_is_refused(
    models, tmp_path: Path, model_type: str, architecture: str
) -> None:
    import json
    import shutil

    _, path = models["roberta"]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw.update(model_type=model_type, architectures=[architecture])
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EngineError, match=f"{architecture}.*not a '{model_type}' architecture"):
        Engine.load(bad)


def test_attention_strategies_agree(models) -> None:
    _, path = models["xlmr"]
    rows = _rows(np.random.default_rng(6), LENGTHS, "xlmr")
    outs = [
        Engine.load(path, EngineConfig(sdpa_strategy=s)).step(RaggedBatch.from_lists(rows)).wait()
        for s in ("per-sequence", "block-diagonal")
    ]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)


def test_step_rejects_bad_batches(models) -> None:
    _, path = models["bert"]
    engine = Engine.load(path)
    with pytest.raises(EngineError, match="outside"):
        engine.step(RaggedBatch.from_lists([[1, VOCAB]]))
    with pytest.raises(EngineError, match="at most 96"):
        engine.step(RaggedBatch.from_lists([[5] * 97]))
    with pytest.raises(EngineError, match="token type"):
        engine.step(RaggedBatch.from_lists([[5, 6]], token_type_ids=[[0, 2]]))
    with pytest.raises(EngineError, match="at least one token"):
        RaggedBatch.from_lists([[5], []])
    with pytest.raises(EngineError, match="pooling"):
        RaggedBatch.from_lists([[5]], pooling=["max"])


def test_lazy_tensor_interfaces(models) -> None:
    import asyncio

    _, path = models["bert"]
    engine = Engine.load(path)
    lazy = engine.step(RaggedBatch.from_lists([[3, 4, 5]]))
    assert lazy.ready()
    assert lazy.shape == (1, 64)
    awaited = asyncio.run(_await(lazy))
    torch.testing.assert_close(awaited, lazy.wait())
    np.testing.assert_array_equal(lazy.numpy(), lazy.wait().numpy())
    result = lazy.wait()
    result /= 2  # a plain tensor: callers may edit it in place


async def _await(lazy):  # type: ignore[no-untyped-def]
    return await lazy


def test_auto_attention_strategy_decisions() -> None:
    from rose.attention.sdpa import choose_sdpa_strategy

    assert choose_sdpa_strategy(np.array([300])) == "per-sequence"
    assert (
        choose_sdpa_strategy(np.array([4] * 16)) == "block-diagonal"
    )  # calls cost more than waste
    assert choose_sdpa_strategy(np.array([64] * 32)) == "per-sequence"
    assert choose_sdpa_strategy(np.array([64] * 32), "cuda") == "block-diagonal"
    assert (
        choose_sdpa_strategy(np.array([512] * 32), "cuda") == "per-sequence"
    )  # [T, T] mask too big


def test_step_on_an_engine_thread_awaited_from_asyncio(models) -> None:
    """How Tulip drives the engine: step() on one dedicated thread, results awaited on a loop."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    _, path = models["xlmr"]
    engine = Engine.load(path)
    rows = _rows(np.random.default_rng(8), (4, 9, 30), "xlmr")
    batches = [RaggedBatch.from_lists([r]) for r in rows]

    async def serve() -> list[torch.Tensor]:
        with ThreadPoolExecutor(max_workers=1) as pool:
            futures = [asyncio.wrap_future(pool.submit(engine.step, b)) for b in batches]
            return [await (await f) for f in futures]

    got = asyncio.run(serve())
    for batch, result in zip(batches, got, strict=True):
        torch.testing.assert_close(result, engine.step(batch).wait(), atol=0, rtol=0)
