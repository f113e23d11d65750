"""Compile-time tile configuration of the SM90 forward kernel, derived from a FwdVariant.

Tile sizes follow the FlashAttention-3/4 Hopper choices (docs/DESIGN.md): the QK^T accumulator, the O
accumulator and P (as the register A operand of the PV wgmma) must fit in the consumer warpgroups'
240-register budget, and Q + `stages` x (K + V) tiles must fit in 227 KB of shared memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from fa4_jax.ops.fwd.spec import FwdVariant

# Hopper allows 227 KB of dynamic shared memory per CTA: an SM has 228 KB, and the hardware reserves
# 1 KB of it for each resident CTA.
SM90_SMEM_BYTES = 227 * 1024
SM90_SMEM_PER_SM = 228 * 1024
# Bytes of shared storage beyond the tiles themselves (Sm90FwdConfig._base_smem_bytes).
SMEM_STRUCT_OVERHEAD = 2 * 1024
# Registers per SM (64K 32-bit registers).
SM90_REGS = 65536


@dataclass(frozen=True)
class Sm90FwdConfig:
    head_dim: int
    tile_m: int          # query rows per CTA: 64 per consumer warpgroup
    tile_n: int          # keys per K/V pipeline stage
    stages: int          # K/V pipeline depth
    consumer_regs: int   # setmaxnreg for each consumer warpgroup
    producer_regs: int   # setmaxnreg for the producer warpgroup
    # With wide O accumulators (hd > 128), rescaling O right before the PV gemm that follows keeps
    # fewer values live across the softmax (measured faster in FA3/FA4 for hd 192/256).
    rescale_o_before_gemm: bool
    # Named-barrier ping-pong between consumer warpgroups, so that one warpgroup's softmax overlaps
    # the other's gemms. Pays off while the gemms are short relative to softmax (hd <= 128).
    warpgroup_pingpong: bool
    # Whether O may get its own smem staging buffer (see separate_o); the KV-cache kernel stores O
    # from registers and has none.
    o_staging: bool = True
    # CTAs resident per SM: the launch asks ptxas for min_blocks_per_mp of them, so registers per
    # thread are capped at 64K / (ctas * threads) and shared memory must fit ctas times.
    ctas_per_sm: int = 1
    # FP8 K/V (KV-cache tiles): the stages hold 1-byte elements, widened to fp16 for the wgmma: by the
    # consumer into one buffer (fwd_sm90.py, dequant) or by producer warps into a ring (below).
    kv_fp8: bool = False
    # FP8 K/V: producer warps (fwd_sm90.WIDEN_WARPS: two) widen each V block into a ring of `stages`
    # fp16 buffers beside the consumer's gemms, instead of the consumer widening it into one buffer
    # between them (one-row pages keep the latter: their whole producer warpgroup gathers rows).
    producer_widens_v: bool = False
    # ... and K too, into a second ring (the FP8 chunk tile of two consumer warpgroups: both read every
    # widened block, so no warpgroup can widen one for the other between its own gemms), by a
    # warpgroup of its own (widen_wg) rather than the producer's.
    producer_widens_k: bool = False
    # CTAs per SM the launch's register bound is sized for (ptxas min_blocks_per_mp; 0: ctas_per_sm).
    # Only the paged 16-bit decode tile sets it above ctas_per_sm: registers as for two CTAs (the
    # binary measured), shared memory for one.
    launch_bound_ctas: int = 0
    # FP8 K/V decode tile (decode_fp8_sm90.py): tile_m packed rows (fp8_decode_layout.TILE_M) on one
    # consumer warpgroup of warp mmas with K and V as register operands: no fp16 buffers, a merge
    # buffer for the warps' partial results instead.
    fp8_decode: bool = False
    # KV-cache tiles on a persistent grid that takes its tiles from the handler's zero-at-rest counter
    # (tile_scheduler.TileHandout, as the dense kernel's causal tiles): the 16-bit chunk tile, whose
    # ragged launches hold several tiles per SM. (The dense kernel always has it: fwd_sm90.py.)
    tile_handout: bool = False
    # Producer warps issuing a paged block's TMA pieces (each its share: pieces w, w + copy_warps, ...);
    # 1: warp 0 alone. The paged chunk tiles (16-bit and FP8) use all four (kvcache_config).
    copy_warps: int = 1
    # setmaxnreg of the widening warpgroup (widen_wg; unused without it).
    widen_regs: int = 0

    def __post_init__(self):
        if self.fp8_decode:
            from fa4_jax.kernels import fp8_decode_layout as lay

            if not (self.kv_fp8 and self.tile_m == lay.TILE_M and self.tile_n == lay.TILE_N
                    and self.head_dim in lay.HEAD_DIMS and not self.producer_widens_v):
                raise ValueError(f"fp8_decode: FP8 K/V, tile {lay.TILE_M} x {lay.TILE_N}, head_dim in {lay.HEAD_DIMS}")
        elif self.producer_widens_k and not self.producer_widens_v:
            raise ValueError("producer_widens_k: the producer widens V too")
        elif self.producer_widens_k:
            from fa4_jax.kernels import fp8_widen_layout as wl

            # fwd_sm90.widen_rows skips a warp's round only when it starts past the block: every warp's
            # rounds must end exactly at tile_n (else the last warp would write into the next stage).
            if not (self.head_dim in wl.HEAD_DIMS and self.tile_n % wl.ROUND_ROWS == 0
                    and wl.rows_per_warp(self.tile_n, wl.WARPS) % wl.ROUND_ROWS == 0):
                raise ValueError(f"producer_widens_k: head_dim in {wl.HEAD_DIMS} and whole "
                                 f"{wl.ROUND_ROWS}-row rounds per widening warp; got {self.head_dim=}, {self.tile_n=}")
        elif self.tile_m % 64:
            raise ValueError(f"tile_m must be a multiple of 64 (one wgmma M): {self.tile_m=}")
        if self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256]: {self.tile_n=}")
        if self.head_dim % 16:
            raise ValueError(f"head_dim must be a multiple of 16: {self.head_dim=}")
        if self.smem_bytes > self.smem_limit:
            raise ValueError(f"tiles need {self.smem_bytes=} > {self.smem_limit} bytes of smem "
                             f"({self.ctas_per_sm} CTAs per SM)")
        if self.widen_wg and not (self.widen_regs >= 24 and self.widen_regs % 8 == 0):
            raise ValueError(f"widen_wg: setmaxnreg takes a multiple of 8 >= 24; got {self.widen_regs=}")
        threads = self.num_threads
        regs = 128 * sum(self.warpgroup_regs) * self.launch_ctas
        if regs > SM90_REGS or threads > 1024:
            raise ValueError(f"register budget exceeded: {regs=} > {SM90_REGS}")

    @property
    def smem_limit(self) -> int:
        """Shared memory one CTA may use with ctas_per_sm of them resident: the SM's 228 KB less 1 KB
        reserved per CTA, shared out (227 KB for one CTA, 113 KB each for two)."""
        return SM90_SMEM_PER_SM // self.ctas_per_sm - 1024

    @property
    def launch_ctas(self) -> int:
        """The CTAs per SM the launch bounds registers for (min_blocks_per_mp)."""
        return self.launch_bound_ctas or self.ctas_per_sm

    @property
    def num_consumer_wg(self) -> int:
        return 1 if self.fp8_decode else self.tile_m // 64

    @property
    def widen_wg(self) -> bool:
        """The FP8 chunk tile (producer_widens_k): K and V are widened by a fourth warpgroup after the
        consumers' (four warps, one per SM sub-partition, 32 rows of each block each) at setmaxnreg
        widen_regs; the producer warpgroup only loads. Three producer warps widening (48 / 48 / 32
        rows on three sub-partitions) took 1.03-1.04x its time (docs/PERF.md, 2026-12-06, eleventh
        session)."""
        return self.producer_widens_k

    @property
    def warpgroup_regs(self) -> tuple[int, ...]:
        """setmaxnreg of each warpgroup, in warp order: the producer, the consumers, the widening
        warpgroup (widen_wg). Their sum x 128 threads must fit the launch allocation (checked here
        against the SM's registers, and by the build against the cubin's: aot/worker.py)."""
        return ((self.producer_regs,) + (self.consumer_regs,) * self.num_consumer_wg
                + ((self.widen_regs,) if self.widen_wg else ()))

    @property
    def num_threads(self) -> int:
        return 128 * (self.num_consumer_wg + 1 + int(self.widen_wg))

    @property
    def _base_smem_bytes(self) -> int:
        elem = 2  # bf16 / fp16
        if self.fp8_decode:
            from fa4_jax.kernels import fp8_decode_layout as lay

            # Q lives in registers; the merge buffer instead of the widened buffers.
            return (lay.stage_smem_bytes(self.head_dim, self.stages) + lay.merge_smem_bytes(self.head_dim)
                    + SMEM_STRUCT_OVERHEAD)
        q = self.tile_m * self.head_dim * elem
        kv = 2 * self.stages * self.tile_n * self.head_dim * (1 if self.kv_fp8 else elem)
        # The fp16 K buffer and V's (each a ring of `stages` when the producer widens it).
        rings = (self.stages if self.producer_widens_k else 1) + (self.stages if self.producer_widens_v else 1)
        widened = rings * self.tile_n * self.head_dim * elem
        widened = widened if self.kv_fp8 else 0
        # The kernel's shared storage (fwd_sm90.make_shared_storage) aligns every buffer to 1 KB: the
        # mbarriers ahead of the first buffer take one 1 KB slot, and the small fields after the last
        # (FP8 amax, split-merge flag, tile-handout slot) round the struct up by another. (Counting one
        # KB only, three configurations that asked for two CTAs per SM got one: the kernel checks.)
        return q + kv + widened + SMEM_STRUCT_OVERHEAD

    @property
    def separate_o(self) -> bool:
        """O gets its own smem staging buffer when it fits (hd <= 128). The persistent kernel then
        loads the next tile's Q while this tile's last PV gemm, epilogue and O store run; otherwise
        O reuses Q's buffer and the next Q waits for the store to have read it."""
        return self.o_staging and self._base_smem_bytes + self.tile_m * self.head_dim * 2 <= SM90_SMEM_BYTES

    @property
    def smem_bytes(self) -> int:
        return self._base_smem_bytes + (self.tile_m * self.head_dim * 2 if self.separate_o else 0)

    @classmethod
    def for_variant(cls, v: FwdVariant, varlen: bool = False) -> "Sm90FwdConfig":
        """The tile of a dense variant, or (varlen=True) of the varlen kernel of the same fields."""
        hd = v.head_dim
        if v.tile_m == 64:
            # hd64's short-problem tile (ops/fwd/spec.py SHORT_TILES: causal, max(s_q, s_k) <= 1024): one
            # consumer warpgroup of 64 rows, two CTAs per SM (128 launch registers each: 232 consumer / 24
            # producer), 128-key blocks, 2 stages (81 KB with O's buffer, two per SM).
            return cls(hd, 64, 128, 2, 232, 24, False, False, ctas_per_sm=2)
        if 64 < hd <= 96 and v.tile_m == 0 and (v.mask == "full" or (v.mask == "causal" and not varlen)):
            # hd64's tile at hd96: 192 rows over three consumer warpgroups of 160 registers, so each K/V
            # block feeds 1.5x the rows (the softmax per block is the same work at every head dim);
            # 96-key blocks (O 48 + S 48 fp32 per thread: 128-key blocks spilled 48-96 bytes). H100
            # 2026-12-06: full 4k / 16k 0.90 / 0.90x the time of the 128-row tile, causal 8k / 16k 0.95x.
            # Causal problems up to 2k keep the 128-row tile (tile_m 128, SHORT_TILES: 192 rows took
            # 1.115x at 1k causal, fewer and more unequal tiles), and so does varlen causal, which has no
            # per-call choice of tile and whose sequences are often short; windows keep it too.
            return cls(hd, 192, 96, 2, 160, 32, False, True)
        if hd <= 64:
            # Three consumer warpgroups: at hd 64 the softmax (exp) per tile is large relative to the
            # gemms, so more rows per CTA amortise K/V loads and keep the tensor cores fed.
            return cls(hd, 192, 128, 2, 160, 32, False, True)
        if hd <= 128:
            return cls(hd, 128, 128, 2, 240, 24, False, True)
        if hd <= 192:
            return cls(hd, 128, 112, 2, 240, 24, True, False)
        return cls(hd, 128, 80, 2, 240, 24, True, False)


