"""Absorbed MLA decode over an fp8 pool on Hopper's matrix units, for few query rows.

For s_q * H = 16 folded query rows (16 heads, or 8 heads at s_q = 2), where decode is memory
bound and fp8 halves the bytes; a multiple of 16 rows runs as row groups of 16, G blocks a
sequence and split (`BLOCK_ROWS`; `api` sends it the multiples of 16 that are not multiples of
64, such as 32 heads). The products run transposed, so the narrow query side is
wgmma's N (which may be 16) rather than a 64-row M padded with zeros:

* S^T = K q^T   [64 tokens, 2N]: an fp8 `wgmma` straight from the fp8 stage (K-major, A)
  against q split into two e4m3 parts (q8 [2N, 576] in shared memory, B: rows 0..N-1 the high
  parts, N..2N-1 the low ones), the two column halves of the result added in registers; no
  conversion of K at all;
* O^T += V^T P^T [512, N]: V^T is a register A operand too, built from the same fp8 stage in
  another arrangement (`_v_operand`: each thread's 16 O^T rows are 16 contiguous latent
  columns, so one 16-byte load a token feeds them), 16 tokens a `wgmma`; P^T (f16, in shared
  memory) is B. An 8-bit V could be neither operand as it is (fp8 wgmma operands must be
  K-major, and V's K is the token axis), and V never goes through shared memory as f16.

One CUDA block handles 16 rows of one sequence and one KV split, with three warpgroups:

* warpgroup 2 (producer): issues the first four 64-token fp8 tiles into the four landing
  stages (page >= 8: one TMA copy a tile or a page; page 1 to 4: a `cp.async` row gather,
  its copies signalling the stage), prepares q while they fly (`fp8_q_split.prepare_q_smem`:
  bf16 q from global memory, scaled, split into its e4m3 pair and stored swizzled, and the
  column scales; before the gathers at pages under 8, since its loads would queue behind
  them), then refills a stage once its consumer has its last bytes in registers (after the
  tile's P V operands are loaded);
* warpgroups 0 and 1 (consumers): the tiles alternate between them (tile i goes to consumer
  i % 2, through stage i % 4, so each consumer has a tile landing while it works on one),
  each running its own online softmax over its tiles with its own accumulator (64 fp32
  registers a thread at N = 16); at the end consumer 1 hands its (O^T, max, sum) through
  shared memory and consumer 0 merges the two and stores.

Scales: q is scaled per row by a power of two and split into two e4m3 parts whose sum keeps
the bf16 kernels' score error (`fp8_q_split`). The kernel multiplies each score column by
that row's inverse times sm_scale * k_scale * log2(e) (k_scale and v_scale are [1] operands,
so one kernel serves every layer) and the output by v_scale. Hopper's fp8 wgmma keeps ~13-14
bits in its accumulator, so q k^T restarts from zero every `_PROMOTE` columns and the groups
are summed in fp32. Preparing q in the kernel rather than in XLA kernels before it saves
their launches and the gaps between them (7-32 us a call on the H200; docs/decode_kernel.md).

V^T is converted from fp8 in registers (`_v_operand`), half its pairs by
`cvt.rn.f16x2.e4m3x2` and half on the integer pipe (the e4m3 bits placed as f16 bits: the
value times 2^-8, exact; those output rows are scaled back at the end), so neither pipe
carries all of a tile's conversions (`python -m bench.kernel_ab`; docs/decode_kernel.md). An
fp8 NaN in a used V row reads as a finite value on the integer pipe; V past kv_len is zeroed
before either conversion.

Softmax reductions over the token axis cross the 4 warps of a warpgroup; each consumer does
them in its own shared-memory scratch (Mosaic GPU's built-in reduction scratch is one region
for the whole block, which two warpgroups reducing at once would share).

Masking as in `decode_mgpu`: scores past a column's causal limit or past kv_len are selected
to -inf (a NaN from an unused K row is selected away), and in a partial last tile the V tokens
past kv_len are zeroed before P V, so no unused pool row (NaN, Inf) reaches the result.
Each softmax sum stays a per-thread partial over its tokens until the end (one cross-warp
reduction a tile, for the max, not two). Consumer 0 stores O^T from registers straight to global
memory as [B, S, N, 512] (`_store_transposed`, 16-value vector stores, un-permuting the rows),
so no XLA kernel runs around the launch. Splits and partials are those of the other decode
kernels (`split_tile_range`), so they share the merge. Runs on sm_90a, and on CPU in Mosaic GPU
interpret mode where XLA:CPU has a worker thread for each warpgroup
(`mgpu_ops.interpreter_unsupported`). The softmax takes each column's max over raw scores and
multiplies s - max by the column scale, so scores of any finite size stay finite
(tests/test_pallas_large_scores.py).
`mla_decode`'s auto dispatch runs it from `fp8_mgpu_min_seqs` sequences. Why this design and
what it measures: docs/decode_kernel.md ("fp8 KV"); `python -m bench.decode --kv-dtype fp8
--fp8-variants`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas.decode_common import (
    KVRows,
    block_coords,
    causal_limit,
    seq_start_and_len,
    split_tile_range,
)
from funcmla.attention.pallas.decode_mgpu import MgpuDecodeConfig
from funcmla.attention.pallas.fp8_q_split import (
    Q8_SWIZZLE,
    fp8_operands_unsupported,
    prepare_q_smem,
)
from funcmla.attention.pallas.mgpu_kv_copy import (
    BLOCK_KV,
    filled_scratch,
    init_filled,
    page_size_unsupported,
    produce_tiles,
    wait_filled,
)
from funcmla.attention.pallas.mgpu_ops import (
    compiler_params,
    in_layout,
    iota,
    load,
    mgpu_params,
    swizzled,
    warpgroup_sync,
)

__all__ = ["fp8_narrow_supported", "decode_call", "BLOCK_ROWS", "BLOCK_KV"]

_LN2 = 0.6931471805599453

# Folded query rows a block takes (wgmma N). 32 would fit the registers (O^T is 4 * N a
# thread) but not shared memory: q and P double, 255 KB of the 227 an SM has. A multiple of 16
# rows runs as row groups: G = rows / 16 blocks a sequence and split, side by side in the grid
# (g fastest), so the G blocks read each KV tile at about the same time and all but the first
# from L2.
BLOCK_ROWS = 16
_FP8_SWIZZLE = Q8_SWIZZLE  # bytes; 64 fp8 columns per swizzle tile (576 is 9): stages, q8
# Columns of q k^T per fp8 accumulator: Hopper's fp8 wgmma adds into its accumulator with
# truncated alignment (about 13-14 bits kept), so the error grows with the instructions
# chained on one accumulator; each group of columns starts from zero and is summed in fp32.
_PROMOTE = 128
# fp8 landing stages: two per consumer (a stage is held until its P V). Even: tile t goes to
# consumer t % 2 through stage t % _STAGES, so each stage's fills all go to one consumer, whose
# barrier waits track that stage's phase parity (a thread flips its parity bit at each wait);
# with an odd count the waits fall out of step. Five, with a barrier set per consumer, took
# 1.009-1.023x the time of four on the H100 (decision log, docs/decode_kernel.md).
_STAGES = 4
_REGISTERS = (40, 232, 232)  # `setmaxnreg` (producer, consumer 0, consumer 1), as decode_mgpu's
_CONSUMERS = 2
_D, _DV = 576, 512  # latent row (K) and its first 512 columns (V)
# The odd row blocks of O^T (64 latent columns each, `latent_column`) have their V pairs
# converted on the integer pipe by `_v_operand` rather than with `cvt.rn.f16x2.e4m3x2` (a
# quarter-rate instruction), so half the pairs go to each pipe: e4m3 bits placed as f16 bits
# are the value times 2^-8, exactly (subnormals included); those rows are scaled by 2^8 at
# the end. A pair word holds bytes (column c: even, odd token; column c + 1: even, odd);
# `INT_PAIR_SELECT[half]` (prmt with a zero word) moves column c + half's two bytes to the high
# byte of each 16-bit half, then `INT_SIGN_MASK` keeps the sign and `INT_MAG_MASK` >> 1 the
# exponent and mantissa.
_INT_SCALE = 256.0
INT_PAIR_SELECT = (0x1404, 0x3424)
INT_SIGN_MASK, INT_MAG_MASK = 0x80008000, 0x7F007F00
# Per-consumer scratch of a cross-warp column reduction of [64, N] fp32: 4 warps x 32 lanes
# x 2 values, enough for one register of the result at a time (shared memory is tight).
_RED_BYTES = 4 * 32 * 2 * 4


def fp8_narrow_supported(rows: int, page_size: int, head_dim: int, v_head_dim: int,
                         q_dtype, kv_dtype) -> str | None:
    """None when this kernel handles the shape, else the reason it does not."""
    if rows % BLOCK_ROWS:
        return f"folded rows s_q*H = {rows} is not a multiple of {BLOCK_ROWS}"
    return (fp8_operands_unsupported(head_dim, v_head_dim, q_dtype, kv_dtype)
            or page_size_unsupported(page_size))


def _col_reduce(x, op: str, scratch, interpret: bool):
    """x [64, N] fp32 (WGMMA layout) reduced over its token axis to [N], through this
    warpgroup's own `scratch` for the cross-warp step."""
    if interpret:
        return x.max(axis=0) if op == "max" else x.sum(axis=0)
    n = x.shape[1]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA.reduce(0)))
    def reduce(ctx, x, scratch):
        del ctx
        return x.reduce(op, 0, scratch=scratch)

    return reduce(x, scratch)


