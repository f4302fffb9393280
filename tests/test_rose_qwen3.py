"""ROSE's Qwen3 encoders against `transformers` on tiny random-weight models (fp32, CPU).

Two uses of the same weights: causal attention with last-token pooling (Qwen3-Embedding)
against `Qwen3Model` as it runs, and bidirectional attention with mean pooling (pplx-embed)
against `Qwen3Model` given an all-zeros additive 4-D mask (transformers then applies no
causal mask). Every model is saved with ``save_pretrained`` and loaded through
`Engine.load`, so the real loading path (family dispatch, name map, settings) is tested.

Rerankers: a causal LM with a sentence-transformers LogitScore module (Qwen3-Reranker as
sentence-transformers >= 5.4 ships it) against `Qwen3ForCausalLM`'s softmax over the "yes"
and "no" logits at the last token, tied and untied LM head; and a
`Qwen3ForSequenceClassification`.

Tolerances: pooled embeddings, hidden states and logits within 1e-4 of transformers; a row
of a mixed-length ragged batch within 1e-5 of the same row run alone.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rose import Engine, EngineConfig, EngineError, RaggedBatch
from rose.assets.layout import write_pooling
from rose.attention import SdpaBackend
from rose.graphs import RecordingCaptureBackend
from rose.loading import read_config, read_tensors
from rose.models import FAMILIES, FamilyOptions, family_for

VOCAB = 1000
YES, NO = 9, 4  # the reranker's "yes" / "no" token ids in the tiny vocabulary
LENGTHS = (1, 2, 5, 17, 33, 64, 3, 40)
ATOL = 1e-4


def _qwen3_config(**extra: object) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        head_dim=16,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        **extra,
    )


def _edit_config(path: Path, **changes: object) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[torch.nn.Module, Path]]:
    """Model directories by use, each with the transformers module that is its reference."""
    torch.manual_seed(2024)
    root = tmp_path_factory.mktemp("qwen3")
    base = transformers.Qwen3Model(_qwen3_config()).eval()
    out: dict[str, tuple[torch.nn.Module, Path]] = {}

    # Qwen3-Embedding style: plain qwen3 config, last-token pooling, normalized.
    causal = root / "qwen3-embedding"
    base.save_pretrained(causal)
    write_pooling(causal, 64, "lasttoken", normalize=True)
    out["causal"] = (base, causal)

    # pplx-embed style: its model_type, architecture and flag; mean pooling, not normalized.
    bidir = root / "pplx-embed"
    base.save_pretrained(bidir)
    _edit_config(
        bidir,
        model_type="bidirectional_pplx_qwen3",
        architectures=["PPLXQwen3Model"],
        use_bidirectional_attention=True,
    )
    write_pooling(bidir, 64, "mean")
    out["bidirectional"] = (base, bidir)

    # No sentence-transformers files: the family's default pooling applies.
    bare = root / "qwen3-bare"
    base.save_pretrained(bare)
    out["bare"] = (base, bare)

    # A causal LM checkpoint ("model." prefix, untied lm_head) served as an embedder.
    torch.manual_seed(7)
    lm = transformers.Qwen3ForCausalLM(_qwen3_config(attention_bias=True)).eval()
    lm.save_pretrained(root / "qwen3-lm")
    out["lm"] = (lm.model, root / "qwen3-lm")

    # A one-label sequence classifier (a Qwen3-Reranker converted to "yes minus no").
    torch.manual_seed(8)
    ce = transformers.Qwen3ForSequenceClassification(_qwen3_config(num_labels=1, pad_token_id=0))
    ce.eval().save_pretrained(root / "qwen3-ce")
    out["ce"] = (ce, root / "qwen3-ce")

    # Qwen3-Reranker as sentence-transformers >= 5.4 ships it: causal LM + LogitScore.
    for name, tied in (("rr-tied", True), ("rr-untied", False)):
        torch.manual_seed(9)
        rr = transformers.Qwen3ForCausalLM(_qwen3_config(tie_word_embeddings=tied)).eval()
        rr.save_pretrained(root / name)
        _write_logit_score(root / name, YES, NO)
        out[name] = (rr, root / name)
    return out


def _write_logit_score(path: Path, true_id: int, false_id: int | None) -> None:
    modules = [
        {
            "idx": 0,
            "name": "0",
            "path": "",
            "type": "sentence_transformers.base.models.Transformer",
        },
        {
            "idx": 1,
            "name": "1",
            "path": "1_LogitScore",
            "type": "sentence_transformers.cross_encoder.modules.LogitScore",
        },
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_LogitScore").mkdir(exist_ok=True)
    (path / "1_LogitScore" / "config.json").write_text(
        json.dumps({"true_token_id": true_id, "false_token_id": false_id})
    )


def _rows(seed: int, lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, size=n).tolist() for n in lengths]


def _reference(model: torch.nn.Module, row: list[int], causal: bool) -> torch.Tensor:
    """transformers' last hidden states [L, H] of one row, causal or bidirectional."""
    n = len(row)
    kwargs = {} if causal else {"attention_mask": torch.zeros(1, 1, n, n)}  # attend everywhere
    with torch.no_grad():
        return model(input_ids=torch.tensor([row]), **kwargs).last_hidden_state[0]


