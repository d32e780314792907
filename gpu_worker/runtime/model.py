"""Llama-family decoder (Llama, Qwen2, Mistral) for inference with a slot KV cache.

The model is weights only (a dataclass of tensors); every piece of per-request state lives in
the `KVCache`. `forward` is the one function the verifier and the drafter call: it appends a
ragged batch of new tokens to the cache and returns logits (gpu_worker/runtime/tree_forward.py
verifies a tree of drafts with the same pieces).

Letters in shapes: B batch rows, T tokens per row, M selected positions per row, V vocabulary,
H query heads, Hkv key/value heads, D head dim, E hidden size, I MLP size, W attention window.

RoPE layout: Hugging Face Llama "rotate-half". The D dims of a head form two halves
(x1 = x[:D/2], x2 = x[D/2:]) and dim i is paired with dim i + D/2, both rotated by angle
pos * theta^(-2i/D):  rope(x) = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x2, x1).
(Meta's original checkpoints interleave pairs (2i, 2i+1) instead; HF conversion permutes
q/k weights into the half layout, which is what the safetensors files hold.) We fold the sign
into the sine table, so rotate_half(x) * sin == x.roll(D/2) * signed_sin: one op instead of
three (and `rope` does the whole rotation in one kernel call where the fixed-order kernel runs).

Batch invariance: a position's logits are the same bits whether it is computed in a decode step,
a verify step, a prefill chunk or a whole prompt, alone or next to other rows. Every reduction
runs in an order fixed per row: projections through `linear` (one kernel family for every
number of rows), norms through `rms_norm`, attention through `attention` (units of a fixed shape against keys in
fixed-size blocks, the blocks combined in a fixed order). tests/gpu_worker/runtime/test_model_batch_invariance.py
checks it with torch.equal.
"""

import functools
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from gpu_worker.runtime.kernel_paths import amx_tiles, attention_kernel, fixed_kernel
from gpu_worker.runtime.kv_cache import KEY_BLOCK, ForwardPlan, KVCache
from gpu_worker.runtime.quantized import IntWeight, QuantizedWeight, block_linear, fuse, to_int, usable

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


class ConfigError(ValueError):
    """A config.json this runtime cannot run; the message names the field."""


