"""The bandwidth ceiling the decode benchmarks report against: a device-to-device copy (bytes
read + written per second) through JAX, and the same copy through torch as a cross-check."""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp

from .timing import median_time_s

__all__ = ["hbm_ceiling", "torch_copy_ceiling"]


def hbm_ceiling(gib: float = 4.0, reps: int = 10) -> float:
    """Bytes per second of a `gib` GiB device-to-device copy through JAX (read + written),
    median of `reps` after a warm-up."""
    n = int(gib * 2**30)
    x = jax.random.randint(jax.random.PRNGKey(0), (n // 4,), 0, 2**30, jnp.int32)
    f = jax.jit(lambda v: v + 1)
    t = median_time_s(lambda: jax.block_until_ready(f(x)), reps=reps, warmup=1)
    return 2 * n / t


def torch_copy_ceiling(gib: float = 4.0, reps: int = 10) -> float | None:
    """The same copy through torch (CUDA events), as a cross-check of the JAX one."""
    try:
        import torch
    except ImportError:
        return None
    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(ts)
