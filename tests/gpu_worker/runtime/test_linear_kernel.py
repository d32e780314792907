"""The fixed-order CPU projection kernel (gpu_worker/runtime/linear_kernel.py): right, and a row's bits
independent of the rows around it and of the thread count."""

import threading
import time

import pytest
import torch

from gpu_worker.runtime import linear_kernel
from gpu_worker.runtime.model import MASKED, amx_rows, linear, pack_weight, rms_norm, rope

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernel():
    module = linear_kernel.load()
    # both CPU kinds this project runs on have AVX2: there the kernel must build, not fall back quietly
    assert module is not None or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512")
    if module is None:
        pytest.skip("no AVX2 on this CPU: model.linear uses oneDNN / BLAS")
    return module


def operands(dtype, M=13, N=10, K=37, seed=0):
    """Shapes off the kernel's blocks: N a multiple of none of its block heights (2, 3, 4, 6, 8),
    K not of 8, M above the one-pass rows (12) and not a multiple of 3."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in ((M, K), (N, K), (N,), (M, N))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_kernel_computes_residual_plus_x_w_transposed_plus_b(kernel, dtype):
    x, w, b, residual = operands(dtype)
    exact = residual.double() + x.double() @ w.double().T + b.double()
    got = kernel.fixed_linear(x, w, b, residual)
    assert got.dtype == dtype and got.shape == exact.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact, atol=tolerance * 10, rtol=tolerance)
    torch.testing.assert_close(kernel.fixed_linear(x, w, None, None).double(), x.double() @ w.double().T,
                               atol=tolerance * 10, rtol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [37, 576])
def test_a_rows_bits_do_not_depend_on_the_rows_around_it_or_the_threads(kernel, dtype, K):
    x, w, b, residual = operands(dtype, M=13, N=67, K=K)
    full = kernel.fixed_linear(x, w, b, residual)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start in range(13):
                for stop in range(start + 1, 14):
                    part = kernel.fixed_linear(x[start:stop], w, b, residual[start:stop])
                    assert torch.equal(part, full[start:stop]), (count, start, stop)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_linear_on_paired_rows_gives_the_bits_of_plain_rows_at_every_row_count(kernel, dtype):
    # N = 70: after the blocks of 8, 6 and 4 rows a tail of whole pairs is left
    x, w, b, residual = operands(dtype, M=13, N=70, K=576)
    paired = pack_weight(w)
    assert paired.shape == (35, 72, 2, 8) and torch.equal(paired[3, 5, 1], w[7, 40:48])
    for m in range(1, 14):
        assert torch.equal(linear(x[:m], paired, b, residual[:m]), kernel.fixed_linear(x[:m], w, b, residual[:m])), m


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx512_code_gives_the_avx2_codes_bits_at_every_row_count(kernel, dtype):
    # where the CPU has AVX-512F, two or more rows of x run there (two rows of w a register)
    if not kernel.use_avx512(True):
        pytest.skip("no AVX-512F on this CPU: its AVX2 code is the one that runs")
    try:
        for N, K in ((70, 576), (67, 37)):  # paired rows with a tail of pairs; unpaired, odd, K % 8 != 0
            x, w, b, residual = operands(dtype, M=40, N=N, K=K)
            for weight in (pack_weight(w), w):
                kernel.use_avx512(False)
                reference = linear(x, weight, b, residual)
                kernel.use_avx512(True)
                for m in list(range(1, 20)) + [24, 40]:
                    assert torch.equal(linear(x[:m], weight, b, residual[:m]), reference[:m]), (N, weight.dim(), m)
    finally:
        kernel.use_avx512(True)


def test_weights_are_paired_only_where_the_shape_allows_and_not_when_shared(kernel):
    assert pack_weight(torch.randn(12, 64)).shape == (6, 8, 2, 8)
    for plain in (pack_weight(torch.randn(12, 64), shared=True), pack_weight(torch.randn(11, 64)),
                  pack_weight(torch.randn(12, 60))):
        assert plain.dim() == 2 and not plain.is_mkldnn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_turned_off_the_projections_go_to_onednn_and_stay_row_invariant(monkeypatch, dtype):
    # 48 rows of a 576-wide layer: oneDNN's bfloat16 GEMM on an AMX CPU would give rows 8, 16,
    # 31 and 32 other bits than a larger call does (its float32 one, which serves both, does not)
    monkeypatch.setenv("SPECBUS_LINEAR_KERNEL", "0")
    linear_kernel.load.cache_clear()
    try:
        assert linear_kernel.load() is None
        x, w, b, residual = operands(dtype, M=48, N=1536, K=576)
        packed = pack_weight(w)
        full = linear(x, packed, b, residual)
        assert full.dtype == dtype
        expected = (residual.float() + x.float() @ w.float().T + b.float()).to(dtype)
        torch.testing.assert_close(full, expected, atol=1e-3 if dtype == torch.float32 else 0.25, rtol=1e-2)
        assert all(torch.equal(linear(x[:m], packed, b, residual[:m]), full[:m]) for m in range(1, 49))
    finally:
        linear_kernel.load.cache_clear()


def test_the_kernel_lets_other_threads_run_meanwhile(kernel):
    # a service's event loop (its heartbeats, its bus) runs beside a forward in a worker thread
    x, w = torch.randn(300, 576), torch.randn(16384, 576)
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.01)
    start = time.perf_counter()
    kernel.fixed_linear(x, w, None, None)
    end = time.perf_counter()
    done.set()
    ticker.join()
    assert sum(start < t < end for t in ticks) >= 10, f"no other thread ran during a {end - start:.3f} s call"


def test_amx_rows_lays_each_block_of_16_rows_out_as_tiles_in_k_order():
    w = torch.arange(32 * 64).reshape(32, 64)
    tiles = amx_rows(w)
    assert tiles.shape == (2, 2, 16, 32)
    # tile (block 1, chunk 1), row p = 3: values k = 32 + 6 and 32 + 7 of each of rows 16..31 side by side
    assert torch.equal(tiles[1, 1, 3].view(16, 2), w[16:32, 38:40])


@pytest.fixture
def amx(kernel):
    if not kernel.amx():
        pytest.skip("no AMX here (or SPECBUS_AMX=0): bfloat16 weights take the AVX code")
    return kernel


@pytest.mark.parametrize("N, K", [(80, 576), (48, 64)])  # 5 blocks: a pass of 3 and one of 2; one pass
def test_bfloat16_weights_in_amx_tiles_give_a_row_the_same_bits_at_every_row_and_thread_count(amx, N, K):
    x, w, b, residual = operands(torch.bfloat16, M=40, N=N, K=K)  # 40 rows: tiles of 16, 16 and 8
    tiles = pack_weight(w)
    assert tiles.shape == (N // 16, K // 32, 16, 32)
    full = linear(x, tiles, b, residual)
    exact = residual.double() + x.double() @ w.double().T + b.double()
    torch.testing.assert_close(full.double(), exact, atol=0.2, rtol=2e-2)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start in range(0, 40, 3):
                for stop in list(range(start + 1, start + 18)) + [40]:
                    if stop <= 40:
                        assert torch.equal(linear(x[start:stop], tiles, b, residual[start:stop]), full[start:stop]), \
                            (count, start, stop)
    finally:
        torch.set_num_threads(threads)
    # a tied lm_head gets tiles too (a copy), with the same bits
    assert torch.equal(linear(x, pack_weight(w, shared=True), b, residual), full)


def test_weights_in_amx_tiles_are_refused_where_amx_is_off(kernel):
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    was_on = kernel.amx()
    kernel.use_amx(False)
    try:
        assert pack_weight(w).shape == (16, 8, 2, 8)  # the AVX code's paired rows
        with pytest.raises(RuntimeError, match="AMX"):
            kernel.fixed_linear(x, amx_rows(w), None, None)
    finally:
        kernel.use_amx(was_on)


def test_specbus_amx_0_keeps_bfloat16_weights_on_the_avx_code(kernel, monkeypatch):
    monkeypatch.setenv("SPECBUS_AMX", "0")
    linear_kernel.load.cache_clear()
    try:
        assert not linear_kernel.load().amx()
    finally:
        monkeypatch.delenv("SPECBUS_AMX")
        linear_kernel.load.cache_clear()
        linear_kernel.load()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("E", [576, 37])
def test_rms_norm_is_llamas_and_a_rows_bits_do_not_depend_on_the_rows_or_threads(kernel, dtype, E):
    """Llama's RMSNorm (float32 statistics, x * rstd rounded to the dtype, then the weight), each
    row in one fixed order: the same bits for a row in every sub-batch of 70 rows (past the 64
    from which rows are split between threads), at 1 and 2 threads."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(70, E, generator=g).to(dtype), (torch.rand(E, generator=g) + 0.5).to(dtype)
    full = rms_norm(x, w, 1e-5)
    xf = x.float()
    llama = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * w
    torch.testing.assert_close(full, llama, atol=0, rtol=1e-6 if dtype == torch.float32 else 8e-3)
    assert torch.equal(rms_norm(x.view(7, 10, E), w, 1e-5), full.view(7, 10, E))
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for start in range(0, 70, 3):
                for stop in (start + 1, start + 2, start + 13, 70):
                    assert torch.equal(rms_norm(x[start:stop], w, 1e-5), full[start:stop]), (count, start, stop)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_the_kernel_gives_the_bits_of_the_torch_ops_it_replaces(kernel, dtype):
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 5, 7, 64, generator=g).to(dtype)              # (B, T, H + 2 Hkv, D)
    cos, sin = (torch.randn(3, 5, 1, 64, generator=g).to(dtype) for _ in range(2))
    x = qkv[:, :, :5]
    assert torch.equal(rope(qkv, cos, sin, 5), x * cos + x.roll(32, -1) * sin)


