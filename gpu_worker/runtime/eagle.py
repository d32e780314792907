"""EAGLE-style feature-level draft head: one decoder layer over the target's own features.

The head reads, at position t, the target's final-normed hidden state f_t (what
`model.forward(..., return_hidden=True)` returns; the target's logits at t are lm_head(f_t)) and
the embedding of the token x_{t+1} that followed it, and predicts the target's next feature
f_{t+1}; its draft distribution for x_{t+2} is the target's lm_head applied to that prediction,
over a reduced vocabulary (d2t). Drafting k tokens is a chain: the prediction and the drafted
token are the next position's input (EAGLE-1, Li et al. 2024, arXiv:2401.15077).

    pair t:  u_t = fc([rms(f_t) * feature_norm ; rms(embed[x_{t+1}]) * embed_norm])   (E,)
             h_t = llama_layer(u_t, position t)        (attention over pairs 0..t, own KV cache)
             f^_{t+1} = rms(h_t) * out_norm
             draft_logits = f^_{t+1} @ embed[d2t]^T    (tied target embedding rows, frozen)

A fused head (`EagleConfig.feature_layers`, EAGLE-3, Li et al. 2025, arXiv:2503.01840) reads
instead of f_t the residual streams g_t entering three of the target's layers (a low, a middle
and a high one), projected: f_t := fuse(rms(g_t) * fuse_norm), fuse (E, 3E). It predicts no
feature: at chain steps after the first its input is its own output rms(h) * out_norm, as a
last-feature head's is, but that output is trained by the cross-entropy alone.

The target's embedding and lm_head are reused, not stored in the head's file. The decoder
layer is the target's layer shape (`model.Layer`), run by the same batch-invariant kernels as
the target (`model.linear`, `model.attention`) over a `KVCache` with one layer.

`head_forward` is the inference form (slot KV cache, packed weights, what a drafter calls,
through `draft_chain`); ops/train/eagle_training.py holds the training form of the same math
(`unrolled_forward`, plain autograd ops over whole sequences), and
tests/gpu_worker/runtime/test_eagle.py checks they agree.

Letters: B rows, T tokens per row, N pairs per row, K draft slots, V target vocabulary,
Vd draft vocabulary, E hidden size, H heads, Hkv key/value heads, D head dim.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_worker.runtime.checkpoint import D2T, HF_TO_OURS, CheckpointError, load_d2t, read_config, weight_files
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.tree_draft import DraftNode, best_first_tree, column_parents, preorder
from gpu_worker.runtime.tree_forward import tree_step
from gpu_worker.runtime.model import (ConfigError, DecoderShape, Layer, Model, ModelConfig, decoder_layer, linear,
                                     pack_weight, plan_step, rms_norm, rope_tables)
from schemas.arrays import ROOT_PARENT

CONFIG_FILE = "eagle_config.json"  # not config.json: load_d2t reads that one as a target config
WEIGHTS_FILE = "model.safetensors"
LAYER_NAMES = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class EagleConfig(DecoderShape):
    """The head's shape: its one layer's fields are the target's (`model.DecoderShape`);
    num_layers is 1, so a KVCache can be built from it. feature_layers: empty for a head that
    reads the target's final-normed last hidden state; else the target layers whose incoming
    residual stream it reads, concatenated (a fused head)."""
    target_vocab_size: int
    num_layers: int = 1
    feature_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if self.target_vocab_size <= 0:
            raise ConfigError(f"target_vocab_size must be positive, got {self.target_vocab_size}")
        if self.num_layers != 1:
            raise ConfigError(f"num_layers must be 1, got {self.num_layers}")
        object.__setattr__(self, "feature_layers", tuple(self.feature_layers))  # a JSON list reads back as a tuple
        if any(i < 0 for i in self.feature_layers) or len(set(self.feature_layers)) != len(self.feature_layers):
            raise ConfigError(f"feature_layers must be distinct layer indices, got {list(self.feature_layers)}")

    @property
    def feature_size(self) -> int:
        """Width of the target features the head reads at verified positions: E, or E per fused layer."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @classmethod
    def from_target(cls, target_config: ModelConfig, intermediate_size: int | None = None) -> "EagleConfig":
        shape = target_config.shape_fields()
        shape["intermediate_size"] = intermediate_size or target_config.intermediate_size
        return cls(**shape, target_vocab_size=target_config.vocab_size)

    @classmethod
    def from_json(cls, path) -> "EagleConfig":
        data = json.loads(Path(path).read_text())
        fields = set(cls.__dataclass_fields__)
        unknown, missing = set(data) - fields - {"architecture"}, fields - set(data) - {"num_layers", "feature_layers"}
        if unknown or missing:
            raise ConfigError(f"{path}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}")
        return cls(**{k: v for k, v in data.items() if k in fields})