def _reference_last_token_batch(model: torch.nn.Module, rows: list[list[int]]) -> torch.Tensor:
    """Qwen3-Embedding's recipe: one right-padded causal batch with a 2-D attention mask,
    each row pooled at its last real token (found from the mask). [B, H]"""
    longest = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.int64)
    mask = torch.zeros(len(rows), longest, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
    last = mask.sum(1) - 1  # [B]
    return hidden[torch.arange(len(rows)), last]


def _ragged_hidden(path: Path, rows: list[list[int]], attention_mode: str = "auto") -> torch.Tensor:
    """The family's hidden states [T, H] for a ragged batch, built the way `Engine.load`
    builds the model (config → weights → module), attention through SDPA."""
    raw = read_config(path)
    family = family_for(raw)
    cfg = family.config(raw, FamilyOptions(attention_mode))
    with torch.device("meta"):
        model = family.model(cfg)
    model.load_state_dict(family.load_weights(cfg, read_tensors(path)), strict=True, assign=True)
    model.eval()
    batch = RaggedBatch.from_lists(rows)
    cu = batch.cu_seqlens.astype(np.int64)
    backend = SdpaBackend("per-sequence", causal=cfg.causal)
    positions = torch.from_numpy(family.position_ids(cfg, batch.input_ids, cu))
    with torch.no_grad():
        return model.encoder(
            torch.from_numpy(batch.input_ids), positions, None, backend, backend.plan(cu)
        )


def test_family_table_dispatches_by_model_type(models) -> None:
    assert FAMILIES["qwen3"] is FAMILIES["bidirectional_pplx_qwen3"]
    assert FAMILIES["bert"] is FAMILIES["xlm-roberta"] is not FAMILIES["qwen3"]
    with pytest.raises(EngineError, match="unsupported model_type 'gpt2'"):
        family_for({"model_type": "gpt2"})


@pytest.mark.parametrize("use", ["causal", "bidirectional", "lm"])
def test_hidden_states_match_transformers(models, use: str) -> None:
    model, path = models[use]
    rows = _rows(0)
    hidden = _ragged_hidden(path, rows)  # [T, H]
    start = 0
    for row in rows:
        want = _reference(model, row, causal=use != "bidirectional")
        torch.testing.assert_close(hidden[start : start + len(row)], want, atol=ATOL, rtol=0)
        start += len(row)


def test_causal_last_token_embeddings_match_transformers(models) -> None:
    model, path = models["causal"]
    engine = Engine.load(path)
    info = engine.info
    assert (info.kind, info.dimensions, info.default_pooling, info.default_normalize) == (
        "embedding",
        64,
        "last",
        True,
    )
    assert engine.attention.causal
    rows = _rows(1)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()  # [B, H]
    want = torch.nn.functional.normalize(_reference_last_token_batch(model, rows), dim=-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_bidirectional_mean_embeddings_match_transformers(models) -> None:
    model, path = models["bidirectional"]
    engine = Engine.load(path)
    assert (engine.info.default_pooling, engine.info.default_normalize) == ("mean", False)
    assert not engine.attention.causal
    rows = _rows(2)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()
    for i, row in enumerate(rows):
        want = _reference(model, row, causal=False).mean(0)
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0)
    # the reference really is bidirectional: the causal mean of the same row differs
    causal_mean = _reference(model, rows[3], causal=True).mean(0)
    assert (got[3] - causal_mean).abs().max().item() > 1e-2


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_per_row_pooling_over_causal_hidden_states(models, pooling: str) -> None:
    model, path = models["causal"]
    engine = Engine.load(path)
    rows = _rows(3)
    batch = RaggedBatch.from_lists(
        rows, pooling=[pooling] * len(rows), normalize=[False] * len(rows)
    )
    got = engine.step(batch).wait()
    for i, row in enumerate(rows):
        hidden = _reference(model, row, causal=True)
        want = {"mean": hidden.mean(0), "cls": hidden[0], "last": hidden[-1]}[pooling]
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0)


