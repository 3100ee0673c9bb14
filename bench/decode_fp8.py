"""The fp8 KV grid of `python -m bench.decode --kv-dtype fp8`: each case run with a bf16 pool and
with a float8_e4m3fn pool (the bf16 values / `KV_SCALE`, read with k_scale = v_scale =
`KV_SCALE`) in one process, device time per call, and the fp8 error against float32 attention
over the dequantized cache.

Cases (the fp8 targets in docs/decode_kernel.md, H200): H16 B128 ctx 16k <= 300 us, H16 B32
ctx 4k <= 28 us, H128 B128 ctx 16k (and B32 ctx 4k) no slower than bf16; pages 1 and 64;
error < 1e-2. At 128 heads the grid also times the all-fp8 matrix path
(`DecodeKernelConfig.fp8_products="fp8"`): H128 B128 ctx 16k <= 600 us, error within its
documented bound (`FP8_PRODUCTS_ERR`).
`--fp8-variants` also times the fp8 cases at the variants of `FP8_VARIANTS` (16 heads: the
fp8 Mosaic GPU kernel, and Triton at 4 warps instead of `FP8_NARROW_TILING`'s 8; 128 heads:
the Triton kernel, which the 64-row fp8 Mosaic GPU kernel replaced).
"""

from __future__ import annotations

import dataclasses
import re
import time

import jax

from funcmla.attention.pallas import DecodeKernelConfig

from bench.decode_targets import case_label

__all__ = ["FP8_CASES", "FP8_PRODUCTS", "FP8_VARIANTS", "KV_SCALE", "fp8_grid", "fp8_verdicts"]

# (heads, batch, ctx), each at pages 1 and 64.
FP8_CASES = ((16, 32, 4096), (16, 128, 16384), (128, 32, 4096), (128, 128, 16384))
# Not a power of two, so a wrong scale convention cannot hide in exact arithmetic; the pools'
# normal values / KV_SCALE stay far below e4m3's 448.
KV_SCALE = 0.03
# Tilings timed by --fp8-variants, by heads (DecodeKernelConfig fields).
FP8_VARIANTS = {16: (dict(num_warps=4), dict(kernel="mgpu")),
                128: (dict(kernel="triton"),)}
# Targets in us, device time per call (None: no slower than the case's bf16 time).
FP8_TARGET_US = {(16, 32, 4096): 28.0, (16, 128, 16384): 300.0, (128, 32, 4096): None,
                 (128, 128, 16384): None}
# The all-fp8 matrix path, timed wherever its kernel applies (64-row multiples): its targets
# (absent: no slower than bf16) and its error bound (q and P rounded once to e4m3;
# docs/decode_kernel.md, "fp8 products"), where the default products keep < 1e-2.
FP8_PRODUCTS = dict(fp8_products="fp8")
FP8_PRODUCTS_TARGET_US = {(128, 128, 16384): 600.0}
FP8_PRODUCTS_ERR = 1e-1


def _log(*a):
    print(*a, flush=True)


def _variant_name(variant: dict | None) -> str | None:
    return None if variant is None else ",".join(f"{k}={v}" for k, v in variant.items())


def fp8_verdicts(rows: list[dict]) -> list[dict]:
    """One verdict per fp8 row of the default products or of `FP8_PRODUCTS`: its time, the
    bf16 time of the same case, the target and the error bound (default products: < 1e-2
    against float32 over the dequantized cache; fp8 products: `FP8_PRODUCTS_ERR`)."""
    bf16 = {(r["heads"], r["batch"], r["ctx"], r["page_size"]): r for r in rows
            if r["kv_dtype"] == "bf16" and r.get("variant") is None}
    all_fp8 = _variant_name(FP8_PRODUCTS)
    out = []
    for r in rows:
        if r["kv_dtype"] != "fp8" or r.get("variant") not in (None, all_fp8):
            continue
        key = (r["heads"], r["batch"], r["ctx"])
        base = bf16.get(key + (r["page_size"],))
        products = "fp8" if r.get("variant") == all_fp8 else "mixed"
        target = (FP8_PRODUCTS_TARGET_US if products == "fp8" else FP8_TARGET_US).get(key)
        if target is None and base is not None:
            target = base["time_us"]
        bound = FP8_PRODUCTS_ERR if products == "fp8" else 1e-2
        out.append(dict(case=case_label(*key, r["page_size"]), products=products,
                        fp8_us=r["time_us"],
                        bf16_us=None if base is None else base["time_us"],
                        speedup=None if base is None else base["time_us"] / r["time_us"],
                        target_us=target,
                        time_ok=None if target is None else bool(r["time_us"] <= target),
                        rel_err=r["rel_err"],
                        err_bound=bound,
                        err_ok=r["rel_err"] is not None and r["rel_err"] < bound))
    return out


def fp8_grid(key, ceiling, args, results, deadline, bench_case, fmt_case) -> bool:
    """Runs the fp8 grid into results["fp8_grid"] (rows of `bench_case`) and
    results["fp8_verdicts"]; returns False when a case failed or missed its error bound."""
    _log(f"== fp8 KV grid (kv_scale {KV_SCALE}; bf16 then fp8 per case)")
    rows, ok = [], True
    results["fp8_grid"] = rows
    only = None if args.only is None else re.compile(args.only)
    for i, (h, b, ctx) in enumerate(FP8_CASES):
        for page_size in (1, 64):
            if only is not None and not only.search(case_label(h, b, ctx, page_size)):
                continue
            runs = [("bf16", None, None), ("fp8", KV_SCALE, None)]
            if h % 64 == 0:  # s_q 1: the 64-row fp8 kernel, which has the fp8 products
                runs.append(("fp8", KV_SCALE, FP8_PRODUCTS))
            if args.fp8_variants:
                runs += [("fp8", KV_SCALE, v) for v in FP8_VARIANTS.get(h, ())]
            for dtype, scale, variant in runs:
                vname = _variant_name(variant)
                label = f"{case_label(h, b, ctx, page_size)} {dtype}" + (
                    "" if vname is None else f" {vname}")
                if time.perf_counter() > deadline:
                    _log(f"   {label}: time limit, not run")
                    continue
                cfg = DecodeKernelConfig(partial_dtype=args.partial_dtype)
                if variant is not None:
                    cfg = dataclasses.replace(cfg, **variant)
                try:
                    r = bench_case(jax.random.fold_in(key, 1000 + i), h, b, ctx, page_size,
                                   ceiling, args.reps, cfg, baseline=False,
                                   profile=not args.no_profile, kv_scale=scale)
                except Exception as e:  # noqa: BLE001 - report and go on
                    _log(f"   {label}: FAILED {type(e).__name__}: {e}")
                    ok = False
                    continue
                r["variant"] = vname
                rows.append(r)
                _log(f"   [{dtype}{'' if vname is None else ' ' + vname}] " + fmt_case(r))
    verdicts = fp8_verdicts(rows)
    results["fp8_verdicts"] = verdicts
    _log("== fp8 targets (device us per call; error vs float32 over the dequantized cache)")
    for v in verdicts:
        f = lambda x, fmt="{:.1f}": "-" if x is None else fmt.format(x)  # noqa: E731
        verdict = "met" if v["time_ok"] else "MISSED"
        _log(f"   {v['case']} ({v['products']} products): fp8 {f(v['fp8_us'])} us, bf16 "
             f"{f(v['bf16_us'])} us, "
             f"x{f(v['speedup'], '{:.2f}')}, target {f(v['target_us'])}: {verdict}; err "
             f"{f(v['rel_err'], '{:.1e}')}")
        ok &= v["err_ok"]
    return ok
