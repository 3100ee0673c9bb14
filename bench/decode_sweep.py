"""Tiling / split sweep of the Triton-lowered decode kernel with CUPTI device times (one GPU
call): the measurements behind `DecodeKernelConfig`'s Triton defaults (block_kv, num_stages,
num_warps, block_m) and the split rule's choices (docs/decode_kernel.md, "Knobs").

For each case (heads, batch, ctx, page size) the data (pool copies, q, metadata) and the float32
reference are made once; then every candidate (DecodeKernelConfig, num_splits) is

  * compiled as one jit of `n` `mla_decode` calls on distinct (q, pool copy) pairs and timed by
    wall clock (median of `--reps`, as `bench.decode` does);
  * checked: the first call's output against the float32 reference (relative error, lse error);
  * profiled: all candidates of a case run once more inside one jax.profiler trace, separated by
    a marker kernel; per candidate the median CUPTI duration of the decode kernel and of the
    merge kernel, their sum per call, and the device span per call (first kernel start to last
    kernel end of one jit run / n: the device time a caller of n back-to-back calls sees,
    host gaps included).

Also: the HBM copy ceiling (`bench.copy_ceiling`) and the per-launch host floor (a jit of 32
launches of a tiny Pallas kernel). Writes sweep.json under --out after every case.

    python -m bench.decode_sweep --out out/ --time-limit 250
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from .copy_ceiling import hbm_ceiling, torch_copy_ceiling
from .decode_data import D, DV, SM_SCALE, make_case, pool_copies_and_calls
from .decode_reference import f32_reference, rel_err
from .decode_timing import MARK, device_stats, marker_jit, trace_device_events
from .report import log
from .timing import wall_times_s
from funcmla.attention.pallas import DecodeKernelConfig, mla_decode
from funcmla.attention.pallas.decode_common import (
    choose_num_splits,
    num_row_blocks,
)


def C(**fields) -> DecodeKernelConfig:  # noqa: N802 - the sweep's short name for a config
    """A Triton-kernel config (the sweep times the Triton tiling at 128 heads too)."""
    return DecodeKernelConfig(kernel="triton", **fields)


INTERPRET = False  # --dry: Pallas interpret mode (CPU), tiny cases


def segment_stats(evs, n_calls: int, runs: int) -> dict:
    """device_us = decode + merge kernel medians + the memsets per call; busy_us = every
    device activity per call; span as bench.decode."""
    st = device_stats(evs, n_calls, runs) or dict(span_us=0.0, decode_us=0.0, merge_us=0.0,
                                                   memset_us=0.0, memsets_per_call=0.0,
                                                   busy_us=0.0, kernels_per_call=0.0,
                                                   kernels=[])
    return dict(decode_us=st["decode_us"], merge_us=st["merge_us"], memset_us=st["memset_us"],
                memsets_per_call=st["memsets_per_call"], busy_us=st["busy_us"],
                activities_per_call=st["kernels_per_call"],
                device_us=st["decode_us"] + st["merge_us"] + st["memset_us"],
                span_us_per_call=st["span_us"], kernels=st["kernels"])


def _mark(x):
    return marker_jit(x, INTERPRET)


def host_floor(n=32, reps=5) -> float:
    """Wall seconds per launch of a jit of n tiny Pallas launches (the host's dispatch floor)."""
    xs = [jnp.full((16, 128), float(i), jnp.float32) for i in range(n)]
    f = jax.jit(lambda a: [_mark(x) for x in a])
    ts = wall_times_s(lambda: jax.block_until_ready(f(xs)), reps=reps, warmup=1)
    return statistics.median([t / n for t in ts])


def _bitwise_runs(jf, args, want, got, repeat: int) -> dict:
    """Calls (of 1 + repeat runs of jf) whose out and lse equal `want`'s bit for bit."""
    def same(a, b):
        return bool(jnp.array_equal(a, b))

    total = equal = 0
    for k in range(repeat + 1):
        res = got if k == 0 else jax.block_until_ready(jf(args))
        for (o1, l1), (o2, l2) in zip(want, res):
            total += 1
            equal += same(o1, o2) and same(l1, l2)
    return dict(calls=total, equal=equal)


def run_case(key, h, b, ctx, page_size, variants, reps, ceiling, deadline, prof_runs: int = 2):
    kv_bytes = b * ctx * D * 2
    copies, n = pool_copies_and_calls(kv_bytes)
    pools, qs, meta, slot_mat = make_case(key, b, h, ctx, page_size, 1, copies, n)
    ref_o, ref_l = f32_reference(qs[0], pools[0], slot_mat, 1)
    args = [(qs[i], pools[i % copies], meta) for i in range(n)]
    mkl = dict(max_kv_len=ctx) if page_size == 1 else {}
    nbytes = kv_bytes + qs[0].size * 2 + b * h * DV * 2
    flops = 2 * b * h * ctx * (D + DV)
    out, fns = [], []
    first_res = {}  # split count -> the first variant's n results with it (bitwise checks)
    for variant in variants:
        name, cfg, ns = variant
        if time.perf_counter() > deadline:
            log(f"   (time limit) skipped H{h} B{b} L{ctx} p{page_size} {name}")
            continue
        bm = cfg.resolved_block_m(h)
        rule = choose_num_splits(b, num_row_blocks(h, bm), ctx, cfg, bm)
        ns_eff = rule if ns is None else ns
        kern = (lambda c, s: lambda q, p, m: mla_decode(
            q, p, **m, **mkl, sm_scale=SM_SCALE, num_splits=s, config=c,
            interpret=INTERPRET))(cfg, ns_eff)
        jf = jax.jit(lambda all_args, k=kern: [k(*a) for a in all_args])
        r = dict(variant=name, heads=h, batch=b, ctx=ctx, page_size=page_size, num_splits=ns_eff,
                 rule_splits=rule, block_m=bm, block_kv=cfg.block_kv,
                 num_warps=cfg.resolved_num_warps(bm), num_stages=cfg.resolved_num_stages(bm),
                 config=dataclasses.asdict(cfg), calls=n, copies=copies)
        try:
            t0 = time.perf_counter()
            res = jax.block_until_ready(jf(args))
            r["compile_s"] = time.perf_counter() - t0
            o, lse = res[0]
            r["rel_err"] = rel_err(o, ref_o)
            r["lse_max_abs_err"] = float(jnp.max(jnp.abs(lse - ref_l)))
            if ns_eff not in first_res:
                first_res[ns_eff] = res
            else:
                # same split count as an earlier variant: how many calls' out and lse are
                # bit-identical to it, on `repeat` more runs too
                r["bitwise_vs_first"] = _bitwise_runs(jf, args, first_res[ns_eff], res,
                                                      repeat=6)
            del res, o, lse
            ts = [t / n for t in wall_times_s(lambda jf=jf: jax.block_until_ready(jf(args)),
                                              reps=reps, warmup=0)]
            t = statistics.median(ts)
            r.update(wall_us=t * 1e6, wall_us_min=min(ts) * 1e6, wall_us_max=max(ts) * 1e6,
                     wall_pct_ceiling=100 * nbytes / t / ceiling)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a result
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            log(f"   {name}: FAILED {r['error']}")
            out.append(r)
            continue
        out.append(r)
        fns.append((r, jf))
    # device times: every compiled variant `prof_runs` more runs, separated by a marker kernel
    x = jnp.zeros((16, 128), jnp.float32)
    jax.block_until_ready(_mark(x))

    def body():
        for _, jf in fns:
            jax.block_until_ready(_mark(x))
            for _ in range(prof_runs):
                jax.block_until_ready(jf(args))
        jax.block_until_ready(_mark(x))

    try:
        evs = trace_device_events(body)
    except Exception as e:  # noqa: BLE001
        log(f"   trace failed: {type(e).__name__}: {str(e)[:300]}")
        evs = []
    marks = [i for i, e in enumerate(evs) if MARK in e[2]]
    for k, (r, _) in enumerate(fns):
        if k + 1 < len(marks):
            seg = [e for e in evs[marks[k] + 1:marks[k + 1]] if MARK not in e[2]]
            st = segment_stats(seg, n, prof_runs)
            r.update(st)
            if st["device_us"] > 0:
                r["device_pct_ceiling"] = 100 * nbytes / (st["device_us"] * 1e-6) / ceiling
                r["device_tflops"] = flops / (st["device_us"] * 1e-6) / 1e12
                r["span_pct_ceiling"] = 100 * nbytes / (st["span_us_per_call"] * 1e-6) / ceiling
    for r in out:
        if "error" in r:
            continue
        log(f"   H{h} B{b} L{ctx} p{page_size} {r['variant']:>14} ns={r['num_splits']:>3} "
            f"(rule {r['rule_splits']}): wall {r['wall_us']:7.1f} us "
            f"({r['wall_pct_ceiling']:4.1f}%)"
            f" | device dec {r.get('decode_us', 0):7.1f} + merge {r.get('merge_us', 0):5.1f} = "
            f"{r.get('device_us', 0):7.1f} us ({r.get('device_pct_ceiling', 0):4.1f}%, "
            f"{r.get('device_tflops', 0):5.1f} TF) span {r.get('span_us_per_call', 0):7.1f} "
            f"memset {r.get('memset_us', 0):.2f} busy {r.get('busy_us', 0):.1f} | "
            f"err {r['rel_err']:.1e} | bitwise {r.get('bitwise_vs_first', '-')} | "
            f"compile {r['compile_s']:.1f}s")
    del pools, qs, ref_o, ref_l, args, fns, first_res
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=250.0)
    ap.add_argument("--dry", action="store_true", help="CPU interpret mode, tiny cases")
    a = ap.parse_args(argv)
    global INTERPRET
    INTERPRET = a.dry
    t_start = time.perf_counter()
    deadline = t_start + a.time_limit
    os.makedirs(a.out, exist_ok=True)
    res = dict(jax=jax.__version__, device=str(jax.devices()[0]), cases=[])

    def dump():
        res["wall_s"] = time.perf_counter() - t_start
        with open(os.path.join(a.out, "sweep.json"), "w") as f:
            json.dump(res, f, indent=1)

    res["host_floor_us_per_launch"] = host_floor() * 1e6
    log(f"host floor: {res['host_floor_us_per_launch']:.1f} us per launch (jit of 32 tiny)")
    cj = hbm_ceiling(gib=0.01 if a.dry else 4.0, reps=5)
    try:
        ct = None if a.dry else torch_copy_ceiling(reps=5)
    except Exception:  # noqa: BLE001
        ct = None
    ceiling = max(cj, ct or 0.0)
    res.update(copy_jax_gbps=cj / 1e9, copy_torch_gbps=None if ct is None else ct / 1e9,
               ceiling_gbps=ceiling / 1e9)
    log(f"ceiling {ceiling / 1e9:.0f} GB/s (jax {cj / 1e9:.0f}, torch {(ct or 0) / 1e9:.0f})")
    dump()
    w4s5, w8s5, w8s3, w4s3 = (C(), C(num_warps=8, num_stages=5), C(num_warps=8, num_stages=3),
                              C(num_stages=3))
    cases = [
        ((16, 32, 4096, 1), [("w4s5", w4s5, 4), ("w4s5", w4s5, 8), ("w8s5", w8s5, 2),
                             ("w8s5", w8s5, 4), ("w8s5", w8s5, 8), ("w8s3", w8s3, 4),
                             ("w8s3", w8s3, 8), ("w8s3", w8s3, 16), ("w4s3", w4s3, 8),
                             ("w8kv128s3", C(num_warps=8, num_stages=3, block_kv=128), 4)]),
        ((16, 128, 4096, 1), [("w4s5", w4s5, 1), ("w8s5", w8s5, 1), ("w8s5", w8s5, 2),
                              ("w8s3", w8s3, 1), ("w8s3", w8s3, 2), ("w4s3", w4s3, 2)]),
        ((16, 32, 4096, 64), [("w4s5", w4s5, 4), ("w8s5", w8s5, 4), ("w8s5", w8s5, 8),
                              ("w8s3", w8s3, 8)]),
        ((16, 1, 4096, 1), [("w4s5", w4s5, 64), ("w4s5", w4s5, 32), ("w8s5", w8s5, 64),
                            ("w8s5", w8s5, 32), ("w8s3", w8s3, 64)]),
        ((16, 128, 4096, 64), [("w4s5", w4s5, 1), ("w8s5", w8s5, 1), ("w8s3", w8s3, 1),
                               ("w8s3", w8s3, 2)]),
        ((16, 32, 16384, 1), [("w4s5", w4s5, 4), ("w8s5", w8s5, 4), ("w8s5", w8s5, 8),
                              ("w8s3", w8s3, 8)]),
        ((16, 128, 16384, 1), [("w4s5", w4s5, 1), ("w8s5", w8s5, 1), ("w8s3", w8s3, 1),
                               ("w8s3", w8s3, 2)]),
        ((128, 32, 4096, 64), [("m64", C(), None), ("m32w8s5", C(block_m=32), None)]),
        ((128, 128, 4096, 64), [("m64", C(), None), ("m32w8s5", C(block_m=32), None)]),
    ]
    if a.dry:
        cases = [((16, 2, 256, 1), [("w4s5", w4s5, 2), ("w8s3", w8s3, None)]),
                 ((16, 2, 256, 64), [("w8s5", w8s5, 1)])]
    key = jax.random.PRNGKey(0)
    for i, ((h, b, ctx, page_size), variants) in enumerate(cases):
        if time.perf_counter() > deadline:
            log(f"(time limit) skipped case H{h} B{b} L{ctx} p{page_size}")
            continue
        log(f"== H{h} B{b} L{ctx} p{page_size}")
        try:
            res["cases"] += run_case(jax.random.fold_in(key, i), h, b, ctx, page_size, variants,
                                     a.reps, ceiling, deadline)
        except Exception as e:  # noqa: BLE001
            log(f"   case failed: {type(e).__name__}: {str(e)[:400]}")
        dump()
    dump()
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
