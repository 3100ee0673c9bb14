"""How fast the Mosaic GPU decode kernels' producer streams a paged pool when nothing else runs:
a kernel with the decode kernels' grid (one block a sequence and split) and producer
(`mgpu_kv_copy.produce_tiles`: TMA tiles or pages, the `cp.async` row gather under 8 tokens a
page), whose consumer warpgroup only waits for each tile and releases its stage: the rate a
stage layout streams at with no work beside it. Layouts differ in the pool's dtype and width,
the stage swizzle (a TMA box row is `swizzle` bytes) and the stage count; layouts of the same
bytes side by side show what the layout costs. It bounds no kernel: on the H200 the 16-row fp8
kernel read faster than its own layout's stream (docs/decode_kernel.md, "fp8 KV").

    python -m bench.tma_stream --cases b128_ctx16k_p64,b32_ctx4k_p64 \\
        --layouts fp8_576_sw64_s4,bf16_576_sw128_s2,bf16_576_sw64_s2 --out out/

A layout is <dtype>_<width>_sw<swizzle>_s<stages>: fp8_576_sw64_s4 is the 16-row fp8 kernel's
(`decode_mgpu_fp8`), bf16_576_sw128_s2 the bf16 kernel's (`decode_mgpu`). A case is
b<batch>_ctx<k>k_p<page>, all sequences full, pages in random order; the split count is the
fp8 16-row kernel's rule for 16 heads (`decode_case.case_dispatch`), the same for every layout
of a case, so every layout runs the same grid. Device time per call is the kernel's median
duration from a profiler trace over calls on distinct pool copies (the L2 never holds the
working set). Writes out/tma_stream.json (rewritten after every case): per case and layout the
kernel's time, GB/s read and the copy ceiling's share.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re

__all__ = ["StreamLayout", "parse_layout", "parse_stream_case", "stream_call", "main"]

DEFAULT_CASES = "b128_ctx16k_p64,b128_ctx16k_p1,b32_ctx4k_p64"
DEFAULT_LAYOUTS = "fp8_576_sw64_s4,fp8_576_sw64_s6,fp8_512_sw64_s4,fp8_512_sw128_s4," \
                  "bf16_576_sw128_s2,bf16_576_sw64_s2"
# shared memory a block may take on Hopper (227 KB), less the stream kernel's own 64 bytes
_SMEM_BYTES = 227 * 1024 - 64
_ITEMSIZE = {"fp8": 1, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class StreamLayout:
    """A stage layout: pool dtype ("fp8" float8_e4m3fn or "bf16") and row width in elements,
    the stages' swizzle in bytes (32, 64 or 128) and their count."""

    dtype: str
    width: int
    swizzle: int
    stages: int

    @property
    def name(self) -> str:
        return f"{self.dtype}_{self.width}_sw{self.swizzle}_s{self.stages}"

    @property
    def stage_bytes(self) -> int:
        return 64 * self.width * _ITEMSIZE[self.dtype]


def parse_layout(text: str) -> StreamLayout:
    """"fp8_576_sw64_s4" -> StreamLayout("fp8", 576, 64, 4); raises ValueError naming what does
    not fit (the swizzle tile, the stages' shared memory)."""
    m = re.fullmatch(r"(fp8|bf16)_(\d+)_sw(\d+)_s(\d+)", text)
    if not m:
        raise ValueError(f"layout {text!r} is not <fp8|bf16>_<width>_sw<swizzle>_s<stages>")
    lay = StreamLayout(m[1], int(m[2]), int(m[3]), int(m[4]))
    tile_cols = lay.swizzle // _ITEMSIZE[lay.dtype]
    if lay.swizzle not in (32, 64, 128):
        raise ValueError(f"layout {text!r}: swizzle {lay.swizzle} is not 32, 64 or 128 bytes")
    if lay.width <= 0 or lay.width % tile_cols:
        raise ValueError(f"layout {text!r}: width {lay.width} is not a positive multiple of "
                         f"the swizzle tile's {tile_cols} columns")
    if lay.stages < 1 or lay.stages * lay.stage_bytes > _SMEM_BYTES:
        raise ValueError(f"layout {text!r}: {lay.stages} stages of {lay.stage_bytes} bytes "
                         f"do not fit {_SMEM_BYTES} bytes of shared memory")
    return lay


