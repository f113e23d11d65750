"""tools/fa4_sass_compare.py's SASS reading, on a synthetic listing (the tool itself needs the
FlashAttention-4 wheels, so only its parsing is a CPU test)."""

from __future__ import annotations

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "fa4_sass_compare.py")
_spec = importlib.util.spec_from_file_location("fa4_sass_compare", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                /* 0x00000a0000017a02 */
.L_x_3:
        /*0010*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR20], RZ, !UPT ;
        /*0020*/                   HGMMA.64x80x16.F32.BF16 R24, gdesc[UR24], R24 ;
.L_x_4:
        /*0030*/                   F2FP.BF16.F32.PACK_AB R18, RZ, R152 ;
        /*0040*/                   PRMT R192, R18, 0x5410, R192 ;
        /*0050*/                   HGMMA.64x256x16.F32.BF16 R24, R192, gdesc[UR20].tnspB, R24, gsb0 ;
        /*0060*/                   HGMMA.64x256x16.F32.BF16 R24, R196, gdesc[UR24].tnspB, R24, gsb0 ;
        /*0070*/               @P1 BRA `(.L_x_4) ;
        /*0080*/                   MUFU.EX2 R3, R3 ;
        /*0090*/               @!P0 BRA `(.L_x_3) ;
        /*00a0*/                   BRA `(.L_x_5) ;
.L_x_5:
        /*00b0*/                   EXIT ;
"""


def test_loops_with_gemms_and_their_opcodes():
    loops = tool.loop_histograms(LISTING, min_hgmma=2)
    # Two backward branches: the inner loop (.L_x_4, 2 HGMMA) and the outer (.L_x_3, 4); the forward
    # branch to .L_x_5 is no loop.
    assert sorted(sum(c.values()) for c in loops) == [5, 9]
    inner = min(loops, key=lambda c: sum(c.values()))
    assert inner == {"F2FP": 1, "PRMT": 1, "HGMMA": 2, "BRA": 1}
    outer = max(loops, key=lambda c: sum(c.values()))
    assert outer["HGMMA"] == 4 and outer["MUFU"] == 1 and outer["BRA"] == 2
    assert tool.loop_histograms(LISTING, min_hgmma=5) == []


def test_loop_bodies_are_the_histograms_instructions_smallest_first():
    bodies = tool.loop_bodies(LISTING, min_hgmma=2)
    assert [len(b) for b in bodies] == [5, 9]
    assert [tool._opcode(line) for line in bodies[0]] == ["F2FP", "PRMT", "HGMMA", "HGMMA", "BRA"]
    assert bodies[0][2].startswith("HGMMA.64x256x16.F32.BF16 R24, R192, gdesc[UR20].tnspB")
    assert [sum(c.values()) for c in tool.loop_histograms(LISTING, min_hgmma=2)] == [5, 9]
