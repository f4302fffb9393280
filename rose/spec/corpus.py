"""Chat-style training prompts for a draft head, built from text already on this machine.

The head must learn what the target says in answer to ordinary requests, so the prompts are
instructions and questions ("Explain what a glacier is.") about topics taken from local
text: English words of the target's own tokenizer vocabulary that also occur as words in
the system's documentation, Debian package descriptions (``/var/lib/dpkg/status``) and the
Python documentation topics shipped with the interpreter (`pydoc_data`). The target then
answers them itself (`rose.spec.train_mtp`). Deterministic for a given seed.

Example::

    prompts = local_prompts(Path("tokenizer.json"), n=512, seed=0, exclude=held_out)
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["dpkg_descriptions", "local_prompts", "vocab_topics"]

WORD_TEMPLATES = (
    "What is {w}?",
    "Explain what {w} means.",
    "Describe {w} in a few sentences.",
    "Give three facts about {w}.",
    "Write a short paragraph about {w}.",
    "Why is {w} important?",
    "How would you explain {w} to a child?",
    "List some common uses of {w}.",
    "What are the advantages and disadvantages of {w}?",
    "Tell me something interesting about {w}.",
    "How does {w} work?",
    "Give me two tips related to {w}.",
    "Compare {w} and {v}.",
    "Write a short story about {w} and {v}.",
    "Write a short poem about {w}.",
    "What are the benefits of {w}?",
    "How do {w} and {v} differ?",
    "Give step-by-step instructions involving {w}.",
    "What should a beginner know about {w}?",
    "Why do people care about {w}?",
)
DESCRIPTION_TEMPLATES = (
    "Explain what this software does: {d}.",
    "What would someone use '{d}' for?",
    "Summarize in one paragraph: {d}.",
)
PYDOC_TEMPLATES = (
    "Explain the Python topic '{t}' with an example.",
    "What does '{t}' mean in Python?",
)
_STOP = frozenset(
    "their which other about these under there would through where could should every "
    "those because while after before again being between during further having itself "
    "might never often since still though until whether within without always another "
    "around became become cannot either rather really something sometimes together "
    "toward whose".split()
)
_WORD = re.compile(r"[a-z]{5,12}")


def _doc_words(texts: Iterable[str]) -> set[str]:
    words: set[str] = set()
    for t in texts:
        words.update(_WORD.findall(t.lower()))
    return words


def dpkg_descriptions(status: Path = Path("/var/lib/dpkg/status")) -> list[str]:
    """Short descriptions of installed Debian packages (empty when there is no dpkg)."""
    if not status.is_file():
        return []
    out = []
    for line in status.read_text(errors="replace").splitlines():
        if line.startswith("Description: "):
            d = line[len("Description: ") :].strip().rstrip(".")
            if len(d) >= 12:
                out.append(d)
    return sorted(set(out))


def _pydoc_topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed interpreter may not ship it
        return {}
    return dict(topics)


def vocab_topics(tokenizer_json: Path, reference_text: Iterable[str]) -> list[str]:
    """Whole English words of a byte-level BPE vocabulary (``Ġword`` tokens) that also occur
    as words in ``reference_text`` (drops merge fragments such as ``includ``)."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    known = _doc_words(reference_text)
    out = []
    for tok in vocab:
        w = tok[1:]
        if tok.startswith("Ġ") and _WORD.fullmatch(w) and w in known and w not in _STOP:
            out.append(w)
    return sorted(out)


def local_prompts(
    tokenizer_json: Path, n: int, seed: int = 0, exclude: Sequence[str] = ()
) -> list[str]:
    """``n`` instructions about local topics; none equals (case-insensitively) a string in
    ``exclude``, and no topic is a word of at least 5 letters from it (held-out prompts)."""
    descs = dpkg_descriptions()
    pydoc = _pydoc_topics()
    topics = vocab_topics(tokenizer_json, [*descs, *pydoc.values()])
    banned = _doc_words(exclude)
    topics = [w for w in topics if w not in banned]
    descs = [d for d in descs if not _doc_words([d]) & banned]
    pydoc_keys = sorted(t for t in pydoc if not _doc_words([t]) & banned)
    if not topics:
        raise ValueError("corpus: no topic words found in local text")
    rng = random.Random(seed)
    held = {e.strip().lower() for e in exclude}
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        r = rng.random()
        if r < 0.15 and descs:
            p = rng.choice(DESCRIPTION_TEMPLATES).format(d=rng.choice(descs))
        elif r < 0.2 and pydoc_keys:
            p = rng.choice(PYDOC_TEMPLATES).format(t=rng.choice(pydoc_keys))
        else:
            w, v = rng.sample(topics, 2)
            p = rng.choice(WORD_TEMPLATES).format(w=w, v=v)
        if p.lower() in held or p in seen:
            continue
        seen.add(p)
        out.append(p)
    return out
