"""The SM100 forward kernel's tile configuration on the CPU (issue 16): Tensor Memory column map,
shared memory, K/V stages, per-role register budgets and warp roles, for every head dim the kernels
serve, from fa4_jax/kernels/config_sm100.py itself. No GPU, no cutlass."""

from __future__ import annotations

import itertools

import pytest

from fa4_jax.kernels.config_sm100 import (
    MIN_KV_STAGES, SM100_REGS, SM100_SMEM_BYTES, SM100_TILE_SMEM_BYTES, TMEM_COLUMNS, WARP_ROLES_BY_Q_STAGE,
    Sm100FwdConfig, launch_regs, sm100_fwd_config,
)
from fa4_jax.ops.fwd.spec import HEAD_DIMS

ROWS = (None, 1, 4, 128, 129, 4096)  # None: not known (dense prefill)
CONFIGS = [(hd, rows, sm100_fwd_config(hd, rows)) for hd, rows in itertools.product(HEAD_DIMS, ROWS)]
IDS = [f"hd{hd}-rows{rows}" for hd, rows, _ in CONFIGS]


@pytest.mark.parametrize("hd,rows,cfg", CONFIGS, ids=IDS)
def test_tmem_map_fits_and_does_not_overlap(hd, rows, cfg):
    m = cfg.tmem_map
    assert set(m) == {"S0", "S1", "P0", "P1"} | {f"O{i}" for i in range(cfg.q_stage)}
    assert cfg.tmem_columns <= TMEM_COLUMNS
    # S and O buffers are disjoint and pack [0, tmem_columns) without a gap.
    owners = sorted(v for k, v in m.items() if not k.startswith("P"))
    assert owners[0][0] == 0 and owners[-1][1] == cfg.tmem_columns
    for (a0, a1), (b0, b1) in zip(owners, owners[1:]):
        assert a1 == b0 and a0 < a1
    # P_i (bf16, two per 32-bit column) is the upper half of its own S_i: written over scores the
    # MMA warp has consumed, never over the other tile's S or an O.
    for i in range(2):
        s0, s1 = m[f"S{i}"]
        p0, p1 = m[f"P{i}"]
        assert s0 <= p0 < p1 == s1 and (p1 - p0) * 2 == cfg.tile_n
    for i in range(cfg.q_stage):
        o0, o1 = m[f"O{i}"]
        assert o1 - o0 == hd and o0 >= 2 * cfg.tile_n
    # tcgen05.alloc: a power of two >= 32 columns, at most the whole TMEM -- and all of it: the kernel
    # addresses P in absolute columns, right only for an allocation that starts at column 0.
    a = cfg.tmem_alloc_columns
    assert a & (a - 1) == 0 and 32 <= a <= TMEM_COLUMNS and a >= cfg.tmem_columns
    assert a == TMEM_COLUMNS


@pytest.mark.parametrize("hd,rows,cfg", CONFIGS, ids=IDS)
def test_shared_memory_stages_and_registers(hd, rows, cfg):
    elem = 2
    q = cfg.q_stage * cfg.tile_m * hd * elem
    o = 0 if cfg.o_over_q else q
    kv = cfg.kv_stages * cfg.tile_n * hd * elem
    assert cfg.tile_smem_bytes == q + o + kv <= SM100_TILE_SMEM_BYTES < SM100_SMEM_BYTES
    assert cfg.kv_stages >= MIN_KV_STAGES
    # One more stage would not fit (or the cap is reached): the ring takes what smem leaves.
    assert cfg.kv_stages == 8 or q + o + (cfg.kv_stages + 1) * cfg.tile_n * hd * elem > SM100_TILE_SMEM_BYTES
    budgets = cfg.warpgroup_regs
    assert len(budgets) == cfg.num_threads // 128 == cfg.q_stage + 2
    # setmaxnreg only moves registers inside the launch allocation: budgets past it hang the kernel.
    alloc = launch_regs(cfg.num_threads)
    assert alloc * cfg.num_threads <= SM100_REGS and sum(budgets) == alloc * len(budgets)
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in budgets)
    # The softmax threads hold their row of S (tile_n fp32) plus the row's state.
    assert cfg.softmax_regs >= cfg.tile_n + 32
    assert cfg.num_threads == (512 if cfg.q_stage == 2 else 384)


@pytest.mark.parametrize("hd,rows,cfg", CONFIGS, ids=IDS)
def test_two_q_tiles_exactly_where_tmem_and_the_rows_allow(hd, rows, cfg):
    assert cfg.q_stage == (2 if hd <= 128 and (rows is None or rows > 128) else 1)
    assert cfg.tile_m == 128
    # The FMA-pipe exp2 only where MUFU binds (head_dim <= 128), within FA4's 10-25%.
    assert (0.1 <= cfg.exp2_fma_fraction <= 0.25) if hd <= 128 else cfg.exp2_fma_fraction == 0.0


