"""Shared pytest setup: the `gpu` and `kernel_family` markers, when GPU tests run, skip or fail, and the
end-of-run count of kernel cases.

Tests marked `@pytest.mark.gpu` need a CUDA GPU that the shipped kernels are built for visible to jax:
compute capability 9.x (Hopper), or 10.x (Blackwell, whose kernels are opt-in until a run validates them;
the tests name their variants with the GPU's architecture, gpu_menu.device_arch). Without a GPU they are skipped with a reason that
says what was found, so a CPU-only CI run stays green and fast. On a GPU host a broken setup fails
them instead (tests/gpu_menu.py says exactly when).

`@pytest.mark.kernel_family("kvcache", ...)` names the kernel families a GPU test runs; the run ends
with one line per family: how many of its cases ran on the kernel and how many were skipped (with
pytest-xdist, counted in the controller from each report's user_properties).
"""

from __future__ import annotations

import collections

import pytest

import gpu_menu

GPU_MARKER = ("gpu: needs a CUDA GPU the kernels are built for (9.x Hopper, 10.x Blackwell) visible to jax; "
              "skipped elsewhere")
FAMILY_MARKER = ("kernel_family(*names): the kernel families (fa4_jax.families: fwd, kvcache, varlen) a gpu test "
                 "runs, counted in the end-of-run summary; no names: none")
FAMILY_PROPERTY = "fa4_kernel_families"  # user_properties key: travels with every report, also from xdist workers


def pytest_configure(config):
    # Registered here rather than only in pyproject.toml so `--strict-markers` works whatever the
    # packaging config says.
    config.addinivalue_line("markers", GPU_MARKER)
    config.addinivalue_line("markers", FAMILY_MARKER)


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("kernel_family")
        if marker is not None and marker.args:
            item.user_properties.append((FAMILY_PROPERTY, ",".join(marker.args)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    action, reason = gpu_menu.gpu_status()
    if action == "fail":
        pytest.fail(reason, pytrace=False)
    if action == "skip":
        pytest.skip(reason)


# nodeid -> [families, outcome] of every kernel-family case reported to this process (with xdist, the
# controller receives every worker's reports).
_KERNEL_CASES: dict[str, list] = {}


def _families(report) -> list[str]:
    for entry in getattr(report, "user_properties", ()):
        if len(entry) == 2 and entry[0] == FAMILY_PROPERTY:
            return str(entry[1]).split(",")
    return []


def pytest_runtest_logreport(report):
    families = _families(report)
    if not families:
        return
    state = _KERNEL_CASES.setdefault(report.nodeid, [families, "error"])
    if report.skipped:
        state[1] = "skipped"
    elif report.when == "call":
        state[1] = "passed" if report.passed else "failed"
    elif report.failed:  # setup (a broken GPU setup, a missing library) or teardown
        state[1] = "failed" if state[1] in ("passed", "failed") else "error"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput") or not _KERNEL_CASES:  # an xdist worker: the controller reports
        return
    counts = collections.defaultdict(collections.Counter)
    for families, outcome in _KERNEL_CASES.values():
        for family in families:
            counts[family][outcome] += 1
    terminalreporter.write_sep("=", "fa4_jax kernel cases")
    for family in sorted(counts):
        c = counts[family]
        terminalreporter.write_line(
            f"fa4_jax kernel cases, {family}: {c['passed'] + c['failed']} ran on the kernel ({c['passed']} passed, "
            f"{c['failed']} failed), {c['skipped']} skipped, {c['error']} errors")


@pytest.fixture
def kernel_library(monkeypatch):
    """Pretend the kernel library holds every variant, for tests of what the CUDA lowering emits
    (they export for CUDA from this host, where the lowering asks only the library: see
    fa4_jax/core/lowering.py). Without it those tests would depend on which variants a build has."""
    from fa4_jax.core import platform as _platform

    monkeypatch.setattr(_platform, "library_reason", lambda make_variant: None)


@pytest.fixture(scope="session")
def kernel_variants() -> frozenset:
    """The kernel library's variants (FFI targets registered); a GPU test without a usable library fails."""
    return gpu_menu.kernel_variants()
