"""Extraction: the Pallas kernels of a lowered JAX path, read back without a GPU.

Each Pallas call is one XLA custom call in the CUDA lowering: `__gpu$xla.gpu.triton` (Triton IR,
jax 0.10.2 / 0.11.2), `triton_kernel_call_ffi` (PTX in a protobuf, older jaxlibs) or
`mosaic_gpu_v2` (a serialized Mosaic GPU MLIR module). `extract_kernel_calls` returns them in
program order as `TritonCall` / `MosaicCall`, each operand with its source: the parameter of the
lowered function whose bytes it is (followed back through reshapes, bitcasts and calls), so a
launcher wires a parameter's pointer to every operand that views it.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any, Callable

import jax

from funcmla.interop._containers import proto_fields
from funcmla.interop.launcher.errors import LauncherUnavailable


@dataclasses.dataclass(frozen=True)
class TritonCall:
    """One Pallas Triton kernel as XLA would launch it.

    ptx / ttir: exactly one is set (ttir: MLIR bytecode of the Triton module, jaxlib <= 0.10.2).
    operands / results: ((shape, dtype name), ...) in the kernel's parameter order.
    shared_mem_bytes: dynamic shared memory per block (None until compiled from ttir).
    sources: per operand, the index of the lowered function's parameter whose bytes it is, or
    None for a computed value; () where the call was not read from a lowered module.
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
    sources: tuple[int | None, ...] = ()

    def summary(self) -> dict:
        return {"name": self.name, "grid": self.grid, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "shared_mem_bytes": self.shared_mem_bytes,
                "operands": self.operands, "results": self.results, "sources": self.sources,
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


@dataclasses.dataclass(frozen=True)
class MosaicCall:
    """One Pallas Mosaic GPU kernel as XLA would run it (a `mosaic_gpu_v2` custom call).

    module: the serialized Mosaic GPU MLIR module (bytecode, after Mosaic's serde pass) that
    jaxlib compiles into device code and a host launch function; kernel_hash: its SHA-256 as
    XLA keys it. operands / results: ((shape, dtype name), ...) in the buffer order the host
    launch function takes (operands, then results); sources: as `TritonCall.sources`."""

    name: str
    module: bytes
    kernel_hash: bytes
    operands: tuple[tuple[tuple[int, ...], str], ...]
    results: tuple[tuple[tuple[int, ...], str], ...]
    sources: tuple[int | None, ...] = ()

    def summary(self) -> dict:
        return {"name": self.name, "form": "mosaic_gpu", "module_bytes": len(self.module),
                "operands": self.operands, "results": self.results, "sources": self.sources}


_MOSAIC_TARGETS = ("mosaic_gpu_v2",)
# backend_config keys of a mosaic_gpu_v2 call the launcher can honour (any other key names a
# feature it does not wire, such as multi-device collectives: the extraction refuses it).
# skip_device_barrier (jaxlib 0.11.2) only matters to multi-device kernels.
_MOSAIC_KEYS = {"kernel_hash", "module", "use_custom_barrier", "uses_xla_collective_metadata",
                "skip_device_barrier"}


def _mosaic_call(op, config, operands, results, sources) -> MosaicCall:
    from jax._src.lib.mlir import ir

    keys = {a.name for a in ir.DictAttr(config)} if config is not None \
        else set()
    if "module" not in keys:
        raise LauncherUnavailable("a mosaic_gpu_v2 custom call without a module attribute: "
                                  "this jaxlib lays the call out differently")
    extra = keys - _MOSAIC_KEYS
    if extra:
        raise LauncherUnavailable(f"mosaic_gpu_v2 custom call with {sorted(extra)}: not wired "
                                  "by the launcher (multi-device kernels)")
    for flag in ("use_custom_barrier", "uses_xla_collective_metadata"):
        value = _dict_get(config, flag)
        if value is not None and ir.BoolAttr(value).value:
            raise LauncherUnavailable(f"mosaic_gpu_v2 custom call with {flag}=true: not wired "
                                      "by the launcher")
    attrs = op.operation.attributes
    if "output_operand_aliases" in attrs and len(ir.ArrayAttr(attrs["output_operand_aliases"])):
        raise LauncherUnavailable("mosaic_gpu_v2 custom call with input/output aliases: not "
                                  "wired by the launcher")
    module = _attr_bytes(_dict_get(config, "module"))
    hash_attr = _dict_get(config, "kernel_hash")
    kernel_hash = _attr_bytes(hash_attr) if hash_attr is not None else b""
    return MosaicCall(name=_mosaic_kernel_name(module), module=module, kernel_hash=kernel_hash,
                      operands=operands, results=results, sources=sources)


def _mosaic_kernel_name(module: bytes) -> str:
    """The kernel's name as the module spells it (`mosaic_gpu.kernel_name`-like symbols are
    bytecode strings; the first identifier ending in the Pallas name is good enough for
    messages); "mosaic_gpu" when none is found."""
    names = re.findall(rb"mla_decode\w*|mha_prefill\w*|funcmla_\w+", module)
    return names[0].decode() if names else "mosaic_gpu"


def extract_triton_calls(lowered) -> list[TritonCall]:
    """Every Pallas Triton kernel in a lowered jitted function (`jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`), in program order."""
    return [c for c in extract_kernel_calls(lowered) if isinstance(c, TritonCall)]


def extract_kernel_calls(lowered) -> list[TritonCall | MosaicCall]:
    """Every Pallas kernel (Triton or Mosaic GPU) in a lowered jitted function, in program
    order."""
    from jax._src.lib.mlir import ir

    module = lowered.compiler_ir("stablehlo")
    calls = []
    with module.context:
        graph = _CallGraph(module)
        for op in _walk(module.operation):
            if op.operation.name != "stablehlo.custom_call":
                continue
            attrs = op.operation.attributes
            target = ir.StringAttr(attrs["call_target_name"]).value
            operands = tuple(_type_sig(v) for v in op.operation.operands)
            results = tuple(_type_sig(v) for v in op.operation.results)
            sources = tuple(graph.source(v) for v in op.operation.operands)
            config = attrs["mhlo.backend_config"] if "mhlo.backend_config" in attrs else None
            if target in _MOSAIC_TARGETS:
                calls.append(_mosaic_call(op, config, operands, results, sources))
            elif target == "triton_kernel_call_ffi":
                if config is None:
                    config = attrs["backend_config"]
                raw = zlib.decompress(_attr_bytes(_dict_get(config, "opaque")))
                p = parse_kernel_call_proto(raw)
                calls.append(TritonCall(
                    name=p["name"], grid=p["grid"], num_warps=p["num_warps"], num_stages=None,
                    num_ctas=p["num_ctas"], shared_mem_bytes=p["shared_mem_bytes"],
                    operands=operands, results=results,
                    ptr_divisibility=p["ptr_divisibility"], ptx=p["ptx"], sources=sources))
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
                    ptr_divisibility=divisibility, ttir=ttir, sources=sources))
    return calls


