"""Trellis' Unigram tokenizer (Rust, bound with pyo3).

Loads a Hugging Face ``tokenizer.json`` whose model is Unigram (XLM-R and friends) and
produces exactly the ids Hugging Face ``tokenizers`` produces, several times faster.
Batch calls release the GIL and run in parallel. Like HF's, the tokenizer keeps a cache of
short words' ids (65,536 entries per working buffer, 4 MiB), so repeated words skip the
Viterbi pass; ``Tokenizer.from_file(path, word_cache=0)`` turns it off, and no size changes
any id.

>>> from tokenizer import Tokenizer
>>> tok = Tokenizer.from_file("tokenizer.json")  # doctest: +SKIP
>>> tok.encode("Hello, my dog is cute")  # doctest: +SKIP
[0, 35378, 4, 759, 10269, 83, 99942, 2]
"""

from __future__ import annotations

from ._native import Tokenizer, TokenizerError

__all__ = ["Tokenizer", "TokenizerError"]
