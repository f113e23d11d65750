"""The SM90 tile configurations (fa4_jax/kernels/config.py) on the CPU: every KV-cache configuration
of the menu fits the SM's shared memory and registers as many times as it asks to be resident, and
a configuration that would not is refused with the reason."""

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
