"""AITER's persistent decode work planner (`get_mla_metadata_v1`, fast mode = v1.2) in JAX.

`plan_mla_decode` turns `(qo_indptr, kv_indptr, kv_last_page_lens)` into a `WorkPlan` with static
shapes and no host round trip, bit-exact with AITER's device planner at ROCm/aiter e4048607
(`csrc/kernels/mla/metadata/v1_2_device.cuh`).

Units. `kv_indptr` counts entries of `kv_indices`: tokens when `page_size == 1`, pages otherwise;
it must start at 0. `kv_granularity` is in the same entries; a KV "block" is `kv_granularity`
entries. `qo_indptr` counts query tokens. `kv_offset` in the plan counts tokens.

How. The planner is a greedy bin-packer over qo tiles (one per folded request, or several when
the query is split). Each tile costs `ceil(kv_len / kv_granularity) + overhead` blocks; every
CU ("cluster") gets a payload `P = ceil(sum / num_splits) + overhead`; clusters are filled in
order and a tile that does not fit is cut into split-KV fragments. Only the walk over tiles is
sequential; it carries only `(cu, R)` = (current cluster, payload left) with a short, branch-
free and division-free step (`fill_advance`; divisions by the runtime blocks-per-cluster count
are done vectorised beforehand, `decode_fill.fill_inputs`) and records the state before each
tile (`fill_tiles`: a `lax.scan`, or one Pallas program, `decode_fill_pallas.py`, which where
it pays off runs a chase over the rare *events* of the walk instead, `decode_chase.py`). From
those states `fill_step` derives, for all tiles at once, the start cluster, the end of the
first fragment, the number of fragments and whether the causal tail rule merged the last
fragment. Everything else (costs, prefix sums, fragment expansion, reduce maps) is vectorised
`jnp`. On a GPU the default (`fill_impl="fused"`) runs the walk and everything after it as two
Pallas programs (`decode_fused_pallas.py`), since XLA's form of that tail is many small kernels
(`python -m bench.planners --fills pallas,fused`; docs/planners.md).

Parallel vs serial. AITER runs a "parallel" planner when `max_seqlen_qo == 1`, no qo split, no
head folding, `page_size == 1` and the batch fits in LDS, and a "serial" one otherwise. They
agree except for a zero-length KV tile met on a full cluster: the parallel planner emits no work
for it, the serial one an empty work on the next cluster (§4.4, §4.8). `zero_kv_behaviour`
selects which one is reproduced (`None`: the one AITER would run).

Out of scope: sparse (DSA `topk`), non-fast modes (v1.0, v1.1), context-parallel round robin,
mixed V40 dtypes, `num_heads_k > 1`.

Modules: `decode_config` (the static configuration), `decode_sizes` (buffer capacities),
`decode_fill` (the fill's per-tile algebra), `decode_chase` / `decode_fill_pallas` /
`decode_fused_pallas` (the GPU backends), this module (the orchestration), `oracle_decode` (the
serial NumPy restatement the tests compare against).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from funcmla.checks import check_indptr
from funcmla.planners.decode_config import DecodePlanConfig
from funcmla.planners.decode_fill import (
    NEVER,
    FillParams,
    fill_inputs,
    fill_step,
    fill_tiles_scan,
    fragment_kv_span,
)
from funcmla.planners.decode_fill_pallas import WALKS, fill_tiles_pallas, on_gpu
from funcmla.planners.decode_fused_pallas import plan_tail_pallas
from funcmla.planners.decode_sizes import mla_decode_plan_sizes
from funcmla.planners.inputs import (
    EAGER,
    INT32_MAX,
    TRACED,
    Checker,
    check_no_wrap,
    check_prefix_sums_fit,
    is_concrete,
    to_int32,
)
from funcmla.planners.plan import WorkPlan
from funcmla.planners.search import searchsorted_i32

__all__ = [
    "DecodePlanConfig",
    "FILL_IMPLS",
    "WALKS",
    "check_decode_plan_inputs",
    "decode_tiles",
    "default_fill_impl",
    "fill_tiles",
    "plan_mla_decode",
    "plan_mla_decode_jit",
]

# How the walk and what follows it run: see `plan_mla_decode`.
FILL_IMPLS = ("auto", "scan", "pallas", "fused")


def default_fill_impl() -> str:
    """What fill_impl="auto" runs: on a GPU the fused Pallas programs (fewest kernels, the least
    device time per plan: `python -m bench.planners --fills scan,pallas,fused`); the scan
    elsewhere (Pallas runs interpreted off-GPU)."""
    return "fused" if on_gpu() else "scan"


def fill_tiles(tiles, payload, bpc, *, params: FillParams, fill_impl: str = "auto",
               walk: str = "auto"):
    """The walk: "scan", "pallas" (interpret mode off-GPU) or "auto" (pallas on GPU).
    tiles: int32 [S, 8] (TILE_FIELDS) -> int32 [S, 2] (FILL_STATE_FIELDS, before each tile).
    walk: how the Pallas fill gets there (`decode_fill_pallas.walk_or_chase`)."""
    if fill_impl == "auto":
        fill_impl = "pallas" if on_gpu() else "scan"
    if fill_impl == "scan":
        return fill_tiles_scan(tiles, payload, bpc, params=params)
    if fill_impl == "pallas":
        return fill_tiles_pallas(tiles, payload, bpc, params=params, walk=walk)
    raise ValueError(f"fill_impl must be 'scan', 'pallas' or 'auto', got {fill_impl!r}")


# ---------------------------------------------------------------------------------------------
# Vectorised parts.


def _check_inputs(qo_indptr, kv_indptr, kv_last_page_lens):
    """Ranks, shapes and dtypes (trace time); returns the inputs as int32 and the batch size."""
    out = []
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_last_page_lens", kv_last_page_lens)):
        if np.ndim(x) != 1:
            raise ValueError(f"{name} must be a vector, got shape {np.shape(x)}")
        out.append(to_int32(x, name))
    qo_indptr, kv_indptr, kv_last_page_lens = out
    b = kv_indptr.shape[0] - 1
    if b < 1:
        raise ValueError(f"kv_indptr must have batch_size + 1 >= 2 entries, got {kv_indptr.shape}")
    if qo_indptr.shape != kv_indptr.shape:
        raise ValueError(f"qo_indptr shape {qo_indptr.shape} != kv_indptr shape {kv_indptr.shape}")
    if kv_last_page_lens.shape != (b,):
        raise ValueError(f"kv_last_page_lens must have shape ({b},), got {kv_last_page_lens.shape}")
    return qo_indptr, kv_indptr, kv_last_page_lens, b


def check_decode_plan_inputs(qo_indptr: jax.Array, kv_indptr: jax.Array,
                             kv_last_page_lens: jax.Array, *, config: DecodePlanConfig) -> None:
    """checkify value checks of `plan_mla_decode`'s inputs (int32 [B+1], [B+1], [B]); run them
    under jit with `funcmla.checks.checked`. Eager calls of `plan_mla_decode` run the same checks
    in NumPy by default.

    kv_indptr (and qo_indptr unless uni_seqlen_qo > 0) start at 0, never decrease and never wrap
    past the int32 limit; with qo splits and a ragged qo_indptr, 1 <= qo_len <= max_seqlen_qo;
    with page_size > 1, 1 <= kv_last_page_lens <= page_size for non-empty requests and each
    request's length in tokens fits int32 (kv_offset counts tokens); kv_indptr[-1] leaves room to
    round up to a whole block; the batch's total cost in blocks fits int32.
    """
    _decode_input_checks(TRACED, qo_indptr, kv_indptr, kv_last_page_lens, config=config)


def _decode_input_checks(c: Checker, qo_indptr, kv_indptr, kv_last_page_lens, *,
                         config: DecodePlanConfig) -> None:
    cfg = config
    xp = c.xp
    check_no_wrap(c, kv_indptr, "kv_indptr")
    check_indptr(kv_indptr, "kv_indptr", checker=c)
    if not cfg.uniform_qo:
        check_no_wrap(c, qo_indptr, "qo_indptr")
        check_indptr(qo_indptr, "qo_indptr", checker=c)
        if cfg.qo_splits:
            qo_len = qo_indptr[1:] - qo_indptr[:-1]
            bad = (qo_len < 1) | (qo_len > cfg.max_seqlen_qo)
            b = xp.argmax(bad).astype(xp.int32)
            c.check(~xp.any(bad),
                    f"qo_indptr[{{b1}}] - qo_indptr[{{b}}] = {{q}} query tokens: must be in "
                    f"[1, max_seqlen_qo={cfg.max_seqlen_qo}]", b1=b + 1, b=b, q=qo_len[b])
    gran_room = INT32_MAX - (cfg.kv_granularity - 1)
    c.check(kv_indptr[-1] <= gran_room,
            f"total kv length {{v}} (kv_indptr[-1]) exceeds {gran_room}: the int32 limit "
            f"{INT32_MAX} of work_info less kv_granularity - 1 (the planner rounds up to "
            "whole blocks)", v=kv_indptr[-1])
    entries = kv_indptr[1:] - kv_indptr[:-1]
    if cfg.page_size > 1:
        last = kv_last_page_lens
        bad = (entries > 0) & ((last < 1) | (last > cfg.page_size))
        b = xp.argmax(bad).astype(xp.int32)
        c.check(~xp.any(bad),
                f"kv_last_page_lens[{{b}}] = {{v}} must be in [1, page_size={cfg.page_size}]",
                b=b, v=last[b])
        room = (INT32_MAX - xp.clip(last, 1, cfg.page_size)) // cfg.page_size
        bad = entries - 1 > room
        b = xp.argmax(bad).astype(xp.int32)
        c.check(~xp.any(bad),
                f"request {{b}} has {{e}} pages of page_size={cfg.page_size} tokens: its "
                f"length in tokens exceeds the int32 limit {INT32_MAX} of work_info "
                "(kv_offset counts tokens)", b=b, e=entries[b])
    tl = decode_tiles(qo_indptr, kv_indptr, config=cfg, xp=xp)
    check_prefix_sums_fit(c, xp.where(tl["valid"], tl["n"] + cfg.overhead, 0),
                          "the batch's total cost in blocks (each tile's blocks + overhead)")


def decode_tiles(qo_indptr, kv_indptr, *, config: DecodePlanConfig,
                 xp=jnp) -> dict[str, jax.Array]:
    """Per tile slot (folded batch b, qo tile t), row-major, int32 [S]: the planner's view.

    Keys: valid, batch (folded b), req (b // ratio), kv_begin, kv_end (kv_indices entries,
    relative to kv_indptr[0]), kv_len, n (blocks), qo_tile_size, qo_start, qo_end,
    batch_tail (causal kv trim, entries). `xp`: jax.numpy, or numpy for the eager input checks.
    """
    cfg = config
    b_req = kv_indptr.shape[0] - 1
    ratio, slots = cfg.qk_batch_ratio, cfg.tile_slots_per_batch
    s = xp.arange(b_req * ratio * slots, dtype=xp.int32)
    b = s // slots
    t = s % slots
    req = b // ratio
    kv_begin = kv_indptr[req] - kv_indptr[0]
    kv_end = kv_indptr[req + 1] - kv_indptr[0]
    kv_len = kv_end - kv_begin
    if cfg.uniform_qo:
        uni = cfg.uni_seqlen_qo
        seqlen = xp.full_like(b, uni)
        qo_begin, qo_end_b = uni * b, uni * (b + 1)
    else:  # ratio == 1 here (checked by the config)
        qo_begin, qo_end_b = qo_indptr[b], qo_indptr[b + 1]
        seqlen = qo_end_b - qo_begin
    if not cfg.qo_splits:
        ntiles = xp.ones_like(b)
    elif cfg.planner_num_heads * 2 > cfg.packed_qo_len_per_wg:
        ntiles = seqlen
    else:
        wg = cfg.packed_qo_len_per_wg
        ntiles = (seqlen * cfg.planner_num_heads + wg - 1) // wg
    valid = t < ntiles
    ts = (seqlen + xp.maximum(ntiles, 1) - 1) // xp.maximum(ntiles, 1)
    qo_start = qo_begin + t * ts
    qo_end = xp.minimum(qo_start + ts, qo_end_b)
    if cfg.page_size == 1 and cfg.is_causal:
        if ratio == 1:
            bt = ntiles - 1 - t
        else:
            bt = ntiles - (qo_start // ratio) % cfg.uni_seqlen_qo - 1
        bt = xp.maximum(bt, 0)
    else:
        bt = xp.zeros_like(b)
    gran_log2 = cfg.kv_granularity.bit_length() - 1
    n = (kv_len + cfg.kv_granularity - 1) >> gran_log2
    return dict(valid=valid, batch=b, req=req, kv_begin=kv_begin, kv_end=kv_end, kv_len=kv_len,
                n=n, qo_tile_size=ts, qo_start=qo_start, qo_end=qo_end, batch_tail=bt)


def plan_mla_decode(
    qo_indptr: jax.Array,
    kv_indptr: jax.Array,
    kv_last_page_lens: jax.Array,
    *,
    config: DecodePlanConfig,
    batch_size: int | None = None,
    fill_impl: str = "auto",
    walk: str = "auto",
    num_requests: jax.Array | None = None,
) -> WorkPlan:
    """AITER `get_mla_metadata_v1` (fast mode) as a pure function. jit with config, batch_size,
    fill_impl and walk static.

    qo_indptr:         int32 [B+1] query tokens (ignored when config.uni_seqlen_qo > 0).
    kv_indptr:         int32 [B+1] kv_indices entries (tokens if page_size 1, else pages);
                       kv_indptr[0] must be 0.
    kv_last_page_lens: int32 [B]   tokens in each request's last page (page_size > 1 only).
    batch_size:        request capacity the buffers are sized for (>= B; default B), as in
                       `get_mla_metadata_info_v1(batch_size, ...)`.
    fill_impl:         "scan" | "pallas" (walk only) | "fused" (walk, then everything after
                       it, as two Pallas programs) | "auto" (`default_fill_impl`).
    walk:              for the Pallas fills: "auto" (the chase over events where it pays
                       off, decided in the kernel) | "chase" | "tiles" (one step per tile);
                       see `decode_fill_pallas.walk_or_chase`. Same plan either way.
    num_requests:      optional int32 [] (traced): only requests [0, num_requests) are live;
                       the rest are padding (a shape bucket) and get no tiles, so the plan is
                       the plan of the live prefix (buffers keep the padded sizes; the
                       parallel/serial choice stays the padded batch's).

    Returns a WorkPlan (kind="decode", block_size=page_size) whose buffers have the shapes of
    `mla_decode_plan_sizes(batch_size, config)`. Unused tails are zero (AITER leaves them
    untouched). Checked at trace time: ranks, dtypes, shapes. Values (`check_decode_plan_inputs`:
    well-formed indptrs, qo and last-page lengths, int32 limits) are checked when the inputs are
    concrete (an eager call; host integers of any width are accepted when they fit int32); under
    jit run `funcmla.checks.checked(check_decode_plan_inputs)` for them. An eager call then runs
    the jitted planner (`plan_mla_decode_jit`), compiled once per static arguments and shapes.
    """
    cfg = config
    if not isinstance(cfg, DecodePlanConfig):
        raise TypeError(f"config must be a DecodePlanConfig, got {type(cfg).__name__}")
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    if fill_impl not in FILL_IMPLS:
        raise ValueError(f"fill_impl must be one of {FILL_IMPLS}, got {fill_impl!r}")
    concrete = is_concrete(qo_indptr, kv_indptr, kv_last_page_lens)
    qo_indptr, kv_indptr, kv_last_page_lens, b_req = _check_inputs(
        qo_indptr, kv_indptr, kv_last_page_lens)
    if batch_size is not None and batch_size < b_req:
        raise ValueError(
            f"batch_size={batch_size} is smaller than the batch in kv_indptr ({b_req})")
    if concrete:  # eager call: check the values (under jit: the checkify variant), then plan
        _decode_input_checks(EAGER, *(np.asarray(x) for x in
                                      (qo_indptr, kv_indptr, kv_last_page_lens)), config=cfg)
        return plan_mla_decode_jit(qo_indptr, kv_indptr, kv_last_page_lens, config=cfg,
                                   batch_size=batch_size, fill_impl=fill_impl, walk=walk)
    batch_size = b_req if batch_size is None else batch_size
    sizes = mla_decode_plan_sizes(batch_size, cfg)
    num_cu, max_work = sizes.num_cu, sizes.max_work
    tile_cnt, max_split_tiles = sizes.tile_cnt, sizes.max_split_tiles
    ov, gran = cfg.overhead, cfg.kv_granularity
    page1 = cfg.page_size == 1
    i32 = jnp.int32

    tl = decode_tiles(qo_indptr, kv_indptr, config=cfg)
    if num_requests is not None:
        tl = dict(tl, valid=tl["valid"] & (tl["req"] < num_requests))
    valid, n = tl["valid"], tl["n"]
    num_slots = n.shape[0]

    # Payload per cluster and blocks per fresh cluster.
    sum_blocks = jnp.sum(jnp.where(valid, n + ov, 0))
    num_splits = cfg.num_splits(b_req)
    if num_requests is not None and cfg.max_split_per_batch > 0:
        num_splits = jnp.minimum(cfg.num_cu, cfg.max_split_per_batch * cfg.qk_batch_ratio
                                 * jnp.maximum(num_requests, 1))
    payload = (sum_blocks + num_splits - 1) // num_splits + ov
    bpc = payload - ov

    # Tail rule (page_size 1): a cut at block e ends the tile if it leaves < msq tokens.
    thr = cfg.tail_done_threshold
    kv_len, bt = tl["kv_len"], tl["batch_tail"]
    gran_log2 = gran.bit_length() - 1
    e_min = jnp.where(kv_len >= thr, ((kv_len - thr) >> gran_log2) + 1, 0)
    e_min = jnp.where((bt < thr) & page1, e_min, NEVER)
    all_valid = cfg.all_slots_valid and num_requests is None
    params = FillParams(overhead=ov, parallel=cfg.planner(b_req) == "parallel",
                        tail_rule=page1 and thr > 1, empty_slots=not all_valid)
    tiles = fill_inputs(jnp.where(valid, n, -1), e_min, payload, bpc, params=params)
    if fill_impl == "auto":
        fill_impl = default_fill_impl()
    if fill_impl == "fused":
        return _plan_tail_fused(tl, tiles, payload, bpc, kv_last_page_lens, params=params,
                                cfg=cfg, sizes=sizes, walk=walk, all_slots_valid=all_valid)
    states = fill_tiles(tiles, payload, bpc, params=params, fill_impl=fill_impl, walk=walk)
    _, _, (c0, f, m, _) = fill_step(params, payload, bpc, states[:, 0], states[:, 1],
                                    tuple(tiles.T))

    # Fragments -> works (work order = tile order, then fragment order).
    split = m > 1
    ts = tl["qo_tile_size"]
    works_incl = jnp.cumsum(m, dtype=i32)
    num_works = works_incl[-1]
    works_before = works_incl - m
    red_cnt = jnp.where(split, m, 0)
    red_incl = jnp.cumsum(red_cnt, dtype=i32)
    red_before = red_incl - red_cnt
    num_partials = red_incl[-1]
    partial_before = jnp.cumsum(red_cnt * ts, dtype=i32) - red_cnt * ts

    w = jnp.arange(max_work, dtype=i32)
    slot = jnp.minimum(searchsorted_i32(works_incl, w, "right"), num_slots - 1)
    live = w < num_works
    j = w - works_before[slot]
    m_w, f_w = m[slot], f[slot]
    lpl = None if page1 else kv_last_page_lens[tl["req"][slot]]
    kv_start, kv_stop, kv_offset = fragment_kv_span(
        j, m_w, f_w, tl["kv_begin"][slot], tl["kv_end"][slot], bt[slot], lpl, bpc=bpc,
        gran=gran, page_size=cfg.page_size)
    partial_qo_loc = jnp.where(split[slot], partial_before[slot] + j * ts[slot], -1)
    cols = [tl["batch"][slot], partial_qo_loc, tl["qo_start"][slot], tl["qo_end"][slot],
            kv_start, kv_stop, kv_offset, jnp.zeros_like(w)]
    work_info = jnp.where(live[:, None], jnp.stack(cols, axis=1), 0).astype(i32)

    cluster = jnp.where(live, c0[slot] + j, np.iinfo(np.int32).max)
    work_indptr = jnp.concatenate(
        [jnp.zeros((1,), i32), searchsorted_i32(cluster, jnp.arange(num_cu, dtype=i32), "right")])

    # Reduce maps, indexed by global qo tile (valid slots in order).
    if all_valid:
        tile_slot = jnp.arange(min(tile_cnt, num_slots), dtype=i32)
        num_tiles = jnp.int32(num_slots)
    else:
        valid_incl = jnp.cumsum(valid.astype(i32), dtype=i32)
        num_tiles = valid_incl[-1]
        k = jnp.arange(tile_cnt, dtype=i32)
        tile_slot = jnp.minimum(searchsorted_i32(valid_incl, k + 1, "left"), num_slots - 1)
    k = jnp.arange(tile_slot.shape[0], dtype=i32)
    tile_live = k < num_tiles
    ri_tile = jnp.where(tile_live, red_incl[tile_slot], num_partials)
    reduce_indptr = jnp.full((tile_cnt + 1,), num_partials, i32)
    reduce_indptr = reduce_indptr.at[0].set(0).at[1:1 + tile_slot.shape[0]].set(ri_tile)
    final_live = tile_live & split[tile_slot]
    fm = jnp.stack([tl["qo_start"][tile_slot], tl["qo_end"][tile_slot]], axis=1)
    reduce_final_map = jnp.zeros((tile_cnt, 2), i32)
    reduce_final_map = reduce_final_map.at[:tile_slot.shape[0]].set(
        jnp.where(final_live[:, None], fm, 0))

    p = jnp.arange(max_split_tiles, dtype=i32)
    pslot = jnp.minimum(searchsorted_i32(red_incl, p, "right"), num_slots - 1)
    reduce_partial_map = jnp.where(
        p < num_partials, partial_before[pslot] + (p - red_before[pslot]) * ts[pslot], 0)

    return WorkPlan(
        work_indptr=work_indptr,
        work_info=work_info,
        reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map,
        reduce_partial_map=reduce_partial_map.astype(i32),
        num_works=num_works,
        num_partials=num_partials,
        kind="decode",
        block_size=cfg.page_size,
    )


def _plan_tail_fused(tl, tiles, payload, bpc, kv_last_page_lens, *, params, cfg, sizes, walk,
                     all_slots_valid):
    """The walk and everything after it as Pallas programs (decode_fused_pallas)."""
    lpl = (jnp.zeros_like(tl["req"]) if cfg.page_size == 1
           else kv_last_page_lens[tl["req"]])
    info = jnp.stack([tl["batch"], lpl, tl["kv_begin"], tl["kv_end"], tl["batch_tail"],
                      tl["qo_tile_size"], tl["qo_start"], tl["qo_end"],
                      tl["valid"].astype(jnp.int32)], axis=1).astype(jnp.int32)
    (work_indptr, work_info, reduce_indptr, reduce_final_map, reduce_partial_map, num_works,
     num_partials, _) = plan_tail_pallas(
        tiles, info, payload, bpc, params=params, sizes=sizes, page_size=cfg.page_size,
        kv_granularity=cfg.kv_granularity, all_slots_valid=all_slots_valid, walk=walk)
    return WorkPlan(work_indptr=work_indptr, work_info=work_info, reduce_indptr=reduce_indptr,
                    reduce_final_map=reduce_final_map, reduce_partial_map=reduce_partial_map,
                    num_works=num_works, num_partials=num_partials, kind="decode",
                    block_size=cfg.page_size)


# `plan_mla_decode` under `jax.jit` (config, batch_size, fill_impl and walk static).
plan_mla_decode_jit = jax.jit(plan_mla_decode,
                              static_argnames=("config", "batch_size", "fill_impl", "walk"))
