"""The decode planner's greedy fill as per-tile integer algebra (no branch, no division).

AITER's fill walks the qo tiles in order carrying `(cu, remain)`: the current cluster and the
payload it has left, in blocks (`v1_2_device.cuh`). This module states one tile's
step in two forms, shared by every backend (`lax.scan` here, the Pallas walk in
`decode_fill_pallas`, the chase in `decode_chase`, the fused emission in `decode_fused_pallas`),
so that all of them run the same arithmetic (and `fragment_kv_span` states a work's KV range for
both emitters, `planners.decode` and `decode_fused_pallas`):

* `fill_advance`: only the carry, with a short dependency chain (what the sequential walk runs);
* `fill_step`: the carry plus the tile's placement `(c0, f, m, merged)`, applied to all tiles at
  once from the states the walk recorded.

Divisions by the run-time blocks-per-cluster count `bpc` are done once per tile beforehand
(`fill_inputs`), so the walk itself only adds, compares and selects.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "NEVER",
    "TILE_FIELDS",
    "FILL_STATE_FIELDS",
    "FILL_OUT_FIELDS",
    "FillParams",
    "fill_step",
    "fill_advance",
    "fill_inputs",
    "fill_tiles_scan",
    "fragment_kv_span",
]

NEVER = 2**30  # "no tail-merge point" sentinel, in blocks (larger than any block count)

# Per-tile inputs of the fill, columns of an int32 [S, 8] array (`fill_inputs`). n = -1 marks
# an empty slot. fresh_remain / fresh_dcu: the state change when the tile starts on a fresh
# cluster (it does not depend on the incoming state, so it is precomputed).
TILE_FIELDS = ("n", "n_div", "n_mod", "e_min", "e_min_div", "e_min_mod", "fresh_remain",
               "fresh_dcu")
# What the sequential walk emits per tile: the state (cluster, payload left) BEFORE the tile.
FILL_STATE_FIELDS = ("cu", "remain")
# Per-tile placement derived from that state: start cluster, end of the first fragment (blocks),
# number of fragments, tail merged.
FILL_OUT_FIELDS = ("c0", "f", "m", "merged")


@dataclasses.dataclass(frozen=True)
class FillParams:
    """Static part of the fill.

    overhead:    fixed cost of a work (blocks).
    parallel:    the parallel planner's zero-length-KV rule applies.
    tail_rule:   a tail merge can happen (page_size 1 and max_seqlen_qo > 1); when False the
                 walk skips its arithmetic (with max_seqlen_qo 1 a cut always leaves >= 1 token).
    empty_slots: some slots before the last are empty (n = -1); when False the walk does not
                 test for them (trailing padding only affects discarded states).
    """

    overhead: int
    parallel: bool
    tail_rule: bool = True
    empty_slots: bool = True


def _ceil_div_shifted(qx, rx, f, bpc):
    """ceil((x - f) / bpc) for x = qx * bpc + rx, 0 <= rx < bpc, 1 <= f <= bpc, x > f - bpc."""
    return qx + (rx > f).astype(jnp.int32) - ((rx == 0) & (f == bpc)).astype(jnp.int32)


def fill_step(params: FillParams, payload, bpc, cu, remain, tile):
    """One tile of the greedy fill, in full: (cu', remain', (c0, f, m, merged)).

    `cu`, `remain`: current cluster and its payload left (blocks). `tile`: the first six
    TILE_FIELDS. Scalars or arrays (elementwise); no division, no branch.

    Cases (`v1_2_device.cuh`): the tile fits (one fragment on `cu`); it is cut now
    (`remain > overhead`: first fragment of `remain - overhead` blocks on `cu`, then `bpc`
    blocks per fresh cluster); or the cluster is abandoned and the tile starts on `cu + 1`.
    Tail rule: the first cut point `e` with `kv_len - e * gran < max_seqlen_qo` (precomputed as
    `e >= e_min`) ends the tile there; its fragment takes the rest and over-fills its cluster.
    """
    n, n_div, n_mod, e_min, e_div, e_mod = tile[:6]
    ov = params.overhead
    valid = n >= 0
    fits = n + ov <= remain
    fresh = jnp.logical_not(fits) & (remain <= ov)
    r0 = jnp.where(fresh, payload, remain)
    c0 = jnp.where(fresh, cu + 1, cu)
    f = jnp.where(fits, n, r0 - ov)
    single = fits | (n <= f)
    m = jnp.where(single, 1, 1 + _ceil_div_shifted(n_div, n_mod, f, bpc))
    # First cut point at or past e_min; a merge happens if it is a real cut (index <= m - 2).
    js = jnp.where(e_min <= f, 0, _ceil_div_shifted(e_div, e_mod, f, bpc))
    merged = (m >= 2) & (js <= m - 2)
    m = jnp.where(merged, js + 1, m)
    last_begin = jnp.where(m == 1, 0, f + (m - 2) * bpc)
    new_remain = jnp.where(m == 1, r0, payload) - (n - last_begin) - ov
    new_cu = c0 + m - 1
    live = valid
    if params.parallel:  # zero-length KV on an abandoned cluster: no work, payload left 0
        zskip = valid & fresh & (n == 0)
        new_remain = jnp.where(zskip, 0, new_remain)
        live = valid & jnp.logical_not(zskip)
    new_cu = jnp.where(live, new_cu, cu)
    new_remain = jnp.where(valid, new_remain, remain)
    m = jnp.where(live, m, 0)
    return new_cu, new_remain, (c0, f, m, (live & merged).astype(jnp.int32))


def fill_advance(params: FillParams, payload, bpc, cu, remain, tile):
    """Only the carry of `fill_step`: (cu', remain'), with a short dependency chain.

    The walk over tiles runs this; `fill_step` is then applied to all tiles at once, from the
    states the walk recorded. The fresh-cluster case is precomputed (`fill_inputs`); the
    cut-now case is closed form: with n = q * bpc + r and f = remain - overhead blocks taken now,
    the last fragment leaves `f - r + bpc * ([r > f] - [r == 0 and f == bpc])` and the tile
    ends `q + [r > f] - [r == 0 and f == bpc]` clusters further on.
    """
    n, q, r, e_min, e_div, e_mod, fresh_remain, fresh_dcu = tile
    ov = params.overhead
    fits = n + ov <= remain
    cut_now = remain > ov
    # d = f - r. [r > f] is d < 0; [r == 0 and f == bpc] is d == bpc (remain <= payload), so
    # the cut leaves d mod bpc (d in (-bpc, bpc]) without a multiply.
    d = remain - (r + ov)
    gt = d < 0
    z = d == bpc
    cut_remain = jnp.where(gt, d + bpc, jnp.where(z, 0, d))
    cut_dcu = q + gt.astype(jnp.int32) - z.astype(jnp.int32)
    new_remain = jnp.where(fits, remain - (n + ov),
                           jnp.where(cut_now, cut_remain, fresh_remain))
    new_cu = cu + jnp.where(fits, 0, jnp.where(cut_now, cut_dcu, fresh_dcu))
    if params.tail_rule:  # tail merge, computed alongside and selected at the end
        new_cu, new_remain = _tail_merge(params, payload, bpc, cu, remain, tile, fits, cut_now,
                                         new_cu, new_remain)
    if not params.empty_slots:
        return new_cu, new_remain
    valid = n >= 0
    return jnp.where(valid, new_cu, cu), jnp.where(valid, new_remain, remain)


def _tail_merge(params, payload, bpc, cu, remain, tile, fits, cut_now, new_cu, new_remain):
    n, q, r, e_min, e_div, e_mod = tile[:6]
    ov = params.overhead
    f = remain - ov
    f_eff = jnp.where(cut_now, f, bpc)
    m = 1 + _ceil_div_shifted(q, r, f_eff, bpc)
    js = jnp.where(e_min <= f_eff, 0, _ceil_div_shifted(e_div, e_mod, f_eff, bpc))
    merged = jnp.logical_not(fits) & (m >= 2) & (js <= m - 2)
    last_begin = jnp.where(js == 0, 0, f_eff + (js - 1) * bpc)
    merge_remain = jnp.where((js == 0) & cut_now, remain, payload) - (n - last_begin) - ov
    merge_cu = cu + (1 - cut_now.astype(jnp.int32)) + js
    return jnp.where(merged, merge_cu, new_cu), jnp.where(merged, merge_remain, new_remain)


def fill_inputs(n, e_min, payload, bpc, *, params: FillParams) -> jax.Array:
    """The fill's per-tile inputs (TILE_FIELDS) from block counts n (-1: empty slot) and tail
    points e_min (blocks; >= NEVER: none). int32 [S] -> int32 [S, 8]."""
    q, r = n // bpc, n % bpc
    nf = q + (r > 0).astype(jnp.int32)  # fragments when starting fresh (n >= 1)
    fresh_remain = bpc - (n - (nf - 1) * bpc)
    fresh_dcu = nf
    zero_remain, zero_dcu = (0, 0) if params.parallel else (bpc, 1)
    fresh_remain = jnp.where(n == 0, zero_remain, fresh_remain)
    fresh_dcu = jnp.where(n == 0, zero_dcu, fresh_dcu)
    return jnp.stack([n, q, r, e_min, e_min // bpc, e_min % bpc, fresh_remain, fresh_dcu],
                     axis=1).astype(jnp.int32)


def fill_tiles_scan(tiles: jax.Array, payload: jax.Array, bpc: jax.Array, *,
                    params: FillParams, unroll: int = 1) -> jax.Array:
    """The walk as a `lax.scan`. tiles: int32 [S, 8] -> states before each tile int32 [S, 2]."""

    def body(carry, tile):
        cu, remain = carry
        new = fill_advance(params, payload, bpc, cu, remain, tuple(tile))
        return new, jnp.stack([cu, remain])

    init = (jnp.int32(0), jnp.asarray(payload, jnp.int32))
    _, out = lax.scan(body, init, tiles, unroll=max(1, min(unroll, tiles.shape[0])))
    return out


def fragment_kv_span(j, m, f, kv_begin, kv_end, bt, last_page_len, *, bpc, gran: int,
                     page_size: int):
    """(kv_start, kv_stop, kv_offset) of fragment j of a tile placed as (f, m) (`fill_step`):
    fragment 0 ends at block f, each next one bpc blocks later, the last at the tile's end.
    page_size 1: the tile's `bt` tail tokens are left to the kernel's causal rule and
    kv_offset counts the tokens past kv_stop; else kv_offset counts them from kv_stop's page
    through the request's last page (`last_page_len` tokens; unused, may be None, at 1).
    Element-wise on int32 arrays, inside or outside a Pallas kernel."""
    last = j == m - 1
    begin_blk = jnp.where(j == 0, 0, f + (j - 1) * bpc)
    end_tok = kv_begin + (f + j * bpc) * gran
    kv_start = kv_begin + begin_blk * gran
    if page_size == 1:
        kv_stop = jnp.where(last, kv_end - bt, jnp.minimum(end_tok, kv_end - bt))
        return kv_start, kv_stop, kv_end - kv_stop
    kv_stop = jnp.where(last, kv_end, jnp.minimum(end_tok, kv_end))
    kv_offset = jnp.where(kv_stop == kv_end, 0, (kv_end - kv_stop - 1) * page_size + last_page_len)
    return kv_start, kv_stop, kv_offset
