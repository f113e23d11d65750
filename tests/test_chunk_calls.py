"""tools/chunk_calls.py (the program Nsight Compute profiles for one chunked-prefill row) builds each
row's call and runs it: on the CPU through the XLA reference at benchmark_serving's QUICK sizes."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))

import chunk_calls  # noqa: E402


@pytest.mark.parametrize("row", chunk_calls.ROWS)
def test_every_row_runs(row, capsys):
    assert chunk_calls.main(["--row", row, "--quick", "--xla", "--calls", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{row}: 1 calls, mean |o| ")
    assert float(out.split()[-1]) > 0  # random inputs: a finite, non-zero output
