"""The SASS reader (fa4_jax/aot/sass.py) on freshly compiled objects, CPU-only: the sm_100a tcgen05
probe (tools/sm100_probe.py) must come out as Blackwell code (UTCHMMA, UTCBAR, LDTM, UTMALDG; no
HGMMA) and a Hopper variant as Hopper code (HGMMA; no UTCHMMA).

The SASS tests need nvdisasm, which CUDA 13.0's toolkit lacks: without it they fail rather than
skip, so that CI (which installs the wheel) cannot go green without having looked at a kernel.
"""

from __future__ import annotations

import re

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fa4_jax.aot import sass

ROOT = Path(__file__).resolve().parents[1]
HOPPER_SYMBOL = "fa4_kvcache_sm90_bf16_hd128_local"
# The SM100 attention kernels (fwd_sm100.py): dense, varlen (the same kernel at per-sequence
# offsets, whose MMA warp also zeroes V rows past a sequence's last key), and the KV cache (pack-GQA
# rows gathered by the load warp, split partials merged by the last split CTA): a decode tile on a
# contiguous cache and a prefill-chunk tile on a paged one.
SM100_KVCACHE_SYMBOLS = ("fa4_kvcache_sm100_bf16_hd128_local", "fa4_kvcache_sm100_bf16_hd64_local_softcap_paged_m128",
                         "fa4_kvcache_sm100_bf16_hd96_local_paged_rows1")
SM100_SYMBOLS = ("fa4_fwd_sm100_bf16_hd128_causal", "fa4_varlen_sm100_bf16_hd128_causal", *SM100_KVCACHE_SYMBOLS)


def _nvdisasm() -> str:
    found = sass.find_nvdisasm()
    if found is None:
        pytest.fail(f"nvdisasm not found ($NVDISASM, PATH, /usr/local/cuda/bin, the wheel): `{sass.PIP_HINT}`",
                    pytrace=False)
    return found


