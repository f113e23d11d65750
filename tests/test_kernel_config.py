"""The SM90 tile configurations (fa4_jax/kernels/config.py) on the CPU: every KV-cache configuration
of the menu (and the dense short-problem tile) fits the SM's shared memory and registers as many
times as it asks to be resident, and a configuration that would not is refused with the reason."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from fa4_jax.kernels.config import SM90_REGS, SM90_SMEM_BYTES, Sm90FwdConfig, kvcache_config
from fa4_jax.ops.fwd.spec import HEAD_DIMS
from fa4_jax.ops.kvcache.spec import FP8_HEAD_DIMS, TILE_MS


@pytest.mark.parametrize("hd,tile_m,paged,kv_fp8", [c + (False,) for c in itertools.product(HEAD_DIMS, TILE_MS, (False, True))]
                         + [(hd, tm, paged, True) for hd in FP8_HEAD_DIMS for tm in (TILE_MS[0], 128)
                            for paged in (False, True)])
def test_kvcache_configs_fit_their_residency(hd, tile_m, paged, kv_fp8):
    cfg = kvcache_config(hd, tile_m, paged, kv_fp8)
    ctas = cfg.ctas_per_sm
    # Each resident CTA also takes 1 KB the hardware reserves.
    assert ctas * (cfg.smem_bytes + 1024) <= SM90_SMEM_BYTES + 1024  # 228 KB per SM
    regs = 128 * sum(cfg.warpgroup_regs)
    assert len(cfg.warpgroup_regs) == cfg.num_threads // 128
    assert ctas * regs <= SM90_REGS
    assert cfg.stages >= 2, "decode needs K/V loads in flight behind the block being computed"


def test_hd128_decode_runs_two_ctas_per_sm():
    cfg = kvcache_config(128, 64, False)
    assert (cfg.ctas_per_sm, cfg.tile_n, cfg.stages, cfg.consumer_regs, cfg.producer_regs) == (2, 64, 2, 232, 24)
    # Launch registers 65536 / (2 x 256) = 128: the warpgroup budgets must sum to exactly that pool.
    assert cfg.consumer_regs + cfg.producer_regs == 2 * SM90_REGS // (2 * cfg.num_threads)
    # The paged 16-bit tile: one CTA per SM with three stages (measured faster than two CTAs with two);
    # its producer keeps 40 registers (it spills at 24).
    paged = kvcache_config(128, 64, True)
    assert (paged.ctas_per_sm, paged.tile_n, paged.stages, paged.consumer_regs, paged.producer_regs) == \
        (1, 64, 3, 216, 40)
    assert 2 * (paged.smem_bytes + 1024) > 228 * 1024  # three stages would not fit twice
    # Its registers stay bounded as for two CTAs (the code measured; bounded for one it spilled).
    assert paged.launch_ctas == 2 and paged.consumer_regs + paged.producer_regs == SM90_REGS // paged.num_threads
    assert kvcache_config(128, 128, False).ctas_per_sm == 1
    assert kvcache_config(128, 128, True).ctas_per_sm == 1


@pytest.mark.parametrize("hd,stages,rows1_stages", [(64, 2, 4), (128, 2, 3)])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_decode_runs_two_ctas_per_sm(hd, stages, rows1_stages, paged):
    """FP8 decode tiles: two CTAs per SM at hd64 and hd128 (the launch's 128 registers shared out
    exactly: producer 40 / consumer 216), with as many FP8 stages as fit in half an SM beside Q, the
    widened K buffer and the widened V: the producer's ring of `stages` fp16 buffers (contiguous and
    16-row-piece pages), or the consumer's one buffer (one-row pages, whose producer warpgroup
    gathers rows)."""
    for page_rows, want, widens in ((16, stages, True), (1, rows1_stages, False)):
        if page_rows == 1 and not paged:
            continue
        cfg = kvcache_config(hd, 64, paged, True, page_rows)
        assert (cfg.ctas_per_sm, cfg.stages, cfg.producer_widens_v) == (2, want, widens)
        assert (cfg.producer_regs, cfg.consumer_regs) == ((40, 216) if widens or paged else (24, 232))
        assert cfg.consumer_regs + cfg.producer_regs == 2 * SM90_REGS // (2 * cfg.num_threads)
        ring = cfg.tile_n * hd * 2 if widens else 0  # one more stage: its FP8 K and V (and fp16 V)
        assert 2 * (cfg.smem_bytes + 1024) <= 228 * 1024 < 2 * (cfg.smem_bytes + cfg.tile_n * hd * 2 + ring + 1024)


@pytest.mark.parametrize("hd,stages", [(64, 4), (128, 2)])
@pytest.mark.parametrize("paged", [False, True])
def test_fp8_chunk_tile_widens_k_and_v_in_its_own_warpgroup(monkeypatch, hd, stages, paged):
    """The FP8 chunk tile (two consumer warpgroups, ping-pong, one CTA per SM): both warpgroups read
    every block, so K and V are widened into two fp16 rings of `stages` (as many as fit beside the FP8
    stages and Q: hd128 fills all but a KB of the 227), by a fourth warpgroup (four warps, one per SM
    sub-partition, 32 rows of each block each) after the consumers'. 512 threads launch with 128
    registers each, which the four budgets fill exactly; paged, the loads' warp keeps 40 and its
    warpgroup's other three warps (free now) share the block's TMA pieces. One-row pages (no producer
    warps to spare) have no such tile."""
    from fa4_jax.kernels import fp8_widen_layout as wl
    from fa4_jax.kernels.fwd_sm90 import FlashAttentionForwardSm90
    from fa4_jax.kernels.seams import FwdSeams

    monkeypatch.delenv("FA4_JAX_EXPERIMENTS", raising=False)  # the shipped tile, whatever the environment
    cfg = kvcache_config(hd, 128, paged, True, 16)
    assert (cfg.producer_widens_k, cfg.producer_widens_v, cfg.ctas_per_sm, cfg.warpgroup_pingpong) == \
        (True, True, 1, True)
    assert (cfg.widen_wg, cfg.num_threads, wl.WARPS, wl.rows_per_warp(cfg.tile_n, wl.WARPS)) == (True, 512, 4, 32)
    assert (cfg.tile_n, cfg.stages) == (128, stages)
    assert (cfg.producer_regs, cfg.consumer_regs, cfg.widen_regs) == ((40, 216, 40) if paged else (24, 224, 40))
    assert 2 * cfg.consumer_regs + cfg.producer_regs + cfg.widen_regs == 4 * (SM90_REGS // cfg.num_threads)
    assert cfg.copy_warps == (4 if paged else 1)
    assert FlashAttentionForwardSm90(cfg, "local", False, FwdSeams.kvcache(paged)).widen_warps == (12, 13, 14, 15)
    if paged:  # the pieces are shared out over the producer warps only where the K/V are paged
        with pytest.raises(ValueError, match="copy_warps: paged TMA pieces shared out evenly"):
            FlashAttentionForwardSm90(cfg, "local", False, FwdSeams.kvcache(False))
    with pytest.raises(ValueError, match="widen_wg: setmaxnreg takes a multiple of 8 >= 24"):
        replace(cfg, widen_regs=36)
    with pytest.raises(ValueError, match="register budget exceeded"):
        replace(cfg, consumer_regs=232)
    # Every other KV-cache tile keeps three warpgroups.
    assert kvcache_config(hd, 128, paged, False, 16).num_threads == 384
    assert not kvcache_config(hd, 64, paged, True, 16).widen_wg
    per_stage = cfg.tile_n * hd * (2 + 4)  # FP8 K + V, fp16 K + V
    assert cfg.smem_bytes <= cfg.smem_limit < cfg.smem_bytes + per_stage
    with pytest.raises(ValueError, match="the two-warpgroup tile needs the producer's widening"):
        kvcache_config(hd, 128, True, True, 1)
    with pytest.raises(ValueError, match="producer_widens_k: the producer widens V too"):
        replace(cfg, producer_widens_v=False)
    # The widening warps' 16-row rounds must end exactly at the block's end (fwd_sm90.widen_rows skips a
    # round only when it starts past it), and fp8_widen_layout knows the hd64 / hd128 swizzles only.
    with pytest.raises(ValueError, match=r"producer_widens_k: head_dim in \(64, 128\) and whole 16-row rounds"):
        replace(cfg, tile_n=88)
    with pytest.raises(ValueError, match=r"got self.head_dim=96"):
        kvcache_config(96, 128, paged, True, 16)


def test_smem_estimate_counts_the_structs_two_slack_kilobytes():
    """The shared storage aligns every buffer to 1 KB: the mbarriers before the first and the small
    fields after the last take a KB each (fwd_sm90.py checks the real size against the limit when it
    compiles; these are the sizes the H200 reported for the two hd128 decode tiles)."""
    assert kvcache_config(128, 64, False).smem_bytes == 83968  # 16 KB Q + 2 x 32 KB K/V + 2 KB
    four = replace(kvcache_config(128, 64, False, True), stages=4, ctas_per_sm=1, producer_widens_v=False)  # what ran until 2026-12-04
    assert four.smem_bytes == 116736 > 115712  # the size ncu reported; one KB over half an SM


def test_two_ctas_per_sm_refuse_more_than_half_the_shared_memory():
    with pytest.raises(ValueError, match=r"tiles need self.smem_bytes=\d+ > 115712 bytes of smem \(2 CTAs per SM\)"):
        Sm90FwdConfig(128, 64, 64, 4, 232, 24, False, False, o_staging=False, ctas_per_sm=2)
    with pytest.raises(ValueError, match="register budget exceeded"):
        Sm90FwdConfig(128, 64, 64, 2, 240, 24, False, False, o_staging=False, ctas_per_sm=2)


def test_dense_short_tile_variants_and_config():
    """The dense family's short-problem tiles (ops/fwd/spec.py SHORT_TILES): a variant field with its own
    symbol, built for sm90 causal at hd64 (two CTAs of one 64-row consumer warpgroup per SM with a
    separate O buffer) and hd96 (hd128's 128-row tile under hd96's default of 192 rows); every other
    dense variant keeps its head dim's default tile, and the varlen kernels the default tiles except
    hd96 causal, which keeps 128 rows."""
    from dataclasses import replace

    from fa4_jax.families import FwdVariant, VarlenVariant, default_menu
    from fa4_jax.ops.fwd.spec import SHORT_TILES

    assert SHORT_TILES == {64: (64, 1024), 96: (128, 2048)}
    menu = default_menu()
    short = [v for v in menu if isinstance(v, FwdVariant) and v.tile_m]
    assert sorted(v.symbol for v in short) == [
        "fa4_fwd_sm90_bf16_hd64_causal_m64", "fa4_fwd_sm90_bf16_hd64_causal_softcap_m64",
        "fa4_fwd_sm90_bf16_hd96_causal_m128", "fa4_fwd_sm90_bf16_hd96_causal_softcap_m128",
        "fa4_fwd_sm90_fp16_hd64_causal_m64", "fa4_fwd_sm90_fp16_hd64_causal_softcap_m64",
        "fa4_fwd_sm90_fp16_hd96_causal_m128", "fa4_fwd_sm90_fp16_hd96_causal_softcap_m128"]
    for v in short:
        assert FwdVariant.from_symbol(v.symbol) == v and replace(v, tile_m=0) in menu
    assert FwdVariant.from_symbol("fa4_fwd_sm90_bf16_hd64_causal").tile_m == 0
    # Only where a short tile exists, and only the head dim's own.
    for hd, tile_m, mask in [(128, 64, "causal"), (64, 128, "causal"), (96, 64, "causal"), (96, 128, "full")]:
        with pytest.raises(ValueError, match=rf"tile_m {tile_m} is not a short-problem tile of head_dim {hd}, "
                                             rf"mask {mask} \(short tiles: 64 at head_dim 64, 128 at head_dim 96"):
            FwdVariant("sm90", "bf16", hd, mask, False, tile_m=tile_m)
    with pytest.raises(ValueError, match=r"unsupported tile_m: self.tile_m=192"):
        FwdVariant("sm90", "bf16", 64, "causal", False, tile_m=192)
    for bad in ("fa4_fwd_sm90_bf16_hd64_full_m64", "fa4_fwd_sm90_bf16_hd96_causal_m64"):
        with pytest.raises(ValueError, match="not a FwdVariant symbol"):
            FwdVariant.from_symbol(bad)
    # The varlen family has no short tiles: its menu is the dense one without them.
    fields5 = lambda v: (v.arch, v.dtype, v.head_dim, v.mask, v.softcap)  # noqa: E731
    varlen = [fields5(v) for v in menu if isinstance(v, VarlenVariant)]
    assert sorted(varlen) == sorted(fields5(v) for v in menu if isinstance(v, FwdVariant) and not v.tile_m)

    hd64 = next(v for v in short if v.head_dim == 64)
    cfg = Sm90FwdConfig.for_variant(hd64)
    assert (cfg.tile_m, cfg.tile_n, cfg.stages, cfg.num_consumer_wg, cfg.ctas_per_sm) == (64, 128, 2, 1, 2)
    # Launch registers 65536 / (2 x 256) = 128 per thread: the two warpgroups' budgets average to it.
    assert cfg.consumer_regs + cfg.producer_regs == 2 * SM90_REGS // (cfg.ctas_per_sm * cfg.num_threads)
    assert cfg.separate_o and cfg.ctas_per_sm * (cfg.smem_bytes + 1024) <= SM90_SMEM_BYTES + 1024
    assert Sm90FwdConfig.for_variant(replace(hd64, tile_m=0)).tile_m == 192

    # hd96: 192 x 96 over three consumer warpgroups for full and long causal problems, hd128's tile for
    # short causal ones, windows and varlen causal.
    def tile(v, varlen=False):
        c = Sm90FwdConfig.for_variant(v, varlen=varlen)
        return c.tile_m, c.tile_n, c.num_consumer_wg

    hd96 = FwdVariant("sm90", "bf16", 96, "causal", False)
    hd128 = Sm90FwdConfig.for_variant(replace(hd96, head_dim=128))
    assert tile(hd96) == tile(replace(hd96, mask="full")) == tile(replace(hd96, mask="full"), True) == (192, 96, 3)
    assert tile(replace(hd96, tile_m=128)) == tile(hd96, True) == tile(replace(hd96, mask="local")) == (128, 128, 2)
    assert Sm90FwdConfig.for_variant(replace(hd96, tile_m=128)) == replace(hd128, head_dim=96)


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_chunk_tile_hands_out_tiles_and_shares_its_paged_copies(hd):
    """The 16-bit chunk tile (tile_m 128) takes its tiles from the handler's counter (tile_handout), and
    paged in 16-row pieces all four producer warps issue its TMA pieces, an equal share each
    (copy_warps; the kernel refuses a share that is not whole). The FP8 chunk tile shares its paged
    pieces so too, but walks its tiles statically (its widening warpgroup does); the decode tiles and
    one-row pages (the whole producer warpgroup gathers rows) do neither."""
    for paged in (False, True):
        cfg = kvcache_config(hd, 128, paged)
        assert cfg.tile_handout
        assert cfg.copy_warps == (4 if paged else 1)
        assert (cfg.tile_n // 16) % cfg.copy_warps == 0
        decode = kvcache_config(hd, 64, paged)
        assert not decode.tile_handout and decode.copy_warps == 1
    rows1 = kvcache_config(hd, 128, True, page_rows=1)
    assert not rows1.tile_handout and rows1.copy_warps == 1
    if hd in FP8_HEAD_DIMS:
        for paged in (False, True):
            fp8 = kvcache_config(hd, 128, paged, True)
            assert not fp8.tile_handout and fp8.copy_warps == (4 if paged else 1)
