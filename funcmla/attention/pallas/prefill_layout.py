"""What the prefill kernel runs on for a batch of token CSRs, as index arrays of static sizes.

The kernel reads q / k / v where the caller holds them: a request's tiles are read from the
8-row group its first row falls in (`ROW_ALIGN`, `prefill_mgpu`), so no request is moved.
`prefill_layout` gives the kernel's own operands (request starts and lengths, the tile
schedule), a function of the two token CSRs only (a serving step computes it once for all its
layers); `PrefillGeometry` the static sizes: the row counts the kernel's tensors are padded to
(a multiple of 8, at least one tile: Mosaic GPU's tiled TMA needs both) and the tile slots.

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
    ROW_ALIGN,
    num_tile_slots,
    tile_counts,
    tile_schedule,
)

__all__ = ["ROW_ALIGN", "PrefillGeometry", "PrefillLayout", "prefill_geometry",
           "prefill_layout", "slot_count", "live_tile_count", "check_fits", "prefill_capacity",
           "prefill_batch_capacity"]


@dataclasses.dataclass(frozen=True)
class PrefillGeometry:
    """Static sizes of one prefill: up to `q_capacity` q rows and `kv_capacity` k / v rows in
    up to `batch` requests. The kernel runs on `num_reqs` = batch + 1 requests (the last one:
    q rows past qo_indptr[-1]), tensors of `q_rows` / `kv_rows` rows (the capacities rounded
    up to a multiple of 8, at least one tile; the interpreter gets a spare tile instead, as it
    clamps a slice that runs past the end) and `num_slots` q tiles (the grid's tile axis:
    `num_tile_slots`, which covers any batch, or fewer for a known one: `slot_count`)."""

    q_capacity: int
    kv_capacity: int
    batch: int
    q_rows: int
    kv_rows: int
    num_slots: int

    @property
    def num_reqs(self) -> int:
        return self.batch + 1


def prefill_geometry(q_capacity: int, kv_capacity: int, batch: int, *, block_kv: int,
                     interpret: bool = False, live_tiles: int | None = None
                     ) -> PrefillGeometry:
    """The sizes for up to q_capacity / kv_capacity rows in up to `batch` requests. live_tiles:
    the q tiles of the one batch the geometry will serve (`tile_counts` summed over every
    request, the rows past the last one included), known on the host; None: any batch."""
    if interpret:
        q_rows, kv_rows = q_capacity + BLOCK_Q, kv_capacity + block_kv
    else:
        q_rows = max(_round_up(q_capacity, ROW_ALIGN), BLOCK_Q)
        kv_rows = max(_round_up(kv_capacity, ROW_ALIGN), block_kv)
    bound = num_tile_slots(q_rows, batch + 1)
    slots = bound if live_tiles is None else min(bound, slot_count(live_tiles))
    return PrefillGeometry(q_capacity, kv_capacity, batch, q_rows, kv_rows, slots)


def slot_count(live_tiles: int) -> int:
    """Tile slots for a batch of `live_tiles` q tiles: rounded up to a multiple of an eighth of
    its power of two (exact below 16), so at most 12.5% of the blocks are idle and a kernel is
    compiled for at most 8 counts per doubling. The bound for any batch (`num_tile_slots`)
    leaves up to R + 7 R / 128 slots idle for R requests (18 of 146 a head at 16 x 1k): each is
    a block launched that exits at once (docs/prefill_kernel.md, "Tile schedule")."""
    return _round_up_to_eighth(max(int(live_tiles), 1))


class PrefillLayout(NamedTuple):
    """`prefill_layout`'s index arrays (int32; R = geometry.num_reqs, N = its num_slots)."""

    qo_indptr: jax.Array   # [R + 1] request starts in q's rows
    kv_indptr: jax.Array   # [R + 1] request starts in k / v's rows
    q_lens: jax.Array      # [R] query count per request
    kv_lens: jax.Array     # [R] key count per request
    tile_req: jax.Array    # [N] request of each tile slot (-1: unused), `tile_schedule`
    tile_first: jax.Array  # [N] first row of each tile, counted from its request's 8-row group


def prefill_layout(qo_indptr: jax.Array, kv_indptr: jax.Array, tq: int, tk: int,
                   geometry: PrefillGeometry) -> PrefillLayout:
    """The kernel's operands for B <= geometry.batch requests (qo_indptr / kv_indptr int32
    [B + 1], checked by the caller) over tq q rows and tk k / v rows (within the capacities):
    the CSRs extended by the empty requests and the request of the rows past qo_indptr[-1]."""
    b = qo_indptr.shape[0] - 1
    check_fits(geometry, b, tq, tk)
    pad = geometry.batch - b
    qo = _kernel_qo_indptr(qo_indptr, pad, tq)
    kv = jnp.concatenate([kv_indptr, jnp.broadcast_to(kv_indptr[-1:], (pad + 1,))])
    req, first = tile_schedule(qo, geometry.num_slots)
    return PrefillLayout(
        qo_indptr=qo, kv_indptr=kv, q_lens=qo[1:] - qo[:-1], kv_lens=kv[1:] - kv[:-1],
        tile_req=req, tile_first=first)


def live_tile_count(qo_indptr, tq: int) -> int:
    """The q tiles (`tile_counts`) of the kernel's requests for host-known qo_indptr [B + 1]
    over tq q rows: the caller's and the one of the rows past qo_indptr[-1] (empty requests
    take none). A host value, the size `slot_count` rounds."""
    with jax.ensure_compile_time_eval():  # concrete under an outer trace too
        qo = _kernel_qo_indptr(jnp.asarray(qo_indptr, jnp.int32), 0, tq)
        return int(jnp.sum(tile_counts(qo)))


def _kernel_qo_indptr(qo_indptr: jax.Array, pad: int, tq: int) -> jax.Array:
    """qo_indptr extended by `pad` empty requests and the request of the rows past its last."""
    return jnp.concatenate([qo_indptr, jnp.broadcast_to(qo_indptr[-1:], (pad,)),
                            jnp.array([tq], jnp.int32)])


def prefill_capacity(rows: int) -> int:
    """The row capacity (a compiled shape) that holds `rows` q (or k / v) rows: rows rounded
    up to a multiple of an eighth of its power of two, at least 128. Spare rows cost padding
    (tensors are padded to the capacity), so at most 12.5% of them, for at most 8
    compiles per doubling of the token count (the torch launcher's buckets, and the SGLang
    backend's for the JAX path)."""
    return _round_up_to_eighth(max(int(rows), 128))


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


def _round_up_to_eighth(n: int) -> int:
    """n >= 1 rounded up to a multiple of an eighth of its power of two (exact below 16): at
    most 12.5% over, at most 8 values per doubling (`slot_count`, `prefill_capacity`)."""
    return _round_up(n, 1 << max(n.bit_length() - 4, 0))
