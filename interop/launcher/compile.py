"""Compile: an extracted Triton kernel to a loadable image, by the "xla" or "triton" route.

"xla": XLA's own cubin for the kernel, read from the executable of the jitted JAX path
(`interop/_xla_kernels.py`), so the launcher runs what `mla_decode` runs. "triton": the Triton IR
compiled with the `triton` package (or PTX with ptxas) where JAX has no GPU backend.
Mosaic GPU kernels are compiled by jaxlib itself (`mosaic.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import tempfile
import warnings

import jax

from funcmla.interop.launcher.errors import LauncherUnavailable
from funcmla.interop.launcher.extract import TritonCall, ttir_text
from funcmla.interop.launcher.plan import DecodePlan


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


def _xla_images(plan: DecodePlan) -> dict[str, CompiledImage]:
    from funcmla.interop import _xla_kernels

    fn, avals = plan.source
    calls = plan.triton_calls
    if not calls:
        return {}
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


def compile_plan(plan: DecodePlan, arch_name: str, route: str | None = None
                 ) -> dict[str, CompiledImage]:
    """{kernel name: image} for every Triton kernel of `plan` (see `kernel_route`; a Mosaic GPU
    kernel is compiled by jaxlib at load, `mosaic.py`). With route None
    ("auto") a failure of the XLA route falls back to the triton route with a warning, and
    each image's `how` says why. The route is resolved on every call (the environment may
    change), the images are cached per resolved route."""
    strict = route == "xla" or os.environ.get("FUNCMLA_LAUNCHER_COMPILER") == "xla"
    return _compile_plan(plan, arch_name, kernel_route(route), strict)


@functools.lru_cache(maxsize=64)
def _compile_plan(plan: DecodePlan, arch_name: str, route: str, strict: bool
                  ) -> dict[str, CompiledImage]:
    if route == "xla":
        try:
            return _xla_images(plan)
        except Exception as err:  # noqa: BLE001 - fall back, saying why
            if strict:
                raise LauncherUnavailable(f"XLA route failed: {type(err).__name__}: {err}") \
                    from err
            reason = f"{type(err).__name__}: {str(err)[:300]}"
            warnings.warn(f"funcmla launcher: taking the kernels from XLA failed ({reason}); "
                          "compiling them with the triton package instead (not bit-identical "
                          "to the JAX path)", RuntimeWarning, stacklevel=2)
            images = {c.name: _compile_cached(c, arch_name) for c in plan.triton_calls}
            return {name: dataclasses.replace(image, how=f"{image.how} (XLA route failed: "
                                              f"{reason})") for name, image in images.items()}
    return {c.name: _compile_cached(c, arch_name) for c in plan.triton_calls}
