"""tools/validate_sm100.py on the CPU: its oracle agrees with the library's reference for every mask
and softcap (so a first run on a B200 cannot report a correct kernel as wrong), its verdicts, and its
refusal on a machine that is not a Blackwell GPU."""

from __future__ import annotations

import importlib.util
import json
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


class _DenseImpl:
    """fa4_jax with attention replaced: "fa4" runs `fn`, anything else the library."""

    def __init__(self, fn):
        self.fn = fn

    def attention(self, *a, implementation=None, **kw):
        if implementation == "fa4":
            return self.fn(*a, **kw)
        return fa4_jax.attention(*a, implementation=implementation, **kw)


SMALL_EVERY_TILE = (1, 40, 40, 8, 2)  # the check's logic at a CPU-sized shape


@pytest.mark.parametrize("mask", ["full", "causal", "local"])
def test_every_tile_check_passes_a_correct_implementation(mask):
    from fa4_jax.families import FwdVariant

    ref = _DenseImpl(lambda *a, **kw: fa4_jax.attention(*a, implementation="xla", **kw))
    variant = FwdVariant("sm100", "bf16", 64, mask, mask == "local")
    assert tool.check_every_tile(ref, jax, jnp, variant, seed=2, shape=SMALL_EVERY_TILE) == []


