"""The exact bytes of each token, and where UTF-8 text cut at a token boundary ends mid-character.
Torch-free: the postprocessor's text stream and the gateway's logprob shapes both read it.

A byte-level BPE token (GPT-2's alphabet: `byte_decoder`) is its bytes, whatever they decode to;
an added token is its own text; a SentencePiece byte-fallback piece `<0xNN>` is that byte; any
other token is its decoded text. `incomplete_tail` says how many bytes at the end of a byte
string begin a character that is not finished: the bytes a cut left over.
"""

from __future__ import annotations

import codecs
import re
from functools import lru_cache

from tokenizers import decoders

from text.tokenizer import Tokenizer

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet reversed (character -> byte): printable bytes stand for
    themselves, the others are shifted to 256 + i (the alphabet of openai/gpt-2's encoder)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


def incomplete_tail(raw: bytes) -> int:
    """Bytes at the end of raw that begin a UTF-8 character and do not finish it (0 when raw ends
    on a character boundary, or in bytes that are invalid rather than unfinished)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(raw, final=False)
    return len(decoder.getstate()[0])


class TokenBytes:
    """A tokenizer's per-token bytes (module docstring), cached by id. special: the added tokens'
    ids (their text as it is); skipped: the special ones, which decoded text leaves out."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.hf.decoder, decoders.ByteLevel)
        added = tokenizer.hf.get_added_tokens_decoder()  # id -> AddedToken
        self.special = set(added)
        self.skipped = {token_id for token_id, token in added.items() if token.special}
        self.cache: dict[int, bytes] = {}

    def get(self, token_id: int) -> bytes:
        if token_id not in self.cache:
            piece = self.tokenizer.hf.id_to_token(token_id) or ""
            fallback = BYTE_FALLBACK.fullmatch(piece)
            if token_id in self.special:
                raw = piece.encode()
            elif self.byte_level:
                decoder = byte_decoder()
                raw = bytes(decoder[c] for c in piece if c in decoder)
            elif fallback:
                raw = bytes([int(fallback.group(1), 16)])
            else:
                raw = self.tokenizer.decode([token_id]).encode()
            self.cache[token_id] = raw
        return self.cache[token_id]

    def generated(self, ids) -> bytes:
        """The bytes of generated tokens in a row as their text holds them: skipped tokens left out."""
        return b"".join(self.get(i) for i in ids if i not in self.skipped)
