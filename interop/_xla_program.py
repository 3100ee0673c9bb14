"""A whole XLA GPU executable as a list of kernel launches over its buffer allocations.

`_xla_kernels` reads one Pallas kernel out of an executable; this module reads all of it, so a
small jitted program (the SGLang step's metadata, `funcmla.interop.sglang.step`) can run on
torch's stream without JAX: its kernels launched in order, its buffers torch-owned.

jaxlib 0.11.2 serializes `xla.gpu.GpuExecutableProto` (inside Riegeli records, see
`_xla_kernels.executable_records`) with
  field 10  buffer_allocations: BufferAllocationProto {1 index, 2 size, 3 is_thread_local,
            5 is_entry_computation_parameter, 6 parameter_number, 7 maybe_live_out, 8 color,
            11 is_tuple, 12 is_constant};
  field 11  the output map: {1 ShapeIndexProto {1 packed indices}, 2 {1 allocation index}};
  field 12  constants (none is read here: a program with constants is refused);
  field 13  the thunks of the entry computation, each ThunkProto {1 info {1 name}, kind}.
A program is readable when every thunk is a custom kernel thunk (field 36): {1 args (each
ShapedSliceProto {1 slice {1 offset, 2 size, 3 allocation, 4 element type}}), 2 written,
3 kernel {1 symbol, 2 spec {2 {1 cubin}, 3 arity, 5 argument packing}, 3 grid, 4 block,
6 dynamic shared memory}} whose parameters are one device pointer per argument, in order.
That is what XLA emits for fusions and Pallas (Triton) calls on the H200 (checked against the
step programs' executables in tests/data/). Anything else (while loops, copies, memsets, custom
calls, cuDNN, constants, tuples read by a kernel, non-default memory colors) raises
`UnsupportedProgram` naming the thunk, so the caller keeps the JAX path.

Read by field number with the schema-free reader of `_containers`; figures and the decision in
docs/torch_launcher.md ("The step program on torch's stream").
"""

from __future__ import annotations

import dataclasses

from funcmla.interop._containers import try_proto_fields
from funcmla.interop._xla_kernels import _dim3, cubin_entries, elf_images, executable_records

__all__ = ["Allocation", "KernelLaunch", "CopyLaunch", "XlaProgram", "UnsupportedProgram",
           "parse_program",
           "parse_gpu_executable",
           "arena_layout", "kernel_pointers", "copy_pointers", "pointer_slots", "THUNK_KINDS"]

# ThunkProto oneof field numbers, for messages naming what is refused.
THUNK_KINDS = {2: "sequential", 3: "copy", 4: "device-to-host copy", 5: "host-to-device copy",
               6: "conditional", 7: "while", 8: "kernel (module cubin)", 9: "gemm",
               13: "device-to-device copy", 15: "cudnn", 18: "dynamic slice", 19: "memzero",
               22: "cublasLt matmul", 28: "memset32", 30: "custom call", 36: "custom kernel",
               48: "dynamic memcpy"}
_CUSTOM_KERNEL = 36
_COPIES = (3, 13)  # copy, device-to-device copy
_ALIGN = 256  # each allocation's offset in the arena (XLA aligns buffers to at least 64 B)


class UnsupportedProgram(ValueError):
    """The executable holds something the step launcher cannot replay (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Allocation:
    """One buffer allocation of the executable.

    kind: "parameter" (entry parameter `parameter`), "output" (maybe live out), "temp",
    "thread_local" (no device memory) or "constant". tuple: it holds a tuple's pointer table
    (the output tuple, or a tuple-shaped temporary); no kernel here reads such a table, they
    read the leaves' slices.
    """

    index: int
    size: int
    kind: str
    parameter: int | None = None
    color: int = 0
    tuple: bool = False


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One kernel thunk: cubin, symbol, launch shape and its arguments as
    (allocation, byte offset, byte size), one device pointer parameter each."""

    name: str                      # the thunk's HLO name (for messages)
    entry: str                     # the kernel symbol in `image`
    image: bytes
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem_bytes: int
    args: tuple[tuple[int, int, int], ...]
    written: tuple[bool, ...]


