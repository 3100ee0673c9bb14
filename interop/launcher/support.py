"""The jaxlib versions the launcher's extraction was tested on.

The launcher reads undocumented structures of jaxlib: the custom calls of the CUDA lowering
(`__gpu$xla.gpu.triton`, `mosaic_gpu_v2` and their backend_config keys), the serialized GPU
executable's launch records (`interop/_xla_kernels.py`) and the Mosaic GPU plugin's
`MosaicGpuCompile` entry point. Each can change in any jaxlib release, so the launcher runs only
on the versions its tests passed on; on any other it raises `LauncherUnavailable` and the torch
backends fall back to the JAX path (same kernels through DLPack). Set
FUNCMLA_LAUNCHER_ANY_JAXLIB=1 to try another version (its own checks still refuse a call
layout they do not recognise).
"""

from __future__ import annotations

import os

__all__ = ["TESTED_JAXLIB", "jaxlib_unsupported_reason", "jaxlib_version", "mosaic_host_abi"]

# 0.10.2: CPU CI (extraction, lowering, the Triton route's compile). 0.11.2: the H200 image
# (every route, bit-identity and CUDA-graph tests; bench/torch_path.py).
TESTED_JAXLIB = ("0.10.2", "0.11.2")
# How the Mosaic GPU host launch function that `MosaicGpuCompile` returns takes its arguments
# (interop/_launch.py): 0.10.2 MLIR's packed interface, 0.11.2 (context, stream, buffers), as
# each version's jax.experimental.mosaic.gpu.core._compile_as_torch_gpu_kernel calls it.
_MOSAIC_HOST_ABI = {"0.10.2": 2, "0.11.2": 1}


def jaxlib_version() -> str:
    import jaxlib

    return getattr(jaxlib, "__version__", None) or getattr(
        getattr(jaxlib, "version", None), "__version__", "unknown")


def mosaic_host_abi() -> int:
    """The Mosaic GPU host function's calling convention for this jaxlib (the newest one's on
    an untested jaxlib, where FUNCMLA_LAUNCHER_ANY_JAXLIB=1 allows it)."""
    return _MOSAIC_HOST_ABI.get(jaxlib_version(), 1)


def jaxlib_unsupported_reason() -> str | None:
    """None on a tested jaxlib (or with FUNCMLA_LAUNCHER_ANY_JAXLIB=1), else why not."""
    try:
        version = jaxlib_version()
    except ImportError:
        return "jaxlib is not installed"
    if version in TESTED_JAXLIB or os.environ.get("FUNCMLA_LAUNCHER_ANY_JAXLIB") == "1":
        return None
    return (f"jaxlib {version} is not one the launcher was tested on ({', '.join(TESTED_JAXLIB)});"
            " its kernel extraction reads jaxlib internals. Set FUNCMLA_LAUNCHER_ANY_JAXLIB=1 to "
            "try it")
