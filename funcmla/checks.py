"""Validators: trace-time (shapes, dtypes, static sizes) and value checks usable under `jit`.

Static checks raise at trace time (`ValueError` / `TypeError`). Value checks are checkify user
checks. The entry points (`funcmla.metadata` builders, `funcmla.indices.gather_token_indices`,
`mla_attention_reference`, `run_work_plan`) run them by default whenever their inputs are
concrete (an eager call): a failed check raises `checkify.JaxRuntimeError` (a `ValueError`) at
once. Under `jit`, wrap the function once with `checked(fn)` (or call `run_checked(fn, ...)`):
every entry point traced inside then emits its checks, and `err.throw()` raises the first that
failed. Wrap outside the jit (`jax.jit(checked(fn))`), so the checked and the plain traces do not
share a cache entry:

    step = jax.jit(checks.checked(lambda r2t, rpi, seq: decode_metadata(r2t, rpi, seq,
                                                                        capacity=4096)))
    err, meta = step(req_to_token, req_pool_indices, seq_lens)
    err.throw()  # e.g. "seq_lens[3] = 9000 exceeds max_context_len = 8192 (req_to_token.shape[1])"

Every message names the field, the position and the offending value, e.g.
`kv_indptr must be non-decreasing: kv_indptr[3] = 7 < kv_indptr[2] = 9`, and the limit it broke.

Units: `capacity`, lengths and indptr values are tokens; `num_slots` counts token slots of the
pool; slots `[0, page_size)` are the reserved page 0. Every count is int32 (limit
`INT32_MAX = 2**31 - 1`); host inputs are range-checked before conversion (`funcmla.guards`).
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from funcmla.guards import INT32_MAX, TRACED, Checker, checking, should_check
from funcmla.layout import PageTable, PoolSpec, TokenCSR, check_page_size, expect_layout
from funcmla.segments import segment_positions

__all__ = [
    "CHECK_ERRORS",
    "INT32_MAX",
    "checked",
    "run_checked",
    "should_check",
    "check_page_size",
    "check_token_csr_static",
    "check_metadata_static",
    "check_attention_inputs_static",
    "check_indptr",
    "check_lengths",
    "check_request_indices",
    "check_request_table",
    "check_queries_fit",
    "check_token_csr",
    "check_page_table",
    "check_page_contiguity",
    "check_metadata",
    "check_attention_values",
]

CHECK_ERRORS = checkify.user_checks | checkify.index_checks


def checked(fn):
    """`checkify.checkify(fn)` with user and index checks, and every funcmla entry point traced
    inside `fn` emitting its value checks: returns `(err, out)`; `err.throw()` raises."""

    @functools.wraps(fn)
    def with_checks(*args, **kwargs):
        with checking():
            return fn(*args, **kwargs)

    return checkify.checkify(with_checks, errors=CHECK_ERRORS)


def run_checked(fn, *args, **kwargs):
    """Run `fn` under checkify and raise `JaxRuntimeError` with the first failed check."""
    err, out = checked(fn)(*args, **kwargs)
    err.throw()
    return out


# ---------------------------------------------------------------------------------------------
# Trace-time checks.


def _check_int32_vector(x, name: str) -> None:
    if not hasattr(x, "dtype") or x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")


def check_token_csr_static(kv: TokenCSR, name: str = "kv") -> None:
    """Type, dtype and rank of a TokenCSR."""
    expect_layout(kv, TokenCSR, name)
    _check_int32_vector(kv.indptr, f"{name}.indptr")
    _check_int32_vector(kv.indices, f"{name}.indices")
    if kv.indptr.shape[0] < 1:
        raise ValueError(f"{name}.indptr must have at least one entry, got shape {kv.indptr.shape}")


def check_metadata_static(meta) -> None:
    """Shapes and dtypes of a `funcmla.metadata.ForwardMetadata`."""
    for name in ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len"):
        _check_int32_vector(getattr(meta, name), name)
    batch = meta.kv_indptr.shape[0] - 1
    chex.assert_shape(meta.qo_indptr, (batch + 1,), custom_message="qo_indptr vs kv_indptr")
    chex.assert_shape(meta.kv_last_page_len, (batch,), custom_message="kv_last_page_len")
    chex.assert_shape([meta.max_q_len, meta.max_kv_len], ())


def check_attention_inputs_static(q, kv_pool, meta, *, head_dim: int = 576, v_head_dim: int = 512):
    """q [T, H, head_dim] and kv_pool [slots, head_dim], floating dtypes, metadata shapes."""
    check_metadata_static(meta)
    chex.assert_rank(q, 3)
    chex.assert_rank(kv_pool, 2)
    if q.shape[-1] != head_dim or kv_pool.shape[-1] != head_dim:
        raise ValueError(
            f"q and kv_pool rows must be {head_dim} wide, got q {q.shape}, kv_pool {kv_pool.shape}"
        )
    if not 0 < v_head_dim <= head_dim:
        raise ValueError(f"v_head_dim={v_head_dim} must be in (0, {head_dim}]")
    for name, x in (("q", q), ("kv_pool", kv_pool)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating dtype, got {x.dtype}")


# ---------------------------------------------------------------------------------------------
# Value checks (under jit via checkify).


def _first(bad: jax.Array) -> jax.Array:
    return jnp.argmax(bad).astype(jnp.int32)


def check_indptr(indptr: jax.Array, name: str, *, capacity: int | None = None,
                 checker: Checker = TRACED) -> None:
    """indptr[0] == 0, non-decreasing, and indptr[-1] <= capacity (when given).

    A decrease is also what an int32 cumulative sum that passed `INT32_MAX` looks like (it wraps
    negative), so the message names both causes. `checker` (`funcmla.guards.Checker`): a
    checkify check (default) or an eager NumPy one (the planners' eager calls)."""
    xp, check = checker.xp, checker.check
    check(indptr[0] == 0, f"{name}[0] must be 0, got {{v}}", v=indptr[0])
    if indptr.shape[0] > 1:
        bad = indptr[1:] < indptr[:-1]
        i = xp.argmax(bad).astype(xp.int32)
        check(
            ~xp.any(bad),
            f"{name} must be non-decreasing: {name}[{{i}}] = {{a}} < {name}[{{j}}] = {{b}} "
            f"(a negative length, or a cumulative sum past the int32 limit {INT32_MAX})",
            i=i + 1, a=indptr[i + 1], j=i, b=indptr[i],
        )
    if capacity is not None:
        check(
            indptr[-1] <= capacity,
            f"{name}[-1] = {{v}} live entries exceed the buffer capacity {capacity} "
            "(the buffer is too small for this batch)",
            v=indptr[-1],
        )


def check_lengths(lens: jax.Array, name: str, *, max_context_len: int,
                  limit: str | None = None) -> None:
    """0 <= lens[i] <= max_context_len (tokens); `limit` names the bound in the message."""
    limit = f"max_context_len={max_context_len}" if limit is None else limit
    bad = (lens < 0) | (lens > max_context_len)
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} is outside [0, {limit}]",
        i=i, v=lens[i],
    )


