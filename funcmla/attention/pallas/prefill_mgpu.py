"""Ragged MHA prefill on Hopper's matrix units: a warp-specialized Pallas Mosaic GPU kernel.

q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128] (bf16), requests given by the token CSRs
`qo_indptr` / `kv_indptr`. One CUDA block handles 128 query rows of one request and one head
(a q tile of the static tile schedule, `tile_schedule`), with three warpgroups:

* warpgroup 2 (producer, `producer_registers`): TMA-copies each consumer's 64 q rows once
  and each `block_kv`-token K tile and V tile of the request into a ring of `num_stages`
  shared-memory stages (K and V on separate barriers, so q k^T starts while V lands; consumer
  1's q after the first K tile), and refills a stage once both consumers released it;
* warpgroups 0 and 1 (consumers, `consumer_registers`): 64 query rows each; per tile
  S = q k^T (`wgmma`, K = 192), the online softmax in base 2 (the scale folded into the
  exponent), then O += P V (`wgmma`, P bf16 from registers; P's row sums are added while
  it runs). Both consumers walk the block's tiles in lockstep, so each stage is released by
  two arrivals whatever the causal diagonal does.

Causal (bottom-right): query j of a request with q_len queries and kv_len keys sees keys
< kv_len - q_len + 1 + j. Tiles wholly above the block's diagonal are neither loaded nor
computed; tiles wholly below every row's limit run unmasked; only the diagonal, the KV tail
tile and a first tile with leading keys of no request select scores to -inf.

Requests start anywhere: TMA copies into 8-row-tiled shared memory must start on a multiple of
8 rows (`ROW_ALIGN`), so a request's q and K/V tiles are read from the 8-row group holding its
first row, and the up to 7 rows before it are masked like rows past its end. Rows of a tile
outside the request (the previous or next request, or zero fill past the tensor) never reach
an output: their scores are per row, their outputs are not stored (the store is cut to the
request's rows, `_store_rows`), and V rows outside are zeroed in shared memory (a select)
before P V, so a NaN there is never multiplied by a zero weight. A request with no key gives
out 0 and lse +inf.

Outputs: out [Tq, H, 128] (q's dtype) and lse [Tq, H] (float32, natural log), both stored
row-exactly (out by TMA copies from shared memory, lse by each thread's own stores of its rows,
`_store_lse`), in the layout the caller gets. The grid walks (head, tile slot) items, slots
fastest, so the q tiles of one head run side by side and share that head's K/V through L2;
slots are walked last to first, so a request's longest (causal) tiles start first; a CTA runs
`tiles_per_cta` consecutive items one after the other (`_item`). Runs on sm_90a, and on CPU in
Mosaic GPU interpret mode. Arguments are checked by `funcmla.attention.pallas.prefill`, which
calls `prefill_kernel`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas.mgpu_ops import (
    check_profile,
    check_warpgroup_registers,
    compiler_params,
    in_layout,
    iota,
    load,
    mgpu_params,
    mma_acc_and,
    release_seen,
    store,
    swizzled,
    wait_last_releases,
)

__all__ = ["MgpuPrefillConfig", "prefill_kernel", "num_tile_slots", "tile_schedule",
           "tile_counts", "tile_shifts", "row_leads", "item_kv_tiles", "BLOCK_Q", "ROW_ALIGN",
           "HEAD_DIM", "V_HEAD_DIM", "SMEM_BYTES"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453

ROWS = 64            # query rows per consumer warpgroup (wgmma M)
BLOCK_Q = 2 * ROWS   # query rows per block
HEAD_DIM = 192       # q / k head dim (128 nope + 64 rope)
V_HEAD_DIM = 128     # v head dim
_SWIZZLE = 128       # bytes; 64 bf16 columns per swizzle tile
SMEM_BYTES = 227 * 1024  # an sm_90 block's shared-memory limit
# Tiles are read from multiples of 8 rows: Mosaic GPU copies a tile into 8-row-tiled shared
# memory by TMA over the tensor viewed as 8-row groups, so a copy starting inside a group
# reads the wrong rows (H200: 0.47-0.58 relative error; the interpreter reads exact rows).
ROW_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class MgpuPrefillConfig:
    """Static knobs of the Mosaic GPU prefill kernel (hashable: a jit static argument).

    block_kv: KV tokens per tile (64 or 128: the wgmma N of q k^T and the K of P V).
    num_stages: K/V tiles in flight (the ring's depth); q (48 KB) + num_stages x block_kv x
        (192 + 128) x 2 bytes must fit the SM's 227 KB.
    consumer_registers / producer_registers: `setmaxnreg` per warpgroup; 2 x consumer +
        producer <= 504 (`mgpu_ops.REGISTER_BUDGET`: 3 x the 168 registers a thread ptxas
        gives a 384-thread block).
    pingpong: the two consumers take turns on the matrix units (FlashAttention-3's
        inter-warpgroup schedule): each one's P V waits until the other has issued its next
        q k^T, so one's softmax runs under the other's products. Both meet on a two-arrival
        barrier twice a tile.
    tiles_per_cta: q tiles a CTA runs one after the other (G consecutive tiles of the grid's
        walk, `_item`): the K/V ring runs on across them, and a tile's q and first K/V tile
        load under the previous tile's work, so a block's start (launch, q from HBM) is paid
        once per G tiles; the output staging then sits apart from q (32 KB). 1: one CTA per
        q tile, the output staged over q.
    profile_space / profile_dir: Mosaic GPU's in-kernel profiler (per-warpgroup traces of the
        named phases: wait_q, wait_k, qk, softmax, wait_v, turn, pv, finish, store_wait;
        the producer's copy_q, wait_free, copy), written as a Perfetto trace per call to
        `profile_dir` and summarized by `python -m bench.prefill --profile DIR`; 0 (default):
        off. 16 bytes of shared memory per region and warpgroup.
    Defaults and the sweep that chose them: docs/prefill_kernel.md (`python -m bench.prefill
    --sweep`).
    """

    block_kv: int = 128
    num_stages: int = 2
    consumer_registers: int = 232
    producer_registers: int = 40
    pingpong: bool = True
    tiles_per_cta: int = 1
    profile_space: int = 0
    profile_dir: str = ""

    def __post_init__(self):
        # its limit is the shared-memory budget, checked below with the rest of the block's
        check_profile("MgpuPrefillConfig", self.profile_space, self.profile_dir)
        if not isinstance(self.pingpong, bool):
            raise ValueError(f"MgpuPrefillConfig.pingpong must be a bool, got {self.pingpong!r}")
        if not isinstance(self.tiles_per_cta, int) or isinstance(self.tiles_per_cta, bool) \
                or self.tiles_per_cta < 1:
            raise ValueError(f"MgpuPrefillConfig.tiles_per_cta must be an int >= 1, got "
                             f"{self.tiles_per_cta!r}")
        if self.block_kv not in (64, 128):
            raise ValueError(f"MgpuPrefillConfig.block_kv must be 64 or 128, got "
                             f"{self.block_kv!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"MgpuPrefillConfig.num_stages must be an int >= 2, got "
                             f"{self.num_stages!r}")
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(
                f"MgpuPrefillConfig: block_kv={self.block_kv} x num_stages={self.num_stages} "
                f"(tiles_per_cta={self.tiles_per_cta}, profile_space={self.profile_space}) "
                f"needs {self.smem_bytes()} bytes of "
                f"shared memory, over the {SMEM_BYTES} of an SM")
        check_warpgroup_registers("MgpuPrefillConfig", self.consumer_registers,
                                  self.producer_registers)

    def smem_bytes(self) -> int:
        """Shared memory of one block: q (two 64-row halves, reused for the output where a CTA
        runs one q tile; with several the output is staged apart) and the K/V ring, plus the
        barriers (1 KB, a bound) and the profiler's buffer."""
        q = BLOCK_Q * HEAD_DIM * 2
        out = BLOCK_Q * V_HEAD_DIM * 2 if self.tiles_per_cta > 1 else 0
        ring = self.num_stages * self.block_kv * (HEAD_DIM + V_HEAD_DIM) * 2
        return q + out + ring + 1024 + 3 * 16 * self.profile_space


def row_leads(starts: jax.Array) -> jax.Array:
    """How far each start lies past the 8-row group it falls in (`ROW_ALIGN`): the kernel
    reads a request's tiles from that group's first row and masks the leading rows."""
    return starts % ROW_ALIGN


def tile_counts(qo_indptr: jax.Array) -> jax.Array:
    """q tiles (tile slots) of each request [B]: ceil((lead + q_len) / 128) for the q rows read
    from the request's 8-row group on (`row_leads`), 0 for a request with no queries."""
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    tiles = (row_leads(qo_indptr[:-1]) + q_lens + BLOCK_Q - 1) // BLOCK_Q
    return jnp.where(q_lens > 0, tiles, 0)


def tile_shifts(qo_indptr: jax.Array) -> jax.Array:
    """Rows by which each request's tiles move up [B], so that its last tile ends on the 8-row
    group holding its last row and the partial tile is its first: a causal request's first
    rows see the fewest keys, so there the partial tile's block is the shortest one (at the
    bottom it is the longest, a whole extra KV sweep). 0 where moving up would start before
    row 0 of q, and for a request with no queries; the rows moved in are masked like leads."""
    starts = qo_indptr[:-1]
    q_lens = qo_indptr[1:] - starts
    lead = row_leads(starts)
    span = (lead + q_lens + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN
    shift = tile_counts(qo_indptr) * BLOCK_Q - span
    return jnp.where((q_lens > 0) & (starts - lead - shift >= 0), shift, 0)


def tile_schedule(qo_indptr: jax.Array, num_slots: int) -> tuple[jax.Array, jax.Array]:
    """Static-size q tile schedule: for tile slot s < num_slots, (request, first row of the
    tile counted from the request's 8-row group: a multiple of 8, negative for a first tile
    moved up by `tile_shifts`), or (-1, 0) for an unused slot. Each request gets `tile_counts`
    consecutive slots; `num_tile_slots` covers any B requests over Tq rows. qo_indptr int32
    [B + 1]."""
    tiles = tile_counts(qo_indptr)
    ends = jnp.cumsum(tiles).astype(jnp.int32)
    starts = ends - tiles
    b = tiles.shape[0]
    slot = jnp.arange(num_slots, dtype=jnp.int32)
    req = jnp.searchsorted(ends, slot, side="right").astype(jnp.int32)
    live = req < b
    reqc = jnp.minimum(req, b - 1)
    first = (slot - starts[reqc]) * BLOCK_Q - tile_shifts(qo_indptr)[reqc]
    return jnp.where(live, req, -1), jnp.where(live, first, 0)


def _qk(q_smem, k_smem, block_kv: int, interpret: bool, while_running=None):
    """q k^T in fp32 [64, block_kv] (`wgmma`, K = 192, waited); `while_running()` (if given)
    runs between the issue and the wait. The interpreter runs no wgmma on a transposed
    operand, so there it is a plain fp32 dot of the same tiles."""
    if interpret:
        if while_running is not None:
            while_running()
        return lax.dot_general(q_smem[...], k_smem[...], (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)

    def body(acc_ref):
        plgpu.wgmma(acc_ref, q_smem, k_smem.transpose((1, 0)))
        if while_running is not None:
            while_running()
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC((ROWS, block_kv), jnp.float32))


def _store_rows(o_stage, o_dst_rows, lead, n):
    """Copies rows [lead, n) of o_stage [64, D] to o_dst_rows(start, size) (a global-memory
    slice of `size` rows from row `start` of the stage's), 0 <= lead <= n <= 64, n - lead < 64:
    one copy per set bit of n - lead (32, 16, ..., 1 rows), so no row outside is written."""
    off, count = lead, n - lead
    for size in (32, 16, 8, 4, 2, 1):
        take = (count & size) != 0

        @pl.when(take)
        def _():
            plgpu.copy_smem_to_gmem(o_stage.at[pl.ds(off, size)], o_dst_rows(off, size))

        off = off + jnp.where(take, size, 0)


def _store_lse(lse_ref, lse, row0, h, lead, n, interpret: bool):
    """lse_ref[row0 + r, h] = lse[r] for r in [lead, n): lse [64] f32 (the WGMMA row layout),
    lse_ref [q_rows, H] f32 in global memory. Each thread stores its own rows (a row's four
    replica threads store the same value to the same address), so no row outside [lead, n)
    is written and lse needs no gather after the kernel (docs/prefill_kernel.md, "Output")."""
    if interpret:
        def body(r, carry):
            lse_ref[row0 + r, h] = lse[r]
            return carry

        lax.fori_loop(lead, n, body, 0)
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA.reduce(1), plgpu.RefType(), splat, splat,
                                  splat, splat))
    def store(ctx, x, ref, row0, h, lead, n):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
        f32 = ir.F32Type.get()
        heads = ir.MemRefType(ref.type).shape[1]
        gptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mu.memref_ptr(ref))
        row0, h, lead, n = (v.registers.item() for v in (row0, h, lead, n))
        for idx, reg in zip(x.layout.thread_idxs(x.shape), x.registers.flat):
            r = arith.index_cast(i32, idx[0])
            inside = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, r, lead),
                                arith.cmpi(arith.CmpIPredicate.slt, r, n))
            with mu.when(inside):
                elem = arith.addi(arith.muli(arith.extui(i64, arith.addi(row0, r)),
                                             mu.c(heads, i64)), arith.extui(i64, h))
                dst = mu.getelementptr(gptr, [elem], f32)
                llvm.store(vector.extract(reg, dynamic_position=[], static_position=[0]), dst)

    store(lse, lse_ref, row0, h, lead, n)


