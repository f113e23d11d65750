"""fa4_jax.attention_varlen on CPU, against the shared float64 oracle.

This build has no varlen kernel, so None / "xla" run the pure-JAX reference: the tolerances are those
of test_reference.py (one rounding of the output plus float32 noise). The oracle knows nothing about
packing: sequence b is plain attention of its own query rows over its own keys, sliced out of the
packed tensors, which makes the masks bottom-right aligned per sequence as the contract says.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import attention_varlen
from oracle import (F32_ATOL, LSE_ATOL, OPTION_CASES, UNIT_ROUNDOFF, attention_oracle, make_sinks,
                    refuse_to_run, visible_mask)

# The module itself: the no_run fixture replaces the reference it calls.
varlen = importlib.import_module("fa4_jax.ops.varlen.api")

STATIC = attention_varlen.STATIC_ARGNAMES
D = 64
SCALE = D**-0.5  # the default softmax_scale at head_dim 64

# (query rows, keys) per sequence: keys > queries, no queries, square, no keys (rows that see
# nothing), and one long enough to span several windows.
SEQS = [(5, 9), (0, 4), (7, 7), (3, 0), (40, 60)]
# Fewer keys than the segment holds for sequences 0 and 4: the rest of those segments must be unseen.
SEQUSED_K = np.array([6, 4, 7, 0, 45], np.int32)
EXTRA_Q, EXTRA_K = 3, 2  # rows and keys past the last offsets, owned by no sequence


def f64(x):
    return np.asarray(x, np.float64)


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)



def make_packed(seed, seqs=SEQS, *, h_q=8, h_k=2, dtype=jnp.bfloat16, scale=1.0, extra_q=EXTRA_Q, extra_k=EXTRA_K):
    """Packed q (total_q + extra_q, h_q, D), k and v (total_k + extra_k, h_k, D), cu_seqlens_q/_k."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = offsets([s for s, _ in seqs]), offsets([n for _, n in seqs])
    draw = lambda rows, h: (scale * rng.standard_normal((rows, h, D), dtype=np.float32)).astype(dtype)  # noqa: E731
    return draw(cu_q[-1] + extra_q, h_q), draw(cu_k[-1] + extra_k, h_k), draw(cu_k[-1] + extra_k, h_k), cu_q, cu_k


def segments(cu_q, cu_k, seqused_k=None):
    """(query rows, key rows) slices of each sequence."""
    for b in range(len(cu_q) - 1):
        ks = int(cu_k[b])
        n = int(seqused_k[b]) if seqused_k is not None else int(cu_k[b + 1]) - ks
        yield slice(int(cu_q[b]), int(cu_q[b + 1])), slice(ks, ks + n)


def varlen_oracle_o(q, k, v, cu_q, cu_k, seqused_k=None, *, softmax_scale=SCALE, **kwargs):
    """The oracle's o for every packed row (0 past cu_q[-1]), float64."""
    o = np.zeros(q.shape)
    for rows, keys in segments(cu_q, cu_k, seqused_k):
        o[rows] = attention_oracle(q[None, rows], k[None, keys], v[None, keys], softmax_scale=softmax_scale, xp=np,
                                   **kwargs)[0][0]
    return o


