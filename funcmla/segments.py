"""Segment arithmetic over offset arrays (indptr): which row each position belongs to.

Kept apart from `funcmla.indices` so the value checks (`funcmla.checks`), which the index
builders call, can use it without an import circle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cumsum_i32", "segment_ids", "segment_positions", "take_or_fill"]


def cumsum_i32(x: jax.Array) -> jax.Array:
    """Inclusive int32 cumsum. On CPU, XLA lowers `cumsum` to a reduce-window that is slower
    than a log-depth associative scan at metadata sizes, so use the scan there."""
    x = x.astype(jnp.int32)
    if jax.default_backend() == "cpu":
        return jax.lax.associative_scan(jnp.add, x)
    return jnp.cumsum(x, dtype=jnp.int32)


def segment_ids(indptr: jax.Array, size: int) -> jax.Array:
    """For each position t in [0, size): the row i with indptr[i] <= t < indptr[i + 1].

    Positions at or past indptr[-1] get `num_rows` (one past the last row). O(size + B): a
    scatter-add of row starts followed by a cumsum, so zero-length rows are handled.
    """
    # offsets outside [0, size] (negative, or past the buffer) count into the spare last slot:
    # every scatter index is in bounds, none wraps around
    ends = indptr[1:]
    ends = jnp.where((ends >= 0) & (ends <= size), ends, size)
    starts = jnp.zeros((size + 1,), jnp.int32).at[ends].add(1)
    return cumsum_i32(starts[:size])


def segment_positions(indptr: jax.Array, size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each position t in [0, size): (row, offset, live), with row the `segment_ids` row
    clamped to the last one (an in-bounds index for gathers), offset = t - indptr[row], and live
    = t lies in a row. Dead positions' row and offset are meaningless: mask them with live."""
    batch = indptr.shape[0] - 1
    seg = segment_ids(indptr, size)
    row = jnp.minimum(seg, batch - 1)
    return row, jnp.arange(size, dtype=jnp.int32) - indptr[row], seg < batch


def take_or_fill(x: jax.Array, *idx: jax.Array, fill) -> jax.Array:
    """`x[idx...]` (one index array per leading axis, broadcast together), with `fill` wherever
    an index is outside its axis, negative ones included (no Python-style wrap-around).

    Every gather it issues is in bounds (indices clipped, then the result selected), so it never
    reads out of bounds and never trips checkify's index checks, on any JAX version (jax 0.12
    flags out-of-range `mode="fill"` gathers as out-of-bounds under checkify)."""
    idx = jnp.broadcast_arrays(*idx)
    ok = jnp.ones(idx[0].shape, bool)
    clipped = []
    for axis, i in enumerate(idx):
        n = x.shape[axis]
        ok = ok & (i >= 0) & (i < n)
        clipped.append(jnp.clip(i, 0, max(n - 1, 0)))
    got = x[tuple(clipped)]
    mask = ok.reshape(ok.shape + (1,) * (got.ndim - ok.ndim))
    return jnp.where(mask, got, jnp.asarray(fill, x.dtype))
