"""Absorbed MLA decode over the paged latent pool: a Pallas kernel on the Triton lowering.

One program handles `block_m` folded query rows of one sequence (rows = s_q tokens x H heads,
token-major, so q[b*s_q:(b+1)*s_q] is one contiguous [s_q*H, 576] slab) against one split of
that sequence's KV. Each step gathers `block_kv` pool rows by slot id and reads each row once for
both products: 576 = 512 + 64 is split into two power-of-two loads (the Triton lowering needs
power-of-two tiles), scores = q_nope.k_nope^T + q_pe.k_pe^T, and the 512-wide k_nope tile doubles
as V. Online softmax in base 2 with fp32 accumulators; splits are merged by the one-launch
log-sum-exp kernel of `merge.py`, skipped when there is one split. The sequence's start in the
index table and its KV length are read in the kernel (from kv_indptr for a token CSR, from the
lengths for a page table), so a decode step is one launch (two with a split). Opt-in
(`DecodeKernelConfig.merge_in_kernel`, `mla_decode_merged_rows`): the split program that
finishes last merges its row block in the same launch (an atomic arrival counter); measured
slower than the merge launch on the H200, see `_merge_if_last`.

`mla_decode` is the entry point for both decode kernels: on a GPU it hands bf16 64-row blocks
(at large enough batches) to the warp-specialized Mosaic GPU kernel of
`decode_mgpu.py` (`uses_mgpu`, `DecodeKernelConfig.kernel`), the rest to this one.

Grid: (row blocks, splits, sequences), row blocks fastest, so the programs that read the same KV
run side by side and the second read of a tile comes from L2.

Masking: token j of sequence b is visible to query token i (0-based among its s_q tokens) iff
j < kv_len - s_q + 1 + i (bottom-right causal; with s_q = 1 simply j < kv_len). Gathers past
kv_len are predicated off and read as 0, so whatever the pool holds there (NaN included) never
reaches the result. A sequence with kv_len = 0 gives out 0 and lse +inf.

Addressing: slot ids are int32; the Triton lowering computes element offsets in 64-bit once the
pool exceeds 4 GiB (2**31 bf16 elements), so pools past 2**31 / 576 slots are addressed
correctly (checked on the GPU in bench/decode.py --big-pool). Pools past 2**31 - 1 rows are
rejected.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from funcmla.attention.pallas.decode_common import (
    MAX_POOL_ROWS,
    DecodeKernelConfig,
    KVRows,
    causal_limit,
    choose_num_splits,
    kv_rows_from_csr,
    kv_rows_from_page_table,
    merges_in_kernel,
    num_row_blocks,
    seq_start_and_len,
    split_tile_range,
)
from funcmla.attention.pallas.decode_mgpu import BLOCK_M as MGPU_BLOCK_M
from funcmla.attention.pallas.decode_mgpu import (
    mgpu_decode_supported,
    mgpu_split_config,
    mla_decode_rows_mgpu,
)
from funcmla.attention.pallas.merge import (
    merge_columns,
    merge_ops,
    merge_splits_pallas,
    merge_weights,
)
from funcmla.layout import PageTable, is_power_of_two

__all__ = ["mla_decode", "mla_decode_rows", "mla_decode_merged_rows", "decode_counters",
           "validate_decode_inputs", "DecodeKernelConfig", "uses_mgpu", "decode_num_splits"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
# In-launch merge: partial elements (all splits) read per column chunk. 4 splits x 16 rows x
# 512 columns is one round of loads (64 LDG.128 a thread, no spills; triton 3.6, sm_90a).
_MERGE_LOAD_ELEMS = 32768


def _decode_kernel(*refs, form: str, n_meta: int, entries_per_seq: int | None, page_size: int,
                   block_kv: int, num_splits: int, s_q: int, num_heads: int, d_v: int,
                   d_rope: int, scale_log2: float, final: bool, evict_first: bool,
                   fuse_merge: bool, merge_cols: int | None, interpret: bool):
    hb = pl.program_id(0)
    split = pl.program_id(1)
    b = pl.program_id(2)
    meta, (table_ref, q_ref, kv_ref) = refs[:n_meta], refs[n_meta:n_meta + 3]
    if fuse_merge:  # + counters (input, aliased to the last output); partials, merged, counters
        o_ref, lse_ref, out_ref, lse_out_ref, cnt_ref = refs[n_meta + 4:]
    else:
        o_ref, lse_ref = refs[n_meta + 3:]
    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)
    block_m = q_ref.shape[0]
    table_len = table_ref.shape[0]

    rows = hb * block_m + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    tok = rows // num_heads  # padded rows (tok >= s_q) clamp to kv_len
    limit = causal_limit(kv_len, s_q, tok)

    q_nope = q_ref[:, pl.ds(0, d_v)]
    q_pe = q_ref[:, pl.ds(d_v, d_rope)]

    first, last = split_tile_range(kv_len, split, num_splits, block_kv)

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
        # Two 2-D gathers of the same rows (columns [0, 512) and [512, 576)); both indices are
        # arrays so the interpret-mode discharge can express them as one gather each.
        rows_k = slot[:, None]
        mask = jnp.broadcast_to(in_seq[:, None], (block_kv, d_v))
        k_nope = pltriton.load(
            kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, d_v)), cols_v], mask=mask,
            other=0.0, eviction_policy=eviction)
        mask = jnp.broadcast_to(in_seq[:, None], (block_kv, d_rope))
        k_pe = pltriton.load(
            kv_ref.at[jnp.broadcast_to(rows_k, (block_kv, d_rope)), cols_r], mask=mask,
            other=0.0, eviction_policy=eviction)
        s = lax.dot_general(q_nope, k_nope, nt, preferred_element_type=jnp.float32)
        s = s + lax.dot_general(q_pe, k_pe, nt, preferred_element_type=jnp.float32)
        s = jnp.where(pos[None, :] < limit[:, None], s * scale_log2, -jnp.inf)
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        pv = lax.dot_general(p.astype(k_nope.dtype), k_nope, (((1,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
        return acc * alpha[:, None] + pv, m_new, l_new

    acc = jnp.zeros((block_m, d_v), jnp.float32)
    m_i = jnp.full((block_m,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((block_m,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(first, last, body, (acc, m_i, l_i))

    has = l_i > 0.0
    # With the in-launch merge, o_ref / lse_ref hold all splits of this (sequence, row block).
    at = split if fuse_merge else ...
    o_ref[at] = (acc / jnp.where(has, l_i, 1.0)[:, None]).astype(o_ref.dtype)
    empty = jnp.inf if final else -jnp.inf
    lse_ref[at] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * _LN2, empty)
    if not fuse_merge:
        return
    _merge_if_last(o_ref, lse_ref, out_ref, lse_out_ref, cnt_ref, b * pl.num_programs(0) + hb,
                   num_splits=num_splits, d_v=d_v, merge_cols=merge_cols, interpret=interpret)


def _merge_if_last(o_ref, lse_ref, out_ref, lse_out_ref, cnt_ref, slot, *, num_splits: int,
                   d_v: int, merge_cols: int | None, interpret: bool):
    """Arrival counting + merge of one row block (see `mla_decode_merged_rows`).

    Ordering: the CTA barrier makes every thread's partial stores precede (in the CTA) the
    counter update, which Triton emits from one thread as `atom.global.gpu.acq_rel.add`: the
    release publishes the block's stores at GPU scope (cumulative through the barrier); the
    last arriver's acquire, then Triton's broadcast of the returned value through shared memory
    and a barrier, orders its reads after every other split's release (the pattern of a CUDA
    grid sync: one thread acquires, a CTA barrier, then plain loads). No stale L1 line: the
    acquire invalidates this SM's L1 (SASS `CCTL.IVALL` after the `ATOMG`), and no program
    reads another's partial before it. (jax 0.10.2's Pallas cannot emit ld.global.cg: its
    cache-modifier table is keyed without the dot it checks for.)

    Cost (H200): the merging program reads its row block's partials at ~15-30 GB/s (one
    multiprocessor's loads in flight over the latency; volatile and plain loads alike), so the
    launch ends 4-19 us later than the decode alone: more than the merge launch (2.3-5.2 us),
    which spreads the same bytes over hundreds of programs."""
    if not interpret:
        pltriton.debug_barrier()
    ticket = pltriton.atomic_add(cnt_ref, (slot,), jnp.int32(1))

    @pl.when(ticket == num_splits - 1)
    def _():
        cnt_ref[slot] = jnp.int32(0)  # every split has arrived: ready for the next launch
        ops = merge_ops(interpret)
        block_m = out_ref.shape[0]
        cd = merge_cols or d_v  # widest power of two within the load budget (>= 32)
        while merge_cols is None and cd > 32 and num_splits * block_m * cd > _MERGE_LOAD_ELEMS:
            cd //= 2
        lse = [lse_ref[s, :] for s in range(num_splits)]
        w, safe, lse_out = merge_weights(lse, ops[1])
        for c in range(d_v // cd):
            cols = pl.ds(c * cd, cd)
            out = merge_columns(w, safe, lambda s: o_ref[s, :, cols], (block_m, cd), ops)
            out_ref[:, cols] = out.astype(out_ref.dtype)
        lse_out_ref[...] = lse_out


def _decode_shape(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, s_q: int,
                  num_splits: int | None, config: DecodeKernelConfig,
                  v_head_dim: int) -> tuple[int, int, int, int]:
    """Checks the inputs; (batch, block_m, row blocks, splits)."""
    kv.check()
    t, h, d = q.shape
    slots, d_pool = kv_pool.shape
    if d_pool != d:
        raise ValueError(f"kv_pool row width {d_pool} != q head dim {d} (q {q.shape})")
    d_rope = d - v_head_dim
    if not (is_power_of_two(v_head_dim) and is_power_of_two(d_rope) and d_rope >= 16):
        raise ValueError(
            f"head dim {d} must be v_head_dim ({v_head_dim}) + a rope part, both powers of two "
            ">= 16 (the Triton lowering tiles them separately)")
    if q.dtype != kv_pool.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise TypeError(f"q ({q.dtype}) and kv_pool ({kv_pool.dtype}) must both be bf16 or f16")
    if slots > MAX_POOL_ROWS:
        raise ValueError(f"kv_pool has {slots} rows; slot ids are int32 (at most {MAX_POOL_ROWS})")
    if slots < kv.page_size:
        raise ValueError(f"kv_pool has {slots} rows, fewer than page_size={kv.page_size}")
    if not isinstance(s_q, int) or s_q <= 0 or t % s_q:
        raise ValueError(f"s_q={s_q!r} must be a positive int dividing q.shape[0]={t}")
    b = t // s_q
    if kv.num_seqs != b:
        raise ValueError(f"q holds {b} sequences (T={t}, s_q={s_q}) but the KV metadata has "
                         f"{kv.num_seqs}")
    if kv.form == "strided" and kv.table.shape[0] != b * kv.entries_per_seq:
        raise ValueError(f"KVRows.table has {kv.table.shape[0]} entries; {b} sequences of "
                         f"entries_per_seq={kv.entries_per_seq} need {b * kv.entries_per_seq}")
    rows = s_q * h
    block_m = config.resolved_block_m(rows)
    n_rb = num_row_blocks(rows, block_m)
    if num_splits is None:
        num_splits = decode_num_splits(config, b, rows, kv.max_kv_len, mgpu=False)
    if not isinstance(num_splits, int) or num_splits <= 0:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return b, block_m, n_rb, num_splits


def _decode_call(q: jax.Array, kv_pool: jax.Array, kv: KVRows, counters: jax.Array | None, *,
                 sm_scale: float, s_q: int, num_splits: int | None, config: DecodeKernelConfig,
                 v_head_dim: int, interpret: bool) -> tuple[jax.Array, ...]:
    """The decode pallas_call. counters None: (o, lse) partials (see `mla_decode_rows`); else
    the in-launch merge (`mla_decode_merged_rows`): (out, lse, counters)."""
    b, block_m, n_rb, num_splits = _decode_shape(q, kv_pool, kv, s_q=s_q, num_splits=num_splits,
                                                 config=config, v_head_dim=v_head_dim)
    t, h, d = q.shape
    d_rope = d - v_head_dim
    rows = s_q * h
    rows_pad = n_rb * block_m
    final = num_splits == 1
    # in-launch merge only within the byte bound (past it a single merging program is slow,
    # and the unrolled merge of 32+ splits takes minutes to compile)
    fuse = counters is not None and merges_in_kernel(
        dataclasses.replace(config, merge_in_kernel=True), num_splits, block_m, v_head_dim)
    if counters is not None and (counters.shape != (b * n_rb,) or counters.dtype != jnp.int32):
        raise ValueError(f"counters must be int32 [{b * n_rb}] (sequences x row blocks), got "
                         f"{counters.dtype} {counters.shape}")

    qr = q.reshape(b, rows, d)
    if rows_pad != rows:
        qr = jnp.pad(qr, ((0, 0), (0, rows_pad - rows), (0, 0)))

    meta = kv.meta_operands()
    kernel = functools.partial(
        _decode_kernel, form=kv.form, n_meta=len(meta), entries_per_seq=kv.entries_per_seq,
        page_size=kv.page_size, block_kv=config.block_kv, num_splits=num_splits,
        s_q=s_q, num_heads=h, d_v=v_head_dim, d_rope=d_rope,
        scale_log2=float(sm_scale) * _LOG2E, final=final, evict_first=config.evict_first,
        fuse_merge=fuse, merge_cols=config.merge_block_d, interpret=interpret)
    o_dtype = q.dtype if final else jnp.dtype(config.partial_dtype)
    full = lambda shape: pl.BlockSpec(shape, lambda i, j, k: (0,) * len(shape))  # noqa: E731
    in_specs = [full(m.shape) for m in meta] + [
        full(kv.table.shape),
        pl.BlockSpec((None, block_m, d), lambda i, j, k: (k, i, 0)),
        full(kv_pool.shape),
    ]
    part_shapes = [jax.ShapeDtypeStruct((b, num_splits, rows_pad, v_head_dim), o_dtype),
                   jax.ShapeDtypeStruct((b, num_splits, rows_pad), jnp.float32)]
    operands = [*meta, kv.table, qr, kv_pool]
    name = f"mla_decode_ps{kv.page_size}_m{block_m}_kv{config.block_kv}"
    if not fuse:
        out_specs = [
            pl.BlockSpec((None, None, block_m, v_head_dim), lambda i, j, k: (k, j, i, 0)),
            pl.BlockSpec((None, None, block_m), lambda i, j, k: (k, j, i)),
        ]
        out_shape, aliases = part_shapes, {}
    else:
        # Each program stores its split into the [S, block_m] block of its row block; the
        # last to arrive reads the whole block back and writes the merged output.
        in_specs.append(full(counters.shape))
        operands.append(counters)
        out_specs = [
            pl.BlockSpec((None, num_splits, block_m, v_head_dim), lambda i, j, k: (k, 0, i, 0)),
            pl.BlockSpec((None, num_splits, block_m), lambda i, j, k: (k, 0, i)),
            pl.BlockSpec((None, block_m, v_head_dim), lambda i, j, k: (k, i, 0)),
            pl.BlockSpec((None, block_m), lambda i, j, k: (k, i)),
            full(counters.shape),
        ]
        out_shape = part_shapes + [
            jax.ShapeDtypeStruct((b, rows_pad, v_head_dim), q.dtype),
            jax.ShapeDtypeStruct((b, rows_pad), jnp.float32),
            jax.ShapeDtypeStruct(counters.shape, jnp.int32)]
        aliases = {len(operands) - 1: len(out_shape) - 1}
        name += "_combined"  # (not "merge": bench/decode.py tells kernels apart by name)
    res = pl.pallas_call(
        kernel,
        grid=(n_rb, num_splits, b),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(
            num_warps=config.resolved_num_warps(block_m),
            num_stages=config.resolved_num_stages(block_m)),
        interpret=interpret,
        name=name,
    )(*operands)
    if counters is None:
        return tuple(res)
    if fuse:
        return res[2], res[3], res[4]
    return (*_merged(res[0], res[1], q.dtype, config, interpret), counters)


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "num_splits", "config",
                                              "interpret", "v_head_dim"))
def mla_decode_rows(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float, s_q: int = 1,
                    num_splits: int | None = None, config: DecodeKernelConfig = DecodeKernelConfig(),
                    v_head_dim: int = 512, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The decode kernel alone (one pallas_call, no merge) on a prepared `KVRows`; arguments as
    in `mla_decode`.

    Operands of the pallas_call, by `kv.form`: "lens" (table_start [B], kv_lens [B], table,
    q [B, rows_pad, D], pool), "indptr" (kv_indptr [B+1], table, q, pool), "strided"
    (kv_lens [B], table, q, pool). Returns the kernel's results as they are:
    o [B, S, rows_pad, Dv] (q.dtype when S == 1: final output; else per-split partials in
    `config.partial_dtype`)
    and lse float32 [B, S, rows_pad] (S == 1: +inf for no KV; else -inf for an empty split),
    rows = s_q * H folded token-major, rows_pad = rows rounded up to block_m, S = num_splits
    (or the split rule's choice). `merge_splits_pallas(o, lse, q.dtype)` turns S > 1 partials
    into the output. (`config.merge_in_kernel` is ignored here.)
    """
    return _decode_call(q, kv_pool, kv, None, sm_scale=sm_scale, s_q=s_q, num_splits=num_splits,
                        config=config, v_head_dim=v_head_dim, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "num_splits", "config",
                                              "interpret", "v_head_dim"))
