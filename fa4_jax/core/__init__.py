"""Machinery every kernel family's JAX side shares: the kernel library (library), platform and
device checks (platform), argument validation (validation), the implementation choice
(implementation), primitives (primitive), the FFI call (ffi_call), lowering per platform (lowering),
sharding (partitioning), the cuDNN fallback (cudnn), the exact reference (reference) and jax
version shims (compat)."""
