"""Loads libfa4_jax.so (the AOT-built kernels + XLA FFI handlers) and registers its FFI targets.

Runtime module: imports only the standard library, jax and fa4_jax.families (never `cutlass`).
Nothing here raises because the library is missing or unusable; callers get an empty
`compiled_variants()` / False from `register_targets()`, and `library_status()` says why.

The library's C ABI (ffi/runtime.cc): it lists its FFI targets and their handler stages, its kernel
variants (all families), and loads one variant on one device on request.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from fa4_jax.families import FAMILIES, variant_from_symbol

LIBRARY_ENV = "FA4_JAX_LIBRARY"
# The handler stages every target has (see FamilyHandlers in ffi/runtime.h): initialize loads the
# chosen kernel on the stream's device before any CUDA-graph capture; execute launches it.
STAGES = ("initialize", "execute")
_LIB_NAME = "libfa4_jax.so"
_PKG_DIR = Path(__file__).resolve().parent

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_attempted = False
_status = "not loaded yet"
_variants: frozenset | None = None
_registered: bool | None = None
_prepared: set[tuple[str, int]] = set()


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


_SIGNATURES = {
    "fa4_jax_num_targets": ((), ctypes.c_int),
    "fa4_jax_target_name": ((ctypes.c_int,), ctypes.c_char_p),
    "fa4_jax_ffi_handler": ((ctypes.c_char_p, ctypes.c_char_p), ctypes.c_void_p),
    "fa4_jax_num_variants": ((), ctypes.c_int),
    "fa4_jax_variant_symbol": ((ctypes.c_int,), ctypes.c_char_p),
    "fa4_jax_prepare_variant": ((ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int), ctypes.c_int),
}


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
            for name, (argtypes, restype) in _SIGNATURES.items():
                fn = getattr(lib, name)  # fail here (AttributeError), not at first use
                fn.argtypes, fn.restype = argtypes, restype
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


def targets() -> tuple[str, ...]:
    """The FFI targets the library provides (one per kernel family in its build)."""
    lib = _load()
    if lib is None:
        return ()
    return tuple(lib.fa4_jax_target_name(i).decode() for i in range(lib.fa4_jax_num_targets()))


def compiled_variants() -> frozenset:
    """The kernel variants (of every family) the library was built with; empty when unavailable."""
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
                    found.add(variant_from_symbol(raw.decode()))
                except (AttributeError, UnicodeDecodeError, ValueError, TypeError):
                    # A library newer than this package may list variants it cannot name.
                    _status += f"; ignored unknown variant {raw!r}"
            _variants = frozenset(found)
        return _variants


def register_targets() -> bool:
    """Register every FFI target the library lists, for platform CUDA (once per process).

    Returns False when the library is unavailable or a registration failed (see library_status()).
    A target this package does not know (a newer library) is skipped, not registered blindly.
    """
    global _registered, _status
    lib = _load()
    if lib is None:
        return False
    with _lock:
        if _registered is not None:
            return _registered
        known = {f.target for f in FAMILIES}
        _registered = True
        try:
            import jax

            for i in range(lib.fa4_jax_num_targets()):
                target = lib.fa4_jax_target_name(i).decode()
                if target not in known:
                    _status += f"; skipped unknown FFI target {target!r}"
                    continue
                bundle = {}
                for stage in STAGES:
                    ptr = lib.fa4_jax_ffi_handler(target.encode(), stage.encode())
                    if not ptr:
                        raise RuntimeError(f"the library has no {stage} handler for {target}")
                    bundle[stage] = jax.ffi.pycapsule(ptr)
                jax.ffi.register_ffi_target(target, bundle, platform="CUDA", api_version=1)
        except Exception as e:  # noqa: BLE001 - surfaced through library_status()
            _status += f"; registering the FFI targets failed: {type(e).__name__}: {e}"
            _registered = False
        return _registered


def prepare_variant(variant, device_ordinal: int) -> str | None:
    """Load `variant` on CUDA device `device_ordinal` now; None on success, else why it failed.

    Success is remembered per (variant, device); a failure is not, so a later call tries again
    (a transient failure must not disable the kernel for the rest of the process)."""
    lib = _load()
    if lib is None:
        return f"the kernel library is unavailable: {_status}"
    key = (variant.symbol, int(device_ordinal))
    if key in _prepared:
        return None
    err = ctypes.create_string_buffer(1024)
    if lib.fa4_jax_prepare_variant(variant.symbol.encode(), int(device_ordinal), err, len(err)) != 0:
        return err.value.decode(errors="replace") or f"loading {variant.symbol} failed"
    _prepared.add(key)
    return None
