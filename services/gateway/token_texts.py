"""Per-token bytes and text for the OpenAI logprob shapes (services/gateway/responses.py), cached
by id: a token's text is its own bytes decoded (a token that ends inside a UTF-8 character shows
U+FFFD; `bytes` keeps the exact bytes), and tokens in a row join by their bytes (a character split
across tokens comes out whole)."""

from __future__ import annotations

from collections.abc import Sequence

from text.token_bytes import TokenBytes
from text.tokenizer import Tokenizer


class TokenTexts:
    """Per-token bytes and text for the logprob shapes (module docstring), cached by id."""

    def __init__(self, tokenizer: Tokenizer):
        self.token_bytes = TokenBytes(tokenizer)
        self.skipped = self.token_bytes.skipped  # left out of generated text
        self.cache: dict[int, tuple[bytes, str]] = {}

    def get(self, token_id: int) -> tuple[bytes, str]:
        if token_id not in self.cache:
            raw = self.token_bytes.get(token_id)
            self.cache[token_id] = (raw, raw.decode("utf-8", errors="replace"))
        return self.cache[token_id]

    def text(self, token_id: int) -> str:
        return self.get(token_id)[1]

    def join(self, ids: Sequence[int]) -> str:
        """The text of tokens in a row, special tokens included: the bytes joined, then decoded
        (a character split across tokens comes out whole)."""
        return b"".join(self.get(i)[0] for i in ids).decode("utf-8", errors="replace")

    def width(self, token_id: int) -> int:
        """Characters a token adds to a text (join's): the characters that begin in its bytes (a
        UTF-8 continuation byte begins none)."""
        return sum(1 for b in self.get(token_id)[0] if b & 0xC0 != 0x80)
