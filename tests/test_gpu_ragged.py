"""A ragged batch against a KV cache (attention_with_kvcache with cu_seqlens_q) on the GPU
(`@pytest.mark.gpu`): it runs the varlen kernel over the cache seen as packed sequences, a contiguous
cache in place and a paged one gathered first. Checked with the accuracy rule of tests/accuracy.py
against the XLA path and the fp32 oracle per sequence, with NaN poison past every length and in every
page no sequence owns."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from accuracy import check_against_reference
from fa4_jax.families import VarlenVariant, mask_kind
from gpu_menu import require_variant
from oracle import OPTION_CASES, attention_oracle

pytestmark = [pytest.mark.gpu, pytest.mark.kernel_family("varlen")]

LENS, COUNTS = (700, 1, 300, 0, 129, 64), (512, 1, 1, 0, 129, 3)  # a prefill chunk, decodes, an empty row
H_Q, H_K, HD, CAP = 8, 2, 128, 768


def _case(seed, page_size):
    rng = np.random.default_rng(seed)
    b = len(LENS)
    cu = np.concatenate([[0], np.cumsum(COUNTS)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + 2, H_Q, HD), np.float32)
    dense = [rng.standard_normal((b, CAP, H_K, HD), np.float32) for _ in range(2)]
    for x in dense:
        for i, n in enumerate(LENS):
            x[i, n:] = np.nan
    if page_size is None:
        k, v, table = dense[0], dense[1], None
    else:
        max_pages = CAP // page_size
        num_pages = b * max_pages + 5
        table = np.random.default_rng(seed + 1).permutation(num_pages)[:b * max_pages].astype(np.int32)
        table = table.reshape(b, max_pages)
        k, v = (np.full((num_pages, page_size, H_K, HD), np.nan, np.float32) for _ in range(2))
        for x, d in ((k, dense[0]), (v, dense[1])):
            x[table] = d.reshape(b, max_pages, page_size, H_K, HD)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return bf(q), bf(k), bf(v), jnp.asarray(np.array(LENS, np.int32)), jnp.asarray(cu), table, dense


@pytest.mark.parametrize("options", ["causal", "everything"])
@pytest.mark.parametrize("page_size", [None, 1, 16], ids=["contiguous", "page1", "page16"])
def test_ragged_kernel_matches_oracle(kernel_variants, page_size, options):
    opts = dict(OPTION_CASES[options])
    left, right = opts.get("window_size", (-1, -1))
    require_variant(kernel_variants, VarlenVariant("sm90", "bf16", HD, mask_kind(left, 0 if opts.get("causal") else right),
                                                   opts.get("softcap", 0.0) > 0))
    q, k, v, lens, cu, table, dense = _case(130 + (page_size or 0), page_size)
    table = None if table is None else jnp.asarray(table)

    def run(implementation):
        fn = jax.jit(lambda *a: fa4_jax.attention_with_kvcache(*a[:4], cu_seqlens_q=a[4], page_table=a[5],
                                                               return_lse=True, implementation=implementation, **opts))
        return fn(q, k, v, lens, cu, table)

    o, lse = run("fa4")
    o_x, lse_x = run("xla")
    o_r = jnp.zeros(q.shape, jnp.float32)
    lse_r = jnp.full((H_Q, q.shape[0]), -jnp.inf, jnp.float32)
    if opts.get("sinks") is not None:
        lse_r = jnp.broadcast_to(jnp.asarray(opts["sinks"], jnp.float32)[:, None], lse_r.shape)
    for i, n in enumerate(LENS):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        if rows.start == rows.stop:
            continue
        kd, vd = (jnp.asarray(d[i:i + 1, :n], jnp.bfloat16) for d in dense)
        ob, lb = attention_oracle(q[None, rows], kd, vd, softmax_scale=HD ** -0.5, xp=jnp, **opts)
        o_r, lse_r = o_r.at[rows].set(ob[0]), lse_r.at[:, rows].set(lb[0])
    check_against_reference((o[None], lse[None]), (o_x[None], lse_x[None]), (o_r[None], lse_r[None]),
                            what=f"ragged page={page_size} {options}")
