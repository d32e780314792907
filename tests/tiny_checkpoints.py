"""Tiny checkpoints for tests, written to a directory: random Hugging Face models of the three
families the loader maps, the tiny random pair over the shipped tokenizer, a BPE tokenizer
trained on the spot, the scheduler tests' target/draft/twin set and a target with a noisy copy
as its draft. Plain functions: the fixtures that hold them (once per session) are in
tests/conftest.py and tests/system/conftest.py."""

import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TEXT = "the quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun " * 4
CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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


def copy_shipped_tokenizer(path: Path) -> Path:
    """The tiny pair's tokenizer files (models/tiny/target) into path."""
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_TARGET / name, path / name)
    return path


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
        copy_shipped_tokenizer(path)
    return target, draft


def add_chat_template(model_dir: Path, template: str) -> Path:
    """model_dir's tokenizer_config.json given the chat template (in place)."""
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    return model_dir


def write_tokenizer(path, vocab_size=60):
    """A real BPE tokenizer.json (+ tokenizer_config.json naming EOS) trained on TEXT; id 0 is EOS."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"]))
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<eos>", "eos_token": "<eos>"}))
    return path


def write_model_dirs(root: Path, vocab_size: int | None = None) -> dict[str, Path]:
    """A 2-layer target, a 1-layer draft (other random weights) and a twin draft (the target's
    own files: every greedy draft is accepted), sharing one write_tokenizer tokenizer.
    vocab_size: the models' vocabulary (None: TINY's, wider than the tokenizer's 60 ids)."""
    vocab = {} if vocab_size is None else {"vocab_size": vocab_size}
    target = write_tokenizer(root / "target", **vocab)
    write_hf_model(target, "llama", seed=1, **vocab)
    draft = shutil.copytree(target, root / "draft")
    for weights in draft.glob("*.safetensors"):
        weights.unlink()
    write_hf_model(draft, "llama", seed=2, num_hidden_layers=1, **vocab)
    twin = shutil.copytree(target, root / "twin")
    return {"target": target, "draft": draft, "twin": twin}
