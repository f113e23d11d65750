"""Arch-independent arithmetic of the SM100 (Blackwell) kernels of issue 16, as constants the
kernels will import and the CPU tests check (tests/test_sm100_arithmetic.py), so the two cannot
drift. Pure Python: no cutlass import, nothing here runs on a GPU by itself.

Software exp2 (FlashAttention-4's trick, docs FA4_NOTES.md): the softmax's 2^x, x <= 0 (the row max
already subtracted), is computed for a fraction of the elements on the FMA pipe beside the MUFU
unit, whose 16 ops / clock / SM bind at head_dim <= 128 on Blackwell:

    x < EXP2_MIN_X: 0                          # as MUFU's ex2.approx.ftz (denormals flush to 0)
    n  = floor(x)                              # the kernel: (x + 1.5 * 2^23) - 1.5 * 2^23, round-down
    f  = x - n                                 # exact, in [0, 1)
    p  = fma(fma(fma(P3, f, P2), f, P1), f, 1) # 2^f by a degree-3 polynomial: three FMAs
    2^x = bits(p) + (n << 23)                  # add n to the exponent field: no multiply

EXP2_POLY (p0 = 1 exactly, so 2^0 = 1) is tuned for what the P.V gemm sees, bf16: a tenth of the
way from the minimax fit of the relative error of 1 + p1 f + p2 f^2 + p3 f^3 against 2^f on [0, 1]
(max error 8.56e-5) toward the least-squares fit (smaller errors on average, max 1.65e-4). Result:
max relative error 9.35e-5, and the bf16 rounding of the result equals that of the exact 2^x on
99.01% of [-126, 0] (the minimax fit alone: 98.998%). The tests re-derive both fits.

Conditional rescaling: the online softmax rescales O and the row sum only when the running row max
grows by more than RESCALE_THRESHOLD_LOG2 (log2 units, the scores already scaled by log2(e)); until
then it keeps the stale max, so the exponentials stay <= 2^8 (safe in fp32) and the result is exact
because O and the row sum share that max until the final division.
"""

from __future__ import annotations

# 2^f ~ 1 + P1 f + P2 f^2 + P3 f^3 on [0, 1] (0.9 x minimax + 0.1 x least squares, relative error).
EXP2_POLY = (1.0, 0.6951087113238156, 0.2277113740293337, 0.0769928306878863)
EXP2_POLY_BLEND = 0.1  # the least-squares fit's share
EXP2_POLY_MAX_REL_ERR = 9.36e-5
# Below this the result is 0, as MUFU's ex2.approx.ftz gives (its denormal results flush to zero),
# where the exact value is a float32 denormal: an absolute error under 1.2e-38 against a row sum
# >= 1. Exactly 0 matters: a row whose keys are all masked (scores -inf) must keep a zero sum, which
# the epilogue reads as "no key" (O = 0, lse = -inf); the exponent-field add alone would give 2^-126.
EXP2_MIN_X = -126.0
# Rescale O / the row sum only when the row max grows by more than this (log2 units): 2^8 headroom.
RESCALE_THRESHOLD_LOG2 = 8.0


# ------------------------------------------------------------------------------------------------
# Tile configuration of the SM100 forward kernel (FA4_NOTES.md, "Forward pipeline on SM100").
#
# One CTA of 16 warps (512 threads): softmax warpgroups 0 and 1 (warps 0-7, one thread per row of a
# 128-row Q tile each), the correction warpgroup (8-11: rescales O in Tensor Memory, writes the
# epilogue), then one MMA warp (12, a single thread issues tcgen05.mma), one epilogue warp (13, TMA
# store of O), one load warp (14, TMA of Q/K/V) and one spare (15). With q_stage 1 (one Q tile per
# CTA) softmax warpgroup 1 idles at its minimum budget.
#
# Tensor Memory is 128 lanes x 512 columns of 32 bits. A Q tile's scores S (128 x tile_n fp32) take
# tile_n columns; its P (bf16, two per column) is written over the upper half of its own S, which
# the MMA warp has consumed by then; its O accumulator (128 x head_dim fp32) takes head_dim columns.
# Both S buffers always exist (S of one tile is computed while the other's softmax runs: with one Q
# tile, S of the next key block while the softmax of this one runs), so
#     columns = 2 * tile_n + q_stage * head_dim <= 512,
# which is why two Q tiles per CTA (ping-pong) stop at head_dim 128: 256 + 2 * 192 = 640.
# ------------------------------------------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402

