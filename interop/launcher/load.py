"""Load: a compiled Triton kernel in the device's primary context (torch's)."""

from __future__ import annotations

from funcmla.interop.launcher.compile import CompiledImage, _compile_cached
from funcmla.interop.launcher.errors import LauncherUnavailable
from funcmla.interop.launcher.extract import TritonCall


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


