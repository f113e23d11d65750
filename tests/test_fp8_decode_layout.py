"""The FP8 decode tile's operand placement (fa4_jax/kernels/fp8_decode_layout.py), on the CPU: every
map is a bijection onto the rows and columns it stands for, the two gemms' sum indices agree
between their operands, and the tile's shared-memory loads are free of bank conflicts under the
FP8 stages' swizzle (which the kernel checks against CuTe's layout when it compiles)."""

from __future__ import annotations

import pytest

from fa4_jax.kernels import fp8_decode_layout as lay
from smem_banks import wavefronts

HEAD_DIMS = lay.HEAD_DIMS


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_maps_are_bijections(hd):
    assert sorted(lay.key_row(hd, m) for m in range(16)) == list(range(16))
    assert sorted(lay.v_chunk(hd, g) for g in range(8)) == list(range(8))
    # QK^T's columns: each k-step's 16 logical columns, over all k-steps, cover the head dim once.
    cols = [lay.qk_column(s, j) for s in range(hd // 16) for j in range(16)]
    assert sorted(cols) == list(range(hd))
    # O^T's rows: (m-tile i, lane group g, half) cover the head dim once.
    rows = [lay.o_column(hd, i, g, h) for i in range(hd // 16) for g in range(8) for h in range(2)]
    assert sorted(rows) == list(range(hd))


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_the_key_map_is_its_table(hd):
    """The kernel evaluates the maps on lane indices at run time (bit arithmetic); the tables say them."""
    assert tuple(lay.key_row(hd, m) for m in range(8)) == lay._KEY_ORDER[hd]
    assert tuple(lay.v_chunk(hd, g) for g in range(8)) == lay._V_CHUNK[hd]


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_a_thread_loads_the_columns_its_fragments_name(hd):
    """Lane quad q's 16-byte K load at column 64 G + 16 q holds, at byte 4 u + i, the QK^T k-step 4 G + u
    column that the mma's register i // 2 (a0 / a2, b0 / b1) and half i % 2 stand for."""
    for s in range(hd // 16):
        G, u = divmod(s, 4)
        for q in range(4):
            for i in range(4):
                j = 2 * q + (i % 2) + 8 * (i // 2)  # the mma's k index of register i // 2, half i % 2
                assert lay.qk_column(s, j) == 64 * G + 16 * q + 4 * u + i


@pytest.mark.parametrize("warp", range(lay.WARPS))
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_stage_loads_are_conflict_free(hd, warp):
    base = lay.KEYS_PER_WARP * warp
    for h in range(2):
        for G in range(hd // 64):
            addrs = [lay.swizzle(hd, (base + lay.key_row(hd, l // 4 + 8 * h)) * hd + 64 * G + 16 * (l % 4))
                     for l in range(32)]
            assert wavefronts(addrs, 16) == 4, (h, G)
    width = hd // 8
    for d in (0, 1, 8, 9):
        addrs = [lay.swizzle(hd, (base + lay.key_row(hd, 2 * (l % 4) + d)) * hd + lay.v_chunk(hd, l // 4) * width)
                 for l in range(32)]
        assert wavefronts(addrs, width) == 32 * width // 128, d


def test_identity_maps_would_conflict():
    """The model can fail: in key order, the K loads at hd128 take twice the wavefronts."""
    addrs = [lay.swizzle(128, (l // 4) * 128 + 16 * (l % 4)) for l in range(32)]
    assert wavefronts(addrs, 16) == 8


@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_swizzle_is_a_permutation_of_16_byte_units(hd):
    rows = lay.TILE_N
    offsets = [lay.swizzle(hd, o) for o in range(rows * hd)]
    assert sorted(offsets) == list(range(rows * hd))
    assert all(lay.swizzle(hd, o) % 16 == o % 16 for o in range(0, rows * hd, 7))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_the_tile_fits_two_ctas_per_sm(hd, paged):
    from fa4_jax.kernels.config import kvcache_config

    cfg = kvcache_config(hd, lay.TILE_M, paged, kv_fp8=True)
    assert cfg.fp8_decode and cfg.ctas_per_sm == 2 and cfg.num_consumer_wg == 1
    assert cfg.smem_bytes <= cfg.smem_limit
    assert cfg.stages >= 4  # 64 KB of FP8 stages in flight per CTA
    assert cfg.smem_bytes == (lay.stage_smem_bytes(hd, cfg.stages) + lay.merge_smem_bytes(hd) + 2048)
