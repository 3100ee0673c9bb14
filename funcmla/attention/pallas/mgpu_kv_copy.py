"""How the producer warpgroup of a Mosaic GPU decode kernel fills a KV stage with one 64-token
tile of pool rows: TMA copies (one a tile at page >= 64, one a page at pages 8 to 32), or, at
pages under 8 tokens, which a TMA copy cannot place inside an 8-row swizzled tile (Hopper's TMA
has no row gather), a `cp.async` row gather; and the producer's whole loop (`produce_tiles`).
Used by `decode_mgpu` (bf16 stages, 128-byte swizzle), `decode_mgpu_fp8` and
`decode_mgpu_fp8_wide` (fp8 stages, 64-byte swizzle); a stage is `swizzled`
(8, swizzle / itemsize) tiles either way, and the gather derives its addressing from the
stage's swizzle and the pool's itemsize.

Signalling (`filled_scratch`): a TMA copy completes its stage's Pallas barrier (`full[0]`,
transaction bytes). In the row gather each producer thread ends its part of a tile with
`cp.async.mbarrier.arrive.noinc` on the stage's mbarrier in plain shared memory (`full[1]`, 128
arrivals a fill, initialized by `init_filled`; a Pallas barrier cannot be named inside inline
Mosaic GPU), so the producer goes on to the next stage while the rows are in flight, and a
reader waits on that mbarrier's phase parity (`wait_filled`), with a proxy fence where `wgmma`
reads the stage (`cp.async` writes through the generic proxy). A producer that waited for its
own copies kept one gathered tile in flight: 0.964x / 0.965x the time at H128 B32 L4k page 1
(bf16 / fp8 kernels; `bench.kernel_ab --module funcmla.attention.pallas.decode_mgpu_fp8_wide
--base-file`, docs/decode_kernel.md's decision log). Interpret mode copies at once and arrives
on the Pallas barrier.

Bounds: every token is clamped to [0, kv_len - 1] and every table entry to the table before
it is read, and copies wholly past kv_len read nothing, so a producer may run ahead of its
consumers (and past the sequence) without reading out of bounds. Pool byte offsets are 64-bit
(the TMA names rows by int32 coordinates), so pools past 2**31 bytes need no special care.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from funcmla.attention.pallas.mgpu_ops import release_seen, swizzled, wait_last_releases

__all__ = ["BLOCK_KV", "page_size_unsupported", "pool_rows_unsupported", "gathers",
           "arrivals_per_tile", "filled_scratch", "init_filled", "wait_filled", "gather_rows",
           "gather_tile", "copy_tile", "fill_stage", "produce_tiles"]

BLOCK_KV = 64  # KV tokens per tile
_GATHER_THREADS = 128  # the producer warpgroup: each thread arrives once a gathered fill


def page_size_unsupported(page_size: int) -> str | None:
    """None when a stage can be filled from pages of `page_size` tokens (a divisor of the
    tile, gathered or copied a page at a time, or a multiple of it), else why not."""
    if page_size < BLOCK_KV and BLOCK_KV % page_size:
        return f"page size {page_size} does not divide the {BLOCK_KV}-token tile"
    if page_size > BLOCK_KV and page_size % BLOCK_KV:
        return f"page size {page_size} is not a multiple of the {BLOCK_KV}-token tile"
    return None


def pool_rows_unsupported(pool_rows: int | None, page_size: int) -> str | None:
    """None when the TMA copies (pages of 8 tokens and more) can read a pool of `pool_rows`
    rows (or the row count is not known), else why not: a copy views the pool as 8-row tiles,
    which must cover it whole. The row gather (pages under 8) reads any pool."""
    if pool_rows is None or gathers(page_size) or pool_rows % 8 == 0:
        return None
    return (f"kv_pool has {pool_rows} rows, not a multiple of 8: the Mosaic GPU kernels' TMA "
            f"copies (page size {page_size} >= 8) view the pool as 8-row tiles")


def gathers(page_size: int) -> bool:
    """Whether tiles are gathered row by row (`gather_tile`) rather than TMA-copied: pages
    under 8 tokens, which a TMA copy cannot place inside an 8-row swizzled tile."""
    return page_size < 8


def arrivals_per_tile(page_size: int) -> int:
    """Arrivals that fill a stage: one TMA copy a page under 64 tokens, else one a tile; the
    gather's 128 threads arrive as one warpgroup."""
    return 1 if gathers(page_size) else max(1, BLOCK_KV // page_size)


def filled_scratch(page_size: int, num_stages: int):
    """Scratch of the "stage filled" signal, one per stage: the Pallas barrier TMA copies
    complete (`arrivals_per_tile`; in interpret mode the gather arrives on it too) and, where
    tiles are gathered, the gather's mbarriers, 8 bytes each in plain shared memory (else
    None). A kernel passes the pair as `full` to `produce_tiles` and `wait_filled`, and runs
    `init_filled` first."""
    words = plgpu.SMEM((num_stages, 2), jnp.uint32) if gathers(page_size) else None
    return (plgpu.Barrier(num_arrivals=arrivals_per_tile(page_size), num_barriers=num_stages),
            words)


def _copies_arrive(full, interpret: bool) -> bool:
    """Whether the tiles of `full` (`filled_scratch`) are gathered by copies that signal
    their stage themselves (not in interpret mode)."""
    return full[1] is not None and not interpret


def init_filled(full, *, interpret: bool) -> None:
    """Initializes the row gather's mbarriers (`filled_scratch`) to 128 arrivals a phase. Run
    by every thread of the block before the warpgroups part: one thread initializes, then the
    block meets (`bar.sync 0`), so no warpgroup arrives or waits before. A no-op at TMA
    pages and in interpret mode."""
    if not _copies_arrive(full, interpret):
        return
    _, words = full
    num_stages = words.shape[0]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def init(ctx, words):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import gpu, nvvm
        from jax.experimental.mosaic.gpu import utils as mu

        i32, i64 = (ir.IntegerType.get_signless(n) for n in (32, 64))
        base = mu.memref_ptr(words)
        one = mu.single_thread_predicate(mu.ThreadSubset.BLOCK)
        for st in range(num_stages):
            nvvm.mbarrier_init(mu.getelementptr(base, [st], i64), mu.c(_GATHER_THREADS, i32),
                               predicate=one)
        nvvm.fence_mbarrier_init()
        gpu.barrier()

    init(words)


def wait_filled(full, fill, *, num_stages: int, async_proxy: bool, interpret: bool) -> None:
    """Waits until fill `fill` (0, 1, ... of this block: stage fill % num_stages, its
    fill // num_stages-th use) has landed. `async_proxy`: the reader is a `wgmma`, which reads
    the stage through the async proxy, so a gathered stage (generic-proxy writes) is fenced
    after the wait."""
    barrier, words = full
    if not _copies_arrive(full, interpret):
        plgpu.barrier_wait(barrier.at[lax.rem(fill, num_stages)])
        return
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat))
    def wait(ctx, words, fill):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, nvvm
        from jax.experimental.mosaic.gpu import utils as mu

        i32 = ir.IntegerType.get_signless(32)
        fill = fill.registers.item()
        use = arith.divui(fill, mu.c(num_stages, i32))
        parity = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(use, mu.c(1, i32)),
                            mu.c(0, i32))
        bars = mu.BarrierRef(base_address=mu.memref_ptr(words), offset=mu.c(0, i32), phases=None,
                            num_barriers=num_stages)
        bars[arith.remui(fill, mu.c(num_stages, i32))].wait_parity(parity)
        if async_proxy:
            nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    wait(words, fill)


