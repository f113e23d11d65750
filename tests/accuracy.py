"""The accuracy rule every GPU test applies (FlashAttention's), shared by the entry points' GPU tests.

With ref32 = attention of the fp32-upcast inputs computed in fp32 (tests/oracle.py),
  max|ours - ref32| <= 2 * max|xla - ref32| + atol,
where `xla` is fa4_jax's own XLA path on the same bf16/f16 inputs (see test_gpu_attention.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def poison_allocator(*shapes_dtypes):
    """Fill and free NaN buffers the size of the coming outputs (best effort; see module docstring)."""
    bufs = [jnp.full(shape, jnp.nan, dtype) for shape, dtype in shapes_dtypes]
    for buf in bufs:
        buf.block_until_ready()
    for buf in bufs:
        buf.delete()


# atol for O: 1e-3 x the output magnitude. It only matters where the XLA path is (nearly) exact, e.g.
# s_k = 1 or rows that round identically; there the kernel's bf16/f16 rounding of P before the PV
# matmul may still move O by a fraction of an output ulp. 1e-3 relative is ~1/4 of a bf16 ulp and
# ~2 fp16 ulps, far below what a wrong tile, mask or scale produces (>= 1e-2 relative).
O_ATOL_REL = 1e-3
# atol for LSE (natural log, fp32): scores come from the same bf16/f16 inputs with fp32 accumulation in
# both, so only summation order and ex2/lg2 approximations differ (~1e-5); 1e-3 leaves margin and stays
# 30x below the shift from dropping one 128-key block at s_k = 4096 (~log(1 - 1/32) = 0.03).
LSE_ATOL = 1e-3


def check_against_reference(out_ours, out_xla, out_ref, *, what: str, no_key=None):
    """Apply the accuracy rule to O and LSE; `what` names the case in failure messages.

    no_key: optional (s_q,) bool, the rows that see no key (o must be exactly 0 there, also with
    sinks, whose LSE is then the sink logit and therefore finite)."""
    (o, lse), (o_x, lse_x), (o_r, lse_r) = (tuple(np.asarray(a, np.float32) for a in t)
                                            for t in (out_ours, out_xla, out_ref))

    assert o.shape == o_r.shape and lse.shape == lse_r.shape, f"{what}: shapes {o.shape=} {lse.shape=}"
    assert not np.isnan(lse).any(), f"{what}: LSE has {np.count_nonzero(np.isnan(lse))} NaN entries"
    assert not np.isnan(lse_x).any(), f"{what}: the XLA path itself gave NaN LSE"

    # Rows with no visible key: exactly O = 0 and LSE = -inf; every other row finite.
    empty = np.isneginf(lse_r)  # (b, h_q, s_q)
    assert np.array_equal(np.isneginf(lse), empty), (
        f"{what}: LSE is -inf at {np.count_nonzero(np.isneginf(lse))} rows, reference at {np.count_nonzero(empty)}")
    assert np.isfinite(lse[~empty]).all(), f"{what}: +inf in LSE"
    if empty.any():
        o_rows = o.transpose(0, 2, 1, 3)  # (b, h_q, s_q, d)
        assert not o_rows[empty].any(), f"{what}: O != 0 in rows that see no key"
    check_o_against_reference(o, o_x, o_r, what=what, no_key=no_key, dtype=out_ours[0].dtype)

    if (~empty).any():
        lerr = np.abs(lse[~empty] - lse_r[~empty]).max()
        lerr_x = np.abs(lse_x[~empty] - lse_r[~empty]).max()
        assert lerr_x <= LSE_ATOL, f"{what}: the XLA path's LSE is itself off the fp32 oracle by {lerr_x:.3g}"
        lbound = 2 * lerr_x + LSE_ATOL
        assert lerr <= lbound, f"{what}: max|LSE - ref32| = {lerr:.3g} > bound {lbound:.3g} (xla err {lerr_x:.3g})"


def check_o_against_reference(o_ours, o_xla, o_ref, *, what: str, no_key=None, dtype=None):
    """The rule's O part alone, for outputs that come without LSE (o: (b, s, h, d) or (s, h, d);
    dtype: the inputs' dtype, default o_ours.dtype). check_against_reference calls it."""
    eps = float(jnp.finfo(o_ours.dtype if dtype is None else dtype).eps)
    o, o_x, o_r = (np.asarray(a, np.float32) for a in (o_ours, o_xla, o_ref))
    assert o.shape == o_r.shape == o_x.shape, f"{what}: shapes {o.shape=} {o_x.shape=} {o_r.shape=}"
    assert np.isfinite(o).all(), f"{what}: O has {np.count_nonzero(~np.isfinite(o))} NaN/Inf entries"
    assert np.isfinite(o_x).all(), f"{what}: the XLA path itself gave NaN/Inf"
    if no_key is not None and no_key.any():
        assert not o[:, no_key].any(), f"{what}: O != 0 in {np.count_nonzero(no_key)} rows that see no key"

    # The bound is only as good as the XLA path it is built from: a wrong XLA result would make it vacuous.
    # That path rounds an fp32 result once (contract: "exact" reference), so per row it is within half an
    # ulp of the row's largest element; 2 ulps is the sanity cap. Failing here blames the XLA path.
    xla_row_err = np.abs(o_x - o_r).max(-1)
    xla_bad = xla_row_err > 2 * eps * np.abs(o_r).max(-1) + 1e-6
    assert not xla_bad.any(), (
        f"{what}: the XLA path (implementation='xla') is itself off the fp32 oracle in {np.count_nonzero(xla_bad)} "
        f"rows (max err {xla_row_err.max():.3g}); fix the reference before judging the kernel")

    err = np.abs(o - o_r).max()
    err_x = np.abs(o_x - o_r).max()
    bound = 2 * err_x + O_ATOL_REL * np.abs(o_r).max() + 1e-6
    where = np.unravel_index(np.argmax(np.abs(o - o_r)), o.shape)
    assert err <= bound, f"{what}: max|O - ref32| = {err:.3g} at {where} > bound {bound:.3g} (xla err {err_x:.3g})"

    # The same rule per query row (max over head_dim), with atol = one ulp of the row's magnitude. The
    # global max is set by the largest rows (early causal rows, where O ~ one row of V ~ 3), so alone it
    # would let a wrong kv block in a long row (|O| ~ 0.05) pass. An emulation of an FA-style kernel (P
    # rounded to bf16/f16 before PV, fp32 accumulation) used at most half of this bound on these shapes.
    row_err = np.abs(o - o_r).max(-1)
    row_bound = 2 * xla_row_err + eps * np.abs(o_r).max(-1) + 1e-6
    bad = row_err > row_bound
    if bad.any():
        i = np.unravel_index(np.argmax(row_err / row_bound), row_err.shape)
        raise AssertionError(
            f"{what}: {np.count_nonzero(bad)} of {bad.size} rows over the per-row bound; worst row {i}: "
            f"err {row_err[i]:.3g} > bound {row_bound[i]:.3g} (|ref row| max {np.abs(o_r[i]).max():.3g})")
