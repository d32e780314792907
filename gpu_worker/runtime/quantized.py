"""Projection weights kept as a GGUF file stores them: rows of Q4_1 or Q8_0 blocks of 32 weights.

`specbus models pull` writes them beside the float32 weights (gguf_convert.GGUF_BLOCKS_FILE, HF
names, q and k rows unpermuted). With `weights: gguf` a model's projections and its tied lm_head
are `QuantizedWeight`s, which `model.linear` hands to the projection kernel's `quant_linear`: it
widens each block in registers as gguf's own float32 dequantization does (Q4_1 d * q + m, two
roundings; Q8_0 d * q) and then runs fixed_linear's operations on the widened rows. So a row's
bits do not depend on the row count, and they equal the float32 model dequantized from the same
file, bit for bit (tests/gpu_worker/runtime/test_quantized.py); the weights a step reads are
those of the file (a Q4_1 weight is 5 bits, a Q8_0 one 8.5, float32 32).

`weights: int8` holds any model's projections (and lm_head) so: its dense weights quantized to
Q8_0 blocks at load (`quantize_q8_0`), weight-only int8, for a model that ships no GGUF blocks. That
changes the model (ops/bench/RESULTS.md measures by how much); the kernel's identities hold for the
quantized model as they do for the published blocks.

`weights: int8dot` serves the same blocks by llama.cpp's arithmetic instead (`IntWeight`,
`int_linear`, linear_kernel's int_kernel.cpp): each row of x quantized on its own to int8 blocks of
32 (a float32 scale max|x| / 127), each block's integer dot product with the weights' block exact
in int32, then its scales applied and the blocks summed in float32 in one fixed order. A row's
bits still depend on nothing beside it (nor on the instruction set: scalar, AVX2 and AVX512-VNNI
give the same bits), so every identity the forward promises holds for this model; but it is
another model than the float32 one: the one llama.cpp computes from the file, up to its rounding
of the activation scales to fp16 (ours stay float32) and its order of float sums. It reads the
same bytes and multiplies bytes, not floats: on a CPU with VNNI a one-row step costs about the
weights' bytes, and a verify's rows share each weight read (8 rows a pass over a group of w), so
it costs the integer arithmetic of its rows, not their bytes again (ops/bench/RESULTS.md).

Activations stay float32: the widened weights need fp32's mantissa (an fp16 d times q plus an
fp16 m), so `gguf` goes with dtype float32, on a CPU where the kernel runs. The embedding lookup
reads a dense float32 copy of the (tied) embedding: a step reads only its tokens' rows of it.
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from gpu_worker.runtime import kernel_paths, linear_kernel
from schemas.config import GGUF_BLOCKS_FILE

# the kernel's QuantKind and each block's bytes (linear_kernel.cpp)
KERNEL_KIND = {"q4_1": 0, "q8_0": 1}
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
BLOCK_WEIGHTS = 32
WEIGHT_FORMATS = ("auto", "dense", "gguf", "int8", "int8dot")


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight W (out, in) as rows of GGUF blocks: blocks (out, in/32 * BLOCK_BYTES[kind]) uint8."""
    blocks: torch.Tensor
    kind: str

    @property
    def shape(self) -> tuple[int, int]:
        rows, row_bytes = self.blocks.shape
        return rows, row_bytes // BLOCK_BYTES[self.kind] * BLOCK_WEIGHTS


@dataclass(frozen=True)
class IntWeight:
    """A weight W (out, in) as GGUF blocks in int_linear's layout (`int_pack`: groups of 16 rows,
    the same bytes as the file's blocks, the last group padded with zero rows)."""
    packed: torch.Tensor
    kind: str
    rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.packed.shape[1] // (16 * BLOCK_BYTES[self.kind]) * BLOCK_WEIGHTS


def to_int(weight: QuantizedWeight) -> IntWeight:
    """weight's blocks repacked for `int_linear` (the kernel must be there: `usable`)."""
    packed = linear_kernel.load().int_pack(weight.blocks, KERNEL_KIND[weight.kind])
    return IntWeight(packed, weight.kind, weight.blocks.shape[0])


def int_linear(x: torch.Tensor, w: IntWeight, b: torch.Tensor | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ W^T + b for x (N, in) float32 by int8 activation blocks and integer dot
    products; (N, out) float32, a row's bits its own (int_kernel.cpp says the operations)."""
    return linear_kernel.load().int_linear(x, w.packed, KERNEL_KIND[w.kind], w.rows, b, residual)


def block_linear(x: torch.Tensor, w: QuantizedWeight | IntWeight, b: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """`quant_linear` or `int_linear`, by w's kind."""
    return (int_linear if isinstance(w, IntWeight) else quant_linear)(x, w, b, residual)


def has_blocks(path) -> bool:
    return (Path(path) / GGUF_BLOCKS_FILE).is_file()


def read_blocks(path) -> dict[str, QuantizedWeight]:
    """Every weight of path's GGUF_BLOCKS_FILE under its HF name (FileNotFoundError without it)."""
    file = Path(path) / GGUF_BLOCKS_FILE
    with safe_open(file, framework="pt", device="cpu") as f:
        kinds = f.metadata() or {}
        return {name: QuantizedWeight(f.get_tensor(name), kinds[name]) for name in f.keys()}  # noqa: SIM118


def fuse(weights: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """The rows of weights one after another (q, k, v into wqkv; gate, up into w_gate_up), or None
    where one is missing or their block types differ (the caller keeps the dense weights)."""
    if any(w is None for w in weights) or len({w.kind for w in weights}) != 1:
        return None
    return QuantizedWeight(torch.cat([w.blocks for w in weights]).contiguous(), weights[0].kind)


def quantize_q8_0(w: torch.Tensor) -> QuantizedWeight:
    """W (out, in), in a multiple of 32 -> its Q8_0 blocks by gguf's own quantizer (ggml's
    reference: per block of 32, d = max |w| / 127 stored as fp16, q = round(w / d)): weight-only
    int8, 8.5 bits a weight, a changed model (each weight moves by about half a step d at most)."""
    from gguf import GGMLQuantizationType, quants

    blocks = quants.quantize(w.detach().to(torch.float32).contiguous().numpy(), GGMLQuantizationType.Q8_0)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(blocks)), "q8_0")


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """W (out, in) float32, by gguf's own dequantization (the values `quant_linear` widens to)."""
    from gguf import GGMLQuantizationType, quants

    qtype = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[weight.kind]
    values = quants.dequantize(weight.blocks.numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(weight.shape)


def usable(dtype: torch.dtype, device: str) -> bool:
    """Whether `quant_linear` serves a model of this dtype on this device here."""
    # the rule asked before the kernel is loaded (a load may build it)
    return kernel_paths.blocks_serve(device, str(dtype).removeprefix("torch."), True) and linear_kernel.load() is not None


def quant_linear(x: torch.Tensor, w: QuantizedWeight, b: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x @ W^T + b for x (N, in) float32; (N, out) float32, fixed_linear's order."""
    return linear_kernel.load().quant_linear(x, w.blocks, KERNEL_KIND[w.kind], b, residual)
