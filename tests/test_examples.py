"""The examples that run in seconds on a CPU stay runnable (each in a fresh process, as a user runs
it): generate.py (tiny config, Flax decoder with a paged cache), sharded_inference.py (8 fake CPU
devices), serve.py (tiny continuous-batching engine on a paged cache) and benchmark_serving.py --quick
(its tables through the XLA reference)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,flags,expect", [
    ("generate.py", [], "logits vs the XLA-reference model at every step"),
    ("generate.py", ["--kv-dtype", "fp8"], "FP8 KV cache vs the bf16 cache at every step"),
    ("sharded_inference.py", [], "context-parallel"),
], ids=["generate", "generate_fp8", "sharded_inference"])
def test_example_runs(script, flags, expect):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # sharded_inference.py asks for its 8 host devices itself
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script), *flags], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert expect in proc.stdout and proc.stdout.rstrip().endswith("OK"), proc.stdout[-2000:]


@pytest.mark.parametrize("page_size", [1, 5])
def test_serve_continuous_batching(page_size, tmp_path):
    """serve.py --tiny: both engine modes (one ragged call per layer, and separate prefill/decode calls)
    produce every request's reference greedy tokens, with freed pages NaN-poisoned (--poison) and
    handed to later requests (pages reused > 0: the isolation of recycled pages is exercised)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "serve.py"), "--tiny", "--page-size", str(page_size),
                           "--poison", "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    assert proc.stdout.rstrip().endswith("OK"), log
    agreement = re.findall(r"agreement: (\d+)/(\d+) requests match", proc.stdout)
    reused = [int(n) for n in re.findall(r"pages reused: (\d+)", proc.stdout)]
    assert len(agreement) == 2 and all(ok == total and int(total) > 0 for ok, total in agreement), log
    assert len(reused) == 2 and all(n > 0 for n in reused), log
    results = json.loads(out.read_text())
    assert results["config"]["page_size"] == page_size and results["poison"]
    for mode in ("mixed", "baseline"):
        r = results["modes"][mode]
        assert r["ok"] and r["agreement"]["mismatched_requests"] == [], r["agreement"]
        assert r["metrics"]["pages_reused"] > 0


