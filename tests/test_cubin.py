"""The build's register-pool check and the cubin reader behind it (fa4_jax/aot/cubin.py), on the
built library's own cubins (CPU-only)."""

from __future__ import annotations

import json
import os

import pytest

from fa4_jax.aot.cubin import cubin_resources, register_pool_problem
from fa4_jax.core import library as _ffi

ATTN = "kernel_cutlass_kernel_fa4_jaxkernelsfwd_sm90FlashAttentionForwardSm90_x"
COMBINE = "kernel_cutlass_combine_fa4_jaxkernelscombineSplitCombine_x"


def test_register_pool_fits_or_names_the_shortfall():
    # tile_m 128: 2 x 240 + 24 registers per thread slot, launched with 168 x 384 = 64512: fits exactly.
    res = {ATTN: {"regs": 168, "frame": 0}, COMBINE: {"regs": 33, "frame": 0}}
    assert register_pool_problem(res, 384, [240, 240, 24], "FlashAttentionForward") is None
    # A 32-register producer needs 65536 > 64512: the consumers would wait forever to rise to 240.
    msg = register_pool_problem(res, 384, [240, 240, 32], "FlashAttentionForward")
    assert msg is not None and "need 65536 registers" in msg and "168 x 384 = 64512" in msg, msg
    # tile_m 64 with a 64-register producer: 240 x 256 holds 240 + 64 per slot.
    assert register_pool_problem({ATTN: {"regs": 240}}, 256, [240, 64], "FlashAttentionForward") is None
    # Only the kernels the budgets belong to count (the combine kernel has no setmaxnreg).
    assert register_pool_problem({COMBINE: {"regs": 33}}, 384, [240, 240, 24], "FlashAttentionForward") is None


@pytest.mark.parametrize("head_dim,packed_rows,regs", [(128, None, 128), (256, None, 168), (128, 128, 168)])
def test_the_build_checks_the_sm100_register_pool_too(monkeypatch, head_dim, packed_rows, regs):
    # The SM100 roles' budgets (two softmax warpgroups: 2 x 208 + 56 + 40 = 4 x 128; one: 248 + 152 +
    # 104 = 3 x 168) must fit the launch allocation as the SM90 ones do, or the kernel hangs: the
    # exporter's check covers both configurations (it skipped SM100's until 2026-12-05).
    import types
    from pathlib import Path

    from fa4_jax.aot import cubin, worker
    from fa4_jax.families import FwdVariant
    from fa4_jax.kernels.config_sm100 import sm100_fwd_config

    cfg = sm100_fwd_config(head_dim, packed_rows=packed_rows)
    kernel = types.SimpleNamespace(cfg=cfg, call=None)
    module = types.SimpleNamespace(make_kernel=lambda variant: types.MethodType(lambda self: None, kernel))
    variant = FwdVariant("sm100", "bf16", head_dim, "causal", False)
    attn = "kernel_cutlass_kernel_fa4_jaxkernelsfwd_sm100FlashAttentionForwardSm100_x"
    monkeypatch.setattr(cubin, "kernel_resources", lambda obj: {attn: {"regs": regs}})
    worker._check_register_pool(module, variant, Path("unused.o"))
    monkeypatch.setattr(cubin, "kernel_resources", lambda obj: {attn: {"regs": regs - 8}})
    with pytest.raises(worker.AotError, match=rf"setmaxnreg budgets \[{', '.join(map(str, cfg.warpgroup_regs))}\]"):
        worker._check_register_pool(module, variant, Path("unused.o"))


@pytest.mark.parametrize("paged", [False, True])
def test_the_build_counts_the_fp8_chunk_tiles_widening_warpgroup(monkeypatch, paged):
    # The FP8 chunk tile's fourth warpgroup (the widening: Sm90FwdConfig.widen_wg) has a budget of its
    # own: 24 + 2 x 224 + 40 (paged 40 + 2 x 216 + 40) = 4 x 128 fill the launch's 128 x 512. Without
    # it the check asked for 472 x 128 and passed a 120-register launch that would hang.
    import types
    from pathlib import Path

    from fa4_jax.aot import cubin, worker
    from fa4_jax.families import KVCacheVariant
    from fa4_jax.kernels.config import kvcache_config

    monkeypatch.delenv("FA4_JAX_EXPERIMENTS", raising=False)
    cfg = kvcache_config(128, 128, paged, True)
    assert (cfg.num_threads, cfg.warpgroup_regs) == (512, (40, 216, 216, 40) if paged else (24, 224, 224, 40))
    kernel = types.SimpleNamespace(cfg=cfg, call=None)
    module = types.SimpleNamespace(make_kernel=lambda variant: types.MethodType(lambda self: None, kernel))
    variant = KVCacheVariant("sm90", "bf16", 128, "local", False, paged=paged, tile_m=128, kv_fp8=True)
    monkeypatch.setattr(cubin, "kernel_resources", lambda obj: {ATTN: {"regs": 128}})
    worker._check_register_pool(module, variant, Path("unused.o"))
    monkeypatch.setattr(cubin, "kernel_resources", lambda obj: {ATTN: {"regs": 120}})
    with pytest.raises(worker.AotError, match=r"need 65536 registers, but the kernel launches with 120 x 512"):
        worker._check_register_pool(module, variant, Path("unused.o"))


def test_library_cubins_are_read():
    """One cubin per variant in the library, each with an attention kernel whose launch registers the
    reader finds (the numbers the build checks every variant's budgets against), and one per companion
    (the KV-cache split combine: fa4_menu.json's "companions"), each with that kernel alone."""
    path = _ffi.library_path()
    if path is None:
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"CI builds the library, yet: {_ffi.library_status()}")
        pytest.skip(f"no kernel library: {_ffi.library_status()}")
    import ctypes
    lib = ctypes.CDLL(str(path))
    lib.fa4_jax_num_variants.restype = ctypes.c_int
    companions = json.loads((path.parent / "fa4_menu.json").read_text())["companions"]
    assert all(c.startswith("fa4_combine_") for c in companions), companions
    cubins = cubin_resources(path)
    assert len(cubins) == lib.fa4_jax_num_variants() + len(companions), (len(cubins), lib.fa4_jax_num_variants())
    combines = 0
    for kernels in cubins:
        attn = [r for name, r in kernels.items() if "FlashAttentionForward" in name]
        if not attn:
            (name, res), = kernels.items()
            assert "SplitCombine" in name and res.get("frame", 0) == 0, kernels
            combines += 1
            continue
        assert len(attn) == 1 and len(kernels) == 1, kernels  # the combine is no longer inside
        assert 24 <= attn[0]["regs"] <= 255, attn
    assert combines == len(companions)
