"""jax.export of programs calling fa4_jax from this CPU host (tests/export_case.py in a CPU-only
subprocess): with implementation=None the CUDA branch carries the kernels although no GPU is here,
the CPU branch the reference; the artifacts survive serialization. tests/test_gpu_export.py runs the
CUDA artifact on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from export_case import inputs, step
from fa4_jax.export import ffi_targets
from fa4_jax.families import KVCACHE

HERE = Path(__file__).resolve().parent


def export_from_cpu_host(tmp_path, platforms: str):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "export_case.py"), str(tmp_path), platforms], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return jax.export.deserialize(bytearray((tmp_path / "step.bin").read_bytes()))


def kernel_calls(exported) -> list[str]:
    return sorted(re.findall(r"stablehlo\.custom_call @(fa4_jax_\w+)\(", exported.mlir_module()))


@pytest.fixture(scope="module")
def library():
    from fa4_jax.core import library as _ffi

    if not _ffi.compiled_variants():
        pytest.fail(f"these tests need the built kernel library: {_ffi.library_status()}")


def test_cuda_export_from_a_cpu_host_calls_the_kernels(tmp_path, library):
    exported = export_from_cpu_host(tmp_path, "cuda")
    assert exported.platforms == ("cuda",)
    # One kernel call per entry point (dense, KV cache, varlen), named by the versioned FFI targets.
    assert kernel_calls(exported) == sorted(ffi_targets()), exported.mlir_module()[:2000]
    assert "stablehlo.exponential" not in exported.mlir_module(), "no reference branch in a CUDA-only export"
    # implementation=None does not opt in: served on a GPU whose kernels no hardware run has validated
    # (SM100 today), the handler refuses with an FFI error instead of running them (ffi NotValidated).
    opt_in = re.findall(r"unvalidated_ok = (true|false)", exported.mlir_module())
    assert opt_in == ["false"] * 3, opt_in


def test_multi_platform_export_runs_the_reference_here(tmp_path, library):
    exported = export_from_cpu_host(tmp_path, "cpu,cuda")
    assert exported.platforms == ("cpu", "cuda")
    assert kernel_calls(exported) == sorted(ffi_targets())  # in the CUDA branch
    args = inputs()
    # On the CPU whatever the host has (on a GPU host the CUDA branch would run the kernels, and on an
    # unvalidated one refuse them: tests/test_gpu_export.py covers both).
    with jax.default_device(jax.devices("cpu")[0]):
        got = exported.call(*args.values())
        want = jax.jit(step)(*args.values())  # implementation=None on the CPU: the reference
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_export_safety_checks_name_every_target():
    checks = fa4_jax.export_safety_checks()
    assert len(checks) == len(ffi_targets()) == 3
    assert {str(c) for c in checks} == {f"custom_call:{t}" for t in ffi_targets()}


# -- symbolic (shape-polymorphic) shapes --------------------------------------------------------------

def _symbolic_export(fn, specs, platforms):
    return jax.export.export(jax.jit(fn), platforms=platforms, disabled_checks=fa4_jax.export_safety_checks())(*specs)


def _bf16(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)


def test_split_capacity_with_symbolic_dims_bounds_every_value():
    # The workspace extent must be static and hold every split count num_splits=None may pick for any
    # value the symbolic dims take at run time.
    from fa4_jax.ops.kvcache.primitive import split_capacity

    b, cap = jax.export.symbolic_shape("b, cap")
    for h_q, h_k, s_q in [(8, 2, 1), (32, 8, 1), (8, 8, 4), (4, 1, 1)]:
        for q_shape, k_shape, table in [((b, s_q, h_q, 128), (b, cap, h_k, 128), None),
                                        ((b, s_q, h_q, 128), (b, 640, h_k, 128), None),
                                        ((2, s_q, h_q, 128), (2, cap, h_k, 128), None),
                                        ((b, s_q, h_q, 128), (40, 64, h_k, 128), (b, cap))]:
            extent = split_capacity(q_shape, k_shape, table, 0)
            assert isinstance(extent, int) and 1 <= extent <= 256, extent
            for bv in (1, 2, 64):
                for cv in (1, 640, 100_000):
                    concrete = lambda shape: tuple(bv if d is b else cv if d is cap else d for d in shape)  # noqa: E731
                    want = split_capacity(concrete(q_shape), concrete(k_shape),
                                          None if table is None else concrete(table), 0)
                    assert want <= extent, (q_shape, k_shape, table, bv, cv, want, extent)
    assert split_capacity((b, 1, 8, 128), (b, cap, 2, 128), None, 7) == 7  # a forced count is the extent


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_symbolic_batch_and_capacity_exports_and_runs(kernel_library, paged):
    b, n = jax.export.symbolic_shape("b, n")
    h_q, h_k, d = 8, 2, 128
    if paged:  # n = pages per row: capacity 64 * n
        specs = [jax.ShapeDtypeStruct(s, t) for s, t in [((b, 1, h_q, d), jnp.bfloat16), ((24, 64, h_k, d), jnp.bfloat16),
                                                       ((24, 64, h_k, d), jnp.bfloat16), ((b,), jnp.int32),
                                                       ((b, n), jnp.int32)]]
        fn = lambda q, k, v, lens, t: fa4_jax.attention_with_kvcache(q, k, v, lens, page_table=t, causal=True)  # noqa: E731
    else:
        specs = [jax.ShapeDtypeStruct(s, t) for s, t in [((b, 1, h_q, d), jnp.bfloat16), ((b, n, h_k, d), jnp.bfloat16),
                                                       ((b, n, h_k, d), jnp.bfloat16), ((b,), jnp.int32)]]
        fn = lambda q, k, v, lens: fa4_jax.attention_with_kvcache(q, k, v, lens, causal=True)  # noqa: E731
    cuda = _symbolic_export(fn, specs, ["cuda"])
    assert kernel_calls(cuda) == [KVCACHE.target]
    # The split workspace results have a static extent (the bound over every b and capacity).
    (call,) = [line for line in cuda.mlir_module().splitlines() if "custom_call @" + KVCACHE.target in line]
    workspace = re.findall(r"tensor<(\d+)x\?x1x8x128xf32>", call)
    assert len(workspace) == 1 and 1 <= int(workspace[0]) <= 256, call[-400:]

    both = _symbolic_export(fn, specs, ["cpu", "cuda"])
    rng = np.random.default_rng(1)
    for bv, nv in [(2, 5), (3, 2)]:
        q = _bf16(rng, bv, 1, h_q, d)
        lens = rng.integers(0, 64 * nv if paged else nv, bv, endpoint=True).astype(np.int32)
        if paged:
            k, v = _bf16(rng, 24, 64, h_k, d), _bf16(rng, 24, 64, h_k, d)
            args = (q, k, v, lens, rng.permutation(24)[: bv * nv].reshape(bv, nv).astype(np.int32))
        else:
            args = (q, _bf16(rng, bv, nv, h_k, d), _bf16(rng, bv, nv, h_k, d), lens)
        with jax.default_device(jax.devices("cpu")[0]):  # the CPU branch, on any host
            got, want = both.call(*args), jax.jit(fn)(*args)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic_tokens"])
def test_kvcache_ragged_exports_and_runs(kernel_library, symbolic):
    """A continuous-batching step (ragged q over a paged pool) exported from this CPU host: the CUDA
    branch is one kernel call (with the lowering's tile list), the CPU branch the reference; with a
    symbolic number of packed tokens the static max_seqlen_q hint keeps the kernel."""
    (t,) = jax.export.symbolic_shape("t") if symbolic else (40,)
    h_q, h_k, d, ps, b, mp = 8, 2, 128, 16, 3, 4
    specs = [jax.ShapeDtypeStruct(s, dt) for s, dt in [((t, h_q, d), jnp.bfloat16), ((20, ps, h_k, d), jnp.bfloat16),
                                                        ((20, ps, h_k, d), jnp.bfloat16), ((b,), jnp.int32),
                                                        ((b + 1,), jnp.int32), ((b, mp), jnp.int32)]]
    fn = lambda q, k, v, lens, cu, table: fa4_jax.attention_with_kvcache(  # noqa: E731
        q, k, v, lens, cu_seqlens_q=cu, page_table=table, max_seqlen_q=32, causal=True)
    assert kernel_calls(_symbolic_export(fn, specs, ["cuda"])) == [KVCACHE.target]
    both = _symbolic_export(fn, specs, ["cpu", "cuda"])
    rng = np.random.default_rng(4)
    for total, counts in [(40, [32, 1, 7]), (11, [0, 1, 9])]:
        if not symbolic and total != 40:
            continue
        cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        lens = np.array([50, 9, 64], np.int32)
        args = (_bf16(rng, total, h_q, d), _bf16(rng, 20, ps, h_k, d), _bf16(rng, 20, ps, h_k, d), lens, cu,
                rng.permutation(20)[: b * mp].reshape(b, mp).astype(np.int32))
        with jax.default_device(jax.devices("cpu")[0]):  # the CPU branch, on any host
            got, want = both.call(*args), jax.jit(fn)(*args)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

def test_varlen_symbolic_number_of_sequences_exports_and_runs(kernel_library):
    (n,) = jax.export.symbolic_shape("n")
    t, h_q, h_k, d = 96, 8, 2, 64
    specs = [jax.ShapeDtypeStruct((t, h_q, d), jnp.bfloat16), jax.ShapeDtypeStruct((t, h_k, d), jnp.bfloat16),
             jax.ShapeDtypeStruct((t, h_k, d), jnp.bfloat16), jax.ShapeDtypeStruct((n + 1,), jnp.int32),
             jax.ShapeDtypeStruct((n + 1,), jnp.int32)]
    fn = lambda q, k, v, cq, ck: fa4_jax.attention_varlen(q, k, v, cq, ck, causal=True)  # noqa: E731
    assert kernel_calls(_symbolic_export(fn, specs, ["cuda"])) == ["fa4_jax_varlen_v2"]
    both = _symbolic_export(fn, specs, ["cpu", "cuda"])
    rng = np.random.default_rng(2)
    q, k, v = _bf16(rng, t, h_q, d), _bf16(rng, t, h_k, d), _bf16(rng, t, h_k, d)
    for cu_q, cu_k in [([0, 96], [0, 96]), ([0, 10, 10, 60, 90], [0, 30, 31, 80, 96])]:
        args = (q, k, v, np.asarray(cu_q, np.int32), np.asarray(cu_k, np.int32))
        np.testing.assert_array_equal(np.asarray(both.call(*args), np.float32), np.asarray(jax.jit(fn)(*args), np.float32))


def test_varlen_symbolic_tokens_need_max_seqlen_q_for_the_kernel(kernel_library):
    # The kernel's grid needs a static bound on each sequence's queries: without max_seqlen_q a symbolic
    # token count runs the reference on CUDA (None) or raises naming the dimension ("fa4").
    n, t = jax.export.symbolic_shape("n, t")
    specs = [jax.ShapeDtypeStruct((t, 8, 64), jnp.bfloat16), jax.ShapeDtypeStruct((t, 2, 64), jnp.bfloat16),
             jax.ShapeDtypeStruct((t, 2, 64), jnp.bfloat16), jax.ShapeDtypeStruct((n + 1,), jnp.int32),
             jax.ShapeDtypeStruct((n + 1,), jnp.int32)]

    def fn(**kw):
        return lambda q, k, v, cq, ck: fa4_jax.attention_varlen(q, k, v, cq, ck, causal=True, **kw)

    assert kernel_calls(_symbolic_export(fn(), specs, ["cuda"])) == []
    assert kernel_calls(_symbolic_export(fn(max_seqlen_q=512), specs, ["cuda"])) == ["fa4_jax_varlen_v2"]
    with pytest.raises(RuntimeError, match=r'"fa4" cannot run here: q has a symbolic number of tokens \(t\).*max_seqlen_q'):
        _symbolic_export(fn(implementation="fa4"), specs, ["cuda"])


# -- the hint in jax.export's refusal --------------------------------------------------------------------

def _step_specs():
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs().values()]


def test_export_without_disabled_checks_names_export_safety_checks(kernel_library):
    # jax lists each refused custom call with its location; the kernel calls' location carries the hint.
    with pytest.raises(ValueError) as info:
        jax.export.export(jax.jit(step), platforms=["cuda"])(*_step_specs())
    message = str(info.value)
    assert "Cannot serialize code with custom calls" in message
    for target in ffi_targets():
        assert re.search(rf"custom_call @{target}\(.*\n?.*{re.escape(fa4_jax.export.EXPORT_HINT)}", message), target


def _without_locations(text: str) -> str:
    text = re.sub(r"\s*loc\([^()]*(\([^()]*\))*[^()]*\)", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith("#loc"))


def test_export_hint_changes_only_locations(kernel_library, monkeypatch):
    from fa4_jax.core import lowering

    def module(hint):
        monkeypatch.setattr(lowering, "EXPORT_HINT", hint)
        exported = jax.export.export(jax.jit(lambda *a: step(*a)), platforms=["cuda"],  # a fresh trace
                                     disabled_checks=fa4_jax.export_safety_checks())(*_step_specs())
        return exported.mlir_module()

    with_hint, other = module(fa4_jax.export.EXPORT_HINT), module("another scope")
    assert fa4_jax.export.EXPORT_HINT in with_hint and "another scope" in other
    stripped = _without_locations(with_hint)
    assert stripped == _without_locations(other)
    assert len(re.findall(r"stablehlo\.custom_call @fa4_jax_\w+\(", stripped)) == 3 and "loc(" not in stripped