def _threads_per_row(swizzle: int) -> int:
    """Threads that copy one row of a 64-column chunk: one a 16-byte vector of the swizzle."""
    return swizzle // 16


def _rows_layout(swizzle: int):
    """Register layout of `gather_rows`' result: thread t holds elements t + 128 j."""
    return plgpu.Layout.WG_STRIDED((BLOCK_KV * _threads_per_row(swizzle),), vec_size=1)


def _tile_source(kv_ref, table_ref, start_entry, tok, page_size: int):
    """Pool rows of the TMA copy that starts at token `tok` (one page, or one 64-token tile
    when pages are larger); the table is read only for a token inside the sequence."""
    rows = min(page_size, BLOCK_KV)
    page = table_ref[start_entry + tok // page_size]
    return kv_ref.at[pl.ds(page * page_size + tok % page_size, rows)]


def copy_tile(kv_ref, table_ref, dst, full, start_entry, tile, kv_len, *, page_size: int):
    """TMA-copies tile `tile`'s pool rows into stage ref `dst`, each copy arriving on barrier
    `full` (`arrivals_per_tile` of them); pages >= 8. Copies wholly past kv_len read nothing
    (their table entries may be padding or past the table) and arrive all the same, so the
    stage's barrier completes."""
    copies = arrivals_per_tile(page_size)
    rows = min(page_size, BLOCK_KV)
    with jax.named_scope("copy"):  # the producer's phase, as in `gather_tile`
        for j in range(copies):
            tok = tile * BLOCK_KV + j * rows
            if copies == 1:
                src = _tile_source(kv_ref, table_ref, start_entry, tok, page_size)
                plgpu.copy_gmem_to_smem(src, dst, full)
            else:
                @pl.when(tok < kv_len)
                def _():
                    src = _tile_source(kv_ref, table_ref, start_entry, tok, page_size)
                    plgpu.copy_gmem_to_smem(src, dst.at[pl.ds(j * rows, rows)], full)

                @pl.when(tok >= kv_len)
                def _():
                    plgpu.barrier_arrive(full)


def gather_rows(table_ref, entry0, tok0, last_tok, *, page_size: int, swizzle: int,
                interpret: bool):
    """The pool rows the row gather copies for tokens tok0 .. tok0 + 63, each token clamped to
    [0, last_tok] and each table entry to the table. Compiled: int32 [64 x tpr] in the
    strided warpgroup layout (tpr = swizzle / 16 threads a row: 8 for bf16 stages, 4 for
    fp8), thread t holding the rows of tokens tok0 + t // tpr + (128 / tpr) j; its loads land
    while the previous tile's copies do. Interpret mode returns a placeholder (the
    interpreter's gather reads the table itself)."""
    tpr = _threads_per_row(swizzle)
    size = BLOCK_KV * tpr
    if interpret:
        return jnp.zeros((size,), jnp.int32)
    splat = plgpu.Layout.WG_SPLAT(())
    stride = 128 // tpr  # tokens between one thread's rows

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat, splat, splat),
                       return_type=plgpu.ShapeDtypeStruct(
                           (size,), jnp.int32, layout=_rows_layout(swizzle)))
    def rows(ctx, table, entry0, tok0, last_tok):
        del ctx
        import numpy as np
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, memref, vector
        from jax.experimental.mosaic import gpu as mgpu
        from jax.experimental.mosaic.gpu import utils as mu

        i32 = ir.IntegerType.get_signless(32)
        entry0, tok0, last_tok = (x.registers.item() for x in (entry0, tok0, last_tok))

        def k(n):
            return mu.c(n, i32)

        r0 = arith.shrui(arith.remui(mu.thread_idx(), k(128)), k(tpr.bit_length() - 1))
        log2_page = page_size.bit_length() - 1
        last_entry = k(ir.MemRefType(table.type).shape[0] - 1)
        regs = []
        for j in range(BLOCK_KV // stride):
            tok = arith.minsi(arith.addi(tok0, arith.addi(r0, k(stride * j))), last_tok)
            tok = arith.maxsi(tok, k(0))
            entry = arith.minsi(arith.addi(entry0, arith.shrui(tok, k(log2_page))), last_entry)
            row = memref.load(table, [arith.index_cast(ir.IndexType.get(), entry)])
            if page_size > 1:
                row = arith.addi(arith.shli(row, k(log2_page)), arith.andi(tok, k(page_size - 1)))
            regs.append(vector.broadcast(ir.VectorType.get((1,), i32), row))
        return mgpu.FragmentedArray(_registers=np.array(regs), _layout=mgpu.WGStridedFragLayout(
            (size,), 1), _is_signed=True)

    return rows(table_ref, entry0, tok0, last_tok)


def _gather_issue(kv_ref, table_ref, stages, slot, rows, entry0, tok0, last_tok, *,
                  page_size: int, swizzle: int, interpret: bool, words):
    """Starts copying pool `rows` (`gather_rows`) into stage `slot` of `stages`, in its
    `swizzled` layout, as 16-byte `cp.async` copies; each thread's copies then arrive on
    mbarrier `slot` of `words` (the stages' mbarriers, `filled_scratch`) as they land
    (`cp.async.mbarrier.arrive.noinc`).

    Thread t copies 16-byte vector t % tpr of each 64-column chunk of rows t // tpr +
    (128 / tpr) j, so a warp reads 32 / tpr whole swizzle-byte row segments an instruction
    (bf16: 8 threads a row, 4 rows each, 36 copies a thread; fp8: 4, 2 rows, 18). The
    interpreter has no inline Mosaic GPU, so there the rows are copied one by one, from the
    table, at once."""
    _, d = kv_ref.shape
    if interpret:
        def row(r, carry):
            tok = jnp.minimum(tok0 + r, last_tok)
            src = table_ref[entry0 + tok // page_size] * page_size + tok % page_size
            stages[slot, pl.ds(r, 1), :] = kv_ref[pl.ds(src, 1), :]
            return carry

        lax.fori_loop(0, BLOCK_KV, row, 0)
        return

    itemsize = jnp.dtype(kv_ref.dtype).itemsize
    tpr = _threads_per_row(swizzle)
    row_tiles_per_j = 128 // tpr // 8   # 8-row tiles between one thread's rows
    # The swizzle XORs a row segment's 16-byte vector index with bits 7.. of the row's byte
    # offset in its 8-row tile (128 * r8 at a 128-byte swizzle, 64 * r8 at 64 bytes).
    swizzle_shift = 7 - (swizzle.bit_length() - 1)
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(swizzled(swizzle, itemsize)),
                                  splat, _rows_layout(swizzle), plgpu.RefType()))
    def copy(ctx, pool, stages, slot, rows, words):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import arith, llvm, nvvm, vector
        from jax.experimental.mosaic.gpu import utils as mu

        i8, i32, i64 = (ir.IntegerType.get_signless(n) for n in (8, 32, 64))
        slot = slot.registers.item()
        src_rows = [vector.extract(r, dynamic_position=[], static_position=[0])
                    for r in rows.registers.flat]

        def k(n):
            return mu.c(n, i32)

        tile_bytes = 8 * swizzle                # one 8-row x 64-column swizzle tile
        n_chunks = d * itemsize // swizzle      # 64-column chunks per row (9 for d = 576)
        t = arith.remui(mu.thread_idx(), k(128))
        vec = arith.andi(t, k(tpr - 1))         # 16-byte vector within a chunk row
        r0 = arith.shrui(t, k(tpr.bit_length() - 1))  # first row; rows r0 + (128 / tpr) j
        r8 = arith.andi(r0, k(7))               # row within its 8-row tile (same for every j)
        # Element (r, c) of stage s lives at byte s * 64 * d * itemsize + ((r // 8) * n_chunks
        # + c // 64) * tile_bytes + (r % 8) * swizzle + ((c % 64) * itemsize // 16 XOR the
        # swizzle's row bits) * 16 + (c * itemsize) % 16.
        dst_off = arith.addi(
            arith.addi(arith.muli(slot, k(BLOCK_KV * d * itemsize)),
                       arith.muli(arith.shrui(r0, k(3)), k(n_chunks * tile_bytes))),
            arith.addi(arith.muli(r8, k(swizzle)),
                       arith.shli(arith.xori(vec, r8 if swizzle_shift == 0 else
                                             arith.shrui(r8, k(swizzle_shift))), k(4))))
        dst0 = mu.getelementptr(mu.memref_ptr(stages), [dst_off], i8)
        pool_ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                      mu.memref_ptr(pool))
        vec_bytes = arith.extui(i64, arith.shli(vec, k(4)))
        srcs = [mu.getelementptr(pool_ptr, [arith.addi(arith.muli(
            arith.extui(i64, r), mu.c(d * itemsize, i64)), vec_bytes)], i8) for r in src_rows]
        for j, src in enumerate(srcs):
            for c in range(n_chunks):
                nvvm.cp_async_shared_global(
                    mu.getelementptr(dst0, [(row_tiles_per_j * j * n_chunks + c) * tile_bytes],
                                     i8),
                    mu.getelementptr(src, [c * swizzle], i8),
                    16, nvvm.LoadCacheModifierKind.CG)
        nvvm.cp_async_mbarrier_arrive(mu.getelementptr(mu.memref_ptr(words), [slot], i64),
                                      noinc=True)

    copy(kv_ref, stages, slot, rows, words)


