"""One package per kernel family's JAX side: <family>/api.py (the public function), primitive.py
(the primitive: abstract eval, vmap, lowering), sharding.py (the sharding rule), reference.py (the exact
pure-JAX reference), spec.py (the family's description: variant, kernel ABI, FFI call signature, menu;
registered in fa4_jax/families/__init__.py)."""
