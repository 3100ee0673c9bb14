"""Functional paged KV allocator (SGLang `PagedTokenToKVPoolAllocator` + `ReqToTokenPool`).

The allocator hands out whole **pages** but reports **token slots**,
`slot = page * page_size + offset`, and records them in `req_to_token[req, t]` (token `t` of
request row `req`). Page 0 (slots `[0, page_size)`) is reserved for padded tokens and is never
handed out. For every live request the contiguity invariant holds:
`req_to_token[r, t] = page(r, t // page_size) * page_size + t % page_size`.

Everything is a pure function over an explicit `AllocatorState` pytree with static shapes:

>>> import jax.numpy as jnp
>>> state = init_allocator(AllocatorSpec(num_pages=4, page_size=4, num_req_slots=2,
...                                      max_context_len=16))
>>> res = alloc_extend(state, jnp.array([1]), jnp.array([0]), jnp.array([6]), capacity=8)
>>> bool(res.ok), int(res.num_tokens), res.out_cache_loc.tolist()  # pages 1 and 2
(True, 6, [4, 5, 6, 7, 8, 9, 0, 0])
>>> state = res.state
>>> res = alloc_decode(state, jnp.array([1]), jnp.array([7]))  # continues page 2
>>> res.out_cache_loc.tolist(), res.state.req_to_token[1, :8].tolist()
([10], [4, 5, 6, 7, 8, 9, 10, 0])
>>> res = alloc_extend(state, jnp.array([0]), jnp.array([0]), jnp.array([9]), capacity=16)
>>> status_names(res.status), bool(res.oom)  # 3 pages needed, 2 free: state unchanged
(['OUT_OF_PAGES'], True)

Semantics, as in SGLang (`sglang/srt/mem_cache/allocator/paged.py`):

* `alloc_extend`: per request, first the rest of the current partial page from
  `last_loc + 1` (`last_loc = req_to_token[r, prefix_len - 1]`), then whole new pages, then a
  partial last page. New pages are taken in batch order from the top of the free-page stack.
* `alloc_decode`: one token per request, `last_loc + 1`, or the first slot of a fresh page when
  the new token starts a page.
* freeing releases whole pages, `unique(slot // page_size)`. Pages carry a reference count so a
  prefix shared by several rows (`share_prefix`) is released once, when its last holder lets go.
  Freed pages are pushed on the stack in ascending order, smallest on top, which is SGLang's order
  without `need_sort` (`free_pages = cat(unique(freed), free_pages)`); with `need_sort` SGLang
  parks freed pages and sorts them in when it runs low, a different but equally valid choice.

Failures are values, never silent reuse: every operation returns a `status` bit set (0 = ok; see
`OUT_OF_PAGES` ...) and, when it is not 0, the state it returns is the input state, unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import functools

import jax
import jax.numpy as jnp

from funcmla.guards import int_array, is_concrete
from funcmla.layout import PoolSpec, check_page_size

__all__ = [
    "AllocatorSpec",
    "AllocatorState",
    "AllocResult",
    "UpdateResult",
    "AllocatorError",
    "OK",
    "OUT_OF_PAGES",
    "BAD_REQUEST_INDEX",
    "BAD_LENGTH",
    "OVER_CAPACITY",
    "SHARED_PAGE_WRITE",
    "status_names",
    "raise_for_status",
    "init_allocator",
    "alloc_extend",
    "alloc_decode",
    "truncate_requests",
    "free_requests",
    "share_prefix",
    "num_free_pages",
    "pages_in_use",
]

# Status bits (int32). Several can be set at once; any non-zero status leaves the state unchanged.
OK = 0
OUT_OF_PAGES = 1  # the batch needs more new pages than are free
BAD_REQUEST_INDEX = 2  # a row index outside [0, num_req_slots), repeated, or src == dst
BAD_LENGTH = 4  # lengths disagree with the allocator's req_lens, exceed max_context_len, ...
OVER_CAPACITY = 8  # the new tokens do not fit the static out_cache_loc capacity
SHARED_PAGE_WRITE = 16  # would write into a partial page that another row also holds

_STATUS_NAMES = {
    OUT_OF_PAGES: "OUT_OF_PAGES",
    BAD_REQUEST_INDEX: "BAD_REQUEST_INDEX",
    BAD_LENGTH: "BAD_LENGTH",
    OVER_CAPACITY: "OVER_CAPACITY",
    SHARED_PAGE_WRITE: "SHARED_PAGE_WRITE",
}

_INT32_MAX = 2**31 - 1


def status_names(status) -> list[str]:
    """Names of the bits set in a (host) status value; [] for OK."""
    code = int(status)
    return [name for bit, name in _STATUS_NAMES.items() if code & bit]


class AllocatorError(ValueError):
    """Raised by `raise_for_status` for a non-OK allocator status."""

    def __init__(self, op: str, status: int):
        self.status = int(status)
        super().__init__(f"{op} failed: status={self.status} ({', '.join(status_names(status))})")


def raise_for_status(result: "AllocResult | UpdateResult", op: str = "allocator op") -> None:
    """Host-side convenience: raise `AllocatorError` naming the failed bits if not ok."""
    code = int(jax.device_get(result.status))
    if code != OK:
        raise AllocatorError(op, code)


@dataclasses.dataclass(frozen=True)
class AllocatorSpec:
    """Static sizes of an allocator (hashable; a valid jit static argument).

    num_pages:       usable pages (ids 1..num_pages; page 0 is reserved on top of these).
    page_size:       tokens per page, a power of two.
    num_req_slots:   rows of req_to_token (SGLang's req_to_token_pool size).
    max_context_len: columns of req_to_token, in tokens.
    """

    num_pages: int
    page_size: int
    num_req_slots: int
    max_context_len: int

    def __post_init__(self):
        for name in ("num_pages", "page_size", "num_req_slots", "max_context_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"AllocatorSpec.{name} must be a positive int, got {value!r}")
        check_page_size(self.page_size, "AllocatorSpec.page_size")
        if self.pool.num_slots > _INT32_MAX:
            raise ValueError(
                f"AllocatorSpec: (num_pages + 1) * page_size = {self.pool.num_slots} token slots "
                "overflows int32 slot ids"
            )

    @classmethod
    def for_pool(cls, pool: PoolSpec, *, num_req_slots: int, max_context_len: int):
        """The allocator handing out the pages of `pool`."""
        if not isinstance(pool, PoolSpec):
            raise TypeError(f"AllocatorSpec.for_pool: pool must be a PoolSpec, got {pool!r}")
        return cls(pool.num_pages, pool.page_size, num_req_slots, max_context_len)

    @property
    def pool(self) -> PoolSpec:
        """The KV pool this allocator hands slots of: `(num_pages + 1) * page_size` rows."""
        return PoolSpec(num_pages=self.num_pages, page_size=self.page_size)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllocatorState:
    """Allocator state: free pages, page reference counts and the request -> token-slot table.

    free_pages:    int32 [num_pages]            stack of free **page ids**; entries [0, num_free)
                                                are free, free_pages[num_free - 1] is handed out
                                                next; entries past num_free are 0.
    num_free:      int32 []                     number of free pages.
    page_refcount: int32 [num_pages + 1]        rows holding each **page id**; [0] (the reserved
                                                page) is always 0. A page is free iff its count
                                                is 0 (and page 0 is never free).
    req_to_token:  int32 [num_req_slots, max_context_len]  **token slots**; entries at or past
                                                req_lens[r] are 0.
    req_lens:      int32 [num_req_slots]        **tokens** with a slot in each row.
    page_size:     static int, tokens per page.
    """

    free_pages: jax.Array
    num_free: jax.Array
    page_refcount: jax.Array
    req_to_token: jax.Array
    req_lens: jax.Array
    page_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def spec(self) -> AllocatorSpec:
        rows, cols = self.req_to_token.shape
        return AllocatorSpec(self.free_pages.shape[0], self.page_size, rows, cols)

    @property
    def num_pages(self) -> int:
        return self.free_pages.shape[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AllocResult:
    """Result of `alloc_extend` / `alloc_decode`.

    state:         the new state if ok, else the input state unchanged.
    out_cache_loc: int32 [capacity]  new **token slots** (extend: packed in batch order, request
                   by request; decode: one per batch row). Padding and every entry when not ok
                   are 0, the reserved slot, so writing KV there is harmless.
    num_tokens:    int32 []  live entries of out_cache_loc (extend: sum of extend lengths).
    status:        int32 []  0 = ok, else a bit set of OUT_OF_PAGES, BAD_... (see module).
    """

    state: AllocatorState
    out_cache_loc: jax.Array
    num_tokens: jax.Array
    status: jax.Array

    @property
    def ok(self) -> jax.Array:
        return self.status == OK

    @property
    def oom(self) -> jax.Array:
        return (self.status & OUT_OF_PAGES) != 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """Result of `truncate_requests` / `free_requests` / `share_prefix`.

    state:  the new state if ok, else the input state unchanged.
    status: int32 []  0 = ok, else a bit set (see module).
    """

    state: AllocatorState
    status: jax.Array

    @property
    def ok(self) -> jax.Array:
        return self.status == OK


def init_allocator(spec: AllocatorSpec) -> AllocatorState:
    """A fresh allocator: every page free (page 1 handed out first), every row empty."""
    if not isinstance(spec, AllocatorSpec):
        raise TypeError(f"init_allocator: spec must be an AllocatorSpec, got {type(spec).__name__}")
    n = spec.num_pages
    return AllocatorState(
        free_pages=jnp.arange(n, 0, -1, dtype=jnp.int32),  # top of the stack (last) is page 1
        num_free=jnp.asarray(n, jnp.int32),
        page_refcount=jnp.zeros((n + 1,), jnp.int32),
        req_to_token=jnp.zeros((spec.num_req_slots, spec.max_context_len), jnp.int32),
        req_lens=jnp.zeros((spec.num_req_slots,), jnp.int32),
        page_size=spec.page_size,
    )


def num_free_pages(state: AllocatorState) -> jax.Array:
    """int32 []: free pages."""
    return state.num_free


def pages_in_use(state: AllocatorState) -> jax.Array:
    """int32 []: pages held by at least one row (num_pages - num_free)."""
    return state.num_pages - state.num_free


# --------------------------------------------------------------------------------------------
# helpers


def _cdiv(x: jax.Array, d: int) -> jax.Array:
    return (x + d - 1) // d


def _batch_args(name: str, fields: str, *arrays, valid=None):
    """Cast per-request arrays (named by the comma-separated `fields`) to int32 [B], checking
    integer dtypes, equal rank-1 shapes and host values inside int32, and the valid mask."""
    arrays = [int_array(a, f"{name}: {f.strip()}") for f, a in zip(fields.split(","), arrays)]
    shape = arrays[0].shape
    if len(shape) != 1 or shape[0] == 0:
        raise ValueError(
            f"{name}: per-request arrays must be rank 1 [B] with B >= 1 (pad with "
            f"valid=False), got shape {shape}"
        )
    for a in arrays[1:]:
        if a.shape != shape:
            raise ValueError(f"{name}: per-request arrays disagree in shape: {shape} vs {a.shape}")
    if valid is None:
        valid = jnp.ones(shape, jnp.bool_)
    else:
        valid = jnp.asarray(valid)
        if valid.shape != shape or valid.dtype != jnp.bool_:
            raise ValueError(
                f"{name}: valid must be bool {shape}, got {valid.dtype} {valid.shape}"
            )
    return (*arrays, valid)


def _row_checks(state: AllocatorState, rows: jax.Array, active: jax.Array):
    """(in-range mask, clipped rows, BAD_REQUEST_INDEX if an active row is out of range or
    repeated among the active rows)."""
    num_rows = state.req_to_token.shape[0]
    in_range = (rows >= 0) & (rows < num_rows)
    safe = jnp.where(in_range, rows, 0)
    counts = jnp.zeros((num_rows,), jnp.int32).at[jnp.where(active & in_range, rows, num_rows)].add(
        1, mode="drop"
    )
    bad = jnp.any(active & ~in_range) | jnp.any(counts > 1)
    return in_range, safe, jnp.where(bad, BAD_REQUEST_INDEX, OK)


def _select(status: jax.Array, new, old):
    """`new` when status is OK, else `old` (elementwise over matching pytrees)."""
    ok = status == OK
    return jax.tree_util.tree_map(lambda a, b: jnp.where(ok, a, b), new, old)


def _take_pages(state: AllocatorState, total_new: jax.Array):
    """Pop `total_new` pages off the stack: zero their stack entries and set refcount 1."""
    num_pages = state.num_pages
    k = jnp.arange(num_pages)
    taken = (k >= state.num_free - total_new) & (k < state.num_free)
    page_refcount = state.page_refcount.at[jnp.where(taken, state.free_pages, num_pages + 1)].set(
        1, mode="drop"
    )
    free_pages = jnp.where(taken, 0, state.free_pages)
    return free_pages, state.num_free - total_new, page_refcount


def _allocate(state, rows, prefix_lens, seq_lens, valid, tok_row, tok_pos, tok_valid, status):
    """Shared core of alloc_extend / alloc_decode.

    Per request b (int32 [B]): rows, prefix_lens, seq_lens (tokens), valid. Per output entry n
    (int32 [N]): tok_row (which request), tok_pos (token position in that request), tok_valid.
    """
    page_size = state.page_size
    num_rows, max_len = state.req_to_token.shape
    num_pages = state.num_pages

    active = valid & (seq_lens != prefix_lens)
    in_range, safe_rows, status_rows = _row_checks(state, rows, active)
    cur_len = state.req_lens[safe_rows]
    last_idx = jnp.clip(prefix_lens - 1, 0, max_len - 1)
    last_loc = jnp.where(prefix_lens > 0, state.req_to_token[safe_rows, last_idx], -1)
    pages_before = _cdiv(prefix_lens, page_size)
    checked = active & in_range  # out-of-range rows are reported as BAD_REQUEST_INDEX only
    bad_len = (valid & (seq_lens < prefix_lens)) | (
        checked & ((prefix_lens != cur_len) | (seq_lens > max_len) | (prefix_lens < 0))
    )
    # Part 1 writes into the page of last_loc; it must belong to this row alone.
    part1 = checked & (prefix_lens % page_size != 0)
    shared = part1 & (state.page_refcount[jnp.clip(last_loc // page_size, 0, num_pages)] > 1)

    new_pages = jnp.where(active, _cdiv(seq_lens, page_size) - pages_before, 0)
    page_start = jnp.cumsum(new_pages) - new_pages  # exclusive prefix sum, in pages
    total_new = jnp.sum(new_pages)
    status = (
        status
        | status_rows
        | jnp.where(jnp.any(bad_len), BAD_LENGTH, OK)
        | jnp.where(jnp.any(shared), SHARED_PAGE_WRITE, OK)
        | jnp.where(total_new > state.num_free, OUT_OF_PAGES, OK)
    )

    # Slot of each output token: part 1 continues last_loc, parts 2 and 3 index new pages.
    b = tok_row
    pos = tok_pos
    in_old_page = pos < pages_before[b] * page_size
    k = page_start[b] + pos // page_size - pages_before[b]  # rank among the batch's new pages
    page = state.free_pages[jnp.clip(state.num_free - 1 - k, 0, num_pages - 1)]
    slot = jnp.where(in_old_page, last_loc[b] + 1 + (pos - prefix_lens[b]),
                     page * page_size + pos % page_size)
    slot = jnp.where(tok_valid & (status == OK), slot, 0)

    free_pages, num_free, page_refcount = _take_pages(state, total_new)
    req_to_token = state.req_to_token.at[
        jnp.where(tok_valid, safe_rows[b], num_rows), jnp.clip(pos, 0, max_len - 1)
    ].set(slot, mode="drop")
    req_lens = state.req_lens.at[jnp.where(active, safe_rows, num_rows)].set(seq_lens, mode="drop")
    new_state = dataclasses.replace(
        state,
        free_pages=free_pages,
        num_free=num_free,
        page_refcount=page_refcount,
        req_to_token=req_to_token,
        req_lens=req_lens,
    )
    return _select(status, new_state, state), slot, status


# --------------------------------------------------------------------------------------------
# public operations


def _host_ints(*names: str):
    """Range-check the named integer arguments on the host before `jax.jit` sees them: with
    x64 off the jit boundary would narrow an int64 value modulo 2**32 (2**32 + 1 -> 1)."""

    def wrap(jitted):
        sig = inspect.signature(jitted)

        @functools.wraps(jitted)
        def call(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            for name in names:
                value = bound.arguments.get(name)
                if value is not None and is_concrete(value):
                    int_array(value, f"{jitted.__name__}: {name}")
            return jitted(*args, **kwargs)

        return call

    return wrap


@_host_ints("req_pool_indices", "prefix_lens", "seq_lens")
@functools.partial(jax.jit, static_argnames=("capacity",))
def alloc_extend(
    state: AllocatorState,
    req_pool_indices: jax.Array,  # int32 [B] rows of req_to_token
    prefix_lens: jax.Array,  # int32 [B] tokens already allocated (== req_lens[row])
    seq_lens: jax.Array,  # int32 [B] tokens after the extend
    valid: jax.Array | None = None,  # bool [B]; padded rows False (or give them seq == prefix)
    *,
    capacity: int,  # static: length of out_cache_loc, in tokens
) -> AllocResult:
    """Allocate `seq_lens - prefix_lens` token slots per request (SGLang `alloc_extend`).

    Returns `out_cache_loc [capacity]`: the new slots, request after request in batch order
    (entries `[0, num_tokens)`), also written to `req_to_token[row, prefix_len:seq_len]`.
    Rows with `seq_len == prefix_len` or `valid == False` allocate nothing and are not checked
    beyond `seq_len >= prefix_len` for valid rows. Status bits: OUT_OF_PAGES, BAD_REQUEST_INDEX
    (row out of range or repeated), BAD_LENGTH (`prefix_len != req_lens[row]`, `seq_len <
    prefix_len`, `seq_len > max_context_len`), OVER_CAPACITY (`num_tokens > capacity`),
    SHARED_PAGE_WRITE. On any of them the state is returned unchanged.
    """
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"alloc_extend: capacity must be a positive int, got {capacity!r}")
    rows, prefix_lens, seq_lens, valid = _batch_args(
        "alloc_extend", "req_pool_indices, prefix_lens, seq_lens", req_pool_indices, prefix_lens,
        seq_lens, valid=valid
    )
    num_batch = rows.shape[0]
    extend_lens = jnp.where(valid & (seq_lens > prefix_lens), seq_lens - prefix_lens, 0)
    ends = jnp.cumsum(extend_lens)  # token offsets of each request's new slots
    num_tokens = ends[-1] if num_batch else jnp.int32(0)
    t = jnp.arange(capacity, dtype=jnp.int32)
    tok_row = jnp.clip(jnp.searchsorted(ends, t, side="right"), 0, max(num_batch - 1, 0))
    tok_valid = t < num_tokens
    tok_pos = prefix_lens[tok_row] + t - (ends - extend_lens)[tok_row]
    status = jnp.where(num_tokens > capacity, OVER_CAPACITY, OK)
    new_state, slots, status = _allocate(
        state, rows, prefix_lens, seq_lens, valid, tok_row, tok_pos, tok_valid, status
    )
    return AllocResult(new_state, slots, num_tokens.astype(jnp.int32), status.astype(jnp.int32))


@_host_ints("req_pool_indices", "seq_lens")
@jax.jit
def alloc_decode(
    state: AllocatorState,
    req_pool_indices: jax.Array,  # int32 [B] rows of req_to_token
    seq_lens: jax.Array,  # int32 [B] tokens including the new one (== req_lens[row] + 1)
    valid: jax.Array | None = None,  # bool [B]; padded rows False
) -> AllocResult:
    """Allocate one token slot per valid request (SGLang `alloc_decode`).

    `out_cache_loc [B]`: `last_loc + 1` when the new token (position `seq_len - 1`) continues a
    page, else the first slot of a fresh page; 0 for padded rows. Also written to
    `req_to_token[row, seq_len - 1]`. Status bits as in `alloc_extend` (BAD_LENGTH when
    `seq_len - 1 != req_lens[row]` or `seq_len > max_context_len`).
    """
    rows, seq_lens, valid = _batch_args("alloc_decode", "req_pool_indices, seq_lens",
                                     req_pool_indices, seq_lens, valid=valid)
    prefix_lens = seq_lens - 1
    num_batch = rows.shape[0]
    tok_row = jnp.arange(num_batch, dtype=jnp.int32)
    new_state, slots, status = _allocate(
        state, rows, prefix_lens, seq_lens, valid, tok_row, prefix_lens, valid, jnp.int32(OK)
    )
    num_tokens = jnp.sum(valid).astype(jnp.int32)
    return AllocResult(new_state, slots, num_tokens, status.astype(jnp.int32))


@_host_ints("req_pool_indices", "new_lens")
@jax.jit
def truncate_requests(
    state: AllocatorState,
    req_pool_indices: jax.Array,  # int32 [B] rows of req_to_token
    new_lens: jax.Array,  # int32 [B] tokens to keep (0 <= new_len <= req_lens[row])
    valid: jax.Array | None = None,  # bool [B]
) -> UpdateResult:
    """Drop each row's tokens past `new_len` and release the pages it no longer touches.

    A row releases its pages `[ceil(new_len / page_size), ceil(req_len / page_size))` (whole
    pages, as SGLang's `free`: `unique(slot // page_size)`); a page returns to the free stack
    when its reference count reaches 0, so pages still held by another row (a shared prefix)
    stay allocated. Freed pages are pushed in ascending id order, the smallest on top (handed
    out first). The dropped req_to_token entries are zeroed. Used for finished requests
    (`free_requests`) and rejected draft tokens. Status: BAD_REQUEST_INDEX, BAD_LENGTH (`new_len` outside `[0, req_len]`).
    """
    rows, new_lens, valid = _batch_args(
        "truncate_requests", "req_pool_indices, new_lens", req_pool_indices, new_lens, valid=valid
    )
    page_size = state.page_size
    num_rows, max_len = state.req_to_token.shape
    num_pages = state.num_pages

    in_range, safe_rows, status = _row_checks(state, rows, valid)
    cur_len = state.req_lens[safe_rows]
    bad_len = valid & in_range & ((new_lens < 0) | (new_lens > cur_len))
    status = status | jnp.where(jnp.any(bad_len), BAD_LENGTH, OK)
    active = valid & in_range & (new_lens < cur_len)

    row_tokens = state.req_to_token[safe_rows]  # [B, max_len] token slots
    p = jnp.arange(_cdiv(max_len, page_size), dtype=jnp.int32)  # page index within a row
    page_ids = row_tokens[:, p * page_size] // page_size  # [B, max_pages] page ids
    released = (
        active[:, None]
        & (p[None, :] >= _cdiv(new_lens, page_size)[:, None])
        & (p[None, :] < _cdiv(cur_len, page_size)[:, None])
    )
    page_refcount = state.page_refcount.at[jnp.where(released, page_ids, num_pages + 1)].add(
        -1, mode="drop"
    )
    freed = (state.page_refcount > 0) & (page_refcount == 0)  # [num_pages + 1] by page id
    num_freed = jnp.sum(freed).astype(jnp.int32)
    rank = jnp.cumsum(freed) - 1  # ascending rank among freed pages
    dest = jnp.where(freed, state.num_free + num_freed - 1 - rank, num_pages)
    free_pages = state.free_pages.at[dest].set(
        jnp.arange(num_pages + 1, dtype=jnp.int32), mode="drop"
    )

    cols = jnp.arange(max_len, dtype=jnp.int32)
    kept = jnp.where(cols[None, :] < new_lens[:, None], row_tokens, 0)
    req_to_token = state.req_to_token.at[jnp.where(active, safe_rows, num_rows)].set(
        kept, mode="drop"
    )
    req_lens = state.req_lens.at[jnp.where(active, safe_rows, num_rows)].set(new_lens, mode="drop")
    new_state = dataclasses.replace(
        state,
        free_pages=free_pages,
        num_free=state.num_free + num_freed,
        page_refcount=page_refcount,
        req_to_token=req_to_token,
        req_lens=req_lens,
    )
    return UpdateResult(_select(status, new_state, state), status.astype(jnp.int32))


def free_requests(
    state: AllocatorState,
    req_pool_indices: jax.Array,  # int32 [B] rows to free
    valid: jax.Array | None = None,  # bool [B]
) -> UpdateResult:
    """Free whole rows: `truncate_requests` to length 0 (pages shared with other rows survive)."""
    rows = int_array(req_pool_indices, "free_requests: req_pool_indices")
    return truncate_requests(state, rows, jnp.zeros_like(rows), valid)


@_host_ints("src_req", "dst_req", "prefix_lens")
@jax.jit
def share_prefix(
    state: AllocatorState,
    src_req: jax.Array,  # int32 [B] rows holding the prefix
    dst_req: jax.Array,  # int32 [B] empty rows (req_lens == 0) that receive it
    prefix_lens: jax.Array,  # int32 [B] tokens, a multiple of page_size, <= req_lens[src]
    valid: jax.Array | None = None,  # bool [B]
) -> UpdateResult:
    """Give `dst` the first `prefix_len` token slots of `src` (a radix-cache prefix hit).

    Copies `req_to_token[src, :prefix_len]` into the empty row `dst` and adds a reference to each
    of those pages, so they are freed only when every holder has released them. `prefix_len` must
    be page aligned (SGLang's paged radix cache matches whole pages): a partial shared page would
    be written by both rows' next tokens. Rows with `prefix_len == 0` are no-ops. Status:
    BAD_REQUEST_INDEX (out of range, `src == dst`, a dst repeated), BAD_LENGTH (unaligned,
    longer than src, dst not empty).
    """
    src, dst, prefix_lens, valid = _batch_args(
        "share_prefix", "src_req, dst_req, prefix_lens", src_req, dst_req, prefix_lens,
        valid=valid
    )
    page_size = state.page_size
    num_rows, max_len = state.req_to_token.shape
    num_pages = state.num_pages

    active = valid & (prefix_lens != 0)
    dst_in, safe_dst, status = _row_checks(state, dst, active)
    src_in = (src >= 0) & (src < num_rows)
    safe_src = jnp.where(src_in, src, 0)
    bad_index = jnp.any(active & (~src_in | (src == dst)))
    bad_len = (active & src_in & dst_in) & (
        (prefix_lens < 0)
        | (prefix_lens % page_size != 0)
        | (prefix_lens > state.req_lens[safe_src])
        | (state.req_lens[safe_dst] != 0)
    )
    status = (
        status
        | jnp.where(bad_index, BAD_REQUEST_INDEX, OK)
        | jnp.where(jnp.any(bad_len), BAD_LENGTH, OK)
    )

    src_tokens = state.req_to_token[safe_src]  # [B, max_len] token slots
    cols = jnp.arange(max_len, dtype=jnp.int32)
    copied = jnp.where(cols[None, :] < prefix_lens[:, None], src_tokens, 0)
    p = jnp.arange(_cdiv(max_len, page_size), dtype=jnp.int32)
    page_ids = src_tokens[:, p * page_size] // page_size
    shared = active[:, None] & (p[None, :] < (prefix_lens // page_size)[:, None])
    page_refcount = state.page_refcount.at[jnp.where(shared, page_ids, num_pages + 1)].add(
        1, mode="drop"
    )
    req_to_token = state.req_to_token.at[jnp.where(active, safe_dst, num_rows)].set(
        copied, mode="drop"
    )
    req_lens = state.req_lens.at[jnp.where(active, safe_dst, num_rows)].set(
        prefix_lens, mode="drop"
    )
    new_state = dataclasses.replace(
        state, page_refcount=page_refcount, req_to_token=req_to_token, req_lens=req_lens
    )
    return UpdateResult(_select(status, new_state, state), status.astype(jnp.int32))
