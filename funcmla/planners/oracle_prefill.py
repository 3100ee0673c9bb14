"""Plain serial NumPy restatement of AITER's prefill planner `get_ps_metadata_v1` (the test oracle).

It follows `kn_generate_ps_metadata` / `generate_reduce_info` (`v1_2_host.cuh`)
loop for loop: no vectorisation, no cleverness, so that the jitted planner in
`funcmla.planners.prefill` can be checked against it field by field.

Units: `qo_indptr` and `context_lens` count tokens; `kv_indptr` ("pages_kv_indptr") counts
entries of `block_size` tokens; `kv_start` / `kv_end` of a work are such entries.

A hand-worked example (8 TGs, lens [600, 300], causal): it is reproduced by
`num_cu=8, num_heads_k=1, gqa_ratio=1, qhead_granularity=1, qlen_granularity=256,
kvlen_granularity=128, block_size=1, max_qlen=600`, with `qo_indptr = kv_indptr = [0, 600, 900]`
and `context_lens = [600, 300]`. Batch 0's tiles are visited [0,256), [512,600), [256,512) and cost
2, 5, 4 units of 128 tokens; batch 1's cost 2, 3: 16 units, 2 per TG. Four tiles are split
(3, 3, 2, 2 fragments) and `reduce_indptr = [0, 3, 6, 8, 10, 10, 10]`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ps_prefill_sizes_oracle", "ps_prefill_plan_oracle"]


def ps_prefill_sizes_oracle(batch_size, num_heads_k, max_qlen, qlen_granularity, num_cu):
    """`get_ps_metadata_info_v1`: (max_works, num_tiles, max_partials)."""
    num_clusters = math.gcd(num_heads_k, num_cu)
    cus_per_cluster = num_cu // num_clusters
    max_qo_split = math.ceil(max_qlen / qlen_granularity)
    num_tiles = batch_size * max_qo_split
    max_works = (batch_size + cus_per_cluster - 1) * max_qo_split * num_heads_k
    max_partials = min(batch_size + cus_per_cluster - 1, (cus_per_cluster - 1) * 2) * max_qo_split
    return max_works, num_tiles, max_partials


def _plan_one_cluster(qo_indptr, kv_indptr, context_lens, *, cluster_id, kheads, tgs,
                      qhead_granularity, qlen_granularity, kvlen_granularity, block_size,
                      is_causal, work_indptr, works):
    assert kvlen_granularity % block_size == 0
    blocks_per_unit = kvlen_granularity // block_size
    batch_size = len(qo_indptr) - 1

    # Step 1: query tiles, visited ping-pong within a batch (0, n-1, 1, n-2, ...).
    tiles = []  # (batch, qo_start, qo_end, num_blocks, effective_kv_len)
    total_units = 0
    for b in range(batch_size):
        qo_len = qo_indptr[b + 1] - qo_indptr[b]
        kv_len = context_lens[b]
        ranges = [(s, min(s + qlen_granularity, qo_len)) for s in range(0, qo_len, qlen_granularity)]
        n = len(ranges)
        for i in range(n):
            idx = i // 2 if i % 2 == 0 else n - 1 - i // 2
            lo, hi = ranges[idx]
            eff = min(kv_len - qo_len + hi, kv_len) if is_causal else kv_len
            assert eff >= 0, "context_lens must be >= the query length"
            units = -(-eff // kvlen_granularity)
            tiles.append((b, qo_indptr[b] + lo, qo_indptr[b] + hi, units * blocks_per_unit, eff))
            total_units += units
    average, remainder = divmod(total_units, tgs)

    # Step 2: greedy fill of the thread groups, the same split duplicated for each k head.
    tile_idx = block_idx = partial_idx = 0
    for tg in range(tgs):
        for kh_off in range(kheads):
            kh = cluster_id * kheads + kh_off
            q_head_range = (((kh + 1) * qhead_granularity) << 16) | ((kh * qhead_granularity) & 0xFFFF)
            saved = (tile_idx, block_idx, partial_idx)
            cap = (average + 1 if tg < remainder else average) * blocks_per_unit
            while tile_idx < len(tiles) and cap > 0:
                b, qs, qe, num_blocks, eff = tiles[tile_idx]
                rem_blocks = num_blocks - block_idx
                rem_kv = eff - block_idx * block_size
                kv_s = block_idx + kv_indptr[b]
                if rem_kv <= cap * block_size:  # finish the tile
                    if block_idx == 0:
                        ploc = -1
                    else:
                        ploc = qlen_granularity * partial_idx
                        partial_idx += 1
                    kv_e = min(kv_s + rem_blocks, kv_indptr[b + 1])
                    works.append([b, ploc, qs, qe, kv_s, kv_e, 0, q_head_range])
                    tile_idx += 1
                    block_idx = 0
                    cap -= rem_blocks
                else:  # cut the tile where this TG's capacity ends
                    ploc = qlen_granularity * partial_idx
                    partial_idx += 1
                    kv_e = min(kv_s + cap, kv_indptr[b + 1])
                    kv_off = context_lens[b] - (kv_e - kv_indptr[b]) * block_size
                    works.append([b, ploc, qs, qe, kv_s, kv_e, kv_off, q_head_range])
                    block_idx += cap
                    cap = 0
            if kh_off != kheads - 1:
                tile_idx, block_idx, partial_idx = saved
        work_indptr[cluster_id * tgs + tg + 1] = len(works)


def ps_prefill_plan_oracle(qo_indptr, kv_indptr, context_lens, *, num_cu, num_heads_k, gqa_ratio,
                           qhead_granularity, qlen_granularity, kvlen_granularity, block_size,
                           is_causal, max_qlen):
    """Returns a dict of int32 NumPy arrays named like `WorkPlan`'s fields, sized as
    `get_ps_metadata_info_v1` sizes them, unused tails zero (as the host planner leaves them).

    `gqa_ratio` does not change the plan (AITER passes it through unused); it is accepted so the
    argument list matches the upstream call.
    """
    del gqa_ratio
    qo_indptr = [int(x) for x in qo_indptr]
    kv_indptr = [int(x) for x in kv_indptr]
    context_lens = [int(x) for x in context_lens]
    batch_size = len(qo_indptr) - 1
    assert max(np.diff(qo_indptr), default=0) <= max_qlen, "a query is longer than max_qlen"
    max_works, num_tiles, max_partials = ps_prefill_sizes_oracle(
        batch_size, num_heads_k, max_qlen, qlen_granularity, num_cu)

    num_clusters = math.gcd(num_heads_k, num_cu)
    tgs = num_cu // num_clusters
    kheads = num_heads_k // num_clusters
    work_indptr = [0] * (num_cu + 1)
    works = []
    for cluster_id in range(num_clusters):
        _plan_one_cluster(qo_indptr, kv_indptr, context_lens, cluster_id=cluster_id, kheads=kheads,
                          tgs=tgs, qhead_granularity=qhead_granularity,
                          qlen_granularity=qlen_granularity, kvlen_granularity=kvlen_granularity,
                          block_size=block_size, is_causal=is_causal, work_indptr=work_indptr,
                          works=works)
    assert len(works) == work_indptr[-1] <= max_works

    # Reduce info: split works grouped by (qo_start, qo_end) in lexicographic order, the partial
    # locations of a group de-duplicated (across k heads) and sorted.
    groups: dict[tuple[int, int], set[int]] = {}
    for w in works:
        if w[1] != -1:
            groups.setdefault((w[2], w[3]), set()).add(w[1])
    reduce_indptr = np.zeros(num_tiles + 1, np.int32)
    reduce_final_map = np.zeros((num_tiles, 2), np.int32)
    reduce_partial_map = np.zeros(max_partials, np.int32)
    count = 0
    for g, key in enumerate(sorted(groups)):
        locs = sorted(groups[key])
        reduce_final_map[g] = key
        reduce_partial_map[count : count + len(locs)] = locs
        count += len(locs)
        reduce_indptr[g + 1] = count
    reduce_indptr[len(groups) + 1 :] = count

    work_info = np.zeros((max_works, 8), np.int32)
    if works:
        work_info[: len(works)] = np.asarray(works, np.int64).astype(np.int32)
    return dict(
        work_indptr=np.asarray(work_indptr, np.int32),
        work_info=work_info,
        reduce_indptr=reduce_indptr,
        reduce_final_map=reduce_final_map,
        reduce_partial_map=reduce_partial_map,
        num_works=np.int32(len(works)),
        num_partials=np.int32(count),
    )
