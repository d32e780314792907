"""Load Hugging Face checkpoint directories (config.json + *.safetensors) and d2t maps."""

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpu_worker.runtime.model import Model, ModelConfig, build_model, weight_names
from gpu_worker.runtime.quantized import BLOCK_WEIGHTS, QuantizedWeight, quantize_q8_0, read_blocks
from schemas.config import GGUF_BLOCKS_FILE

D2T_FILE = "d2t.safetensors"

# HF tensor name -> our name (see model.weight_names); None: present in some files, not used.
HF_TO_OURS = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "norm",
    "lm_head.weight": "lm_head",
    "model.layers.{}.input_layernorm.weight": "layers.{}.attn_norm",
    "model.layers.{}.post_attention_layernorm.weight": "layers.{}.mlp_norm",
    "model.layers.{}.self_attn.q_proj.weight": "layers.{}.wq",
    "model.layers.{}.self_attn.k_proj.weight": "layers.{}.wk",
    "model.layers.{}.self_attn.v_proj.weight": "layers.{}.wv",
    "model.layers.{}.self_attn.o_proj.weight": "layers.{}.wo",
    "model.layers.{}.self_attn.q_proj.bias": "layers.{}.bq",
    "model.layers.{}.self_attn.k_proj.bias": "layers.{}.bk",
    "model.layers.{}.self_attn.v_proj.bias": "layers.{}.bv",
    "model.layers.{}.self_attn.o_proj.bias": "layers.{}.bo",
    "model.layers.{}.mlp.gate_proj.weight": "layers.{}.w_gate",
    "model.layers.{}.mlp.up_proj.weight": "layers.{}.w_up",
    "model.layers.{}.mlp.down_proj.weight": "layers.{}.w_down",
    "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
}
_LAYER_NUMBER = re.compile(r"(?<=^model\.layers\.)\d+(?=\.)")


class CheckpointError(ValueError):
    """A checkpoint directory or file this runtime cannot load; the message lists what it found."""


