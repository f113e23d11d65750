"""tools/ncu_stalls.py on a small CSV of Nsight Compute's source-page shape (CPU): offsets from the
kernel's first instruction, stall totals per reason, address ranges, the report."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import ncu_stalls  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "Instructions Executed", "stall_barrier", "stall_long_sb", "stall_wait", "stall_barrier (Not Issued)"]
ROWS = [
    ["0x7f0000001000", "  S2R R11, SR_TID.X", "5", "5", "100", "0", "0", "5", "0"],
    ["0x7f0000001010", "  BAR.SYNC.DEFER_BLOCKING R11, 0x100", "7", "7", "100", "1", "0", "6", "1"],
    ["0x7f0000001020", "  UMOV UR19, 0x40000040", "90", "88", "100", "88", "0", "2", "88"],
    ["0x7f0000001030", "  @!P0  NANOSLEEP.SYNCS 0x989680", "40", "40", "50", "0", "40", "", "0"],
]


def _write(tmp_path, name, rows):
    path = tmp_path / name
    lines = ['"Kernel Name","kernel_cutlass_kernel_x",'] + [",".join(f'"{c}"' for c in r) for r in [HEADER] + rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_load_totals_and_ranges(tmp_path):
    instrs = ncu_stalls.load(_write(tmp_path, "a.csv", ROWS))
    assert [i.offset for i in instrs] == [0x0, 0x10, 0x20, 0x30]
    assert instrs[2].source == "UMOV UR19, 0x40000040" and instrs[2].samples == 90 and instrs[2].executed == 100
    assert set(instrs[0].stalls) == {"barrier", "long_sb", "wait"}  # "(Not Issued)" columns left out
    t = ncu_stalls.totals(instrs)
    assert (t["barrier"], t["long_sb"], t["wait"]) == (89, 40, 13)
    inner = ncu_stalls.within(instrs, *ncu_stalls.parse_range("0x10-0x20"))
    assert [i.offset for i in inner] == [0x10, 0x20]
    assert ncu_stalls.totals(inner)["long_sb"] == 0


def test_report_compares_two_profiles(tmp_path, capsys):
    more_barrier = [r[:] for r in ROWS]
    more_barrier[2][2], more_barrier[2][5] = "190", "188"
    a, b = _write(tmp_path, "contig.csv", ROWS), _write(tmp_path, "paged.csv", more_barrier)
    assert ncu_stalls.main([a, b, "--range", "0x0-0x20", "--top", "2"]) == 0
    out = capsys.readouterr().out
    barrier = next(line for line in out.splitlines() if line.startswith("barrier"))
    assert barrier.split()[1] == "89" and barrier.split()[3] == "189"  # samples, share, samples, share
    assert "top 2 instructions of paged.csv" in out and "UMOV UR19" in out and "NANOSLEEP" not in out