def test_benchmark_plots_a_saved_run(tmp_path):
    """benchmark.py --from-json --plot draws a saved run without a GPU: one panel per (causal, head
    dim), a line per competitor that has numbers (here FlashAttention-4 only in one panel)."""
    rows = []
    for hd in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096):
                r = dict(head_dim=hd, causal=causal, seqlen=s, fa4_bf16_tflops=300.0 + s / 64,
                         cudnn_bf16_tflops=280.0 + s / 80)
                if hd == 128 and causal:
                    r["flash4_bf16_tflops"] = 310.0 + s / 70
                rows.append(r)
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(dict(meta=dict(device="NVIDIA TEST", jax="0", date="2026-12-03T10:00", commit="abc"),
                                     rows=rows)))
    png = tmp_path / "plot.png"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(ROOT / "examples" / "benchmark.py")]
    proc = subprocess.run(cmd + ["--from-json", str(saved), "--plot", str(png)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "plot (fa4_jax, cuDNN, FlashAttention-4) written to" in proc.stdout, proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    bad = subprocess.run(cmd + ["--from-json", str(saved)], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--from-json needs --plot" in bad.stderr


def test_benchmark_consistency_lines():
    """Issue 18's fp16-vs-bf16 and hd96 / hd192-vs-neighbours summary of a run's rows: ratios, the row
    of the smallest, and rows without both sides left out."""
    sys.path.insert(0, str(ROOT / "examples"))
    import benchmark

    rows = [dict(head_dim=hd, causal=c, seqlen=s, fa4_bf16_tflops=tf, fa4_fp16_tflops=tf * f16)
            for hd, c, s, tf, f16 in [(64, False, 1024, 400.0, 1.0), (128, False, 1024, 600.0, 0.98),
                                      (96, False, 1024, 450.0, 1.02), (96, False, 4096, 480.0, 1.0),
                                      (192, True, 1024, 500.0, 0.97), (256, True, 1024, 600.0, 1.0)]]
    rows.append(dict(head_dim=128, causal=True, seqlen=1024, fa4_bf16_tflops=400.0))  # no fp16 number
    lines = benchmark.consistency_lines(rows)
    assert lines[0] == "fa4_jax fp16 / bf16: 0.970-1.020 over 6 rows (min at hd192 causal 1024)", lines
    # hd96 at 1k against (400 + 600) / 2; its 4k row has no neighbours. hd192 causal 1k against (400 + 600) / 2.
    assert "fa4_jax bf16 hd96 / mean(hd64, hd128): 0.900-0.900 over 1 rows (min at hd96 full 1024)" in lines
    assert "fa4_jax bf16 hd192 / mean(hd128, hd256): 1.000-1.000 over 1 rows (min at hd192 causal 1024)" in lines
    assert not any("fp16 hd192" in line for line in lines), lines  # hd128 causal has no fp16 number
    assert benchmark.consistency_lines([]) == []


def test_benchmark_serving_quick(tmp_path):
    """benchmark_serving.py --quick runs on CPU (XLA reference), checks every row against its float32
    oracle, prints the three tables with their headings and writes the JSON."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out_json = tmp_path / "serving.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "benchmark_serving.py"), "--quick", "--json",
                           str(out_json)], env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-2000:] + proc.stderr[-3000:]
    for heading in ("[1] mixed step", "[2] decode", "[3] chunked prefill", "workload", "page",
                    "ours one call (us)", "ours two calls (us)", "ours ragged (us)", "ours plain (us)", "TB/s",
                    "dense per seq (us)", "TFLOP/s", "CPU/reference"):
        assert heading in out, (heading, out[-3000:])
    # FlashAttention-4 (PyTorch) is never compared on CPU: one line says why, its columns are left out.
    assert "FlashAttention-4: " in out and "FA4 (us)" not in out
    assert "WRONG" not in out and "n/a" not in out, out[-3000:]
    assert "refused" not in out  # every page size runs through both APIs (page size 1 included)
    data = json.loads(out_json.read_text())
    rows = data["mixed"] + data["decode"] + data["chunked_prefill"]
    assert [r["page_size"] for r in data["decode"]] == [1, 16, "contiguous"]
    for r in rows:  # our ragged call was checked and timed in every row
        ours = r.get("ours_one_call") or r.get("ours_ragged")
        assert ours["rel_err"] < 2e-2 and ours["us"] > 0, r


def _fake_gpu(capability):
    import types

    return types.SimpleNamespace(platform="gpu", compute_capability=capability, device_kind="NVIDIA TEST", id=0)


@pytest.mark.parametrize("capability,family,runs", [
    ("9.0", "kvcache", True), ("10.0", "fwd", True), ("10.0", "varlen", True), ("10.0", "kvcache", True),
    ("8.0", "fwd", False),
])
def test_benchmarks_measure_only_the_kernels_a_gpu_has(monkeypatch, capability, family, runs):
    # The benchmarks ask benchmark.kernel_device(family) first: a Blackwell GPU has every family's
    # kernels (opt-in); an older GPU none, and the benchmarks say so instead of failing.
    import jax

    sys.path.insert(0, str(ROOT / "examples"))
    import benchmark

    gpu = _fake_gpu(capability)
    monkeypatch.setattr(jax, "devices", lambda platform=None: [gpu])
    device, why = benchmark.kernel_device(family)
    assert (device is gpu) == runs and (why is None) == runs, why


@pytest.mark.parametrize("capability", ["9.0", "10.0"])
def test_serving_benchmark_times_the_page_sizes_the_kernels_serve(monkeypatch, capability):
    # Both architectures' KV-cache kernels serve every page size (16-row pieces or rows). A build whose
    # menu reads pages in 16-row pieces only (as Blackwell's did before its one-row gather) would time
    # cuDNN or the reference at 1, 5, 100: the serving benchmark leaves those out (and says so).
    sys.path.insert(0, str(ROOT / "examples"))
    import benchmark

    import fa4_jax.families as families

    sizes = (1, 5, 16, 48, 64, 100)
    assert benchmark.kvcache_page_sizes(_fake_gpu(capability), sizes) == sizes
    arch = {"9.0": "sm90", "10.0": "sm100"}[capability]
    menu = tuple(v for v in families.default_menu() if not (v.arch == arch and getattr(v, "page_rows", 16) == 1))
    monkeypatch.setattr(families, "default_menu", lambda: menu)
    assert benchmark.kvcache_page_sizes(_fake_gpu(capability), sizes) == (16, 48, 64)


def test_benchmarks_without_a_gpu_say_why():
    sys.path.insert(0, str(ROOT / "examples"))
    import benchmark

    device, why = benchmark.kernel_device("fwd")
    assert device is None and why.startswith("no GPU (default backend 'cpu'")
