"""Absorbed MLA extend over the paged latent pool: decode over query chunks.

An extend (prefill with a prefix, chunked prefill, long target-verify, draft-extend, any
ragged batch) is run by the decode kernels (`api`): each request's queries are cut into
chunks of C tokens aligned to the request's end (the first chunk is left-padded), and each
chunk becomes a pseudo-sequence of the "lens" `KVRows` form, with the request's first table
entry and, as its KV length, the keys its last query sees (prefix + the chunk's end). The
decode kernels' bottom-right causal limit over s_q = C folded tokens then gives each query of
the chunk exactly its keys; padded rows see fewer keys (never past the request) and are
dropped. One decode call over P pseudo-sequences (P static: from T, B and C) runs the whole
batch, with the decode kernels' masking (unused pool rows never reach an output), their split
rule and merge where the grid is short, and their fp8 pools.

C = max(1, 64 // H) (`chunk_tokens`): C * H >= 64 folded rows fill the Mosaic GPU kernel's
64-row `wgmma` blocks (C = 1 at H >= 64, where q is the pseudo-sequences' q as it lies: no
copy; C = 4 at H = 16, where a gather pads q into chunks). Non-causal extend runs C = 1, each
token seeing its request's whole KV. Design and numbers: docs/decode_kernel.md, "Extend:
decode over query chunks"; reproduce with `python -m bench.extend`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from funcmla.attention.pallas.api import (KV_FP8_DTYPE, _mla_decode_kv, kernel_choice,
                                          pool_scales)
from funcmla.attention.pallas.decode_common import (
    MAX_POOL_ROWS,
    DecodeKernelConfig,
    KVRows,
    check_kv_form,
)
from funcmla.checks import _first, check_indptr, check_queries_fit
from funcmla.guards import enforce, should_check
from funcmla.layout import PageTable
from funcmla.segments import cumsum_i32, segment_positions, take_or_fill

__all__ = ["mla_extend", "chunk_tokens", "num_pseudo_seqs", "extend_chunks",
           "extend_kernel_config", "check_extend_values"]

# Folded query rows the Mosaic GPU kernel's blocks hold (its wgmma M).
_FILL_ROWS = 64
def chunk_tokens(num_heads: int, causal: bool = True) -> int:
    """C, the query tokens of one pseudo-sequence: max(1, 64 // H) when causal, so that C * H
    >= 64 folded rows fill a 64-row block (1 at H >= 64, 4 at H = 16); 1 when not causal
    (a chunk's tokens share one causal limit only in a causal extend)."""
    if not causal:
        return 1
    return max(1, _FILL_ROWS // num_heads)


def num_pseudo_seqs(num_tokens: int, num_requests: int, chunk: int,
                    max_q_len: int | None = None) -> int:
    """P, the static count of pseudo-sequences: an upper bound on sum_i ceil(q_len_i / C) for
    B requests of T tokens in all (each request wastes at most C - 1 padded rows), and on
    B * ceil(max_q_len / C) when max_q_len is given. T itself when C = 1."""
    if chunk == 1:  # pseudo-sequence p is token p: q is used as it lies
        return max(num_tokens, 1)
    bound = (num_tokens + num_requests * (chunk - 1)) // chunk
    if max_q_len is not None:
        bound = min(bound, num_requests * -(-max_q_len // chunk))
    return max(bound, 1)


def extend_kernel_config(config: DecodeKernelConfig, num_heads: int, chunk: int,
                         num_pseudo: int, page_size: int, *, head_dim: int = 576,
                         v_head_dim: int = 512, dtype=jnp.bfloat16, kv_dtype=None,
                         interpret: bool = False,
                         pool_rows: int | None = None) -> DecodeKernelConfig:
    """The decode config an extend runs with: `config` itself, except that kernel="auto" on
    a GPU becomes "mgpu" where the Mosaic GPU kernel takes the shape (bf16 pool, C * H a
    multiple of 64, the page size, the pool's `pool_rows` when given) and the pseudo-sequences
    give at least `config.mgpu_min_blocks` blocks of 64 rows: `api.kernel_choice` over the
    pseudo-sequences (an extend is a decode of s_q = C over them), fp8 pools alike (H200, H128
    B8 1024 tokens over 4k: 26.6 / 28.8 ms on the 64-row fp8 Mosaic GPU kernel against 69.0 /
    70.2 ms on Triton, page 64 / 1; docs/decode_kernel.md, "Extend"). An extend runs the
    "mixed" fp8 products (`DecodeKernelConfig.fp8_products` is a decode setting)."""
    if config.fp8_products != "mixed":
        config = dataclasses.replace(config, fp8_products="mixed")
    if config.kernel != "auto":
        return config
    q = jax.ShapeDtypeStruct((num_pseudo * chunk, num_heads, head_dim), dtype)
    pick, _ = kernel_choice(config, q, page_size, chunk, v_head_dim=v_head_dim,
                            interpret=interpret, kv_dtype=kv_dtype, pool_rows=pool_rows)
    return dataclasses.replace(config, kernel="mgpu") if pick == "mgpu" else config


def extend_chunks(qo_indptr: jax.Array, req_start: jax.Array, req_kv_lens: jax.Array, *,
                  num_pseudo: int, chunk: int, causal: bool):
    """The pseudo-sequences of an extend (XLA ops; inside a jit).

    qo_indptr int32 [B+1] (query tokens), req_start int32 [B] (each request's first table
    entry), req_kv_lens int32 [B] (keys). Request i has n_i = ceil(q_len_i / C) chunks; chunk
    c (0-based) holds its query tokens [q_len_i - (n_i - c) * C, q_len_i - (n_i - c - 1) * C)
    (negative positions: padding) and sees kv_len_i - (n_i - 1 - c) * C keys at its last
    token (causal), else kv_len_i.

    Returns (table_start [P], kv_lens [P], chunk_indptr [B+1]): pseudo-sequences past the
    last request have kv_len 0 (out 0, no read); a negative length (kv_len < q_len, refused
    eagerly) is clamped to 0, which is what the reference gives those queries (no keys).
    """
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    n = (jnp.maximum(q_lens, 0) + chunk - 1) // chunk
    chunk_indptr = jnp.concatenate([jnp.zeros((1,), jnp.int32), cumsum_i32(n)])
    req, c, live = segment_positions(chunk_indptr, num_pseudo)
    kv = req_kv_lens[req]
    if causal:
        kv = kv - (n[req] - 1 - c) * chunk
    kv_lens = jnp.where(live, jnp.maximum(kv, 0), 0).astype(jnp.int32)
    table_start = jnp.where(live, req_start[req], 0).astype(jnp.int32)
    return table_start, kv_lens, chunk_indptr


def _chunk_tokens_of_pseudo(qo_indptr, chunk_indptr, num_pseudo: int, chunk: int):
    """Query token of each pseudo-sequence row: int32 [P, C], -1 for padding."""
    req, c, live = segment_positions(chunk_indptr, num_pseudo)
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    n = chunk_indptr[1:] - chunk_indptr[:-1]
    j = (q_lens[req] - (n[req] - c) * chunk)[:, None] + jnp.arange(chunk, dtype=jnp.int32)
    ok = live[:, None] & (j >= 0)
    return jnp.where(ok, qo_indptr[req][:, None] + j, -1)


def _pseudo_of_tokens(qo_indptr, chunk_indptr, num_tokens: int, chunk: int):
    """(pseudo-sequence, row within it, live) of each query token t < T."""
    req, j, live = segment_positions(qo_indptr, num_tokens)
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    n = chunk_indptr[1:] - chunk_indptr[:-1]
    back = q_lens[req] - 1 - j  # tokens after t in its request
    p = chunk_indptr[req] + n[req] - 1 - back // chunk
    return jnp.where(live, p, -1), chunk - 1 - back % chunk, live


def _take_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    """x[rows] along axis 0 for a 2-byte x [N, ...] (q or the output), a zero row wherever
    rows[i] is outside [0, N) (padding: -1). Rows move as 32-bit words (one bf16 row of
    H x 576 is H x 288 words), so XLA's gather copies 4 bytes an element, not 2
    (`python -m bench.extend --only H16`)."""
    n = x.shape[0]
    words = jax.lax.bitcast_convert_type(x.reshape(n, -1, 2), jnp.uint32)
    ok = (rows >= 0) & (rows < n)
    got = jnp.where(ok[:, None], jnp.take(words, jnp.clip(rows, 0, n - 1), axis=0), 0)
    return jax.lax.bitcast_convert_type(got, x.dtype).reshape(rows.shape + x.shape[1:])


@functools.partial(jax.jit, static_argnames=(
    "page_size", "max_kv_len", "entries_per_row", "chunk", "num_pseudo", "causal", "sm_scale",
    "num_splits", "config", "v_head_dim", "interpret", "kv_dtype"))
def _mla_extend(q, kv_pool, qo_indptr, table, kv_meta, scales, *, page_size, max_kv_len,
                entries_per_row, chunk, num_pseudo, causal, sm_scale, num_splits, config,
                v_head_dim, interpret, kv_dtype):
    """kv_meta: kv_indptr [B+1] (token CSR, entries_per_row None) or lengths [B] (page table of
    `entries_per_row` entries a request, flattened into `table`)."""
    t, h, d = q.shape
    if entries_per_row is None:
        req_start, req_kv = kv_meta[:-1], kv_meta[1:] - kv_meta[:-1]
    else:
        req_kv = kv_meta
        req_start = jnp.arange(kv_meta.shape[0], dtype=jnp.int32) * entries_per_row
    table_start, kv_lens, chunk_indptr = extend_chunks(
        qo_indptr, req_start, req_kv, num_pseudo=num_pseudo, chunk=chunk, causal=causal)
    kv = KVRows(table, table_start, kv_lens, page_size, max_kv_len)
    if chunk == 1:
        qp = q  # pseudo-sequence p is token p (tokens past qo_indptr[-1] get kv_len 0)
    else:
        qp = _take_rows(q, _chunk_tokens_of_pseudo(qo_indptr, chunk_indptr, num_pseudo,
                                                   chunk).reshape(-1))
    out, lse = _mla_decode_kv(qp, kv_pool, kv, scales, sm_scale=sm_scale, s_q=chunk,
                              num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                              interpret=interpret, kv_dtype=kv_dtype)
    if chunk == 1:
        return out, lse
    p, r, _ = _pseudo_of_tokens(qo_indptr, chunk_indptr, t, chunk)
    row = jnp.where(p >= 0, p * chunk + r, -1)  # dead tokens (p = -1): out 0, lse +inf
    return _take_rows(out, row), take_or_fill(lse, row, fill=jnp.inf)


def _check_int_vector(x, name: str, min_len: int) -> None:
    if not hasattr(x, "dtype") or x.dtype != jnp.int32:
        raise TypeError(f"{name} must be an int32 array, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 1 or x.shape[0] < min_len:
        raise ValueError(f"{name} must have shape [{'B+1' if min_len == 2 else 'n'}] "
                         f"(at least {min_len} entries), got {tuple(x.shape)}")


def check_extend_values(qo_indptr, kv_meta, table, *, num_q: int, pool_rows: int,
                        page_size: int, entries_per_row: int | None, causal: bool,
                        max_q_len: int | None, max_kv_len: int | None) -> None:
    """The value checks of `mla_extend` (checkify; `funcmla.guards.enforce` runs them):
    qo_indptr well formed and within q's rows; the KV metadata well formed (token CSR:
    kv_indptr within kv_indices; page table: lengths within its width); live slots or pages
    inside the pool; q_len <= max_q_len, kv_len <= max_kv_len where given; and, causal,
    q_len <= kv_len for every request (a query sees its own key)."""
    check_indptr(qo_indptr, "qo_indptr")
    checkify.check(qo_indptr[-1] <= num_q,
                   f"qo_indptr[-1] = {{v}} query rows but q has {num_q} rows (requests past "
                   f"row {num_q} would be dropped)", v=qo_indptr[-1])
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    if entries_per_row is None:
        check_indptr(kv_meta, "kv_indptr", capacity=table.shape[0])
        kv_lens = kv_meta[1:] - kv_meta[:-1]
        live = jnp.arange(table.shape[0]) < kv_meta[-1]
        bad = live & ((table < 0) | (table >= pool_rows))
        i = _first(bad)
        checkify.check(~jnp.any(bad), f"kv_indices[{{i}}] = {{v}} is outside the pool's "
                       f"{pool_rows} rows [0, {pool_rows})", i=i, v=table[i])
    else:
        kv_lens = kv_meta
        width = entries_per_row * page_size
        bad = (kv_lens < 0) | (kv_lens > width)
        i = _first(bad)
        checkify.check(~jnp.any(bad), f"page_table.lengths[{{i}}] = {{v}} is outside [0, "
                       f"{width}] (the table's {entries_per_row} pages of {page_size} tokens)",
                       i=i, v=kv_lens[i])
        rows = table.reshape(-1, entries_per_row)
        used = jnp.arange(entries_per_row)[None, :] < ((kv_lens + page_size - 1)
                                                       // page_size)[:, None]
        pages = pool_rows // page_size
        bad = (used & ((rows < 0) | (rows >= pages))).reshape(-1)
        f = _first(bad)
        checkify.check(~jnp.any(bad), f"page_table.table[{{r}}, {{c}}] = {{v}} is outside the "
                       f"pool's {pages} pages [0, {pages})", r=f // entries_per_row,
                       c=f % entries_per_row, v=table[f])
    if max_q_len is not None:
        i = _first(q_lens > max_q_len)
        checkify.check(~jnp.any(q_lens > max_q_len), f"q_len of request {{i}} = {{v}} "
                       f"exceeds max_q_len = {max_q_len}", i=i, v=q_lens[i])
    if max_kv_len is not None:
        i = _first(kv_lens > max_kv_len)
        checkify.check(~jnp.any(kv_lens > max_kv_len), f"kv_lens[{{i}}] = {{v}} exceeds "
                       f"max_kv_len = {max_kv_len}", i=i, v=kv_lens[i])
    if causal:
        check_queries_fit(q_lens, kv_lens, q_name="qo_indptr lengths", k_name="kv lengths")


def _static_int(value, name: str, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be {'None or ' if allow_none else ''}a positive int, "
                         f"got {value!r}")


def mla_extend(q: jax.Array, kv_pool: jax.Array, *, qo_indptr: jax.Array,
               kv_indptr: jax.Array | None = None, kv_indices: jax.Array | None = None,
               page_table: PageTable | None = None, sm_scale: float, causal: bool = True,
               v_head_dim: int = 512, max_q_len: int | None = None,
               max_kv_len: int | None = None, num_splits: int | None = None,
               config: DecodeKernelConfig = DecodeKernelConfig(), interpret: bool = False,
               k_scale=None, v_scale=None, kv_dtype=None) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA extend (ragged queries) over the paged latent pool, on the decode kernels.

    q:          [T, H, 576] bf16 (f16 on the Triton kernel); request i's queries are rows
                qo_indptr[i] .. qo_indptr[i+1] (rows past qo_indptr[-1]: padding, out 0).
    kv_pool:    [slots, 576], q's dtype or float8_e4m3fn (with k_scale / v_scale, as
                `mla_decode`; kv_dtype="float8_e4m3fn" for a uint8 pool of fp8 bytes).
    qo_indptr:  int32 [B+1], query tokens per request (any from 0 up).
    KV metadata, exactly one of:
      kv_indptr [B+1] int32 (tokens) + kv_indices [capacity] int32 (token slots): page size 1.
      page_table: `funcmla.layout.PageTable` of B rows (page ids, lengths in tokens).
    causal:     bottom-right causal (query j of q_len sees keys [0, kv_len - q_len + 1 + j):
                kv_len >= q_len), else every query sees all kv_len keys.
    max_q_len:  static bound on queries per request (tightens P where C > 1).
    max_kv_len: static bound on keys per request, for the split rule (token CSR only;
                default the capacity of kv_indices; a page table implies its width).
    num_splits, config: as `mla_decode` (split count, kernel choice and tiling); "auto" picks
                the Mosaic GPU kernel from `mgpu_min_blocks` blocks (`extend_kernel_config`).

    Returns out [T, H, v_head_dim] (q.dtype) and lse [T, H] float32 (natural log); a query
    that sees no key gets out 0 and lse +inf. Values are checked where concrete (and under
    `funcmla.checks.checked`; `check_extend_values`), raising ValueError naming the field;
    under a plain jit bad values never read out of bounds. Pool rows no request uses never
    reach the output, whatever they hold.
    """
    if q.ndim != 3:
        raise ValueError(f"q must have shape [T, H, D], got {q.shape}")
    if kv_pool.ndim != 2:
        raise ValueError(f"kv_pool must have shape [slots, D], got {kv_pool.shape}")
    _check_int_vector(qo_indptr, "qo_indptr", 2)
    batch = qo_indptr.shape[0] - 1
    check_kv_form(page_table, kv_indptr, kv_indices, max_kv_len)
    if page_table is not None:
        if not isinstance(page_table, PageTable):
            raise TypeError(f"page_table must be a funcmla.layout.PageTable, got "
                            f"{type(page_table).__name__}")
        table2, kv_meta = page_table.table, page_table.lengths
        for name, x in (("page_table.table", table2), ("page_table.lengths", kv_meta)):
            if x.dtype != jnp.int32:
                raise TypeError(f"{name} must be int32, got {x.dtype}")
        if table2.ndim != 2 or table2.shape[1] < 1 or table2.shape[0] != batch:
            raise ValueError(f"page_table.table has shape {tuple(table2.shape)}; qo_indptr "
                             f"({batch + 1} entries) needs [{batch}, max_pages >= 1]")
        if kv_meta.shape != (batch,):
            raise ValueError(f"page_table.lengths has shape {tuple(kv_meta.shape)}; qo_indptr "
                             f"({batch + 1} entries) needs [{batch}]")
        page_size, entries = page_table.page_size, table2.shape[1]
        table = table2.reshape(-1)
        bound = entries * page_size
    else:
        _check_int_vector(kv_indptr, "kv_indptr", 2)
        _check_int_vector(kv_indices, "kv_indices", 1)
        if kv_indptr.shape != qo_indptr.shape:
            raise ValueError(f"kv_indptr has {kv_indptr.shape[0]} entries and qo_indptr "
                             f"{qo_indptr.shape[0]}: both must be [B+1] for the same B")
        _static_int(max_kv_len, "max_kv_len")
        page_size, entries, table, kv_meta = 1, None, kv_indices, kv_indptr
        bound = kv_indices.shape[0] if max_kv_len is None else max_kv_len
    _static_int(max_q_len, "max_q_len")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if not isinstance(config, DecodeKernelConfig):
        raise TypeError(f"config must be a DecodeKernelConfig, got {type(config).__name__}")
    if not (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)):
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive finite float")
    if kv_pool.shape[0] > MAX_POOL_ROWS:
        raise ValueError(f"kv_pool has {kv_pool.shape[0]} rows; slot ids are int32 (at most "
                         f"{MAX_POOL_ROWS})")
    scales = pool_scales(kv_pool, kv_dtype, k_scale, v_scale)
    t, h, _ = q.shape
    if should_check(qo_indptr, kv_meta, table):
        enforce(check_extend_values, qo_indptr, kv_meta, table, num_q=t,
                pool_rows=kv_pool.shape[0], page_size=page_size, entries_per_row=entries,
                causal=causal, max_q_len=max_q_len,
                max_kv_len=max_kv_len if page_table is None else None)
    chunk = chunk_tokens(max(h, 1), causal)
    if t == 0:
        return (jnp.zeros((0, h, v_head_dim), q.dtype), jnp.zeros((0, h), jnp.float32))
    num_pseudo = num_pseudo_seqs(t, batch, chunk, max_q_len)
    if isinstance(h, int) and h > 0:
        config = extend_kernel_config(config, h, chunk, num_pseudo, page_size,
                                      head_dim=q.shape[2], v_head_dim=v_head_dim, dtype=q.dtype,
                                      kv_dtype=(kv_pool.dtype if kv_dtype is None
                                                else KV_FP8_DTYPE),
                                      interpret=interpret, pool_rows=kv_pool.shape[0])
    return _mla_extend(q, kv_pool, qo_indptr, table, kv_meta, scales, page_size=page_size,
                       max_kv_len=int(bound), entries_per_row=entries, chunk=chunk,
                       num_pseudo=num_pseudo, causal=causal, sm_scale=float(sm_scale),
                       num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                       interpret=interpret,
                       kv_dtype=None if kv_dtype is None else KV_FP8_DTYPE.name)
