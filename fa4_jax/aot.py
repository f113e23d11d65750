"""Build-time AOT exporter: CuTe-DSL kernels -> object files + the C++ dispatch table.

    python -m fa4_jax.aot --out DIR [--jobs N] [--force]
    python -m fa4_jax.aot --list

For every variant of `menu_from_env()` (narrowed by FA4_JAX_VARIANTS) a worker process calls
`fa4_jax.kernels.compile_fwd(variant)` GPU-blind and `export_to_c`, which writes DIR/S.o and DIR/S.h
(S = variant.symbol). The exporter then checks each header against the ABI the FFI handler fills
(tensor struct ranks, wrapper parameter list) and writes DIR/fa4_variants.inc: one launch thunk and one
module-load thunk per variant plus the table ffi/fa4_jax_ffi.cc dispatches on.

This is the only module besides fa4_jax/kernels that (indirectly, inside the workers) imports `cutlass`;
nothing in the runtime package imports it, so it never runs on the GPU host.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from fa4_jax.variants import FwdVariant, menu_from_env

INC_FILE = "fa4_variants.inc"
MENU_FILE = "fa4_menu.json"  # installed next to the .so; tests compare it with the library
FINGERPRINT_FILE = "fa4_fingerprints.json"  # object cache of this directory
REQUEST_FILE = "fa4_request.json"  # menu + kernel file list recorded at CMake configure time
_KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
_PREFIX = "[fa4_jax.aot]"

# The ABI of one exported kernel (see the contract): for each tensor argument, the number of dynamic
# shape / stride modes its struct carries and the C++ expressions (fields of fa4_jax::FwdParams) that
# fill them, in the mode order of the kernel's fake tensors. The header check and the generated
# thunks both read this table, so they cannot disagree.
TENSOR_ABI: dict[str, tuple[str, tuple[str, ...], tuple[str, ...]]] = {
    #  name    data pointer  shapes                       strides (elements)
    "mQ": ("p.q", ("p.b", "p.s_q", "p.h_q"), ("p.q_stride[0]", "p.q_stride[1]", "p.q_stride[2]")),
    "mK": ("p.k", ("p.b", "p.s_k", "p.h_k"), ("p.k_stride[0]", "p.k_stride[1]", "p.k_stride[2]")),
    "mV": ("p.v", ("p.b", "p.s_k", "p.h_k"), ("p.v_stride[0]", "p.v_stride[1]", "p.v_stride[2]")),
    "mO": ("p.o", ("p.b", "p.s_q", "p.h_q"), ("p.o_stride[0]", "p.o_stride[1]", "p.o_stride[2]")),
    "mLSE": ("p.lse", ("p.b", "p.h_q", "p.s_q"), ("p.lse_stride[0]", "p.lse_stride[1]")),
}
SCALAR_PARAMS = ("float softmax_scale_log2", "cudaStream_t stream")
_ARCH_NUM = {"sm90": 90, "sm100": 100}
_DTYPE_ENUM = {"bf16": "fa4_jax::DType::kBF16", "fp16": "fa4_jax::DType::kFP16"}

# CUDA entry points a kernel's host code may call while XLA captures the custom call into a CUDA
# graph. The handler is registered command-buffer compatible (see ffi/fa4_jax_ffi.cc), which is only
# true while the exported host code stays within stream-ordered launches and pure queries. Calls in
# _CAPTURE_UNSAFE synchronize, allocate or query stream state and would break capture, so they fail
# the build; calls in neither set only warn so a new benign query does not block the build.
_CAPTURE_SAFE = {
    "cudaLaunchKernel", "cudaLaunchKernelEx", "cudaLaunchKernelExC",
    "cudaLibraryLoadData", "cudaLibraryGetKernel", "cuLibraryGetKernel", "cudaLibraryUnload",
    "cudaGetDevice", "cudaGetDeviceCount", "cuDeviceGet", "cudaDeviceGetAttribute",
    "cudaFuncSetAttribute", "cudaKernelSetAttributeForDevice", "cuKernelGetAttribute",
    "cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cudaGetLastError",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor", "cudaMemsetAsync", "cudaMemcpyAsync",
}
_CAPTURE_UNSAFE = {
    "cudaMalloc", "cudaMallocAsync", "cudaMallocHost", "cudaMallocManaged", "cudaFree",
    "cudaFreeAsync", "cudaFreeHost", "cudaMemcpy", "cudaMemset", "cudaDeviceSynchronize",
    "cudaStreamSynchronize", "cudaStreamQuery", "cudaStreamCreate", "cudaStreamDestroy",
    "cudaEventSynchronize", "cudaEventQuery", "cuEventSynchronize", "cuEventQuery",
    "cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphLaunch", "cudaGraphInstantiate",
    "cudaSetDevice", "cudaStreamAddCallback", "cudaProfilerStart", "cudaProfilerStop",
}
_CUDA_SYMBOL_RE = re.compile(r"^_?(cu(?:da)?[A-Z]\w*)$")


class AotError(RuntimeError):
    """A build failure with a message meant for the person running the build."""


# --------------------------------------------------------------------------------------------------
# Fingerprints (object cache)


def _cutlass_dsl_version() -> str:
    # importlib.metadata, not `import cutlass`: --list and cache checks must stay fast.
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def _kernel_sources_digest() -> str:
    h = hashlib.sha256()
    if _KERNELS_DIR.is_dir():
        for path in sorted(_KERNELS_DIR.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            h.update(path.relative_to(_KERNELS_DIR).as_posix().encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(variant: FwdVariant, sources_digest: str, dsl_version: str) -> str:
    key = json.dumps(
        {"variant": repr(variant), "kernels": sources_digest, "cutlass_dsl": dsl_version},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_json(path: Path, data: dict) -> None:
    # Atomic replace: an interrupted build must not leave a cache file that vouches for objects
    # it never saw complete.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Compilation (runs in worker processes)


def _compile_one(symbol: str, out_dir: str) -> dict:
    """Compile + export one variant. Returns timings, or the formatted error (exceptions from the
    DSL do not always pickle, so the worker sends text back)."""
    t0 = time.perf_counter()
    try:
        variant = FwdVariant.from_symbol(symbol)
        from fa4_jax import kernels  # imports cutlass: keep it inside the worker

        t1 = time.perf_counter()
        compiled = kernels.compile_fwd(variant)
        t2 = time.perf_counter()
        # Export into a private temp dir, then move: a killed build leaves no half-written S.o
        # next to a valid S.h.
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{symbol}.") as tmp:
            compiled.export_to_c(file_path=tmp, file_name=symbol, function_prefix=symbol)
            for ext in (".h", ".o"):
                src = Path(tmp) / f"{symbol}{ext}"
                if not src.is_file():
                    raise AotError(f"export_to_c did not write {src.name}")
                os.replace(src, Path(out_dir) / f"{symbol}{ext}")
        t3 = time.perf_counter()
        return {"symbol": symbol, "import_s": t1 - t0, "compile_s": t2 - t1, "export_s": t3 - t2}
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        return {"symbol": symbol, "error": traceback.format_exc()}


def _compile_all(symbols: list[str], out_dir: Path, jobs: int, on_done) -> None:
    if jobs <= 1 or len(symbols) <= 1:
        # In-process: one variant (the common iteration case) does not pay for a spawned worker
        # re-importing the DSL, and tracebacks/pdb work directly.
        for s in symbols:
            on_done(_compile_one(s, str(out_dir)))
        return
    # spawn, not fork: the DSL holds MLIR contexts and threads that do not survive fork.
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(_compile_one, s, str(out_dir)) for s in symbols]
        try:
            for fut in concurrent.futures.as_completed(futures):
                on_done(fut.result())
        except BaseException:
            for f in futures:
                f.cancel()
            raise


# --------------------------------------------------------------------------------------------------
# Header checks


def _norm(decl: str) -> str:
    decl = re.sub(r"\s+", " ", decl.strip())
    return re.sub(r"\s*\*\s*", " *", decl)


def expected_struct_fields(tensor: str) -> list[str]:
    _, shapes, strides = TENSOR_ABI[tensor]
    return [
        "void *data",
        f"int32_t dynamic_shapes[{len(shapes)}]",
        f"int64_t dynamic_strides[{len(strides)}]",
    ]


def expected_wrapper_params(symbol: str) -> list[str]:
    params = [f"{symbol}_Kernel_Module_t *module"]
    params += [f"{symbol}_Tensor_{t}_t *{t}" for t in TENSOR_ABI]
    params += list(SCALAR_PARAMS)
    return [_norm(p) for p in params]


def check_header(symbol: str, text: str) -> list[str]:
    """Return every way `text` (S.h) departs from the ABI the generated thunks assume."""
    problems = []
    structs = {
        m.group("name"): [_norm(f) for f in m.group("body").split(";") if f.strip()]
        for m in re.finditer(r"typedef\s+struct\s*\{(?P<body>[^{}]*)\}\s*(?P<name>\w+)\s*;", text)
    }
    for tensor in TENSOR_ABI:
        name = f"{symbol}_Tensor_{tensor}_t"
        want = expected_struct_fields(tensor)
        got = structs.get(name)
        if got is None:
            problems.append(f"missing tensor struct {name} (is the kernel argument named {tensor}?)")
        elif got != want:
            problems.append(f"{name} is {{{'; '.join(got)}}}, expected {{{'; '.join(want)}}}")
    m = re.search(rf"static\s+inline\s+int32_t\s+cute_dsl_{symbol}_wrapper\s*\((?P<params>[^)]*)\)", text)
    if m is None:
        problems.append(f"missing `static inline int32_t cute_dsl_{symbol}_wrapper(...)`")
    else:
        got = [_norm(p) for p in m.group("params").split(",")]
        want = expected_wrapper_params(symbol)
        if got != want:
            problems.append(
                f"cute_dsl_{symbol}_wrapper parameters are\n      ({', '.join(got)})\n"
                f"    expected\n      ({', '.join(want)})"
            )
    for fn in (f"{symbol}_Kernel_Module_Load", f"{symbol}_Kernel_Module_Unload"):
        if not re.search(rf"\b{fn}\s*\(\s*{symbol}_Kernel_Module_t\s*\*", text):
            problems.append(f"missing {fn}({symbol}_Kernel_Module_t *)")
    # The FFI code captures module-load errors by defining this macro first; it must stay overridable.
    if "#ifndef CUTE_DSL_CUDA_ERROR_CHECK" not in text:
        problems.append("CUTE_DSL_CUDA_ERROR_CHECK is not #ifndef-guarded; load errors could not be captured")
    return problems


def cuda_calls(obj: Path) -> list[str] | None:
    """CUDA runtime/driver entry points S.o references (None when `nm` is unavailable)."""
    import subprocess

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


# --------------------------------------------------------------------------------------------------
# Code generation


def _thunks(v: FwdVariant) -> str:
    s = v.symbol
    lines = [
        f"// ---- {s}",
        f"static {s}_Kernel_Module_t {s}_module;",
        "",
        f"static cudaError_t {s}_load(void *module) {{",
        "  ::fa4_jax::detail::load_error = cudaSuccess;",
        f"  {s}_Kernel_Module_Load(static_cast<{s}_Kernel_Module_t *>(module));",
        "  return ::fa4_jax::detail::load_error;",
        "}",
        "",
        f"static int32_t {s}_launch(void *module, const ::fa4_jax::FwdParams &p) {{",
    ]
    for tensor, (data, shapes, strides) in TENSOR_ABI.items():
        lines.append(f"  {s}_Tensor_{tensor}_t {tensor};")
        lines.append(f"  {tensor}.data = {data};")
        lines += [f"  {tensor}.dynamic_shapes[{i}] = {e};" for i, e in enumerate(shapes)]
        lines += [f"  {tensor}.dynamic_strides[{i}] = {e};" for i, e in enumerate(strides)]
    args = ", ".join(f"&{t}" for t in TENSOR_ABI)
    lines += [
        f"  return cute_dsl_{s}_wrapper(static_cast<{s}_Kernel_Module_t *>(module), {args},",
        "                             p.softmax_scale_log2, p.stream);",
        "}",
        "",
    ]
    return "\n".join(lines)


def generate_inc(menu: list[FwdVariant], dsl_version: str) -> str:
    out = [
        f"// Generated by `python -m fa4_jax.aot` (nvidia-cutlass-dsl {dsl_version}); do not edit.",
        f"// {len(menu)} kernel variant(s). Included once, by ffi/fa4_jax_ffi.cc, after ffi/fa4_table.h.",
        "#pragma once",
        "#ifndef CUTE_DSL_CUDA_ERROR_CHECK",
        '#error "include ffi/fa4_table.h (defines CUTE_DSL_CUDA_ERROR_CHECK) before fa4_variants.inc"',
        "#endif",
        "",
    ]
    out += [f'#include "{v.symbol}.h"' for v in menu]
    out += ["", "namespace fa4_jax::generated {", ""]
    out += [_thunks(v) for v in menu]
    out.append(f"inline constexpr int kNumVariants = {len(menu)};")
    out.append("static const ::fa4_jax::VariantEntry kVariants[kNumVariants] = {")
    for v in menu:
        s = v.symbol
        causal = "true" if v.causal else "false"
        out.append(
            f'    {{"{s}", {_ARCH_NUM[v.arch]}, {_DTYPE_ENUM[v.dtype]}, {v.head_dim}, {causal},'
            f" &{s}_launch, &{s}_load, &{s}_module}},"
        )
    out += ["};", "", "}  // namespace fa4_jax::generated", ""]
    return "\n".join(out)


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged content keeps its mtime, so make/ninja do not recompile the FFI code needlessly.
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------
# Driver


def _kernel_source_names() -> list[str]:
    if not _KERNELS_DIR.is_dir():
        return []
    return sorted(
        p.relative_to(_KERNELS_DIR).as_posix()
        for p in _KERNELS_DIR.rglob("*.py")
        if "__pycache__" not in p.parts
    )


def _menu_for(spec: str) -> list[FwdVariant]:
    return sorted(menu_from_env({"FA4_JAX_VARIANTS": spec}))


def build(out: Path, jobs: int, force: bool = False, request: Path | None = None) -> None:
    """Compile (or take from the cache) every variant of the menu, check, and generate the table.

    The menu is FA4_JAX_VARIANTS from the environment, or, with `request` (the CMake build step),
    the spec recorded in that file at configure time.
    """
    t_start = time.perf_counter()
    if request is not None:
        req = _read_json(request)
        if "fa4_jax_variants" not in req:
            raise AotError(f"{request} is missing or unreadable; reconfigure the build")
        spec = req["fa4_jax_variants"]
        menu = _menu_for(spec)
        if [v.symbol for v in menu] != req.get("variants"):
            raise AotError(f"the menu changed since {request} was written; reconfigure the build")
    else:
        spec = os.environ.get("FA4_JAX_VARIANTS", "")
        menu = _menu_for(spec)
    if not menu:
        raise AotError("the variant menu is empty")
    out.mkdir(parents=True, exist_ok=True)
    dsl_version = _cutlass_dsl_version()
    digest = _kernel_sources_digest()
    fp_path = out / FINGERPRINT_FILE
    fps = _read_json(fp_path)
    want = {v.symbol: fingerprint(v, digest, dsl_version) for v in menu}

    todo, cached = [], []
    for v in menu:
        s = v.symbol
        fresh = (out / f"{s}.o").is_file() and (out / f"{s}.h").is_file() and fps.get(s) == want[s]
        (cached if fresh and not force else todo).append(s)
    for s in todo:  # forget stale entries first: a crash mid-build must not resurrect them
        fps.pop(s, None)
    _write_json(fp_path, fps)

    jobs = max(1, min(jobs, len(todo))) if todo else 1
    print(
        f"{_PREFIX} {len(menu)} variant(s): {len(todo)} to compile, {len(cached)} cached; "
        f"jobs={jobs}; nvidia-cutlass-dsl {dsl_version}; out={out}",
        flush=True,
    )
    for s in cached:
        print(f"{_PREFIX}   {s:<40s} cached", flush=True)

    failures = []

    def on_done(res: dict) -> None:
        s = res["symbol"]
        if "error" in res:
            failures.append(res)
            print(f"{_PREFIX}   {s:<40s} FAILED", flush=True)
            return
        fps[s] = want[s]
        _write_json(fp_path, fps)
        print(
            f"{_PREFIX}   {s:<40s} compile {res['compile_s']:6.1f} s  export {res['export_s']:5.1f} s"
            f"  (worker import {res['import_s']:4.1f} s)",
            flush=True,
        )

    if todo:
        _compile_all(todo, out, jobs, on_done)
    if failures:
        details = "\n".join(f"--- {f['symbol']}\n{f['error']}" for f in failures)
        raise AotError(
            f"{len(failures)} of {len(todo)} variant(s) failed to compile:\n{details}\n"
            f"(rerun one alone with FA4_JAX_VARIANTS=... python -m fa4_jax.aot --out {out} --jobs 1)"
        )

    problems, calls = [], {}
    for v in menu:
        s = v.symbol
        for p in check_header(s, (out / f"{s}.h").read_text()):
            problems.append(f"{s}.h: {p}")
        calls[s] = cuda_calls(out / f"{s}.o")
        unsafe = sorted(set(calls[s] or ()) & _CAPTURE_UNSAFE)
        if unsafe:
            problems.append(
                f"{s}.o calls {', '.join(unsafe)}, which is illegal while XLA captures the custom "
                "call into a CUDA graph; the FFI handler is registered command-buffer compatible "
                "(ffi/fa4_jax_ffi.cc). Remove the call from the kernel's host code, or drop that trait."
            )
        unknown = sorted(set(calls[s] or ()) - _CAPTURE_SAFE - _CAPTURE_UNSAFE)
        if unknown:
            print(
                f"{_PREFIX} warning: {s}.o calls {', '.join(unknown)}; check it is legal during "
                "CUDA graph capture and add it to _CAPTURE_SAFE or _CAPTURE_UNSAFE in fa4_jax/aot.py",
                flush=True,
            )
    if problems:
        raise AotError(
            "exported kernels do not match the ABI that ffi/fa4_jax_ffi.cc fills "
            "(see TENSOR_ABI in fa4_jax/aot.py and the contract):\n  " + "\n  ".join(problems)
        )

    _write_if_changed(out / INC_FILE, generate_inc(menu, dsl_version))
    _write_if_changed(
        out / MENU_FILE,
        json.dumps(
            {
                "variants": [v.symbol for v in menu],
                "fa4_jax_variants": spec,
                "cutlass_dsl_version": dsl_version,
                "cuda_calls": calls,
            },
            indent=1,
            sort_keys=True,
        )
        + "\n",
    )
    print(
        f"{_PREFIX} done: {len(menu)} variant(s) ({len(todo)} compiled, {len(cached)} cached) in "
        f"{time.perf_counter() - t_start:.1f} s; wrote {out / INC_FILE}",
        flush=True,
    )


def _cutlass_dsl_runtime_archive() -> Path | None:
    """<nvidia_cutlass_dsl>/cu13/lib/libcuda_dialect_runtime_static.a, found without importing
    cutlass (it defines the _cuda*/_cu* wrappers the exported objects call)."""
    import importlib.util

    candidates = []
    for dist in ("nvidia-cutlass-dsl-libs-cu13", "nvidia-cutlass-dsl"):
        try:
            files = importlib.metadata.distribution(dist).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for f in files:
            if f.as_posix().endswith("cu13/lib/libcuda_dialect_runtime_static.a"):
                candidates.append(Path(f.locate()).resolve())
    spec = importlib.util.find_spec("cutlass")
    if spec is not None and spec.origin:
        # .../nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py
        candidates.append(Path(spec.origin).resolve().parents[2] / "cu13" / "lib" / "libcuda_dialect_runtime_static.a")
    return next((c for c in candidates if c.is_file()), None)


def write_cmake_config(path: Path, out: Path) -> None:
    """Everything CMakeLists.txt needs from Python, in one interpreter start: the menu (to name the
    custom command's outputs), the jax FFI headers and the DSL's static runtime. Also writes
    out/fa4_request.json, the build step's input (see CMakeLists.txt)."""
    import jax

    spec = os.environ.get("FA4_JAX_VARIANTS", "")
    menu = _menu_for(spec)
    archive = _cutlass_dsl_runtime_archive()
    if archive is None:
        raise AotError(
            "libcuda_dialect_runtime_static.a not found: install nvidia-cutlass-dsl[cu13]==4.8.1 "
            "in the build environment"
        )

    def q(x) -> str:
        return '"' + str(x).replace("\\", "/").replace('"', '\\"') + '"'

    lines = [
        "# Generated by `python -m fa4_jax.aot --cmake-config`; do not edit.",
        f"set(FA4_SYMBOLS {' '.join(v.symbol for v in menu)})",
        f"set(FA4_JAX_FFI_INCLUDE_DIR {q(jax.ffi.include_dir())})",
        f"set(FA4_CUTE_DSL_RUNTIME_STATIC {q(archive)})",
        f"set(FA4_CUTLASS_DSL_VERSION {q(_cutlass_dsl_version())})",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_if_changed(path, "\n".join(lines) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    req = {"fa4_jax_variants": spec, "variants": [v.symbol for v in menu], "kernel_sources": _kernel_source_names()}
    _write_if_changed(out / REQUEST_FILE, json.dumps(req, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="output directory for S.o, S.h and fa4_variants.inc")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel worker processes")
    parser.add_argument("--force", action="store_true", help="recompile even if the cache is valid")
    parser.add_argument("--list", action="store_true", help="print the variant menu and exit")
    # Used by CMakeLists.txt only.
    parser.add_argument("--cmake-config", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--request", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        if args.cmake_config is not None:
            if args.out is None:
                parser.error("--cmake-config needs --out")
            write_cmake_config(args.cmake_config.resolve(), args.out.resolve())
            return 0
        if args.list:
            for v in sorted(menu_from_env()):
                print(v.symbol)
            return 0
        if args.out is None:
            parser.error("--out is required (unless --list)")
        build(args.out.resolve(), args.jobs, force=args.force, request=args.request)
        return 0
    except (AotError, ValueError) as e:
        print(f"{_PREFIX} error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
