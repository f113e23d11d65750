"""The KV-cache family: `fa4_jax.attention_with_kvcache` and `fa4_jax.update_kvcache`."""
