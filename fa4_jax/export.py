"""Exporting programs that call fa4_jax (`jax.export`), on any host, for any platform.

    exported = jax.export.export(jax.jit(step), platforms=("cpu", "cuda"),
                                 disabled_checks=fa4_jax.export_safety_checks())(*arg_specs)
    blob = exported.serialize()                       # on a CPU build host, say
    ...
    import fa4_jax                                    # on the serving host: registers the kernels
    jax.export.deserialize(blob).call(*args)

With implementation=None the kernel-or-reference choice is made per platform while lowering (see
fa4_jax/core/lowering.py): the CUDA branch calls the kernel when the kernel library of the exporting host
holds it, every other platform gets the reference. The CUDA program names the kernels only by their
FFI target (one per kernel family, versioned with its ABI: `fa4_jax_fwd_v4`, ...), which the
serving host's `import fa4_jax` registers from its own library; the handler picks the variant for the
GPU it runs on and returns an FFI error naming the device if that GPU has no kernels.

Forgetting `disabled_checks` makes jax.export refuse the kernel calls; its error lists each refused
call with its location, and fa4_jax lowers every kernel call inside `jax.named_scope(EXPORT_HINT)`,
so that location reads "fa4_jax: jax.export needs disabled_checks=fa4_jax.export_safety_checks()".

A program that uses cuDNN (implementation="cudnn", or None on a GPU without our kernels: see
fa4_jax/core/cudnn.py) calls jax's `__cudnn$fmha*` custom calls, which jax does not guarantee stable
either; exporting it needs `jax.export.DisabledSafetyCheck.custom_call(...)` for those targets too.
implementation=None never picks cuDNN while exporting (the target GPU is not known then).
"""

from __future__ import annotations

import jax

from fa4_jax.families import FAMILIES

__all__ = ["export_safety_checks", "ffi_targets"]

# The name scope of every kernel call (fa4_jax/core/lowering.py): it shows in jax.export's error.
EXPORT_HINT = "fa4_jax: jax.export needs disabled_checks=fa4_jax.export_safety_checks()"


def ffi_targets() -> tuple[str, ...]:
    """The FFI custom-call targets an exported fa4_jax program may contain (one per kernel family)."""
    return tuple(family.target for family in FAMILIES)


def export_safety_checks() -> tuple[jax.export.DisabledSafetyCheck, ...]:
    """The `jax.export.DisabledSafetyCheck`s a program calling fa4_jax kernels needs: jax refuses to
    export custom calls it does not know unless told they are stable; ours are (versioned targets).
    Pass them as `jax.export.export(..., disabled_checks=fa4_jax.export_safety_checks())`."""
    return tuple(jax.export.DisabledSafetyCheck.custom_call(target) for target in ffi_targets())
