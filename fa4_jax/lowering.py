"""How every per-shard primitive (fa4_*_local) lowers: the kernel or the reference, per platform.

The choice is made here, at lowering time, for the platform being lowered for, not when the call is
traced. So one traced program serves every target: `jax.jit` on a Hopper GPU emits the kernel, on a
CPU the reference, and `jax.export(..., platforms=("cpu", "cuda"))` on any host carries both.

The primitive's `implementation` param:
- "xla": the reference everywhere.
- "auto" (the API's implementation=None): on CUDA the kernel when it can serve the call, else the
  reference; on every other platform the reference.
- "fa4": the kernel, or a clear error while lowering (never a silent fallback).

"Can serve the call" (fa4_jax._platform.lowering_reason): when the lowering targets devices of this
process that are GPUs (jax.jit on a GPU host), each must be a supported GPU on which the variant's
module loads; when it targets none (jax.export, or export for CUDA from a CPU host) the kernel
library must hold the variant, and the FFI handler checks the GPU when the program runs (an
unsupported device gets an FFI error naming it).
"""

from __future__ import annotations

from typing import Callable

from fa4_jax import _compat, _platform


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


def register_local_lowerings(local_prim, *, reference: Callable, kernel: Callable,
                             variant: Callable, is_empty: Callable) -> None:
    """Lowering rules of a per-shard primitive.

    reference(*operands, **params) / kernel(*operands, **params): the two bodies (traceable).
    variant(arch, dtype, head_dim, params): the kernel variant the call needs on `arch` (the
      primitive's kernel_variant; dtype and head_dim are those of the first operand, q).
    is_empty(avals_in, params): a zero-size problem, which the reference answers without a launch."""
    reference_lowering = _compat.lower_fun(reference, multiple_results=True)
    kernel_lowering = _compat.lower_fun(kernel, multiple_results=True)

    def other_platforms(ctx, *operands, **params):
        if params["implementation"] == "fa4":
            # (a multi-platform lowering calls this rule for every platform but CUDA)
            platforms = ", ".join(p for p in ctx.module_context.platforms if p != "cuda")
            raise RuntimeError(
                f'implementation="fa4" cannot run here: the program is lowered for {platforms}, not an NVIDIA '
                'Hopper GPU (CUDA). Use implementation=None (the kernel on CUDA, the reference elsewhere) or "xla"')
        return reference_lowering(ctx, *operands, **params)

    def cuda(ctx, *operands, **params):
        implementation = params["implementation"]
        if implementation == "xla" or is_empty(ctx.avals_in, params):
            return reference_lowering(ctx, *operands, **params)
        q = ctx.avals_in[0]
        reason = _platform.lowering_reason(lambda arch: variant(arch, q.dtype, q.shape[-1], params),
                                           target_devices(ctx))
        if reason is None:
            return kernel_lowering(ctx, *operands, **params)
        if implementation == "fa4":
            raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
        return reference_lowering(ctx, *operands, **params)

    _compat.register_lowering(local_prim, other_platforms)
    _compat.register_lowering(local_prim, cuda, platform="cuda")