def mla_decode_merged_rows(q: jax.Array, kv_pool: jax.Array, kv: KVRows, counters: jax.Array, *,
                           sm_scale: float, s_q: int = 1, num_splits: int | None = None,
                           config: DecodeKernelConfig = DecodeKernelConfig(),
                           v_head_dim: int = 512,
                           interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decode with the split merge inside the same launch (one pallas_call); arguments as in
    `mla_decode_rows`, plus the arrival counters.

    counters: int32 [B * row_blocks] (`decode_counters`), all 0 on entry. Each split program,
    after storing its partial, adds 1 to its row block's counter; the program that arrives
    last combines the S partials exactly as `merge_splits_pallas` does (same operations, same
    rounding: bit-identical) and sets the counter back to 0. So the returned counters are all
    0 again: a caller that threads them from call to call (or donates them) never clears
    them; `mla_decode` makes fresh zeros per call instead (a memset on the device).
    Returns out [B, rows_pad, Dv] (q.dtype), lse float32 [B, rows_pad] (+inf for no KV) and
    the counters. The merge runs in the launch whatever `config.merge_in_kernel` says, but
    only while one row block's partials are at most MAX_IN_KERNEL_MERGE_BYTES (S x block_m x
    Dv x 4 bytes); past that (e.g. batch 1 with 64 splits), and with one split, the counters
    are passed through untouched and the result comes from the two-launch path (decode +
    merge kernel; one launch when S == 1).
    """
    return _decode_call(q, kv_pool, kv, counters, sm_scale=sm_scale, s_q=s_q,
                        num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                        interpret=interpret)


def decode_counters(num_seqs: int, num_heads: int, *, s_q: int = 1,
                    config: DecodeKernelConfig = DecodeKernelConfig()) -> jax.Array:
    """Zeroed arrival counters for `mla_decode_merged_rows`: int32 [num_seqs * row_blocks]."""
    rows = s_q * num_heads
    return jnp.zeros((num_seqs * num_row_blocks(rows, config.resolved_block_m(rows)),),
                     jnp.int32)


def decode_num_splits(config: DecodeKernelConfig, num_seqs: int, rows: int, max_kv_len: int,
                      *, mgpu: bool) -> int:
    """The split rule's KV split count for `num_seqs` sequences of `rows` folded query rows
    (s_q * H) and up to `max_kv_len` tokens, for the kernel `mla_decode` runs (`uses_mgpu`):
    64-row blocks and `mgpu_split_config` for the Mosaic GPU kernel, `config`'s block rows
    for the Triton one."""
    if mgpu:
        return choose_num_splits(num_seqs, rows // MGPU_BLOCK_M, max_kv_len,
                                 mgpu_split_config(config), MGPU_BLOCK_M)
    block_m = config.resolved_block_m(rows)
    return choose_num_splits(num_seqs, num_row_blocks(rows, block_m), max_kv_len, config,
                             block_m)


def _merged(o: jax.Array, lse: jax.Array, out_dtype, config: DecodeKernelConfig,
            interpret: bool) -> tuple[jax.Array, jax.Array]:
    """Per-split results [B, S, R, Dv] / [B, S, R] -> [B, R, Dv] / [B, R]: the kernel's own
    output when S == 1, else the merge kernel's."""
    if o.shape[1] == 1:
        return o[:, 0], lse[:, 0]
    return merge_splits_pallas(o, lse, out_dtype, block_d=config.merge_block_d,
                               interpret=interpret)


