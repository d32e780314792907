"""Which path each op of the forward runs on this machine: the one place that decides, and the
report `specbus up`, `specbus models list` and the verifier's log print.

Op families and their paths (our kernel is gpu_worker/runtime/linear_kernel.py's module: it runs
on a CPU with AVX2 and FMA, for float32 and bfloat16, unless SPECBUS_LINEAR_KERNEL=0 or its build
failed):

| family | our kernel | fallback |
|---|---|---|
| projection, dense | `fixed_linear` (AVX-512 from two rows of x where the CPU has AVX-512F, AVX2 at one row); bfloat16 weights on AMX tiles (`amx_tiles`) where the kernel runs them | oneDNN's packed float32 GEMM on the CPU, else torch's matmul |
| projection, GGUF blocks (weights gguf, int8) | `quant_linear`: each block widened to float32 in registers as gguf dequantizes it (the dequantization), then fixed_linear's order | none: the weights need the kernel (float32 on the CPU) |
| projection, integer (weights int8dot) | `int_linear` on the ISA `use_int_isa` picks (SPECBUS_INT_ISA: vnni, avx2, scalar; the same bits on each) | none |
| norms | `fixed_rms_norm` | torch's rms_norm |
| RoPE | `fixed_rope` | three torch ops (the same bits) |
| attention | `unit_blocks` and `combine_units` (head_dim a multiple of ATTENTION_HEAD_MULTIPLE) | torch's CPU flash kernel, else plain ops |
| KV write | `kv_write` | two index_put_ |
| Gumbel candidates | `gumbel_candidates` (float32 probabilities) | every token scored by torch ops |

model.py, kv_cache.py, quantized.py and sampling/coupling.py ask the functions here at each call
(`fixed_kernel`, `attention_kernel`, `amx_tiles`, `blocks_serve`, `candidates_kernel`), and
`op_paths` states the same rules for a report. A `Machine` says what the rules read: `loaded()`
asks the loaded kernel (torch imported; what the verifier logs), `predicted()` reads
/proc/cpuinfo, the SPECBUS_* settings and whether the kernel is built, without importing torch
(`specbus models list`, which must stay torch-free, prints that; the AMX tile permission Linux
grants at load is then assumed).

`python -m services.verifier.verifier kernel-paths` prints the loaded report for a verifier's
settings (gpu_worker/batching/slots.py `kernel_report`); `specbus up` runs it beside its start and
prints its lines once the stack is ready.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

from gpu_worker.runtime import linear_kernel

KERNEL_DTYPES = ("float32", "bfloat16")  # what our kernel's ops are compiled for
ATTENTION_HEAD_MULTIPLE = 8  # unit_blocks' lanes: head_dim a multiple of it
AMX_TILE = (16, 32)  # AMX tiles hold 16 rows of w by 32 values of k: a weight's shape a multiple of it
BLOCK_FORMATS = ("gguf", "int8", "int8dot")  # weights held as GGUF blocks (quantized.py)


@dataclass(frozen=True)
class Machine:
    """What the choice of paths reads: the CPU, whether our kernel runs and its settings."""
    isa: str              # the widest vector ISA the CPU offers: AVX512, AVX2 or below
    kernel: str           # loaded / built / not built / off (SPECBUS_LINEAR_KERNEL=0) / unavailable (why)
    kernel_runs: bool     # whether our kernel serves (predicted: it will once built)
    avx512: bool          # the kernel's AVX-512 code (AVX-512F)
    amx: bool             # bfloat16 weights on AMX tiles
    int_isa: str          # int_linear's ISA
    onednn: bool          # torch's oneDNN, the projections' fallback on the CPU
    source: str           # "loaded" (asked of the loaded kernel) or "predicted" (/proc/cpuinfo, settings)


@dataclass(frozen=True)
class OpPath:
    family: str
    path: str
    kernel: bool  # our kernel serves it (else a fallback)


@dataclass(frozen=True)
class KernelReport:
    machine: Machine
    device: str
    dtype: str
    weights: str
    ops: tuple[OpPath, ...]

    def lines(self) -> list[str]:
        m = self.machine
        head = (f"kernel paths ({m.source}): ISA {m.isa}, AMX {'on' if m.amx else 'off'}, kernel {m.kernel}, "
                f"int ISA {m.int_isa}; device {self.device}, dtype {self.dtype}, weights {self.weights}")
        return [head] + [f"  {op.family:<22} {'kernel  ' if op.kernel else 'fallback'} {op.path}" for op in self.ops]

    def as_dict(self) -> dict:
        return {"machine": asdict(self.machine), "device": self.device, "dtype": self.dtype, "weights": self.weights,
                "ops": {op.family: {"path": op.path, "kernel": op.kernel} for op in self.ops}}


# ---------------------------------------------------------------------------------------------
# the rules, as the forward asks them (tensors) and as a report states them (names)


def serves(device: str, dtype: str, kernel_runs: bool) -> bool:
    """Whether our kernel serves tensors of this device type and dtype name."""
    return kernel_runs and device == "cpu" and dtype in KERNEL_DTYPES


def blocks_serve(device: str, dtype: str, kernel_runs: bool) -> bool:
    """Whether weights held as GGUF blocks serve a model of this dtype name on this device."""
    return dtype == "float32" and serves(device, dtype, kernel_runs)


@functools.cache
def _kernel_dtype(device: str, dtype) -> bool:
    return device == "cpu" and str(dtype).removeprefix("torch.") in KERNEL_DTYPES


def fixed_kernel(t):
    """Our kernel's module (`linear_kernel.load`) where it serves tensor t's device and dtype,
    else None: projections, norms, RoPE and the KV write ask this."""
    return linear_kernel.load() if _kernel_dtype(t.device.type, t.dtype) else None


def attention_kernel(t, head_dim: int):
    """The module whose `unit_blocks` and `combine_units` serve attention over t with heads of
    head_dim, else None (torch's flash kernel on the CPU, plain ops elsewhere)."""
    return fixed_kernel(t) if head_dim % ATTENTION_HEAD_MULTIPLE == 0 else None


def amx_tiles(kernel, w) -> bool:
    """Whether weight w (out, in) goes to AMX tiles: bfloat16, the kernel running them, its
    shape a multiple of AMX_TILE."""
    return (str(w.dtype) == "torch.bfloat16" and kernel.amx()
            and w.shape[0] % AMX_TILE[0] == 0 and w.shape[1] % AMX_TILE[1] == 0)


def candidates_kernel(rows, candidates: int):
    """The module whose `gumbel_candidates` serves probability rows (R, N), else None (every
    token scored): float32 rows with more tokens than candidates."""
    return fixed_kernel(rows) if str(rows.dtype) == "torch.float32" and rows.shape[-1] > candidates else None


def projection_path(m: Machine, device: str, dtype: str, weights: str) -> OpPath:
    """How a projection runs for this weights format (dense, gguf, int8, int8dot)."""
    if weights in BLOCK_FORMATS:
        if not blocks_serve(device, dtype, m.kernel_runs):
            return OpPath("projection", f"unavailable: weights {weights} need float32 on a CPU with our kernel", False)
        if weights == "int8dot":
            return OpPath("projection", f"int_linear, int8 dot products on {m.int_isa}", True)
        held = "GGUF blocks" if weights == "gguf" else "Q8_0 blocks quantized at load"
        return OpPath("projection", f"quant_linear over {held} ({'AVX-512' if m.avx512 else 'AVX2'})", True)
    if serves(device, dtype, m.kernel_runs):
        simd = "AVX-512 from two rows, AVX2 at one" if m.avx512 else "AVX2"
        tiles = "AMX tiles where the shape allows, else " if dtype == "bfloat16" and m.amx else ""
        return OpPath("projection", f"fixed_linear, {tiles}{simd}", True)
    if device == "cpu" and m.onednn:
        return OpPath("projection", "oneDNN packed float32 GEMM", False)
    return OpPath("projection", "torch matmul", False)


def op_paths(m: Machine, device: str, dtype: str, weights: str, head_dim: int | None = None) -> tuple[OpPath, ...]:
    """Each op family's path for a model of this dtype name and weights format on device
    (head_dim: the model's, None when not known)."""
    on = serves(device, dtype, m.kernel_runs)
    if on and (head_dim is None or head_dim % ATTENTION_HEAD_MULTIPLE == 0):
        where = "" if head_dim is not None else f" (head_dim a multiple of {ATTENTION_HEAD_MULTIPLE})"
        attention = OpPath("attention", f"unit_blocks + combine_units{where}", True)
    else:
        attention = OpPath("attention", "torch's CPU flash kernel" if device == "cpu" else "plain torch ops", False)
    gumbel = serves(device, "float32", m.kernel_runs)
    blocks = weights in BLOCK_FORMATS and blocks_serve(device, dtype, m.kernel_runs)
    dequantization = ("none: integer dot products, the scales applied in float32" if weights == "int8dot" else
                      "in registers inside quant_linear (gguf's float32 dequantization)") if blocks else "none (dense)"
    return (projection_path(m, device, dtype, weights),
            OpPath("dequantization", dequantization, blocks),
            OpPath("norms", "fixed_rms_norm" if on else "torch rms_norm", on),
            OpPath("rope", "fixed_rope" if on else "torch ops (the same bits)", on),
            attention,
            OpPath("kv write", "kv_write" if on else "index_put_", on),
            OpPath("gumbel candidates", "gumbel_candidates" if gumbel else "every token scored (torch)", gumbel))


# ---------------------------------------------------------------------------------------------
# the machine: asked of the loaded kernel, or predicted without torch


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's flags in /proc/cpuinfo (empty where there is none)."""
    try:
        lines = Path(cpuinfo).read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))


