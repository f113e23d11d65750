"""Shared pytest setup: the `gpu` marker and its auto-skip.

Tests marked `@pytest.mark.gpu` need a CUDA GPU of compute capability 9.x (Hopper) visible to jax: the
only architecture the shipped kernels are built for. Everywhere else they are skipped with a reason
that says what was found, so a CPU-only CI run stays green and fast.
"""

from __future__ import annotations

import functools

import pytest

GPU_MARKER = "gpu: needs a CUDA GPU of compute capability 9.x (Hopper) visible to jax; skipped elsewhere"


def pytest_configure(config):
    # Registered here rather than only in pyproject.toml so `--strict-markers` works whatever the
    # packaging config says.
    config.addinivalue_line("markers", GPU_MARKER)


@functools.lru_cache(maxsize=None)
def hopper_skip_reason() -> str | None:
    """None when a GPU the kernels are built for is visible to jax, else why the gpu tests are skipped.

    Asks fa4_jax._platform, the one place that decides whether the kernels can run on a device."""
    import jax  # imported lazily: a run without gpu tests should not pay for it

    from fa4_jax import _platform

    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # CPU-only jaxlib, or the CUDA plugin failed to initialise
        return f"no CUDA GPU visible to jax (default backend {jax.default_backend()!r})"
    if not devices:
        return "no CUDA GPU visible to jax"
    return _platform.device_unavailable_reason(devices[0])


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    reason = hopper_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def kernel_library(monkeypatch):
    """Pretend the kernel library holds every variant, for tests of what the CUDA lowering emits
    (they export for CUDA from this host, where the lowering asks only the library: see
    fa4_jax/lowering.py). Without it those tests would depend on which variants a build has."""
    from fa4_jax import _platform

    monkeypatch.setattr(_platform, "library_reason", lambda make_variant: None)