def check_request_indices(req_pool_indices: jax.Array, *, pool_size: int,
                          name: str = "req_pool_indices") -> None:
    """0 <= req_pool_indices[i] < pool_size (rows of req_to_token)."""
    bad = (req_pool_indices < 0) | (req_pool_indices >= pool_size)
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} is outside the request pool [0, {pool_size})",
        i=i, v=req_pool_indices[i],
    )


def check_request_table(req_to_token: jax.Array, req_pool_indices: jax.Array, lens: jax.Array,
                        kv_start: jax.Array | None = None, *, capacity: int,
                        lens_name: str = "kv_lens") -> None:
    """What gathering `lens[i]` slots from row `req_pool_indices[i]` of `req_to_token`,
    starting at column `kv_start[i]`, needs: rows inside the table, lengths >= 0, starts >= 0,
    `kv_start + lens <= req_to_token.shape[1]` (max_context_len) and `sum(lens) <= capacity`.
    Lengths are checked before the total, so the message names the cause, not the overflow."""
    rows, cols = req_to_token.shape
    check_request_indices(req_pool_indices, pool_size=rows)
    neg = lens < 0
    i = _first(neg)
    checkify.check(~jnp.any(neg), f"{lens_name}[{{i}}] = {{v}} must be >= 0", i=i, v=lens[i])
    start = jnp.zeros_like(lens) if kv_start is None else kv_start
    if kv_start is not None:
        neg = start < 0
        i = _first(neg)
        checkify.check(~jnp.any(neg), "kv_start[{i}] = {v} must be >= 0", i=i, v=start[i])
    # start + len compared without forming the sum (it could wrap): len > cols - start
    long = lens > cols - start
    i = _first(long)
    what = lens_name if kv_start is None else f"kv_start + {lens_name}"
    checkify.check(
        ~jnp.any(long),
        f"{what}[{{i}}] = {{v}} exceeds max_context_len = {cols} (req_to_token.shape[1])",
        i=i, v=start[i] + lens[i],
    )
    # the running total in int32: with lengths >= 0, a sum past INT32_MAX shows as a decrease
    total = jnp.cumsum(jnp.maximum(lens, 0), dtype=jnp.int32)
    if total.shape[0] > 1:
        wrap = total[1:] < total[:-1]
        i = _first(wrap) + 1
        checkify.check(
            ~jnp.any(wrap),
            f"sum({lens_name}) exceeds the int32 limit {INT32_MAX} (passed at "
            f"{lens_name}[{{i}}]); split the batch",
            i=i,
        )
    over = total > capacity
    i = _first(over)
    checkify.check(
        ~jnp.any(over),
        f"sum({lens_name}) = {{v}} live tokens exceed the buffer capacity {capacity} (the "
        f"kv_indices buffer is too small for this batch; first past it at {lens_name}[{{i}}])",
        i=i, v=total[-1] if total.shape[0] else jnp.int32(0),
    )


