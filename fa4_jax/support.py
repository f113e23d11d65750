"""What runs where: the support matrix of every public entry point, generated from the kernel menu and
the cuDNN mapping, so that README.md's table cannot drift from the code.

    python -m fa4_jax.support            # print the markdown
    python -m fa4_jax.support --write    # rewrite it in README.md (between the support-matrix markers)
    python -m fa4_jax.support --check    # exit 1 if README.md's copy is stale

A cell is one kind of call with `implementation=None`: entry point x device x dtype x head_dim x page
size x mask x sequence lengths x softcap x sinks x return_lse, and says what it lowers to: "kernel"
(an fa4_jax kernel of `fa4_jax.families.default_menu()`, the menu the build compiles and the lowering
asks for), "cuDNN" (`fa4_jax.core.cudnn.feature_reason` is None: jax's cuDNN flash attention computes the
call exactly) or "reference" (the pure-JAX reference). tests/test_support_matrix.py checks README's
copy and samples cells against the lowering's own decisions.

Importing this module needs only the standard library and fa4_jax.families; building the matrix
imports fa4_jax.core.cudnn (jax), never cutlass.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from fa4_jax.families import ARCH_CC, DTYPES, FAMILIES, HEAD_DIMS, VALIDATED_ARCHES, KernelFamily, default_menu
from fa4_jax.families.base import PublicEntry
from fa4_jax.ops.kvcache.spec import PAGE_SIZES


KERNEL, CUDNN, REFERENCE = "kernel", "cuDNN", "reference"
_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Device:
    """A column: `key` names a kernel architecture when it is one of fa4_jax.families.ARCH_CC;
    `capability` is the compute capability cuDNN's conditions are checked at (None: not CUDA)."""

    key: str
    title: str
    capability: str | None


DEVICES = (
    Device("sm80", "Ampere, Ada (sm_8x: A100, L40)", "8.0"),
    Device("sm90", "Hopper (sm_90: H100, H200)", "9.0"),
    Device("sm100", "Blackwell (sm_100: B200)", "10.0"),
    Device("cpu", "CPU and other platforms", None),
)

# Masks, by (left, right) window: the categories that decide the kernel variant and cuDNN's mapping.
# w >= 0 and r > 0 are small here so that no shape below trims them to unbounded (as the API does for
# a side that reaches past every key).
WINDOWS = {
    "none": (-1, -1),
    "causal": (-1, 0),
    "(w, 0)": (16, 0),
    "(w, -1)": (16, -1),
    "(-1, r)": (-1, 4),
    "(w, r)": (16, 4),
}
_WINDOW_TITLES = {
    "none": "no mask", "causal": "causal", "(w, 0)": "causal window `(w, 0)`", "(w, -1)": "left window `(w, -1)`",
    "(-1, r)": "right window `(-1, r)`", "(w, r)": "two-sided window `(w, r)`",
}


@dataclass(frozen=True, eq=False)  # compared (and hashed) by identity: one object per entry point
class EntryPoint:
    """A public entry point (or one cache layout of it), as its family declares it (`PublicEntry` in
    fa4_jax/families/base.py), with the family that serves it."""

    family: KernelFamily
    entry: PublicEntry

    name = property(lambda self: self.entry.name)
    cudnn_entry = property(lambda self: self.entry.cudnn_entry)
    seqlens = property(lambda self: self.entry.seqlens)
    paged = property(lambda self: dict(self.entry.fixed).get("paged", False))  # rows per page size

    @property
    def features(self) -> tuple[tuple[str, tuple], ...]:
        """The feature axes of this entry point's cells and their values (the plainest call first)."""
        return (("mask", tuple(WINDOWS)), ("seqlens", tuple(t for t, _, _ in self.seqlens)),
                ("softcap", (False, True)), ("sinks", (False, True)), ("return_lse", (False, True)))

    def variant(self, arch: str, dtype: str, head_dim: int, mask: str, softcap: bool, seqlens: str | None = None,
                page_size: int | None = None):
        """The kernel this call needs on `arch`, or None when the family has no such kernel (e.g. a
        head_dim outside the family's HEAD_DIMS)."""
        fields = dict(self.entry.fixed)
        if self.entry.shape_fields is not None:
            s_q = next(q for title, q, _ in self.seqlens if title == seqlens)
            fields.update(self.entry.shape_fields(seqlen_q=s_q, page_size=page_size))
        try:
            return self.family.variant(arch=arch, dtype=dtype, head_dim=head_dim,
                                       mask=self.family.kernel_mask(*WINDOWS[mask]),
                                       softcap=softcap, **fields)
        except ValueError:
            return None


