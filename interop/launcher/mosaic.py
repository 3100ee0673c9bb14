"""Mosaic GPU kernels: compiled by jaxlib from the module XLA would run, launched on any stream.

A `mosaic_gpu_v2` custom call carries its kernel as a serialized Mosaic GPU module. jaxlib's
CUDA plugin exports `MosaicGpuCompile(module, size)`, the compile-and-load step of the custom
call itself (the one `jax.experimental.mosaic.gpu.as_torch_gpu_kernel` uses): it returns a
context (the loaded device code) and a host launch function. Called with
(context, stream, buffers) (the argument convention differs by jaxlib: `support.py`), that
function encodes the kernel's TMA descriptors from the buffer
addresses on the host (`cuTensorMapEncodeTiled`; they travel as kernel parameters, so a CUDA
graph captures them with the launch) and launches the kernel on `stream`. The launcher calls it
from its launch program with torch's current stream and the call's buffers, so a torch caller
runs the machine code `mla_decode` runs (same module bytes, same compiler) with no JAX dispatch.

Why not `as_torch_gpu_kernel` itself: it launches on torch's default stream (not the current
one, so not inside `torch.cuda.graph`), allocates outputs and builds a ctypes argument array per
call (tens of microseconds of host time). Why not XLA's compiled cubin (as for Triton kernels):
the Mosaic GPU kernel's TMA descriptors are built by its host function, which is not in the
executable's launch records. Why not a cubin launched through the driver with descriptors built
here: it would restate Mosaic's descriptor layout (swizzle, tiling, box shapes) per kernel, which
jaxlib already owns.
"""

from __future__ import annotations

import ctypes
import functools

from funcmla.interop.launcher.errors import LauncherUnavailable
from funcmla.interop.launcher.extract import MosaicCall
from funcmla.interop.launcher.support import mosaic_host_abi

__all__ = ["MosaicKernel", "mosaic_library", "mosaic_unavailable_reason"]


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str]:
    paths = []
    for plugin in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            module = __import__(plugin, fromlist=["_get_library_path"])
            paths.append(str(module._get_library_path()))
        except Exception:  # noqa: BLE001 - not installed / no such helper
            continue
    errors = []
    for path in paths + [None]:
        try:
            lib = ctypes.CDLL(path)
        except OSError as err:
            errors.append(f"{path}: {err}")
            continue
        if hasattr(lib, "MosaicGpuCompile") and hasattr(lib, "MosaicGpuUnload"):
            return lib, path or "the process's loaded libraries"
        errors.append(f"{path or 'process'}: no MosaicGpuCompile")
    return None, "jaxlib's CUDA plugin exports no MosaicGpuCompile (" + "; ".join(errors) + ")"


def mosaic_unavailable_reason() -> str | None:
    """None where jaxlib's Mosaic GPU compiler can be called from here, else why not."""
    return _library()[1] if _library()[0] is None else None


def mosaic_library() -> ctypes.CDLL:
    lib, how = _library()
    if lib is None:
        raise LauncherUnavailable(how)
    return lib


@functools.lru_cache(maxsize=256)
def _compiled(module: bytes, device_index: int) -> tuple[int, int, int]:
    """(handle, context, host launch function) of `module` loaded on `device_index` (cached:
    one compile per module and device for the process; never unloaded)."""
    from funcmla.interop import _cuda_driver as cd

    lib = mosaic_library()
    compile_fn = lib.MosaicGpuCompile
    compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
    compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
    cd.driver().make_current(device_index)  # the module loads into the current context
    handle = compile_fn(module, len(module))
    if not handle:
        raise LauncherUnavailable("jaxlib's MosaicGpuCompile failed on the decode kernel's module")
    return ctypes.addressof(handle.contents), int(handle[0] or 0), int(handle[1] or 0)


class MosaicKernel:
    """One Mosaic GPU kernel compiled and loaded by jaxlib for `device_index`.

    `function` (the context) and `host` (the launch function) feed a launch program
    (`interop/_launch.py`); grid, block and shared memory are the host function's own."""

    route = "mosaic"

    def __init__(self, call: MosaicCall, device_index: int):
        self.call = call
        _, self.function, self.host = _compiled(call.module, device_index)
        if not self.host:
            raise LauncherUnavailable("MosaicGpuCompile returned no launch function")
        self.host_abi = mosaic_host_abi()
        self.num_params = len(call.operands) + len(call.results)
        self.grid, self.block, self.shared_mem_bytes = (0, 0, 0), (0, 0, 0), 0

    def info(self) -> dict:
        return {**self.call.summary(), "route": self.route,
                "compiled_with": "jaxlib MosaicGpuCompile (the mosaic_gpu_v2 custom call's)"}
