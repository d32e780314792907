"""The CPU projection kernel: x @ W^T (+ b, + residual) with one fixed order of operations per
output, whatever the number of rows (linear_kernel.cpp says the order), compiled on first use.

Why our own: a row's bits must not depend on how many rows share the call (a decode step's one
row, a verify step's k+1, a prefill chunk's hundreds), and no CPU library promises that: MKL
picks its kernel and split by the row count, oneDNN's packed GEMM is row-invariant where it
serves the dtype but costs more than a GEMV at one row with the weights cold (as in a forward;
figures: ops/bench/RESULTS.md, "Figures behind gpu_worker's choices"), and emulates bfloat16 slowly without AVX512-BF16. This kernel streams each weight row
from memory once for up to 12 rows of x, prefetching the next block while it multiplies, so a
one-row step costs what a GEMV does and a verify step of k+1 rows little more; `model.pack_weight`
stores weights with rows paired (`model.pair_rows`) so that a block is a few sequential streams. It needs AVX2 and FMA (both CPU kinds this project runs on have them, and the same code,
hence the same bits, runs on both); elsewhere `load` returns None and `model.linear` keeps
oneDNN (gpu_worker/runtime/kernel_paths.py decides each op's path). A GPU needs its own batch-invariant matmul instead (fixed tiles, no split-K chosen by
shape).

`quant_linear(x, blocks, kind, b, residual)` does the same for a weight held as GGUF blocks
(gpu_worker/runtime/quantized.py): each block is widened in registers exactly as gguf dequantizes
it and multiplied by x's rows in the float32 path's order: directly for up to 12 rows of x (one
or two groups of rows), through a float32 tile of the thread's for more. Where the CPU has
AVX-512F (`use_avx512`) two rows of w share a 512-bit register with the same lane chains, so the
bits are the AVX2 code's: for GGUF blocks at every row count, for dense weights from two rows of x
on (a verify, a tree, a batch, a prefill: twice the multiply-adds an instruction and twice the
accumulators; one row stays on the AVX2 code, which is bound by memory there). Threads take rows
of w in small ranges as they free up (`shared_for`).

`int_linear(x, packed, kind, N, b, residual)` (int_kernel.cpp, the same module) serves GGUF
blocks by integer dot products instead (weights `int8dot`, gpu_worker/runtime/quantized.py): x's
rows quantized to int8 blocks of 32, exact int32 block sums (VPDPBUSD where the CPU has
AVX512-VNNI, else AVX2's VPMADDUBSW; `use_int_isa` forces one, or the scalar reference, for
tests: all give the same bits), float32 scales and sums in one fixed order per output.
SPECBUS_INT_ISA (best, vnni, avx2, scalar) picks the ISA at load. No AMX path: its int8 tiles
(TDPBUSD) would need the tile permission probe of the bfloat16 path and a test CPU.

The module also holds the decoder layer's other pieces that are cheaper as one call than as
several torch ops (each op costs microseconds of dispatch, a few hundred of them a forward):
`fixed_rms_norm(x, w, eps)`, Llama's RMSNorm with a row's sum of squares in one fixed order
(16 lanes, then a pairwise tree), `fixed_rope(qkv, cos, sin, heads)`, the rotate-half RoPE with
the bits of the torch ops it replaces, `kv_write`, a row's new keys and values copied into its
slot, and `model.attention`'s two calls a layer: `unit_blocks(q, k, v, mask, unit_q, scale)`, each
query row's softmax over each block of keys in a fixed order (scores by the projection's
dot-product order, exp by one polynomial on 8 lanes, the sums over keys in key order), so a row's
bits depend on neither its neighbours nor the threads (it skips work whose result is known
exactly: key groups the row may not see, keys whose weight is 0 for every row), and
`combine_units(out, lse, unit_out, n)`, a row's blocks combined by their log-sum-exps in a fixed
tree, written where the row goes (the query rows gathered and scattered in the kernel, not by
torch ops around it).
Outside the forward, `gumbel_candidates(probs, keys, token_ids, m)` hashes a vocabulary row's
Gumbel noise uniforms in one pass and keeps the m tokens that could win the Gumbel-max draw
(gpu_worker/sampling/coupling.py scores those and proves the rest out).

Built with torch's C++ extension loader (the compiler and headers that build torch extensions,
ninja from PyPI) into $SPECBUS_HOME/torch_extensions, under a name that carries the source's
hash, so checkouts of different versions never share a build. `make models` builds it ahead
(`python -m gpu_worker.runtime.linear_kernel`); otherwise the first process to load a model builds it
(about a minute; others wait on torch's lock) and later ones import it. SPECBUS_LINEAR_KERNEL=0
turns it off (oneDNN's float32 GEMM / BLAS then, still row-invariant: model.pack_weight).

bfloat16 weights on a CPU with AMX (`amx_bf16` and `amx_tile` in /proc/cpuinfo, and a Linux that
grants the tile state) go to AMX tiles instead: `model.pack_weight` lays them out as tiles
(`model.amx_rows`) and TDPBF16PS multiplies 16 rows of x by 16 rows of w by 32 values of k an
instruction, so a verify of 16 rows or a prefill chunk costs little more than the weights' bytes
(ops/bench/RESULTS.md). Each output still takes the same operations at every row and thread
count, but the hardware sums a tile's products its own way, not as the AVX chains do: bfloat16
bits on an AMX CPU are its own (docs/PROTOCOL.md, Bitwise guarantee). SPECBUS_AMX=0 keeps the AVX
code there, whose bits every CPU kind shares.
"""

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import structlog