def parse_stream_case(text: str) -> tuple[int, int, int]:
    """"b128_ctx16k_p64" -> (batch 128, ctx 16384, page 64)."""
    m = re.fullmatch(r"b(\d+)_ctx(\d+)k_p(\d+)", text)
    if not m or min(int(m[1]), int(m[2]), int(m[3])) <= 0:
        raise ValueError(f"case {text!r} is not b<batch>_ctx<k>k_p<page> with positive "
                         f"numbers")
    return int(m[1]), int(m[2]) * 1024, int(m[3])


def _kernel(*refs, form: str, entries_per_seq: int | None, page_size: int, num_splits: int,
            lay: StreamLayout, interpret: bool):
    import jax.numpy as jnp
    from jax import lax
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from funcmla.attention.pallas.decode_common import (
        block_coords,
        seq_start_and_len,
        split_tile_range,
    )
    from funcmla.attention.pallas.mgpu_kv_copy import (
        BLOCK_KV,
        init_filled,
        produce_tiles,
        wait_filled,
    )

    n_meta = len(refs) - 4
    meta, (table_ref, kv_ref, o_ref, scratch) = refs[:n_meta], refs[n_meta:]
    stages, full, empty, o_stage = scratch
    blk = lax.axis_index("blk")
    b, split, _ = block_coords(blk, num_splits, 1)
    start_entry, kv_len = seq_start_and_len(form, meta, b, entries_per_seq)
    first, last = split_tile_range(kv_len, split, num_splits, BLOCK_KV)
    count = jnp.maximum(last - first, 0)
    init_filled(full, interpret=interpret)

    @pl.when(lax.axis_index("wg") == 1)
    def _producer():
        produce_tiles(kv_ref, table_ref, stages, full, empty, first=first, count=count,
                      start_entry=start_entry, kv_len=kv_len, num_stages=lay.stages,
                      page_size=page_size, swizzle=lay.swizzle, interpret=interpret)

    @pl.when(lax.axis_index("wg") == 0)
    def _consumer():
        def step(i, carry):
            wait_filled(full, i, num_stages=lay.stages, async_proxy=False, interpret=interpret)
            plgpu.barrier_arrive(empty.at[lax.rem(i, lay.stages)])
            return carry

        lax.fori_loop(0, count, step, 0)
        o_stage[...] = jnp.full(o_stage.shape, count, jnp.int32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_stage, o_ref.at[blk])
        plgpu.wait_smem_to_gmem(0)


