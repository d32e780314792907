"""services/gateway/token_texts.py with the tiny target's real byte-level tokenizer."""

import pytest

from text.tokenizer import load_tokenizer
from schemas.config import TINY_TARGET
from services.gateway.token_texts import TokenTexts


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(TINY_TARGET)


def test_token_texts_keep_the_exact_bytes_of_a_split_character(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("é€")
    raw = b"".join(texts.get(i)[0] for i in ids)
    assert raw == "é€".encode()
    assert all(texts.text(i) == tokenizer.decode([i]) for i in tokenizer.encode("def main():\n    return 1"))
    assert texts.text(tokenizer.eos_ids[0]) == "<|endoftext|>"
