"""For every registered kernel family, the Python FFI call (fa4_jax.core.ffi_call, as jax lowers it for
CUDA) and the generated C++ binding (fa4_jax.aot.codegen, what the handler's XLA binding decodes) agree:
operand order, ranks and dtypes, results, attribute names and types. Both come from the family's
CallSignature; this checks that neither side drifts from it (no GPU, no cutlass needed).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import pytest

from fa4_jax.aot import codegen
from fa4_jax.core.ffi_call import kernel_call
from fa4_jax.families import FAMILIES

# A size for every dim name the families use (distinct, so a swapped dim shows). "b1" is b + 1.
SIZES = dict(b=2, b1=3, qb=1, s_q=3, s_k=5, h_q=4, h_k=2, d=64, kv_rows=6, kv_len=16, max_pages=3, total_q=7, total_k=9,
             splits=2, n_tile_entries=8)
MLIR_DTYPES = {"input": "bf16", "cache": "bf16", "f32": "f32", "i32": "i32"}
ATTR_VALUES = {"f32": 0.5, "i32": 1, "bool": True}


def _cases():
    for fam in FAMILIES:
        optional = [b.name for b in fam.call.operands if b.optional or b.fill is not None]
        for present in itertools.product((False, True), repeat=len(optional)):
            yield pytest.param(fam, dict(zip(optional, present)),
                               id=f"{fam.name}-" + "-".join(f"{n}={int(p)}" for n, p in zip(optional, present)))


def _spec(buffer):
    dtype = jnp.bfloat16 if buffer.dtype in ("input", "cache") else {"f32": jnp.float32, "i32": jnp.int32}[buffer.dtype]
    return jax.ShapeDtypeStruct(tuple(SIZES[d] for d in buffer.dims), dtype)


def _python_call(family, present: dict) -> str:
    """The custom call jax emits for the family's kernel_call, as MLIR text (one line)."""
    given = [b for b in family.call.operands if present.get(b.name, True)]

    def f(*arrays):
        named = {b.name: x for b, x in zip(given, arrays)}
        attrs = {a.name: ATTR_VALUES[a.dtype] for a in family.call.attrs}
        return kernel_call(family, named, attrs, dims=dict(SIZES))

    text = jax.jit(f).trace(*[_spec(b) for b in given]).lower(lowering_platforms=("cuda",)).as_text()
    (line,) = [ln for ln in text.splitlines() if f"custom_call @{family.target}" in ln]
    return line


def _mlir_types(text: str) -> list[tuple[int, str]]:
    """(rank, element type) of each `tensor<AxBx...xT>` in order."""
    return [(len(m.split("x")) - 1, m.split("x")[-1]) for m in re.findall(r"tensor<([^>]*)>", text)]


def _cpp_binding(family) -> tuple[list, list, list]:
    """From the generated fa4_<family>.inc: the binding's operands and results (name, rank, dtype, as the
    Call struct documents each binding slot) and attributes (name, C++ type), in binding order."""
    menu = [v for v in family.default_menu()][:1]
    inc = codegen.generate_family_inc(family, menu, "test")
    binding = inc[inc.index("auto Binding() {"):]
    binding = binding[:binding.index("}")]
    args = re.findall(r"\.template Arg<ffi::AnyBuffer>\(\)  // (\w+)", binding)
    rets = re.findall(r"\.template Ret<ffi::AnyBuffer>\(\)  // (\w+)", binding)
    attrs = re.findall(r'\.template Attr<(\w+)>\("(\w+)"\)', binding)
    call = inc[inc.index("struct Call {"):]
    slots = dict(re.findall(r"(\w+);  // (?:operand|result) (\([^)]*\) \w+)", call[:call.index("};")]))

    def described(name):
        dims, dtype = slots[name].rsplit(" ", 1)
        return name, len([d for d in dims.strip("(,)").split(",") if d.strip()]), dtype

    return [described(n) for n in args], [described(n) for n in rets], [(n, t) for t, n in attrs]


@pytest.mark.parametrize("family,present", list(_cases()))
def test_python_call_matches_generated_binding(family, present):
    line = _python_call(family, present)
    cpp_args, cpp_rets, cpp_attrs = _cpp_binding(family)

    signature = line[line.rindex(": (") + 3:]
    operand_text, result_text = signature.split(") -> ")
    py_args, py_rets = _mlir_types(operand_text), _mlir_types(result_text)
    assert len(py_args) == len(cpp_args), f"operand count: python {py_args} vs C++ {cpp_args}"
    for (rank, elt), (name, cpp_rank, dtype) in zip(py_args, cpp_args):
        assert elt == MLIR_DTYPES[dtype], f"operand {name}: python {elt}, C++ {dtype}"
        absent = not present.get(name, True) and any(b.name == name and b.optional for b in family.call.operands)
        assert rank == cpp_rank, f"operand {name}: python rank {rank}, C++ rank {cpp_rank} (absent={absent})"
    assert [(r, e) for r, e in py_rets] == [(rank, MLIR_DTYPES[dt]) for _, rank, dt in cpp_rets], \
        f"results: python {py_rets} vs C++ {cpp_rets}"

    config = line[line.index("backend_config = {") + len("backend_config = {"):]
    config = config[:config.index("}")]
    py_attrs = {}
    for name, value in re.findall(r"(\w+) = ([^,]+)", config):
        py_attrs[name] = value.split(" : ")[1].strip() if " : " in value else "bool"
    cpp_types = {"float": "f32", "int32_t": "i32", "bool": "bool"}
    assert py_attrs == {n: cpp_types[t] for n, t in cpp_attrs}, f"attributes: python {py_attrs} vs C++ {cpp_attrs}"
    # Presence attributes say exactly which optional operands were given.
    for b in family.call.operands:
        if b.optional:
            flag = re.search(rf"has_{b.name} = (true|false)", config).group(1)
            assert flag == ("true" if present[b.name] else "false"), config