@dataclasses.dataclass(frozen=True)
class _Item:
    """One q tile of the grid's walk (a head and a tile slot) as every warpgroup sees it."""

    live: jax.Array      # a tile of a request (an unused slot, or past the items: not)
    h: jax.Array         # head
    q_base: jax.Array    # the request's first q row, rounded down to its 8-row group
    kv_base: jax.Array   # ... and its first key
    q_lead: jax.Array    # rows of q_base's group before the request (masked)
    kv_lead: jax.Array
    q_end: jax.Array     # the request's rows are [q_lead, q_end) counted from q_base
    kv_end: jax.Array    # its keys [kv_lead, kv_end) counted from kv_base
    qb0: jax.Array       # the tile's first row, counted from q_base
    count: jax.Array     # KV tiles the tile reads (0 where not live)


def _item(k, *, cta, qo_indptr_ref, kv_indptr_ref, q_lens_ref, kv_lens_ref, req_ref,
          first_ref, causal: bool, block_kv: int, num_slots: int, num_items: int,
          tiles_per_cta: int) -> _Item:
    """The k-th q tile CTA `cta` runs. The grid walks (head, slot) items, slots fastest and
    last to first (a request's longest causal tiles first); CTA c runs items c G .. c G + G - 1
    (G = tiles_per_cta), neighbouring tiles of one head, and the hardware schedules the CTAs in
    order, so the tiles running side by side share their head's K/V through L2 and a ragged
    batch balances over the SMs as CTAs finish (docs/prefill_kernel.md, "Several q tiles a
    CTA")."""
    idx = cta * tiles_per_cta + k
    inside = idx < num_items
    idx = jnp.minimum(idx, num_items - 1)
    h = idx // num_slots
    slot_id = num_slots - 1 - lax.rem(idx, num_slots)
    req = req_ref[slot_id]
    live = inside & (req >= 0)
    reqc = jnp.maximum(req, 0)
    # A request's rows are read from the 8-row group its first row falls in (`ROW_ALIGN`):
    # counted from there (q_base, kv_base), its rows are [q_lead, q_end) and its keys
    # [kv_lead, kv_end). The bottom-right causal bound keeps its form in these coordinates:
    # row r sees keys < kv_end - q_end + 1 + r.
    q_start, kv_start = qo_indptr_ref[reqc], kv_indptr_ref[reqc]
    q_lead, kv_lead = lax.rem(q_start, ROW_ALIGN), lax.rem(kv_start, ROW_ALIGN)  # starts >= 0
    q_end, kv_len = q_lead + q_lens_ref[reqc], kv_lens_ref[reqc]
    kv_end = kv_lead + kv_len
    qb0 = first_ref[slot_id]
    # Tiles of the item: up to its last row's causal limit (all of the KV otherwise).
    if causal:
        last_row = jnp.minimum(qb0 + BLOCK_Q, q_end) - 1
        limit_max = jnp.clip(kv_end - q_end + 1 + last_row, 0, kv_end)
    else:
        limit_max = kv_end
    count = jnp.where(live & (kv_len > 0), (limit_max + block_kv - 1) // block_kv, 0)
    return _Item(live=live, h=h, q_base=q_start - q_lead, kv_base=kv_start - kv_lead,
                 q_lead=q_lead, kv_lead=kv_lead, q_end=q_end, kv_end=kv_end, qb0=qb0,
                 count=count)


def item_kv_tiles(qo_indptr: jax.Array, kv_indptr: jax.Array, q_lens: jax.Array,
                  kv_lens: jax.Array, *, heads: int, num_slots: int, causal: bool,
                  block_kv: int) -> jax.Array:
    """int32 [heads * num_slots]: the KV tiles each (head, slot) item of the kernel's walk
    reads (heads outer, slots last to first; 0 for an unused slot), for the schedule
    `tile_schedule(qo_indptr, num_slots)` gives; the kernel's own rule (`_item`), for a
    schedule model outside it (`python -m bench.prefill_schedule`). Arguments as the
    kernel's: qo_indptr, kv_indptr int32 [R + 1], q_lens, kv_lens int32 [R]."""
    req, first = tile_schedule(qo_indptr, num_slots)
    n = heads * num_slots
    item = functools.partial(
        _item, cta=0, qo_indptr_ref=qo_indptr, kv_indptr_ref=kv_indptr, q_lens_ref=q_lens,
        kv_lens_ref=kv_lens, req_ref=req, first_ref=first, causal=causal, block_kv=block_kv,
        num_slots=num_slots, num_items=n, tiles_per_cta=n)
    return jax.vmap(lambda k: item(k).count)(jnp.arange(n, dtype=jnp.int32))


def _walk(tiles: int, body, init):
    """body(k, carry) over this CTA's q tiles k = 0..tiles-1 (a plain call for one tile)."""
    if tiles == 1:
        return body(jnp.int32(0), init)
    return lax.fori_loop(0, tiles, body, init)


def _kernel(qo_indptr_ref, kv_indptr_ref, q_lens_ref, kv_lens_ref, req_ref, first_ref, q_ref,
            k_ref, v_ref, o_ref, lse_ref, scratch, *, causal: bool, block_kv: int,
            num_stages: int, num_slots: int, num_items: int, scale_log2: float,
            cfg: MgpuPrefillConfig, interpret: bool):
    walks = cfg.tiles_per_cta > 1
    if walks:  # the output staging is apart from q (the next tile's q loads early)
        qo0, qo1, out0, out1, *scratch = scratch
        o_stages, o_full_stages = (out0[0], out1[0]), (out0[1], out1[1])
    else:  # q is dead at the block's end: the output staging reuses its memory
        qo0, qo1, *scratch = scratch
        o_stages, o_full_stages = (qo0[1], qo1[1]), (qo0[2], qo1[2])
    q_smems = (qo0[0], qo1[0])
    k_smem, v_smem, q_bar, q_free, k_full, v_full, k_empty, v_empty, v_clean, turn = scratch

    wg = lax.axis_index("wg")
    item = functools.partial(
        _item, cta=lax.axis_index("cta"), qo_indptr_ref=qo_indptr_ref,
        kv_indptr_ref=kv_indptr_ref, q_lens_ref=q_lens_ref, kv_lens_ref=kv_lens_ref,
        req_ref=req_ref, first_ref=first_ref, causal=causal, block_kv=block_kv,
        num_slots=num_slots, num_items=num_items, tiles_per_cta=cfg.tiles_per_cta)

    @pl.when(wg == 2)
    def _producer():
        plgpu.set_max_registers(cfg.producer_registers, action="decrease")

        def run(k, carry):
            g, n_q = carry  # tiles filled so far (the ring position), q tiles loaded
            it = item(k)

            def copy_q(w):
                with jax.named_scope("copy_q"):
                    plgpu.copy_gmem_to_smem(
                        q_ref.at[pl.ds(it.q_base + it.qb0 + w * ROWS, ROWS), it.h],
                        q_smems[w], q_bar.at[w])

            def copy_kv(i, which):
                free, full, src, dst = ((k_empty, k_full, k_ref, k_smem),
                                        (v_empty, v_full, v_ref, v_smem))[which]
                st = lax.rem(g + i, num_stages)

                @pl.when(g + i >= num_stages)
                def _():
                    with jax.named_scope("wait_free"):
                        plgpu.barrier_wait(free.at[st])
                    release_seen(interpret)

                with jax.named_scope("copy"):
                    plgpu.copy_gmem_to_smem(
                        src.at[pl.ds(it.kv_base + i * block_kv, block_kv), it.h],
                        dst.at[st], full.at[st])

            def load_tile(i, c):
                copy_kv(i, 0)
                copy_kv(i, 1)
                return c

            @pl.when(it.live)
            def _():
                if walks:
                    # The item's first K / V tile as soon as a stage is free, then q once
                    # both consumers are past the previous item's last q k^T.
                    pl.when(it.count > 0)(lambda: load_tile(0, None))

                    @pl.when(n_q > 0)
                    def _():
                        with jax.named_scope("wait_q_free"):
                            plgpu.barrier_wait(q_free)
                        release_seen(interpret)

                    copy_q(0)
                    copy_q(1)
                else:
                    # What consumer 0's first q k^T reads goes first: q half 0 and K tile 0,
                    # then q half 1 (consumer 1 starts half a turn later) and V tile 0
                    # (`bench.kernel_ab`; 0.8% at 16 x 1k H128 on the H200,
                    # docs/prefill_kernel.md).
                    copy_q(0)
                    pl.when(it.count > 0)(lambda: copy_kv(0, 0))
                    copy_q(1)
                    pl.when(it.count > 0)(lambda: copy_kv(0, 1))
                lax.fori_loop(1, it.count, load_tile, None)

            return g + it.count, n_q + it.live.astype(jnp.int32)

        g, n_q = _walk(cfg.tiles_per_cta, run, (jnp.int32(0), jnp.int32(0)))
        # each stage's and q's last release
        wait_last_releases((k_empty, v_empty), g, num_stages)
        if walks:
            pl.when(n_q > 0)(lambda: plgpu.barrier_wait(q_free))

    def consumer(w: int):
        plgpu.set_max_registers(cfg.consumer_registers, action="increase")
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        q_smem = q_smems[w]

        def meet():
            """Both consumers at the turn barrier (`MgpuPrefillConfig.pingpong`)."""
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        def run(k, g):  # g: the ring position (KV tiles of this CTA's earlier q tiles)
            it = item(k)
            kv_lead, kv_end, count = it.kv_lead, it.kv_end, it.count
            row0 = it.qb0 + w * ROWS  # this consumer's first row, counted from q_base
            # Keys visible to row r of this consumer: < diag + r (causal), in
            # [kv_lead, kv_end) always. Tile 0's rows below kv_lead are not the request's:
            # masked where kv_lead > 0.
            diag = kv_end - it.q_end + 1 + row0 if causal else kv_end
            first_limit = jnp.clip(diag, 0, kv_end)
            n_lead = jnp.minimum((kv_lead > 0).astype(jnp.int32), count)
            n_plain = jnp.clip(first_limit // block_kv, n_lead, count)  # plain: [n_lead, n_plain)

            def step(i, carry, masked: bool):
                acc, m_i, l_i = carry
                st = lax.rem(g + i, num_stages)
                with jax.named_scope("wait_k"):
                    plgpu.barrier_wait(k_full.at[st])
                with jax.named_scope("qk"):
                    s = _qk(q_smem, k_smem.at[st], block_kv, interpret,
                            meet if cfg.pingpong else None)
                plgpu.barrier_arrive(k_empty.at[st])
                with jax.named_scope("softmax"):
                    if masked:
                        # The iotas are built here, in the masked tiles only: a [64, 128]
                        # int32 array is 64 registers a thread, which the unmasked loop need
                        # not hold.
                        rows_iota = iota((ROWS, block_kv), 0, interpret)
                        cols_iota = iota((ROWS, block_kv), 1, interpret)
                        base = i * block_kv
                        keep = (cols_iota < kv_end - base) & (cols_iota >= kv_lead - base)
                        if causal:
                            keep = keep & (cols_iota - rows_iota < diag - base)
                        s = jnp.where(keep, s, -jnp.inf)
                    # The max is over raw scores and the scale (> 0) multiplies s - max: a
                    # multiply-add s * scale - max would leave exp2 a rounding residual of up
                    # to half an ulp of the scaled max (+inf past ~2^31;
                    # tests/test_pallas_large_scores.py).
                    m_new = jnp.maximum(m_i, s.max(axis=1))
                    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
                    alpha = jnp.exp2((m_i - m_safe) * scale_log2)
                    p = jnp.exp2((s - lax.broadcast_in_dim(m_safe, s.shape, [0])) * scale_log2)
                    p16 = p.astype(q_smem.dtype)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                if cfg.pingpong:  # this softmax is done; P V waits for the other's q k^T issue
                    plgpu.barrier_arrive(turn)
                with jax.named_scope("wait_v"):
                    plgpu.barrier_wait(v_full.at[st])
                if masked:
                    lo, hi = kv_lead - i * block_kv, kv_end - i * block_kv

                    # The first and the KV tail tile: V rows of no key of the request (the
                    # previous or next request, or zero fill) are zeroed before P V (a
                    # select: a NaN there is never multiplied by a zero weight). Consumer 0
                    # zeroes them and signals; consumer 1 waits for that.
                    @pl.when((lo > 0) | (hi < block_kv))
                    def _():
                        if w == 0:
                            for c in range(V_HEAD_DIM // 64):
                                ref = v_smem.at[st, :, pl.ds(c * 64, 64)]
                                chunk = load(ref, plgpu.Layout.WGMMA, interpret)
                                rows_v = iota((block_kv, 64), 0, interpret)
                                ref[...] = jnp.where((rows_v >= lo) & (rows_v < hi),
                                                     chunk, jnp.zeros_like(chunk))
                            plgpu.commit_smem()
                            plgpu.barrier_arrive(v_clean.at[st])
                        else:
                            plgpu.barrier_wait(v_clean.at[st])

                if cfg.pingpong:
                    with jax.named_scope("turn"):
                        plgpu.barrier_wait(turn)
                with jax.named_scope("pv"):
                    acc, l_i = mma_acc_and(acc, p16, v_smem.at[st], l_i,
                                           lambda l_prev: l_prev * alpha + p.sum(axis=1),
                                           interpret)
                plgpu.barrier_arrive(v_empty.at[st])
                return acc, m_new, l_i

            @pl.when(it.live)
            def _():
                acc = in_layout(jnp.zeros((ROWS, V_HEAD_DIM), jnp.float32),
                                plgpu.Layout.WGMMA, interpret)
                m_i = in_layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), row_layout,
                                interpret)
                l_i = in_layout(jnp.zeros((ROWS,), jnp.float32), row_layout, interpret)
                with jax.named_scope("wait_q"):
                    plgpu.barrier_wait(q_bar.at[w])
                if cfg.pingpong and w == 1:  # consumer 1 starts half a turn behind consumer 0
                    meet()
                carry = lax.fori_loop(0, n_lead, functools.partial(step, masked=True),
                                      (acc, m_i, l_i))
                carry = lax.fori_loop(n_lead, n_plain, functools.partial(step, masked=False),
                                      carry)
                acc, m_i, l_i = lax.fori_loop(n_plain, count,
                                              functools.partial(step, masked=True), carry)
                if walks:  # this item's last q k^T is done: the next item's q may land
                    plgpu.barrier_arrive(q_free)
                if cfg.pingpong and w == 0:  # ... and consumer 0 closes that half turn
                    meet()

                with jax.named_scope("finish"):
                    has = l_i > 0.0
                    l_safe = jnp.where(has, l_i, 1.0)
                    # One reciprocal a row and a multiply an element: a division an element
                    # is IEEE division's instruction sequence on every accumulator register.
                    out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
                    lse = jnp.where(has, (m_i * scale_log2 + jnp.log2(l_safe)) * _LN2,
                                    jnp.inf)
                    out = out.astype(o_stages[w].dtype)
                    # this consumer's rows of the request: [lead, n_rows) of its 64
                    lead = jnp.clip(it.q_lead - row0, 0, ROWS)
                    n_rows = jnp.clip(it.q_end - row0, 0, ROWS)
                    full = (lead == 0) & (n_rows == ROWS)

                    def dst(off, size):
                        return o_ref.at[pl.ds(it.q_base + row0 + off, size), it.h]

                    if walks:  # the previous item's stores have read the staging (at
                        # the first item none is pending and the wait returns at once)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

                    # A full half (its rows start on a multiple of 8) goes through the
                    # swizzled staging (stores free of bank conflicts, one TMA copy); a
                    # partial one through the row-major one, whose rows the copies of 32, 16,
                    # ..., 1 rows can address.
                    @pl.when(full)
                    def _():
                        o_full_stages[w][...] = out
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_full_stages[w], dst(0, ROWS))

                    @pl.when(jnp.logical_not(full))
                    def _():
                        store(o_stages[w], out, interpret)
                        plgpu.commit_smem()
                        _store_rows(o_stages[w], dst, lead, n_rows)

                    _store_lse(lse_ref, lse, it.q_base + row0, it.h, lead, n_rows, interpret)

            return g + count

        _walk(cfg.tiles_per_cta, run, jnp.int32(0))
        with jax.named_scope("store_wait"):
            plgpu.wait_smem_to_gmem(0)

    for w in range(2):
        pl.when(wg == w)(functools.partial(consumer, w))


