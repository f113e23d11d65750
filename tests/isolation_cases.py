"""Isolation: memory a row may not read never changes that row (issue 13; docs/DESIGN.md, isolation).

A KV cache's slots past cache_seqlens[b], pages the row's table does not reach, another packed
sequence's keys, keys past seqused_k, another vmapped slice: in a server they hold anything, NaN/Inf
left by a request that diverged included. Each case runs a call twice, once on clean random memory
and once with that memory poisoned (NaN, +Inf or -Inf), and requires the rows that must not see it to
be *bitwise* equal (the poisoned keys' scores are masked by a select and their V rows zeroed or kept
out of P @ V, so nothing of them may remain), plus finite, and the clean call to agree with the
float64 oracle on the row's own keys.

Shared by tests/test_isolation.py (CPU: the reference) and tests/test_gpu_isolation.py (the kernels,
with split counts); `implementation` and `num_splits` are the caller's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax
from oracle import attention_oracle, make_sinks

POISONS = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}

# Option sets: every mask kind, softcap and sinks (sinks get h_q logits at call time).
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(40, 3)),
    "softcap_sinks": dict(softcap=5.0, sinks=True),
}


def _np(x):
    return np.asarray(x, np.float32)


def _opts(opts, h_q, seed):
    kw = dict(opts)
    if kw.pop("sinks", False):
        kw["sinks"] = jnp.asarray(make_sinks(seed, h_q))
    return kw


def _assert_same(clean, poisoned, rows, what):
    """o and lse of the selected rows bitwise equal and finite. rows: index into (o, lse) pairs."""
    for name, a, b in (("o", *[_np(x[0])[rows[0]] for x in (clean, poisoned)]),
                       ("lse", *[_np(x[1])[rows[1]] for x in (clean, poisoned)])):
        assert np.isfinite(a).all() or name == "lse", f"{what}: clean {name} not finite"
        bad = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        assert not bad.any(), (f"{what}: {np.count_nonzero(bad)} of {bad.size} {name} values changed by memory the "
                               f"rows may not read (poisoned: {np.count_nonzero(~np.isfinite(b))} non-finite)")


def kvcache_case(*, implementation, poison, where, opts, s_q=1, page_size=None, num_splits=None, hd=64,
                 h_q=8, h_k=2, lens=(333, 700), capacity=1000, dtype=jnp.bfloat16, seed=0):
    """attention_with_kvcache: every slot no length covers (where="all"), only slot len (the boundary,
    "boundary"), or slots inside the last key's block ("tile") hold `poison`. Paged: shuffled pool,
    the rows' unused pages and a spare page poisoned too, and table entries past the needed pages
    pointing at poisoned pages."""
    rng = np.random.default_rng(seed)
    b = len(lens)
    lens = np.asarray(lens, np.int32)
    scale = 2.0 if opts.get("softcap") else 1.0
    q = jnp.asarray(scale * rng.standard_normal((b, s_q, h_q, hd)), dtype)
    if page_size is None:
        shape, table = (b, capacity, h_k, hd), None
    else:
        max_pages = -(-capacity // page_size)
        num_pages = b * max_pages + 2
        table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
        shape = (num_pages, page_size, h_k, hd)
    k = scale * rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)

    # Which (row, slot) cells must not be read, in cache coordinates (b, position).
    pos = np.arange(capacity if page_size is None else table.shape[1] * page_size)
    hidden = pos[None, :] >= lens[:, None]
    if where == "boundary":
        hidden &= pos[None, :] == lens[:, None]
    elif where == "tile":
        hidden &= pos[None, :] < (lens[:, None] // 128 + 1) * 128
    kp, vp = k.copy(), v.copy()
    if page_size is None:
        kp[hidden], vp[hidden] = poison, poison
    else:
        owned_any = np.zeros(shape[0], bool)
        for i in range(b):
            for p in range(table.shape[1]):
                sl = hidden[i, p * page_size:(p + 1) * page_size]
                kp[table[i, p], sl], vp[table[i, p], sl] = poison, poison
                owned_any[table[i, p]] |= ~sl.all()
        if where == "all":
            spare = ~np.isin(np.arange(shape[0]), table)
            kp[spare], vp[spare] = poison, poison
            # Entries past each row's last needed page point at poisoned pages (unowned memory).
            for i in range(b):
                need = -(-int(lens[i]) // page_size)
                poisoned_pages = np.flatnonzero(~owned_any)
                if need < table.shape[1] and poisoned_pages.size:
                    table[i, need:] = rng.choice(poisoned_pages, table.shape[1] - need)
    kw = _opts(opts, h_q, seed)
    t = None if table is None else jnp.asarray(table)

    def call(k, v):
        return fa4_jax.attention_with_kvcache(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lens),
                                              page_table=t, num_splits=num_splits, return_lse=True,
                                              implementation=implementation, **kw)

    clean, poisoned = call(k, v), call(kp, vp)
    what = f"kvcache {poison} {where} page={page_size} s_q={s_q} splits={num_splits} {opts}"
    _assert_same(clean, poisoned, (np.s_[...], np.s_[...]), what)
    # The clean call is attention over each row's own keys (the oracle sees nothing else).
    for i in range(b):
        kk, vv = (x[i] if table is None else x[table[i]].reshape(-1, h_k, hd) for x in (k, v))
        o_r, lse_r = attention_oracle(_np(q[i:i + 1]), _np(jnp.asarray(kk[None, :lens[i]], dtype)),
                                      _np(jnp.asarray(vv[None, :lens[i]], dtype)), softmax_scale=hd ** -0.5,
                                      **{k_: (np.asarray(v_) if k_ == "sinks" else v_) for k_, v_ in kw.items()})
        err = np.abs(_np(clean[0][i]) - o_r[0]).max()
        assert err <= 2e-2 * max(1.0, np.abs(o_r).max()), f"{what}: row {i} off the oracle by {err:.3g}"
        np.testing.assert_allclose(_np(clean[1][i]), lse_r[0], atol=2e-3, rtol=0, err_msg=what)


def varlen_case(*, implementation, poison, opts, seqlens=(10, 100, 37), victim=1, hd=64, h_q=4, h_k=2,
                seqused=None, dtype=jnp.bfloat16, seed=0):
    """attention_varlen: sequence `victim`'s keys and values hold `poison`; every other sequence's rows
    must not change. With `seqused`, keys past seqused_k[b] of every sequence are poisoned too (and a
    seqused_k larger than the sequence's key count must not reach the next sequence)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(seqlens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1])
    scale = 2.0 if opts.get("softcap") else 1.0
    q = jnp.asarray(scale * rng.standard_normal((total, h_q, hd)), dtype)
    k = scale * rng.standard_normal((total, h_k, hd)).astype(np.float32)
    v = rng.standard_normal((total, h_k, hd)).astype(np.float32)
    kp, vp = k.copy(), v.copy()
    kp[cu[victim]:cu[victim + 1]], vp[cu[victim]:cu[victim + 1]] = poison, poison
    used = None
    if seqused is not None:
        used = np.asarray(seqused, np.int32)
        for i, n in enumerate(used):
            start = cu[i] + max(0, min(int(n), int(lens[i])))
            kp[start:cu[i + 1]], vp[start:cu[i + 1]] = poison, poison
    kw = _opts(opts, h_q, seed)

    def call(k, v):
        return fa4_jax.attention_varlen(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(cu),
                                        jnp.asarray(cu), seqused_k=None if used is None else jnp.asarray(used),
                                        return_lse=True, implementation=implementation, **kw)

    clean, poisoned = call(k, v), call(kp, vp)
    rows = np.concatenate([np.arange(cu[i], cu[i + 1]) for i in range(len(lens)) if i != victim])
    _assert_same(clean, poisoned, (rows, np.s_[:, rows]), f"varlen {poison} victim={victim} used={seqused} {opts}")
    return clean, poisoned, cu


def varlen_vmap_case(*, implementation, poison, hd=64, dtype=jnp.bfloat16, seed=0):
    """vmap of attention_varlen (the slices are packed into one call): slice 1's keys/values poisoned,
    slice 0 unchanged."""
    rng = np.random.default_rng(seed)
    cu = jnp.asarray([0, 9, 30], jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 30, 4, hd)), dtype)
    k = rng.standard_normal((2, 30, 2, hd)).astype(np.float32)
    v = rng.standard_normal((2, 30, 2, hd)).astype(np.float32)
    kp, vp = k.copy(), v.copy()
    kp[1], vp[1] = poison, poison
    f = jax.vmap(lambda q, k, v: fa4_jax.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True,
                                                           implementation=implementation))
    clean = f(q, jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    poisoned = f(q, jnp.asarray(kp, dtype), jnp.asarray(vp, dtype))
    _assert_same(clean, poisoned, (np.s_[0], np.s_[0]), f"vmap varlen {poison}")


# Per-head sink logits covering every special value: +inf takes the whole mass (o = 0, lse = +inf), NaN
# makes the row NaN, -inf is no sink; finite ones behave as usual.
SPECIAL_SINKS = np.array([np.inf, -np.inf, np.nan, 1.5, -80.0, 0.0, np.inf, 2.0], np.float32)


def check_sink_semantics(o, lse, head_axis_o, head_axis_lse, sinks, what):
    """Per head of `sinks`: +inf -> o = 0 and lse = +inf; NaN -> o and lse NaN; else o finite and lse
    finite (or -inf for a row that sees no key and has no sink)."""
    o, lse = np.asarray(o, np.float32), np.asarray(lse)
    for h, sink in enumerate(np.asarray(sinks)):
        oh, lh = np.take(o, h, axis=head_axis_o), np.take(lse, h, axis=head_axis_lse)
        if np.isposinf(sink):
            assert (oh == 0).all() and np.isposinf(lh).all(), f"{what}: head {h}, sink +inf: o={oh.max()}, lse={lh}"
        elif np.isnan(sink):
            assert np.isnan(oh).all() and np.isnan(lh).all(), f"{what}: head {h}, sink NaN"
        else:
            assert np.isfinite(oh).all(), f"{what}: head {h}, sink {sink}: o not finite"
            assert not (np.isnan(lh) | np.isposinf(lh)).any(), f"{what}: head {h}, sink {sink}: lse {lh}"