def kvcache_config(head_dim: int, tile_m: int = 64, paged: bool = False, kv_fp8: bool = False,
                   page_rows: int = 16) -> Sm90FwdConfig:
    """KV-cache tiles: pack-GQA query rows (seqlen_q x q-heads per KV head) -- 64 (one consumer
    warpgroup) for decode, which has few rows, or 128 (two warpgroups) for chunked prefill, which
    is compute-bound like the dense kernel -- and as many K/V stages as shared memory holds, because
    decode is bound by HBM bandwidth: each SM needs ~64 KB of loads in flight to draw its share of
    4.3 TB/s. Producer registers: setmaxnreg only moves registers within the CTA's launch
    allocation. At tile_m 128 that is 168 x 384 = 2 x 240 + 24 per thread slot, full: a producer
    budget of 32 hung on the H200 (the consumers waited forever to rise to 240); a paged one trades
    8 registers of each consumer for 16 more of its own. At tile_m 64 it is
    240 x 256, so a paged producer (page lookups, shuffles, row addresses: it spilled at 24) keeps
    64, whether it copies TMA pieces or (one-row pages) gathers rows with its whole warpgroup.
    Decode at hd128 runs two CTAs per SM (ctas_per_sm; see below), except the paged 16-bit tile;
    FP8 decode at hd64 and hd128 does too; its few-row tile (tile_m fp8_decode_layout.TILE_M) is
    fp8_decode_config's. FP8 chunks (tile_m 128) run the 16-bit chunk tile on K and V that a fourth
    warpgroup widens into fp16 rings (producer_widens_k, widen_wg: 512 threads of 128 registers)."""
    from fa4_jax.kernels import fp8_decode_layout as lay

    if kv_fp8 and tile_m == lay.TILE_M:
        return fp8_decode_config(head_dim, paged)
    tile_n = 128 if head_dim <= 128 else 64
    producer_regs, consumer_regs = 24, 240
    if paged and tile_m == 128:
        # The launch allocation is full (2 x 240 + 24 = 3 x 168) and the paged producer spilled at 24
        # (a 24-104 byte frame). 2 x 232 + 40 fills it exactly; the consumers do not spill at 232
        # (frame 0 at every head dim) and the producer does not at 40.
        producer_regs, consumer_regs = 40, 232
    if paged and tile_m == 64:
        # The paged producer spills at 24 registers (an 88-96 byte stack frame); at tile_m 64 the
        # kernel launches with 240 registers x 256 threads, so the one consumer warpgroup keeps its
        # 240 and the producer can keep 64 (frame 0; page-1 decode 2.5 -> 3.6 TB/s).
        producer_regs = 64

    # Two warpgroups take turns issuing their gemms (as the dense kernel does at hd <= 128), so that one's
    # softmax runs under the other's gemms: a chunk is compute-bound.
    pingpong = tile_m == 128 and head_dim <= 128
    ctas, max_stages, launch_bound = 1, 4, 0
    if tile_m == 64 and head_dim == 128:
        # Decode at hd128: two CTAs per SM (128 launch registers, shared by setmaxnreg: 232 consumer /
        # 24 producer, or 216 / 40 for the paged producer, which spills at 24 and does not at 40;
        # 64-key blocks). Twice the resident warps and finer blocks draw HBM bandwidth more evenly.
        # Same-run A/B against one CTA per SM of 128-key blocks (docs/PERF.md): contiguous
        # 0.976-0.987x the time at 1 x 8k, 1 x 32k and 8 x 32k with two stages; the "three stages"
        # measured then (113 KB, and paged 0.92-0.97x at 8 x 32k) were 114 KB in fact: one CTA per SM
        # of 64-key blocks (see the paged case below).
        tile_n, ctas = 64, 2
        producer_regs, consumer_regs = (40, 216) if paged else (24, 232)
        max_stages = 2
        if paged and not kv_fp8:
            # The paged 16-bit tile keeps one CTA per SM with three stages: what ran (and was measured)
            # since 2026-12-02, when the shared-memory estimate was 1 KB short and two did not fit;
            # two CTAs with two stages each measured 1-3% slower at pages 16 and 64 (docs/PERF.md,
            # 2026-12-04). Its launch keeps the register bound of two CTAs (128 per thread; the code
            # measured): bounded for one, ptxas gave it 216 at launch and an 8-24 byte stack frame.
            ctas, max_stages, launch_bound = 1, 3, 2
    if kv_fp8 and tile_m == 64 and head_dim == 64:
        # FP8 tiles are bound by the consumer warpgroup widening each block (fwd_sm90.dequant), not by
        # HBM: a second CTA per SM doubles the warps that widen (hd128 2026-12-04: 1.28x on batched
        # rows). 128 launch registers as at hd128.
        ctas = 2
        producer_regs, consumer_regs = (40, 216) if paged else (24, 232)

    if kv_fp8:
        # FP8 stages are half the bytes: twice as many keep the same bytes in flight per SM (as many
        # as fit: three at hd128 and four at hd64 with two CTAs per SM where the consumer widens V into
        # one buffer; two beside the producer's ring of fp16 V stages).
        max_stages *= 2
    producer_widens = kv_fp8 and not (paged and page_rows == 1)
    if producer_widens and tile_m == 64:
        # The widening warps hold 8 loads at a time before their stores (fwd_sm90.widen_block): 40
        # registers, as the paged producer; the consumer keeps 216 (the 128 launch registers of two
        # CTAs per SM shared out exactly; at 200 its split merge spilled).
        producer_regs, consumer_regs = 40, 216
    widens_k = kv_fp8 and tile_m == 128
    widen_regs = 0
    if widens_k:
        # The FP8 chunk tile: both warpgroups read every block, so K is widened as well as V (two fp16
        # rings; the FP8 stages are only the widening's source), by a warpgroup of its own (widen_wg).
        # 512 threads launch with 128 registers each: 2 x 224 + 24 (the loads' warp) + 40 (the
        # widening's 16-row rounds); paged, the loads' warps spill at 24: 2 x 216 + 40 + 40 (the
        # consumers have no stack frame at 216). One-row pages have no producer warps to spare (the
        # whole warpgroup gathers rows): they keep the 64-row tile.
        if not producer_widens:
            raise ValueError("FP8 K/V: the two-warpgroup tile needs the producer's widening (no one-row pages)")
        producer_regs, consumer_regs, widen_regs = (40, 216, 40) if paged else (24, 224, 40)

    # The 16-bit chunk tile takes its tiles from a counter (tile_handout): a ragged prefill holds ~8 tiles
    # per SM, each of which would otherwise pay a CTA's start (Q, the first K/V blocks) and end (the
    # last PV gemm, O's stores) with nothing beside them. Not the FP8 chunk tile (its widening warps
    # walk the tiles themselves) nor one-row pages (the whole producer warpgroup gathers rows).
    handout = tile_m == 128 and not kv_fp8 and not (paged and page_rows == 1)
    # Its paged block's 16 TMA boxes per tensor (8 pieces of 16 rows, two swizzle halves each), their
    # page lookups and shuffles, ~425 producer instructions per block, went through warp 0, on the
    # sub-partition of one warp of each consumer warpgroup: those consumer warps fell behind in their
    # softmax, and the other warpgroup waited at the ping-pong turn (Nsight Compute, ragged chunks
    # page 64: 4.5x the contiguous kernel's turn waits). Spread over the four producer warps, one per
    # sub-partition, the step runs 2.5% faster (H100, docs/PERF.md 2026-12-06, tenth session).
    # Beside the FP8 chunk tile's widening warpgroup the producer warpgroup's warps 1-3 are free, and one
    # widening warp shares sub-partition 0 with the loads' warp: its paged pieces go over four warps too.
    copy_warps = 4 if (handout or widens_k) and paged else 1

    def config(stages: int) -> Sm90FwdConfig:
        return Sm90FwdConfig(head_dim, tile_m, tile_n, stages, consumer_regs, producer_regs, head_dim > 128, pingpong,
                             o_staging=False, ctas_per_sm=ctas, kv_fp8=kv_fp8, launch_bound_ctas=launch_bound,
                             producer_widens_v=producer_widens, producer_widens_k=widens_k, tile_handout=handout,
                             copy_warps=copy_warps, widen_regs=widen_regs)

    return _most_stages(config, max_stages)


