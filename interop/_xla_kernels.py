"""The machine code XLA itself runs for a Pallas (Triton) kernel, for the torch launcher.

jax lowers a Pallas call on the Triton lowering to an XLA custom call holding Triton IR; XLA
compiles that IR with its own bundled Triton and LLVM into the executable's module. Compiling
the same IR with another Triton (the `triton` package) gives different machine code (seen on the
H200: 2 to 298 bf16 ulp apart). To launch exactly what XLA launches, `xla_kernels` has XLA compile
the jitted function holding the call, on this process's GPU backend, and reads the executable:

* jaxlib 0.11.2 (H200, CUDA 13): `LoadedExecutable.serialize()` is a small header and a Riegeli file
  (`_containers.riegeli_records`: 64 KiB blocks, simple chunks, Snappy-compressed) whose executable
  record is itself a Riegeli file holding `xla.gpu.GpuExecutableProto`. Its thunks record each
  kernel launch: the symbol (XLA names the kernel after the Pallas call, `_N` added if the name
  repeats), the cubin defining it (one per Triton kernel), grid, block and dynamic shared memory
  (`launch_specs`). Parameters: one pointer per buffer, operands then results (Triton's two scratch
  pointers are null constants inside the kernel, so they are not parameters), read from the cubin's
  `.nv.info.<kernel>` section (`cubin_entries`). All of this matched XLA's own launches captured
  with CUPTI on the H200 (2026-11-30), and the launcher's outputs on these kernels were
  bit-identical to the executable's.
* older jaxlibs (no launch records): XLA compiles again with `xla_dump_to`; symbol and parameters
  from the PTX it dumps (or the PTX inside the executable), dynamic shared memory from
  `ttg.shared` in its Triton pass log (`xla_dump_emitter_re=triton-fusion`, or
  `xla_dump_hlo_pass_re=triton-fusion-emitter`), the image from the cubin in the serialized
  executable, else ptxas on XLA's PTX. Grid and block are then the custom call's (grid,
  32 * num_warps), as XLA launches them.
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

from funcmla.interop._containers import RIEGELI_START, riegeli_records, try_proto_fields

__all__ = ["XlaKernel", "xla_kernels", "elf_images", "pass_log_shared_bytes", "ptx_entries",
           "ptx_block", "ptx_from_blob", "cubin_entries", "executable_records", "launch_specs",
           "executable_launches", "XlaLaunch"]

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
    ptx: str                      # "" where XLA's PTX was not needed (or not found)
    grid: tuple[int, ...] | None = None   # as XLA launches it, where the executable says
    block: tuple[int, ...] | None = None


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


def executable_records(blob: bytes) -> list[bytes]:
    """The innermost records of the Riegeli file in `blob` (a serialized PJRT executable:
    jaxlib 0.11.2 writes the executable-and-options record into one Riegeli file and the GPU
    executable proto into another inside it); [] where `blob` holds no Riegeli file."""
    at = blob.find(RIEGELI_START)
    if at < 0:
        return []
    out = []
    for rec in riegeli_records(blob[at:], trailing_ok=True):
        out += executable_records(rec) if rec.startswith(RIEGELI_START) else [rec]
    return out


def _dim3(buf: bytes, depth: int = 0) -> tuple[int, int, int] | None:
    """x, y, z of a message holding varint fields 1-3 (directly or as its one submessage)."""
    msg = try_proto_fields(buf)
    if not msg:
        return None
    if all(w == 0 and f in (1, 2, 3) for f, w, _ in msg):
        got = {f: v for f, _, v in msg}
        return got.get(1, 0), got.get(2, 0), got.get(3, 0)
    subs = [v for _, w, v in msg if w == 2]
    if depth < 2 and len(subs) == 1 and len(msg) == 1:
        return _dim3(subs[0], depth + 1)
    return None


@dataclasses.dataclass(frozen=True)
class XlaLaunch:
    """One kernel launch recorded in XLA's GPU executable: symbol, the cubin defining it, and
    the grid, block and dynamic shared memory XLA launches it with."""

    entry: str
    image: bytes
    grid: tuple[int, int, int] | None
    block: tuple[int, int, int] | None
    shared_mem_bytes: int


_IDENT = re.compile(r"[A-Za-z_$][\w$.]*")


def _cubins_in(buf: bytes, depth: int = 0) -> list[bytes]:
    if buf.startswith(b"\x7fELF"):
        return elf_images(buf)[:1]
    msg = try_proto_fields(buf) if depth < 3 else None
    return [img for _, w, v in msg or () if w == 2 for img in _cubins_in(v, depth + 1)]


def launch_specs(record: bytes, depth: int = 0) -> list[XlaLaunch]:
    """Every kernel launch spec in a GPU executable proto (jaxlib 0.11.2's
    `xla.gpu.GpuExecutableProto`): a message whose field 1 is the kernel's symbol, field 2 holds
    the cubin defining that symbol, fields 3 / 4 the grid / block (x, y, z) and field 6 the
    dynamic shared memory in bytes (absent: 0). Read by shape, not by a compiled schema."""
    msg = try_proto_fields(record) if depth < 12 else None
    if not msg:
        return []
    fields: dict[int, list] = {}
    for f, w, v in msg:
        fields.setdefault(f, []).append((w, v))
    name = fields.get(1, [(None, b"")])[0]
    if name[0] == 2 and len(fields.get(2, ())) == 1 and fields[2][0][0] == 2:
        text = name[1].decode("ascii", errors="replace")
        if _IDENT.fullmatch(text):
            needle = b"\0" + name[1] + b"\0"
            images = [img for img in _cubins_in(fields[2][0][1]) if needle in img]
            if images:
                dims = [_dim3(fields[k][0][1]) if fields.get(k) and fields[k][0][0] == 2
                        else None for k in (3, 4)]
                shared = fields.get(6, [(0, 0)])[0]
                return [XlaLaunch(text, images[0], dims[0], dims[1],
                                  shared[1] if shared[0] == 0 else 0)]
    out = []
    for _, w, v in msg:
        if w == 2 and len(v) > 8 and not v.startswith(b"\x7fELF"):
            out += launch_specs(v, depth + 1)
    return out


def executable_launches(blob: bytes) -> list[XlaLaunch]:
    """Every kernel launch spec in a serialized executable (see `launch_specs`)."""
    return [spec for rec in executable_records(blob) for spec in launch_specs(rec)]


def _serialized_executable(compiled) -> bytes | None:
    """The executable as PJRT serializes it (the runtime executable's own bytes; else jax's
    pickle, which embeds them), or None where this backend cannot serialize it."""
    try:
        return bytes(compiled.runtime_executable().serialize())
    except Exception:  # noqa: BLE001 - try jax's wrapper
        pass
    try:
        from jax.experimental.serialize_executable import serialize

        return serialize(compiled)[0]
    except Exception:  # noqa: BLE001 - not serializable on this backend/version
        return None


def _compile(fn: Callable, avals: Sequence[Any]):
    import jax

    return jax.jit(fn).trace(*avals).lower().compile()


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


def _want(want) -> tuple[int, int | None, tuple[int, ...] | None]:
    if isinstance(want, int):
        return want, None, None
    return (tuple(want) + (None, None))[:3]


def _name_pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name) + r"(_\d+)?")


def _kernels_from_launches(launches: list[XlaLaunch], wants: dict) -> dict[str, XlaKernel]:
    """{name: kernel} for `wants` from the launch specs of XLA's executable (see xla_kernels)."""
    by_entry = {}
    for spec in launches:
        by_entry.setdefault(spec.entry, spec)
    params = {}
    for e, spec in by_entry.items():
        decls = cubin_entries(spec.image).get(e)
        params[e] = decls[0] if decls else None

    def fits(e, num_buffers, threads, grid):
        spec, decls = by_entry[e], params[e]
        return (decls is not None and len(decls) == num_buffers
                and all(".u64" in d for d in decls)
                and (threads is None or spec.block == (threads, 1, 1))
                and (grid is None or spec.grid == tuple(grid)))

    out, taken = {}, set()
    named = {e for e in by_entry if any(_name_pattern(n).fullmatch(e) for n in wants)}
    for name, want in wants.items():
        num_buffers, threads, grid = _want(want)
        matches = sorted((e for e in by_entry if _name_pattern(name).fullmatch(e)), key=len)
        how_found = "by name"
        if not matches:
            sig = [e for e in by_entry if e not in taken and e not in named
                   and fits(e, num_buffers, threads, grid)]
            if len(sig) == 1:
                matches, how_found = sig, "by signature (no kernel carries its name)"
        if not matches:
            raise RuntimeError(
                f"XLA's executable launches no kernel named {name!r} and no single kernel with "
                f"its signature ({num_buffers} pointers, block {threads}, grid {grid}); it "
                f"launches {[(s.entry, s.grid, s.block) for s in launches][:8]}")
        entry = matches[0]
        spec = by_entry[entry]
        if not fits(entry, num_buffers, threads, grid):
            decls = params[entry]
            raise RuntimeError(
                f"XLA's kernel {entry} takes {None if decls is None else len(decls)} "
                f"parameters ({(decls or [])[:3]}...) and is launched with grid {spec.grid}, "
                f"block {spec.block}; expected {num_buffers} 64-bit pointers, block "
                f"{threads} and grid {grid}")
        taken.add(entry)
        out[name] = XlaKernel(
            name=name, entry=entry, image=spec.image,
            image_from=f"cubin from XLA's serialized executable (its kernel launch); found "
                       f"{how_found}",
            num_params=len(params[entry]), shared_mem_bytes=spec.shared_mem_bytes,
            shared_mem_from="XLA's kernel launch in the serialized executable", ptx="",
            grid=spec.grid, block=spec.block)
    return out


