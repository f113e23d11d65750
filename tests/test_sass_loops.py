"""fa4_jax.aot.sass.loop_bodies (tools/sass_loops.py) on a hand-written nvdisasm listing: no CUDA
tools needed. A loop is a backward branch's span, counted once; forward branches are not loops."""

from __future__ import annotations

from fa4_jax.aot import sass

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0020*/                   MUFU.EX2 R3, R2 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   F2FP.BF16.F32.PACK_AB R5, R4, R3 ;
.L_x_1:
        /*0050*/                   FMNMX R6, R5, R4, !PT ;
        /*0060*/               @!P1 BRA `(.L_x_0) ;
        /*0070*/                   LDS.64 R8, [R2+UR4] ;
.L_x_2:
        /*0080*/                   F2FP.F16.E4M3.UNPACK_B R10, R8 ;
        /*0090*/                   STS.128 [R3], R8 ;
        /*00a0*/               @P2 BRA `(.L_x_2) ;
        /*00b0*/                   EXIT ;
"""


def test_backward_branches_are_loops_counted_from_target_to_branch():
    loops = sass.loop_bodies(LISTING)
    assert [(t, b) for t, b, _ in loops] == [(0x10, 0x60), (0x80, 0xA0)]
    outer = loops[0][2]
    # The forward branch inside is one of the body's instructions, its target is not a loop.
    assert outer == {"HGMMA": 1, "MUFU": 1, "BRA": 2, "F2FP": 1, "FMNMX": 1}
    assert loops[1][2] == {"F2FP": 1, "STS": 1, "BRA": 1}


def test_no_loops_without_backward_branches():
    straight = "\n".join(line for line in LISTING.splitlines() if "BRA" not in line)
    assert sass.loop_bodies(straight) == []
