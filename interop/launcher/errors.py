"""The launcher's two error classes."""


class LauncherArgumentError(ValueError):
    """A tensor handed to a launcher does not match its compiled configuration."""


class LauncherUnavailable(RuntimeError):
    """The launcher cannot run here: no CUDA torch or NVIDIA driver, an untested jaxlib, no
    Mosaic GPU compiler, or kernels it does not wire (the message says which)."""


