"""Fixtures of the gpu_worker tests (the checkpoint writers are tests/tiny_checkpoints.py): a tiny
Llama, the verifier tests' tiny random target and its plain continuations (verifier/verifier_steps.py
has the loop around verify_batch), the tiny target loaded for the EAGLE and feature tests."""

from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models

from gpu_worker.runtime.checkpoint import load_model
from schemas.config import TINY_TARGET
from tests.gpu_worker.drafter.test_eagle_drafter import MAX_SEQ_LEN
from tests.gpu_worker.verifier.verifier_steps import PENALTIES, PROMPT, V, generate, new_verifier
from tests.tiny_checkpoints import write_hf_model


@pytest.fixture
def hf_llama(tmp_path):
    return tmp_path, write_hf_model(tmp_path, "llama")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    hf = write_hf_model(path, "llama", seed=5)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return SimpleNamespace(path=path, hf=hf)


@pytest.fixture(scope="module")
def greedy_tokens(target):
    """The target's plain greedy continuation of PROMPT, one token per step (k = 0)."""
    tokens, _, steps = generate(new_verifier(target), "plain", PROMPT, 16)
    assert steps == 16
    return tokens


@pytest.fixture(scope="module")
def penalised_tokens(target):
    """The target's greedy continuation of PROMPT with PENALTIES, one token per step (k = 0)."""
    tokens, _, steps = generate(new_verifier(target), "plain", PROMPT, 16, **PENALTIES)
    assert steps == 16
    return tokens


@pytest.fixture(scope="module")
def tiny_target_model():
    """The tiny target (models/tiny) loaded as gpu_worker runs it, max_seq_len MAX_SEQ_LEN."""
    model, _ = load_model(TINY_TARGET, max_seq_len=MAX_SEQ_LEN)
    return model
