"""Training prompts for the MTP head come from local text and leave held-out prompts out."""

from __future__ import annotations

import json
from pathlib import Path

from rose.spec.corpus import local_prompts, vocab_topics


def _tokenizer(tmp_path: Path, words: list[str]) -> Path:
    vocab = {"Ġ" + w: i for i, w in enumerate(words)} | {"incl": len(words)}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    return path


def test_topics_are_whole_words_seen_in_reference_text(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path, ["exception", "lambda", "includ", "which", "zzqqx"])
    ref = ["An exception is raised; a lambda expression which includes nothing."]
    # "includ" is a merge fragment (not a word of the text), "which" a stop word
    assert vocab_topics(tok, ref) == ["exception", "lambda"]


def test_local_prompts_are_deterministic_and_exclude_held_out(tmp_path: Path) -> None:
    words = ["exception", "lambda", "module", "function", "rainbow", "string", "import"]
    tok = _tokenizer(tmp_path, words)
    held_out = ["Explain how a rainbow forms.", "What is lambda?"]
    a = local_prompts(tok, 40, seed=3, exclude=held_out)
    b = local_prompts(tok, 40, seed=3, exclude=held_out)
    assert a == b and len(a) == 40 and len(set(a)) == 40
    assert a != local_prompts(tok, 40, seed=4, exclude=held_out)
    for p in a:
        assert p not in held_out
        assert "rainbow" not in p.lower() and "lambda" not in p.lower(), p