def prefill_kernel(q_rows: int, heads: int, num_reqs: int, dtype, *,
                   sm_scale: float, causal: bool,
                   config: MgpuPrefillConfig = MgpuPrefillConfig(), interpret=False,
                   num_slots: int | None = None):
    """The Mosaic GPU pallas call for static shapes, as a function of its nine operands:

        (qo_indptr, kv_indptr int32 [R + 1] (request starts), q_lens, kv_lens int32 [R],
         tile_req, tile_first int32 [N] (`tile_schedule`), q [q_rows, H, 192],
         k [kv_rows, H, 192], v [kv_rows, H, 128]) -> (out [q_rows, H, 128] (dtype; rows of
         no request unwritten), lse f32 [q_rows, H] (rows of no request unwritten))

    with R = num_reqs, N = num_slots (None: `num_tile_slots(q_rows, num_reqs)`, which covers
    any R requests; fewer must still cover the batch's tiles, `tile_counts`) and any kv_rows
    (a multiple of 8 and at least block_kv on a GPU). `prefill.mha_prefill` builds the
    operands from token CSRs (`prefill_layout`); the torch launcher
    (`funcmla.interop.launcher.prefill`) lowers this function alone, so every kernel operand
    is one of its inputs."""
    if num_slots is None:
        num_slots = num_tile_slots(q_rows, num_reqs)
    bkv, ns = config.block_kv, config.num_stages
    transforms = swizzled(_SWIZZLE, 2)
    q_half = plgpu.SMEM((ROWS, HEAD_DIM), dtype, transforms=transforms)
    o_half = plgpu.SMEM((ROWS, V_HEAD_DIM), dtype)
    o_full = plgpu.SMEM((ROWS, V_HEAD_DIM), dtype, transforms=transforms)
    if config.tiles_per_cta > 1:
        # q apart from the output stagings: the next item's q lands while this one finishes.
        q_or_out = [(q_half,) for _ in range(2)]
        outs = [(o_half, o_full) if interpret else plgpu.RefUnion(o_half, o_full)
                for _ in range(2)]
    elif interpret:  # the interpreter has no RefUnion (and no shared-memory limit)
        q_or_out, outs = [(q_half, o_half, o_full) for _ in range(2)], []
    else:
        # Each consumer's q half and its two output stagings share memory (q is dead once
        # the consumer's last q k^T is done).
        q_or_out = [plgpu.RefUnion(q_half, o_half, o_full) for _ in range(2)]
        outs = []
    num_items = heads * num_slots
    num_ctas = -(-num_items // config.tiles_per_cta)
    scratch = [
        *q_or_out,
        *outs,
        plgpu.SMEM((ns, bkv, HEAD_DIM), dtype, transforms=transforms),
        plgpu.SMEM((ns, bkv, V_HEAD_DIM), dtype, transforms=transforms),
        plgpu.Barrier(num_barriers=2),                    # q half w landed
        plgpu.Barrier(num_arrivals=2),                    # q read by both (G > 1)
        plgpu.Barrier(num_barriers=ns),                   # K stage filled
        plgpu.Barrier(num_barriers=ns),                   # V stage filled
        plgpu.Barrier(num_arrivals=2, num_barriers=ns),   # K stage released by both
        plgpu.Barrier(num_arrivals=2, num_barriers=ns),   # V stage released by both
        plgpu.Barrier(num_barriers=ns),                   # V tail rows zeroed (consumer 0)
        plgpu.Barrier(num_arrivals=2),                    # the consumers' turns (pingpong)
    ]
    kernel = functools.partial(
        _kernel, causal=causal, block_kv=bkv, num_stages=ns, num_slots=num_slots,
        num_items=num_items, scale_log2=float(sm_scale) * _LOG2E, cfg=config,
        interpret=interpret)
    return plgpu.kernel(
        lambda *refs: kernel(*refs[:11], refs[11:]),
        out_type=(jax.ShapeDtypeStruct((q_rows, heads, V_HEAD_DIM), dtype),
                  jax.ShapeDtypeStruct((q_rows, heads), jnp.float32)),
        scratch_types=scratch,
        # One flat axis of (head, slot) items, slots fastest: the q tiles of one head run
        # side by side and stream that head's K/V tiles at about the same time from L2.
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        compiler_params=compiler_params(config.profile_space, config.profile_dir),
        interpret=mgpu_params(interpret),
        kernel_name=(f"mha_prefill_mgpu_{'causal' if causal else 'full'}_kv{bkv}_s{ns}"
                     + ("_pingpong" if config.pingpong else "")
                     + (f"_g{config.tiles_per_cta}" if config.tiles_per_cta > 1 else "")),
    )


def num_tile_slots(q_rows: int, num_reqs: int) -> int:
    """Tile slots of the static schedule: ceil((q_rows + 7 R) / 128) + R covers any R requests
    over q_rows rows (`tile_counts`: each request adds at most 7 leading rows and one partial
    tile)."""
    return -(-(q_rows + (ROW_ALIGN - 1) * num_reqs) // BLOCK_Q) + num_reqs