# Ops whose result holds exactly the bytes of their operand, in the same order: a row-major
# reshape, and a bitcast to another element type (a trailing dimension appears or disappears
# where the widths differ).
_SAME_BYTES = ("stablehlo.reshape", "stablehlo.bitcast_convert")


def _operation(x):
    return getattr(x, "operation", x)


def _downcast(ir, value):
    """(BlockArgument, None), (None, OpResult) or (None, None) for an MLIR value, across the
    bindings' versions (a cast constructor, or `maybe_downcast`)."""
    for kind in (ir.BlockArgument, ir.OpResult):
        if isinstance(value, kind):
            return (value, None) if kind is ir.BlockArgument else (None, value)
    for kind in (ir.BlockArgument, ir.OpResult):
        try:
            cast = kind(value)
        except (ValueError, TypeError):
            continue
        return (cast, None) if kind is ir.BlockArgument else (None, cast)
    return None, None


class _CallGraph:
    """The functions of a lowered module and their call sites, to follow a value back to the
    public function's parameters (`source`)."""

    def __init__(self, module):
        from jax._src.lib.mlir import ir

        self._ir = ir
        self.funcs, self.calls, self.entry = {}, {}, None
        for op in module.body.operations:
            op = _operation(op)
            if op.name != "func.func":
                continue
            name = ir.StringAttr(op.attributes["sym_name"]).value
            self.funcs[name] = op
            public = ("sym_visibility" not in op.attributes
                      or ir.StringAttr(op.attributes["sym_visibility"]).value == "public")
            if public and (self.entry is None or name == "main"):
                self.entry = name
        for op in _walk(module.operation):
            op = _operation(op)
            if op.name == "func.call":
                callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
                self.calls.setdefault(callee, []).append(op)

    def source(self, value, limit: int = 256) -> int | None:
        """The index of the entry function's parameter whose bytes `value` is, following
        `_SAME_BYTES` ops, arguments of functions called from one place, and results of calls;
        None for anything else (a computed value, a function called from several places)."""
        ir = self._ir
        for _ in range(limit):
            arg, result = _downcast(ir, value)
            if arg is not None:
                func = _operation(arg.owner.owner)
                if func.name != "func.func":
                    return None  # an argument of a region inside an op (a loop body)
                name = ir.StringAttr(func.attributes["sym_name"]).value
                if name == self.entry:
                    return arg.arg_number
                sites = self.calls.get(name, [])
                if len(sites) != 1:
                    return None
                value = sites[0].operands[arg.arg_number]
                continue
            if result is None:
                return None
            op = _operation(result.owner)
            if op.name in _SAME_BYTES:
                value = op.operands[0]
            elif op.name == "func.call":
                callee = self.funcs.get(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
                if callee is None:
                    return None
                ret = _operation(list(callee.regions[0].blocks[0].operations)[-1])
                value = ret.operands[result.result_number]
            else:
                return None
        return None


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


