"""The launcher's two error classes."""

class LauncherArgumentError(ValueError):
    """A tensor handed to a launcher does not match its compiled configuration."""


class LauncherUnavailable(RuntimeError):
    """The launcher cannot run here (no CUDA torch, no NVIDIA driver, no Triton lowering)."""