ENTRY_POINTS = tuple(EntryPoint(fam, entry) for fam in FAMILIES for entry in fam.entries)
assert {e.family.name for e in ENTRY_POINTS} == {f.name for f in FAMILIES}, "an entry point per kernel family"

BEGIN_MARKER = "<!-- support-matrix:begin -->"
END_MARKER = "<!-- support-matrix:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def shipped_arches() -> tuple[str, ...]:
    """The GPU architectures the default build has kernels for, oldest first."""
    return tuple(sorted({v.arch for v in default_menu()}, key=ARCH_CC.__getitem__))


@functools.lru_cache(maxsize=None)
def _fallback(entry: EntryPoint, device: Device, dtype: str, head_dim: int, mask: str, seqlens: str,
              softcap: bool, sinks: bool) -> str:
    """What `implementation=None` lowers to where no fa4_jax kernel serves the call: on an NVIDIA GPU
    cuDNN when fa4_jax.core.cudnn.feature_reason says it computes the call exactly at that GPU's compute
    capability, else (and on every other platform) the reference."""
    if device.capability is None or not entry.cudnn_entry:  # (a family without a cuDNN mapping)
        return REFERENCE
    from fa4_jax.core import cudnn  # imports jax: only when the matrix is built

    (s_q, s_k), = [(q, k) for title, q, k in entry.seqlens if title == seqlens]
    reason = cudnn.feature_reason(entry.cudnn_entry, dtype=_DTYPE_NAMES[dtype], head_dim=head_dim, seqlen_q=s_q,
                                  seqlen_k=s_k, window=WINDOWS[mask], softcap=30.0 if softcap else 0.0, sinks=sinks,
                                  paged=entry.paged, compute_capability=device.capability)
    return CUDNN if reason is None else REFERENCE


def support_matrix() -> list[dict]:
    """Every cell: one dict per entry point x device x dtype x head_dim x page size x features.

    Keys: entry_point, device (a DEVICES key: "sm80", "sm90", "sm100", "cpu"), dtype ("bf16"/"fp16"),
    head_dim, page_size (None unless paged), mask (a WINDOWS key), seqlens (a title of the entry
    point's `seqlens`), softcap, sinks, return_lse (bools), runs ("kernel", "cuDNN" or "reference")
    variant (the kernel's symbol, or None) and opt_in (a kernel exists but is not validated on hardware:
    implementation="fa4" runs it). Only inputs the API accepts are listed (bf16/fp16,
    its head dims and page sizes)."""
    menu = set(default_menu())
    cells = []
    for ep in ENTRY_POINTS:
        shapes = itertools.product(DTYPES, HEAD_DIMS, PAGE_SIZES if ep.paged else (None,))
        for (dtype, head_dim, page_size), features in itertools.product(
                shapes, itertools.product(*(values for _, values in ep.features))):
            call = dict(zip((a for a, _ in ep.features), features))
            for device in DEVICES:
                variant = ep.variant(device.key, dtype, head_dim, call["mask"], call["softcap"], call["seqlens"],
                                     page_size) if device.key in ARCH_CC else None
                # implementation=None: a kernel not yet validated on hardware is opt-in (platform.py):
                # implementation="fa4" runs it, None the next choice.
                opt_in = variant in menu and variant.arch not in VALIDATED_ARCHES
                variant = variant if variant in menu and not opt_in else None
                runs = KERNEL if variant is not None else _fallback(
                    ep, device, dtype, head_dim, call["mask"], call["seqlens"], call["softcap"], call["sinks"])
                cells.append(dict(entry_point=ep.name, device=device.key, dtype=dtype, head_dim=head_dim,
                                  page_size=page_size, **call, runs=runs, opt_in=opt_in,
                                  variant=None if variant is None else variant.symbol))
    return cells


# ---- the cells as tables ----------------------------------------------------------------------------

_ROW_AXES = ("head_dim", "dtype", "page_size")