def attention_reference(q, k, v, mask, scale):
    """float64 softmax(q k^T * scale + mask) v and log-sum-exp."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale + mask.double()
    lse = scores.logsumexp(-1)
    return (scores - lse.unsqueeze(-1)).exp() @ v.double(), lse


def unit_blocks(kernel, q, k, v, mask, scale):
    """kernel.unit_blocks with each (a, h) of q (A, H, L, D), k, v (A, H, S, D), mask (A, H, L, S)
    a unit of one key block: (out (A, H, L, D), lse (A, H, L))."""
    A, H, L, D = q.shape
    S = k.shape[2]
    out, lse = kernel.unit_blocks(q.reshape(A * H * L, 1, D), k.reshape(A * H, 1, S, D), v.reshape(A * H, 1, S, D),
                                  mask.reshape(A * H, 1, L, S), torch.arange(A * H * L).view(A * H, L), scale)
    return out.view(A, H, L, D), lse.view(A, H, L)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("L", [4, 9])
def test_unit_blocks_is_softmax_attention_and_a_rows_bits_are_its_own(kernel, dtype, L):
    """Each row against its block of keys, in one fixed order: right against float64, and a
    row's bits the same in any sub-batch, alone, and at 1 or 2 threads; a row that may see no key
    gets the mean of the values (and lse near MASKED: the block then weighs 0 in the combine).
    L = 9: three tiles of rows, bfloat16 values widened once for all of them."""
    g = torch.Generator().manual_seed(3)
    A, H, S, D = 3, 2, 256, 64
    q, k, v = (torch.randn(A, H, n, D, generator=g).to(dtype) for n in (L, S, S))
    mask = torch.zeros(A, H, L, S)
    mask[..., 129:] = MASKED                                   # whole groups of 8 keys and a part of one
    mask[1, :, :, 50:60] = MASKED
    mask[0, 0, 1] = MASKED                                     # a row that sees nothing
    out, lse = unit_blocks(kernel, q, k, v, mask, D ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    want, want_lse = attention_reference(q, k, v, mask, D ** -0.5)
    seen = torch.ones(A, H, L, dtype=torch.bool)
    seen[0, 0, 1] = False
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double()[seen], want[seen], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(lse.double()[seen], want_lse[seen], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0, 1].double(), v[0, 0].double().mean(0), atol=tolerance, rtol=tolerance)
    assert lse[0, 0, 1] < MASKED / 2
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            part = unit_blocks(kernel, q[1:], k[1:], v[1:], mask[1:], D ** -0.5)
            assert torch.equal(part[0], out[1:]) and torch.equal(part[1], lse[1:])
            for r in range(L):
                one = unit_blocks(kernel, q[:, :, r:r + 1], k, v, mask[:, :, r:r + 1], D ** -0.5)
                assert torch.equal(one[0], out[:, :, r:r + 1]) and torch.equal(one[1], lse[:, :, r:r + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_unit_blocks_on_avx512_gives_the_avx2_codes_bits(kernel, dtype):
    """Where the CPU has AVX-512F, attention's block kernel runs there (keys in pairs a register,
    16 lanes of values): the AVX2 code's bits, for head sizes with 16-lane chunks and 8-lane
    tails, one to three tiles of rows, and masks that hide groups of keys from some rows only."""
    if not kernel.use_avx512(True):
        pytest.skip("no AVX-512F on this CPU: its AVX2 code is the one that runs")
    g = torch.Generator().manual_seed(7)
    try:
        for D, S, L in ((64, 256, 4), (64, 256, 9), (24, 64, 3), (8, 64, 5), (128, 128, 1)):
            q, k, v = (torch.randn(2, 3, n, D, generator=g).to(dtype) for n in (L, S, S))
            mask = torch.zeros(2, 3, L, S)
            mask.masked_fill_(torch.arange(S) > torch.randint(0, S, (2, 3, L, 1), generator=g), MASKED)
            mask[0, 1, 0, :40] = MASKED
            kernel.use_avx512(False)
            want = unit_blocks(kernel, q, k, v, mask, D ** -0.5)
            kernel.use_avx512(True)
            got = unit_blocks(kernel, q, k, v, mask, D ** -0.5)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (D, S, L)
    finally:
        kernel.use_avx512(True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_combine_units_is_attention_over_all_blocks_and_ignores_blocks_past_a_row(kernel, dtype):
    """unit_blocks over 3 key blocks then combine_units: softmax attention over all the keys
    (float64 reference); a row that sees only block 0 has the bits of a one-block call, and more
    blocks it cannot see (a wider window) change no row; padding rows (unit_out -1) write nothing."""
    g = torch.Generator().manual_seed(5)
    B, Hkv, M, KB, D, nb = 2, 3, 8, 256, 64, 3
    q = torch.randn(B * M, Hkv, D, generator=g).to(dtype)               # unit (b, h)'s row m: q[b*M + m, h]
    k, v = (torch.randn(B, Hkv, (nb + 2) * KB, D, generator=g).to(dtype) for _ in range(2))
    ends = torch.tensor([[700, 300, 100, 20, 600, 256, 257, 1], [5, 768, 512, 511, 400, 100, 30, 9]])
    keys = torch.arange((nb + 2) * KB).view(1, nb + 2, 1, KB)
    wide = torch.zeros(B, nb + 2, M, KB).masked_fill_(keys >= ends.view(B, 1, M, 1), MASKED)
    unit_q = (torch.arange(B).view(B, 1, 1) * M + torch.arange(M).view(1, 1, M)) * Hkv + torch.arange(Hkv).view(1, Hkv, 1)
    unit_q = unit_q.view(B * Hkv, M)                                    # unit (b, h), row m: q row (b*M + m)*Hkv + h

    def attend(blocks, unit_out):
        out, lse = kernel.unit_blocks(q, k, v, wide[:, :blocks].contiguous(), unit_q, D ** -0.5)
        return kernel.combine_units(out, lse, unit_out, B * M * Hkv)

    got = attend(nb, unit_q)                                            # (B*M*Hkv, D): row (b, m, h)
    for b in range(B):
        for m in range(M):
            n = int(ends[b, m])
            want, _ = attention_reference(q[b * M + m].unsqueeze(1), k[b, :, :n], v[b, :, :n], torch.zeros(Hkv, 1, n),
                                          D ** -0.5)
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.view(B, M, Hkv, D)[b, m].double(), want.squeeze(1), atol=tolerance,
                                       rtol=tolerance)
    assert torch.equal(attend(nb + 2, unit_q), got)                     # two more masked blocks: the same bits
    short = ends <= KB                                                  # rows inside block 0
    one = attend(1, unit_q).view(B, M, Hkv, D)
    assert torch.equal(one[short], got.view(B, M, Hkv, D)[short])
    padded = torch.where(torch.arange(M) < M - 2, unit_q, -1)           # the last two rows padding
    part = attend(nb, padded).view(B, M, Hkv, D)
    assert torch.equal(part[:, :M - 2], got.view(B, M, Hkv, D)[:, :M - 2])


def test_kv_write_copies_a_rows_keys_and_values_into_its_columns(kernel):
    keys, values = torch.zeros(3, 10, 8), torch.zeros(3, 10, 8)
    k, v = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    kernel.kv_write(keys, values, k, v, torch.tensor([4, 9]))
    assert torch.equal(keys[:, [4, 9]], k.transpose(0, 1)) and torch.equal(values[:, [4, 9]], v.transpose(0, 1))
    assert not keys[:, :4].any() and not values[:, 5:9].any()
    with pytest.raises(RuntimeError, match="outside"):
        kernel.kv_write(keys, values, k, v, torch.tensor([4, 10]))
