"""When a GPU test may skip: the one place that decides (used by tests/conftest.py and the GPU tests).

A GPU run must not go green on a broken setup. On a GPU host (an NVIDIA GPU is present: /dev/nvidia0
exists or `nvidia-smi -L` lists one), or anywhere with FA4_JAX_REQUIRE_GPU=1,
- jax without a working GPU backend (jax.devices("gpu") raises: a CPU-only jaxlib, a CUDA plugin that
  failed to initialise) fails every `gpu` test;
- with FA4_JAX_REQUIRE_GPU=1, a GPU the kernels are not built for (neither Hopper nor Blackwell) fails
  them too (on a plain GPU host it skips them: nothing there can run the kernels);
- a missing or empty kernel library fails every test that needs a kernel (`kernel_variants`);
- a variant of the default menu missing from the library fails the test that needs it
  (`require_variant`), unless the library was built from an explicitly narrowed menu (FA4_JAX_VARIANTS
  at build time, recorded in the library's fa4_menu.json), or the GPU's architecture has no kernel of
  that kind (no kernels of the family at all, or -- FP8 KV caches and the short-problem dense tile,
  which only Hopper has -- not this one, which another architecture has) -- the reasons a kernel case
  may skip; the skip reason names which.

GPU tests name the variants they need with `device_arch()` (the GPU's kernel architecture), so the
same tests run on Hopper and on Blackwell; `validated()` says whether implementation=None may pick
the kernels there (fa4_jax.families.VALIDATED_ARCHES).
Without a GPU (a CPU-only CI host) every `gpu` test skips with what was found.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REQUIRE_ENV = "FA4_JAX_REQUIRE_GPU"
MENU_FILE = "fa4_menu.json"  # written next to the library by the exporter (fa4_jax/aot/build.py)


@functools.cache
def gpu_host() -> str | None:
    """Why this host must run the GPU tests (a sentence), or None."""
    if os.environ.get(REQUIRE_ENV, "") == "1":
        return f"{REQUIRE_ENV}=1"
    if Path("/dev/nvidia0").exists():
        return "an NVIDIA GPU is present (/dev/nvidia0)"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        if "GPU " in out:
            return f"an NVIDIA GPU is present (nvidia-smi -L: {out.splitlines()[0].strip()})"
    return None


@functools.cache
def gpu_status() -> tuple[str, str | None]:
    """("run", None), ("skip", reason) or ("fail", reason) for every `gpu` test of this process."""
    import jax

    from fa4_jax.core import platform as _platform

    host = gpu_host()
    required = os.environ.get(REQUIRE_ENV, "") == "1"
    try:
        devices = jax.devices("gpu")
        problem = None if devices else "jax lists no GPU device"
    except RuntimeError as e:  # CPU-only jaxlib, JAX_PLATFORMS without cuda, or a CUDA plugin that failed
        devices, problem = [], f"jax.devices('gpu') raised RuntimeError: {e}"
    if problem is not None:
        if host is None:
            return "skip", f"no CUDA GPU visible to jax (default backend {jax.default_backend()!r}; {problem})"
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if platforms and not required and not {"cuda", "gpu"} & set(platforms.split(",")):
            return "skip", f"JAX_PLATFORMS={platforms!r} excludes the GPU on this GPU host"
        return "fail", (f"GPU run on a broken setup: {host}, but {problem}. Install jax with its CUDA plugin "
                        f"(pip install 'jax[cuda12]') or fix the driver; a GPU host must not skip the GPU tests.")
    reason = _platform.device_unavailable_reason(devices[0])
    if reason is None:
        return "run", None
    return ("fail" if required else "skip"), reason


@functools.cache
def library_menu() -> tuple[str, str]:
    """(spec, where): the FA4_JAX_VARIANTS the library was built with ("" = the full default menu) and
    where that was read."""
    from fa4_jax.core import library
    from fa4_jax.families import MENU_ENV

    path = library.library_path()
    menu_file = None if path is None else path.parent / MENU_FILE
    if menu_file is not None and menu_file.is_file():
        spec = json.loads(menu_file.read_text()).get("fa4_jax_variants", "") or ""
        return spec.strip(), str(menu_file)
    # No menu file (a library from elsewhere, FA4_JAX_LIBRARY): only the environment can narrow it.
    return os.environ.get(MENU_ENV, "").strip(), f"${MENU_ENV} (no {MENU_FILE} next to {path})"


def kernel_variants() -> frozenset:
    """The library's variants, FFI targets registered; fails the test when there is no usable library."""
    from fa4_jax.core import library

    registered = library.register_targets()
    built = library.compiled_variants()
    if not built:
        pytest.fail(f"GPU run without the kernel library: {library.library_status()}. Build it (pip install . or "
                    "python tools/build_inplace.py) or point FA4_JAX_LIBRARY at libfa4_jax.so.", pytrace=False)
    if not registered:
        pytest.fail(f"the kernel library's FFI targets did not register: {library.library_status()}", pytrace=False)
    return built


def require_variant(built, variant) -> None:
    """Returns when the library has `variant`; skips only when a narrowed menu left it out; fails otherwise."""
    if variant in built:
        return
    from fa4_jax.families import MENU_ENV, default_menu, family_of, menu_from_env

    family = family_of(variant)
    if not any(v.arch == variant.arch and family_of(v) is family for v in default_menu()):
        # The device's architecture has no kernels of this family yet; the call would take cuDNN or the
        # reference, which the cuDNN tests cover.
        pytest.skip(f"no {family.name} kernels for {variant.arch} in the default menu yet: {variant.symbol}")
    if variant not in default_menu():
        kin = [v for v in default_menu() if dataclasses.replace(v, arch=variant.arch) == variant]
        if kin:
            # Another architecture has this kind of kernel, the device's not yet (FP8 caches: Hopper
            # only, spec.FP8_ARCHES); the call would take the reference.
            pytest.skip(f"{variant.symbol}: {variant.arch} has no kernel of this kind yet ({kin[0].symbol} is "
                        f"{kin[0].arch}'s)")
        pytest.fail(f"{variant.symbol} is not in the default menu: the test asks for a kernel no build has",
                    pytrace=False)
    spec, where = library_menu()
    if not spec:
        pytest.fail(f"the kernel library lacks {variant.symbol}, a variant of the default menu, and was built with "
                    f"the full menu ({where}): a broken build", pytrace=False)
    if variant in menu_from_env({MENU_ENV: spec}):
        pytest.fail(f"the kernel library lacks {variant.symbol} although its narrowed menu {MENU_ENV}={spec!r} "
                    f"({where}) has it: a broken build", pytrace=False)
    pytest.skip(f"narrowed menu: {variant.symbol} not built ({MENU_ENV}={spec!r}, {where})")


@functools.cache
def device_arch() -> str:
    """The kernel architecture ("sm90", "sm100") of the GPU the tests run on: the arch of the variants
    a GPU test asks for."""
    import jax

    from fa4_jax.core import platform as _platform

    arch = _platform.device_arch(jax.devices("gpu")[0])
    if arch is None:
        pytest.fail(f"no kernel architecture for {jax.devices('gpu')[0].device_kind}", pytrace=False)
    return arch


def validated() -> bool:
    """Whether implementation=None picks the kernels on this GPU (validated on hardware); elsewhere only
    implementation="fa4" runs them (opt-in, with a warning)."""
    from fa4_jax.families import VALIDATED_ARCHES

    return device_arch() in VALIDATED_ARCHES
