"""Compiling and exporting variants in worker processes (the only place `cutlass` is imported)."""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path


class AotError(RuntimeError):
    """A build failure with a message meant for the person running the build."""


def compile_one(symbol: str, out_dir: str) -> dict:
    """Compile + export one variant. Returns timings, or the formatted error (exceptions from the
    DSL do not always pickle, so the worker sends text back)."""
    t0 = time.perf_counter()
    try:
        from fa4_jax.families import description_of, variant_from_symbol

        variant = variant_from_symbol(symbol)
        flag = _arch_of(symbol)
        if os.environ.get(DSL_ARCH_ENV, flag) != flag:
            raise AotError(f"{symbol} targets {flag}, but this process's CuTe DSL was set up for "
                           f"{DSL_ARCH_ENV}={os.environ[DSL_ARCH_ENV]}: compile each architecture in its own "
                           "process (compile_all does)")
        _use_arch(flag)  # effective if this process has not imported cutlass yet
        module_name, _, fn_name = description_of(variant).compile.partition(":")
        compile_variant = getattr(importlib.import_module(module_name), fn_name)  # imports cutlass
        t1 = time.perf_counter()
        compiled = compile_variant(variant)
        t2 = time.perf_counter()
        # Export into a private temp dir, then move: a killed build leaves no half-written S.o
        # next to a valid S.h.
        with tempfile.TemporaryDirectory(dir=out_dir, prefix=f".{symbol}.") as tmp:
            compiled.export_to_c(file_path=tmp, file_name=symbol, function_prefix=symbol)
            for ext in (".h", ".o"):
                src = Path(tmp) / f"{symbol}{ext}"
                if not src.is_file():
                    raise AotError(f"export_to_c did not write {src.name}")
            _check_register_pool(importlib.import_module(module_name), variant, Path(tmp) / f"{symbol}.o")
            for ext in (".h", ".o"):
                os.replace(Path(tmp) / f"{symbol}{ext}", Path(out_dir) / f"{symbol}{ext}")
        t3 = time.perf_counter()
        return {"symbol": symbol, "import_s": t1 - t0, "compile_s": t2 - t1, "export_s": t3 - t2}
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim
        return {"symbol": symbol, "error": traceback.format_exc()}


def _check_register_pool(module, variant, obj: Path) -> None:
    """A variant whose warpgroup register budgets exceed its launch allocation would hang on the GPU
    (cubin.register_pool_problem): fail the build instead. The budgets come from the kernel object
    the family's make_kernel builds (its `cfg`), the allocation from the exported cubin."""
    from fa4_jax.aot.cubin import kernel_resources, register_pool_problem

    make_kernel = getattr(module, "make_kernel", None)
    cfg = getattr(getattr(make_kernel(variant), "__self__", None), "cfg", None) if make_kernel else None
    if cfg is None:
        return
    if not hasattr(cfg, "warpgroup_regs"):  # SM90: producer, consumers (, widening); SM100: its roles
        return
    budgets = list(cfg.warpgroup_regs)
    problem = register_pool_problem(kernel_resources(obj), cfg.num_threads, budgets, "FlashAttentionForward")
    if problem:
        raise AotError(f"{variant.symbol}: {problem}")


# The DSL's trace-time target (which instructions its atoms admit: wgmma on sm_90a, tcgen05 on
# sm_100a). In cutlass-dsl 4.8.1 `cute.compile` takes it from the `--gpu-arch` option and reads this
# variable (once, at `import cutlass`) only when the option is empty -- verified GPU-blind: an
# sm_100a tcgen05 kernel compiles with CUTE_DSL_ARCH=sm_90a, and the Hopper objects are identical
# with and without the variable (tools/sm100_probe.py). Each process still compiles one
# architecture and sets the variable to match before it imports cutlass, so that nothing the DSL
# reads at import can disagree with the option. GPU-blind, never from a device query (unset and
# GPU-less, the DSL assumes sm_100a).
DSL_ARCH_ENV = "CUTE_DSL_ARCH"


def _arch_of(symbol: str) -> str:
    from fa4_jax.families import variant_from_symbol
    from fa4_jax.families.base import GPU_ARCH_FLAG

    return GPU_ARCH_FLAG[variant_from_symbol(symbol).arch]


def _use_arch(flag: str) -> None:
    """A worker's initializer: this process compiles for `flag` (before it imports cutlass)."""
    os.environ[DSL_ARCH_ENV] = flag


def by_arch(symbols: list[str]) -> dict[str, list[str]]:
    """The symbols grouped by their --gpu-arch (sm_90a, sm_100a), each group in menu order."""
    groups: dict[str, list[str]] = {}
    for s in symbols:
        groups.setdefault(_arch_of(s), []).append(s)
    return groups


def compile_all(symbols: list[str], out_dir: Path, jobs: int, on_done) -> None:
    groups = by_arch(symbols)
    if len(groups) == 1 and (jobs <= 1 or len(symbols) <= 1):
        (flag,) = groups
        if "cutlass" not in sys.modules or os.environ.get(DSL_ARCH_ENV) == flag:
            # In-process: one variant (the common iteration case) does not pay for a spawned worker
            # re-importing the DSL, and tracebacks/pdb work directly.
            _use_arch(flag)
            for s in symbols:
                on_done(compile_one(s, str(out_dir)))
            return
    # spawn, not fork: the DSL holds MLIR contexts and threads that do not survive fork. One pool
    # per architecture (its workers import cutlass for that target), one after the other.
    ctx = multiprocessing.get_context("spawn")
    for flag, group in groups.items():
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx, initializer=_use_arch,
                                                    initargs=(flag,)) as pool:
            futures = [pool.submit(compile_one, s, str(out_dir)) for s in group]
            try:
                for fut in concurrent.futures.as_completed(futures):
                    on_done(fut.result())
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
