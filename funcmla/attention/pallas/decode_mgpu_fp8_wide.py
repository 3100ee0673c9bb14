"""Absorbed MLA decode over an fp8 pool at 64 folded query rows a block (128 heads), on
Hopper's matrix units: a warp-specialized Pallas Mosaic GPU kernel.

At 64 rows a block decode is compute bound, so the products keep `decode_mgpu`'s form (S = q
k^T [64 rows, 64 tokens], O += P V) and the fp8 bytes go where the matrix units take them
without conversion:

* S = q k^T: fp8 `wgmma`s with A = q's two e4m3 parts (q8 [128, 576] in shared memory, rows
  0-63 the high parts, 64-127 the low ones: `fp8_q_split`) and B = the fp8 landing stage
  itself (K-major). Each part is one chain of `wgmma`s over all 576 columns on its own
  accumulator (Hopper's fp8 `wgmma` keeps ~13-14 bits in its accumulator, so the two parts
  are not chained together), the two summed in fp32. K is never converted.
* O += P V: V's K axis is the token axis, which an 8-bit operand cannot have as its
  contiguous one, so each tile's V [64, 512] is converted to f16 (exact) into one
  shared-memory buffer (`_convert_v`, `cvt.rn.f16x2.e4m3x2` a pair, 16-byte loads and
  stores, no bank conflicts) while consumer 0 runs q k^T, each consumer's 256 columns apart:
  the producer converts consumer 0's, consumer 1 its own. Then both consumers add P V over
  their halves (P f16, from consumer 0's registers / handed through shared memory).

One CUDA block handles 64 folded rows of one sequence against one split of its KV, with three
warpgroups:

* warpgroup 2 (producer): issues the first two fp8 tiles into the two landing stages (TMA
  copies, or a `cp.async` row gather under 8 tokens a page: `mgpu_kv_copy`), prepares q's
  e4m3 parts and the row factors meanwhile (`fp8_q_split.prepare_q_smem`; before the
  gathers at pages under 8, as `produce_tiles` orders it); then, tile by
  tile, converts V's columns 0-255 once consumer 0's previous P V has read them, and
  refills the tile's stage once consumer 0's q k^T and consumer 1's conversion have read it;
* warpgroup 0 (consumer): q k^T, the masked online softmax in base 2 (each row's factor
  sm_scale * k_scale * log2(e) / up multiplies s - max), P and the row rescale alpha to
  consumer 1, then O[:, :256] += P V[:, :256] with P from its registers;
* warpgroup 1 (consumer): V's columns 256-511 to f16, then O[:, 256:] += P V[:, 256:].

Split this way the conversion runs on two warpgroups at once, and neither consumer waits for
the other's P V before its half is converted (one converter for all 512 columns was the
tile's critical path: `python -m bench.decode_profile --kernels fp8`).

Shared memory: q8 72 KB + two fp8 stages 72 KB + f16 V 64 KB + P 8 KB; the output staging
reuses the stages and V once both consumers meet after their last tile. Masking: scores past
a row's causal limit (and so past kv_len) are selected to -inf, which also drops a NaN from an
unused K row; V tokens past kv_len are converted as zeros. So no unused pool row (NaN, Inf)
reaches the result. Zero-length KV gives out 0 and lse +inf. Grid, splits and partials are
`decode_mgpu`'s, so the merge is shared. Runs on sm_90a, and on CPU in Mosaic GPU interpret
mode (`mgpu_ops.interpreter_unsupported`). Why this design and what it measures:
docs/decode_kernel.md ("fp8 KV"); `python -m bench.decode --kv-dtype fp8`.

`products="fp8"` (`DecodeKernelConfig.fp8_products`) is the all-fp8 matrix path: q rounded
once to e4m3 (q8 [64, 576]; q k^T one `wgmma` chain on one accumulator), P scaled by 2^8 and
rounded to e4m3 into shared memory (A of both consumers' P V), and consumer 1 transposes each
tile's V into V^T [512, 64] fp8 (`_transpose_v`: the K-major B an 8-bit P V needs) instead of
converting it (the producer converts nothing); three stages fit. Its error is e4m3's
(5.7-5.8e-2 on the output against float32; docs/decode_kernel.md, "fp8 products").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas import fp8_transpose
from funcmla.attention.pallas.decode_common import (
    FP8_PRODUCTS,
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
    mma_acc,
    mma_acc_and,
    swizzled,
    warpgroup_sync,
)

__all__ = ["fp8_wide_supported", "decode_call", "BLOCK_M", "BLOCK_KV"]

_LN2 = 0.6931471805599453

BLOCK_M = 64      # folded query rows per block (wgmma M)
_HALF = 256       # output columns per consumer warpgroup (wgmma N <= 256)
_D, _DV = 576, 512
_STAGES = 2       # fp8 landing stages (36 KB each)
_V_SWIZZLE = 128  # bytes; the f16 V buffer and P: 64 f16 columns per swizzle tile
_O_SWIZZLE = 128  # bytes; the output staging (register stores free of bank conflicts)
# `setmaxnreg` budgets (producer, consumer 0, consumer 1) by products. Mixed: the producer
# converts V's first half, consumer 0 holds both q k^T accumulators beside its output half and
# P, consumer 1 an output half and its share of the conversion; 0.95-0.99x the time of the
# bf16 kernel's 40 / 232 / 232, under which consumer 0 reloads more spills in its loops
# (docs/decode_kernel.md, decision log). fp8: the producer only copies, consumer 1 transposes V.
_REGISTERS = {"mixed": (64, 240, 200), "fp8": (40, 232, 232)}
# q k^T: each of q's e4m3 parts is one chain of fp8 wgmmas over all 576 columns on its own
# accumulator (18 wgmmas a chain), the parts summed in fp32 once both are done, so no chain is
# drained before the tile's last. Hopper's fp8 wgmma keeps ~13-14 bits in its accumulator, so
# the chain's length sets the score error: groups of 192 columns with both parts on one
# accumulator (12 a chain, drained and summed per group) measured 3.5e-3 against 3.6-3.7e-3
# here, and took 1.01 / 1.09 / 1.15x the time (H100, H128 B128 L16k p64 / B32 L4k p64 /
# B128 L16k p1); both parts on one chain of all 576 (36 wgmmas): 7.9e-3, too near the 1e-2
# bound. The fp8 products' one part is one chain as well (docs/decode_kernel.md, decision log).
# fp8_products="fp8": q and P each rounded once to e4m3 and both products on fp8 wgmmas; P in
# [0, 1] is scaled by 2^8 first (e4m3 keeps weights down to 2^-17 of the row's largest,
# subnormals included), the output by 2^-8 at the end. Shared memory is then q8 36 KB, V^T
# 32 KB and P 4 KB beside the stages, so it takes a third stage (not timed against two; a
# fourth: 1.017 / 0.995x the time, docs/decode_kernel.md, decision log).
_P_SCALE = 256.0
_FP8_PV_STAGES = 3


def fp8_wide_supported(rows: int, page_size: int, head_dim: int, v_head_dim: int,
                       q_dtype, kv_dtype) -> str | None:
    """None when this kernel handles the shape, else the reason it does not."""
    if rows % BLOCK_M:
        return f"folded rows s_q*H = {rows} is not a multiple of {BLOCK_M}"
    return (fp8_operands_unsupported(head_dim, v_head_dim, q_dtype, kv_dtype)
            or page_size_unsupported(page_size))


def _scores(q8_smem, stage, interpret: bool):
    """S = q k^T of the tile in `stage` [64 rows, 64 tokens] fp32, unscaled: each of q's e4m3
    parts (A: the high and the low one, or the high one alone when q8_smem has 64 rows) by the
    fp8 stage (B, K-major) as one `wgmma` chain on its own accumulator, the parts summed in
    fp32 registers."""
    parts = q8_smem.shape[0] // BLOCK_M
    if interpret:
        k = stage[...].astype(jnp.float32)
        q = q8_smem[...].astype(jnp.float32)
        dims = (((1,), (1,)), ((), ()))
        prods = [lax.dot_general(q[i * BLOCK_M:(i + 1) * BLOCK_M], k, dims,
                                 preferred_element_type=jnp.float32) for i in range(parts)]
        return prods[0] if parts == 1 else prods[0] + prods[1]
    k_t = stage.transpose((1, 0))

    def body(*accs):
        for i, acc in enumerate(accs):
            plgpu.wgmma(acc, q8_smem.at[pl.ds(i * BLOCK_M, BLOCK_M)], k_t)
        total = None
        for n, acc in enumerate(accs):  # the high part's first, while the low one's runs
            part = plgpu.wgmma_accumulator_load(acc, wait_n=parts - 1 - n)
            total = part if total is None else total + part
        return total

    return pl.run_scoped(body, *([plgpu.ACC((BLOCK_M, BLOCK_KV), jnp.float32)] * parts))


def _valid_v(stages, slot, valid):
    """V [64, 512] of stage `slot` with tokens at or past `valid` zeroed: what `_convert_v` and
    `_transpose_v` read, as the interpreter's plain ops."""
    v = stages[slot, :, pl.ds(0, _DV)]
    tok = lax.broadcasted_iota(jnp.int32, v.shape, 0)
    return jnp.where(tok < valid, v, jnp.zeros_like(v))


