"""Fixtures of the scheduler-side tests that run without NATS."""

import pytest

from text.tokenizer import load_tokenizer
from tests.tiny_checkpoints import write_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A real BPE tokenizer trained on the spot (tests/tiny_checkpoints.py write_tokenizer); id 0 is EOS."""
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok")))
