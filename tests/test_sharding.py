"""Sharding rules of fa4_jax.attention under jax.jit over a Mesh, on 8 host (CPU) devices.

tests/sharding_cases.py runs in a subprocess with --xla_force_host_platform_device_count=8 (the flag
must be set before jax starts; this process already has one device), through the XLA reference as the
per-shard body. Each case compares the sharded result with the unsharded call and reports the
collectives of the compiled program with their sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
NO_COLLECTIVE = ["batch", "heads", "batch_heads", "gqa_heads_divide_kv", "gqa_more_shards_than_kv", "mqa_8_shards",
                 "sinks_heads", "qseq_noncausal", "window", "shard_map", "kv_batch", "kv_batch_heads", "kv_paged_batch",
                 "varlen_heads", "vmap_batch", "export_shard_map", "kv_ragged_heads", "kv_fp8_batch", "kv_fp8_heads"]
GATHERED = ["qseq_causal_replicated", "head_dim_replicated", "kv_window_covers_cache_gathered",
            "varlen_tokens_replicated", "kv_ragged_rows_replicated"]
CONTEXT_PARALLEL = ["kv_cp_decode", "kv_cp_decode_batch", "kv_cp_paged_decode", "kv_cp_paged_full_sinks",
                    "kv_cp_causal_chunk", "kv_cp_window_right", "kv_cp_sliding_window", "kv_cp_sliding_window_chunk_sinks",
                    "kv_cp_paged_causal_chunk", "kv_cp_paged_sliding_window"]
# How close the sharded result must be to the unsharded one (O and LSE):
# - BITWISE: each device runs the reference on whole rows with the same shapes per (batch, kv head)
#   matmul (batch, MHA heads, whole KV groups) or on gathered operands: the same numbers.
# - ROUNDED: a GQA group's query heads split over devices (or a KV group per device) changes the
#   shapes of the score and P @ V matmuls, and XLA:CPU orders a dot's float32 reduction by its shapes
#   (see reference.attention_reference's query_chunk note). The float32 values agree to summation
#   order, so O is at most one bf16 rounding apart (|dO| <= eps_bf16 |O|) and LSE a few float32 ulps.
#   On GPUs the kernel computes each (row, head) tile alike whatever the grid: test_gpu_sharding.py
#   asserts bitwise equality there.
# - CONTEXT_PARALLEL: partials over disjoint key ranges, each rounded to bf16 (error <= u |o_i|), merged
#   in float32 by their LSE weights w_i and rounded once more. Per element, with u = 2**-8:
#     |O_sharded - O| <= u (sum_i w_i |o_i| + 2 |O|) <= u (P|V| + 2 |O|),
#   P|V| the row's softmax weights applied to |V| (the unsharded call on |V|; sum_i w_i |o_i| <= P|V|
#   since each |o_i| <= P_i |V|). A bound relative to each row's own values: a long row whose |O| is
#   small next to |V| keeps its margin, and a dropped or doubled key block (O moves by ~|V| / n for n
#   keys, LSE by ~1/n) fails it at these lengths. LSE: merged in float32, a few ulps.
ROUNDED = ["gqa_heads_divide_kv", "gqa_more_shards_than_kv", "kv_batch_heads", "kv_ragged_heads", "kv_fp8_heads"]
BITWISE = [c for c in NO_COLLECTIVE + GATHERED if c not in ROUNDED]
LSE_ULPS_ATOL = 1e-5  # ~20 float32 ulps at |lse| ~ 4-8 (these inputs); one key more or less moves it >= 1e-3


@pytest.fixture(scope="module")
def cases() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "sharding_cases.py")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {c["case"]: c for c in map(json.loads, proc.stdout.splitlines())}


def test_every_case_ran(cases):
    assert set(NO_COLLECTIVE + GATHERED + CONTEXT_PARALLEL) == set(cases)
    assert set(BITWISE + ROUNDED + CONTEXT_PARALLEL) == set(cases)


@pytest.mark.parametrize("case", BITWISE)
def test_sharded_equals_unsharded_bitwise(cases, case):
    c = cases[case]
    assert c["max_err_o"] == 0.0 and c["max_err_lse"] == 0.0 and c["lse_inf_match"], c


@pytest.mark.parametrize("case", ROUNDED)
def test_sharded_equals_unsharded_to_one_rounding(cases, case):
    c = cases[case]
    assert c["o_ulp_ratio"] <= 1.0, c
    assert c["max_err_lse"] <= LSE_ULPS_ATOL and c["lse_inf_match"], c


@pytest.mark.parametrize("case", CONTEXT_PARALLEL)
def test_context_parallel_within_the_merge_bound(cases, case):
    c = cases[case]
    assert c["o_cp_ratio"] <= 1.0, c
    assert c["max_err_lse"] <= LSE_ULPS_ATOL and c["lse_inf_match"], c


@pytest.mark.parametrize("case", CONTEXT_PARALLEL)
def test_context_parallel_moves_only_partials_and_tails(cases, case):
    """A cache sharded along its length (or a pool by pages) never moves: only all-gathers of the
    (o, lse) partials (at most devices x b x h x s_q x (d + 1) float32 values in all) and, where some
    keys are visible to only some queries (s_q > 1 with a causal/right mask, or a left window), one
    all-reduce per K/V of those tail keys (b x tail x hk x d)."""
    c = cases[case]
    ops = c["collectives"]
    gathers = [n for op, n in ops if op == "all-gather"]
    reduces = [n for op, n in ops if op == "all-reduce"]
    assert ops and len(gathers) + len(reduces) == len(ops), c
    assert sum(gathers) <= 8 * c["partial_bytes"], c
    # K and V's bf16 tails, one all-reduce each or one of both; XLA:CPU widens bf16 reductions to f32.
    assert len(reduces) <= 2 and all(n <= 2 * c["tail_bytes"] for n in reduces), c
    assert bool(reduces) == bool(c["tail_bytes"]), c
    assert max(n for _, n in ops) < c["cache_bytes"], c  # no gather of a whole cache


@pytest.mark.parametrize("case", NO_COLLECTIVE)
def test_batch_and_head_sharding_need_no_collective(cases, case):
    assert cases[case]["collectives"] == [], cases[case]


def test_causal_query_sequence_is_gathered_once(cases):
    """A causal mask depends on absolute row positions: the q shards are all-gathered (q's size, not
    K/V's: those were replicated already), documented in fa4_jax/ops/fwd/sharding.py."""
    c = cases["qseq_causal_replicated"]
    assert [op for op, _ in c["collectives"]] and all(op == "all-gather" for op, _ in c["collectives"]), c
    assert sum(n for _, n in c["collectives"]) <= 2 * c["q_bytes"], c


@pytest.mark.parametrize("case", ["head_dim_replicated", "kv_window_covers_cache_gathered", "varlen_tokens_replicated",
                                  "kv_ragged_rows_replicated"])
def test_unsupported_shardings_are_gathered(cases, case):
    """head_dim, the cache of a call whose left window spans the whole cache, varlen token axes and
    a ragged batch's packed rows are all-gathered first (the documented reshard), and the result is
    exact (BITWISE)."""
    c = cases[case]
    assert c["collectives"] and all(op == "all-gather" for op, _ in c["collectives"]), c
    if case == "kv_window_covers_cache_gathered":  # the cache itself moves, not (o, lse) partials
        assert max(n for _, n in c["collectives"]) >= c["cache_bytes"] > 0, c


def _cache_runs(tmp_path, mode: str) -> list[list[str]]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.run([sys.executable, str(HERE / "cache_key_case.py"), str(tmp_path), mode], env=env,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    return [r.stdout.split() for r in runs]


def test_shard_map_program_hits_the_persistent_cache(tmp_path):
    """Two processes compiling the same shard_map program share one persistent-cache entry: inside
    shard_map custom_partitioning is inlined, so no per-process callback address reaches the key."""
    first, second = _cache_runs(tmp_path, "shard_map")
    assert len(first) == 1 and first == second, (first, second)


def test_partitioned_program_hits_the_persistent_cache(tmp_path):
    """A jit-partitioned program embeds the partition callback's address, which changes per process;
    with jax_remove_custom_partitioning_ptr_from_cache_key jax drops it from the key. That is safe for
    fa4_jax because the call's params are written into the HLO (fa4_jax.core.partitioning.PARAMS_ATTRIBUTE): two
    programs differing only in softmax_scale keep two entries, and the second process reads both back and
    gets the right results (checked inside cache_key_case.py)."""
    first, second = _cache_runs(tmp_path, "jit")
    assert len(first) == 2 and first == second, (first, second)
