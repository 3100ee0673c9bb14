"""Index expansion between request tables, token CSRs and page tables.

All functions are pure, jit-able and have static output shapes. Units are in every name:
`*_lens` count tokens, `indptr` of a `TokenCSR` counts tokens, a `PageTable` holds page ids.

* `gather_token_indices`: SGLang's `create_flashinfer_kv_indices_triton`:
  `kv_indices[kv_indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]`.
* `page_table_from_token_slots`: SGLang's `create_flashmla_kv_indices_triton`:
  `table[i, p] = req_to_token[r_i, kv_start_i + p * page_size] // page_size` for
  `p < ceil(len / page_size)`.
* `token_slots_from_page_table`: `slot = table[i, t // page_size] * page_size + t % page_size`,
  as a TokenCSR.
* `kv_last_page_len`: `(len - 1) % page_size + 1` (0 for an empty sequence).

Entries past the live range (`kv_indices[kv_indptr[-1]:]`, page-table columns past
`ceil(len / page_size)`) hold `FILL_SLOT` / `FILL_PAGE` = 0: the reserved padding page, so a stray
read stays inside the pool and is recognisable. Kernels must never read them.

Value checks (`funcmla.checks.check_request_table`: rows inside the table, lengths and starts
>= 0, `kv_start + len <= max_context_len`, totals within `capacity` and int32) run when the
inputs are concrete and under `funcmla.checks.checked`. Unchecked under `jit`, gathers still
never read out of bounds: an out-of-range row or column (negative ones included: no Python-style
wrap-around) yields the fill value, never a clamped or wrapped row.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from funcmla.checks import check_indptr, check_lengths, check_request_table
from funcmla.guards import check_int32_total, enforce, int_array, should_check
from funcmla.layout import PageTable, TokenCSR, check_page_size, expect_layout
from funcmla.segments import cumsum_i32, segment_ids, segment_positions, take_or_fill

__all__ = [
    "FILL_SLOT",
    "FILL_PAGE",
    "indptr_from_lens",
    "segment_ids",
    "cumsum_i32",
    "gather_token_indices",
    "request_inputs",
    "capacity_arg",
    "token_csr_from_table",
    "page_table_from_token_slots",
    "token_slots_from_page_table",
    "page_table_from_csr",
    "kv_last_page_len",
]

FILL_SLOT = 0  # token slot 0 lies in the reserved page 0
FILL_PAGE = 0  # page 0 is reserved


def indptr_from_lens(lens: jax.Array) -> jax.Array:
    """int32 [B] lengths -> int32 [B + 1] offsets `[0, cumsum(lens)]` (same units as lens).

    Concrete lengths are summed in 64 bits first: a total past int32 raises ValueError."""
    check_int32_total(lens, "lens")
    lens = jnp.asarray(lens).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lens, dtype=jnp.int32)])


def capacity_arg(capacity) -> int:
    """A static buffer length: a positive Python int (ValueError naming it otherwise)."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    return capacity


def request_inputs(req_to_token, req_pool_indices, lens, kv_start=None, *, lens_name: str,
                   capacity: int | None = None):
    """Shape, dtype and (when checking) value checks of a request-table gather; returns the
    inputs as int32 arrays `(req_to_token, req_pool_indices, lens, kv_start)`."""
    req_to_token = int_array(req_to_token, "req_to_token", ndim=2)
    req_pool_indices = int_array(req_pool_indices, "req_pool_indices", ndim=1)
    lens = int_array(lens, lens_name, ndim=1)
    batch = req_pool_indices.shape[0]
    if batch == 0:
        raise ValueError("req_pool_indices is empty: a batch needs at least one request")
    if kv_start is not None:
        kv_start = int_array(kv_start, "kv_start", ndim=1)
    for name, arr in ((lens_name, lens), ("kv_start", kv_start)):
        if arr is not None and arr.shape != (batch,):
            raise ValueError(
                f"{name} must have shape [batch]=({batch},) like req_pool_indices, got "
                f"{tuple(arr.shape)}")
    if should_check(req_to_token, req_pool_indices, lens, kv_start):
        cap = 2**31 - 1 if capacity is None else capacity
        enforce(check_request_table, req_to_token, req_pool_indices, lens, kv_start,
                capacity=cap, lens_name=lens_name)
    return req_to_token, req_pool_indices, lens, kv_start


def gather_token_indices(
    req_to_token: jax.Array,  # int32 [num_req_slots, max_context_len]  token slots
    req_pool_indices: jax.Array,  # int32 [B]
    kv_lens: jax.Array,  # int32 [B]  tokens to take per request
    kv_start: jax.Array | None = None,  # int32 [B]  first position (token) in the row
    *,
    capacity: int,
    lens_name: str = "kv_lens",
) -> TokenCSR:
    """Build the token-granular KV CSR of a batch from the request table.

    Returns `TokenCSR(indptr=[0, cumsum(kv_lens)], indices [capacity])` where
    `indices[indptr[i] + j] = req_to_token[req_pool_indices[i], kv_start[i] + j]` for
    `j < kv_lens[i]` and `FILL_SLOT` past `indptr[-1]`. Checked values (see the module
    docstring) raise `ValueError`; unchecked under `jit`, live tokens past `capacity` are dropped
    (never written out of bounds) and out-of-range reads yield `FILL_SLOT`. `lens_name` names
    `kv_lens` in error messages (the metadata builders pass `seq_lens`).
    """
    capacity_arg(capacity)
    req_to_token, req_pool_indices, kv_lens, kv_start = request_inputs(
        req_to_token, req_pool_indices, kv_lens, kv_start, lens_name=lens_name, capacity=capacity)
    return token_csr_from_table(req_to_token, req_pool_indices, kv_lens, kv_start, capacity=capacity)


