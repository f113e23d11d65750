"""NumPy models of the SM100 kernels' arithmetic, step for step as fa4_jax/kernels/config_sm100.py
describes it, in float32 (FMA emulated exactly through float64: a float32 product is exact there)."""

from __future__ import annotations

import numpy as np

from fa4_jax.kernels.config_sm100 import EXP2_MIN_X, EXP2_POLY, RESCALE_THRESHOLD_LOG2


def fma32(a, b, c):
    """float32 fma: the float64 product of two float32 values is exact, so one rounding of a*b + c
    to float32 happens at the end (double rounding through float64 is within 2^-53, below fp32's ulp
    except on exact ties, which these tests do not depend on)."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def exp2_emulated(x: np.ndarray) -> np.ndarray:
    """2^x for float32 x <= RESCALE_THRESHOLD_LOG2 (a stale max lets a score exceed it by that much)
    the way the kernel's FMA path computes it."""
    x_in = np.asarray(x, np.float32)
    # The kernel's max.f32 replaces NaN by EXP2_MIN_X too; the NaN is put back at the end.
    x = np.fmax(np.where(np.isnan(x_in), np.float32(EXP2_MIN_X), x_in), np.float32(EXP2_MIN_X))
    n = np.floor(x).astype(np.float32)
    f = (x - n).astype(np.float32)  # exact
    p0, p1, p2, p3 = (np.float32(c) for c in EXP2_POLY)
    p = fma32(fma32(fma32(p3, f, p2), f, p1), f, p0)
    bits = p.view(np.int32) + (n.astype(np.int32) << 23)
    out = np.where(x_in < np.float32(EXP2_MIN_X), np.float32(0.0), bits.view(np.float32))
    return np.where(np.isnan(x_in), x_in, out)  # NaN stays NaN, as through MUFU


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest even), returned as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def online_softmax_pv(s_log2: np.ndarray, v: np.ndarray, block: int, conditional: bool):
    """O = softmax(s) V for one row block, streamed over key blocks as the kernel does, with scores
    already in log2 units. conditional: rescale only when the max grows by more than the threshold.
    Returns (o, lse_log2, rescales)."""
    rows = s_log2.shape[0]
    m = np.full(rows, -np.inf, np.float32)  # the max the exponentials are taken against
    l = np.zeros(rows, np.float32)
    o = np.zeros((rows, v.shape[1]), np.float32)
    rescales = 0
    for start in range(0, s_log2.shape[1], block):
        s = s_log2[:, start:start + block].astype(np.float32)
        m_new = np.maximum(m, s.max(axis=1))
        grow = m_new - np.where(np.isfinite(m), m, -np.inf)
        need = ~np.isfinite(m) | (grow > RESCALE_THRESHOLD_LOG2) if conditional else m_new > m
        if need.any():
            # Per warp in the kernel: here per row block, which is the coarser (safe) choice.
            scale = np.where(np.isfinite(m), np.exp2(m - m_new), 0.0).astype(np.float32)
            scale = np.where(need, scale, 1.0).astype(np.float32)
            o *= scale[:, None]
            l *= scale
            m = np.where(need, m_new, m).astype(np.float32)
            rescales += int(np.isfinite(m).all() and start > 0)
        p = np.exp2(s - m[:, None]).astype(np.float32)
        assert p.max() <= 2.0 ** RESCALE_THRESHOLD_LOG2 * (1 + 1e-6), "an exponential exceeded the headroom"
        l += p.sum(axis=1)
        o += p @ v[start:start + block].astype(np.float32)
    return o / l[:, None], m + np.log2(l), rescales
