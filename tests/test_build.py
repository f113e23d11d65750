"""The built kernel library (CPU-only checks; no GPU needed).

libfa4_jax.so must load with ctypes on a machine without a GPU or CUDA driver, export the plain C
ABI that fa4_jax._ffi uses, and contain exactly the variant menu it was built with (recorded by the
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

from fa4_jax import _ffi
from fa4_jax.variants import FwdVariant, menu_from_env

EXPORTS = {
    "fa4_jax_num_variants",
    "fa4_jax_variant_symbol",
    f"{_ffi.FWD_TARGET}_instantiate",
    f"{_ffi.FWD_TARGET}_execute",
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
        assert FwdVariant.from_symbol(s).symbol == s
    n = lib.fa4_jax_num_variants()
    assert lib.fa4_jax_variant_symbol(n) is None
    assert lib.fa4_jax_variant_symbol(-1) is None


def test_library_matches_build_menu(lib_symbols, built_menu):
    # The menu the build asked for (FA4_JAX_VARIANTS as the build saw it) is what the library holds.
    expected = {v.symbol for v in menu_from_env({"FA4_JAX_VARIANTS": built_menu["fa4_jax_variants"]})}
    assert set(built_menu["variants"]) == expected
    assert set(lib_symbols) == expected


def test_full_menu_unless_narrowed(lib_symbols, built_menu):
    if built_menu["fa4_jax_variants"] or os.environ.get("FA4_JAX_VARIANTS"):
        pytest.skip(f"library built for FA4_JAX_VARIANTS={built_menu['fa4_jax_variants']!r}")
    assert set(lib_symbols) == {v.symbol for v in menu_from_env({})}


def test_ffi_loader(lib_path, lib_symbols):
    assert _ffi.compiled_variants() == frozenset(FwdVariant.from_symbol(s) for s in lib_symbols)
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
