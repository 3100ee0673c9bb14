"""funcmla's Pallas kernels as torch ops: compiled once, launched on torch's current stream.

The mechanism (evidence and alternatives in docs/torch_launcher.md):

1. **Extract.** A Pallas call on the Triton lowering becomes one XLA custom call when a jitted
   function is lowered; lowering needs no data and no GPU. `extract_triton_calls` walks the
   lowered StableHLO and reads each call back: grid, warps, stages, operand/result types, and
   the kernel itself. jax 0.10.2 and 0.11.2 (seen on the H200 image) emit
   `__gpu$xla.gpu.triton`, holding the kernel's Triton IR (MLIR bytecode) that XLA compiles
   internally; some jaxlib versions emit `triton_kernel_call_ffi`, whose backend config is a
   zlib-compressed `jax_triton.TritonAnyKernelCall` protobuf holding PTX (both are read).
2. **Compile** (`compile_call`, no GPU needed). Triton IR -> PTX with jaxlib's Triton
   compilation handler where one is registered, else -> cubin with the `triton` package (3.6 on
   the H200 image; jaxlib's IR is printed as text with jaxlib's Triton dialect and compiled as a
   .ttir source). PTX -> cubin with ptxas (the driver's JIT as a last resort).
3. **Load** the image with `cuModuleLoadDataEx` in the device's primary context (torch's), and
   raise the dynamic shared-memory limit when a kernel needs more than 48 KiB.
4. **Launch.** `cuLaunchKernel` through ctypes (`funcmla.interop._cuda_driver`) on
   `torch.cuda.current_stream()` (read with `torch._C._cuda_getCurrentRawStream`), with a
   kernel-parameter array built once per kernel: a call writes the new device pointers into it
   and launches. Triton's ABI appends two pointer parameters (global and profile scratch) that
   these kernels do not use (checked: zero scratch sizes); they are passed as null, as jaxlib
   does. Launches on a capturing stream are captured by CUDA graphs; replays run the kernels
   on whatever the captured buffers then hold.

Each launcher checks every tensor before any launch: dtype, shape (against the compiled static
configuration), contiguity, device and alignment (the kernels' Triton IR declares
`tt.divisibility = 32` on every pointer, so 32 bytes). A failed check raises
`LauncherArgumentError` (a ValueError) naming the argument, and nothing is launched. Index
*values* are not checked (that would need a device sync); `validate_decode_inputs` does that
eagerly.

The decode launcher (`decode_launcher`, or `torch_decode` keyed by shapes) runs, per call:
  prep kernel  (Pallas, here; skipped when the caller passes kv_lens):
               kv_lens[b] = kv_indptr[b+1] - kv_indptr[b]
  decode kernel (Pallas, funcmla.attention.pallas.decode_triton): its pallas_call, extracted
               from `mla_decode_rows`, with table_start = kv_indptr (its first B entries);
  merge kernel (Pallas, here; only when num_splits > 1): the log-sum-exp combine of
               `decode_common.merge_splits`, with IEEE (.rn) multiply, add and divide.
q and out alias the kernels' [B, rows, D] blocks directly when rows (= s_q * heads) is a
multiple of the kernel's row block; otherwise q is copied into a zero-padded buffer and the
result copied out (two extra torch copies, still capturable).

Limits: one launcher's scratch (kv_lens, split partials) is shared by its calls, so calls of one
launcher must not run concurrently on different streams; a launcher instance is guarded by a
lock against concurrent host threads. NVIDIA GPUs only; no ROCm. fp8 pools are not taken (the
decode kernel reads bf16/f16).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import shutil
import subprocess
import tempfile
import threading
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.attention.pallas import DecodeKernelConfig, choose_num_splits
from funcmla.attention.pallas.decode_common import KVRows, num_row_blocks

__all__ = [
    "LauncherArgumentError",
    "LauncherUnavailable",
    "TritonCall",
    "extract_triton_calls",
    "parse_kernel_call_proto",
    "ptx_entry_params",
    "TensorSpec",
    "LoadedKernel",
    "DecodeLaunchConfig",
    "DecodePlan",
    "decode_plan",
    "DecodeLauncher",
    "decode_launcher",
    "launcher_unavailable_reason",
    "merge_splits_pallas",
    "kv_lens_pallas",
    "MERGE_CONTRACT",
    "compile_call",
    "ttir_text",
    "ttir_divisibility",
    "torch_decode",
    "torch_decode_unsupported_reason",
]


class LauncherArgumentError(ValueError):
    """A tensor handed to a launcher does not match its compiled configuration."""


class LauncherUnavailable(RuntimeError):
    """The launcher cannot run here (no CUDA torch, no NVIDIA driver, no Triton lowering)."""


# ============================================================================ extraction
@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Pallas Triton kernel as XLA would launch it.

    ptx / ttir: exactly one is set (ttir: MLIR bytecode of the Triton module, jaxlib <= 0.10.2).
    operands / results: ((shape, dtype name), ...) in the kernel's parameter order.
    shared_mem_bytes: dynamic shared memory per block (None until compiled from ttir).
    """

    name: str
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int | None
    num_ctas: int
    shared_mem_bytes: int | None
    operands: tuple[tuple[tuple[int, ...], str], ...]
    results: tuple[tuple[tuple[int, ...], str], ...]
    ptr_divisibility: tuple[int, ...]
    ptx: str | None = None
    ttir: bytes | None = None

    def summary(self) -> dict:
        return {"name": self.name, "grid": self.grid, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "shared_mem_bytes": self.shared_mem_bytes,
                "operands": self.operands, "results": self.results,
                "form": "ptx" if self.ptx is not None else "ttir"}


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated protobuf varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _proto_fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """Wire-format fields of one protobuf message: (field number, wire type, value)."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            n, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
        out.append((field, wire, value))
    return out


def parse_kernel_call_proto(serialized: bytes) -> dict:
    """Decode a `jax_triton.TritonAnyKernelCall` (jaxlib/gpu/triton.proto) holding one plain
    kernel call. Returns {name, num_warps, num_ctas, shared_mem_bytes, ptx, grid,
    ptr_divisibility}; raises ValueError for autotuned calls, scalar or zero-filled parameters."""
    call = None
    for field, _, value in _proto_fields(serialized):
        if field == 1:
            call = value
        elif field == 2:
            raise ValueError("autotuned Triton kernel calls are not supported by the launcher")
    if call is None:
        raise ValueError("TritonAnyKernelCall holds no kernel_call")
    kernel, grid, divisibility = None, [0, 0, 0], []
    for field, _, value in _proto_fields(call):
        if field == 1:
            kernel = value
        elif field in (2, 3, 4):
            grid[field - 2] = value
        elif field == 5:
            param = _proto_fields(value)
            if len(param) != 1 or param[0][0] != 1:
                raise ValueError("only array parameters are supported (Pallas passes no scalars)")
            array = dict((f, v) for f, _, v in _proto_fields(param[0][2]))
            if array.get(1, 0):
                raise ValueError(f"array parameter {len(divisibility)} asks for "
                                 f"{array[1]} zeroed bytes; not supported")
            divisibility.append(int(array.get(2, 0)))
    if kernel is None:
        raise ValueError("TritonKernelCall holds no kernel")
    k = {1: b"", 2: 0, 3: 0, 4: b"", 10: 1}
    for field, _, value in _proto_fields(kernel):
        k[field] = value
    return {"name": k[1].decode(), "num_warps": int(k[2]), "num_ctas": int(k[10]),
            "shared_mem_bytes": int(k[3]), "ptx": k[4].decode(), "grid": tuple(grid),
            "ptr_divisibility": tuple(divisibility)}


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _walk(inner.operation)


def _type_sig(value) -> tuple[tuple[int, ...], str]:
    from jax._src.lib.mlir import ir

    t = ir.RankedTensorType(value.type)
    return tuple(int(d) for d in t.shape), str(t.element_type)


def _attr_bytes(attr) -> bytes:
    from jax._src.lib.mlir import ir

    return ir.StringAttr(attr).value_bytes


def _dict_get(attr, key):
    from jax._src.lib.mlir import ir

    d = ir.DictAttr(attr)
    return d[key] if key in d else None


def extract_triton_calls(lowered) -> list[TritonCall]:
    """Every Pallas Triton kernel in a lowered jitted function (`jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`), in program order."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    calls = []
    with module.context:
        for op in _walk(module.operation):
            if op.operation.name != "stablehlo.custom_call":
                continue
            attrs = op.operation.attributes
            target = ir.StringAttr(attrs["call_target_name"]).value
            operands = tuple(_type_sig(v) for v in op.operation.operands)
            results = tuple(_type_sig(v) for v in op.operation.results)
            config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
            if target == "triton_kernel_call_ffi":
                if config is None:
                    config = attrs["backend_config"]
                raw = zlib.decompress(_attr_bytes(_dict_get(config, "opaque")))
                p = parse_kernel_call_proto(raw)
                calls.append(TritonCall(
                    name=p["name"], grid=p["grid"], num_warps=p["num_warps"], num_stages=None,
                    num_ctas=p["num_ctas"], shared_mem_bytes=p["shared_mem_bytes"],
                    operands=operands, results=results,
                    ptr_divisibility=p["ptr_divisibility"], ptx=p["ptx"]))
            elif target == "__gpu$xla.gpu.triton":
                geti = lambda k: int(ir.IntegerAttr(_dict_get(config, k)).value)  # noqa: E731
                ttir = _attr_bytes(_dict_get(config, "ir"))
                divisibility = ttir_divisibility(ttir_text(ttir))
                if len(divisibility) != len(operands) + len(results):
                    raise ValueError(f"Triton IR takes {len(divisibility)} arguments; the custom "
                                     f"call has {len(operands)} operands + {len(results)} results")
                calls.append(TritonCall(
                    name=ir.StringAttr(_dict_get(config, "name")).value,
                    grid=(geti("grid_x"), geti("grid_y"), geti("grid_z")),
                    num_warps=geti("num_warps"), num_stages=geti("num_stages"), num_ctas=1,
                    shared_mem_bytes=None, operands=operands, results=results,
                    ptr_divisibility=divisibility, ttir=ttir))
    return calls


