"""Loads libfa4_jax.so (the AOT-built kernels + XLA FFI handlers) and registers its FFI target.

Runtime module: imports only the standard library, jax and fa4_jax.variants (never `cutlass`).
Nothing here raises because the library is missing or unusable; callers get an empty
`compiled_variants()` / False from `register_targets()`, and `library_status()` says why.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from fa4_jax.variants import FwdVariant

FWD_TARGET = "fa4_jax_fwd_v1"
LIBRARY_ENV = "FA4_JAX_LIBRARY"
_LIB_NAME = "libfa4_jax.so"
_PKG_DIR = Path(__file__).resolve().parent

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_attempted = False
_status = "not loaded yet"
_variants: frozenset[FwdVariant] | None = None
_registered = False


def _candidate_dirs() -> list[Path]:
    """fa4_jax/_lib next to this file (regular installs, tools/build_inplace.py) and in every other
    directory of the package's __path__: scikit-build-core's editable install serves the Python
    files from the checkout but installs the library under site-packages/fa4_jax/_lib."""
    dirs = [_PKG_DIR / "_lib"]
    try:
        import fa4_jax

        for entry in getattr(fa4_jax, "__path__", ()):
            d = Path(entry).resolve() / "_lib"
            if d not in dirs:
                dirs.append(d)
    except Exception:  # noqa: BLE001 - a half-initialized package must not break the lookup
        pass
    return dirs


def library_path() -> Path | None:
    """The library to load: $FA4_JAX_LIBRARY if set, else fa4_jax/_lib/libfa4_jax.so.
    None when no such file exists (see library_status()).

    Where an editable install and an in-place build both left a library, the newer one wins:
    that is the build the user ran last.
    """
    env = os.environ.get(LIBRARY_ENV)
    if env:
        p = Path(env).expanduser()
        return p if p.is_file() else None
    found = [d / _LIB_NAME for d in _candidate_dirs() if (d / _LIB_NAME).is_file()]
    if found:
        return max(found, key=lambda p: p.stat().st_mtime)
    return _installed_library()


def _installed_library() -> Path | None:
    """The library of an installed fa4-jax wheel, for when the package itself is imported from a
    checkout that has none (e.g. `pip install .` followed by pytest run inside the checkout)."""
    try:
        import importlib.metadata

        p = Path(importlib.metadata.distribution("fa4-jax").locate_file(f"fa4_jax/_lib/{_LIB_NAME}"))
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable
        return None
    return p if p.is_file() else None


def _missing_reason() -> str:
    env = os.environ.get(LIBRARY_ENV)
    if env:
        return f"{LIBRARY_ENV}={env!r} does not name a file"
    looked = ", ".join(str(d / _LIB_NAME) for d in _candidate_dirs())
    return (
        f"{_LIB_NAME} was not built (looked for {looked}); build it with `pip install .` or "
        "`python tools/build_inplace.py` on a machine with nvidia-cutlass-dsl, or point "
        f"{LIBRARY_ENV} at a built copy"
    )


def _load() -> ctypes.CDLL | None:
    """Load the library once per process; later calls return the cached handle (or None)."""
    global _lib, _load_attempted, _status
    with _lock:
        if _load_attempted:
            return _lib
        _load_attempted = True
        path = library_path()
        if path is None:
            _status = _missing_reason()
            return None
        try:
            lib = ctypes.cdll.LoadLibrary(str(path))
            lib.fa4_jax_num_variants.argtypes = ()
            lib.fa4_jax_num_variants.restype = ctypes.c_int
            lib.fa4_jax_variant_symbol.argtypes = (ctypes.c_int,)
            lib.fa4_jax_variant_symbol.restype = ctypes.c_char_p
            for stage in ("instantiate", "execute"):
                getattr(lib, f"{FWD_TARGET}_{stage}")  # fail here, not at registration
        except (OSError, AttributeError) as e:
            _status = f"cannot load {path}: {e}"
            return None
        _lib = lib
        _status = f"loaded {path}"
        return lib


def library_status() -> str:
    """One line for error messages: where the library was loaded from, or why it is unavailable."""
    _load()
    return _status


def compiled_variants() -> frozenset[FwdVariant]:
    """The kernel variants the library was built with; empty when it is unavailable."""
    global _variants, _status
    lib = _load()
    if lib is None:
        return frozenset()
    with _lock:
        if _variants is None:
            found = set()
            for i in range(lib.fa4_jax_num_variants()):
                raw = lib.fa4_jax_variant_symbol(i)
                try:
                    found.add(FwdVariant.from_symbol(raw.decode()))
                except (AttributeError, UnicodeDecodeError, ValueError, TypeError):
                    # A library newer than this package may list variants it cannot name.
                    _status += f"; ignored unknown variant {raw!r}"
            _variants = frozenset(found)
        return _variants


def register_targets() -> bool:
    """Register the "fa4_jax_fwd_v1" FFI target for platform CUDA (once per process).

    Returns False when the library is unavailable or registration failed (see library_status()).
    Both handler stages are registered: instantiate loads the kernel modules once, outside any
    CUDA-graph capture; execute launches the kernel.
    """
    global _registered, _status
    lib = _load()
    if lib is None:
        return False
    with _lock:
        if _registered:
            return True
        try:
            import jax

            bundle = {
                stage: jax.ffi.pycapsule(getattr(lib, f"{FWD_TARGET}_{stage}"))
                for stage in ("instantiate", "execute")
            }
            jax.ffi.register_ffi_target(FWD_TARGET, bundle, platform="CUDA", api_version=1)
        except Exception as e:  # noqa: BLE001 - surfaced through library_status()
            _status += f"; registering {FWD_TARGET} failed: {type(e).__name__}: {e}"
            return False
        _registered = True
        return True
