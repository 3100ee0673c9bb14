"""The machine code XLA itself runs for a Pallas (Triton) kernel, for the torch launcher.

jax lowers a Pallas call on the Triton lowering to an XLA custom call holding Triton IR; XLA
compiles that IR with its own bundled Triton and LLVM into the executable's module. Compiling
the same IR with another Triton (the `triton` package) gives different machine code (seen on the
H200: 2 to 298 bf16 ulp apart). To launch exactly what XLA launches, `xla_kernels` has XLA compile
the jitted function holding the call, on this process's GPU backend, and takes from it:

* the kernel symbol and its parameters: from the PTX XLA dumps (`xla_dump_to`); XLA names the
  kernel after the Pallas call (with a `_N` suffix if the name repeats) and passes the custom
  call's buffers, operands then results, one pointer each (Triton's two scratch pointers are
  replaced by null constants inside the kernel, so they are not parameters);
* the dynamic shared memory XLA launches it with: the `ttg.shared` attribute of the Triton
  module after XLA's Triton passes, from the pass log XLA writes when its Triton emitter dump is
  enabled (`xla_dump_emitter_re=triton-fusion`, or `xla_dump_hlo_pass_re=triton-fusion-emitter`
  on older XLA);
* the image: the cubin embedded in the serialized executable (the bytes XLA loads; jaxlib 0.11.2
  Snappy-compresses it, `snappy_decompress`), found as the ELF image (EM_CUDA) defining the
  symbol; if the executable cannot be serialized, ptxas on
  XLA's PTX (same PTX, possibly another ptxas than XLA's). Where neither a dump nor the
  executable holds PTX (jaxlib 0.11.2 on the H200), symbols and parameters are read from the
  cubin's own `.text.<kernel>` / `.nv.info.<kernel>` sections (`cubin_entries`).
Grid and block are the custom call's (grid, 32 * num_warps), as XLA launches them.
"""

from __future__ import annotations

import dataclasses
import glob
import mmap
import os
import re
import struct
import tempfile
from typing import Any, Callable, Sequence

__all__ = ["XlaKernel", "xla_kernels", "elf_images", "pass_log_shared_bytes", "ptx_entries",
           "ptx_block", "ptx_from_blob", "cubin_entries", "snappy_decompress",
           "executable_payloads"]

_DUMP_OPTION_SETS: tuple[dict, ...] = (
    {"xla_dump_emitter_re": "triton-fusion"},
    {"xla_dump_hlo_pass_re": "triton-fusion-emitter"},
    {},
)
_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\((.*?)\)", re.S)
_NOT_TEXT = re.compile(rb"[^\t\n\r\x20-\x7e]")
_SHARED = re.compile(rb"(?:ttg|triton_gpu)\.shared\"?\s*=\s*(\d+)\s*:\s*i32")
EM_CUDA = 190


@dataclasses.dataclass(frozen=True)
class XlaKernel:
    """One Pallas kernel as XLA compiled it (see the module docstring)."""

    name: str                     # the Pallas call name
    entry: str                    # XLA's kernel symbol
    image: bytes                  # cubin (or NUL-terminated PTX for the driver JIT)
    image_from: str
    num_params: int
    shared_mem_bytes: int | None  # None: XLA's figure was not found
    shared_mem_from: str
    ptx: str


def ptx_entries(ptx: str) -> dict[str, list[str]]:
    """{entry name: parameter declarations} of every kernel entry in `ptx`."""
    return {name: [p.strip() for p in body.split(",") if p.strip()]
            for name, body in _ENTRY.findall(ptx)}


def elf_images(blob: bytes) -> list[bytes]:
    """Every little-endian 64-bit EM_CUDA ELF image embedded in `blob` (cut to its extent)."""
    out, pos = [], blob.find(b"\x7fELF")
    while pos >= 0:
        hdr = blob[pos:pos + 64]
        if len(hdr) == 64 and hdr[4] == 2 and hdr[5] == 1 and \
                struct.unpack_from("<H", hdr, 18)[0] == EM_CUDA:
            phoff, shoff = struct.unpack_from("<QQ", hdr, 32)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", hdr, 54)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            ok = end <= len(blob) - pos
            for i in range(shnum if ok else 0):
                sh = blob[pos + shoff + i * shentsize: pos + shoff + (i + 1) * shentsize]
                if len(sh) < 40:
                    ok = False
                    break
                sh_type = struct.unpack_from("<I", sh, 4)[0]
                sh_offset, sh_size = struct.unpack_from("<QQ", sh, 24)
                if sh_type != 8:  # SHT_NOBITS occupies no bytes in the file
                    end = max(end, sh_offset + sh_size)
            if ok and end <= len(blob) - pos:
                out.append(bytes(blob[pos:pos + end]))
        pos = blob.find(b"\x7fELF", pos + 4)
    return out


