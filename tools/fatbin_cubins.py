#!/usr/bin/env python3
"""The cubins inside a CUDA shared library, written out for nvdisasm.

nvcc embeds each kernel file's device code in the host ELF's .nv_fatbin section: a run of fat
binaries (magic 0xBA55ED50), each a header and entries, an entry a header and a payload (kind 2:
a cubin, itself an ELF; kind 1: PTX). This reads that section and writes every cubin payload to
OUTDIR, so that a library built elsewhere (FlashAttention-3's in ../shared/anchors/fa3/) can be
disassembled on a machine without CUDA's cuobjdump (scripts/disasm.sh LIB REGEX).

    tools/fatbin_cubins.py LIB[.xz] OUTDIR      # prints one line per cubin written

A compressed entry (its payload not an ELF) is named and skipped: decompressing it needs the
codec nvcc used, which this does not carry.
"""

import argparse
import lzma
import struct
import sys
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
ELF_MAGIC = b"\x7fELF"
KIND_CUBIN = 2


def section(elf: bytes, wanted: str) -> bytes:
    """The bytes of the 64-bit little-endian ELF's section `wanted`."""
    if elf[:4] != ELF_MAGIC or elf[4] != 2 or elf[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's file offset
    for name, _type, _flags, _addr, offset, size in headers:
        if elf[names + name:elf.index(b"\0", names + name)].decode() == wanted:
            return elf[offset:offset + size]
    raise ValueError(f"no {wanted} section (not a library with CUDA device code)")


def entries(fatbins: bytes):
    """(kind, arch, payload) of every entry of the fat binaries laid end to end in `fatbins`."""
    pos = 0
    while pos + 16 <= len(fatbins):
        magic, _version, header_size, size = struct.unpack_from("<IHHQ", fatbins, pos)
        if magic != FATBIN_MAGIC:  # padding between fat binaries
            pos += 8
            continue
        entry, end = pos + header_size, pos + header_size + size
        while entry < end:
            kind, _unknown, entry_header, payload = struct.unpack_from("<HHIQ", fatbins, entry)
            arch = struct.unpack_from("<I", fatbins, entry + 0x1C)[0]
            start = entry + entry_header
            yield kind, arch, fatbins[start:start + payload]
            entry = start + payload
        pos = end


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", type=Path, help="a shared library or executable (.xz: decompressed first)")
    parser.add_argument("outdir", type=Path)
    args = parser.parse_args(argv)
    data = args.library.read_bytes()
    if args.library.suffix == ".xz":
        data = lzma.decompress(data)
    try:
        fatbins = section(data, ".nv_fatbin")
    except ValueError as e:
        print(f"fatbin_cubins: {args.library}: {e}", file=sys.stderr)
        return 1
    args.outdir.mkdir(parents=True, exist_ok=True)
    written = 0
    for index, (kind, arch, payload) in enumerate(entries(fatbins)):
        if kind != KIND_CUBIN:
            continue
        if payload[:4] != ELF_MAGIC:
            print(f"entry {index} (sm_{arch}): compressed, skipped")
            continue
        path = args.outdir / f"entry{index:03d}_sm{arch}.cubin"
        path.write_bytes(payload)
        print(path)
        written += 1
    if written == 0:
        print(f"fatbin_cubins: {args.library}: no uncompressed cubin", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
