"""text/token_bytes.py with the tiny target's real byte-level tokenizer: each token's exact bytes,
and the unfinished character at the end of a cut."""

import pytest

from schemas.config import TINY_TARGET
from text.token_bytes import TokenBytes, byte_decoder, incomplete_tail
from text.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def token_bytes():
    return TokenBytes(load_tokenizer(TINY_TARGET))


@pytest.mark.parametrize("raw, tail", [
    (b"", 0), (b"abc", 0), ("\u20ac".encode(), 0),
    (b"a\xe2", 1), (b"a\xe2\x82", 2), (b"\xf0\x9f\x98", 3),  # a character begun, not finished
    (b"a\xff", 0), (b"a\x82", 0),  # invalid bytes are not unfinished ones
])
def test_the_incomplete_tail_is_the_bytes_of_an_unfinished_last_character(raw, tail):
    assert incomplete_tail(raw) == tail


def test_tokens_keep_their_exact_bytes_and_special_tokens_their_text(token_bytes):
    tokenizer = token_bytes.tokenizer
    ids = tokenizer.encode("é€ x")
    assert b"".join(token_bytes.get(i) for i in ids) == "é€ x".encode()
    eos = tokenizer.eos_ids[0]
    assert token_bytes.get(eos) == b"<|endoftext|>" and eos in token_bytes.skipped
    assert token_bytes.generated([*ids, eos]) == "é€ x".encode()
    assert len(byte_decoder()) == 256 and sorted(byte_decoder().values()) == list(range(256))
