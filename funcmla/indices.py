"""Index expansion between request tables, token CSRs and page tables.

All functions are pure, jit-able and have static output shapes. Units are in every name:
`*_lens` count tokens, `indptr` of a `TokenCSR` counts tokens, a `PageTable` holds page ids.

* `gather_token_indices`: SGLang's `create_flashinfer_kv_indices_triton`:
  `kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]`.
* `page_table_from_token_slots`: SGLang's `create_flashmla_kv_indices_triton`:
  `table[i, p] = req_to_token[r_i, kv_start_i + p * ps] // ps` for `p < ceil(len / ps)`.
* `token_slots_from_page_table`: `slot = table[i, t // ps] * ps + t % ps`, as a TokenCSR.
* `kv_last_page_len`: `(len - 1) % ps + 1` (0 for an empty sequence).

Entries past the live range (`kv_indices[kv_indptr[-1]:]`, page-table columns past
`ceil(len / ps)`) hold `FILL_SLOT` / `FILL_PAGE` = 0: the reserved padding page, so a stray
read stays inside the pool and is recognisable. Kernels must never read them.

These functions do not bounds-check their inputs (that is `funcmla.checks`); gathers use
`mode="fill"` so an out-of-range read yields the fill value instead of a silently clamped row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from funcmla.layout import PageTable, TokenCSR, expect_layout, is_power_of_two

__all__ = [
    "FILL_SLOT",
    "FILL_PAGE",
    "indptr_from_lens",
    "segment_ids",
    "cumsum_i32",
    "gather_token_indices",
    "page_table_from_token_slots",
    "token_slots_from_page_table",
    "page_table_from_csr",
    "kv_last_page_len",
]

FILL_SLOT = 0  # token slot 0 lies in the reserved page 0
FILL_PAGE = 0  # page 0 is reserved


def _check_page_size(page_size) -> None:
    if not is_power_of_two(page_size):
        raise ValueError(f"page_size must be a power of two, got {page_size!r}")


def indptr_from_lens(lens: jax.Array) -> jax.Array:
    """int32 [B] lengths -> int32 [B + 1] offsets `[0, cumsum(lens)]` (same units as lens)."""
    lens = jnp.asarray(lens, jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])


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
    starts = jnp.zeros((size + 1,), jnp.int32).at[indptr[1:]].add(1, mode="drop")
    return cumsum_i32(starts[:size])


def gather_token_indices(
    req_to_token: jax.Array,  # int32 [num_req_slots, max_context_len]  token slots
    req_pool_indices: jax.Array,  # int32 [B]
    kv_lens: jax.Array,  # int32 [B]  tokens to take per request
    kv_start: jax.Array | None = None,  # int32 [B]  first position (token) in the row
    *,
    capacity: int,
) -> TokenCSR:
    """Build the token-granular KV CSR of a batch from the request table.

    Returns `TokenCSR(indptr=[0, cumsum(kv_lens)], indices [capacity])` where
    `indices[indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]` for
    `j < kv_lens[i]` and `FILL_SLOT` past `indptr[-1]`. If the live tokens exceed `capacity`,
    the overflow is dropped (never written out of bounds); `funcmla.checks.check_token_csr`
    reports it.
    """
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    req_to_token = jnp.asarray(req_to_token)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    req_pool_indices = jnp.asarray(req_pool_indices, jnp.int32)
    batch = kv_lens.shape[0]
    kv_start = jnp.zeros((batch,), jnp.int32) if kv_start is None else jnp.asarray(kv_start)
    indptr = indptr_from_lens(kv_lens)
    t = jnp.arange(capacity, dtype=jnp.int32)
    seg = segment_ids(indptr, capacity)
    live = seg < batch
    seg_c = jnp.minimum(seg, batch - 1)
    # dead positions gather row 0, column 0 (never an out-of-bounds read, so checkify's index
    # checks stay meaningful: they fire only for live positions past the request table)
    pos = jnp.where(live, kv_start[seg_c] + t - indptr[seg_c], 0)
    rows = jnp.where(live, req_pool_indices[seg_c], 0)
    slots = req_to_token.at[rows, pos].get(mode="fill", fill_value=FILL_SLOT)
    return TokenCSR(indptr=indptr, indices=jnp.where(live, slots, FILL_SLOT).astype(jnp.int32))


def page_table_from_token_slots(
    req_to_token: jax.Array,  # int32 [num_req_slots, max_context_len]  token slots
    req_pool_indices: jax.Array,  # int32 [B]
    kv_lens: jax.Array,  # int32 [B]  tokens
    kv_start: jax.Array | None = None,  # int32 [B]  first position; must be page-aligned
    *,
    page_size: int,
    max_pages: int,
) -> PageTable:
    """Page table of a batch: `table[i, p] = req_to_token[r_i, kv_start_i + p * ps] // ps`.

    Columns `p >= ceil(kv_lens[i] / ps)` hold `FILL_PAGE`. Relies on the allocator's
    contiguity invariant (`slot(t) = page(t // ps) * ps + t % ps`), checked by
    `funcmla.checks.check_page_contiguity`.
    """
    _check_page_size(page_size)
    req_to_token = jnp.asarray(req_to_token)
    req_pool_indices = jnp.asarray(req_pool_indices, jnp.int32)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    batch = kv_lens.shape[0]
    kv_start = jnp.zeros((batch,), jnp.int32) if kv_start is None else jnp.asarray(kv_start)
    p = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    n_pages = (kv_lens + page_size - 1) // page_size
    live = p < n_pages[:, None]
    pos = jnp.where(live, kv_start[:, None] + p * page_size, 0)
    slots = req_to_token.at[req_pool_indices[:, None], pos].get(mode="fill", fill_value=0)
    table = jnp.where(p < n_pages[:, None], slots // page_size, FILL_PAGE).astype(jnp.int32)
    return PageTable(table=table, lengths=kv_lens, page_size=page_size)


def token_slots_from_page_table(page_table: PageTable, *, capacity: int) -> TokenCSR:
    """Expand a PageTable to a TokenCSR: `indices[indptr[i] + t] = table[i, t//ps]*ps + t%ps`."""
    expect_layout(page_table, PageTable, "page_table")
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    ps = page_table.page_size
    lens = page_table.lengths.astype(jnp.int32)
    batch = lens.shape[0]
    indptr = indptr_from_lens(lens)
    t = jnp.arange(capacity, dtype=jnp.int32)
    seg = segment_ids(indptr, capacity)
    live = seg < batch
    seg_c = jnp.minimum(seg, batch - 1)
    off = jnp.where(live, t - indptr[seg_c], 0)
    page = page_table.table.at[seg_c, off // ps].get(mode="fill", fill_value=FILL_PAGE)
    slots = page * ps + off % ps
    return TokenCSR(indptr=indptr, indices=jnp.where(live, slots, FILL_SLOT).astype(jnp.int32))


def page_table_from_csr(kv: TokenCSR, *, page_size: int, max_pages: int) -> PageTable:
    """Compress a TokenCSR to a PageTable: the page of the token at each page start.

    Exact only when every sequence's slots obey the contiguity invariant (check it with
    `funcmla.checks.check_page_contiguity`).
    """
    expect_layout(kv, TokenCSR, "kv")
    _check_page_size(page_size)
    lens = kv.lengths
    p = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    n_pages = (lens + page_size - 1) // page_size
    pos = jnp.where(p < n_pages[:, None], kv.indptr[:-1, None] + p * page_size, 0)
    slots = kv.indices.at[pos].get(mode="fill", fill_value=FILL_SLOT)
    table = jnp.where(p < n_pages[:, None], slots // page_size, FILL_PAGE).astype(jnp.int32)
    return PageTable(table=table, lengths=lens, page_size=page_size)


def kv_last_page_len(kv_lens: jax.Array, *, page_size: int) -> jax.Array:
    """int32 [B]: tokens in each sequence's last page, `(len - 1) % ps + 1`; 0 if len == 0."""
    _check_page_size(page_size)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    return jnp.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 0).astype(jnp.int32)
