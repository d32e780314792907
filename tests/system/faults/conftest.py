"""The workload of the fault tests (test_faults.py, test_failover.py, test_cluster.py): a tiny
random target with a noisy copy of itself as the draft, and NUM_REQUESTS prompts."""

import pytest
import torch

from ops.train.train_models import read_text, source_files
from tests.tiny_checkpoints import copy_shipped_tokenizer, write_hf_model

NUM_REQUESTS = 8
PROMPT_TOKENS = 16
TINY_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024)
DRAFT_NOISE = 0.02  # relative to each weight's std: the draft mostly agrees with the target


@pytest.fixture(scope="session")
def noisy_pair(tmp_path_factory, tokenizer):
    """A tiny random target over the shipped tokenizer, and a draft = target + noise."""
    root = tmp_path_factory.mktemp("noisy-pair")
    target, draft = copy_shipped_tokenizer(root / "target"), copy_shipped_tokenizer(root / "draft")
    model = write_hf_model(target, "llama", seed=11, vocab_size=tokenizer.vocab_size, **TINY_MODEL)
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * p.std() * DRAFT_NOISE)
    model.save_pretrained(draft)
    return target, draft


@pytest.fixture(scope="session")
def prompts(tokenizer) -> list[list[int]]:
    """Consecutive PROMPT_TOKENS-token windows of the first held-out stdlib file."""
    _, held_out = source_files()
    ids = tokenizer.encode(read_text(held_out[0]))
    windows = [ids[i * PROMPT_TOKENS:(i + 1) * PROMPT_TOKENS] for i in range(NUM_REQUESTS)]
    assert len(windows[-1]) == PROMPT_TOKENS and len(set(map(tuple, windows))) == NUM_REQUESTS
    return windows
