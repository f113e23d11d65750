"""tools/pipe_rates.cu, the instruction-rate benchmark, on the CPU: every kernel compiles to the SASS its
row names (a benchmark that measured some other instruction would mislead), and two facts that need
no GPU to read off the SASS or the arithmetic:

- Hopper has no packed MUFU: tanh.approx / ex2.approx on f16x2 and bf16x2 issue two MUFU operations,
  one per half (so a packed softcap tanh does not halve softcap's MUFU work, issue 18);
- the integer e4m3 -> f16 conversion the benchmark times (E4m3x2ToF16x2Int, a lever of issue 17) is
  exact, times 2^-8, for every pair of finite codes.

Needs nvcc (the CUDA toolkit CI has) and nvdisasm (as tests/test_sass.py): without them these fail
rather than skip.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fa4_jax.aot import sass

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("pipe_rates", ROOT / "tools" / "pipe_rates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tool = _tool()
    out = tmp_path_factory.mktemp("pipe_rates")
    exe, cubin = tool.build(out), tool.build(out, cubin=True)
    listing = subprocess.run([str(exe), "--list"], capture_output=True, text=True, check=True).stdout
    rows = [line.split("\t") for line in listing.splitlines()]
    nvdisasm = sass.find_nvdisasm()
    if nvdisasm is None:
        pytest.fail(f"nvdisasm not found: `{sass.PIP_HINT}`", pytrace=False)
    kernels = sass.split_functions(sass.disassemble(cubin.read_bytes(), nvdisasm))
    return rows, kernels


def _kernel(kernels: dict, structs: list[str]) -> str:
    """The SASS of rate_kernel<Op> (or <Pair<A, B>>), found by the structs' mangled names."""
    if len(structs) == 1:
        want = f"rate_kernelINS_{len(structs[0])}{structs[0]}E"
    else:
        want = "rate_kernelINS_4PairINS_" + "ENS_".join(f"{len(s)}{s}" for s in structs) + "E"
    (text,) = [t for name, t in kernels.items() if want in name]
    return text


def _count(text: str, opcode: str) -> int:
    """Instructions whose full opcode (modifiers included) starts with `opcode`."""
    return len(re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?" + re.escape(opcode) + r"[\s.]", text))


def test_every_row_compiles_to_its_instruction(built):
    rows, kernels = built
    singles = {kernel: sass_op for kernel, _name, sass_op in rows if "," not in kernel}
    assert len(rows) >= 20 and len(singles) >= 15, rows
    for kernel, name, sass_op in rows:
        structs = kernel.split(",")
        text = _kernel(kernels, structs)
        for s in structs:
            assert _count(text, singles[s]) > 0, (name, singles[s])


def test_packed_mufu_forms_issue_one_mufu_per_half(built):
    _rows, kernels = built
    per_op = _count(_kernel(kernels, ["Tanh"]), "MUFU.TANH")
    assert per_op >= 32  # 8 chains x 4 unrolled steps, at least
    for struct, opcode in (("TanhF16x2", "MUFU.TANH.F16"), ("TanhBf16x2", "MUFU.TANH.BF16"),
                           ("Ex2F16x2", "MUFU.EX2.F16"), ("Ex2Bf16x2", "MUFU.EX2.BF16")):
        assert _count(_kernel(kernels, [struct]), opcode) == 2 * per_op, struct


def _integer_e4m3x2_to_f16x2(w: np.ndarray) -> np.ndarray:
    """E4m3x2ToF16x2Int's four instructions on the low 16 bits of each word (uint32 arithmetic)."""
    w = w.astype(np.uint32)
    x = ((w & 0xFF) << 8) | (((w >> 8) & 0xFF) << 24)  # prmt.b32 x, w, 0, 0x1404
    y = x >> 1
    return (y + (y & 0x40004000)).astype(np.uint32)


def test_integer_conversion_is_exact_times_two_to_the_minus_8():
    w = np.arange(1 << 16, dtype=np.uint32)
    out = _integer_e4m3x2_to_f16x2(w)
    halves = np.stack([out & 0xFFFF, out >> 16], axis=-1).astype(np.uint16).view(np.float16).astype(np.float64)
    codes = np.stack([w & 0xFF, w >> 8], axis=-1).astype(np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**-8
    finite = np.isfinite(want)
    np.testing.assert_array_equal(halves[finite], want[finite])
    assert np.array_equal(np.signbit(halves[finite]), np.signbit(want[finite]))  # -0 stays -0
    # NaN codes (S.1111.111) come out as +-1.875, i.e. 480 * 2^-8, where e4m3's largest value 448 comes
    # out as 1.75: a kernel using this must keep them NaN itself.
    nan_codes = codes[~finite]
    assert set(nan_codes.tolist()) == {0x7F, 0xFF}
    assert set(np.abs(halves[~finite]).tolist()) == {1.875}
