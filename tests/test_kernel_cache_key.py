"""The object cache's fingerprints cover only the kernel sources a family's compile imports
(fa4_jax/aot/cache.py). CPU only, no cutlass: the import closure is read from the sources."""

from __future__ import annotations

import dataclasses

import pytest

from fa4_jax.aot import cache


@dataclasses.dataclass(frozen=True)
class _Family:  # the fields family_abi_digest and kernel_sources_digest read
    name: str
    compile: str
    target: str = "t"
    params: tuple = ()
    tensors: tuple = ()
    scalars: tuple = ()


FAM_A = _Family("a", "fa4_jax.kernels.entry_a:compile_variant")
FAM_B = _Family("b", "fa4_jax.kernels.entry_b:compile_variant")

# A small kernels package: two entry modules over one shared kernel, each with a helper of its own,
# reached through the import forms the real kernels use (absolute, `from pkg import mod`, relative,
# function-level).
_TREE = {
    "__init__.py": '"""kernels"""\n',
    "entry_a.py": "from fa4_jax.kernels.common import DTYPES\n\ndef compile_variant(v):\n"
                  "    from fa4_jax.kernels.kernel import Kernel\n    from fa4_jax.kernels import only_a\n",
    "entry_b.py": "from .common import DTYPES\nfrom fa4_jax.kernels.kernel import Kernel\n"
                  "import fa4_jax.kernels.only_b\n",
    "common.py": "DTYPES = {}\n",
    "kernel.py": "import math\nfrom fa4_jax.kernels import shared as sh\nclass Kernel: pass\n",
    "shared.py": "from . import common\n",
    "only_a.py": "X = 1\n",
    "only_b.py": "Y = 1\n",
    "unused.py": "Z = 1\n",
}


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    root.mkdir()
    for name, text in _TREE.items():
        (root / name).write_text(text)
    monkeypatch.setattr(cache, "KERNELS_DIR", root)
    return root


def _fingerprints():
    return {fam.name: cache.fingerprint("variant", fam, cache.kernel_sources_digest(fam), "4.8.1")
            for fam in (FAM_A, FAM_B)}


def test_closure_follows_every_import_form(kernels):
    common = ["__init__.py", "common.py", "kernel.py", "shared.py"]
    assert cache.kernel_module_files("fa4_jax.kernels.entry_a") == sorted(common + ["entry_a.py", "only_a.py"])
    assert cache.kernel_module_files("fa4_jax.kernels.entry_b") == sorted(common + ["entry_b.py", "only_b.py"])


def test_edit_to_one_familys_module_keeps_the_others(kernels):
    before = _fingerprints()
    (kernels / "only_a.py").write_text("X = 2\n")
    after = _fingerprints()
    assert after["a"] != before["a"]
    assert after["b"] == before["b"]
    (kernels / "unused.py").write_text("Z = 2\n")  # imported by no family: no recompile
    assert _fingerprints() == after


def test_edit_to_shared_module_changes_all(kernels):
    for name in ("shared.py", "common.py", "__init__.py"):
        before = _fingerprints()
        (kernels / name).write_text((kernels / name).read_text() + "# edited\n")
        after = _fingerprints()
        assert after["a"] != before["a"] and after["b"] != before["b"], name


def test_new_import_joins_the_closure(kernels):
    (kernels / "only_b.py").write_text("from fa4_jax.kernels.only_a import X\n")
    before = _fingerprints()
    (kernels / "only_a.py").write_text("X = 3\n")
    after = _fingerprints()
    assert after["a"] != before["a"] and after["b"] != before["b"]


@pytest.mark.parametrize("text", ["import importlib\nm = importlib.import_module('fa4_jax.kernels.x')\n",
                                  "m = __import__('fa4_jax.kernels.x')\n", "def broken(:\n"])
def test_unreadable_imports_cover_every_source(kernels, text):
    (kernels / "only_b.py").write_text(text)
    assert cache.kernel_module_files("fa4_jax.kernels.entry_b") is None
    before = _fingerprints()
    (kernels / "unused.py").write_text("Z = 3\n")
    after = _fingerprints()
    assert after["b"] != before["b"]  # every source counts for b
    assert after["a"] == before["a"]  # a's closure is still read statically


