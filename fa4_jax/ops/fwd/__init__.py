"""The dense forward family: `fa4_jax.attention`."""
