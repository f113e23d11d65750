#!/usr/bin/env python3
"""Registers and stack frame of every kernel in the AOT-exported objects, read from the cubins
inside them (no CUDA tools needed: this toolkit's ptxas is older than the DSL's PTX, and it ships no
cuobjdump / nvdisasm).

    python tools/cubin_resources.py                          # build/inplace/kernels/*.o
    python tools/cubin_resources.py --only paged --frames    # variants with a stack frame only

A stack frame (EIATTR_FRAME_SIZE > 0) in a kernel means local memory: usually spills. The paged
KV-cache producer spilled at 24 registers (88-96 bytes), which is why kvcache_config gives it 64 at
tile_m 64. REGCOUNT is the launch allocation per thread: setmaxnreg can only move registers within
registers x threads of the CTA, so a larger warpgroup budget than that allocation holds would hang.
"""

from __future__ import annotations

import argparse
import re
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EIATTR_REGCOUNT, EIATTR_FRAME_SIZE = 0x2F, 0x12


def _sections(elf: bytes):
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for name, _type, _flags, _addr, off, size in headers:
        yield elf[strtab + name:elf.index(b"\0", strtab + name)].decode(), off, size


def _symbols(elf: bytes) -> dict[int, str]:
    """Symbol index -> name, from .symtab and its string table."""
    secs = {n: (o, s) for n, o, s in _sections(elf)}
    if ".symtab" not in secs or ".strtab" not in secs:
        return {}
    (so, ss), (to, _) = secs[".symtab"], secs[".strtab"]
    out = {}
    for i in range(ss // 24):
        name = struct.unpack_from("<I", elf, so + 24 * i)[0]
        out[i] = elf[to + name:elf.index(b"\0", to + name)].decode()
    return out


def kernel_resources(obj: Path) -> dict[str, dict[str, int]]:
    """{kernel name: {"regs": n, "frame": bytes}} for the cubin embedded in an exported object."""
    data = obj.read_bytes()
    starts = [m.start() for m in re.finditer(b"\x7fELF", data)]
    out: dict[str, dict[str, int]] = {}
    for start in starts[1:]:  # the first ELF is the host object itself
        elf = data[start:]
        if struct.unpack_from("<H", elf, 0x12)[0] != 190:  # EM_CUDA
            continue
        names = _symbols(elf)
        for name, off, size in _sections(elf):
            if name != ".nv.info":
                continue
            p = off
            while p < off + size:
                fmt, attr = elf[p], elf[p + 1]
                if fmt == 4:  # EIFMT_SVAL: u16 size, payload
                    n = struct.unpack_from("<H", elf, p + 2)[0]
                    payload, p = elf[p + 4:p + 4 + n], p + 4 + n
                elif fmt == 3:  # EIFMT_HVAL: u16 inline
                    payload, p = elf[p + 2:p + 4], p + 4
                else:
                    payload, p = b"", p + 2
                if attr in (EIATTR_REGCOUNT, EIATTR_FRAME_SIZE) and len(payload) == 8:
                    sym, value = struct.unpack_from("<II", payload)
                    key = "regs" if attr == EIATTR_REGCOUNT else "frame"
                    out.setdefault(names.get(sym, f"sym{sym}"), {})[key] = value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=ROOT / "build" / "inplace" / "kernels")
    ap.add_argument("--only", default="", help="substring of the variant symbol")
    ap.add_argument("--frames", action="store_true", help="only kernels with a stack frame")
    args = ap.parse_args(argv)
    objs = sorted(p for p in args.dir.glob("fa4_*.o") if args.only in p.stem)
    if not objs:
        print(f"no exported objects matching {args.only!r} in {args.dir}", file=sys.stderr)
        return 1
    for obj in objs:
        for kernel, res in kernel_resources(obj).items():
            if args.frames and not res.get("frame"):
                continue
            role = "combine" if "combine" in kernel else "attention"
            print(f"{obj.stem:<56} {role:<9} regs {res.get('regs', '?'):>3}  frame {res.get('frame', 0):>4} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
