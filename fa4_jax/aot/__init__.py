"""Build-time AOT exporter: CuTe-DSL kernels -> object files + the generated C++ tables.

    python -m fa4_jax.aot --out DIR [--jobs N] [--force]      # what CMake runs
    python -m fa4_jax.aot --list                               # the menu

Modules, one concern each:
  build     the driver: menu -> cache -> compile -> check -> generate
  cache     the object cache (fingerprints of kernel sources, variant, family ABI, DSL version)
  worker    compiling and exporting one variant in a worker process (imports `cutlass`)
  abi       checking each exported header against its family's ABI, and its CUDA calls
  codegen   fa4_<family>.inc (params, key, thunks, dispatch table) and fa4_registry.inc
  cmake     what CMakeLists.txt needs from Python, in one interpreter start

Nothing in the runtime package imports this package or fa4_jax.kernels.
"""