def vector_isa(flags: frozenset[str]) -> str:
    if "avx512f" in flags:
        return "AVX512"
    return "AVX2" if {"avx2", "fma"} <= flags else f"below AVX2 ({platform.machine()})"


def predicted(flags: frozenset[str] | None = None) -> Machine:
    """The machine as /proc/cpuinfo, the settings and the build directory say, torch not imported
    (the kernel assumed to build where the CPU can run it)."""
    flags = cpu_flags() if flags is None else flags
    capable = {"avx2", "fma"} <= flags
    avx512 = capable and "avx512f" in flags
    vnni = avx512 and {"avx512bw", "avx512_vnni"} <= flags
    if linear_kernel.turned_off():
        kernel = "off (SPECBUS_LINEAR_KERNEL=0)"
    elif not capable:
        kernel = "unavailable (no AVX2 and FMA)"
    else:
        kernel = "built" if linear_kernel.built() else "not built (built at the first start)"
    runs = capable and not linear_kernel.turned_off()
    amx = runs and avx512 and {"amx_bf16", "amx_tile"} <= flags and linear_kernel.amx_wanted()
    wanted = linear_kernel.int_isa_wanted()
    int_isa = ("vnni" if vnni else "avx2") if wanted in ("best", "vnni") else wanted
    return Machine(isa=vector_isa(flags), kernel=kernel, kernel_runs=runs, avx512=avx512, amx=amx,
                   int_isa=int_isa if runs else "none", onednn=platform.machine() in ("x86_64", "AMD64"),
                   source="predicted")


