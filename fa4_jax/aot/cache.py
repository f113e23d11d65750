"""The exporter's object cache: a variant is recompiled only when its fingerprint changes."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

FINGERPRINT_FILE = "fa4_fingerprints.json"
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"


def cutlass_dsl_version() -> str:
    # importlib.metadata, not `import cutlass`: --list and cache checks must stay fast.
    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return "missing"


def kernel_source_names() -> list[str]:
    if not KERNELS_DIR.is_dir():
        return []
    return sorted(p.relative_to(KERNELS_DIR).as_posix() for p in KERNELS_DIR.rglob("*.py")
                  if "__pycache__" not in p.parts)


def kernel_sources_digest() -> str:
    h = hashlib.sha256()
    for name in kernel_source_names():
        h.update(name.encode() + b"\0")
        h.update((KERNELS_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()


def family_abi_digest(family) -> str:
    """The family's ABI description (tensors, scalars, params, key): a change recompiles its variants."""
    abi = {f.name: repr(getattr(family, f.name)) for f in dataclasses.fields(family)
           if f.name in ("target", "params", "tensors", "scalars", "compile")}
    return hashlib.sha256(json.dumps(abi, sort_keys=True).encode()).hexdigest()


def fingerprint(variant, family, sources_digest: str, dsl_version: str) -> str:
    key = json.dumps(
        {"variant": repr(variant), "abi": family_abi_digest(family), "kernels": sources_digest,
         "cutlass_dsl": dsl_version},
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_json(path: Path, data: dict) -> None:
    # Atomic replace: an interrupted build must not leave a cache file that vouches for objects
    # it never saw complete.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def write_if_changed(path: Path, text: str) -> None:
    # Unchanged content keeps its mtime, so make/ninja do not recompile the FFI code needlessly.
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
