"""The SM90 tile configurations (fa4_jax/kernels/config.py) on the CPU: every KV-cache configuration
of the menu (and the dense short-problem tile) fits the SM's shared memory and registers as many
times as it asks to be resident, and a configuration that would not is refused with the reason."""

from __future__ import annotations

import itertools

import pytest

from fa4_jax.kernels.config import SM90_REGS, SM90_SMEM_BYTES, Sm90FwdConfig, kvcache_config
from fa4_jax.ops.fwd.spec import HEAD_DIMS
from fa4_jax.ops.kvcache.spec import TILE_MS


@pytest.mark.parametrize("hd,tile_m,paged", list(itertools.product(HEAD_DIMS, TILE_MS, (False, True))))
def test_kvcache_configs_fit_their_residency(hd, tile_m, paged):
    cfg = kvcache_config(hd, tile_m, paged)
    ctas = cfg.ctas_per_sm
    # Each resident CTA also takes 1 KB the hardware reserves.
    assert ctas * (cfg.smem_bytes + 1024) <= SM90_SMEM_BYTES + 1024  # 228 KB per SM
    regs = 128 * (cfg.num_consumer_wg * cfg.consumer_regs + cfg.producer_regs)
    assert ctas * regs <= SM90_REGS
    assert cfg.stages >= 2, "decode needs K/V loads in flight behind the block being computed"


def test_hd128_decode_runs_two_ctas_per_sm():
    cfg = kvcache_config(128, 64, False)
    assert (cfg.ctas_per_sm, cfg.tile_n, cfg.stages, cfg.consumer_regs, cfg.producer_regs) == (2, 64, 2, 232, 24)
    # Launch registers 65536 / (2 x 256) = 128: the warpgroup budgets must sum to exactly that pool.
    assert cfg.consumer_regs + cfg.producer_regs == 2 * SM90_REGS // (2 * cfg.num_threads)
    paged = kvcache_config(128, 64, True)
    # The paged producer keeps 40 (it spills at 24); three stages fill the 113 KB of half an SM exactly.
    assert (paged.ctas_per_sm, paged.tile_n, paged.stages, paged.consumer_regs, paged.producer_regs) == \
        (2, 64, 3, 216, 40)
    assert paged.consumer_regs + paged.producer_regs == 2 * SM90_REGS // (2 * paged.num_threads)
    assert 2 * (paged.smem_bytes + 1024) == 228 * 1024
    assert kvcache_config(128, 128, False).ctas_per_sm == 1
    assert kvcache_config(128, 128, True).ctas_per_sm == 1


def test_two_ctas_per_sm_refuse_more_than_half_the_shared_memory():
    with pytest.raises(ValueError, match=r"tiles need self.smem_bytes=\d+ > 115712 bytes of smem \(2 CTAs per SM\)"):
        Sm90FwdConfig(128, 64, 64, 4, 232, 24, False, False, o_staging=False, ctas_per_sm=2)
    with pytest.raises(ValueError, match="register budget exceeded"):
        Sm90FwdConfig(128, 64, 64, 2, 240, 24, False, False, o_staging=False, ctas_per_sm=2)


def test_dense_short_tile_variants_and_config():
    """The dense family's short-problem tile (ops/fwd/spec.py SHORT_TILE_*): a variant field with its own
    symbol, built for sm90 hd64 causal only, two CTAs of one 64-row consumer warpgroup per SM with a
    separate O buffer; every other dense variant keeps its head dim's default tile."""
    from dataclasses import replace

    from fa4_jax.families import FwdVariant, VarlenVariant, default_menu
    from fa4_jax.ops.fwd.spec import SHORT_TILE_M

    menu = default_menu()
    short = [v for v in menu if isinstance(v, FwdVariant) and v.tile_m]
    assert sorted(v.symbol for v in short) == [
        "fa4_fwd_sm90_bf16_hd64_causal_m64", "fa4_fwd_sm90_bf16_hd64_causal_softcap_m64",
        "fa4_fwd_sm90_fp16_hd64_causal_m64", "fa4_fwd_sm90_fp16_hd64_causal_softcap_m64"]
    for v in short:
        assert FwdVariant.from_symbol(v.symbol) == v and replace(v, tile_m=0) in menu
    assert FwdVariant.from_symbol("fa4_fwd_sm90_bf16_hd64_causal").tile_m == 0
    # Only where a short tile exists.
    with pytest.raises(ValueError, match=r"tile_m 64 is a tile for head_dim \(64,\) and mask \('causal',\) only"):
        FwdVariant("sm90", "bf16", 128, "causal", False, tile_m=SHORT_TILE_M)
    with pytest.raises(ValueError, match=r"unsupported tile_m: self.tile_m=128"):
        FwdVariant("sm90", "bf16", 64, "causal", False, tile_m=128)
    with pytest.raises(ValueError, match="not a FwdVariant symbol"):
        FwdVariant.from_symbol("fa4_fwd_sm90_bf16_hd64_full_m64")
    # The varlen family serves the dense tiles only: its menu is the dense one without the short tiles.
    fields5 = lambda v: (v.arch, v.dtype, v.head_dim, v.mask, v.softcap)  # noqa: E731
    varlen = [fields5(v) for v in menu if isinstance(v, VarlenVariant)]
    assert sorted(varlen) == sorted(fields5(v) for v in menu if isinstance(v, FwdVariant) and not v.tile_m)

    cfg = Sm90FwdConfig.for_variant(short[0])
    assert (cfg.tile_m, cfg.tile_n, cfg.stages, cfg.num_consumer_wg, cfg.ctas_per_sm) == (64, 128, 2, 1, 2)
    # Launch registers 65536 / (2 x 256) = 128 per thread: the two warpgroups' budgets average to it.
    assert cfg.consumer_regs + cfg.producer_regs == 2 * SM90_REGS // (cfg.ctas_per_sm * cfg.num_threads)
    assert cfg.separate_o and cfg.ctas_per_sm * (cfg.smem_bytes + 1024) <= SM90_SMEM_BYTES + 1024
    assert Sm90FwdConfig.for_variant(replace(short[0], tile_m=0)).tile_m == 192