def test_abi_change_changes_fingerprint(kernels):
    digest = cache.kernel_sources_digest(FAM_A)
    other = dataclasses.replace(FAM_A, tensors=("q",))
    assert cache.fingerprint("v", FAM_A, digest, "x") != cache.fingerprint("v", other, digest, "x")


@pytest.fixture
def two_experiments(monkeypatch):
    """kernels/experiments.py's registry with two names in it (it is empty while no kernel change
    awaits a GPU): the mechanism is tested whatever the registry holds."""
    from fa4_jax.kernels import experiments

    monkeypatch.setattr(experiments, "KNOWN", {"exp_a": "a test experiment", "exp_b": "another"})
    return experiments


@pytest.mark.parametrize("env,value", [("FA4_JAX_PHASE_TIMES", "1"), ("FA4_JAX_EXPERIMENTS", "exp_a"),
                                       ("FA4_JAX_EXPERIMENTS", "exp_b")])
def test_build_switches_change_the_fingerprint(monkeypatch, two_experiments, env, value):
    # These switches compile other code from the same sources: a cached object must not serve both.
    digest = cache.kernel_sources_digest(FAM_A)
    monkeypatch.delenv(env, raising=False)
    off = cache.fingerprint("v", FAM_A, digest, "x")
    monkeypatch.setenv(env, value)
    assert cache.fingerprint("v", FAM_A, digest, "x") != off


def test_experiments_are_a_set_of_known_names(monkeypatch, two_experiments):
    experiments = two_experiments
    digest = cache.kernel_sources_digest(FAM_A)
    monkeypatch.setenv("FA4_JAX_EXPERIMENTS", "exp_b, exp_a")
    both = cache.fingerprint("v", FAM_A, digest, "x")
    assert experiments.active() == ("exp_a", "exp_b")
    monkeypatch.setenv("FA4_JAX_EXPERIMENTS", "exp_a,exp_b,")
    assert cache.fingerprint("v", FAM_A, digest, "x") == both  # order and spacing do not matter
    monkeypatch.setenv("FA4_JAX_EXPERIMENTS", "exp_c")
    with pytest.raises(ValueError, match=r"FA4_JAX_EXPERIMENTS: unknown experiment\(s\) \['exp_c'\]"):
        experiments.active()
    with pytest.raises(KeyError, match="not an experiment: 'nope'"):
        experiments.enabled("nope")


def test_real_families_import_their_entry_and_not_the_others():
    from fa4_jax.families import FAMILIES

    # Families and their companions (the KV-cache split combine): each compiles from its own entry.
    entries = {d.name: d.compile.partition(":")[0] for fam in FAMILIES for d in (fam, *fam.companions)}
    assert len(entries) == sum(1 + len(fam.companions) for fam in FAMILIES)
    files = {name: cache.kernel_module_files(module) for name, module in entries.items()}
    for name, module in entries.items():
        own = module.rsplit(".", 1)[1] + ".py"
        assert files[name] is not None and own in files[name]
        for other, other_files in files.items():
            if other != name:
                assert own not in other_files, f"{other} imports {name}'s entry module"
    # Every kernels source is used by some family (a file nothing imports is dead code), but for the
    # experiments' registry, which kernels import only while it names an experiment they read.
    from fa4_jax.kernels import experiments

    used = set().union(*files.values())
    assert used | ({"experiments.py"} if not experiments.KNOWN else set()) == set(cache.kernel_source_names())


def test_a_build_dir_reconfigured_with_other_experiments_reruns_the_exporter(tmp_path, monkeypatch, two_experiments):
    """CMake reruns the exporter only when its request file changes: the experiments are in it, and the
    build step compiles the request's experiments, not those of the shell that runs `cmake --build`."""
    import json

    from fa4_jax.aot import build, cmake

    experiments = two_experiments

    spec = "fwd:arch=sm90,dtype=bf16,head_dim=128,mask=causal,softcap=false"
    monkeypatch.setenv("FA4_JAX_VARIANTS", spec)
    monkeypatch.setenv("FA4_JAX_EXPERIMENTS", "exp_b")  # (restored after the test)
    menu = [v.symbol for v in cmake.sorted_menu(spec)]
    request = tmp_path / "fa4_request.json"
    for recorded in ([], ["exp_a"]):
        request.write_text(json.dumps({"fa4_jax_variants": spec, "variants": menu, "experiments": recorded}))
        assert [v.symbol for v in build.resolve_menu(request)[1]] == menu
        assert list(experiments.active()) == recorded
