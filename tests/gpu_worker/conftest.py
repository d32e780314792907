"""Tiny randomly initialised Hugging Face checkpoints written to tmp_path."""

import shutil
from pathlib import Path

import pytest
import torch
import transformers

from gpu_worker.runtime.checkpoint import save_d2t
from schemas.config import TINY_TARGET

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=500.0)
VT, VD = 4096, 1024  # the shipped tokenizer's vocabulary; a tiny draft keeps 1023 ids + "other"
CONFIG_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
}


def write_hf_model(path, family="llama", seed=0, **overrides):
    """Save a random HF model of `family` to path; return it (eval mode, fp32)."""
    config_class, model_class = CONFIG_CLASSES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides})).eval()
    with torch.no_grad():  # random norm weights and biases, so a wrong mapping shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (name.endswith("norm.weight")))
    model.save_pretrained(path)
    return model


@pytest.fixture
def hf_llama(tmp_path):
    return tmp_path, write_hf_model(tmp_path, "llama")


def write_tiny_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random target (vocab 4096, the shipped tokenizer) and a tiny draft over 1024 ids
    with a many-to-one d2t map (draft "other" -> target 0); both with the shipped tokenizer."""
    target, draft = root / "target", root / "draft"
    shape = dict(hidden_size=32, intermediate_size=48, max_position_embeddings=2048, bos_token_id=0,
                 eos_token_id=0, tie_word_embeddings=True)
    write_hf_model(target, "llama", seed=1, vocab_size=VT, num_hidden_layers=2, **shape)
    write_hf_model(draft, "llama", seed=2, vocab_size=VD, num_hidden_layers=1, **shape)
    kept = torch.arange(VD - 1)
    t2d = torch.full((VT,), VD - 1, dtype=torch.long)
    t2d[kept] = torch.arange(VD - 1)
    save_d2t(draft, torch.cat([kept, torch.tensor([0])]), t2d, VD - 1)
    for path in (target, draft):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_TARGET / name, path / name)
    return target, draft
