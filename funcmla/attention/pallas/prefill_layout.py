"""Where the prefill kernel's rows come from and go to: the realigned layout as index arrays.

Mosaic GPU copies q / k / v tiles into 8-row-tiled shared memory by TMA over the tensor viewed
as 8-row tiles, so a tile must start on a multiple of 8 rows (`ROW_ALIGN`): a start in the
middle of an 8-row group reads the wrong rows. `mha_prefill` therefore copies q, k and v into
a layout where each request's rows start on a multiple of 8, runs the kernel there and gathers
out and lse back. `prefill_layout` is that layout as int32 index arrays of static sizes (a
function of the two token CSRs only, so a serving step computes it once for all its layers):
the kernel's own operands (aligned starts, lengths, tile schedule) and the four gathers.

Requests: the caller's B, then `geometry.batch - B` empty ones (a launcher built for up to
`batch` requests serves fewer), then one request holding the q rows past qo_indptr[-1] with no
keys (the kernel writes their out 0 and lse +inf itself). `funcmla.interop.launcher.prefill`
restates `prefill_layout` in torch ops; tests/test_launcher_prefill.py holds the two equal.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from funcmla.attention.pallas.prefill_mgpu import (
    BLOCK_Q,
    first_slots,
    num_tile_slots,
    tile_schedule,
)
from funcmla.segments import segment_positions

__all__ = ["ROW_ALIGN", "PrefillGeometry", "PrefillLayout", "prefill_geometry",
           "prefill_layout", "lse_columns", "check_fits", "prefill_capacity",
           "prefill_batch_capacity"]

ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class PrefillGeometry:
    """Static sizes of one realigned prefill: up to `q_capacity` q rows and `kv_capacity` k / v
    rows in up to `batch` requests. The kernel runs on `num_reqs` = batch + 1 requests (the
    last one: q rows past qo_indptr[-1]), `q_rows` / `kv_rows` realigned rows (each request's
    length rounded up to 8, a multiple of 8 in all, at least one tile; the interpreter gets a
    spare tile instead, as it clamps a slice that runs past the end) and `num_slots` q tiles."""

    q_capacity: int
    kv_capacity: int
    batch: int
    q_rows: int
    kv_rows: int

    @property
    def num_reqs(self) -> int:
        return self.batch + 1

    @property
    def num_slots(self) -> int:
        return num_tile_slots(self.q_rows, self.num_reqs)


def prefill_geometry(q_capacity: int, kv_capacity: int, batch: int, *, block_kv: int,
                     interpret: bool = False, realign: bool = True) -> PrefillGeometry:
    """The realigned sizes for up to q_capacity / kv_capacity rows in up to `batch` requests
    (realign=False: the rows as they are, for requests known to start on multiples of 8)."""
    gaps = (ROW_ALIGN - 1) * (batch + 1) if realign else 0
    q_rows, kv_rows = q_capacity + gaps, kv_capacity + gaps
    if interpret:
        q_rows, kv_rows = q_rows + BLOCK_Q, kv_rows + block_kv
    else:
        q_rows = max(_round_up(q_rows, ROW_ALIGN), BLOCK_Q)
        kv_rows = max(_round_up(kv_rows, ROW_ALIGN), block_kv)
    return PrefillGeometry(q_capacity, kv_capacity, batch, q_rows, kv_rows)


class PrefillLayout(NamedTuple):
    """`prefill_layout`'s index arrays (int32; R = geometry.num_reqs, N = its num_slots)."""

    qo_indptr: jax.Array   # [R + 1] request starts in the kernel's q rows (multiples of 8)
    kv_indptr: jax.Array   # [R + 1] request starts in the kernel's k / v rows
    q_lens: jax.Array      # [R] query count per request
    kv_lens: jax.Array     # [R] key count per request
    tile_req: jax.Array    # [N] request of each tile slot (-1: unused), `tile_schedule`
    tile_first: jax.Array  # [N] first query row of each tile within its request
    q_src: jax.Array       # [q_rows] the q row copied into each kernel q row
    kv_src: jax.Array      # [kv_rows] the k / v row copied into each kernel k / v row
    out_rows: jax.Array    # [Tq] the kernel out row of each query row
    lse_cols: jax.Array    # [Tq] each query row's column of the lse tiles viewed [H, N * 128]


