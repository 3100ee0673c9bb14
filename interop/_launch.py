"""Launch programs: a fixed sequence of CUDA kernels started by one call per use.

A `LaunchProgram` holds, in one ctypes structure (mirrored by `_launch_program.c`):
  stream, mask     written per call (mask bit i: launch kernel i this time);
  slots[32]        device pointers; the first `per_call` are written per call, the rest once;
  kernels[i]       function handle, grid, block, dynamic shared memory, and a parameter array
                   whose entries point at slots, so writing a slot re-targets every kernel that
                   reads it; or, for a Mosaic GPU kernel, jaxlib's host launch function and its
                   context (`host`, `host_abi`), called with the stream and the slots' values.
The hot path (`DecodeLauncher.__call__`) is one `struct.pack_into` of the per-call words and one
foreign call, `funcmla_run(program)`, which loops over the kernels calling `cuLaunchKernel`.

Why a tiny C helper: a ctypes call of `cuLaunchKernel` converts its 11 arguments on every call,
once per kernel; the helper makes one foreign call with one argument for all kernels of a decode
call (`python -m bench.launcher` compares both; figures in docs/torch_launcher.md), and the
driver receives the same arguments. It is compiled at first use with the system C compiler (`cc`,
or $CC) into a per-user cache, needs no CUDA headers and links nothing (the address of the
driver's `cuLaunchKernel` is stored in the program). Without a compiler (or with
FUNCMLA_LAUNCH_NATIVE=0) the same program runs through pure ctypes, one `cuLaunchKernel` call per
kernel with pre-converted arguments: identical launches, more host time (`native_reason()` says
which is in use and why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import struct
import subprocess
import tempfile
from typing import Sequence

__all__ = [
    "MAX_KERNELS",
    "MAX_PARAMS",
    "MAX_SLOTS",
    "ProgramKernel",
    "LaunchProgram",
    "native_library",
    "native_reason",
    "launch_function_type",
    "StageProgram",
    "MAX_COPIES",
]

MAX_KERNELS, MAX_PARAMS, MAX_SLOTS = 64, 32, 128
MAX_COPIES = 4
MAX_ARGS, MAX_SHAPES, MAX_DIMS = 8, 4, 4
BAD_ARGUMENT = -1  # funcmla_run_checked: a tensor check failed, nothing was launched
_AOTI = ("data_ptr", "sizes", "strides", "dim", "dtype", "device_type", "device_index")
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launch_program.c")

# cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, kernelParams, extra) -> CUresult
launch_function_type = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p)


# A Mosaic GPU host launch function, by host_abi: 1 = void(context, stream, buffers) (jaxlib
# 0.11.2); 2 = void(args), args = {&context, &stream, &buffers} (MLIR's packed interface, 0.10.2).
HOST_ABI_DIRECT, HOST_ABI_PACKED = 1, 2
_HOST_FN = {HOST_ABI_DIRECT: ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p,
                                              ctypes.c_void_p),
            HOST_ABI_PACKED: ctypes.CFUNCTYPE(None, ctypes.c_void_p)}


class _Kernel(ctypes.Structure):
    _fields_ = [("function", ctypes.c_void_p), ("host", ctypes.c_void_p),
                ("host_abi", ctypes.c_uint64), ("grid", ctypes.c_uint32 * 3),
                ("block", ctypes.c_uint32 * 3), ("shared_mem_bytes", ctypes.c_uint32),
                ("num_params", ctypes.c_uint32), ("params", ctypes.c_void_p * MAX_PARAMS)]


class _TorchApi(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _AOTI]


class _ArgSpec(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int32), ("device_type", ctypes.c_int32),
                ("device_index", ctypes.c_int32), ("num_shapes", ctypes.c_int32),
                ("align_mask", ctypes.c_uint64), ("ndim", ctypes.c_int64 * MAX_SHAPES),
                ("shape", (ctypes.c_int64 * MAX_DIMS) * MAX_SHAPES)]


class _Program(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_uint64), ("mask", ctypes.c_uint64),
                ("slots", ctypes.c_uint64 * MAX_SLOTS), ("launch", ctypes.c_void_p),
                ("num_kernels", ctypes.c_uint32), ("failed_kernel", ctypes.c_int32),
                ("kernels", _Kernel * MAX_KERNELS), ("torch", _TorchApi),
                ("num_args", ctypes.c_uint32), ("bad_argument", ctypes.c_int32),
                ("args", _ArgSpec * MAX_ARGS)]


class _Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D (only its size is checked here)
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
                ("srcMemoryType", ctypes.c_int32), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("dstXInBytes", ctypes.c_size_t),
                ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int32),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64),
                ("dstArray", ctypes.c_void_p), ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class _Stage(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_uint64), ("num_copies", ctypes.c_uint64),
                ("live_value", ctypes.c_uint64), ("src", ctypes.c_uint64 * MAX_COPIES),
                ("src_pitch", ctypes.c_uint64 * MAX_COPIES),
                ("count", ctypes.c_uint64 * MAX_COPIES), ("dst", ctypes.c_uint64 * MAX_COPIES),
                ("live_dst", ctypes.c_uint64), ("graph_exec", ctypes.c_void_p),
                ("memcpy2d", ctypes.c_void_p), ("memset32", ctypes.c_void_p),
                ("graph_launch", ctypes.c_void_p), ("failed", ctypes.c_int32)]


def ctypes_layout() -> tuple[int, ...]:
    """The sizes and offsets `funcmla_layout` reports, as the ctypes mirror has them."""
    return (ctypes.sizeof(_Program), _Program.kernels.offset, ctypes.sizeof(_Kernel),
            _Program.launch.offset, _Program.torch.offset, _Program.args.offset,
            ctypes.sizeof(_ArgSpec), ctypes.sizeof(_Stage), ctypes.sizeof(_Memcpy2D))


def native_layout(lib) -> tuple[int, ...]:
    """The C helper's sizes and offsets (`funcmla_layout` writes one word per entry of
    `ctypes_layout()`: the buffer is sized from it, so the two cannot drift apart)."""
    out = (ctypes.c_uint64 * len(ctypes_layout()))()
    lib.funcmla_layout(out)
    return tuple(out)


def _cache_dir() -> str:
    base = os.environ.get("FUNCMLA_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(xdg, "funcmla")
    try:
        os.makedirs(base, exist_ok=True)
        probe = os.path.join(base, f".w{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
        return base
    except OSError:
        path = os.path.join(tempfile.gettempdir(), f"funcmla-{os.getuid()}")
        os.makedirs(path, exist_ok=True)
        return path


def _compiler() -> str | None:
    for cand in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


@functools.lru_cache(maxsize=1)
def native_library() -> tuple[ctypes.CDLL | None, str]:
    """(the compiled helper, how it was obtained) or (None, why not)."""
    if os.environ.get("FUNCMLA_LAUNCH_NATIVE", "1") == "0":
        return None, "disabled by FUNCMLA_LAUNCH_NATIVE=0"
    with open(_SOURCE, "rb") as f:
        src = f.read()
    tag = hashlib.sha256(src + platform.machine().encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"libfuncmla_launch_{tag}.so")
    how = f"cached {path}"
    if not os.path.exists(path):
        cc = _compiler()
        if cc is None:
            return None, "no C compiler (cc, gcc, clang or $CC) on PATH"
        tmp = f"{path}.tmp{os.getpid()}"
        proc = subprocess.run([cc, "-O2", "-std=c99", "-shared", "-fPIC", "-o", tmp, _SOURCE],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            return None, f"{cc} failed: {proc.stderr.strip()[:300]}"
        os.replace(tmp, path)
        how = f"compiled with {cc} into {path}"
    try:
        lib = ctypes.CDLL(path)
    except OSError as err:
        return None, f"could not load {path}: {err}"
    layout, want = native_layout(lib), ctypes_layout()
    if layout != want:
        return None, f"struct layout of {path} {tuple(layout)} != ctypes {want}"
    return lib, how


@functools.lru_cache(maxsize=1)
def torch_api() -> tuple[_TorchApi | None, str]:
    """(addresses of libtorch's `aoti_torch_get_*` shim functions, how) or (None, why not).

    Returned only where `describe` agrees with torch's own accessors on probe tensors (four
    dtypes; 1-, 2- and 3-d; a sliced, non-contiguous view with a storage offset)."""
    lib, how = native_library()
    if lib is None:
        return None, f"no native helper ({how})"
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    api = _TorchApi()
    try:
        shim = ctypes.CDLL(os.path.join(libdir, "libtorch_cpu.so"))
        for name in _AOTI:
            setattr(api, name, ctypes.cast(getattr(shim, f"aoti_torch_get_{name}"),
                                           ctypes.c_void_p).value)
    except (OSError, AttributeError) as err:
        return None, f"libtorch's aoti_torch_get_* shim not found ({err})"
    base = torch.arange(3 * 5 * 8, dtype=torch.float32).reshape(3, 5, 8).to(torch.bfloat16)
    probes = [base, base[1:, :, ::2], torch.zeros(7, dtype=torch.int32),
              torch.zeros(2, 3, dtype=torch.float32), torch.zeros(4, dtype=torch.float16)]
    codes = set()
    for t in probes:
        got = describe(api, t)
        if got is None:
            return None, "the shim could not read a probe tensor"
        dtype, device_type, device_index, ndim, data, sizes, strides = got
        if (ndim, sizes, strides, data, device_index) != (
                t.dim(), tuple(t.shape), tuple(t.stride()), t.data_ptr(), t.get_device()):
            return None, (f"the shim disagrees with torch on a probe tensor: {got} vs "
                          f"{(t.dim(), tuple(t.shape), tuple(t.stride()), t.data_ptr())}")
        codes.add((t.dtype, dtype))
    if len({c for _, c in codes}) != len({d for d, _ in codes}):
        return None, f"the shim's dtype codes do not tell the probe dtypes apart: {codes}"
    return api, f"libtorch shim in {libdir}"


def describe(api: _TorchApi, tensor) -> tuple | None:
    """(dtype code, device type, device index, ndim, data pointer, sizes, strides) of a torch
    tensor as the C helper reads it (None if it cannot)."""
    lib, _ = native_library()
    out = (ctypes.c_int64 * 13)()
    if lib is None or lib.funcmla_describe(ctypes.byref(api), ctypes.c_uint64(tensor._cdata),
                                           out):
        return None
    n = out[3]
    if not 0 <= n <= MAX_DIMS:
        return None
    return (out[0], out[1], out[2], n, out[4], tuple(out[5:5 + n]), tuple(out[9:9 + n]))


def native_reason() -> str | None:
    """None when the C helper is in use, else why the pure-ctypes path runs."""
    lib, how = native_library()
    return None if lib is not None else how


class ProgramKernel:
    """One kernel of a program: handle, launch shape and the slot each parameter reads.

    host: 0 for a kernel launched with cuLaunchKernel(function, grid, block, ...); else the
    address of a Mosaic GPU host launch function (`function` is then its context, and grid /
    block / shared memory are the host function's business), called as `host_abi` says
    (HOST_ABI_DIRECT / HOST_ABI_PACKED) with buffers[j] = the value of param_slots[j]."""

    __slots__ = ("name", "function", "grid", "block", "shared_mem_bytes", "param_slots", "host",
                 "host_abi")

    def __init__(self, name: str, function: int, grid: Sequence[int], block: Sequence[int],
                 shared_mem_bytes: int, param_slots: Sequence[int], host: int = 0,
                 host_abi: int = HOST_ABI_DIRECT):
        if len(param_slots) > MAX_PARAMS:
            raise ValueError(f"{name}: {len(param_slots)} parameters; a program kernel takes at "
                             f"most {MAX_PARAMS}")
        if any(not 0 <= s < MAX_SLOTS for s in param_slots):
            raise ValueError(f"{name}: parameter slots {list(param_slots)} outside "
                             f"[0, {MAX_SLOTS})")
        self.name, self.function = name, int(function)
        self.grid, self.block = tuple(int(g) for g in grid), tuple(int(b) for b in block)
        self.shared_mem_bytes, self.param_slots = int(shared_mem_bytes), tuple(param_slots)
        self.host = int(host)
        if self.host and host_abi not in _HOST_FN:
            raise ValueError(f"{name}: host_abi must be one of {sorted(_HOST_FN)}, got {host_abi}")
        self.host_abi = int(host_abi)


class LaunchProgram:
    """A fixed sequence of kernels over shared pointer slots (see the module docstring).

    per_call: how many leading slots the caller writes on each call, with
              `pack(buffer, 0, stream, mask, *values)` (a bound `struct.Struct.pack_into`);
    fixed:    {slot: value} written once (scratch buffers, null scratch pointers).
    Then `run(ref)` launches the kernels whose mask bit is set and returns a CUresult
    (`failed_kernel` names the kernel on error).
    """

    def __init__(self, kernels: Sequence[ProgramKernel], per_call: int,
                 fixed: dict[int, int], launch_address: int, *, native: bool | None = None):
        if not 0 < len(kernels) <= MAX_KERNELS:
            raise ValueError(f"a program runs 1..{MAX_KERNELS} kernels, got {len(kernels)}")
        if not 0 <= per_call <= MAX_SLOTS - len(fixed) or any(s < per_call for s in fixed):
            raise ValueError(f"per-call slots [0, {per_call}) overlap fixed slots {sorted(fixed)}")
        self.kernels = tuple(kernels)
        self.per_call = per_call
        p = _Program()
        self.struct = p
        for slot, value in fixed.items():
            p.slots[slot] = int(value)
        p.launch = int(launch_address)
        p.num_kernels = len(kernels)
        p.failed_kernel = -1
        slots_base = ctypes.addressof(p.slots)
        for i, k in enumerate(kernels):
            d = p.kernels[i]
            d.function = k.function
            d.host = k.host
            d.host_abi = k.host_abi
            d.grid[:] = list(k.grid)
            d.block[:] = list(k.block)
            d.shared_mem_bytes = k.shared_mem_bytes
            d.num_params = len(k.param_slots)
            for j, slot in enumerate(k.param_slots):
                d.params[j] = slots_base + 8 * slot
        self.pack = struct.Struct(f"<{2 + per_call}Q").pack_into
        self.buffer = p
        self.ref = ctypes.byref(p)
        lib, how = native_library()
        if native is False:
            lib, how = None, "pure ctypes requested"
        elif native and lib is None:
            raise RuntimeError(f"the native launch helper is unavailable: {how}")
        self.native = lib is not None
        self.run_checked = None
        self.how = "native (one foreign call per use)" if lib is not None else (
            f"ctypes (one cuLaunchKernel call per kernel; {how})")
        if lib is not None:
            run = lib["funcmla_run"]  # a fresh function object: argtypes stay unset (fastest)
            run.restype = ctypes.c_int
            self.run = run
        else:
            self._raw = launch_function_type(int(launch_address))
            u = ctypes.c_uint
            self._pre = [(ctypes.c_void_p(k.function), u(k.grid[0]), u(k.grid[1]), u(k.grid[2]),
                          u(k.block[0]), u(k.block[1]), u(k.block[2]), u(k.shared_mem_bytes))
                         for k in kernels]
            self._host = [self._host_call(p, i, k) if k.host else None
                          for i, k in enumerate(kernels)]
            self._params = [ctypes.c_void_p(ctypes.addressof(p.kernels[i].params))
                            for i in range(len(kernels))]
            self.run = self._run_ctypes

    def enable_checks(self, api: _TorchApi, specs: Sequence[tuple]) -> None:
        """Let `run_checked(ref)` take tensors: slots[i] = tensor._cdata for i < len(specs), each
        checked in C against spec (dtype code, device type, device index, align mask, shapes)
        and replaced by its data pointer (native helper only)."""
        if not self.native:
            raise RuntimeError("tensor checks in C need the native helper")
        if len(specs) > MAX_ARGS:
            raise ValueError(f"at most {MAX_ARGS} checked arguments, got {len(specs)}")
        p = self.struct
        p.torch = api
        for i, (dtype, device_type, device_index, align_mask, shapes) in enumerate(specs):
            a = p.args[i]
            if not 0 < len(shapes) <= MAX_SHAPES or any(len(sh) > MAX_DIMS for sh in shapes):
                raise ValueError(f"argument {i}: 1..{MAX_SHAPES} shapes of <= {MAX_DIMS} dims")
            a.dtype, a.device_type, a.device_index = dtype, device_type, device_index
            a.align_mask, a.num_shapes = align_mask, len(shapes)
            for j, sh in enumerate(shapes):
                a.ndim[j] = len(sh)
                for d, n in enumerate(sh):
                    a.shape[j][d] = n
        p.num_args = len(specs)
        lib, _ = native_library()
        run = lib["funcmla_run_checked"]
        run.restype = ctypes.c_int
        self.run_checked = run

    @property
    def bad_argument(self) -> int:
        return int(self.struct.bad_argument)

    def _run_ctypes(self, _ref) -> int:
        p = self.struct
        stream = ctypes.c_void_p(p.stream)
        mask = p.mask
        p.failed_kernel = -1
        raw = self._raw
        for i, pre in enumerate(self._pre):
            if mask >> i & 1:
                host = self._host[i]
                if host is not None:
                    host(p.stream)
                    continue
                rc = raw(*pre, stream, self._params[i], None)
                if rc:
                    p.failed_kernel = i
                    return rc
        return 0

    @staticmethod
    def _host_call(p, index: int, k: ProgramKernel):
        """The ctypes form of funcmla_run's Mosaic GPU branch for kernel `index`."""
        fn = _HOST_FN[k.host_abi](k.host)
        n = len(k.param_slots)
        buffers = (ctypes.c_void_p * max(n, 1))()
        context, stream = ctypes.c_void_p(k.function), ctypes.c_void_p()
        buffer_list = ctypes.c_void_p(ctypes.addressof(buffers))
        args = (ctypes.c_void_p * 3)(ctypes.addressof(context), ctypes.addressof(stream),
                                     ctypes.addressof(buffer_list))
        slots = p.slots
        taken = k.param_slots

        direct = k.host_abi == HOST_ABI_DIRECT

        def call(stream_value: int) -> None:
            for j, slot in enumerate(taken):
                buffers[j] = slots[slot]
            stream.value = stream_value
            if direct:
                fn(context, stream, buffer_list)
            else:
                fn(args)

        call.keep = (buffers, context, stream, buffer_list, args)
        return call

    def slot(self, index: int) -> int:
        return int(self.struct.slots[index])

    def set_slot(self, index: int, value: int) -> None:
        self.struct.slots[index] = int(value)

    @property
    def failed_kernel(self) -> ProgramKernel | None:
        i = self.struct.failed_kernel
        return self.kernels[i] if 0 <= i < len(self.kernels) else None

    def launch(self, stream: int, mask: int, *values: int) -> int:
        """Write the per-call words and run (convenience; the launchers inline this)."""
        self.pack(self.buffer, 0, stream, mask, *values)
        return self.run(self.ref)


class StageProgram:
    """One step of a metadata program on a stream, in one foreign call (`funcmla_stage_run`,
    native helper only): up to MAX_COPIES device copies of 32-bit words into fixed places
    (a source pitch of 8 reads an int64 tensor's low words), a 32-bit memset of one word, then
    `cuGraphLaunch` of an instantiated graph.

    Per call, `pack(buffer, 0, stream, num_copies, live_value, *src, *src_pitch, *count,
    *dst)` (4 each) then `run(ref)`; returns a CUresult, `failed` says which step failed.
    addresses: (cuMemcpy2DAsync_v2, cuMemsetD32Async, cuGraphLaunch) in the driver.
    """

    def __init__(self, live_dst: int, graph_exec: int, addresses: tuple[int, int, int]):
        lib, how = native_library()
        if lib is None:
            raise RuntimeError(f"the native launch helper is unavailable: {how}")
        st = _Stage()
        st.live_dst, st.graph_exec = int(live_dst), int(graph_exec)
        st.memcpy2d, st.memset32, st.graph_launch = (int(a) for a in addresses)
        st.failed = -1
        self.struct = self.buffer = st
        self.ref = ctypes.byref(st)
        self.pack = struct.Struct(f"<3Q{4 * MAX_COPIES}Q").pack_into
        run = lib["funcmla_stage_run"]
        run.restype = ctypes.c_int
        self.run = run

    @property
    def failed(self) -> int:
        return int(self.struct.failed)
