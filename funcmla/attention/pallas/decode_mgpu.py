"""Absorbed MLA decode on Hopper's matrix units: a warp-specialized Pallas Mosaic GPU kernel.

For the compute-bound shapes (s_q * H a multiple of 64 folded query rows). One CUDA block
handles 64 folded rows of one sequence against one split of its KV, with three warpgroups:

* warpgroup 2 (producer, 40 registers a thread): TMA-copies q once, then each 64-token KV tile
  into one of two shared-memory stages (page >= 64: one TMA copy a tile; page 8 to 32: one a
  page; page 1 to 4: a `cp.async` row gather; `mgpu_kv_copy`), and refills a stage once both
  consumers released it;
* warpgroup 0 (consumer): S = q k^T (64 x 64, K = 576, `wgmma`), the masked online softmax in
  base 2, then O[:, :256] += P V[:, :256] with P (bf16) from its registers; while that `wgmma`
  runs it hands P (over the tile's rope columns, dead once q k^T is done) and the row rescale
  alpha to consumer 1 through shared memory and adds up P's row sums;
* warpgroup 1 (consumer): O[:, 256:] += P V[:, 256:] with P from shared memory.

Each consumer owns half of the 64 x 512 fp32 accumulator (128 registers a thread). Shared
memory: q 72 KB + 2 KV stages 144 KB; the output staging reuses the stages once both consumers
have met on a barrier after their last tile. Each warpgroup's phases are named
(`jax.named_scope`) for Mosaic GPU's in-kernel profiler (`MgpuDecodeConfig.profile_space`).

Masking: tiles wholly below every row's causal limit run unmasked; in the others, scores past
the limit are selected to -inf and V rows past kv_len are zeroed in shared memory before P V,
so no unused pool row (NaN, Inf) reaches the result. Zero-length KV gives out 0 and lse +inf.
The TMA copies name pool rows by int32 coordinates and the gather forms 64-bit byte offsets,
so pools past 2**31 bytes need no special care.

Grid: one flat axis of blocks (sequence, split, row block), row blocks fastest, so a
sequence's row blocks run side by side and the second read of each KV tile hits L2; flat, so
more than 65535 sequences (an extend's pseudo-sequences) launch. Splits,
masking and partials are those of `decode_triton`, so the two kernels are interchangeable per
call and share the merge. Arguments are checked by `funcmla.attention.pallas.api`, which calls
`decode_call`. Runs on sm_90a, and on CPU in Mosaic GPU interpret mode.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas.mgpu_kv_copy import (
    BLOCK_KV,
    filled_scratch,
    init_filled,
    page_size_unsupported,
    produce_tiles,
    wait_filled,
)
from funcmla.attention.pallas.mgpu_ops import (
    check_profile,
    check_warpgroup_budgets,
    compiler_params,
    in_layout,
    iota,
    load,
    mgpu_params,
    mma_acc,
    mma_acc_and,
    swizzled,
)
from funcmla.attention.pallas.decode_common import (
    DecodeKernelConfig,
    KVRows,
    block_coords,
    causal_limit,
    seq_start_and_len,
    split_tile_range,
)

__all__ = ["MgpuDecodeConfig", "mgpu_decode_supported", "mgpu_split_config", "decode_call",
           "BLOCK_M", "BLOCK_KV"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

BLOCK_M = 64      # folded query rows per block (wgmma M)
_HALF = 256       # output columns per consumer warpgroup (wgmma N <= 256)
_SWIZZLE = 128    # bytes; 64 bf16 columns per swizzle tile
_STAGES = 2
MAX_PROFILE_SPACE = 160  # x 3 warpgroups x 16 bytes = 7.5 KB of the shared memory left free


@dataclasses.dataclass(frozen=True)
class MgpuDecodeConfig:
    """Static knobs of the Mosaic GPU decode kernels (hashable: a jit static argument).

    registers: `setmaxnreg` budgets (producer, consumer 0, consumer 1), each a multiple of 8
        in [24, 256], summing to at most 504 (`mgpu_ops.REGISTER_BUDGET`); None (default):
        the kernel's own (`decode_mgpu` and `decode_mgpu_fp8`: (40, 232, 232);
        `decode_mgpu_fp8_wide`: (64, 240, 200), (40, 232, 232) for fp8 products). A consumer
        holds a 64 x 256 fp32 accumulator half (128 registers) plus its products' operands.
    profile_space: timed regions per warpgroup for Mosaic GPU's in-kernel profiler (the named
        phases qk, wait_kv, softmax, hand_off, pv, wait_p, wait_free, copy, finish), written
        as a Perfetto trace per call to `profile_dir`; 0 (default): off. 16 bytes of shared
        memory per region and warpgroup, so at most MAX_PROFILE_SPACE.
    """

    registers: tuple[int, int, int] | None = None
    profile_space: int = 0
    profile_dir: str = ""

    def __post_init__(self):
        if self.registers is not None:
            check_warpgroup_budgets("MgpuDecodeConfig", "registers", self.registers)
        check_profile("MgpuDecodeConfig", self.profile_space, self.profile_dir,
                      MAX_PROFILE_SPACE)

    def kernel_registers(self, default: tuple[int, int, int]) -> tuple[int, int, int]:
        """The budgets a kernel runs with: `registers`, else the kernel's `default`."""
        return default if self.registers is None else self.registers