def _most_stages(config, max_stages: int) -> Sm90FwdConfig:
    """config(stages) with the most stages in [2, max_stages] that fit shared memory."""
    stages = 2
    while stages < max_stages:
        try:
            config(stages + 1)
        except ValueError:  # out of shared memory
            break
        stages += 1
    return config(stages)


def fp8_decode_config(head_dim: int, paged: bool) -> Sm90FwdConfig:
    """The FP8 decode tile (decode_fp8_sm90.py): 16 packed rows, 64-key stages, two CTAs per SM (128
    launch registers: 232 consumer / 24 producer, or 216 / 40 paged, as the 64-row decode tiles) and
    as many stages as the other half of the shared memory holds beside the merge buffer: FP8 bytes
    in flight are what draws HBM bandwidth, and nothing else needs the space."""
    from fa4_jax.kernels import fp8_decode_layout as lay

    producer_regs, consumer_regs = (40, 216) if paged else (24, 232)

    def config(stages: int) -> Sm90FwdConfig:
        return Sm90FwdConfig(head_dim, lay.TILE_M, lay.TILE_N, stages, consumer_regs, producer_regs, False, False,
                             o_staging=False, ctas_per_sm=2, kv_fp8=True, fp8_decode=True)

    return _most_stages(config, 8)