def check_result(o, lse, q, k, v, cu_q, cu_k, seqused_k=None, *, softmax_scale=SCALE, **kwargs):
    """Compares (o, lse) with the oracle sequence by sequence; rows that see no key exactly (o = 0;
    lse = -inf or the head's sink logit); rows past cu_q[-1] give o = 0. Returns the number of
    rows inside sequences that see no key."""
    total_q, h_q, _ = q.shape
    assert (o.shape, o.dtype) == (q.shape, q.dtype), f"{o.shape=} {o.dtype=}"
    assert (lse.shape, lse.dtype) == ((h_q, total_q), jnp.float32), f"{lse.shape=} {lse.dtype=}"
    o, lse = f64(o), f64(lse)
    assert not np.isnan(o).any() and not np.isnan(lse[:, :cu_q[-1]]).any()
    u = UNIT_ROUNDOFF[q.dtype.type]
    window, causal, sinks = kwargs.get("window_size", (-1, -1)), kwargs.get("causal", False), kwargs.get("sinks")
    n_empty = 0
    for b, (rows, keys) in enumerate(segments(cu_q, cu_k, seqused_k)):
        if rows.start == rows.stop:
            continue
        o_want, lse_want = attention_oracle(q[None, rows], k[None, keys], v[None, keys], softmax_scale=softmax_scale,
                                            xp=np, **kwargs)
        o_b, lse_b = o[rows], lse[:, rows]
        np.testing.assert_allclose(o_b, o_want[0], rtol=1.01 * u, atol=F32_ATOL, err_msg=f"sequence {b}")
        np.testing.assert_array_equal(np.isneginf(lse_b), np.isneginf(lse_want[0]), err_msg=f"sequence {b}")
        finite = np.isfinite(lse_want[0])
        np.testing.assert_allclose(lse_b[finite], lse_want[0][finite], rtol=0, atol=LSE_ATOL, err_msg=f"sequence {b}")

        empty = ~visible_mask(rows.stop - rows.start, keys.stop - keys.start, window, causal).any(1)
        n_empty += int(empty.sum())
        assert np.all(o_b[empty] == 0.0), f"sequence {b}: rows that see no key must give o = 0 exactly"
        want = -np.inf if sinks is None else f64(np.float32(sinks))[:, None]
        got = lse_b[:, empty]
        np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape), err_msg=f"sequence {b}: empty rows")
    assert np.all(o[cu_q[-1]:] == 0.0), "rows past cu_seqlens_q[-1] belong to no sequence: o = 0"
    return n_empty


# -- accuracy -----------------------------------------------------------------------------------

CASES = OPTION_CASES  # shared with the other entry points' tests (tests/oracle.py)


# Every case over whole key segments; seqused_k with a few.
@pytest.mark.parametrize(
    "case,used", [(c, False) for c in sorted(CASES)] + [(c, True) for c in ("plain", "causal_window", "everything")]
)
def test_matches_oracle(case, used):
    kwargs = CASES[case]
    q, k, v, cu_q, cu_k = make_packed(10 + len(case) + used, scale=2.0 if "softcap" in kwargs else 1.0)
    seqused_k = SEQUSED_K if used else None
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, seqused_k=seqused_k, return_lse=True, **kwargs)
    n_empty = check_result(o, lse, q, k, v, cu_q, cu_k, seqused_k, **kwargs)
    assert n_empty >= 3, "the keyless sequence's rows see nothing, whatever the options"
    if "sinks" in kwargs:
        # The keyless sequence's rows 12..14 see only the sink: its logit is the whole log-sum-exp.
        np.testing.assert_array_equal(lse[:, 12:15], np.broadcast_to(kwargs["sinks"][:, None], (8, 3)))
    if kwargs:
        # The options must matter on these inputs, or the comparison above proves nothing about them.
        o_plain = varlen_oracle_o(q, k, v, cu_q, cu_k, seqused_k)
        assert np.abs(f64(o) - o_plain).max() > 1e-2, "the options had no visible effect"


def test_seqused_k_hides_the_rest_of_the_segment():
    # The same packed tensors with the unused keys replaced: seqused_k must make that invisible.
    q, k, v, cu_q, cu_k = make_packed(20)
    k2, v2 = k.copy(), v.copy()
    for b, n in enumerate(SEQUSED_K):
        k2[cu_k[b] + n:cu_k[b + 1]] *= -3
        v2[cu_k[b] + n:cu_k[b + 1]] *= -3
    kwargs = dict(seqused_k=SEQUSED_K, causal=True, return_lse=True)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, **kwargs)
    o2, lse2 = attention_varlen(q, k2, v2, cu_q, cu_k, **kwargs)
    np.testing.assert_array_equal(f64(o), f64(o2))
    np.testing.assert_array_equal(lse, lse2)
    assert np.abs(f64(o) - f64(attention_varlen(q, k, v, cu_q, cu_k, causal=True))).max() > 1e-2


