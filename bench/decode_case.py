"""One timed case of the decode benchmark (`bench_case`): the kernel and the XLA baseline, wall
clock and device time, bandwidth, TFLOP/s and error against the float32 reference; and its
one-line summary (`fmt_case`)."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from funcmla.attention.pallas import (
    DecodeKernelConfig,
    merge_splits_pallas,
    mla_decode,
    mla_decode_rows,
)
from funcmla.attention.pallas.api import decode_num_splits, uses_mgpu
from funcmla.attention.pallas.decode_common import (
    fp8_triton_config,
    kv_rows_from_csr,
    kv_rows_from_page_table,
    num_row_blocks,
)

from .decode_data import D, DV, SM_SCALE, make_case, pool_copies_and_calls
from .decode_reference import f32_reference, rel_err, xla_decode
from .decode_targets import case_label
from .decode_timing import profile_timings, time_calls

__all__ = ["case_dispatch", "bench_case", "fmt_case"]

# The float32 reference of the case last checked, by (key, shape, kv_scale): variants of one
# case share it, and only one is kept since they can be large.
_REFS: dict = {}


def case_dispatch(h: int, b: int, ctx: int, page_size: int, config: DecodeKernelConfig, *,
                  s_q: int = 1, fp8: bool = False) -> tuple[DecodeKernelConfig, bool, int]:
    """What `mla_decode` runs for a case (b sequences of ctx tokens, h heads, a bf16 q and a
    bf16 or fp8 pool): the config its Triton path resolves, whether the Mosaic GPU kernel
    runs, and the split rule's count."""
    rows = s_q * h
    cfg = fp8_triton_config(config, rows) if fp8 else config
    kv_dtype = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    mgpu = uses_mgpu(cfg, jax.ShapeDtypeStruct((b * s_q, h, D), jnp.bfloat16), page_size, s_q,
                     kv_dtype=kv_dtype)
    return cfg, mgpu, decode_num_splits(cfg, b, rows, ctx, mgpu=mgpu, kv_fp8=fp8)


