"""Dense reference for absorbed MLA attention over a paged latent pool, driven by metadata.

    q        [T, H, D]      D = kv_lora_rank + qk_rope_head_dim (576)
    kv_pool  [slots, D]     one latent row per token slot; V = kv_pool[:, :v_head_dim] (512)
    qo_indptr, kv_indptr    int32 [B + 1]  token offsets (queries, keys)
    kv_indices              int32 [capacity]  token slots

Query j (0-based) of request i, with q_len = qo_indptr[i+1] - qo_indptr[i] queries and
kv_len = kv_indptr[i+1] - kv_indptr[i] keys, attends to keys [0, kv_len - (q_len - 1 - j))
when causal (bottom-right aligned: the last query sees every key), else to all kv_len keys.
Queries past qo_indptr[-1] (padding) and queries that see no key get out = 0 and lse = +inf,
as FlashMLA and AITER report them. Everything is computed in float32 (`Precision.HIGHEST`);
lse is the natural log of the softmax denominator of the scaled scores. An fp8 pool
(`funcmla.attention.kv_quant`) is dequantized in float32: k = k_scale * x, v = v_scale * x.

Masked keys contribute exactly zero whatever their pool rows hold (NaN, Inf): they are selected
away before the products, never multiplied by a zero weight.

`mha_attention_reference` is the same rule for ragged multi-head attention over dense
q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv] (the MHA prefill, `funcmla.attention.pallas.prefill`). Values are checked
(`funcmla.checks.check_attention_values`) when concrete and under `funcmla.checks.checked`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from funcmla.attention.kv_quant import check_kv_pool_dtype, kv_scales
from funcmla.checks import check_attention_values
from funcmla.guards import enforce, should_check
from funcmla.layout import expect_index_array
from funcmla.segments import segment_ids, take_or_fill

__all__ = ["mla_attention_reference", "mha_attention_reference", "visible_kv_lens"]


def visible_kv_lens(
    qo_indptr: jax.Array, kv_indptr: jax.Array, num_q: int, *, causal: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Per query row t < num_q: (request index b [T], keys visible to it [T]).

    Rows past qo_indptr[-1] get b = num_requests and 0 visible keys.
    """
    batch = qo_indptr.shape[0] - 1
    b = segment_ids(qo_indptr, num_q)
    live = b < batch
    bc = jnp.minimum(b, batch - 1)
    t = jnp.arange(num_q, dtype=jnp.int32)
    q_len = qo_indptr[bc + 1] - qo_indptr[bc]
    kv_len = kv_indptr[bc + 1] - kv_indptr[bc]
    j = t - qo_indptr[bc]
    vis = kv_len - (q_len - 1 - j) if causal else kv_len
    vis = jnp.where(live, jnp.clip(vis, 0, kv_len), 0)
    return b, vis.astype(jnp.int32)