def check_queries_fit(qo_lens: jax.Array, kv_lens: jax.Array, *, q_name: str = "qo_lens",
                      k_name: str = "kv_lens") -> None:
    """0 <= qo_lens[j] <= kv_lens[j]: bottom-right causal attention needs a key per query."""
    bad = (qo_lens < 0) | (qo_lens > kv_lens)
    j = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"request {{j}} has {{q}} queries but only {{k}} keys ({q_name} must be in "
        f"[0, {k_name}]): {q_name}[{{j}}] = {{q}}, {k_name}[{{j}}] = {{k}}",
        j=j, q=qo_lens[j], k=kv_lens[j],
    )


def _check_live_slots(indices, live, *, num_slots: int, page_size: int, name: str) -> None:
    bad = live & ((indices < page_size) | (indices >= num_slots))
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} is outside the usable pool slots [{page_size}, {num_slots}) "
        "(slots below page_size are the reserved page 0)",
        i=i, v=indices[i],
    )


def check_token_csr(kv: TokenCSR, *, pool: PoolSpec, name: str = "kv_indices") -> None:
    """indptr well formed and within capacity; every live slot inside the pool, not page 0."""
    check_token_csr_static(kv, name)
    indptr_name = name.replace("indices", "indptr") if "indices" in name else f"{name}.indptr"
    check_indptr(kv.indptr, indptr_name, capacity=kv.capacity)
    live = jnp.arange(kv.capacity) < kv.indptr[-1]
    _check_live_slots(kv.indices, live, num_slots=pool.num_slots, page_size=pool.page_size,
                      name=name)


