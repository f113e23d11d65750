"""The varlen family: `fa4_jax.attention_varlen`."""
