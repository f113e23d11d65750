"""jax.export of programs calling fa4_jax from this CPU host (tests/export_case.py in a CPU-only
subprocess): with implementation=None the CUDA branch carries the kernels although no GPU is here,
the CPU branch the reference; the artifacts survive serialization. tests/test_gpu_export.py runs the
CUDA artifact on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import fa4_jax
from export_case import inputs, step
from fa4_jax.export import ffi_targets

HERE = Path(__file__).resolve().parent


def export_from_cpu_host(tmp_path, platforms: str):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "export_case.py"), str(tmp_path), platforms], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return jax.export.deserialize(bytearray((tmp_path / "step.bin").read_bytes()))


def kernel_calls(exported) -> list[str]:
    return sorted(re.findall(r"stablehlo\.custom_call @(fa4_jax_\w+)\(", exported.mlir_module()))


@pytest.fixture(scope="module")
def library():
    from fa4_jax import _ffi

    if not _ffi.compiled_variants():
        pytest.fail(f"these tests need the built kernel library: {_ffi.library_status()}")


def test_cuda_export_from_a_cpu_host_calls_the_kernels(tmp_path, library):
    exported = export_from_cpu_host(tmp_path, "cuda")
    assert exported.platforms == ("cuda",)
    # One kernel call per entry point (dense, KV cache, varlen), named by the versioned FFI targets.
    assert kernel_calls(exported) == sorted(ffi_targets()), exported.mlir_module()[:2000]
    assert "stablehlo.exponential" not in exported.mlir_module(), "no reference branch in a CUDA-only export"


def test_multi_platform_export_runs_the_reference_here(tmp_path, library):
    exported = export_from_cpu_host(tmp_path, "cpu,cuda")
    assert exported.platforms == ("cpu", "cuda")
    assert kernel_calls(exported) == sorted(ffi_targets())  # in the CUDA branch
    args = inputs()
    got = exported.call(*args.values())
    want = jax.jit(step)(*args.values())  # implementation=None on this CPU: the reference
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_export_safety_checks_name_every_target():
    checks = fa4_jax.export_safety_checks()
    assert len(checks) == len(ffi_targets()) == 3
    assert {str(c) for c in checks} == {f"custom_call:{t}" for t in ffi_targets()}
