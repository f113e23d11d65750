"""The examples that run in seconds on a CPU stay runnable (each in a fresh process, as a user runs
it): generate.py (tiny config, Flax decoder with a paged cache) and sharded_inference.py (8 fake CPU
devices)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,expect", [
    ("generate.py", "logits vs the XLA-reference model at every step"),
    ("sharded_inference.py", "context-parallel"),
])
def test_example_runs(script, expect):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # sharded_inference.py asks for its 8 host devices itself
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert expect in proc.stdout and proc.stdout.rstrip().endswith("OK"), proc.stdout[-2000:]
