"""In-kernel phase profile of the Mosaic GPU decode kernels: where a block's cycles go.

Each case runs once per kernel with Mosaic GPU's profiler on (`MgpuDecodeConfig.profile_space`;
the kernels name their phases with `jax.named_scope`) and prints `bench.kernel_trace`'s
summary: per warpgroup the cycles a block spends in each phase (also per KV tile of the block),
the block span, the share of the kernel's wall time the SMs spend inside blocks and the gap
between blocks. Nothing is timed: the profiler's stores add cycles, so compare phases of one
trace, not spans against `bench.decode`'s times.

    python -m bench.decode_profile --cases h128_b128_ctx4k_p64 --kernels bf16,fp8,fp8-products \\
        --out out/

Kernels: "bf16" (`decode_mgpu`, bf16 pool), "fp8" (the fp8 Mosaic GPU kernel the dispatch rule
picks for the rows: `decode_mgpu_fp8_wide` at a multiple of 64, else `decode_mgpu_fp8`),
"fp8-products" (`decode_mgpu_fp8_wide` with `products="fp8"`). A block records about 6
regions a tile per warpgroup and the profiler holds `MAX_PROFILE_SPACE`, so a case whose split
rule leaves more than `max_profiled_tiles()` tiles in a block runs with more splits (reported
as `num_splits`); the per-tile figures do not depend on it. Writes out/decode_profile.json and
the traces under out/decode_profile/.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import decode_mgpu, decode_mgpu_fp8, decode_mgpu_fp8_wide
from funcmla.attention.pallas.api import DecodeKernelConfig, decode_num_splits, fp8_mgpu_kernel
from funcmla.attention.pallas.decode_common import kv_rows_from_csr, kv_rows_from_page_table
from funcmla.attention.pallas.decode_mgpu import MAX_PROFILE_SPACE, MgpuDecodeConfig
from funcmla.attention.pallas.mgpu_kv_copy import BLOCK_KV

from .decode_data import D, DV, SM_SCALE, make_case
from .decode_fp8 import KV_SCALE
from .kernel_ab import parse_case
from .kernel_trace import format_summary, profiled_summary

__all__ = ["KERNELS", "max_profiled_tiles", "profile_splits", "kernel_call", "unsupported",
           "main"]

KERNELS = ("bf16", "fp8", "fp8-products")
REGIONS_PER_TILE = 6  # the most named phases a warpgroup enters per KV tile
REGIONS_PER_BLOCK = 8  # and per block (q, finish, the stores)


def max_profiled_tiles(space: int = MAX_PROFILE_SPACE) -> int:
    """The most KV tiles a block may hold for its trace to fit `space` regions a warpgroup."""
    return (space - REGIONS_PER_BLOCK) // REGIONS_PER_TILE


def profile_splits(rule_splits: int, ctx: int, space: int = MAX_PROFILE_SPACE) -> int:
    """The split count a profiled case runs with: the split rule's, or more where a split
    would hold more than `max_profiled_tiles(space)` tiles."""
    tiles = -(-ctx // BLOCK_KV)
    return max(rule_splits, -(-tiles // max_profiled_tiles(space)))


def kernel_call(kernel: str, h: int):
    """(module, extra decode_call arguments, pool is fp8) of a kernel name of `KERNELS` at h
    heads (s_q 1)."""
    if kernel == "bf16":
        return decode_mgpu, {}, False
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    products = "fp8" if kernel == "fp8-products" else "mixed"
    module = fp8_mgpu_kernel(h, DecodeKernelConfig(fp8_products=products))  # mla_decode's rule
    return module, ({"products": products} if products == "fp8" else {}), True


def unsupported(kernel: str, h: int, page: int) -> str | None:
    """Why `kernel` does not take h heads (s_q 1) at this page size, or None."""
    module, _, fp8 = kernel_call(kernel, h)
    if module is decode_mgpu:
        return decode_mgpu.mgpu_decode_supported(h, page, D, DV, jnp.bfloat16)
    check = (decode_mgpu_fp8_wide.fp8_wide_supported if module is decode_mgpu_fp8_wide
             else decode_mgpu_fp8.fp8_narrow_supported)
    return check(h, page, D, DV, jnp.bfloat16, jnp.float8_e4m3fn)


def profile_case(case: str, kernel: str, out_dir: str, clock_ghz: float) -> dict:
    """One profiled call of `kernel` on `case` (h<H>_b<B>_ctx<k>k_p<page>): its trace summary."""
    h, b, ctx, page = parse_case(case)
    module, extra, fp8 = kernel_call(kernel, h)
    why = unsupported(kernel, h, page)
    if why is not None:
        raise ValueError(f"{module.__name__.rsplit('.', 1)[1]} does not take {case}: {why}")
    pools, qs, meta, _ = make_case(jax.random.key(1), b, h, ctx, page, 1, 1, 1,
                                   kv_scale=KV_SCALE if fp8 else None)
    if page == 1:
        kv = kv_rows_from_csr(meta["kv_indptr"], meta["kv_indices"], ctx)
    else:
        kv = kv_rows_from_page_table(meta["page_table"])
    rule = decode_num_splits(DecodeKernelConfig(), b, h, ctx, mgpu=True, kv_fp8=fp8)
    splits = profile_splits(rule, ctx)
    trace_dir = os.path.join(out_dir, "decode_profile", f"{case}_{kernel}")
    config = MgpuDecodeConfig(profile_space=MAX_PROFILE_SPACE, profile_dir=trace_dir)
    if fp8:
        scale = jnp.full((1,), KV_SCALE, jnp.float32)
        extra = dict(extra, k_scale=scale, v_scale=scale)
    fn = jax.jit(lambda q, pool: module.decode_call(
        q, pool, kv, sm_scale=SM_SCALE, s_q=1, num_splits=splits, config=config, **extra))
    profiled = profiled_summary(lambda: jax.block_until_ready(fn(qs[0], pools[0])), trace_dir,
                                clock_ghz=clock_ghz)
    if profiled is None:
        raise RuntimeError(f"{case} {kernel}: no trace written under {trace_dir}")
    summary, trace = profiled
    tiles = -(-ctx // BLOCK_KV) / splits
    return dict(case=case, kernel=kernel, module=module.__name__.rsplit(".", 1)[1],
                num_splits=splits, rule_splits=rule, tiles_per_block=tiles, trace=trace,
                **summary)


def format_per_tile(row: dict) -> str:
    """Each warpgroup's phases in cycles per KV tile (a block's cycles over its tiles)."""
    tiles = row["tiles_per_block"]
    lines = [f"  per tile ({tiles:.1f} tiles a block):"]
    for wg, w in row["warpgroups"].items():
        parts = ", ".join(f"{n} {p['cycles_per_block'] / tiles:.0f}"
                          for n, p in w["phases"].items())
        lines.append(f"    wg{wg}: {w['span_cycles'] / tiles:.0f} a tile: {parts}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="h128_b128_ctx1k_p64,h128_b32_ctx4k_p64",
                    help="comma-separated h<H>_b<B>_ctx<k>k_p<page>")
    ap.add_argument("--kernels", default=",".join(KERNELS),
                    help=f"comma-separated, of {', '.join(KERNELS)}")
    ap.add_argument("--clock-ghz", type=float, default=1.755,
                    help="SM clock for block ends (cycles to ns)")
    ap.add_argument("--out", default="out")
    args = ap.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    for k in kernels:
        kernel_call(k, 128)  # names an unknown kernel before anything runs
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        parse_case(c)
    os.makedirs(args.out, exist_ok=True)
    rows, errors = [], {}

    def save():
        with open(os.path.join(args.out, "decode_profile.json"), "w") as f:
            json.dump(dict(device=str(jax.devices()[0]), rows=rows, errors=errors), f,
                      indent=1)

    for case in cases:
        for kernel in kernels:
            try:
                row = profile_case(case, kernel, args.out, args.clock_ghz)
            except Exception as e:  # noqa: BLE001 - keep the other cases running
                errors[f"{case} {kernel}"] = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"{case} {kernel}: {errors[f'{case} {kernel}']}", flush=True)
            else:
                print(f"{case} {kernel} ({row['module']}, {row['num_splits']} splits):\n"
                      f"{format_summary(row)}\n{format_per_tile(row)}", flush=True)
                rows.append(row)
            save()
    return 1 if errors and not rows else 0


if __name__ == "__main__":
    raise SystemExit(main())