def test_every_tile_check_names_the_wrong_heads():
    # A stand-in that gets the later heads wrong (as a persistent CTA's later tiles could): reported
    # by head, not averaged away.
    from fa4_jax.families import FwdVariant

    def later_heads_wrong(q, k, v, **kw):
        o, lse = fa4_jax.attention(q, k, v, implementation="xla", **kw)
        return o.at[:, :, 6:].multiply(0.5), lse

    failures = tool.check_every_tile(_DenseImpl(later_heads_wrong), jax, jnp, FwdVariant("sm100", "bf16", 64, "full",
                                     False), seed=3, shape=SMALL_EVERY_TILE)
    assert len(failures) == 1 and "heads [6, 7] wrong" in failures[0], failures
    assert tool.EVERY_TILE_SHAPE[3] * -(-tool.EVERY_TILE_SHAPE[1] // 256) > 148  # more tiles than B200 SMs


SMALL_SINKS = (1, 37, 37, len(tool.SINKS), 2)


@pytest.mark.parametrize("mask", ["full", "causal", "local"])
def test_sinks_check_passes_a_correct_implementation(mask):
    from fa4_jax.families import FwdVariant

    ref = _DenseImpl(lambda *a, **kw: fa4_jax.attention(*a, implementation="xla", **kw))
    assert tool.check_sinks(ref, jax, jnp, FwdVariant("sm100", "bf16", 64, mask, False), seed=4, shape=SMALL_SINKS) == []


def test_sinks_check_catches_a_nan_for_an_infinite_sink_and_dropped_sinks():
    from fa4_jax.families import FwdVariant

    variant = FwdVariant("sm100", "bf16", 64, "causal", False)

    def inf_sink_nan(q, k, v, sinks=None, **kw):  # the SM100 kernel's normalisation until 2026-12-05
        o, lse = fa4_jax.attention(q, k, v, sinks=sinks, implementation="xla", **kw)
        inf = jnp.isposinf(sinks)
        return jnp.where(inf[None, None, :, None], jnp.nan, o), jnp.where(inf[None, :, None], jnp.nan, lse)

    failures = tool.check_sinks(_DenseImpl(inf_sink_nan), jax, jnp, variant, seed=5, shape=SMALL_SINKS)
    assert len(failures) == 1 and "NaN in heads [0]" in failures[0], failures
    no_sinks = _DenseImpl(lambda q, k, v, sinks=None, **kw: fa4_jax.attention(q, k, v, implementation="xla", **kw))
    failures = tool.check_sinks(no_sinks, jax, jnp, variant, seed=5, shape=SMALL_SINKS)
    assert len(failures) == 1 and "+inf sink must give o = 0" in failures[0], failures


class _Impl:
    """fa4_jax with attention_varlen pinned to `implementation` (the reference, on this host)."""

    def __init__(self, fn):
        self.attention_varlen = fn


@pytest.mark.parametrize("mask", ["full", "causal", "local"])
def test_varlen_check_passes_a_correct_implementation(mask):
    # The library's own reference stands in for the kernel: it is exact and isolates the sequences,
    # so the checker must find nothing (a first run on a B200 cannot fail a correct kernel).
    from fa4_jax.families import VarlenVariant

    ref = _Impl(lambda *a, implementation=None, **kw: fa4_jax.attention_varlen(*a, implementation="xla", **kw))
    variant = VarlenVariant("sm100", "bf16", 64, mask, True)
    assert tool.check_varlen_variant(ref, jax, jnp, variant, seed=3) == []


def test_varlen_check_catches_a_leak_and_padding():
    # An implementation whose sequences see each other's keys (one sequence over the whole packed
    # batch), and which leaves the padding rows alone: each finding is reported.
    from fa4_jax.families import VarlenVariant

    def leaky(q, k, v, cu_q, cu_k, *, max_seqlen_q=None, implementation=None, **kw):
        total = k.shape[0]
        whole = jnp.asarray([0, total], jnp.int32)
        o, lse = fa4_jax.attention_varlen(q[:total], k, v, whole, whole, implementation="xla", **kw)
        pad = q.shape[0] - total
        return (jnp.concatenate([o, jnp.ones((pad, *o.shape[1:]), o.dtype)]),
                jnp.concatenate([lse, jnp.zeros((lse.shape[0], pad), lse.dtype)], axis=1))

    failures = tool.check_varlen_variant(_Impl(leaky), jax, jnp, VarlenVariant("sm100", "bf16", 64, "full", False),
                                         seed=4)
    assert any("output error" in f for f in failures), failures
    assert "varlen: padding rows past cu_seqlens_q[b] are not o = 0, lse = -inf" in failures
    assert any("NaN in the other sequences' K/V changed it" in f for f in failures), failures


class _KVImpl:
    """fa4_jax with attention_with_kvcache replaced (the reference, or a broken stand-in)."""

    def __init__(self, fn):
        self.attention_with_kvcache = fn


def _reference_kvcache(*a, implementation=None, **kw):
    return fa4_jax.attention_with_kvcache(*a, implementation="xla", **kw)


@pytest.mark.parametrize("paged,tile_m,softcap,page_rows", [(False, 64, False, 16), (True, 64, True, 16),
                                                            (True, 128, False, 16), (True, 64, False, 1)])
def test_kvcache_check_passes_a_correct_implementation(paged, tile_m, softcap, page_rows):
    # The library's reference stands in for the kernel: exact, and it never reads past a length, so
    # the checker must find nothing, for decode rows and a prefill chunk, contiguous and paged (16-row
    # pieces at page 48, rows at page 7).
    from fa4_jax.families import KVCacheVariant

    variant = KVCacheVariant("sm100", "bf16", 64, "local", softcap, paged, tile_m, page_rows)
    assert tool.check_kvcache_variant(_KVImpl(_reference_kvcache), jax, jnp, variant, seed=5) == []


def test_kvcache_check_catches_reads_past_the_lengths():
    # A stand-in that attends to the whole cache (every slot, valid or not) and gives the empty cache
    # keys: wrong against the oracle, changed by NaN past the lengths, and not o = 0 for no keys.
    from fa4_jax.families import KVCacheVariant

    def whole_cache(q, kc, vc, lens, *, page_table=None, implementation=None, **kw):
        full = jnp.full_like(lens, kc.shape[1])
        return fa4_jax.attention_with_kvcache(q, kc, vc, full, implementation="xla", **kw)

    failures = tool.check_kvcache_variant(_KVImpl(whole_cache), jax, jnp,
                                          KVCacheVariant("sm100", "bf16", 64, "local", False), seed=6)
    assert any("output error" in f for f in failures), failures
    assert any("an empty cache does not give o = 0, lse = -inf" in f for f in failures), failures
    assert any("NaN in the slots past the lengths (or in unowned pages) changed the output" in f
               for f in failures), failures


def test_kv_pages_hold_each_sequence_and_mark_what_it_owns():
    k = np.random.default_rng(0).standard_normal((4, tool.KV_CAPACITY, 2, 8)).astype(np.float32)
    lens = tool.kv_lengths(3)
    kp, vp, table, owned = tool.to_pages(k, k, lens, seed=1)
    per_seq = tool.KV_CAPACITY // tool.KV_PAGE
    assert table.shape == (4, per_seq) and len(set(table.ravel())) == table.size and kp.shape[0] == table.size + 3
    for i, n in enumerate(lens):
        slots = kp[table[i]].reshape(tool.KV_CAPACITY, 2, 8)
        np.testing.assert_array_equal(slots, k[i])
        assert owned[table[i]].reshape(-1).sum() == n and owned[table[i]].reshape(-1)[:n].all()
    assert owned.sum() == lens.sum()


class _FakeChild:
    """A stand-in child process for run_isolated: walks `pending` in order, writing each variant's
    result, until a variant marked "hang" (then stays alive, silent) or "crash" (then exits 3)."""

    def __init__(self, behaviour, pending, path, started):
        self.behaviour, self.pending, self.path, self.rc = behaviour, list(pending), path, None
        started.append(list(pending))

    def poll(self):
        if self.rc is not None:
            return self.rc
        for symbol in self.pending:
            what = self.behaviour.get(symbol, "ok")
            if what == "hang":
                return None
            if what == "crash":
                self.rc = 3
                return self.rc
            with open(self.path, "a") as f:
                f.write(json.dumps({"symbol": symbol, "failures": [] if what == "ok" else ["wrong"]}) + "\n")
            self.pending = self.pending[1:]
        self.rc = 0
        return self.rc

    def kill(self):
        self.rc = -9

    def wait(self):
        return self.rc

    def stderr_tail(self):
        return "an illegal memory access was encountered" if self.rc == 3 else ""


def test_isolation_blames_the_hanging_and_crashing_variants_and_checks_the_rest():
    behaviour = {"b": "hang", "c": "fail", "e": "crash"}
    started = []
    failures = tool.run_isolated(list("abcdef"), lambda pending, path: _FakeChild(behaviour, pending, path, started),
                                 timeout_s=0.3)
    assert failures["a"] == failures["d"] == failures["f"] == []
    assert failures["c"] == ["wrong"]
    assert failures["b"] == ["hung: no result in 0 s (killed)"]
    assert failures["e"] == ["crashed (exit 3): an illegal memory access was encountered"]
    # A new child after each: the hang's, the crash's; nothing checked twice.
    assert started == [list("abcdef"), list("cdef"), ["f"]]


def test_isolation_stops_when_the_children_fail_before_any_check():
    started = []
    failures = tool.run_isolated(list("abcd"), lambda pending, path: _FakeChild({s: "crash" for s in "abcd"},
                                                                                pending, path, started), timeout_s=5)
    assert failures["a"][0].startswith("crashed (exit 3)")
    assert all(failures[s][0].startswith("not run: the checking process fails before any check") for s in "bcd")
    assert len(started) == 2
