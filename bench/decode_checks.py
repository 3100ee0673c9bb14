"""The decode benchmark's correctness checks on the GPU: a sweep over head counts, s_q 1 to 4,
page sizes 1/16/64 and split counts on ragged lengths with zero-length sequences and NaN in
every unused pool row (`--check`), and pool rows past 2**31 / 576 slots (`--big-pool`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas import mla_decode
from funcmla.layout import PageTable

from .decode_data import D, SM_SCALE
from .decode_reference import np_reference
from .report import log

__all__ = ["big_pool_check", "correctness_sweep"]


def correctness_sweep(rng: np.random.Generator, results: dict) -> bool:
    """`mla_decode` against float64 NumPy in every case (out within 1e-2, lse, +inf and 0 for
    empty sequences, nothing from a NaN row); True when all pass. Into results["correctness"]."""
    log("== correctness sweep (GPU, vs float64 numpy)")
    worst = 0.0
    fails = []
    cases = []  # every head count x s_q, page sizes 1/16/64 in rotation (each seen 5-6 times)
    for h in (16, 32, 64, 128):
        for s_q in (1, 2, 3, 4):
            cases.append((h, s_q, (1, 16, 64)[len(cases) % 3]))
    for h, s_q, page_size in cases:
        b = 5
        lens = rng.integers(0, 700, size=b)
        lens[1] = 0
        lens[2] = max(lens[2], 1)
        max_pages = -(-int(lens.max()) // page_size) + 1
        n_pages = b * max_pages + 1
        slots = n_pages * page_size
        pool = rng.standard_normal((slots, D)).astype(np.float32)
        pool[:page_size] = np.nan  # reserved page / padding target
        q = rng.standard_normal((b * s_q, h, D)).astype(np.float32)
        page_perm = rng.permutation(np.arange(1, n_pages)).astype(np.int32)
        table = page_perm[: b * max_pages].reshape(b, max_pages).copy()
        slot_lists = []
        for i in range(b):
            np_ = -(-int(lens[i]) // page_size)
            table[i, np_:] = 0  # padded entries
            pos = np.arange(lens[i])
            slot_lists.append(table[i, pos // page_size] * page_size + pos % page_size)
        # poison rows not used by any sequence
        used = np.zeros(slots, bool)
        for sl in slot_lists:
            used[sl] = True
        pool[~used] = np.nan
        qb = jnp.asarray(q, jnp.bfloat16)
        pb = jnp.asarray(pool, jnp.bfloat16)
        ref_o, ref_l = np_reference(qb, pb, slot_lists, s_q, SM_SCALE)
        for ns in (None, 1, 3):
            if page_size == 1:
                indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
                ind = np.zeros(int(indptr[-1]) + 37, np.int32)
                ind[: indptr[-1]] = np.concatenate(slot_lists) if indptr[-1] else []
                meta = dict(kv_indptr=jnp.asarray(indptr), kv_indices=jnp.asarray(ind))
            else:
                meta = dict(page_table=PageTable(jnp.asarray(table), jnp.asarray(
                    lens.astype(np.int32)), page_size))
            o, lse = mla_decode(qb, pb, **meta, sm_scale=SM_SCALE, s_q=s_q, num_splits=ns)
            o = np.asarray(jnp.asarray(o, jnp.float32), np.float64)
            lse = np.asarray(lse, np.float64)
            live = np.isfinite(ref_l)
            err = np.linalg.norm(o - ref_o) / np.linalg.norm(ref_o)
            ok = (np.isfinite(o).all() and err < 1e-2
                  and np.allclose(lse[live], ref_l[live], atol=2e-2, rtol=1e-3)
                  and (lse[~live] == np.inf).all() and (o[~live] == 0).all())
            worst = max(worst, err)
            if not ok:
                fails.append(dict(h=h, s_q=s_q, page_size=page_size, ns=ns, err=float(err)))
    log(f"   {len(cases) * 3} runs, worst rel err {worst:.2e}, failures {len(fails)}: {fails[:5]}")
    results["correctness"] = dict(runs=len(cases) * 3, worst_rel_err=worst, failures=fails)
    return not fails


def big_pool_check(results: dict) -> bool:
    """Slots past 2**31 / 576 (the int32 element-offset limit) are addressed correctly."""
    log("== big-pool check")
    limit = 2**31 // D
    slots = limit + 70_000
    pool = jnp.zeros((slots, D), jnp.bfloat16)
    key = jax.random.PRNGKey(7)
    high = jax.random.normal(key, (64, D), jnp.bfloat16)
    start = slots - 64
    pool = jax.lax.dynamic_update_slice(pool, high, (start, 0))
    q = jax.random.normal(jax.random.fold_in(key, 1), (1, 16, D), jnp.bfloat16)
    indptr = jnp.array([0, 64], jnp.int32)
    ind = jnp.arange(start, slots, dtype=jnp.int32)
    o, lse = mla_decode(q, pool, kv_indptr=indptr, kv_indices=ind, sm_scale=SM_SCALE)
    ref_o, ref_l = np_reference(q, high, [np.arange(64)], 1, SM_SCALE)
    err = float(np.linalg.norm(np.asarray(o, np.float64) - ref_o) / np.linalg.norm(ref_o))
    log(f"   pool {slots} slots ({slots * D * 2 / 2**30:.2f} GiB), rows >= {start}: rel err "
        f"{err:.2e}")
    results["big_pool"] = dict(slots=slots, pool_gib=slots * D * 2 / 2**30, rel_err=err)
    del pool
    return err < 1e-2
