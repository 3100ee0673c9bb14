"""Scale operands of an fp8 launcher: k_scale / v_scale as the float32 device tensors the kernel
reads, with no device-to-host sync.

A scale is a Python real or a float32 tensor of shape () or [1] on the launcher's device
(SGLang's `layer.k_scale`; `layer.k_scale_float` is the float). A tensor is passed by pointer:
its value is the caller's contract (reading it would need a sync). A float is checked (positive,
finite as float32: `funcmla.attention.kv_quant.check_kv_scale_values`) and served from
`FloatScales`: one device tensor per distinct value and device, written once, on the stream of
the call that first passes the value, and never rewritten or freed, so a CUDA graph that captured
its address reads that value at every replay. A value first seen during a stream capture is
refused (its write would only run at replay); pass it once before capturing, or pass a tensor.
"""

from __future__ import annotations

import numbers
import threading

from funcmla.attention.kv_quant import check_kv_scale_values
from funcmla.interop.launcher.errors import LauncherArgumentError

__all__ = ["MAX_FLOAT_SCALES", "FloatScales", "ScaleOperands", "float_scales"]

# Distinct float scales kept per device (each a 4-byte tensor in its own allocation). The copies
# are never freed (a captured graph may read any of them), so the count is bounded.
MAX_FLOAT_SCALES = 4096


class FloatScales:
    """Device copies of float scales on one torch device: `tensor(name, value)` -> a float32
    [1] tensor holding `value`, created on first use and kept (see the module docstring)."""

    def __init__(self, device):
        import torch

        self.device = torch.device(device)
        self.cache: dict[float, object] = {}
        self._lock = threading.Lock()
        self._torch = torch

    def tensor(self, name: str, value: float):
        """The device copy of `value` (named `name` in errors); raises LauncherArgumentError for
        a value that is not a positive finite float32, a first sight during a CUDA stream
        capture, or more than MAX_FLOAT_SCALES distinct values."""
        torch = self._torch
        with self._lock:
            t = self.cache.get(value)
            if t is not None:
                return t
            try:
                check_kv_scale_values(**{name: value})
            except ValueError as err:
                raise LauncherArgumentError(str(err)) from None
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise LauncherArgumentError(
                    f"{name}={value!r} is a float the launcher has not seen before, passed during "
                    "a CUDA graph capture: its device copy cannot be written there (the write "
                    "would only run at replay). Call the launcher once with this value before "
                    "capturing, or pass a float32 device tensor")
            if len(self.cache) >= MAX_FLOAT_SCALES:
                raise LauncherArgumentError(
                    f"{name}={value!r}: {MAX_FLOAT_SCALES} distinct float scales are already "
                    f"kept on {self.device} (never freed: captured graphs may read them); pass "
                    "float32 device tensors")
            t = torch.full((1,), value, dtype=torch.float32, device=self.device)
            self.cache[value] = t
            return t


_BY_DEVICE: dict[str, FloatScales] = {}
_BY_DEVICE_LOCK = threading.Lock()


def float_scales(device) -> FloatScales:
    """The `FloatScales` of `device` (one per device, shared by its launchers)."""
    key = str(device)
    with _BY_DEVICE_LOCK:
        got = _BY_DEVICE.get(key)
        if got is None:
            got = _BY_DEVICE[key] = FloatScales(device)
        return got


class ScaleOperands:
    """`(k_scale, v_scale) -> (k tensor, v tensor)` for one launcher's device: v_scale defaults
    to k_scale, k_scale to 1 (`funcmla.attention.kv_quant`'s rule). Tensors pass through
    unchanged (the launcher's tensor checks name a wrong one); floats become their device
    copies; anything else raises LauncherArgumentError naming the argument."""

    def __init__(self, device):
        import torch

        self.floats = float_scales(device)
        self.one = self.floats.tensor("k_scale", 1.0)  # at build: never first seen in a capture
        self._tensor = torch.Tensor

    def __call__(self, k_scale, v_scale):
        cache = self.floats.cache
        if k_scale is None:
            k = self.one
        else:
            k = cache.get(k_scale) if k_scale.__class__ is float else None
            if k is None:
                k = self._other("k_scale", k_scale)
        if v_scale is None:
            return k, k
        v = cache.get(v_scale) if v_scale.__class__ is float else None
        if v is None:
            v = self._other("v_scale", v_scale)
        return k, v

    def _other(self, name: str, value):
        if isinstance(value, self._tensor):
            return value
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return self.floats.tensor(name, float(value))
        raise LauncherArgumentError(f"{name} must be a float or a float32 torch tensor of shape "
                                    f"() or [1], got {type(value).__name__}")