def uses_mgpu(config: DecodeKernelConfig, q, page_size: int, s_q: int, *,
              v_head_dim: int = 512, interpret: bool = False) -> bool:
    """Whether `mla_decode` runs the Mosaic GPU kernel for q ([T, H, D], an array or a
    ShapeDtypeStruct) at this page size (`DecodeKernelConfig.kernel`); raises for
    kernel="mgpu" on a shape it does not take."""
    if config.kernel == "triton":
        return False
    why = mgpu_decode_supported(s_q * q.shape[1], page_size, q.shape[2], v_head_dim, q.dtype)
    if config.kernel == "mgpu":
        if why is not None:
            raise ValueError(f"DecodeKernelConfig.kernel='mgpu': {why}")
        return True
    if why is not None or interpret or jax.default_backend() != "gpu":
        return False
    # Small batches stay on Triton: a Mosaic GPU block's fixed cost (and its launch, which
    # also copies TMA descriptors) outweighs its matrix rate when the row blocks alone cannot
    # fill a quarter of the GPU (H200, batch 1, 128 heads, ctx 4k: Triton 19.6 us, Mosaic GPU
    # 22.1 us; batch 32, page 1, decode launch alone: 175.7 vs 75.2 us).
    blocks = (q.shape[0] // s_q) * (s_q * q.shape[1] // MGPU_BLOCK_M)
    return blocks >= config.num_sms // 4


@functools.partial(jax.jit, static_argnames=("sm_scale", "s_q", "num_splits", "config",
                                              "interpret", "v_head_dim"))
def _mla_decode_kv(q, kv_pool, kv: KVRows, *, sm_scale, s_q, num_splits, config, v_head_dim,
                   interpret):
    """Decode kernel + (num_splits > 1) merge, unpadded to [T, H, Dv] and [T, H]: the merge
    kernel, or the in-launch merge when `merges_in_kernel`."""
    t, h, _ = q.shape
    rows = s_q * h
    if uses_mgpu(config, q, kv.page_size, s_q, v_head_dim=v_head_dim, interpret=interpret):
        ns = num_splits or decode_num_splits(config, t // s_q, rows, kv.max_kv_len, mgpu=True)
        o, lse = mla_decode_rows_mgpu(q, kv_pool, kv, sm_scale=sm_scale, s_q=s_q,
                                      num_splits=ns, v_head_dim=v_head_dim,
                                      partial_dtype=config.partial_dtype, interpret=interpret)
        out, lse_out = _merged(o, lse, q.dtype, config, interpret)
        return out.reshape(t, h, v_head_dim), lse_out.reshape(t, h)
    b, block_m, n_rb, ns = _decode_shape(q, kv_pool, kv, s_q=s_q, num_splits=num_splits,
                                         config=config, v_head_dim=v_head_dim)
    common = dict(sm_scale=sm_scale, s_q=s_q, num_splits=ns, config=config,
                  v_head_dim=v_head_dim, interpret=interpret)
    if merges_in_kernel(config, ns, block_m, v_head_dim):
        out, lse_out, _ = _decode_call(q, kv_pool, kv, jnp.zeros((b * n_rb,), jnp.int32),
                                       **common)
    else:
        o, lse = _decode_call(q, kv_pool, kv, None, **common)
        out, lse_out = _merged(o, lse, q.dtype, config, interpret)
    if out.shape[1] != rows:
        out, lse_out = out[:, :rows], lse_out[:, :rows]
    return out.reshape(t, h, v_head_dim), lse_out.reshape(t, h)


def mla_decode(q: jax.Array, kv_pool: jax.Array, *, kv_indptr: jax.Array | None = None,
               kv_indices: jax.Array | None = None, page_table: PageTable | None = None,
               sm_scale: float, s_q: int = 1, num_splits: int | None = None,
               config: DecodeKernelConfig = DecodeKernelConfig(), max_kv_len: int | None = None,
               v_head_dim: int = 512, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Absorbed MLA decode over the paged latent pool.

    q:          [T, H, 576] bf16, T = batch * s_q, token-major (the s_q tokens of a sequence
                are consecutive).
    kv_pool:    [slots, 576] bf16; V is the first `v_head_dim` (512) columns of each row.
    KV metadata, exactly one of:
      kv_indptr [B+1] int32 (tokens) + kv_indices [capacity] int32 (token slots); page size 1.
      page_table: funcmla.layout.PageTable (page ids [B, max_pages], lengths [B] in tokens,
                  static page_size); token t of sequence b is row table[b, t//ps]*ps + t%ps.
    sm_scale:   softmax scale (static float).
    s_q:        query tokens per sequence (1..4 for speculative decoding), bottom-right causal.
    num_splits: split-KV count; None picks it with the split rule (`decode_num_splits`).
    max_kv_len: static upper bound on KV tokens per sequence for the split rule (token CSR
                only; defaults to the capacity of kv_indices).
    config:     `DecodeKernelConfig`: which kernel (`kernel`: on a GPU, bf16 shapes with s_q * H a
                multiple of 64 run the warp-specialized Mosaic GPU kernel at batches that fill it,
                the rest the Triton-lowered one) and its tiling; `merge_in_kernel=True` merges
                the splits in the decode launch (opt-in, slower on H200).
    interpret:  run in Pallas interpret mode (CPU).

    Returns out [T, H, 512] (q.dtype) and lse [T, H] float32 (natural log); a sequence with no
    KV gives out 0 and lse +inf. Index values are not checked here (see
    `validate_decode_inputs` for an eager check); out-of-range positions are never read.
    """
    if page_table is not None:
        if kv_indptr is not None or kv_indices is not None:
            raise ValueError("pass either page_table or (kv_indptr, kv_indices), not both")
        if max_kv_len is not None:
            raise ValueError("max_kv_len is implied by the page table's width")
        kv = kv_rows_from_page_table(page_table)
    else:
        if kv_indptr is None or kv_indices is None:
            raise ValueError("pass kv_indptr and kv_indices (token CSR) or page_table")
        kv = kv_rows_from_csr(kv_indptr, kv_indices, max_kv_len)
    return _mla_decode_kv(q, kv_pool, kv, sm_scale=float(sm_scale), s_q=s_q,
                          num_splits=num_splits, config=config, v_head_dim=v_head_dim,
                          interpret=interpret)


def validate_decode_inputs(kv_pool_rows: int, *, kv_indptr=None, kv_indices=None,
                           page_table: PageTable | None = None) -> None:
    """Eager (non-jittable) value check of decode metadata; raises ValueError naming the field.

    Token CSR: kv_indptr starts at 0, is non-decreasing and ends within kv_indices; every live
    kv_indices entry is in [0, kv_pool_rows). Page table: lengths fit the table width and every
    live page id p has (p + 1) * page_size <= kv_pool_rows.
    """
    import numpy as np

    if page_table is not None:
        table = np.asarray(page_table.table)
        lengths = np.asarray(page_table.lengths)
        ps = page_table.page_size
        if (lengths < 0).any():
            raise ValueError(f"page_table.lengths has negative values: {lengths[lengths < 0][:4]}")
        need = -(-lengths // ps)
        if (need > table.shape[1]).any():
            bad = int(np.argmax(need > table.shape[1]))
            raise ValueError(f"page_table.lengths[{bad}]={lengths[bad]} needs {need[bad]} pages; "
                             f"the table has {table.shape[1]}")
        for i, n in enumerate(need):
            live = table[i, :n]
            if live.size and (live.min() < 0 or (live.max() + 1) * ps > kv_pool_rows):
                raise ValueError(f"page_table.table[{i}] has page ids outside "
                                 f"[0, {kv_pool_rows // ps}): {live.min()}..{live.max()}")
        return
    indptr = np.asarray(kv_indptr)
    indices = np.asarray(kv_indices)
    if indptr[0] != 0 or (np.diff(indptr) < 0).any() or indptr[-1] > indices.shape[0]:
        raise ValueError(f"kv_indptr must start at 0, not decrease and end <= "
                         f"{indices.shape[0]}; got {indptr[:4]}..{indptr[-1]}")
    live = indices[: indptr[-1]]
    if live.size and (live.min() < 0 or live.max() >= kv_pool_rows):
        raise ValueError(f"kv_indices has slots outside [0, {kv_pool_rows}): "
                         f"{live.min()}..{live.max()}")

