"""Can an fa4_jax kernel run here? The one place that answers it.

The public API asks before choosing the kernel (implementation=None falls back to the XLA reference
when the answer is no; implementation="fa4" raises with the reason); the tests' `gpu` marker and the
examples ask the same functions. "Here" means: the device is a GPU whose compute capability has
kernels (fa4_jax.families.ARCH_CC), the built library has the requested variant, its FFI targets are
registered, and the variant's module actually loads on that device.

FA4_JAX_DISABLE_KERNELS=1 (read on every question, so setting it in a running process works for every
program lowered afterwards) hides the kernels: every answer is then "no", and implementation=None
takes the path of a GPU without kernels (cuDNN where it computes exactly the call, else the reference;
see fa4_jax/core/cudnn.py). For tests and comparisons; the library stays registered for programs that
already call it.
"""

from __future__ import annotations

import functools
import os
from typing import Callable

import warnings

from fa4_jax.families import ARCH_CC, VALIDATED_ARCHES, default_menu

_BUILD_HINT = (
    "Build the kernel library with `pip install .` (or `python tools/build_inplace.py`) on a machine "
    "with the CUDA toolkit, or point FA4_JAX_LIBRARY at a built libfa4_jax.so."
)
DISABLE_KERNELS_ENV = "FA4_JAX_DISABLE_KERNELS"
# "9.0" -> "sm90": jax reports compute capability as "major.minor".
_ARCH_BY_CAPABILITY = {f"{cc // 10}.{cc % 10}": arch for arch, cc in ARCH_CC.items()}


def kernels_disabled() -> bool:
    """FA4_JAX_DISABLE_KERNELS is set to a true value ("1", "true", "yes", "on"; read at every call)."""
    return os.environ.get(DISABLE_KERNELS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def default_device():
    import jax

    return jax.devices()[0]


def device_arch(device) -> str | None:
    """The kernel architecture of `device` ("sm90"), or None for a CPU or an unknown GPU."""
    if getattr(device, "platform", None) != "gpu":
        return None
    return _ARCH_BY_CAPABILITY.get(str(getattr(device, "compute_capability", "")))


@functools.cache  # asked on every call of the API; the menu is fixed
def shipped_arches() -> frozenset[str]:
    """Architectures the default build has kernels for (today: Hopper)."""
    return frozenset(v.arch for v in default_menu())


def _arch_names(arches) -> str:
    names = {"sm90": "9.0 (Hopper)", "sm100": "10.0 (Blackwell)"}
    return ", ".join(names.get(a, a) for a in sorted(arches, key=lambda a: ARCH_CC.get(a, 0)))


def device_unavailable_reason(device) -> str | None:
    """None when `device` is a GPU of an architecture the default build ships kernels for."""
    capability = getattr(device, "compute_capability", None)
    if getattr(device, "platform", None) != "gpu" or capability is None:
        return (
            f"the default device is {getattr(device, 'platform', '?')!r} ({getattr(device, 'device_kind', '?')}), "
            'not an NVIDIA Hopper GPU; use implementation="xla" or None'
        )
    arch = device_arch(device)
    if arch not in shipped_arches():
        return (
            f"the default GPU ({device.device_kind}) has compute capability {capability}; the fa4_jax kernels "
            f'are built for {_arch_names(shipped_arches())} only; use implementation="xla" or None'
        )
    return None


def unvalidated_reason(device) -> str | None:
    """None when `device`'s kernels have been validated on hardware (families.VALIDATED_ARCHES), else
    why implementation=None does not pick them. implementation="fa4" still runs them (with
    warn_unvalidated)."""
    arch = device_arch(device)
    if arch is None or arch in VALIDATED_ARCHES:
        return None
    return (f"the fa4_jax kernels for compute capability {_arch_names([arch])} have not been validated on hardware "
            'yet; implementation="fa4" runs them (checking them against implementation="xla" is advised)')


@functools.cache  # once per architecture and process
def warn_unvalidated(arch: str) -> None:
    """implementation="fa4" on an architecture whose kernels no run on hardware has validated yet."""
    warnings.warn(f"fa4_jax: the {_arch_names([arch])} kernels are compiled but have not been validated on "
                  'hardware yet; compare their results with implementation="xla" before relying on them '
                  "(tools/validate_sm100.py)", RuntimeWarning, stacklevel=3)


def unavailable_reason(make_variant: Callable[[str], object], device=None) -> str | None:
    """None when the kernel `make_variant(arch)` can serve a call on `device` (default: jax's
    default device); otherwise a sentence saying why not and what to do."""
    device = default_device() if device is None else device
    reason = device_unavailable_reason(device)
    if reason is not None:
        return reason
    variant = make_variant(device_arch(device))
    reason = _variant_reason(variant)
    if reason is not None:
        return reason
    from fa4_jax.core import library

    if not library.register_targets():
        return f"registering the FFI targets failed: {library.library_status()}"
    ordinal = getattr(device, "local_hardware_id", None)
    problem = library.prepare_variant(variant, device.id if ordinal is None else ordinal)
    if problem is not None:
        return f"the kernel {variant.symbol} does not load on {device.device_kind} (device {device.id}): {problem}"
    return None


def _variant_reason(variant) -> str | None:
    """None when the kernel library holds `variant`, else why not."""
    if kernels_disabled():
        return f"the fa4_jax kernels are hidden by {DISABLE_KERNELS_ENV}={os.environ[DISABLE_KERNELS_ENV]}"
    try:
        from fa4_jax.core import library
    except ImportError as e:
        return f"the FFI loader fa4_jax.core.library cannot be imported ({e}). {_BUILD_HINT}"
    built = library.compiled_variants()
    if not built:  # library missing or unloadable; library_status() says which and what to do
        return f"the kernel library is unavailable: {library.library_status()}"
    if variant not in built:
        same_family = sorted(v.symbol for v in built if type(v) is type(variant))
        return (
            f"the kernel library has no variant {variant.symbol} (it has {len(same_family)} of its family: "
            f"{', '.join(same_family)}). Rebuild with that variant in FA4_JAX_VARIANTS (unset means the "
            f"full default menu). {_BUILD_HINT}"
        )
    return None


def library_reason(make_variant: Callable[[str], object]) -> str | None:
    """None when the kernel library holds `make_variant(arch)` for an architecture it ships: what a
    program can be built with when its target GPU is not known (e.g. exported from a CPU host)."""
    reasons = [_variant_reason(make_variant(arch)) for arch in sorted(shipped_arches())]
    return None if None in reasons else reasons[0]


def lowering_reason(make_variant: Callable[[str], object], devices) -> str | None:
    """None when a program lowered for CUDA onto `devices` can use the kernel `make_variant(arch)`.

    GPUs among `devices` (jax.jit on this host) must each run it (unavailable_reason). Without
    GPUs (jax.export, or exporting for CUDA from a CPU host, whose devices are CPUs) only the library
    is asked; the FFI handler checks the device when the program runs."""
    gpus = [d for d in devices if getattr(d, "platform", None) == "gpu"]
    for device in gpus:
        reason = unavailable_reason(make_variant, device)
        if reason is not None:
            return reason
    return None if gpus else library_reason(make_variant)
