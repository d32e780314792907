"""Fixtures of the gpu_worker tests (the checkpoint writers are tests/tiny_checkpoints.py)."""

import pytest

from tests.tiny_checkpoints import write_hf_model


@pytest.fixture
def hf_llama(tmp_path):
    return tmp_path, write_hf_model(tmp_path, "llama")
