"""What the decode benchmark compares the kernel with: the XLA baseline it is timed against
(gather, einsum, softmax, einsum), its float32 form at Precision.HIGHEST as the reference of a
case, and a float64 NumPy reference over ragged sequences for the correctness checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .decode_data import D, DV, SM_SCALE

__all__ = ["HI", "f32_reference", "np_reference", "rel_err", "xla_decode"]

HI = jax.lax.Precision.HIGHEST


def xla_decode(q: jax.Array, pool: jax.Array, slot_mat: jax.Array, *, s_q: int, sm_scale: float,
               precision: jax.lax.Precision | None = None) -> tuple[jax.Array, jax.Array]:
    """The XLA baseline: gather [B, L, 576], scores, softmax, PV. Equal-length sequences."""
    b, ctx = slot_mat.shape
    t, h, _ = q.shape
    kv = pool[slot_mat]  # [B, L, D]
    qr = q.reshape(b, s_q * h, D)
    s = jnp.einsum("brd,bld->brl", qr, kv, preferred_element_type=jnp.float32,
                   precision=precision) * sm_scale
    tok = jnp.arange(s_q * h) // h
    limit = ctx - s_q + 1 + tok
    s = jnp.where(jnp.arange(ctx)[None, None, :] < limit[None, :, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - m)
    l_ = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("brl,bld->brd", p.astype(kv.dtype) if precision is None else p,
                   kv[..., :DV], preferred_element_type=jnp.float32, precision=precision)
    o = o / l_
    lse = (m + jnp.log(l_))[..., 0]
    return o.reshape(t, h, DV).astype(q.dtype if precision is None else jnp.float32), \
        lse.reshape(t, h)


def rel_err(a: jax.Array, ref: jax.Array) -> float:
    """||a - ref|| / ||ref|| over all elements, in float32."""
    a = jnp.asarray(a, jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm((a - ref).ravel()) / jnp.linalg.norm(ref.ravel()))


def np_reference(q: jax.Array, pool: jax.Array, slot_lists: list, s_q: int,
                 sm_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 numpy reference; slot_lists[b] = the sequence's token slots."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    pool = np.asarray(jnp.asarray(pool, jnp.float32), np.float64)
    t, h, _ = q.shape
    out = np.zeros((t, h, DV))
    lse = np.full((t, h), np.inf)
    for b, sl in enumerate(slot_lists):
        kv = pool[np.asarray(sl, np.int64)]
        for i in range(s_q):
            vis = min(max(len(sl) - s_q + 1 + i, 0), len(sl))
            if vis == 0:
                continue
            s = q[b * s_q + i] @ kv[:vis].T * sm_scale
            m = s.max(1, keepdims=True)
            p = np.exp(s - m)
            l_ = p.sum(1, keepdims=True)
            out[b * s_q + i] = p @ kv[:vis, :DV] / l_
            lse[b * s_q + i] = (m + np.log(l_))[:, 0]
    return out, lse


@functools.partial(jax.jit, static_argnums=(3, 4))
def f32_reference(q: jax.Array, p: jax.Array, slot_mat: jax.Array, s_q: int,
                  kv_scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """float32 (Precision.HIGHEST) XLA reference of one case (an fp8 pool dequantized)."""
    pf = p.astype(jnp.float32) if kv_scale is None else p.astype(jnp.float32) * kv_scale
    return xla_decode(q.astype(jnp.float32), pf, slot_mat, s_q=s_q, sm_scale=SM_SCALE,
                      precision=HI)
