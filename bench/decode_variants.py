"""Tiling variants of the decode kernel on the target cases, scored by device time (`--variants`:
the default is replaced only by a variant >= 3% faster), and the merge kernel alone at several
output tiles."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp

from funcmla.attention.pallas import DecodeKernelConfig, merge_splits_pallas
from funcmla.attention.pallas.merge import merge_block_d

from .decode_case import bench_case, fmt_case
from .decode_data import DV
from .decode_targets import case_label
from .decode_timing import profile_timings, time_calls
from .report import log

__all__ = ["merge_tiles", "variant_sweep"]


def variant_sweep(key: jax.Array, ceiling: float, results: dict,
                  deadline: float) -> dict[int, DecodeKernelConfig]:
    """Tiling / split variants on the target cases; returns {heads: best config}."""
    C = DecodeKernelConfig
    var = []
    results["variants"] = var
    tuned = {}

    def run(name, h, b, ctx, page_size, c, ns=None, **kw):
        if time.perf_counter() > deadline:
            log(f"   (time limit) skipped H{h} B{b} {name}")
            return None
        try:
            r = bench_case(key, h, b, ctx, page_size, ceiling, 5, c, num_splits=ns, baseline=False,
                           kernel_only=kw.pop("kernel_only", False),
                           merge_alone=kw.pop("merge_alone", False), **kw)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
            log(f"   {case_label(h, b, ctx, page_size)} {name}: FAILED {type(e).__name__}: "
                f"{str(e)[:300]}")
            var.append(dict(variant=name, heads=h, batch=b, ctx=ctx, page_size=page_size,
                            error=f"{type(e).__name__}: {str(e)[:300]}"))
            return None
        r["variant"] = name
        var.append(r)
        log(f"   {name:>18}: " + fmt_case(r))
        return r

    # 16 heads: the default (kv64, 5 stages: two 64-token tiles in flight, one program per SM)
    # against 32-token tiles with 3 or 4 in flight. 128 heads: no cheap tiling change left
    # (docs/decode_kernel.md); the default runs.
    sweeps = {
        16: ([(32, 4096, 1), (128, 4096, 1)], {
            "kv64-st5": C(), "kv32-st9": C(block_kv=32, num_stages=9),
            "kv32-st7": C(block_kv=32, num_stages=7)}),
    }
    tuned[128] = C()
    for h, (cases, cfgs) in sweeps.items():
        log(f"== variants, {h} heads (scored by device time)")
        score = {}
        for name, c in cfgs.items():
            tot = 0.0
            for (b, ctx, page_size) in cases:
                r = run(name, h, b, ctx, page_size, c)
                tot += math.inf if r is None else r["time_us"] / (b * ctx)
            score[name] = tot
        first = next(iter(cfgs))  # the default: replaced only by a variant >= 3% faster
        best = min(score, key=score.get)
        if score[best] > 0.97 * score[first]:
            best = first
        tuned[h] = cfgs[best]
        log(f"   -> heads {h}: {best} {cfgs[best]}")
    merge_tiles(key, results, deadline)
    results["tuned"] = {str(k): dataclasses.asdict(v) for k, v in tuned.items()}
    return tuned


def merge_tiles(key: jax.Array, results: dict, deadline: float, reps: int = 5) -> None:
    """The merge kernel alone (device time) at several output tiles, for split counts the
    decode kernel uses (batch 1: 32-64 splits; batch 32: 4)."""
    log("== merge kernel alone: output tile (block_d) x shape, device time")
    timings, meta = [], []
    for (b, s, r) in ((1, 64, 16), (1, 32, 16), (32, 4, 16), (1, 64, 128)):
        if time.perf_counter() > deadline:
            break
        margs = [(jax.random.normal(jax.random.fold_in(key, 300 + i), (b, s, r, DV)),
                  jax.random.normal(jax.random.fold_in(key, 400 + i), (b, s, r)))
                 for i in range(8)]
        for bd in (64, 32, 16, 8):
            t = time_calls(lambda o_, l_, bd=bd: merge_splits_pallas(o_, l_, jnp.bfloat16,
                                                                   block_d=bd), margs, reps)
            timings.append(t)
            meta.append(dict(batch=b, splits=s, rows=r, block_d=bd,
                             rule_block_d=merge_block_d(b, r, DV)))
    profile_timings(timings)
    out = []
    for t, m in zip(timings, meta):
        m.update(wall_us=t.wall_s * 1e6, device_us=None if t.dev is None else t.dev["merge_us"])
        out.append(m)
        log(f"   B{m['batch']} S{m['splits']} R{m['rows']} block_d {m['block_d']:>3} (rule "
            f"{m['rule_block_d']}): device {m['device_us'] or 0:.2f} us, wall {m['wall_us']:.1f}")
    results["merge_tiles"] = out