_EIATTR_KPARAM_INFO = 0x17
_EIATTR_CBANK_PARAM_SIZE = 0x19
_EIATTR_MAX_THREADS = 0x05
_EIATTR_REQNTID = 0x10


def _elf_sections(image: bytes) -> dict[str, bytes]:
    """{section name: contents} of a little-endian 64-bit ELF image."""
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", image, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", image, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = heads[shstrndx][4], heads[shstrndx][5]
    strtab = image[strtab_off:strtab_off + strtab_size]
    out = {}
    for name_off, sh_type, _flags, _addr, offset, size in heads:
        name = strtab[name_off:strtab.index(b"\0", name_off)].decode(errors="replace")
        out[name] = b"" if sh_type == 8 else image[offset:offset + size]  # 8: SHT_NOBITS
    return out


def _nv_info(data: bytes):
    """(attribute, value bytes) records of an `.nv.info.<kernel>` section."""
    pos = 0
    while pos + 4 <= len(data):
        fmt, attr = data[pos], data[pos + 1]
        if fmt == 0x04:  # EIFMT_SVAL: u16 size, then the value
            size = struct.unpack_from("<H", data, pos + 2)[0]
            yield attr, data[pos + 4:pos + 4 + size]
            pos += 4 + size
        else:  # EIFMT_NVAL / BVAL / HVAL: a 2-byte value in a 4-byte record
            yield attr, data[pos + 2:pos + 4]
            pos += 4