def lower_for_cuda(fn: Callable, *avals) -> Any:
    """Lower `fn` for CUDA without running it (works on a CPU-only machine)."""
    return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",))


def extract_one(fn: Callable, *avals) -> TritonCall:
    """The single Pallas Triton kernel of `fn`; raises if there is not exactly one."""
    calls = extract_triton_calls(lower_for_cuda(fn, *avals))
    if len(calls) != 1:
        raise LauncherUnavailable(
            f"expected exactly one Pallas Triton kernel in {getattr(fn, '__name__', fn)}, "
            f"found {len(calls)} (is the Triton lowering of pallas_call in use?)")
    return calls[0]


# ============================================================================ PTX handling
_ENTRY = re.compile(r"\.entry\s+([\w$.]+)\s*\((.*?)\)", re.S)


def ptx_entry_params(ptx: str, name: str | None = None) -> tuple[str, list[str]]:
    """(entry name, parameter declarations) of the kernel entry in `ptx`."""
    entries = _ENTRY.findall(ptx)
    if name is not None:
        entries = [e for e in entries if e[0] == name]
    if len(entries) != 1:
        raise ValueError(f"expected one .entry{'' if name is None else ' ' + name} in the PTX, "
                         f"found {len(entries)}")
    entry, body = entries[0]
    params = [p.strip() for p in body.split(",") if p.strip()]
    return entry, params


def ptx_target(ptx: str) -> str:
    m = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    if not m:
        raise ValueError("PTX has no .target line")
    return m.group(1)


