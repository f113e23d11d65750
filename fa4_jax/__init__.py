"""fa4_jax: FlashAttention-4-class forward attention for JAX.

    import fa4_jax
    o = fa4_jax.attention(q, k, v, causal=True)   # (batch, seqlen, heads, head_dim), bf16/fp16

On an sm_90 GPU with the built kernel library this runs the AOT-compiled CuTe-DSL kernel through an
XLA FFI custom call; elsewhere it runs the exact pure-JAX reference. Importing needs neither the
kernel library nor cutlass.
"""

from fa4_jax.attention import attention
from fa4_jax.reference import attention_reference
from fa4_jax.families import FwdVariant

__version__ = "0.1.0"

__all__ = ["attention", "attention_reference", "FwdVariant", "__version__"]
