"""tests/gpu_menu.py and tests/conftest.py on CPU: when GPU tests run, skip or fail (a GPU run must not go
green on a broken setup), and the end-of-run count of kernel cases per family (also under pytest-xdist)."""

from __future__ import annotations

import dataclasses
import shutil
import types
from pathlib import Path

import jax
import pytest

import gpu_menu
from fa4_jax.families import FwdVariant, KVCacheVariant

pytest_plugins = "pytester"
HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def fresh_status():
    gpu_menu.gpu_host.cache_clear()
    gpu_menu.gpu_status.cache_clear()
    gpu_menu.library_menu.cache_clear()
    yield
    gpu_menu.gpu_host.cache_clear()
    gpu_menu.gpu_status.cache_clear()
    gpu_menu.library_menu.cache_clear()


def fake_gpu(capability):
    return types.SimpleNamespace(platform="gpu", compute_capability=capability, device_kind="NVIDIA TEST", id=0)


def no_gpu_backend(platform=None):
    if platform == "gpu":
        raise RuntimeError("Unknown backend: 'gpu' requested")
    return [types.SimpleNamespace(platform="cpu", device_kind="cpu", id=0)]


@pytest.mark.parametrize(
    "host,require,devices,want",
    [
        (None, "", no_gpu_backend, "skip"),  # a CPU-only host: skip
        ("an NVIDIA GPU is present (/dev/nvidia0)", "", no_gpu_backend, "fail"),  # broken CUDA plugin
        (None, "1", no_gpu_backend, "fail"),  # FA4_JAX_REQUIRE_GPU=1 anywhere
        ("an NVIDIA GPU is present (/dev/nvidia0)", "", lambda p=None: [fake_gpu("9.0")], "run"),
        ("an NVIDIA GPU is present (/dev/nvidia0)", "", lambda p=None: [fake_gpu("10.0")], "run"),  # opt-in kernels
        ("an NVIDIA GPU is present (/dev/nvidia0)", "", lambda p=None: [fake_gpu("8.0")], "skip"),  # not Hopper
        (None, "1", lambda p=None: [fake_gpu("8.0")], "fail"),
    ],
    ids=["cpu_host", "gpu_host_broken_backend", "required_no_backend", "hopper", "blackwell", "ampere",
         "required_ampere"],
)
def test_gpu_status(monkeypatch, host, require, devices, want):
    monkeypatch.setenv(gpu_menu.REQUIRE_ENV, require)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(gpu_menu, "gpu_host", lambda: host if not require else f"{gpu_menu.REQUIRE_ENV}=1")
    monkeypatch.setattr(jax, "devices", devices)
    action, reason = gpu_menu.gpu_status()
    assert action == want, reason
    if want == "fail" and devices is no_gpu_backend:
        assert "GPU run on a broken setup" in reason and "RuntimeError" in reason


def test_gpu_host_detection(monkeypatch):
    monkeypatch.setenv(gpu_menu.REQUIRE_ENV, "1")
    assert gpu_menu.gpu_host() == f"{gpu_menu.REQUIRE_ENV}=1"


def fake_library(monkeypatch, built):
    from fa4_jax.core import library as _ffi

    monkeypatch.setattr(_ffi, "register_targets", lambda: bool(built))
    monkeypatch.setattr(_ffi, "compiled_variants", lambda: frozenset(built))
    monkeypatch.setattr(_ffi, "library_status", lambda: "libfa4_jax.so was not built (looked for ...)")


def test_missing_library_fails(monkeypatch):
    fake_library(monkeypatch, ())
    with pytest.raises(pytest.fail.Exception, match=r"GPU run without the kernel library: libfa4_jax\.so was not built"):
        gpu_menu.kernel_variants()


HAVE = FwdVariant("sm90", "bf16", 128, "causal", False)
LACK = KVCacheVariant("sm90", "fp16", 64, "local", False, True)


def test_present_variant_runs(monkeypatch):
    fake_library(monkeypatch, [HAVE])
    assert gpu_menu.require_variant(gpu_menu.kernel_variants(), HAVE) is None


def test_default_menu_variant_missing_from_a_full_build_fails(monkeypatch):
    monkeypatch.setattr(gpu_menu, "library_menu", lambda: ("", "/lib/fa4_menu.json"))
    with pytest.raises(pytest.fail.Exception, match=rf"lacks {LACK.symbol}, a variant of the default menu, and was "
                                                    r"built with the full menu \(/lib/fa4_menu\.json\)"):
        gpu_menu.require_variant(frozenset([HAVE]), LACK)


def test_narrowed_menu_skips_what_it_left_out(monkeypatch):
    monkeypatch.setattr(gpu_menu, "library_menu", lambda: ("dtype=bf16", "/lib/fa4_menu.json"))
    with pytest.raises(pytest.skip.Exception, match=rf"narrowed menu: {LACK.symbol} not built "
                                                    r"\(FA4_JAX_VARIANTS='dtype=bf16', /lib/fa4_menu\.json\)"):
        gpu_menu.require_variant(frozenset([HAVE]), LACK)


