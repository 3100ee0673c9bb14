"""Benchmark of the Pallas paged MLA decode kernel (funcmla.attention.pallas) on one GPU.

Measures, in one process:
  * the HBM ceiling: a 4 GiB device-to-device copy (bytes read + written);
  * an XLA baseline: jnp gather of the KV rows + einsum softmax einsum, under jit;
  * the kernel, over heads {16, 128} x batch {1, 32, 128} x context {1k, 4k, 16k} x page size
    {1, 64} (--quick: context 4k only), random data, several pool copies so L2 (60 MB) never
    holds the working set.

Timing, two views of each case (and of the XLA baseline):
  * wall: one jitted function runs `mla_decode` (decode kernel + merge kernel when split) `n`
    times on distinct (q, pool copy) pairs, so XLA cannot merge the calls; its wall time (after
    a warm-up, synchronised) / n, median over `--reps` (n >= 8; 32 for small cases);
  * device (the headline; skip: --no-profile): the same compiled function run twice more under
    a jax.profiler trace (CUPTI): the device span per call (first kernel start to last kernel
    end of a run, / n: the GPU time per call when calls are issued back to back, gaps between
    kernels included) and the median duration of the decode and merge kernels.
On the H200 machine the wall clock of one run of the jit carries ~0.4-1 ms of host work before
and after its kernels (the GPU idles then; docs/decode_kernel.md), i.e. 50-120 us per call
at n = 8: the wall clock measures that, not the kernel, for every case below ~1 ms per call.
Options: --kernel-alone (the decode kernel alone, `mla_decode_rows`, wall clock),
--merge-alone (the merge kernel alone on partials of the kernel's shape), --partial-dtype
float32 (the grid with float32 split partials; the default is bfloat16,
`DecodeKernelConfig.partial_dtype`).

Reports time, GB/s (bytes = B*ctx*576*2 + q + out), % of the copy ceiling, TFLOP/s
(2*B*H*ctx*(576+512)), the ratio to the XLA baseline (device span to device span; wall to wall
as well), and the relative error against a float32 reference (Precision.HIGHEST). --check runs
a correctness sweep first (s_q 1..4, page sizes 1/16/64, varying lengths with zero-length
sequences, NaN in unused pool rows), --big-pool checks addressing past 2**31 / 576 slots,
--torch measures the torch -> DLPack -> kernel -> torch per-call host overhead, --variants times
tiling variants on the target cases by device time (the default is replaced only by a variant
>= 3% faster) and the merge kernel's output tiles, and runs the grid with the chosen configs.
--time-limit / --variants-time-limit bound one call (the grid runs the target cases first).
Writes decode.json and decode.png under --out, and ends with the decode targets judged on the
grid (`bench.decode_targets`). --kv-dtype fp8 runs the fp8 KV grid instead (`bench.decode_fp8`:
each case with a bf16 pool and a float8_e4m3fn pool in the same run; error against float32
over the dequantized cache), saved as decode_fp8.json.

This module is the command line and the grid's order; the parts: `bench.decode_data` (cases),
`bench.decode_reference` (XLA baseline, references), `bench.decode_timing` (wall clock, device
time), `bench.copy_ceiling`, `bench.decode_case` (one timed case), `bench.decode_checks`,
`bench.decode_variants`, `bench.decode_torch_shim`, `bench.decode_report`, `bench.decode_fp8`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

import jax
import numpy as np

from funcmla.attention.pallas import DecodeKernelConfig

from .copy_ceiling import hbm_ceiling, torch_copy_ceiling
from .decode_case import bench_case, fmt_case
from .decode_checks import big_pool_check, correctness_sweep
from .decode_data import D, DV, SM_SCALE, make_case
from .decode_reference import HI, np_reference, rel_err, xla_decode
from .decode_report import dump, plot, print_table
from .decode_targets import case_label, print_verdicts, target_verdicts
from .decode_timing import (
    MARK,
    Timing,
    device_stats,
    profile_timings,
    time_calls,
    trace_device_events,
)
from .decode_torch_shim import torch_overhead
from .decode_variants import merge_tiles, variant_sweep
from .report import log

__all__ = [
    "D", "DV", "SM_SCALE", "HI", "MARK", "GRID_ORDER_NOTE", "Timing", "log", "make_case",
    "xla_decode", "rel_err", "np_reference", "time_calls", "trace_device_events",
    "device_stats", "profile_timings", "hbm_ceiling", "torch_copy_ceiling",
    "correctness_sweep", "big_pool_check", "bench_case", "fmt_case", "torch_overhead",
    "print_table", "plot", "dump", "grid_cases", "variant_sweep", "merge_tiles", "main",
]


GRID_ORDER_NOTE = ("grid order: target cases first (B >= 32 ctx 4k, batch 1 ctx 4k, B >= 32 "
                   "ctx 16k), then the rest, so a time limit drops non-target cases first")


def grid_cases(ctxs: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
    """(h, b, ctx, page_size) in priority order (see GRID_ORDER_NOTE)."""
    allc = [(h, b, c, page_size) for h in (16, 128) for b in (1, 32, 128) for c in ctxs
            for page_size in (1, 64)]
    t4k = [x for x in allc if x[1] >= 32 and x[2] == 4096]
    b1 = [x for x in allc if x[1] == 1 and x[2] == 4096]
    t16k = [x for x in allc if x[1] >= 32 and x[2] > 4096]
    rest = [x for x in allc if x not in t4k + b1 + t16k]
    return t4k + b1 + t16k + rest


def main(argv: list[str] | None = None) -> int:
    """The benchmark (options: --help); exit status 0 when every check passed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true", help="context 4k only")
    ap.add_argument("--check", action="store_true", help="correctness sweep first")
    ap.add_argument("--big-pool", action="store_true", help="addressing past 2**31/576 slots")
    ap.add_argument("--torch", action="store_true", help="torch shim overhead")
    ap.add_argument("--variants", action="store_true", help="tiling variants on target cases")
    ap.add_argument("--no-grid", action="store_true", help="skip the main grid")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds: start no new case after this (results so far are kept)")
    ap.add_argument("--variants-time-limit", type=float, default=None,
                    help="seconds from the start: start no new variant after this")
    ap.add_argument("--kernel-alone", action="store_true",
                    help="grid: also time the decode kernel alone (wall clock)")
    ap.add_argument("--merge-alone", action="store_true",
                    help="grid: also time the merge kernel alone")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the device-time (CUPTI) trace; the headline is then wall clock")
    ap.add_argument("--only", metavar="REGEX",
                    help="grid and fp8 grid: run only the cases whose label ('H128 B1 L16384 p64') "
                    "matches")
    ap.add_argument("--partial-dtype", choices=("float32", "bfloat16"),
                    default=DecodeKernelConfig().partial_dtype,
                    help="grid: storage of the split partials (DecodeKernelConfig.partial_dtype)")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the fp8 KV grid (bench.decode_fp8), bf16 and fp8 pools per case")
    ap.add_argument("--fp8-variants", action="store_true",
                    help="--kv-dtype fp8: also time the Triton tilings of "
                    "bench.decode_fp8.FP8_VARIANTS")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    deadline = math.inf if args.time_limit is None else t_start + args.time_limit
    os.makedirs(args.out, exist_ok=True)
    results = dict(device=str(jax.devices()[0]), jax=jax.__version__, argv=sys.argv[1:],
                   defaults={"16": dataclasses.asdict(DecodeKernelConfig()),
                             "128": dataclasses.asdict(DecodeKernelConfig())})
    log(f"jax {jax.__version__} on {jax.devices()[0]}")
    ok = True
    rng = np.random.default_rng(0)
    if args.check:
        ok &= correctness_sweep(rng, results)
    if args.big_pool:
        ok &= big_pool_check(results)
    if args.torch:
        try:
            torch_overhead(results)
        except Exception as e:  # report, keep benchmarking
            log(f"   torch shim failed: {type(e).__name__}: {e}")
            results["torch_shim"] = dict(error=f"{type(e).__name__}: {e}")
    dump(results, args.out)
    jax_ceiling = hbm_ceiling()
    try:
        torch_ceiling = torch_copy_ceiling()
    except Exception as e:  # torch without CUDA
        log(f"   torch copy failed: {e}")
        torch_ceiling = None
    ceiling = max(jax_ceiling, torch_ceiling or 0.0)
    results["hbm_ceiling_gbps"] = ceiling / 1e9
    results["copy_jax_gbps"] = jax_ceiling / 1e9
    results["copy_torch_gbps"] = None if torch_ceiling is None else torch_ceiling / 1e9
    log(f"== HBM copy ceiling {ceiling / 1e9:.0f} GB/s (jax {jax_ceiling / 1e9:.0f}, torch "
        f"{(torch_ceiling or 0) / 1e9:.0f})")

    key = jax.random.PRNGKey(0)
    rows = []
    tuned = {}
    if args.variants:
        v_deadline = (deadline if args.variants_time_limit is None
                      else min(deadline, t_start + args.variants_time_limit))
        tuned = variant_sweep(key, ceiling, results, v_deadline)
        dump(results, args.out)
    if args.kv_dtype == "fp8":
        from bench.decode_fp8 import fp8_grid

        ok &= fp8_grid(key, ceiling, args, results, deadline, bench_case, fmt_case)
        results["wall_s"] = time.perf_counter() - t_start
        with open(os.path.join(args.out, "decode_fp8.json"), "w") as f:
            json.dump(results, f, indent=1)
        log("OK" if ok else "SOME CHECKS FAILED")
        return 0 if ok else 1
    if not args.no_grid:
        log("== grid (" + GRID_ORDER_NOTE + ")")
        ctxs = (4096,) if args.quick else (1024, 4096, 16384)
        skipped = []
        only = None if args.only is None else re.compile(args.only)
        for i, (h, b, ctx, page_size) in enumerate(grid_cases(ctxs)):
            if only is not None and not only.search(case_label(h, b, ctx, page_size)):
                continue
            if time.perf_counter() > deadline:
                skipped.append((h, b, ctx, page_size))
                continue
            cfg = dataclasses.replace(tuned.get(h, DecodeKernelConfig()),
                                      partial_dtype=args.partial_dtype)
            try:
                r = bench_case(jax.random.fold_in(key, i), h, b, ctx, page_size, ceiling, args.reps,
                               cfg, profile=not args.no_profile,
                               kernel_only=args.kernel_alone, merge_alone=args.merge_alone)
            except Exception as e:  # noqa: BLE001
                log(f"   {case_label(h, b, ctx, page_size)}: FAILED {type(e).__name__}: {e}")
                ok = False
                continue
            rows.append(r)
            results["grid"] = rows
            dump(results, args.out)
            log("   " + fmt_case(r))
        if skipped:
            log(f"   time limit: {len(skipped)} cases not run: {skipped}")
        results["grid_skipped"] = skipped
        results["grid"] = rows
    results["wall_s"] = time.perf_counter() - t_start
    dump(results, args.out)
    if rows:
        plot(rows, os.path.join(args.out, "decode.png"))
        print_table(rows, f"paged MLA decode (ceiling {ceiling / 1e9:.0f} GB/s)")
        results["targets"] = target_verdicts(rows)
        dump(results, args.out)
        log("== targets")
        print_verdicts(results["targets"], log)
    log("OK" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
