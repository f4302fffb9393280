from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["Tokenizer", "TokenizerError"]

class TokenizerError(ValueError): ...

class Tokenizer:
    @staticmethod
    def from_file(path: str, word_cache: int = 65536) -> Tokenizer: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def page_kind(self) -> str: ...
    @property
    def word_cache(self) -> int: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...
    def _scratch_bytes(self) -> int: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...
    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        max_length: int | None = None,
        split_special_tokens: bool = False,
    ) -> list[int]: ...
    def encode_batch(
        self,
        texts: Sequence[str],
        add_special_tokens: bool = True,
        max_length: int | None = None,
        split_special_tokens: bool = False,
    ) -> list[list[int]]: ...
    def encode_batch_packed(
        self,
        texts: Sequence[str],
        add_special_tokens: bool = True,
        max_length: int | None = None,
        split_special_tokens: bool = False,
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32]]: ...
    def encode_pair(
        self, a: str, b: str, add_special_tokens: bool = True, max_length: int | None = None
    ) -> list[int]: ...
    def encode_pairs_packed(
        self,
        query: str,
        documents: Sequence[str],
        max_length: int | None = None,
        max_second: int | None = None,
        left: bool = False,
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32], npt.NDArray[np.uint32]]: ...
    def encode_with_offsets(
        self, text: str, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]: ...
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...
