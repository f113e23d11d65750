"""What a kernel family is, as data: the one description the exporter, the generated C++ table and
the Python registration all read.

A *family* is a set of kernels that share one exported C ABI, one C++ params struct, one FFI target
and one handler (dense forward, KV-cache decode, varlen; SM100 kernels of
an existing family are new variants of it, not a new family). A *variant* is one compiled kernel:
a frozen dataclass whose fields are the compile key and the dispatch key, and whose `symbol` names the
object file, the C wrapper, the table row and error messages.

Pure Python on purpose: imported at build time (fa4_jax.aot) and at run time (fa4_jax.core.library,
fa4_jax.core.platform), so it must import neither `cutlass` nor `jax`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

# Architectures a variant may target, and the compute capability (major*10+minor) its cubin runs on.
# The generated dispatch tables compare this number with the device's at run time.
ARCH_CC = {"sm90": 90, "sm100": 100}
# Architectures whose kernels have been run and checked on hardware. The others' kernels are opt-in:
# implementation=None does not pick them (cuDNN or the reference serve the call), implementation="fa4"
# runs them with a one-time warning (fa4_jax.core.platform). SM100 is compiled GPU-blind only: no
# Blackwell GPU has run it yet (issue 16; tools/validate_sm100.py is the first contact).
VALIDATED_ARCHES = frozenset({"sm90"})
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


# ---- the FFI call signature -------------------------------------------------------------------
# A family's XLA FFI call is declared once, as a CallSignature; fa4_jax.aot.codegen generates the C++
# side from it (the binding, the `Call` struct the hand-written Resolve reads, presence attributes of
# optional operands, the dtype/rank/alignment checks, the constants) and fa4_jax.core.ffi_call the
# Python side (operand packing, result shapes, attribute types). Each side is checked against it.

# Element types an FFI buffer may declare: "input" is the call's element type (q's: bf16 or f16; every
# "input" buffer shares it), the others are fixed. Values: the xla::ffi::DataType enumerator(s).
# "cache" is a KV cache's: q's dtype, or float8_e4m3fn (an FP8 cache with its scales).
BUFFER_DTYPES = {"input": ("BF16", "F16"), "cache": ("BF16", "F16", "F8E4M3FN"), "f32": ("F32",), "i32": ("S32",)}
# Attribute kinds: (C++ type, numpy type name) -- the FFI ABI is typed, so both sides must agree.
ATTR_TYPES = {"f32": ("float", "float32"), "i32": ("int32_t", "int32"), "bool": ("bool", "bool_")}


@dataclass(frozen=True)
class Buffer:
    """One operand or result of a family's FFI call.

    dims: symbolic extents, e.g. ("b", "s_q", "h_q", "d"). An operand binds its names to its shape;
      a result's shape is read from them (names no operand binds come from the caller, e.g. the
      workspace's "splits"). Also the rank the handler checks.
    optional (operands): may be absent. The Python side then sends a zero-size array and the
      attribute has_<name> = False; the handler sees std::nullopt. Presence is thus said once.
    fill (operands): absent -> the Python side sends an array of dims filled with this value (the
      kernel always reads the buffer, e.g. sinks of -inf add nothing to a denominator).
    workspace (results): scratch the kernels need, allocated by XLA (CUDA-graph safe); the Python
      wrapper drops it from what it returns.
    """

    name: str
    dtype: str
    dims: tuple[str, ...]
    doc: str = ""
    optional: bool = False
    fill: float | None = None
    workspace: bool = False
    param: str = ""  # the Params pointer field it fills, when not named like the buffer

    def __post_init__(self):
        if self.dtype not in BUFFER_DTYPES:
            raise ValueError(f"buffer {self.name}: dtype {self.dtype!r} not in {sorted(BUFFER_DTYPES)}")
        if self.optional and self.fill is not None:
            raise ValueError(f"buffer {self.name}: optional (absent allowed) or fill (always sent), not both")

    @property
    def align(self) -> int:
        """Bytes the execute stage requires of its address: 16 where the kernels use TMA or 16-byte
        vector accesses (the call's tensors and the workspace), 4 for scalar float/int arrays."""
        return 16 if self.dtype in ("input", "cache") or self.workspace else 4


@dataclass(frozen=True)
class Attr:
    """One attribute of a family's FFI call; `dtype` is a key of ATTR_TYPES."""

    name: str
    dtype: str
    doc: str = ""

    def __post_init__(self):
        if self.dtype not in ATTR_TYPES:
            raise ValueError(f"attribute {self.name}: dtype {self.dtype!r} not in {sorted(ATTR_TYPES)}")

    @property
    def c_type(self) -> str:
        return ATTR_TYPES[self.dtype][0]


@dataclass(frozen=True)
class CallSignature:
    """A family's FFI call: operands, results and attributes in ABI order, and the integer constants
    its Python side and its handler share (generated as C++ `kCamelCase` constants; a tuple of ints
    becomes a constexpr array)."""

    operands: tuple[Buffer, ...]
    results: tuple[Buffer, ...]
    attrs: tuple[Attr, ...]
    constants: tuple[tuple[str, int | tuple[int, ...]], ...] = ()

    def __post_init__(self):
        names = [b.name for b in (*self.operands, *self.results)] + [a.name for a in self.all_attrs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"call signature: names used twice: {dup}")
        if any(b.optional or b.fill is not None for b in self.results):
            raise ValueError("results cannot be optional or filled")
        if any(b.workspace for b in self.operands):
            raise ValueError("operands cannot be workspace")

    @property
    def presence_attrs(self) -> tuple[Attr, ...]:
        """The generated has_<name> attribute of each optional operand, after the declared ones."""
        return tuple(Attr(f"has_{b.name}", "bool", f"whether {b.name} was given") for b in self.operands
                     if b.optional)

    @property
    def all_attrs(self) -> tuple[Attr, ...]:
        return (*self.attrs, *self.presence_attrs, OPT_IN_ATTR)


# Every family's call ends with this generated attribute (after the presence ones): whether the call
# may run kernels of an architecture outside VALIDATED_ARCHES. The lowering sets it for
# implementation="fa4" only, so a program exported with implementation=None refuses, on a GPU whose
# kernels no hardware run has validated, with an FFI error that says how to opt in.
OPT_IN_ATTR = Attr("unvalidated_ok", "bool", 'implementation="fa4": kernels outside VALIDATED_ARCHES may run')

# Limits the Python validation and every handler share (fa4_jax/core/validation.py says why these values);
# generated into fa4_shared.inc for ffi/handler_util.h.
MAX_SOFTMAX_SCALE = 1e4
MAX_SOFTCAP = 1e6
SHARED_CONSTANTS = (("max_softmax_scale", MAX_SOFTMAX_SCALE), ("max_softcap", MAX_SOFTCAP))


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
class PublicEntry:
    """One row group of the support matrix (fa4_jax/support.py): a public function the family serves
    (or one cache layout of it), its name in fa4_jax.core.cudnn ("" = no cuDNN mapping), the kinds of
    sequence lengths that matter to cuDNN's mask mapping as (title, seqlen_q, seqlen_k or cache
    capacity) with small representative values, and the variant fields this row fixes (e.g.
    (("paged", True),)). `shape_fields(seqlen_q, page_size)`, where a variant field follows the
    call's shape (e.g. the KV-cache kernel's query tile and page pieces), gives those fields."""

    name: str
    cudnn_entry: str
    seqlens: tuple[tuple[str, int, int], ...]
    fixed: tuple[tuple[str, Any], ...] = ()
    shape_fields: Callable[..., dict] | None = None


@dataclass(frozen=True)
class Companion:
    """A kernel a family's variants launch after their own when `when` holds (e.g. the KV-cache split
    combine), compiled once per companion variant -- `of(variant)`, a coarser key than the family's --
    instead of into every variant's object. Its exported wrapper takes `tensors` and `scalars`, C++
    expressions over the family's Params `p` like the family's own (the stream is appended); the
    generated Variant row launches it after the variant's kernel and loads it with the variant.

    Its variant dataclass (the Variant mixin, a FAMILY_PREFIX of its own, an `arch` field) names its
    object file and wrapper; `compile` is "module:function", as a family's."""

    name: str  # C++ member names of the Variant row: <name>_symbol, <name>_fn, <name>_module
    variant: type
    of: Callable[[Any], Any]  # a family variant -> the companion variant it launches
    tensors: tuple[TensorArg, ...]
    scalars: tuple[ScalarArg, ...]
    when: str  # C++ condition over `p`: launch it after the variant's kernel
    compile: str


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
    call: CallSignature  # the FFI call: generated C++ binding and Python wrapper
    handler: str  # the hand-written C++ Resolve (checks -> kernel params), relative to the repository root
    compile: str  # "module:function" that compiles one variant GPU-blind (build time only)
    default_menu: Callable[[], tuple]
    # The variant's mask kind for a call's normalised window (left, right; -1 = unbounded): what the
    # lowering, the support matrix and the tests ask for. The handler picks the same kind in C++.
    kernel_mask: Callable[[int, int], str]
    entries: tuple[PublicEntry, ...] = ()  # the public functions it serves, for the support matrix
    # CTAs of a variant resident per SM (its kernel configuration), emitted into the generated
    # Variant table as `ctas_per_sm` for the handler's work split; None: 1 for every variant.
    ctas_per_sm: Callable[[Any], int] | None = None
    # Whether a variant's kernel takes its tiles from a zero-at-rest counter the handler passes (a
    # persistent grid: kernels/tile_scheduler.py TileHandout), emitted as `tile_handout`; None: false
    # (the dense family has no hook: every dense kernel has the handout, and ffi/fwd.cc decides by mask).
    tile_handout: Callable[[Any], bool] | None = None
    # Kernels compiled apart and launched after a variant's own (Companion).
    companions: tuple[Companion, ...] = ()

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