def stream_call(pool, kv, *, num_splits: int, lay: StreamLayout, interpret: bool = False):
    """Streams every sequence's tiles of `pool` [slots, width] (described by `kv`, a
    `decode_common.KVRows`) through `lay`'s stages: one block a sequence and split, a producer
    and a consumer warpgroup. Returns int32 [blocks, 128], each row the block's tile count."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from funcmla.attention.pallas.mgpu_kv_copy import BLOCK_KV, filled_scratch
    from funcmla.attention.pallas.mgpu_ops import compiler_params, mgpu_params, swizzled

    blocks = kv.num_seqs * num_splits
    scratch = [
        plgpu.SMEM((lay.stages, BLOCK_KV, lay.width), pool.dtype,
                   transforms=swizzled(lay.swizzle, _ITEMSIZE[lay.dtype])),
        filled_scratch(kv.page_size, lay.stages),
        plgpu.Barrier(num_barriers=lay.stages),
        plgpu.SMEM((128,), jnp.int32),  # a warpgroup-wide store
    ]
    meta = kv.meta_operands()
    kernel = functools.partial(_kernel, form=kv.form, entries_per_seq=kv.entries_per_seq,
                               page_size=kv.page_size, num_splits=num_splits, lay=lay,
                               interpret=interpret)
    n_io = len(meta) + 3  # meta, table, pool; out
    call = plgpu.kernel(
        lambda *refs: kernel(*refs[:n_io], refs[n_io:]),
        out_type=jax.ShapeDtypeStruct((blocks, 128), jnp.int32),
        scratch_types=scratch,
        grid=(blocks,),
        grid_names=("blk",),
        num_threads=2,
        thread_name="wg",
        compiler_params=compiler_params(),
        interpret=mgpu_params(interpret),
        kernel_name=f"tma_stream_{lay.name}_ps{kv.page_size}",
    )
    return call(*meta, kv.table, pool)


def case_metadata(key, b: int, ctx: int, page_size: int):
    """(KVRows, slots) of b full sequences of ctx tokens, pages (or, at page 1, tokens) in a
    random order, pool row 0 unused (`decode_data.case_tables`, the decode benchmark's)."""
    from funcmla.attention.pallas.decode_common import kv_rows_from_csr, kv_rows_from_page_table

    from .decode_data import case_tables

    meta, slots, _ = case_tables(key, b, ctx, page_size)
    if page_size == 1:
        return kv_rows_from_csr(meta["kv_indptr"], meta["kv_indices"], ctx), slots
    return kv_rows_from_page_table(meta["page_table"]), slots


def _pool(key, slots: int, lay: StreamLayout):
    """Random bytes as a [slots, width] pool of the layout's dtype (nothing reads the values)."""
    import jax
    import jax.numpy as jnp

    if lay.dtype == "fp8":
        bits = jax.random.bits(key, (slots, lay.width), jnp.uint8)
        return jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
    bits = jax.random.bits(key, (slots, lay.width), jnp.uint16)
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def time_case(b: int, ctx: int, page_size: int, lay: StreamLayout, *, num_splits: int,
              reps: int) -> dict:
    """One case and layout: the stream kernel's median device time a call, GB/s read."""
    import jax

    from funcmla.attention.pallas.mgpu_kv_copy import BLOCK_KV

    from .decode_data import pool_copies_and_calls
    from .timing import device_kernel_times

    key = jax.random.PRNGKey(0)
    kv, slots = case_metadata(key, b, ctx, page_size)
    read = b * ctx * lay.width * _ITEMSIZE[lay.dtype]
    copies, calls = pool_copies_and_calls(read)
    pools = [_pool(jax.random.fold_in(key, c + 1), slots, lay) for c in range(copies)]
    f = jax.jit(functools.partial(stream_call, num_splits=num_splits, lay=lay))
    counts = jax.device_get(f(pools[0], kv))
    tiles = b * (-(-ctx // BLOCK_KV))
    if int(counts[:, 0].sum()) != tiles:  # every tile streamed once
        raise RuntimeError(f"{lay.name}: streamed {int(counts[:, 0].sum())} tiles, not {tiles}")

    def run():
        outs = [f(pools[i % copies], kv) for i in range(calls)]
        jax.block_until_ready(outs)

    stats = device_kernel_times(run, reps=reps)
    mine = [k for k in stats["kernels"] if "tma_stream" in k["name"]]
    us = mine[0]["median_us"]
    return dict(layout=lay.name, us=us, gb_s=read / us / 1e3, bytes=read,
                stage_bytes=lay.stage_bytes, stages=lay.stages, swizzle=lay.swizzle)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=DEFAULT_CASES, help="b<batch>_ctx<k>k_p<page>, ...")
    ap.add_argument("--layouts", default=DEFAULT_LAYOUTS,
                    help="<fp8|bf16>_<width>_sw<swizzle>_s<stages>, ...")
    ap.add_argument("--reps", type=int, default=3, help="traced runs of a case's calls")
    ap.add_argument("--out", default="out/")
    args = ap.parse_args(argv)
    cases = [(n, parse_stream_case(n)) for n in args.cases.split(",")]
    layouts = [parse_layout(t) for t in args.layouts.split(",")]

    from funcmla.attention.pallas import DecodeKernelConfig

    from .copy_ceiling import hbm_ceiling
    from .decode_case import case_dispatch
    from .report import log
    from .timing import environment, print_table, write_json

    ceiling = hbm_ceiling()
    info = dict(environment(), ceiling_gb_s=ceiling / 1e9, reps=args.reps)
    path = os.path.join(args.out, "tma_stream.json")
    rows, table = [], []
    for name, (b, ctx, page) in cases:
        splits = case_dispatch(16, b, ctx, page, DecodeKernelConfig(), fp8=True)[2]
        for lay in layouts:
            try:
                r = time_case(b, ctx, page, lay, num_splits=splits, reps=args.reps)
            except Exception as e:  # noqa: BLE001 - a layout that fails leaves the others
                log(f"{name} {lay.name}: {type(e).__name__}: {str(e)[:300]}")
                rows.append(dict(case=name, layout=lay.name, error=f"{type(e).__name__}: {e}"))
                continue
            r.update(case=name, batch=b, ctx=ctx, page_size=page, splits=splits,
                     ceiling_share=r["gb_s"] * 1e9 / ceiling)
            rows.append(r)
            table.append([name, lay.name, splits, r["us"], r["gb_s"], r["ceiling_share"]])
            log(f"{name} {lay.name}: {r['us']:.1f} us, {r['gb_s']:.0f} GB/s")
            write_json(path, dict(info=info, rows=rows))
    write_json(path, dict(info=info, rows=rows))
    print_table(f"TMA stream (copy ceiling {ceiling / 1e9:.0f} GB/s)",
                ["case", "layout", "splits", "us", "GB/s", "of ceiling"], table)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
