"""The few CUDA driver API calls the kernel launcher needs, through ctypes on libcuda.

Why ctypes on libcuda rather than a binding package or a compiled extension: the driver library
is present wherever an NVIDIA GPU is usable (torch and JAX load it too), so this adds no
dependency and no build step; the per-call path is one foreign call (`cuLaunchKernel`) whose
argument array is prepared once. `cuda-bindings` would do the same work with more per-call
conversion; a C++ extension would save about a microsecond per call but needs nvcc and a build
per torch version.

Everything here runs in the device's primary context, the one torch and JAX use.
"""

from __future__ import annotations

import ctypes
import functools
import threading

__all__ = [
    "CudaDriverError",
    "CudaDriverUnavailable",
    "driver",
    "Driver",
    "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES",
    "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES",
    "CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
]

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_CONTEXT = 201
CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_JIT_INFO_LOG_BUFFER = 3
CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES = 4
CU_JIT_ERROR_LOG_BUFFER = 5
CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6


class CudaDriverUnavailable(RuntimeError):
    """libcuda.so could not be loaded (no NVIDIA driver on this machine)."""


class CudaDriverError(RuntimeError):
    """A driver call returned an error code; the message names the call and the code."""

    def __init__(self, call: str, code: int, name: str, text: str, detail: str = ""):
        self.call, self.code = call, code
        msg = f"{call} failed: {name} ({code}): {text}"
        super().__init__(msg + (f"\n{detail}" if detail else ""))


class Driver:
    """ctypes handles on libcuda; `launch` is the hot path (no Python-side allocation)."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        vp, ui, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int

        def fn(name, *argtypes):
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = i
            return f

        P = ctypes.POINTER
        self._init = fn("cuInit", ui)
        self._device_get = fn("cuDeviceGet", P(i), i)
        self._device_get_attribute = fn("cuDeviceGetAttribute", P(i), i, i)
        self._primary_ctx_retain = fn("cuDevicePrimaryCtxRetain", P(vp), i)
        self._ctx_get_current = fn("cuCtxGetCurrent", P(vp))
        self._ctx_set_current = fn("cuCtxSetCurrent", vp)
        self._module_load_data_ex = fn("cuModuleLoadDataEx", P(vp), ctypes.c_char_p, ui,
                                       P(i), P(vp))
        self._module_get_function = fn("cuModuleGetFunction", P(vp), vp, ctypes.c_char_p)
        self._func_get_attribute = fn("cuFuncGetAttribute", P(i), i, vp)
        self._func_set_attribute = fn("cuFuncSetAttribute", vp, i, i)
        self._get_error_name = fn("cuGetErrorName", i, P(ctypes.c_char_p))
        self._get_error_string = fn("cuGetErrorString", i, P(ctypes.c_char_p))
        # cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, kernelParams, extra)
        self.launch_raw = fn("cuLaunchKernel", vp, ui, ui, ui, ui, ui, ui, ui, vp, vp, vp)
        self._lock = threading.Lock()
        self._primary: dict[int, int] = {}
        self._check("cuInit", self._init(0))

    # -- errors -----------------------------------------------------------------------------
    def error_text(self, code: int) -> tuple[str, str]:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        self._get_error_name(code, ctypes.byref(name))
        self._get_error_string(code, ctypes.byref(text))
        return ((name.value or b"CUDA_ERROR_UNKNOWN").decode(),
                (text.value or b"unknown error").decode())

    def _check(self, call: str, code: int, detail: str = "") -> None:
        if code != CUDA_SUCCESS:
            raise CudaDriverError(call, code, *self.error_text(code), detail)

    # -- context ----------------------------------------------------------------------------
    def primary_context(self, device_index: int) -> int:
        """Retain (once) and return the primary context of device `device_index`."""
        with self._lock:
            if device_index not in self._primary:
                dev, ctx = ctypes.c_int(), ctypes.c_void_p()
                self._check("cuDeviceGet", self._device_get(ctypes.byref(dev), device_index))
                self._check("cuDevicePrimaryCtxRetain",
                            self._primary_ctx_retain(ctypes.byref(ctx), dev.value))
                self._primary[device_index] = ctx.value
            return self._primary[device_index]

    def make_current(self, device_index: int) -> None:
        """Make the primary context of `device_index` current on this thread."""
        ctx = self.primary_context(device_index)
        cur = ctypes.c_void_p()
        self._check("cuCtxGetCurrent", self._ctx_get_current(ctypes.byref(cur)))
        if cur.value != ctx:
            self._check("cuCtxSetCurrent", self._ctx_set_current(ctx))

    def device_attribute(self, device_index: int, attribute: int) -> int:
        dev, value = ctypes.c_int(), ctypes.c_int()
        self._check("cuDeviceGet", self._device_get(ctypes.byref(dev), device_index))
        self._check("cuDeviceGetAttribute",
                    self._device_get_attribute(ctypes.byref(value), attribute, dev.value))
        return value.value

    # -- modules and functions --------------------------------------------------------------
    def load_function(self, image: bytes, name: str, device_index: int) -> tuple[int, int]:
        """Load a cubin (or NUL-terminated PTX, compiled by the driver) and return
        (module handle, function handle) in the device's primary context."""
        self.make_current(device_index)
        module = ctypes.c_void_p()
        log_size = 1 << 14
        err_log = ctypes.create_string_buffer(log_size)
        opts = (ctypes.c_int * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
        vals = (ctypes.c_void_p * 2)(ctypes.cast(err_log, ctypes.c_void_p).value, log_size)
        code = self._module_load_data_ex(ctypes.byref(module), image, 2, opts, vals)
        self._check("cuModuleLoadDataEx", code, err_log.value.decode(errors="replace"))
        function = ctypes.c_void_p()
        self._check("cuModuleGetFunction",
                    self._module_get_function(ctypes.byref(function), module, name.encode()))
        return module.value, function.value

    def function_attribute(self, function: int, attribute: int) -> int:
        value = ctypes.c_int()
        self._check("cuFuncGetAttribute",
                    self._func_get_attribute(ctypes.byref(value), attribute, function))
        return value.value

    def set_function_attribute(self, function: int, attribute: int, value: int) -> None:
        self._check("cuFuncSetAttribute", self._func_set_attribute(function, attribute, value))

    @property
    def launch_address(self) -> int:
        """Address of the driver's cuLaunchKernel (for the launch programs of _launch.py)."""
        return ctypes.cast(self.launch_raw, ctypes.c_void_p).value

    def check_launch(self, code: int, name: str) -> None:
        self._check(f"cuLaunchKernel({name})", code)


@functools.lru_cache(maxsize=1)
def driver() -> Driver:
    """The process-wide driver handle; raises CudaDriverUnavailable without libcuda."""
    for soname in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(soname)
        except OSError:
            continue
        return Driver(lib)
    raise CudaDriverUnavailable("libcuda.so.1 not found: no NVIDIA driver on this machine")