SM100_SMEM_BYTES = 227 * 1024  # dynamic shared memory per CTA on sm_100 (same cap as sm_90)
# What Q, O and the K/V stages may take of it; the rest holds the mbarriers, the TMEM address and
# alignment padding (FlashAttention-4 leaves the same 3 KB).
SM100_TILE_SMEM_BYTES = 224 * 1024
TMEM_COLUMNS = 512
TMEM_LANES = 128
SM100_REGS = 65536  # 32-bit registers per SM: one CTA per SM takes them all
SM100_MAX_KV_STAGES = 8
MIN_KV_STAGES = 3
# Warp roles. Two Q tiles per CTA (q_stage 2): 16 warps, FlashAttention-4's layout; one Q tile: 12
# warps, the second softmax warpgroup dropped and the single-warp roles moved up.
WARP_ROLES_BY_Q_STAGE = {
    2: {"softmax0": (0, 1, 2, 3), "softmax1": (4, 5, 6, 7), "correction": (8, 9, 10, 11), "mma": (12,),
        "epilogue": (13,), "load": (14,), "spare": (15,)},
    1: {"softmax0": (0, 1, 2, 3), "correction": (4, 5, 6, 7), "mma": (8,), "load": (9,), "spare": (10, 11)},
}
WARP_ROLES = WARP_ROLES_BY_Q_STAGE[2]
NUM_WARPS = 16


def launch_regs(threads: int) -> int:
    """Registers per thread a CTA of `threads` launches with when it alone fills the SM (allocation in
    units of 8): setmaxnreg moves registers between warpgroups inside that pool only (a budget
    past it hangs the kernel), so the warpgroups' budgets sum to this times their number."""
    return SM100_REGS // threads // 8 * 8