def _softmax_attend(s, valid, has, weigh_values):
    """One query's (out [H, Dv], lse [H]) from its scaled scores s [H, S]: keys where `valid`
    is False are selected away (never multiplied by zero), and a query with no key (`has`
    False) gets out 0 and lse +inf. `weigh_values(p)` is p [H, S] applied to the values."""
    s = jnp.where(valid[None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[None, :], jnp.exp(s - m), 0.0)
    denom = jnp.where(has, jnp.sum(p, axis=-1), 1.0)
    out = jnp.where(has, weigh_values(p) / denom[:, None], 0.0)
    lse = jnp.where(has, m[:, 0] + jnp.log(denom), jnp.inf)
    return out, lse


def mla_attention_reference(
    q: jax.Array,  # [T, H, D]
    kv_pool: jax.Array,  # [slots, D]
    qo_indptr: jax.Array,  # int32 [B + 1]
    kv_indptr: jax.Array,  # int32 [B + 1]
    kv_indices: jax.Array,  # int32 [capacity]
    *,
    sm_scale: float,
    v_head_dim: int = 512,
    causal: bool = True,
    max_kv_len: int | None = None,
    query_chunk: int = 16,
    k_scale=None,
    v_scale=None,
) -> tuple[jax.Array, jax.Array]:
    """Returns (out float32 [T, H, v_head_dim], lse float32 [T, H]).

    `max_kv_len` (static, tokens) bounds the keys gathered per query; it defaults to
    `kv_indices.shape[0]`, always correct but slower. Checked (eager, or under
    `funcmla.checks.checked`): well-formed indptrs, `qo_indptr[-1] <= T` (no request dropped),
    `kv_indptr[-1] <= capacity`, every request's KV length <= `max_kv_len`, live slots inside
    the pool. Unchecked under `jit`, nothing is read out of bounds (keys past `max_kv_len` are
    ignored, queries past `T` are not computed). `k_scale` / `v_scale`: the per-layer scales
    of an fp8 pool (`funcmla.attention.kv_quant`; a float or a float32 array of shape () or
    [1]); an error for other pools.
    """
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                    ("kv_indices", kv_indices)):
        expect_index_array(x, name)
    if q.ndim != 3 or kv_pool.ndim != 2 or q.shape[-1] != kv_pool.shape[-1]:
        raise ValueError(
            f"expected q [T, H, D] and kv_pool [slots, D], got q {q.shape}, kv_pool {kv_pool.shape}"
        )
    if qo_indptr.shape != kv_indptr.shape or qo_indptr.ndim != 1 or kv_indices.ndim != 1:
        raise ValueError(
            f"qo_indptr and kv_indptr must both be [B + 1] and kv_indices 1-D, got "
            f"{tuple(qo_indptr.shape)}, {tuple(kv_indptr.shape)}, {tuple(kv_indices.shape)}")
    if not 0 < v_head_dim <= kv_pool.shape[-1]:
        raise ValueError(f"v_head_dim={v_head_dim} must be in (0, {kv_pool.shape[-1]}]")
    check_kv_pool_dtype(kv_pool.dtype)
    scales = kv_scales(kv_pool.dtype, k_scale, v_scale)
    if max_kv_len is not None and (not isinstance(max_kv_len, int) or max_kv_len < 0):
        raise ValueError(f"max_kv_len must be an int >= 0 or None, got {max_kv_len!r}")
    if should_check(qo_indptr, kv_indptr, kv_indices):
        enforce(check_attention_values, qo_indptr, kv_indptr, kv_indices, num_q=q.shape[0],
                num_slots=kv_pool.shape[0], max_kv_len=max_kv_len)
    return _reference(q, kv_pool, qo_indptr, kv_indptr, kv_indices, scales, sm_scale=sm_scale,
                      v_head_dim=v_head_dim, causal=causal, max_kv_len=max_kv_len,
                      query_chunk=query_chunk)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "v_head_dim", "causal", "max_kv_len", "query_chunk")
)
def _reference(q, kv_pool, qo_indptr, kv_indptr, kv_indices, scales, *, sm_scale, v_head_dim,
               causal, max_kv_len, query_chunk):
    num_q, num_heads, _ = q.shape
    span = kv_indices.shape[0] if max_kv_len is None else int(max_kv_len)
    span = max(span, 1)
    b, vis = visible_kv_lens(qo_indptr, kv_indptr, num_q, causal=causal)
    batch = qo_indptr.shape[0] - 1
    start = kv_indptr[jnp.minimum(b, batch - 1)]
    pos = jnp.arange(span, dtype=jnp.int32)
    hi = jax.lax.Precision.HIGHEST
    k_scale, v_scale = (1.0, 1.0) if scales is None else (scales[0][0], scales[1][0])

    def one_query(args):
        q_t, start_t, vis_t = args
        valid = pos < vis_t
        slots = take_or_fill(kv_indices, start_t + pos, fill=-1)
        k = take_or_fill(kv_pool, slots, fill=0)
        # select, never multiply: a masked key's row (slot 0, an unused row: NaN, Inf) is gone
        k = jnp.where(valid[:, None], k.astype(jnp.float32), 0.0)  # [S, D]
        v = k[:, :v_head_dim] * v_scale  # fp8 pools: dequantized in float32
        k = k * k_scale
        s = jnp.einsum("hd,sd->hs", q_t.astype(jnp.float32), k, precision=hi) * sm_scale
        return _softmax_attend(s, valid, vis_t > 0,
                               lambda p: jnp.einsum("hs,sd->hd", p, v, precision=hi))

    out, lse = jax.lax.map(one_query, (q, start, vis), batch_size=max(1, min(query_chunk, num_q)))
    return out.astype(jnp.float32), lse.astype(jnp.float32)