def test_every_family_declares_its_call():
    for fam in FAMILIES:
        names = [b.name for b in (*fam.call.operands, *fam.call.results)]
        assert names[0] == "q" and fam.call.operands[0].dtype == "input", f"{fam.name}: q first (its dtype rules)"
        assert any(not b.workspace for b in fam.call.results), fam.name


def test_generated_constants_match_the_family():
    """The constants the handler reads are the Python values (no copy to keep in sync)."""
    for fam in FAMILIES:
        inc = codegen.generate_family_inc(fam, list(fam.default_menu())[:1], "test")
        for name, value in fam.call.constants:
            text = "{" + ", ".join(map(str, value)) + "}" if isinstance(value, tuple) else str(value)
            decl = f"inline constexpr int64_t k{codegen.camel(name)}{'[]' if isinstance(value, tuple) else ''} = {text};"
            assert decl in inc, (fam.name, name, decl)
    shared = codegen.generate_shared_inc("test")
    from fa4_jax.core.validation import MAX_SOFTCAP, MAX_SOFTMAX_SCALE

    assert f"kMaxSoftmaxScale = {MAX_SOFTMAX_SCALE!r};" in shared and f"kMaxSoftcap = {MAX_SOFTCAP!r};" in shared


def test_generated_variant_table_carries_each_kernels_residency():
    """The handler's split count reads `ctas_per_sm`, and its choice of a tile handout `tile_handout`,
    from the generated table: the kernel config's values (kernels/config.py) for every KV-cache variant,
    1 and false where a family does not say."""
    from fa4_jax.ops.kvcache.spec import KVCacheVariant, ctas_per_sm, tile_handout

    handouts = set()
    for fam in FAMILIES:
        menu = list(fam.default_menu())
        inc = codegen.generate_family_inc(fam, menu, "test")
        for v in menu:
            want = fam.ctas_per_sm(v) if fam.ctas_per_sm else 1
            handout = bool(fam.tile_handout and fam.tile_handout(v))
            if handout:
                handouts.add(v)
            assert re.search(rf'\{{"{v.symbol}", .*&{v.symbol}_module, {want}, {str(handout).lower()}, '
                             rf'&kVariantInfos\[', inc), v.symbol
    fp8 = KVCacheVariant("sm90", "bf16", 128, "local", False, kv_fp8=True)
    assert ctas_per_sm(fp8) == 2 and ctas_per_sm(KVCacheVariant("sm100", "bf16", 128, "local", False)) == 1
    # The handout: the 16-bit SM90 chunk tile (contiguous, or paged in 16-row pieces), nothing else.
    assert handouts and all(v.arch == "sm90" and v.tile_m == 128 and not v.kv_fp8 and v.page_rows == 16
                            for v in handouts)
    assert tile_handout(KVCacheVariant("sm90", "bf16", 128, "local", False, paged=True, tile_m=128))
    for other in (KVCacheVariant("sm90", "bf16", 128, "local", False, tile_m=64),
                  KVCacheVariant("sm90", "bf16", 128, "local", False, paged=True, tile_m=128, page_rows=1),
                  KVCacheVariant("sm90", "bf16", 128, "local", False, tile_m=128, kv_fp8=True),
                  KVCacheVariant("sm100", "bf16", 128, "local", False, tile_m=128)):
        assert not tile_handout(other), other


def test_unvalidated_arches_need_the_calls_opt_in():
    """families.VALIDATED_ARCHES reaches the handlers as IsValidatedArch, and every family's stage
    refuses a variant of another arch unless the call's generated unvalidated_ok attribute is set (the
    lowering sets it for implementation="fa4" only: tests/test_export.py, tests/test_primitive.py)."""
    from fa4_jax.families import ARCH_CC, VALIDATED_ARCHES
    from fa4_jax.families.base import OPT_IN_ATTR

    shared = codegen.generate_shared_inc("test")
    ccs = sorted(ARCH_CC[a] for a in VALIDATED_ARCHES)
    assert ccs == [90]
    assert "inline constexpr bool IsValidatedArch(int cc) { return cc == 90; }" in shared
    for fam in FAMILIES:
        assert fam.call.all_attrs[-1] == OPT_IN_ATTR, fam.name
        inc = codegen.generate_family_inc(fam, list(fam.default_menu())[:1], "test")
        assert "  if (!unvalidated_ok && !IsValidatedArch(r.variant->key.arch))\n" \
               "    return NotValidated(kTarget, r.variant->symbol, r.device);" in inc, fam.name
        assert '.template Attr<bool>("unvalidated_ok");' in inc, fam.name
