"""tools/validate_sm100.py on the CPU: its oracle agrees with the library's reference for every mask
and softcap (so a first run on a B200 cannot report a correct kernel as wrong), its verdicts, and its
refusal on a machine that is not a Blackwell GPU."""

from __future__ import annotations

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "validate_sm100.py")
_spec = importlib.util.spec_from_file_location("validate_sm100", _PATH)
tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tool)


@pytest.mark.parametrize("mask", ["full", "causal", "local"])
@pytest.mark.parametrize("softcap", [0.0, tool.SOFTCAP])
@pytest.mark.parametrize("shape", [(1, 45, 45, 4, 2), (1, 9, 130, 4, 1)], ids=["square", "fewer_queries"])
def test_oracle_matches_the_reference(mask, softcap, shape):
    b, s_q, s_k, h_q, h_k = shape
    keys = jax.random.split(jax.random.key(s_q + s_k), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, 64), jnp.float32).astype(jnp.bfloat16)
               for kk, s, h in zip(keys, (s_q, s_k, s_k), (h_q, h_k, h_k)))
    window = tool.WINDOW if mask == "local" else (-1, -1)
    o, lse = fa4_jax.attention(q, k, v, causal=mask == "causal", window_size=window, softcap=softcap,
                               return_lse=True, implementation="xla")
    rows = np.arange(s_q)
    ref_o, ref_lse = tool.oracle(q, k, v, rows, mask == "causal", window, softcap, heads=h_q)
    assert np.abs(np.asarray(o[0], np.float64) - ref_o).max() < 2e-2
    assert np.abs(np.asarray(lse[0], np.float64) - ref_lse).max() < 1e-3


def test_verdicts():
    assert tool.verdict([], [1.02, 0.95]) == "switch on (0.95x cuDNN at worst)"
    assert tool.verdict([], []) == "switch on (no cuDNN row to compare)"
    assert tool.verdict([], [1.1, 0.7]) == "keep opt-in: 0.70x cuDNN at worst (below 0.9x)"
    assert tool.verdict(["(2, 333, 333, 8, 2): non-finite output", "x"], [1.2]) == \
        "do not use: (2, 333, 333, 8, 2): non-finite output"


def test_refuses_a_machine_that_is_not_blackwell(capsys):
    assert tool.main([]) == 2
    assert "not a Blackwell (sm_100) GPU; run it on a B200, or pass --any-arch" in capsys.readouterr().err
