"""The exporter's driver: menu -> object cache -> compile -> ABI check -> generated C++."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from fa4_jax.aot import abi, cache, codegen
from fa4_jax.aot.cmake import REQUEST_FILE, families_in, sorted_menu
from fa4_jax.aot.worker import AotError, compile_all
from fa4_jax.families import MENU_ENV, description_of, family_of, objects_of
from fa4_jax.kernels import experiments

MENU_FILE = "fa4_menu.json"  # installed next to the .so; tests compare it with the library
REGISTRY_FILE = "fa4_registry.inc"
SHARED_FILE = "fa4_shared.inc"
PREFIX = "[fa4_jax.aot]"


def family_inc_name(family) -> str:
    return f"fa4_{family.name}.inc"


def _log(msg: str) -> None:
    print(f"{PREFIX} {msg}", flush=True)


def resolve_menu(request: Path | None) -> tuple[str, list]:
    """The menu: FA4_JAX_VARIANTS from the environment, or (the CMake build step) the spec recorded
    in the request file at configure time, which must still select the same variants. The build step
    also compiles the experiments recorded there (kernels/experiments.py), whatever its own
    environment says: this sets FA4_JAX_EXPERIMENTS for this process and the workers it starts."""
    if request is None:
        spec = os.environ.get(MENU_ENV, "")
        return spec, sorted_menu(spec)
    req = cache.read_json(request)
    if "fa4_jax_variants" not in req:
        raise AotError(f"{request} is missing or unreadable; reconfigure the build")
    spec = req["fa4_jax_variants"]
    menu = sorted_menu(spec)
    if [v.symbol for v in menu] != req.get("variants"):
        raise AotError(f"the menu changed since {request} was written; reconfigure the build")
    os.environ[experiments.ENV] = ",".join(req.get("experiments", []))
    return spec, menu


def compile_menu(menu: list, out: Path, jobs: int, force: bool, dsl_version: str) -> tuple[int, int]:
    """Compiles every object of the menu (its variants and their companions: objects_of) that is
    missing or stale. Returns (compiled, cached)."""
    objects = objects_of(menu)
    # Per family or companion (keyed by its entry): the kernels sources its entry module imports.
    descriptions = {description_of(v).compile: description_of(v) for v in objects}
    digests = {entry: cache.kernel_sources_digest(d) for entry, d in descriptions.items()}
    fp_path = out / cache.FINGERPRINT_FILE
    fps = cache.read_json(fp_path)
    want = {v.symbol: cache.fingerprint(v, description_of(v), digests[description_of(v).compile], dsl_version)
            for v in objects}

    todo, cached = [], []
    for s in want:
        fresh = (out / f"{s}.o").is_file() and (out / f"{s}.h").is_file() and fps.get(s) == want[s]
        (cached if fresh and not force else todo).append(s)
    for s in todo:  # forget stale entries first: a crash mid-build must not resurrect them
        fps.pop(s, None)
    cache.write_json(fp_path, fps)

    jobs = max(1, min(jobs, len(todo))) if todo else 1
    _log(f"{len(menu)} variant(s) and {len(objects) - len(menu)} companion(s): {len(todo)} to compile, "
         f"{len(cached)} cached; jobs={jobs}; "
         f"nvidia-cutlass-dsl {dsl_version}; out={out}")
    for s in cached:
        _log(f"  {s:<44s} cached")

    failures = []

    def on_done(res: dict) -> None:
        s = res["symbol"]
        if "error" in res:
            failures.append(res)
            _log(f"  {s:<44s} FAILED")
            return
        fps[s] = want[s]
        cache.write_json(fp_path, fps)
        _log(f"  {s:<44s} compile {res['compile_s']:6.1f} s  export {res['export_s']:5.1f} s"
             f"  (worker import {res['import_s']:4.1f} s)")

    if todo:
        compile_all(todo, out, jobs, on_done)
    if failures:
        details = "\n".join(f"--- {f['symbol']}\n{f['error']}" for f in failures)
        raise AotError(
            f"{len(failures)} of {len(todo)} object(s) failed to compile:\n{details}\n"
            f"(rerun one alone with {MENU_ENV}=... python -m fa4_jax.aot --out {out} --jobs 1; a companion "
            f"such as fa4_combine_* comes with any variant that launches it, or compile it by symbol with "
            f"fa4_jax.aot.worker.compile_one)"
        )
    return len(todo), len(cached)


def check_menu(menu: list, out: Path) -> dict:
    """Header ABI and CUDA-call checks of every exported object (companions included). Returns
    {symbol: cuda calls}."""
    problems, calls = [], {}
    for v in objects_of(menu):
        s = v.symbol
        problems += [f"{s}.h: {p}" for p in abi.check_header(description_of(v), s, (out / f"{s}.h").read_text())]
        calls[s] = abi.cuda_calls(out / f"{s}.o")
        errors, warnings = abi.capture_problems(s, calls[s])
        problems += errors
        for w in warnings:
            _log(f"warning: {w}")
    if problems:
        raise AotError(
            "exported kernels do not match the ABI their family describes (fa4_jax/ops/<family>/spec.py):\n  "
            + "\n  ".join(problems)
        )
    return calls


def build(out: Path, jobs: int, force: bool = False, request: Path | None = None) -> None:
    t_start = time.perf_counter()
    spec, menu = resolve_menu(request)
    if not menu:
        raise AotError("the variant menu is empty")
    out.mkdir(parents=True, exist_ok=True)
    dsl_version = cache.cutlass_dsl_version()
    n_compiled, n_cached = compile_menu(menu, out, jobs, force, dsl_version)
    calls = check_menu(menu, out)

    families = families_in(menu)
    for fam in families:
        fam_menu = [v for v in menu if family_of(v) is fam]
        cache.write_if_changed(out / family_inc_name(fam), codegen.generate_family_inc(fam, fam_menu, dsl_version))
    cache.write_if_changed(out / REGISTRY_FILE, codegen.generate_registry_inc(families, dsl_version))
    cache.write_if_changed(out / SHARED_FILE, codegen.generate_shared_inc(dsl_version))
    cache.write_if_changed(
        out / MENU_FILE,
        json.dumps(
            {"variants": [v.symbol for v in menu], "fa4_jax_variants": spec,
             "companions": [v.symbol for v in objects_of(menu)[len(menu):]],
             "families": {f.name: f.target for f in families},
             "cutlass_dsl_version": dsl_version, "cuda_calls": calls,
             # Kernels built with experiments (kernels/experiments.py) are not the shipped ones.
             "experiments": list(experiments.active())},
            indent=1, sort_keys=True,
        ) + "\n",
    )
    n_companions = len(objects_of(menu)) - len(menu)
    _log(f"done: {len(menu)} variant(s) and {n_companions} companion(s) ({n_compiled} objects compiled, "
         f"{n_cached} cached) in "
         f"{time.perf_counter() - t_start:.1f} s; families: {', '.join(f.name for f in families)}")


__all__ = ["MENU_FILE", "REGISTRY_FILE", "REQUEST_FILE", "SHARED_FILE", "build", "family_inc_name"]