# `setmaxnreg` budgets (producer, consumer 0, consumer 1): the producer only issues copies;
# each consumer holds an accumulator half, scores and P (40 + 2 x 232 = 504).
_REGISTERS = (40, 232, 232)


def mgpu_decode_supported(rows: int, page_size: int, head_dim: int, v_head_dim: int,
                          dtype) -> str | None:
    """None when the Mosaic GPU kernel handles this shape, else the reason it does not."""
    if rows % BLOCK_M:
        return f"folded rows s_q*H = {rows} is not a multiple of {BLOCK_M}"
    if v_head_dim != 2 * _HALF:
        return f"v_head_dim {v_head_dim} != {2 * _HALF}"
    if head_dim % 64 or head_dim <= v_head_dim:
        return f"head dim {head_dim} must be v_head_dim + a multiple of 64"
    if jnp.dtype(dtype) != jnp.bfloat16:
        return f"dtype {jnp.dtype(dtype)} is not bfloat16"
    return page_size_unsupported(page_size)


def mgpu_split_config(config: DecodeKernelConfig) -> DecodeKernelConfig:
    """`config` for the split rule (`choose_num_splits`) when this kernel runs: at least two
    KV tiles per split, since a block's fixed cost (q in, partial out, three warpgroups to
    start) outweighs one tile (docs/decode_kernel.md, "Knobs")."""
    return dataclasses.replace(config, min_blocks_per_split=max(2, config.min_blocks_per_split))


def _qk(q_smem, k_smem, interpret: bool):
    """q k^T in fp32 [BLOCK_M, BLOCK_KV] (`wgmma`, K = the full head dim). Mosaic GPU's
    interpreter cannot run a wgmma on a transposed operand (jax 0.10.2), so there it is a
    plain fp32 dot of the same shared-memory tiles."""
    if interpret:
        return lax.dot_general(q_smem[...], k_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((BLOCK_M, BLOCK_KV), jnp.float32))


