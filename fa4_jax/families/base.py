"""What a kernel family is, as data: the one description the exporter, the generated C++ table and
the Python registration all read.

A *family* is a set of kernels that share one exported C ABI, one C++ params struct, one FFI target
and one handler (dense forward, KV-cache decode, varlen; SM100 kernels of
an existing family are new variants of it, not a new family). A *variant* is one compiled kernel:
a frozen dataclass whose fields are the compile key and the dispatch key, and whose `symbol` names the
object file, the C wrapper, the table row and error messages.

Pure Python on purpose: imported at build time (fa4_jax.aot) and at run time (fa4_jax._ffi,
fa4_jax._platform), so it must import neither `cutlass` nor `jax`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

# Architectures a variant may target, and the compute capability (major*10+minor) its cubin runs on.
# The generated dispatch tables compare this number with the device's at run time.
ARCH_CC = {"sm90": 90, "sm100": 100}
# CuTe-DSL --gpu-arch for each architecture (arch-specific features: wgmma/setmaxnreg, tcgen05).
GPU_ARCH_FLAG = {"sm90": "sm_90a", "sm100": "sm_100a"}
DTYPES = ("bf16", "fp16")
DTYPE_CPP = {"bf16": "::fa4_jax::DType::kBF16", "fp16": "::fa4_jax::DType::kFP16"}


def camel(name: str) -> str:
    """`full` -> `Full`, `split_kv` -> `SplitKv`: C++ enumerator and type spelling."""
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


@dataclass(frozen=True)
class Field:
    """One field of a family's generated C++ params struct (filled by the hand-written handler)."""

    c_type: str
    name: str
    comment: str = ""


@dataclass(frozen=True)
class TensorArg:
    """One tensor argument of the exported kernels: its name (the kernel's parameter name, hence the
    exported struct `<symbol>_Tensor_<name>_t`) and the C++ expressions over the params struct `p`
    that fill its data pointer, dynamic shapes and dynamic strides, in the kernel's mode order."""

    name: str
    data: str
    shapes: tuple[str, ...]
    strides: tuple[str, ...]


@dataclass(frozen=True)
class ScalarArg:
    """One scalar argument of the exported wrapper, after the tensors and before the stream."""

    c_type: str
    name: str
    expr: str


def params_as_scalars(params: tuple[Field, ...], *names: str) -> tuple[ScalarArg, ...]:
    """Scalar kernel arguments passed straight from same-named params fields (the common case)."""
    by_name = {f.name: f for f in params}
    return tuple(ScalarArg(by_name[n].c_type, n, f"p.{n}") for n in names)


@dataclass(frozen=True)
class KeyField:
    """One field of the C++ dispatch key: the variant dataclass field `name`, its C++ type, and how
    a value becomes a C++ literal."""

    name: str
    c_type: str
    literal: Callable[[Any], str]


def int_literal(v) -> str:
    return str(int(v))


def bool_literal(v) -> str:
    return "true" if v else "false"


def arch_literal(v) -> str:
    return str(ARCH_CC[v])


def dtype_literal(v) -> str:
    return DTYPE_CPP[v]


def enum_literal(enum: str) -> Callable[[str], str]:
    return lambda v: f"{enum}::k{camel(v)}"


@dataclass(frozen=True)
class KernelFamily:
    """Everything about one family that is not kernel code. See the module docstring."""

    name: str  # C++ namespace fa4_jax::gen::<name>, generated file fa4_<name>.inc
    target: str  # FFI target; the library exports <target>_initialize and <target>_execute
    variant: type  # frozen dataclass (see Variant)
    params: tuple[Field, ...]  # C++ struct fa4_jax::gen::<name>::Params
    tensors: tuple[TensorArg, ...]
    scalars: tuple[ScalarArg, ...]  # the stream (cudaStream_t p.stream) is always appended
    key: tuple[KeyField, ...]  # C++ struct fa4_jax::gen::<name>::Key, compared field by field
    enums: dict[str, tuple[str, ...]]  # generated `enum class E : int { kA, kB }`, e.g. Mask
    handler: str  # the hand-written C++ handler source, relative to the repository root
    compile: str  # "module:function" that compiles one variant GPU-blind (build time only)
    default_menu: Callable[[], tuple]

    def __post_init__(self):
        names = {f.name for f in fields(self.variant)}
        missing = [k.name for k in self.key if k.name not in names]
        if missing:
            raise ValueError(f"family {self.name}: key fields {missing} are not fields of {self.variant.__name__}")


class Variant:
    """Mixin for variant dataclasses: the symbol <-> key codec and menu filtering.

    Subclasses set FAMILY_PREFIX (e.g. "fa4_fwd") and implement `_symbol_parts()` (the parts after
    the prefix, joined by "_") and `_from_parts(parts)`.
    """

    FAMILY_PREFIX: ClassVar[str]

    @property
    def symbol(self) -> str:
        return "_".join((self.FAMILY_PREFIX, *self._symbol_parts()))

    @classmethod
    def from_symbol(cls, symbol: str):
        prefix = cls.FAMILY_PREFIX + "_"
        if not symbol.startswith(prefix):
            raise ValueError(f"not a {cls.__name__} symbol: {symbol=}")
        try:
            variant = cls._from_parts(symbol[len(prefix):].split("_"))
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise ValueError(f"not a {cls.__name__} symbol: {symbol=} ({e})") from None
        if variant.symbol != symbol:  # e.g. a non-canonical spelling of some field
            raise ValueError(f"not a canonical {cls.__name__} symbol: {symbol=} (would be {variant.symbol})")
        return variant

    def check_fields(self, choices: dict, flags: tuple = ()) -> None:
        """ValueError unless each field in `choices` holds one of its allowed values; TypeError unless
        each field in `flags` is a bool. For the subclasses' __post_init__."""
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"unsupported {name}: self.{name}={value!r}; expected one of {tuple(allowed)}")
        for name in flags:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool: self.{name}={getattr(self, name)!r}")

    def __str__(self) -> str:  # used in error messages
        return self.symbol

    def matches(self, pattern: dict[str, str]) -> bool:
        """`pattern` maps field names to lower-case string values (see menu_from_env)."""
        return all(str(getattr(self, k)).lower() == v for k, v in pattern.items())


def parse_hd(part: str) -> int:
    m = re.fullmatch(r"hd(\d+)", part)
    if m is None:
        raise ValueError(f"expected hd<N>, got {part!r}")
    return int(m.group(1))
