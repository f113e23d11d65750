"""The built kernel library (CPU-only checks; no GPU needed).

libfa4_jax.so must load with ctypes on a machine without a GPU or CUDA driver, export the plain C
ABI that fa4_jax.core.library uses, and contain exactly the variant menu it was built with (recorded by the
exporter in fa4_menu.json next to the library).

Without a built library these tests skip, except under CI (CI=true), where the build is part of
the job and a missing library is a failure.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess

import pytest

from fa4_jax.core import library as _ffi
from fa4_jax.families import FAMILIES, menu_from_env, objects_of, variant_from_symbol

# The library's whole C ABI (ffi/runtime.cc); every family's handlers are reached through it.
EXPORTS = {
    "fa4_jax_num_targets",
    "fa4_jax_target_name",
    "fa4_jax_ffi_handler",
    "fa4_jax_num_variants",
    "fa4_jax_variant_symbol",
    "fa4_jax_prepare_variant",
}


@pytest.fixture(scope="module")
def lib_path():
    path = _ffi.library_path()
    if path is None:
        reason = f"no kernel library: {_ffi.library_status()}"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI builds the library, yet {reason}")
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def lib(lib_path):
    lib = ctypes.CDLL(str(lib_path))
    lib.fa4_jax_num_variants.restype = ctypes.c_int
    lib.fa4_jax_variant_symbol.argtypes = (ctypes.c_int,)
    lib.fa4_jax_variant_symbol.restype = ctypes.c_char_p
    lib.fa4_jax_target_name.argtypes = (ctypes.c_int,)
    lib.fa4_jax_target_name.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def lib_symbols(lib):
    n = lib.fa4_jax_num_variants()
    return [lib.fa4_jax_variant_symbol(i).decode() for i in range(n)]


@pytest.fixture(scope="module")
def built_menu(lib_path):
    path = lib_path.parent / "fa4_menu.json"
    assert path.is_file(), f"{path} (written by fa4_jax.aot, installed next to the library) is missing"
    return json.loads(path.read_text())


def test_exports_c_abi(lib):
    for name in EXPORTS:
        assert hasattr(lib, name), f"library does not export {name}"


def test_variant_symbols(lib, lib_symbols):
    assert lib_symbols, "library was built with no kernel variant"
    assert len(set(lib_symbols)) == len(lib_symbols), lib_symbols
    for s in lib_symbols:
        assert variant_from_symbol(s).symbol == s
    n = lib.fa4_jax_num_variants()
    assert lib.fa4_jax_variant_symbol(n) is None
    assert lib.fa4_jax_variant_symbol(-1) is None


def test_library_matches_build_menu(lib_symbols, built_menu):
    # The menu the build asked for (FA4_JAX_VARIANTS as the build saw it) is what the library holds.
    menu = menu_from_env({"FA4_JAX_VARIANTS": built_menu["fa4_jax_variants"]})
    expected = {v.symbol for v in menu}
    assert set(built_menu["variants"]) == expected
    assert set(lib_symbols) == expected
    # The companions (the KV-cache split combine) are objects of the library, not variants of it.
    assert built_menu["companions"] == [v.symbol for v in objects_of(menu)[len(menu):]]
    assert not set(built_menu["companions"]) & set(lib_symbols)


def test_full_menu_unless_narrowed(lib_symbols, built_menu):
    if built_menu["fa4_jax_variants"] or os.environ.get("FA4_JAX_VARIANTS"):
        pytest.skip(f"library built for FA4_JAX_VARIANTS={built_menu['fa4_jax_variants']!r}")
    assert set(lib_symbols) == {v.symbol for v in menu_from_env({})}
    # ... with the shipped kernels: no build-time experiment (kernels/experiments.py) in it.
    assert built_menu.get("experiments", []) == []


def test_ffi_loader(lib_path, lib_symbols):
    assert _ffi.compiled_variants() == frozenset(variant_from_symbol(s) for s in lib_symbols)
    assert str(lib_path) in _ffi.library_status() or os.environ.get(_ffi.LIBRARY_ENV)
    # Registration for platform CUDA works without a GPU: jax defers it until a CUDA backend exists.
    assert _ffi.register_targets(), _ffi.library_status()
    assert _ffi.register_targets()  # idempotent


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils `nm` not available")
def test_dynamic_symbol_table(lib_path):
    def nm(*flags):
        out = subprocess.run(["nm", "-D", *flags, str(lib_path)], check=True, capture_output=True, text=True)
        return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}

    # Only the C ABI is exported: the kernels' objects, the static CUDA runtime and the DSL runtime
    # stay private, so several copies (or another cudart) can live in one process.
    assert nm("--defined-only") == EXPORTS
    undefined = nm("--undefined-only")
    # Loadable without a GPU stack and without Python: no CUDA, driver or CPython symbols needed.
    assert not {s for s in undefined if s.startswith(("cu", "Py", "_Py"))}, sorted(undefined)


def test_targets_and_handlers(lib, built_menu):
    # One FFI target per family present in the build, each with both handler stages.
    n = lib.fa4_jax_num_targets()
    names = [lib.fa4_jax_target_name(i).decode() for i in range(n)]
    assert names == list(built_menu["families"].values())
    assert set(names) <= {f.target for f in FAMILIES}
    lib.fa4_jax_ffi_handler.restype = ctypes.c_void_p
    lib.fa4_jax_ffi_handler.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
    for name in names:
        for stage in _ffi.STAGES:
            assert lib.fa4_jax_ffi_handler(name.encode(), stage.encode()), (name, stage)
        assert not lib.fa4_jax_ffi_handler(name.encode(), b"prepare")
    assert not lib.fa4_jax_ffi_handler(b"no_such_target", b"execute")
    assert lib.fa4_jax_target_name(n) is None
    assert _ffi.targets() == tuple(names)


def _prepare(lib, symbol, device=0):
    lib.fa4_jax_prepare_variant.restype = ctypes.c_int
    lib.fa4_jax_prepare_variant.argtypes = (ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)
    err = ctypes.create_string_buffer(256)
    return lib.fa4_jax_prepare_variant(symbol.encode(), device, err, len(err)), err.value.decode()


def test_a_variant_loads_its_companion_first(lib, lib_symbols, monkeypatch):
    # The KV-cache variants launch the split combine, a companion object of their (arch, dtype,
    # head_dim): loading a variant loads it first, and its failure is the variant's, named.
    from fa4_jax.ops.kvcache.spec import COMBINE

    kv = [s for s in lib_symbols if s.startswith("fa4_kvcache_")]
    if not kv:
        pytest.skip("library built without KV-cache variants")
    monkeypatch.setenv("FA4_JAX_FAIL_MODULE_LOAD", "fa4_combine_")
    combine = COMBINE.of(variant_from_symbol(kv[0])).symbol
    assert _prepare(lib, kv[0]) == (1, f"loading {combine} on device 0 failed: simulated by FA4_JAX_FAIL_MODULE_LOAD")


def test_prepare_reports_errors_as_text(lib, lib_symbols, monkeypatch):
    # Loading must fail politely (a return code and a sentence), never crash the process: on this
    # GPU-less machine the CUDA runtime itself refuses, and unknown symbols/devices are named.
    assert _prepare(lib, "fa4_fwd_sm90_bf16_hd32_full") == (1, "this library has no variant fa4_fwd_sm90_bf16_hd32_full")
    rc, msg = _prepare(lib, lib_symbols[0], device=64)
    assert rc == 1 and "out of range" in msg
    monkeypatch.setenv("FA4_JAX_FAIL_MODULE_LOAD", "all")
    rc, msg = _prepare(lib, lib_symbols[0])
    assert rc == 1 and msg.endswith("simulated by FA4_JAX_FAIL_MODULE_LOAD"), msg