def xla_kernels(fn: Callable, avals: Sequence[Any], wants: dict[str, tuple],
                compile_ptx: Callable[[str], tuple[bytes, str]]) -> dict[str, XlaKernel]:
    """Compile `fn` at `avals` with XLA (this process's default backend must be the GPU) and
    return {name: kernel} for each Pallas call `name` in `wants`, all from the one executable.

    wants[name] = (buffer pointers it takes, threads per block or None[, grid]). Where the
    serialized executable records its kernel launches (jaxlib 0.11.2: Riegeli records, the
    GPU executable proto's kernel thunks), each kernel is read from there: cubin, grid, block
    and dynamic shared memory exactly as XLA launches it (`executable_launches`). Otherwise
    (older jaxlibs) XLA compiles again with a dump directory and the kernel's PTX, pass log and
    cubin are read from the dump and the executable (`_kernels_from_dump`).
    A kernel is found by its name (XLA names it after the Pallas call, `_N` added when the name
    repeats); failing that, by its signature: the one kernel, not otherwise taken, with that
    many 64-bit parameters, that block size (and grid); if several qualify, none is taken.
    compile_ptx(ptx) -> (image, how): used only where the executable holds no cubin for it.
    Raises RuntimeError naming what was not found or does not match.
    """
    blob = _serialized_executable(_compile(fn, avals))
    launches = executable_launches(blob) if blob is not None else []
    if launches:
        return _kernels_from_launches(launches, wants)
    return _kernels_from_dump(fn, avals, wants, compile_ptx)


def _kernels_from_dump(fn: Callable, avals: Sequence[Any], wants: dict,
                       compile_ptx: Callable[[str], tuple[bytes, str]]) -> dict[str, XlaKernel]:
    """The route for executables that record no kernel launches: see `xla_kernels`."""
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
        if blob is not None and not images:  # in (compressed) Riegeli records: look inside
            try:
                images = [img for rec in executable_records(blob) for img in elf_images(rec)]
            except ValueError:
                images = []
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
            num_buffers, threads, _grid = _want(want)
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