def test_default_pooling_without_sentence_transformers_files(models) -> None:
    model, path = models["bare"]
    causal = Engine.load(path)
    assert (causal.info.default_pooling, causal.info.default_normalize) == ("last", False)
    bidir = Engine.load(path, EngineConfig(attention_mode="bidirectional"))
    assert bidir.info.default_pooling == "mean" and not bidir.attention.causal
    row = _rows(4, (9,))[0]
    got = causal.step(RaggedBatch.from_lists([row])).wait()[0]
    torch.testing.assert_close(got, _reference(model, row, causal=True)[-1], atol=ATOL, rtol=0)
    got = bidir.step(RaggedBatch.from_lists([row])).wait()[0]
    want = _reference(model, row, causal=False).mean(0)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_attention_mode_override(models) -> None:
    """EngineConfig.attention_mode beats the directory, both ways; BERT refuses causal."""
    model, pplx = models["bidirectional"]
    row = _rows(5, (12,))[0]
    forced = Engine.load(pplx, EngineConfig(attention_mode="causal"))
    assert forced.attention.causal
    got = forced.step(RaggedBatch.from_lists([row])).wait()[0]
    want = _reference(model, row, causal=True).mean(0)  # the directory's pooling stays
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    _, qwen = models["causal"]
    assert not Engine.load(qwen, EngineConfig(attention_mode="bidirectional")).attention.causal
    with pytest.raises(EngineError, match="attention_mode"):
        EngineConfig(attention_mode="sideways")


def test_is_causal_flag_in_config(models, tmp_path: Path) -> None:
    _, path = models["bare"]
    d = tmp_path / "gritlm-style"
    shutil.copytree(path, d)
    _edit_config(d, is_causal=False)
    assert not Engine.load(d).attention.causal
    _edit_config(d, use_bidirectional_attention=False)  # the pplx flag wins over is_causal
    assert Engine.load(d).attention.causal


def test_bert_refuses_causal_attention(tmp_path: Path) -> None:
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=40,
    )
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    engine = Engine.load(tmp_path / "bert")
    assert not engine.attention.causal and engine.info.token_types == 2
    with pytest.raises(EngineError, match="bidirectionally only"):
        Engine.load(tmp_path / "bert", EngineConfig(attention_mode="causal"))


