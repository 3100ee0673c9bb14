"""The decode kernels' dispatch rules (`DecodeKernelConfig.mgpu_min_blocks`, and
`fp8_mgpu_min_seqs` with --kv-dtype fp8) measured: each case run on the Triton kernel and on the
Mosaic GPU kernel in one process, device time per call (decode + merge,
`bench.decode.bench_case`), at the batch sizes around the rule's threshold.

Cases: 128 heads (s_q 1: 2 blocks of 64 rows per sequence) at batch 1-16 and 16 heads with
s_q 4 (MTP verify: 1 block per sequence) at batch 4-32, contexts 4k and 16k, page 64 (page 1
where marked). fp8 (`FP8_CASES`): 16 heads, a float8_e4m3fn pool read with k_scale = v_scale
= `bench.decode_fp8.KV_SCALE`, batch 1-32 at 4k (1 also at 1k and 16k), pages 1 and 64. The
rule is right where "auto" picks the faster kernel in every case; the table prints each case's
blocks, both times and the auto pick.

    python -m bench.decode_dispatch --out out/                   # out/decode_dispatch.json
    python -m bench.decode_dispatch --kv-dtype fp8 --out out/    # out/decode_fp8_dispatch.json
"""

from __future__ import annotations

import argparse
import os
import re
import time

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import DecodeKernelConfig
from funcmla.attention.pallas.api import kernel_choice

from .decode import bench_case
from .decode_fp8 import KV_SCALE
from .timing import environment, write_json

# (heads, batch, ctx, page_size, s_q)
CASES = (
    (128, 1, 4096, 64, 1), (128, 2, 4096, 64, 1), (128, 3, 4096, 64, 1),
    (128, 4, 4096, 64, 1), (128, 8, 4096, 64, 1), (128, 16, 4096, 64, 1),
    (128, 2, 16384, 64, 1), (128, 8, 16384, 64, 1), (128, 16, 16384, 64, 1),
    (128, 1, 4096, 1, 1), (128, 2, 4096, 1, 1), (128, 16, 4096, 1, 1),
    (16, 4, 4096, 64, 4), (16, 8, 4096, 64, 4), (16, 32, 4096, 64, 4),
)
FP8_CASES = tuple((16, b, ctx, page_size, 1)
                  for b, ctx in ((1, 1024), (1, 4096), (1, 16384), (2, 4096), (4, 4096),
                                 (8, 4096), (16, 4096), (32, 4096))
                  for page_size in (1, 64))


def case_name(h: int, b: int, ctx: int, page_size: int, s_q: int) -> str:
    return f"H{h} B{b} L{ctx} p{page_size} s_q{s_q}"


def dispatch_rows(cases=CASES, *, reps: int = 3, deadline: float | None = None,
                  log=print, kv_scale: float | None = None) -> list[dict]:
    """One row per (case, kernel): device us per call, splits, error vs float32, the blocks of
    64 rows and what "auto" picks for them. kv_scale: an fp8 pool (`bench_case`'s)."""
    key = jax.random.PRNGKey(1)
    rows = []
    for h, b, ctx, page_size, s_q in cases:
        blocks = b * (s_q * h // 64)
        q = jax.ShapeDtypeStruct((b * s_q, h, 576), jnp.bfloat16)
        kv_dtype = None if kv_scale is None else jnp.float8_e4m3fn
        pick = kernel_choice(DecodeKernelConfig(), q, page_size, s_q, kv_dtype=kv_dtype)[0]
        for kernel in ("triton", "mgpu"):
            if deadline is not None and time.perf_counter() > deadline:
                log(f"{case_name(h, b, ctx, page_size, s_q)} {kernel}: time limit, not run")
                continue
            r = bench_case(key, h, b, ctx, page_size, 1.0, reps,
                           DecodeKernelConfig(kernel=kernel), baseline=False, s_q=s_q,
                           kv_scale=kv_scale)
            row = dict(heads=h, batch=b, ctx=ctx, page_size=page_size, s_q=s_q, blocks=blocks,
                       kernel=kernel, auto_pick=pick, time_us=r["time_us"],
                       num_splits=r["num_splits"], rel_err=r["rel_err"])
            rows.append(row)
            log(f"{case_name(h, b, ctx, page_size, s_q)} ({blocks} blocks, auto {pick}) "
                f"{kernel}: {r['time_us']:.1f} us, {r['num_splits']} splits, "
                f"err {r['rel_err']:.1e}")
    return rows


def verdicts(rows: list[dict]) -> list[dict]:
    """Per case with both kernels timed: the faster kernel and whether "auto" picks it."""
    by_case: dict[tuple, dict] = {}
    for r in rows:
        by_case.setdefault((r["heads"], r["batch"], r["ctx"], r["page_size"], r["s_q"]),
                           {})[r["kernel"]] = r
    out = []
    for case, kernels in by_case.items():
        if len(kernels) < 2:
            continue
        fast = min(kernels.values(), key=lambda r: r["time_us"])
        out.append(dict(case=case, blocks=fast["blocks"], triton_us=kernels["triton"]["time_us"],
                        mgpu_us=kernels["mgpu"]["time_us"], faster=fast["kernel"],
                        auto_pick=fast["auto_pick"], auto_right=fast["kernel"] == fast["auto_pick"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds for the cases")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="fp8: the FP8_CASES on a float8_e4m3fn pool (fp8_mgpu_min_seqs)")
    ap.add_argument("--only", metavar="REGEX", default=None,
                    help="cases whose name (H128 B1 L4096 p64 s_q1, ...) matches REGEX")
    args = ap.parse_args(argv)
    deadline = None if args.time_limit is None else time.perf_counter() + args.time_limit
    fp8 = args.kv_dtype == "fp8"
    cases = [c for c in (FP8_CASES if fp8 else CASES)
             if args.only is None or re.search(args.only, case_name(*c))]
    rows = dispatch_rows(cases, reps=args.reps, deadline=deadline,
                         kv_scale=KV_SCALE if fp8 else None)
    judged = verdicts(rows)
    print("case (H, B, ctx, page, s_q) | blocks | triton us | mgpu us | faster | auto")
    for v in judged:
        print(f"{v['case']} | {v['blocks']} | {v['triton_us']:.1f} | {v['mgpu_us']:.1f} | "
              f"{v['faster']} | {v['auto_pick']}{'' if v['auto_right'] else ' (WRONG)'}")
    name = "decode_fp8_dispatch.json" if fp8 else "decode_dispatch.json"
    path = write_json(os.path.join(args.out, name),
                      dict(benchmark="decode_dispatch", env=environment(), kv_dtype=args.kv_dtype,
                           mgpu_min_blocks=DecodeKernelConfig().mgpu_min_blocks,
                           fp8_mgpu_min_seqs=DecodeKernelConfig().fp8_mgpu_min_seqs, rows=rows,
                           verdicts=judged))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
