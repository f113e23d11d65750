"""The varlen kernel (fa4_jax/kernels/fwd_sm90.py, configured by FwdSeams.varlen) on the GPU (`@pytest.mark.gpu`) against the fp32
oracle, with the accuracy rule of tests/accuracy.py (O and LSE): each sequence is plain attention of its
own rows over its own keys (bottom-right aligned), rows past cu_seqlens_q[-1] are o = 0. Twice per case
with fresh inputs after poisoning the allocator. Every kernel call is implementation="fa4" (a missing
kernel fails; tests/gpu_menu.py says when a case may skip)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference, poison_allocator
from fa4_jax.families import FwdVariant, VarlenVariant, mask_kind
from gpu_menu import device_arch, require_variant
from oracle import OPTION_CASES, attention_oracle, make_sinks

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("varlen")]


@pytest.fixture(scope="module")
def built(kernel_variants):
    return kernel_variants


def _require(built, dtype, hd, opts):
    left, right = opts.get("window_size", (-1, -1))
    if opts.get("causal"):
        right = 0 if right < 0 else right
    require_variant(built, VarlenVariant(device_arch(), dtype, hd, mask_kind(left, right), opts.get("softcap", 0.0) > 0))


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _oracle(q, k, v, cu_q, cu_k, used, opts):
    """(o (total_q, h, d), lse (h, total_q)) in fp32: per sequence the shared oracle, zeros elsewhere."""
    total_q, h_q, d = q.shape
    kw = dict(opts)
    kw.setdefault("softmax_scale", d ** -0.5)
    sinks = kw.get("sinks")
    o = jnp.zeros((total_q, h_q, d), jnp.float32)
    lse = (jnp.full((h_q, total_q), -jnp.inf, jnp.float32) if sinks is None
           else jnp.broadcast_to(jnp.asarray(sinks)[:, None], (h_q, total_q)))
    for b in range(len(cu_q) - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ks = int(cu_k[b])
        n = int(used[b]) if used is not None else int(cu_k[b + 1]) - ks
        if rows.stop == rows.start:
            continue
        ob, lb = attention_oracle(q[None, rows], k[None, ks:ks + n], v[None, ks:ks + n], xp=jnp, **kw)
        o = o.at[rows].set(ob[0])
        lse = lse.at[:, rows].set(lb[0])
    return o, lse


def run_varlen_case(built, seqs, *, h_q=8, h_k=2, opts=None, dtype="bf16", hd=128, extra_q=3, extra_k=2,
                    seqused=None, max_seqlen_q=None, seed=0):
    opts = dict(opts or {})
    _require(built, dtype, hd, opts)
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[dtype]
    cu_q, cu_k = offsets([s for s, _ in seqs]), offsets([n for _, n in seqs])
    total_q, total_k = int(cu_q[-1]) + extra_q, int(cu_k[-1]) + extra_k
    scale = 2.0 if opts.get("softcap") else 1.0
    sinks = opts.pop("sinks", None)
    sinks = None if sinks is None else jnp.asarray(make_sinks(seed + 3, h_q))
    used = None if seqused is None else jnp.asarray(np.asarray(seqused, np.int32))
    kw = dict(return_lse=True, max_seqlen_q=max_seqlen_q, **opts)

    @jax.jit
    def both(q, k, v, cq, ck, u, s):
        return (fa4_jax.attention_varlen(q, k, v, cq, ck, seqused_k=u, sinks=s, implementation="fa4", **kw),
                fa4_jax.attention_varlen(q, k, v, cq, ck, seqused_k=u, sinks=s, implementation="xla", **kw))

    what = f"varlen {dtype} hd{hd} seqs={seqs} h={h_q}/{h_k} {opts} sinks={sinks is not None} used={seqused}"
    for run in range(2):
        ks = jax.random.split(jax.random.key(seed * 2 + run), 3)
        q = (scale * jax.random.normal(ks[0], (total_q, h_q, hd), jnp.float32)).astype(dt)
        k = (scale * jax.random.normal(ks[1], (total_k, h_k, hd), jnp.float32)).astype(dt)
        v = jax.random.normal(ks[2], (total_k, h_k, hd), jnp.float32).astype(dt)
        poison_allocator(((total_q, h_q, hd), dt), ((h_q, total_q), jnp.float32))
        ours, xla = both(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), used, sinks)
        ref = _oracle(q, k, v, cu_q, cu_k, None if used is None else np.asarray(used),
                      dict(opts, **({} if sinks is None else {"sinks": sinks})))
        # The shared rule is written for (b, s, h, d) / (b, h, s): one "batch" of packed rows.
        add_b = lambda t: (t[0][None], t[1][None])  # noqa: E731
        check_against_reference(add_b(ours), add_b(xla), add_b(ref), what=f"{what} run {run}")


# Sequences: keys > queries, an empty one, square, one with no keys, one spanning several tiles.
SEQS = [(5, 9), (0, 4), (7, 7), (3, 0), (300, 420), (129, 129)]
GQA = {"mha": 8, "gqa4": 2, "mqa": 1}


@pytest.mark.parametrize("heads_kv", list(GQA), ids=list(GQA))
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_varlen_options_gqa(built, case, heads_kv):
    run_varlen_case(built, SEQS, h_k=GQA[heads_kv], opts=OPTION_CASES[case], seed=len(case))


@pytest.mark.parametrize("case", ["plain", "causal", "everything"])
def test_varlen_seqused_and_hint(built, case):
    run_varlen_case(built, SEQS, opts=OPTION_CASES[case], seqused=[6, 4, 7, 0, 200, 1], max_seqlen_q=300)


@pytest.mark.parametrize("max_seqlen_q", [None, 300, 301, 4096], ids=["none", "exact", "exact_plus_1", "loose"])
def test_varlen_max_seqlen_hints(built, max_seqlen_q):
    """The kernel's grid is sized by max_seqlen_q (default total_q): an exact, a loose and no hint must
    all give the oracle's result (on CPU the reference ignores the hint: tests/test_varlen.py)."""
    run_varlen_case(built, SEQS, opts=OPTION_CASES["everything"], max_seqlen_q=max_seqlen_q, seed=7)