@dataclasses.dataclass(frozen=True)
class CopyLaunch:
    """One device-to-device copy thunk: `nbytes` from src to dst, each (allocation, byte
    offset, byte size)."""

    name: str
    src: tuple[int, int, int]
    dst: tuple[int, int, int]
    nbytes: int

    @property
    def args(self) -> tuple[tuple[int, int, int], ...]:
        return (self.src, self.dst)

    @property
    def written(self) -> tuple[bool, ...]:
        return (False, True)


@dataclasses.dataclass(frozen=True)
class XlaProgram:
    """allocations by index; outputs: flat output index -> allocation index (the tuple's
    leaves; -1 is the tuple itself); steps (kernel launches and copies) in order."""

    allocations: tuple[Allocation, ...]
    outputs: dict[int, int]
    steps: tuple[KernelLaunch | CopyLaunch, ...]

    @property
    def kernels(self) -> tuple[KernelLaunch, ...]:
        return tuple(s for s in self.steps if isinstance(s, KernelLaunch))

    def parameter_allocation(self, number: int) -> Allocation:
        for a in self.allocations:
            if a.kind == "parameter" and a.parameter == number:
                return a
        raise UnsupportedProgram(f"no allocation holds entry parameter {number}")


def _fields(buf: bytes, what: str) -> dict[int, list]:
    msg = try_proto_fields(buf)
    if msg is None:
        raise UnsupportedProgram(f"{what} is not a protobuf message")
    out: dict[int, list] = {}
    for f, w, v in msg:
        out.setdefault(f, []).append(v)
    return out


def _int(fields: dict, key: int, default: int = 0) -> int:
    v = fields.get(key, [default])[0]
    if not isinstance(v, int):
        raise UnsupportedProgram(f"field {key} is not a varint")
    return v


def _packed_varints(buf: bytes) -> list[int]:
    from funcmla.interop._containers import read_varint

    out, pos = [], 0
    while pos < len(buf):
        v, pos = read_varint(buf, pos)
        out.append(v)
    return out


def _allocation(buf: bytes) -> Allocation:
    f = _fields(buf, "a BufferAllocationProto")
    index, size, color = _int(f, 1), _int(f, 2), _int(f, 8)
    if _int(f, 12):
        kind = "constant"
    elif _int(f, 3):
        kind = "thread_local"
    elif _int(f, 5):
        kind = "parameter"
    elif _int(f, 7):
        kind = "output"
    else:
        kind = "temp"
    return Allocation(index, size, kind, _int(f, 6) if kind == "parameter" else None, color,
                      bool(_int(f, 11)))


def _kernel(name: str, buf: bytes) -> KernelLaunch:
    t = _fields(buf, f"thunk {name}")
    unknown = set(t) - {1, 2, 3, 4, 6}
    if unknown:
        raise UnsupportedProgram(f"thunk {name}: custom kernel fields {sorted(unknown)} are not "
                                 "understood")
    args = []
    for a in t.get(1, []):
        s = _fields(_fields(a, f"thunk {name} argument").get(1, [b""])[0],
                    f"thunk {name} argument slice")
        args.append((_int(s, 3), _int(s, 1), _int(s, 2)))
    written = tuple(bool(b) for b in t.get(2, [b""])[0])
    k = _fields(t[3][0], f"thunk {name} kernel")
    if set(k) - {1, 2, 3, 4, 6}:
        raise UnsupportedProgram(f"thunk {name}: kernel fields {sorted(set(k) - {1, 2, 3, 4, 6})}"
                                 " (cluster dimensions, TMA metadata?) are not understood")
    entry = k[1][0].decode("ascii", errors="replace")
    spec = _fields(k[2][0], f"thunk {name} kernel spec")
    images = [img for v in spec.get(2, []) for img in _cubins(v)]
    needle = b"\0" + entry.encode() + b"\0"
    images = [img for img in images if needle in img]
    if not images:
        raise UnsupportedProgram(f"thunk {name}: no cubin defining {entry} (PTX-only kernels are "
                                 "not replayed)")
    arity = _int(spec, 3, len(args))
    if arity != len(args):
        raise UnsupportedProgram(f"thunk {name}: kernel arity {arity} != {len(args)} arguments")
    for i, p in enumerate(spec.get(5, [b""])[0] and _fields(spec[5][0], "packing").get(1, [])):
        item = _fields(_fields(p, "packing entry").get(1, [b""])[0], "packing entry")
        if (_int(item, 1), _int(item, 2)) != (1, i):
            raise UnsupportedProgram(f"thunk {name}: parameter {i} is not the device pointer of "
                                     f"argument {i} ({item})")
    decls = cubin_entries(images[0]).get(entry)
    if decls is None or len(decls[0]) != len(args) or any(".u64" not in d for d in decls[0]):
        raise UnsupportedProgram(f"thunk {name}: {entry} takes "
                                 f"{None if decls is None else decls[0]}, not {len(args)} "
                                 "pointers")
    grid = _dim3(k[3][0]) if 3 in k else None
    block = _dim3(k[4][0]) if 4 in k else None
    if not grid or not block or 0 in grid or 0 in block:
        raise UnsupportedProgram(f"thunk {name}: launch shape grid {grid} block {block}")
    return KernelLaunch(name, entry, images[0], grid, block, _int(k, 6), tuple(args), written)


