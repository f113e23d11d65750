"""fa4_jax: FlashAttention-4-class forward attention for JAX.

    import fa4_jax
    o = fa4_jax.attention(q, k, v, causal=True)   # (batch, seqlen, heads, head_dim), bf16/fp16

On an sm_90 GPU with the built kernel library this runs the AOT-compiled CuTe-DSL kernel through an
XLA FFI custom call; elsewhere it runs the exact pure-JAX reference. Importing needs neither the
kernel library nor cutlass.
"""

from fa4_jax import _ffi
from fa4_jax.attention import attention
from fa4_jax.export import export_safety_checks
from fa4_jax.families import FwdVariant
from fa4_jax.kvcache import attention_with_kvcache, update_kvcache
from fa4_jax.reference import attention_reference, attention_varlen_reference, attention_with_kvcache_reference
from fa4_jax.varlen import attention_varlen

__version__ = "0.1.0"

# Register the kernels' FFI targets with jax now (jax keeps them until its CUDA backend starts; no
# device is touched), so that a deserialized jax.export program that calls them compiles here even
# if nothing else in this process used fa4_jax. Without a loadable library this does nothing.
_ffi.register_targets()

__all__ = [
    "attention", "attention_reference", "attention_varlen", "attention_varlen_reference", "attention_with_kvcache",
    "attention_with_kvcache_reference", "export_safety_checks", "update_kvcache", "FwdVariant", "__version__",
]
