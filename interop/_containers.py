"""Binary containers the torch launcher reads: the protobuf wire format, Snappy blocks and
Riegeli files (jaxlib serializes kernel calls as protobufs and XLA's GPU executables as
protobufs inside Snappy-compressed Riegeli files). Schema-free readers, only what the launcher
needs; every malformed input raises ValueError (or gives None where a caller probes whether
some bytes are a message at all)."""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["read_varint", "proto_fields", "try_proto_fields", "snappy_decompress",
           "riegeli_records", "RIEGELI_START"]


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A base-128 varint at buf[pos:]: (value, position after it)."""
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:  # 10 bytes at most (a negative int64 takes all ten)
            raise ValueError("varint too long")


def snappy_decompress(buf: bytes, start: int = 0) -> bytes:
    """Raw Snappy block format (preamble: uncompressed length as a varint; then literals and
    back-copies): the compression of the Riegeli chunks XLA serializes executables into.
    Raises ValueError on anything that is not a well-formed block."""
    try:
        total, pos = read_varint(buf, start)
    except IndexError as err:
        raise ValueError("truncated preamble") from err
    if total > 64 * len(buf) + 1024:
        raise ValueError(f"implausible length {total}")
    out = bytearray()
    while len(out) < total:
        if pos >= len(buf):
            raise ValueError("truncated block")
        tag = buf[pos]
        kind = tag & 3
        if kind == 0:  # literal
            n = tag >> 2
            pos += 1
            if n >= 60:
                extra = n - 59
                n = int.from_bytes(buf[pos:pos + extra], "little")
                pos += extra
            n += 1
            if pos + n > len(buf):
                raise ValueError("literal past the end")
            out += buf[pos:pos + n]
            pos += n
            continue
        if kind == 1:
            n = 4 + ((tag >> 2) & 7)
            offset = ((tag >> 5) << 8) | buf[pos + 1]
            pos += 2
        elif kind == 2:
            n = 1 + (tag >> 2)
            offset = int.from_bytes(buf[pos + 1:pos + 3], "little")
            pos += 3
        else:
            n = 1 + (tag >> 2)
            offset = int.from_bytes(buf[pos + 1:pos + 5], "little")
            pos += 5
        if offset == 0 or offset > len(out):
            raise ValueError("bad back-reference")
        for _ in range(n):  # copies may overlap their own output
            out.append(out[-offset])
    if len(out) != total:
        raise ValueError("length mismatch")
    return bytes(out)


RIEGELI_START = bytes.fromhex(  # every Riegeli file's first 64 bytes: block header + signature
    "83af70d10d884a3f00000000000000004000000000000000"
    "91bac23c9287e1a90000000000000000e19f13c0e9b1c372"
    "73000000000000000000000000000000")
_BLOCK, _BLOCK_HEADER, _CHUNK_HEADER = 1 << 16, 24, 40


def _riegeli_span(f: bytes, pos: int, n: int) -> tuple[bytes, int]:
    """n logical bytes of Riegeli file `f` from file position pos (block headers, 24 bytes at
    every 64 KiB boundary, skipped) and the file position after them."""
    out = bytearray()
    while n:
        if pos % _BLOCK < _BLOCK_HEADER:
            pos += _BLOCK_HEADER - pos % _BLOCK
        take = min(n, _BLOCK - pos % _BLOCK)
        piece = f[pos:pos + take]
        if len(piece) < take:
            raise ValueError(f"Riegeli file truncated at byte {pos + len(piece)}")
        out += piece
        pos, n = pos + take, n - take
    return bytes(out), pos


def _riegeli_block(data: bytes, compression: int) -> bytes:
    if compression == 0:
        return data
    if compression != 0x73:  # 's'
        raise ValueError(f"Riegeli chunk compressed with {chr(compression)!r} (only "
                         "uncompressed and Snappy chunks are read)")
    size, pos = read_varint(data, 0)
    out = snappy_decompress(data, pos)
    if len(out) != size:
        raise ValueError(f"Snappy block of {len(out)} bytes where {size} were announced")
    return out


def riegeli_records(f: bytes, *, trailing_ok: bool = False) -> list[bytes]:
    """The records of a Riegeli file (the container XLA serializes executables into): simple
    chunks, uncompressed or Snappy-compressed; signature, metadata and padding chunks skipped.
    Checksums are not verified. Raises ValueError on anything else (transposed chunks, other
    compressions, truncation, sizes that do not add up). trailing_ok: `f` may continue past the
    file (e.g. the rest of a pickle); reading stops at the first chunk header that does not fit
    or names no chunk type."""
    if not f.startswith(RIEGELI_START):
        raise ValueError("not a Riegeli file (no Riegeli signature at its start)")
    records, pos = [], 0
    while True:
        if pos % _BLOCK < _BLOCK_HEADER:
            pos += _BLOCK_HEADER - pos % _BLOCK
        if pos >= len(f):
            return records
        begin = pos
        try:
            header, pos = _riegeli_span(f, pos, _CHUNK_HEADER)
            _hash, data_size, _data_hash, type_and_count, decoded = struct.unpack("<5Q", header)
            kind, count = type_and_count & 0xFF, type_and_count >> 8
            if trailing_ok and kind not in (0x73, 0x6D, 0x70, 0x72, 0x74):
                return records
            data, pos = _riegeli_span(f, pos, data_size)
        except ValueError:
            if trailing_ok and records:
                return records
            raise
        pos = max(pos, begin + count)
        if kind in (0x73, 0x6D, 0x70):  # 's'ignature, 'm'etadata, 'p'adding
            continue
        if kind != 0x72:  # 'r': simple chunk
            raise ValueError(f"Riegeli chunk of type {chr(kind)!r} at byte {begin} (only simple "
                             "chunks are read)")
        sizes_size, p = read_varint(data, 1)
        sizes = _riegeli_block(data[p:p + sizes_size], data[0])
        values = _riegeli_block(data[p + sizes_size:], data[0])
        lengths, q = [], 0
        while q < len(sizes):
            n, q = read_varint(sizes, q)
            lengths.append(n)
        if len(lengths) != count or sum(lengths) != len(values) or len(values) != decoded:
            raise ValueError(f"Riegeli chunk at byte {begin}: {len(lengths)} record sizes "
                             f"summing to {sum(lengths)} for {count} records of {decoded} bytes "
                             f"({len(values)} decoded)")
        at = 0
        for n in lengths:
            records.append(values[at:at + n])
            at += n


def proto_fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of a protobuf message, in order (varints
    as ints, length-delimited and fixed-size fields as bytes). Raises ValueError where `buf` is
    not a well-formed message."""
    got = try_proto_fields(buf)
    if got is None:
        raise ValueError("not a well-formed protobuf message")
    return got


def try_proto_fields(buf: bytes) -> list[tuple[int, int, Any]] | None:
    """`proto_fields`, or None if `buf` is not a message (for probing bytes by shape)."""
    out, pos = [], 0
    try:
        while pos < len(buf):
            key, pos = read_varint(buf, pos)
            field, wire = key >> 3, key & 7
            if field == 0:
                return None
            if wire == 0:
                value, pos = read_varint(buf, pos)
            elif wire == 2:
                n, pos = read_varint(buf, pos)
                if pos + n > len(buf):
                    return None
                value, pos = buf[pos:pos + n], pos + n
            elif wire in (1, 5):
                size = 8 if wire == 1 else 4
                if pos + size > len(buf):
                    return None
                value, pos = buf[pos:pos + size], pos + size
            else:
                return None
            out.append((field, wire, value))
    except (IndexError, ValueError):
        return None
    return out