@dataclass(frozen=True)
class Sm100FwdConfig:
    head_dim: int
    q_stage: int           # 128-row Q tiles per CTA: 2 = the two softmax warpgroups ping-pong
    kv_stages: int         # K/V pipeline depth, in tiles (K and V tiles share one ring)
    softmax_regs: int      # setmaxnreg per softmax warpgroup
    correction_regs: int   # setmaxnreg of the correction warpgroup
    other_regs: int        # setmaxnreg of the MMA / epilogue / load / spare warpgroup
    exp2_fma_fraction: float  # share of the softmax's 2^x taken on the FMA pipe (EXP2_POLY)
    tile_m: int = 128      # rows per Q tile: one per softmax thread, and tcgen05.mma's M
    tile_n: int = 128      # keys per K/V tile
    # O's staging tile for the TMA store reuses Q's buffer (their lifetimes within a tile do not
    # overlap; the next tile's Q then waits for the store): what keeps >= 3 K/V stages at hd > 128.
    o_over_q: bool = False

    def __post_init__(self):
        if self.q_stage not in (1, 2):
            raise ValueError(f"q_stage must be 1 or 2: {self.q_stage=}")
        if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, 256]: {self.head_dim=}")
        if self.tmem_columns > TMEM_COLUMNS:
            raise ValueError(f"TMEM needs {self.tmem_columns} columns > {TMEM_COLUMNS} "
                             f"({self.q_stage=}, {self.head_dim=})")
        if self.tmem_alloc_columns != TMEM_COLUMNS:
            # fwd_sm100 addresses P (the P.V gemm's A operand) in absolute columns: right only while the
            # allocation starts at column 0, which an allocation of every column guarantees.
            raise ValueError(f"the kernel allocates all {TMEM_COLUMNS} TMEM columns; {self.tmem_alloc_columns=} "
                             f"({self.tmem_columns} used, {self.q_stage=}, {self.head_dim=})")
        if self.tile_smem_bytes > SM100_TILE_SMEM_BYTES:
            raise ValueError(f"tiles need {self.tile_smem_bytes} > {SM100_TILE_SMEM_BYTES} bytes of smem")
        if self.kv_stages < MIN_KV_STAGES:
            raise ValueError(f"{self.kv_stages=} < {MIN_KV_STAGES}: K_j, V_j and K_(j+1) must be in flight together")
        budgets = self.warpgroup_regs
        pool = launch_regs(self.num_threads) * len(budgets)
        if sum(budgets) != pool or any(r % 8 or not 24 <= r <= 256 for r in budgets):
            raise ValueError(f"setmaxnreg budgets {budgets} must be multiples of 8 in [24, 256] summing to "
                             f"{pool} (the launch allocation of {self.num_threads} threads)")
        if not 0.0 <= self.exp2_fma_fraction <= 0.5:
            raise ValueError(f"exp2_fma_fraction must be in [0, 0.5]: {self.exp2_fma_fraction=}")

    @property
    def warp_roles(self) -> dict[str, tuple[int, ...]]:
        return WARP_ROLES_BY_Q_STAGE[self.q_stage]

    @property
    def num_threads(self) -> int:
        return 32 * sum(len(w) for w in self.warp_roles.values())

    @property
    def warpgroup_regs(self) -> tuple[int, ...]:
        """setmaxnreg of each warpgroup in warp order: the softmax ones, the correction one, the one
        of the single-warp roles."""
        return (self.softmax_regs,) * self.q_stage + (self.correction_regs, self.other_regs)

    @property
    def tmem_map(self) -> dict[str, tuple[int, int]]:
        """[first, end) TMEM columns of each buffer: S0, S1, then O of each Q tile; P_i is the upper
        half of S_i (bf16 packs two to a column)."""
        cols = {"S0": (0, self.tile_n), "S1": (self.tile_n, 2 * self.tile_n)}
        for i in range(2):
            half = cols[f"S{i}"][0] + self.tile_n // 2
            cols[f"P{i}"] = (half, half + self.tile_n // 2)
        for i in range(self.q_stage):
            first = 2 * self.tile_n + i * self.head_dim
            cols[f"O{i}"] = (first, first + self.head_dim)
        return cols

    @property
    def tmem_columns(self) -> int:
        return 2 * self.tile_n + self.q_stage * self.head_dim

    @property
    def tmem_alloc_columns(self) -> int:
        """tcgen05.alloc takes a power of two >= 32 columns."""
        n = 32
        while n < self.tmem_columns:
            n *= 2
        return n

    @property
    def q_bytes(self) -> int:
        return self.q_stage * self.tile_m * self.head_dim * 2

    @property
    def kv_tile_bytes(self) -> int:
        return self.tile_n * self.head_dim * 2

    @property
    def ring_stages(self) -> int:
        """K/V stages of the kernel as it runs today (fwd_sm100.py): a K ring and a V ring of this many
        tiles each, together what shared memory holds beside the CTA's q_stage Q tiles (O leaves from
        registers: no staging tile), capped at 4. Two Q tiles at head_dim 128 leave two per ring:
        K_j, K_(j+1), V_j and V_(j+1) in flight, four tiles, where FlashAttention-4's shared ring
        holds three beside its O staging."""
        return min((SM100_TILE_SMEM_BYTES - self.q_bytes) // (2 * self.kv_tile_bytes), 4)

    @property
    def kernel_smem_bytes(self) -> int:
        """The operand tiles the kernel allocates: the Q tiles and the two rings."""
        return self.q_bytes + 2 * self.ring_stages * self.kv_tile_bytes

    @property
    def tile_smem_bytes(self) -> int:
        """Q tiles, an O staging tile per Q tile (the epilogue's TMA store) unless O reuses Q's, the
        K/V ring."""
        return (1 if self.o_over_q else 2) * self.q_bytes + self.kv_stages * self.kv_tile_bytes


def _kv_stages(head_dim: int, q_stage: int, tile_n: int, o_over_q: bool, tile_m: int = 128) -> int:
    """As many K/V tiles as the shared memory left by Q and O holds (capped: past a few stages the
    loads are far enough ahead)."""
    q_and_o = (1 if o_over_q else 2) * q_stage * tile_m * head_dim * 2
    return min((SM100_TILE_SMEM_BYTES - q_and_o) // (tile_n * head_dim * 2), SM100_MAX_KV_STAGES)


def sm100_fwd_config(head_dim: int, packed_rows: int | None = None) -> Sm100FwdConfig:
    """The configuration for one head dim. packed_rows (rows of one (sequence, KV head) tile after
    pack-GQA, when known): a decode-shaped call with <= 128 rows gets one Q tile per CTA, as does
    every head_dim > 128 (TMEM: 2 * 128 + 2 * 192 > 512). Past head_dim 128, O's staging reuses Q's
    smem and the K/V tiles are 64 keys, to keep >= 3 K/V stages (two K and two V tiles in flight
    where K and V have rings of their own, as in fwd_sm100.py). Register budgets follow
    the roles' needs: the softmax threads hold a row of S (tile_n fp32) and its P; the correction
    threads one O column slice at a time; the single-thread warps (MMA, load, epilogue) next to
    nothing."""
    q_stage = 2 if head_dim <= 128 and (packed_rows is None or packed_rows > 128) else 1
    tile_n = 64 if head_dim > 128 else 128
    o_over_q = head_dim > 128
    if q_stage == 2:
        # 16 warps, 128 registers each at launch: 2 x 208 + 56 + 40 = 4 x 128. The softmax threads
        # hold a row of S (128 fp32 at tile_n 128) and a 16-column chunk of P; at 192 (FA4's budget)
        # and 200 the masked block step of the varlen and softcap variants spilled. The correction
        # threads use <= 48 (a 32-column chunk of O and its row's address), the MMA and load
        # threads <= 34.
        softmax, correction = 208, 56
    else:
        # 12 warps, 168 at launch (3 x 168 = 504): the softmax threads hold a row of S and its P
        # (192 values at tile_n 128: they spilled at 176, and with softcap at 240), the correction
        # threads 32-column chunks of O, the MMA and load threads next to nothing.
        softmax, correction = 248, 152
    other = launch_regs(32 * sum(len(w) for w in WARP_ROLES_BY_Q_STAGE[q_stage].values())) * (q_stage + 2) \
        - q_stage * softmax - correction
    # FMA-pipe exp2 pays where MUFU binds, head_dim <= 128 (T_exp >= T_mma, FA4_NOTES.md); the
    # starting fractions, to be tuned on hardware (tools/validate_sm100.py), sit in FA4's 10-25%.
    # hd64 takes 3 of 16 rather than 4: at 4 the emulation's temporaries pushed the causal and
    # windowed block steps past the two-Q-tile softmax budget (an 8-byte spill).
    fraction = {64: 0.1875, 96: 0.1875, 128: 0.125}.get(head_dim, 0.0)
    return Sm100FwdConfig(head_dim, q_stage, _kv_stages(head_dim, q_stage, tile_n, o_over_q), softmax, correction,
                          other, fraction, tile_n=tile_n, o_over_q=o_over_q)


def tile_of_block(block, num_m_blocks, heads, longest_first: bool):
    """(m_block, head, batch) of CTA `block` of a dense or varlen launch, one CTA per tile (the kernel
    calls this with its Int32 indices, the tests with ints). m-blocks run fastest, so that the CTAs
    resident at the same time share one head's K/V in L2. longest_first (causal and windowed masks):
    the m-blocks in reverse -- with bottom-right aligned masks the last query tile sees the most keys
    -- so the hardware, which launches CTAs in index order, starts the longest tiles first and the
    short ones fill the tail (a varlen grid follows max_seqlen_q: a sequence's last tiles run first)."""
    m_block = block % num_m_blocks
    if longest_first:
        m_block = num_m_blocks - 1 - m_block
    return m_block, (block // num_m_blocks) % heads, block // (num_m_blocks * heads)


# ------------------------------------------------------------------------------------------------
# docs/SM100.md's resource table: generated from this file (python -m fa4_jax.kernels.config_sm100
# --write), checked by tests/test_sm100_config.py. The measured side (registers, stack frames of the
# compiled kernels) is tools/cubin_resources.py's and tests/test_sass.py's.
# ------------------------------------------------------------------------------------------------
TABLE_BEGIN = "<!-- sm100-resources:begin (generated: python -m fa4_jax.kernels.config_sm100 --write) -->"
TABLE_END = "<!-- sm100-resources:end -->"
HEAD_DIMS = (64, 96, 128, 192, 256)  # fa4_jax.ops.fwd.spec.HEAD_DIMS (not imported: keeps this file stdlib-only)


def resources_table() -> str:
    """One row per configuration the kernels compile today, per head dim: the dense / varlen one
    (sm100_fwd_config(head_dim): two Q tiles per CTA at head_dim <= 128) and the KV cache's
    (packed_rows=128: one Q tile), merged where they are the same."""
    lines = [
        "| head_dim | kernels | Q tiles × rows, K/V tile | K ring + V ring | operand smem (limit) "
        "| TMEM columns (alloc, limit) | setmaxnreg: softmax / correction / MMA, load | FMA-pipe exp2 share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for hd in HEAD_DIMS:
        prefill, cache = sm100_fwd_config(hd), sm100_fwd_config(hd, packed_rows=128)
        rows = [("dense, varlen, KV cache", cache)] if prefill == cache else \
            [("dense, varlen", prefill), ("KV cache", cache)]
        for kernels, cfg in rows:
            lines.append(
                f"| {hd} | {kernels} | {cfg.q_stage} × {cfg.tile_m}, {cfg.tile_n} "
                f"| {cfg.ring_stages} + {cfg.ring_stages} "
                f"| {cfg.kernel_smem_bytes // 1024} KB ({SM100_TILE_SMEM_BYTES // 1024} KB) "
                f"| {cfg.tmem_columns} ({cfg.tmem_alloc_columns}, {TMEM_COLUMNS}) "
                f"| {cfg.softmax_regs} / {cfg.correction_regs} / {cfg.other_regs} "
                f"| {cfg.exp2_fma_fraction:g} |")
    return "\n".join(lines)


def render_into(text: str) -> str:
    """`text` with the table between its markers replaced by resources_table()."""
    head, sep, rest = text.partition(TABLE_BEGIN)
    _, sep2, tail = rest.partition(TABLE_END)
    if not (sep and sep2):
        raise ValueError(f"no {TABLE_BEGIN!r} ... {TABLE_END!r} markers")
    return f"{head}{TABLE_BEGIN}\n{resources_table()}\n{TABLE_END}{tail}"


def main(argv=None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Regenerate docs/SM100.md's resource table.")
    parser.add_argument("--doc", type=Path, default=Path(__file__).resolve().parents[2] / "docs" / "SM100.md")
    parser.add_argument("--write", action="store_true", help="rewrite the table in place (default: check it)")
    args = parser.parse_args(argv)
    text = args.doc.read_text()
    fresh = render_into(text)
    if args.write:
        args.doc.write_text(fresh)
        return 0
    if fresh != text:
        print(f"{args.doc}: the SM100 resource table is stale: python -m fa4_jax.kernels.config_sm100 --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
