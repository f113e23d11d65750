"""The seams of a forward attention kernel: where the dense, varlen and KV-cache families differ.

One forward kernel class per architecture (today fwd_sm90.FlashAttentionForwardSm90) has one body
-- producer, mainloop, softmax, masks -- and a `FwdSeams` that picks, at compile time, the piece
plugged into each seam (FlashAttention-3/4 style switches, named so that an SM100 kernel can offer
the same ones):

- seqlens: where a tile's sequence lengths come from (SeqlenInfo, seqlen.py)
    DENSE   the tensors' extents (b, s, h, d)
    VARLEN  cu_seqlens_q / cu_seqlens_k offsets into packed (t, h, d) tensors, seqused_k
    CACHE   cache_seqlens[b] keys of a KV cache, clamped to its capacity; a ragged batch's rows
            from cu_seqlens_q (a runtime flag: the same kernel serves both)
- q_load: how a tile's Q rows reach shared memory
    TMA         one TMA box at the sequence's offset
    PACKED_GQA  the (query, q-head) rows of one KV head's q-heads, gathered row by row (cp.async)
- kv_load: how K/V blocks reach shared memory
    CONTIGUOUS  one TMA box per block
    PAGED       a page table maps pieces to pages of a pool: 16-row TMA boxes, or (page_rows 1, any
                page size) rows gathered by the producer warpgroup with cp.async
- scheduler: which tiles a CTA takes (tile_scheduler.py)
    PERSISTENT  a 1-D grid of min(tiles, max_ctas) CTAs, longest tiles first for causal/local masks
    SPLIT       one CTA per (tile, split): the KV blocks of a tile are divided over num_splits CTAs
- epilogue: how O and LSE leave the CTA
    TMA_STORE       O staged in shared memory, one TMA box (dense: the box ends where the tensor does)
    ROW_STORE       from registers with a row predicate (varlen: a box would clobber the next sequence)
    SPLIT_PARTIALS  from registers, per packed row: final o / lse, or float32 partials that the
                    last split CTA of each tile, or the combine kernel, merges (split_merge.py)

Pure Python: the family entry modules (fwd.py, varlen.py, kvcache.py) pick a preset.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


# The values of each seam, as listed in the module docstring.
Seqlens = enum.Enum("Seqlens", ["DENSE", "VARLEN", "CACHE"])
QLoad = enum.Enum("QLoad", ["TMA", "PACKED_GQA"])
KVLoad = enum.Enum("KVLoad", ["CONTIGUOUS", "PAGED"])
Scheduler = enum.Enum("Scheduler", ["PERSISTENT", "SPLIT"])
Epilogue = enum.Enum("Epilogue", ["TMA_STORE", "ROW_STORE", "SPLIT_PARTIALS"])


@dataclass(frozen=True)
class FwdSeams:
    seqlens: Seqlens
    q_load: QLoad
    kv_load: KVLoad
    scheduler: Scheduler
    epilogue: Epilogue

    def __post_init__(self):
        # The combinations the kernels implement. Pack-GQA rows map to (query, head) by a runtime
        # division, so they go with per-row stores; split partials need the combine kernel's layout.
        supported = {
            (Seqlens.DENSE, QLoad.TMA, KVLoad.CONTIGUOUS, Scheduler.PERSISTENT, Epilogue.TMA_STORE),
            (Seqlens.VARLEN, QLoad.TMA, KVLoad.CONTIGUOUS, Scheduler.PERSISTENT, Epilogue.ROW_STORE),
            (Seqlens.CACHE, QLoad.PACKED_GQA, KVLoad.CONTIGUOUS, Scheduler.SPLIT, Epilogue.SPLIT_PARTIALS),
            (Seqlens.CACHE, QLoad.PACKED_GQA, KVLoad.PAGED, Scheduler.SPLIT, Epilogue.SPLIT_PARTIALS),
        }
        if (self.seqlens, self.q_load, self.kv_load, self.scheduler, self.epilogue) not in supported:
            raise ValueError(f"no kernel implements {self}")

    @property
    def keys_past_end(self) -> bool:
        """Whether a K/V block may run past the sequence's last key into memory the sequence does
        not own (a cache's unused slots or pages, the next packed sequence). Dense tensors end where
        the sequence ends (TMA fills zeros past it)."""
        return self.seqlens is not Seqlens.DENSE

    @staticmethod
    def dense() -> "FwdSeams":
        return FwdSeams(Seqlens.DENSE, QLoad.TMA, KVLoad.CONTIGUOUS, Scheduler.PERSISTENT, Epilogue.TMA_STORE)

    @staticmethod
    def varlen() -> "FwdSeams":
        return FwdSeams(Seqlens.VARLEN, QLoad.TMA, KVLoad.CONTIGUOUS, Scheduler.PERSISTENT, Epilogue.ROW_STORE)

    @staticmethod
    def kvcache(paged: bool) -> "FwdSeams":
        return FwdSeams(Seqlens.CACHE, QLoad.PACKED_GQA, KVLoad.PAGED if paged else KVLoad.CONTIGUOUS,
                        Scheduler.SPLIT, Epilogue.SPLIT_PARTIALS)
