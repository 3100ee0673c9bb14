"""funcmla's Pallas kernels as torch ops: compiled once, launched on torch's current stream.

The mechanism (evidence, alternatives and H200 numbers in docs/torch_launcher.md):

1. **Extract** (no GPU). The JAX path of a decode configuration (`mla_decode` under jit) is
   lowered for CUDA; each Pallas call on the Triton lowering is one XLA custom call there, read
   back by `extract_triton_calls`: name, grid, warps, stages, operand/result types and the
   kernel (Triton IR as `__gpu$xla.gpu.triton`, jax 0.10.2 and 0.11.2; or PTX inside a
   `triton_kernel_call_ffi` protobuf on other jaxlibs). A decode step is the decode kernel, plus
   the merge kernel (`funcmla.attention.pallas.merge`) when it splits the KV.
2. **Compile**, by one of two routes (`kernel_route`):
   * "xla" (default where JAX has a GPU backend in this process): XLA compiles that same jitted
     JAX path and the launcher takes XLA's own result for each kernel from the serialized
     executable: cubin, symbol, grid, block and dynamic shared memory as XLA launches them
     (jaxlib 0.11.2; older jaxlibs: XLA's dumped PTX and Triton pass log,
     `interop/_xla_kernels.py`). The launcher then runs the machine code `mla_decode` runs, so
     outputs are bit-identical.
   * "triton" (fallback; no GPU backend needed): the Triton IR is compiled with the `triton`
     package (3.6 on the H200 image), or PTX with ptxas. Same kernels, but another Triton
     compiles them to other machine code: not bit-identical to XLA's (2-298 bf16 ulp seen).
3. **Load** each image with `cuModuleLoadDataEx` in the device's primary context (torch's), and
   raise the dynamic shared-memory limit where a kernel needs more than 48 KiB.
4. **Launch** all kernels of a call with one foreign call (`interop/_launch.py`: a program of
   kernels over pointer slots, run by a tiny C helper compiled at first use, or by pure ctypes
   without a C compiler), on `torch.cuda.current_stream()`, so launches inside
   `torch.cuda.graph(...)` are captured and replays run the kernels on the captured buffers.

Each call checks every tensor before any launch: dtype, shape (against the compiled static
configuration), contiguity, device and alignment (the kernels' Triton IR declares
`tt.divisibility = 32` on every pointer). The check is one fused expression over the
arguments (about 0.3 us per tensor on a 2-core Xeon); on any mismatch the per-argument checker
(`TensorSpec`) raises `LauncherArgumentError` naming the argument, and nothing is launched.
Index *values* are not checked (that would need a device sync; `validate_decode_inputs` does it
eagerly).

Limits: one launcher's scratch (split partials, padded rows) is shared by its calls, so calls
of one launcher must not run concurrently on different streams; a lock serializes host threads.
NVIDIA GPUs only; no ROCm. fp8 pools are not taken (the decode kernel reads bf16/f16).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
import warnings
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import DecodeKernelConfig, mla_decode
from funcmla.interop._containers import proto_fields
from funcmla.attention.pallas.decode_common import num_row_blocks
from funcmla.layout import PageTable

__all__ = [
    "LauncherArgumentError",
    "LauncherUnavailable",
    "TritonCall",
    "extract_triton_calls",
    "parse_kernel_call_proto",
    "ptx_entry_params",
    "TensorSpec",
    "LoadedKernel",
    "CompiledImage",
    "DecodeLaunchConfig",
    "DecodePlan",
    "decode_plan",
    "compile_plan",
    "kernel_route",
    "DecodeLauncher",
    "PagedDecodeLauncher",
    "decode_launcher",
    "launcher_unavailable_reason",
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


def parse_kernel_call_proto(serialized: bytes) -> dict:
    """Decode a `jax_triton.TritonAnyKernelCall` (jaxlib/gpu/triton.proto) holding one plain
    kernel call. Returns {name, num_warps, num_ctas, shared_mem_bytes, ptx, grid,
    ptr_divisibility}; raises ValueError for autotuned calls, scalar or zero-filled parameters."""
    call = None
    for field, _, value in proto_fields(serialized):
        if field == 1:
            call = value
        elif field == 2:
            raise ValueError("autotuned Triton kernel calls are not supported by the launcher")
    if call is None:
        raise ValueError("TritonAnyKernelCall holds no kernel_call")
    kernel, grid, divisibility = None, [0, 0, 0], []
    for field, _, value in proto_fields(call):
        if field == 1:
            kernel = value
        elif field in (2, 3, 4):
            grid[field - 2] = value
        elif field == 5:
            param = proto_fields(value)
            if len(param) != 1 or param[0][0] != 1:
                raise ValueError("only array parameters are supported (Pallas passes no scalars)")
            array = dict((f, v) for f, _, v in proto_fields(param[0][2]))
            if array.get(1, 0):
                raise ValueError(f"array parameter {len(divisibility)} asks for "
                                 f"{array[1]} zeroed bytes; not supported")
            divisibility.append(int(array.get(2, 0)))
    if kernel is None:
        raise ValueError("TritonKernelCall holds no kernel")
    k = {1: b"", 2: 0, 3: 0, 4: b"", 10: 1}
    for field, _, value in proto_fields(kernel):
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
    num_params: int         # PTX parameters (buffers [+ Triton's trailing scratch pointers])
    shared_mem_bytes: int | None  # dynamic shared memory per block (None: unknown, see how)
    how: str                # which compiler produced `image`
    ptx: str
    route: str = "triton"   # "xla": XLA's own machine code; "triton": compiled here


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


_ROUTES = ("auto", "xla", "triton")


def kernel_route(route: str | None = None) -> str:
    """"xla" or "triton": `route`, else $FUNCMLA_LAUNCHER_COMPILER, else "auto" = "xla" where
    this process's JAX default backend is a GPU (XLA can compile and dump there), else
    "triton"."""
    route = route or os.environ.get("FUNCMLA_LAUNCHER_COMPILER", "auto")
    if route not in _ROUTES:
        raise ValueError(f"launcher compile route must be one of {_ROUTES}, got {route!r}")
    if route == "auto":
        try:
            route = "xla" if jax.default_backend() == "gpu" else "triton"
        except RuntimeError:
            route = "triton"
    return route


def _xla_images(plan: "DecodePlan") -> dict[str, CompiledImage]:
    from funcmla.interop import _xla_kernels

    fn, avals = plan.source
    calls = plan.calls
    got = _xla_kernels.xla_kernels(
        fn, avals, {c.name: (len(c.operands) + len(c.results), 32 * c.num_warps, tuple(c.grid))
                    for c in calls}, compile_ptx)
    out = {}
    for c in calls:
        k = got[c.name]
        out[c.name] = CompiledImage(
            k.image, k.entry, k.num_params, k.shared_mem_bytes,
            f"XLA: {k.image_from}; shared memory: {k.shared_mem_from}", k.ptx, route="xla")
    return out


@functools.lru_cache(maxsize=64)
def compile_plan(plan: "DecodePlan", arch_name: str, route: str | None = None
                 ) -> dict[str, CompiledImage]:
    """{kernel name: image} for every kernel of `plan` (see `kernel_route`). With route None
    ("auto") a failure of the XLA route falls back to the triton route with a warning, and
    each image's `how` says why."""
    requested = route
    route = kernel_route(route)
    if route == "xla":
        try:
            return _xla_images(plan)
        except Exception as err:  # noqa: BLE001 - fall back, saying why
            if requested == "xla" or os.environ.get("FUNCMLA_LAUNCHER_COMPILER") == "xla":
                raise LauncherUnavailable(f"XLA route failed: {type(err).__name__}: {err}") \
                    from err
            reason = f"{type(err).__name__}: {str(err)[:300]}"
            warnings.warn(f"funcmla launcher: taking the kernels from XLA failed ({reason}); "
                          "compiling them with the triton package instead (not bit-identical "
                          "to the JAX path)", RuntimeWarning, stacklevel=2)
            return {c.name: dataclasses.replace(
                _compile_cached(c, arch_name), how=f"{_compile_cached(c, arch_name).how} "
                f"(XLA route failed: {reason})") for c in plan.calls}
    return {c.name: _compile_cached(c, arch_name) for c in plan.calls}


