"""The SASS of the kernels inside an exported object, so that tests can check which instructions a
GPU-blind build really emitted (issue 16: the Blackwell kernels are verified statically -- no
sm_100 GPU runs them in CI).

Build- and test-time only, stdlib only (plus cubin.py, also stdlib): the cubins are cut out of
the object here and handed to NVIDIA's `nvdisasm`, which CUDA 13.0's /usr/local/cuda does not
ship; the `nvidia-cuda-nvdisasm` wheel does (`pip install nvidia-cuda-nvdisasm`). cubin.py reads
the same cubins for resources.

Two things the cubins taught (ptxas 13.0 and the DSL's 13.4, ELF ABI version 8):
- the SM number is e_flags bits 8..15, but the architecture-specific `a` is not in e_flags at all
  (sm_90 and sm_90a cubins have the same 0x06005a04; LLVM's EF_CUDA_ACCELERATORS bit 0x8 is clear
  in both): it is attribute 0x09 of the `.nv.compat` section, 1 for `a`. Flipping that one byte
  flips what cuobjdump (`sm=90a`) and nvdisasm (`.target sm_90a`) print; editing the `-arch` in the
  ptxas command line that `.note.nv.tkinfo` records does not.
  `sm_100f` cubins are byte-identical to `sm_100` ones but for the ptxas command line in the
  `.note.nv.tkinfo` note, so a family target reads back as the plain one.
- the DSL names kernels `kernel_cutlass_<fn>_<module+class>_object_at__<mangled args>` cut to a
  fixed length with an `_<n>` suffix, so tests should match kernels by substring.
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from fa4_jax.aot.cubin import EM_CUDA, section_headers

PIP_HINT = "pip install nvidia-cuda-nvdisasm"
_SHT_NOBITS = 8
_COMPAT_ARCH_SPECIFIC = 0x09  # .nv.compat attribute: 1 for an `a` target
_EF_CUDA_ACCELERATORS_V1 = 0x800  # the `a` bit of the pre-ABI-8 layout (SM in the low byte)
_EF_CUDA_ACCELERATORS = 0x8  # LLVM's `a` bit for ABI 8; ptxas 13 leaves it clear, others may not


class NvdisasmNotFound(RuntimeError):
    """No nvdisasm to run; the message says how to install one."""


def _executable(path) -> str | None:
    return str(path) if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def _wheel_nvdisasm() -> str | None:
    # The folder under `nvidia/` is the wheel's choice (cu13/bin for the 13.x wheels) and not the
    # same across CUDA majors, so the installed file list decides; the namespace package is the
    # fallback for copies without metadata (a vendored or --target tree off sys.path's dist-infos).
    try:
        dist = importlib.metadata.distribution("nvidia-cuda-nvdisasm")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for f in (dist.files or []) if dist else []:
        if f.name == "nvdisasm" and f.parent.name == "bin":
            found = _executable(dist.locate_file(f))
            if found:
                return found
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm")):
            found = _executable(candidate)
            if found:
                return found
    return None


def find_nvdisasm() -> str | None:
    """$NVDISASM, `nvdisasm` on PATH, /usr/local/cuda/bin/nvdisasm, then the nvidia-cuda-nvdisasm
    wheel's binary; None if none of them is an executable file."""
    return (_executable(os.environ.get("NVDISASM")) or shutil.which("nvdisasm")
            or _executable("/usr/local/cuda/bin/nvdisasm") or _wheel_nvdisasm())


def _require_nvdisasm() -> str:
    found = find_nvdisasm()
    if found is None:
        raise NvdisasmNotFound(
            f"nvdisasm not found (NVDISASM={os.environ.get('NVDISASM')!r}, PATH, /usr/local/cuda/bin, the "
            f"nvidia-cuda-nvdisasm wheel): `{PIP_HINT}` (CUDA 13.0's toolkit does not ship it)")
    return found


def _elf_end(elf: bytes) -> int:
    # The section table need not be last: the cubin ends wherever its furthest header table or
    # section payload does (the object's own bytes follow it).
    shoff, phoff = struct.unpack_from("<Q", elf, 0x28)[0], struct.unpack_from("<Q", elf, 0x20)[0]
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", elf, 0x36)
    end = max(0x40, shoff + shentsize * shnum, phoff + phentsize * phnum)
    for _name, typ, off, size in section_headers(elf):
        if typ != _SHT_NOBITS:
            end = max(end, off + size)
    return end


def embedded_cubins(path) -> list[bytes]:
    """The CUDA ELFs embedded in a file (an exported object: one; the linked library: one per
    variant), each cut to its own length so that a disassembler can read it as a file.

    cubin.py finds the same ELFs but reads them in place; nvdisasm needs each as a file of its own.
    """
    data = Path(path).read_bytes()
    cubins, pos = [], 0
    while (start := data.find(b"\x7fELF", pos)) >= 0:
        elf = data[start:]
        if len(elf) < 0x40 or elf[4] != 2 or struct.unpack_from("<H", elf, 0x12)[0] != EM_CUDA:
            pos = start + 1  # the host object or library itself, or bytes that happen to match
            continue
        end = _elf_end(elf)
        cubins.append(elf[:end])
        pos = start + end
    return cubins