def _slice(buf: bytes, what: str) -> tuple[int, int, int]:
    """(allocation, offset, size) of a BufferAllocationSliceProto, or of the slice inside a
    ShapedSliceProto (its field 1 is then a message, not the offset)."""
    f = _fields(buf, what)
    if f.get(1) and isinstance(f[1][0], bytes):
        f = _fields(f[1][0], what)
    return _int(f, 3), _int(f, 1), _int(f, 2)


def _copy(name: str, kind: int, buf: bytes) -> CopyLaunch:
    c = _fields(buf, f"copy thunk {name}")
    if kind == 13 and set(c) == {1}:  # DeviceToDeviceCopyThunkProto {1 CopyThunkProto}
        c = _fields(c[1][0], f"copy thunk {name}")
    if set(c) - {1, 2, 3} or not c.get(1) or not c.get(2):
        raise UnsupportedProgram(f"copy thunk {name}: fields {sorted(c)} are not understood")
    src = _slice(c[1][0], f"copy thunk {name} source")
    dst = _slice(c[2][0], f"copy thunk {name} destination")
    nbytes = _int(c, 3, src[2])
    if not 0 < nbytes <= min(src[2], dst[2]):
        raise UnsupportedProgram(f"copy thunk {name}: {nbytes} bytes from a {src[2]}-byte to a "
                                 f"{dst[2]}-byte slice")
    return CopyLaunch(name, src, dst, nbytes)


def _cubins(buf: bytes, depth: int = 0) -> list[bytes]:
    if buf.startswith(b"\x7fELF"):
        return elf_images(buf)[:1]
    msg = try_proto_fields(buf) if depth < 3 else None
    return [img for _, w, v in msg or () if w == 2 for img in _cubins(v, depth + 1)]


def _gpu_executable(blob: bytes) -> bytes:
    for rec in executable_records(blob):
        f = try_proto_fields(rec)
        if f and any(n == 13 for n, _, _ in f) and any(n == 10 for n, _, _ in f):
            return rec
    raise UnsupportedProgram("no GpuExecutableProto with thunks and buffer allocations in the "
                             "serialized executable (an older jaxlib's legacy format?)")


def parse_program(blob: bytes) -> XlaProgram:
    """The kernel launches and buffer allocations of a serialized executable (jaxlib 0.11.2's
    format, see the module docstring). Raises UnsupportedProgram naming what it cannot replay."""
    return parse_gpu_executable(_gpu_executable(blob))


