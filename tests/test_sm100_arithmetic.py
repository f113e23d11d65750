"""The SM100 kernels' arithmetic on the CPU (issue 16), with the constants imported from the kernel
config (fa4_jax/kernels/config_sm100.py): the FMA-pipe exp2 and the conditional online-softmax
rescaling. No GPU, no cutlass."""

from __future__ import annotations

import numpy as np

from fa4_jax.kernels.config_sm100 import EXP2_POLY, EXP2_POLY_BLEND, EXP2_POLY_MAX_REL_ERR, RESCALE_THRESHOLD_LOG2
from sm100_models import exp2_emulated, online_softmax_pv, to_bf16


F = np.linspace(0.0, 1.0, 200001)
# Relative error of 1 + p1 f + p2 f^2 + p3 f^3 against 2^f is A @ (p1, p2, p3) - B.
A = np.stack([F / 2 ** F, F ** 2 / 2 ** F, F ** 3 / 2 ** F], 1)
B = 1 - 1 / 2 ** F


def _remez_exp2_degree3(iterations: int = 40):
    """Minimax of the relative error on [0, 1] (Remez exchange over F's extrema)."""
    ref = np.array([0.05, 0.35, 0.7, 1.0])
    for _ in range(iterations):
        a = np.stack([ref / 2 ** ref, ref ** 2 / 2 ** ref, ref ** 3 / 2 ** ref, (-1.0) ** np.arange(4)], 1)
        coeffs = np.linalg.solve(a, 1 - 1 / 2 ** ref)[:3]
        err = A @ coeffs - B
        runs = np.split(np.arange(1, len(F)), np.where(np.diff(np.sign(err[1:])) != 0)[0] + 1)
        ext = sorted((r[np.argmax(np.abs(err[r]))] for r in runs if len(r)), key=lambda i: -abs(err[i]))[:4]
        ref = np.sort(F[ext])
    return coeffs


def test_exp2_coefficients_are_the_documented_blend():
    minimax = _remez_exp2_degree3()
    assert abs(np.abs(A @ minimax - B).max() - 8.56e-5) < 1e-7
    least_squares = np.linalg.lstsq(A, B, rcond=None)[0]
    blend = (1 - EXP2_POLY_BLEND) * minimax + EXP2_POLY_BLEND * least_squares
    assert EXP2_POLY[0] == 1.0
    np.testing.assert_allclose(EXP2_POLY[1:], blend, rtol=0, atol=1e-7)
    assert np.abs(A @ np.asarray(EXP2_POLY[1:]) - B).max() <= EXP2_POLY_MAX_REL_ERR


def test_exp2_emulation_relative_error_over_the_softmax_range():
    # A dense sweep of [-127, 0] (every float32 step would be 2^30 values: 4M points, plus the
    # integers and their neighbours, where the floor changes).
    x = np.concatenate([np.linspace(-127.0, 0.0, 4_000_001, dtype=np.float32),
                        np.arange(-127, 1, dtype=np.float32),
                        np.nextafter(np.arange(-126, 1, dtype=np.float32), np.float32(-np.inf))])
    got = exp2_emulated(x).astype(np.float64)
    exact = np.exp2(x.astype(np.float64))
    assert np.isfinite(got).all() and (got >= 0).all()
    # Where 2^x is a normal float32 (x >= -126): relative error within the polynomial's bound.
    normal = x >= -126
    rel = np.abs(got[normal] / exact[normal] - 1)
    assert rel.max() <= 1e-4, (rel.max(), x[normal][np.argmax(rel)])
    assert (got[normal] > 0).all()
    # Below (config_sm100.EXP2_MIN_X) the exact value is a float32 denormal and the emulation gives
    # 0, as MUFU does: an absolute error under 2^-126, nothing against a row sum >= 1.
    assert np.abs(got[~normal] - exact[~normal]).max() <= 2.0 ** -126
    # What the P.V gemm sees: bf16. The emulation matches bf16-rounded exact exp2 on >= 99% of the
    # range whose results are normal floats.
    same = to_bf16(got[normal].astype(np.float32)) == to_bf16(exact[normal].astype(np.float32))
    assert same.mean() >= 0.99, same.mean()
    # Exact powers of two stay exact (f = 0: p = 1).
    k = np.arange(-126, 1, dtype=np.float32)
    np.testing.assert_array_equal(exp2_emulated(k), np.exp2(k))


def test_exp2_emulation_above_zero_up_to_the_rescaling_headroom():
    # The max the softmax subtracts may be stale (conditional rescaling): a score can exceed it by up
    # to RESCALE_THRESHOLD_LOG2, so the FMA path also sees x in (0, threshold]. The exponent-field add
    # works the same for a positive floor: the same relative error and bf16 agreement there.
    x = np.concatenate([np.linspace(0.0, RESCALE_THRESHOLD_LOG2, 400_001, dtype=np.float32),
                        np.nextafter(np.arange(1, RESCALE_THRESHOLD_LOG2 + 1, dtype=np.float32), np.float32(0))])
    got = exp2_emulated(x).astype(np.float64)
    exact = np.exp2(x.astype(np.float64))
    rel = np.abs(got / exact - 1)
    assert rel.max() <= 1e-4, (rel.max(), x[np.argmax(rel)])
    same = to_bf16(got.astype(np.float32)) == to_bf16(exact.astype(np.float32))
    assert same.mean() >= 0.99, same.mean()
    k = np.arange(0, RESCALE_THRESHOLD_LOG2 + 1, dtype=np.float32)
    np.testing.assert_array_equal(exp2_emulated(k), np.exp2(k))


def test_exp2_emulation_flushes_below_the_normal_range_to_zero():
    # As MUFU's ex2.approx.ftz: a fully masked row (scores -inf) must keep an exact zero sum.
    assert exp2_emulated(np.float32(-1000.0)) == 0.0
    assert exp2_emulated(np.float32(-np.inf)) == 0.0
    assert exp2_emulated(np.float32(-126.0)) == np.float32(2.0 ** -126)
    assert exp2_emulated(np.nextafter(np.float32(-126.0), np.float32(-np.inf))) == 0.0
    assert np.isnan(exp2_emulated(np.float32(np.nan)))


def test_conditional_rescaling_is_exact_and_rescales_less():
    rng = np.random.default_rng(0)
    rows, keys, d, block = 64, 1024, 32, 128
    # Scores whose row max drifts upward across the keys (the case that makes a standard online
    # softmax rescale often): log2-domain scores plus a ramp.
    s = (rng.standard_normal((rows, keys)) * 3 + np.linspace(0, 12, keys)[None]).astype(np.float32)
    v = rng.standard_normal((keys, d)).astype(np.float32)
    p = np.exp2(s.astype(np.float64) - s.max(axis=1, keepdims=True))
    exact = (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)
    lse_exact = s.max(axis=1) + np.log2(p.sum(axis=1))
    o_std, lse_std, n_std = online_softmax_pv(s, v, block, conditional=False)
    o_cond, lse_cond, n_cond = online_softmax_pv(s, v, block, conditional=True)
    for o, lse in ((o_std, lse_std), (o_cond, lse_cond)):
        np.testing.assert_allclose(o, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
        np.testing.assert_allclose(lse, lse_exact, rtol=1e-6, atol=1e-5)
    assert n_cond < n_std, (n_cond, n_std)
    assert RESCALE_THRESHOLD_LOG2 == 8.0
