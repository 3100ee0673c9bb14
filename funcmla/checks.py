"""Validators: trace-time (shapes, dtypes, static sizes) and value checks usable under `jit`.

Static checks raise at trace time (`ValueError` / `TypeError` / chex's `AssertionError`).
Value checks use `jax.experimental.checkify` user checks: call them inside a function, wrap it
with `checked(fn)` (or `checkify.checkify(fn, errors=CHECK_ERRORS)`), and call
`err.throw()` on the returned error. Every message names the field, the position and the
offending value, e.g. `kv_indptr must be non-decreasing: kv_indptr[3] = 7 < kv_indptr[2] = 9`.

Units: `capacity`, lengths and indptr values are tokens; `num_slots` counts token slots of the
pool; slots `[0, page_size)` are the reserved page 0.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax.experimental import checkify

from funcmla.layout import PageTable, PoolSpec, TokenCSR, expect_layout, is_power_of_two

__all__ = [
    "CHECK_ERRORS",
    "checked",
    "run_checked",
    "check_page_size",
    "check_token_csr_static",
    "check_metadata_static",
    "check_attention_inputs_static",
    "check_indptr",
    "check_lengths",
    "check_request_indices",
    "check_token_csr",
    "check_page_table",
    "check_page_contiguity",
    "check_metadata",
]

CHECK_ERRORS = checkify.user_checks | checkify.index_checks


def checked(fn):
    """`checkify.checkify(fn)` with user and index checks: returns (err, out)."""
    return checkify.checkify(fn, errors=CHECK_ERRORS)


def run_checked(fn, *args, **kwargs):
    """Run `fn` under checkify and raise `JaxRuntimeError` with the first failed check."""
    err, out = checked(fn)(*args, **kwargs)
    err.throw()
    return out


# ---------------------------------------------------------------------------------------------
# Trace-time checks.


def check_page_size(page_size, name: str = "page_size") -> None:
    if not is_power_of_two(page_size):
        raise ValueError(f"{name} must be a power of two, got {page_size!r}")


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
    from funcmla.metadata import MODES  # local: metadata imports nothing from here

    for name in ("kv_indptr", "kv_indices", "qo_indptr", "kv_last_page_len"):
        _check_int32_vector(getattr(meta, name), name)
    batch = meta.kv_indptr.shape[0] - 1
    chex.assert_shape(meta.qo_indptr, (batch + 1,), custom_message="qo_indptr vs kv_indptr")
    chex.assert_shape(meta.kv_last_page_len, (batch,), custom_message="kv_last_page_len")
    chex.assert_shape([meta.max_q_len, meta.max_kv_len], ())
    if meta.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {meta.mode!r}")


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


def check_indptr(indptr: jax.Array, name: str, *, capacity: int | None = None) -> None:
    """indptr[0] == 0, non-decreasing, and indptr[-1] <= capacity (when given)."""
    checkify.check(indptr[0] == 0, f"{name}[0] must be 0, got {{v}}", v=indptr[0])
    if indptr.shape[0] > 1:
        bad = indptr[1:] < indptr[:-1]
        i = _first(bad)
        checkify.check(
            ~jnp.any(bad),
            f"{name} must be non-decreasing: {name}[{{i}}] = {{a}} < {name}[{{j}}] = {{b}}",
            i=i + 1, a=indptr[i + 1], j=i, b=indptr[i],
        )
    if capacity is not None:
        checkify.check(
            indptr[-1] <= capacity,
            f"{name}[-1] = {{v}} live entries exceed the buffer capacity {capacity} "
            "(the buffer is too small for this batch)",
            v=indptr[-1],
        )


def check_lengths(lens: jax.Array, name: str, *, max_context_len: int) -> None:
    """0 <= lens[i] <= max_context_len (tokens)."""
    bad = (lens < 0) | (lens > max_context_len)
    i = _first(bad)
    checkify.check(
        ~jnp.any(bad),
        f"{name}[{{i}}] = {{v}} is outside [0, max_context_len={max_context_len}]",
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
    """Within a page, consecutive tokens occupy consecutive slots: slot(t) % ps == t % ps and
    slot(t) == slot(t - 1) + 1 when t % ps != 0 (the invariant page tables rely on)."""
    check_page_size(page_size)
    from funcmla.indices import segment_ids

    n = kv.capacity
    t = jnp.arange(n, dtype=jnp.int32)
    seg = segment_ids(kv.indptr, n)
    live = seg < kv.num_seqs
    off = t - kv.indptr[jnp.minimum(seg, kv.num_seqs - 1)]
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
    check_token_csr(meta.kv, pool=pool, name="kv_indices")
    check_lengths(meta.kv_lens, "kv_lens", max_context_len=max_context_len)
    ones = meta.kv_last_page_len == 1
    i = _first(~ones)
    checkify.check(jnp.all(ones), "kv_last_page_len[{i}] = {v} must be 1 (token-granular)",
                   i=i, v=meta.kv_last_page_len[i])
    more_q = meta.qo_lens > meta.kv_lens
    j = _first(more_q)
    checkify.check(
        ~jnp.any(more_q),
        "request {j} has {q} queries but only {k} keys (qo_lens must be <= kv_lens)",
        j=j, q=meta.qo_lens[j], k=meta.kv_lens[j],
    )
