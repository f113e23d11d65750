"""How a call's `implementation` argument becomes the primitive's param ("fa4", "cudnn", "xla" or
"auto"), checked as far as it can be at the call; shared by every family's public function."""

from __future__ import annotations

from typing import Literal

from fa4_jax.core import cudnn, platform

# The public entry points' `implementation` argument (None: the kernel where it can run, else cuDNN
# where it computes exactly the call on a GPU, else the reference).
Implementation = Literal["fa4", "cudnn", "xla"]


def trim_window(left: int, right: int, s_q, s_k) -> tuple[int, int]:
    """A side that reaches past every key is unbounded: (left >= s_k - 1) sees key 0 from every row,
    (right >= s_q - 1) sees key s_k - 1. Unbounded sides let the plain or causal kernel serve the
    call instead of the windowed one (same result, no per-element window test)."""
    if isinstance(s_k, int) and left >= max(s_k - 1, 0):
        left = -1
    if isinstance(s_q, int) and right >= max(s_q - 1, 0):
        right = -1
    return left, right


def resolve_implementation(implementation, variant, cudnn_call: tuple | None = None) -> str:
    """Maps the user's choice to the primitive's param: "xla", "fa4", "cudnn" or "auto" (None).

    "auto" is decided per platform when the program is lowered (fa4_jax/core/lowering.py), so a program
    traced on a CPU host and exported for CUDA carries the kernel. "fa4" is checked now as far as it
    can be: on a GPU default device everything (device, library, module load: see fa4_jax.core.platform),
    elsewhere (tracing for export) that the library holds the kernel `variant(arch)`; lowering it for
    a platform without the kernel raises. "cudnn" likewise: `cudnn_call` = (entry point, operands,
    primitive params) must map exactly onto cuDNN (ValueError otherwise), and a GPU default device
    must run it (RuntimeError otherwise)."""
    if implementation == "xla":
        return "xla"
    if implementation is None:
        return "auto"
    if implementation == "cudnn":
        return _resolve_cudnn(*cudnn_call)
    if implementation != "fa4":
        raise ValueError(f'implementation must be None, "fa4", "cudnn" or "xla"; got {implementation=}')
    device = platform.default_device()
    if getattr(device, "platform", None) == "gpu":
        reason = platform.unavailable_reason(variant, device)
    else:
        reason = platform.library_reason(variant)
    if reason is not None:
        raise RuntimeError(f'implementation="fa4" cannot run here: {reason}')
    if getattr(device, "platform", None) == "gpu" and platform.unvalidated_reason(device) is not None:
        platform.warn_unvalidated(platform.device_arch(device))
    return "fa4"


def _resolve_cudnn(entry: str, operands: tuple, params: dict) -> str:
    reason = cudnn.cudnn_reason(entry, operands, params)
    if reason is not None:
        raise ValueError(f'implementation="cudnn" cannot express this call: {reason}. Use implementation=None '
                         '(the kernel, cuDNN or the reference, whichever computes it here) or "xla"')
    device = platform.default_device()
    if getattr(device, "platform", None) == "gpu":
        reason = cudnn.device_reason([device], operands[0].shape[-1])
        if reason is not None:
            raise RuntimeError(f'implementation="cudnn" cannot run here: {reason}')
    return "cudnn"