def _convert_v(stages, slot, v_smem, valid, half: int, interpret: bool):
    """v_smem[:, 256 half : 256 half + 256] f16 = those columns of V in stage `slot`, tokens
    at or past `valid` as zeros (the columns consumer `half`'s P V reads). Thread t converts
    16-byte vectors j * 128 + t (j of the half's parity) in the stage's physical order (a warp
    reads one 512-byte swizzle tile: no bank conflicts), each into two 16-byte f16 vectors of
    the same row (128-byte swizzle; the 8 lanes of a store phase land in 8 distinct bank
    groups)."""
    if interpret:
        lo = half * _HALF
        v_smem[:, pl.ds(lo, _HALF)] = _valid_v(stages, slot, valid)[:, lo:lo + _HALF].astype(
            jnp.float16)
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(swizzled(Q8_SWIZZLE, 1)),
                                  plgpu.RefType(swizzled(_V_SWIZZLE, 2)), splat, splat))
    def convert(ctx, stages, v16, slot, valid):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32 = (ir.IntegerType.get_signless(n) for n in (8, 32))
        v4 = ir.VectorType.get((4,), i32)
        slot, valid = slot.registers.item(), valid.registers.item()
        src_tiles = _D // 64   # 64-column tiles a row of 8 stage rows holds (512 B each)
        dst_tiles = _DV // 64  # and of the f16 buffer (1 KB each)

        def k(n):
            return mu.c(n, i32)

        def cvt(word, half: int):  # bytes 2 half, 2 half + 1 of a word -> an f16 pair
            return llvm.inline_asm(
                i32, [word], "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                f"cvt.rn.f16x2.e4m3x2 $0, {('lo', 'hi')[half]}; }}", "=r,r")

        t = arith.remui(mu.thread_idx(), k(128))
        q32 = arith.andi(t, k(31))
        r8, pv = arith.shrui(q32, k(2)), arith.andi(q32, k(3))
        lv = arith.xori(pv, arith.shrui(r8, k(1)))  # the vector's 16 columns: 16 lv + ...
        src0 = mu.getelementptr(mu.memref_ptr(stages), [arith.addi(
            arith.muli(slot, k(BLOCK_KV * _D)), arith.addi(arith.shli(r8, k(6)),
                                                           arith.shli(pv, k(4))))], i8)
        dst_row = arith.shli(r8, k(7))
        dst_lo = arith.shli(arith.xori(arith.shli(lv, k(1)), r8), k(4))
        dst_hi = arith.shli(arith.xori(arith.addi(arith.shli(lv, k(1)), k(1)), r8), k(4))
        dst0 = mu.memref_ptr(v16)
        zero = vector.broadcast(v4, k(0))
        warp = arith.shrui(t, k(5))
        for j in range(half, BLOCK_KV * _DV // 16 // 128, 2):  # tiles of columns 256 half +
            tile = arith.addi(k(4 * j), warp)  # 8 x 8 tiles of V, 4 warps a pass
            tr, tc = arith.shrui(tile, k(3)), arith.andi(tile, k(7))
            x = llvm.load(v4, mu.getelementptr(src0, [arith.muli(
                arith.addi(arith.muli(tr, k(src_tiles)), tc), k(512))], i8), alignment=16)
            tok = arith.addi(arith.shli(tr, k(3)), r8)
            x = arith.select(arith.cmpi(arith.CmpIPredicate.slt, tok, valid), x, zero)
            words = [vector.extract(x, dynamic_position=[], static_position=[w])
                     for w in range(4)]
            f16s = [cvt(w, h) for w in words for h in range(2)]
            base = arith.addi(arith.muli(arith.addi(arith.muli(tr, k(dst_tiles)), tc),
                                         k(1024)), dst_row)
            for off, part in ((dst_lo, f16s[:4]), (dst_hi, f16s[4:])):
                llvm.store(vector.from_elements(v4, part), mu.getelementptr(
                    dst0, [arith.addi(base, off)], i8), alignment=16)

    convert(stages, v_smem, slot, valid)


def transpose_thread_map(t: int, p: int) -> tuple[int, int, int, int]:
    """(cb8, tb16, flip, rot) of thread t (0-127) in pass p (0, 1) of `_transpose_v`: it moves
    columns 8 cb8 .. 8 cb8 + 7 of tokens 16 tb16 .. 16 tb16 + 15; its load k reads token
    16 tb16 + (k ^ flip), and its output word i of a 4-column block holds column i ^ rot. So
    the 16 threads of an 8-byte load phase read 16 distinct bank slots of the stage (64-byte
    swizzle: token parity by flip, chunk and half by cb8), and the 8 threads of a 16-byte store
    phase write 8 distinct ones of V^T (column parity and chunk by rot, the chunk's swizzle by
    tb16). Plain ints here; the kernel computes the same bits from its thread index."""
    lane, w = t & 31, t >> 5
    cb8 = lane | (w & 1) << 5
    tb16 = p | (((lane >> 2) & 1) ^ (w >> 1)) << 1
    return cb8, tb16, (lane >> 3) & 1, lane & 3


_STAGE_ROWS8 = _D // 64 * 512  # bytes of 8 rows of an fp8 stage (9 swizzle tiles of 512 B)


def transpose_load_offset(kk: int, p: int) -> tuple[int, int, int]:
    """(c, odd, imm) of load kk (0-15) in pass p (0, 1) of `_transpose_v`: the load reads stage
    bytes base(c, odd) + imm. The thread's 8 registers base(c, odd) = the stage's offset + its
    columns' (8 cb8: tile and half) + 4 hb row groups of 8 (tb16 = p + 2 hb) + ((chunk ^ c)
    << 4) + 64 flip (an even kk) or - 64 flip (an odd one) hold all that depends on the thread
    and the tile; imm is a constant of the instruction. This holds because the token,
    16 tb16 + (kk ^ flip), has only its bit 0 flipped, so the swizzle's row bits (kk & 7) >> 1
    are static: no address arithmetic a load, and nothing kept per load across tiles (the
    offsets ptxas hoisted there spilled)."""
    return (kk & 7) >> 1, kk & 1, (2 * p + (kk >> 3)) * _STAGE_ROWS8 + (kk & 7) * 64


def transpose_token_mask(valid_rel: int, quad: int) -> int:
    """The bytes kept of a V^T word holding tokens 4 quad .. 4 quad + 3 of a thread's 16-token
    block (byte j: token 4 quad + j), where valid_rel = kv_len - the block's first token:
    0xFF for a token below it, 0 past it."""
    n = min(max(valid_rel - 4 * quad, 0), 4)
    return (0xFFFFFFFF >> (8 * (4 - n))) & 0xFFFFFFFF


def _transpose_v(stages, slot, vt_smem, valid, interpret: bool):
    """vt_smem [512, 64] fp8 = V^T of stage `slot` (its first 512 columns), tokens at or past
    `valid` as zeros: the K-major B operand an fp8 P V needs (V's K axis is the token axis).
    Each thread moves 16 tokens x 8 columns a pass, two passes (`transpose_thread_map`): 8-byte
    loads (token k's 8 bytes as two words, columns 4 g .. 4 g + 3) from 8 base registers and
    constant offsets (`transpose_load_offset`), `fp8_transpose.transpose_4x4` of each 4-token,
    4-column block, 16-byte stores of a column's 16 tokens, each word masked to the tokens
    below `valid` (`transpose_token_mask`); no bank conflicts either way."""
    if interpret:
        vt_smem[...] = _valid_v(stages, slot, valid).T
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(swizzled(Q8_SWIZZLE, 1)),
                                  plgpu.RefType(swizzled(Q8_SWIZZLE, 1)), splat, splat))
    def transpose(ctx, stages, vt, slot, valid):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32, i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
        v2, v4 = ir.VectorType.get((2,), i32), ir.VectorType.get((4,), i32)
        slot, valid = slot.registers.item(), valid.registers.item()

        def k(n, ty=i32):
            return mu.c(n, ty)

        def bit(x, n):
            return arith.andi(arith.shrui(x, k(n)), k(1))

        def prmt(a, b, s):
            return llvm.inline_asm(i32, [a, b, s], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")

        t = arith.remui(mu.thread_idx(), k(128))
        lane, w = arith.andi(t, k(31)), arith.shrui(t, k(5))
        cb8 = arith.ori(lane, arith.shli(arith.andi(w, k(1)), k(5)))
        flip, rot = bit(lane, 3), arith.andi(lane, k(3))
        hb = arith.xori(bit(lane, 2), arith.shrui(w, k(1)))
        tb16s = [arith.ori(k(p), arith.shli(hb, k(1))) for p in range(2)]  # p + 2 hb
        # the first-stage selectors: X takes columns rot, rot ^ 1 of a word, Y rot ^ 2, rot ^ 3
        sel = {}
        for name, base in (("x", 0), ("y", 2)):
            cases = {(r, f): fp8_transpose.pair_select(base ^ r, base ^ r ^ 1, f)
                     for r in range(4) for f in range(2)}
            value = None
            for (r, f), c in cases.items():
                hit = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, rot, k(r)),
                                 arith.cmpi(arith.CmpIPredicate.eq, flip, k(f)))
                value = k(c) if value is None else arith.select(hit, k(c), value)
            sel[name] = value
        # load bases (`transpose_load_offset`): column 8 cb8's tile and half, the thread's
        # 16-token blocks, the swizzle chunk of each row pair, the flipped token's row
        col_tile = arith.shrui(cb8, k(3))
        chunk = arith.andi(arith.shrui(cb8, k(1)), k(3))
        half = arith.shli(arith.andi(cb8, k(1)), k(3))
        src = arith.addi(
            arith.addi(arith.muli(slot, k(BLOCK_KV * _D)), arith.shli(col_tile, k(9))),
            arith.addi(half, arith.muli(hb, k(4 * _STAGE_ROWS8))))
        flip64 = arith.shli(flip, k(6))
        ptr0 = mu.memref_ptr(stages)
        bases = {(c, odd): mu.getelementptr(ptr0, [arith.addi(
            arith.addi(src, arith.shli(arith.xori(chunk, k(c)), k(4))),
            arith.subi(k(0), flip64) if odd else flip64)], i8)
            for c in range(4) for odd in range(2)}
        dst0 = mu.getelementptr(mu.memref_ptr(vt), [arith.shli(cb8, k(9))], i8)
        # per pass, the kept bytes of each token quad (`transpose_token_mask`)
        masks = []
        for tb16 in tb16s:
            rel = arith.subi(valid, arith.shli(tb16, k(4)))
            row = []
            for quad in range(4):
                n = arith.minsi(arith.maxsi(arith.subi(rel, k(4 * quad)), k(0)), k(4))
                shift = arith.extui(i64, arith.shli(arith.subi(k(4), n), k(3)))
                row.append(arith.trunci(i32, arith.shrui(k(0xFFFFFFFF, i64), shift)))
            masks.append(row)
        for p, tb16 in enumerate(tb16s):
            words = []
            for kk in range(16):
                c, odd, imm = transpose_load_offset(kk, p)
                x = llvm.load(v2, mu.getelementptr(bases[c, odd], [imm], i8), alignment=8)
                words.append([vector.extract(x, dynamic_position=[], static_position=[g])
                              for g in range(2)])
            for g in range(2):
                # by quad of tokens: word i holds column 4 g + (i ^ rot), those 4 tokens
                quads = [fp8_transpose.transpose_4x4(
                    prmt, [words[4 * quad + j][g] for j in range(4)], sel["x"], sel["y"], k)
                    for quad in range(4)]
                cols = [[arith.andi(quads[quad][i], masks[p][quad]) for quad in range(4)]
                        for i in range(4)]
                for i in range(4):
                    c8 = arith.addi(k(4 * g), arith.xori(k(i), rot))  # column within 8
                    off = arith.addi(arith.shli(c8, k(6)), arith.shli(
                        arith.xori(tb16, arith.shrui(c8, k(1))), k(4)))
                    llvm.store(vector.from_elements(v4, cols[i]),
                               mu.getelementptr(dst0, [off], i8), alignment=16)

    transpose(stages, vt_smem, slot, valid)


