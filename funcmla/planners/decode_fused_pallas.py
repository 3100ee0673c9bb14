"""The decode planner after its prologue as two Pallas programs: walk, then derive and emit.

Why: XLA's form of the planner's tail (`fill_step`, three prefix sums, three `searchsorted`,
gathers and scatters into five buffers) compiles to about 19 small kernels, more device time than
the walk itself (`python -m bench.planners --fills pallas,fused --profile-batches 256`;
docs/planners.md). Here:

1. **walk** (`decode_fill_pallas.walk_or_chase`, one program of one warp): the state before
   each tile, by the chase over events where it pays off, else the tile walk;
2. **derive** (second program, EMIT_PROGRAMS thread blocks of EMIT_WARPS warps; each block
   derives its own copy), in vector chunks over the tiles: `(c0, f, m)` with `fill_step` (the
   same function the XLA path runs) and the running sums (works, partials, partial rows, valid
   tiles), into a scratch output `derived` [programs, 8, S_p];
3. barrier; **emit** every buffer of the plan in chunks of EMIT_BLOCK outputs dealt to the
   blocks round-robin. A work finds its tile by a binary search over the running work count
   (gathers from `derived`), then reads the tile's fields; `work_indptr[c + 1]` = works of the
   tiles that end on or before cluster `c` plus the leading fragments of the next tile; the
   reduce maps likewise search the partial and valid-tile counts.

The walk is a separate program because it is one warp's scalar (or reduction-bound) work; the
emission is bound by one block's memory pipe (scattered gathers and stores), so it is spread over
several blocks.

Every element of every output is written (unused tails get zero), so nothing is initialised
first. The outputs equal the NumPy oracle's, field by field (tests/test_planner_decode.py in
interpret mode; `python -m bench.planners --check` compiled on a GPU).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.layout import next_power_of_two
from funcmla.planners.decode_fill import FillParams, fill_step, fragment_kv_span
from funcmla.planners.decode_fill_pallas import fill_tiles_pallas, on_gpu, padded_slots
from funcmla.planners.decode_sizes import DecodePlanSizes

__all__ = ["INFO_FIELDS", "DERIVED_FIELDS", "plan_tail_pallas"]

# Per-tile fields the emission reads (columns 8.. of the kernel's int32 `slots` input
# [S_p, 17], after the 8 TILE_FIELDS the walk reads).
INFO_FIELDS = ("batch", "last_page_len", "kv_begin", "kv_end", "batch_tail", "qo_tile_size",
               "qo_start", "qo_end", "valid")
(_BATCH, _LPL, _KV_BEGIN, _KV_END, _BT, _TS, _QO_START, _QO_END, _VALID) = range(9)
_INFO = 8  # first info column of `slots`
# Rows of the `derived` scratch output [programs, 8, S_p]: the tile's placement and running sums
# (one copy per program).
DERIVED_FIELDS = ("c0", "f", "m", "works_incl", "red_incl", "partial_excl", "valid_incl",
                  "last_cluster")
(_C0, _F, _M, _WORKS_INCL, _RED_INCL, _PARTIAL_EXCL, _VALID_INCL, _LAST_CLUSTER) = range(8)

VECTOR_BLOCK = 512  # elements per vector chunk (power of two, as Triton requires)
# Emission: chunks of EMIT_BLOCK outputs dealt round-robin to EMIT_PROGRAMS programs (thread
# blocks: one block's emission is bound by its own memory pipe, not by its warp count), unrolled
# up to UNROLL_CHUNKS chunks in all (`python -m bench.planners --fills fused`, docs/planners.md).
EMIT_BLOCK = 128
EMIT_PROGRAMS = 16
UNROLL_CHUNKS = 64
EMIT_WARPS = 4  # warps per derive + emit program


def _search(gather, n: int, v, *, strict: bool):
    """Number of entries of a non-decreasing a[0:n] that are <= v (< v if strict), for a vector
    v, by binary lifting; `gather(idx)` reads a at int32 indices. n is static (>= 1)."""
    lo = jnp.zeros_like(v)
    step = 1 << (n.bit_length() - 1)
    while step >= 1:
        cand = lo + step
        a = gather(jnp.minimum(cand, n) - 1)
        ok = (cand <= n) & ((a < v) if strict else (a <= v))
        lo = jnp.where(ok, cand, lo)
        step //= 2
    return lo


def _emit_kernel(scalars_ref, slots_ref, states_ref,
                 derived_ref, work_info_ref, work_indptr_ref, reduce_indptr_ref,
                 reduce_final_map_ref, reduce_partial_map_ref, num_works_ref, num_partials_ref, *,
                 params: FillParams, num_slots: int, sizes: DecodePlanSizes, page_size: int,
                 kv_granularity: int, all_slots_valid: bool, interpret: bool):
    i32 = jnp.int32
    S = num_slots
    s_p = slots_ref.shape[0]
    payload, bpc = scalars_ref[0], scalars_ref[1]
    pid = pl.program_id(0)  # every program derives its own copy, then emits its share
    programs = derived_ref.shape[0]

    def barrier():
        if not interpret:  # interpret mode runs sequentially
            pltriton.debug_barrier()

    # 2. Derive placement and running sums, chunk by chunk.
    ch = min(VECTOR_BLOCK, s_p)

    def derive(ci, carry):
        works, reds, prows, valids = carry
        base = ci * ch
        idx = base + lax.iota(i32, ch)
        inside = idx < S
        cols = [slots_ref[pl.ds(base, ch), c] for c in range(6)]
        cols[0] = jnp.where(inside, cols[0], -1)  # beyond the last slot: empty
        cu = states_ref[pl.ds(base, ch), 0]
        remain = states_ref[pl.ds(base, ch), 1]
        _, _, (c0, f, m, _) = fill_step(params, payload, bpc, cu, remain, tuple(cols))
        ts = slots_ref[pl.ds(base, ch), _INFO + _TS]
        valid = jnp.where(inside, slots_ref[pl.ds(base, ch), _INFO + _VALID], 0)
        red_cnt = jnp.where(m > 1, m, 0)
        prow = red_cnt * ts
        works_incl = jnp.cumsum(m) + works
        red_incl = jnp.cumsum(red_cnt) + reds
        partial_excl = jnp.cumsum(prow) - prow + prows
        valid_incl = jnp.cumsum(valid) + valids
        last_cluster = jnp.where(m > 0, c0 + m - 1, cu)
        for row, val in ((_C0, c0), (_F, f), (_M, m), (_WORKS_INCL, works_incl),
                         (_RED_INCL, red_incl), (_PARTIAL_EXCL, partial_excl),
                         (_VALID_INCL, valid_incl), (_LAST_CLUSTER, last_cluster)):
            derived_ref[pid, row, pl.ds(base, ch)] = val.astype(i32)
        return (works + jnp.sum(m), reds + jnp.sum(red_cnt), prows + jnp.sum(prow),
                valids + jnp.sum(valid))

    zero = jnp.int32(0)
    num_works, num_partials, _, num_valid = lax.fori_loop(
        0, s_p // ch, derive, (zero, zero, zero, zero))
    num_works_ref[0] = num_works
    num_partials_ref[0] = num_partials
    barrier()

    def row(r):
        return lambda ix: derived_ref[pid, r, ix]

    def info(r, ix):
        return slots_ref[ix, _INFO + r]

    phases = []

    def blocks(size: int, body):
        """Queue body(base, idx, mask, eb) over [0, size) in vector chunks (masked tail); the
        chunks of all phases are dealt to the programs round-robin by `run_phases`."""
        # Interpret mode (CPU tests): big chunks, fewer traced bodies, a faster compile.
        eb = min(VECTOR_BLOCK if interpret else EMIT_BLOCK, next_power_of_two(size))
        phases.append((size, eb, -(-size // eb), body))

    def run_chunk(bi, size, eb, body):
        base = bi * eb  # traced: the last chunk may overhang (masked)
        idx = base + lax.iota(i32, eb)
        body(base, idx, idx < size, eb)

    def run_phases():
        """Each program runs its chunks. Unrolled (one `pl.when` per chunk) up to UNROLL_CHUNKS
        chunks in all, else a loop per phase over the program's chunks."""
        # Interpret mode unrolls less, so that CPU tests reach both forms.
        if sum(nb for _, _, nb, _ in phases) <= (4 if interpret else UNROLL_CHUNKS):
            t = 0
            for size, eb, nb, body in phases:
                for bi in range(nb):
                    pl.when(pid == t % programs)(
                        functools.partial(run_chunk, i32(bi), size, eb, body))
                    t += 1
            return
        for size, eb, nb, body in phases:
            def loop_body(i, c, size=size, eb=eb, body=body):
                run_chunk(pid + i * programs, size, eb, body)
                return c

            lax.fori_loop(0, (jnp.maximum(nb - pid, 0) + programs - 1) // programs, loop_body, 0)

    def store(ref, base, eb, col, val, mask):
        at = ref.at[pl.ds(base, eb)] if col is None else ref.at[pl.ds(base, eb), jnp.int32(col)]
        pltriton.store(at, val.astype(i32), mask=mask)

    gran = kv_granularity

    # 3a. work_info.
    def emit_works(base, w, mask, eb):
        slot = jnp.minimum(_search(row(_WORKS_INCL), S, w, strict=False), S - 1)
        m_w, f_w = derived_ref[pid, _M, slot], derived_ref[pid, _F, slot]
        j = w - (derived_ref[pid, _WORKS_INCL, slot] - m_w)
        live = w < num_works
        ts = info(_TS, slot)
        lpl = None if page_size == 1 else info(_LPL, slot)
        kv_start, kv_stop, kv_offset = fragment_kv_span(
            j, m_w, f_w, info(_KV_BEGIN, slot), info(_KV_END, slot), info(_BT, slot), lpl,
            bpc=bpc, gran=gran, page_size=page_size)
        partial_qo_loc = jnp.where(m_w > 1, derived_ref[pid, _PARTIAL_EXCL, slot] + j * ts, -1)
        cols = (info(_BATCH, slot), partial_qo_loc, info(_QO_START, slot), info(_QO_END, slot),
                kv_start, kv_stop, kv_offset, jnp.zeros_like(w))
        for c, val in enumerate(cols):
            store(work_info_ref, base, eb, c, jnp.where(live, val, 0), mask)

    blocks(sizes.max_work, emit_works)

    # 3b. work_indptr[i] for i = c + 1: works on clusters <= c.
    def emit_indptr(base, i, mask, eb):
        c = i - 1
        s = _search(row(_LAST_CLUSTER), S, c, strict=False)  # tiles ending on or before c
        sc = jnp.minimum(s, S - 1)
        before = jnp.where(s > 0, derived_ref[pid, _WORKS_INCL, jnp.maximum(s - 1, 0)], 0)
        lead = jnp.clip(c - derived_ref[pid, _C0, sc] + 1, 0, derived_ref[pid, _M, sc])
        val = before + jnp.where(s < S, lead, 0)
        store(work_indptr_ref, base, eb, None, jnp.where(i == 0, 0, val), mask)

    blocks(sizes.num_cu + 1, emit_indptr)

    # 3c. Reduce maps, indexed by global qo tile k (valid slots in order).
    def tile_slot(k):
        if all_slots_valid:
            return jnp.clip(k, 0, S - 1), (k >= 0) & (k < min(sizes.tile_cnt, S))
        ts = _search(row(_VALID_INCL), S, k + 1, strict=True)
        return jnp.minimum(ts, S - 1), (k >= 0) & (k < num_valid)

    def emit_reduce_indptr(base, i, mask, eb):
        slot, live = tile_slot(i - 1)
        val = jnp.where(live, derived_ref[pid, _RED_INCL, slot], num_partials)
        store(reduce_indptr_ref, base, eb, None, jnp.where(i == 0, 0, val), mask)

    blocks(sizes.tile_cnt + 1, emit_reduce_indptr)

    def emit_final_map(base, k, mask, eb):
        slot, live = tile_slot(k)
        live = live & (derived_ref[pid, _M, slot] > 1)
        store(reduce_final_map_ref, base, eb, 0, jnp.where(live, info(_QO_START, slot), 0), mask)
        store(reduce_final_map_ref, base, eb, 1, jnp.where(live, info(_QO_END, slot), 0), mask)

    blocks(sizes.tile_cnt, emit_final_map)

    def emit_partial_map(base, p, mask, eb):
        slot = jnp.minimum(_search(row(_RED_INCL), S, p, strict=False), S - 1)
        m_s = derived_ref[pid, _M, slot]
        red_excl = derived_ref[pid, _RED_INCL, slot] - jnp.where(m_s > 1, m_s, 0)
        val = derived_ref[pid, _PARTIAL_EXCL, slot] + (p - red_excl) * info(_TS, slot)
        store(reduce_partial_map_ref, base, eb, None, jnp.where(p < num_partials, val, 0), mask)

    blocks(sizes.max_split_tiles, emit_partial_map)
    run_phases()


def plan_tail_pallas(tiles: jax.Array, info: jax.Array, payload: jax.Array, bpc: jax.Array, *,
                     params: FillParams, sizes: DecodePlanSizes, page_size: int,
                     kv_granularity: int, all_slots_valid: bool,
                     interpret: bool | None = None,
                     walk: str = "auto"):
    """Walk, then derive + emit, as Pallas programs.

    tiles: int32 [S, 8] (decode_fill.TILE_FIELDS, n = -1 for empty slots); info: int32 [S, 9]
    (INFO_FIELDS); payload, bpc: int32 scalars (blocks). Returns (work_indptr, work_info,
    reduce_indptr, reduce_final_map, reduce_partial_map, num_works, num_partials) with the
    shapes of `sizes`, plus the walk's states [S, 2] for checking.
    The walk runs in its own one-warp program (`fill_tiles_pallas`), derive + emit in a second
    program of EMIT_PROGRAMS thread blocks of EMIT_WARPS warps.
    walk: "auto" | "chase" | "tiles" (`decode_fill_pallas.walk_or_chase`).
    """
    if interpret is None:
        interpret = not on_gpu()
    programs = 2 if interpret else EMIT_PROGRAMS  # interpret mode runs programs one by one
    num_slots = tiles.shape[0]
    if tiles.shape != (num_slots, _INFO) or info.shape != (num_slots, len(INFO_FIELDS)):
        raise ValueError(f"tiles / info must have shapes ({num_slots}, {_INFO}) / "
                         f"({num_slots}, {len(INFO_FIELDS)}), got {tiles.shape} / {info.shape}")
    # One input array: XLA builds it in one fusion, the kernels read rows and columns of it.
    slots = jnp.concatenate([tiles, info], axis=1).astype(jnp.int32)
    s_p = padded_slots(num_slots)
    if s_p > VECTOR_BLOCK:
        s_p = -(-num_slots // VECTOR_BLOCK) * VECTOR_BLOCK
    if s_p != num_slots:
        pad = s_p - num_slots
        slots = jnp.concatenate(
            [slots, jnp.zeros((pad, slots.shape[1]), jnp.int32).at[:, 0].set(-1)])
    payload = jnp.asarray(payload, jnp.int32)
    bpc = jnp.asarray(bpc, jnp.int32)
    scalars = jnp.stack([payload, bpc])
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    out_shape = (
        sds(programs, len(DERIVED_FIELDS), s_p),
        sds(sizes.max_work, 8),
        sds(sizes.num_cu + 1),
        sds(sizes.tile_cnt + 1),
        sds(sizes.tile_cnt, 2),
        sds(sizes.max_split_tiles),
        sds(1),  # num_works, num_partials: separate outputs, so that reading them is free
        sds(1),
    )
    states = fill_tiles_pallas(slots, payload, bpc, params=params, walk=walk,
                               live_slots=num_slots, interpret=interpret)
    kwargs = {}
    if not interpret:
        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=EMIT_WARPS, num_stages=1)
    kernel = functools.partial(
        _emit_kernel, params=params, num_slots=num_slots, sizes=sizes, page_size=page_size,
        kv_granularity=kv_granularity, all_slots_valid=all_slots_valid, interpret=interpret)
    call = pl.pallas_call(kernel, out_shape=out_shape, grid=(programs,), interpret=interpret,
                          name="mla_decode_plan_emit", **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Triton.*deprecated.*")
        outs = call(scalars, slots, states)
    (_, work_info, work_indptr, reduce_indptr, reduce_final_map, reduce_partial_map,
     num_works, num_partials) = outs
    return (work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map,
            num_works.reshape(()), num_partials.reshape(()), states[:num_slots])