def _ptxas_candidates() -> list[str]:
    found = []
    env = os.environ.get("FUNCMLA_PTXAS")
    if env:
        found.append(env)
    import importlib

    for mod in ("nvidia.cu13", "nvidia.cuda_nvcc"):
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        for base in list(getattr(m, "__path__", [])):
            found.append(os.path.join(base, "bin", "ptxas"))
    try:
        import triton.backends.nvidia as tnv

        found.append(os.path.join(os.path.dirname(tnv.__file__), "bin", "ptxas"))
    except Exception:  # noqa: BLE001 - triton is optional
        pass
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            found.append(os.path.join(root, "bin", "ptxas"))
    which = shutil.which("ptxas")
    if which:
        found.append(which)
    seen, out = set(), []
    for path in found:
        if path not in seen and os.path.isfile(path) and os.access(path, os.X_OK):
            seen.add(path)
            out.append(path)
    return out


@functools.lru_cache(maxsize=64)
def compile_ptx(ptx: str) -> tuple[bytes, str]:
    """PTX -> (module image, how). Tries each ptxas found; else the driver JIT (image = PTX)."""
    arch = ptx_target(ptx)
    errors = []
    for ptxas in _ptxas_candidates():
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas, f"-arch={arch}", "-o", dst, src],
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                with open(dst, "rb") as f:
                    return f.read(), f"ptxas:{ptxas}"
            errors.append(f"{ptxas}: {proc.stderr.strip()[:300]}")
    return ptx.encode() + b"\0", "driver-jit" + (f" (ptxas failed: {errors})" if errors else "")


def ttir_text(call_or_bytecode) -> str:
    """Triton IR (a TritonCall's, or MLIR bytecode) as text, parsed with jaxlib's dialect."""
    from jax._src.lib.mlir import ir
    from jaxlib.triton import dialect as tt_dialect

    raw = call_or_bytecode.ttir if isinstance(call_or_bytecode, TritonCall) else call_or_bytecode
    ctx = ir.Context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        module = ir.Module.parse(raw)
        return module.operation.get_asm(enable_debug_info=False)


_FUNC_SIG = re.compile(r"tt\.func\s+public\s+@([\w$.]+)\((.*?)\)\s*(?:attributes|\{)", re.S)


def ttir_divisibility(text: str) -> tuple[int, ...]:
    """Pointer divisibility (bytes) the kernel assumes for each argument (1 where unstated)."""
    m = _FUNC_SIG.search(text)
    if not m:
        raise ValueError("no public tt.func in the Triton IR")
    args = re.split(r",\s*(?=%arg\d+:)", m.group(2).strip())
    out = []
    for arg in args:
        d = re.search(r"tt\.divisibility\s*=\s*(\d+)", arg)
        out.append(int(d.group(1)) if d else 1)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CompiledImage:
    """A loadable module image of one kernel, with what a launch needs to know."""

    image: bytes            # cubin (or NUL-terminated PTX for the driver's JIT)
    entry: str              # kernel symbol
    num_params: int         # PTX parameters (buffers + Triton's trailing scratch pointers)
    shared_mem_bytes: int   # dynamic shared memory per block
    how: str                # which compiler produced `image`
    ptx: str


def _check_params(call: TritonCall, ptx: str) -> tuple[str, int]:
    entry, params = ptx_entry_params(ptx, call.name if f".entry {call.name}(" in ptx else None)
    n_buffers = len(call.operands) + len(call.results)
    if len(params) - n_buffers not in (0, 1, 2) or not all(
            ".u64" in p or ".b64" in p for p in params):
        raise LauncherUnavailable(
            f"{call.name}: PTX entry has {len(params)} parameters {params[:4]}..., expected "
            f"{n_buffers} buffer pointers plus up to 2 scratch pointers")
    return entry, len(params)


def _compile_ttir_with_triton(call: TritonCall, cc: int) -> CompiledImage:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
    except ImportError as err:
        raise LauncherUnavailable(
            "this jax lowers Pallas to Triton IR that XLA compiles internally; the launcher "
            f"compiles it with the `triton` package, which is not importable ({err})") from None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{call.name}.ttir")
        with open(path, "w") as f:
            f.write(ttir_text(call))
        kernel = triton.compile(path, target=GPUTarget("cuda", cc, 32),
                                options=dict(num_warps=call.num_warps, num_ctas=1,
                                             num_stages=3 if call.num_stages is None
                                             else call.num_stages))
    md = kernel.metadata
    for field in ("global_scratch_size", "profile_scratch_size"):
        if getattr(md, field, 0):
            raise LauncherUnavailable(f"{call.name} needs Triton {field}={getattr(md, field)}; "
                                      "the launcher passes no scratch")
    cluster = tuple(getattr(md, "cluster_dims", (1, 1, 1)) or (1, 1, 1))
    if any(c != 1 for c in cluster):
        raise LauncherUnavailable(f"{call.name}: cluster dims {cluster} are not supported")
    if md.num_warps != call.num_warps:
        raise LauncherUnavailable(f"{call.name}: Triton compiled {md.num_warps} warps, the "
                                  f"lowering asked for {call.num_warps}")
    ptx = kernel.asm["ptx"]
    entry, num_params = _check_params(call, ptx)
    if entry != md.name:
        raise LauncherUnavailable(f"{call.name}: PTX entry {entry} != Triton's name {md.name}")
    return CompiledImage(kernel.asm["cubin"], entry, num_params, int(md.shared),
                         f"triton {triton.__version__} (TTIR -> cubin)", ptx)