def _pv_and(acc, p_regs, p_smem, v_smem, half: int, fp8_pv: bool, x, under, interpret: bool):
    """(acc + P V over output columns [256 half, 256 half + 256), under(x)), `under` run while
    the `wgmma` does (None: x is returned as it is). fp8_pv: P8 [64, 64] e4m3 (A, shared
    memory) by V^T's rows (B, K-major: `_transpose_v`); else P f16 (A: `p_regs` when given,
    else `p_smem`) by the f16 V's columns (B)."""
    cols = pl.ds(half * _HALF, _HALF)
    if fp8_pv and interpret:
        acc = acc + lax.dot_general(p_smem[...].astype(jnp.float32),
                                    v_smem[cols, :].astype(jnp.float32),
                                    (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc, (x if under is None else under(x))
    if fp8_pv:
        a, b = p_smem, v_smem.at[cols].transpose((1, 0))
    else:
        a, b = (p_smem if p_regs is None else p_regs), v_smem.at[:, cols]
    if under is None:
        return mma_acc(acc, a, b, interpret), x
    return mma_acc_and(acc, a, b, x, under, interpret)


def _kernel(*refs, form: str, entries_per_seq: int | None, page_size: int, num_splits: int,
            s_q: int, num_heads: int, sm_scale: float, final: bool, products: str,
            cfg: MgpuDecodeConfig, interpret: bool):
    n_meta = len(refs) - 8
    meta, (table_ref, q_ref, k_scale_ref, v_scale_ref, kv_ref, o_ref, lse_ref, scratch) = (
        refs[:n_meta], refs[n_meta:])
    (q8_smem, scale_smem, kv_or_out, p_smem, alpha_smem, l_smem, q_bar, k_full, k_empty,
     v_full, v_free, p_full, p_free, l_ready) = scratch
    (stages, v_smem), (o_stage, lse_stage) = kv_or_out
    fp8_pv = products == "fp8"  # P V on fp8 wgmmas: P8 and V^T (v_smem) in shared memory

    b, split, rb = block_coords(lax.axis_index("blk"), num_splits, s_q * num_heads // BLOCK_M)
    wg = lax.axis_index("wg")
    budgets = cfg.kernel_registers(_REGISTERS[products])
    row_lo = rb * BLOCK_M

    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)
    first, last = split_tile_range(kv_len, split, num_splits, BLOCK_KV)
    count = jnp.maximum(last - first, 0)
    n_stages = stages.shape[0]
    init_filled(k_full, interpret=interpret)

    def wait_kv(i, wgmma_reads: bool):
        with jax.named_scope("wait_kv"):
            wait_filled(k_full, i, num_stages=n_stages, async_proxy=wgmma_reads,
                        interpret=interpret)

    @pl.when(wg == 2)
    def _producer():
        # a stage is released by consumer 0's q k^T and consumer 1's conversion (or transpose);
        # with the default products the producer converts V's columns 0-255 itself (for
        # consumer 0's P V), so consumer 1 converts only its own half
        def prepare():  # q's e4m3 parts, then the registers go to the consumers
            with jax.named_scope("prepare_q"):
                prepare_q_smem(q_ref, k_scale_ref, v_scale_ref, q8_smem, scale_smem, b, row_lo,
                               sm_scale=sm_scale, interpret=interpret,
                               parts=q8_smem.shape[0] // BLOCK_M)
                plgpu.commit_smem()
                plgpu.barrier_arrive(q_bar)
            plgpu.set_max_registers(budgets[0], action="decrease")

        def convert_half0(i):
            slot = lax.rem(i, n_stages)
            wait_kv(i, False)

            @pl.when(i > 0)  # consumer 0's previous P V has read V's columns 0-255
            def _():
                with jax.named_scope("wait_v_free"):
                    plgpu.barrier_wait(v_free)

            with jax.named_scope("convert"):
                _convert_v(stages, slot, v_smem, kv_len - (first + i) * BLOCK_KV, 0, interpret)
                plgpu.commit_smem()
                plgpu.barrier_arrive(v_full)

        produce_tiles(kv_ref, table_ref, stages, k_full, k_empty, first=first, count=count,
                      start_entry=start_entry, kv_len=kv_len, num_stages=n_stages,
                      page_size=page_size, swizzle=Q8_SWIZZLE, interpret=interpret,
                      prepare=prepare, consume=None if fp8_pv else convert_half0)
        if not fp8_pv:
            @pl.when(count > 0)  # consumer 0's last P V: every phase of v_free is observed
            def _():
                plgpu.barrier_wait(v_free)

    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def finish(acc, m_i, l_i, half: int):
        """Consumer `half` after its last P V: both meet (the output staging reuses the stages
        and V; consumer 0 hands over the row sums), then its output half is normalized and
        written, and consumer 0 writes the lse."""
        with jax.named_scope("finish"):
            if half == 0:
                l_smem[...] = l_i
            else:  # the factors' writes, ordered before consumer 1's reads
                plgpu.barrier_wait(q_bar)
            plgpu.barrier_arrive(l_ready)
            plgpu.barrier_wait(l_ready)
            l_i = load(l_smem, row_layout, interpret)
            has = l_i > 0.0
            l_safe = jnp.where(has, l_i, 1.0)
            v_scale = load(scale_smem.at[1], row_layout, interpret)
            if fp8_pv:  # P8 holds p * _P_SCALE
                v_scale = v_scale * (1.0 / _P_SCALE)
            out = acc * lax.broadcast_in_dim(v_scale / l_safe, acc.shape, [0])
            o_stage.at[half][...] = out.astype(o_stage.dtype)  # swizzled: no bank conflicts
            if half == 0:
                factor = load(scale_smem.at[0], row_layout, interpret)
                empty = jnp.inf if final else -jnp.inf
                lse_stage[...] = jnp.where(has, (m_i * factor + jnp.log2(l_safe)) * _LN2, empty)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_stage.at[half], o_ref.at[b, split, pl.ds(row_lo, BLOCK_M),
                                                               pl.ds(half * _HALF, _HALF)])
            if half == 0:
                plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, split, pl.ds(row_lo, BLOCK_M)])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 0)
    def _consumer0():
        plgpu.set_max_registers(budgets[1], action="increase")
        rows_iota = iota((BLOCK_M, BLOCK_KV), 0, interpret)
        cols_iota = iota((BLOCK_M, BLOCK_KV), 1, interpret)
        limit = causal_limit(kv_len, s_q, (row_lo + rows_iota) // num_heads)
        acc0 = in_layout(jnp.zeros((BLOCK_M, _HALF), jnp.float32), plgpu.Layout.WGMMA,
                         interpret)
        m0 = in_layout(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout, interpret)
        l0 = in_layout(jnp.zeros((BLOCK_M,), jnp.float32), row_layout, interpret)
        n_plain = jnp.clip((kv_len - s_q + 1) // BLOCK_KV - first, 0, count)
        plgpu.barrier_wait(q_bar)
        factor = load(scale_smem.at[0], row_layout, interpret)

        def step(i, carry, masked: bool):
            acc, m_i, l_i = carry
            slot = lax.rem(i, n_stages)
            tile = first + i
            with jax.named_scope("qk"):
                wait_kv(i, True)
                s = _scores(q8_smem, stages.at[slot], interpret)
                plgpu.barrier_arrive(k_empty.at[slot])
            if masked:
                s = jnp.where(tile * BLOCK_KV + cols_iota < limit, s, -jnp.inf)
            with jax.named_scope("softmax"):
                # max over raw scores, the factor (> 0) multiplying s - max (`decode_mgpu`)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                alpha = jnp.exp2((m_i - m_safe) * factor)
                p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
                             * lax.broadcast_in_dim(factor, s.shape, [0]))
                if fp8_pv:
                    p_op = (p * _P_SCALE).astype(jnp.float8_e4m3fn)
                else:
                    p_op = p.astype(jnp.float16)
            # V converted (fp8 products: by consumer 1, which is then past its previous P V,
            # so P and alpha are free; else the producer's half, and consumer 1 says when)
            with jax.named_scope("wait_v"):
                plgpu.barrier_wait(v_full)
                if not fp8_pv:
                    @pl.when(i > 0)
                    def _():
                        plgpu.barrier_wait(p_free)
            with jax.named_scope("hand_off"):
                p_smem[...] = p_op
                alpha_smem[...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_full)
            with jax.named_scope("pv"):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if fp8_pv:  # every thread's P8 stores, before its wgmma reads them
                    warpgroup_sync(interpret)
                acc, l_i = _pv_and(acc, p_op, p_smem, v_smem, 0, fp8_pv, l_i,
                                   lambda l: l * alpha + p.sum(axis=1), interpret)
                plgpu.barrier_arrive(v_free)
            return acc, m_new, l_i

        carry = lax.fori_loop(0, n_plain, functools.partial(step, masked=False),
                              (acc0, m0, l0))
        carry = lax.fori_loop(n_plain, count, functools.partial(step, masked=True), carry)
        if not fp8_pv:
            @pl.when(count > 0)  # consumer 1's last P V: every phase of p_free is observed
            def _():
                plgpu.barrier_wait(p_free)
        finish(*carry, 0)

    @pl.when(wg == 1)
    def _consumer1():
        plgpu.set_max_registers(budgets[2], action="increase")
        acc0 = in_layout(jnp.zeros((BLOCK_M, _HALF), jnp.float32), plgpu.Layout.WGMMA,
                         interpret)

        def step(i, acc):
            slot = lax.rem(i, n_stages)
            wait_kv(i, False)

            if fp8_pv:
                @pl.when(i > 0)  # consumer 0's previous P V has read V^T
                def _():
                    with jax.named_scope("wait_free"):
                        plgpu.barrier_wait(v_free)

            valid = kv_len - (first + i) * BLOCK_KV
            with jax.named_scope("transpose" if fp8_pv else "convert"):
                if fp8_pv:
                    _transpose_v(stages, slot, v_smem, valid, interpret)
                else:  # its own half: its previous P V, which read it, is done
                    _convert_v(stages, slot, v_smem, valid, 1, interpret)
                plgpu.commit_smem()
                warpgroup_sync(interpret)  # every thread's V stores, before this P V reads them
                plgpu.barrier_arrive(k_empty.at[slot])
                if fp8_pv:
                    plgpu.barrier_arrive(v_full)
            with jax.named_scope("wait_p"):
                plgpu.barrier_wait(p_full)
                alpha = load(alpha_smem, row_layout, interpret)
            with jax.named_scope("pv"):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = _pv_and(acc, None, p_smem, v_smem, 1, fp8_pv, None, None, interpret)[0]
                if not fp8_pv:  # P and alpha read
                    plgpu.barrier_arrive(p_free)
                return acc

        acc = lax.fori_loop(0, count, step, acc0)

        if fp8_pv:
            @pl.when(count > 0)  # consumer 0's last P V: every phase of v_free is observed
            def _():
                plgpu.barrier_wait(v_free)

        finish(acc, None, None, 1)


def decode_call(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float, s_q: int,
                num_splits: int, k_scale: jax.Array, v_scale: jax.Array,
                v_head_dim: int = 512, partial_dtype="bfloat16", products: str = "mixed",
                config: MgpuDecodeConfig = MgpuDecodeConfig(),
                interpret=False) -> tuple[jax.Array, jax.Array]:
    """The pallas call on checked arguments (`api.check_decode_args` and
    `fp8_wide_supported`): o [B, S, rows, 512] and lse [B, S, rows], the contract of
    `decode_mgpu.decode_call`. k_scale / v_scale: float32 [1]. products: "mixed" (q as two
    e4m3 parts, P f16: the bf16 kernels' error) or "fp8" (q and P rounded once to e4m3, both
    products on fp8 `wgmma`s; `DecodeKernelConfig.fp8_products`). config: the warpgroups'
    registers and the in-kernel profiler (`MgpuDecodeConfig`; phases prepare_q, copy,
    wait_free, and with the default products wait_kv, wait_v_free, convert on the producer;
    qk, wait_kv, softmax, wait_v, hand_off, pv, finish on consumer 0; wait_kv, convert or
    wait_free and transpose, wait_p, pv, finish on consumer 1)."""
    if products not in FP8_PRODUCTS:
        raise ValueError(f"products must be one of {FP8_PRODUCTS}, got {products!r}")
    fp8_pv = products == "fp8"
    t, h, d = q.shape
    rows = s_q * h
    b = t // s_q
    final = num_splits == 1
    o_dtype = q.dtype if final else jnp.dtype(partial_dtype)
    fp8_tiles = swizzled(Q8_SWIZZLE, 1)
    f16_tiles = swizzled(_V_SWIZZLE, 2)
    n_stages = _FP8_PV_STAGES if fp8_pv else _STAGES
    stages = plgpu.SMEM((n_stages, BLOCK_KV, d), kv_pool.dtype, transforms=fp8_tiles)
    if fp8_pv:  # V^T, fp8 (`_transpose_v`)
        v_smem = plgpu.SMEM((v_head_dim, BLOCK_KV), jnp.float8_e4m3fn, transforms=fp8_tiles)
    else:  # V, f16 (`_convert_v`)
        v_smem = plgpu.SMEM((BLOCK_KV, v_head_dim), jnp.float16, transforms=f16_tiles)
    o_stage = plgpu.SMEM((2, BLOCK_M, _HALF), o_dtype,
                         transforms=swizzled(_O_SWIZZLE, jnp.dtype(o_dtype).itemsize))
    lse_stage = plgpu.SMEM((BLOCK_M,), jnp.float32)
    scratch = [
        plgpu.SMEM(((1 if fp8_pv else 2) * BLOCK_M, d), jnp.float8_e4m3fn,
                   transforms=fp8_tiles),  # q's e4m3 parts
        plgpu.SMEM((2, BLOCK_M), jnp.float32),  # row factors, v_scale
        # the output staging reuses the stages and V once both consumers have met at the end
        # (the interpreter has no RefUnion, nor a shared-memory limit)
        (((stages, v_smem), (o_stage, lse_stage)) if interpret
         else plgpu.RefUnion((stages, v_smem), (o_stage, lse_stage))),
        (plgpu.SMEM((BLOCK_M, BLOCK_KV), jnp.float8_e4m3fn, transforms=fp8_tiles) if fp8_pv
         else plgpu.SMEM((BLOCK_M, BLOCK_KV), jnp.float16, transforms=f16_tiles)),  # P
        plgpu.SMEM((BLOCK_M,), jnp.float32),  # alpha
        plgpu.SMEM((BLOCK_M,), jnp.float32),  # row sums, handed to consumer 1 at the end
        plgpu.Barrier(),  # q8 and the factors prepared
        filled_scratch(kv.page_size, n_stages),  # stage filled
        plgpu.Barrier(num_arrivals=2, num_barriers=n_stages),  # stage read by q k^T and V
        plgpu.Barrier(),  # V converted (its columns 0-255, or V^T transposed)
        plgpu.Barrier(),  # consumer 0's P V done with V
        plgpu.Barrier(),  # P and alpha written
        plgpu.Barrier(),  # consumer 1's P V done with P and alpha (default products)
        plgpu.Barrier(num_arrivals=2),  # both consumers done; row sums written
    ]
    meta = kv.meta_operands()
    kernel = functools.partial(
        _kernel, form=kv.form, entries_per_seq=kv.entries_per_seq, page_size=kv.page_size,
        num_splits=num_splits, s_q=s_q, num_heads=h, sm_scale=float(sm_scale), final=final,
        products=products, cfg=config, interpret=interpret)
    n_io = len(meta) + 7  # meta, table, q, k_scale, v_scale, pool; o, lse
    call = plgpu.kernel(
        lambda *refs: kernel(*refs[:n_io], refs[n_io:]),
        out_type=(jax.ShapeDtypeStruct((b, num_splits, rows, v_head_dim), o_dtype),
                  jax.ShapeDtypeStruct((b, num_splits, rows), jnp.float32)),
        scratch_types=scratch,
        grid=(b * num_splits * (rows // BLOCK_M),),
        grid_names=("blk",),
        num_threads=3,
        thread_name="wg",
        compiler_params=compiler_params(config.profile_space, config.profile_dir),
        interpret=mgpu_params(interpret),
        kernel_name=f"mla_decode_mgpu_fp8w{'a' if fp8_pv else ''}_ps{kv.page_size}",
    )
    return call(*meta, kv.table, q.reshape(b, rows, d), k_scale.reshape(1).astype(jnp.float32),
                v_scale.reshape(1).astype(jnp.float32), kv_pool)