def mha_attention_reference(
    q: jax.Array,  # [Tq, H, Dqk]
    k: jax.Array,  # [Tk, H, Dqk]
    v: jax.Array,  # [Tk, H, Dv]
    qo_indptr: jax.Array,  # int32 [B + 1]
    kv_indptr: jax.Array,  # int32 [B + 1]
    *,
    sm_scale: float,
    causal: bool = True,
    max_kv_len: int | None = None,
    query_chunk: int = 16,
) -> tuple[jax.Array, jax.Array]:
    """Ragged multi-head attention in float32: (out [Tq, H, Dv], lse [Tq, H]).

    Request i's queries are q rows [qo_indptr[i], qo_indptr[i+1]), its keys and values k / v
    rows [kv_indptr[i], kv_indptr[i+1]); head h of a query attends to head h of its keys
    (num_kv_heads = H). Causal is bottom-right, as in `mla_attention_reference`; queries that
    see no key (kv_len 0, rows past qo_indptr[-1]) get out 0 and lse +inf. Keys outside a
    query's visible range are selected away before the products (NaN or Inf rows there never
    reach the output). `max_kv_len` (static) bounds the keys gathered per query (default Tk).
    """
    for name, x in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr)):
        expect_index_array(x, name)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or q.shape[1:] != k.shape[1:] \
            or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"expected q [Tq, H, D], k [Tk, H, D], v [Tk, H, Dv], got q {q.shape}, "
                         f"k {k.shape}, v {v.shape}")
    if qo_indptr.shape != kv_indptr.shape or qo_indptr.ndim != 1:
        raise ValueError(f"qo_indptr and kv_indptr must both be [B + 1], got "
                         f"{tuple(qo_indptr.shape)}, {tuple(kv_indptr.shape)}")
    return _mha_reference(q, k, v, qo_indptr, kv_indptr, sm_scale=float(sm_scale),
                          causal=causal, max_kv_len=max_kv_len, query_chunk=query_chunk)


@functools.partial(jax.jit, static_argnames=("sm_scale", "causal", "max_kv_len", "query_chunk"))
def _mha_reference(q, k, v, qo_indptr, kv_indptr, *, sm_scale, causal, max_kv_len,
                   query_chunk):
    num_q = q.shape[0]
    span = max(k.shape[0] if max_kv_len is None else int(max_kv_len), 1)
    b, vis = visible_kv_lens(qo_indptr, kv_indptr, num_q, causal=causal)
    start = kv_indptr[jnp.minimum(b, qo_indptr.shape[0] - 2)]
    pos = jnp.arange(span, dtype=jnp.int32)
    hi = jax.lax.Precision.HIGHEST

    def one_query(args):
        q_t, start_t, vis_t = args
        valid = pos < vis_t
        rows = start_t + pos
        kt = jnp.where(valid[:, None, None], take_or_fill(k, rows, fill=0).astype(jnp.float32),
                       0.0)  # [S, H, D]; select, never multiply
        vt = jnp.where(valid[:, None, None], take_or_fill(v, rows, fill=0).astype(jnp.float32),
                       0.0)
        s = jnp.einsum("hd,shd->hs", q_t.astype(jnp.float32), kt, precision=hi) * sm_scale
        return _softmax_attend(s, valid, vis_t > 0,
                               lambda p: jnp.einsum("hs,shd->hd", p, vt, precision=hi))

    out, lse = jax.lax.map(one_query, (q, start, vis), batch_size=max(1, min(query_chunk, num_q)))
    return out.astype(jnp.float32), lse.astype(jnp.float32)
