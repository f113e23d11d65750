"""The registry of kernel families (the vocabulary they are described in: fa4_jax/families/base.py)
and the build menu.

Each family is described in its own folder, fa4_jax/ops/<family>/spec.py (variant dataclass,
KernelFamily, FFI call signature); adding one is that folder, its kernel entry and handler, and one
line in FAMILIES below (BUILD.md, "Adding a family"). Nothing else lists families: the exporter,
CMake, the generated C++ registry and fa4_jax.core.library all iterate FAMILIES.

The descriptions import neither cutlass nor jax themselves: they are read at build time and at run
time alike.
"""

from __future__ import annotations

import os
from dataclasses import fields

from fa4_jax.families.base import ARCH_CC, DTYPES, VALIDATED_ARCHES, Companion, KernelFamily, Variant
from fa4_jax.ops.fwd.spec import FWD, HEAD_DIMS, MASKS, FwdVariant, mask_kind
from fa4_jax.ops.kvcache.spec import KVCACHE, KVCacheVariant
from fa4_jax.ops.varlen.spec import VARLEN, VarlenVariant

FAMILIES: tuple[KernelFamily, ...] = (FWD, KVCACHE, VARLEN)
# A symbol prefix names one family or one companion (description_of and variant_from_symbol take the
# first match): two families sharing a companion must share the Companion object itself.
_PREFIXES = [d.variant.FAMILY_PREFIX for d in {id(d): d for f in FAMILIES for d in (f, *f.companions)}.values()]
if len(set(_PREFIXES)) != len(_PREFIXES) or any(a != b and a.startswith(b + "_") for a in _PREFIXES
                                                 for b in _PREFIXES):
    raise ValueError(f"kernel families and companions need distinct symbol prefixes: {sorted(_PREFIXES)}")

MENU_ENV = "FA4_JAX_VARIANTS"

__all__ = [
    "ARCH_CC", "DTYPES", "FAMILIES", "FWD", "FwdVariant", "HEAD_DIMS", "KVCACHE", "KVCacheVariant", "KernelFamily",
    "MASKS", "MENU_ENV", "VALIDATED_ARCHES", "VARLEN", "VarlenVariant",
    "Variant", "default_menu", "description_of", "family_of", "mask_kind", "menu_from_env", "objects_of",
    "variant_from_symbol",
]


def family_of(variant) -> KernelFamily:
    for fam in FAMILIES:
        if type(variant) is fam.variant:  # exact: the families share AttentionVariant's fields
            return fam
    raise TypeError(f"{variant!r} is not a variant of any kernel family")


def description_of(variant) -> KernelFamily | Companion:
    """What makes and checks `variant`'s object (its `compile`, `tensors` and `scalars`): its family,
    or for a companion variant (e.g. the KV-cache split combine) that companion."""
    for fam in FAMILIES:
        if type(variant) is fam.variant:
            return fam
        for comp in fam.companions:
            if type(variant) is comp.variant:
                return comp
    raise TypeError(f"{variant!r} is not a variant of any kernel family or companion")


def variant_from_symbol(symbol: str):
    """The variant an exported symbol names, whatever its family (or companion); ValueError if none."""
    for desc in (d for fam in FAMILIES for d in (fam, *fam.companions)):
        if symbol.startswith(desc.variant.FAMILY_PREFIX + "_"):
            return desc.variant.from_symbol(symbol)
    raise ValueError(f"{symbol=} names no variant of the families {[f.name for f in FAMILIES]}")


def objects_of(menu) -> list:
    """Every variant the build compiles an object for: `menu`, then the companion variants its
    variants launch, each once (sorted by symbol)."""
    companions = {comp.of(v) for v in menu for comp in family_of(v).companions}
    return list(menu) + sorted(companions, key=lambda c: c.symbol)


def default_menu() -> tuple:
    """Every variant of every family that `pip install` builds by default."""
    return tuple(v for fam in FAMILIES for v in fam.default_menu())


def _parse_pattern(pattern: str) -> tuple[str | None, dict[str, str]]:
    """`[family:]field=value[,field=value...]` -> (family name or None, {field: value})."""
    family, sep, rest = pattern.partition(":")
    if not sep:
        family, rest = None, pattern
    want = {}
    for item in rest.split(","):
        if not item.strip():
            continue
        key, _, value = item.strip().partition("=")
        want[key.strip()] = value.strip().lower()
    return (family.strip() if family else None), want


def menu_from_env(environ=os.environ) -> tuple:
    """The build menu, narrowed by FA4_JAX_VARIANTS for quick iteration.

    FA4_JAX_VARIANTS holds `;`-separated patterns `[family:]field=value[,field=value]`; a variant is
    built when it matches any pattern (a pattern without `family:` applies to every family that has
    all the fields it names). Examples:
      FA4_JAX_VARIANTS="dtype=bf16,head_dim=128"             -> every family, bf16 hd128 only
      FA4_JAX_VARIANTS="fwd:head_dim=64;fwd:head_dim=128,mask=causal,softcap=false"
    Unset or empty means the full default menu.
    """
    spec = environ.get(MENU_ENV, "").strip()
    menu = default_menu()
    if not spec:
        return menu
    patterns = [_parse_pattern(p) for p in spec.split(";") if p.strip()]
    known = {f.name: {x.name for x in fields(f.variant)} for f in FAMILIES}
    for family, want in patterns:
        if family is not None and family not in known:
            raise ValueError(f"{MENU_ENV}: unknown family {family!r}; expected one of {sorted(known)}")
        candidates = [family] if family else list(known)
        if not any(set(want) <= known[f] for f in candidates):
            bad = sorted(set(want) - set().union(*(known[f] for f in candidates)))
            raise ValueError(f"{MENU_ENV}: unknown field(s) {bad}; fields are {known}")

    def chosen(v) -> bool:
        fam = family_of(v).name
        names = known[fam]
        return any((f in (None, fam)) and set(want) <= names and v.matches(want) for f, want in patterns)

    picked = tuple(v for v in menu if chosen(v))
    if not picked:
        raise ValueError(f"{MENU_ENV}={spec!r} selects no variant of the default menu")
    return picked