@dataclass(frozen=True)
class Row:
    """One row of the main table: the call shapes it covers and, per device, what runs for each
    feature combination ({features tuple: runs}, in the entry point's `features` order)."""

    entry_point: str
    axes: tuple[tuple[str, frozenset], ...]  # _ROW_AXES -> the values covered
    outcome: tuple[tuple[str, tuple], ...]  # device key -> sorted ((features, runs, opt_in), ...)

    def covers(self, cell: dict) -> bool:
        return cell["entry_point"] == self.entry_point and all(cell[a] in vals for a, vals in self.axes)

    def predicts(self, cell: dict) -> str:
        entry = _entry(self.entry_point)
        runs = {f: r for f, r, _ in dict(self.outcome)[cell["device"]]}
        return runs[tuple(cell[a] for a, _ in entry.features)]


def _entry(name: str) -> EntryPoint:
    (entry,) = [e for e in ENTRY_POINTS if e.name == name]
    return entry


def support_rows(cells: list[dict] | None = None) -> list[Row]:
    """The main table: per entry point, call shapes (head_dim, dtype, page size) that run the same
    thing on every device for every feature combination are merged into one row."""
    cells = support_matrix() if cells is None else cells
    rows = []
    for ep in ENTRY_POINTS:
        outcomes: dict[tuple, dict] = {}
        for c in cells:
            if c["entry_point"] == ep.name:
                per_device = outcomes.setdefault(tuple(c[a] for a in _ROW_AXES), {})
                per_device.setdefault(c["device"], []).append(
                    (tuple(c[a] for a, _ in ep.features), c["runs"], c["opt_in"]))
        boxes = {tuple(frozenset([v]) for v in key): tuple((d, tuple(sorted(o))) for d, o in sorted(per.items()))
                 for key, per in outcomes.items()}
        changed = True
        while changed:  # merge boxes with equal outcomes along one axis at a time
            changed = False
            for i in range(len(_ROW_AXES)):
                groups: dict[tuple, list] = {}
                for box, outcome in boxes.items():
                    groups.setdefault((box[:i] + box[i + 1:], outcome), []).append(box)
                boxes = {}
                for (rest, outcome), members in groups.items():
                    boxes[rest[:i] + (frozenset().union(*(b[i] for b in members)),) + rest[i:]] = outcome
                    changed |= len(members) > 1
        order = dict(head_dim=HEAD_DIMS, dtype=DTYPES, page_size=PAGE_SIZES if ep.paged else (None,))
        for box in sorted(boxes, key=lambda b: [min(order[a].index(v) for v in vals) for a, vals in zip(_ROW_AXES, b)]):
            rows.append(Row(ep.name, tuple(zip(_ROW_AXES, box)), boxes[box]))
    return rows


def cudnn_features(entry: EntryPoint, cells: list[dict]) -> frozenset:
    """The feature combinations of `entry` that run cuDNN on some GPU without a kernel (the same set
    wherever cuDNN runs at all: checked when the table is made)."""
    return frozenset(tuple(c[a] for a, _ in entry.features) for c in cells
                     if c["entry_point"] == entry.name and c["runs"] == CUDNN)


def _cell_text(entry: EntryPoint, device: Device, outcome: tuple, cudnn_set: frozenset) -> str:
    runs = {f: r for f, r, _ in outcome}
    opt_in = {o for *_, o in outcome}
    if len(opt_in) > 1:
        raise ValueError(f"{entry.name} on {device.key}: opt-in kernels for some feature combinations only: {outcome}")
    values = set(runs.values())
    if values == {KERNEL}:
        return KERNEL
    if values == {REFERENCE}:
        text = REFERENCE
    elif KERNEL not in values and {f for f, r in runs.items() if r == CUDNN} == cudnn_set:
        text = "cuDNN\\*, else reference"
    else:
        raise ValueError(f"{entry.name} on {device.key}: a mix of {sorted(values)} the table cannot state: {outcome}")
    if opt_in == {True}:
        return f"**opt-in kernel**: {text}"
    return f"**no kernel**: {text}" if device.key in shipped_arches() else text


def _entry_text(name: str) -> str:
    """`attention_with_kvcache (paged)` -> the function in code font, the layout after it."""
    function, _, layout = name.partition(" ")
    return f"`{function}` {layout}".rstrip()


def _values_text(values: frozenset, ordering: tuple) -> str:
    return "–" if values == frozenset([None]) else ", ".join(str(v) for v in ordering if v in values)