def prefill_layout(qo_indptr: jax.Array, kv_indptr: jax.Array, tq: int, tk: int,
                   geometry: PrefillGeometry) -> PrefillLayout:
    """The realigned layout of B <= geometry.batch requests (qo_indptr / kv_indptr int32
    [B + 1], checked by the caller) over tq q rows and tk k / v rows (within the capacities).
    Rows of the realigned layout between requests repeat an in-bounds row: the kernel masks
    their keys, zeroes their V and never stores their queries."""
    b = qo_indptr.shape[0] - 1
    check_fits(geometry, b, tq, tk)
    pad = geometry.batch - b
    qo = jnp.concatenate([qo_indptr, jnp.broadcast_to(qo_indptr[-1:], (pad,)),
                          jnp.array([tq], jnp.int32)])
    kv = jnp.concatenate([kv_indptr, jnp.broadcast_to(kv_indptr[-1:], (pad + 1,))])
    qo_a, kv_a = _aligned_indptr(qo), _aligned_indptr(kv)
    req, first = tile_schedule(qo_a, geometry.num_slots)
    row, j, _ = segment_positions(qo, tq)
    return PrefillLayout(
        qo_indptr=qo_a, kv_indptr=kv_a, q_lens=qo[1:] - qo[:-1], kv_lens=kv[1:] - kv[:-1],
        tile_req=req, tile_first=first,
        q_src=_sources(qo, qo_a, geometry.q_rows, tq),
        kv_src=_sources(kv, kv_a, geometry.kv_rows, tk),
        # in bounds for any index values (an identity for checked CSRs): gathers never wrap
        out_rows=jnp.clip(qo_a[row] + j, 0, geometry.q_rows - 1),
        lse_cols=jnp.clip(lse_columns(qo, tq), 0, geometry.num_slots * BLOCK_Q - 1))


def lse_columns(qo_indptr: jax.Array, tq: int) -> jax.Array:
    """Each query row's column of the kernel's lse tiles [H, N, 2, 64] viewed [H, N * 128]:
    its request's first tile slot + its row // 128 (`tile_schedule`; the slots depend on the
    requests' lengths only, the same in the realigned layout). qo_indptr: every request,
    the rows past the caller's last one included."""
    row, j, _ = segment_positions(qo_indptr, tq)
    return (first_slots(qo_indptr)[row] + j // BLOCK_Q) * BLOCK_Q + j % BLOCK_Q


def prefill_capacity(rows: int) -> int:
    """The row capacity (a compiled shape) that holds `rows` q (or k / v) rows: rows rounded
    up to a multiple of an eighth of its power of two, at least 128. Spare rows cost copies
    (the realigned layout covers the capacity), so at most 12.5% of them, for at most 8
    compiles per doubling of the token count (the torch launcher's buckets, and the SGLang
    backend's for the JAX path)."""
    n = max(int(rows), 128)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def prefill_batch_capacity(batch: int) -> int:
    """The request capacity for `batch` requests: the next power of two, at least 8. A spare
    request has no rows and costs one idle tile slot (a block that exits at once)."""
    return max(8, 1 << (max(int(batch), 1) - 1).bit_length())


def check_fits(geometry: PrefillGeometry, batch: int, tq: int, tk: int) -> None:
    """Raise ValueError unless `batch` requests over tq q rows and tk k / v rows fit."""
    if batch > geometry.batch or tq > geometry.q_capacity or tk > geometry.kv_capacity:
        raise ValueError(f"{batch} requests over {tq} q rows and {tk} k / v rows exceed the "
                         f"geometry's {geometry.batch} / {geometry.q_capacity} / "
                         f"{geometry.kv_capacity}")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _aligned_indptr(indptr):
    """Request starts on multiples of ROW_ALIGN: the CSR of the lengths rounded up to it (the
    kernel takes the true lengths apart)."""
    lens = indptr[1:] - indptr[:-1]
    padded = (lens + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded, dtype=jnp.int32)])


def _sources(indptr, aligned, rows: int, t: int):
    """The source row (in [0, t), 0 for t = 0) of each of `rows` rows laid out as `aligned`."""
    d = jnp.arange(rows, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(aligned[1:], d, side="right"), 0,
                   indptr.shape[0] - 2).astype(jnp.int32)
    j = d - aligned[req]
    src = jnp.where(j < indptr[req + 1] - indptr[req], indptr[req] + j, 0)
    return jnp.clip(src, 0, max(t - 1, 0))
