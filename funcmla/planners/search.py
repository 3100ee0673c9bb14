"""The planners' binary search: `jnp.searchsorted` as int32, in the form that suits the backend.

On a GPU the search is unrolled (`method="scan_unrolled"`): XLA fuses it into one kernel and
emits no while loop, so a plan program is a plain sequence of kernel launches that the torch
metadata launcher can replay (`funcmla.interop.sglang.step_launch`). Elsewhere it is a loop
(`"scan"`), which compiles faster and runs as fast on a CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["on_gpu", "searchsorted_i32"]


def on_gpu() -> bool:
    """JAX runs on a GPU (where the Pallas planner programs compile; elsewhere they run in
    interpret mode)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def searchsorted_i32(sorted_arr: jax.Array, x: jax.Array, side: str) -> jax.Array:
    """int32 insertion indices of `x` into the ascending `sorted_arr` (`side`: "left"/"right")."""
    method = "scan_unrolled" if on_gpu() else "scan"
    return jnp.searchsorted(sorted_arr, x, side=side, method=method).astype(jnp.int32)
