"""Kernel variant keys: one frozen dataclass per compiled kernel.

This module is imported both at build time (the AOT exporter) and at run time (dispatch checks in
Python, symbol lookup), so it must stay pure Python: no `cutlass`, no `jax`.

A variant's `symbol` is the name its object file, header, C wrapper and dispatch-table entry carry,
so the key, the exported symbol and the run-time lookup cannot drift apart.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

ARCHES = ("sm90", "sm100")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 96, 128, 192, 256)

_SYMBOL_RE = re.compile(r"^fa4_fwd_(sm\d+)_(bf16|fp16)_hd(\d+)_(causal|full)$")


@dataclass(frozen=True, order=True)
class FwdVariant:
    """One forward-attention kernel: architecture x dtype x head_dim x mask kind."""

    arch: str = "sm90"
    dtype: str = "bf16"
    head_dim: int = 128
    causal: bool = False

    def __post_init__(self):
        if self.arch not in ARCHES:
            raise ValueError(f"unsupported arch: {self.arch=}; expected one of {ARCHES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported dtype: {self.dtype=}; expected one of {DTYPES}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"unsupported head_dim: {self.head_dim=}; expected one of {HEAD_DIMS}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool: {self.causal=}")

    @property
    def symbol(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"fa4_fwd_{self.arch}_{self.dtype}_hd{self.head_dim}_{mask}"

    @classmethod
    def from_symbol(cls, symbol: str) -> "FwdVariant":
        m = _SYMBOL_RE.match(symbol)
        if m is None:
            raise ValueError(f"not a forward-kernel symbol: {symbol=}")
        arch, dtype, hd, mask = m.groups()
        return cls(arch=arch, dtype=dtype, head_dim=int(hd), causal=(mask == "causal"))

    def __str__(self) -> str:  # used in error messages
        return self.symbol


def default_menu() -> tuple[FwdVariant, ...]:
    """Every variant `pip install` builds by default (Hopper kernels only for now)."""
    return tuple(
        FwdVariant("sm90", dtype, hd, causal)
        for dtype in DTYPES
        for hd in HEAD_DIMS
        for causal in (False, True)
    )


def _matches(variant: FwdVariant, pattern: str) -> bool:
    """`pattern` is `field=value[,field=value...]`, e.g. `dtype=bf16,head_dim=128`."""
    want = {}
    for item in pattern.split(","):
        key, _, value = item.strip().partition("=")
        names = {f.name for f in fields(FwdVariant)}
        if key not in names:
            raise ValueError(f"FA4_JAX_VARIANTS: unknown field {key!r}; expected one of {sorted(names)}")
        want[key] = value.strip().lower()
    return all(str(getattr(variant, k)).lower() == v for k, v in want.items())


def menu_from_env(environ=os.environ) -> tuple[FwdVariant, ...]:
    """The build menu, narrowed by the FA4_JAX_VARIANTS knob for quick iteration.

    FA4_JAX_VARIANTS holds `;`-separated patterns, each `field=value[,field=value]`; a variant is
    built when it matches any pattern. Examples:
      FA4_JAX_VARIANTS="dtype=bf16,head_dim=128"            -> 2 variants (causal and not)
      FA4_JAX_VARIANTS="head_dim=64;head_dim=128,causal=true"
    Unset or empty means the full default menu.
    """
    spec = environ.get("FA4_JAX_VARIANTS", "").strip()
    menu = default_menu()
    if not spec:
        return menu
    chosen = tuple(v for v in menu if any(_matches(v, p) for p in spec.split(";") if p.strip()))
    if not chosen:
        raise ValueError(f"FA4_JAX_VARIANTS={spec!r} selects no variant of the default menu")
    return chosen
