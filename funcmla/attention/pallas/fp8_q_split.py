"""q for fp8 `wgmma`: each query row split exactly enough into two e4m3 parts, the rule the fp8
Mosaic GPU decode kernels (`decode_mgpu_fp8`, `decode_mgpu_fp8_wide`) share.

Per row a power of two `up` (`pow2_row_scales` at `Q_TOP`, exact) takes the row's largest |q|
into [2^7, 2^8), below e4m3's 448; hi = e4m3(q up), lo = e4m3(q up - hi) (the residual is exact
in fp32). For a bf16 q, hi + lo is q up exactly for every element within 2^9 of its row's
largest (8 significant bits: hi holds 4, lo the next 4 and stays a normal e4m3 number), and
within 2^-10 of q up's unit below that, where an element weighs < 2^-9 of the row's largest in
the score; so q k^T on fp8 operands keeps the bf16 kernels' error. A row holding Inf or NaN gets
a NaN score factor (e4m3's saturation would make it finite). docs/decode_kernel.md, "fp8 KV".

`prepare_q` states the rule in XLA (the tests' and the interpreter's form); `prepare_q_smem`
computes the same values in a kernel's warpgroup, straight from q in global memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas.decode_common import pow2_row_scales
from funcmla.attention.pallas.mgpu_ops import swizzled

__all__ = ["Q_TOP", "Q8_SWIZZLE", "fp8_operands_unsupported", "prepare_q", "prepare_q_smem"]

_LOG2E = 1.4426950408889634
# q * up's largest |value| in a row lands in [2^7, 2^8): below e4m3's 448, and the low part
# (at most half an e4m3 step of the high one, 2^3 below it) stays a normal number down to
# elements 2^9 below the row's largest.
Q_TOP = 7
Q8_SWIZZLE = 64  # bytes: 64 fp8 columns per swizzle tile of q8 (and of the fp8 KV stages)
_CHUNK = 64      # q columns per load


def fp8_operands_unsupported(head_dim: int, v_head_dim: int, q_dtype, kv_dtype) -> str | None:
    """None when the fp8 Mosaic GPU kernels take these operands (a float8_e4m3fn pool of 576-
    column latent rows, V its first 512, q bf16 or f16: the dtypes `prepare_q_smem` splits),
    else why not."""
    if jnp.dtype(kv_dtype) != jnp.float8_e4m3fn:
        return f"kv_pool dtype {jnp.dtype(kv_dtype).name} is not float8_e4m3fn"
    if jnp.dtype(q_dtype) not in (jnp.bfloat16, jnp.float16):
        return f"q dtype {jnp.dtype(q_dtype).name} is not bfloat16 or float16"
    if v_head_dim != 512 or head_dim != 576:
        return f"head dims ({head_dim}, {v_head_dim}) are not (576, 512)"
    return None


def prepare_q(q: jax.Array, *, sm_scale: float, k_scale: jax.Array, v_scale: jax.Array):
    """(q8 [B, 2 rows, 576] e4m3, scales [B, 2, rows] fp32) from q [B, rows, 576]: q8 rows
    0..rows-1 the high parts, rows..2 rows-1 the low ones; scales[:, 0] = down * sm_scale *
    k_scale * log2(e) (the score factor of each row, NaN for a row holding Inf or NaN),
    scales[:, 1] = v_scale."""
    qf = q.astype(jnp.float32)
    # |q| as float32 bits: an integer max orders them with NaN above Inf, as `prepare_q_smem`
    # does (a float max need not propagate NaN: XLA's CPU reduction drops it)
    bits = jnp.max(lax.bitcast_convert_type(qf, jnp.int32) & 0x7FFFFFFF, axis=-1)
    amax = lax.bitcast_convert_type(bits, jnp.float32)
    up, down = pow2_row_scales(amax, Q_TOP)
    down = jnp.where(bits < 0x7F800000, down, jnp.nan)
    x = qf * up[..., None]
    hi = x.astype(jnp.float8_e4m3fn)
    lo = (x - hi.astype(jnp.float32)).astype(jnp.float8_e4m3fn)
    col = down * (float(sm_scale) * _LOG2E) * k_scale.reshape(())
    vs = jnp.broadcast_to(v_scale.reshape(()), col.shape).astype(jnp.float32)
    return jnp.concatenate([hi, lo], axis=1), jnp.stack([col, vs], axis=1)


def prepare_q_smem(q_ref, k_scale_ref, v_scale_ref, q8_smem, scale_smem, b, row_lo, *,
                   sm_scale: float, interpret: bool, parts: int = 2):
    """One warpgroup: rows row_lo .. row_lo + n - 1 of sequence `b` (q_ref [B, R, 576], bf16
    or f16, in global memory; n = q8_smem.shape[0] // parts, a multiple of 16) split into
    q8_smem [parts n, 576] ((8, 64)-tiled, 64-byte swizzle: rows 0..n-1 the high parts, n..2n-1
    the low ones; parts=1 keeps the high parts alone, q rounded once to e4m3) and their factors
    into scale_smem [2, n], the values `prepare_q` gives. Thread t takes rows t // 8 + 16 p and
    8 columns (16 bytes of bf16) at 8 (t % 8) of each 64-column chunk; a row's largest |q|
    meets over its 8 threads by shuffles."""
    if parts not in (1, 2):
        raise ValueError(f"parts must be 1 or 2, got {parts!r}")
    n = q8_smem.shape[0] // parts
    if interpret:
        q8, scales = prepare_q(q_ref[pl.ds(b, 1), pl.ds(row_lo, n)], sm_scale=sm_scale,
                               k_scale=k_scale_ref[...], v_scale=v_scale_ref[...])
        q8_smem[...] = q8[0, :parts * n]
        scale_smem[...] = scales[0]
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(),
                                  plgpu.RefType(swizzled(Q8_SWIZZLE, 1)), plgpu.RefType(),
                                  splat, splat))
    def prep(ctx, q, k_scale, v_scale, q8, scales, b, row_lo):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, memref, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32, i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
        f16, f32 = ir.F16Type.get(), ir.F32Type.get()
        q_ty = ir.MemRefType(q.type)
        _, q_rows, d = q_ty.shape
        v8 = ir.VectorType.get((8,), q_ty.element_type)
        n_chunks = d // _CHUNK

        def k(n, ty=i32):
            return mu.c(n, ty)

        def splat(x, ty):
            return vector.broadcast(ir.VectorType.get((8,), ty), x)

        def elem(x, j):
            return vector.extract(x, dynamic_position=[], static_position=[j])

        def to_e4m3(x4):  # 4 fp32 -> 4 e4m3 bytes in one word, x4[0] in the low byte
            return llvm.inline_asm(
                i32, x4, "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                "=r,f,f,f,f")

        def from_e4m3(word, half: int):  # bytes 2 half, 2 half + 1 of a word -> 2 fp32
            pair = mu.bitcast(llvm.inline_asm(
                i32, [word], "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $1; "
                f"cvt.rn.f16x2.e4m3x2 $0, {('lo', 'hi')[half]}; }}", "=r,r"),
                ir.VectorType.get((2,), f16))
            wide = arith.extf(ir.VectorType.get((2,), f32), pair)
            return [elem(wide, 0), elem(wide, 1)]

        def scalar(ref):
            p = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(ref))
            return llvm.load(f32, p)

        b, row_lo = b.registers.item(), row_lo.registers.item()
        t = arith.remui(mu.thread_idx(), k(128))
        vec = arith.andi(t, k(7))
        gptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(q))
        k_scale, vs = scalar(k_scale), scalar(v_scale)
        lo_rows = (n // 8) * n_chunks * 512  # row n + R sits n // 8 tile rows further
        v2 = ir.VectorType.get((2,), i32)
        for p in range(n // 16):
            r = arith.addi(arith.shrui(t, k(3)), k(16 * p))
            row = arith.addi(arith.addi(arith.muli(b, k(q_rows)), row_lo), r)
            row_bytes = arith.muli(arith.extui(i64, row), k(2 * d, i64))
            src = mu.getelementptr(gptr, [arith.addi(row_bytes, arith.extui(i64, arith.shli(
                vec, k(4))))], i8)
            xs = [arith.extf(ir.VectorType.get((8,), f32), llvm.load(
                v8, mu.getelementptr(src, [2 * _CHUNK * j], i8), alignment=16))
                for j in range(n_chunks)]
            # |q| as float32 bits: an integer max orders them (NaN above Inf, as jnp.max gives)
            amax = None
            for x in xs:
                bits = arith.andi(vector.bitcast(ir.VectorType.get((8,), i32), x),
                                  splat(k(0x7FFFFFFF), i32))
                amax = bits if amax is None else arith.maxui(amax, bits)
            amax = vector.reduction(i32, vector.CombiningKind.MAXUI, amax)
            amax = mu.warp_tree_reduce(amax, arith.maxui, 8)
            # pow2_row_scales(amax, Q_TOP) from the exponent bits; a row holding Inf or NaN
            # gets a NaN factor
            e_raw = arith.andi(arith.shrui(amax, k(23)), k(0xFF))
            e = arith.minsi(arith.maxsi(e_raw, k(Q_TOP + 1)), k(254))
            up = arith.bitcast(f32, arith.shli(arith.subi(k(254 + Q_TOP), e), k(23)))
            down = arith.bitcast(f32, arith.shli(arith.subi(e, k(Q_TOP)), k(23)))
            down = arith.select(arith.cmpi(arith.CmpIPredicate.eq, e_raw, k(0xFF)),
                                mu.c(float("nan"), f32), down)
            # Element (R, c) of q8 lives at byte ((R // 8) * 9 + c // 64) * 512 + (R % 8) * 64
            # + (((c % 64) // 16) ^ ((R % 8) // 2)) * 16 + c % 16 (64-byte swizzle); this
            # thread's 8 columns of a chunk are the half (vec % 2) of 16-byte vector vec // 2.
            r8 = arith.andi(r, k(7))
            dst_off = arith.addi(
                arith.addi(arith.muli(arith.shrui(r, k(3)), k(n_chunks * 512)),
                           arith.shli(r8, k(6))),
                arith.addi(arith.shli(arith.xori(arith.shrui(vec, k(1)), arith.shrui(r8, k(1))),
                                      k(4)), arith.shli(arith.andi(vec, k(1)), k(3))))
            dst = mu.getelementptr(mu.memref_ptr(q8), [dst_off], i8)
            for j, x in enumerate(xs):
                x = arith.mulf(x, splat(up, f32))  # exact: a power of two
                xv = [elem(x, i) for i in range(8)]
                hi = [to_e4m3(xv[4 * h:4 * h + 4]) for h in range(2)]
                parts_out = [(hi, j * 512)]
                if parts == 2:
                    back = [v for w in hi for half in range(2) for v in from_e4m3(w, half)]
                    res = [arith.subf(a, c) for a, c in zip(xv, back)]  # exact in fp32
                    lo = [to_e4m3(res[4 * h:4 * h + 4]) for h in range(2)]
                    parts_out.append((lo, lo_rows + j * 512))
                for words, off in parts_out:
                    llvm.store(vector.from_elements(v2, words),
                               mu.getelementptr(dst, [off], i8), alignment=8)
            ri = arith.index_castui(ir.IndexType.get(), r)
            # the row's 8 threads store the same values
            factor = arith.mulf(arith.mulf(down, mu.c(float(sm_scale) * _LOG2E, f32)), k_scale)
            memref.store(factor, scales, [mu.c(0, ir.IndexType.get()), ri])
            memref.store(vs, scales, [mu.c(1, ir.IndexType.get()), ri])

    prep(q_ref, k_scale_ref, v_scale_ref, q8_smem, scale_smem, b, row_lo)
