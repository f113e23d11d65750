"""CuTe-DSL kernels. Build time only: these modules import `nvidia-cutlass-dsl`.

Each kernel family has one entry module whose `compile_variant(variant)` builds the fake tensors of
the family's exported C ABI (fa4_jax/families/) and compiles one variant GPU-blind; the AOT exporter
(fa4_jax.aot) finds it through `KernelFamily.compile`. Shared pieces: `common` (fake tensors, compile
options), `tile_scheduler`, `seqlen`, `block_info`, `mask`, `softmax`, `named_barrier`, `utils`.
"""
