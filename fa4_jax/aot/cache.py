"""The exporter's object cache: a variant is recompiled only when its fingerprint changes.

A fingerprint covers the variant, its family's ABI description, the nvidia-cutlass-dsl version and
the fa4_jax/kernels sources its compile can import (the static import closure of the family's
`compile` module), so editing one family's kernel code does not recompile the others."""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from fa4_jax.kernels import experiments

FINGERPRINT_FILE = "fa4_fingerprints.json"
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
KERNELS_PACKAGE = "fa4_jax.kernels"


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


def _kernel_module_file(module: str) -> str | None:
    """fa4_jax.kernels.a.b -> "a/b.py" (or "a/b/__init__.py"), relative to KERNELS_DIR; None when
    the name is not a module of the package (e.g. a class imported from one)."""
    if module != KERNELS_PACKAGE and not module.startswith(KERNELS_PACKAGE + "."):
        return None
    parts = module.split(".")[len(KERNELS_PACKAGE.split(".")):]
    for rel in ("/".join(parts) + ".py", "/".join(parts + ["__init__.py"])):
        if rel != ".py" and (KERNELS_DIR / rel).is_file():
            return rel
    return None


def _imported_modules(rel: str) -> set[str] | None:
    """Every module a kernels source file names in an import statement, anywhere in the file
    (function-level imports included: they run during a compile). None when the file cannot be
    read statically: a syntax error, or imports by name at run time (importlib, __import__)."""
    try:
        tree = ast.parse((KERNELS_DIR / rel).read_text(), filename=rel)
    except (OSError, SyntaxError, ValueError):
        return None
    parts = rel[: -len(".py")].split("/")
    package = ".".join([KERNELS_PACKAGE] + parts[:-1])  # the package a relative import starts from
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            # `from pkg import mod` imports the submodule pkg.mod (kept only if it is a file).
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Name) and node.id == "__import__":
            return None
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            return None
    return names


def kernel_module_files(entry_module: str) -> list[str] | None:
    """The kernels sources a compile through `entry_module` (a family's `compile` module) can
    import: the closure of its import statements within fa4_jax.kernels, with the package's
    __init__. None when that cannot be told statically (see _imported_modules) or the entry is not
    in the package: then every kernels source counts."""
    start = _kernel_module_file(entry_module)
    if start is None:
        return None
    seen, todo = set(), [start, "__init__.py"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        imported = _imported_modules(rel)
        if imported is None:
            return None
        for module in imported:
            # Importing a.b.c runs the __init__ of a and a.b first.
            parts = module.split(".")
            for n in range(1, len(parts) + 1):
                dep = _kernel_module_file(".".join(parts[:n]))
                if dep is not None and dep not in seen:
                    todo.append(dep)
    return sorted(seen)


def kernel_sources_digest(family=None) -> str:
    """Digest of the kernels sources a family's variants are compiled from (all of them without a
    family, or when its imports cannot be followed statically): an edit to a module that only
    another family's kernels import leaves this family's objects cached."""
    names = None
    if family is not None:
        names = kernel_module_files(family.compile.partition(":")[0])
    h = hashlib.sha256()
    for name in kernel_source_names() if names is None else names:
        h.update(name.encode() + b"\0")
        h.update((KERNELS_DIR / name).read_bytes() + b"\0")
    return h.hexdigest()


def family_abi_digest(family) -> str:
    """The family's (or companion's) ABI description (tensors, scalars, params, key): a change
    recompiles its variants."""
    abi = {f.name: repr(getattr(family, f.name)) for f in dataclasses.fields(family)
           if f.name in ("target", "params", "tensors", "scalars", "compile")}
    return hashlib.sha256(json.dumps(abi, sort_keys=True).encode()).hexdigest()


def fingerprint(variant, family, sources_digest: str, dsl_version: str) -> str:
    key = json.dumps(
        {"variant": repr(variant), "abi": family_abi_digest(family), "kernels": sources_digest,
         "cutlass_dsl": dsl_version,
         # Diagnostic and experiment builds compile other code from the same sources
         # (kernels/phase_times.py, kernels/experiments.py).
         "phase_times": os.environ.get("FA4_JAX_PHASE_TIMES", ""),
         "experiments": list(experiments.active())},
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
