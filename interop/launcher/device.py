"""The device side every launcher shares: whether it can run here, which CUDA device a caller
means, and torch's current stream as a raw handle."""

from __future__ import annotations

from funcmla.interop.launcher.errors import LauncherUnavailable
from funcmla.interop.launcher.support import jaxlib_unsupported_reason

__all__ = ["launcher_unavailable_reason", "cuda_device_index", "current_raw_stream_fn",
           "launch_device"]


def launcher_unavailable_reason(device=None) -> str | None:
    """None if the launcher can run on `device` (default: torch's current CUDA device)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    why = jaxlib_unsupported_reason()
    if why is not None:
        return why
    if getattr(torch.version, "hip", None):
        return "torch runs on ROCm; the launcher targets NVIDIA GPUs"
    try:
        from funcmla.interop import _cuda_driver

        _cuda_driver.driver()
    except Exception as err:  # noqa: BLE001 - report any reason
        return f"CUDA driver API unavailable ({err})"
    return None


def cuda_device_index(device) -> int:
    """The CUDA device index `device` names (a torch device, an index, or None: torch's
    current device); LauncherUnavailable for a device that is not CUDA."""
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise LauncherUnavailable(f"the launcher runs on CUDA devices, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def current_raw_stream_fn(torch):
    """device index -> torch's current CUDA stream handle (an int), cheaply."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def launch_device(torch, device, *, real: bool):
    """(torch.device, its index: -1 for the CPU) a launcher is built on. real (no stand-in
    kernels): LauncherUnavailable unless the launcher can run here and the device is CUDA. A
    CUDA device without an index is torch's current one; torch's context on it is initialised
    (its current stream)."""
    device = torch.device(device)
    if real:
        reason = launcher_unavailable_reason()
        if reason is not None:
            raise LauncherUnavailable(reason)
        if device.type != "cuda":
            raise LauncherUnavailable(f"the launcher runs on CUDA devices, got {device}")
    if device.type != "cuda":
        return device, -1
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.current_stream(device)  # initialises torch's context on the device
    return device, device.index
