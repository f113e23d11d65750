"""tools/decode_phases.py's reading of the kernel's phase stamps (kernels/phase_times.py), on CPU: the
lines of the last call only, the phases per CTA, skipped phases left out, and the missing-stamps error."""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "decode_phases.py")
_spec = importlib.util.spec_from_file_location("decode_phases", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


def _phase(cta, merged, entry, *deltas):
    """A PHASE line: stamps at entry + the running sum of deltas (0 = a skipped phase)."""
    stamps, t = [entry], entry
    for d in deltas:
        t += d
        stamps.append(t if d else 0)
    return " ".join(str(x) for x in ["PHASE", cta, merged, *stamps])


def test_summary_of_the_last_call():
    first = _phase(0, 0, 5, 1, 1, 1, 1, 1, 1, 1)  # a warm-up call's line: ignored
    text = "\n".join([
        first, "CALL 0",
        _phase(0, 0, 1000, 400, 1500, 100, 7000, 700, 50, 1300), "PROD 0 1450 2350 9000",
        _phase(1, 1, 1064, 380, 1600, 60, 7600, 740, 40, 3000), "PROD 1 1500 2400 9800",
        _phase(2, 0, 1032, 420, 0, 0, 0, 600, 30, 1200), "PROD 2 1470 0 1480",  # a split with no keys
        "some other output", "CALL 1",
    ])
    phases, prods = tool.last_call(text)
    assert [p[0] for p in phases] == [0, 1, 2] and sorted(prods) == [0, 1, 2]
    rows = {label: (n, lo, med, hi) for label, n, lo, med, hi in tool.summarize(phases, prods)}
    assert rows["kernel entry (after the first CTA's)"] == (3, 0, 32, 64)
    assert rows["producer: entry -> load start"] == (3, 436, 438, 450)
    assert rows["producer: -> first K copy issued"] == (2, 900, 900, 900)
    assert rows["consumer: Q gathered"] == (2, 1500, 1600, 1600)
    assert rows["consumer: mainloop"] == (2, 7000, 7600, 7600)
    assert rows["consumer: finalize + store"] == (2, 700, 740, 740)  # not CTA 2: it ran no mainloop
    assert rows["consumer: merge protocol (not last)"] == (2, 1200, 1300, 1300)
    assert rows["consumer: merge protocol + merge (last)"] == (1, 3000, 3000, 3000)
    assert rows["CTA end (after the first CTA's entry)"][3] == 1064 + 380 + 1600 + 60 + 7600 + 740 + 40 + 3000 - 1000


def test_a_library_without_stamps_is_named():
    with pytest.raises(SystemExit, match="no phase stamps: build the library with FA4_JAX_PHASE_TIMES=1"):
        tool.last_call("CALL 0\nCALL 1\n")