def parse_gpu_executable(record: bytes) -> XlaProgram:
    """`parse_program` of the GpuExecutableProto record itself."""
    gpu = _fields(record, "the GpuExecutableProto")
    if gpu.get(12):
        raise UnsupportedProgram(f"the executable has {len(gpu[12])} constants (not replayed)")
    allocs = tuple(_allocation(a)
                   for a in _fields(gpu[10][0], "buffer_allocations").get(1, []))
    if [a.index for a in allocs] != list(range(len(allocs))):
        raise UnsupportedProgram("buffer allocations are not numbered 0..n-1")
    outputs = {}
    for entry in gpu.get(11, []):
        e = _fields(entry, "an output map entry")
        index = _packed_varints(_fields(e.get(1, [b""])[0], "a shape index").get(1, [b""])[0])
        alloc = _int(_fields(e.get(2, [b""])[0], "an output info"), 1)
        if len(index) > 1:
            raise UnsupportedProgram(f"nested output tuple index {index}")
        outputs[index[0] if index else -1] = alloc
    steps = []
    for thunk in gpu.get(13, []):
        t = _fields(thunk, "a ThunkProto")
        info = _fields(t.get(1, [b""])[0], "a thunk info")
        name = info.get(1, [b"?"])[0].decode("ascii", errors="replace")
        kinds = [k for k in t if k != 1]
        if kinds == [_CUSTOM_KERNEL]:
            steps.append(_kernel(name, t[_CUSTOM_KERNEL][0]))
        elif len(kinds) == 1 and kinds[0] in _COPIES:
            steps.append(_copy(name, kinds[0], t[kinds[0]][0]))
        else:
            what = ", ".join(THUNK_KINDS.get(k, f"kind {k}") for k in kinds) or "empty"
            raise UnsupportedProgram(f"thunk {name} is a {what} thunk; only custom kernel and "
                                     "device-to-device copy thunks are replayed")
    for k in steps:
        for alloc, offset, size in k.args:
            if not 0 <= alloc < len(allocs):
                raise UnsupportedProgram(f"thunk {k.name}: allocation {alloc} does not exist")
            a = allocs[alloc]
            if a.kind in ("thread_local", "constant") or a.color:
                raise UnsupportedProgram(f"thunk {k.name} reads a {a.kind} allocation "
                                         f"(#{alloc}, color {a.color})")
            if offset < 0 or size < 0 or offset + size > a.size:
                raise UnsupportedProgram(f"thunk {k.name}: slice [{offset}, {offset + size}) "
                                         f"outside allocation #{alloc} of {a.size} bytes")
    return XlaProgram(allocs, outputs, tuple(steps))


def arena_layout(program: XlaProgram, exclude=()) -> tuple[dict[int, int], int]:
    """({allocation index: byte offset in one arena}, arena bytes) for every allocation the
    program's kernels use that is not an entry parameter (outputs and temps), each aligned to
    256 bytes; allocations in `exclude` live elsewhere (a caller-owned output buffer)."""
    used = {a for k in program.steps for a, _, _ in k.args} | set(program.outputs.values())
    offsets, at = {}, 0
    for a in program.allocations:
        if a.index in used and a.kind in ("output", "temp") and a.index not in exclude:
            offsets[a.index] = at
            at += -(-a.size // _ALIGN) * _ALIGN
    return offsets, at


def kernel_pointers(program: XlaProgram, bases: dict[int, int]) -> list[tuple[int, ...]]:
    """Each kernel's parameter values: base address of the argument's allocation + its slice
    offset. bases: {allocation index: device address} for every allocation a kernel reads
    (KeyError-free: a missing one raises UnsupportedProgram naming it)."""
    out = []
    for k in program.kernels:
        row = []
        for alloc, offset, _size in k.args:
            if alloc not in bases:
                raise UnsupportedProgram(f"thunk {k.name} reads allocation #{alloc} "
                                         f"({program.allocations[alloc].kind}), which has no "
                                         "address")
            row.append(bases[alloc] + offset)
        out.append(tuple(row))
    return out


def pointer_slots(pointers: list[tuple[int, ...]]) -> tuple[dict[int, int], list[list[int]]]:
    """({slot: pointer value}, per-kernel parameter slots): one slot per distinct pointer, in
    order of first use (the launch program's fixed slots)."""
    index: dict[int, int] = {}
    rows = [[index.setdefault(p, len(index)) for p in row] for row in pointers]
    return {slot: p for p, slot in index.items()}, rows


def copy_pointers(program: XlaProgram, bases: dict[int, int]) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each copy step, in order."""
    out = []
    for c in program.steps:
        if isinstance(c, CopyLaunch):
            (sa, so, _), (da, do, _) = c.src, c.dst
            if sa not in bases or da not in bases:
                raise UnsupportedProgram(f"copy {c.name}: allocation without an address")
            out.append((bases[sa] + so, bases[da] + do, c.nbytes))
    return out
