"""Validators for any `WorkPlan` (decode or prefill) against the metadata it will be run with.

Two front ends over the same checks:

* `check_work_plan(...)`: checkify user checks (`plan_findings`, traced JAX), usable under `jit`
  (wrap with `funcmla.checks.checked` / `run_checked`); the first failing check is raised. All
  indexing is in bounds, so it also runs under checkify's index checks.
* `plan_problems(...)`: host helper in plain NumPy loops (no compile: the traced version compiles
  slowly on XLA:CPU) returning every problem as a readable string (empty list: the plan is valid).
Each problem names the field, the position and the value, with the same wording in both.

What is checked (units: `kv_start`/`kv_end` are kv_indices entries of `page_size` tokens, the
metadata's granularity; rows are the plan's query rows, folded for decode head folding):

* kv_indptr[0] == 0; work_indptr[0] == 0, non-decreasing, work_indptr[-1] <= max_work and
  == num_works.
* every live work: batch_idx in range; qo range inside its request's rows; kv range inside its
  request's kv_indptr range; 0 <= kv_offset <= kv_len.
* granularity: the plan's `block_size` equals the metadata's tokens per entry, and each
  request's entry count equals ceil(kv_len / block_size): at page size 64 with the legacy pairing
  a token CSR has kv_len entries where the plan expects kv_len / 64.
* each qo tile (batch, qo range, head range) is a chain of works with contiguous kv ranges starting
  at the request's first entry (no gap, no overlap, no fragment cut short by kv_offset), whose
  last work reaches the tile's causal end (bottom-right: the last row's visible keys) in tokens;
  a one-work tile writes the final output (partial_qo_loc == -1), a split tile only partials.
* every live (row, head) is covered by exactly one tile.
* reduce maps: reduce_indptr[0] == 0, non-decreasing, reduce_indptr[-1] == num_partials <=
  len(reduce_partial_map); every group with entries has >= 2 (mla_reduce_v1 skips smaller ones),
  groups in increasing qo order with strictly increasing partial locations; every partial work's
  (qo_start, qo_end) has a group containing its partial_qo_loc; every group entry is used by
  the same number of works (one per head range); unsplit tiles have no group; partial rows of
  works on the same heads do not overlap.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from funcmla.planners.plan import (
    BATCH_IDX, KV_END, KV_OFFSET, KV_START, PARTIAL_QO_LOC, QO_END, QO_START, Q_HEAD_RANGE,
    WorkPlan,
)

__all__ = ["Finding", "plan_findings", "check_work_plan", "plan_problems"]

BIG = 2**30


class Finding(NamedTuple):
    """One check: `bad` (bool scalar), a message template and its scalar fields."""

    template: str
    bad: jax.Array
    fields: dict


def _first(mask):
    """Index of the first True (0 when none, or when empty)."""
    if mask.size == 0:
        return jnp.int32(0)
    return jnp.argmax(mask).astype(jnp.int32)


# Everything below indexes strictly in bounds (explicit clips, +1 sentinel slots), so that the
# checks also run under checkify's index checks, which flag any out-of-bounds gather/scatter.


def _scatter(n, fill, idx, val, op="set"):
    """A length-n array from `fill`, with `val` scattered at idx (idx outside [0, n) dropped)."""
    idx = jnp.where((idx >= 0) & (idx < n), idx, n)
    buf = jnp.full((n + 1,) + jnp.shape(fill), fill, jnp.asarray(fill).dtype)
    return getattr(buf.at[idx], op)(val)[:n]


def _take(arr, idx, fill):
    """arr[idx] with `fill` where idx is outside [0, len(arr))."""
    padded = jnp.concatenate([arr, jnp.full((1,), fill, arr.dtype)])
    n = arr.shape[0]
    return padded[jnp.where((idx >= 0) & (idx < n), idx, n)]


def _count(mask):
    return jnp.sum(mask.astype(jnp.int32))


def plan_findings(
    plan: WorkPlan,
    metadata,
    *,
    page_size: int = 1,
    causal: bool = True,
    num_heads: int = 1,
    num_rows: int,
    qk_batch_ratio: int = 1,
    uni_seqlen_qo: int = -1,
) -> list[Finding]:
    """All findings, as traced values (see the module docstring).

    metadata: qo_indptr [B+1] (query tokens), kv_indptr [B+1] (entries), kv_last_page_len [B].
    num_heads: q heads per row of the plan's row space (H / qk_batch_ratio); decode works cover
    all of them. num_rows: static number of rows in the plan's row space (>= live rows).
    """
    ratio = qk_batch_ratio
    qo_indptr = jnp.asarray(metadata.qo_indptr, jnp.int32)
    kv_indptr = jnp.asarray(metadata.kv_indptr, jnp.int32)
    last = jnp.asarray(metadata.kv_last_page_len, jnp.int32)
    batch = kv_indptr.shape[0] - 1
    folded = batch * ratio
    n_ent = kv_indptr[1:] - kv_indptr[:-1]
    kv_len = jnp.where(n_ent > 0, (n_ent - 1) * page_size + last, 0)
    F: list[Finding] = []

    def add(template, bad, **fields):
        F.append(Finding(template, jnp.asarray(bad, bool), fields))

    add("kv_indptr[0] = {v} must be 0 (plans index kv_indices relative to it)",
        kv_indptr[0] != 0, v=kv_indptr[0])

    # ---- work_indptr
    wp = plan.work_indptr
    add("work_indptr[0] = {v} must be 0", wp[0] != 0, v=wp[0])
    dec = wp[1:] < wp[:-1]
    c = _first(dec)
    add("work_indptr must be non-decreasing: work_indptr[{i}] = {a} < work_indptr[{j}] = {b}",
        jnp.any(dec), i=c + 1, a=wp[c + 1], j=c, b=wp[c])
    add(f"work_indptr[-1] = {{v}} exceeds max_work = {plan.max_work} (rows of work_info)",
        wp[-1] > plan.max_work, v=wp[-1])
    add("num_works = {n} differs from work_indptr[-1] = {v}", plan.num_works != wp[-1],
        n=plan.num_works, v=wp[-1])

    if plan.max_work == 0:  # an empty plan (e.g. prefill with max_qlen 0): nothing else to check
        return F

    # ---- per-work ranges
    wi = plan.work_info
    nw = jnp.minimum(plan.num_works, plan.max_work)
    w_ids = jnp.arange(plan.max_work, dtype=jnp.int32)
    live = w_ids < nw
    bf = wi[:, BATCH_IDX]
    bad = live & ((bf < 0) | (bf >= folded))
    w = _first(bad)
    add(f"work_info[{{w}}].batch_idx = {{v}} is outside [0, {folded})", jnp.any(bad), w=w, v=bf[w])
    bfc = jnp.clip(bf, 0, folded - 1)
    req = bfc // ratio
    if ratio > 1:
        q_base, q_end = uni_seqlen_qo * bfc, uni_seqlen_qo * (bfc + 1)
    else:
        q_base, q_end = qo_indptr[req], qo_indptr[req + 1]
    q_len = q_end - q_base
    qs, qe = wi[:, QO_START], wi[:, QO_END]
    bad = live & ((qs < q_base) | (qs >= qe) | (qe > q_end))
    w = _first(bad)
    add("work_info[{w}] qo range [{qs}, {qe}) is empty or outside batch {b}'s rows [{lo}, {hi})",
        jnp.any(bad), w=w, qs=qs[w], qe=qe[w], b=bf[w], lo=q_base[w], hi=q_end[w])
    ks, ke, koff = wi[:, KV_START], wi[:, KV_END], wi[:, KV_OFFSET]
    kb, kend = kv_indptr[req], kv_indptr[req + 1]
    bad = live & ((ks < kb) | (ks > ke) | (ke > kend))
    w = _first(bad)
    add("work_info[{w}] kv range [{ks}, {ke}) is outside request {r}'s kv_indptr range [{lo}, {hi})",
        jnp.any(bad), w=w, ks=ks[w], ke=ke[w], r=req[w], lo=kb[w], hi=kend[w])
    bad = live & ((koff < 0) | (koff > kv_len[req]))
    w = _first(bad)
    add("work_info[{w}].kv_offset = {v} is outside [0, kv_len = {n}] tokens",
        jnp.any(bad), w=w, v=koff[w], n=kv_len[req][w])

    # ---- granularity
    add(f"plan.block_size = {plan.block_size} but kv_indices entries hold {page_size} token(s): works "
        f"address kv_len / {plan.block_size} entries (the sglang#25556 bug)",
        jnp.asarray(plan.block_size != page_size))
    want = (kv_len + plan.block_size - 1) // plan.block_size
    used = _scatter(batch, jnp.int32(0), req, live.astype(jnp.int32), "add") > 0
    bad = used & (n_ent != want)
    r = _first(bad)
    add(f"request {{r}}: kv_indptr[{{r1}}] - kv_indptr[{{r}}] = {{e}} entries, but its {{n}} tokens "
        f"are {{x}} entries at the plan's block_size = {plan.block_size}: the works' kv ranges do "
        "not cover the request's tokens", jnp.any(bad), r=r, r1=r + 1, e=n_ent[r], n=kv_len[r],
        x=want[r])

    # ---- tile chains: sort live works by (batch, qo_start, qo_end, head range, kv_start)
    qhr = wi[:, Q_HEAD_RANGE]
    key_b = jnp.where(live, bf, BIG)
    perm = jnp.lexsort((ks, qhr, qe, qs, key_b))
    s_live = live[perm]
    sk = [a[perm] for a in (bf, qs, qe, qhr)]
    same_prev = jnp.concatenate([jnp.zeros((1,), bool),
                                 jnp.all(jnp.stack([a[1:] == a[:-1] for a in sk]), axis=0)])
    same_prev = same_prev & s_live
    first = s_live & ~same_prev
    is_last = s_live & ~jnp.concatenate([same_prev[1:], jnp.zeros((1,), bool)])
    chain = jnp.cumsum(first.astype(jnp.int32)) - 1
    chain_len = _scatter(plan.max_work, jnp.int32(0), jnp.where(s_live, chain, -1), 1, "add")[
        jnp.clip(chain, 0, plan.max_work - 1)]
    s_ks, s_ke, s_koff, s_req = ks[perm], ke[perm], koff[perm], req[perm]
    s_ploc = wi[:, PARTIAL_QO_LOC][perm]
    s_kb, s_len = kb[perm], kv_len[req][perm]
    tok_end = jnp.minimum(jnp.minimum((s_ke - s_kb) * page_size, s_len - s_koff), s_len)

    bad = first & (s_ks != s_kb)
    i = _first(bad)
    add("tile (batch {b}, qo [{qs}, {qe})): its first work work_info[{w}] starts at kv entry {ks}, "
        "not at the request's first entry kv_indptr[{r}] = {kb} (KV not covered)",
        jnp.any(bad), b=sk[0][i], qs=sk[1][i], qe=sk[2][i], w=perm[i], ks=s_ks[i], r=s_req[i],
        kb=s_kb[i])
    prev_ke = jnp.concatenate([s_ke[:1], s_ke[:-1]])
    bad = same_prev & (s_ks != prev_ke)
    i = _first(bad)
    add("tile (batch {b}, qo [{qs}, {qe})): work_info[{w}].kv_start = {ks} but the previous "
        "fragment ends at {pe} (gap or overlap)", jnp.any(bad), b=sk[0][i], qs=sk[1][i],
        qe=sk[2][i], w=perm[i], ks=s_ks[i], pe=prev_ke[i])
    bad = s_live & ~is_last & (tok_end < (s_ke - s_kb) * page_size)
    i = _first(bad)
    add("work_info[{w}]: kv_offset = {o} ends the fragment at token {t}, before its kv_end "
        "(entry {ke}) (gap)", jnp.any(bad), w=perm[i], o=s_koff[i], t=tok_end[i], ke=s_ke[i])
    s_qbase, s_qlen = q_base[perm], q_len[perm]
    need = s_len
    if causal:
        need = jnp.clip(s_len - s_qlen + (sk[2] - s_qbase), 0, s_len)
    bad = is_last & (tok_end < need)
    i = _first(bad)
    add(f"tile (batch {{b}}, qo [{{qs}}, {{qe}})) needs {{n}} KV tokens but its works cover entries "
        f"[{{kb}}, {{ke}}) = {{t}} tokens at {page_size} token(s) per entry (plan block_size = "
        f"{plan.block_size})", jnp.any(bad), b=sk[0][i], qs=sk[1][i], qe=sk[2][i], n=need[i],
        kb=s_kb[i], ke=s_ke[i], t=tok_end[i])
    bad = s_live & (chain_len == 1) & (s_ploc != -1)
    i = _first(bad)
    add("tile (batch {b}, qo [{qs}, {qe})) has one work (work_info[{w}]) but partial_qo_loc = {p} "
        "(an unsplit tile must write the final output, -1)", jnp.any(bad), b=sk[0][i],
        qs=sk[1][i], qe=sk[2][i], w=perm[i], p=s_ploc[i])
    bad = s_live & (chain_len > 1) & (s_ploc < 0)
    i = _first(bad)
    add("tile (batch {b}, qo [{qs}, {qe})) is split into {n} works but work_info[{w}] writes the "
        "final output (partial_qo_loc = {p})", jnp.any(bad), b=sk[0][i], qs=sk[1][i], qe=sk[2][i],
        n=chain_len[i], w=perm[i], p=s_ploc[i])

    # ---- every live (row, head) covered by exactly one tile
    heads = jnp.arange(num_heads, dtype=jnp.int32)
    if plan.kind == "prefill":
        h_lo, h_hi = qhr & 0xFFFF, qhr >> 16
    else:
        h_lo, h_hi = jnp.zeros_like(qhr), jnp.full_like(qhr, num_heads)
    first_w = _scatter(plan.max_work, False, perm, first)
    hmask = (first_w[:, None] & (heads[None, :] >= h_lo[:, None]) & (heads[None, :] < h_hi[:, None])
             ).astype(jnp.int32)
    diff = jnp.zeros((num_rows + 1, num_heads), jnp.int32)
    diff = diff.at[jnp.clip(qs, 0, num_rows)].add(hmask).at[jnp.clip(qe, 0, num_rows)].add(-hmask)
    cover = jnp.cumsum(diff, axis=0)[:num_rows]
    live_rows = qo_indptr[-1] * ratio if ratio == 1 else folded * uni_seqlen_qo
    bad = (jnp.arange(num_rows)[:, None] < live_rows) & (cover != 1)
    flat = _first(bad.reshape(-1))
    add("row {r}, head {h} is covered by {c} tiles (must be exactly 1)", jnp.any(bad),
        r=flat // num_heads, h=flat % num_heads, c=cover.reshape(-1)[flat])

    # ---- reduce maps
    ri, fmap, pmap = plan.reduce_indptr, plan.reduce_final_map, plan.reduce_partial_map
    n_ent_map = pmap.shape[0]
    add("reduce_indptr[0] = {v} must be 0", ri[0] != 0, v=ri[0])
    dec = ri[1:] < ri[:-1]
    g = _first(dec)
    add("reduce_indptr must be non-decreasing: reduce_indptr[{i}] = {a} < reduce_indptr[{j}] = {b}",
        jnp.any(dec), i=g + 1, a=_take(ri, g + 1, 0), j=g, b=ri[g])
    add(f"reduce_indptr[-1] = {{v}} differs from num_partials = {{n}} or exceeds "
        f"len(reduce_partial_map) = {n_ent_map}", (ri[-1] != plan.num_partials) | (ri[-1] > n_ent_map),
        v=ri[-1], n=plan.num_partials)
    if plan.num_tiles > 0:
        m = ri[1:] - ri[:-1]
        bad = m == 1
        g = _first(bad)
        add("reduce group {g} (reduce_final_map = [{qs}, {qe})) has a single partial; mla_reduce_v1 "
            "skips it and the rows are never written", jnp.any(bad), g=g, qs=fmap[g, 0], qe=fmap[g, 1])
        glive = m > 0
        gpos = jnp.cumsum(glive.astype(jnp.int32)) - 1
        nt = plan.num_tiles
        dst = jnp.where(glive, gpos, nt)
        c_qs = _scatter(nt, jnp.int32(BIG), dst, fmap[:, 0])
        c_qe = _scatter(nt, jnp.int32(BIG), dst, fmap[:, 1])
        c_lo = _scatter(nt, jnp.int32(0), dst, ri[:-1])
        c_hi = _scatter(nt, jnp.int32(0), dst, ri[1:])
        c_g = _scatter(nt, jnp.int32(0), dst, jnp.arange(nt, dtype=jnp.int32))
        n_live = jnp.sum(glive.astype(jnp.int32))
        bad = (jnp.arange(1, nt) < n_live) & (c_qs[1:] <= c_qs[:-1])
        i = _first(bad)
        add("reduce_final_map rows of groups {g0} and {g1} are not in increasing qo order "
            "({a} then {b})", jnp.any(bad), g0=c_g[i], g1=_take(c_g, i + 1, 0), a=c_qs[i],
            b=_take(c_qs, i + 1, 0))
        e = jnp.arange(n_ent_map, dtype=jnp.int32)
        e_live = e < jnp.minimum(ri[-1], n_ent_map)
        if n_ent_map > 1:
            same_grp = jnp.searchsorted(ri, e[1:], side="right") == jnp.searchsorted(ri, e[:-1], side="right")
            bad = e_live[1:] & same_grp & (pmap[1:] <= pmap[:-1])
            i = _first(bad)
            add("reduce_partial_map[{i}] = {a} is not above reduce_partial_map[{j}] = {b} in the same "
                "group (duplicate or unsorted partial rows)", jnp.any(bad), i=i + 1, a=pmap[i + 1],
                j=i, b=pmap[i])

        # lookup of each live work's tile in the groups
        gi = jnp.clip(jnp.searchsorted(c_qs, qs).astype(jnp.int32), 0, nt - 1)
        has_grp = (gi < n_live) & (c_qs[gi] == qs) & (c_qe[gi] == qe)
        ploc = wi[:, PARTIAL_QO_LOC]
        lo, hi = c_lo[gi], c_hi[gi]

        def bsearch(_, lh):
            a, b_ = lh
            mid = (a + b_) // 2
            go = _take(pmap, mid, BIG) < ploc
            run = a < b_
            return jnp.where(run & go, mid + 1, a), jnp.where(run & ~go, mid, b_)

        pos, _ = jax.lax.fori_loop(0, 32, bsearch, (lo, hi))
        found = has_grp & (pos < hi) & (_take(pmap, pos, BIG) == ploc)
        part = live & (ploc >= 0)
        bad = part & ~found
        w = _first(bad)
        add("work_info[{w}] (qo [{qs}, {qe})) writes partial rows at {p} but no reduce group for "
            "that qo range lists it", jnp.any(bad), w=w, qs=qs[w], qe=qe[w], p=ploc[w])
        bad = live & (ploc < 0) & has_grp
        w = _first(bad)
        add("work_info[{w}] writes the final output of qo [{qs}, {qe}) but a reduce group also "
            "merges those rows (reduce_final_map is only for split tiles)", jnp.any(bad), w=w,
            qs=qs[w], qe=qe[w])
        if n_ent_map > 0:
            refs = _scatter(n_ent_map, jnp.int32(0), jnp.where(part & found, pos, -1), 1, "add")
            e_grp = jnp.clip(jnp.searchsorted(ri, e, side="right").astype(jnp.int32) - 1, 0, nt - 1)
            first_ref = _take(refs, ri[e_grp], 0)
            bad = e_live & ((refs == 0) | (refs != first_ref))
            i = _first(bad)
            add("reduce_partial_map[{i}] = {v} (group {g}) is written by {c} works, the group's first "
                "entry by {f} (every entry needs one work per head range)", jnp.any(bad), i=i, v=pmap[i],
                g=e_grp[i], c=refs[i], f=first_ref[i])

    # ---- partial rows of works on the same heads must not overlap
    ploc = wi[:, PARTIAL_QO_LOC]
    part = live & (ploc >= 0)
    pperm = jnp.lexsort((ploc, h_lo, jnp.where(part, 0, 1)))
    p_part, p_h, p_loc, p_rows = part[pperm], h_lo[pperm], ploc[pperm], (qe - qs)[pperm]
    bad = p_part[1:] & p_part[:-1] & (p_h[1:] == p_h[:-1]) & (p_loc[1:] < p_loc[:-1] + p_rows[:-1])
    i = _first(bad)
    add("partial rows overlap: work_info[{a}] writes rows [{p}, {pe}) and work_info[{b}] starts at "
        "row {q} on the same heads", jnp.any(bad), a=pperm[i], p=p_loc[i], pe=p_loc[i] + p_rows[i],
        b=_take(pperm, i + 1, 0), q=_take(p_loc, i + 1, 0))
    return F


def check_work_plan(plan: WorkPlan, metadata, *, num_rows: int, num_heads: int = 1,
                    page_size: int = 1, causal: bool = True, qk_batch_ratio: int = 1,
                    uni_seqlen_qo: int = -1) -> None:
    """checkify value checks of every finding (run under `funcmla.checks.checked`)."""
    for f in plan_findings(plan, metadata, page_size=page_size, causal=causal,
                           num_heads=num_heads, num_rows=num_rows, qk_batch_ratio=qk_batch_ratio,
                           uni_seqlen_qo=uni_seqlen_qo):
        checkify.check(~f.bad, f.template, **f.fields)


def plan_problems(plan: WorkPlan, metadata, *, page_size: int = 1, causal: bool = True,
                  num_heads: int | None = None, qk_batch_ratio: int = 1,
                  uni_seqlen_qo: int = -1, max_per_check: int = 3) -> list[str]:
    """Host helper: the same checks as `plan_findings`, in plain NumPy loops (no compile), every
    offending position listed (at most `max_per_check` per check, then a count).

    num_heads: q heads per plan row (H / qk_batch_ratio); default: for prefill plans the largest
    head-range end in the plan; decode works cover every head. Returns [] for a valid plan.
    """
    ratio = qk_batch_ratio
    qo_indptr = np.asarray(metadata.qo_indptr, np.int64)
    kv_indptr = np.asarray(metadata.kv_indptr, np.int64)
    last = np.asarray(metadata.kv_last_page_len, np.int64)
    wp = np.asarray(plan.work_indptr, np.int64)
    wi_all = np.asarray(plan.work_info, np.int64)
    ri = np.asarray(plan.reduce_indptr, np.int64)
    fmap = np.asarray(plan.reduce_final_map, np.int64)
    pmap = np.asarray(plan.reduce_partial_map, np.int64)
    num_works, num_partials = int(plan.num_works), int(plan.num_partials)
    batch = len(kv_indptr) - 1
    folded = batch * ratio
    n_ent = np.diff(kv_indptr)
    kv_len = np.where(n_ent > 0, (n_ent - 1) * page_size + last, 0)
    out: list[str] = []
    counts: dict[str, int] = {}

    def report(check: str, msg: str):
        counts[check] = counts.get(check, 0) + 1
        if counts[check] <= max_per_check:
            out.append(msg)

    def report_start_and_order(check: str, name: str, arr: np.ndarray):
        """`name`[0] == 0 and non-decreasing (the same wording as the traced checks)."""
        if arr[0] != 0:
            report(check + "0", f"{name}[0] = {arr[0]} must be 0")
        for i in np.nonzero(arr[1:] < arr[:-1])[0]:
            report(check + "mono", f"{name} must be non-decreasing: {name}[{i + 1}] = "
                                   f"{arr[i + 1]} < {name}[{i}] = {arr[i]}")

    if kv_indptr[0] != 0:
        report("kv0", f"kv_indptr[0] = {kv_indptr[0]} must be 0 (plans index kv_indices relative to it)")
    report_start_and_order("wp", "work_indptr", wp)
    if wp[-1] > plan.max_work:
        report("wpmax", f"work_indptr[-1] = {wp[-1]} exceeds max_work = {plan.max_work} (rows of work_info)")
    if num_works != wp[-1]:
        report("nw", f"num_works = {num_works} differs from work_indptr[-1] = {wp[-1]}")
    if plan.block_size != page_size:
        report("gran", f"plan.block_size = {plan.block_size} but kv_indices entries hold {page_size} token(s): "
                       f"works address kv_len / {plan.block_size} entries (the sglang#25556 bug)")

    nw = min(num_works, plan.max_work)
    wi = wi_all[:nw]
    if num_heads is None:
        num_heads = int(max(1, (wi[:, Q_HEAD_RANGE] >> 16).max(initial=1))) if plan.kind == "prefill" else 1

    def q_range(b):
        if ratio > 1:
            return uni_seqlen_qo * b, uni_seqlen_qo * (b + 1)
        r = b // ratio
        return int(qo_indptr[r]), int(qo_indptr[r + 1])

    chains: dict[tuple, list[int]] = {}
    ok_work = np.zeros(nw, bool)
    for w in range(nw):
        b, ploc, qs, qe, ks, ke, koff, qhr = (int(x) for x in wi[w])
        if not 0 <= b < folded:
            report("batch", f"work_info[{w}].batch_idx = {b} is outside [0, {folded})")
            continue
        r = b // ratio
        lo, hi = q_range(b)
        if not (lo <= qs < qe <= hi):
            report("qo", f"work_info[{w}] qo range [{qs}, {qe}) is empty or outside batch {b}'s rows "
                         f"[{lo}, {hi})")
        if not (kv_indptr[r] <= ks <= ke <= kv_indptr[r + 1]):
            report("kv", f"work_info[{w}] kv range [{ks}, {ke}) is outside request {r}'s kv_indptr "
                         f"range [{kv_indptr[r]}, {kv_indptr[r + 1]})")
            continue
        if not 0 <= koff <= kv_len[r]:
            report("koff", f"work_info[{w}].kv_offset = {koff} is outside [0, kv_len = {kv_len[r]}] tokens")
        ok_work[w] = True
        chains.setdefault((b, qs, qe, qhr), []).append(w)

    for r in sorted({int(b) // ratio for b in wi[ok_work, BATCH_IDX]}):
        want = -(-int(kv_len[r]) // plan.block_size)
        if n_ent[r] != want:
            report("entries", f"request {r}: kv_indptr[{r + 1}] - kv_indptr[{r}] = {n_ent[r]} entries, but "
                              f"its {kv_len[r]} tokens are {want} entries at the plan's block_size = "
                              f"{plan.block_size}: the works' kv ranges do not cover the request's tokens")

    live_rows = int(qo_indptr[-1]) if ratio == 1 else folded * uni_seqlen_qo
    n_rows = max(live_rows, int(wi[:, QO_END].max(initial=0)))
    cover = np.zeros((n_rows + 1, num_heads), np.int64)
    split_tiles, whole_tiles = set(), set()
    for (b, qs, qe, qhr), ws in chains.items():
        ws = sorted(ws, key=lambda w: wi[w, KV_START])
        r = b // ratio
        kb, n = int(kv_indptr[r]), int(kv_len[r])
        heads = f", heads [{qhr & 0xFFFF}, {qhr >> 16})" if plan.kind == "prefill" else ""
        tile = f"tile (batch {b}, qo [{qs}, {qe}){heads})"
        if wi[ws[0], KV_START] != kb:
            report("first", f"{tile}: its first work work_info[{ws[0]}] starts at kv entry "
                            f"{wi[ws[0], KV_START]}, not at the request's first entry kv_indptr[{r}] = "
                            f"{kb} (KV not covered)")
        for prev, w in zip(ws, ws[1:]):
            if wi[w, KV_START] != wi[prev, KV_END]:
                report("gap", f"{tile}: work_info[{w}].kv_start = {wi[w, KV_START]} but the previous "
                              f"fragment ends at {wi[prev, KV_END]} (gap or overlap)")
        ends = [min((wi[w, KV_END] - kb) * page_size, n - wi[w, KV_OFFSET], n) for w in ws]
        for w, e in zip(ws[:-1], ends[:-1]):
            if e < (wi[w, KV_END] - kb) * page_size:
                report("short", f"work_info[{w}]: kv_offset = {wi[w, KV_OFFSET]} ends the fragment at "
                                f"token {e}, before its kv_end (entry {wi[w, KV_END]}) (gap)")
        lo, hi = q_range(b)
        need = min(max(n - (hi - lo) + (qe - lo), 0), n) if causal else n
        if ends[-1] < need:
            report("cover", f"{tile} needs {need} KV tokens but its works cover entries [{kb}, "
                            f"{wi[ws[-1], KV_END]}) = {ends[-1]} tokens at {page_size} token(s) per entry "
                            f"(plan block_size = {plan.block_size})")
        plocs = wi[ws, PARTIAL_QO_LOC]
        if len(ws) == 1 and plocs[0] != -1:
            report("unsplit", f"{tile} has one work (work_info[{ws[0]}]) but partial_qo_loc = {plocs[0]} "
                              "(an unsplit tile must write the final output, -1)")
        if len(ws) > 1 and np.any(plocs < 0):
            report("split", f"{tile} is split into {len(ws)} works but work_info[{ws[int(np.argmax(plocs < 0))]}] "
                            "writes the final output (partial_qo_loc = -1)")
        (split_tiles if len(ws) > 1 else whole_tiles).add((qs, qe))
        h_lo, h_hi = (qhr & 0xFFFF, qhr >> 16) if plan.kind == "prefill" else (0, num_heads)
        cover[qs, h_lo:h_hi] += 1
        cover[qe, h_lo:h_hi] -= 1
    cover = np.cumsum(cover, axis=0)[:live_rows]
    for r, h in zip(*np.nonzero(cover != 1)):
        report("rows", f"row {r}, head {h} is covered by {cover[r, h]} tiles (must be exactly 1)")

    report_start_and_order("ri", "reduce_indptr", ri)
    if ri[-1] != num_partials or ri[-1] > len(pmap):
        report("rilast", f"reduce_indptr[-1] = {ri[-1]} differs from num_partials = {num_partials} or "
                         f"exceeds len(reduce_partial_map) = {len(pmap)}")
    groups: dict[tuple[int, int], tuple[int, list[int]]] = {}
    prev_qs = None
    for g in range(plan.num_tiles):
        lo, hi = int(ri[g]), int(min(ri[g + 1], len(pmap)))
        if hi <= lo:
            continue
        key = (int(fmap[g, 0]), int(fmap[g, 1]))
        locs = [int(x) for x in pmap[lo:hi]]
        if hi - lo == 1:
            report("single", f"reduce group {g} (reduce_final_map = [{key[0]}, {key[1]})) has a single "
                             "partial; mla_reduce_v1 skips it and the rows are never written")
        if prev_qs is not None and key[0] <= prev_qs:
            report("order", f"reduce_final_map row of group {g} ([{key[0]}, {key[1]})) is not in "
                            f"increasing qo order")
        prev_qs = key[0]
        for i in range(lo + 1, hi):
            if pmap[i] <= pmap[i - 1]:
                report("dup", f"reduce_partial_map[{i}] = {pmap[i]} is not above reduce_partial_map[{i - 1}] "
                              f"= {pmap[i - 1]} in the same group (duplicate or unsorted partial rows)")
        groups[key] = (g, locs)
        if key in whole_tiles and key not in split_tiles:
            report("final", f"reduce group {g} merges qo [{key[0]}, {key[1]}), an unsplit tile "
                            "(reduce_final_map is only for split tiles)")
    refs: dict[tuple[int, int], int] = {}
    rows_by_heads: dict[int, list[tuple[int, int, int]]] = {}
    for w in np.nonzero(ok_work)[0]:
        ploc, qs, qe, qhr = int(wi[w, PARTIAL_QO_LOC]), int(wi[w, QO_START]), int(wi[w, QO_END]), int(wi[w, Q_HEAD_RANGE])
        if ploc < 0:
            continue
        grp = groups.get((qs, qe))
        if grp is None or ploc not in grp[1]:
            report("plist", f"work_info[{w}] (qo [{qs}, {qe})) writes partial rows at {ploc} but no "
                            "reduce group for that qo range lists it")
        else:
            refs[(grp[0], ploc)] = refs.get((grp[0], ploc), 0) + 1
        rows_by_heads.setdefault(qhr & 0xFFFF if plan.kind == "prefill" else 0, []).append((ploc, qe - qs, int(w)))
    for key, (g, locs) in groups.items():
        c = [refs.get((g, p), 0) for p in locs]
        for i, (p, ci) in enumerate(zip(locs, c)):
            if ci == 0 or ci != c[0]:
                report("refs", f"reduce_partial_map[{int(ri[g]) + i}] = {p} (group {g}) is written by {ci} "
                               f"works, the group's first entry by {c[0]} (every entry needs one work "
                               "per head range)")
    for items in rows_by_heads.values():
        items.sort()
        for (p0, n0, w0), (p1, _, w1) in zip(items, items[1:]):
            if p1 < p0 + n0:
                report("overlap", f"partial rows overlap: work_info[{w0}] writes rows [{p0}, {p0 + n0}) and "
                                  f"work_info[{w1}] starts at row {p1} on the same heads")
    for check, n in counts.items():
        if n > max_per_check:
            out.append(f"... and {n - max_per_check} more of the above kind ({check})")
    return out
