"""Per-architecture compilation (issue 16): the CuTe DSL takes its trace-time target from
CUTE_DSL_ARCH at `import cutlass`, so the build compiles each architecture in its own processes
(fa4_jax/aot/worker.py). CPU only; nothing here imports cutlass."""

from __future__ import annotations

import pytest

from fa4_jax.aot import worker


def test_symbols_are_grouped_by_architecture_in_menu_order():
    symbols = ["fa4_fwd_sm90_bf16_hd128_causal", "fa4_fwd_sm100_bf16_hd128_causal",
               "fa4_kvcache_sm90_bf16_hd64_local", "fa4_varlen_sm100_fp16_hd256_local"]
    assert worker.by_arch(symbols) == {
        "sm_90a": ["fa4_fwd_sm90_bf16_hd128_causal", "fa4_kvcache_sm90_bf16_hd64_local"],
        "sm_100a": ["fa4_fwd_sm100_bf16_hd128_causal", "fa4_varlen_sm100_fp16_hd256_local"],
    }


def test_a_process_set_up_for_another_architecture_refuses_to_compile(monkeypatch, tmp_path):
    monkeypatch.setenv(worker.DSL_ARCH_ENV, "sm_100a")
    res = worker.compile_one("fa4_fwd_sm90_bf16_hd128_causal", str(tmp_path))
    assert "error" in res
    assert ("fa4_fwd_sm90_bf16_hd128_causal targets sm_90a, but this process's CuTe DSL was set up for "
            "CUTE_DSL_ARCH=sm_100a") in res["error"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["sm_90a", "sm_100a"])
def test_worker_initializer_sets_the_target(monkeypatch, flag):
    monkeypatch.delenv(worker.DSL_ARCH_ENV, raising=False)
    worker._use_arch(flag)
    import os

    assert os.environ[worker.DSL_ARCH_ENV] == flag