@functools.partial(jax.jit, static_argnames=("capacity",))
def token_csr_from_table(req_to_token, req_pool_indices, kv_lens, kv_start=None, *,
                         capacity: int) -> TokenCSR:
    """`gather_token_indices` after its checks: int32 inputs as `request_inputs` returns them,
    no value check (out-of-range reads still give FILL_SLOT)."""
    batch = kv_lens.shape[0]
    if kv_start is None:
        kv_start = jnp.zeros((batch,), jnp.int32)
    indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(kv_lens, dtype=jnp.int32)])
    seg_c, off, live = segment_positions(indptr, capacity)
    # dead positions gather row 0, column 0 (never an out-of-bounds read, so checkify's index
    # checks stay meaningful: they fire only for live positions past the request table)
    pos = jnp.where(live, kv_start[seg_c] + off, 0)
    rows = jnp.where(live, req_pool_indices[seg_c], 0)
    slots = take_or_fill(req_to_token, rows, pos, fill=FILL_SLOT)
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
    """Page table of a batch:
    `table[i, p] = req_to_token[r_i, kv_start_i + p * page_size] // page_size`.

    Columns `p >= ceil(kv_lens[i] / page_size)` hold `FILL_PAGE`. Relies on the allocator's
    contiguity invariant (`slot(t) = page(t // page_size) * page_size + t % page_size`), checked by
    `funcmla.checks.check_page_contiguity`. Checked values as `gather_token_indices`, plus
    `ceil(kv_lens / page_size) <= max_pages`.
    """
    check_page_size(page_size)
    if not isinstance(max_pages, int) or isinstance(max_pages, bool) or max_pages <= 0:
        raise ValueError(f"max_pages must be a positive int, got {max_pages!r}")
    req_to_token, req_pool_indices, kv_lens, kv_start = request_inputs(
        req_to_token, req_pool_indices, kv_lens, kv_start, lens_name="kv_lens",
        capacity=None)
    if should_check(kv_lens):
        enforce(check_lengths, kv_lens, name="kv_lens", max_context_len=max_pages * page_size,
                      limit=f"max_pages * page_size = {max_pages * page_size}")
    batch = kv_lens.shape[0]
    if kv_start is None:
        kv_start = jnp.zeros((batch,), jnp.int32)
    p = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    n_pages = (kv_lens + page_size - 1) // page_size
    live = p < n_pages[:, None]
    pos = jnp.where(live, kv_start[:, None] + p * page_size, 0)
    slots = take_or_fill(req_to_token, req_pool_indices[:, None], pos, fill=0)
    table = jnp.where(live, slots // page_size, FILL_PAGE).astype(jnp.int32)
    return PageTable(table=table, lengths=kv_lens, page_size=page_size)


def token_slots_from_page_table(page_table: PageTable, *, capacity: int) -> TokenCSR:
    """Expand a PageTable to a TokenCSR:
    `indices[indptr[i] + t] = table[i, t // page_size] * page_size + t % page_size`.

    Checked (eager, or under `funcmla.checks.checked`): `0 <= lengths <= max_pages * page_size` and
    the total within `capacity` (both would otherwise read or drop fill entries silently)."""
    expect_layout(page_table, PageTable, "page_table")
    capacity_arg(capacity)
    page_size = page_table.page_size
    lens = int_array(page_table.lengths, "page_table.lengths", ndim=1)
    indptr = indptr_from_lens(lens)
    if should_check(lens):
        limit = page_table.max_pages * page_size
        enforce(check_lengths, lens, name="page_table.lengths", max_context_len=limit,
                limit=f"max_pages * page_size = {limit}")
        enforce(check_indptr, indptr, name="kv_indptr", capacity=capacity)
    seg_c, off, live = segment_positions(indptr, capacity)
    off = jnp.where(live, off, 0)
    page = take_or_fill(page_table.table, seg_c, off // page_size, fill=FILL_PAGE)
    slots = page * page_size + off % page_size
    return TokenCSR(indptr=indptr, indices=jnp.where(live, slots, FILL_SLOT).astype(jnp.int32))


def page_table_from_csr(kv: TokenCSR, *, page_size: int, max_pages: int) -> PageTable:
    """Compress a TokenCSR to a PageTable: the page of the token at each page start.

    Exact only when every sequence's slots obey the contiguity invariant (check it with
    `funcmla.checks.check_page_contiguity`).
    """
    expect_layout(kv, TokenCSR, "kv")
    check_page_size(page_size)
    lens = kv.lengths
    p = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    n_pages = (lens + page_size - 1) // page_size
    pos = jnp.where(p < n_pages[:, None], kv.indptr[:-1, None] + p * page_size, 0)
    slots = take_or_fill(kv.indices, pos, fill=FILL_SLOT)
    table = jnp.where(p < n_pages[:, None], slots // page_size, FILL_PAGE).astype(jnp.int32)
    return PageTable(table=table, lengths=lens, page_size=page_size)


def kv_last_page_len(kv_lens: jax.Array, *, page_size: int) -> jax.Array:
    """int32 [B]: tokens in each sequence's last page, `(len - 1) % page_size + 1`; 0 if
    len == 0."""
    check_page_size(page_size)
    kv_lens = jnp.asarray(kv_lens, jnp.int32)
    return jnp.where(kv_lens > 0, (kv_lens - 1) % page_size + 1, 0).astype(jnp.int32)
