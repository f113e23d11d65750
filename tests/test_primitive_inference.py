"""The inference primitives fa4_kvcache and fa4_varlen: lowerings, vmap rules and their refusal to
differentiate, checked without a GPU.

As in test_primitive.py, exporting for platforms=["cuda"] runs the CUDA lowering rule on this CPU-only
machine, so the StableHLO a GPU host would compile (the FFI custom call, its operands, workspace
results and attributes) can be inspected here. The vmap rules are checked numerically through the
reference path (implementation="xla", float32 inputs, which the reference accepts): each slice of a
vmapped call must equal the unbatched call on that slice.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax import attention_varlen, attention_with_kvcache
from fa4_jax.families import KVCACHE, VARLEN
from fa4_jax.ops.kvcache.spec import auto_split_capacity
from fa4_jax.ops.kvcache.primitive import fa4_kvcache_p
from fa4_jax.ops.varlen.primitive import fa4_varlen_p

# What the CUDA lowering emits must not depend on which variants this host's build has.
pytestmark = pytest.mark.usefixtures("kernel_library")

KV_TARGET = KVCACHE.target
VL_TARGET = VARLEN.target
ALLOW = [jax.export.DisabledSafetyCheck.custom_call(KV_TARGET), jax.export.DisabledSafetyCheck.custom_call(VL_TARGET)]
NEG_INF_F32 = "0xFF800000"  # how StableHLO spells float32 -inf


# -- helpers --------------------------------------------------------------------------------------

def export_text(fn, args, platforms, disabled_checks=ALLOW):
    exported = jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=disabled_checks)(*args)
    return exported, exported.mlir_module()


def custom_calls(text):
    return re.findall(r"stablehlo\.custom_call @(\w+)\(", text)


def call_line(text, target):
    lines = [l for l in text.splitlines() if f"stablehlo.custom_call @{target}(" in l]
    assert len(lines) == 1, f"expected one call to {target}, got {len(lines)}"
    return lines[0]


def operand_names(line, target):
    (names,) = re.findall(rf"@{target}\(([^)]*)\)", line)
    return [n.strip() for n in names.split(",")]


def signature(line):
    """(operand types, result types) of a custom call line."""
    m = re.search(r"\} : \(([^()]*)\) -> \(([^()]*)\)", line)
    assert m, line
    return m.group(1).split(", "), m.group(2).split(", ")


def definitions(text):
    return dict(re.findall(r"^\s*(%[\w#]+) = (.*)$", text, flags=re.M))


def is_splat(text, name, shape, elt, value):
    """Whether SSA value `name` is a constant array of `shape` filled with `value` (a splat
    constant, or a broadcast of a scalar constant: whichever the JAX version emits)."""
    t = f"tensor<{'x'.join(map(str, shape))}x{elt}>"
    defs = definitions(text)
    d = defs[name]
    if re.match(rf"stablehlo\.constant dense<{value}> : {t}", d):
        return True
    m = re.match(rf"stablehlo\.broadcast_in_dim (%\w+), dims = \[\] : \(tensor<{elt}>\) -> {t}", d)
    return bool(m) and re.match(rf"stablehlo\.constant dense<{value}> : tensor<{elt}>", defs[m.group(1)]) is not None


def f32(x):
    return np.asarray(x, np.float32)


def tensor(shape, elt):
    return f"tensor<{'x'.join(map(str, shape))}x{elt}>"


def kv_bind(q, k, v, seqlens, page_table=None, sinks=None, *, softmax_scale=0.125, window_left=-1,
            window_right=0, softcap=0.0, num_splits=0, implementation="auto"):
    """Binds fa4_kvcache as is (no device or library checks)."""
    operands = tuple(x for x in (q, k, v, seqlens, page_table, sinks) if x is not None)
    return tuple(fa4_kvcache_p.bind(*operands, softmax_scale=softmax_scale, window_left=window_left,
                                    window_right=window_right, softcap=softcap, has_sinks=sinks is not None,
                                    paged=page_table is not None, ragged=False, kv_fp8=False, max_seqlen_q=0, tile_m=64, page_rows=16,
                                    num_splits=num_splits, implementation=implementation))


def vl_bind(q, k, v, cu_q, cu_k, seqused_k=None, sinks=None, *, softmax_scale=0.125, window_left=-1,
            window_right=0, softcap=0.0, max_seqlen_q=0, implementation="auto"):
    """Binds fa4_varlen as is (no device or library checks)."""
    operands = tuple(x for x in (q, k, v, cu_q, cu_k, seqused_k, sinks) if x is not None)
    return tuple(fa4_varlen_p.bind(*operands, softmax_scale=softmax_scale, window_left=window_left,
                                   window_right=window_right, softcap=softcap, has_seqused=seqused_k is not None,
                                   has_sinks=sinks is not None, max_seqlen_q=max_seqlen_q,
                                   implementation=implementation))


def test_targets_are_the_current_abis():
    # The FFI ABI names: the C++ handlers register them and serialized exports name them, so a
    # change must be deliberate (a new version suffix), never a side effect. kvcache v2: an absent
    # page table is a zero-size operand with has_page_table = false (v1: a dummy table and `paged`);
    # v3: ragged batches (optional cu_seqlens_q, max_seqlen_q and tile_m attributes); v4: an
    # optional tile list (ragged calls with more than one query tile per sequence); v5: the opt-in
    # attribute; v6: FP8 caches with the k_scale / v_scale operands.
    assert KV_TARGET == "fa4_jax_kvcache_v6", f"{KV_TARGET=}"
    assert VL_TARGET == "fa4_jax_varlen_v2", f"{VL_TARGET=}"


@pytest.mark.parametrize("max_seqlen_q,listed", [(1, False), (16, False), (17, False), (32, False), (33, True), (300, True)])
def test_ragged_lowering_sends_a_tile_list_when_sequences_span_tiles(max_seqlen_q, listed):
    # 8 q-heads over 2 KV heads: 4 packed rows per query. A ragged call whose longest sequence fits one
    # tile (64 rows up to 16 queries, 128 up to 32) runs every sequence's single tile; longer ones get
    # the lowering's list of the tiles with rows (ops/kvcache/tiles.py): 2 * (ceil(total_q * 4 /
    # tile_m) + b + 1) entries.
    from fa4_jax.ops.kvcache.spec import tile_m_for
    total_q, b = 333, 5
    q = jax.ShapeDtypeStruct((1, total_q, H_Q, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, CAPACITY, H_K, D), jnp.bfloat16)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    tile_m = tile_m_for(max_seqlen_q * (H_Q // H_K))

    def f(q, k, v, lens, cu):
        return fa4_kvcache_p.bind(q, k, v, lens, cu, softmax_scale=0.125, window_left=-1, window_right=0,
                                  softcap=0.0, has_sinks=False, paged=False, ragged=True, kv_fp8=False, max_seqlen_q=max_seqlen_q,
                                  tile_m=tile_m, page_rows=16, num_splits=0, implementation="auto")

    _, text = export_text(f, [q, kv, kv, i32(b), i32(b + 1)], ["cuda"])
    line = call_line(text, KV_TARGET)
    operands, _ = signature(line)
    entries = 2 * (-(-total_q * (H_Q // H_K) // tile_m) + b + 1) if listed else 0
    assert operands[6] == tensor((entries,), "i32"), f"{operands=}"
    assert f"has_tile_list = {'true' if listed else 'false'}" in line


# -- fa4_kvcache: CUDA lowering -------------------------------------------------------------------

B, S_Q, H_Q, H_K, D = 2, 4, 8, 2, 128
CAPACITY = 1024
PAGE_SIZE, NUM_PAGES, MAX_PAGES = 64, 40, 12
# The workspace extent num_splits=None may pick: tiles = B * H_K * ceil(S_Q * (H_Q // H_K) / 64) = 4 CTAs
# without splitting, so the 320-CTA target allows 80 splits; the key blocks (128 keys each) bound it:
# 1024 keys -> 8 for the contiguous cache, MAX_PAGES * PAGE_SIZE = 768 keys -> 6 for the paged one (the
# pool's NUM_PAGES * PAGE_SIZE = 2560 keys must not count: a sequence sees at most max_pages pages).
AUTO_CAP = {False: 8, True: 6}


def kv_specs(*, b=B, s_q=S_Q, h_q=H_Q, h_k=H_K, d=D, paged=False, capacity=CAPACITY, num_pages=NUM_PAGES,
             page_size=PAGE_SIZE, max_pages=MAX_PAGES, sinks=None, dtype=jnp.bfloat16):
    q = jax.ShapeDtypeStruct((b, s_q, h_q, d), dtype)
    cache = (num_pages, page_size) if paged else (b, capacity)
    kv = jax.ShapeDtypeStruct((*cache, h_k, d), dtype)
    specs = [q, kv, kv, jax.ShapeDtypeStruct((b,), jnp.int32)]
    if paged:
        specs.append(jax.ShapeDtypeStruct((b, max_pages), jnp.int32))
    if sinks is not None:
        specs.append(jax.ShapeDtypeStruct((h_q,), sinks))
    return specs


def test_auto_capacity_constants():
    # The literals above, recomputed by the family's own formula (they are what the lowering must use).
    assert auto_split_capacity(B, H_K, S_Q * (H_Q // H_K), CAPACITY) == AUTO_CAP[False]
    assert auto_split_capacity(B, H_K, S_Q * (H_Q // H_K), PAGE_SIZE * MAX_PAGES) == AUTO_CAP[True]


@pytest.mark.parametrize("num_splits", [0, 5], ids=["auto_splits", "forced_5"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_cuda_lowering_emits_one_ffi_call(paged, with_sinks, num_splits):
    args = kv_specs(paged=paged, sinks=jnp.float32 if with_sinks else None)

    def f(*a):
        q, k, v, lens, *rest = a
        table = rest[0] if paged else None
        sinks = rest[-1] if with_sinks else None
        return kv_bind(q, k, v, lens, table, sinks, softmax_scale=0.0625, window_left=100, window_right=0,
                       softcap=30.0, num_splits=num_splits)

    exported, text = export_text(f, args, ["cuda"])
    assert custom_calls(text) == [KV_TARGET], f"{custom_calls(text)=}"
    line = call_line(text, KV_TARGET)

    # Ten operands always: q, k, v, cache_seqlens, page_table, cu_seqlens_q, tile_list, sinks, k_scale,
    # v_scale (the last two zero-size for 16-bit caches).
    names = operand_names(line, KV_TARGET)
    assert len(names) == 10, f"{names=}"
    assert names[:4] == ["%arg0", "%arg1", "%arg2", "%arg3"], f"{names=}"
    if paged:
        assert names[4] == "%arg4", f"the page table must be passed as is: {names=}"
    else:
        assert is_splat(text, names[4], (0, 0), "i32", "0"), f"page_table operand {names[4]} is not a (0, 0) array"
    assert is_splat(text, names[5], (0,), "i32", "0"), f"cu_seqlens_q operand {names[5]} is not a (0,) array"
    assert is_splat(text, names[6], (0,), "i32", "0"), f"tile_list operand {names[6]} is not a (0,) array"
    if with_sinks:
        assert names[7] == f"%arg{4 + paged}", f"{names=}"
        assert NEG_INF_F32 not in text, "given sinks must not be replaced by the -inf default"
    else:
        assert is_splat(text, names[7], (H_Q,), "f32", NEG_INF_F32), f"sinks operand {names[7]} is not -inf"
    # (k_scale / v_scale: (0,) float32, checked in the signature below.)

    cap = num_splits or AUTO_CAP[paged]
    kv_type = tensor((NUM_PAGES, PAGE_SIZE, H_K, D) if paged else (B, CAPACITY, H_K, D), "bf16")
    operands, results = signature(line)
    assert operands == [
        tensor((B, S_Q, H_Q, D), "bf16"), kv_type, kv_type, tensor((B,), "i32"),
        tensor((B, MAX_PAGES) if paged else (0, 0), "i32"), tensor((0,), "i32"), tensor((0,), "i32"),
        tensor((H_Q,), "f32"), tensor((0,), "f32"), tensor((0,), "f32"),
    ], f"{operands=}"
    assert results == [
        tensor((B, S_Q, H_Q, D), "bf16"), tensor((B, H_Q, S_Q), "f32"),
        tensor((cap, B, S_Q, H_Q, D), "f32"),  # o_accum: per-split partial outputs
        tensor((cap, B, H_Q, S_Q), "f32"),  # lse_accum: per-split partial LSEs
    ], f"{results=}"

    # Typed-FFI attributes with the types ffi/kvcache.cc decodes.
    for attribute in (f"num_splits = {num_splits} : i32", f"has_page_table = {'true' if paged else 'false'}",
                      "has_cu_seqlens_q = false", "has_tile_list = false", "has_k_scale = false", "has_v_scale = false", "tile_m = 64 : i32", "max_seqlen_q = 0 : i32", "page_rows = 16 : i32",
                      "softmax_scale = 6.250000e-02 : f32", "softcap = 3.000000e+01 : f32",
                      "window_left = 100 : i32", "window_right = 0 : i32"):
        assert attribute in line, f"{attribute=} missing from {line}"
    # Only o and lse leave the call; the workspace does not.
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        ((B, S_Q, H_Q, D), jnp.bfloat16), ((B, H_Q, S_Q), jnp.float32)]


def test_kvcache_cuda_lowering_converts_sinks_to_float32():
    args = kv_specs(paged=True, sinks=jnp.bfloat16)
    f = lambda q, k, v, lens, table, sinks: kv_bind(q, k, v, lens, table, sinks)  # noqa: E731
    _, text = export_text(f, args, ["cuda"])
    names = operand_names(call_line(text, KV_TARGET), KV_TARGET)
    convert = rf"{re.escape(names[7])} = stablehlo\.convert %arg5 : \(tensor<8xbf16>\) -> tensor<8xf32>"
    assert re.search(convert, text), "bf16 sinks must be converted to float32"


@pytest.mark.parametrize(
    "implementation,platforms",
    [("xla", ["cuda"]), ("auto", ["cpu"]), ("xla", ["cpu"])],
)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_reference_lowering_has_no_custom_call(paged, implementation, platforms):
    args = kv_specs(paged=paged, capacity=128, max_pages=2, num_pages=6, sinks=jnp.float32)
    f = lambda *a: kv_bind(*a[:4], a[4] if paged else None, a[-1], implementation=implementation)  # noqa: E731
    _, text = export_text(f, args, platforms, disabled_checks=())
    assert custom_calls(text) == [], f"{custom_calls(text)=}"
    assert "stablehlo.dot_general" in text and "stablehlo.exponential" in text


def test_kvcache_public_xla_exports_without_custom_call():
    # The public API with implementation="xla", exported for CUDA: the reference, no kernel.
    args = kv_specs(paged=True, d=64, capacity=128, max_pages=2, num_pages=6)
    f = lambda q, k, v, lens, table: attention_with_kvcache(q, k, v, lens, page_table=table, causal=True,  # noqa: E731
                                                            return_lse=True, implementation="xla")
    _, text = export_text(f, args, ["cuda"], disabled_checks=())
    assert custom_calls(text) == [], f"{custom_calls(text)=}"


@pytest.mark.parametrize(
    "shape",
    [dict(b=0), dict(b=0, paged=True), dict(s_q=0), dict(capacity=0), dict(s_q=0, paged=True),
     # A page table with no pages: capacity 0, as for capacity=0 (ffi/kvcache.cc refuses max_pages < 1).
     dict(max_pages=0, paged=True)],
    ids=["batch0", "batch0_paged", "seqlen_q0", "capacity0", "seqlen_q0_paged", "max_pages0"],
)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_kvcache_zero_size_never_reaches_the_kernel(shape, with_sinks):
    kw = dict(d=64, h_q=4, h_k=2, num_pages=6, page_size=16)
    kw = dict(kw, **shape)
    paged = kw.get("paged", False)
    args = kv_specs(sinks=jnp.float32 if with_sinks else None, **kw)
    f = lambda *a: kv_bind(*a[:4], a[4] if paged else None, a[-1] if with_sinks else None,  # noqa: E731
                           window_left=3, window_right=0)
    _, text = export_text(f, args, ["cuda"])
    assert custom_calls(text) == [], f"{custom_calls(text)=}"

    # The multi-platform artifact, called here: o = 0, lse = -inf / the sink logit.
    exported, _ = export_text(f, args, ["cpu", "cuda"])
    rng = np.random.default_rng(0)
    values = []
    for s in args:
        if s.dtype == jnp.int32:
            values.append(np.zeros(s.shape, np.int32))
        else:
            values.append(rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype))
    if with_sinks:
        values[-1] = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
    o, lse = exported.call(*values)
    b, s_q, h_q = args[0].shape[:3]
    assert (o.shape, o.dtype) == (args[0].shape, jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((b, h_q, s_q), jnp.float32)
    assert np.all(f32(o) == 0.0)
    want = values[-1][None, :, None] if with_sinks else -np.inf
    np.testing.assert_array_equal(lse, np.broadcast_to(want, (b, h_q, s_q)))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_kvcache_public_zero_batch_on_cpu(paged):
    # The public API on this CPU (the reference): a batch of 0 gives empty results, paged or not.
    q = np.zeros((0, 3, 4, 64), jnp.bfloat16)
    k = np.zeros((6, 16, 2, 64) if paged else (0, 16, 2, 64), jnp.bfloat16)
    table = np.zeros((0, 2), np.int32) if paged else None
    o, lse = attention_with_kvcache(q, k, k, np.zeros((0,), np.int32), page_table=table, return_lse=True)
    assert (o.shape, lse.shape) == ((0, 3, 4, 64), (0, 4, 3)), f"{o.shape=} {lse.shape=}"


# -- fa4_varlen: CUDA lowering --------------------------------------------------------------------

TOTAL_Q, TOTAL_K, VB, VH_Q, VH_K, VD = 200, 300, 3, 8, 2, 128


def vl_specs(*, total_q=TOTAL_Q, total_k=TOTAL_K, b=VB, h_q=VH_Q, h_k=VH_K, d=VD, seqused=False, sinks=None,
             dtype=jnp.bfloat16):
    specs = [jax.ShapeDtypeStruct((total_q, h_q, d), dtype), jax.ShapeDtypeStruct((total_k, h_k, d), dtype),
             jax.ShapeDtypeStruct((total_k, h_k, d), dtype), jax.ShapeDtypeStruct((b + 1,), jnp.int32),
             jax.ShapeDtypeStruct((b + 1,), jnp.int32)]
    if seqused:
        specs.append(jax.ShapeDtypeStruct((b,), jnp.int32))
    if sinks is not None:
        specs.append(jax.ShapeDtypeStruct((h_q,), sinks))
    return specs


@pytest.mark.parametrize("hint,attribute", [(0, TOTAL_Q), (50, 50), (TOTAL_Q, TOTAL_Q), (1000, TOTAL_Q)],
                         ids=["no_hint", "hint_50", "hint_total", "hint_past_total"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
@pytest.mark.parametrize("seqused", [False, True], ids=["no_seqused", "seqused"])
def test_varlen_cuda_lowering_emits_one_ffi_call(seqused, with_sinks, hint, attribute):
    args = vl_specs(seqused=seqused, sinks=jnp.float32 if with_sinks else None)

    def f(*a):
        q, k, v, cu_q, cu_k, *rest = a
        used = rest[0] if seqused else None
        sinks = rest[-1] if with_sinks else None
        return vl_bind(q, k, v, cu_q, cu_k, used, sinks, softmax_scale=0.0625, window_left=7, window_right=3,
                       softcap=20.0, max_seqlen_q=hint)

    exported, text = export_text(f, args, ["cuda"])
    assert custom_calls(text) == [VL_TARGET], f"{custom_calls(text)=}"
    line = call_line(text, VL_TARGET)

    # Seven operands always: q, k, v, cu_q, cu_k, seqused_k, sinks.
    names = operand_names(line, VL_TARGET)
    assert len(names) == 7 and names[:5] == ["%arg0", "%arg1", "%arg2", "%arg3", "%arg4"], f"{names=}"
    if seqused:
        assert names[5] == "%arg5", f"{names=}"
    else:
        # cu_seqlens_k[1:] - cu_seqlens_k[:-1]: the whole key segments.
        assert definitions(text)[names[5]].startswith("stablehlo.subtract"), definitions(text)[names[5]]
    if with_sinks:
        assert names[6] == f"%arg{5 + seqused}", f"{names=}"
        assert NEG_INF_F32 not in text
    else:
        assert is_splat(text, names[6], (VH_Q,), "f32", NEG_INF_F32), f"sinks operand {names[6]} is not -inf"

    operands, results = signature(line)
    assert operands == [
        tensor((TOTAL_Q, VH_Q, VD), "bf16"), tensor((TOTAL_K, VH_K, VD), "bf16"), tensor((TOTAL_K, VH_K, VD), "bf16"),
        tensor((VB + 1,), "i32"), tensor((VB + 1,), "i32"), tensor((VB,), "i32"), tensor((VH_Q,), "f32"),
    ], f"{operands=}"
    assert results == [tensor((TOTAL_Q, VH_Q, VD), "bf16"), tensor((VH_Q, TOTAL_Q), "f32")], f"{results=}"
    for a in (f"max_seqlen_q = {attribute} : i32", "softmax_scale = 6.250000e-02 : f32",
              "softcap = 2.000000e+01 : f32", "window_left = 7 : i32", "window_right = 3 : i32"):
        assert a in line, f"{a=} missing from {line}"
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        ((TOTAL_Q, VH_Q, VD), jnp.bfloat16), ((VH_Q, TOTAL_Q), jnp.float32)]


@pytest.mark.parametrize(
    "implementation,platforms",
    [("xla", ["cuda"]), ("auto", ["cpu"]), ("xla", ["cpu"])],
)
def test_varlen_reference_lowering_has_no_custom_call(implementation, platforms):
    args = vl_specs(total_q=40, total_k=50, seqused=True, sinks=jnp.float32)
    f = lambda *a: vl_bind(*a, implementation=implementation)  # noqa: E731
    _, text = export_text(f, args, platforms, disabled_checks=())
    assert custom_calls(text) == [], f"{custom_calls(text)=}"


@pytest.mark.parametrize("shape", [dict(total_q=0), dict(total_k=0), dict(b=0)], ids=["total_q0", "total_k0", "batch0"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_varlen_zero_size_never_reaches_the_kernel(shape, with_sinks):
    args = vl_specs(d=64, h_q=4, h_k=2, sinks=jnp.float32 if with_sinks else None, **shape)
    f = lambda q, k, v, cu_q, cu_k, *sinks: vl_bind(q, k, v, cu_q, cu_k, None, *sinks, window_left=3,  # noqa: E731
                                                    window_right=0)
    _, text = export_text(f, args, ["cuda"], disabled_checks=())
    assert custom_calls(text) == [], f"{custom_calls(text)=}"

    # The multi-platform artifact, called here: o = 0 everywhere; lse = -inf / the sink logit (the
    # rows of sequences without keys, and rows past cu_seqlens_q[-1], see nothing but the sink).
    exported, _ = export_text(f, args, ["cpu", "cuda"])
    total_q, h_q = args[0].shape[:2]
    b = args[3].shape[0] - 1
    cu_q = np.linspace(0, total_q, b + 1).astype(np.int32)  # the query rows split over the sequences
    cu_k = np.linspace(0, args[1].shape[0], b + 1).astype(np.int32)
    rng = np.random.default_rng(1)
    values = [rng.standard_normal(s.shape, dtype=np.float32).astype(s.dtype) for s in args[:3]] + [cu_q, cu_k]
    if with_sinks:
        values.append(np.array([0.5, -1.0, 2.0, -np.inf], np.float32))
    o, lse = exported.call(*values)
    assert (o.shape, o.dtype) == (args[0].shape, jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((h_q, total_q), jnp.float32)
    assert np.all(f32(o) == 0.0)
    want = values[-1][:, None] if with_sinks else -np.inf
    np.testing.assert_array_equal(lse, np.broadcast_to(want, (h_q, total_q)))


# -- vmap: one kernel launch under the CUDA lowering ----------------------------------------------

N = 3  # vmapped slices


def batched_spec(spec, axis, n=N):
    if axis is None:
        return spec
    shape = list(spec.shape)
    shape.insert(axis, n)
    return jax.ShapeDtypeStruct(tuple(shape), spec.dtype)


@pytest.mark.parametrize(
    "paged,with_sinks,in_axes",
    [
        (False, False, (0, None, None, None)),  # (a) only q mapped
        (False, True, (0, None, None, None, 0)),  # (a) q and sinks mapped
        (True, True, (2, None, None, None, None, None)),  # (a) paged, q mapped on an inner axis
        (False, False, (0, 0, 0, 0)),  # (b) everything mapped
        (False, True, (0, 0, 0, 0, None)),  # (b) with shared sinks
        (True, False, (0, 0, 0, 0, 0)),  # (b') mapped pool and page table
        (True, False, (0, None, None, 0, 0)),  # (b'') shared pool, mapped page table
    ],
    ids=["a_q_only", "a_q_sinks", "a_paged_axis2", "b_all", "b_shared_sinks", "b_paged_pool", "b_shared_pool"],
)
def test_kvcache_vmap_is_one_custom_call(paged, with_sinks, in_axes):
    base = kv_specs(paged=paged, sinks=jnp.float32 if with_sinks else None, capacity=512, max_pages=8)
    args = [batched_spec(s, a) for s, a in zip(base, in_axes)]

    def f(*a):
        return kv_bind(*a[:4], a[4] if paged else None, a[-1] if with_sinks else None, window_left=16, softcap=5.0)

    exported, text = export_text(jax.vmap(f, in_axes=in_axes), args, ["cuda"])
    assert text.count(f"@{KV_TARGET}(") == 1, "vmap must be one kernel launch"
    assert custom_calls(text) == [KV_TARGET]
    assert "stablehlo.while" not in text, "vmap must not loop"
    line = call_line(text, KV_TARGET)
    operands, results = signature(line)
    names = operand_names(line, KV_TARGET)

    cache_mapped = any(a is not None for a in in_axes[1:4 + paged])
    if not cache_mapped:
        # (a): the slices join the query heads; the cache goes to the kernel as is (no copy).
        b, h_q = B, N * H_Q
        assert names[1:3] == ["%arg1", "%arg2"], f"the cache must not be copied: {names=}"
        if paged:
            assert names[4] == "%arg4", f"{names=}"
        cache_type = base[1]
    else:
        # (b): the slices join the batch; a mapped page pool becomes one pool of N * NUM_PAGES pages.
        b, h_q = N * B, H_Q
        cache_type = base[1] if not in_axes[1] == 0 else jax.ShapeDtypeStruct(
            (N * base[1].shape[0], *base[1].shape[1:]), base[1].dtype)
    keys = PAGE_SIZE * 8 if paged else 512
    cap = auto_split_capacity(b, H_K, S_Q * (h_q // H_K), keys)
    assert operands[0] == tensor((b, S_Q, h_q, D), "bf16"), f"{operands=}"
    assert operands[1] == operands[2] == tensor(cache_type.shape, "bf16"), f"{operands=}"
    assert operands[3] == tensor((b,), "i32"), f"{operands=}"
    assert operands[4] == (tensor((b, 8), "i32") if paged else tensor((0, 0), "i32")), f"{operands=}"
    assert operands[5] == tensor((0,), "i32"), f"{operands=}"  # no cu_seqlens_q
    assert operands[6] == tensor((0,), "i32"), f"{operands=}"  # no tile list
    assert operands[7] == tensor((h_q,), "f32"), f"{operands=}"
    assert results == [tensor((b, S_Q, h_q, D), "bf16"), tensor((b, h_q, S_Q), "f32"),
                       tensor((cap, b, S_Q, h_q, D), "f32"), tensor((cap, b, h_q, S_Q), "f32")], f"{results=}"
    for attribute in ("window_left = 16 : i32", "window_right = 0 : i32", "softcap = 5.000000e+00 : f32",
                      f"has_page_table = {'true' if paged else 'false'}", "num_splits = 0 : i32"):
        assert attribute in line, f"{attribute=}"
    assert [a.shape for a in exported.out_avals] == [(N, B, S_Q, H_Q, D), (N, B, H_Q, S_Q)]


def test_varlen_vmap_is_one_custom_call():
    base = vl_specs(seqused=True, sinks=jnp.float32)
    in_axes = (0, 0, 0, 0, 0, 0, None)
    args = [batched_spec(s, a) for s, a in zip(base, in_axes)]
    f = lambda *a: vl_bind(*a, max_seqlen_q=64)  # noqa: E731
    exported, text = export_text(jax.vmap(f, in_axes=in_axes), args, ["cuda"])
    assert custom_calls(text) == [VL_TARGET], f"{custom_calls(text)=}"
    assert "stablehlo.while" not in text, "vmap must not loop"
    line = call_line(text, VL_TARGET)
    operands, results = signature(line)
    # One packed call: N * (b + 1) sequences (each slice's plus a keyless gap sequence).
    nseq = N * (VB + 1)
    assert operands == [
        tensor((N * TOTAL_Q, VH_Q, VD), "bf16"), tensor((N * TOTAL_K, VH_K, VD), "bf16"),
        tensor((N * TOTAL_K, VH_K, VD), "bf16"), tensor((nseq + 1,), "i32"), tensor((nseq + 1,), "i32"),
        tensor((nseq,), "i32"), tensor((VH_Q,), "f32"),
    ], f"{operands=}"
    assert results == [tensor((N * TOTAL_Q, VH_Q, VD), "bf16"), tensor((VH_Q, N * TOTAL_Q), "f32")], f"{results=}"
    # The gap sequences may be longer than the hint: the folded call bounds rows by the packed total.
    assert f"max_seqlen_q = {N * TOTAL_Q} : i32" in line, line
    assert [a.shape for a in exported.out_avals] == [(N, TOTAL_Q, VH_Q, VD), (N, VH_Q, TOTAL_Q)]


# -- vmap: numerics through the reference ---------------------------------------------------------

NB, NS_Q, NH_Q, NH_K, ND = 3, 3, 4, 2, 32
N_CAP = 20  # contiguous capacity
N_PAGE, N_POOL, N_MAXP = 8, 7, 3  # page size, pages in the pool, pages per sequence (capacity 24)
TOL = dict(rtol=1e-5, atol=1e-5)


def _slice(x, axis, i):
    return x if axis is None else np.take(x, i, axis=axis)


def _place(stacked, axis):
    """A (N, ...) stack with its slice axis moved to `axis`; None keeps slice 0 only (unmapped)."""
    return stacked[0] if axis is None else np.moveaxis(stacked, 0, axis)


def _kv_slices(seed, paged, with_sinks):
    """N independent sets of (q, k, v, seqlens[, page_table][, sinks]) in float32, each with a
    sequence that sees nothing (seqlens 0) and one at full capacity."""
    rng = np.random.default_rng(seed)
    cap = N_PAGE * N_MAXP if paged else N_CAP
    out = []
    for _ in range(N):
        q = rng.standard_normal((NB, NS_Q, NH_Q, ND), dtype=np.float32)
        lead = (N_POOL, N_PAGE) if paged else (NB, N_CAP)
        k, v = (rng.standard_normal((*lead, NH_K, ND), dtype=np.float32) for _ in range(2))
        lens = rng.permutation(np.array([0, cap, rng.integers(1, cap)], np.int32))
        xs = [q, k, v, lens]
        if paged:
            # Distinct page ids but 9 slots in a pool of 7: sequences share pages, as attention may.
            xs.append(rng.integers(0, N_POOL, (NB, N_MAXP)).astype(np.int32))
        if with_sinks:
            xs.append((2 * rng.standard_normal(NH_Q)).astype(np.float32))
        out.append(xs)
    return [np.stack(parts) for parts in zip(*out)]


KV_VMAP_CASES = {
    # (paged, sinks, in_axes over (q, k, v, seqlens[, page_table][, sinks]))
    "a_q_only": (False, False, (0, None, None, None)),
    "a_q_inner_axis_shared_sinks": (False, True, (2, None, None, None, None)),
    "a_q_and_sinks_paged": (True, True, (0, None, None, None, None, 0)),
    "a_sinks_only": (False, True, (None, None, None, None, 0)),
    "b_all_contiguous": (False, False, (0, 0, 0, 0)),
    "b_all_contiguous_shared_sinks": (False, True, (0, 1, 1, 0, None)),
    "b_cache_only": (False, False, (None, 0, 0, None)),
    "b_seqlens_only": (False, True, (None, None, None, 0, None)),
    "b_paged_mapped_pool_and_table": (True, True, (0, 0, 0, 0, 0, None)),
    "b_paged_mapped_pool_shared_table": (True, False, (0, 0, 0, 0, None)),
    "b_paged_shared_pool_mapped_table": (True, False, (0, None, None, 0, 0)),
    "c_sinks_and_cache": (False, True, (0, 0, 0, 0, 0)),
    "c_sinks_and_paged_pool": (True, True, (0, 0, 0, 0, 0, 0)),
    "c_sinks_and_page_table": (True, True, (None, None, None, None, 1, 0)),
}


@pytest.mark.parametrize("case", sorted(KV_VMAP_CASES))
def test_kvcache_vmap_matches_slices(case):
    paged, with_sinks, in_axes = KV_VMAP_CASES[case]
    stacks = _kv_slices(len(case), paged, with_sinks)
    args = [_place(s, a) for s, a in zip(stacks, in_axes)]
    opts = dict(softmax_scale=0.3, window_left=9, window_right=0, softcap=4.0, implementation="xla")

    def f(*a):
        return kv_bind(*a[:4], a[4] if paged else None, a[-1] if with_sinks else None, **opts)

    # The rule the case is named after: (a) one bind with the slices in the query heads and the cache
    # as is, (b) one bind with the slices in the batch, (c) a sequential map.
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args)
    binds = [e for e in jaxpr.eqns if e.primitive is fa4_kvcache_p]
    if case.startswith("a_"):
        assert len(binds) == 1, jaxpr
        assert binds[0].invars[0].aval.shape == (NB, NS_Q, N * NH_Q, ND)
        assert binds[0].invars[1].aval.shape == stacks[1].shape[1:], "the cache must not be broadcast"
    elif case.startswith("b_"):
        assert len(binds) == 1, jaxpr
        assert binds[0].invars[0].aval.shape == (N * NB, NS_Q, NH_Q, ND)
    else:
        assert binds == [] and "scan" in str(jaxpr), jaxpr

    o, lse = jax.vmap(f, in_axes=in_axes)(*args)
    assert (o.shape, lse.shape) == ((N, NB, NS_Q, NH_Q, ND), (N, NB, NH_Q, NS_Q)), f"{o.shape=} {lse.shape=}"
    for i in range(N):
        o_i, lse_i = f(*(_slice(x, a, i) for x, a in zip(args, in_axes)))
        np.testing.assert_allclose(f32(o[i]), f32(o_i), **TOL, err_msg=f"o, slice {i}")
        np.testing.assert_allclose(f32(lse[i]), f32(lse_i), **TOL, err_msg=f"lse, slice {i}")
    # The inputs must exercise the contract: seqlens 0 gives empty rows, other rows see keys.
    assert np.isneginf(f32(lse)).any() or with_sinks
    assert np.isfinite(f32(lse)).any()


def test_kvcache_vmap_public_api_matches_slices():
    # attention_with_kvcache under vmap (bf16, the public dtypes), q only mapped: the slices fold
    # into the query heads, whose GQA grouping must survive.
    rng = np.random.default_rng(5)
    q = rng.standard_normal((N, NB, 2, 8, 64), dtype=np.float32).astype(jnp.bfloat16)
    k, v = (rng.standard_normal((NB, 40, 2, 64), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2))
    lens = np.array([0, 40, 17], np.int32)
    sinks = (2 * rng.standard_normal((N, 8))).astype(np.float32)
    f = lambda q, s: attention_with_kvcache(q, k, v, lens, causal=True, window_size=(6, -1), sinks=s,  # noqa: E731
                                            return_lse=True, implementation="xla")
    o, lse = jax.vmap(f)(q, sinks)
    for i in range(N):
        o_i, lse_i = f(q[i], sinks[i])
        np.testing.assert_allclose(f32(o[i]), f32(o_i), rtol=2.0**-7, atol=1e-5, err_msg=f"slice {i}")
        np.testing.assert_allclose(f32(lse[i]), f32(lse_i), rtol=0, atol=1e-4, err_msg=f"slice {i}")


# Per slice: cu_seqlens_q / cu_seqlens_k with an empty query sequence, a keyless sequence and rows /
# keys past the last offsets (owned by no sequence: o = 0 there).
VL_TOTAL_Q, VL_TOTAL_K = 24, 30
VL_CU_Q = np.array([[0, 5, 5, 12], [0, 2, 9, 20], [0, 8, 10, 10]], np.int32)
VL_CU_K = np.array([[0, 7, 9, 16], [0, 3, 12, 25], [0, 10, 10, 14]], np.int32)
VL_USED = np.array([[7, 1, 5], [2, 9, 13], [4, 0, 4]], np.int32)


def _vl_slices(seed, seqused, with_sinks):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((N, VL_TOTAL_Q, NH_Q, ND), dtype=np.float32)
    k, v = (rng.standard_normal((N, VL_TOTAL_K, NH_K, ND), dtype=np.float32) for _ in range(2))
    xs = [q, k, v, VL_CU_Q, VL_CU_K]
    if seqused:
        xs.append(VL_USED)
    if with_sinks:
        xs.append((2 * rng.standard_normal((N, NH_Q))).astype(np.float32))
    return xs


VL_VMAP_CASES = {
    # (seqused, sinks, in_axes over (q, k, v, cu_q, cu_k[, seqused_k][, sinks]))
    "all_mapped": (False, False, (0, 0, 0, 0, 0)),
    "all_mapped_seqused_shared_sinks": (True, True, (0, 0, 0, 0, 0, 0, None)),
    "shared_offsets": (False, True, (1, 0, 0, None, None, None)),
    "q_only": (True, False, (0, None, None, None, None, None)),
    "sinks_mapped": (False, True, (0, 0, 0, 0, 0, 0)),
    "sinks_mapped_seqused": (True, True, (0, 0, 0, 0, 0, 0, 0)),
    "sinks_and_q_mapped": (False, True, (0, None, None, None, None, 0)),
}


@pytest.mark.parametrize("case", sorted(VL_VMAP_CASES))
def test_varlen_vmap_matches_slices(case):
    seqused, with_sinks, in_axes = VL_VMAP_CASES[case]
    args = [_place(s, a) for s, a in zip(_vl_slices(len(case), seqused, with_sinks), in_axes)]
    opts = dict(softmax_scale=0.3, window_left=6, window_right=0, softcap=4.0, implementation="xla")

    def f(*a):
        return vl_bind(*a[:5], a[5] if seqused else None, a[-1] if with_sinks else None, max_seqlen_q=11, **opts)

    # One packed bind, or a sequential map when the sinks are per slice.
    jaxpr = jax.make_jaxpr(jax.vmap(f, in_axes=in_axes))(*args)
    binds = [e for e in jaxpr.eqns if e.primitive is fa4_varlen_p]
    if case.startswith("sinks"):
        assert binds == [] and "scan" in str(jaxpr), jaxpr
    else:
        assert len(binds) == 1, jaxpr
        assert binds[0].invars[0].aval.shape == (N * VL_TOTAL_Q, NH_Q, ND)
        assert binds[0].invars[3].aval.shape == (N * (NB + 1) + 1,)

    o, lse = jax.vmap(f, in_axes=in_axes)(*args)
    assert (o.shape, lse.shape) == ((N, VL_TOTAL_Q, NH_Q, ND), (N, NH_Q, VL_TOTAL_Q)), f"{o.shape=} {lse.shape=}"
    for i in range(N):
        sliced = [_slice(x, a, i) for x, a in zip(args, in_axes)]
        o_i, lse_i = f(*sliced)
        np.testing.assert_allclose(f32(o[i]), f32(o_i), **TOL, err_msg=f"o, slice {i}")
        np.testing.assert_allclose(f32(lse[i]), f32(lse_i), **TOL, err_msg=f"lse, slice {i}")
        # Rows past cu_seqlens_q[-1] belong to no sequence: o = 0, and they see no key.
        end = int(sliced[3][-1])
        assert end < VL_TOTAL_Q
        assert np.all(f32(o[i, end:]) == 0.0), f"slice {i}: rows past cu_seqlens_q[-1] must give o = 0"
        want = sliced[-1][:, None] if with_sinks else -np.inf
        np.testing.assert_array_equal(f32(lse[i][:, end:]), np.broadcast_to(want, (NH_Q, VL_TOTAL_Q - end)),
                                      err_msg=f"slice {i}: rows past cu_seqlens_q[-1]")
        assert np.abs(f32(o[i, :end])).max() > 0.1


# -- inference only ---------------------------------------------------------------------------------

def _kv_public_inputs():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 4, 64), dtype=np.float32).astype(jnp.bfloat16)
    k, v = (rng.standard_normal((2, 16, 2, 64), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2))
    return q, k, v, np.array([5, 16], np.int32)


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("wrt", [0, 1])
def test_grad_through_kvcache_raises(implementation, wrt):
    q, k, v, lens = _kv_public_inputs()

    def loss(q, k):
        o = attention_with_kvcache(q, k, v, lens, causal=True, implementation=implementation)
        return o.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(loss, argnums=wrt)(q, k)
    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(jax.jit(loss), argnums=wrt)(q, k)


def test_jvp_through_kvcache_raises():
    q, k, v, lens = _kv_public_inputs()
    f = lambda q: attention_with_kvcache(q, k, v, lens, implementation="xla")  # noqa: E731
    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.jvp(f, (q,), (jnp.ones_like(q),))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_grad_through_varlen_raises(implementation, wrt):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((12, 4, 64), dtype=np.float32).astype(jnp.bfloat16)
    k, v = (rng.standard_normal((15, 2, 64), dtype=np.float32).astype(jnp.bfloat16) for _ in range(2))
    cu_q, cu_k = np.array([0, 4, 10], np.int32), np.array([0, 6, 15], np.int32)

    def loss(q, k, v):
        o = attention_varlen(q, k, v, cu_q, cu_k, causal=True, implementation=implementation)
        return o.astype(jnp.float32).sum()

    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(loss, argnums=wrt)(q, k, v)
    with pytest.raises(NotImplementedError, match="inference-only"):
        jax.grad(jax.jit(loss), argnums=wrt)(q, k, v)


# -- abstract evaluation: a direct bind is checked like the API call -------------------------------

_BAD_BINDS = {
    "kv_lens": (lambda: kv_bind(*kv_specs()[:3], jax.ShapeDtypeStruct((B + 1,), jnp.int32)),
                ValueError, r"cache_seqlens must have shape \(2,\) \(batch,\)"),
    "kv_sinks": (lambda: kv_bind(*kv_specs(), sinks=jax.ShapeDtypeStruct((H_Q + 1,), jnp.float32)),
                 ValueError, r"sinks must have shape \(heads_q,\)"),
    "kv_table": (lambda: kv_bind(*kv_specs(paged=True)[:4], jax.ShapeDtypeStruct((B + 1, MAX_PAGES), jnp.int32)),
                 ValueError, r"page_table"),
    "kv_count": (lambda: fa4_kvcache_p.bind(*kv_specs()[:3], softmax_scale=0.1, window_left=-1, window_right=-1,
                                            softcap=0.0, has_sinks=False, paged=False, ragged=False, kv_fp8=False,
                                            max_seqlen_q=0, tile_m=64, page_rows=16, num_splits=0,
                                            implementation="xla"),
                 ValueError, r"fa4_kvcache takes 4 operands with these params"),
    "varlen_offsets": (lambda: vl_bind(jax.ShapeDtypeStruct((10, 4, 64), jnp.bfloat16),
                                           *[jax.ShapeDtypeStruct((12, 2, 64), jnp.bfloat16)] * 2,
                                      jax.ShapeDtypeStruct((3,), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)),
                       ValueError, r"cu_seqlens_k must have shape \(3,\) \(batch \+ 1,\)"),
    "varlen_seqused": (lambda: vl_bind(jax.ShapeDtypeStruct((10, 4, 64), jnp.bfloat16),
                                           *[jax.ShapeDtypeStruct((12, 2, 64), jnp.bfloat16)] * 2,
                                           *[jax.ShapeDtypeStruct((3,), jnp.int32)] * 2,
                                           seqused_k=jax.ShapeDtypeStruct((3,), jnp.int32)),
                       ValueError, r"seqused_k must have shape \(2,\) \(batch,\)"),
}


@pytest.mark.parametrize("case", sorted(_BAD_BINDS))
def test_direct_bind_checks_shapes(case):
    """Every primitive's abstract evaluation checks its operands against its params and their shapes
    the way the public function does (the dense one: tests/test_primitive.py)."""
    fn, error, message = _BAD_BINDS[case]
    with pytest.raises(error, match=message):
        jax.eval_shape(fn)
