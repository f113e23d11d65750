"""How every per-shard primitive (fa4_*_local) lowers: the kernel, cuDNN or the reference, per platform.

The choice is made here, at lowering time, for the platform being lowered for, not when the call is
traced. So one traced program serves every target: `jax.jit` on a Hopper GPU emits the kernel, on a
CPU the reference, and `jax.export(..., platforms=("cpu", "cuda"))` on any host carries both.

The primitive's `implementation` param:
- "xla": the reference everywhere.
- "auto" (the API's implementation=None): on CUDA the kernel when it can serve the call, else cuDNN
  when it computes exactly the call on the target GPUs (fa4_jax/core/cudnn.py), else the reference; on
  every other platform the reference.
- "fa4": the kernel, or a clear error while lowering (never a silent fallback).
- "cudnn": jax's cuDNN flash attention, or a clear error while lowering.

"Can serve the call" (fa4_jax.core.platform.lowering_reason): when the lowering targets devices of this
process that are GPUs (jax.jit on a GPU host), each must be a supported GPU on which the variant's
module loads; when it targets none (jax.export, or export for CUDA from a CPU host) the kernel
library must hold the variant, and the FFI handler checks the GPU when the program runs (an
unsupported device gets an FFI error naming it). cuDNN is chosen for "auto" only when the target
GPUs are known (its conditions depend on the GPU and the cuDNN version): a program lowered without
them keeps the kernel-or-reference choice.

Kernel calls are lowered inside `jax.named_scope(EXPORT_HINT)`: the scope becomes part of the custom
call's location, which jax.export prints next to each custom call it refuses, so the error names
`fa4_jax.export_safety_checks()`. It changes nothing else (same call, same attributes).
"""

from __future__ import annotations

from typing import Callable

import jax

from fa4_jax.core import compat, cudnn, platform
from fa4_jax.export import EXPORT_HINT


def target_devices(ctx) -> tuple:
    """The devices the module being lowered will run on, as far as the lowering knows them: the
    device assignment of a jit (jax passes it for primitives that require devices while lowering,
    as ours do), the mesh of a partitioned or shard_map body; () when unknown."""
    axis_context = ctx.module_context.axis_context
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None:
        mesh = getattr(axis_context, "mesh", None)
        devices = getattr(mesh, "devices", None)
        devices = () if devices is None else tuple(getattr(devices, "flat", devices))
    return tuple(devices)


def _with_export_hint(kernel: Callable) -> Callable:
    def kernel_in_scope(*operands, **params):
        with jax.named_scope(EXPORT_HINT):
            return kernel(*operands, **params)

    return kernel_in_scope


def _no_variant_reason(entry: str, make_variant: Callable[[str], object]) -> str | None:
    """Why no kernel variant exists for the call (e.g. a head_dim its family is not built for), or None.
    A variant dataclass refuses unsupported fields with ValueError/TypeError."""
    for arch in sorted(platform.shipped_arches()):
        try:
            make_variant(arch)
        except (ValueError, TypeError) as e:
            return f"the {entry} kernels do not cover this call ({e})"
    return None


def register_local_lowerings(local_prim, *, reference: Callable, kernel: Callable, variant: Callable,
                             is_empty: Callable, shape_reason: Callable | None = None,
                             cudnn_entry: str | None = None) -> None:
    """Lowering rules of a per-shard primitive.

    reference(*operands, **params) / kernel(*operands, **params): the two bodies (traceable).
    cudnn_entry: the public entry point the primitive serves, which names its cuDNN mapping
      (fa4_jax/core/cudnn.py; None = the family has none) and its kernels in error messages.
    variant(arch, dtype, head_dim, params): the kernel variant the call needs on `arch` (the
      primitive's kernel_variant; dtype and head_dim are those of the first operand, q).
    is_empty(avals_in, params): a zero-size problem, which the reference answers without a launch.
    shape_reason(avals_in, params): optional; why the kernel cannot take these shapes (e.g. a symbolic
      dimension it needs as a static bound), or None."""
    entry = cudnn_entry or local_prim.name
    reference_lowering = compat.lower_fun(reference, multiple_results=True)
    kernel_lowering = compat.lower_fun(_with_export_hint(kernel), multiple_results=True)
    cudnn_body = cudnn.body(cudnn_entry) if cudnn_entry else None
    cudnn_lowering = None if cudnn_body is None else compat.lower_fun(cudnn_body, multiple_results=True)

    def other_platforms(ctx, *operands, **params):
        implementation = params["implementation"]
        if implementation in ("fa4", "cudnn"):
            # (a multi-platform lowering calls this rule for every platform but CUDA)
            platforms = ", ".join(p for p in ctx.module_context.platforms if p != "cuda")
            target = "an NVIDIA Hopper GPU (CUDA)" if implementation == "fa4" else "an NVIDIA GPU (CUDA)"
            raise RuntimeError(
                f'implementation="{implementation}" cannot run here: the program is lowered for {platforms}, not '
                f'{target}. Use implementation=None (the kernel or cuDNN on CUDA, the reference elsewhere) or "xla"')
        return reference_lowering(ctx, *operands, **params)

    def cuda(ctx, *operands, **params):
        implementation = params["implementation"]
        if implementation == "xla":
            return reference_lowering(ctx, *operands, **params)
        devices = target_devices(ctx)
        if implementation == "cudnn":
            reason = cudnn.cudnn_reason(entry, ctx.avals_in, params)
            if reason is None:
                # Without known target GPUs, jax's cuDNN checks read this process's GPU.
                gpus = [d for d in devices if getattr(d, "platform", None) == "gpu"] or cudnn.local_cuda_gpus()
                reason = cudnn.device_reason(gpus, ctx.avals_in[0].shape[-1])
            if reason is not None:
                raise RuntimeError(f'implementation="cudnn" cannot run here: {reason}')
            return cudnn_lowering(ctx, *operands, **params)
        if is_empty(ctx.avals_in, params):
            return reference_lowering(ctx, *operands, **params)
        q = ctx.avals_in[0]
        make_variant = lambda arch: variant(arch, q.dtype, q.shape[-1], params)  # noqa: E731
        reason = ((shape_reason and shape_reason(ctx.avals_in, params)) or _no_variant_reason(entry, make_variant)
                  or platform.lowering_reason(make_variant, devices))
        unvalidated = [platform.device_arch(d) for d in devices if platform.unvalidated_reason(d) is not None]
        if reason is None and unvalidated and implementation != "fa4":
            # Kernels no hardware run has validated yet are opt-in (families.VALIDATED_ARCHES).
            reason = platform.unvalidated_reason(next(d for d in devices if platform.unvalidated_reason(d)))
        if reason is None:
            for arch in sorted(set(unvalidated)):
                platform.warn_unvalidated(arch)
            return kernel_lowering(ctx, *operands, **params)
        if implementation == "fa4":
            raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
        if cudnn_lowering is not None and cudnn.auto_reason(entry, ctx.avals_in, params, devices) is None:
            return cudnn_lowering(ctx, *operands, **params)
        return reference_lowering(ctx, *operands, **params)

    compat.register_lowering(local_prim, other_platforms)
    compat.register_lowering(local_prim, cuda, platform="cuda")