def weight_names(config: EagleConfig | None = None) -> list[str]:
    """The head's own tensors (the target's embedding is not among them); a fused head's config
    adds its projection of the fused layers."""
    fused = ["fuse_norm", "fuse.weight"] if config is not None and config.feature_layers else []
    return (["fc.weight", "fc.bias", "feature_norm", "embed_norm", "out_norm"]
            + [f"layer.{n}" for n in LAYER_NAMES] + fused)


def load_head_weights(path) -> tuple[EagleConfig, dict[str, torch.Tensor], D2T]:
    """(config, float32 weights, d2t maps) of a head directory; ConfigError naming what is wrong."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"{path} has no {CONFIG_FILE}: not an EAGLE head directory")
    config = EagleConfig.from_json(path / CONFIG_FILE)
    with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
        weights = {n: f.get_tensor(n).float() for n in f.keys()}  # noqa: SIM118 (safe_open, not a dict)
    if set(weights) != set(weight_names(config)):
        raise ConfigError(f"{path / WEIGHTS_FILE}: expected tensors {weight_names(config)}, found {sorted(weights)}")
    maps = load_d2t(path)
    if maps is None or maps.target_vocab_size != config.target_vocab_size:
        raise ConfigError(f"{path}: d2t.safetensors missing or not for a {config.target_vocab_size}-token target")
    return config, weights, maps


def pack_features(features: torch.Tensor) -> bytes:
    """features (N, E) any float dtype -> N * E little-endian bf16 values, row-major: what a
    verifier ships (docs/PROTOCOL.md#feature-level-drafts)."""
    assert features.dim() == 2, features.shape
    return features.detach().to(device="cpu", dtype=torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()


def unpack_features(data: bytes, shape: tuple[int, int], field: str = "features") -> torch.Tensor:
    """`pack_features`'s bytes -> (N, E) bf16; ValueError naming field when the sizes disagree."""
    n, e = shape
    if n < 0 or e <= 0 or len(data) != 2 * n * e:
        raise ValueError(f"{field}: {len(data)} bytes do not hold a bf16 matrix of shape {list(shape)}")
    return torch.frombuffer(bytearray(data), dtype=torch.bfloat16).view(n, e)


# ---------------------------------------------------------------------------------------------
# inference


@dataclass
class TargetPieces:
    """What the head reuses of its target without its layers: its config and embedding (V, E).
    `build_head` takes this or the whole Model."""
    config: ModelConfig
    embed: torch.Tensor


def load_target_pieces(path, device="cpu", dtype=torch.float32) -> TargetPieces:
    """The target's config and embedding from its HF-layout directory, reading no other tensor
    (a drafter process need not hold the target's layers)."""
    config = read_config(path)
    for file in weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            name = next((n for n in f.keys() if HF_TO_OURS.get(n) == "embed"), None)  # noqa: SIM118 (safe_open)
            if name is not None:
                return TargetPieces(config, f.get_tensor(name).to(device=device, dtype=dtype))
    raise CheckpointError(f"{path}: no embedding tensor among its weights {[p.name for p in weight_files(path)]}")


@dataclass
class EagleHead:
    """The head ready to run: its weights (through `pack_weight`) and the frozen target pieces."""
    config: EagleConfig
    fc: torch.Tensor               # (E, 2E) packed
    fc_bias: torch.Tensor          # (E,)
    feature_norm: torch.Tensor     # (E,)
    embed_norm: torch.Tensor       # (E,)
    layer: Layer
    out_norm: torch.Tensor         # (E,)
    embed: torch.Tensor            # (V, E) the target's embedding (shared, not copied)
    lm_rows: torch.Tensor          # (Vd, E) packed: the target's lm_head rows of d2t
    d2t: torch.Tensor              # (Vd,) int64
    other_id: int                  # draft id never proposed (its logit is -inf)
    rope_cos: torch.Tensor         # (P, D)
    rope_sin: torch.Tensor         # (P, D) sign folded in (model.rope_tables)
    fuse_norm: torch.Tensor | None = None   # (F, E) a fused head's: per fused layer, F of them
    fuse: torch.Tensor | None = None        # (E, F*E) packed


def build_head(config: EagleConfig, weights: dict[str, torch.Tensor], maps: D2T, target: Model | TargetPieces,
               max_seq_len: int | None = None) -> EagleHead:
    """Pack the head's weights on the target's device and dtype. The target must tie its
    lm_head to its embedding (its lm_head rows are read from the embedding)."""
    misfit = head_misfit(config, target.config)
    if misfit is not None:
        raise ConfigError(misfit)
    device, dtype = target.embed.device, target.embed.dtype

    def get(name):
        return weights[name].to(device=device, dtype=dtype)

    layer = Layer(attn_norm=get("layer.attn_norm"),
                  wqkv=pack_weight(torch.cat([get("layer.wq"), get("layer.wk"), get("layer.wv")])), bqkv=None,
                  wo=pack_weight(get("layer.wo")), bo=None, mlp_norm=get("layer.mlp_norm"),
                  w_gate_up=pack_weight(torch.cat([get("layer.w_gate"), get("layer.w_up")])),
                  w_down=pack_weight(get("layer.w_down")))
    cos, sin = rope_tables(config, max_seq_len or config.max_position_embeddings, device, dtype)
    fused = bool(config.feature_layers)
    return EagleHead(config=config, fc=pack_weight(get("fc.weight")), fc_bias=get("fc.bias"),
                     feature_norm=get("feature_norm"), embed_norm=get("embed_norm"), layer=layer,
                     out_norm=get("out_norm"), embed=target.embed,
                     lm_rows=pack_weight(target.embed[maps.d2t.to(device)].contiguous()),
                     d2t=maps.d2t.to(device), other_id=maps.other_id,
                     rope_cos=cos, rope_sin=sin,
                     fuse_norm=get("fuse_norm").view(len(config.feature_layers), -1) if fused else None,
                     fuse=pack_weight(get("fuse.weight")) if fused else None)


def head_misfit(config: EagleConfig, target_config: ModelConfig) -> str | None:
    """Why a head cannot serve a target, naming both shapes, or None when it can."""
    if not target_config.tie_word_embeddings:
        return "the EAGLE head needs a target with tied embeddings (tie_word_embeddings)"
    if any(i >= target_config.num_layers for i in config.feature_layers):
        return (f"the EAGLE head reads target layers {list(config.feature_layers)}; the target has "
                f"{target_config.num_layers}")
    if target_config.hidden_size != config.hidden_size or target_config.vocab_size != config.target_vocab_size:
        return (f"the EAGLE head is for a target of hidden size {config.hidden_size} and vocabulary "
                f"{config.target_vocab_size}; the target has hidden size {target_config.hidden_size} and vocabulary "
                f"{target_config.vocab_size}")
    return None


def load_head(path, target: Model | TargetPieces, max_seq_len: int | None = None) -> EagleHead:
    config, weights, maps = load_head_weights(path)
    return build_head(config, weights, maps, target, max_seq_len)


def new_cache(head: EagleHead, max_slots: int, max_seq_len: int, memory_bytes: int | None = None) -> KVCache:
    """The head's own KV cache: one layer, one slot per request (memory_bytes: its budget, as
    KVCache's)."""
    return KVCache(head.config, max_slots, max_seq_len, device=head.embed.device, dtype=head.embed.dtype,
                   memory_bytes=memory_bytes)


@torch.inference_mode()
def head_forward(head: EagleHead, cache: KVCache, slots: torch.Tensor, features: torch.Tensor,
                 token_ids: torch.Tensor, num_new: torch.Tensor,
                 logits_index: torch.Tensor | None = None, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Append pairs (features[b, t], token_ids[b, t]) to each row's slot; return the draft logits
    and the predicted next features at the selected pairs.

    slots: (B,) int64 allocated slots of `cache` (`new_cache`); features: (B, T, E) the target's
    final-normed hidden states f at the slot's next positions (any float dtype); token_ids:
    (B, T) int64 target ids, token_ids[b, t] the token that followed features[b, t]; num_new:
    (B,) int64 CPU, row b's pairs are its first num_new[b] (the rest padding). logits_index:
    (B, M) int64 pairs to read out, or None for all. A fused head's features are (B, T, F*E), the
    target's layers `config.feature_layers` concatenated, unless own: the head's own predictions
    (B, T, E) at a chain's later steps. Returns draft logits (B, M, Vd) with
    other_id at -inf, and predicted features (B, M, E) (the next pair's input in a chain). The
    slot's length advances by num_new (`KVCache.truncate` rolls drafted pairs back).
    """
    cfg = head.config
    B, T = token_ids.shape
    assert slots.shape == (B,) and num_new.shape == (B,), (slots.shape, token_ids.shape, num_new.shape)
    step = plan_step(cache, head.rope_cos, head.rope_sin, slots, num_new, T, cfg.num_heads, cfg.num_kv_heads)
    x = decoder_layer(cfg, head.layer, 0, pair_inputs(head, features, token_ids, own), cache, step)
    cache.commit(slots, num_new)
    x = x.view(B, T, cfg.hidden_size)
    if logits_index is not None:
        assert logits_index.dim() == 2 and logits_index.shape[0] == B, logits_index.shape
        x = x.gather(1, logits_index.to(x.device).unsqueeze(-1).expand(-1, -1, cfg.hidden_size))   # (B, M, E)
    return read_head(head, x)


def pair_inputs(head: EagleHead, features: torch.Tensor, token_ids: torch.Tensor, own: bool = False) -> torch.Tensor:
    """The decoder layer's input u of pairs (features[b, t], token_ids[b, t]) (module docstring):
    features (B, T, E) (a fused head's (B, T, F*E) unless own), token_ids (B, T) -> (B*T, E)."""
    cfg = head.config
    B, T = token_ids.shape
    E = cfg.hidden_size
    fused = head.fuse is not None and not own
    width = cfg.feature_size if fused else E
    assert features.shape == (B, T, width), (features.shape, token_ids.shape, width)
    device, dtype = head.embed.device, head.embed.dtype
    features = features.to(device=device, dtype=dtype)
    if fused:  # a fused head's target layers: each normed (their scales differ by depth), projected
        flat = features.reshape(B * T, -1)
        parts = [rms_norm(flat[:, i * E:(i + 1) * E].contiguous(), w, cfg.rms_norm_eps)
                 for i, w in enumerate(head.fuse_norm)]
        features = linear(torch.cat(parts, -1), head.fuse)
    f = rms_norm(features.reshape(B * T, E), head.feature_norm, cfg.rms_norm_eps)
    e = rms_norm(head.embed[token_ids.to(device).view(-1)], head.embed_norm, cfg.rms_norm_eps)
    return linear(torch.cat([f, e], -1), head.fc, head.fc_bias)            # (B*T, E)


def read_head(head: EagleHead, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output x (B, M, E) -> draft logits (B, M, Vd) with other_id at -inf, and the
    predicted features (B, M, E)."""
    predicted = rms_norm(x, head.out_norm, head.config.rms_norm_eps)
    logits = linear(predicted.reshape(-1, x.shape[-1]), head.lm_rows).view(*predicted.shape[:2], -1)
    logits[..., head.other_id] = -math.inf
    return logits, predicted


def greedy_choice(logits: torch.Tensor, step: int) -> torch.Tensor:
    """logits (B, Vd) -> draft ids (B,): the argmax (other_id is -inf)."""
    return logits.argmax(-1)


@torch.inference_mode()
def draft_chain(head: EagleHead, cache: KVCache, slots: torch.Tensor, features: torch.Tensor,
                token_ids: torch.Tensor, num_new: torch.Tensor, k: int,
                choose=greedy_choice) -> tuple[torch.Tensor, torch.Tensor]:
    """Feed each row's newly verified pairs, then draft k tokens as a chain; the drafted pairs are
    rolled back, so the slots end holding exactly the verified pairs.

    slots (B,), features (B, T, E) (a fused head's (B, T, F*E)), token_ids (B, T), num_new (B,)
    >= 1: as `head_forward` (the last pair of a row is its newest target feature and the token
    the target emitted from it).
    choose(logits (B, Vd), step) -> draft ids (B,): greedy by default; a sampled drafter draws
    there with its own uniforms. Returns draft token ids (B, k) as target ids and the draft logits
    (B, k, Vd) each was chosen from (float32; map draft ids to target ids with head.d2t).
    """
    B = slots.shape[0]
    assert k >= 1 and bool((num_new >= 1).all()), (k, num_new)
    committed = cache.lengths[slots.cpu()].clone() + num_new
    last = (num_new - 1).view(B, 1)
    logits, predicted = head_forward(head, cache, slots, features, token_ids, num_new, logits_index=last)
    one = torch.ones(B, dtype=torch.long)
    drafts, all_logits = [], []
    for step in range(k):
        all_logits.append(logits[:, 0].float())
        drafts.append(choose(logits[:, 0], step))
        if step + 1 < k:
            logits, predicted = head_forward(head, cache, slots, predicted, head.d2t[drafts[-1]].view(B, 1), one,
                                             own=True)
    for b, slot in enumerate(slots.tolist()):
        cache.truncate(slot, int(committed[b]))
    draft_ids = torch.stack(drafts, 1)                                # (B, k) draft ids
    return head.d2t[draft_ids], torch.stack(all_logits, 1)


def tree_columns_needed(topk: int, depth: int) -> int:
    """Columns of draft_tree's widest head step: the root and topk expanded nodes a level."""
    return 1 + topk * (depth - 1)


@torch.inference_mode()
def draft_tree(head: EagleHead, cache: KVCache, slot: int, features: torch.Tensor, token_ids: torch.Tensor,
               depth: int, max_nodes: int, topk: int, rank=None) -> tuple[list[int], list[int]]:
    """Feed one row's newly verified pairs, then draft an EAGLE-2 tree (gpu_worker/runtime/
    tree_draft.py `best_first_tree`): a level is one head step over the root pair and every
    expanded node's pair so far, a tree of columns (`tree_forward.tree_step`: each sees the slot's
    pairs and its path), a node's pair being its parent's predicted feature and its token.

    slot: an allocated slot of cache; features (T, E) (a fused head's (T, F*E)), token_ids (T,)
    int64, T >= 1: the slot's next pairs, as a row of `draft_chain`; the slot has room for
    tree_columns_needed(topk, depth) - 1 positions past them. Returns (target ids, parents) in
    depth-first preorder (`tree_draft.preorder`): at most max_nodes nodes, none deeper than depth.
    rank: as `best_first_tree`'s. The slot ends holding exactly the verified pairs.
    """
    assert token_ids.dim() == 1 and len(token_ids) >= 1
    slots, T = torch.tensor([slot]), len(token_ids)
    logits, predicted = head_forward(head, cache, slots, features[None], token_ids[None], torch.tensor([T]),
                                     logits_index=torch.tensor([[T - 1]]))
    committed = int(cache.lengths[slot])
    if depth > 1:  # the tree steps write the last pair again at its place, as their root column
        cache.truncate(slot, committed - 1)
    inputs = [pair_inputs(head, features[None, -1:], token_ids[None, -1:])]   # per column, (1, E)
    predicted_at = {ROOT_PARENT: predicted[0, 0]}                              # node -> the feature it predicted
    columns: list[int] = []

    def grow(chosen: list[int], nodes: list[DraftNode]) -> torch.Tensor:
        parents_features = torch.stack([predicted_at[nodes[n].parent] for n in chosen])[:, None]   # (n, 1, E)
        tokens = head.d2t[torch.tensor([[nodes[n].draft_id] for n in chosen])]
        u = pair_inputs(head, parents_features, tokens, own=True)
        inputs.extend(u.split(1))
        columns.extend(chosen)
        step = tree_step(head.config, cache, slots, column_parents(columns, nodes), torch.tensor([len(columns)]),
                         len(columns) + 1, head.rope_cos, head.rope_sin, head.embed)
        x = decoder_layer(head.config, head.layer, 0, torch.cat(inputs), cache, step)
        logits, predicted = read_head(head, x[len(inputs) - len(chosen):].view(1, len(chosen), -1))
        predicted_at.update(zip(chosen, predicted[0]))
        return logits[0]

    nodes, kept = best_first_tree(logits[0, 0], grow, depth, max_nodes, topk, rank)
    if depth > 1:
        cache.commit(slots, torch.tensor([1]))           # the root pair, rewritten in place by the steps
    return preorder(nodes, kept, head.d2t)