def cubin_entries(image: bytes) -> dict[str, tuple[list[str], tuple[int, int, int] | None]]:
    """{kernel: (parameter declarations, block or None)} read from a cubin's own sections.

    Kernels are the `.text.<name>` sections. Parameters come from `.nv.info.<name>`: one
    EIATTR_KPARAM_INFO record per parameter (ordinal, offset, size in its top 14 bits), else
    the parameter bank size in 8-byte slots; they are rendered as PTX-style declarations
    (`.param .u64 p<i>` for 8-byte ones) so that PTX and cubin entries compare alike. For
    executables that embed no PTX (jaxlib 0.11.2 on the H200 dumps none either)."""
    secs = _elf_sections(image)
    out = {}
    for sec in secs:
        if not sec.startswith(".text."):
            continue
        name = sec[len(".text."):]
        params: dict[int, int] = {}
        bank, block = None, None
        for attr, val in _nv_info(secs.get(".nv.info." + name, b"")):
            if attr == _EIATTR_KPARAM_INFO and len(val) >= 12:
                _index, ordinal, _offset, flags = struct.unpack_from("<IHHI", val)
                params[ordinal] = flags >> 18
            elif attr == _EIATTR_CBANK_PARAM_SIZE:
                bank = struct.unpack_from("<H", val)[0]
            elif attr in (_EIATTR_MAX_THREADS, _EIATTR_REQNTID) and len(val) >= 12:
                block = struct.unpack_from("<III", val)
        if params:
            sizes = [params[i] for i in sorted(params)]
        elif bank is not None:
            sizes = [8] * (bank // 8)
        else:
            continue
        decls = [f".param .u64 p{i}" if sz == 8 else f".param .b8 p{i}[{sz}]"
                 for i, sz in enumerate(sizes)]
        out[name] = (decls, block)
    return out


def pass_log_shared_bytes(path: str) -> int | None:
    """The last `ttg.shared = N` in a Triton pass log (the final allocation), or None."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            last = None
            for match in _SHARED.finditer(m):
                last = match
            return int(last.group(1)) if last else None


def _no_compilation_cache():
    """A context in which jax's persistent compilation cache is off (a cached executable would
    skip the dump); a null context where this jax has no such switch."""
    import contextlib

    try:
        from jax._src import config as jax_config

        return jax_config.enable_compilation_cache(False)
    except Exception:  # noqa: BLE001 - older/newer jax without the state
        return contextlib.nullcontext()


def _compile_with_dump(fn: Callable, avals: Sequence[Any], dump_dir: str):
    import jax

    lowered = jax.jit(fn).trace(*avals).lower()
    errors = []
    for extra in _DUMP_OPTION_SETS:
        try:
            with _no_compilation_cache():
                compiled = lowered.compile(compiler_options={"xla_dump_to": dump_dir, **extra})
            return compiled, extra, errors
        except Exception as err:  # noqa: BLE001 - unknown option on this XLA: try the next
            errors.append(f"{extra or 'dump only'}: {type(err).__name__}: {str(err)[:160]}")
    raise RuntimeError("XLA would not compile with a dump directory: " + "; ".join(errors))


def ptx_from_blob(blob: bytes, entry_prefix: str) -> dict[str, tuple[str, list[str]]]:
    """PTX modules embedded in `blob` (a serialized executable) that define an entry starting
    with `entry_prefix`: {entry: (module text, parameters)}."""
    out: dict[str, tuple[str, list[str]]] = {}
    pos = blob.find(b".entry " + entry_prefix.encode())
    while pos >= 0:
        start = blob.rfind(b"//\n// Generated by", 0, pos)
        if start < 0:
            start = blob.rfind(b".version", 0, pos)
        stop = _NOT_TEXT.search(blob, pos)
        end = stop.start() if stop else len(blob)
        if start >= 0:
            text = blob[start:end].decode("ascii", errors="replace")
            for entry, params in ptx_entries(text).items():
                if entry.startswith(entry_prefix):
                    out.setdefault(entry, (text, params))
        pos = blob.find(b".entry " + entry_prefix.encode(), end)
    return out


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 35:
            raise ValueError("varint too long")


def snappy_decompress(buf: bytes, start: int = 0) -> bytes:
    """Raw Snappy block format (preamble: uncompressed length as a varint; then literals and
    back-copies). XLA compresses the executables it serializes; the cubins are inside.
    Raises ValueError on anything that is not a well-formed block."""
    try:
        total, pos = _varint(buf, start)
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


def executable_payloads(blob: bytes) -> list[bytes]:
    """`blob` and, where a Snappy block starts in its first 4 KiB (after a header), its
    contents."""
    out = [blob]
    for start in range(0, min(4096, len(blob))):
        try:
            data = snappy_decompress(blob, start)
        except (ValueError, IndexError):
            continue
        if b"\x7fELF" in data:
            out.append(data)
            break
    return out


def _serialized_executable(compiled) -> bytes | None:
    try:
        from jax.experimental.serialize_executable import serialize

        return serialize(compiled)[0]
    except Exception:  # noqa: BLE001 - not serializable on this backend/version
        return None


def ptx_block(ptx: str, entry: str) -> tuple[int, int, int] | None:
    """The `.maxntid` / `.reqntid` block shape declared for `entry` (None if none is)."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\(.*?\)(.*?)\{", ptx, re.S)
    if not m:
        return None
    d = re.search(r"\.(?:maxntid|reqntid)\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?",
                  m.group(1))
    if not d:
        return None
    return tuple(int(v) if v else 1 for v in d.groups())


