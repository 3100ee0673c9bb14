"""The torch path against the JAX path on one GPU, in one run: device time per call for the
decode grid, and the checks that make the torch path the JAX path (bit-identity, a 61-layer
CUDA graph, host time per call, the torch op under torch.compile).

Device time per call (grid): H {16, 128} x B {1, 32, 128} x ctx {4k, 16k} x page {1, 64},
every sequence at full context, pool = B * ctx rows (+ a few) of random bf16.
  torch   the launcher (`decode_launcher`, out/lse given) from torch: a `torch.cuda._sleep`
          kernel first so the launches queue behind it, then per call a CUDA event pair around
          one call; median over --reps calls.
  jax     `mla_decode` under jit on the same data (DLPack views), from a JAX profiler trace,
          each call queued behind a spin kernel (bench.timing.device_kernel_times, "span_us":
          first kernel start to last kernel end; median over --reps calls).
  kernel  which decode kernel the launcher runs ("mgpu" / "triton") and, for Triton, why.

Checks (PASS/FAIL in the JSON):
  bitwise     launcher == mla_decode (out and lse bit for bit) for Mosaic GPU and Triton
              shapes, split and unsplit, page 1 and 64, s_q 2;
  graph61     61 launcher calls captured in one torch CUDA graph, replayed with new q and new
              metadata == uncaptured calls, layer 0 == the JAX path;
  torch_op    torch.ops.funcmla.mla_decode(_out) == the launcher; under torch.compile
              (fullgraph) too, with the op one node of the graph;
  host        perf_counter_ns around one call, no sync, median of --calls (the stream drained
              every 100 calls outside the timed region): the launcher, the torch op, the launch
              program alone, jax's own `_as_torch_gpu_kernel` on the same Mosaic module, and a
              cuda-bindings cuLaunchKernel of the merge kernel.

fp8 (--kv-dtype fp8): the same grid and checks over a float8_e4m3fn pool of the same shapes,
read with k_scale = v_scale = 0.03 (the kernel mla_decode picks: the fp8 Mosaic GPU kernel at 16
heads from 16 sequences, Triton elsewhere);
bitwise and host time with the scale as a float and as a device tensor, the graph's layers
with their own scales, misuse with bad scales; the JAX path reads the pool's uint8 bytes with
kv_dtype (bitcast inside its jit). Written to launcher_torch_path_fp8_<card>.json unless --name.

Usage: python -m bench.torch_path [--out docs/results/] [--reps 30] [--calls 2000]
       [--skip-grid] [--only-grid] [--kv-dtype bf16|fp8]
       python -m bench.torch_path --plot docs/results/launcher_torch_path_h200.json  (no GPU:
       the grid as a PNG next to the JSON, torch / JAX device time per case)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from .launch_cases import (  # noqa: E402
    FP8_SCALE,
    SCALE,
    graph_replay_checks,
    launch_config,
    misuse_checks,
    same_bits,
)
from .report import Report, card_tag, log  # noqa: E402
from .timing import host_us  # noqa: E402

RESULTS: dict = {"info": {}, "checks": {}, "verdicts": {}, "host_us": {}, "grid": [],
                 "errors": {}}
REPORT = Report(RESULTS)
save, section = REPORT.save, REPORT.section


def plot(path: str) -> str:
    """Bar chart of the grid in `path` (torch and JAX device time per case, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        rows = [r for r in json.load(f)["grid"] if "torch_us" in r]
    fig, ax = plt.subplots(figsize=(14, 5))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["torch_us"] for r in rows], 0.4, label="torch launcher")
    ax.bar([x + 0.2 for x in xs], [r["jax_us"] for r in rows], 0.4, label="JAX mla_decode")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"H{r['H']} B{r['B']} {r['ctx'] // 1024}k p{r['page']}\n{r['kernel']}"
                        for r in rows], rotation=90, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("device time per call (us)")
    ax.set_title("funcmla decode on the H200: torch launcher vs JAX path (same kernels)")
    ax.legend()
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/")
    ap.add_argument("--name", default=None,
                    help="JSON file name (default launcher_torch_path[_fp8]_<card>.json, "
                         "the card from the device's name: h100, h200)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--only-grid", action="store_true")
    ap.add_argument("--grid-only", metavar="REGEX", default=None,
                    help="grid cases whose name (h128_b1_ctx4k_p64, ...) matches REGEX")
    ap.add_argument("--plot", metavar="JSON", help="plot a saved run's grid and exit")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the pool: bf16 (q's dtype) or float8_e4m3fn with k_scale / v_scale")
    args = ap.parse_args(argv)
    fp8 = args.kv_dtype == "fp8"
    if args.plot:
        log(plot(args.plot))
        return 0
    os.makedirs(args.out, exist_ok=True)

    import jax
    import jaxlib
    import torch

    if args.name is None:
        tag = card_tag(torch.cuda.get_device_name(0))
        args.name = f"launcher_torch_path{'_fp8' if fp8 else ''}_{tag}.json"
    REPORT.path = os.path.join(args.out, args.name)

    from .timing import device_kernel_times
    from funcmla.attention.pallas import mla_decode
    from funcmla.interop import _launch
    from funcmla.interop import launcher as L
    from funcmla.interop.dlpack import to_jax
    from funcmla.layout import PageTable

    dev = torch.device("cuda", 0)
    sync = torch.cuda.synchronize
    info = RESULTS["info"]
    info.update(jax=jax.__version__, jaxlib=jaxlib.__version__, torch=torch.__version__,
                device=torch.cuda.get_device_name(0), jax_backend=jax.default_backend(),
                route=L.kernel_route(), native_launch=_launch.native_library()[1],
                mosaic=L.mosaic.mosaic_unavailable_reason() or "MosaicGpuCompile found")
    pool_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    info.update(kv_dtype=str(pool_dtype), k_scale=FP8_SCALE if fp8 else None)
    log(json.dumps(info, indent=1))
    gen = torch.Generator(device=dev)
    gen.manual_seed(0)

    cfg = functools.partial(launch_config, ctx=4096,
                            kv_dtype="float8_e4m3fn" if fp8 else None)
    # the launcher's scale keywords: a float (its device copy, cached) or a device tensor
    scale_tensor = torch.full((1,), FP8_SCALE, device=dev)
    sk = dict(k_scale=FP8_SCALE) if fp8 else {}
    sk_tensor = dict(k_scale=scale_tensor) if fp8 else {}
    op_scales = (scale_tensor, scale_tensor) if fp8 else ()

    def batch(c, *, full=False, seed=0):
        """q, kv_pool, x, y on dev: random lengths (full: every sequence at max length) and a
        random permutation of pool rows / pages (one row / page per position)."""
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        b, t, h = c.num_seqs, c.num_seqs * c.s_q, c.num_heads
        max_len = c.resolved_max_kv_len
        if full:
            lens = torch.full((b,), max_len, dtype=torch.int32)
        else:
            lens = torch.randint(c.s_q, max_len + 1, (b,), generator=g, dtype=torch.int32)
            if b > 1:
                lens[0] = 0
        q = torch.randn(t, h, c.head_dim, generator=g).to(torch.bfloat16).to(dev)
        kv = torch.randn(c.pool_rows, c.head_dim, device=dev, generator=gen).to(pool_dtype)
        if c.page_size == 1:
            indptr = torch.zeros(b + 1, dtype=torch.int32)
            indptr[1:] = torch.cumsum(lens, 0)
            indices = torch.zeros(c.kv_capacity, dtype=torch.int32)
            n = int(indptr[-1])
            indices[:n] = (torch.randperm(c.pool_rows - 1, generator=g)[:n] + 1).int()
            return q, kv, indptr.to(dev), indices.to(dev)
        pages = c.pool_rows // c.page_size
        table = (torch.randperm(pages - 1, generator=g)[:b * c.max_pages] + 1).int()
        return q, kv, table.view(b, c.max_pages).to(dev), lens.to(dev)

    def jax_fn(c, k_scale=FP8_SCALE):
        """mla_decode for c under jit; an fp8 pool as its uint8 bytes (`jax_pool`), bitcast
        inside with kv_dtype and read with k_scale."""
        common = dict(sm_scale=c.sm_scale, s_q=c.s_q, num_splits=c.num_splits, config=c.kernel,
                      v_head_dim=c.v_head_dim)
        if fp8:
            common.update(kv_dtype="float8_e4m3fn", k_scale=k_scale)
        if c.page_size == 1:
            return jax.jit(lambda q, kv, x, y: mla_decode(
                q, kv, kv_indptr=x, kv_indices=y, max_kv_len=c.resolved_max_kv_len, **common))
        return jax.jit(lambda q, kv, x, y: mla_decode(
            q, kv, page_table=PageTable(x, y, c.page_size), **common))

    def jax_pool(kv):
        return to_jax(kv, fp8="bits") if fp8 else jax.dlpack.from_dlpack(kv)

    def jax_path(c, q, kv, x, y, k_scale=FP8_SCALE):
        j = jax.dlpack.from_dlpack
        out, lse = jax_fn(c, k_scale)(j(q), jax_pool(kv), j(x), j(y))
        return torch.from_dlpack(out), torch.from_dlpack(lse)

    def max_abs(a, b) -> float:
        return float((a.float() - b.float()).abs().nan_to_num(0.0).max())

    launchers = {}

    def launcher(name, c):
        if name not in launchers:
            t0 = time.perf_counter()
            launchers[name] = L.decode_launcher(c, dev)
            inf = launchers[name].info()
            info[f"launcher[{name}]"] = inf
            log(f"built {name} in {time.perf_counter() - t0:.1f}s: kernel={inf['kernel']} "
                f"splits={inf['num_splits']} reason={inf['kernel_reason']} "
                f"launch={inf['launch'][:24]} checks={inf['checks'][:24]}")
        return launchers[name]

    checks = {
        "b32_h128_ps64": cfg(32, 128, page_size=64),
        "b32_h128_ps1": cfg(32, 128),
        "b128_h128_ps64_s1": cfg(128, 128, page_size=64, splits=1),
        "b64_h64_sq2_ps1": cfg(64, 64, s_q=2, ctx=2048),
        "b32_h16_ps64": cfg(32, 16, page_size=64),
        "b32_h16_ps1": cfg(32, 16),
        "b1_h128_ps1": cfg(1, 128),
    }

    @section("bitwise: torch launcher vs mla_decode")
    def bitwise():
        res = {}
        forms = {"": sk, "[tensor scale]": sk_tensor} if fp8 else {"": {}}
        for name, c in checks.items():
            lau = launcher(name, c)
            q, kv, x, y = batch(c)
            t, h = c.num_seqs * c.s_q, c.num_heads
            ref_out, ref_lse = jax_path(c, q, kv, x, y)
            for form, kw in forms.items():
                out = torch.full((t, h, 512), float("nan"), dtype=torch.bfloat16, device=dev)
                lse = torch.full((t, h), float("nan"), device=dev)
                lau(q, kv, x, y, out=out, lse=lse, **kw)
                sync()
                r = {"kernel": lau.plan.kernel, "splits": lau.plan.num_splits,
                     "out_bitwise": same_bits(out, ref_out),
                     "lse_bitwise": same_bits(lse, ref_lse),
                     "out_max_abs": max_abs(out, ref_out)}
                r["ok"] = r["out_bitwise"] and r["lse_bitwise"]
                res[name + form] = r
                log(("PASS " if r["ok"] else "FAIL ") + name + form, r)
        RESULTS["checks"]["bitwise"] = res
        RESULTS["verdicts"]["bitwise"] = bool(res) and all(r["ok"] for r in res.values())
        RESULTS["verdicts"]["mgpu_reached"] = "mgpu" in {r["kernel"] for r in res.values()}

    graph_case = "b32_h16_ps64" if fp8 else "b32_h128_ps64"

    @section("CUDA graph: 61 launcher calls (" + ("fp8 Mosaic GPU decode + merge, per-layer "
                                                  "scales" if fp8 else "Mosaic GPU decode + merge")
             + ") replayed")
    def graph61():
        c = checks[graph_case]
        lau = launcher(graph_case, c)
        layers = 61
        _, kv0, x, y = batch(c)
        kvs = [kv0] + [torch.randn_like(kv0, dtype=torch.float32).to(pool_dtype)
                       for _ in range(3)]
        t, h = c.num_seqs, c.num_heads
        qs = [torch.randn(t, h, 576, device=dev).to(torch.bfloat16) for _ in range(layers)]
        # fp8: each layer its own k_scale, a float (its device copy written in the eager
        # warm-up before the capture) or, every fourth layer, a device tensor
        scales = [{"k_scale": scale_tensor if i % 4 == 3 else FP8_SCALE * (1 + i / 64)}
                  for i in range(layers)] if fp8 else None
        res, g = graph_replay_checks(
            lau, qs, [kvs[i % 4] for i in range(layers)], x, y,
            lambda step: batch(c, seed=step + 1)[2:], functools.partial(jax_path, c),
            sync=sync, log=log, scales=scales)
        RESULTS["checks"]["graph61"] = res
        RESULTS["verdicts"]["graph61"] = all(all(r.values()) for r in res)
        RESULTS["host_us"]["graph_replay_61"] = host_us(g.replay, 50, sync, warmup=3)

    @section("torch op and torch.compile")
    def torch_op():
        ops = L.register_torch_ops()
        c = checks["b32_h128_ps64"]
        lau = launcher("b32_h128_ps64", c)
        q, kv, x, y = batch(c)
        ref_out, ref_lse = lau(q, kv, x, y, **sk_tensor)
        o1, l1 = torch.ops.funcmla.mla_decode(q, kv, x, y, SCALE, 1, 64, 0, 0, 512, *op_scales)
        o2 = torch.empty_like(ref_out)
        l2 = torch.empty_like(ref_lse)
        torch.ops.funcmla.mla_decode_out(q, kv, x, y, o2, l2, SCALE, 1, 64, 0, 0, 512,
                                         *op_scales)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        def step(q, kv, x, y):
            o, lse = torch.ops.funcmla.mla_decode(q, kv, x, y, SCALE, 1, 64, 0, 0, 512,
                                                  *op_scales)
            return o * 1, lse

        compiled = torch.compile(step, backend=backend, fullgraph=True)
        o3, l3 = compiled(q, kv, x, y)
        inductor = torch.compile(step, fullgraph=True)
        o4, l4 = inductor(q, kv, x, y)
        sync()
        nodes = [str(n.target) for gm in graphs for n in gm.graph.nodes
                 if n.op == "call_function"]
        r = {"op_equals_launcher": same_bits(o1, ref_out) and same_bits(l1, ref_lse),
             "op_out_equals_launcher": same_bits(o2, ref_out) and same_bits(l2, ref_lse),
             "compiled_equals_launcher": same_bits(o3, ref_out) and same_bits(l3, ref_lse),
             "inductor_equals_launcher": same_bits(o4, ref_out) and same_bits(l4, ref_lse),
             "one_op_node": sum("funcmla.mla_decode" in n for n in nodes) == 1}
        RESULTS["checks"]["torch_op"] = {**r, "graph_nodes": nodes}
        RESULTS["verdicts"]["torch_op"] = all(r.values())
        log(r, nodes)
        T = RESULTS["host_us"]
        n = args.calls
        T["op_mla_decode_out"] = host_us(lambda: torch.ops.funcmla.mla_decode_out(
            q, kv, x, y, o2, l2, SCALE, 1, 64, 0, 0, 512, *op_scales), n, sync)
        del ops

    @section("host time per call")
    def host():
        T = RESULTS["host_us"]
        n = args.calls
        T["timer_floor"] = host_us(lambda: None, n, lambda: None)
        a = torch.randn(128, device=dev)
        T["torch_add_128"] = host_us(lambda: torch.add(a, a), n, sync)
        for name in ("b32_h128_ps64", "b32_h128_ps1", "b128_h128_ps64_s1", "b32_h16_ps64"):
            c = checks[name]
            lau = launcher(name, c)
            q, kv, x, y = batch(c)
            out, lse = lau(q, kv, x, y, **sk)
            T[f"launcher[{name}]"] = host_us(lambda: lau(q, kv, x, y, out=out, lse=lse, **sk),
                                            n, sync)
            if fp8:
                T[f"launcher_tensor_scale[{name}]"] = host_us(
                    lambda: lau(q, kv, x, y, out=out, lse=lse, **sk_tensor), n, sync)
            T[f"launcher_alloc[{name}]"] = host_us(lambda: lau(q, kv, x, y, **sk), n, sync)
            T[f"torch_decode[{name}]"] = host_us(lambda: L.torch_decode(
                q, kv, x, y, sm_scale=SCALE, out=out, lse=lse, **sk), n, sync) \
                if c.page_size == 1 else None
            p = lau.program
            stream = torch.cuda.current_stream().cuda_stream
            scale_ptrs = (scale_tensor.data_ptr(),) * 2 if fp8 else (0, 0)
            p.pack(p.buffer, 0, stream, (1 << len(p.kernels)) - 1, x.data_ptr(), y.data_ptr(),
                   q.data_ptr(), kv.data_ptr(), out.data_ptr(), lse.data_ptr(), *scale_ptrs,
                   0)  # no "lens" table
            T[f"program_run[{name}]"] = host_us(lambda: p.run(p.ref), n, sync)
            if lau.plan.kernel == "mgpu":
                p.struct.mask = 1  # the Mosaic GPU host function alone
                T[f"mosaic_host_fn[{name}]"] = host_us(lambda: p.run(p.ref), n, sync)
                p.struct.mask = (1 << len(p.kernels)) - 1
            log(name, {k: v for k, v in T.items() if name in k})
        if fp8:  # the alternatives below are the Mosaic GPU kernel's and the bf16 merge's
            log(json.dumps(T, indent=1))
            return
        # Alternative (a): jax's own torch interop on the same Mosaic module.
        c = checks["b128_h128_ps64_s1"]
        lau = launcher("b128_h128_ps64_s1", c)
        try:
            import jax.numpy as jnp
            from jax.experimental.mosaic.gpu import core as mgpu_core

            call = lau.plan.decode
            dt = {"i32": jnp.int32, "bf16": jnp.bfloat16, "f32": jnp.float32}
            ins = tuple(jax.ShapeDtypeStruct(s, dt[d]) for s, d in call.operands)
            outs = tuple(jax.ShapeDtypeStruct(s, dt[d]) for s, d in call.results)
            fn = mgpu_core._as_torch_gpu_kernel(call.module, ins, outs)
            q, kv, x, y = batch(c)
            ref = lau(q, kv, x, y)
            torch.cuda.default_stream(dev).synchronize()
            meta, table = (y, x.view(-1)) if c.page_size > 1 else (x, y)
            got = fn(meta, table, q, kv)
            sync()
            RESULTS["checks"]["as_torch_gpu_kernel_bitwise"] = (
                same_bits(got[0].view(ref[0].shape), ref[0])
                and same_bits(got[1].view(ref[1].shape), ref[1]))
            T["as_torch_gpu_kernel[b128_h128_ps64_s1]"] = host_us(
                lambda: fn(meta, table, q, kv), n, sync)
        except Exception as err:  # noqa: BLE001
            RESULTS["errors"]["as_torch_gpu_kernel"] = f"{type(err).__name__}: {err}"
            log("as_torch_gpu_kernel:", traceback.format_exc())
        # cuda-bindings: cuLaunchKernel of the merge kernel, its parameter array prepared once.
        try:
            from cuda.bindings import driver as cbd

            c = checks["b32_h128_ps64"]
            lau = launcher("b32_h128_ps64", c)
            merge = lau.merge
            ptrs = merge.args  # the LoadedKernel's own argument array (values)
            q, kv, x, y = batch(c)
            out, lse = lau(q, kv, x, y)
            ptrs[0], ptrs[1] = lau._o_part.data_ptr(), lau._lse_part.data_ptr()
            ptrs[2], ptrs[3] = out.data_ptr(), lse.data_ptr()
            import ctypes

            params = ctypes.addressof(merge._params)
            fn_handle = cbd.CUfunction(merge.function)
            g, b = merge.grid, merge.block
            stream = cbd.CUstream(torch.cuda.current_stream().cuda_stream)

            def cb_launch():
                cbd.cuLaunchKernel(fn_handle, g[0], g[1], g[2], b[0], b[1], b[2],
                                   merge.shared_mem_bytes, stream, params, 0)

            T["cuda_bindings_cuLaunchKernel[merge]"] = host_us(cb_launch, n, sync)
            T["ctypes_cuLaunchKernel[merge]"] = host_us(lambda: merge.launch(
                torch.cuda.current_stream().cuda_stream), n, sync)
            import cuda.bindings

            info["cuda_bindings"] = getattr(cuda.bindings, "__version__", "?")
        except Exception as err:  # noqa: BLE001
            RESULTS["errors"]["cuda_bindings"] = f"{type(err).__name__}: {err}"
            log("cuda-bindings:", traceback.format_exc())
        log(json.dumps(T, indent=1))

    @section("device time grid: torch launcher vs JAX path")
    def grid():
        reps = args.reps
        for h in (16, 128):
            for b in (1, 32, 128):
                for ctx in (4096, 16384):
                    for page_size in (1, 64):
                        c = cfg(b, h, page_size=page_size, ctx=ctx)
                        name = f"h{h}_b{b}_ctx{ctx // 1024}k_p{page_size}"
                        if args.grid_only and not re.search(args.grid_only, name):
                            continue
                        row = {"name": name, "H": h, "B": b, "ctx": ctx, "page": page_size}
                        try:
                            lau = L.decode_launcher(c, dev)
                            row.update(kernel=lau.plan.kernel, splits=lau.plan.num_splits,
                                       kernel_reason=lau.plan.kernel_reason)
                            q, kv, x, y = batch(c, full=True)
                            out, lse = lau(q, kv, x, y, **sk)
                            starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
                            ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
                            sync()
                            torch.cuda._sleep(40_000_000)  # ~20 ms: the calls queue behind it
                            for i in range(reps):
                                starts[i].record()
                                lau(q, kv, x, y, out=out, lse=lse, **sk)
                                ends[i].record()
                            sync()
                            row["torch_us"] = statistics.median(
                                s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))
                            # the same calls back to back between one event pair: the mean
                            # per call without the per-call event records between kernels
                            torch.cuda._sleep(40_000_000)
                            starts[0].record()
                            for i in range(reps):
                                lau(q, kv, x, y, out=out, lse=lse, **sk)
                            ends[0].record()
                            sync()
                            row["torch_loop_us"] = starts[0].elapsed_time(ends[0]) * 1e3 / reps
                            j = jax.dlpack.from_dlpack
                            fn = jax_fn(c)
                            ja = (j(q), jax_pool(kv), j(x), j(y))
                            jo = fn(*ja)
                            jax.block_until_ready(jo)
                            row["bitwise"] = (same_bits(torch.from_dlpack(jo[0]), out)
                                              and same_bits(torch.from_dlpack(jo[1]), lse))
                            stats = device_kernel_times(
                                lambda: jax.block_until_ready(fn(*ja)), reps=reps, primed=True)
                            row["jax_us"] = stats["span_us"] if stats else None
                            del q, kv, x, y, out, lse, ja, jo
                        except Exception as err:  # noqa: BLE001
                            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                            log(traceback.format_exc())
                        RESULTS["grid"].append(row)
                        log(row)
                        save()
                        launchers.pop(name, None)
                        torch.cuda.empty_cache()

    @section("misuse: LauncherArgumentError before any launch (" + ("fp8 Triton" if fp8 else
                                                                     "Mosaic GPU") + " launcher)")
    def misuse():
        c = checks["b32_h128_ps64"]
        lau = launcher("b32_h128_ps64", c)
        q, kv, x, y = batch(c)
        extra = {"table_int64": dict(x=x.long()), "lengths_cpu": dict(y=y.cpu())}
        if fp8:
            extra.update(k_scale_float64=dict(k_scale=scale_tensor.double()),
                         k_scale_cpu=dict(k_scale=scale_tensor.cpu()),
                         v_scale_negative=dict(v_scale=-1.0),
                         kv_pool_bf16=dict(kv=kv.to(torch.bfloat16)))
        res = misuse_checks(lau, q, kv, x, y, extra, sync=sync)
        RESULTS["checks"]["misuse"] = res
        RESULTS["verdicts"]["misuse"] = all(r["ok"] for r in res.values())
        log({k: v["ok"] for k, v in res.items()})

    if not args.only_grid:
        bitwise()
        misuse()
        graph61()
        torch_op()
        host()
    if not args.skip_grid:
        grid()
    log(json.dumps(RESULTS["verdicts"], indent=1))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