def compile_call(call: TritonCall, arch_name: str) -> CompiledImage:
    """Compile an extracted kernel for compute capability `arch_name` ("9.0"); no GPU needed.

    PTX form: ptxas (else the driver's JIT at load time). Triton-IR form: jaxlib's Triton
    compilation handler where this jaxlib registers one (the compiler XLA would use), else the
    `triton` package.
    """
    if call.num_ctas != 1:
        raise LauncherUnavailable(f"{call.name}: clusters (num_ctas={call.num_ctas}) are not "
                                  "supported")
    cc = int(arch_name.replace(".", ""))
    if call.ptx is None:
        from jax._src.lib import triton as jl_triton

        compile_fn = getattr(jl_triton, "compile", None)
        res = None
        if compile_fn is not None:
            try:  # raises RuntimeError where no handler is registered (no CUDA plugin)
                res = compile_fn("cuda", call.ttir, arch_name, num_warps=call.num_warps,
                                 num_ctas=1,
                                 num_stages=3 if call.num_stages is None else call.num_stages)
            except RuntimeError:
                res = None
        if res is None or not getattr(res, "asm", None):
            return _compile_ttir_with_triton(call, cc)
        call = dataclasses.replace(call, ptx=res.asm, shared_mem_bytes=int(res.smem_bytes))
    entry, num_params = _check_params(call, call.ptx)
    image, how = compile_ptx(call.ptx)
    return CompiledImage(image, entry, num_params, int(call.shared_mem_bytes or 0), how, call.ptx)


@functools.lru_cache(maxsize=256)
def _compile_cached(call: TritonCall, arch_name: str) -> CompiledImage:
    return compile_call(call, arch_name)


