"""GGUF block weights (gpu_worker/runtime/quantized.py): `quant_linear` is bit for bit the
fixed-order kernel on the weights gguf dequantizes, whatever the row count and thread count, and
the default target served from its blocks is bit for bit the float32 model converted from the
same file."""

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from gpu_worker.batching.slots import resolve_dtype, resolve_weights
from gpu_worker.runtime import linear_kernel
from gpu_worker.runtime.checkpoint import load_model, read_config
from gpu_worker.runtime.kv_cache import KVCache
from gpu_worker.runtime.model import forward, pack_weight
from gpu_worker.runtime.quantized import (
    BLOCK_BYTES,
    QuantizedWeight,
    dequantize,
    fuse,
    int_linear,
    quant_linear,
    quantize_q8_0,
    read_blocks,
    to_int,
)
from schemas.config import TINY_TARGET
from schemas.errors import SpecbusError

KINDS = ["q4_1", "q8_0"]


@pytest.fixture(scope="module")
def kernel():
    module = linear_kernel.load()
    if module is None:
        pytest.skip("no AVX2 on this CPU: GGUF weights are served dense")
    return module


def random_weight(kind: str, rows: int, inner: int, seed: int = 0) -> QuantizedWeight:
    """Random blocks: any nibbles / int8 values, small fp16 scales (and minimums)."""
    rng = np.random.default_rng(seed)
    nb = inner // 32
    raw = rng.integers(0, 256, size=(rows, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.standard_normal((rows, nb, 2 if kind == "q4_1" else 1)) * 0.02).astype(np.float16)
    raw[:, :, :scales.shape[-1] * 2] = scales.view(np.uint8).reshape(rows, nb, -1)
    return QuantizedWeight(torch.from_numpy(raw.reshape(rows, -1).copy()), kind)


def test_dequantize_is_ggufs_own():
    w = random_weight("q4_1", 6, 64)
    reference = quants.dequantize(w.blocks.numpy(), GGMLQuantizationType.Q4_1)
    assert torch.equal(dequantize(w), torch.from_numpy(reference.astype(np.float32)))
    assert w.shape == (6, 64)


@pytest.fixture(params=["avx512", "avx2"])
def isa(request, kernel):
    """The kernel's AVX-512 code, then its AVX2 code (both where the CPU has AVX-512F)."""
    if request.param == "avx512" and not kernel.use_avx512(True):
        pytest.skip("no AVX-512F on this CPU: its AVX2 code is the one that runs")
    kernel.use_avx512(request.param == "avx512")
    yield request.param
    kernel.use_avx512(True)


@pytest.mark.parametrize("kind", KINDS)
def test_quant_linear_equals_the_kernel_on_the_dequantized_weight(kernel, isa, kind):
    """The same bits from either instruction set (fixed_linear's AVX2 code is the reference), for
    a decode row, a verify's few (widened as multiplied) and a tree's or prefill's many (widened
    once into a buffer)."""
    N, K = 70, 96  # N off every block height (2, 3, 4, 6, 8), even (paired dense rows)
    w = random_weight(kind, N, K)
    dense = dequantize(w)
    g = torch.Generator().manual_seed(1)
    b, x_all, r_all = torch.randn(N, generator=g), torch.randn(20, K, generator=g), torch.randn(20, N, generator=g)
    kernel.use_avx512(False)
    reference = kernel.fixed_linear(x_all, pack_weight(dense), b, r_all)
    kernel.use_avx512(isa == "avx512")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for M in range(1, 21):
            x, r = x_all[:M], r_all[:M]
            got = quant_linear(x, w, b, r)
            assert torch.equal(got, reference[:M]), (kind, isa, threads, M)
            assert torch.equal(got[:1], quant_linear(x[:1], w, b, r[:1])), "a row depends on its neighbours"


def test_fused_blocks_are_the_rows_one_after_another(kernel):
    a, b = random_weight("q4_1", 4, 64, seed=2), random_weight("q4_1", 6, 64, seed=3)
    x = torch.randn(3, 64)
    fused = fuse([a, b])
    assert torch.equal(quant_linear(x, fused), torch.cat([quant_linear(x, a), quant_linear(x, b)], 1))
    assert fuse([a, random_weight("q8_0", 4, 64)]) is None and fuse([a, None]) is None


def test_quant_linear_refuses_a_bad_shape(kernel):
    w = random_weight("q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="blocks of 32 weights along K"):
        kernel.quant_linear(torch.randn(2, 96), w.blocks, 1, None, None)


def test_weights_setting_resolves_and_names_the_field(kernel):
    assert resolve_weights("auto", str(TINY_TARGET), torch.float32, "cpu") == "dense"  # no blocks there
    assert resolve_dtype("auto", "cpu", str(TINY_TARGET)) == resolve_dtype("auto", "cpu")
    assert resolve_weights("dense", str(TINY_TARGET), torch.float32, "cpu") == "dense"
    with pytest.raises(SpecbusError, match="weights gguf needs GGUF blocks") as error:
        resolve_weights("gguf", str(TINY_TARGET), torch.float32, "cpu")
    assert error.value.field == "weights"
    with pytest.raises(SpecbusError, match="is not one of") as error:
        resolve_weights("int3", str(TINY_TARGET), torch.float32, "cpu")
    assert error.value.field == "weights"


@pytest.mark.real_model
def test_the_default_target_from_its_blocks_is_the_float32_model(kernel, smollm2_target):
    path = smollm2_target
    blocks = read_blocks(path)
    assert {w.kind for w in blocks.values()} == {"q4_1", "q8_0"}
    with pytest.raises(SpecbusError, match="dtype float32") as error:
        resolve_weights("gguf", str(path), torch.bfloat16, "cpu")
    assert error.value.field == "weights"
    # weights auto: the float32 model of the blocks under dtype float32, integer dot products under auto
    assert resolve_weights("auto", str(path), torch.float32, "cpu", "float32") == "gguf"
    assert resolve_weights("auto", str(path), torch.float32, "cpu", "auto") == "int8dot"
    with pytest.raises(SpecbusError, match="weights int8dot needs GGUF blocks") as error:
        resolve_weights("int8dot", str(TINY_TARGET), torch.float32, "cpu")
    assert error.value.field == "weights"
    assert resolve_weights("auto", str(path), torch.bfloat16, "cpu") == "dense"
    # dtype auto serves the published blocks wherever the kernel runs, whatever the CPU's bf16
    assert resolve_dtype("auto", "cpu", str(path)) == torch.float32
    dense, config = load_model(path, max_seq_len=256)
    served, _ = load_model(path, max_seq_len=256, weights_format="gguf")
    assert isinstance(served.layers[0].wqkv, QuantizedWeight) and isinstance(served.lm_head, QuantizedWeight)
    assert torch.equal(dequantize(blocks["model.embed_tokens.weight"]), dense.embed)
    ids = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    num_new = torch.tensor([24, 17, 1])
    logits = []
    for model in (dense, served):
        cache = KVCache(read_config(path), 3, 256, "cpu", torch.float32)
        slots = torch.tensor([cache.allocate() for _ in range(3)])
        logits.append(forward(model, cache, slots, ids, num_new))
    for row, n in enumerate(num_new.tolist()):
        assert torch.equal(logits[0][row, :n], logits[1][row, :n]), f"row {row}"


def test_quantize_q8_0_is_ggufs_own_and_moves_a_weight_by_about_half_a_step():
    w = torch.randn(6, 96, generator=torch.Generator().manual_seed(0))
    q = quantize_q8_0(w)
    assert q.kind == "q8_0" and q.shape == (6, 96)
    assert np.array_equal(q.blocks.numpy(), quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    step = w.view(6, 3, 32).abs().amax(-1, keepdim=True) / 127
    # half a step, plus q (<= 127) times the fp16 scale's rounding (2^-11 of it)
    assert ((dequantize(q) - w).view(6, 3, 32).abs() <= step * (0.5 + 127 * 2 ** -11)).all()


def test_int8_weights_are_the_float32_model_of_their_blocks_row_for_row(kernel):
    """weights int8: projections and the tied lm_head quantized at load, served from the blocks;
    a row's logits are bit for bit the float32 model whose weights are those blocks dequantized,
    at any batch, and top-1 agrees with the unquantized model on the tiny target."""
    dense, config = load_model(TINY_TARGET)
    served, _ = load_model(TINY_TARGET, weights_format="int8")
    assert isinstance(served.layers[0].w_gate_up, QuantizedWeight) and isinstance(served.lm_head, QuantizedWeight)
    as_float = dataclasses.replace(served, lm_head=pack_weight(dequantize(served.lm_head)), layers=[
        dataclasses.replace(layer, **{name: pack_weight(dequantize(getattr(layer, name)))
                                      for name in ("wqkv", "wo", "w_gate_up", "w_down")}) for layer in served.layers])
    ids = torch.randint(0, config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    num_new = torch.tensor([24, 17, 1])
    logits = []
    for model in (dense, served, as_float):
        cache = KVCache(config, 3, 64, "cpu", torch.float32)
        slots = torch.tensor([cache.allocate() for _ in range(3)])
        logits.append(forward(model, cache, slots, ids, num_new))
    for row, n in enumerate(num_new.tolist()):
        assert torch.equal(logits[1][row, :n], logits[2][row, :n]), f"row {row}"
        assert (logits[1][row, :n].argmax(-1) == logits[0][row, :n].argmax(-1)).float().mean() >= 0.9
    alone = KVCache(config, 1, 64, "cpu", torch.float32)
    one = forward(served, alone, torch.tensor([alone.allocate()]), ids[2:3, :1], torch.tensor([1]))
    assert torch.equal(one[0, 0], logits[1][2, 0])


def test_int8_weights_need_float32_and_dtype_auto_picks_it(kernel):
    assert resolve_weights("int8", str(TINY_TARGET), torch.float32, "cpu") == "int8"
    assert resolve_dtype("auto", "cpu", None, "int8") == torch.float32
    with pytest.raises(SpecbusError, match="weights int8 needs dtype float32") as error:
        resolve_weights("int8", str(TINY_TARGET), torch.bfloat16, "cpu")
    assert error.value.field == "weights"


INT_ISAS = ["scalar", "avx2", "vnni"]


@pytest.fixture(params=INT_ISAS)
def int_isa(request, kernel):
    """int_linear on each instruction set this CPU runs (the scalar reference, AVX2, AVX512-VNNI)."""
    if kernel.use_int_isa(request.param) != request.param:
        kernel.use_int_isa("best")
        pytest.skip(f"no {request.param} on this CPU")
    yield request.param
    kernel.use_int_isa("best")


def integer_reference(x: torch.Tensor, w: QuantizedWeight, b: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """int_linear's operations in torch (int_kernel.cpp): x's rows as int8 blocks, exact integer
    dot products, then each block's float32 scales and the blocks summed in order."""
    rows, inner = w.shape
    blocks = w.blocks.view(rows, inner // 32, BLOCK_BYTES[w.kind])
    dw = blocks[..., :2].contiguous().view(torch.float16).float()[..., 0]  # (N, C)
    if w.kind == "q4_1":
        mw = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        nibbles = blocks[..., 4:].to(torch.int64)
        qw = torch.cat([nibbles & 0x0F, nibbles >> 4], -1)
    else:
        qw = blocks[..., 2:].contiguous().view(torch.int8).to(torch.int64)
    xb = x.view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1)
    dx = amax / 127
    qx = torch.round(xb * torch.where(amax > 0, 127 / amax, 0)[..., None])  # half to even
    dxs = dx * qx.sum(-1)
    dots = torch.einsum("mck,nck->mnc", qx.to(torch.int64), qw).float()
    s = (dw[None] * dx[:, None]) * dots
    if w.kind == "q4_1":
        s = s + mw[None] * dxs[:, None]
    acc = torch.zeros(x.shape[0], rows)
    for c in range(s.shape[-1]):
        acc = acc + s[..., c]
    return residual + (acc + b)


@pytest.mark.parametrize("kind", KINDS)
def test_int_linear_is_its_integer_arithmetic_bit_for_bit_on_every_isa(kernel, int_isa, kind):
    """Every ISA computes the documented operations exactly (so all give the same bits), for rows
    of w not a multiple of the 16-row groups, and is near the float32 product of the dequantized
    weight (activations rounded to int8 steps of max|x| / 127)."""
    w = random_weight(kind, 67, 96, seed=3)
    g = torch.Generator().manual_seed(1)
    x, b, residual = torch.randn(13, 96, generator=g), torch.randn(67, generator=g), torch.randn(13, 67, generator=g)
    x[2, :32] = 0  # a block of zeros: its scale 0, its dot products 0
    packed = to_int(w)
    assert packed.shape == w.shape
    got = int_linear(x, packed, b, residual)
    assert torch.equal(got, integer_reference(x, w, b, residual))
    exact = residual + x.double() @ dequantize(w).double().T + b
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_int_linear_gives_a_row_the_same_bits_at_every_row_count_and_thread_count(kernel):
    """Rows 1..64 (a decode step, a verify, a tree, a prefill chunk), alone or beside others, on one
    thread or two: a row's outputs never change."""
    w = to_int(random_weight("q4_1", 40, 64, seed=4))
    g = torch.Generator().manual_seed(2)
    x, b = torch.randn(64, 64, generator=g), torch.randn(40, generator=g)
    full = int_linear(x, w, b)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in range(1, 65):
                start = (rows * 7) % (65 - rows)
                assert torch.equal(int_linear(x[start:start + rows], w, b), full[start:start + rows]), (count, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", KINDS)
def test_int_linear_passes_of_rows_give_each_row_its_own_bits_on_every_isa(kernel, int_isa, kind):
    """The kernel takes rows of x in passes (8 at a time on VNNI, the first pass of several
    prefetching, then the rest; 4 at a time on AVX2): at every row count 1..64 and offset a row's
    outputs are the documented arithmetic's, for rows of w not a multiple of the 16-row groups."""
    w = random_weight(kind, 40, 96, seed=5)
    g = torch.Generator().manual_seed(6)
    x, b, residual = torch.randn(64, 96, generator=g), torch.randn(40, generator=g), torch.randn(64, 40, generator=g)
    want = integer_reference(x, w, b, residual)
    packed = to_int(w)
    for rows in range(1, 65):
        start = (rows * 5) % (65 - rows)
        got = int_linear(x[start:start + rows], packed, b, residual[start:start + rows])
        assert torch.equal(got, want[start:start + rows]), (int_isa, rows)


@pytest.mark.parametrize("kind", KINDS)
def test_int_linear_quantizes_edge_blocks_alike_on_every_isa(kernel, kind):
    """Activation blocks of zeros, of subnormals (127 / max|x| overflows: q = 0), of huge values,
    and with an inf or a NaN (that row's outputs NaN, no other row's): the same bits on every ISA
    (the vector quantization against the scalar reference)."""
    w = to_int(random_weight(kind, 20, 96, seed=7))
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(8))
    x[1, :32] = 0
    x[2, 32:64] = 1e-42
    x[3] = x[3] * 1e30
    x[4, 40] = float("inf")
    x[5, 70] = float("nan")
    x[6, 3] = 1e-30
    results = {}
    for isa in INT_ISAS:
        if kernel.use_int_isa(isa) == isa:
            results[isa] = int_linear(x, w)
    kernel.use_int_isa("best")
    assert results["scalar"][[4, 5]].isnan().all()
    finite = [0, 1, 2, 3, 6]
    assert results["scalar"][finite].isfinite().all()
    for isa, got in results.items():
        assert torch.equal(got[finite], results["scalar"][finite]), isa
        assert got[[4, 5]].isnan().all(), isa


def test_int_linear_refuses_a_bad_shape(kernel):
    w = to_int(random_weight("q8_0", 20, 64))
    with pytest.raises(RuntimeError, match="packed blocks of 32 weights along K = 96"):
        int_linear(torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match="residual"):
        int_linear(torch.randn(2, 64), w, None, torch.randn(3, 20))