def loaded() -> Machine:
    """The machine as the loaded kernel says (imports torch and loads or builds the kernel)."""
    import torch

    flags = cpu_flags()
    module = linear_kernel.load()
    if module is None:
        kernel = "off (SPECBUS_LINEAR_KERNEL=0)" if linear_kernel.turned_off() else "unavailable (see the log)"
    else:
        kernel = "loaded"
    return Machine(isa=vector_isa(flags), kernel=kernel, kernel_runs=module is not None,
                   avx512=module is not None and "avx512f" in flags, amx=module is not None and module.amx(),
                   # re-applies the setting `load` applied: the ISA in use
                   int_isa=module.use_int_isa(linear_kernel.int_isa_wanted()) if module is not None else "none",
                   onednn=torch.backends.mkldnn.is_available(), source="loaded")


def summary(m: Machine, device: str = "cpu") -> list[str]:
    """The machine and each op family's path for every dtype and weights format a model may be
    served in on device (`specbus models list`: which one a verifier takes depends on its settings)."""
    lines = [f"kernel paths ({m.source}): ISA {m.isa}, AMX {'on' if m.amx else 'off'}, kernel {m.kernel}, "
             f"int ISA {m.int_isa}"]
    served = [("float32", w) for w in ("dense", *BLOCK_FORMATS)] + [("bfloat16", "dense")]
    for dtype, weights in served:
        op = projection_path(m, device, dtype, weights)
        lines.append(f"  {'projection ' + dtype + ' ' + weights:<30} {'kernel  ' if op.kernel else 'fallback'} {op.path}")
    by_dtype = {dtype: op_paths(m, device, dtype, "dense")[2:] for dtype in KERNEL_DTYPES}
    for ops in zip(*by_dtype.values()):
        named = [(ops[0].family, ops[0])] if len(set(ops)) == 1 else [(f"{o.family} {d}", o) for d, o in zip(by_dtype, ops)]
        lines += [f"  {name:<30} {'kernel  ' if op.kernel else 'fallback'} {op.path}" for name, op in named]
    return lines


def report(device: str, dtype: str, weights: str, head_dim: int | None = None,
           machine: Machine | None = None) -> KernelReport:
    """The paths of a model of dtype name and weights format on device (machine: `loaded()`)."""
    machine = loaded() if machine is None else machine
    return KernelReport(machine, device, dtype, weights, op_paths(machine, device, dtype, weights, head_dim))