# ============================================================================ loading / launch
class LoadedKernel:
    """One compiled kernel in a device's primary context, with its parameter array.

    `set_arg(i, ptr)` / `args[i] = ptr` write device pointer i (the kernel's i-th operand or
    result); `launch(stream)` enqueues it. The trailing scratch parameters stay null.
    """

    def __init__(self, call: TritonCall, device_index: int, arch_name: str):
        import ctypes

        from funcmla.interop import _cuda_driver as cd

        compiled = _compile_cached(call, arch_name)
        self.call, self.entry, self.num_params = call, compiled.entry, compiled.num_params
        self.num_buffers = len(call.operands) + len(call.results)
        self.ptx, self.image, self.how = compiled.ptx, compiled.image, compiled.how
        drv = cd.driver()
        try:
            self.module, self.function = drv.load_function(self.image, self.entry, device_index)
        except cd.CudaDriverError as err:
            if not self.how.startswith("ptxas") and not self.how.startswith("triton"):
                raise
            # A cubin from a ptxas newer than the driver does not load: let the driver compile.
            self.image, self.how = self.ptx.encode() + b"\0", f"driver-jit (cubin refused: {err})"
            self.module, self.function = drv.load_function(self.image, self.entry, device_index)
        smem = compiled.shared_mem_bytes
        self.shared_mem_bytes = int(smem)
        if self.shared_mem_bytes > 48 * 1024:
            optin = drv.device_attribute(device_index,
                                         cd.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            if self.shared_mem_bytes > optin:
                raise LauncherUnavailable(f"{call.name} needs {self.shared_mem_bytes} B of shared "
                                          f"memory; the device allows {optin}")
            drv.set_function_attribute(self.function,
                                       cd.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       self.shared_mem_bytes)
        self.num_regs = drv.function_attribute(self.function, cd.CU_FUNC_ATTRIBUTE_NUM_REGS)
        self.args = (ctypes.c_void_p * self.num_params)()  # values (device pointers)
        base = ctypes.addressof(self.args)
        size = ctypes.sizeof(ctypes.c_void_p)
        self._params = (ctypes.c_void_p * self.num_params)(
            *[base + i * size for i in range(self.num_params)])
        self._params_ptr = ctypes.addressof(self._params)
        gx, gy, gz = call.grid
        u = ctypes.c_uint
        # Pre-converted launch arguments: only the stream changes per call (ctypes converts a
        # ready c_uint/c_void_p much faster than a Python int).
        self._pre = (ctypes.c_void_p(self.function), u(gx), u(gy), u(gz),
                     u(32 * call.num_warps), u(1), u(1), u(self.shared_mem_bytes))
        self._stream_arg = ctypes.c_void_p(0)
        self._params_arg = ctypes.c_void_p(self._params_ptr)
        self._raw = drv.launch_raw
        self._drv = drv
        self._device_index = device_index

    def launch(self, stream: int) -> None:
        s = self._stream_arg
        s.value = stream
        code = self._raw(*self._pre, s, self._params_arg, None)
        if code:
            if code == 201:  # no current context on this thread: use the primary one, retry
                self._drv.make_current(self._device_index)
                code = self._raw(*self._pre, s, self._params_arg, None)
            if code:
                self._drv.check_launch(code, self.call.name)

    def info(self) -> dict:
        return {**self.call.summary(), "entry": self.entry, "num_params": self.num_params,
                "compiled_with": self.how, "shared_mem_bytes": self.shared_mem_bytes,
                "num_regs": self.num_regs}


# ============================================================================ argument checks
_TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32"}


class TensorSpec:
    """What one launcher argument must be: dtype, one of `shapes`, contiguous, on
    `device_index` (torch's `get_device()`: -1 is the CPU), `align`-byte aligned."""

    __slots__ = ("name", "dtype", "shapes", "device_index", "align", "_mask", "_shape_text",
                 "_one")

    def __init__(self, name: str, dtype, shapes: Sequence[tuple[int, ...]], device_index: int,
                 align: int = 16):
        self.name, self.dtype, self.device_index = name, dtype, device_index
        if align <= 0 or align & (align - 1):
            raise ValueError(f"TensorSpec.align must be a power of two, got {align}")
        self.align, self._mask = align, align - 1
        self.shapes = frozenset(tuple(s) for s in shapes)
        self._one = next(iter(self.shapes)) if len(self.shapes) == 1 else None
        self._shape_text = " or ".join(str(list(s)) for s in sorted(self.shapes))

    def pointer(self, t) -> int:
        """Check `t` and return its data pointer (raises LauncherArgumentError)."""
        try:
            dtype, shape = t.dtype, t.shape
        except AttributeError:
            raise LauncherArgumentError(f"{self.name} must be a torch.Tensor, got "
                                        f"{type(t).__name__}") from None
        if dtype is not self.dtype:
            import torch

            if not isinstance(t, torch.Tensor):
                raise LauncherArgumentError(f"{self.name} must be a torch.Tensor, got "
                                            f"{type(t).__name__}")
            raise LauncherArgumentError(f"{self.name} must be {self.dtype}, got {dtype}")
        if (shape != self._one) if self._one is not None else (shape not in self.shapes):
            raise LauncherArgumentError(f"{self.name} has shape {list(shape)}; the compiled "
                                        f"configuration takes {self._shape_text}")
        if not t.is_contiguous():
            raise LauncherArgumentError(f"{self.name} must be contiguous (strides "
                                        f"{t.stride()}); pass .contiguous()")
        if t.get_device() != self.device_index:
            where = "cpu" if self.device_index < 0 else f"cuda:{self.device_index}"
            raise LauncherArgumentError(f"{self.name} is on {t.device}; the launcher was "
                                        f"built for {where}")
        ptr = t.data_ptr()
        if ptr & self._mask:
            raise LauncherArgumentError(f"{self.name} data pointer {ptr:#x} is not {self.align}-"
                                        "byte aligned (a sliced view?); the compiled kernels "
                                        "assume it")
        return ptr


# ============================================================================ Pallas helpers
def _kv_lens_kernel(indptr_ref, lens_ref):
    i = pl.program_id(0)
    lens_ref[i] = indptr_ref[i + 1] - indptr_ref[i]


def kv_lens_pallas(kv_indptr: jax.Array, *, interpret: bool = False) -> jax.Array:
    """kv_lens int32 [B] = kv_indptr[1:] - kv_indptr[:-1] (tokens), one program per sequence."""
    b = kv_indptr.shape[0] - 1
    full = lambda n: pl.BlockSpec((n,), lambda i: (0,))  # noqa: E731
    return pl.pallas_call(
        _kv_lens_kernel, grid=(b,), in_specs=[full(b + 1)], out_specs=full(b),
        out_shape=jax.ShapeDtypeStruct((b,), jnp.int32),
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret, name="funcmla_kv_lens")(kv_indptr)


# How the merge kernel rounds: "separate" rounds w*o and each sum (mul.rn / add.rn), "fma"
# fuses them. Chosen on the H200 by comparing with XLA's merge_splits (docs/torch_launcher.md).
MERGE_CONTRACT = "separate"
MERGE_BLOCK_R = 16


def _asm(op: str, *args):
    """One f32 PTX instruction applied elementwise (rounding fixed, no compiler contraction)."""
    shape = args[0].shape
    regs = ", ".join(f"${i + 1}" for i in range(len(args)))
    [out] = pltriton.elementwise_inline_asm(
        f"{op} $0, {regs};", args=[jnp.broadcast_to(a, shape) for a in args],
        constraints="=r," + ",".join("r" for _ in args), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out


def _merge_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, num_splits: int, contract: str,
                  interpret: bool):
    if interpret:
        mul, add, div, fma = (lambda a, b: a * b), (lambda a, b: a + b), (lambda a, b: a / b), None
    else:
        mul = lambda a, b: _asm("mul.rn.f32", a, b)  # noqa: E731
        add = lambda a, b: _asm("add.rn.f32", a, b)  # noqa: E731
        div = lambda a, b: _asm("div.rn.f32", a, b)  # noqa: E731
        fma = lambda a, b, c: _asm("fma.rn.f32", a, b, c)  # noqa: E731
    lse = [lse_ref[s, :] for s in range(num_splits)]
    m = lse[0]
    for s in range(1, num_splits):
        m = jnp.maximum(m, lse[s])
    m_safe = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)
    total = jnp.zeros_like(m)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    for s in range(num_splits):
        w = jnp.exp(lse[s] - m_safe)
        total = add(total, w)
        wb = jnp.broadcast_to(w[:, None], acc.shape)
        o = o_ref[s, :, :]
        if contract == "fma" and fma is not None:
            acc = fma(wb, o, acc)
        else:
            acc = add(acc, mul(wb, o))
    has = total > 0.0
    safe = jnp.where(has, total, 1.0)
    out_ref[...] = div(acc, jnp.broadcast_to(safe[:, None], acc.shape)).astype(out_ref.dtype)
    lse_out_ref[...] = jnp.where(has, m_safe + jnp.log(safe), jnp.inf)


