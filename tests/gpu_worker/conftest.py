"""Tiny randomly initialised Hugging Face checkpoints written to tmp_path."""

import pytest
import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=500.0)
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
