"""Named hardware barriers (bar.sync ids) used by the SM90 kernels. 0 is __syncthreads; the K/V/Q
pipelines use mbarriers, not named barriers. 16 ids exist per CTA."""

from __future__ import annotations

import enum


class NamedBarrierFwd(enum.IntEnum):
    SYNC_THREADS = 0
    EPILOGUE = 1  # all consumer warpgroups: sO aliases sQ, written only after everyone read Q
    WG1_TURN = 2  # ping-pong: consumer warpgroup 0 may issue its gemms (then 3 and 4 for wg 1, 2)
    WG2_TURN = 3
    WG3_TURN = 4
    WG1_V_TAIL = 5  # a consumer warpgroup's own V rows zeroed (see clear_v_rows in fwd_sm90.py); 6, 7 for wg 1, 2
    WG2_V_TAIL = 6
    WG3_V_TAIL = 7
    TILE_FULL = 8  # dynamic tile handout (tile_scheduler.TileHandout): the next tile index is in shared memory
    TILE_EMPTY = 9  # ... and every consumer has read it

    @classmethod
    def turn(cls, wg) -> int:
        """The barrier a consumer warpgroup (0-based, possibly a runtime value) waits on for its turn."""
        return int(cls.WG1_TURN) + wg

    @classmethod
    def v_tail(cls, wg) -> int:
        """The barrier of one consumer warpgroup's 128 threads after they zeroed V rows."""
        return int(cls.WG1_V_TAIL) + wg