def _kernel(*refs, form: str, entries_per_seq: int | None, page_size: int, num_splits: int,
            s_q: int, num_heads: int, d_v: int, scale_log2: float, final: bool,
            cfg: MgpuDecodeConfig, interpret: bool):
    n_meta = len(refs) - 6
    meta, (table_ref, q_ref, kv_ref, o_ref, lse_ref, scratch) = refs[:n_meta], refs[n_meta:]
    (q_smem, kv_or_out, alpha_smem, l_smem, q_bar, k_full, k_empty, p_full, l_ready) = scratch
    (kv_smem,), (o_stage, lse_stage) = kv_or_out

    b, split, rb = block_coords(lax.axis_index("blk"), num_splits, s_q * num_heads // BLOCK_M)
    wg = lax.axis_index("wg")

    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)

    first, last = split_tile_range(kv_len, split, num_splits, BLOCK_KV)
    count = jnp.maximum(last - first, 0)
    row_lo = rb * BLOCK_M

    producer_registers, *consumer_registers = cfg.kernel_registers(_REGISTERS)
    init_filled(k_full, interpret=interpret)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(producer_registers, action="decrease")
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row_lo, BLOCK_M)], q_smem, q_bar)

        # a stage is released by both consumers
        produce_tiles(kv_ref, table_ref, kv_smem, k_full, k_empty, first=first, count=count,
                      start_entry=start_entry, kv_len=kv_len, num_stages=_STAGES,
                      page_size=page_size, swizzle=_SWIZZLE, interpret=interpret)

    def _store(out, which: int, lse):
        """Output half `which` ([64, 256], this block's rows and split) and, with `lse`, the
        block's lse, through shared memory to global memory."""
        o_stage.at[which][...] = out.astype(o_stage.dtype)  # swizzled: no bank conflicts
        if lse is not None:
            lse_stage[...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_stage.at[which], o_ref.at[b, split, pl.ds(row_lo, BLOCK_M),
                                        pl.ds(which * _HALF, _HALF)])
        if lse is not None:
            plgpu.copy_smem_to_gmem(lse_stage, lse_ref.at[b, split, pl.ds(row_lo, BLOCK_M)])
        plgpu.wait_smem_to_gmem(0)

    def _finish(acc, m_i, l_i, half: int):
        """Consumer `half` once its last P V is added: both consumers meet first (the output
        staging reuses the KV stages, and consumer 0 hands over the row sums); then its output
        half is normalized and written (consumer 0 also writes the lse)."""
        with jax.named_scope("finish"):
            if half == 0:  # consumer 1 keeps no row sums
                l_smem[...] = l_i
            plgpu.barrier_arrive(l_ready)
            plgpu.barrier_wait(l_ready)
            l_i = load(l_smem, plgpu.Layout.WGMMA.reduce(1), interpret)
            has = l_i > 0.0
            l_safe = jnp.where(has, l_i, 1.0)
            # one reciprocal a row, a multiply an element (not IEEE division on each)
            out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
            lse = None
            if half == 0:
                empty = jnp.inf if final else -jnp.inf
                lse = jnp.where(has, (m_i * scale_log2 + jnp.log2(l_safe)) * _LN2, empty)
            _store(out, half, lse)

    @pl.when(wg < 2)
    def _consumers():
        if consumer_registers[0] == consumer_registers[1]:
            plgpu.set_max_registers(consumer_registers[0], action="increase")
        else:
            for c, n in enumerate(consumer_registers):
                pl.when(wg == c)(lambda n=n: plgpu.set_max_registers(n, action="increase"))
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        rows_iota = iota((BLOCK_M, BLOCK_KV), 0, interpret)
        cols_iota = iota((BLOCK_M, BLOCK_KV), 1, interpret)
        # Per folded row (token-major: row // H is the token).
        limit = causal_limit(kv_len, s_q, (row_lo + rows_iota) // num_heads)
        acc0 = in_layout(jnp.zeros((BLOCK_M, _HALF), jnp.float32), plgpu.Layout.WGMMA, interpret)
        m0 = in_layout(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout, interpret)
        l0 = in_layout(jnp.zeros((BLOCK_M,), jnp.float32), row_layout, interpret)
        # Tiles wholly below every row's causal limit (kv_len - s_q + 1 + the row's token) need
        # no mask and have no tail: they run first, unmasked.
        n_plain = jnp.clip((kv_len - s_q + 1) // BLOCK_KV - first, 0, count)

        def p_ref(slot):  # P of the stage's tile, over its rope columns
            return kv_smem.at[slot, :, pl.ds(d_v, BLOCK_KV)]

        def scores(i, slot, tile, masked: bool):
            """q k^T of the tile in `slot` (the block's i-th) [64, 64] fp32, unscaled; -inf
            past each row's causal limit when `masked`."""
            with jax.named_scope("qk"):
                with jax.named_scope("wait_kv"):
                    wait_filled(k_full, i, num_stages=_STAGES, async_proxy=True,
                                interpret=interpret)
                s = _qk(q_smem, kv_smem.at[slot], interpret)
            if masked:
                s = jnp.where(tile * BLOCK_KV + cols_iota < limit, s, -jnp.inf)
            return s

        def softmax(slot, tile, s, m_prev, masked: bool):
            """Online-softmax step on scores s against the running max m_prev: (m_new, alpha,
            P fp32); in a partial last tile, also zeroes V rows past kv_len (a pool row there
            may hold NaN) and makes that visible to `wgmma`."""
            # The max is over raw scores and the scale (> 0) multiplies s - max: a multiply-add
            # s * scale - max would leave exp2 a rounding residual of up to half an ulp of the
            # scaled max (+inf past ~2^31; tests/test_pallas_large_scores.py).
            m_new = jnp.maximum(m_prev, s.max(axis=1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2((m_prev - m_safe) * scale_log2)
            p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [0])) * scale_log2)
            if masked:
                valid = kv_len - tile * BLOCK_KV

                @pl.when(valid < BLOCK_KV)
                def _():
                    for c in range(d_v // 64):
                        ref = kv_smem.at[slot, :, pl.ds(c * 64, 64)]
                        chunk = load(ref, plgpu.Layout.WGMMA, interpret)
                        ref[...] = jnp.where(rows_iota < valid, chunk, jnp.zeros_like(chunk))
                    plgpu.commit_smem()

            return m_new, alpha, p

        def hand_off(slot, p16, alpha):
            """P (bf16, over the tile's rope columns, dead once q k^T is done) and alpha next
            to it, to consumer 1: both live as long as the stage, so the stage's own barriers
            order them."""
            with jax.named_scope("hand_off"):
                p_ref(slot)[...] = p16
                alpha_smem.at[slot][...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_full.at[slot])

        def step0(i, carry, masked: bool):
            """Consumer 0, one tile: q k^T, the softmax, then its P V with P straight from
            registers; P's hand-off to consumer 1 and the row sums of P (a reduction across
            threads) run while that P V does."""
            acc, m_i, l_i = carry
            slot = lax.rem(i, _STAGES)
            tile = first + i
            s = scores(i, slot, tile, masked)
            with jax.named_scope("softmax"):
                m_i, alpha, p = softmax(slot, tile, s, m_i, masked)
                p16 = p.astype(q_smem.dtype)
            with jax.named_scope("pv"):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def under_pv(l_i):
                    hand_off(slot, p16, alpha)
                    return l_i * alpha + p.sum(axis=1)

                acc, l_i = mma_acc_and(acc, p16, kv_smem.at[slot, :, pl.ds(0, _HALF)], l_i,
                                        under_pv, interpret)
                plgpu.barrier_arrive(k_empty.at[slot])
            return acc, m_i, l_i

        def step1(i, acc):
            """Consumer 1, one tile: rescale by consumer 0's alpha, add P V[:, 256:]."""
            slot = lax.rem(i, _STAGES)
            with jax.named_scope("wait_p"):
                plgpu.barrier_wait(p_full.at[slot])
                alpha = load(alpha_smem.at[slot], row_layout, interpret)
            with jax.named_scope("pv"):
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                acc = mma_acc(acc, p_ref(slot), kv_smem.at[slot, :, pl.ds(_HALF, _HALF)],
                               interpret)
                plgpu.barrier_arrive(k_empty.at[slot])
            return acc

        @pl.when(wg == 0)
        def _():
            plgpu.barrier_wait(q_bar)
            plain = functools.partial(step0, masked=False)
            masked = functools.partial(step0, masked=True)
            carry = lax.fori_loop(0, n_plain, plain, (acc0, m0, l0))
            _finish(*lax.fori_loop(n_plain, count, masked, carry), 0)

        @pl.when(wg == 1)
        def _():
            # Consumer 1 keeps neither the running max nor the row sums (it masks nothing).
            _finish(lax.fori_loop(0, count, step1, acc0), None, None, 1)


def decode_call(q: jax.Array, kv_pool: jax.Array, kv: KVRows, *, sm_scale: float, s_q: int,
                num_splits: int, v_head_dim: int = 512, partial_dtype="bfloat16",
                config: MgpuDecodeConfig = MgpuDecodeConfig(),
                interpret=False) -> tuple[jax.Array, jax.Array]:
    """The Mosaic GPU pallas call on checked arguments (`api.check_decode_args` and
    `mgpu_decode_supported`); same results as `decode_triton.decode_call` with rows_pad =
    rows. `interpret`: False, True, or Pallas's GPU interpreter parameters."""
    t, h, d = q.shape
    rows = s_q * h
    b = t // s_q
    final = num_splits == 1
    o_dtype = q.dtype if final else jnp.dtype(partial_dtype)

    transforms = swizzled(_SWIZZLE, 2)
    kv_stages = plgpu.SMEM((_STAGES, BLOCK_KV, d), q.dtype, transforms=transforms)
    o_stage = plgpu.SMEM((2, BLOCK_M, _HALF), o_dtype,
                         transforms=swizzled(_SWIZZLE, jnp.dtype(o_dtype).itemsize))
    lse_stage = plgpu.SMEM((BLOCK_M,), jnp.float32)
    scratch = [
        plgpu.SMEM((BLOCK_M, d), q.dtype, transforms=transforms),
        # The output staging reuses the KV stages' memory (idle once both consumers meet at
        # the end); the interpreter has no RefUnion (and no shared-memory limit), so there
        # they are apart.
        (((kv_stages,), (o_stage, lse_stage)) if interpret
         else plgpu.RefUnion((kv_stages,), (o_stage, lse_stage))),
        plgpu.SMEM((_STAGES, BLOCK_M), jnp.float32),  # alpha of each stage's tile
        plgpu.SMEM((BLOCK_M,), jnp.float32),  # row sums, handed to consumer 1 at the end
        plgpu.Barrier(),  # q landed
        filled_scratch(kv.page_size, _STAGES),  # stage filled
        plgpu.Barrier(num_arrivals=2, num_barriers=_STAGES),  # stage released by both
        plgpu.Barrier(num_barriers=_STAGES),  # P and alpha of the stage's tile written
        plgpu.Barrier(num_arrivals=2),  # both consumers done; row sums written
    ]
    meta = kv.meta_operands()
    kernel = functools.partial(
        _kernel, form=kv.form, entries_per_seq=kv.entries_per_seq, page_size=kv.page_size,
        num_splits=num_splits, s_q=s_q, num_heads=h, d_v=v_head_dim,
        scale_log2=float(sm_scale) * _LOG2E, final=final, cfg=config,
        interpret=interpret)

    call = plgpu.kernel(
        lambda *refs: kernel(*refs[:len(meta) + 5], refs[len(meta) + 5:]),
        out_type=(jax.ShapeDtypeStruct((b, num_splits, rows, v_head_dim), o_dtype),
                  jax.ShapeDtypeStruct((b, num_splits, rows), jnp.float32)),
        scratch_types=scratch,
        # The row blocks of one sequence and split are launched back to back (the flat
        # block index has rb fastest, `block_coords`), so they stream the same KV tiles at about
        # the same time and the second read of each tile hits L2.
        grid=(b * num_splits * (rows // BLOCK_M),),
        grid_names=("blk",),
        num_threads=3,
        thread_name="wg",
        compiler_params=compiler_params(config.profile_space, config.profile_dir),
        interpret=mgpu_params(interpret),
        kernel_name=f"mla_decode_mgpu_ps{kv.page_size}",
    )
    qr = q.reshape(b, rows, d)
    return call(*meta, kv.table, qr, kv_pool)