def _run(args: list[str], env_arch: str | None, what: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    # Each compile gets a process of its own: the DSL fixes its target when cutlass is imported, so
    # one pytest process could not build both architectures (compile_all uses a pool per arch for
    # the same reason), and other tests may already have imported it for Hopper.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("CUTE_DSL_ARCH", None)
    env.pop("FA4_JAX_EXPERIMENTS", None)
    env.update(extra_env or {})
    if env_arch:
        env["CUTE_DSL_ARCH"] = env_arch
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    return proc


@pytest.fixture(scope="module")
def sm100_obj(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sm100_probe")
    _run([str(ROOT / "tools" / "sm100_probe.py"), str(out), "sm_100a"], "sm_100a", "compiling tools/sm100_probe.py")
    return out / "probe_sm100.o"


def _compile_one(tmp_path_factory, symbol: str, extra_env: dict | None = None) -> Path:
    out = tmp_path_factory.mktemp(symbol)
    code = ("import json, sys; from fa4_jax.aot.worker import compile_one; "
            f"print(json.dumps(compile_one({symbol!r}, sys.argv[1])))")
    proc = _run(["-c", code, str(out)], None, f"compile_one({symbol!r})", extra_env)  # ~4 s
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "error" in result:
        pytest.fail(f"compile_one({symbol!r}):\n{result['error']}", pytrace=False)
    return out / f"{symbol}.o"


@pytest.fixture(scope="module")
def sm90_obj(tmp_path_factory) -> Path:
    return _compile_one(tmp_path_factory, HOPPER_SYMBOL)


@pytest.fixture(scope="module", params=SM100_SYMBOLS)
def sm100_attention_obj(request, tmp_path_factory) -> Path:
    return _compile_one(tmp_path_factory, request.param)


def _diverged_elects(text: str) -> list[str]:
    """ELECTs that ptxas had to wrap in WARPSYNC.COLLECTIVE (the out-of-line path it emits for an
    elect.sync of the full warp that may execute in a diverged warp): an elect nested in another
    elect's branch, whose other lanes never arrive."""
    instrs = [line.strip() for line in text.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", line)]
    return [op for i, op in enumerate(instrs)
            if "WARPSYNC.COLLECTIVE" in op and any(x.split()[1].startswith("ELECT") for x in instrs[i + 1:i + 3])]


def test_sm100_attention_kernel_is_tcgen05_without_spills(sm100_attention_obj):
    """The SM100 forward kernel compiled GPU-blind: sm_100a code whose gemms are tcgen05.mma with
    accumulators in Tensor Memory (S and O loaded and P and O stored by tcgen05.ld / st), handoffs by
    tcgen05.commit, per-warpgroup setmaxnreg budgets, and no local memory."""
    from fa4_jax.aot.cubin import kernel_resources

    assert sass.cubin_arch(sm100_attention_obj) == {"sm_100a"}
    kernels = sass.kernel_sass(sm100_attention_obj, _nvdisasm())
    (name, text), = [(n, t) for n, t in kernels.items() if "FlashAttentionForwardSm100" in n]
    ops = sass.opcode_counts(text)
    for op in ("UTCHMMA", "UTCBAR", "LDTM", "STTM", "USETMAXREG", "MUFU"):
        assert ops[op] > 0, (op, sorted(ops.items()))
    # Tensor Memory allocated (tcgen05.alloc: UTCATOMSWS.FIND_AND_SET), the permit relinquished
    # (UVIRTCOUNT) and freed (tcgen05.dealloc: UTCATOMSWS.AND). TmemAllocator acts only in its
    # allocator warp: when that was not the MMA warp, the allocation compiled to nothing.
    for pattern in (r"UTCATOMSWS\.FIND_AND_SET", r"UVIRTCOUNT\.DEALLOC", r"UTCATOMSWS\.AND\b"):
        assert re.search(pattern, text), (pattern, sorted(ops.items()))
    # Each tcgen05.mma issued by the whole MMA warp (the DSL elects its thread): wrapped in elect_one(),
    # the DSL's own elect.sync ran in one lane of a diverged warp (ptxas: WARPSYNC.COLLECTIVE, ELECT)
    # while the other 31 waited at the branch's end -- every kernel deadlocked at its first gemm.
    assert not _diverged_elects(text), _diverged_elects(text)[:3]
    # K/V by TMA, except one-row page pieces: rows gathered by the load warp's cp.async (LDGSTS).
    rows1 = sm100_attention_obj.stem.endswith("_rows1")
    assert (ops["UTMALDG"] == 0) == rows1, sorted(ops.items())
    assert ops["HGMMA"] == ops["STL"] == ops["LDL"] == 0, sorted(ops.items())
    (res,) = [r for k, r in kernel_resources(sm100_attention_obj).items() if "FlashAttentionForwardSm100" in k]
    assert res.get("frame", 0) == 0, res
    # The role budgets are the configuration's (config_sm100): dense and varlen compile two Q tiles
    # per CTA at head_dim <= 128 (softmax warpgroups at 208 registers), the KV cache one (248).
    from fa4_jax.kernels.config_sm100 import sm100_fwd_config

    symbol = sm100_attention_obj.stem
    head_dim = int(symbol.split("_hd")[1].split("_")[0])
    cfg = sm100_fwd_config(head_dim, packed_rows=128 if symbol in SM100_KVCACHE_SYMBOLS else None)
    budgets = {int(m, 16) for m in re.findall(r"USETMAXREG\S*\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text)}
    assert budgets == set(cfg.warpgroup_regs), (budgets, cfg)
    if sm100_attention_obj.stem in SM100_KVCACHE_SYMBOLS:
        # The load warp's cp.async gather of the pack-GQA Q rows, and the fused split merge's tile
        # counter; the combine kernel for calls without counters is an object of its own
        # (test_combine_companion_objects).
        for op in ("LDGSTS", "ATOMG"):
            assert ops[op] > 0, (op, sorted(ops.items()))
        assert list(kernels) == [name], list(kernels)


@pytest.fixture(scope="module", params=["fa4_combine_sm100_bf16_hd256", "fa4_combine_sm90_fp16_hd64"])
def combine_obj(request, tmp_path_factory) -> Path:
    return _compile_one(tmp_path_factory, request.param)


def test_combine_companion_objects(combine_obj):
    """The KV-cache family's split combine, compiled once per (arch, dtype, head_dim): the target's
    code, one kernel, no local memory."""
    from fa4_jax.aot.cubin import kernel_resources

    arch = "sm_100a" if "_sm100_" in combine_obj.stem else "sm_90a"
    assert sass.cubin_arch(combine_obj) == {arch}
    kernels = sass.kernel_sass(combine_obj, _nvdisasm())
    (name, text), = kernels.items()
    assert "SplitCombine" in name, name
    ops = sass.opcode_counts(text)
    assert ops["STL"] == ops["LDL"] == ops["HGMMA"] == ops["UTCHMMA"] == 0, sorted(ops.items())
    (res,) = kernel_resources(combine_obj).values()
    assert res.get("frame", 0) == 0, res


def test_sm100_probe_is_sm100a(sm100_obj):
    assert sass.cubin_arch(sm100_obj) == {"sm_100a"}


def test_sm100_probe_sass_is_tcgen05(sm100_obj):
    kernels = sass.kernel_sass(sm100_obj, _nvdisasm())
    assert len(kernels) == 1 and "ProbeGemm" in next(iter(kernels)), list(kernels)
    ops = sass.opcode_counts(next(iter(kernels.values())))
    # tcgen05.mma, tcgen05.commit to the mbarrier, tcgen05.ld of the accumulator, the TMA loads.
    for op in ("UTCHMMA", "UTCBAR", "LDTM", "UTMALDG"):
        assert ops[op] > 0, (op, sorted(ops.items()))
    assert ops["HGMMA"] == 0, sorted(ops.items())


def test_hopper_variant_is_sm90a(sm90_obj):
    assert sass.cubin_arch(sm90_obj) == {"sm_90a"}


def test_hopper_variant_sass_is_wgmma(sm90_obj):
    kernels = sass.kernel_sass(sm90_obj, _nvdisasm())
    attn = [text for name, text in kernels.items() if "FlashAttentionForward" in name]
    assert len(attn) == 1, list(kernels)
    assert sass.opcode_counts(attn[0])["HGMMA"] > 0
    for name, text in kernels.items():
        assert sass.opcode_counts(text)["UTCHMMA"] == 0, name


FP8_CHUNK_PAGED = "fa4_kvcache_sm90_bf16_hd128_local_paged_m128_kvfp8"
FP8_CHUNK_CONTIGUOUS = "fa4_kvcache_sm90_bf16_hd128_local_m128_kvfp8"


@pytest.fixture(scope="module", params=[FP8_CHUNK_PAGED, FP8_CHUNK_CONTIGUOUS], ids=["paged", "contiguous"])
def fp8_chunk_obj(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _compile_one(tmp_path_factory, request.param)


def test_fp8_chunk_tile_widening_warps(fp8_chunk_obj):
    """The FP8 chunk tile (hd128): no local memory at the four warpgroups' budgets (consumers 224, the
    loads' warpgroup 24, the widening warpgroup 40; paged 216 / 40 / 40); the e4m3 -> fp16
    conversions (F2FP...E4M3) at each call site of widen_rows in widen_kv; the TMA loads."""
    from fa4_jax.aot.cubin import kernel_resources

    symbol, obj = fp8_chunk_obj
    (text,) = [t for n, t in sass.kernel_sass(obj, _nvdisasm()).items() if "FlashAttentionForward" in n]
    ops = sass.opcode_counts(text)
    assert ops["STL"] == ops["LDL"] == 0, sorted(ops.items())
    (res,) = [r for k, r in kernel_resources(obj).items() if "FlashAttentionForward" in k]
    assert res.get("frame", 0) == 0, res
    budgets = {int(m, 16) for m in re.findall(r"USETMAXREG\S*\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", text)}
    assert budgets == ({40, 216} if symbol == FP8_CHUNK_PAGED else {24, 40, 224}), budgets
    # One setmaxnreg per role (loads, consumers, widening) and 128 launch registers x 512 threads, the
    # pool the four warpgroups' budgets fill exactly.
    assert len(re.findall(r"USETMAXREG", text)) == 3, re.findall(r"USETMAXREG\S*\s+\S+", text)
    assert res.get("regs") == 128, res
    converts = len(re.findall(r"F2FP\.F16\.E4M3", text))
    # widen_rows inlined at each call site: the highest block peeled off the loop (its K, the next K,
    # its masked V: fwd_sm90.widen_phases), then the loop's K and unmasked V -- five; at hd128 a
    # warp's 32 rows are 16 passes of 4 conversions.
    assert converts == 5 * 32 // 2 * 4, converts
    assert ops["UTMALDG"] > 0, sorted(ops.items())


def test_arch_specific_suffix_comes_from_nv_compat(sm90_obj):
    """e_flags is the same for sm_90 and sm_90a; clearing .nv.compat attribute 0x09 (what
    cuobjdump and nvdisasm read the `a` from) must turn the reading into plain sm_90."""
    (elf,) = sass.embedded_cubins(sm90_obj)
    assert sass.elf_arch(elf) == "sm_90a"
    (off, size), = [(o, s) for name, _t, o, s in sass.section_headers(elf) if name == ".nv.compat"]
    at = elf.find(b"\x02\x09\x01", off, off + size)
    assert at >= 0 and (at - off) % 4 == 0, elf[off:off + size].hex()
    patched = bytearray(elf)
    patched[at + 2] = 0
    assert sass.elf_arch(bytes(patched)) == "sm_90"


def test_opcode_counts_and_function_split():
    listing = """\t.target\tsm_100a

//--------------------- .text.k                   --------------------------
\t.section\t.text.k,"ax",@progbits
.text.k:
        /*0000*/                   LDC R1, c[0x0][0x37c] ;
        /*0010*/               @P0 BRA `(.L_x_0) ;
        /*0020*/              @!P1 BRA `(.L_x_7) ;
        /*0030*/         @!UPT UTCHMMA gdesc[UR20], gdesc[UR22], tmem[UR29], tmem[UR6], idesc[UR7], UR8, !UPT ;
        /*0040*/                   LDTM.x32 R100, tmem[UR4] ;
        /*0050*/                   UTMALDG.2D [UR8], [UR10] ;
//--------------------- .text.other_1 --------------------------
        /*0000*/                   EXIT ;
//--------------------- SYMBOLS --------------------------
\t.type\t\t.nv.reservedSmem.offset0,@object
"""
    funcs = sass.split_functions(listing)
    assert list(funcs) == ["k", "other_1"]
    assert sass.opcode_counts(funcs["k"]) == {"LDC": 1, "BRA": 2, "UTCHMMA": 1, "LDTM": 1, "UTMALDG": 1}
    assert sass.opcode_counts(funcs["other_1"]) == {"EXIT": 1}


def test_missing_nvdisasm_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(sass, "find_nvdisasm", lambda: None)
    with pytest.raises(sass.NvdisasmNotFound, match="pip install nvidia-cuda-nvdisasm"):
        sass.kernel_sass(tmp_path / "none.o")
