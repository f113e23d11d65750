"""CuTe-DSL kernels. Build time only: these modules import `nvidia-cutlass-dsl`.

Each kernel family has one entry module (fwd, varlen, kvcache) whose `compile_variant(variant)` builds
the fake tensors of the family's exported C ABI (fa4_jax/ops/<family>/spec.py) and compiles one variant
GPU-blind; the AOT exporter (fa4_jax.aot) finds it through `KernelFamily.compile`. The KV-cache
family's split combine has an entry of its own (combine: one object per arch, dtype and head dim,
`Companion.compile`). Every family is
one configuration of one forward kernel per architecture (fwd_sm90; fwd_sm100 on Blackwell, with
config_sm100 and exp2_fma), switched at its seams (seams.py): `tile_problem` and `seqlen` (sequence
lengths), `loaders` (Q, K/V), `tile_scheduler` (with `tile_order`, its plain arithmetic),
`epilogue_sm90`, `split_epilogue` and `split_merge` (O). Shared pieces: `common` (fake tensors, compile options), `config`, `block_info`, `mask`,
`softmax`, `named_barrier`, `utils`.
"""