def merge_splits_pallas(o_part: jax.Array, lse_part: jax.Array, out_dtype, *,
                        contract: str | None = None, interpret: bool = False):
    """`decode_common.merge_splits` as one Pallas kernel.

    o_part f32 [B, S, R, Dv], lse_part f32 [B, S, R] (natural log, -inf for empty splits), R a
    multiple of 16 -> out [B, R, Dv] (out_dtype), lse f32 [B, R] (+inf where all are empty).
    """
    b, s, r, dv = o_part.shape
    if r % MERGE_BLOCK_R:
        raise ValueError(f"merge rows {r} must be a multiple of {MERGE_BLOCK_R}")
    br = MERGE_BLOCK_R
    kernel = functools.partial(_merge_kernel, num_splits=s,
                               contract=contract or MERGE_CONTRACT, interpret=interpret)
    return pl.pallas_call(
        kernel, grid=(b, r // br),
        in_specs=[pl.BlockSpec((None, s, br, dv), lambda i, j: (i, 0, j, 0)),
                  pl.BlockSpec((None, s, br), lambda i, j: (i, 0, j))],
        out_specs=[pl.BlockSpec((None, br, dv), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((None, br), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((b, r, dv), out_dtype),
                   jax.ShapeDtypeStruct((b, r), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret, name=f"funcmla_merge_s{s}")(o_part, lse_part)


# ============================================================================ decode
_JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig:
    """Static configuration of one compiled decode launcher (token CSR, page size 1).

    num_seqs:    B (requests), num_heads: H, s_q: query tokens per request (T = B * s_q).
    pool_rows:   rows (token slots) of kv_pool [pool_rows, head_dim].
    kv_capacity: length of kv_indices (entries).
    max_kv_len:  static bound on KV tokens per request for the split rule; None: kv_capacity.
    num_splits:  split-KV count; None: `choose_num_splits` (what `mla_decode` picks).
    """

    num_seqs: int
    num_heads: int
    pool_rows: int
    kv_capacity: int
    sm_scale: float
    s_q: int = 1
    max_kv_len: int | None = None
    num_splits: int | None = None
    head_dim: int = 576
    v_head_dim: int = 512
    dtype: str = "bfloat16"
    kernel: DecodeKernelConfig = DecodeKernelConfig()

    def __post_init__(self):
        for name in ("num_seqs", "num_heads", "pool_rows", "kv_capacity", "s_q", "head_dim",
                     "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecodeLaunchConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_kv_len", "num_splits"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"DecodeLaunchConfig.{name} must be None or a positive int, "
                                 f"got {value!r}")
        if self.dtype not in _JNP_DTYPES:
            raise ValueError(f"DecodeLaunchConfig.dtype must be one of {sorted(_JNP_DTYPES)}, "
                             f"got {self.dtype!r}")
        if not isinstance(self.kernel, DecodeKernelConfig):
            raise TypeError(f"DecodeLaunchConfig.kernel must be a DecodeKernelConfig, got "
                            f"{type(self.kernel).__name__}")

    @property
    def rows(self) -> int:
        return self.s_q * self.num_heads

    @property
    def block_m(self) -> int:
        return self.kernel.resolved_block_m(self.rows)

    @property
    def rows_pad(self) -> int:
        return num_row_blocks(self.rows, self.block_m) * self.block_m

    @property
    def resolved_max_kv_len(self) -> int:
        return self.kv_capacity if self.max_kv_len is None else self.max_kv_len

    @property
    def resolved_num_splits(self) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return choose_num_splits(self.num_seqs, num_row_blocks(self.rows, self.block_m),
                                 self.resolved_max_kv_len, self.kernel)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The kernels of one decode configuration, extracted (no GPU needed)."""

    config: DecodeLaunchConfig
    num_splits: int
    prep: TritonCall
    decode: TritonCall
    merge: TritonCall | None


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


@functools.lru_cache(maxsize=128)
def decode_plan(config: DecodeLaunchConfig) -> DecodePlan:
    """Lower the three Pallas kernels of `config` for CUDA and read them back (cached)."""
    from funcmla.attention.pallas import mla_decode_rows

    c = config
    b, t, d, dv = c.num_seqs, c.num_seqs * c.s_q, c.head_dim, c.v_head_dim
    dt = _JNP_DTYPES[c.dtype]
    splits = c.resolved_num_splits
    i32 = jnp.int32
    prep = extract_one(kv_lens_pallas, _sds((b + 1,), i32))

    def decode_fn(q, kv_pool, table, table_start, kv_lens):
        kv = KVRows(table, table_start, kv_lens, 1, c.resolved_max_kv_len)
        return mla_decode_rows(q, kv_pool, kv, sm_scale=float(c.sm_scale), s_q=c.s_q,
                               num_splits=splits, config=c.kernel, v_head_dim=dv)

    decode = extract_one(decode_fn, _sds((t, c.num_heads, d), dt), _sds((c.pool_rows, d), dt),
                         _sds((c.kv_capacity,), i32), _sds((b,), i32), _sds((b,), i32))
    rp = c.rows_pad
    dname = "bf16" if dt == jnp.bfloat16 else "f16"
    o_dtype = dname if splits == 1 else "f32"
    want_in = (((b,), "i32"), ((b,), "i32"), ((c.kv_capacity,), "i32"), ((b, rp, d), dname),
               ((c.pool_rows, d), dname))
    want_out = (((b, splits, rp, dv), o_dtype), ((b, splits, rp), "f32"))
    if decode.operands != want_in or decode.results != want_out:
        raise LauncherUnavailable(
            "the decode kernel's signature is not the one this launcher wires: got "
            f"{decode.operands} -> {decode.results}, expected {want_in} -> {want_out} "
            "(funcmla.attention.pallas.decode_triton changed its pallas_call)")
    merge = None
    if splits > 1:
        merge = extract_one(functools.partial(merge_splits_pallas, out_dtype=dt),
                            _sds((b, splits, rp, dv), jnp.float32),
                            _sds((b, splits, rp), jnp.float32))
    return DecodePlan(c, splits, prep, decode, merge)


def launcher_unavailable_reason(device=None) -> str | None:
    """None if the launcher can run on `device` (default: torch's current CUDA device)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    if getattr(torch.version, "hip", None):
        return "torch runs on ROCm; the launcher targets NVIDIA GPUs"
    try:
        from funcmla.interop import _cuda_driver

        _cuda_driver.driver()
    except Exception as err:  # noqa: BLE001 - report any reason
        return f"CUDA driver API unavailable ({err})"
    return None


class DecodeLauncher:
    """`mla_decode` for one static configuration, on torch tensors (see the module docstring).

    __call__(q [T, H, 576], kv_pool [pool_rows, 576] (or [pool_rows, 1, 576] /
    [pool_rows, 1, 1, 576]), kv_indptr int32 [B+1] (tokens), kv_indices int32 [kv_capacity]
    (token slots), kv_lens=None int32 [B], out=None [T, H, 512], lse=None float32 [T, H])
    -> (out, lse).
    kv_lens: KV tokens per request; must equal kv_indptr[1:] - kv_indptr[:-1] (not checked: a
    device read); given (SGLang has it: seq_lens), the prep kernel is skipped (one launch less).
    out/lse are allocated (torch.empty) unless given; give them for the fastest call. Results equal `mla_decode` on the same
    inputs: bit-identical for num_splits == 1; for num_splits > 1 the combine is the Pallas
    merge kernel (see docs/torch_launcher.md for its measured agreement with XLA's).
    """

    def __init__(self, plan: DecodePlan, device, *, kernel_factory: Callable | None = None,
                 stream_fn: Callable[[int], int] | None = None):
        """device: a CUDA torch.device. kernel_factory(call, device_index, arch) -> an object with
        `args` (settable pointer slots) and `launch(stream)`; default `LoadedKernel`. Tests pass
        a recording fake (and a CPU device) to check the wiring without a GPU."""
        import torch

        device = torch.device(device)
        c = plan.config
        if kernel_factory is None:
            reason = launcher_unavailable_reason()
            if reason is not None:
                raise LauncherUnavailable(reason)
            if device.type != "cuda":
                raise LauncherUnavailable(f"the launcher runs on CUDA devices, got {device}")
            kernel_factory = LoadedKernel
        device_index = device.index if device.type == "cuda" else -1
        if device.type == "cuda":
            if device_index is None:
                device_index = torch.cuda.current_device()
                device = torch.device("cuda", device_index)
            major, minor = torch.cuda.get_device_capability(device)
            arch = f"{major}.{minor}"
            torch.cuda.current_stream(device)  # initialises torch's context on the device
        else:
            arch = "cpu"
        self.plan, self.config, self.device_index, self.device = plan, c, device_index, device
        self.prep = kernel_factory(plan.prep, device_index, arch)
        self.decode = kernel_factory(plan.decode, device_index, arch)
        self.merge = (kernel_factory(plan.merge, device_index, arch)
                      if plan.merge is not None else None)
        tdt = getattr(torch, c.dtype)
        b, t, h, d, dv = c.num_seqs, c.num_seqs * c.s_q, c.num_heads, c.head_dim, c.v_head_dim
        s, rp, r = plan.num_splits, c.rows_pad, c.rows
        self.padded = rp != r
        self._out_shape, self._lse_shape, self._dtype = (t, h, dv), (t, h), tdt
        calls = [plan.prep, plan.decode] + ([plan.merge] if plan.merge is not None else [])
        align = max(max(k.ptr_divisibility) for k in calls)  # what the kernels assume (bytes)
        self.align = align
        self.q_spec = TensorSpec("q", tdt, [(t, h, d)], device_index, align)
        self.kv_spec = TensorSpec("kv_pool", tdt, [(c.pool_rows, d), (c.pool_rows, 1, d),
                                                   (c.pool_rows, 1, 1, d)], device_index, align)
        self.indptr_spec = TensorSpec("kv_indptr", torch.int32, [(b + 1,)], device_index, align)
        self.indices_spec = TensorSpec("kv_indices", torch.int32, [(c.kv_capacity,)],
                                       device_index, align)
        self.out_spec = TensorSpec("out", tdt, [(t, h, dv)], device_index, align)
        self.lse_spec = TensorSpec("lse", torch.float32, [(t, h)], device_index, align)
        self.lens_spec = TensorSpec("kv_lens", torch.int32, [(b,)], device_index, align)
        dev = self.device
        self._kv_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self._q_pad = torch.zeros(b, rp, d, dtype=tdt, device=dev) if self.padded else None
        if s > 1:
            self._o_part = torch.empty(b, s, rp, dv, dtype=torch.float32, device=dev)
            self._lse_part = torch.empty(b, s, rp, dtype=torch.float32, device=dev)
        if self.padded:
            self._out_pad = torch.empty(b, rp, dv, dtype=tdt, device=dev)
            self._lse_pad = torch.empty(b, rp, dtype=torch.float32, device=dev)
        # Fixed pointers, written once.
        self._kv_lens_ptr = self._kv_lens.data_ptr()
        self.prep.args[1] = self._kv_lens_ptr
        if self.padded:
            self.decode.args[3] = self._q_pad.data_ptr()
        if s > 1:
            self.decode.args[5] = self._o_part.data_ptr()
            self.decode.args[6] = self._lse_part.data_ptr()
            self.merge.args[0] = self._o_part.data_ptr()
            self.merge.args[1] = self._lse_part.data_ptr()
            if self.padded:
                self.merge.args[2] = self._out_pad.data_ptr()
                self.merge.args[3] = self._lse_pad.data_ptr()
        elif self.padded:
            self.decode.args[5] = self._out_pad.data_ptr()
            self.decode.args[6] = self._lse_pad.data_ptr()
        self._split = s > 1
        self._lock = threading.Lock()
        self._empty = torch.empty
        self._stream = stream_fn or _current_raw_stream_fn(torch)

    def __call__(self, q, kv_pool, kv_indptr, kv_indices, *, kv_lens=None, out=None, lse=None):
        q_ptr = self.q_spec.pointer(q)
        kv_ptr = self.kv_spec.pointer(kv_pool)
        indptr_ptr = self.indptr_spec.pointer(kv_indptr)
        indices_ptr = self.indices_spec.pointer(kv_indices)
        lens_ptr = None if kv_lens is None else self.lens_spec.pointer(kv_lens)
        if out is None:
            out = self._empty(self._out_shape, dtype=self._dtype, device=self.device)
            out_ptr = out.data_ptr()
        else:
            out_ptr = self.out_spec.pointer(out)
        if lse is None:
            lse = self._empty(self._lse_shape, dtype=self._dtype_f32, device=self.device)
            lse_ptr = lse.data_ptr()
        else:
            lse_ptr = self.lse_spec.pointer(lse)
        stream = self._stream(self.device_index)
        with self._lock:
            dec = self.decode
            da = dec.args
            if lens_ptr is None:
                self.prep.args[0] = indptr_ptr
                self.prep.launch(stream)
                da[1] = self._kv_lens_ptr
            else:
                da[1] = lens_ptr
            da[0] = indptr_ptr
            da[2] = indices_ptr
            da[4] = kv_ptr
            if self.padded:
                self._q_pad[:, :self.config.rows].copy_(q.view(self._q_pad.shape[0],
                                                               self.config.rows, -1))
            else:
                da[3] = q_ptr
            if not self._split:
                if not self.padded:
                    da[5] = out_ptr
                    da[6] = lse_ptr
                dec.launch(stream)
            else:
                dec.launch(stream)
                if not self.padded:
                    self.merge.args[2] = out_ptr
                    self.merge.args[3] = lse_ptr
                self.merge.launch(stream)
            if self.padded:
                r = self.config.rows
                out.view(self._out_pad.shape[0], r, -1).copy_(self._out_pad[:, :r])
                lse.view(self._lse_pad.shape[0], r).copy_(self._lse_pad[:, :r])
        return out, lse

    @property
    def _dtype_f32(self):
        import torch

        return torch.float32

    def info(self) -> dict:
        kernels = [self.prep, self.decode] + ([self.merge] if self.merge else [])
        return {"config": dataclasses.asdict(self.config), "num_splits": self.plan.num_splits,
                "padded": self.padded, "kernels": [k.info() for k in kernels]}


def _current_raw_stream_fn(torch):
    """device index -> torch's current CUDA stream handle (an int), cheaply."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_LAUNCHERS: dict[tuple[DecodeLaunchConfig, int], DecodeLauncher] = {}
_LAUNCHERS_LOCK = threading.Lock()


def decode_launcher(config: DecodeLaunchConfig, device=None) -> DecodeLauncher:
    """The launcher of `config` on `device` (a torch device, index or None for the current
    CUDA device): built (lowered, compiled, loaded) on first use and cached."""
    import torch

    if device is None:
        index = torch.cuda.current_device()
    elif isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "cuda":
            raise LauncherUnavailable(f"the launcher runs on CUDA devices, got {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
    key = (config, index)
    with _LAUNCHERS_LOCK:
        launcher = _LAUNCHERS.get(key)
        if launcher is None:
            launcher = DecodeLauncher(decode_plan(config), torch.device("cuda", index))
            _LAUNCHERS[key] = launcher
    return launcher


# ============================================================================ torch entry point
_TORCH_KEYED: dict[tuple, DecodeLauncher] = {}


def torch_decode_unsupported_reason(q, kv_pool, kv_indptr, kv_indices) -> str | None:
    """None if `torch_decode` can run these inputs, else why not (the caller then falls back to
    the DLPack + jit path). Checks kinds only (torch CUDA tensors, bf16/f16 q and pool, int32
    metadata) and the launcher's availability; shapes and layout are checked by the call."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    for name, t in (("q", q), ("kv_pool", kv_pool), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices)):
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor ({type(t).__name__})"
        if not t.is_cuda:
            return f"{name} is on {t.device}, not a CUDA device"
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_pool.dtype != q.dtype:
        return f"q ({q.dtype}) and kv_pool ({kv_pool.dtype}) must both be bf16 or f16"
    if kv_indptr.dtype != torch.int32 or kv_indices.dtype != torch.int32:
        return "kv_indptr and kv_indices must be int32"
    return launcher_unavailable_reason()


def torch_decode(q, kv_pool, kv_indptr, kv_indices, *, sm_scale: float, s_q: int = 1,
                 max_kv_len: int | None = None, num_splits: int | None = None,
                 v_head_dim: int = 512, kv_lens=None, out=None, lse=None,
                 kernel: DecodeKernelConfig = DecodeKernelConfig()):
    """`mla_decode` on torch CUDA tensors through the launcher of their static configuration
    (derived from the shapes; built once per configuration and cached).

    q [B*s_q, H, D], kv_pool [rows, D] / [rows, 1, D] / [rows, 1, 1, D], kv_indptr int32 [B+1],
    kv_indices int32 [capacity] -> (out [B*s_q, H, v_head_dim], lse float32 [B*s_q, H]).
    Raises LauncherUnavailable where the launcher cannot run (see
    `torch_decode_unsupported_reason`), LauncherArgumentError for misuse.
    """
    key = (tuple(q.shape), kv_pool.shape[0], kv_pool.shape[-1], kv_indptr.shape[0],
           kv_indices.shape[0], q.dtype, float(sm_scale), s_q, max_kv_len, num_splits,
           v_head_dim, kernel, q.get_device())
    launcher = _TORCH_KEYED.get(key)
    if launcher is None:
        reason = torch_decode_unsupported_reason(q, kv_pool, kv_indptr, kv_indices)
        if reason is not None:
            raise LauncherUnavailable(reason)
        if q.dim() != 3 or kv_indptr.dim() != 1 or q.shape[0] != (kv_indptr.shape[0] - 1) * s_q:
            raise LauncherArgumentError(
                f"q {list(q.shape)} must be [B * s_q, H, D] with B = kv_indptr.shape[0] - 1 = "
                f"{kv_indptr.shape[0] - 1} and s_q = {s_q}")
        config = DecodeLaunchConfig(
            num_seqs=kv_indptr.shape[0] - 1, num_heads=q.shape[1], pool_rows=kv_pool.shape[0],
            kv_capacity=kv_indices.shape[0], sm_scale=float(sm_scale), s_q=s_q,
            max_kv_len=max_kv_len, num_splits=num_splits, head_dim=q.shape[2],
            v_head_dim=v_head_dim, dtype=str(q.dtype).removeprefix("torch."), kernel=kernel)
        launcher = decode_launcher(config, q.device)
        _TORCH_KEYED[key] = launcher
    return launcher(q, kv_pool, kv_indptr, kv_indices, kv_lens=kv_lens, out=out, lse=lse)