def bench_case(key: jax.Array, h: int, b: int, ctx: int, page_size: int, ceiling: float,
               reps: int, config: DecodeKernelConfig, num_splits: int | None = None,
               baseline: bool = True, s_q: int = 1, kernel_only: bool = False,
               merge_alone: bool = False, profile: bool = True, check: bool = True,
               kv_scale: float | None = None) -> dict:
    """One case, timed two ways (see `bench.decode`): `wall_us`, the wall clock per
    `mla_decode` call of a jit of n calls; `device_us`, the device span per call of that jit
    (CUPTI), with the decode and merge kernels' durations. The headline `time_us` (GB/s, % of
    the ceiling, TFLOP/s, ratio to XLA) is the device span when profiled, else the wall clock;
    the XLA baseline is timed the same two ways. kernel_only: the decode kernel alone
    (`mla_decode_rows`) by wall clock; merge_alone: the merge kernel alone on partials of the
    kernel's shape (wall clock and device). kv_scale: an fp8 pool (float8_e4m3fn) read with
    k_scale = v_scale = kv_scale (no XLA baseline)."""
    fp8 = kv_scale is not None
    kv_bytes = b * ctx * D * (1 if fp8 else 2)
    copies, n = pool_copies_and_calls(kv_bytes)
    pools, qs, meta, slot_mat = make_case(key, b, h, ctx, page_size, s_q, copies, n,
                                          kv_scale=kv_scale)
    # metadata travels as jit arguments (never as baked-in constants)
    args = [(qs[i], pools[i % copies], meta) for i in range(n)]
    mkl = dict(max_kv_len=ctx) if page_size == 1 else {}
    if fp8:
        mkl["k_scale"] = kv_scale
    kern = lambda q, p, m: mla_decode(q, p, **m, **mkl, sm_scale=SM_SCALE,  # noqa: E731
                                      s_q=s_q, num_splits=num_splits, config=config)
    t0 = time.perf_counter()
    t_main = time_calls(kern, args, reps)
    t_compile = time.perf_counter() - t0
    rows = s_q * h
    cfg, mgpu, rule = case_dispatch(h, b, ctx, page_size, config, s_q=s_q, fp8=fp8)
    bm = cfg.resolved_block_m(rows)
    kernel = "mgpu" if mgpu else "triton"
    ns = num_splits or rule
    t_kern = None
    if kernel_only and ns > 1:
        def parts(q, p, m):
            kv = (kv_rows_from_csr(m["kv_indptr"], m["kv_indices"], ctx) if page_size == 1
                  else kv_rows_from_page_table(m["page_table"]))
            return mla_decode_rows(q, p, kv, sm_scale=SM_SCALE, s_q=s_q, num_splits=ns,
                                   config=cfg, k_scale=kv_scale)
        t_kern = time_calls(parts, args, reps)
    err = lse_err = None
    if check:
        o, lse = jax.jit(kern)(qs[0], pools[0], meta)
        ref_key = (tuple(np.asarray(jax.random.key_data(key)).ravel().tolist())
                   if jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
                   else tuple(np.asarray(key).ravel().tolist()), h, b, ctx, page_size, s_q,
                   kv_scale)
        if ref_key not in _REFS:
            _REFS.clear()  # one case's reference at a time (they can be large)
            _REFS[ref_key] = f32_reference(qs[0], pools[0], slot_mat, s_q, kv_scale)
        ref_o, ref_l = _REFS[ref_key]
        err = rel_err(o, ref_o)
        lse_err = float(jnp.max(jnp.abs(lse - ref_l)))
        del o, lse, ref_o, ref_l
    t_x = None
    if baseline and not fp8:
        xargs = [(qs[i], pools[i % copies], slot_mat) for i in range(n)]
        base = lambda q, p, sm: xla_decode(q, p, sm, s_q=s_q, sm_scale=SM_SCALE)  # noqa: E731
        t_x = time_calls(base, xargs, reps)
    t_merge = None
    if merge_alone and ns > 1:  # the merge kernel alone, on partials of the kernel's shape
        rp = num_row_blocks(rows, bm) * bm
        nm = min(n, 8)
        margs = [(jax.random.normal(jax.random.fold_in(key, 100 + i), (b, ns, rp, DV),
                                    jnp.dtype(cfg.partial_dtype)),
                  jax.random.normal(jax.random.fold_in(key, 200 + i), (b, ns, rp)))
                 for i in range(nm)]
        t_merge = time_calls(lambda o_, l_: merge_splits_pallas(
            o_, l_, jnp.bfloat16, block_d=cfg.merge_block_d), margs, reps)
    if profile:
        profile_timings([t_main, t_x, t_merge])
    nbytes = kv_bytes + qs[0].size * 2 + b * s_q * h * DV * 2
    flops = 2 * b * s_q * h * ctx * (D + DV)
    del pools, qs, args
    us = lambda t: None if t is None else t * 1e6  # noqa: E731
    dev = t_main.dev
    device_us = None if dev is None else dev["span_us"]
    t_us = device_us if device_us else t_main.wall_s * 1e6
    x_dev = None if t_x is None or t_x.dev is None else t_x.dev["span_us"]
    x_wall = None if t_x is None else t_x.wall_s * 1e6
    x_us = x_dev if device_us else x_wall
    return dict(heads=h, batch=b, ctx=ctx, page_size=page_size, s_q=s_q, num_splits=ns, block_m=bm,
                kernel=kernel, kv_dtype="fp8" if fp8 else "bf16", kv_scale=kv_scale,
                block_kv=cfg.block_kv, num_stages=cfg.resolved_num_stages(bm),
                num_warps=cfg.resolved_num_warps(bm), copies=copies, calls_per_timing=n,
                compile_and_time_s=t_compile, config=dataclasses.asdict(cfg),
                time_us=t_us, time_source="device span" if device_us else "wall",
                device_us=device_us,
                decode_us=None if dev is None else dev["decode_us"],
                merge_us=None if dev is None else dev["merge_us"],
                device=dev,
                wall_us=t_main.wall_s * 1e6, wall_us_min=t_main.wall_min_s * 1e6,
                wall_us_max=t_main.wall_max_s * 1e6,
                kernel_wall_us=None if t_kern is None else t_kern.wall_s * 1e6,
                merge_alone_wall_us=None if t_merge is None else us(t_merge.wall_s),
                merge_alone_device_us=None if t_merge is None or t_merge.dev is None
                else t_merge.dev["merge_us"],
                gbps=nbytes / t_us / 1e3, pct_ceiling=100 * nbytes / (t_us * 1e-6) / ceiling,
                wall_pct_ceiling=100 * nbytes / t_main.wall_s / ceiling,
                tflops=flops / t_us / 1e6,
                rel_err=err, lse_max_abs_err=lse_err,
                xla_us=x_us, xla_device_us=x_dev, xla_wall_us=x_wall,
                xla_device=None if t_x is None else t_x.dev,
                speedup_vs_xla=None if not x_us else x_us / t_us,
                wall_speedup_vs_xla=None if x_wall is None else x_wall / (t_main.wall_s * 1e6))


def fmt_case(r: dict) -> str:
    """One line for a `bench_case` row: device and wall time, % of the ceiling, TF, ratio to
    XLA and error."""
    dev = ("" if r["device_us"] is None else
           f"device {r['device_us']:.1f} us (decode {r['decode_us']:.1f} + merge "
           f"{r['merge_us']:.1f}), ")
    x = "" if r["speedup_vs_xla"] is None else (
        f", x{r['speedup_vs_xla']:.2f} vs XLA ({r['xla_us']:.1f} us)")
    k = "" if r["kernel_wall_us"] is None else f", kernel alone wall {r['kernel_wall_us']:.1f}"
    m = "" if r["merge_alone_device_us"] is None else (
        f", merge alone device {r['merge_alone_device_us']:.1f}")
    e = "" if r["rel_err"] is None else f", err {r['rel_err']:.1e}"
    return (f"{case_label(r['heads'], r['batch'], r['ctx'], r['page_size'])} "
            f"ns={r['num_splits']} "
            f"[{r.get('kernel', 'triton')}]: "
            f"{dev}wall {r['wall_us']:.1f} us ({r['wall_us_min']:.1f}-{r['wall_us_max']:.1f})"
            f"{k}{m}, {r['pct_ceiling']:.1f}% ceil ({r['time_source']}; wall "
            f"{r['wall_pct_ceiling']:.1f}%), {r['tflops']:.1f} TF{x}{e}")
