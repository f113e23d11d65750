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
  fa4_jax.support  the support matrix: what runs the kernel, cuDNN or the reference, per GPU

Inside (see BUILD.md, "Layout"): fa4_jax.ops.<family> holds each kernel family's JAX side (public
function, primitive, sharding rule, reference), fa4_jax.core the machinery they share,
fa4_jax.families the family descriptions' registry, fa4_jax.kernels and fa4_jax.aot the build.

The package ships a `py.typed` marker (PEP 561): the public signatures carry type hints.
"""

from fa4_jax.core import library
from fa4_jax.export import export_safety_checks
from fa4_jax.families import FwdVariant
from fa4_jax.ops.fwd.api import attention
from fa4_jax.ops.fwd.reference import attention_reference
from fa4_jax.ops.kvcache.api import attention_with_kvcache, update_kvcache
from fa4_jax.ops.kvcache.reference import attention_with_kvcache_reference
from fa4_jax.ops.varlen.api import attention_varlen
from fa4_jax.ops.varlen.reference import attention_varlen_reference

__version__ = "0.1.0"

# Register the kernels' FFI targets with jax now (jax keeps them until its CUDA backend starts; no
# device is touched), so that a deserialized jax.export program that calls them compiles here even
# if nothing else in this process used fa4_jax. Without a loadable library this does nothing.
library.register_targets()

# Exactly the public API (tests/test_public_api.py checks that each name exists, is documented and
# annotated). The submodules fa4_jax.export and fa4_jax.flax are public too, but not re-exported here.
__all__ = [
    "FwdVariant", "__version__", "attention", "attention_reference", "attention_varlen", "attention_varlen_reference",
    "attention_with_kvcache", "attention_with_kvcache_reference", "export_safety_checks", "update_kvcache",
]