def check_page_table(pt: PageTable, *, pool: PoolSpec, max_context_len: int) -> None:
    """Lengths within max_context_len and the table; live page ids inside [1, num_pages]."""
    expect_layout(pt, PageTable, "page_table")
    if pt.page_size != pool.page_size:
        raise ValueError(
            f"page_table.page_size={pt.page_size} differs from the pool's {pool.page_size}"
        )
    check_lengths(pt.lengths, "page_table.lengths",
                  max_context_len=min(max_context_len, pt.max_pages * pt.page_size))
    cols = jnp.arange(pt.max_pages)[None, :]
    live = cols < pt.num_pages[:, None]
    bad = live & ((pt.table < 1) | (pt.table > pool.num_pages))
    flat = _first(bad.reshape(-1))
    r, c = flat // pt.max_pages, flat % pt.max_pages
    checkify.check(
        ~jnp.any(bad),
        f"page_table[{{r}}, {{c}}] = {{v}} is outside the usable pages [1, {pool.num_pages}] "
        "(page 0 is reserved)",
        r=r, c=c, v=pt.table[r, c],
    )


def check_page_contiguity(kv: TokenCSR, *, page_size: int, name: str = "kv_indices") -> None:
    """Within a page, consecutive tokens occupy consecutive slots: slot(t) % page_size ==
    t % page_size and slot(t) == slot(t - 1) + 1 when t % page_size != 0 (the invariant page
    tables rely on)."""
    check_page_size(page_size)
    _, off, live = segment_positions(kv.indptr, kv.capacity)
    prev = jnp.concatenate([kv.indices[:1], kv.indices[:-1]])
    bad = live & (
        (kv.indices % page_size != off % page_size)
        | ((off % page_size != 0) & (kv.indices != prev + 1))
    )
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} breaks page contiguity at page_size {page_size} "
        "(token {o} of its sequence)",
        i=i, v=kv.indices[i], o=off[i],
    )


def check_metadata(meta, *, pool: PoolSpec, max_context_len: int) -> None:
    """All value checks of a ForwardMetadata: both indptrs, capacity, live slots, lengths,
    kv_last_page_len == 1, and queries <= keys per request (bottom-right causal needs it)."""
    check_metadata_static(meta)
    check_indptr(meta.qo_indptr, "qo_indptr")
    # the cause before the symptom: a length over the maximum reads fill slots past the row
    check_lengths(meta.kv_lens, "kv_lens", max_context_len=max_context_len)
    check_token_csr(meta.kv, pool=pool, name="kv_indices")
    ones = meta.kv_last_page_len == 1
    i = _first(~ones)
    checkify.check(jnp.all(ones), "kv_last_page_len[{i}] = {v} must be 1 (token-granular)",
                   i=i, v=meta.kv_last_page_len[i])
    check_queries_fit(meta.qo_lens, meta.kv_lens)


def check_attention_values(qo_indptr: jax.Array, kv_indptr: jax.Array, kv_indices: jax.Array, *,
                           num_q: int, num_slots: int, max_kv_len: int | None = None) -> None:
    """What the attention paths need of their metadata: both indptrs well formed, every query row
    inside q (`qo_indptr[-1] <= T`, else requests would be dropped), `kv_indptr[-1] <=
    capacity`, each request's KV length <= `max_kv_len` (when given, else keys would be
    ignored) and every live slot a row of the pool."""
    check_indptr(qo_indptr, "qo_indptr")
    check_indptr(kv_indptr, "kv_indptr", capacity=kv_indices.shape[0])
    checkify.check(
        qo_indptr[-1] <= num_q,
        f"qo_indptr[-1] = {{v}} query rows but q has {num_q} rows (requests past row {num_q} "
        "would be dropped)",
        v=qo_indptr[-1],
    )
    if max_kv_len is not None:
        lens = kv_indptr[1:] - kv_indptr[:-1]
        long = lens > max_kv_len
        i = _first(long)
        checkify.check(
            ~jnp.any(long),
            f"kv_lens[{{i}}] = {{v}} exceeds max_kv_len = {max_kv_len} (its keys past "
            f"{max_kv_len} would be ignored)",
            i=i, v=lens[i],
        )
    live = jnp.arange(kv_indices.shape[0]) < kv_indptr[-1]
    bad = live & ((kv_indices < 0) | (kv_indices >= num_slots))
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"kv_indices[{{i}}] = {{v}} is outside the pool's {num_slots} rows [0, {num_slots})",
        i=i, v=kv_indices[i],
    )