from schemas.config import specbus_home

SOURCE = Path(__file__).with_name("linear_kernel.cpp")
# compiled with it into one module (int_kernel.cpp: GGUF blocks by integer dot products); the
# header is shared by both and hashed with them
SOURCES = [SOURCE, SOURCE.with_name("int_kernel.cpp")]
HEADERS = [SOURCE.with_name("shared_for.h")]
# -fopenmp: shared_for's `#pragma omp parallel` is dropped without it, and the kernel then runs
# on one thread whatever torch.set_num_threads says.
# -mf16c: fp16 scales widened by one instruction (every AVX2 CPU has F16C).
# -ffp-contract=off: a multiply and an add stay two roundings (GGUF weights are widened as
# gguf's float32 dequantization computes them); the dot products use explicit FMAs.
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
BUILD_TIMEOUT_S = 900.0  # a first build takes about a minute on 2 idle cores
log = structlog.get_logger(__name__)


def build_dir() -> Path:
    """Where this source, these flags and this Python and torch build to (nothing imported)."""
    text = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    digest = hashlib.sha256(text + " ".join(FLAGS).encode()).hexdigest()[:12]
    torch_version = importlib.metadata.version("torch")
    return specbus_home() / "torch_extensions" / f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch_version}" / digest


def module_name() -> str:
    return f"specbus_linear_{build_dir().name}"


def built() -> bool:
    """Whether the kernel is built for this checkout (cheap: torch is not imported)."""
    return (build_dir() / f"{module_name()}.so").exists()


def turned_off() -> bool:
    return os.environ.get("SPECBUS_LINEAR_KERNEL", "1") == "0"


def amx_wanted() -> bool:
    """SPECBUS_AMX: 0 keeps bfloat16 weights off AMX tiles."""
    return os.environ.get("SPECBUS_AMX", "1") != "0"


def int_isa_wanted() -> str:
    """SPECBUS_INT_ISA: int_linear's ISA (best, vnni, avx2, scalar)."""
    return os.environ.get("SPECBUS_INT_ISA", "best")


def import_built():
    """The built module imported as a file, or None where that fails (a build still being written).

    The build directory's name is the hash of this source and flags for this Python and torch, so
    a .so there is this kernel: importing it needs neither ninja nor the extension loader's lock,
    which every process starting at once (a stack, several checkouts) would otherwise queue on."""
    path = build_dir() / f"{module_name()}.so"
    try:
        spec = importlib.util.spec_from_file_location(module_name(), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except ImportError as error:
        log.info("linear_kernel_import_failed", path=str(path), reason=str(error)[:500])
        return None


@functools.cache
def load():
    """The compiled module (its `fixed_linear(x, w, b, residual)`), or None where it cannot run
    here: turned off, a CPU without AVX2/FMA, or a failed build (logged). SPECBUS_AMX=0 keeps
    bfloat16 weights off AMX tiles (`use_amx(False)`)."""
    import torch

    if turned_off():
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        log.warning("linear_kernel_unavailable", reason=f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
        return None
    module = import_built() if built() else None
    if module is None:
        module = build()
    if module is not None:
        module.use_amx(amx_wanted())
        module.use_int_isa(int_isa_wanted())
    return module


def build():
    """Compile the kernel into build_dir() and import it; None (logged) where the build fails."""
    from torch.utils import cpp_extension

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    # ninja from the virtualenv's bin, which is not on PATH when its python runs without activation
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        return cpp_extension.load(name=module_name(), sources=[str(path) for path in SOURCES], extra_cflags=FLAGS,
                                  extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    except Exception as error:  # no compiler, no headers: oneDNN serves instead
        log.warning("linear_kernel_unavailable", reason=f"build failed: {error}"[:2000])
        return None


if __name__ == "__main__":
    module = load()
    print(f"linear kernel: {'built in ' + str(build_dir()) if module else 'not used (oneDNN / BLAS)'}")
    sys.exit(0)
