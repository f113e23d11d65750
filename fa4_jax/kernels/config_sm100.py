"""Arch-independent arithmetic of the SM100 (Blackwell) kernels of issue 16, as constants the
kernels will import and the CPU tests check (tests/test_sm100_arithmetic.py), so the two cannot
drift. Pure Python: no cutlass import, nothing here runs on a GPU by itself.

Software exp2 (FlashAttention-4's trick, docs FA4_NOTES.md): the softmax's 2^x, x <= 0 (the row max
already subtracted), is computed for a fraction of the elements on the FMA pipe beside the MUFU
unit, whose 16 ops / clock / SM bind at head_dim <= 128 on Blackwell:

    x  = max(x, EXP2_MIN_X)                    # keep 2^x normal (no denormal exponent field)
    n  = floor(x)                              # the kernel: (x + 1.5 * 2^23) - 1.5 * 2^23, round-down
    f  = x - n                                 # exact, in [0, 1)
    p  = fma(fma(fma(P3, f, P2), f, P1), f, 1) # 2^f by a degree-3 polynomial: three FMAs
    2^x = bits(p) + (n << 23)                  # add n to the exponent field: no multiply

EXP2_POLY (p0 = 1 exactly, so 2^0 = 1) is tuned for what the P.V gemm sees, bf16: a tenth of the
way from the minimax fit of the relative error of 1 + p1 f + p2 f^2 + p3 f^3 against 2^f on [0, 1]
(max error 8.56e-5) toward the least-squares fit (smaller errors on average, max 1.65e-4). Result:
max relative error 9.35e-5, and the bf16 rounding of the result equals that of the exact 2^x on
99.01% of [-126, 0] (the minimax fit alone: 98.998%). The tests re-derive both fits.

Conditional rescaling: the online softmax rescales O and the row sum only when the running row max
grows by more than RESCALE_THRESHOLD_LOG2 (log2 units, the scores already scaled by log2(e)); until
then it keeps the stale max, so the exponentials stay <= 2^8 (safe in fp32) and the result is exact
because O and the row sum share that max until the final division.
"""

from __future__ import annotations

# 2^f ~ 1 + P1 f + P2 f^2 + P3 f^3 on [0, 1] (0.9 x minimax + 0.1 x least squares, relative error).
EXP2_POLY = (1.0, 0.6951087113238156, 0.2277113740293337, 0.0769928306878863)
EXP2_POLY_BLEND = 0.1  # the least-squares fit's share
EXP2_POLY_MAX_REL_ERR = 9.36e-5
# Inputs are clamped here so that the exponent-field add always gives a normal float32: below it the
# result is 2^-126 (the smallest normal) where the exact value is a denormal, an absolute error under
# 1.2e-38 against a row sum >= 1 (MUFU's ex2.approx.ftz flushes those to 0, equally negligible).
EXP2_MIN_X = -126.0
# Rescale O / the row sum only when the row max grows by more than this (log2 units): 2^8 headroom.
RESCALE_THRESHOLD_LOG2 = 8.0
