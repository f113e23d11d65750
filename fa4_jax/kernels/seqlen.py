"""Sequence lengths of one batch entry, read once per tile: the one place a kernel asks for
seqlen_q, seqlen_k and where a sequence starts in its tensors.

Dense tensors (today's families): the lengths are the tensors' extents, offsets are 0. The varlen
and KV-cache families add constructors here (offsets from `cu_seqlens`, seqlen_k from the cache's
valid lengths) and the kernels' block ranges, masks and epilogues stay as they are, since they only
ever read a SeqlenInfo.
"""

from __future__ import annotations

from dataclasses import dataclass

from cutlass import Int32


@dataclass(frozen=True)  # frozen: usable inside a kernel's dynamic tile loop (see tile_scheduler.py)
class SeqlenInfo:
    seqlen_q: Int32
    seqlen_k: Int32
    offset_q: Int32 | int = 0
    offset_k: Int32 | int = 0

    @staticmethod
    def dense(seqlen_q: Int32, seqlen_k: Int32) -> "SeqlenInfo":
        return SeqlenInfo(seqlen_q, seqlen_k)
