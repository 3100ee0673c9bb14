"""Absorbed MLA decode over the paged latent pool: a Pallas kernel on the Triton lowering.

One program handles `block_m` folded query rows of one sequence (rows = s_q tokens x H heads,
token-major) against one split of that sequence's KV. Each step gathers `block_kv` pool rows by
slot id and reads each row once for both products: the 576 columns load as two power-of-two
tiles (512 + 64; the Triton lowering needs power-of-two tiles), scores = q_nope k_nope^T +
q_pe k_pe^T, and the 512-wide k_nope tile doubles as V. Online softmax in base 2 with fp32
accumulators. Grid (row blocks, splits, sequences), row blocks fastest, so programs reading the
same KV run side by side and the second read of a tile comes from L2.

Masking: token j is visible to query token i (of s_q) iff j < kv_len - s_q + 1 + i. Loads past
kv_len are predicated off and read as 0, and masked scores are selected to -inf, so no unused
pool row (NaN, Inf) reaches the result. A sequence with kv_len = 0 gives out 0 and lse +inf.
Slot ids are int32; the lowering forms 64-bit element offsets once the pool exceeds 4 GiB
(`python -m bench.decode --big-pool` checks it).

An fp8 pool (float8_e4m3fn) is read as fp8 bytes (half the traffic of bf16) and converted on
chip; the per-layer k_scale multiplies the float32 scores and v_scale the float32 output
(`funcmla.attention.kv_quant`), so the fp8 values themselves are never rescaled. Below 64 rows
(mma.sync) the bytes become f16 (one instruction a pair on sm_90, exact), q is scaled per row
by a power of two so that f16 holds it, and each tile is handled in `FP8_CHUNK`-column pieces:
a piece feeds q k^T straight from shared memory and, converted in registers, is staged in
shared memory as f16 for P V (the transposed read that 8-bit types have no ldmatrix for). At
64 rows (wgmma) the bytes become q's dtype and V is a second fp8 load of the same rows.

Arguments are checked by `funcmla.attention.pallas.api`, which calls `decode_call`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.attention.pallas.decode_common import (
    FP8_CHUNK,
    DecodeKernelConfig,
    KVRows,
    causal_limit,
    f16_row_scales,
    num_row_blocks,
    seq_start_and_len,
    split_tile_range,
)

__all__ = ["decode_call"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


def _f16_row_scales(q_ref, d_v: int, d_rope: int):
    """`f16_row_scales` of q's rows (the nope and rope parts load apart: Triton tiles powers
    of two)."""
    qn = q_ref[:, pl.ds(0, d_v)].astype(jnp.float32)
    qp = q_ref[:, pl.ds(d_v, d_rope)].astype(jnp.float32)
    return f16_row_scales(jnp.maximum(jnp.max(jnp.abs(qn), axis=1), jnp.max(jnp.abs(qp), axis=1)))


def _softmax_step(s, pos, limit, score_scale, m_i, l_i):
    """One tile of the masked online softmax in base 2: raw scores s [M, N] of tokens `pos` [N],
    scaled by `score_scale` (log2 units) and masked past each row's `limit` [M], against the
    running max m_i and sum l_i [M]. Returns (p, alpha, m_new, l_new). Masked scores are
    selected to -inf, not multiplied, so their P is exactly 0; a row with no score yet keeps
    max -inf and rescales by exp2(-inf - 0) = 0."""
    s = jnp.where(pos[None, :] < limit[:, None], s * score_scale, -jnp.inf)
    m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m_i - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + jnp.sum(p, axis=1)


def _decode_kernel(*refs, form: str, n_meta: int, entries_per_seq: int | None, page_size: int,
                   block_kv: int, num_splits: int, s_q: int, num_heads: int, d_v: int,
                   d_rope: int, scale_log2: float, final: bool, evict_first: bool,
                   fp8: bool):
    hb = pl.program_id(0)
    split = pl.program_id(1)
    b = pl.program_id(2)
    meta, refs = refs[:n_meta], refs[n_meta:]
    if fp8:
        table_ref, q_ref, kv_ref, k_scale_ref, v_scale_ref, o_ref, lse_ref = refs
        score_scale = scale_log2 * k_scale_ref[0]
    else:
        table_ref, q_ref, kv_ref, o_ref, lse_ref = refs
        score_scale = scale_log2
    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)
    block_m = q_ref.shape[0]
    table_len = table_ref.shape[0]

    rows = hb * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    tok = rows // num_heads  # padded rows (tok >= s_q) clamp to kv_len
    limit = causal_limit(kv_len, s_q, tok)

    q_nope = q_ref[:, pl.ds(0, d_v)]
    q_pe = q_ref[:, pl.ds(d_v, d_rope)]

    first, last = split_tile_range(kv_len, split, num_splits, block_kv)
    if fp8 and block_m < 64:
        _fp8_narrow(q_ref, kv_ref, table_ref, o_ref, lse_ref, v_scale_ref,
                    score_scale=score_scale, first=first, last=last, kv_len=kv_len,
                    start_entry=start_entry, limit=limit, page_size=page_size,
                    block_kv=block_kv, d_v=d_v, d_rope=d_rope, final=final,
                    evict_first=evict_first)
        return

    eviction = "evict_first" if evict_first else None
    cols_v = lax.broadcasted_iota(jnp.int32, (block_kv, d_v), 1)
    cols_r = d_v + lax.broadcasted_iota(jnp.int32, (block_kv, d_rope), 1)
    nt = (((1,), (1,)), ((), ()))

    def body(blk, carry):
        acc, m_i, l_i = carry
        pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        in_seq = pos < kv_len
        entry = jnp.minimum(start_entry + pos // page_size, table_len - 1)
        ids = table_ref[entry]
        slot = jnp.where(in_seq, ids * page_size + pos % page_size, 0)
        # Two gathers of the same rows (columns [0, 512) and [512, 576)), masked past kv_len:
        # rows there read as 0 whatever the pool holds. Array indices on both axes let the
        # interpret-mode discharge express each as one gather.
        rows_k = slot[:, None]
        mask = jnp.broadcast_to(in_seq[:, None], (block_kv, d_v))
        k_nope = pltriton.load(
            kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, d_v)), cols_v], mask=mask,
            other=0.0, eviction_policy=eviction)
        mask = jnp.broadcast_to(in_seq[:, None], (block_kv, d_rope))
        k_pe = pltriton.load(
            kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, d_rope)), cols_r], mask=mask,
            other=0.0, eviction_policy=eviction)
        v = k_nope
        if fp8:
            # 64 rows (wgmma): fp8 bytes converted to q's dtype on chip (exact: bf16 and f16
            # hold every e4m3 value). V is loaded a second time (from L2/L1): one fp8 tile
            # converted for two products in two layouts is not pipelined by Triton, a tile
            # per product is.
            v = pltriton.load(
                kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, d_v)), cols_v],
                mask=jnp.broadcast_to(in_seq[:, None], (block_kv, d_v)), other=0.0,
                eviction_policy="evict_last" if evict_first else "evict_first")
            k_nope, k_pe = k_nope.astype(q_nope.dtype), k_pe.astype(q_nope.dtype)
            v = v.astype(q_nope.dtype)
        s = lax.dot_general(q_nope, k_nope, nt, preferred_element_type=jnp.float32)
        s = s + lax.dot_general(q_pe, k_pe, nt, preferred_element_type=jnp.float32)
        p, alpha, m_new, l_new = _softmax_step(s, pos, limit, score_scale, m_i, l_i)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l_new

    acc = jnp.zeros((block_m, d_v), jnp.float32)
    m_i = jnp.full((block_m,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((block_m,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(first, last, body, (acc, m_i, l_i))

    has = l_i > 0.0
    denom = jnp.where(has, l_i, 1.0)
    if fp8:
        denom = denom / v_scale_ref[0]
    o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)
    _store_lse(lse_ref, m_i, l_i, has, final)


def _store_lse(lse_ref, m_i, l_i, has, final: bool):
    empty = jnp.inf if final else -jnp.inf
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * _LN2, empty)


def _fp8_narrow(q_ref, kv_ref, table_ref, o_ref, lse_ref, v_scale_ref, *, score_scale, first,
                last, kv_len, start_entry, limit, page_size: int, block_kv: int, d_v: int,
                d_rope: int, final: bool, evict_first: bool):
    """The fp8 loop below 64 rows (mma.sync): f16 products over `FP8_CHUNK`-column pieces.

    Each piece of a tile is one fp8 load (predicated off past kv_len: 0 whatever the pool
    holds) with two users: q k^T reads it from shared memory and converts in the matrix-operand
    layout (K-major, no transpose), and P V takes it converted in registers and selected
    against the same mask. The select keeps Triton from moving the conversion behind the
    layout change (`OptimizeDotOperands` does not hoist through `arith.select`), so V reaches
    shared memory as f16 and is read with `ldmatrix.trans`; hoisted, the transposed 8-bit
    operand is read a byte at a time. Accumulators are kept a piece each."""
    block_m = q_ref.shape[0]
    table_len = table_ref.shape[0]
    if d_v % FP8_CHUNK:
        raise ValueError(f"the fp8 decode kernel needs v_head_dim a multiple of {FP8_CHUNK}, "
                         f"got {d_v}")
    n_chunks = d_v // FP8_CHUNK
    f16 = jnp.float16
    if q_ref.dtype == f16:
        scale = lambda x: x  # noqa: E731
    else:
        up, down = _f16_row_scales(q_ref, d_v, d_rope)
        score_scale = score_scale * down[:, None]
        scale = lambda x: (x.astype(jnp.float32) * up[:, None]).astype(f16)  # noqa: E731
    q_chunks = [scale(q_ref[:, pl.ds(c * FP8_CHUNK, FP8_CHUNK)]) for c in range(n_chunks)]
    q_pe = scale(q_ref[:, pl.ds(d_v, d_rope)])
    eviction = "evict_first" if evict_first else None
    nt = (((1,), (1,)), ((), ()))
    nn = (((1,), (0,)), ((), ()))

    def gather(rows_k, in_seq, col0: int, width: int):
        cols = col0 + lax.broadcasted_iota(jnp.int32, (block_kv, width), 1)
        return pltriton.load(
            kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, width)), cols],
            mask=jnp.broadcast_to(in_seq[:, None], (block_kv, width)), other=0.0,
            eviction_policy=eviction)

    def body(blk, carry):
        accs, m_i, l_i = carry
        pos = blk * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        in_seq = pos < kv_len
        entry = jnp.minimum(start_entry + pos // page_size, table_len - 1)
        ids = table_ref[entry]
        rows_k = jnp.where(in_seq, ids * page_size + pos % page_size, 0)[:, None]
        pieces, s = [], None
        for c, q_c in enumerate(q_chunks):
            pieces.append(gather(rows_k, in_seq, c * FP8_CHUNK, FP8_CHUNK))
            part = lax.dot_general(q_c, pieces[-1].astype(f16), nt,
                                   preferred_element_type=jnp.float32)
            s = part if s is None else s + part
        k_pe = gather(rows_k, in_seq, d_v, d_rope).astype(f16)
        s = s + lax.dot_general(q_pe, k_pe, nt, preferred_element_type=jnp.float32)
        p, alpha, m_new, l_new = _softmax_step(s, pos, limit, score_scale, m_i, l_i)
        p = p.astype(f16)
        out = []
        for acc, k_c in zip(accs, pieces):
            live = jnp.broadcast_to(in_seq[:, None], k_c.shape)
            v = jnp.where(live, k_c.astype(f16), 0.0).astype(f16)
            out.append(acc * alpha[:, None]
                       + lax.dot_general(p, v, nn, preferred_element_type=jnp.float32))
        return tuple(out), m_new, l_new

    accs = tuple(jnp.zeros((block_m, FP8_CHUNK), jnp.float32) for _ in range(n_chunks))
    m_i = jnp.full((block_m,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((block_m,), jnp.float32)
    accs, m_i, l_i = lax.fori_loop(first, last, body, (accs, m_i, l_i))

    has = l_i > 0.0
    denom = jnp.where(has, l_i, 1.0) / v_scale_ref[0]
    for c, acc in enumerate(accs):
        o_ref[:, pl.ds(c * FP8_CHUNK, FP8_CHUNK)] = (acc / denom[:, None]).astype(o_ref.dtype)
    _store_lse(lse_ref, m_i, l_i, has, final)


def decode_call(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float, s_q: int,
                num_splits: int, config: DecodeKernelConfig, v_head_dim: int,
                interpret: bool, scales: tuple[jax.Array, jax.Array] | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """The decode pallas_call on checked arguments (`api.check_decode_args`). `scales`:
    (k_scale, v_scale) float32 [1] for an fp8 pool, None otherwise.

    Returns o [B, S, rows_pad, Dv] (q.dtype when S == 1, else `config.partial_dtype`) and lse
    float32 [B, S, rows_pad] (S == 1: +inf for no KV; else -inf for an empty split); rows =
    s_q * H folded token-major, rows_pad = rows rounded up to block_m.
    """
    t, h, d = q.shape
    b = t // s_q
    d_rope = d - v_head_dim
    rows = s_q * h
    block_m = config.resolved_block_m(rows)
    n_rb = num_row_blocks(rows, block_m)
    rows_pad = n_rb * block_m
    final = num_splits == 1

    qr = q.reshape(b, rows, d)
    if rows_pad != rows:
        qr = jnp.pad(qr, ((0, 0), (0, rows_pad - rows), (0, 0)))

    meta = kv.meta_operands()
    kernel = functools.partial(
        _decode_kernel, form=kv.form, n_meta=len(meta), entries_per_seq=kv.entries_per_seq,
        page_size=kv.page_size, block_kv=config.block_kv, num_splits=num_splits,
        s_q=s_q, num_heads=h, d_v=v_head_dim, d_rope=d_rope,
        scale_log2=float(sm_scale) * _LOG2E, final=final, evict_first=config.evict_first,
        fp8=scales is not None)
    o_dtype = q.dtype if final else jnp.dtype(config.partial_dtype)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))  # noqa: E731
    in_specs = [full(m.shape) for m in meta] + [
        full(kv.table.shape),
        pl.BlockSpec((None, block_m, d), lambda i, j, k: (k, i, 0)),
        full(kv_pool.shape),
    ] + ([full((1,)), full((1,))] if scales is not None else [])
    out_specs = [
        pl.BlockSpec((None, None, block_m, v_head_dim), lambda i, j, k: (k, j, i, 0)),
        pl.BlockSpec((None, None, block_m), lambda i, j, k: (k, j, i)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, num_splits, rows_pad, v_head_dim), o_dtype),
                 jax.ShapeDtypeStruct((b, num_splits, rows_pad), jnp.float32)]
    o, lse = pl.pallas_call(
        kernel,
        grid=(n_rb, num_splits, b),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(
            num_warps=config.resolved_num_warps(block_m),
            num_stages=config.resolved_num_stages(block_m)),
        interpret=interpret,
        name=(f"mla_decode_ps{kv.page_size}_m{block_m}_kv{config.block_kv}"
              + ("_fp8" if scales is not None else "")),
    )(*meta, kv.table, qr, kv_pool, *(scales or ()))
    return o, lse