def weight_files(path) -> list[Path]:
    """Shards named by model.safetensors.index.json, else every *.safetensors but d2t's."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointError(f"{index} names shards that do not exist: {missing}")
        return [path / n for n in names]
    files = sorted(p for p in path.glob("*.safetensors") if p.name != D2T_FILE)
    if not files:
        found = sorted(p.name for p in path.iterdir()) if path.is_dir() else "not a directory"
        raise CheckpointError(f"no *.safetensors weights in {path}; found: {found}")
    return files


def our_name(hf_name: str) -> str | None:
    """Map one HF tensor name through HF_TO_OURS; KeyError if it has no entry."""
    match = _LAYER_NUMBER.search(hf_name)
    if match is None:
        return HF_TO_OURS[hf_name]
    ours = HF_TO_OURS[_LAYER_NUMBER.sub("{}", hf_name, count=1)]
    return None if ours is None else ours.format(match.group())


def read_config(path) -> ModelConfig:
    config_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CheckpointError(f"model directory {path} does not exist")
    if not config_file.exists():
        raise CheckpointError(f"no config.json in {path}")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


def load_model(path, device="cpu", dtype=torch.float32, max_seq_len: int | None = None,
               weights_format: str = "dense") -> tuple[Model, ModelConfig]:
    """Load an HF-layout directory. fp16/bf16 files are converted to `dtype`.

    max_seq_len bounds the RoPE tables (see model.build_model). A tied checkpoint that also
    stores lm_head.weight uses the embedding, as transformers does. weights_format "gguf": the
    projections the directory keeps as GGUF blocks (GGUF_BLOCKS_FILE, gpu_worker/runtime/quantized.py)
    are read as blocks, not as dense weights (CheckpointError where there are none); "int8": the
    dense weights quantized to Q8_0 blocks at load (`int8_blocks`), a changed model; "int8dot":
    gguf's blocks multiplied by int8 activation blocks (`quantized.IntWeight`), llama.cpp's model.
    """
    config = read_config(path)
    expected = set(weight_names(config))
    blocks = {}
    if weights_format in ("gguf", "int8dot"):
        if not (Path(path) / GGUF_BLOCKS_FILE).is_file():
            raise CheckpointError(f"{path} has no {GGUF_BLOCKS_FILE} (GGUF block weights): `specbus models pull "
                                  f"--force` writes it for the default target; use weights dense otherwise")
        blocks = {our_name(name): weight for name, weight in read_blocks(path).items()}
        expected -= blocks.keys() - {"embed"}  # the lookup reads a dense embedding
    elif weights_format not in ("dense", "int8"):
        raise ValueError(f"weights_format {weights_format!r}: dense, gguf, int8 or int8dot")
    weights, unexpected = {}, []
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                try:
                    name = our_name(hf_name)
                except KeyError:
                    unexpected.append(hf_name)
                    continue
                if name in expected:
                    weights[name] = f.get_tensor(hf_name).to(dtype, copy=True)
                elif name is not None and name not in blocks and not (name == "lm_head" and config.tie_word_embeddings):
                    unexpected.append(hf_name)
    missing = sorted(expected - weights.keys())
    if missing or unexpected:
        raise CheckpointError(f"{path}: missing tensors {missing}, unexpected tensors "
                              f"{sorted(unexpected)}")
    if weights_format == "int8":
        blocks = int8_blocks(config, weights)
    return build_model(config, weights, device, dtype, max_seq_len, blocks, weights_format == "int8dot"), config


def int8_blocks(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, QuantizedWeight]:
    """`weights: int8`: the projections and the lm_head (the embedding's, tied) of weights as Q8_0
    blocks (`quantize_q8_0`), those whose inner size is a multiple of 32; the rest stay dense."""
    names = [f"layers.{i}.{n}" for i in range(config.num_layers)
             for n in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    names.append("embed" if config.tie_word_embeddings else "lm_head")
    return {name: quantize_q8_0(weights[name]) for name in names if weights[name].shape[1] % BLOCK_WEIGHTS == 0}


def model_id(path) -> str:
    """Stable, cheap id: directory name + hash of config.json and weight file names/sizes."""
    path = Path(path)
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in weight_files(path):
        digest.update(f"{file.name}:{file.stat().st_size}".encode())
    return f"{path.resolve().name}-{digest.hexdigest()[:12]}"


@dataclass(frozen=True)
class D2T:
    """Draft vocabulary map (EAGLE-3 style reduced draft vocabulary).

    d2t: (V_draft,) int64, target id of each draft id (may be many-to-one).
    t2d: (V_target,) int64, draft id of each target id; ids outside the draft vocabulary
        map to other_id.
    other_id: the draft id standing for "a target token outside my vocabulary"; input only,
        never proposed.
    """
    d2t: torch.Tensor
    t2d: torch.Tensor
    other_id: int

    def __post_init__(self):
        d2t, t2d, other = self.d2t, self.t2d, self.other_id
        for name, t in (("d2t", d2t), ("t2d", t2d)):
            if t.dtype != torch.int64 or t.dim() != 1 or t.numel() == 0:
                raise CheckpointError(f"{name} must be a non-empty 1-D int64 tensor, got "
                                      f"{t.dtype} {tuple(t.shape)}")
        v_draft, v_target = d2t.numel(), t2d.numel()
        if not 0 <= other < v_draft:
            raise CheckpointError(f"other_id {other} outside the draft vocabulary [0, {v_draft})")
        if int(d2t.min()) < 0 or int(d2t.max()) >= v_target:
            raise CheckpointError(f"d2t values must lie in [0, V_target={v_target}), got "
                                  f"[{int(d2t.min())}, {int(d2t.max())}]")
        if int(t2d.min()) < 0 or int(t2d.max()) >= v_draft:
            raise CheckpointError(f"t2d values must lie in [0, V_draft={v_draft}), got "
                                  f"[{int(t2d.min())}, {int(t2d.max())}]")
        # A target id given a real draft id must come back to itself through d2t.
        mapped = torch.nonzero(t2d != other).flatten()
        broken = mapped[d2t[t2d[mapped]] != mapped]
        if broken.numel():
            raise CheckpointError(f"t2d and d2t disagree for target ids {broken[:10].tolist()}: "
                                  f"d2t[t2d[id]] != id")

    @property
    def draft_vocab_size(self) -> int:
        return self.d2t.numel()

    @property
    def target_vocab_size(self) -> int:
        return self.t2d.numel()


def save_d2t(path, d2t: torch.Tensor, t2d: torch.Tensor, other_id: int) -> None:
    """Write path/d2t.safetensors (validated first)."""
    D2T(d2t, t2d, other_id)
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(Path(path) / D2T_FILE),
              metadata={"other_id": str(other_id)})


def load_d2t(path) -> D2T | None:
    """Read path/d2t.safetensors, or None if absent. Checks len(d2t) against the draft's
    config.json vocab_size when that file is present."""
    file = Path(path) / D2T_FILE
    if not file.exists():
        return None
    with safe_open(file, framework="pt", device="cpu") as f:
        keys, metadata = set(f.keys()), f.metadata() or {}
        if keys != {"d2t", "t2d"} or "other_id" not in metadata:
            raise CheckpointError(f"{file} must hold tensors d2t, t2d and metadata other_id; "
                                  f"found tensors {sorted(keys)}, metadata {sorted(metadata)}")
        d2t = D2T(f.get_tensor("d2t"), f.get_tensor("t2d"), int(metadata["other_id"]))
    if (Path(path) / "config.json").exists():
        vocab = read_config(path).vocab_size
        if vocab != d2t.draft_vocab_size:
            raise CheckpointError(f"{file}: d2t has {d2t.draft_vocab_size} draft ids but "
                                  f"config.json vocab_size is {vocab}")
    return d2t
