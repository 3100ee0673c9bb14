"""The decode benchmark's cases: MLA dimensions, random bf16 (or fp8) pool copies, queries and
metadata (token CSR at page size 1, a page table otherwise), and the rule for how many copies
and calls one timing uses."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from funcmla.config import MLADims
from funcmla.layout import PageTable

__all__ = ["D", "DV", "SM_SCALE", "make_case", "case_tables", "pool_copies_and_calls"]

D, DV = 576, 512
SM_SCALE = MLADims().sm_scale


def pool_copies_and_calls(kv_bytes: float) -> tuple[int, int]:
    """(pool copies, calls per timing) for a case reading `kv_bytes` of KV: copies enough to
    cover 256 MB (at most 32), so the 60 MB L2 never holds the working set across calls, and at
    least 32 calls for small cases (8 for those of 64 MB and more), so a timing spans enough
    device time."""
    copies = int(min(32, max(1, math.ceil(256e6 / kv_bytes))))
    return copies, max(copies, 32 if kv_bytes < 64e6 else 8)


def make_case(key: jax.Array, b: int, h: int, ctx: int, page_size: int, s_q: int, copies: int,
              n_q: int, kv_scale: float | None = None
              ) -> tuple[list[jax.Array], list[jax.Array], dict, jax.Array]:
    """Pool copies [copies][slots, 576], q list, metadata pytree (CSR arrays for page 1, a
    PageTable else) and the [B, ctx] slot matrix for the XLA baseline. kv_scale: fp8 pools
    (float8_e4m3fn) holding the bf16 pool's values / kv_scale."""
    k1, k2, k3 = jax.random.split(key, 3)
    meta, slots, slot_mat = case_tables(k3, b, ctx, page_size)
    pools = [jax.random.normal(jax.random.fold_in(k1, c), (slots, D), jnp.bfloat16)
             for c in range(copies)]
    if kv_scale is not None:
        pools = [_to_fp8(p, kv_scale) for p in pools]
    qs = [jax.random.normal(jax.random.fold_in(k2, i), (b * s_q, h, D), jnp.bfloat16)
          for i in range(n_q)]
    return pools, qs, meta, slot_mat


def case_tables(key: jax.Array, b: int, ctx: int, page_size: int
                ) -> tuple[dict, int, jax.Array]:
    """(metadata pytree, pool rows, [B, ctx] slot matrix) of b full sequences of ctx tokens:
    at page 1 a token CSR over a permutation of slots 1.., else a PageTable over a permutation
    of pages 1.. (ceil(ctx / page_size) a sequence); pool row 0 (page 0) unused."""
    if page_size == 1:
        slots = b * ctx + 1
        perm = jax.random.permutation(key, jnp.arange(1, slots, dtype=jnp.int32))
        indptr = jnp.arange(b + 1, dtype=jnp.int32) * ctx
        return dict(kv_indptr=indptr, kv_indices=perm), slots, perm.reshape(b, ctx)
    per_seq = -(-ctx // page_size)
    npages = b * per_seq
    perm = jax.random.permutation(key, jnp.arange(1, npages + 1, dtype=jnp.int32))
    table = perm.reshape(b, per_seq)
    lengths = jnp.full((b,), ctx, jnp.int32)
    pos = jnp.arange(ctx, dtype=jnp.int32)
    slot_mat = table[:, pos // page_size] * page_size + pos % page_size
    return (dict(page_table=PageTable(table, lengths, page_size)), (npages + 1) * page_size,
            slot_mat)


@functools.partial(jax.jit, static_argnums=1)
def _to_fp8(pool, kv_scale: float):
    return (pool.astype(jnp.float32) / kv_scale).astype(jnp.float8_e4m3fn)