def xla_kernels(fn: Callable, avals: Sequence[Any], wants: dict[str, tuple[int, int | None]],
                compile_ptx: Callable[[str], tuple[bytes, str]]) -> dict[str, XlaKernel]:
    """Compile `fn` at `avals` with XLA (this process's default backend must be the GPU) and
    return {name: kernel} for each Pallas call `name` in `wants`, all from the one executable.

    wants[name] = (buffer pointers it takes, threads per block or None). A kernel is found by
    its name (XLA names it after the Pallas call, `_N` added when the name repeats); failing
    that, by its signature: the one entry, not otherwise taken, with that many 64-bit
    parameters and that block size (if several qualify, none is taken).
    compile_ptx(ptx) -> (image, how): used only where the executable holds no cubin for it.
    Raises RuntimeError naming what was not found.
    """
    keep = os.environ.get("FUNCMLA_XLA_DUMP_KEEP")  # debugging: keep XLA's dump there
    with tempfile.TemporaryDirectory(prefix="funcmla-xla-") as tmp:
        if keep:
            tmp = tempfile.mkdtemp(prefix="funcmla-xla-", dir=keep)
        compiled, dump_opts, dump_errors = _compile_with_dump(fn, avals, tmp)
        ptx_files = sorted(glob.glob(os.path.join(tmp, "**", "*.ptx"), recursive=True))
        found: dict[str, tuple[str, list[str]]] = {}
        for path in ptx_files:
            with open(path, errors="replace") as f:
                text = f.read()
            for entry, params in ptx_entries(text).items():
                found.setdefault(entry, (text, params))
        logs = glob.glob(os.path.join(tmp, "**", "*.triton-passes.log"), recursive=True)
        blob = _serialized_executable(compiled)
        images = elf_images(blob) if blob is not None else []
        if blob is not None and not images:  # compressed (jaxlib 0.11.2): look inside
            images = [img for data in executable_payloads(blob)[1:] for img in elf_images(data)]
        if blob is not None:  # the executable's own PTX (the only PTX if none was dumped)
            for entry, value in ptx_from_blob(blob, "").items():
                found.setdefault(entry, value)
        cubin_blocks: dict[str, tuple[int, int, int] | None] = {}
        for img in images:  # no PTX anywhere: the cubins' own symbols and parameter info
            try:
                entries = cubin_entries(img)
            except (struct.error, IndexError, ValueError):
                continue
            for entry, (params, block) in entries.items():
                if entry not in found:
                    found[entry] = ("", params)
                    cubin_blocks[entry] = block

        def fits(entry: str, num_buffers: int, threads: int | None) -> bool:
            ptx, params = found[entry]
            block = ptx_block(ptx, entry) if ptx else cubin_blocks.get(entry)
            return (len(params) == num_buffers and all(".u64" in p or ".b64" in p
                                                       for p in params)
                    and (threads is None or block is None or block == (threads, 1, 1)))

        out, taken = {}, set()
        for name, want in wants.items():
            num_buffers, threads = want if isinstance(want, tuple) else (want, None)
            pattern = re.compile(re.escape(name) + r"(_\d+)?")
            matches = sorted((e for e in found if pattern.fullmatch(e)), key=len)
            how_found = "by name"
            if not matches:
                named = {e for e in found if any(re.fullmatch(re.escape(n) + r"(_\d+)?", e)
                                                 for n in wants)}
                sig = [e for e in found if e not in taken and e not in named
                       and fits(e, num_buffers, threads)]
                if len(sig) == 1:
                    matches, how_found = sig, "by signature (no entry carries its name)"
            if not matches:
                listing = sorted(os.listdir(tmp))
                raise RuntimeError(
                    f"XLA's PTX has no kernel named {name!r} and no single kernel with its "
                    f"signature (entries: {sorted(found)[:8]}; {len(ptx_files)} .ptx files "
                    f"dumped, options {dump_opts}, {dump_errors}; dump directory: "
                    f"{len(listing)} files, {listing[:40]})")
            entry = matches[0]
            ptx, params = found[entry]
            if not fits(entry, num_buffers, threads):
                raise RuntimeError(
                    f"XLA's kernel {entry} takes {len(params)} parameters ({params[:3]}...) "
                    f"with block {ptx_block(ptx, entry)}; expected {num_buffers} 64-bit "
                    f"pointers and {threads} threads")
            taken.add(entry)
            shared, shared_from = None, (f"not found ({len(logs)} pass logs; dump options "
                                         f"{dump_opts})")
            for path in logs:
                if os.path.basename(path).endswith(f".{entry}.triton-passes.log"):
                    shared = pass_log_shared_bytes(path)
                    if shared is not None:
                        shared_from = ("ttg.shared in XLA's Triton pass log "
                                       f"({os.path.basename(path)})")
                        break
            needle = b"\0" + entry.encode() + b"\0"
            mine = [img for img in images if needle in img]
            if mine:
                image, image_from = mine[0], "cubin from XLA's serialized executable"
            else:
                why = ("no serialized executable" if blob is None else
                       f"none of the {len(images)} cubins in the serialized executable defines it")
                image, how = compile_ptx(ptx)
                image_from = f"{how} on XLA's PTX ({why})"
            out[name] = XlaKernel(name=name, entry=entry, image=image,
                                  image_from=f"{image_from}; found {how_found}",
                                  num_params=len(params), shared_mem_bytes=shared,
                                  shared_mem_from=shared_from, ptx=ptx)
        return out