def gather_tile(kv_ref, table_ref, stages, slot, rows, full, start_entry, tile, kv_len, *,
                page_size: int, swizzle: int, interpret: bool):
    """Row-gathers tile `tile` into stage `slot` of `stages` from `rows` (this tile's
    `gather_rows`), its copies signalling the stage's mbarrier (`full`, `filled_scratch`) as
    they land, and loads the next tile's rows meanwhile. Interpret mode copies at once and
    arrives on the stage's Pallas barrier. Returns the next tile's rows, the loop carry."""
    barrier, words = full
    with jax.named_scope("copy"):
        _gather_issue(kv_ref, table_ref, stages, slot, rows, start_entry, tile * BLOCK_KV,
                      kv_len - 1, page_size=page_size, swizzle=swizzle, interpret=interpret,
                      words=words)
        rows = gather_rows(table_ref, start_entry, (tile + 1) * BLOCK_KV, kv_len - 1,
                           page_size=page_size, swizzle=swizzle, interpret=interpret)
        if interpret:
            plgpu.barrier_arrive(barrier.at[slot])
    return rows


def fill_stage(kv_ref, table_ref, stages, full, empty, i, rows, first, start_entry, kv_len, *,
               num_stages: int, page_size: int, swizzle: int, interpret: bool):
    """The producer's step i of a fori_loop over a split's tiles (tile first + i into stage
    i % num_stages of `stages`): waits until the stage's previous tile is released (barrier
    `empty`, from step num_stages on), then fills it (`gather_tile` at pages under 8, with
    `rows` the loop carry; else `copy_tile`), signalling `full` (`filled_scratch`). Returns
    the carry."""
    slot = lax.rem(i, num_stages)
    tile = first + i

    @pl.when(i >= num_stages)
    def _():
        with jax.named_scope("wait_free"):
            plgpu.barrier_wait(empty.at[slot])
            if not gathers(page_size):  # a TMA copy follows (the gather writes generic)
                release_seen(interpret)

    if gathers(page_size):  # the next tile's rows load while this one's copies land
        return gather_tile(kv_ref, table_ref, stages, slot, rows, full, start_entry,
                           tile, kv_len, page_size=page_size, swizzle=swizzle,
                           interpret=interpret)
    copy_tile(kv_ref, table_ref, stages.at[slot], full[0].at[slot], start_entry, tile, kv_len,
              page_size=page_size)
    return rows


