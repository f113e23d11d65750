"""fa4_jax: FlashAttention-4-class forward attention for JAX.

    import fa4_jax
    o = fa4_jax.attention(q, k, v, causal=True)   # (batch, seqlen, heads, head_dim), bf16/fp16

On an sm_90 GPU with the built kernel library this runs the AOT-compiled CuTe-DSL kernel through an
XLA FFI custom call; elsewhere it runs the exact pure-JAX reference. Importing needs neither the
kernel library nor cutlass.

Public API (`fa4_jax.__all__`; inference only, no gradients):
  attention                 dense (batch, seqlen, heads, head_dim) attention
  attention_with_kvcache    new queries against a contiguous or paged KV cache (decode, chunked prefill)
  update_kvcache            writes new keys/values into such a cache
  attention_varlen          packed variable-length batches (cu_seqlens offsets)
  attention_reference, attention_with_kvcache_reference, attention_varlen_reference
                            the exact pure-JAX references, returning (o, lse)
  export_safety_checks      the jax.export checks to disable for programs that call the kernels
  FwdVariant                names one dense forward kernel (arch, dtype, head_dim, mask, softcap)

Submodules:
  fa4_jax.export   exporting programs that call fa4_jax with `jax.export` (imported with fa4_jax)
  fa4_jax.flax     Flax layers: FA4Attention and the drop-in attention_fn dot_product_attention.
                   Optional (`pip install 'fa4-jax[flax]'`): `import fa4_jax` never imports it or
                   flax; `import fa4_jax.flax` does.

The package ships a `py.typed` marker (PEP 561): the public signatures carry type hints.
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

# Exactly the public API (tests/test_public_api.py checks that each name exists, is documented and
# annotated). The submodules fa4_jax.export and fa4_jax.flax are public too, but not re-exported here.
__all__ = [
    "FwdVariant", "__version__", "attention", "attention_reference", "attention_varlen", "attention_varlen_reference",
    "attention_with_kvcache", "attention_with_kvcache_reference", "export_safety_checks", "update_kvcache",
]
