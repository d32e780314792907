"""Which path each op runs (gpu_worker/runtime/kernel_paths.py): the report says what the forward
does, the torch-free prediction says what the loaded kernel says on this machine, and the command
`specbus up` runs prints the verifier's report."""

import json
import subprocess
import sys

import pytest
import torch

from gpu_worker.runtime import kernel_paths, linear_kernel
from gpu_worker.runtime.model import pack_weight
from schemas.config import TINY_TARGET

FAMILIES = ("projection", "dequantization", "norms", "rope", "attention", "kv write", "gumbel candidates")


def ops(report) -> dict:
    return {op.family: op for op in report.ops}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_report_says_what_the_forward_asks(dtype):
    name = str(dtype).removeprefix("torch.")
    report = kernel_paths.report("cpu", name, "dense", head_dim=64)
    assert tuple(ops(report)) == FAMILIES
    t = torch.zeros(4, 64, dtype=dtype)
    runs = kernel_paths.fixed_kernel(t) is not None
    assert runs == (report.machine.kernel_runs and name != "float16")
    for family in ("projection", "norms", "rope", "kv write"):
        assert ops(report)[family].kernel == runs, family
    assert ops(report)["attention"].kernel == (kernel_paths.attention_kernel(t, 64) is not None)
    assert kernel_paths.attention_kernel(t, 60) is None  # not a multiple of ATTENTION_HEAD_MULTIPLE
    assert not ops(kernel_paths.report("cpu", name, "dense", head_dim=60))["attention"].kernel
    # a weight packed for our kernel is a plain tensor (paired rows or AMX tiles), else oneDNN's
    assert (not pack_weight(torch.zeros(32, 64, dtype=dtype)).is_mkldnn) == runs


def test_the_torch_free_prediction_is_what_the_loaded_kernel_says_here():
    loaded, predicted = kernel_paths.loaded(), kernel_paths.predicted()
    assert (loaded.source, predicted.source) == ("loaded", "predicted")
    for field in ("isa", "kernel_runs", "avx512", "amx", "int_isa", "onednn"):
        assert getattr(loaded, field) == getattr(predicted, field), field
    for dtype in kernel_paths.KERNEL_DTYPES:
        for weights in ("dense", *kernel_paths.BLOCK_FORMATS):
            assert kernel_paths.op_paths(loaded, "cpu", dtype, weights) == \
                kernel_paths.op_paths(predicted, "cpu", dtype, weights), (dtype, weights)


def test_turned_off_every_op_falls_back_and_the_prediction_says_so(monkeypatch):
    monkeypatch.setenv("SPECBUS_LINEAR_KERNEL", "0")
    linear_kernel.load.cache_clear()
    try:
        report = kernel_paths.report("cpu", "float32", "dense", head_dim=64)
        assert report.machine.kernel.startswith("off") and not any(op.kernel for op in report.ops)
        assert kernel_paths.fixed_kernel(torch.zeros(2, 8)) is None
        assert not kernel_paths.predicted().kernel_runs
        assert ops(kernel_paths.report("cpu", "float32", "int8dot", machine=report.machine))["projection"].path \
            .startswith("unavailable")
    finally:
        linear_kernel.load.cache_clear()


def test_a_cpu_without_avx2_or_amx_settings_are_predicted_from_the_flags(monkeypatch):
    old = kernel_paths.predicted(frozenset({"sse4_2"}))
    assert (old.isa.startswith("below AVX2"), old.kernel_runs, old.int_isa) == (True, False, "none")
    amx = frozenset({"avx2", "fma", "avx512f", "avx512bw", "amx_bf16", "amx_tile"})
    assert kernel_paths.predicted(amx).amx and kernel_paths.predicted(amx).int_isa == "avx2"  # no VNNI flag
    assert "AMX tiles" in kernel_paths.projection_path(kernel_paths.predicted(amx), "cpu", "bfloat16", "dense").path
    monkeypatch.setenv("SPECBUS_AMX", "0")
    monkeypatch.setenv("SPECBUS_INT_ISA", "scalar")
    assert not kernel_paths.predicted(amx).amx and kernel_paths.predicted(amx).int_isa == "scalar"


def test_the_command_prints_the_verifiers_report_for_its_settings():
    done = subprocess.run([sys.executable, "-m", "services.verifier.verifier", "kernel-paths", f"--target-model={TINY_TARGET}",
                           "--dtype=float32", "--weights=dense", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["device"], result["dtype"], result["weights"]) == ("cpu", "float32", "dense")
    assert result["machine"]["source"] == "loaded" and set(result["ops"]) == set(FAMILIES)
    assert result["ops"]["projection"]["kernel"] == kernel_paths.loaded().kernel_runs