def produce_tiles(kv_ref, table_ref, stages, full, empty, *, first, count, start_entry,
                  kv_len, num_stages: int, page_size: int, swizzle: int, interpret: bool,
                  prepare=None, consume=None):
    """The producer warpgroup's whole loop: tiles first .. first + count - 1 into the stages
    (`fill_stage`), then a wait on each stage's last release (`wait_last_releases`). `prepare()`,
    if given, is the producer's other work (the fp8 kernels' q split): run after the first
    `num_stages` tiles are issued, so it overlaps their copies; with the row gather it runs
    first (q's loads would queue behind the gathered copies). `consume(i)`, if given, is the
    producer's share of tile first + i's work (it waits for the tile to land itself): run for
    each tile in order, before the tile's stage is refilled with tile first + i + num_stages."""
    fill = functools.partial(fill_stage, kv_ref, table_ref, stages, full, empty, first=first,
                             start_entry=start_entry, kv_len=kv_len, num_stages=num_stages,
                             page_size=page_size, swizzle=swizzle, interpret=interpret)
    rows = (gather_rows(table_ref, start_entry, first * BLOCK_KV, kv_len - 1,
                        page_size=page_size, swizzle=swizzle, interpret=interpret)
            if gathers(page_size) else 0)
    head = count if prepare is None and consume is None else jnp.minimum(count, num_stages)
    if gathers(page_size) and prepare is not None:
        prepare()
    rows = lax.fori_loop(0, head, fill, rows)
    if not gathers(page_size) and prepare is not None:
        prepare()
    if consume is None:
        lax.fori_loop(head, count, fill, rows)
    else:
        def step(i, rows):
            consume(i)
            return fill(i + num_stages, rows)

        rows = lax.fori_loop(0, count - head, step, rows)

        def last(i, rows):
            consume(i)
            return rows

        lax.fori_loop(count - head, count, last, rows)
    wait_last_releases((empty,), count, num_stages)
