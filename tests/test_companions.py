"""Companion kernels (families.base.Companion): the KV-cache family's split combine is compiled once
per (arch, dtype, head_dim) and launched by the generated Variant row after the attention kernel,
instead of being compiled into each of the family's variants (BUILD.md "Build time"). CPU only."""

from __future__ import annotations

import re

from fa4_jax.aot import codegen
from fa4_jax.families import FAMILIES, KVCACHE, default_menu, description_of, family_of, objects_of
from fa4_jax.families import variant_from_symbol
from fa4_jax.ops.kvcache.spec import COMBINE, CombineVariant, KVCacheVariant


def test_the_menu_compiles_one_combine_per_arch_dtype_and_head_dim():
    menu = default_menu()
    objects = objects_of(menu)
    assert objects[:len(menu)] == list(menu)
    companions = objects[len(menu):]
    kv = [v for v in menu if isinstance(v, KVCacheVariant)]
    want = {(v.arch, v.dtype, v.head_dim) for v in kv}
    assert len(want) == 20  # 2 arches x 2 dtypes x 5 head dims
    assert sorted((c.arch, c.dtype, c.head_dim) for c in companions) == sorted(want)
    assert [c.symbol for c in companions] == sorted(c.symbol for c in companions)
    for c in companions:
        assert isinstance(c, CombineVariant) and description_of(c) is COMBINE
        assert variant_from_symbol(c.symbol) == c
    # Families without companions add nothing; a narrowed menu brings only its own combines.
    assert objects_of([v for v in menu if not isinstance(v, KVCacheVariant)]) == [
        v for v in menu if not isinstance(v, KVCacheVariant)]
    one = KVCacheVariant("sm90", "fp16", 96, "local", True, paged=True)
    assert objects_of([one]) == [one, CombineVariant("sm90", "fp16", 96)]
    assert description_of(one) is KVCACHE is family_of(one)


def test_the_combine_reads_the_attention_kernels_own_tensors():
    """The combine's wrapper arguments are the KV-cache family's TensorArgs of the same names: it reads
    the workspace and writes o / lse exactly where the attention kernel's arguments put them."""
    by_name = {t.name: t for t in KVCACHE.tensors}
    assert [t.name for t in COMBINE.tensors] == ["mOaccum", "mLSEaccum", "mO", "mLSE", "mSinks"]
    for t in COMBINE.tensors:
        assert t == by_name[t.name]
    assert [s.name for s in COMBINE.scalars] == ["num_splits"]
    # Only when the splits were not merged by their last CTA (ffi/kvcache.cc leaves the counters null).
    assert COMBINE.when == "p.num_splits > 1 && p.semaphores == nullptr"
    for fam in FAMILIES:
        assert fam.companions == ((COMBINE,) if fam is KVCACHE else ())


def test_generated_rows_launch_and_load_their_combine():
    menu = sorted((v for v in KVCACHE.default_menu() if v.head_dim in (64, 128)), key=lambda v: v.symbol)
    inc = codegen.generate_family_inc(KVCACHE, menu, "test")
    combines = sorted({COMBINE.of(v) for v in menu}, key=lambda c: c.symbol)
    assert len(combines) == 8
    for c in combines:
        s = c.symbol
        assert inc.count(f'#include "{s}.h"') == 1
        assert inc.count(f"static int32_t {s}_launch(void *state, const Params &p) {{") == 1
        # Its wrapper gets the combine's tensors only, then num_splits and the stream.
        assert (f"return cute_dsl_{s}_wrapper(static_cast<{s}_Kernel_Module_t *>(state), &mOaccum, &mLSEaccum, "
                f"&mO, &mLSE, &mSinks, p.num_splits, p.stream);") in inc
        assert f'static const ::fa4_jax::VariantInfo {s}_info{{"{s}", &{s}_module}};' in inc
    for i, v in enumerate(menu):
        c = COMBINE.of(v).symbol
        assert re.search(rf'\{{"{v.symbol}", \{{[^}}]*\}}, &{v.symbol}_launch, &{v.symbol}_module, \d, (?:true|false), '
                         rf'&kVariantInfos\[{i}\], "{c}", &{c}_launch, &{c}_module\}},', inc), v.symbol
        assert f"static const ::fa4_jax::VariantInfo *const {v.symbol}_companions[] = {{&{c}_info}};" in inc
        assert f'{{"{v.symbol}", &{v.symbol}_module, {v.symbol}_companions, 1}},' in inc
    # The row's launch: the attention kernel, then the combine when its condition holds.
    # (`failed` names the wrapper being called, for the launch error's text: CheckedLaunch.)
    launch = inc[inc.index("  int32_t launch(const Params &p, const char **failed) const {"):]
    launch = launch[:launch.index("\n  }\n")]
    assert launch.splitlines()[1:] == [
        "    *failed = symbol;",
        "    if (const int32_t ret = launch_fn(module->state, p); ret != 0) return ret;",
        "    if (p.num_splits > 1 && p.semaphores == nullptr) {",
        "      *failed = combine_symbol;",
        "      if (const int32_t ret = combine_fn(combine_module->state, p); ret != 0) return ret;",
        "    }",
        "    return 0;",
    ]


def test_families_without_companions_launch_their_kernel_alone():
    for fam in FAMILIES:
        if fam.companions:
            continue
        menu = list(fam.default_menu())[:2]
        inc = codegen.generate_family_inc(fam, menu, "test")
        assert "_companions[]" not in inc and "combine" not in inc, fam.name
        for v in menu:
            assert f'{{"{v.symbol}", &{v.symbol}_module}},' in inc