@pytest.mark.parametrize("h_q,h_k", [(8, 2), (8, 1)], ids=["gqa", "mqa"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gqa_mqa_and_dtypes(dtype, h_q, h_k):
    # Per-query-head sinks catch a query-head/kv-head mix-up.
    kwargs = dict(causal=True, window_size=(20, -1), sinks=make_sinks(h_q + h_k, h_q))
    q, k, v, cu_q, cu_k = make_packed(30 + h_k + (dtype == jnp.float16), h_q=h_q, h_k=h_k, dtype=dtype)
    o, lse = attention_varlen(q, k, v, cu_q, cu_k, softmax_scale=0.1, return_lse=True, **kwargs)
    check_result(o, lse, q, k, v, cu_q, cu_k, softmax_scale=0.1, **kwargs)


# -- validation ---------------------------------------------------------------------------------

@pytest.fixture
def no_run(monkeypatch):
    """Any bind of the primitive (kernel or reference) fails the test: validation must come first."""
    refuse_to_run(monkeypatch, varlen, "fa4_varlen_p", "attention_varlen")


def _args(*, d=D, rank4=False, cu_q=None, cu_k=None):
    q, k, v, good_q, good_k = make_packed(50, [(3, 4), (2, 5)], h_q=4, h_k=2, extra_q=0, extra_k=0)
    if d != D:
        q, k, v = (np.concatenate([x, x[..., : d - D]], axis=-1) for x in (q, k, v))
    if rank4:
        q = q[None]
    return q, k, v, good_q if cu_q is None else cu_q, good_k if cu_k is None else cu_k


BAD_ARGS = {
    "cu_k_longer": (dict(cu_k=np.array([0, 4, 9, 9], np.int32)), {}, ValueError,
                    r"cu_seqlens_k must have shape \(3,\) \(batch \+ 1,\) = \(3,\) like cu_seqlens_q: offsets of the "
                    r"key sequences; got cu_seqlens_k\.shape=\(4,\)"),
    "cu_k_shorter": (dict(cu_k=np.array([0, 9], np.int32)), {}, ValueError,
                     r"cu_seqlens_k must have shape \(3,\).*got cu_seqlens_k\.shape=\(2,\)"),
    "cu_q_int64": (dict(cu_q=np.array([0, 3, 5], np.int64)), {}, TypeError,
                   r"cu_seqlens_q must be int32 \(batch \+ 1,\): offsets of the query sequences; "
                   r"got cu_seqlens_q\.dtype=int64"),
    "cu_k_int64": (dict(cu_k=np.array([0, 4, 9], np.int64)), {}, TypeError,
                   r"cu_seqlens_k must be int32 .*got cu_seqlens_k\.dtype=int64"),
    "cu_q_2d": (dict(cu_q=np.array([[0, 3, 5]], np.int32)), {}, ValueError,
                r"cu_seqlens_q must be int32 \(batch \+ 1,\) offsets; got \(1, 3\)"),
    "cu_k_2d": (dict(cu_k=np.array([[0], [4], [9]], np.int32)), {}, ValueError,
                r"cu_seqlens_k must be int32 \(batch \+ 1,\) offsets; got \(3, 1\)"),
    "seqused_wrong_length": ({}, dict(seqused_k=np.array([1, 2, 3], np.int32)), ValueError,
                             r"seqused_k must have shape \(2,\) \(batch,\): keys used per sequence; "
                             r"got seqused_k\.shape=\(3,\)"),
    "seqused_int64": ({}, dict(seqused_k=np.array([1, 2], np.int64)), TypeError,
                      r"seqused_k must be int32 \(batch,\): keys used per sequence; got seqused_k\.dtype=int64"),
    "max_seqlen_q_negative": ({}, dict(max_seqlen_q=-1), TypeError,
                              r"max_seqlen_q must be None or a static Python int >= 0 \(a hint\); got max_seqlen_q=-1"),
    "max_seqlen_q_float": ({}, dict(max_seqlen_q=3.0), TypeError,
                           r"max_seqlen_q must be None or a static Python int >= 0 \(a hint\); got max_seqlen_q=3\.0"),
    "max_seqlen_q_bool": ({}, dict(max_seqlen_q=True), TypeError,
                          r"max_seqlen_q must be None or a static Python int >= 0 \(a hint\); got max_seqlen_q=True"),
    "max_seqlen_k_negative": ({}, dict(max_seqlen_k=-5), TypeError,
                              r"max_seqlen_k must be None or a static Python int >= 0 \(a hint\); got max_seqlen_k=-5"),
    "rank4_q": (dict(rank4=True), {}, ValueError,
                r"q must have rank 3 \(total_tokens, heads, head_dim\); got q\.shape=\(1, 5, 4, 64\)"),
    "head_dim_80": (dict(d=80), {}, ValueError,
                    r"head_dim must be one of \(64, 96, 128, 192, 256\); got head_dim=80 \(q\.shape=\(5, 4, 80\)\)"),
    "triton": ({}, dict(implementation="triton"), ValueError,
               r'implementation must be None, "fa4", "cudnn" or "xla"; got implementation=\'triton\''),
    "causal_right_window_1": ({}, dict(causal=True, window_size=(4, 1)), ValueError,
                              r"causal=True means window_size\[1\] = 0 \(no key after the diagonal\); "
                              r"got window_size=\(4, 1\)"),
    "causal_right_window_only": ({}, dict(causal=True, window_size=(-1, 1)), ValueError,
                                 r"causal=True means window_size\[1\] = 0.*got window_size=\(-1, 1\)"),
    "bad_sinks": ({}, dict(sinks=np.zeros(2, np.float32)), ValueError,
                  r"sinks must have shape \(heads_q,\) = \(4,\); got sinks\.shape=\(2,\)"),
}


def test_fa4_on_cpu_raises_when_lowered():
    # "fa4" traces here (the program could be exported for CUDA) but cannot be lowered for this CPU.
    with pytest.raises(RuntimeError, match=r'implementation="fa4" cannot run here: (the program is lowered for cpu, '
                                           r'not an NVIDIA Hopper GPU|the kernel library)'):
        attention_varlen(*_args(), implementation="fa4")


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_arguments_rejected_before_running(case, no_run):
    arg_kw, call_kw, error, message = BAD_ARGS[case]
    with pytest.raises(error, match=message):
        attention_varlen(*_args(**arg_kw), **call_kw)


# -- transformations and hints ------------------------------------------------------------------

def test_jit_with_traced_offsets():
    q, k, v, cu_q, cu_k = make_packed(60)
    kwargs = dict(causal=True, window_size=(15, -1), softcap=20.0, return_lse=True)
    f = jax.jit(attention_varlen, static_argnames=STATIC)
    sinks = make_sinks(61, 8)
    # Two packings of the same tensors through one compiled program: the offsets are not baked in.
    repacked = [(9, 20), (11, 0), (0, 25), (20, 15), (15, 20)]
    cu_q2, cu_k2 = offsets([s for s, _ in repacked]), offsets([n for _, n in repacked])
    used2 = np.array([20, 0, 25, 9, 20], np.int32)
    for name, cq, ck, used in [("SEQS", cu_q, cu_k, SEQUSED_K), ("repacked", cu_q2, cu_k2, used2)]:
        o, lse = f(q, k, v, jnp.asarray(cq), jnp.asarray(ck), seqused_k=jnp.asarray(used), sinks=jnp.asarray(sinks),
                   **kwargs)
        o_eager, lse_eager = attention_varlen(q, k, v, cq, ck, seqused_k=used, sinks=sinks, **kwargs)
        np.testing.assert_array_equal(f64(o), f64(o_eager), err_msg=name)
        np.testing.assert_array_equal(lse, lse_eager, err_msg=name)
        check_result(o, lse, q, k, v, cq, ck, used, sinks=sinks, causal=True, window_size=(15, -1), softcap=20.0)
    assert f._cache_size() == 1, "cu_seqlens, seqused_k or sinks was treated as static"


def test_max_seqlen_hints_do_not_change_the_result():
    # On CPU the hints only pass through (the reference has no grid to size): each must still give the
    # oracle's result. That the kernel's grid, sized by max_seqlen_q, does not change it is
    # tests/test_gpu_varlen.py's test_varlen_max_seqlen_hints.
    q, k, v, cu_q, cu_k = make_packed(70)
    opts = dict(causal=True, window_size=(6, -1), sinks=make_sinks(71, 8))
    # Exact and loose bounds (a hint below the true maximum breaks the contract, so none is tried).
    runs = [attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **opts),
            attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=40, max_seqlen_k=60, return_lse=True, **opts),
            attention_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=64, return_lse=True, **opts),
            jax.jit(attention_varlen, static_argnames=STATIC)(q, k, v, cu_q, cu_k, max_seqlen_q=55, max_seqlen_k=128,
                                                              return_lse=True, **opts)]
    for o, lse in runs:
        check_result(o, lse, q, k, v, cu_q, cu_k, **opts)