# Causal at every head dim; full attention where the tile differs from the causal one (hd64 and hd96 full
# run 192-row tiles of three consumer warpgroups, hd96 causal 128 rows: kernels/config.py).
@pytest.mark.parametrize("dtype,hd,causal", [("fp16", 128, True), ("bf16", 64, True), ("bf16", 256, True),
                                            ("fp16", 64, True), ("bf16", 96, True), ("fp16", 96, True),
                                            ("bf16", 192, True), ("fp16", 192, True), ("bf16", 96, False),
                                            ("fp16", 96, False), ("bf16", 64, False)])
def test_varlen_dtypes_head_dims(built, dtype, hd, causal):
    run_varlen_case(built, SEQS, dtype=dtype, hd=hd, opts=dict(causal=causal, sinks=make_sinks(0, 8)))


@pytest.mark.kernel_family("varlen", "fwd")
def test_varlen_equal_lengths_match_dense(built):
    """Equal lengths: the varlen kernel on the packed rows and the dense kernel on the (batch, seqlen)
    view are both the same attention: each against the oracle by the accuracy rule."""
    _require(built, "bf16", 128, dict(causal=True))
    require_variant(built, FwdVariant(device_arch(), "bf16", 128, "causal", False))
    b, s, h, d = 4, 384, 8, 128
    ks = jax.random.split(jax.random.key(5), 3)
    q, k, v = (jax.random.normal(x, (b * s, h, d), jnp.float32).astype(jnp.bfloat16) for x in ks)
    cu = jnp.asarray(offsets([s] * b))
    packed = {impl: fa4_jax.attention_varlen(q, k, v, cu, cu, max_seqlen_q=s, causal=True, return_lse=True,
                                             implementation=impl) for impl in ("fa4", "xla")}
    dense_in = tuple(x.reshape(b, s, h, d) for x in (q, k, v))
    dense = {impl: fa4_jax.attention(*dense_in, causal=True, return_lse=True, implementation=impl)
             for impl in ("fa4", "xla")}
    ref = attention_oracle(*dense_in, causal=True, softmax_scale=d ** -0.5, xp=jnp)
    as_dense = lambda t: (t[0].reshape(b, s, h, d), t[1].reshape(h, b, s).transpose(1, 0, 2))  # noqa: E731
    check_against_reference(as_dense(packed["fa4"]), as_dense(packed["xla"]), ref, what="varlen, equal lengths")
    check_against_reference(dense["fa4"], dense["xla"], ref, what="dense, the same rows")


def test_varlen_vmap(built):
    """vmap folds the slices into one packed call: each slice against the oracle (its own sequences)."""
    _require(built, "bf16", 128, {})
    n, h, d = 3, 4, 128
    cu_q = np.stack([offsets([5, 70]), offsets([0, 75]), offsets([40, 20])])
    cu_k = np.stack([offsets([9, 100]), offsets([3, 50]), offsets([40, 1])])
    ks = jax.random.split(jax.random.key(9), 3)
    q = jax.random.normal(ks[0], (n, 80, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (n, 120, h, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (n, 120, h, d), jnp.float32).astype(jnp.bfloat16)
    call = lambda impl: functools.partial(fa4_jax.attention_varlen, implementation=impl, return_lse=True)  # noqa: E731
    o, lse = jax.jit(jax.vmap(call("fa4")))(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    o_x, lse_x = jax.jit(jax.vmap(call("xla")))(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k))
    add_b = lambda t: (t[0][None], t[1][None])  # noqa: E731
    for i in range(n):
        ref = _oracle(q[i], k[i], v[i], cu_q[i], cu_k[i], None, {})
        check_against_reference(add_b((o[i], lse[i])), add_b((o_x[i], lse_x[i])), add_b(ref), what=f"vmap slice {i}")


def test_varlen_broken_offsets_stay_in_bounds(built):
    """Offsets that break the contract (decreasing, negative, past the tensors) give unspecified
    results but no fault: every write is dropped outside [0, total_q), every read outside the
    tensors is a TMA zero fill. A correct call afterwards still works."""
    _require(built, "bf16", 128, dict(causal=True))
    ks = jax.random.split(jax.random.key(4), 3)
    q = jax.random.normal(ks[0], (40, 8, 128), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (30, 2, 128), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (30, 2, 128), jnp.float32).astype(jnp.bfloat16)
    for cu_q, cu_k in [([0, 25, 10, 100000], [0, 5, -40, 70000]), ([-300, 5, 39, -2], [0, 30, 30, 30])]:
        o = fa4_jax.attention_varlen(q, k, v, jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32),
                                     causal=True, implementation="fa4")
        jax.block_until_ready(o)
    run_varlen_case(built, SEQS, opts=dict(causal=True))  # the device is still healthy
