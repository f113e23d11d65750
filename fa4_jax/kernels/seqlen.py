"""Sequence lengths of one batch entry, read once per tile: the one place a kernel asks for
seqlen_q, seqlen_k and where a sequence starts in its tensors.

Dense tensors: the lengths are the tensors' extents, offsets are 0. Varlen tensors add offsets
(from `cu_seqlens`), a KV cache its valid lengths; tile_problem.TileProblem builds the SeqlenInfo
of each, and block ranges, masks and epilogues only ever read a SeqlenInfo.
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
    # CACHE: the extent-0 coordinate of the sequence's rows in q / o / lse -- its batch index, or 0
    # for a ragged batch, whose rows all sit in one packed (1, total_q, h, d) tensor at offset_q.
    batch_q: Int32 | int = 0

    @staticmethod
    def dense(seqlen_q: Int32, seqlen_k: Int32) -> "SeqlenInfo":
        return SeqlenInfo(seqlen_q, seqlen_k)
