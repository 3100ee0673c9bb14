"""fp8 KV pools: which dtypes are taken, the scale convention, and its checks (one home for the
reference and the kernels).

Convention (SGLang's `layer.k_scale` / `layer.v_scale`): a pool row x stored in fp8 stands for
k = k_scale * float(x) in the scores and v = v_scale * float(x[:v_head_dim]) in the output (the
MLA latent row is both K and V). `v_scale` defaults to `k_scale`, `k_scale` to 1. A scale is a
positive finite float32: a Python real, or an array of shape () or [1] (a per-layer scalar), so
one compiled kernel serves every layer. Kernels apply k_scale to the float32 scores and v_scale
to the float32 output, never to the fp8 bytes.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FP8_KV_DTYPES", "is_fp8_kv", "check_kv_pool_dtype", "kv_scales", "one_scale",
           "check_kv_scale_values"]

# fp8 pool dtypes: e4m3fn (NVIDIA, SGLang's fp8_e4m3) and e4m3fnuz (AMD MI300's variant).
FP8_KV_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz))


def is_fp8_kv(dtype) -> bool:
    """Whether `dtype` is an fp8 pool dtype this project reads (`FP8_KV_DTYPES`)."""
    return jnp.dtype(dtype) in FP8_KV_DTYPES


def check_kv_pool_dtype(dtype, taken=None, who: str = "kv_pool") -> None:
    """Raises TypeError naming `who` when the pool dtype is not floating or is an 8-bit float
    other than `FP8_KV_DTYPES` (or, with `taken`, not among `taken`)."""
    dt = jnp.dtype(dtype)
    if taken is not None:
        if dt not in tuple(jnp.dtype(t) for t in taken):
            names = ", ".join(jnp.dtype(t).name for t in taken)
            raise TypeError(f"{who} dtype {dt.name} is not taken here (one of: {names})")
        return
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{who} dtype {dt.name} is not a floating dtype (an fp8 pool stored as "
                        "uint8 must be viewed as float8_e4m3fn or float8_e4m3fnuz)")
    if dt.itemsize == 1 and dt not in FP8_KV_DTYPES:
        raise TypeError(f"{who} dtype {dt.name} is not taken; fp8 pools are float8_e4m3fn or "
                        "float8_e4m3fnuz")


def one_scale(name: str, value, pool_dtype, who: str = "kv_pool") -> jax.Array | None:
    """`value` (None, a positive finite real, or a float32 array of shape () or [1]) as a
    float32 [1] array, None for None; it must scale an fp8 tensor (`who`, of `pool_dtype`).
    Raises naming `name` (values checked where concrete)."""
    if value is None:
        return None
    if not is_fp8_kv(pool_dtype):
        raise ValueError(f"{name} applies to an fp8 {who} (float8_e4m3fn / float8_e4m3fnuz); "
                         f"{who} is {jnp.dtype(pool_dtype).name}")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        v = float(value)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={value!r} must be a positive finite float")
        return jnp.full((1,), v, jnp.float32)
    if isinstance(value, bool) or not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(f"{name} must be a float or a float32 array of shape () or [1], got "
                        f"{type(value).__name__}")
    if tuple(value.shape) not in ((), (1,)):
        raise ValueError(f"{name} must have shape () or [1] (one scale per layer), got "
                         f"{tuple(value.shape)}")
    if jnp.dtype(value.dtype) != jnp.float32:
        raise TypeError(f"{name} must be float32, got {jnp.dtype(value.dtype).name}")
    check_kv_scale_values(**{name: value})
    return jnp.reshape(value, (1,))


def kv_scales(pool_dtype, k_scale=None, v_scale=None) -> tuple[jax.Array, jax.Array] | None:
    """The (k_scale, v_scale) float32 [1] arrays an fp8 pool is read with (v_scale defaults to
    k_scale, k_scale to 1); None for a pool that is not fp8 (where a scale is an error).
    Checks shapes and dtypes always and values where they are concrete (not under jit);
    raises naming the argument."""
    k = one_scale("k_scale", k_scale, pool_dtype)
    v = one_scale("v_scale", v_scale, pool_dtype)
    if not is_fp8_kv(pool_dtype):
        return None
    if k is None:
        k = jnp.ones((1,), jnp.float32)
    return k, (k if v is None else v)


def check_kv_scale_values(**scales) -> None:
    """Eager value check of concrete scale arrays (tracers are skipped: under jit the values are
    the caller's contract); raises ValueError naming the argument and the value."""
    for name, value in scales.items():
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below
            arr = np.asarray(value, np.float32).reshape(-1)
        if not (np.isfinite(arr).all() and (arr > 0).all()):
            raise ValueError(f"{name}={arr.tolist()} must be a positive finite float")
