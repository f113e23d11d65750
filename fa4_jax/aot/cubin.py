"""What the cubins inside the exported objects say about each kernel: its launch registers per
thread (EIATTR_REGCOUNT) and stack frame (EIATTR_FRAME_SIZE: local memory, usually spills), read
from the ELF notes without CUDA tools (this toolkit's ptxas is older than the DSL's PTX and it ships
no cuobjdump).

The build checks one thing with it (`register_pool_problem`): setmaxnreg only moves registers
within the CTA's launch allocation (registers x threads), so warpgroup budgets that need more than
that allocation make the warpgroups that raise theirs wait forever -- a hang on the GPU, which the
build can rule out. `tools/cubin_resources.py` prints the table.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

EIATTR_REGCOUNT, EIATTR_FRAME_SIZE = 0x2F, 0x12
EM_CUDA = 190


def section_headers(elf: bytes):
    """(name, type, offset, size) of each section of an ELF64 (also used by sass.py)."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for name, typ, _flags, _addr, off, size in headers:
        yield elf[strtab + name:elf.index(b"\0", strtab + name)].decode(), typ, off, size


def _sections(elf: bytes):
    for name, _type, off, size in section_headers(elf):
        yield name, off, size


def _symbol_names(elf: bytes) -> dict[int, str]:
    secs = {n: (o, s) for n, o, s in _sections(elf)}
    if ".symtab" not in secs or ".strtab" not in secs:
        return {}
    (sym_off, sym_size), (str_off, _) = secs[".symtab"], secs[".strtab"]
    names = {}
    for i in range(sym_size // 24):  # Elf64_Sym
        name = struct.unpack_from("<I", elf, sym_off + 24 * i)[0]
        names[i] = elf[str_off + name:elf.index(b"\0", str_off + name)].decode()
    return names


def _info_attrs(elf: bytes, off: int, size: int):
    """(attribute, payload) of an .nv.info section's entries."""
    p = off
    while p < off + size:
        fmt, attr = elf[p], elf[p + 1]
        if fmt == 4:  # EIFMT_SVAL: u16 size, then the payload
            n = struct.unpack_from("<H", elf, p + 2)[0]
            yield attr, elf[p + 4:p + 4 + n]
            p += 4 + n
        elif fmt == 3:  # EIFMT_HVAL: a u16 inline
            yield attr, elf[p + 2:p + 4]
            p += 4
        else:  # EIFMT_NVAL
            yield attr, b""
            p += 2


def cubin_resources(path: Path) -> list[dict[str, dict[str, int]]]:
    """For each CUDA ELF embedded in a file (an exported object: one; the linked library: one per
    variant), {kernel name: {"regs": registers per thread, "frame": stack bytes}}."""
    data = Path(path).read_bytes()
    cubins = []
    for start in (m.start() for m in re.finditer(b"\x7fELF", data)):
        elf = data[start:]
        if len(elf) < 0x40 or struct.unpack_from("<H", elf, 0x12)[0] != EM_CUDA:
            continue  # the host object or library itself
        names = _symbol_names(elf)
        kernels: dict[str, dict[str, int]] = {}
        for name, off, size in _sections(elf):
            if name != ".nv.info":
                continue
            for attr, payload in _info_attrs(elf, off, size):
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
                    sym, value = struct.unpack_from("<II", payload)
                    key = "regs" if attr == EIATTR_REGCOUNT else "frame"
                    kernels.setdefault(names.get(sym, f"sym{sym}"), {})[key] = value
        cubins.append(kernels)
    return cubins


def kernel_resources(obj: Path) -> dict[str, dict[str, int]]:
    """The kernels of an exported object's cubin (see cubin_resources)."""
    merged: dict[str, dict[str, int]] = {}
    for kernels in cubin_resources(obj):
        merged.update(kernels)
    return merged


def register_pool_problem(resources: dict, num_threads: int, budgets: list[int], kernel_marker: str) -> str | None:
    """Why the warpgroup register budgets (setmaxnreg per 128-thread warpgroup) cannot fit the launch
    allocation of the kernels whose name contains `kernel_marker`, or None when they fit."""
    need = 128 * sum(budgets)
    for kernel, res in resources.items():
        if kernel_marker not in kernel or "regs" not in res:
            continue
        have = res["regs"] * num_threads
        if have < need:
            return (f"setmaxnreg budgets {budgets} x 128 threads need {need} registers, but the kernel launches "
                    f"with {res['regs']} x {num_threads} = {have}: the warpgroups raising theirs would wait "
                    f"forever (lower a budget in kernels/config.py)")
    return None
