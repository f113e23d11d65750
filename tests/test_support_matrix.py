"""The support matrix (fa4_jax/support.py): README.md holds the generated tables, the tables say exactly
what the cells say, the accepted inputs are the API's, and sampled cells agree with the library's own
decisions: our FFI call is in a program exported for CUDA from this CPU host (with a library holding
exactly the default menu) iff the matrix says "kernel", and fa4_jax.core.cudnn.cudnn_reason accepts the
primitive the public call binds iff the matrix says "cuDNN"."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from fa4_jax import families, support
from fa4_jax.core import cudnn, platform as _platform, validation as _validation
from fa4_jax.export import export_safety_checks, ffi_targets
from fa4_jax.ops.kvcache.spec import PAGE_ROWS_CHOICES, page_rows_for

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CELLS = support.support_matrix()
DEVICES = {d.key: d for d in support.DEVICES}
ENTRIES = {e.name: e for e in support.ENTRY_POINTS}


def find(**want) -> list[dict]:
    return [c for c in CELLS if all(c[k] == v for k, v in want.items())]


def test_readme_tables_are_the_generated_ones():
    text = README.read_text()
    assert support.render_into(text) == text, "README.md's support matrix is stale: python -m fa4_jax.support --write"
    assert text.count(support.BEGIN_MARKER) == text.count(support.END_MARKER) == 1


def test_cli_check_fails_on_a_stale_copy_and_write_fixes_it(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{support.BEGIN_MARKER}\n| old |\n{support.END_MARKER}\noutro\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "fa4_jax.support", *args, "--readme", str(stale)],
                                       capture_output=True, text=True, cwd=ROOT)
    assert run("--check").returncode == 1
    assert run("--write").returncode == 0
    assert run("--check").returncode == 0
    assert stale.read_text() == (f"intro\n{support.BEGIN_MARKER}\n{support.support_matrix_markdown()}"
                                 f"{support.END_MARKER}\noutro\n")


def test_importing_needs_no_jax_and_building_no_cutlass():
    # Without fa4_jax/__init__ (which imports jax): the module alone imports families and the stdlib.
    bare = ("import sys, types; pkg = types.ModuleType('fa4_jax'); pkg.__path__ = ['fa4_jax']; "
            "sys.modules['fa4_jax'] = pkg; import fa4_jax.support; "
            "bad = [m for m in ('jax', 'numpy', 'cutlass') if m in sys.modules]; assert not bad, bad")
    built = ("import sys, fa4_jax.support as s; s.support_matrix_markdown(); "
             "assert 'cutlass' not in sys.modules")
    for code in (bare, built):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_accepted_inputs_are_the_apis():
    assert tuple(_validation.dtype_tag(d) for d in _validation.KERNEL_DTYPES) == families.DTYPES
    assert {c["head_dim"] for c in CELLS} == set(families.HEAD_DIMS)  # what _validation accepts
    # Any page size >= 1 is accepted: the matrix lists the tested ones, both kinds of page pieces.
    assert {c["page_size"] for c in CELLS} == {None, *support.PAGE_SIZES}
    assert {page_rows_for(p) for p in support.PAGE_SIZES} == set(PAGE_ROWS_CHOICES)
    assert {e.cudnn_entry for e in support.ENTRY_POINTS} == set(cudnn.ENTRIES)


def test_every_menu_variant_appears_and_only_where_it_was_built():
    # implementation=None runs the validated architectures' kernels; the others are opt-in (test_opt_in_cells).
    # FP8-cache variants are not cells (the matrix's inputs are 16-bit; README's FP8 paragraph lists them).
    # The dense short-problem tiles (tile_m != 0) are the handler's choice by sequence length, not a cell:
    # their cell names the default tile, which the library also has.
    menu = families.default_menu()
    short = [v for v in menu if isinstance(v, families.FwdVariant) and v.tile_m]
    assert short and all(dataclasses.replace(v, tile_m=0) in menu for v in short)
    validated = {v.symbol for v in menu
                 if v.arch in families.VALIDATED_ARCHES and not getattr(v, "kv_fp8", False) and v not in short}
    assert {c["variant"] for c in CELLS if c["runs"] == support.KERNEL} == validated
    assert all((c["runs"] == support.KERNEL) == (c["variant"] is not None) for c in CELLS)
    shipped = set(support.shipped_arches())
    assert all(c["device"] in shipped for c in CELLS if c["runs"] == support.KERNEL)
    assert all(c["runs"] == support.REFERENCE for c in find(device="cpu"))


def test_every_head_dim_has_a_kernel_in_every_entry_point():
    """Hopper runs our kernel for every cell (every entry point, head dim, dtype, page size and
    feature), so the table marks no Hopper cell "no kernel" (only SM100's, where a family has no
    Blackwell kernel yet)."""
    sm90 = find(device="sm90")
    assert {c["head_dim"] for c in sm90} == {64, 96, 128, 192, 256}
    assert {c["entry_point"] for c in sm90 if c["head_dim"] in (96, 192)} == {c["entry_point"] for c in sm90}
    assert [c for c in sm90 if c["runs"] != support.KERNEL] == []
    columns = ["entry point", "head_dim", "dtype", "page size", *(d.title for d in support.DEVICES)]
    flagged = {columns[i] for line in support.support_matrix_markdown().splitlines() if line.startswith("| `")
               for i, text in enumerate(line.strip("|").split(" | ")) if "**no kernel**" in text}
    assert flagged <= {d.title for d in support.DEVICES if d.key == "sm100"}, flagged


def test_rows_say_exactly_what_the_cells_say():
    rows = support.support_rows(CELLS)
    for cell in CELLS:
        (row,) = [r for r in rows if r.covers(cell)]
        assert row.predicts(cell) == cell["runs"], (row, cell)


def test_only_the_built_architectures_have_kernels():
    gpu = lambda cc, kind: SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=kind)
    for device in support.DEVICES:
        if device.capability is None:
            continue
        reason = _platform.device_unavailable_reason(gpu(device.capability, device.title))
        assert (reason is None) == (device.key in support.shipped_arches()), (device, reason)
    assert support.shipped_arches() == tuple(sorted(_platform.shipped_arches(), key=families.ARCH_CC.get))


# ---- sampled cells against the library's decisions ---------------------------------------------------

def _call(cell):
    """(function, argument specs) of a public call of the kind a cell describes, at the entry point's
    representative sequence lengths (support.EntryPoint.seqlens)."""
    entry = ENTRIES[cell["entry_point"]]
    (s_q, s_k), = [(q, k) for title, q, k in entry.seqlens if title == cell["seqlens"]]
    dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[cell["dtype"]]
    d, h_q, h_k = cell["head_dim"], 4, 2
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    opts = dict(window_size=support.WINDOWS[cell["mask"]], softcap=30.0 if cell["softcap"] else 0.0,
                return_lse=cell["return_lse"])
    sinks = (jax.ShapeDtypeStruct((h_q,), jnp.float32),) if cell["sinks"] else ()
    with_sinks = lambda f: (lambda *a: f(*a[:-1], sinks=a[-1], **opts)) if sinks else (lambda *a: f(*a, **opts))
    if entry.cudnn_entry == cudnn.ATTENTION:
        return with_sinks(fa4_jax.attention), (spec(1, s_q, h_q, d), spec(1, s_k, h_k, d), spec(1, s_k, h_k, d),
                                               *sinks)
    if entry.cudnn_entry == cudnn.VARLEN:
        f = lambda q, k, v, cu_q, cu_k, **kw: fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, **kw)
        return with_sinks(f), (spec(s_q, h_q, d), spec(s_k, h_k, d), spec(s_k, h_k, d), i32(3), i32(3), *sinks)
    q = spec(2, s_q, h_q, d)
    if cell["page_size"] is None:
        return with_sinks(fa4_jax.attention_with_kvcache), (q, spec(2, s_k, h_k, d), spec(2, s_k, h_k, d), i32(2),
                                                            *sinks)
    page = cell["page_size"]
    pages = max(1, s_k // page)
    f = lambda q, k, v, lens, table, **kw: fa4_jax.attention_with_kvcache(q, k, v, lens, page_table=table, **kw)
    return with_sinks(f), (q, spec(8, page, h_k, d), spec(8, page, h_k, d), i32(2), i32(2, pages), *sinks)


def _kernel_sample():
    """Every entry point x head_dim x dtype on each shipped architecture whose kernels are validated
    (an export without a GPU models those; opt-in arches: test_opt_in_cells), the features and page
    sizes cycling through their values."""
    picked = []
    validated = [a for a in support.shipped_arches() if a in families.VALIDATED_ARCHES]
    for arch, entry in itertools.product(validated, support.ENTRY_POINTS):
        features = itertools.cycle(itertools.product(*(v for _, v in entry.features)))
        pages = itertools.cycle(support.PAGE_SIZES)
        for hd, dtype in itertools.product(families.HEAD_DIMS, families.DTYPES):
            want = dict(zip((a for a, _ in entry.features), next(features)))
            (cell,) = find(entry_point=entry.name, device=arch, dtype=dtype, head_dim=hd,
                           page_size=next(pages) if entry.paged else None, **want)
            picked.append(cell)
    return picked


@pytest.fixture
def default_menu_library(monkeypatch):
    """A kernel library holding exactly the default menu (what the lowering asks when exporting from a
    host without GPUs: fa4_jax/core/lowering.py)."""
    menu = set(families.default_menu())
    monkeypatch.setattr(_platform, "library_reason",
                        lambda make_variant: None if make_variant("sm90") in menu else "not in the default menu")


def _our_calls(fn, args, platform):
    exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=export_safety_checks())(*args)
    return set(re.findall(r"stablehlo\.custom_call @(\w+)\(", exported.mlir_module())) & set(ffi_targets())


@pytest.mark.parametrize("cell", _kernel_sample(),
                         ids=lambda c: f"{c['device']}-{c['entry_point']}-{c['dtype']}-hd{c['head_dim']}-{c['mask']}")
def test_sampled_cells_agree_with_the_kernel_lowering(cell, default_menu_library):
    fn, args = _call(cell)
    calls = _our_calls(fn, args, "cuda")
    assert bool(calls) == (cell["runs"] == support.KERNEL), (cell, calls)


def test_opt_in_cells():
    """On an architecture the default build has kernels for that no hardware run has validated (SM100),
    implementation=None never runs a kernel, and a cell says opt-in exactly where the menu has its
    variant (implementation="fa4" would run it)."""
    menu = {v.symbol for v in families.default_menu()}
    unvalidated = [a for a in support.shipped_arches() if a not in families.VALIDATED_ARCHES]
    assert unvalidated == ["sm100"]
    cells = [c for c in support.support_matrix() if c["device"] in unvalidated]
    assert cells and all(c["runs"] != support.KERNEL and c["variant"] is None for c in cells)
    for c in cells:
        entry = support._entry(c["entry_point"])
        v = entry.variant(c["device"], c["dtype"], c["head_dim"], c["mask"], c["softcap"], c["seqlens"], c["page_size"])
        assert c["opt_in"] == (v.symbol in menu), c
    # Every entry point has SM100 kernels (issue 16), the KV-cache ones in both dtypes at every page size
    # (16-row pieces or rows: spec.PAGE_ROWS_BY_ARCH).
    assert {c["entry_point"] for c in cells if c["opt_in"]} == {e.name for e in support.ENTRY_POINTS}
    kv = [c for c in cells if c["entry_point"].startswith("attention_with_kvcache")]
    paged = [c for c in kv if c["page_size"] is not None]
    assert {c["dtype"] for c in paged} == {"bf16", "fp16"} and all(c["opt_in"] for c in paged)


def test_cpu_cells_are_the_reference(default_menu_library):
    (cell,) = find(entry_point="attention", device="cpu", dtype="bf16", head_dim=128, mask="causal",
                   seqlens="seqlen_q == seqlen_k", softcap=False, sinks=False, return_lse=False)
    assert cell["runs"] == support.REFERENCE
    fn, args = _call(cell)
    assert not _our_calls(fn, args, "cpu")


def _cudnn_sample():
    """Every entry point x mask x sequence lengths x (softcap, sinks) on each GPU without kernels, at
    one head_dim that every GPU's cuDNN takes and one that pre-Hopper cuDNN does not."""
    picked = []
    for device in support.DEVICES:
        if device.capability is None or device.key in support.shipped_arches():
            continue
        for entry in support.ENTRY_POINTS:
            for mask, seqlens, (softcap, sinks), hd in itertools.product(
                    support.WINDOWS, [t for t, _, _ in entry.seqlens], [(False, False), (True, False), (False, True)],
                    (128, 192)):
                (cell,) = find(entry_point=entry.name, device=device.key, dtype="fp16" if hd == 192 else "bf16",
                               head_dim=hd, page_size=64 if entry.paged else None, mask=mask, seqlens=seqlens,
                               softcap=softcap, sinks=sinks, return_lse=True)
                picked.append(cell)
    return picked


def test_sampled_cells_agree_with_the_cudnn_mapping():
    """What the lowering asks (fa4_jax.core.cudnn.cudnn_reason on the primitive the public call binds, at the
    device's compute capability) says cuDNN exactly where the matrix does."""
    sample = _cudnn_sample()
    assert {c["runs"] for c in sample} == {support.CUDNN, support.REFERENCE}
    for cell in sample:
        fn, args = _call(cell)
        (eqn,) = [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name.startswith("fa4_")]
        assert eqn.params["implementation"] == "auto"
        entry = ENTRIES[cell["entry_point"]].cudnn_entry
        reason = cudnn.cudnn_reason(entry, [v.aval for v in eqn.invars], eqn.params,
                                    compute_capability=DEVICES[cell["device"]].capability)
        assert (reason is None) == (cell["runs"] == support.CUDNN), (cell, reason)
