"""Checks of each exported kernel against the ABI its family describes (fa4_jax/ops/<family>/spec.py), and of
the CUDA calls its host code makes (the handlers are registered CUDA-graph compatible)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# CUDA entry points a kernel's host code may call while XLA captures the custom call into a CUDA
# graph. The handlers are registered command-buffer compatible, which is only true while the exported
# host code stays within stream-ordered launches and pure queries. Calls in CAPTURE_UNSAFE
# synchronize, allocate or query stream state and would break capture, so they fail the build; calls
# in neither set only warn so a new benign query does not block the build.
CAPTURE_SAFE = {
    "cudaLaunchKernel", "cudaLaunchKernelEx", "cudaLaunchKernelExC",
    "cudaLibraryLoadData", "cudaLibraryGetKernel", "cuLibraryGetKernel", "cudaLibraryUnload",
    "cudaGetDevice", "cudaGetDeviceCount", "cuDeviceGet", "cudaDeviceGetAttribute",
    "cudaFuncSetAttribute", "cudaKernelSetAttributeForDevice", "cuKernelGetAttribute",
    "cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cudaGetLastError",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaMemsetAsync", "cudaMemcpyAsync",
}
CAPTURE_UNSAFE = {
    "cudaMalloc", "cudaMallocAsync", "cudaMallocHost", "cudaMallocManaged", "cudaFree",
    "cudaFreeAsync", "cudaFreeHost", "cudaMemcpy", "cudaMemset", "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaStreamQuery", "cudaStreamCreate", "cudaStreamDestroy",
    "cudaEventSynchronize", "cudaEventQuery", "cuEventSynchronize", "cuEventQuery",
    "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphLaunch", "cudaGraphInstantiate",
    "cudaSetDevice", "cudaStreamAddCallback", "cudaProfilerStart", "cudaProfilerStop",
}
_CUDA_SYMBOL_RE = re.compile(r"^_?(cu(?:da)?[A-Z]\w*)$")


def _norm(decl: str) -> str:
    decl = re.sub(r"\s+", " ", decl.strip())
    return re.sub(r"\s*\*\s*", " *", decl)


def expected_struct_fields(tensor) -> list[str]:
    return [
        "void *data",
        f"int32_t dynamic_shapes[{len(tensor.shapes)}]",
        f"int64_t dynamic_strides[{len(tensor.strides)}]",
    ]


def expected_wrapper_params(family, symbol: str) -> list[str]:
    params = [f"{symbol}_Kernel_Module_t *module"]
    params += [f"{symbol}_Tensor_{t.name}_t *{t.name}" for t in family.tensors]
    params += [f"{s.c_type} {s.name}" for s in family.scalars]
    params.append("cudaStream_t stream")
    return [_norm(p) for p in params]


def check_header(family, symbol: str, text: str) -> list[str]:
    """Every way `text` (S.h) departs from the ABI that the generated thunks assume."""
    problems = []
    structs = {
        m.group("name"): [_norm(f) for f in m.group("body").split(";") if f.strip()]
        for m in re.finditer(r"typedef\s+struct\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;", text)
    }
    for tensor in family.tensors:
        name = f"{symbol}_Tensor_{tensor.name}_t"
        want = expected_struct_fields(tensor)
        got = structs.get(name)
        if got is None:
            problems.append(f"missing tensor struct {name} (is the kernel argument named {tensor.name}?)")
        elif got != want:
            problems.append(f"{name} is {{{'; '.join(got)}}}, expected {{{'; '.join(want)}}}")
    m = re.search(rf"static\s+inline\s+int32_t\s+cute_dsl_{symbol}_wrapper\s*\((?P<params>[^)]*)\)", text)
    if m is None:
        problems.append(f"missing `static inline int32_t cute_dsl_{symbol}_wrapper(...)`")
    else:
        got = [_norm(p) for p in m.group("params").split(",")]
        want = expected_wrapper_params(family, symbol)
        if got != want:
            problems.append(
                f"cute_dsl_{symbol}_wrapper parameters are\n      ({', '.join(got)})\n"
                f"    expected\n      ({', '.join(want)})"
            )
    if _norm("cudaLibrary_t module") not in structs.get(f"{symbol}_Kernel_Module_t", []):
        problems.append(f"{symbol}_Kernel_Module_t is not {{cudaLibrary_t module;}}")
    # The generated per-device loader calls the two functions the header's Module_Load calls (init
    # once, then load_to_device for one device instead of all), with the same argument structs.
    for fn in ("cuda_init", "cuda_load_to_device"):
        if not re.search(rf"void\s+_mlir_{symbol}_{fn}\s*\(\s*void\s*\*\*\s*\)\s*;", text):
            problems.append(f"missing declaration `void _mlir_{symbol}_{fn}(void **);`")
    init_args = r"cudaLibrary_t\s*\*\*\s*libraryPtr;\s*cudaError_t\s*\*\s*ret;"
    load_args = r"cudaLibrary_t\s*\*\*\s*library;\s*int32_t\s*\*\s*device_id;\s*cudaError_t\s*\*\s*ret;"
    for what, pattern in (("init", init_args), ("load_to_device", load_args)):
        if not re.search(r"struct\s*\{\s*" + pattern + r"\s*\}", text):
            problems.append(f"Module_Load's {what} argument struct changed (see fa4_jax/aot/codegen.py)")
    return problems


def cuda_calls(obj: Path) -> list[str] | None:
    """CUDA runtime/driver entry points S.o references (None when `nm` is unavailable)."""
    nm = os.environ.get("NM") or shutil.which("nm")
    if not nm:
        return None
    out = subprocess.run([nm, "-u", str(obj)], check=True, capture_output=True, text=True).stdout
    calls = set()
    for line in out.splitlines():
        m = _CUDA_SYMBOL_RE.match(line.split()[-1]) if line.split() else None
        if m:
            calls.add(m.group(1))
    return sorted(calls)


def capture_problems(symbol: str, calls: list[str] | None) -> tuple[list[str], list[str]]:
    """(errors, warnings) about the CUDA calls of S.o."""
    calls = set(calls or ())
    errors, warnings = [], []
    unsafe = sorted(calls & CAPTURE_UNSAFE)
    if unsafe:
        errors.append(
            f"{symbol}.o calls {', '.join(unsafe)}, which is illegal while XLA captures the custom call "
            "into a CUDA graph; the FFI handlers are registered command-buffer compatible. Remove the "
            "call from the kernel's host code, or drop that trait."
        )
    unknown = sorted(calls - CAPTURE_SAFE - CAPTURE_UNSAFE)
    if unknown:
        warnings.append(
            f"{symbol}.o calls {', '.join(unknown)}; check it is legal during CUDA graph capture and add "
            "it to CAPTURE_SAFE or CAPTURE_UNSAFE in fa4_jax/aot/abi.py"
        )
    return errors, warnings
