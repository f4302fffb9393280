"""Tiny random models with output heads, shared by tests/test_rose_outputs.py and
tests/test_e2e_outputs.py, and their references.

* BGE-M3's shape: a small `XLMRobertaModel` saved by `transformers`, CLS pooling + Normalize
  (its sentence-transformers config), random ``sparse_linear.pt`` (Linear(H, 1)) and
  ``colbert_linear.pt`` (Linear(H, D)) beside it. The reference is FlagEmbedding's published
  formulas on `transformers`' hidden states (`bge_m3_reference`).
* SPLADE's shape: a small `BertForMaskedLM` wrapped by sentence-transformers' SparseEncoder
  (``MLMTransformer`` + ``SpladePooling``) and saved by it; the reference is that SparseEncoder.

Both get a word-level tokenizer (``w4`` ... ``w299``) with their family's special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

VOCAB = 300
HIDDEN = 32
COLBERT_DIM = 24
TEXTS = [
    "w4 w5 w6",
    "w10 w11 w12 w13 w14 w15 w16 w17 w10 w11",
    "w99",
    " ".join(f"w{4 + (i * 7) % 290}" for i in range(30)),
    "w200 w201 w7 w7 w7",
]


def _tokenizer(path: Path, specials: list[str], cls: str, sep: str) -> Tokenizer:
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[3]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    return tok


def _spread(model: torch.nn.Module) -> None:
    """Larger random weights than HF's init, so outputs differ clearly between tokens."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "norm" not in name.lower():
                p.normal_(0.0, 0.3)


def make_bge_m3(path: Path) -> Path:
    torch.manual_seed(3)
    config = transformers.XLMRobertaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=66,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False)
    _spread(model)
    model.save_pretrained(path, safe_serialization=True)
    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tok = _tokenizer(path, specials, "<s>", "</s>")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", cls_token="<s>", eos_token="</s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>",
    )  # fmt: skip
    fast.save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]  # fmt: skip
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": True})
    )
    sparse = torch.nn.Linear(HIDDEN, 1)
    colbert = torch.nn.Linear(HIDDEN, COLBERT_DIM)
    with torch.no_grad():
        sparse.weight.normal_(0.0, 0.5)
        sparse.bias.fill_(1.0)  # about half the tokens weigh > 0
    torch.save(sparse.state_dict(), path / "sparse_linear.pt")
    torch.save(colbert.state_dict(), path / "colbert_linear.pt")
    return path


def make_splade(path: Path, layout: str = "bert") -> Path:
    """A SparseEncoder directory saved by sentence-transformers over a random
    BertForMaskedLM, or a DistilBertForMaskedLM (``layout="distilbert"``: most published
    SPLADE models, e.g. naver/splade-cocondenser-ensembledistil)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    torch.manual_seed(4)
    base = path.parent / (path.name + "-base")
    if layout == "distilbert":
        model: transformers.PreTrainedModel = transformers.DistilBertForMaskedLM(
            transformers.DistilBertConfig(
                vocab_size=VOCAB,
                dim=HIDDEN,
                n_layers=2,
                n_heads=4,
                hidden_dim=64,
                max_position_embeddings=64,
            )  # fmt: skip
        )
    else:
        config = transformers.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        model = transformers.BertForMaskedLM(config)
    _spread(model)
    model.save_pretrained(base, safe_serialization=True)
    specials = ["[PAD]", "[CLS]", "[SEP]", "[UNK]"]
    tok = _tokenizer(base, specials, "[CLS]", "[SEP]")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[UNK]",
    )  # fmt: skip
    fast.save_pretrained(base)
    encoder = SparseEncoder(modules=[MLMTransformer(str(base)), SpladePooling("max")])
    encoder.save_pretrained(str(path))
    return path


def encode(path: Path, texts: list[str]) -> list[list[int]]:
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [e.ids for e in tok.encode_batch(texts)]


def bge_m3_reference(
    path: Path, rows: list[list[int]]
) -> tuple[np.ndarray, list[dict[int, float]], list[np.ndarray]]:
    """FlagEmbedding's BGE-M3 outputs on `transformers` hidden states, one row at a time:
    dense = normalize(h[CLS]); sparse = per token id the max of relu(sparse_linear(h)) over
    the row, without cls/eos/pad/unk and zeros; colbert = normalize(colbert_linear(h[1:]))."""
    model = transformers.XLMRobertaModel.from_pretrained(path, add_pooling_layer=False).eval()
    sparse_linear = torch.nn.Linear(HIDDEN, 1)
    sparse_linear.load_state_dict(torch.load(path / "sparse_linear.pt"))
    colbert_linear = torch.nn.Linear(HIDDEN, COLBERT_DIM)
    colbert_linear.load_state_dict(torch.load(path / "colbert_linear.pt"))
    unused = {0, 1, 2, 3}  # <s>, <pad>, </s>, <unk>: cls, pad, eos, unk
    dense, sparse, colbert = [], [], []
    with torch.no_grad():
        for ids in rows:
            h = model(input_ids=torch.tensor([ids])).last_hidden_state[0]  # [L, H]
            dense.append(torch.nn.functional.normalize(h[0], dim=-1).numpy())
            weights = torch.relu(sparse_linear(h)).squeeze(-1).tolist()
            found: dict[int, float] = {}
            for i, w in zip(ids, weights, strict=True):
                if i not in unused and w > 0 and w > found.get(i, 0.0):
                    found[i] = w
            sparse.append(found)
            vecs = torch.nn.functional.normalize(colbert_linear(h[1:]), dim=-1)
            colbert.append(vecs.numpy())
    return np.stack(dense), sparse, colbert


def splade_reference(path: Path, texts: list[str]) -> list[dict[int, float]]:
    """sentence-transformers' SparseEncoder on `texts`: token id -> weight per text."""
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(path), device="cpu")
    out = encoder.encode(texts, convert_to_tensor=True)
    dense = out.to_dense().numpy()
    return [{int(i): float(row[i]) for i in np.flatnonzero(row)} for row in dense]


def maxsim(query: np.ndarray, doc: np.ndarray) -> float:
    """ColBERT late interaction: Σ over query vectors of the max dot product with the doc's."""
    return float((query @ doc.T).max(axis=1).sum())