def _compat_attrs(elf: bytes, off: int, size: int) -> dict[int, int]:
    # Same entry encoding as .nv.info (cubin._info_attrs), but .nv.compat uses the 4-byte
    # one-byte-value form (format 2) that .nv.info never does.
    attrs, p = {}, off
    while p + 2 <= off + size:
        fmt, attr = elf[p], elf[p + 1]
        if fmt == 2:
            attrs[attr] = elf[p + 2]
            p += 4
        elif fmt == 3:
            attrs[attr] = struct.unpack_from("<H", elf, p + 2)[0]
            p += 4
        elif fmt == 4:
            p += 4 + struct.unpack_from("<H", elf, p + 2)[0]
        else:
            p += 2
    return attrs


def elf_arch(elf: bytes) -> str:
    """'sm_100a' / 'sm_90a' / 'sm_90' ... of one cubin."""
    flags = struct.unpack_from("<I", elf, 0x30)[0]
    if elf[8] >= 8:  # EI_ABIVERSION: CUDA 12.8+ moved the SM number up a byte
        sm = (flags >> 8) & 0xFF
        compat = next((_compat_attrs(elf, off, size) for name, _t, off, size in section_headers(elf)
                       if name == ".nv.compat"), {})
        accel = compat.get(_COMPAT_ARCH_SPECIFIC) == 1 or bool(flags & _EF_CUDA_ACCELERATORS)
    else:
        sm, accel = flags & 0xFF, bool(flags & _EF_CUDA_ACCELERATORS_V1)
    return f"sm_{sm}{'a' if accel else ''}"


def cubin_arch(obj_path) -> set[str]:
    """The architectures of the cubins embedded in a file, e.g. {"sm_100a"}."""
    return {elf_arch(elf) for elf in embedded_cubins(obj_path)}


_HEADER = re.compile(r"^//-+ (\S+)\s*-+$")


def split_functions(listing: str) -> dict[str, str]:
    """nvdisasm's listing cut at its `//----- .text.<name> -----` banners: {name: that function's
    text}. The banner pads short names with spaces; the non-code banners (SYMBOLS, and the data
    sections when -c is not given) end the function before them."""
    out: dict[str, str] = {}
    name, lines = None, []
    for line in listing.splitlines():
        m = _HEADER.match(line)
        if m:
            if name is not None:
                out[name] = "\n".join(lines) + "\n"
            name = m.group(1)[len(".text."):] if m.group(1).startswith(".text.") else None
            lines = []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines) + "\n"
    return out


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> str:
    """nvdisasm -c (code sections only) of one cubin."""
    nvdisasm = nvdisasm or _require_nvdisasm()
    with tempfile.TemporaryDirectory(prefix="fa4_sass.") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{nvdisasm} -c failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def cubin_sass(path, nvdisasm: str | None = None) -> list[dict[str, str]]:
    """For each cubin embedded in a file, {kernel name: its SASS}."""
    nvdisasm = nvdisasm or _require_nvdisasm()
    return [split_functions(disassemble(elf, nvdisasm)) for elf in embedded_cubins(path)]


def kernel_sass(obj_path, nvdisasm: str | None = None) -> dict[str, str]:
    """{kernel name: SASS} over all the cubins of an exported object. Raises NvdisasmNotFound
    (saying `pip install nvidia-cuda-nvdisasm`) when there is no nvdisasm to run."""
    merged: dict[str, str] = {}
    for kernels in cubin_sass(obj_path, nvdisasm):
        merged.update(kernels)
    return merged


# `/*0700*/   @!UP0 UTCHMMA gdesc[UR20], ...` -> UTCHMMA; a `{` opens a dual-issue pair in the
# listings of older architectures.
_INSTR = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+\{?\s*(?:@!?[A-Z]*P[A-Z0-9]*\s+)?([A-Z][A-Z0-9_]*)")


def opcode_counts(sass_text: str) -> collections.Counter:
    """How often each base opcode (the mnemonic before its first '.', predicate dropped) occurs:
    UTCHMMA, LDTM, UTMALDG, HGMMA, ..."""
    return collections.Counter(m.group(1) for line in sass_text.splitlines() if (m := _INSTR.match(line)))


# `.L_x_12:` (a label on a line of its own) and `BRA `(.L_x_12)` (a branch to it).
_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_ADDR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/")
_BRANCH = re.compile(r"\bBRA\b[^;]*\(\.(L_x_\d+)\)")


def loop_bodies(sass_text: str) -> list[tuple[int, int, collections.Counter]]:
    """The loops of one function's SASS: for each backward branch, (target address, branch address,
    base-opcode counts of the instructions from the target to the branch, both included). A loop
    with inner loops or early exits is counted whole: a static count of one pass over the body,
    which is what a per-block comparison of two kernels' mainloops needs (docs/PERF.md, 2026-12-06)."""
    labels: dict[str, int] = {}
    pending: list[str] = []
    instrs: list[tuple[int, str]] = []
    for line in sass_text.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        a, op = _ADDR.match(line), _INSTR.match(line)
        if a and op:
            addr = int(a.group(1), 16)
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append((addr, line))
    loops = []
    for addr, line in instrs:
        m = _BRANCH.search(line)
        target = labels.get(m.group(1)) if m else None
        if target is not None and target <= addr:
            body = "\n".join(text for a, text in instrs if target <= a <= addr)
            loops.append((target, addr, opcode_counts(body)))
    return loops