def _store_cols(ref, x, col0: int, swizzle: int, interpret: bool):
    """ref[:, col0 : col0 + x.shape[1]] = x (f16, WGMMA layout) into a (8, swizzle / 2)-tiled
    ref, as plain `stmatrix` stores: no read of the old values and no warpgroup barrier
    around them (Pallas's store does both); the caller orders them (`warpgroup_sync`)."""
    if interpret:
        ref[:, pl.ds(col0, x.shape[1])] = x
        return
    tile_cols = swizzle // 2

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(swizzled(swizzle, 2))))
    def store(ctx, x, ref):
        del ctx
        from jax.experimental.mosaic.gpu import utils as mu

        t0 = col0 // tile_cols
        sub = mu.memref_slice(ref, (slice(None), slice(t0, t0 + x.shape[1] // tile_cols)))
        x.store_tiled(sub, swizzle=swizzle)

    store(x, ref)


def _fold(s2, rows: int, interpret: bool):
    """S^T [64, rows] from the [64, 2 rows] product with q's (high, low) parts: the two column
    halves summed (registers alone)."""
    if interpret:
        return s2[:, :rows] + s2[:, rows:]

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((BLOCK_KV, rows), jnp.float32,
                                                          layout=plgpu.Layout.WGMMA))
    def fold(ctx, s2):
        del ctx
        import numpy as np
        from jax._src.lib.mlir.dialects import arith
        from jax.experimental.mosaic.gpu import fragmented_array as fa

        regs = s2.registers
        half = regs.shape[1] // 2  # column groups of 8
        out = np.empty((regs.shape[0], half, *regs.shape[2:]), dtype=object)
        for idx in np.ndindex(out.shape):
            hi_idx = (idx[0], idx[1] + half, *idx[2:])
            out[idx] = arith.addf(regs[idx], regs[hi_idx])
        return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return fold(s2)


def _store_transposed(o_ref, x, b, split, row_lo, interpret: bool):
    """o_ref[b, split, row_lo:row_lo + N] = x.T: x [512, N] (WGMMA layout, rows in
    `latent_column` order) into o_ref [B, S, R, 512] in global memory, no shared-memory staging
    (once a block). A thread's 16 rows of x are 16 contiguous latent columns (`_v_operand`), so
    each of its 4 query rows is one 16-value vector store."""
    if interpret:
        o_ref[b, split, pl.ds(row_lo, x.shape[1])] = x.T
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(), splat, splat, splat))
    def store(ctx, x, o, b, split, row_lo):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32, i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
        o_ty = ir.MemRefType(o.type)
        _, n_splits, n_rows, d_v = o_ty.shape
        n_block = x.shape[1]
        itemsize = mu.bitwidth(o_ty.element_type) // 8
        if x.registers.shape != (d_v // 64, n_block // 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"WGMMA layout registers {x.registers.shape}")

        def k(n, ty=i32):
            return mu.c(n, ty)

        t = arith.remui(mu.thread_idx(), k(128))
        w, lane = arith.shrui(t, k(5)), arith.andi(t, k(31))
        g, q4 = arith.shrui(lane, k(2)), arith.andi(lane, k(3))
        col0 = arith.addi(arith.shli(w, k(7)), arith.shli(g, k(4)))
        blk = arith.addi(arith.muli(b.registers.item(), k(n_splits)), split.registers.item())
        gptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(o))
        vec_ty = ir.VectorType.get((16,), o_ty.element_type)
        row0 = row_lo.registers.item()
        for ng in range(n_block // 8):
            for e in range(2):
                n = arith.addi(arith.addi(arith.shli(q4, k(1)), k(8 * ng + e)), row0)
                elem = arith.addi(arith.muli(arith.addi(arith.muli(blk, k(n_rows)), n),
                                             k(d_v)), col0)
                vals = [vector.extract(x.registers[c // 2, ng, 0, 0, c % 2, 0, 0, 0, 0],
                                       dynamic_position=[], static_position=[e])
                        for c in range(16)]
                dst = mu.getelementptr(gptr, [arith.muli(arith.extui(i64, elem),
                                                         k(itemsize, i64))], i8)
                llvm.store(vector.from_elements(vec_ty, vals), dst, alignment=16)

    store(x, o_ref, b, split, row_lo)


def _kernel(*refs, form: str, entries_per_seq: int | None, page_size: int, num_splits: int,
            s_q: int, num_heads: int, d_v: int, sm_scale: float, final: bool,
            cfg: MgpuDecodeConfig, interpret: bool):
    n_meta = len(refs) - 8
    meta, (table_ref, q_ref, k_scale_ref, v_scale_ref, kv_ref, o_ref, lse_ref, scratch) = (
        refs[:n_meta], refs[n_meta:])
    (q_smem, scale_smem, stages, lse_stage, acc1_smem, m_smem, l_smem, p_smem, red, q_bar,
     k_full, k_empty, handed) = scratch

    rows = BLOCK_ROWS
    # row groups of a sequence and split side by side (g fastest)
    b, split, g = block_coords(lax.axis_index("blk"), num_splits, s_q * num_heads // rows)
    row_lo = g * rows
    wg = lax.axis_index("wg")
    budgets = cfg.kernel_registers(_REGISTERS)
    d = kv_ref.shape[1]
    pv_swizzle = 2 * rows  # bytes of one P^T row (f16)

    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)
    first, last = split_tile_range(kv_len, split, num_splits, BLOCK_KV)
    count = jnp.maximum(last - first, 0)
    init_filled(k_full, interpret=interpret)

    @pl.when(wg == 2)
    def _producer():
        # a stage is released once its consumer's P V has its last bytes in registers
        def prepare():  # q's rows, then the registers go to the consumers
            with jax.named_scope("prepare_q"):
                prepare_q_smem(q_ref, k_scale_ref, v_scale_ref, q_smem, scale_smem, b, row_lo,
                               sm_scale=sm_scale, interpret=interpret)
                plgpu.commit_smem()
                plgpu.barrier_arrive(q_bar)
            plgpu.set_max_registers(budgets[0], action="decrease")

        produce_tiles(kv_ref, table_ref, stages, k_full, k_empty, first=first, count=count,
                      start_entry=start_entry, kv_len=kv_len, num_stages=_STAGES,
                      page_size=page_size, swizzle=_FP8_SWIZZLE, interpret=interpret,
                      prepare=prepare)

    col_layout = plgpu.Layout.WGMMA.reduce(0)

    def consumer(c: int):
        """Consumer c: tiles c, c + 2, ... (step j's through stage (c + 2 j) % _STAGES)."""
        plgpu.set_max_registers(budgets[1 + c], action="increase")
        p_ref = p_smem.at[c]
        plgpu.barrier_wait(q_bar)
        col_scale = load(scale_smem.at[0], col_layout, interpret)
        acc0 = in_layout(jnp.zeros((d_v, rows), jnp.float32), plgpu.Layout.WGMMA, interpret)
        m0 = in_layout(jnp.full((rows,), -jnp.inf, jnp.float32), col_layout, interpret)
        # Each thread's partial sums of p over its own token rows (summed over tokens once, at
        # the end: no cross-warp reduction a tile for them)
        l0 = in_layout(jnp.zeros((BLOCK_KV, rows), jnp.float32), plgpu.Layout.WGMMA, interpret)
        n_plain = jnp.clip((kv_len - s_q + 1) // BLOCK_KV - first, 0, count)

        def scores(fill, slot):
            """S^T of the block's fill-th tile, in stage `slot`, [64, rows] fp32 (unscaled):
            fp8 `wgmma`s of the stage (A, K-major) by q's (high, low) e4m3 parts (B, N = 2
            rows), `_PROMOTE` columns each into a fresh accumulator, summed in fp32 registers
            while the next runs; then the halves summed. Tokens past kv_len are left to the
            caller's mask (selected to -inf)."""
            stage = stages.at[slot]
            with jax.named_scope("wait_kv"):
                wait_filled(k_full, fill, num_stages=_STAGES, async_proxy=True,
                            interpret=interpret)
            if interpret:
                s2 = lax.dot_general(stage[...].astype(jnp.float32),
                                     q_smem[...].astype(jnp.float32), (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
                return _fold(s2, rows, interpret)
            n_groups = -(-d // _PROMOTE)  # the last group takes what is left
            zeros = in_layout(jnp.zeros((BLOCK_KV, 2 * rows), jnp.float32), plgpu.Layout.WGMMA,
                              interpret)

            def body(acc_a, acc_b):
                accs = (acc_a, acc_b)

                def issue(g):
                    cols = pl.ds(g * _PROMOTE, min(_PROMOTE, d - g * _PROMOTE))
                    plgpu.wgmma(accs[g % 2], stage.at[:, cols],
                                q_smem.at[:, cols].transpose((1, 0)))

                issue(0)
                total = None
                for g in range(n_groups):
                    more = g + 1 < n_groups
                    if more:
                        issue(g + 1)
                    part = plgpu.wgmma_accumulator_load(accs[g % 2], wait_n=1 if more else 0)
                    total = part if total is None else total + part
                    if g + 2 < n_groups:
                        accs[g % 2][...] = zeros
                return total

            s2 = pl.run_scoped(body, plgpu.ACC((BLOCK_KV, 2 * rows), jnp.float32),
                               plgpu.ACC((BLOCK_KV, 2 * rows), jnp.float32))
            return _fold(s2, rows, interpret)

        def step(j, carry, masked: bool):
            acc, m_i, l_i = carry
            tile = first + c + 2 * j
            slot = lax.rem(c + 2 * j, _STAGES)
            valid = kv_len - tile * BLOCK_KV
            with jax.named_scope("qk"):
                s = scores(c + 2 * j, slot)  # raw: the column scale multiplies s - max
            with jax.named_scope("softmax"):
                if masked:  # the iotas live only here (registers)
                    tok_iota = iota((BLOCK_KV, rows), 0, interpret)
                    col_iota = iota((BLOCK_KV, rows), 1, interpret)
                    limit = causal_limit(kv_len, s_q, (row_lo + col_iota) // num_heads)
                    s = jnp.where(tile * BLOCK_KV + tok_iota < limit, s, -jnp.inf)
                m_new = jnp.maximum(m_i, _col_reduce(s, "max", red.at[c], interpret))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2((m_i - m_safe) * col_scale)
                p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [1]))
                             * lax.broadcast_in_dim(col_scale, s.shape, [1]))
                l_i = l_i * lax.broadcast_in_dim(alpha, s.shape, [1]) + p
            with jax.named_scope("p_store"):
                _store_cols(p_ref, p.astype(jnp.float16), 0, pv_swizzle, interpret)
                plgpu.commit_smem()
                warpgroup_sync(interpret)  # every thread's P stores, before P V reads them
            with jax.named_scope("pv"):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
                acc = _pv(acc, stages, slot, p_ref,
                          lambda: plgpu.barrier_arrive(k_empty.at[slot]), valid, masked,
                          interpret)
            return acc, m_new, l_i

        n_mine = jnp.maximum((count - c + 1) // 2, 0)
        n_plain_mine = jnp.clip((n_plain - c + 1) // 2, 0, n_mine)
        carry = lax.fori_loop(0, n_plain_mine, functools.partial(step, masked=False),
                              (acc0, m0, l0))
        acc, m_i, l_part = lax.fori_loop(n_plain_mine, n_mine,
                                         functools.partial(step, masked=True), carry)
        with jax.named_scope("finish"):
            l_i = _col_reduce(l_part, "add", red.at[c], interpret)
            if c == 1:  # hand over
                acc1_smem[...] = acc
                m_smem[...] = m_i
                l_smem[...] = l_i
                plgpu.commit_smem()
                plgpu.barrier_arrive(handed)
                return
            plgpu.barrier_wait(handed)
            acc1 = load(acc1_smem, plgpu.Layout.WGMMA, interpret)
            m1 = load(m_smem, col_layout, interpret)
            l1 = load(l_smem, col_layout, interpret)
            m = jnp.maximum(m_i, m1)
            m_safe = jnp.where(m == -jnp.inf, 0.0, m)
            a0 = jnp.exp2((m_i - m_safe) * col_scale)
            a1 = jnp.exp2((m1 - m_safe) * col_scale)
            l = l_i * a0 + l1 * a1
            has = l > 0.0
            l_safe = jnp.where(has, l, 1.0)
            v_scale = load(scale_smem.at[1], col_layout, interpret)

            def bc(x):
                return lax.broadcast_in_dim(x, acc.shape, [1])

            # the odd row blocks hold V times 2^-8 (`_INT_SCALE`)
            o_rows = iota(acc.shape, 0, interpret)
            fix = jnp.where(_int_block(o_rows // 64), _INT_SCALE, 1.0)
            if interpret:  # rows there are latent columns in order: scaled in `_v_operand` alike
                fix = jnp.where(_int_block(latent_row_block(o_rows)), _INT_SCALE, 1.0)
            out = (acc * bc(a0) + acc1 * bc(a1)) * bc(v_scale / l_safe) * fix
            empty = jnp.inf if final else -jnp.inf
            _store_transposed(o_ref, out.astype(o_ref.dtype), b, split, row_lo, interpret)
            lse_stage[...] = jnp.where(has, (m * col_scale + jnp.log2(l_safe)) * _LN2, empty)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, split, pl.ds(row_lo, rows)])
            plgpu.wait_smem_to_gmem(0)

    for c in range(_CONSUMERS):
        pl.when(wg == c)(functools.partial(consumer, c))


def _v_operand(stages, slot, kk: int, valid, masked: bool, interpret: bool):
    """V^T of tokens 16 kk .. 16 kk + 15 of stage `slot`: [512, 16] f16 in the WGMMA layout
    (the register A operand of P V), converted from the stage's fp8 bytes, its rows in
    `latent_column` order. Tokens past `valid` are zeroed when `masked`.

    Thread (warp w, lane l) holds rows 64 mb + 16 w + 8 h + l // 4 and tokens 2 (l % 4) + {0, 1}
    (+ 8): with rows mapped to latent columns 128 w + 16 (l // 4) + 2 mb + h, its 16 rows are
    16 contiguous bytes of a token's row, one 16-byte load a token. Odd quads of lanes load the
    odd token first, so the 8 lanes of a load phase hit 8 distinct 16-byte bank groups; the
    `prmt` that pairs each column's two tokens undoes the order, and `cvt.rn.f16x2.e4m3x2`
    converts a pair."""
    if interpret:
        v = stages[slot, pl.ds(16 * kk, 16), pl.ds(0, _DV)]
        if masked:
            v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, 0) + 16 * kk < valid, v,
                          jnp.zeros_like(v))
        vt = v.astype(jnp.float16).T  # rows are latent columns in order here
        block = latent_row_block(lax.broadcasted_iota(jnp.int32, (_DV, 1), 0))
        return jnp.where(_int_block(block), vt / _INT_SCALE, vt)
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(swizzled(_FP8_SWIZZLE, 1)), splat, splat),
                       return_type=plgpu.ShapeDtypeStruct((_DV, 16), jnp.float16,
                                                          layout=plgpu.Layout.WGMMA))
    def operand(ctx, stages, slot, valid):
        del ctx
        import numpy as np
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32 = (ir.IntegerType.get_signless(n) for n in (8, 32))
        f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
        v4 = ir.VectorType.get((4,), i32)
        slot, valid = slot.registers.item(), valid.registers.item()
        regs_shape = fa.WGMMA_LAYOUT.registers_shape((_DV, 16))
        if regs_shape != (8, 2, 1, 1, 2, 1, 1, 1, 1):  # (row block, token group, half)
            raise NotImplementedError(f"WGMMA layout registers {regs_shape}")

        def k(n):
            return mu.c(n, i32)

        t = arith.remui(mu.thread_idx(), k(128))
        w, lane = arith.shrui(t, k(5)), arith.andi(t, k(31))
        g, q4 = arith.shrui(lane, k(2)), arith.andi(lane, k(3))
        odd = arith.andi(g, k(1))
        # The thread's 16 latent columns start at 128 w + 16 g: 64-column tile 2 w + g // 4,
        # 16-byte vector g % 4 of it, swizzled by the row's bits ((r % 8) // 2 = q4).
        vec = arith.xori(arith.andi(g, k(3)), q4)
        col_off = arith.addi(arith.shli(arith.addi(arith.shli(w, k(1)), arith.shrui(g, k(2))),
                                        k(9)), arith.shli(vec, k(4)))
        base = arith.addi(arith.muli(slot, k(BLOCK_KV * _D)), col_off)
        ptr0 = mu.memref_ptr(stages)
        # byte selectors pairing (even token, odd token) of two columns; swapped on odd quads
        sel = [arith.xori(k(lo), arith.muli(odd, k(lo ^ sw)))
               for lo, sw in ((0x5140, 0x1504), (0x7362, 0x3726))]

        def load_token(kg: int, e: int):
            """16 bytes of token 16 kk + 8 kg + 2 q4 + (e ^ odd): this thread's columns."""
            r8 = arith.addi(arith.shli(q4, k(1)), arith.xori(odd, k(e)))
            off = arith.addi(base, arith.addi(arith.shli(r8, k(6)),
                                              k((2 * kk + kg) * (_D // _FP8_SWIZZLE) * 512)))
            x = llvm.load(v4, mu.getelementptr(ptr0, [off], i8), alignment=16)
            if masked:
                tok = arith.addi(r8, k(16 * kk + 8 * kg))
                x = arith.select(arith.cmpi(arith.CmpIPredicate.slt, tok, valid), x,
                                 vector.broadcast(v4, k(0)))
            return x

        def word(x, j):
            return vector.extract(x, dynamic_position=[], static_position=[j])

        def prmt(a, b, s):
            return llvm.inline_asm(i32, [a, b, s], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")

        def cvt(pair_word, half: int):
            return mu.bitcast(llvm.inline_asm(
                i32, [pair_word],
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                f"cvt.rn.f16x2.e4m3x2 $0, {('lo', 'hi')[half]}; }}", "=r,r"), f16x2)

        def int_cvt(pair_word, half: int):
            # bytes 2 half, 2 half + 1 to the high byte of each 16-bit half (prmt with a zero
            # word), then sign kept and exponent + mantissa moved down a bit: f16 bits of the
            # e4m3 value times 2^-8
            w = prmt(pair_word, k(0), k(INT_PAIR_SELECT[half]))
            mag = arith.shrui(arith.andi(w, k(INT_MAG_MASK)), k(1))
            sign = arith.andi(w, k(INT_SIGN_MASK - (1 << 32)))  # as a signed i32
            return mu.bitcast(arith.ori(mag, sign), f16x2)

        regs = np.empty(regs_shape, dtype=object)
        for kg in range(2):
            x0, x1 = load_token(kg, 0), load_token(kg, 1)
            for j in range(4):
                for s_i in range(2):
                    paired = prmt(word(x0, j), word(x1, j), sel[s_i])
                    for half in range(2):
                        c = 4 * j + 2 * s_i + half  # the thread's column 2 mb + h
                        conv = int_cvt if (c // 2) % 2 else cvt  # odd row blocks
                        regs[c // 2, kg, 0, 0, c % 2, 0, 0, 0, 0] = conv(paired, half)
        return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=None)

    return operand(stages, slot, valid)


def latent_column(m):
    """The latent column that row m of the kernel's O^T holds (`_v_operand`'s order):
    m = 64 mb + 16 w + 8 h + g -> 128 w + 16 g + 2 mb + h. Works on ints and index values."""
    return (((m >> 4) & 3) << 7) + ((m & 7) << 4) + ((m >> 6) << 1) + ((m >> 3) & 1)


def _int_block(mb):
    """Whether row block `mb` (an int array) has its V converted on the integer pipe (the odd
    ones, `_INT_SCALE`)."""
    return mb - (mb // 2) * 2 == 1


def latent_row_block(c):
    """The row block mb of O^T (`latent_column`'s inverse, m // 64) that latent column c
    lands in: c = 128 w + 16 g + 2 mb + h -> mb = (c % 16) // 2."""
    return (c & 15) >> 1


def _pv(acc, stages, slot, p_ref, release, valid, masked: bool, interpret: bool):
    """acc [512, N] + V^T P^T over the stage's 64 tokens, 16 a `wgmma` (V^T in registers,
    `_v_operand`; P^T slices from shared memory), the next operand converted while one runs;
    `release()` once the last bytes of the stage are in registers."""
    if interpret:
        for kk in range(BLOCK_KV // 16):
            a = _v_operand(stages, slot, kk, valid, masked, interpret)
            acc = acc + lax.dot_general(a.astype(jnp.float32),
                                        p_ref[pl.ds(16 * kk, 16), :].astype(jnp.float32),
                                        (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        release()
        return acc

    def body(acc_ref):
        for kk in range(BLOCK_KV // 16):
            a = _v_operand(stages, slot, kk, valid, masked, interpret)
            if kk == BLOCK_KV // 16 - 1:
                release()
            plgpu.wgmma(acc_ref, a, p_ref.at[pl.ds(16 * kk, 16)])
            plgpu.wgmma_wait(1)
        plgpu.wgmma_wait(0)

    return pl.run_state(body)(plgpu.ACC.init(acc))


def decode_call(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float, s_q: int,
                num_splits: int, k_scale: jax.Array, v_scale: jax.Array,
                v_head_dim: int = 512, partial_dtype="bfloat16",
                config: MgpuDecodeConfig = MgpuDecodeConfig(),
                interpret=False) -> tuple[jax.Array, jax.Array]:
    """The pallas call on checked arguments (`api.check_decode_args` and
    `fp8_narrow_supported`): o [B, S, rows, 512] and lse [B, S, rows], the contract of
    `decode_mgpu.decode_call`. k_scale / v_scale: float32 [1]. config: the warpgroups'
    registers and the in-kernel profiler (`MgpuDecodeConfig`; phases prepare_q, copy,
    wait_free on the producer, qk, wait_kv, softmax, p_store, pv, finish on each consumer)."""
    if _STAGES % _CONSUMERS:  # a knob `bench.kernel_ab --set` can rebind
        raise ValueError(f"decode_mgpu_fp8._STAGES = {_STAGES} must be a multiple of "
                         f"{_CONSUMERS}: each stage's fills go to one consumer")
    t, h, d = q.shape
    total_rows = s_q * h
    rows = BLOCK_ROWS  # a block's
    b = t // s_q
    final = num_splits == 1
    o_dtype = q.dtype if final else jnp.dtype(partial_dtype)
    pv_swizzle = 2 * rows  # bytes of one P^T row (f16)
    scratch = [
        plgpu.SMEM((2 * rows, d), jnp.float8_e4m3fn, transforms=swizzled(_FP8_SWIZZLE, 1)),
        plgpu.SMEM((2, rows), jnp.float32),
        plgpu.SMEM((_STAGES, BLOCK_KV, d), kv_pool.dtype, transforms=swizzled(_FP8_SWIZZLE, 1)),
        plgpu.SMEM((rows,), jnp.float32),  # lse staging
        # consumer 1's hand-off: O^T, max, sum
        plgpu.SMEM((v_head_dim, rows), jnp.float32),
        plgpu.SMEM((rows,), jnp.float32),
        plgpu.SMEM((rows,), jnp.float32),
        plgpu.SMEM((_CONSUMERS, BLOCK_KV, rows), jnp.float16, transforms=swizzled(pv_swizzle, 2)),
        plgpu.SMEM((_CONSUMERS, _RED_BYTES // 4), jnp.float32),
        plgpu.Barrier(),  # q and the scales prepared
        filled_scratch(kv.page_size, _STAGES),  # stage filled
        plgpu.Barrier(num_barriers=_STAGES),  # stage's bytes in its consumer's registers
        plgpu.Barrier(),  # consumer 1's (O^T, max, sum) handed over
    ]
    meta = kv.meta_operands()
    kernel = functools.partial(
        _kernel, form=kv.form, entries_per_seq=kv.entries_per_seq, page_size=kv.page_size,
        num_splits=num_splits, s_q=s_q, num_heads=h, d_v=v_head_dim, sm_scale=float(sm_scale),
        final=final, cfg=config, interpret=interpret)
    n_io = len(meta) + 7  # meta, table, q, k_scale, v_scale, pool; o, lse
    call = plgpu.kernel(
        lambda *refs: kernel(*refs[:n_io], refs[n_io:]),
        out_type=(jax.ShapeDtypeStruct((b, num_splits, total_rows, v_head_dim), o_dtype),
                  jax.ShapeDtypeStruct((b, num_splits, total_rows), jnp.float32)),
        scratch_types=scratch,
        grid=(b * num_splits * (total_rows // rows),),
        grid_names=("blk",),
        num_threads=3,
        thread_name="wg",
        compiler_params=compiler_params(config.profile_space, config.profile_dir),
        interpret=mgpu_params(interpret),
        kernel_name=f"mla_decode_mgpu_fp8_ps{kv.page_size}",
    )
    return call(*meta, kv.table, q.reshape(b, total_rows, d),
                k_scale.reshape(1).astype(jnp.float32),
                v_scale.reshape(1).astype(jnp.float32), kv_pool)
