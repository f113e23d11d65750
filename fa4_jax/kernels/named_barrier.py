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

    @classmethod
    def turn(cls, wg) -> int:
        """The barrier a consumer warpgroup (0-based, possibly a runtime value) waits on for its turn."""
        return int(cls.WG1_TURN) + wg
