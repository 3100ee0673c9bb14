"""Test oracle: AITER's v1.2 decode planner restated as a plain serial NumPy loop.

This follows the serial planner (`kn_get_mla_metadata_v1_2` in v1_2_device.cuh): walk clusters in
order, fill each with tiles until its payload is spent, cut tiles that do not fit. With `planner ==
"parallel"` it also reproduces the one way the parallel planner differs: a zero-length KV tile met
on an abandoned cluster yields no work.
It shares only the static host-side decisions (DecodePlanConfig properties) with the JAX planner,
not its closed-form algebra. Unused buffer tails are zero.
"""

from __future__ import annotations

import numpy as np

from funcmla.planners.decode_config import DecodePlanConfig
from funcmla.planners.decode_sizes import mla_decode_plan_sizes
from funcmla.planners.plan import WorkPlan

__all__ = ["plan_mla_decode_reference"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def plan_mla_decode_reference(qo_indptr, kv_indptr, kv_last_page_lens, *,
                              config: DecodePlanConfig, batch_size: int | None = None,
                              planner: str | None = None) -> WorkPlan:
    """Serial restatement of `get_mla_metadata_v1` (fast mode). NumPy in, NumPy WorkPlan out.

    `planner` overrides `config.planner(B)` ("parallel" or "serial").
    """
    cfg = config
    qo_indptr = np.asarray(qo_indptr, np.int64)
    kv_indptr = np.asarray(kv_indptr, np.int64)
    last_page = np.asarray(kv_last_page_lens, np.int64)
    num_req = len(kv_indptr) - 1
    sizes = mla_decode_plan_sizes(batch_size or num_req, cfg)
    planner = planner or cfg.planner(num_req)
    ratio, ov, gran = cfg.qk_batch_ratio, cfg.overhead, cfg.kv_granularity
    page_size = cfg.page_size
    uni, thr = cfg.uni_seqlen_qo, cfg.tail_done_threshold
    num_batches = num_req * ratio

    def seqlen(b):
        return uni if uni > 0 else int(qo_indptr[b + 1] - qo_indptr[b])

    def qo_begin(b):
        return uni * b if uni > 0 else int(qo_indptr[b])

    def qo_end(b):
        return uni * (b + 1) if uni > 0 else int(qo_indptr[b + 1])

    def kv_range(b):  # folded sub-batches share their request's KV
        r = b // ratio
        return int(kv_indptr[r] - kv_indptr[0]), int(kv_indptr[r + 1] - kv_indptr[0])

    def nblocks(b):
        kb, ke = kv_range(b)
        return _cdiv(ke - kb, gran)

    sum_blocks = sum((nblocks(b) + ov) * cfg.num_qo_tiles(seqlen(b)) for b in range(num_batches))
    payload = _cdiv(sum_blocks, cfg.num_splits(num_req)) + ov

    work_info = np.zeros(sizes.work_info, np.int32)
    work_indptr = np.zeros(sizes.work_indptr, np.int32)
    reduce_indptr = np.zeros(sizes.reduce_indptr, np.int32)
    reduce_final_map = np.zeros(sizes.reduce_final_map, np.int32)
    reduce_partial_map = np.zeros(sizes.reduce_partial_map, np.int32)

    b, t, k, ns, tail_done = 0, 0, 0, 0, False  # batch, qo tile, kv blocks done, splits so far
    num_works = partial_idx = tile_counter = last_ri = 0
    for c in range(cfg.num_cu):
        remain = payload
        while b < num_batches:
            kb, ke = kv_range(b)
            tiles = cfg.num_qo_tiles(seqlen(b))
            ts = _cdiv(seqlen(b), tiles)
            qs = qo_begin(b) + t * ts
            qe = min(qs + ts, qo_end(b))
            n = _cdiv(ke - kb, gran)
            rb = n - k  # blocks of this tile still to place
            if ratio == 1:
                bt = tiles - 1 - t
            else:
                bt = tiles - (qs // ratio) % uni - 1
            bt = max(bt, 0) if cfg.is_causal else 0
            kv_s = kb + k * gran

            def kv_offset(kv_e):  # KV tokens of the batch after kv_e
                if page_size == 1:
                    return ke - kv_e
                return 0 if kv_e == ke else (ke - kv_e - 1) * page_size + int(last_page[b])

            if remain >= rb + ov or tail_done:  # the rest of the tile fits: final fragment
                if page_size == 1:
                    kv_e = min(kv_s + rb * gran, ke - bt)
                    if 0 < ke - kv_e < thr or tail_done:
                        kv_e = min(ke - bt, ke)
                else:
                    kv_e = min(kv_s + rb * gran, ke)
                row = [b, -1, qs, qe, kv_s, kv_e, kv_offset(kv_e), 0]
                if ns > 0:  # split tile: last fragment + its reduce group
                    row[1] = partial_idx
                    reduce_indptr[tile_counter + 1] = last_ri + ns + 1
                    reduce_final_map[tile_counter] = (qs, qe)
                    for s in range(ns + 1):
                        reduce_partial_map[last_ri + s] = partial_idx - (ns - s) * ts
                    partial_idx += ts
                    last_ri += ns + 1
                else:
                    reduce_indptr[tile_counter + 1] = last_ri
                work_info[num_works] = row
                num_works += 1
                tile_counter += 1
                remain -= rb + ov
                t = (t + 1) % tiles if cfg.qo_splits else 0
                if t == 0:
                    b += 1
                k, ns, tail_done = 0, 0, False
            elif planner == "parallel" and n == 0 and remain <= ov:
                # parallel planner: a zero-length tile on an abandoned cluster emits nothing
                reduce_indptr[tile_counter + 1] = last_ri
                tile_counter += 1
                b += 1
                remain = 0
            else:
                if remain > ov:  # cut: this cluster takes what it can
                    cons = remain - ov
                    kv_e = min(kv_s + cons * gran, ke - bt if page_size == 1 else ke)
                    if page_size == 1 and ke - kv_e < thr:
                        tail_done = True  # a short KV tail stays with this fragment
                    else:
                        work_info[num_works] = [b, partial_idx, qs, qe, kv_s, kv_e,
                                                kv_offset(kv_e), 0]
                        num_works += 1
                        partial_idx += ts
                        k += cons
                        ns += 1
                if not tail_done:
                    break  # cluster closed
        work_indptr[c + 1] = num_works
    assert b == num_batches, "planner ran out of clusters"  # cannot happen (docs §4.8.6)
    reduce_indptr[tile_counter:] = last_ri

    return WorkPlan(
        work_indptr=work_indptr,
        work_info=work_info,
        reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map,
        reduce_partial_map=reduce_partial_map,
        num_works=np.int32(num_works),
        num_partials=np.int32(last_ri),
        kind="decode",
        block_size=page_size,
    )