@pytest.mark.parametrize("strategy", ["per-sequence", "block-diagonal"])
@pytest.mark.parametrize("use", ["causal", "bidirectional", "ce", "rr-tied"])
def test_ragged_batch_equals_rows_alone(models, use: str, strategy: str) -> None:
    _, path = models[use]
    engine = Engine.load(path, EngineConfig(sdpa_strategy=strategy))
    rows = _rows(6)
    together = engine.step(RaggedBatch.from_lists(rows)).wait()
    for i, row in enumerate(rows):
        alone = engine.step(RaggedBatch.from_lists([row])).wait()
        torch.testing.assert_close(together[i], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("use", ["causal", "bidirectional"])
def test_graph_path_with_padding_row_matches_eager(models, use: str) -> None:
    """The graph-keyed path (recorded on the CPU): padded buckets with a padding row."""
    _, path = models[use]
    rows = _rows(7, (5, 17, 3))
    eager = Engine.load(path).step(RaggedBatch.from_lists(rows)).wait()
    graphed = Engine.load(path)
    rec = RecordingCaptureBackend()
    graphed.use_capture_backend(rec)
    for _ in range(3):  # warm-up, capture, replay
        got = graphed.step(RaggedBatch.from_lists(rows)).wait()
        torch.testing.assert_close(got, eager, atol=1e-5, rtol=0)
    assert [e for e, _ in rec.events] == ["warmup", "capture", "replay", "replay"]


def test_sequence_classifier_logits_match_transformers(models) -> None:
    model, path = models["ce"]
    engine = Engine.load(path)
    assert (engine.info.kind, engine.info.num_labels) == ("cross-encoder", 1)
    rows = _rows(8)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()
    assert got.shape == (len(rows), 1)
    with torch.no_grad():
        for i, row in enumerate(rows):
            want = model(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["rr-tied", "rr-untied"])
def test_logit_score_reranker_matches_yes_no_softmax(models, name: str) -> None:
    """score = softmax over the "yes"/"no" LM logits at the last token: the engine's one
    logit is their difference, whose sigmoid (the "default" activation for one label) is it."""
    from rose.pooling import apply_activation

    model, path = models[name]
    engine = Engine.load(path)
    assert (engine.info.kind, engine.info.num_labels, engine.info.token_types) == (
        "cross-encoder",
        1,
        1,
    )
    assert engine.attention.causal
    rows = _rows(9)
    got = engine.step(RaggedBatch.from_lists(rows)).wait()  # [B, 1]
    scores = apply_activation(got, "default", engine.info.num_labels)[:, 0]
    with torch.no_grad():
        for i, row in enumerate(rows):
            last = model(input_ids=torch.tensor([row])).logits[0, -1]  # [V]
            pair = last[[NO, YES]]
            torch.testing.assert_close(got[i, 0], pair[1] - pair[0], atol=ATOL, rtol=0)
            want = torch.softmax(pair, dim=-1)[1]
            torch.testing.assert_close(scores[i], want, atol=ATOL, rtol=0)


def test_logit_score_needs_an_lm_head(models, tmp_path: Path) -> None:
    _, path = models["rr-untied"]
    d = tmp_path / "headless"
    shutil.copytree(path, d)
    tensors = load_file(str(d / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match="needs the LM head 'lm_head.weight'"):
        Engine.load(d)
    _write_logit_score(d, VOCAB + 3, None)
    with pytest.raises(EngineError, match="outside the vocabulary"):
        Engine.load(d)
    _, bert_dir = models["ce"]  # a sequence classifier already has its head
    d2 = tmp_path / "ce-with-logit-score"
    shutil.copytree(bert_dir, d2)
    _write_logit_score(d2, YES, NO)
    with pytest.raises(EngineError, match="LogitScore module needs a causal LM"):
        Engine.load(d2)


def test_bad_checkpoints_name_the_problem(models, tmp_path: Path) -> None:
    _, path = models["bare"]
    d = tmp_path / "broken"
    shutil.copytree(path, d)
    tensors = load_file(str(d / "model.safetensors"))
    dropped = {k: v for k, v in tensors.items() if k != "layers.1.self_attn.k_norm.weight"}
    save_file(dropped, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match=r"missing 1 tensors.*layers\.1\.self_attn\.k_norm"):
        Engine.load(d)
    bad = dict(tensors)
    bad["layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # as if no GQA
    save_file(bad, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match="k_proj.weight has shape"):
        Engine.load(d)
    extra = dict(tensors)
    extra["layers.0.surprise"] = torch.zeros(2)
    save_file(extra, str(d / "model.safetensors"))
    with pytest.raises(EngineError, match="unexpected tensors"):
        Engine.load(d)
    save_file(tensors, str(d / "model.safetensors"))
    _edit_config(d, use_sliding_window=True)
    with pytest.raises(EngineError, match="use_sliding_window"):
        Engine.load(d)
    _edit_config(d, use_sliding_window=False, architectures=["Qwen3MoeForCausalLM"])
    with pytest.raises(EngineError, match="unsupported architecture 'Qwen3MoeForCausalLM'"):
        Engine.load(d)


def test_token_types_must_be_zero(models) -> None:
    _, path = models["causal"]
    engine = Engine.load(path)
    with pytest.raises(EngineError, match="token type ids must be in 0..0"):
        engine.step(RaggedBatch.from_lists([[5, 6]], token_type_ids=[[0, 1]]))
    with pytest.raises(EngineError, match="at most 128"):
        engine.step(RaggedBatch.from_lists([[5] * 129]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["causal", "bidirectional"])
def test_cuda_flashinfer_agrees_with_sdpa(tmp_path: Path, mode: str) -> None:
    """bf16 on CUDA: the default backend (FlashInfer ragged prefill when it imports, with
    CUDA graphs) against SDPA, eager, for both attention modes (cos >= 0.999)."""
    from rose.attention import flashinfer_coverage

    torch.manual_seed(11)
    cfg = _qwen3_config(hidden_size=128, intermediate_size=256, head_dim=64)
    transformers.Qwen3Model(cfg).save_pretrained(tmp_path)
    rows = _rows(10)
    batch = RaggedBatch.from_lists(rows, pooling=["mean"] * len(rows))
    fast = Engine.load(tmp_path, EngineConfig(device="cuda", attention_mode=mode))
    uncovered = flashinfer_coverage(fast.attention.name)  # raises on a silent fallback
    assert fast.attention.causal == (mode == "causal")
    slow = Engine.load(
        tmp_path,
        EngineConfig(device="cuda", attention="sdpa", cuda_graphs=False, attention_mode=mode),
    )
    want = slow.step(batch).wait()
    for _ in range(3):  # warm-up, capture, replay
        got = fast.step(batch).wait()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.min().item() >= 0.999, cos
    if uncovered:  # graphs agreed with eager, but FlashInfer itself was not tested
        pytest.skip(uncovered)


@pytest.mark.parametrize("name", ["causal", "bidirectional", "ce"])
def test_grouped_cpu_passes_equal_one_pass(models, name: str) -> None:
    """CPU passes in groups of rows (`EngineConfig.cpu_pass_tokens`): last-token and mean
    embeddings and classifier logits equal the batch's in one pass."""
    path = models[name][1]
    rows = _rows(9)
    whole = Engine.load(path, EngineConfig(cpu_pass_tokens=10**6))
    grouped = Engine.load(path, EngineConfig(cpu_pass_tokens=max(LENGTHS)))
    calls: list[int] = []
    grouped._model.encoder.register_forward_hook(lambda m, a, out: calls.append(len(out)))
    want = whole.step(RaggedBatch.from_lists(rows)).wait()
    got = grouped.step(RaggedBatch.from_lists(rows)).wait()
    assert len(calls) >= 3 and sum(calls) == sum(LENGTHS)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
