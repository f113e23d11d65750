"""Every fenced ```python block of README.md runs as written (CPU, each in a fresh process, as a user who
copies it would run it): the blocks define their own inputs. Blocks of other languages (bash) are not run."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of each fenced block whose info string is `python`."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(2)) for m in _FENCE.finditer(text) if m.group(1) == "python"]


BLOCKS = python_blocks(README.read_text())


def _block_id(index: int, line: int, source: str) -> str:
    first = next((s.strip() for s in source.splitlines() if s.strip()), "")
    return f"block{index}-line{line}: {first[:60]}"


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 4, f"expected the API, KV-cache, varlen and Flax snippets; found {len(BLOCKS)} python blocks"


def test_fence_parser():
    text = "a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\n\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (8, "y = 2\n\n")]


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[_block_id(i, *b) for i, b in enumerate(BLOCKS)])
def test_python_block_runs(index):
    line, source = BLOCKS[index]
    label = _block_id(index, line, source)
    if re.search(r"^\s*(from|import) flax\b", source, re.MULTILINE) and importlib.util.find_spec("flax") is None:
        pytest.skip(f"{label} needs flax (pip install '.[flax]'; CI installs it)")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", source], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, (
        f"README.md python {label} (line {line}) failed:\n{source}\n--- stderr ---\n{proc.stderr[-4000:]}")