@dataclass(frozen=True)
class DecoderShape:
    """The shape of a Llama decoder layer and its RoPE: what `decoder_layer` and `rope_tables`
    read. The target's ModelConfig is one, and so is an EAGLE head's EagleConfig
    (gpu_worker/runtime/eagle.py), whose one layer is the target's layer shape."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads / num_attention_heads ({self.num_heads}) is not a multiple of "
                              f"num_kv_heads / num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    def shape_fields(self) -> dict:
        """The DecoderShape fields of this config, by name (to build another config of the same shape)."""
        return {f.name: getattr(self, f.name) for f in fields(DecoderShape)}


@dataclass(frozen=True)
class ModelConfig(DecoderShape):
    """A checkpoint's config.json (`from_hf`): the decoder shape, then the vocabulary, the
    number of layers and which projections have a bias."""
    architecture: str
    vocab_size: int
    num_layers: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool

    def __post_init__(self):
        for name in ("vocab_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        super().__post_init__()

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x or 5.x layout).

        `sliding_window` (Mistral, Qwen2) is ignored: attention is always full, which equals
        sliding-window attention while a sequence stays within the window.
        """
        architectures = hf.get("architectures") or []
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if len(architectures) != 1 or not supported:
            raise ConfigError(f"unsupported architectures {architectures!r} in config.json; "
                              f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        architecture = supported[0]

        def field(name):
            if hf.get(name) is None:
                raise ConfigError(f"config.json lacks required field {name!r}")
            return hf[name]

        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        # transformers 5.x: rope_parameters={rope_theta, rope_type}; 4.x: rope_theta at the top
        # and rope_scaling=None or {type|rope_type: ...}.
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
        if rope_type not in (None, "default"):
            raise ConfigError(f"rope scaling type {rope_type!r} is not supported (only 'default')")
        num_heads = field("num_attention_heads")
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            architecture=architecture,
            vocab_size=field("vocab_size"),
            hidden_size=field("hidden_size"),
            intermediate_size=field("intermediate_size"),
            num_layers=field("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or field("hidden_size") // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
            max_position_embeddings=field("max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
            qkv_bias=architecture == "Qwen2ForCausalLM" or attention_bias,
            o_bias=architecture != "Qwen2ForCausalLM" and attention_bias,
        )


@dataclass
class Layer:
    """Projection weights as `pack_weight` leaves them, for `linear`: the shapes below are the
    checkpoint's (out, in); held with rows paired for the fixed-order kernel, or as oneDNN's
    packed copies where that kernel cannot run on this CPU."""
    attn_norm: torch.Tensor        # (E,)
    wqkv: torch.Tensor             # ((H + 2*Hkv) * D, E): q, k, v projections fused at load
    bqkv: torch.Tensor | None      # ((H + 2*Hkv) * D,)
    wo: torch.Tensor               # (E, H*D)
    bo: torch.Tensor | None        # (E,)
    mlp_norm: torch.Tensor         # (E,)
    w_gate_up: torch.Tensor        # (2*I, E): gate and up projections fused at load
    w_down: torch.Tensor           # (E, I)


@dataclass
class Model:
    config: ModelConfig
    embed: torch.Tensor            # (V, E)
    layers: list[Layer]
    norm: torch.Tensor             # (E,)
    lm_head: torch.Tensor          # (V, E) through `pack_weight` (of `embed` when tied)
    rope_cos: torch.Tensor         # (P, D) for positions 0..P-1
    rope_sin: torch.Tensor         # (P, D) with the rotate-half sign folded in: (-sin, sin)


def weight_names(config: ModelConfig) -> list[str]:
    """Names `build_model` expects, in our scheme (`layers.{i}.wq`, ...)."""
    per_layer = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if config.qkv_bias:
        per_layer += ["bq", "bk", "bv"]
    if config.o_bias:
        per_layer += ["bo"]
    names = ["embed", "norm"] + ([] if config.tie_word_embeddings else ["lm_head"])
    return names + [f"layers.{i}.{n}" for i in range(config.num_layers) for n in per_layer]


def rope_tables(shape: DecoderShape, num_positions: int, device=None,
                dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), each (P, D), computed in float32 as HF Llama's default rotary
    embedding, then moved to device and dtype: the tables `plan_step` reads (a Model's, an
    EAGLE head's)."""
    d = shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)  # (P, D/2)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([-freqs, freqs], -1).sin()
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], device="cpu",
                dtype=torch.float32, max_seq_len: int | None = None,
                blocks: dict[str, QuantizedWeight] | None = None, integer: bool = False) -> Model:
    """Fuse per-projection weights (named as `weight_names`) into a `Model` on `device`.

    blocks (named alike): projections kept as GGUF blocks (float32 on the CPU only,
    gpu_worker/runtime/quantized.py); a projection whose pieces are all there is one, and its
    dense weights are not needed; a tied lm_head is the embedding's blocks (integer: as `IntWeight`s).

    RoPE tables cover positions 0..max_seq_len-1 (default: max_position_embeddings; a
    smaller value keeps the tables small for configs that allow 128k positions).
    """
    num_positions = max_seq_len or config.max_position_embeddings
    if num_positions > config.max_position_embeddings:
        raise ConfigError(f"max_seq_len {num_positions} exceeds max_position_embeddings "
                          f"{config.max_position_embeddings}")

    def get(name):
        return weights[name].to(device=device, dtype=dtype)

    def cat(*names):  # (out, in) pieces -> one (out_total, in) tensor
        return torch.cat([get(n) for n in names])

    blocks = blocks or {}
    if blocks and not usable(dtype, str(device)):
        raise ConfigError(f"GGUF block weights need float32 on a CPU with the projection kernel, not {dtype} on {device}")

    def held(weight: QuantizedWeight | None) -> QuantizedWeight | IntWeight | None:
        return to_int(weight) if integer and weight is not None else weight

    def projection(*names):
        fused = held(fuse([blocks.get(n) for n in names]))
        return fused if fused is not None else pack_weight(cat(*names))

    layers = []
    for i in range(config.num_layers):
        p = f"layers.{i}."
        layers.append(Layer(
            attn_norm=get(p + "attn_norm"),
            wqkv=projection(p + "wq", p + "wk", p + "wv"),
            bqkv=cat(p + "bq", p + "bk", p + "bv") if config.qkv_bias else None,
            wo=projection(p + "wo"),
            bo=get(p + "bo") if config.o_bias else None,
            mlp_norm=get(p + "mlp_norm"),
            w_gate_up=projection(p + "w_gate", p + "w_up"),
            w_down=projection(p + "w_down"),
        ))
    embed = get("embed")
    cos, sin = rope_tables(config, num_positions, device, dtype)
    return Model(config=config, embed=embed, layers=layers, norm=get("norm"),
                 lm_head=held(blocks.get("embed")) or pack_weight(embed, shared=True) if config.tie_word_embeddings
                 else projection("lm_head"),
                 rope_cos=cos, rope_sin=sin)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of each row of x (..., E) with weight w (E,): x's shape and dtype. A row's
    bits do not depend on how many rows share the call: the fixed-order kernel's sum of squares
    (linear_kernel.cpp `rms_rows`), else torch's."""
    kernel = fixed_kernel(x)
    if kernel is not None:
        return kernel.fixed_rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> torch.Tensor:
    """The first `heads` heads of qkv (B, T, S, D) rotated by RoPE rows cos and signed sin
    (B, T, 1, D): (B, T, heads, D), x * cos + x.roll(D/2) * sin (module docstring), in one kernel
    call where the fixed-order kernel runs (its bits are these three torch ops')."""
    B, T, S, D = qkv.shape
    kernel = fixed_kernel(qkv)
    if kernel is not None:
        return kernel.fixed_rope(qkv.view(B * T, S, D), cos.view(B * T, D), sin.view(B * T, D), heads).view(B, T, heads, D)
    x = qkv[:, :, :heads]
    return x * cos + x.roll(D // 2, -1) * sin


def pair_rows(w: torch.Tensor) -> torch.Tensor:
    """w (out, in), out even, in a multiple of 8 -> (out/2, in/8, 2, 8): rows 2p and 2p+1 of w
    interleaved in chunks of 8 values, the layout the fixed-order kernel streams fastest."""
    out, inner = w.shape
    return w.reshape(out // 2, 2, inner // 8, 8).transpose(1, 2).contiguous()


def amx_rows(w: torch.Tensor) -> torch.Tensor:
    """w (out, in), out a multiple of 16, in of 32 -> (out/16, in/32, 16, 32): for each block of
    16 rows and chunk of 32 values of k, the AMX tile of that piece of w in the "VNNI" layout
    (row p of the tile: values 2p and 2p+1 of each of the 16 rows side by side), the tiles of a
    block in k order: a block is one sequential stream."""
    out, inner = w.shape
    return w.reshape(out // 16, 16, inner // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(out // 16, inner // 32, 16, 32)


def pack_weight(w: torch.Tensor, shared: bool = False) -> torch.Tensor:
    """w (out, in) -> what `linear` takes: for our fixed-order CPU kernel, bfloat16 w as AMX tiles
    (`amx_rows`) where the kernel runs them and the shape allows, even when `shared` (a tied
    lm_head: a second copy, E*V*2 bytes, for a verify or prefill at tile speed); else w's rows paired
    (`pair_rows`) where its shape allows and w is not `shared` (read as it is elsewhere too, as a
    tied lm_head is the embedding: pairing would hold a second copy), else w itself (contiguous);
    where that kernel cannot run, oneDNN's packed float32 copy (bfloat16 w too), else w itself
    for a BLAS matmul (gpu_worker/runtime/kernel_paths.py decides which).

    Why not a library's matmul: MKL, torch's float32 BLAS on x86, picks its kernel by the number
    of rows (a GEMV at one row, other kernels and thread splits at a few rows), each summing over
    `in` in its own order, so a row's bits depend on how many rows share the call. oneDNN's
    kernel for a packed weight is one blocked GEMM for every row count (packed for 4 rows: a
    layout packed for one row sends one-row calls to a GEMV of oneDNN's own), dearer than a GEMV
    at one row with the weights cold; our kernel costs a GEMV's (ops/bench/RESULTS.md). Its bfloat16
    GEMM does not keep that on an AMX CPU (it picks a kernel by the row count), so bfloat16 goes
    through its float32 one (twice the weights' bytes, on a fallback). A GPU needs
    batch-invariant matmul kernels instead (a fixed tile configuration, no split-K chosen from
    the row count).
    """
    kernel = fixed_kernel(w)
    if kernel is not None:
        out, inner = w.shape
        if amx_tiles(kernel, w):
            return amx_rows(w)  # shared too: tiles are worth a copy of a tied lm_head (E*V*2 bytes)
        return pair_rows(w) if not shared and out % 2 == 0 and inner % 8 == 0 else w.contiguous()
    if w.device.type == "cpu" and torch.backends.mkldnn.is_available():
        # bfloat16 as a float32 copy: oneDNN's bfloat16 GEMM on an AMX CPU picks its kernel by
        # the row count (rows 8, 16, 31, 32 of a 576-wide layer differ from the same rows in a
        # larger call), its float32 GEMM does not; `linear` rounds the float32 result once.
        try:
            return torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), 4)
        except RuntimeError:  # oneDNN refuses on this CPU
            pass
    return w.contiguous()


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedWeight | IntWeight, b: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ W^T + b for x (N, in) and w = pack_weight(W) or W as GGUF blocks (widened
    to float32, or by integer dot products); (N, out). A row's bits do not depend on N."""
    if isinstance(w, QuantizedWeight | IntWeight):
        return block_linear(x, w, b, residual)
    if w.is_mkldnn:  # float32 (pack_weight): x, b and residual to float32, the result back once
        x32, b32 = x.float(), None if b is None else b.float()
        if residual is None:
            out = torch.ops.mkldnn._linear_pointwise(x32, w, b32, "none", [], "")
        else:
            out = torch.ops.mkldnn._linear_pointwise.binary(x32, residual.float(), w, b32, "add")
        return out.to(x.dtype)
    kernel = fixed_kernel(x)
    if kernel is not None:
        return kernel.fixed_linear(x, w, b, residual)
    out = torch.mm(x, w.t()) if residual is None else torch.addmm(residual, x, w.t())
    return out if b is None else out.add_(b)


QUERY_TILE = 4  # query rows per attention unit: every unit has the same shape whatever T and B
# The additive mask's value for a key a row may not see: finite, so a row that sees no key of a
# block gets a finite log-sum-exp near MASKED there and the block weight exp(MASKED - m) = 0
# exactly, with no -inf - -inf; a masked key itself gets weight exactly 0, as with -inf.
MASKED = -1e30
# `attention` takes exp of each row's block weight on this many lanes (a broadcast), not one.
EXP_LANES = 16


@dataclass
class AttentionPlan:
    """How `attention` lays out one forward's batch, the same for all its layers: units of
    QUERY_TILE query rows of one key/value head (a head's T*G rows in (t, g) order, padded to
    nq units, M = nq*QT rows) against the window's nb blocks of KEY_BLOCK keys; built by
    `attention_plan`."""
    nq: int
    nb: int
    mask: torch.Tensor       # (B, nb, M, KB) float32, 0 = may attend, MASKED = may not: a unit
                             # row's keys in each block (the same for every key/value head)
    unit_q: torch.Tensor     # (B*Hkv, M) int64 the query row, of q viewed (B*T*H, D), of each unit
                             # row; padding rows repeat a real row (their outputs are dropped)
    unit_out: torch.Tensor   # (B*Hkv, M) int64 the same row as the output's, -1 for padding rows
    out_rows: torch.Tensor   # (B*T*H,) the unit row, among (B*Hkv, M), that holds query row
                             # (b, t, head)


@functools.lru_cache(maxsize=64)
def unit_layout(B: int, T: int, Hkv: int, G: int, device: torch.device) -> tuple:
    """The part of an AttentionPlan that positions do not change, cached: every step of a batch
    shape has the same (callers must not modify the tensors). Returns (row_token, unit_q,
    unit_out, out_rows): row_token (M,) the token of each unit row of a head, T for padding
    rows; the others as in AttentionPlan."""
    R, nq = T * G, -(-T * G // QUERY_TILE)
    n = torch.arange(nq * QUERY_TILE, device=device)                    # a head's unit rows
    t = n // G
    head = torch.arange(Hkv, device=device).view(1, Hkv, 1) * G + n % G   # (1, Hkv, M)
    batch = torch.arange(B, device=device).view(B, 1, 1)
    unit_q = ((batch * T + t.clamp_max(T - 1)) * Hkv * G + head).view(B * Hkv, -1)
    unit_out = torch.where(n < R, unit_q, -1)
    out_rows = torch.arange(B * Hkv, device=device).view(B, 1, Hkv, 1) * (nq * QUERY_TILE) + \
        torch.arange(R, device=device).view(1, T, 1, G)                 # (B, T, Hkv, G)
    return t.clamp_max(T), unit_q, unit_out, out_rows.flatten()


def attention_plan(pos: torch.Tensor, Hkv: int, G: int, W: int) -> AttentionPlan:
    """The AttentionPlan of new tokens at positions pos (B, T) int64, each seeing keys 0..pos,
    over a window of W keys (a multiple of KEY_BLOCK), for Hkv key/value heads of G query
    heads each. Always a mask, even where a decode step could attend to everything: one
    attention path for every step."""
    B, T = pos.shape
    nq, nb = -(-T * G // QUERY_TILE), W // KEY_BLOCK
    row_token, unit_q, unit_out, out_rows = unit_layout(B, T, Hkv, G, pos.device)
    row_pos = F.pad(pos, (0, 1), value=W).index_select(1, row_token)     # (B, M); padding rows see all
    keys = torch.arange(W, device=pos.device).view(1, nb, 1, KEY_BLOCK)
    mask = torch.zeros(B, nb, nq * QUERY_TILE, KEY_BLOCK, device=pos.device)
    mask.masked_fill_(keys > row_pos.view(B, 1, -1, 1), MASKED)
    return AttentionPlan(nq=nq, nb=nb, mask=mask, unit_q=unit_q, unit_out=unit_out, out_rows=out_rows)


def flash_mask(plan: AttentionPlan, Hkv: int) -> torch.Tensor:
    """plan.mask in `block_outputs`' layout for torch's flash kernel: (B*Hkv, nb, QT, KB) if
    nq == 1, else (nq, B*Hkv*nb, QT, KB)."""
    B, nb, nq = plan.mask.shape[0], plan.nb, plan.nq
    mask = plan.mask.view(B, 1, nb, nq, QUERY_TILE, KEY_BLOCK).expand(-1, Hkv, -1, -1, -1, -1)
    if nq == 1:
        return mask.reshape(B * Hkv, nb, QUERY_TILE, KEY_BLOCK)
    return mask.permute(3, 0, 1, 2, 4, 5).reshape(nq, B * Hkv * nb, QUERY_TILE, KEY_BLOCK)


def block_sum(x: torch.Tensor) -> torch.Tensor:
    """x (U, nb, ...) -> (U, ...): the sum over the nb key blocks as a pairwise tree over block
    positions, ((0 + 1) + (2 + 3)) + ..., blocks past nb counting as blocks of zeros.

    A block of zeros adds exactly 0 wherever it enters the tree, so a row whose keys end in
    block j gets the same bits whatever the number of blocks after j (other rows' windows).
    Each level sums a dim of size 2: one addition, whatever order a kernel takes.
    """
    nb = x.shape[1]
    levels = (nb - 1).bit_length()
    if nb < 2 ** levels:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, 2 ** levels - nb))
    if levels > 1:
        x = x.unflatten(1, (2,) * levels)
    for dim in range(levels, 0, -1):  # the last of the split dims pairs blocks 2i and 2i + 1
        x = x.sum(dim)
    return x


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What `attention` takes from its block kernel (linear_kernel.cpp `unit_blocks`, or torch's CPU
    flash kernel where ours cannot run), in plain ops for other devices:
    q (..., L, D), k, v (..., S, D), mask (..., L, S) additive -> out (..., L, D) float32, the
    softmax-weighted values, and lse (..., L) float32, the log-sum-exp of the row's scores.
    Batch-invariant only where the device's matmuls are (on a GPU: fixed tiles, no split-K
    chosen by shape)."""
    scores = q.float() @ k.float().transpose(-1, -2) * scale + mask
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v.float(), lse


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """Causal GQA attention whose bits per query row do not depend on T, B or the window.

    q: (B, T, H, D); k, v: (B, Hkv, W, D) with W = plan.nb * KEY_BLOCK and (B, Hkv) mergeable
    into one dim (the cache's slot-major layout, or contiguous); plan: `attention_plan`.
    Returns (B*T, H*D) in q's dtype.

    SDPA's reductions over keys follow its split of the work, chosen from the query and key
    lengths, and a call without a mask takes another path. Here every piece of work has one
    shape: a unit of QUERY_TILE query rows (the G query heads of a key/value head fold into
    rows, so K/V are never repeated) against one block of KEY_BLOCK keys. Where our kernel
    runs (AVX2, D a multiple of 8, SPECBUS_LINEAR_KERNEL not 0), two calls a layer:
    linear_kernel.cpp `unit_blocks` (each unit row's scores, softmax and weighted sum over a
    block's keys in one fixed order, keys in order: each pair's softmax-weighted values out_j and
    log-sum-exp lse_j) and `combine_units`; elsewhere torch's CPU flash kernel, which reduces a
    block of fewer than 512 keys in one piece (four rows, not G: flash's per-thread buffers are
    then 32-byte aligned on every thread, and its matmuls' bits depend on that alignment), and
    `combine_blocks`. A row's blocks are combined as in FlashAttention's blockwise softmax (Dao
    et al. 2022, sec. 3.1; Flash-Decoding's combine of split keys): out = sum_j exp(lse_j - m)
    out_j / sum_j exp(lse_j - m), m = max_j lse_j, the sums in `block_sum`'s fixed tree. A block
    the row cannot see at all has lse_j near MASKED, so weight exactly 0: wherever the window
    ends, the row's bits are the same. In torch's combine each weight's exp runs on EXP_LANES
    lanes of a broadcast, so on every row in a loop of its own, never in the scalar tail of a
    long run (whose rounding may differ from the vector code's); ours has one exp for all.

    On a GPU this is where a fixed-split attention kernel goes (FlashInfer / FlexAttention with
    a fixed KV split size); `block_attention` there is only as invariant as the GPU's matmuls.
    """
    B, T, H, D = q.shape
    out, lse = block_outputs(q, k, v, plan)
    kernel = attention_kernel(q, D)
    if kernel is not None:
        U, nb, M = out.shape[0], plan.nb, plan.nq * QUERY_TILE
        out = kernel.combine_units(out.view(U, nb, M, D), lse.view(U, nb, M), plan.unit_out, B * T * H)
        return out.view(B * T, H * D)
    if plan.nb > 1:  # nb == 1: the one block's weight is exp(0) = 1, the same bits as combining
        out = combine_blocks(out, lse, q.dtype)
    return out.reshape(-1, D).index_select(0, plan.out_rows).view(B * T, H * D)


def block_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  plan: AttentionPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention`'s block kernel: each unit against each key block, not yet combined. q, k, v,
    plan as `attention`; returns out (U, nb, nq, QT, D) in q's dtype (on the CPU) and lse
    (U, nb, nq, QT, 1) float32, U = B*Hkv, QT = QUERY_TILE (unit row n of (U, nq*QT) is
    plan.out_rows' numbering)."""
    B, D = q.shape[0], q.shape[-1]
    U, nq, nb = B * k.shape[1], plan.nq, plan.nb
    kernel = attention_kernel(q, D)
    if kernel is not None:  # our fixed-order kernel (linear_kernel.cpp `unit_blocks`)
        out, lse = kernel.unit_blocks(q.flatten(0, 1), k, v, plan.mask, plan.unit_q, D ** -0.5)
        return out.view(U, nb, nq, QUERY_TILE, D), lse.view(U, nb, nq, QUERY_TILE, 1)
    units = q.reshape(-1, D)[plan.unit_q].view(B, -1, 1, nq * QUERY_TILE, D).expand(-1, -1, nb, -1, -1)
    mask = flash_mask(plan, k.shape[1])
    if nq == 1:  # (batch, heads) = (unit, block): the keys as they are
        units = units.reshape(U, nb, QUERY_TILE, D)
        k, v = k.reshape(U, nb, KEY_BLOCK, D), v.reshape(U, nb, KEY_BLOCK, D)
    else:  # (unit, head*block): keys shared by the units (copied where the heads are apart)
        units = units.reshape(U * nb, nq, QUERY_TILE, D).transpose(0, 1)
        k, v = (t.reshape(1, U * nb, KEY_BLOCK, D).expand(nq, -1, -1, -1) for t in (k, v))
    if q.is_cpu:  # torch's flash kernel itself: no dispatch to another backend
        out, lse = torch._scaled_dot_product_flash_attention_for_cpu(units, k, v, attn_mask=mask, scale=D ** -0.5)[:2]
    else:
        out, lse = block_attention(units, k, v, mask, D ** -0.5)
    if nq > 1:  # back to (U*nb, nq, QT, ...), the kernel's memory order here
        out, lse = out.transpose(0, 1), lse.transpose(0, 1)
    return out.reshape(U, nb, nq, QUERY_TILE, D), lse.reshape(U, nb, nq, QUERY_TILE, 1)


def combine_blocks(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FlashAttention's blockwise softmax combine (see `attention`): out (U, nb, ..., D) and lse
    (U, nb, ..., 1) of each row's nb key blocks -> (U, ..., D) in dtype. Every op is per element
    (a block's weight, its exp on EXP_LANES lanes, sums over size-2 dims in `block_sum`'s tree),
    so a row's bits depend only on its own blocks, in their order, whatever the layout of the rows.
    Where our block kernel serves, its `combine_units` (the same tree, its own exp): the bits of
    `attention`'s combine there."""
    U, nb, D = out.shape[0], out.shape[1], out.shape[-1]
    kernel = attention_kernel(out, D)
    if kernel is not None:
        rows = out.shape[2:-1].numel()
        own = torch.arange(U * rows, device=out.device).view(U, rows)
        combined = kernel.combine_units(out.reshape(U, nb, rows, D).contiguous(), lse.reshape(U, nb, rows).contiguous(),
                                        own, U * rows)
        return combined.view(U, *out.shape[2:]).to(dtype)
    weight = (lse - lse.amax(1, keepdim=True)).expand(*lse.shape[:-1], EXP_LANES).exp()[..., :1]
    return (block_sum(out * weight) / block_sum(weight)).to(dtype)


@dataclass
class Step:
    """One forward's cache plan and what every layer reads from it; `attend` is the step's
    attention (a tree step, gpu_worker/runtime/tree_forward.py, has its own)."""
    plan: ForwardPlan
    cos: torch.Tensor              # (B, T, 1, D) RoPE of each new token's position
    sin: torch.Tensor              # (B, T, 1, D)
    attention: list[AttentionPlan]  # one per window group of the plan (KVCache.plan), in its order

    def attend(self, q: torch.Tensor, cache: KVCache, index: int) -> torch.Tensor:
        """Attention of q (B, T, H, D) for layer `index` of cache, its K/V written: (B*T, H*D)."""
        return grouped_attention(q, cache, index, self)


def rope_rows(rope_cos: torch.Tensor, rope_sin: torch.Tensor,
              pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RoPE rows (cos, signed_sin) of positions pos (B, T) in tables (P, D): (B, T, 1, D) each."""
    (B, T), D, flat = pos.shape, rope_cos.shape[1], pos.flatten()
    return rope_cos.index_select(0, flat).view(B, T, 1, D), rope_sin.index_select(0, flat).view(B, T, 1, D)


def plan_step(cache: KVCache, rope_cos: torch.Tensor, rope_sin: torch.Tensor, slots: torch.Tensor,
              num_new: torch.Tensor, T: int, num_heads: int, num_kv_heads: int) -> Step:
    """Plan a forward of T new tokens per row on cache (`KVCache.plan`: it checks the batch and
    grows the slots) and build the RoPE rows and the attention layout every layer uses, one per
    window group."""
    plan = cache.plan(slots, num_new, T)
    return Step(plan, *rope_rows(rope_cos, rope_sin, plan.rope_pos),
                attention=[attention_plan(plan.rope_pos if g.rows is None else plan.rope_pos.index_select(0, g.rows),
                                          num_kv_heads, num_heads // num_kv_heads, g.window) for g in plan.groups])


def by_group(q: torch.Tensor, groups: list, plans: list, attend) -> torch.Tensor:
    """attend(q_g, group, plan) -> (Bg*T, H*D) for each window group of a forward and its plan,
    q_g the group's rows of q (B, T, H, D); the rows gathered back into (B*T, H*D)."""
    B, T, H, D = q.shape
    if len(groups) == 1:
        return attend(q, groups[0], plans[0])
    out = q.new_empty(B, T, H * D)
    for group, plan in zip(groups, plans):
        rows = attend(q.index_select(0, group.rows), group, plan)
        out.index_copy_(0, group.rows, rows.view(-1, T, H * D))
    return out.view(B * T, H * D)


def grouped_attention(q: torch.Tensor, cache: KVCache, index: int, step: Step) -> torch.Tensor:
    """`attention` of q (B, T, H, D) for layer `index`, each window group over its own window:
    (B*T, H*D). A row's bits do not depend on the window (`attention`), so they are those of
    one call over the longest window, without reading or attending over keys the row cannot see."""
    return by_group(q, step.plan.groups, step.attention,
                    lambda q_g, group, plan: attention(q_g, *cache.window(index, group), plan))


def decoder_layer(cfg: DecoderShape, layer: Layer, index: int, x: torch.Tensor, cache: KVCache,
                  step: Step) -> torch.Tensor:
    """One Llama decoder layer (layer `index` of cache) over x (B*T, E); returns (B*T, E). cfg:
    the target's config, or an EAGLE head's."""
    B, T = step.plan.rope_pos.shape
    H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    qkv = linear(h, layer.wqkv, layer.bqkv).view(B, T, H + 2 * Hkv, D)
    qk = rope(qkv, step.cos, step.sin, H + Hkv)                      # (B, T, H+Hkv, D)
    cache.update(index, step.plan, qk[:, :, H:], qkv[:, :, H + Hkv:])
    o = step.attend(qk[:, :, :H], cache, index)                      # (B*T, H*D)
    x = linear(o, layer.wo, layer.bo, residual=x)
    h = rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps)
    gate, up = linear(h, layer.w_gate_up).chunk(2, -1)               # (B*T, I) each
    return linear(F.silu(gate) * up, layer.w_down, residual=x)


@torch.inference_mode()
def forward(model: Model, cache: KVCache, slots: torch.Tensor, token_ids: torch.Tensor,
            num_new: torch.Tensor, logits_index: torch.Tensor | None = None,
            return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Append new tokens to each row's cache slot, attend causally, return logits.

    slots: (B,) int64, distinct allocated cache slots (CPU tensor: bookkeeping is on CPU).
    token_ids: (B, T) int64. Row b's new tokens are token_ids[b, :num_new[b]]; the rest of
        the row is padding (any valid id).
    num_new: (B,) int64 on CPU, 0 <= num_new[b] <= T. A row with 0 leaves its slot untouched.
    logits_index: (B, M) int64 positions in [0, T) whose logits to return, or None for all.
    Returns (B, T, V) or (B, M, V) logits in the model's dtype; with return_hidden, also the
    final-normed hidden states of every new position, (B, T, E) whatever logits_index asks (the
    logits at t are lm_head of row t): the target features a feature-level (EAGLE-style) draft
    conditions on. Batch-invariant like the logits.

    New token t of row b sits at position cache.lengths[slot_b] + t and sees the slot's
    committed prefix plus new tokens 0..t. Logits at padding positions (t >= num_new[b]) are
    unspecified; padding never touches a slot's committed prefix (its cache writes land in
    a scratch column). On return cache.lengths[slots] has advanced by num_new. Raises
    CacheCapacityError (nothing written) when a row would pass cache.max_seq_len.
    """
    B, T = token_ids.shape
    x = forward_rows(model, cache, slots, token_ids, num_new)
    return read_out(model, x.view(B, T, model.config.hidden_size), logits_index, return_hidden)


@torch.inference_mode()
def forward_layers(model: Model, cache: KVCache, slots: torch.Tensor, token_ids: torch.Tensor, num_new: torch.Tensor,
                   layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`forward(..., return_hidden=True)` (its logits and hidden, bit for bit) that also returns
    the residual stream entering each of `layers` (0-based; 0 is the embedding), concatenated:
    (logits (B, T, V), hidden (B, T, E), (B, T, len(layers) * E)): the low, middle and high target
    features an EAGLE-3 head fuses."""
    B, T = token_ids.shape
    kept = dict.fromkeys(layers)
    x = forward_rows(model, cache, slots, token_ids, num_new, kept)
    logits, hidden = read_out(model, x.view(B, T, model.config.hidden_size), None, True)
    return logits, hidden, torch.cat([kept[i] for i in layers], -1).view(B, T, -1)


def forward_rows(model: Model, cache: KVCache, slots: torch.Tensor, token_ids: torch.Tensor, num_new: torch.Tensor,
                 kept: dict | None = None) -> torch.Tensor:
    """`forward` up to the read-out: plan, every layer, commit; (B*T, E), not normed."""
    cfg = model.config
    B, T = token_ids.shape
    assert slots.shape == (B,) and num_new.shape == (B,), (slots.shape, num_new.shape, B)
    check_cache(model, cache)
    step = plan_step(cache, model.rope_cos, model.rope_sin, slots, num_new, T, cfg.num_heads, cfg.num_kv_heads)
    x = run_layers(model, cache, step, token_ids, kept)
    cache.commit(slots, num_new)
    return x


def check_cache(model: Model, cache: KVCache) -> None:
    """ValueError unless cache suits model: its dtype and device, positions within the RoPE table."""
    if cache.max_seq_len > model.rope_cos.shape[0]:
        raise ValueError(f"cache max_seq_len {cache.max_seq_len} exceeds the model's RoPE table "
                         f"({model.rope_cos.shape[0]} positions); load with a larger max_seq_len")
    if (cache.dtype, cache.device) != (model.embed.dtype, model.embed.device):
        raise ValueError(f"cache is {cache.dtype} on {cache.device}, model is "
                         f"{model.embed.dtype} on {model.embed.device}")


def run_layers(model: Model, cache: KVCache, step: Step, token_ids: torch.Tensor,
               kept: dict | None = None) -> torch.Tensor:
    """Embed token_ids (B, T) and run every decoder layer of a planned step: (B*T, E), not normed.
    kept: {layer index: ...} set to the (B*T, E) stream entering each of those layers."""
    x = model.embed[token_ids.to(model.embed.device).reshape(-1)]    # (B*T, E)
    for i, layer in enumerate(model.layers):
        if kept is not None and i in kept:
            kept[i] = x
        x = decoder_layer(model.config, layer, i, x, cache, step)
    return x


def read_out(model: Model, x: torch.Tensor, logits_index: torch.Tensor | None,
             return_hidden: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The final norm and lm_head over the last layer's x (B, T, E): `forward`'s return value
    (logits_index, return_hidden as there)."""
    cfg = model.config
    B, _, E = x.shape
    # The final norm is per row: norm then gather equals gather then norm, bit for bit; norm
    # every row only when they are all returned.
    hidden = rms_norm(x, model.norm, cfg.rms_norm_eps) if return_hidden else None  # (B, T, E)
    if hidden is not None:
        x = hidden
    if logits_index is not None:
        assert logits_index.shape[0] == B and logits_index.dim() == 2, logits_index.shape
        index = logits_index.to(x.device).unsqueeze(-1).expand(-1, -1, E)
        x = x.gather(1, index)                                       # (B, M, E)
    if hidden is None:
        x = rms_norm(x, model.norm, cfg.rms_norm_eps)
    logits = linear(x.reshape(-1, E), model.lm_head).view(*x.shape[:2], cfg.vocab_size)
    return (logits, hidden) if return_hidden else logits