@pytest.mark.parametrize("q_stage", [1, 2])
def test_warp_roles_cover_the_cta_once(q_stage):
    roles = WARP_ROLES_BY_Q_STAGE[q_stage]
    warps = sorted(w for ws in roles.values() for w in ws)
    assert warps == list(range(len(warps))) and len(warps) == 4 * (q_stage + 2)
    softmax = [r for r in roles if r.startswith("softmax")]
    assert len(softmax) == q_stage and all(len(roles[r]) == 4 for r in (*softmax, "correction"))
    # Warpgroup order matches warpgroup_regs: softmax ones, correction, then the single-warp roles.
    assert [w // 4 for r in softmax for w in roles[r][:1]] == list(range(q_stage))
    assert roles["correction"][0] // 4 == q_stage
    assert {w // 4 for r in roles if r not in (*softmax, "correction") for w in roles[r]} == {q_stage + 1}


@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=192, q_stage=2, kv_stages=3), r"TMEM needs 640 columns > 512"),
    (dict(head_dim=256, q_stage=1, kv_stages=3, tile_n=128), r"tiles need .* bytes of smem"),
    (dict(head_dim=128, q_stage=2, kv_stages=2), r"kv_stages=2 < 3"),
    (dict(head_dim=128, q_stage=3, kv_stages=3), r"q_stage must be 1 or 2"),
    (dict(head_dim=120, q_stage=1, kv_stages=3), r"head_dim must be a multiple of 16"),
])
def test_impossible_configurations_are_refused(kwargs, match):
    args = dict(softmax_regs=192, correction_regs=80, other_regs=48, exp2_fma_fraction=0.125)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        Sm100FwdConfig(**args)


def test_register_budgets_must_fill_the_register_file():
    with pytest.raises(ValueError, match=r"setmaxnreg budgets \(200, 200, 80, 48\) must be multiples of 8 in "
                                         r"\[24, 256\] summing to 512 \(the launch allocation of 512 threads\)"):
        Sm100FwdConfig(128, 2, 3, 200, 80, 48, 0.125)


def test_docs_table_is_the_generated_one():
    from pathlib import Path

    from fa4_jax.kernels import config_sm100

    doc = Path(__file__).resolve().parents[1] / "docs" / "SM100.md"
    text = doc.read_text()
    assert config_sm100.render_into(text) == text, "docs/SM100.md is stale: python -m fa4_jax.kernels.config_sm100 --write"
    assert config_sm100.HEAD_DIMS == HEAD_DIMS
    assert config_sm100.main(["--doc", str(doc)]) == 0


@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("rows", [None, 128], ids=["prefill", "kvcache"])
def test_the_kernels_rings_fit(hd, rows):
    # What fwd_sm100.py allocates today (the CTA's Q tiles, a K ring and a V ring) for the dense /
    # varlen kernels (rows None) and the KV-cache ones: within the operand budget, at least two
    # stages per ring (a block's K and the next one's in flight).
    cfg = sm100_fwd_config(hd, packed_rows=rows)
    assert 2 <= cfg.ring_stages <= 4
    assert cfg.kernel_smem_bytes == cfg.q_bytes + 2 * cfg.ring_stages * cfg.kv_tile_bytes <= SM100_TILE_SMEM_BYTES
    assert cfg.ring_stages == 4 or cfg.kernel_smem_bytes + 2 * cfg.kv_tile_bytes > SM100_TILE_SMEM_BYTES



@pytest.mark.parametrize("num_m_blocks,heads,batch", [(1, 3, 2), (7, 2, 3), (16, 5, 1)])
@pytest.mark.parametrize("longest_first", [False, True])
def test_tile_order_covers_every_tile_once_longest_first_for_masks(num_m_blocks, heads, batch, longest_first):
    from fa4_jax.kernels.config_sm100 import tile_of_block

    order = [tile_of_block(b, num_m_blocks, heads, longest_first) for b in range(num_m_blocks * heads * batch)]
    assert sorted(order) == sorted(itertools.product(range(num_m_blocks), range(heads), range(batch)))
    # m-blocks fastest: consecutive CTAs share a (head, batch), i.e. its K/V in L2.
    groups = [order[i:i + num_m_blocks] for i in range(0, len(order), num_m_blocks)]
    assert all(len({(h, b) for _, h, b in g}) == 1 for g in groups)
    # Causal (square, bottom-right aligned): m-block m sees m + 1 key blocks. Longest first means each
    # (head, batch)'s tiles are launched in non-increasing work.
    work = [[m + 1 for m, _, _ in g] for g in groups]
    if longest_first:
        assert all(w == sorted(w, reverse=True) for w in work)
    else:
        assert all(w == sorted(w) for w in work)


def test_a_config_allocating_part_of_tmem_is_refused():
    """fwd_sm100 builds P's operand from the allocation's layout with absolute columns (the SASS has
    0x40.., not base + 0x40): a partial allocation, which need not start at column 0, is refused."""
    import dataclasses

    cfg = CONFIGS[0][2]
    with pytest.raises(ValueError, match=r"the kernel allocates all 512 TMEM columns; self.tmem_alloc_columns=256"):
        dataclasses.replace(cfg, head_dim=16, tile_n=64)