# ============================================================================ loading / launch
class LoadedKernel:
    """One compiled kernel in a device's primary context.

    `function`, `grid`, `block`, `shared_mem_bytes`, `num_params` feed a launch program; for a
    one-off launch, `args[i] = ptr` writes pointer i (the kernel's i-th operand or result; any
    trailing Triton scratch parameters stay null) and `launch(stream)` enqueues it.
    compiled: the image to load (default: the triton route's `compile_call`).
    """

    def __init__(self, call: TritonCall, device_index: int, arch_name: str,
                 compiled: CompiledImage | None = None):
        import ctypes

        from funcmla.interop import _cuda_driver as cd

        if compiled is None:
            compiled = _compile_cached(call, arch_name)
        self.call, self.entry, self.num_params = call, compiled.entry, compiled.num_params
        self.num_buffers = len(call.operands) + len(call.results)
        self.ptx, self.image, self.how = compiled.ptx, compiled.image, compiled.how
        self.route = compiled.route
        drv = cd.driver()
        try:
            self.module, self.function = drv.load_function(self.image, self.entry, device_index)
        except cd.CudaDriverError as err:
            if self.image[:4] != b"\x7fELF" or not self.ptx:
                raise
            # A cubin from a ptxas newer than the driver does not load: let the driver compile.
            self.image, self.how = self.ptx.encode() + b"\0", f"driver-jit (cubin refused: {err})"
            self.module, self.function = drv.load_function(self.image, self.entry, device_index)
        optin = None
        smem = compiled.shared_mem_bytes
        if smem is None:
            # XLA's figure was not found: give the kernel all a block may have (correct; may
            # lower occupancy). `how` records it.
            optin = drv.device_attribute(device_index,
                                         cd.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            smem = optin - drv.function_attribute(self.function,
                                                  cd.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            self.how += f"; launched with the device maximum {smem} B of shared memory"
        self.shared_mem_bytes = int(smem)
        if self.shared_mem_bytes > 48 * 1024:
            if optin is None:
                optin = drv.device_attribute(
                    device_index, cd.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            if self.shared_mem_bytes > optin:
                raise LauncherUnavailable(f"{call.name} needs {self.shared_mem_bytes} B of shared "
                                          f"memory; the device allows {optin}")
            drv.set_function_attribute(self.function,
                                       cd.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       self.shared_mem_bytes)
        self.num_regs = drv.function_attribute(self.function, cd.CU_FUNC_ATTRIBUTE_NUM_REGS)
        self.grid = tuple(call.grid)
        self.block = (32 * call.num_warps, 1, 1)
        self.args = (ctypes.c_void_p * self.num_params)()  # values (device pointers)
        base = ctypes.addressof(self.args)
        size = ctypes.sizeof(ctypes.c_void_p)
        self._params = (ctypes.c_void_p * self.num_params)(
            *[base + i * size for i in range(self.num_params)])
        u = ctypes.c_uint
        self._pre = (ctypes.c_void_p(self.function), u(self.grid[0]), u(self.grid[1]),
                     u(self.grid[2]), u(self.block[0]), u(1), u(1), u(self.shared_mem_bytes))
        self._params_arg = ctypes.c_void_p(ctypes.addressof(self._params))
        self._drv = drv
        self._device_index = device_index

    def launch(self, stream: int) -> None:
        import ctypes

        s = ctypes.c_void_p(stream)
        code = self._drv.launch_raw(*self._pre, s, self._params_arg, None)
        if code == 201:  # no current context on this thread: use the primary one, retry
            self._drv.make_current(self._device_index)
            code = self._drv.launch_raw(*self._pre, s, self._params_arg, None)
        if code:
            self._drv.check_launch(code, self.call.name)

    def info(self) -> dict:
        return {**self.call.summary(), "entry": self.entry, "num_params": self.num_params,
                "route": self.route, "compiled_with": self.how,
                "shared_mem_bytes": self.shared_mem_bytes, "num_regs": self.num_regs}


# ============================================================================ argument checks
_TORCH_DTYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "i32": "int32"}
_SHORT_DTYPES = {name: short for short, name in _TORCH_DTYPES.items()}  # "bfloat16" -> "bf16"


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




# ============================================================================ decode
_JNP_DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class DecodeLaunchConfig:
    """Static configuration of one compiled decode launcher.

    num_seqs:    B (requests), num_heads: H, s_q: query tokens per request (T = B * s_q).
    pool_rows:   rows (token slots) of kv_pool [pool_rows, head_dim].
    page_size:   1: token CSR (kv_indptr [B+1], kv_indices [kv_capacity] token slots);
                 > 1: page table [B, kv_capacity // B] of page ids + lengths [B] (tokens).
    kv_capacity: entries of the index table: len(kv_indices), or B * max_pages.
    max_kv_len:  token CSR only: static bound on KV tokens per request for the split rule;
                 None: kv_capacity (as `mla_decode`). Page tables imply max_pages * page_size.
    num_splits:  split-KV count; None: what `mla_decode` picks (its split rule).
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
    page_size: int = 1

    def __post_init__(self):
        for name in ("num_seqs", "num_heads", "pool_rows", "kv_capacity", "s_q", "head_dim",
                     "v_head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DecodeLaunchConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_kv_len", "num_splits"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value <= 0):
                raise ValueError(f"DecodeLaunchConfig.{name} must be None or a positive int, "
                                 f"got {value!r}")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"DecodeLaunchConfig.page_size must be a power of two, got "
                             f"{self.page_size}")
        if self.page_size > 1:
            if self.kv_capacity % self.num_seqs:
                raise ValueError(f"DecodeLaunchConfig.kv_capacity={self.kv_capacity} must be "
                                 f"num_seqs * max_pages (num_seqs={self.num_seqs}) for a page "
                                 "table")
            if self.max_kv_len is not None:
                raise ValueError("DecodeLaunchConfig.max_kv_len is implied by the page table "
                                 "(max_pages * page_size); leave it None")
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
    def max_pages(self) -> int:
        """Page-table width (entries per request; kv_capacity // num_seqs)."""
        return self.kv_capacity // self.num_seqs

    @property
    def resolved_max_kv_len(self) -> int:
        if self.page_size > 1:
            return self.max_pages * self.page_size
        return self.kv_capacity if self.max_kv_len is None else self.max_kv_len


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The kernels of one decode configuration, read from its JAX path (no GPU needed).

    decode / merge: the Pallas calls of `mla_decode` for this configuration, in program
    order (merge only when num_splits > 1); source: (the jitted JAX path, its input avals),
    which the "xla" route compiles."""

    config: DecodeLaunchConfig
    num_splits: int
    decode: TritonCall
    merge: TritonCall | None
    source: tuple = dataclasses.field(compare=False, repr=False)

    @property
    def calls(self) -> tuple[TritonCall, ...]:
        return (self.decode,) if self.merge is None else (self.decode, self.merge)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def jax_path(config: DecodeLaunchConfig) -> tuple[Callable, tuple]:
    """(fn, avals): `mla_decode` for `config` as a function of the launcher's inputs, in the
    launcher's argument order (q, kv_pool, kv_indptr, kv_indices) or (q, kv_pool, page_table,
    lengths)."""
    c = config
    dt = _JNP_DTYPES[c.dtype]
    b, t, i32 = c.num_seqs, c.num_seqs * c.s_q, jnp.int32
    q = _sds((t, c.num_heads, c.head_dim), dt)
    pool = _sds((c.pool_rows, c.head_dim), dt)
    # The launcher replays Triton-lowered kernels (it reads their cubins back); the Mosaic
    # GPU kernel is a different kind of custom call, so its JAX path is pinned to Triton.
    common = dict(sm_scale=float(c.sm_scale), s_q=c.s_q, num_splits=c.num_splits,
                  config=dataclasses.replace(c.kernel, kernel="triton"),
                  v_head_dim=c.v_head_dim)
    if c.page_size == 1:
        def csr(q, kv_pool, kv_indptr, kv_indices):
            return mla_decode(q, kv_pool, kv_indptr=kv_indptr, kv_indices=kv_indices,
                              max_kv_len=c.max_kv_len, **common)

        return csr, (q, pool, _sds((b + 1,), i32), _sds((c.kv_capacity,), i32))

    def paged(q, kv_pool, page_table, lengths):
        return mla_decode(q, kv_pool, page_table=PageTable(page_table, lengths, c.page_size),
                          **common)

    return paged, (q, pool, _sds((b, c.max_pages), i32), _sds((b,), i32))


@functools.lru_cache(maxsize=128)
def decode_plan(config: DecodeLaunchConfig) -> DecodePlan:
    """Lower `mla_decode` for `config` for CUDA and read its kernels back (cached)."""
    c = config
    b, d, dv, rp = c.num_seqs, c.head_dim, c.v_head_dim, c.rows_pad
    fn, avals = jax_path(c)
    calls = extract_triton_calls(lower_for_cuda(fn, *avals))
    dname = _SHORT_DTYPES[c.dtype]
    meta = ((b + 1,), "i32") if c.page_size == 1 else ((b,), "i32")
    want_in = (meta, ((c.kv_capacity,), "i32"), ((b, rp, d), dname), ((c.pool_rows, d), dname))
    if not calls or calls[0].operands != want_in:
        raise LauncherUnavailable(
            "the JAX path's decode kernel is not the one this launcher wires: got "
            f"{[(k.name, k.operands) for k in calls]}, expected operands {want_in} "
            "(funcmla.attention.pallas changed its pallas_call)")
    decode = calls[0]
    splits = decode.grid[1]
    o_dtype = dname if splits == 1 else _SHORT_DTYPES[c.kernel.partial_dtype]
    want_out = (((b, splits, rp, dv), o_dtype), ((b, splits, rp), "f32"))
    want_merge = (want_out, (((b, rp, dv), dname), ((b, rp), "f32")))
    ok = decode.results == want_out and len(calls) == (1 if splits == 1 else 2)
    if ok and splits > 1:
        ok = (calls[1].operands, calls[1].results) == want_merge
    if not ok:
        raise LauncherUnavailable(
            "the JAX path's kernels are not the ones this launcher wires: got "
            f"{[(k.name, k.operands, k.results) for k in calls]}, expected decode -> "
            f"{want_out}" + (f", then a merge {want_merge}" if splits > 1 else ""))
    return DecodePlan(c, splits, decode, calls[1] if splits > 1 else None, (fn, avals))


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


# Pointer slots of a decode program (interop/_launch.py). Per call: the two index tensors in
# argument order (x, y), q, kv_pool, out, lse. Fixed: scratch buffers and a null pointer.
_X, _Y, _Q, _KV, _OUT, _LSE = range(6)
_BAD_ARGUMENT = -1  # = _launch.BAD_ARGUMENT: a check in C refused an argument
_OPART, _LPART, _QPAD, _OUTPAD, _LSEPAD, _NULL = range(6, 12)


class _DecodeLauncherBase:
    """Shared body of the decode launchers (see `DecodeLauncher`)."""

    _x_name = _y_name = ""
    _x_decode_operand = 0  # which decode operand (0: start/lens meta, 1: table) x feeds

    def __init__(self, plan: DecodePlan, device, *, kernel_factory: Callable | None = None,
                 stream_fn: Callable[[int], int] | None = None, launch_address: int | None = None,
                 native: bool | None = None, route: str | None = None):
        """device: a CUDA torch.device. kernel_factory(call, device_index, arch) -> an object
        with function, grid, block, shared_mem_bytes, num_params, info() (default: the plan's
        kernels compiled by `compile_plan(plan, arch, route)` and loaded). Tests pass fakes, a
        CPU device, stream_fn and a launch_address (a recording cuLaunchKernel stand-in)."""
        import torch

        from funcmla.interop import _launch

        device = torch.device(device)
        c = plan.config
        if kernel_factory is None:
            reason = launcher_unavailable_reason()
            if reason is not None:
                raise LauncherUnavailable(reason)
            if device.type != "cuda":
                raise LauncherUnavailable(f"the launcher runs on CUDA devices, got {device}")
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
        if kernel_factory is None:
            images = compile_plan(plan, arch, route)

            def kernel_factory(call, index, arch_name):
                return LoadedKernel(call, index, arch_name, images[call.name])
        if launch_address is None:
            from funcmla.interop import _cuda_driver

            launch_address = _cuda_driver.driver().launch_address
        self.plan, self.config, self.device_index, self.device = plan, c, device_index, device
        self.decode = kernel_factory(plan.decode, device_index, arch)
        self.merge = (kernel_factory(plan.merge, device_index, arch)
                      if plan.merge is not None else None)
        tdt = getattr(torch, c.dtype)
        b, t, h, dv = c.num_seqs, c.num_seqs * c.s_q, c.num_heads, c.v_head_dim
        s, rp, r = plan.num_splits, c.rows_pad, c.rows
        self.padded = rp != r
        split = s > 1
        self._out_shape, self._lse_shape, self._dtype = (t, h, dv), (t, h), tdt
        self.align = max(max(k.ptr_divisibility) for k in plan.calls)
        fixed = {_NULL: 0}
        dev = device
        if split:
            self._o_part = torch.empty(b, s, rp, dv, dtype=getattr(torch, c.kernel.partial_dtype),
                                       device=dev)
            self._lse_part = torch.empty(b, s, rp, dtype=torch.float32, device=dev)
            fixed.update({_OPART: self._o_part.data_ptr(), _LPART: self._lse_part.data_ptr()})
        if self.padded:
            self._q_pad = torch.zeros(b, rp, c.head_dim, dtype=tdt, device=dev)
            self._out_pad = torch.empty(b, rp, dv, dtype=tdt, device=dev)
            self._lse_pad = torch.empty(b, rp, dtype=torch.float32, device=dev)
            fixed.update({_QPAD: self._q_pad.data_ptr(), _OUTPAD: self._out_pad.data_ptr(),
                          _LSEPAD: self._lse_pad.data_ptr()})
        meta, table = (_X, _Y) if self._x_decode_operand == 0 else (_Y, _X)
        out_slot = _OUTPAD if self.padded else _OUT
        lse_slot = _LSEPAD if self.padded else _LSE
        dec_params = [meta, table, _QPAD if self.padded else _Q, _KV,
                      _OPART if split else out_slot, _LPART if split else lse_slot]
        kernels = [self._program_kernel(self.decode, dec_params)]
        if split:
            kernels.append(self._program_kernel(self.merge, [_OPART, _LPART, out_slot,
                                                             lse_slot]))
        self.program = _launch.LaunchProgram(kernels, 6, fixed, launch_address, native=native)
        p = self.program
        self._hot = (p.pack, p.buffer, (1 << len(kernels)) - 1, p.run, p.ref)
        self._lock = threading.Lock()
        self._empty = torch.empty
        self._stream = stream_fn or _current_raw_stream_fn(torch)
        self._specs_setup(torch, tdt, device_index)
        self._checked_hot = None
        self.checks = self._enable_c_checks(torch)

    def _enable_c_checks(self, torch) -> str:
        """Move the per-call tensor checks into the C helper where it can read torch tensors
        (see interop/_launch_program.c); returns which checks run."""
        from funcmla.interop import _launch

        if self.padded:
            return "python (padded rows: q is copied before the launch)"
        if not self.program.native:
            return "python (no native helper)"
        api, how = _launch.torch_api()
        if api is None:
            return f"python ({how})"
        codes = {}
        for dtype in (self._dtype, torch.int32, torch.float32):
            got = _launch.describe(api, torch.empty(1, dtype=dtype, device=self.device))
            if got is None:
                return "python (the shim cannot read a tensor on this device)"
            codes[dtype] = got[:3]
        mask = self.align - 1
        specs = []
        for spec in (self.x_spec, self.y_spec, self.q_spec, self.kv_spec, self.out_spec,
                     self.lse_spec):  # slot order: _X, _Y, _Q, _KV, _OUT, _LSE
            dtype_code, device_type, device_index = codes[spec.dtype]
            specs.append((dtype_code, device_type, device_index, mask, sorted(spec.shapes)))
        self.program.enable_checks(api, specs)
        p = self.program
        self._checked_hot = (p.pack, p.buffer, (1 << len(p.kernels)) - 1, p.run_checked, p.ref)
        return f"C ({how})"

    @staticmethod
    def _program_kernel(k, slots: list[int]):
        from funcmla.interop import _launch

        if k.num_params < len(slots):
            raise LauncherUnavailable(f"{k.call.name} takes {k.num_params} parameters, fewer "
                                      f"than its {len(slots)} buffers")
        return _launch.ProgramKernel(k.call.name, k.function, k.grid, k.block,
                                     k.shared_mem_bytes,
                                     slots + [_NULL] * (k.num_params - len(slots)))

    def _specs_setup(self, torch, tdt, di) -> None:
        c, a = self.config, self.align
        t, h, d = c.num_seqs * c.s_q, c.num_heads, c.head_dim
        pool_shapes = [(c.pool_rows, d), (c.pool_rows, 1, d)]
        ps = c.page_size
        if ps > 1 and c.pool_rows % ps == 0:
            pool_shapes += [(c.pool_rows // ps, ps, d), (c.pool_rows // ps, ps, 1, d)]
        self.q_spec = TensorSpec("q", tdt, [(t, h, d)], di, a)
        self.kv_spec = TensorSpec("kv_pool", tdt, pool_shapes, di, a)
        self.x_spec = TensorSpec(self._x_name, torch.int32, [self._x_shape()], di, a)
        self.y_spec = TensorSpec(self._y_name, torch.int32, [self._y_shape()], di, a)
        self.out_spec = TensorSpec("out", tdt, [self._out_shape], di, a)
        self.lse_spec = TensorSpec("lse", torch.float32, [self._lse_shape], di, a)
        self._i32, self._f32 = torch.int32, torch.float32
        self._set_fast(pool_shapes[0])

    def _set_fast(self, kv_shape) -> None:
        c = self.config
        self._fast = (self._dtype, self._i32, self._f32, torch_size(kv_shape), self.device_index,
                      self.align - 1, torch_size((c.num_seqs * c.s_q, c.num_heads, c.head_dim)),
                      torch_size(self._x_shape()), torch_size(self._y_shape()),
                      torch_size(self._out_shape), torch_size(self._lse_shape))

    def _checked(self, q, kv_pool, x, y, out, lse) -> tuple[int, ...]:
        """The per-argument checks (raise LauncherArgumentError naming the argument)."""
        ptrs = (self.q_spec.pointer(q), self.kv_spec.pointer(kv_pool), self.x_spec.pointer(x),
                self.y_spec.pointer(y), self.out_spec.pointer(out), self.lse_spec.pointer(lse))
        if tuple(kv_pool.shape) != tuple(self._fast[3]):  # another accepted pool view
            self._set_fast(tuple(kv_pool.shape))
        return ptrs

    def _call(self, q, kv_pool, x, y, out, lse):
        hot = self._checked_hot
        if hot is not None:  # checks and launches in one foreign call (C helper + torch shim)
            try:
                if out is None:
                    out = self._empty(self._out_shape, dtype=self._dtype, device=self.device)
                if lse is None:
                    lse = self._empty(self._lse_shape, dtype=self._f32, device=self.device)
                cq, ck, cx, cy = q._cdata, kv_pool._cdata, x._cdata, y._cdata
                co, cl = out._cdata, lse._cdata
            except AttributeError:  # not a torch tensor: the Python checks say which
                hot = None
            if hot is not None:
                pack, buf, mask, run_checked, ref = hot
                stream = self._stream(self.device_index)
                with self._lock:
                    try:
                        pack(buf, 0, stream, mask, cx, cy, cq, ck, co, cl)
                    except (struct.error, TypeError):  # a subclass's _cdata is no address
                        rc = _BAD_ARGUMENT
                    else:
                        rc = run_checked(ref)
                        if rc > 0:
                            self._launch_failed(rc, mask, ref)
                if rc >= 0:
                    return out, lse
                # a check failed in C (nothing launched): the Python checks name the argument
        return self._call_python(q, kv_pool, x, y, out, lse)

    def _call_python(self, q, kv_pool, x, y, out, lse):
        dt, i32, f32, kvs, di, m, qs, xs, ys, os_, ls = self._fast
        try:
            if out is None:
                out = self._empty(os_, dtype=dt, device=self.device)
            if lse is None:
                lse = self._empty(ls, dtype=f32, device=self.device)
            pq, pk, px, py = q.data_ptr(), kv_pool.data_ptr(), x.data_ptr(), y.data_ptr()
            po, pl = out.data_ptr(), lse.data_ptr()
            ok = (q.dtype is dt and kv_pool.dtype is dt and x.dtype is i32 and y.dtype is i32
                  and out.dtype is dt and lse.dtype is f32
                  and q.shape == qs and kv_pool.shape == kvs and x.shape == xs and y.shape == ys
                  and out.shape == os_ and lse.shape == ls
                  and q.is_contiguous() and kv_pool.is_contiguous() and x.is_contiguous()
                  and y.is_contiguous() and out.is_contiguous() and lse.is_contiguous()
                  and q.get_device() == di and kv_pool.get_device() == di
                  and x.get_device() == di and y.get_device() == di
                  and out.get_device() == di and lse.get_device() == di
                  and not (pq | pk | px | py | po | pl) & m)
        except Exception:  # noqa: BLE001 - not a tensor, no storage, ...: the slow path says
            ok = False
        if not ok:
            pq, pk, px, py, po, pl = self._checked(q, kv_pool, x, y, out, lse)
        if self.padded:
            c = self.config
            self._q_pad[:, :c.rows].copy_(q.view(c.num_seqs, c.rows, -1))
        stream = self._stream(di)
        pack, buf, mask, run, ref = self._hot
        with self._lock:
            pack(buf, 0, stream, mask, px, py, pq, pk, po, pl)
            rc = run(ref)
            if rc:
                self._launch_failed(rc, mask, ref)
        if self.padded:
            r = self.config.rows
            out.view(self.config.num_seqs, r, -1).copy_(self._out_pad[:, :r])
            lse.view(self.config.num_seqs, r).copy_(self._lse_pad[:, :r])
        return out, lse

    def _launch_failed(self, rc: int, mask: int, ref) -> None:
        from funcmla.interop import _cuda_driver as cd

        k = self.program.failed_kernel
        first = (mask & -mask).bit_length() - 1
        if rc == cd.CUDA_ERROR_INVALID_CONTEXT and k is self.program.kernels[first]:
            # Nothing was launched: this thread had no current context. Use the primary one.
            cd.driver().make_current(self.device_index)
            rc = self.program.run(ref)
            if not rc:
                return
            k = self.program.failed_kernel
        cd.driver().check_launch(rc, k.name if k is not None else "?")

    def info(self) -> dict:
        kernels = [self.decode] + ([self.merge] if self.merge else [])
        return {"config": dataclasses.asdict(self.config), "num_splits": self.plan.num_splits,
                "padded": self.padded, "launch": self.program.how, "checks": self.checks,
                "kernels": [k.info() for k in kernels]}


def torch_size(shape):
    import torch

    return torch.Size(shape)


class DecodeLauncher(_DecodeLauncherBase):
    """`mla_decode` on torch tensors for one static configuration (token CSR, page size 1).

    __call__(q [T, H, 576], kv_pool [pool_rows, 576] (or [pool_rows, 1, 576]), kv_indptr int32
    [B+1] (tokens), kv_indices int32 [kv_capacity] (token slots), out=None [T, H, 512],
    lse=None float32 [T, H]) -> (out, lse), written on torch's current stream: the decode
    kernel, then the merge kernel when the configuration splits the KV (one foreign call).
    out/lse are allocated (torch.empty) unless given; give them for the fastest call.
    Results equal `mla_decode` on the same inputs bit for bit on the "xla" route.
    """

    _x_name, _y_name, _x_decode_operand = "kv_indptr", "kv_indices", 0

    def _x_shape(self):
        return (self.config.num_seqs + 1,)

    def _y_shape(self):
        return (self.config.kv_capacity,)

    def __call__(self, q, kv_pool, kv_indptr, kv_indices, *, out=None, lse=None):
        return self._call(q, kv_pool, kv_indptr, kv_indices, out, lse)


class PagedDecodeLauncher(_DecodeLauncherBase):
    """`mla_decode(page_table=...)` on torch tensors for one static configuration (page size
    > 1; FlashMLA-style block table).

    __call__(q [T, H, 576], kv_pool [pool_rows, 576] (or [pool_rows, 1, 576],
    [pool_rows / ps, ps, 576], [pool_rows / ps, ps, 1, 576]), page_table int32 [B, max_pages]
    (page ids), lengths int32 [B] (tokens), out=None, lse=None) -> (out, lse).
    """

    _x_name, _y_name, _x_decode_operand = "page_table", "lengths", 1

    def _x_shape(self):
        return (self.config.num_seqs, self.config.max_pages)

    def _y_shape(self):
        return (self.config.num_seqs,)

    def __call__(self, q, kv_pool, page_table, lengths, *, out=None, lse=None):
        return self._call(q, kv_pool, page_table, lengths, out, lse)


def _current_raw_stream_fn(torch):
    """device index -> torch's current CUDA stream handle (an int), cheaply."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


_LAUNCHERS: dict[tuple[DecodeLaunchConfig, int], _DecodeLauncherBase] = {}
_LAUNCHERS_LOCK = threading.Lock()


def decode_launcher(config: DecodeLaunchConfig, device=None):
    """The launcher of `config` on `device` (a torch device, index or None for the current
    CUDA device): built (lowered, compiled, loaded) on first use and cached. A
    `DecodeLauncher` for page_size 1, else a `PagedDecodeLauncher`."""
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
            cls = DecodeLauncher if config.page_size == 1 else PagedDecodeLauncher
            launcher = cls(decode_plan(config), torch.device("cuda", index))
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
                 v_head_dim: int = 512, out=None, lse=None,
                 kernel: DecodeKernelConfig = DecodeKernelConfig()):
    """`mla_decode` on torch CUDA tensors through the launcher of their static configuration
    (derived from the shapes; built once per configuration and cached).

    q [B*s_q, H, D], kv_pool [rows, D] / [rows, 1, D], kv_indptr int32 [B+1], kv_indices int32
    [capacity] -> (out [B*s_q, H, v_head_dim], lse float32 [B*s_q, H]).
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
    return launcher(q, kv_pool, kv_indptr, kv_indices, out=out, lse=lse)