def _cudnn_table(cells: list[dict]) -> list[str]:
    """cuDNN\\*: per entry point and mask, the sequence lengths for which cuDNN serves the call."""
    lines = ["| cuDNN\\* serves | " + " | ".join(_WINDOW_TITLES[w] for w in WINDOWS) + " | softcap or sinks |",
             "|---" * (len(WINDOWS) + 2) + "|"]
    for ep in ENTRY_POINTS:
        combos = cudnn_features(ep, cells)
        titles = [t for t, _, _ in ep.seqlens]
        cols = []
        for mask in WINDOWS:
            ok = [t for t in titles if any(f[0] == mask and f[1] == t for f in combos)]
            cols.append("any lengths" if ok == titles else " or ".join(ok) if ok else "no")
        cols.append("yes" if any(f[2] or f[3] for f in combos) else "no")
        lines.append(f"| {_entry_text(ep.name)} | " + " | ".join(cols) + " |")
    return lines


NOTES = (
    "Each row holds for every mask, softcap, sinks and `return_lse`, unless it says cuDNN\\*: the cells are "
    "what `implementation=None` lowers to. kernel: an fa4_jax kernel of the default build (a build narrowed "
    "by `FA4_JAX_VARIANTS`, a missing library or a kernel that does not load leaves the call to the next "
    "choice). cuDNN\\*: `jax.nn.dot_product_attention`'s cuDNN flash attention where it computes exactly "
    "fa4_jax's semantics, the reference for every other call; the table below says where, from "
    "`fa4_jax/core/cudnn.py`, which explains why (cuDNN's masks are aligned top-left, ours bottom-right; it has no "
    "softcap or sinks; paged caches and packed batches are not mapped). cuDNN also needs cuDNN >= 9.0 in "
    "jax (9.11 on compute capability 10.3), head_dim <= 128 below compute capability 9.0, static shapes, "
    "and a GPU known while lowering: a program exported without one (e.g. from a CPU host) keeps the "
    "kernel-or-reference choice. `FA4_JAX_DISABLE_CUDNN=1` turns cuDNN off; `implementation=\"cudnn\"` "
    "demands it, `\"fa4\"` the kernel (each raises where it cannot run), `\"xla\"` runs the reference. "
    "Zero-size calls (no batch, query or key) run the reference. **opt-in kernel**: the build has a "
    "kernel that no run on hardware has validated yet (SM100, compiled GPU-blind): `implementation=\"fa4\"` "
    "runs it (with a one-time warning), `None` the choice the cell names, and a program exported with "
    "`None` refuses to run it."
)


def support_matrix_markdown() -> str:
    """The README's section between the support-matrix markers: the main table, the cuDNN table, notes."""
    cells = support_matrix()
    lines = [
        "<!-- generated by `python -m fa4_jax.support --write` from fa4_jax.families and fa4_jax.core.cudnn; "
        "do not edit by hand -->",
        "",
        "| entry point | head_dim | dtype | page size | " + " | ".join(d.title for d in DEVICES) + " |",
        "|---" * (4 + len(DEVICES)) + "|",
    ]
    cudnn_sets = {ep.name: cudnn_features(ep, cells) for ep in ENTRY_POINTS}
    for row in support_rows(cells):
        axes, outcome, ep = dict(row.axes), dict(row.outcome), _entry(row.entry_point)
        lines.append("| " + " | ".join([
            _entry_text(row.entry_point),
            _values_text(axes["head_dim"], HEAD_DIMS),
            _values_text(axes["dtype"], DTYPES),
            _values_text(axes["page_size"], PAGE_SIZES),
            *(_cell_text(ep, d, outcome[d.key], cudnn_sets[ep.name]) for d in DEVICES),
        ]) + " |")
    lines += ["", textwrap.fill(NOTES, 103, break_long_words=False, break_on_hyphens=False), ""]
    lines += _cudnn_table(cells)
    return "\n".join(lines) + "\n"


def render_into(text: str) -> str:
    """`text` (README.md's contents) with the section between the markers replaced by the generated one."""
    begin, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if begin < 0 or end < begin:
        raise ValueError(f"README has no {BEGIN_MARKER} ... {END_MARKER} section")
    return text[:begin + len(BEGIN_MARKER)] + "\n" + support_matrix_markdown() + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa4_jax.support", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the tables in README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md's tables are not the generated ones")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        sys.stdout.write(support_matrix_markdown())
        return 0
    old = args.readme.read_text()
    new = render_into(old)
    if args.check:
        if new != old:
            print(f"{args.readme}: the support matrix is stale; run `python -m fa4_jax.support --write`",
                  file=sys.stderr)
            return 1
        return 0
    if new != old:
        args.readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
