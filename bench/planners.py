"""Benchmark of the AITER work planners in JAX (funcmla.planners) against their NumPy oracles.

Layout: one `bench_<planner>(...)` function per planner (`bench_decode`, `bench_prefill`, listed
in `BENCHES`), each returning a list of result rows (dicts); `main()` runs them and writes the
table, JSON and plot. docs/planners.md says which commands produced its tables.

Decode. For each configuration and batch size (random KV lengths 0..8k tokens, seeded), it
measures:
  * host_us: median wall time of one jitted plan call + block_until_ready (after compile): what a
    caller pays per step, dispatch included;
  * device_us: device time per plan, estimated as (T(K) - T(1)) / (K - 1) where T(K) is the wall
    time of one jitted function running K plans back to back, each fed from the previous
    (so XLA can neither merge nor reorder them); dispatch cancels out;
  * device_busy_us / device_span_us (--profile-batches, GPU): from a jax.profiler trace
    (CUPTI), the sum of the plan's kernel durations and the median span from its first kernel's
    start to its last kernel's end (gaps included), with the kernels listed in the log;
  * device_primed_us (--profile-batches, GPU): that span again with every call queued behind a
    long spin kernel (bench.timing.queue_prime), so that all the plan's kernels are queued
    before the first one starts: the device's own time, without the host's launch gaps (what
    a serving step sees when the host runs ahead of the GPU);
  * oracle_us: the NumPy serial oracle (plan_mla_decode_reference) on the host, the baseline;
  * match: the plan equals the oracle field by field.
Fill implementations: "scan" (lax.scan), "pallas" (the walk as one Pallas program, the rest in
XLA) and "fused" (the walk, then derivation and every output, as two Pallas programs); the
Pallas ones are compiled with the Triton backend on GPU and run in interpret mode elsewhere, so
--fills scan is the CPU default. A suffix picks the Pallas walk: "fused/tiles" (one step per
tile), "fused/chase" (the chase over events), none: "auto".

Usage: python -m bench.planners [--quick] [--out out/] [--batches 1,16,64,256,1024]
       [--fills scan,pallas,fused] [--configs mi300x-h16,...] [--planners decode,prefill]
       [--check [--check-fills fused]] [--fill-only] [--profile-batches 256]
       (--check: also compare the fills with the oracle on extra configs, ragged qo,
       zero-length KV; --fill-only: time the walk alone at several chunk sizes;
       --profile-batches: per-kernel device times from a profiler trace, GPU only).
Writes planners.json and planners.png under --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from .timing import device_kernel_times, environment, median_time_s, write_json  # noqa: E402
from funcmla.config import H200, MI300X, MI355X, custom_device  # noqa: E402
from funcmla.planners.decode import plan_mla_decode, plan_mla_decode_jit  # noqa: E402
from funcmla.planners.decode_config import DecodePlanConfig  # noqa: E402
from funcmla.planners.decode_fill import (  # noqa: E402
    NEVER,
    FillParams,
    fill_inputs,
    fill_tiles_scan,
)
from funcmla.planners.decode_fill_pallas import fill_tiles_pallas, on_gpu  # noqa: E402
from funcmla.planners.oracle_decode import plan_mla_decode_reference  # noqa: E402
from funcmla.planners.oracle_prefill import ps_prefill_plan_oracle  # noqa: E402
from funcmla.planners.prefill import (  # noqa: E402
    PrefillPlanConfig,
    plan_ps_prefill_jit,
    ps_prefill_plan_sizes,
)

PLAN_FIELDS = ("work_indptr", "work_info", "reduce_indptr", "reduce_final_map",
               "reduce_partial_map", "num_works", "num_partials")

DECODE_CONFIGS = {
    # DeepSeek-V3 TP8 decode: 16 heads, native, parallel planner (msq 1)
    "mi300x-h16": DecodePlanConfig(device=MI300X, num_heads=16, uni_seqlen_qo=1),
    # 128 heads bf16 on gfx942: folded to 16 x 8 batches, serial planner (8x the tiles)
    "mi300x-h128-bf16": DecodePlanConfig(device=MI300X, num_heads=128, uni_seqlen_qo=1),
    # MTP-2 verify, fp8, 128 heads native on gfx950: a qo tile per token, causal trim
    "mi355x-h128-fp8-mtp2": DecodePlanConfig(
        device=MI355X, num_heads=128, q_dtype="fp8", kv_dtype="fp8", max_seqlen_qo=2,
        uni_seqlen_qo=2, is_causal=True),
    # the H200's 132 SMs as clusters (AITER's rules for a non-AMD arch)
    "h200-h16": DecodePlanConfig(device=H200, num_heads=16, uni_seqlen_qo=1),
}

CHECK_CONFIGS = {
    "gfx950-h64-fp8-mtp4-ragged": DecodePlanConfig(
        device=custom_device(80, "gfx950"), num_heads=64, q_dtype="fp8", kv_dtype="fp8",
        max_seqlen_qo=4, is_causal=True),
    "h16-mtp4-gran4-tail": DecodePlanConfig(
        device=custom_device(256), num_heads=16, max_seqlen_qo=4, uni_seqlen_qo=4,
        kv_granularity=4, is_causal=True),
    "page64-serial": DecodePlanConfig(device=MI355X, num_heads=16, page_size=64,
                                      kv_granularity=64, zero_kv_behaviour="serial"),
}


def log(*a):
    print(*a, flush=True)


def decode_inputs(cfg: DecodePlanConfig, batch: int, seed: int = 0, max_kv: int = 8192,
                  zero_frac: float = 0.1):
    """Random decode batch: kv lengths in entries (tokens / pages), qo lengths, last-page lens."""
    rng = np.random.default_rng(seed)
    kv_tok = rng.integers(1, max_kv + 1, batch)
    kv_tok[rng.random(batch) < zero_frac] = 0
    kv_lens = -(-kv_tok // cfg.page_size)
    qo_lens = (np.full(batch, cfg.uni_seqlen_qo) if cfg.uniform_qo
               else rng.integers(1, cfg.max_seqlen_qo + 1, batch))
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    last = np.where(kv_tok > 0, (kv_tok - 1) % cfg.page_size + 1, 1).astype(np.int32)
    return qo_indptr, kv_indptr, last


def _plans_equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f)))
               for f in PLAN_FIELDS)


def _try(what, fn, *a, **kw):
    """Run fn; on failure log the error and return None (a failing variant must not stop the
    rest of a one-shot device run)."""
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001
        import traceback

        log(f"FAILED {what}: {type(e).__name__}: {e}")
        traceback.print_exc(limit=4)
        return None


def _first_then_median(what, fn, reps):
    """Run fn once (the compile; a failure is logged and gives None), then time it: returns
    (first result, seconds of the first call, median seconds of the later calls)."""
    t0 = time.perf_counter()
    got = _try(what, fn)
    if got is None:
        return None
    compile_s = time.perf_counter() - t0
    return got, compile_s, median_time_s(fn, reps=reps, min_time_s=0.05)


def _fill_and_walk(fill: str) -> tuple[str, str]:
    """A --fills entry, "impl" or "impl/walk", as (fill_impl, walk)."""
    impl, _, walk = fill.partition("/")
    return impl, walk or "auto"


def _chained(cfg, fill_impl, k, walk="auto"):
    """k plans back to back in one jit, each input depending (trivially) on the previous plan."""

    def run(qo, kv, last):
        dep = jnp.int32(0)
        plan = None
        for _ in range(k):
            plan = plan_mla_decode(qo, kv + dep, last, config=cfg, fill_impl=fill_impl,
                                   walk=walk)
            dep = jnp.minimum(plan.num_works, 0)  # always 0, opaque to XLA
        return plan

    return jax.jit(run)


def _device_time_us(cfg, fill_impl, args, k=4, reps=10, walk="auto"):
    one = _chained(cfg, fill_impl, 1, walk)
    many = _chained(cfg, fill_impl, k, walk)
    jax.block_until_ready(one(*args))
    jax.block_until_ready(many(*args))
    t1 = median_time_s(lambda: jax.block_until_ready(one(*args)), reps=reps, min_time_s=0.05)
    tk = median_time_s(lambda: jax.block_until_ready(many(*args)), reps=reps, min_time_s=0.05)
    return max(tk - t1, 0.0) / (k - 1) * 1e6


def bench_decode(batches=(1, 16, 64, 256, 1024), configs=None, fills=("scan",),
                 device_time=True, device_time_batches=None, reps=20, profile_batches=()):
    """Time plan_mla_decode (jit, after compile) against the NumPy oracle. Returns rows."""
    configs = configs or DECODE_CONFIGS
    rows = []
    for name, cfg in configs.items():
        for batch in batches:
            qo, kv, last = decode_inputs(cfg, batch, seed=batch)
            ref = plan_mla_decode_reference(qo, kv, last, config=cfg)
            oracle_s = median_time_s(
                lambda: plan_mla_decode_reference(qo, kv, last, config=cfg),
                reps=3 if batch >= 256 else 7)
            args = tuple(jnp.asarray(x) for x in (qo, kv, last))
            for fill in fills:
                impl, walk = _fill_and_walk(fill)

                def fn(impl=impl, walk=walk):
                    return jax.block_until_ready(
                        plan_mla_decode_jit(*args, config=cfg, fill_impl=impl, walk=walk))

                timed = _first_then_median(f"decode {name} B={batch} {fill}", fn, reps)
                if timed is None:
                    continue
                got, compile_s, host_s = timed
                dev_us = None
                if device_time and (device_time_batches is None or batch in device_time_batches):
                    dev_us = _try(f"device time {name} B={batch} {fill}", _device_time_us,
                                  cfg, impl, args, walk=walk)
                prof = primed = None
                if batch in profile_batches:
                    prof = _try(f"profile {name} B={batch} {fill}", device_kernel_times, fn)
                    primed = _try(f"primed profile {name} B={batch} {fill}",
                                  device_kernel_times, fn, primed=True)
                    if prof:
                        log(f"profile {name} B={batch} {fill}: {prof['kernels_per_call']:.1f} "
                            f"kernels/call, busy {prof['busy_us_per_call']:.1f} us/call, "
                            f"span {prof['span_us']:.1f} us, primed span "
                            f"{primed['span_us'] if primed else float('nan'):.1f} us")
                        for kern in prof["kernels"][:12]:
                            log(f"    {kern['total_us_per_call']:7.2f} us/call "
                                f"x{kern['per_call']:.0f}  {kern['name'][:90]}")
                row = dict(planner="decode", config=name, batch=batch, fill=fill,
                           tiles=int(cfg.folded_batch_size(batch) * cfg.tile_slots_per_batch),
                           num_works=int(got.num_works), num_partials=int(got.num_partials),
                           host_us=host_s * 1e6, device_us=dev_us, oracle_us=oracle_s * 1e6,
                           speedup_vs_oracle=oracle_s / host_s, compile_s=compile_s,
                           match=_plans_equal(got, ref),
                           device_busy_us=prof["busy_us_per_call"] if prof else None,
                           device_span_us=prof["span_us"] if prof else None,
                           device_primed_us=primed["span_us"] if primed else None,
                           profile=prof, primed_profile=primed)
                rows.append(row)
                log(f"decode {name:22s} B={batch:5d} {fill:6s} host {row['host_us']:9.1f} us"
                    f"  device {dev_us if dev_us is None else round(dev_us, 1)} us"
                    f"  oracle {row['oracle_us']:9.1f} us  match={row['match']}")
    return rows


def check_decode(fills=("scan", "pallas"), batches=(7, 300)):
    """Every fill == the oracle on the bench and check configs (incl. zero KV, ragged qo)."""
    rows = []
    for name, cfg in {**DECODE_CONFIGS, **CHECK_CONFIGS}.items():
        for batch in batches:
            for seed, zero_frac, max_kv in ((1, 0.3, 8192), (2, 0.0, 40), (3, 0.7, 32768)):
                qo, kv, last = decode_inputs(cfg, batch, seed=seed, max_kv=max_kv,
                                             zero_frac=zero_frac)
                ref = plan_mla_decode_reference(qo, kv, last, config=cfg)
                args = tuple(jnp.asarray(x) for x in (qo, kv, last))
                for fill in fills:
                    impl, walk = _fill_and_walk(fill)
                    got = _try(f"check {name} B={batch} {fill}", plan_mla_decode_jit, *args,
                               config=cfg, fill_impl=impl, walk=walk)
                    if got is None:  # refused (e.g. walk "chase" with the tail rule): logged
                        continue
                    ok = _plans_equal(got, ref)
                    rows.append(dict(config=name, batch=batch, seed=seed, fill=fill, match=ok))
                    if not ok:
                        log(f"MISMATCH {name} B={batch} seed={seed} fill={fill}")
    log(f"check_decode: {sum(r['match'] for r in rows)}/{len(rows)} plans equal the oracle")
    return rows


def bench_decode_fill(batch=256, config="mi300x-h16", variants=None, k=8):
    """Device time of the fill alone (tiles precomputed): scan vs Pallas at several chunk sizes,
    each chunk's loads issued one chunk ahead."""
    variants = variants or (["scan"] + (["pallas8", "pallas16", "pallas32"]
                                        if on_gpu() else []))
    cfg = DECODE_CONFIGS[config]
    qo, kv, last = decode_inputs(cfg, batch, seed=batch)
    n = -(-np.diff(kv) // cfg.kv_granularity)
    n = np.repeat(n, cfg.qk_batch_ratio * cfg.tile_slots_per_batch)
    payload = -(-(n + cfg.overhead).sum() // cfg.num_splits(batch)) + cfg.overhead
    bpc = payload - cfg.overhead
    params = FillParams(overhead=cfg.overhead, parallel=cfg.planner(batch) == "parallel",
                        tail_rule=False, empty_slots=False)
    tiles = fill_inputs(jnp.asarray(n, jnp.int32), jnp.full(n.shape, NEVER, jnp.int32),
                        jnp.int32(payload), jnp.int32(bpc), params=params)
    rows = []
    for variant in variants:
        def one(t, variant=variant):
            if variant == "scan":
                return fill_tiles_scan(t, jnp.int32(payload), jnp.int32(bpc), params=params)
            return fill_tiles_pallas(t, jnp.int32(payload), jnp.int32(bpc), params=params,
                                     chunk=int(variant[len("pallas"):]))

        def chained(t, kk, one=one):
            out = None
            for _ in range(kk):
                out = one(t)
                t = t + jnp.minimum(out[0:1, 0:1], 0)  # 0, but sequences the calls
            return out

        def measure(chained=chained):
            f1 = jax.jit(lambda t: chained(t, 1))
            fk = jax.jit(lambda t: chained(t, k))
            ref = np.asarray(fill_tiles_scan(tiles, jnp.int32(payload), jnp.int32(bpc),
                                             params=params))
            same = np.array_equal(np.asarray(f1(tiles)), ref)
            jax.block_until_ready(fk(tiles))
            t1 = median_time_s(lambda: jax.block_until_ready(f1(tiles)), reps=10,
                               min_time_s=0.05)
            tk = median_time_s(lambda: jax.block_until_ready(fk(tiles)), reps=10,
                               min_time_s=0.05)
            return t1, tk, same

        res = _try(f"fill {variant}", measure)
        if res is None:
            continue
        t1, tk, same = res
        rows.append(dict(planner="decode-fill", config=config, batch=batch, fill=variant,
                         host_us=t1 * 1e6, device_us=max(tk - t1, 0) / (k - 1) * 1e6,
                         match=same))
        log(f"fill {config} B={batch} {variant}: host {t1 * 1e6:.1f} us, device "
            f"{rows[-1]['device_us']:.1f} us, same as scan: {same}")
    return rows


PREFILL_CONFIGS = {
    # SGLang's fp8 MHA prefill at TP8 on MI355X: 16 KV heads (gqa 1), 16 clusters of 16 CUs
    "mi355x-hk16": dict(device=MI355X, num_heads_k=16),
    # one KV head, 16 q heads per work: qlen_granularity 16, 304 TGs in one cluster
    "mi300x-hk1-gqa16": dict(device=MI300X, gqa_ratio=16),
    # the pre-#25556 pairing at page size 64 (block_size 64, kvlen_granularity 128)
    "mi355x-hk16-legacy64": dict(device=MI355X, num_heads_k=16, legacy_page_size=64),
}
PREFILL_MAX_QLEN = 2048


def prefill_inputs(batch: int, seed: int = 0, block_size: int = 1):
    """Random extend batch: 1..2048 new tokens on a 0..4096-token prefix per request."""
    rng = np.random.default_rng(seed)
    qo = rng.integers(1, PREFILL_MAX_QLEN + 1, batch)
    ctx = qo + rng.integers(0, 4097, batch)
    qo_indptr = np.concatenate([[0], np.cumsum(qo)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(-(-ctx // block_size))]).astype(np.int32)
    return qo_indptr, kv_indptr, ctx.astype(np.int32)


def bench_prefill(batches=(1, 16, 64, 256, 1024), configs=None, reps=20):
    """Time plan_ps_prefill_jit (after compile) against the NumPy serial oracle
    (ps_prefill_plan_oracle, the restatement of AITER's host C++ planner). Returns rows."""
    rows = []
    for name, spec in (configs or PREFILL_CONFIGS).items():
        spec = dict(spec)
        legacy_ps = spec.pop("legacy_page_size", None)
        if legacy_ps:
            cfg = PrefillPlanConfig.legacy_page_granular(legacy_ps, max_qlen=PREFILL_MAX_QLEN, **spec)
        else:
            cfg = PrefillPlanConfig(max_qlen=PREFILL_MAX_QLEN, **spec)
        for batch in batches:
            qo, kv, ctx = prefill_inputs(batch, seed=batch, block_size=cfg.block_size)

            def oracle():
                return ps_prefill_plan_oracle(
                    qo, kv, ctx, num_cu=cfg.device.num_cu, num_heads_k=cfg.num_heads_k,
                    gqa_ratio=cfg.gqa_ratio, qhead_granularity=cfg.qhead_granularity,
                    qlen_granularity=cfg.qlen_granularity, kvlen_granularity=cfg.kvlen_granularity,
                    block_size=cfg.block_size, is_causal=cfg.is_causal, max_qlen=cfg.max_qlen)

            ref = oracle()
            oracle_s = median_time_s(oracle, reps=3 if batch >= 256 else 7)
            args = tuple(jnp.asarray(x) for x in (qo, kv, ctx))

            def fn():
                return jax.block_until_ready(plan_ps_prefill_jit(*args, config=cfg))

            timed = _first_then_median(f"prefill {name} B={batch}", fn, reps)
            if timed is None:
                continue
            got, compile_s, host_s = timed
            match = all(np.array_equal(np.asarray(getattr(got, f)), ref[f]) for f in PLAN_FIELDS)
            row = dict(planner="prefill", config=name, batch=batch, fill="jit",
                       tiles=ps_prefill_plan_sizes(batch, cfg.max_qlen, config=cfg).num_tiles,
                       num_works=int(got.num_works), num_partials=int(got.num_partials),
                       host_us=host_s * 1e6, device_us=None, oracle_us=oracle_s * 1e6,
                       speedup_vs_oracle=oracle_s / host_s, compile_s=compile_s, match=match)
            rows.append(row)
            log(f"prefill {name:22s} B={batch:5d} host {row['host_us']:9.1f} us  oracle "
                f"{row['oracle_us']:10.1f} us  x{row['speedup_vs_oracle']:.1f}  match={match}")
    return rows


BENCHES = {"decode": bench_decode, "prefill": bench_prefill}


def _print_table(title, columns, rows):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(*[f"{x:.4g}" if isinstance(x, float) else str(x) for x in r])
    Console(width=max(160, Console().width)).print(table)


def _plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(r["planner"], r["config"], r["fill"]) for r in rows if "oracle_us" in r})
    for planner, config, fill in keys:
        rs = sorted((r for r in rows if (r["planner"], r["config"], r["fill"]) ==
                     (planner, config, fill)), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["host_us"] for r in rs], "o-",
                label=f"{planner} {config} jit/{fill}")
    for planner, config in sorted({(p, c) for p, c, _ in keys}):
        rs = sorted((r for r in rows if (r["planner"], r["config"]) == (planner, config)
                     and "oracle_us" in r), key=lambda r: r["batch"])
        seen = {}
        for r in rs:
            seen.setdefault(r["batch"], r["oracle_us"])
        ax.plot(list(seen), list(seen.values()), "x--", label=f"{planner} {config} NumPy oracle")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (requests)")
    ax.set_ylabel("plan time per call, host wall (us)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/")
    ap.add_argument("--batches", default="1,16,64,256,1024")
    ap.add_argument("--fills", default=None, help="scan,pallas (default: scan off-GPU)")
    ap.add_argument("--configs", default=",".join(DECODE_CONFIGS))
    ap.add_argument("--device-time-batches", default=None,
                    help="batches to estimate device time for (default: all)")
    ap.add_argument("--no-device-time", action="store_true")
    ap.add_argument("--profile-batches", default="",
                    help="batches to profile kernel by kernel (jax.profiler trace; GPU only)")
    ap.add_argument("--check", action="store_true", help="also run the oracle checks")
    ap.add_argument("--fill-only", action="store_true", help="also time the fill alone")
    ap.add_argument("--quick", action="store_true", help="batches 1,64 only (smoke run)")
    ap.add_argument("--planners", default=",".join(BENCHES),
                    help=f"which planners to time (default: {','.join(BENCHES)})")
    ap.add_argument("--check-fills", default=None,
                    help="fills for --check (default: the timed fills)")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches = "1,64"

    fills = tuple((args.fills or ("scan,pallas" if on_gpu() else "scan")).split(","))
    batches = tuple(int(b) for b in args.batches.split(","))
    configs = {k: DECODE_CONFIGS[k] for k in args.configs.split(",")}
    dt_batches = (None if args.device_time_batches is None
                  else {int(b) for b in args.device_time_batches.split(",")})
    prof_batches = {int(b) for b in args.profile_batches.split(",") if b}
    env = environment()
    log(f"environment: {env}")
    payload = {"environment": env, "rows": [], "checks": []}
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "planners.json")

    def save():  # after every section, so a cut-short device run still leaves its results
        write_json(json_path, payload)

    if args.check:
        check_fills = tuple(args.check_fills.split(",")) if args.check_fills else fills
        payload["checks"] = check_decode(fills=check_fills)
        save()
    if args.fill_only:
        payload["rows"] += bench_decode_fill()
        save()
    for name, bench in BENCHES.items():
        if name not in args.planners.split(","):
            continue
        if name == "decode":
            for cname, cfg in configs.items():
                payload["rows"] += bench(batches=batches, configs={cname: cfg}, fills=fills,
                                         device_time=not args.no_device_time,
                                         device_time_batches=dt_batches,
                                         profile_batches=prof_batches)
                save()
        else:
            payload["rows"] += bench(batches=batches)
            save()

    table = [[r["planner"], r["config"], r["batch"], r["fill"], r.get("tiles", ""),
              r.get("num_works", ""), r["host_us"],
              "" if r.get("device_us") is None else r["device_us"],
              "" if r.get("device_busy_us") is None else r["device_busy_us"],
              "" if r.get("device_span_us") is None else r["device_span_us"],
              "" if r.get("device_primed_us") is None else r["device_primed_us"],
              r.get("oracle_us", ""), r.get("speedup_vs_oracle", ""), r.get("match", "")]
             for r in payload["rows"]]
    _print_table(f"work planners on {env['device']} (us; median)",
                 ["planner", "config", "batch", "fill", "tiles", "works", "host us",
                  "device us", "kernels us", "span us", "primed us", "oracle us", "oracle/host",
                  "match"], table)
    save()
    log("wrote", json_path)
    png = _plot(payload["rows"], os.path.join(args.out, "planners.png"))
    if png:
        log("wrote", png)
    return payload


if __name__ == "__main__":
    main()
