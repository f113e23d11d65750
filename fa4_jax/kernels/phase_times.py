"""Optional per-CTA phase timestamps in the KV-cache kernel, for tools/decode_phases.py (issue 20: where a
short decode call's time goes). Build time only.

Off unless the library is built with FA4_JAX_PHASE_TIMES=1 (the exporter's object cache keys on it,
aot/cache.fingerprint): the kernels are then unchanged. On, every CTA's first consumer thread reads
%globaltimer at the points below and, at its end, prints one line per CTA with device printf:

    PHASE <cta> <merged> <entry> <consume> <q_ready> <first_k> <mainloop_end> <stored> <merge_start> <end>
    PROD  <cta> <load_start> <first_k_issued> <last_issued>

`merged` is 1 for the split CTA that merged its tile's splits. The producer's stamps travel through
shared memory: a printf from the producer warp, at its setmaxnreg budget of 24-40 registers, hit an
illegal instruction on the H200.
"""

from __future__ import annotations

import os

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

ENABLED = os.environ.get("FA4_JAX_PHASE_TIMES", "") == "1"

# Consumer stamps (indices into Stamps.consumer) and producer stamps (Stamps.producer, in shared memory).
ENTRY, CONSUME, Q_READY, FIRST_K, MAINLOOP_END, STORED, MERGE_START, END = range(8)
LOAD_START, FIRST_K_ISSUED, LAST_ISSUED = range(3)


class Stamps:
    """The stamps of one CTA while the kernel is traced. Disabled (`on` False: the build's default, or
    a kernel other than the KV-cache family's), every method is a no-op that emits nothing."""

    def __init__(self, on: bool):
        self.on = on
        self.consumer = None
        self.producer = None  # shared memory, 3 x Int64
        self.producer_regs = None

    def start(self, storage):
        """At kernel entry (every thread): the entry stamp and the producer's shared slots."""
        if not self.on:
            return
        self.entry = cute.arch.globaltimer()
        self.producer = storage.phase_times.get_tensor(cute.make_layout(3))

    def begin_consumer(self):
        if not self.on:
            return
        self.consumer = cute.make_rmem_tensor(8, cutlass.Int64)
        self.consumer.fill(0)
        self.consumer[ENTRY] = self.entry
        self.consumer[CONSUME] = cute.arch.globaltimer()

    def begin_producer(self):
        if not self.on:
            return
        self.producer_regs = cute.make_rmem_tensor(3, cutlass.Int64)
        self.producer_regs.fill(0)
        self.producer_regs[LOAD_START] = cute.arch.globaltimer()

    def consumer_at(self, i: int):
        if self.on:
            t = self.consumer
            t[i] = cute.arch.globaltimer()

    def producer_at(self, i: int):
        if self.on:
            t = self.producer_regs
            t[i] = cute.arch.globaltimer()

    @cute.jit
    def end_producer(self):
        """The producer's stamps into shared memory (its first thread only)."""
        if const_expr(self.on):
            t, s = self.producer_regs, self.producer
            t[LAST_ISSUED] = cute.arch.globaltimer()
            if cute.arch.thread_idx()[0] == 0:
                for i in cutlass.range_constexpr(3):
                    s[i] = t[i]

    @cute.jit
    def end_consumer(self, tidx, merged):
        """The CTA's lines, from its first consumer thread."""
        if const_expr(self.on):
            t, s = self.consumer, self.producer
            t[END] = cute.arch.globaltimer()
            if tidx == 0:
                cta = cute.arch.block_idx()[0]
                cute.printf("PHASE %d %d %lld %lld %lld %lld %lld %lld %lld %lld\n", cta, merged, t[0], t[1], t[2],
                            t[3], t[4], t[5], t[6], t[7])
                cute.printf("PROD %d %lld %lld %lld\n", cta, s[0], s[1], s[2])


def smem_fields(on: bool) -> dict:
    """The shared-storage field of the producer's stamps (none when off)."""
    return {"phase_times": cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 3], 16]} if on else {}
