"""Convert a llama.cpp GGUF file of a Llama-architecture model into an HF-layout directory that
gpu_worker.runtime.checkpoint.load_model (and transformers) load: config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json (with the chat template).

Torch-free (numpy, the `gguf` package, safetensors, tokenizers), so `specbus models pull` does not
load torch. Why our own converter rather than transformers' GGUF reader: it needs no transformers
or accelerate at run time (both dev-only here), it is faster (see ops/bench/RESULTS.md, Figures
behind gpu_worker's choices), and its pre-tokenizer is the one llama.cpp uses for the file
(transformers' GGUF tokenizer has no digit split; SmolLM2's vocabulary has no multi-digit
tokens, so both encode the same). tests/system/test_models.py checks weights, tokenizer and
logits against transformers' own GGUF loading.

Weights are dequantized with gguf's own `quants.dequantize` and stored as float32: a Q4_1 weight
is d * q + m with fp16 d and m, which needs more mantissa than bf16's 8 bits, so fp32 is the only
dtype that keeps the file's values exactly; the runtime casts to bf16 at load when asked.
llama.cpp's converter permutes the rows of q and k (its RoPE rotates adjacent pairs, HF's rotates
the two halves of each head); `unpermute_qk` undoes it.

Beside them, GGUF_BLOCKS_FILE keeps every Q4_1 and Q8_0 weight as the file stores it: each row's
blocks as bytes, (out, in/32 * block bytes) uint8 under its HF name (q and k rows unpermuted the
same way), the block type in the metadata. The runtime reads these with `--weights gguf`
(gpu_worker/runtime/quantized.py): the published weights as they are, widened in the projection
kernel to exactly the float32 values of model.safetensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm

from schemas.config import GGUF_BLOCKS_FILE

# GGUF tensor name (per layer: "blk.{}.") -> HF name
GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# llama.cpp's pre-tokenizer types (tokenizer.ggml.pre) with their splitting regexes, as HF
# pre-tokenizers. "smollm" and the others in its group split every digit off, then apply GPT-2's
# byte-level regex (llama.cpp src/llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_STARCODER/SMOLLM/...).
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
BYTE_LEVEL_PRE = {"gpt-2", "default"}
CONTROL_TOKEN = 3  # tokenizer.ggml.token_type: 1 normal, 3 control, 4 user-defined
USER_DEFINED_TOKEN = 4
# End-of-turn tokens: when the chat template closes turns with one of these, generation stops at
# it (as llama.cpp's end-of-generation list does), whatever eos id the file itself declares.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


class GGUFConversionError(ValueError):
    """A GGUF file this converter does not handle; the message says what it found."""


def field_value(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config(reader: GGUFReader) -> dict:
    """config.json of the file's model. GGUFConversionError for a non-Llama file."""
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise GGUFConversionError(f"general.architecture is {arch!r}; only 'llama' is converted")

    def meta(name, default=None):
        value = field_value(reader, f"llama.{name}", default)
        if value is None:
            raise GGUFConversionError(f"GGUF metadata lacks llama.{name}")
        return value

    num_heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    tensor_names = {t.name for t in reader.tensors}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(field_value(reader, "tokenizer.ggml.tokens")),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": meta("attention.head_count_kv", num_heads),
        "head_dim": meta("rope.dimension_count", hidden // num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),  # transformers 4.x
        "rope_parameters": {"rope_theta": float(meta("rope.freq_base", 10000.0)), "rope_type": "default"},
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk":
        key = parts[2]
        if key not in GGUF_TO_HF:
            raise GGUFConversionError(f"tensor {gguf_name!r} has no HF counterpart here")
        return GGUF_TO_HF[key].format(parts[1])
    if gguf_name not in GGUF_TO_HF:
        raise GGUFConversionError(f"tensor {gguf_name!r} has no HF counterpart here")
    return GGUF_TO_HF[gguf_name]


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation. weight: (num_heads * head_dim, hidden).

    llama.cpp's convert_hf_to_gguf.py stores w.reshape(n_head, 2, head_dim // 2, hidden)
    .swapaxes(1, 2); the inverse reads the rows as (n_head, head_dim // 2, 2) and swaps back."""
    rows, cols = weight.shape
    return weight.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 in HF's (out, in) shape (GGUF lists dims innermost first)."""
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        values = np.asarray(tensor.data, dtype=np.float32)
    else:
        values = quants.dequantize(tensor.data, tensor.tensor_type)
    return values.reshape(tuple(int(n) for n in reversed(tensor.shape)))


def convert_weights(reader: GGUFReader, config: dict, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name; a tied lm_head is left out."""
    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", disable=not progress):
        name = hf_name(tensor.name)
        values = dequantized(tensor)
        if name.endswith("q_proj.weight"):
            values = unpermute_qk(values, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_qk(values, config["num_key_value_heads"])
        weights[name] = np.ascontiguousarray(values, dtype=np.float32)
    return weights


# the block types the runtime reads as stored (gpu_worker/runtime/quantized.py names them alike)
STORED_BLOCK_TYPES = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}


def stored_blocks(reader: GGUFReader, config: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The Q4_1 / Q8_0 tensors as stored, (out, in/32 * block bytes) uint8 under their HF names,
    rows in HF's order; and each one's block type name."""
    blocks, kinds = {}, {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in STORED_BLOCK_TYPES:
            continue
        name = hf_name(tensor.name)
        rows = np.asarray(tensor.data, dtype=np.uint8).reshape(int(tensor.shape[-1]), -1)
        if name.endswith("q_proj.weight"):
            rows = unpermute_qk(rows, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            rows = unpermute_qk(rows, config["num_key_value_heads"])
        blocks[name] = np.ascontiguousarray(rows)
        kinds[name] = STORED_BLOCK_TYPES[tensor.tensor_type]
    return blocks, kinds


def build_tokenizer(reader: GGUFReader) -> Tokenizer:
    """The file's byte-level BPE tokenizer with llama.cpp's pre-tokenizer for it; control and
    user-defined tokens become added tokens (control ones special)."""
    kind, pre = field_value(reader, "tokenizer.ggml.model"), field_value(reader, "tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise GGUFConversionError(f"tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is converted")
    if pre not in DIGIT_SPLIT_PRE | BYTE_LEVEL_PRE:
        raise GGUFConversionError(f"tokenizer.ggml.pre {pre!r} is not one of {sorted(DIGIT_SPLIT_PRE | BYTE_LEVEL_PRE)}")
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type")
    merges = [tuple(merge.split(" ", 1)) for merge in field_value(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if pre in DIGIT_SPLIT_PRE else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(token, special=kind_ == CONTROL_TOKEN, normalized=False)
                          for token, kind_ in zip(tokens, types) if kind_ in (CONTROL_TOKEN, USER_DEFINED_TOKEN)])
    return tokenizer


def special_tokens(reader: GGUFReader, tokens: list[str], chat_template: str | None) -> dict[str, str]:
    """bos/eos/unk/pad token strings: the file's ids, except that eos is the template's
    end-of-turn token when it has one (SmolLM2's file says eos = <|im_start|>; chat turns end
    with <|im_end|>, the eos of the original checkpoint)."""
    named = {}
    for key in ("bos", "eos", "unknown", "padding"):
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            named[{"unknown": "unk", "padding": "pad"}.get(key, key)] = tokens[token_id]
    end_of_turn = next((t for t in END_OF_TURN_TOKENS if chat_template and t in chat_template and t in tokens), None)
    if end_of_turn:
        named["eos"] = named["pad"] = end_of_turn
    return named


def convert_gguf(gguf_path, out_dir, progress: bool = True) -> dict:
    """Write the HF-layout directory out_dir (created) from gguf_path; returns its config."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    chat_template = field_value(reader, "tokenizer.chat_template")
    named = special_tokens(reader, tokens, chat_template)
    ids = {f"{key}_token_id": tokens.index(token) for key, token in named.items() if key in ("bos", "eos", "pad")}
    config.update(ids)
    save_file(convert_weights(reader, config, progress), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    blocks, kinds = stored_blocks(reader, config)
    if blocks:
        (out_dir / GGUF_BLOCKS_FILE).parent.mkdir(exist_ok=True)  # a folder: no *.safetensors weights glob finds it
        save_file(blocks, str(out_dir / GGUF_BLOCKS_FILE), metadata={"format": "gguf-blocks", **kinds})
    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {f"{key}_token": token for key, token in named.items()}
    tokenizer_config |= {"add_bos_token": False, "clean_up_tokenization_spaces": False,
                         "model_max_length": config["max_position_embeddings"],
                         "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    for name, content in (("config.json", config), ("generation_config.json", ids),
                          ("tokenizer_config.json", tokenizer_config)):
        (out_dir / name).write_text(json.dumps(content, indent=2) + "\n")
    return config
