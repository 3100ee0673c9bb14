"""Argument checks: what each launcher tensor must be (`TensorSpec`)."""

from __future__ import annotations

from typing import Sequence

from funcmla.interop.launcher.errors import LauncherArgumentError
from funcmla.layout import is_power_of_two


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
        if not is_power_of_two(align):
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


def expect_tensor(name: str, x, dtype, device_index: int, device) -> None:
    """x is a torch tensor of `dtype` (or of one of a tuple of dtypes) on `device_index`
    (torch's `get_device()`; `device` names it); else LauncherArgumentError naming `name`.
    The launchers whose tensors take several shapes check shapes themselves."""
    import torch

    if not isinstance(x, torch.Tensor):
        raise LauncherArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in (dtype if isinstance(dtype, tuple) else (dtype,)):
        want = " or ".join(map(str, dtype)) if isinstance(dtype, tuple) else dtype
        raise LauncherArgumentError(f"{name} must be {want}, got {x.dtype}")
    if x.get_device() != device_index:
        raise LauncherArgumentError(f"{name} is on {x.device}; the launcher was built for "
                                    f"{device}")
