"""Fixtures of the system tests (tests/system/: whole stacks, many processes), beside the shared
ones of tests/conftest.py."""

import pytest

from schemas.config import TINY_TARGET
from text.tokenizer import load_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The shipped tiny tokenizer (models/tiny/target), which every tiny pair of these tests carries."""
    return load_tokenizer(TINY_TARGET)