def test_narrowed_menu_fails_for_what_it_should_have(monkeypatch):
    monkeypatch.setattr(gpu_menu, "library_menu", lambda: ("dtype=fp16", "/lib/fa4_menu.json"))
    with pytest.raises(pytest.fail.Exception, match=r"although its narrowed menu FA4_JAX_VARIANTS='dtype=fp16'"):
        gpu_menu.require_variant(frozenset([HAVE]), LACK)


def test_variant_outside_the_default_menu_fails(monkeypatch):
    import fa4_jax.families as families

    # Neither arch has LACK's kind (else the rule is the skip of the test below).
    menu = tuple(v for v in families.default_menu() if dataclasses.replace(v, arch=LACK.arch) != LACK)
    monkeypatch.setattr(families, "default_menu", lambda: menu)
    with pytest.raises(pytest.fail.Exception, match=rf"{LACK.symbol} is not in the default menu"):
        gpu_menu.require_variant(frozenset([HAVE]), LACK)


def test_a_family_without_kernels_for_the_gpus_arch_skips(monkeypatch):
    # A family with no kernels for the device's architecture (as the KV-cache family on Blackwell was
    # before issue 16's SM100 KV-cache kernels): its GPU cases skip, naming why.
    import fa4_jax.families as families

    menu = tuple(v for v in families.default_menu() if not (v.arch == "sm100" and isinstance(v, KVCacheVariant)))
    monkeypatch.setattr(families, "default_menu", lambda: menu)
    with pytest.raises(pytest.skip.Exception, match=r"no kvcache kernels for sm100 in the default menu yet: "
                                                    r"fa4_kvcache_sm100_bf16_hd128_local"):
        gpu_menu.require_variant(frozenset([HAVE]), KVCacheVariant("sm100", "bf16", 128, "local", False))


def test_a_kernel_kind_the_gpus_arch_lacks_skips():
    # FP8 caches have Hopper kernels only (spec.FP8_ARCHES): an FP8 case skips on a Blackwell GPU, naming
    # the SM90 kernel that exists.
    fp8 = KVCacheVariant("sm100", "bf16", 128, "local", False, True, 64, 1, kv_fp8=True)
    assert dataclasses.replace(fp8, kv_fp8=False) in families_menu()
    with pytest.raises(pytest.skip.Exception, match=r"fa4_kvcache_sm100_bf16_hd128_local_paged_rows1_kvfp8: sm100 "
                                                    r"has no kernel of this kind yet \(fa4_kvcache_sm90_bf16_hd128_"
                                                    r"local_paged_rows1_kvfp8 is sm90's\)"):
        gpu_menu.require_variant(frozenset([HAVE]), fp8)


def families_menu():
    import fa4_jax.families as families

    return families.default_menu()


@pytest.mark.parametrize("capability,arch,validated", [("9.0", "sm90", True), ("10.0", "sm100", False)])
def test_gpu_tests_name_the_devices_arch(monkeypatch, capability, arch, validated):
    # The GPU tests ask for variants of the GPU's own architecture, and know whether implementation=None
    # picks the kernels there (Blackwell's are opt-in until a run validates them).
    gpu_menu.device_arch.cache_clear()
    monkeypatch.setattr(jax, "devices", lambda platform=None: [fake_gpu(capability)])
    try:
        assert (gpu_menu.device_arch(), gpu_menu.validated()) == (arch, validated)
    finally:
        gpu_menu.device_arch.cache_clear()


def test_library_menu_reads_the_menu_file(monkeypatch, tmp_path):
    from fa4_jax.core import library as _ffi

    (tmp_path / "libfa4_jax.so").write_bytes(b"")
    (tmp_path / gpu_menu.MENU_FILE).write_text('{"fa4_jax_variants": "head_dim=128", "variants": []}')
    monkeypatch.setattr(_ffi, "library_path", lambda: tmp_path / "libfa4_jax.so")
    assert gpu_menu.library_menu() == ("head_dim=128", str(tmp_path / gpu_menu.MENU_FILE))


SUMMARY_CASES = '''
import pytest

@pytest.mark.kernel_family("kvcache")
@pytest.mark.parametrize("i", range(3))
def test_kv(i):
    pass

@pytest.mark.kernel_family("kvcache", "varlen")
def test_skipped():
    pytest.skip("narrowed menu: not built")

@pytest.mark.kernel_family("varlen")
def test_fails():
    assert False

@pytest.fixture
def broken():
    pytest.fail("GPU run without the kernel library")

@pytest.mark.kernel_family("fwd")
def test_setup_error(broken):
    pass

@pytest.mark.kernel_family()
def test_no_kernel():
    pass

def test_unmarked():
    pass
'''


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_end_of_run_summary_counts_kernel_cases(pytester, workers):
    for name in ("conftest.py", "gpu_menu.py"):
        shutil.copy(HERE / name, pytester.path / name)
    pytester.makepyfile(test_cases=SUMMARY_CASES)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *workers)
    result.assert_outcomes(passed=5, skipped=1, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*= fa4_jax kernel cases =*",
        "fa4_jax kernel cases, fwd: 0 ran on the kernel (0 passed, 0 failed), 0 skipped, 1 errors",
        "fa4_jax kernel cases, kvcache: 3 ran on the kernel (3 passed, 0 failed), 1 skipped, 0 errors",
        "fa4_jax kernel cases, varlen: 1 ran on the kernel (0 passed, 1 failed), 1 skipped, 0 errors",
    ])
