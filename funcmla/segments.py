"""Segment arithmetic over offset arrays (indptr): which row each position belongs to.

Kept apart from `funcmla.indices` so the value checks (`funcmla.checks`), which the index
builders call, can use it without an import circle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["cumsum_i32", "segment_ids"]


def cumsum_i32(x: jax.Array) -> jax.Array:
    """Inclusive int32 cumsum. On CPU, XLA lowers `cumsum` to a slow reduce-window (about 5x
    slower than a log-depth associative scan at 4M elements), so use the scan there."""
    x = x.astype(jnp.int32)
    if jax.default_backend() == "cpu":
        return jax.lax.associative_scan(jnp.add, x)
    return jnp.cumsum(x, dtype=jnp.int32)


def segment_ids(indptr: jax.Array, size: int) -> jax.Array:
    """For each position t in [0, size): the row i with indptr[i] <= t < indptr[i + 1].

    Positions at or past indptr[-1] get `num_rows` (one past the last row). O(size + B): a
    scatter-add of row starts followed by a cumsum, so zero-length rows are handled.
    """
    starts = jnp.zeros((size + 1,), jnp.int32).at[indptr[1:]].add(
        1, mode="drop", wrap_negative_indices=False)  # a negative offset is dropped, not wrapped
    return cumsum_i32(starts[:size])
