"""P V on fp8 `wgmma`s with V^T as the register operand: the fp8 products of the 16-row fp8
Mosaic GPU decode kernel (`decode_mgpu_fp8`, `DecodeKernelConfig.fp8_products="fp8"`).

O^T [512, N] += V^T [512, 64 tokens] P^T [64, N]: V^T is built in registers straight from the
kernel's fp8 landing stage in the 8-bit wgmma A fragment, its bytes transposed by `prmt`
(`fp8_transpose`) and never converted; P^T (p * 2^8 rounded to e4m3) is B, stored K-major in
shared memory. The rows of O^T are the kernel's permuted latent columns
(`decode_mgpu_fp8.latent_column`): each thread's 16 rows are 16 contiguous bytes of a token's
row, one 16-byte load a token. Each piece also runs in Mosaic GPU's interpreter as plain ops.
docs/decode_kernel.md, "fp8 products".
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas import fp8_transpose
from funcmla.attention.pallas.fp8_q_split import Q8_SWIZZLE
from funcmla.attention.pallas.mgpu_kv_copy import BLOCK_KV
from funcmla.attention.pallas.mgpu_ops import swizzled

__all__ = ["store_pt8", "v_operand8", "pv8"]

_D, _DV = 576, 512  # latent row (K) and its first 512 columns (V)
_FP8_SWIZZLE = Q8_SWIZZLE  # bytes: the stages' and P^T's 64-byte swizzle


def store_pt8(p_ref, x, interpret: bool):
    """p_ref [N, 64] e4m3 ((8, 64)-tiled, 64-byte swizzle; P^T K-major, the B of an fp8 P V) =
    e4m3(x).T for x [64 tokens, N] fp32 in the WGMMA layout: each thread's (token, row) values
    as single bytes (a warp's 32 stores hit 8 distinct words)."""
    if interpret:
        p_ref[...] = x.astype(jnp.float8_e4m3fn).T
        return

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(swizzled(_FP8_SWIZZLE, 1))))
    def store(ctx, x, pt):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i16, i32 = (ir.IntegerType.get_signless(n) for n in (8, 16, 32))
        regs = x.registers
        if regs.shape != (1, x.shape[1] // 8, 1, 1, 2, 1, 1, 1, 1):
            raise NotImplementedError(f"WGMMA layout registers {regs.shape}")

        def k(n):
            return mu.c(n, i32)

        t = arith.remui(mu.thread_idx(), k(128))
        w, lane = arith.shrui(t, k(5)), arith.andi(t, k(31))
        g, q4 = arith.shrui(lane, k(2)), arith.andi(lane, k(3))
        base = mu.memref_ptr(pt)
        for kc in range(regs.shape[1]):  # rows 8 kc + 2 q4 + {0, 1}
            r0 = arith.addi(k(8 * kc), arith.shli(q4, k(1)))
            for h in range(2):  # tokens 16 w + 8 h + g
                tok = arith.addi(arith.addi(arith.shli(w, k(4)), k(8 * h)), g)
                pair = regs[0, kc, 0, 0, h, 0, 0, 0, 0]
                v = [vector.extract(pair, dynamic_position=[], static_position=[e])
                     for e in range(2)]
                # bytes: the low one row r0, the high one r0 + 1
                word = llvm.inline_asm(i16, [v[1], v[0]],
                                       "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f")
                for e in range(2):
                    r = arith.addi(r0, k(e))
                    r8 = arith.andi(r, k(7))
                    off = arith.addi(arith.addi(
                        arith.shli(arith.shrui(r, k(3)), k(9)), arith.shli(r8, k(6))),
                        arith.addi(arith.shli(arith.xori(arith.shrui(tok, k(4)),
                                                         arith.shrui(r8, k(1))), k(4)),
                                   arith.andi(tok, k(15))))
                    byte = arith.trunci(i8, arith.shrui(word, mu.c(8 * e, i16)))
                    llvm.store(byte, mu.getelementptr(base, [off], i8))

    store(x, p_ref)


def v_operand8(stages, slot, valid, masked: bool, interpret: bool):
    """V^T of stage `slot`'s 64 tokens: [512, 64] e4m3 in the 8-bit WGMMA layout (the register A
    operand of an fp8 P V), its rows in `decode_mgpu_fp8.latent_column` order, no conversion:
    tokens past `valid` are zeroed when `masked`.

    Thread (warp w, lane l) holds rows 64 mb + 16 w + 8 h + l // 4 (latent columns 128 w +
    16 (l // 4) + 2 mb + h: 16 contiguous bytes of a token's row) and tokens 16 t + 4 (l % 4)
    + {0..3}: one 16-byte load a token, and `fp8_transpose.transpose_4x4` of each 4-token,
    4-column block. Lanes with bit 1 set load each token pair odd token first, so the 8 lanes of
    a load phase hit 8 distinct 16-byte bank groups."""
    if interpret:
        v = stages[slot, :, pl.ds(0, _DV)]
        if masked:
            v = jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, 0) < valid, v,
                          jnp.zeros_like(v))
        return v.T  # rows are latent columns in order here
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(swizzled(_FP8_SWIZZLE, 1)), splat, splat),
                       return_type=plgpu.ShapeDtypeStruct((_DV, BLOCK_KV), jnp.float8_e4m3fn,
                                                          layout=plgpu.Layout.WGMMA_8BIT))
    def operand(ctx, stages, slot, valid):
        del ctx
        import numpy as np
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32 = (ir.IntegerType.get_signless(n) for n in (8, 32))
        f8x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        v4 = ir.VectorType.get((4,), i32)
        slot, valid = slot.registers.item(), valid.registers.item()
        regs_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape((_DV, BLOCK_KV))
        if regs_shape != (8, 4, 1, 1, 2, 1, 1, 1, 1):  # (row block, token group, half)
            raise NotImplementedError(f"8-bit WGMMA layout registers {regs_shape}")

        def k(n):
            return mu.c(n, i32)

        def prmt(a, b, s):
            return llvm.inline_asm(i32, [a, b, s], "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")

        t = arith.remui(mu.thread_idx(), k(128))
        w, lane = arith.shrui(t, k(5)), arith.andi(t, k(31))
        g, q4 = arith.shrui(lane, k(2)), arith.andi(lane, k(3))
        flip = arith.andi(arith.shrui(lane, k(1)), k(1))
        flipped = arith.cmpi(arith.CmpIPredicate.ne, flip, k(0))
        sels = [arith.select(flipped, k(fp8_transpose.pair_select(x, x + 1, 1)),
                             k(fp8_transpose.pair_select(x, x + 1, 0))) for x in (0, 2)]
        # the thread's 16 columns: 64-column tile 2 w + g // 4, 16-byte vector g % 4 of it
        col_off = arith.shli(arith.addi(arith.shli(w, k(1)), arith.shrui(g, k(2))), k(9))
        base = mu.getelementptr(mu.memref_ptr(stages), [arith.addi(
            arith.muli(slot, k(BLOCK_KV * _D)), col_off)], i8)
        chunk = arith.andi(g, k(3))
        zero = vector.broadcast(v4, k(0))
        regs = np.empty(regs_shape, dtype=object)
        for tg in range(BLOCK_KV // 16):
            loads = []
            for kk in range(4):  # token 16 tg + 4 q4 + (kk ^ flip)
                tok = arith.addi(k(16 * tg), arith.addi(arith.shli(q4, k(2)),
                                                        arith.xori(k(kk), flip)))
                r8 = arith.andi(tok, k(7))
                off = arith.addi(arith.addi(
                    arith.muli(arith.shrui(tok, k(3)), k((_D // _FP8_SWIZZLE) * 512)),
                    arith.shli(r8, k(6))),
                    arith.shli(arith.xori(chunk, arith.shrui(r8, k(1))), k(4)))
                x = llvm.load(v4, mu.getelementptr(base, [off], i8), alignment=16)
                if masked:
                    x = arith.select(arith.cmpi(arith.CmpIPredicate.slt, tok, valid), x, zero)
                loads.append([vector.extract(x, dynamic_position=[], static_position=[j])
                              for j in range(4)])
            for j in range(4):  # the thread's columns 4 j .. 4 j + 3
                cols = fp8_transpose.transpose_4x4(prmt, [loads[kk][j] for kk in range(4)],
                                                   sels[0], sels[1], k)
                for i, word in enumerate(cols):
                    c = 4 * j + i  # the thread's column 2 mb + h
                    regs[c // 2, tg, 0, 0, c % 2, 0, 0, 0, 0] = mu.bitcast(word, f8x4)
        return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT_8BIT,
                                  _is_signed=None)

    return operand(stages, slot, valid)


def pv8(acc, stages, slot, p_ref, release, valid, masked: bool, interpret: bool):
    """acc [512, N] + V^T P^T over the stage's 64 tokens on fp8 `wgmma`s: V^T e4m3 in registers
    (`v_operand8`), P^T e4m3 in shared memory (B, K-major); `release()` once the stage's last
    bytes are in registers."""
    if interpret:
        a = v_operand8(stages, slot, valid, masked, interpret).astype(jnp.float32)
        release()
        return acc + lax.dot_general(a, p_ref[...].astype(jnp.float32),
                                     (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)

    def body(acc_ref):
        a = v_operand8(stages, slot, valid, masked, interpret)
        release()
        plgpu.wgmma(acc_ref, a, p_ref.transpose((1, 0)))
        plgpu.wgmma_wait(0)

    return pl.run_state(body)(plgpu.ACC.init(acc))
