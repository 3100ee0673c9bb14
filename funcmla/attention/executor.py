"""Execute a `WorkPlan` the way AITER's persistent kernels read it: per-work partial attention,
then a log-sum-exp merge with `mla_reduce_v1` semantics. The executable statement of what a plan
means (modelled on AITER's `torch_mla_extend_split_kv` + `torch_mla_reduce_v1`).

    q        [T, H, D]    D = 576 (absorbed MLA; prefill plans run these shapes too)
    kv_pool  [slots, D]   one latent row per token slot; V = kv_pool[:, :v_head_dim]
    metadata             qo_indptr [B+1] (query tokens), kv_indptr [B+1] (kv_indices entries),
                         kv_indices [cap] (entries), kv_last_page_len [B] (tokens in the last
                         entry); `funcmla.metadata.ForwardMetadata` or `PagedKVMetadata`.

One kv_indices entry is `page_size` tokens: a token slot when 1 (token CSR), a page id when
> 1 (token t of the entry lives at slot `page * page_size + t`). A work of request `b`
(`batch_idx // qk_batch_ratio`) reads entries `[kv_start, kv_end)`, i.e. batch-local tokens
`[(kv_start - kv_indptr[b]) * page_size,
  min((kv_end - kv_indptr[b]) * page_size, kv_len - kv_offset))`,
exactly as the kernel does: it reads entries, whatever granularity the planner assumed. That is
why a plan whose `block_size` differs from `page_size` is refused unless
`allow_legacy_mismatch=True` (then it runs literally, reproducing the seed's garbage).

Causal masking is bottom-right on absolute positions: query j of a request with q_len queries
and kv_len keys sees keys `u <= kv_len - q_len + j`. A work with `partial_qo_loc == -1` writes
final rows (lse +inf and out 0 where no key is visible); otherwise it writes fp32 partial rows
`partial_qo_loc + (row - qo_start)` with lse -inf where no key is visible. For each reduce group
with at least two partials (`mla_reduce_v1` skips smaller ones), rows `[qo_start, qo_end)` of
`reduce_final_map` are merged: `m = max lse_i`, `out = sum e^(lse_i - m) out_i / sum e^(...)`,
`lse = log(sum) + m`, `+inf` when the sum is 0.

Prefill plans restrict each work to q heads `[q_head_range & 0xFFFF, q_head_range >> 16)`;
decode plans cover all heads. Decode plans with head folding (`qk_batch_ratio > 1`) index folded
rows: q is viewed as `(bs, ratio, seqlen, H / ratio)` rows as AITER's `mla_decode_fwd` does
(`aiter/mla.py`), and the output is unfolded back.

Cost: works run in chunks of `work_chunk` and chunks past `num_works` are skipped, so time
follows the live works. Memory does not: the fp32 partial buffer has AITER's static size
(`len(reduce_partial_map) * max_qo_span` rows x H x v_head_dim, as the kernels' `logits`
scratch), which for prefill plans on 256 CUs reaches gigabytes; plan small batches here.

Static bounds: `max_qo_span` (query rows per work) and `max_kv_span` (tokens per work). A live
work that exceeds them, or writes partial rows past `max_partials * max_qo_span`, or a prefill
plan whose works leave some of q's heads uncovered (a `PrefillPlanConfig.gqa_ratio` below q's
heads), makes the whole output NaN (loud, never a silent clamp or zero heads); `plan_spans`
computes the bounds on the host. With concrete inputs (eager, or under
`funcmla.checks.checked`) the head coverage and the metadata are checked and raise instead.

Masked keys and rows contribute exactly zero whatever the pool holds in them (NaN, Inf): they
are selected away, never multiplied by a zero weight.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax.experimental import checkify

from funcmla.checks import check_indptr
from funcmla.guards import enforce, should_check
from funcmla.planners.plan import (
    BATCH_IDX, KV_END, KV_OFFSET, KV_START, PARTIAL_QO_LOC, QO_END, QO_START, Q_HEAD_RANGE,
    WorkPlan,
)

__all__ = ["PagedKVMetadata", "run_work_plan", "plan_spans", "reduce_partials"]


class PagedKVMetadata(NamedTuple):
    """Metadata whose kv_indices entries are pages (AITER decode with page_size > 1).

    qo_indptr [B+1] query tokens; kv_indptr [B+1] pages; kv_indices [cap] page ids;
    kv_last_page_len [B] tokens in each request's last page. Pass `page_size` to the executor.
    """

    qo_indptr: jax.Array
    kv_indptr: jax.Array
    kv_indices: jax.Array
    kv_last_page_len: jax.Array


def _entry_granularity_check(plan: WorkPlan, metadata, page_size: int, allow: bool) -> None:
    if getattr(metadata, "granularity", None) == "token" and page_size != 1:
        raise ValueError(
            f"page_size={page_size} but the metadata ({type(metadata).__name__}) is "
            "token-granular: its kv_indices entries are single tokens")
    if plan.block_size != page_size and not allow:
        raise ValueError(
            f"{plan.kind} plan block_size={plan.block_size} but kv_indices entries hold "
            f"page_size={page_size} token(s): the kernel would read kv_len/{plan.block_size}"
            " entries per work, not kv_len tokens (sglang#25556). Re-plan with block_size="
            f"{page_size}, or pass allow_legacy_mismatch=True to reproduce the bug.")


def _fold_q(q, *, ratio: int, seqlen: int):
    """[bs*seqlen, H, D] -> [bs*ratio*seqlen, H/ratio, D], rows ordered (bs, ratio, seqlen)."""
    t, h, d = q.shape
    bs = t // seqlen
    return q.reshape(bs, seqlen, ratio, h // ratio, d).transpose(0, 2, 1, 3, 4).reshape(
        bs * ratio * seqlen, h // ratio, d)


def _unfold(x, *, ratio: int, seqlen: int):
    """Inverse of `_fold_q` for [rows, Hf, ...] arrays."""
    rows, hf = x.shape[:2]
    rest = x.shape[2:]
    bs = rows // (ratio * seqlen)
    x = x.reshape((bs, ratio, seqlen, hf) + rest)
    x = jnp.moveaxis(x, 1, 2)
    return x.reshape((bs * seqlen, ratio * hf) + rest)


def reduce_partials(out, lse, part_out, part_lse, plan: WorkPlan, *, max_qo_span: int):
    """`mla_reduce_v1`: merge partial rows into final rows for groups with >= 2 partials.

    out [T, H, Dv], lse [T, H]: final rows (overwritten where a group merges);
    part_out [P, H, Dv], part_lse [P, H]: fp32 partial rows. Returns (out, lse).
    """
    num_rows, num_heads = lse.shape
    ri = plan.reduce_indptr
    num_entries = plan.reduce_partial_map.shape[0]
    if num_entries == 0 or plan.num_tiles == 0:
        return out, lse
    e = jnp.arange(num_entries, dtype=jnp.int32)
    grp = jnp.clip(jnp.searchsorted(ri[1:], e, side="right").astype(jnp.int32), 0, plan.num_tiles - 1)
    m_grp = ri[grp + 1] - ri[grp]
    e_live = (e < ri[-1]) & (e >= ri[grp]) & (m_grp >= 2)
    qs, qe = plan.reduce_final_map[grp, 0], plan.reduce_final_map[grp, 1]
    l = jnp.arange(max_qo_span, dtype=jnp.int32)
    tgt = qs[:, None] + l[None, :]  # [E, L]
    ok = e_live[:, None] & (tgt < qe[:, None]) & (tgt >= 0) & (tgt < num_rows)
    src = plan.reduce_partial_map[:, None] + l[None, :]
    ok = ok & (src >= 0) & (src < part_lse.shape[0])
    tgt = jnp.where(ok, tgt, num_rows)
    src = jnp.where(ok, src, 0)
    p_lse = part_lse[src]  # [E, L, H]
    p_out = jnp.where(ok[..., None, None], part_out[src], 0.0)  # [E, L, H, Dv]; no stray NaN
    m = jnp.full((num_rows + 1, num_heads), -jnp.inf, jnp.float32).at[tgt].max(
        jnp.where(ok[..., None], p_lse, -jnp.inf))
    m_t = m[tgt]
    finite_m = jnp.isfinite(m_t)
    w = jnp.where(ok[..., None] & finite_m & jnp.isfinite(p_lse), jnp.exp(p_lse - jnp.where(finite_m, m_t, 0.0)), 0.0)
    den = jnp.zeros((num_rows + 1, num_heads), jnp.float32).at[tgt].add(w)[:num_rows]
    num = jnp.zeros((num_rows + 1, num_heads, out.shape[-1]), jnp.float32).at[tgt].add(
        w[..., None] * p_out)[:num_rows]
    merged = jnp.zeros((num_rows + 1,), bool).at[tgt].set(True)[:num_rows]
    has = den > 0
    r_out = jnp.where(has[..., None], num / jnp.where(has, den, 1.0)[..., None], 0.0)
    r_lse = jnp.where(has, jnp.log(jnp.where(has, den, 1.0)) + m[:num_rows], jnp.inf)
    out = jnp.where(merged[:, None, None], r_out, out)
    lse = jnp.where(merged[:, None], r_lse, lse)
    return out, lse


def run_work_plan(
    q: jax.Array,  # [T, H, D]
    kv_pool: jax.Array,  # [slots, D]
    metadata,
    plan: WorkPlan,
    *,
    sm_scale: float,
    max_qo_span: int,
    max_kv_span: int,
    v_head_dim: int = 512,
    causal: bool = True,
    page_size: int = 1,
    qk_batch_ratio: int = 1,
    uni_seqlen_qo: int = -1,
    allow_legacy_mismatch: bool = False,
    work_chunk: int = 8,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out float32 [T, H, v_head_dim], lse float32 [T, H]) as the kernels + reduce would.

    Equals `mla_attention_reference` for every valid plan. `qk_batch_ratio` / `uni_seqlen_qo`
    describe decode head folding (`DecodePlanConfig.qk_batch_ratio`, `.uni_seqlen_qo`).
    `page_size` is the tokens per kv_indices entry (1: token-granular metadata).
    """
    _entry_granularity_check(plan, metadata, page_size, allow_legacy_mismatch)
    if q.ndim != 3 or kv_pool.ndim != 2 or q.shape[-1] != kv_pool.shape[-1]:
        raise ValueError(f"expected q [T, H, D] and kv_pool [slots, D], got {q.shape}, {kv_pool.shape}")
    if not 0 < v_head_dim <= kv_pool.shape[-1]:
        raise ValueError(f"v_head_dim={v_head_dim} must be in (0, {kv_pool.shape[-1]}]")
    for name, v in (("max_qo_span", max_qo_span), ("max_kv_span", max_kv_span)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if should_check(q, metadata, plan):
        enforce(_check_values, metadata, plan, q_shape=tuple(q.shape),
                qk_batch_ratio=qk_batch_ratio)
    return _run_work_plan(q, kv_pool, metadata, plan, sm_scale=sm_scale, max_qo_span=max_qo_span,
                          max_kv_span=max_kv_span, v_head_dim=v_head_dim, causal=causal,
                          page_size=page_size, qk_batch_ratio=qk_batch_ratio,
                          uni_seqlen_qo=uni_seqlen_qo,
                          allow_legacy_mismatch=allow_legacy_mismatch, work_chunk=work_chunk)


def _check_values(metadata, plan: WorkPlan, *, q_shape: tuple, qk_batch_ratio: int) -> None:
    """The executor's value checks: well-formed indptrs, query rows inside q, and (prefill) every
    q head covered by the plan's head ranges."""
    check_indptr(metadata.qo_indptr, "qo_indptr")
    check_indptr(metadata.kv_indptr, "kv_indptr", capacity=metadata.kv_indices.shape[0])
    if qk_batch_ratio == 1:
        checkify.check(
            metadata.qo_indptr[-1] <= q_shape[0],
            f"qo_indptr[-1] = {{v}} query rows but q has {q_shape[0]} rows",
            v=metadata.qo_indptr[-1])
    if plan.kind == "prefill" and len(q_shape) == 3:
        heads = q_shape[1]
        wi = plan.work_info
        live = jnp.arange(wi.shape[0]) < plan.num_works
        hr = wi[:, Q_HEAD_RANGE]
        lo = jnp.min(jnp.where(live, hr & 0xFFFF, heads))
        hi = jnp.max(jnp.where(live, hr >> 16, 0))
        checkify.check(
            (plan.num_works == 0) | ((lo == 0) & (hi == heads)),
            f"the prefill plan's works cover q heads [{{lo}}, {{hi}}) but q has {heads} heads: "
            f"build it with PrefillPlanConfig(gqa_ratio={heads}) (absorbed MLA: every q head "
            "shares the one latent KV head)",
            lo=lo, hi=hi)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "max_qo_span", "max_kv_span", "v_head_dim", "causal",
                     "page_size", "qk_batch_ratio", "uni_seqlen_qo", "allow_legacy_mismatch",
                     "work_chunk"),
)
def _run_work_plan(q, kv_pool, metadata, plan: WorkPlan, *, sm_scale, max_qo_span, max_kv_span,
                   v_head_dim, causal, page_size, qk_batch_ratio, uni_seqlen_qo,
                   allow_legacy_mismatch, work_chunk):
    ratio = qk_batch_ratio
    num_tokens, num_heads, _ = q.shape
    qo_indptr = metadata.qo_indptr
    kv_indptr, kv_indices = metadata.kv_indptr, metadata.kv_indices
    last_len = metadata.kv_last_page_len
    batch = kv_indptr.shape[0] - 1
    if ratio > 1:
        if plan.kind != "decode" or uni_seqlen_qo < 1 or num_heads % ratio:
            raise ValueError(
                f"qk_batch_ratio={ratio} needs a decode plan, uni_seqlen_qo >= 1 (got "
                f"{uni_seqlen_qo}) and num_heads ({num_heads}) divisible by the ratio")
        if num_tokens != batch * uni_seqlen_qo:
            raise ValueError(f"folded decode needs q rows = B * uni_seqlen_qo = {batch * uni_seqlen_qo}, got {num_tokens}")
        qf = _fold_q(q, ratio=ratio, seqlen=uni_seqlen_qo)
    else:
        qf = q
    rows_f, heads_f, _ = qf.shape
    hi = jax.lax.Precision.HIGHEST
    qf32 = qf.astype(jnp.float32)
    n_entries = kv_indptr[1:] - kv_indptr[:-1]
    kv_len = jnp.where(n_entries > 0, (n_entries - 1) * page_size + last_len, 0)
    qo_len = qo_indptr[1:] - qo_indptr[:-1]

    wi = plan.work_info
    w_ids = jnp.arange(plan.max_work, dtype=jnp.int32)
    live = w_ids < plan.num_works
    req = jnp.clip(wi[:, BATCH_IDX] // ratio, 0, batch - 1)
    kb = kv_indptr[req]
    tok_start = (wi[:, KV_START] - kb) * page_size
    tok_end = jnp.minimum(jnp.minimum((wi[:, KV_END] - kb) * page_size,
                                      kv_len[req] - wi[:, KV_OFFSET]), kv_len[req])
    if ratio > 1:
        q_base = uni_seqlen_qo * wi[:, BATCH_IDX]
        q_len_w = jnp.full_like(q_base, uni_seqlen_qo)
    else:
        q_base, q_len_w = qo_indptr[req], qo_len[req]
    if plan.kind == "prefill":
        h_lo, h_hi = wi[:, Q_HEAD_RANGE] & 0xFFFF, wi[:, Q_HEAD_RANGE] >> 16
    else:
        h_lo, h_hi = jnp.zeros_like(req), jnp.full_like(req, heads_f)
    span = tok_end - tok_start
    n_rows = wi[:, QO_END] - wi[:, QO_START]
    ploc = wi[:, PARTIAL_QO_LOC]
    part_rows = plan.reduce_partial_map.shape[0] * max_qo_span
    overflow = live & ((span > max_kv_span) | (n_rows > max_qo_span)
                       | ((ploc >= 0) & (ploc + n_rows > part_rows)))
    # every q head must be covered by some live work (prefill plans carry head ranges)
    covered = jnp.any(live[:, None] & (h_lo[:, None] <= jnp.arange(heads_f))
                      & (jnp.arange(heads_f) < h_hi[:, None]), axis=0)
    uncovered = jnp.any(plan.num_works > 0) & ~jnp.all(covered)

    pos = jnp.arange(max_kv_span, dtype=jnp.int32)
    lrow = jnp.arange(max_qo_span, dtype=jnp.int32)
    heads = jnp.arange(heads_f, dtype=jnp.int32)

    def one_work(args):
        qs, qe, ts, te, kbase, kvl, qb, ql = args
        u = ts + pos  # batch-local token positions
        kv_ok = (pos < te - ts) & (u >= 0)
        entry = kbase + u // page_size
        ent = kv_indices[jnp.clip(entry, 0, kv_indices.shape[0] - 1)]
        slot = ent * page_size + u % page_size if page_size > 1 else ent
        k = kv_pool[jnp.clip(jnp.where(kv_ok, slot, 0), 0, kv_pool.shape[0] - 1)]
        # select, never multiply: masked keys' rows (slot 0, unused rows: NaN, Inf) are gone
        k = jnp.where(kv_ok[:, None], k.astype(jnp.float32), 0.0)
        rows = qs + lrow
        row_ok = rows < qe
        qr = qf32[jnp.clip(rows, 0, rows_f - 1)]  # [L, Hf, D]; rows past qe are masked
        vis = kv_ok[None, :] & row_ok[:, None]
        if causal:
            vis = vis & (u[None, :] <= kvl - ql + (rows - qb)[:, None])
        s = jnp.einsum("lhd,sd->lhs", qr, k, precision=hi) * sm_scale
        s = jnp.where(vis[:, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        fm = jnp.isfinite(m)
        p = jnp.where(vis[:, None, :], jnp.exp(s - jnp.where(fm, m, 0.0)[..., None]), 0.0)
        den = jnp.sum(p, axis=-1)
        o = jnp.einsum("lhs,sd->lhd", p, k[:, :v_head_dim], precision=hi)
        has = den > 0
        o = jnp.where(has[..., None], o / jnp.where(has, den, 1.0)[..., None], 0.0)
        lse = jnp.where(has, jnp.log(jnp.where(has, den, 1.0)) + jnp.where(fm, m, 0.0), -jnp.inf)
        return o, lse

    rows = wi[:, QO_START][:, None] + lrow[None, :]  # [W, L]
    ok = (live[:, None] & (rows < wi[:, QO_END][:, None]))[:, :, None] & (
        (heads[None, None, :] >= h_lo[:, None, None]) & (heads[None, None, :] < h_hi[:, None, None]))
    final = (ploc < 0)[:, None, None] & ok
    partial = (ploc >= 0)[:, None, None] & ok
    # Scatter targets; masked entries go to a spare last slot (everything stays in bounds, so
    # this also runs under checkify's index checks).
    in_rows = ((rows >= 0) & (rows < rows_f))[:, :, None]
    f_spare, p_spare = rows_f * heads_f, part_rows * heads_f
    f_idx = jnp.where(final & in_rows, rows[:, :, None] * heads_f + heads[None, None, :], f_spare)
    p_rows = ploc[:, None] + lrow[None, :]
    p_idx = jnp.where(partial & (p_rows < part_rows)[:, :, None],
                      p_rows[:, :, None] * heads_f + heads[None, None, :], p_spare)

    # Works run in chunks of `work_chunk`: vectorised inside a chunk, sequential across chunks,
    # each chunk scattering its rows straight into the output / partial buffers. Live works are
    # the prefix [0, num_works), so chunks without a live work are skipped: time and memory
    # follow the plan's live works, not its static capacity (max_work can be 10-100x larger).
    chunk = max(1, min(work_chunk, plan.max_work))
    n_chunks = -(-plan.max_work // chunk)
    pad = n_chunks * chunk - plan.max_work

    def chunked(a, fill=0):
        widths = [(0, pad)] + [(0, 0)] * (a.ndim - 1)
        return jnp.pad(a, widths, constant_values=fill).reshape((n_chunks, chunk) + a.shape[1:])

    work_args = tuple(chunked(a) for a in (
        wi[:, QO_START], wi[:, QO_END], tok_start, tok_end, kb, kv_len[req], q_base, q_len_w))
    live_c = chunked(live, False)
    f_idx_c, p_idx_c = chunked(f_idx, f_spare), chunked(p_idx, p_spare)

    def run_chunk(c, bufs):
        def compute(bufs):
            out, lse, part_out, part_lse = bufs
            o_w, lse_w = jax.vmap(one_work)(tuple(a[c] for a in work_args))  # [C, L, Hf, (Dv)]
            fi, pi = f_idx_c[c].reshape(-1), p_idx_c[c].reshape(-1)
            o_flat, l_flat = o_w.reshape(-1, v_head_dim), lse_w.reshape(-1)
            # final rows: out 0 and lse +inf where nothing is visible
            out = out.at[fi].set(o_flat)
            lse = lse.at[fi].set(jnp.where(jnp.isneginf(l_flat), jnp.inf, l_flat))
            part_out = part_out.at[pi].set(o_flat)
            part_lse = part_lse.at[pi].set(l_flat)
            return out, lse, part_out, part_lse

        return jax.lax.cond(jnp.any(live_c[c]), compute, lambda b: b, bufs)

    bufs = (jnp.zeros((f_spare + 1, v_head_dim), jnp.float32),
            jnp.full((f_spare + 1,), jnp.inf, jnp.float32),
            jnp.zeros((p_spare + 1, v_head_dim), jnp.float32),
            jnp.full((p_spare + 1,), -jnp.inf, jnp.float32))
    out, lse, part_out, part_lse = (b[:-1] for b in jax.lax.fori_loop(0, n_chunks, run_chunk, bufs))

    out, lse = reduce_partials(
        out.reshape(rows_f, heads_f, v_head_dim), lse.reshape(rows_f, heads_f),
        part_out.reshape(part_rows, heads_f, v_head_dim), part_lse.reshape(part_rows, heads_f),
        plan, max_qo_span=max_qo_span)
    bad = jnp.any(overflow) | uncovered
    out = jnp.where(bad, jnp.nan, out)
    lse = jnp.where(bad, jnp.nan, lse)
    if ratio > 1:
        out = _unfold(out, ratio=ratio, seqlen=uni_seqlen_qo)
        lse = _unfold(lse, ratio=ratio, seqlen=uni_seqlen_qo)
    return out, lse


def plan_spans(plan: WorkPlan, metadata, *, page_size: int = 1, qk_batch_ratio: int = 1) -> tuple[int, int]:
    """Host helper: (max_qo_span, max_kv_span) the live works of `plan` need (at least 1 each),
    computed with the executor's own range rule. Needs concrete arrays."""
    wi = np.asarray(plan.work_info)[: int(plan.num_works)]
    if len(wi) == 0:
        return 1, 1
    kv_indptr = np.asarray(metadata.kv_indptr)
    last = np.asarray(metadata.kv_last_page_len)
    n = np.diff(kv_indptr)
    kv_len = np.where(n > 0, (n - 1) * page_size + last, 0)
    req = np.clip(wi[:, BATCH_IDX] // qk_batch_ratio, 0, len(n) - 1)
    kb = kv_indptr[req]
    start = (wi[:, KV_START] - kb) * page_size
    end = np.minimum(np.minimum((wi[:, KV_END] - kb) * page_size, kv_len[req] - wi[:, KV_OFFSET]), kv_len[req])
    return max(1, int((wi[:, QO_END] - wi[:, QO_START]).max())), max(1, int((end - start).max()))
