"""Host time per call of funcmla's torch launcher for the Pallas decode kernel, against the other
ways of reaching a kernel from torch, all measured in one run on one GPU; plus the checks that
make the launcher usable in a serving step (bit-identity, CUDA-graph capture, misuse).

Rows of the timing table (host time of one call: perf_counter_ns around the call, no sync;
median over --calls calls; the stream is drained every 100 calls outside the timed region, so
the launch queue never fills and GPU time never leaks into host time):
  torch_add_128            torch's own elementwise op on 128 elements (baseline of the table)
  jax_jit_add_128          a jitted jnp add on 128-element JAX arrays
  jax_jit_decode           jitted `mla_decode` on JAX arrays (same shapes as the launcher)
  dlpack_jit_decode        torch -> jax.dlpack.from_dlpack -> jitted mla_decode -> torch.from_dlpack
  launcher_decode[_alloc]  the launcher (out/lse given | allocated per call)
  launcher_decode_kvlens   the launcher with kv_lens given too (no prep kernel: one launch less)
  launcher_checks_only     the argument checks alone (4 inputs + 2 outputs)
  launch_only              one raw cuLaunchKernel of the decode kernel (prepared parameters)
  graph_replay_1           torch CUDA graph replay of one launcher call
  graph_replay_61          replay of a 61-layer graph (one decode per layer), per replay

Checks (each prints PASS/FAIL and lands in the JSON):
  bitwise      launcher vs `mla_decode` (JAX path via DLPack) for several configurations
               (num_splits 1 and > 1, padded rows, 128 heads, empty sequences);
  merge_xla    the Pallas merge kernel (both rounding variants) vs XLA's `merge_splits`;
  graph61      61 launcher calls captured once, replayed twice with new q and new metadata:
               equal (bitwise) to uncaptured calls on the same data, and changed between steps;
  misuse       wrong dtype / non-contiguous / wrong device / wrong shape / misaligned raise
               LauncherArgumentError and the sentinel output is untouched (nothing launched).

Usage: python -m bench.launcher [--out out/] [--calls 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402

RESULTS: dict = {"checks": {}, "timings_us": {}, "info": {}, "errors": {}}


def log(*a):
    print(*a, flush=True)


def section(name):
    def deco(fn):
        def run(*args, **kw):
            t0 = time.perf_counter()
            log(f"\n=== {name}")
            try:
                return fn(*args, **kw)
            except Exception as err:  # noqa: BLE001 - keep the other sections running
                RESULTS["errors"][name] = f"{type(err).__name__}: {err}"
                log(traceback.format_exc())
            finally:
                log(f"=== {name}: {time.perf_counter() - t0:.1f} s")
        return run
    return deco


def host_times_us(fn, calls: int, sync, warmup: int = 50) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    pc = time.perf_counter_ns
    for i in range(calls):
        t0 = pc()
        fn()
        times.append(pc() - t0)
        if i % 100 == 99:
            sync()
    sync()
    return statistics.median(times) / 1e3


def random_batch(torch, rng, cfg, dev, *, empty_first=True):
    """q, kv_pool, kv_indptr, kv_indices (torch, on dev) with random lengths <= max_kv_len."""
    b, t, h = cfg.num_seqs, cfg.num_seqs * cfg.s_q, cfg.num_heads
    max_len = min(cfg.resolved_max_kv_len, cfg.kv_capacity // b)
    lens = rng.integers(cfg.s_q, max_len + 1, size=b)
    if empty_first and b > 1:
        lens[0] = 0
    indptr = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    indices = np.zeros(cfg.kv_capacity, np.int32)
    indices[: indptr[-1]] = rng.choice(np.arange(1, cfg.pool_rows), size=indptr[-1], replace=False)
    q = torch.randn(t, h, cfg.head_dim, device=dev).to(torch.bfloat16)
    kv = torch.randn(cfg.pool_rows, cfg.head_dim, device=dev).to(torch.bfloat16)
    return (q, kv, torch.from_numpy(indptr).to(dev), torch.from_numpy(indices).to(dev))


def same_bits(torch, a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return bool(torch.equal(a.view(view[a.dtype]), b.view(view[b.dtype])))


def max_ulp(torch, a, b) -> int:
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
    ia = a.contiguous().view(view[a.dtype]).to(torch.int64)
    ib = b.contiguous().view(view[b.dtype]).to(torch.int64)
    return int((ia - ib).abs().max().item()) if ia.numel() else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/")
    ap.add_argument("--calls", type=int, default=10_000)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    from funcmla.attention.pallas import mla_decode
    from funcmla.attention.pallas.decode_common import merge_splits
    from funcmla.interop import launcher as L

    dev = torch.device("cuda", 0)
    info = RESULTS["info"]
    info.update(jax=jax.__version__, torch=torch.__version__, device=torch.cuda.get_device_name(0),
                jax_devices=str(jax.devices()), ptxas=L._ptxas_candidates())
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    log(json.dumps(info, indent=1))
    sync = torch.cuda.synchronize
    rng = np.random.default_rng(0)
    scale = 0.1352337788608801

    cfgs = {
        "b8_h16_split": L.DecodeLaunchConfig(num_seqs=8, num_heads=16, pool_rows=32768,
                                             kv_capacity=8 * 1024, max_kv_len=1024,
                                             sm_scale=scale),
        "b8_h16_s1": L.DecodeLaunchConfig(num_seqs=8, num_heads=16, pool_rows=32768,
                                          kv_capacity=8 * 1024, max_kv_len=1024, sm_scale=scale,
                                          num_splits=1),
        "b4_h128_split": L.DecodeLaunchConfig(num_seqs=4, num_heads=128, pool_rows=16384,
                                              kv_capacity=4 * 2048, max_kv_len=2048,
                                              sm_scale=scale),
        "b3_h8_sq3_pad": L.DecodeLaunchConfig(num_seqs=3, num_heads=8, s_q=3, pool_rows=8192,
                                              kv_capacity=3 * 512, max_kv_len=512,
                                              sm_scale=scale),
        "b160_h16_auto1": L.DecodeLaunchConfig(num_seqs=160, num_heads=16, pool_rows=65536,
                                               kv_capacity=160 * 256, max_kv_len=256,
                                               sm_scale=scale),
    }
    launchers = {}

    @section("probe: lowering form, PTX, ptxas")
    def probe():
        lowered = L.lower_for_cuda(lambda x: L.kv_lens_pallas(x),
                                   jax.ShapeDtypeStruct((9,), jnp.int32))
        text = lowered.as_text()
        targets = sorted(set(__import__("re").findall(r"custom_call @([\w$.]+)", text)))
        info["custom_call_targets"] = targets
        log("custom call targets:", targets)
        plan = L.decode_plan(cfgs["b8_h16_split"])
        for k in (plan.prep, plan.decode, plan.merge):
            log(k.summary())
        if plan.decode.ttir is not None:
            with open(os.path.join(args.out, "decode.ttir"), "w") as f:
                f.write(L.ttir_text(plan.decode))
        img = L.compile_call(plan.decode, "9.0")
        with open(os.path.join(args.out, "decode.ptx"), "w") as f:
            f.write(img.ptx)
        log("decode kernel compiled:", img.entry, img.num_params, "params,",
            img.shared_mem_bytes, "B smem, target", L.ptx_target(img.ptx), "by", img.how)

    os.makedirs(args.out, exist_ok=True)
    probe()

    @section("build launchers")
    def build():
        for name, cfg in cfgs.items():
            t0 = time.perf_counter()
            launchers[name] = L.decode_launcher(cfg, dev)
            info[f"build_s[{name}]"] = round(time.perf_counter() - t0, 2)
            info[f"launcher[{name}]"] = launchers[name].info()
            k = launchers[name].info()["kernels"]
            log(name, f"{time.perf_counter() - t0:.2f}s splits={launchers[name].plan.num_splits}",
                [(x["name"], x["grid"], x["num_params"], x["shared_mem_bytes"], x["num_regs"],
                  x["compiled_with"][:60]) for x in k])

    build()

    def jax_decode(cfg, q, kv, indptr, indices):
        out, lse = mla_decode(jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv),
                              kv_indptr=jax.dlpack.from_dlpack(indptr),
                              kv_indices=jax.dlpack.from_dlpack(indices), sm_scale=cfg.sm_scale,
                              s_q=cfg.s_q, num_splits=cfg.num_splits, config=cfg.kernel,
                              max_kv_len=cfg.resolved_max_kv_len, v_head_dim=cfg.v_head_dim)
        return torch.from_dlpack(out), torch.from_dlpack(lse)

    @section("bitwise: launcher vs mla_decode (JAX path)")
    def bitwise():
        res = {}
        for name, lau in launchers.items():
            cfg = cfgs[name]
            q, kv, indptr, indices = random_batch(torch, rng, cfg, dev)
            out, lse = lau(q, kv, indptr, indices)
            ref_out, ref_lse = jax_decode(cfg, q, kv, indptr, indices)
            sync()
            ok_o, ok_l = same_bits(torch, out, ref_out), same_bits(torch, lse, ref_lse)
            fin = torch.isfinite(ref_lse)
            res[name] = {"splits": lau.plan.num_splits, "out_bitwise": ok_o, "lse_bitwise": ok_l,
                         "out_max_ulp": max_ulp(torch, out, ref_out),
                         "lse_max_ulp_finite": max_ulp(torch, lse[fin], ref_lse[fin]),
                         "lse_inf_match": bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))),
                         "out_max_abs": float((out.float() - ref_out.float()).abs().max())}
            log(name, res[name])
        RESULTS["checks"]["bitwise"] = res

    bitwise()

    @section("merge kernel vs XLA merge_splits")
    def merge_vs_xla():
        res = {}
        xla_merge = jax.jit(merge_splits, static_argnums=2)
        for contract in ("separate", "fma"):
            for s in (2, 3, 5, 8):
                b, r, dv = 4, 32, 512
                call = L.extract_one(
                    lambda o, l: L.merge_splits_pallas(o, l, jnp.bfloat16, contract=contract),
                    jax.ShapeDtypeStruct((b, s, r, dv), jnp.float32),
                    jax.ShapeDtypeStruct((b, s, r), jnp.float32))
                k = L.LoadedKernel(call, 0, "9.0")
                o = torch.randn(b, s, r, dv, device=dev)
                lse = torch.randn(b, s, r, device=dev) * 4
                lse[0, 1:] = -float("inf")
                lse[1, :, :3] = -float("inf")
                out = torch.empty(b, r, dv, dtype=torch.bfloat16, device=dev)
                lse_out = torch.empty(b, r, device=dev)
                for i, t in enumerate((o, lse, out, lse_out)):
                    k.args[i] = t.data_ptr()
                k.launch(torch.cuda.current_stream().cuda_stream)
                ro, rl = xla_merge(jax.dlpack.from_dlpack(o), jax.dlpack.from_dlpack(lse),
                                   jnp.bfloat16)
                ro, rl = torch.from_dlpack(ro), torch.from_dlpack(rl)
                sync()
                fin = torch.isfinite(rl)
                res[f"{contract}_s{s}"] = {
                    "out_bitwise": same_bits(torch, out, ro),
                    "lse_bitwise": same_bits(torch, lse_out, rl),
                    "out_mismatch_frac": float((out.view(torch.int16) != ro.view(torch.int16))
                                               .float().mean()),
                    "out_max_ulp": max_ulp(torch, out, ro),
                    "lse_max_ulp": max_ulp(torch, lse_out[fin], rl[fin])}
                log(contract, s, res[f"{contract}_s{s}"])
        RESULTS["checks"]["merge_xla"] = res

    merge_vs_xla()

    @section("misuse raises and launches nothing")
    def misuse():
        name = "b8_h16_s1"
        cfg, lau = cfgs[name], launchers[name]
        q, kv, indptr, indices = random_batch(torch, rng, cfg, dev)
        out = torch.full((cfg.num_seqs, cfg.num_heads, 512), 7.0, dtype=torch.bfloat16,
                         device=dev)
        lse = torch.full((cfg.num_seqs, cfg.num_heads), 7.0, device=dev)
        qbig = torch.zeros(q.numel() + 8, dtype=q.dtype, device=dev)
        cases = {
            "q_float32": dict(q=q.float()),
            "q_noncontig": dict(q=q.transpose(0, 1).contiguous().transpose(0, 1)),
            "q_cpu": dict(q=q.cpu()),
            "q_shape": dict(q=q[:-1].contiguous()),
            "q_misaligned": dict(q=qbig[1:1 + q.numel()].view(q.shape)),
            "kv_pool_rows": dict(kv=kv[:-1]),
            "indptr_int64": dict(indptr=indptr.long()),
            "indptr_shape": dict(indptr=indptr[:-1].contiguous()),
            "indices_cpu": dict(indices=indices.cpu()),
            "out_dtype": dict(out=out.float()),
            "lse_shape": dict(lse=lse[:-1]),
            "not_a_tensor": dict(q=np.zeros(3)),
        }
        res = {}
        for case, kw in cases.items():
            a = dict(q=q, kv=kv, indptr=indptr, indices=indices, out=out, lse=lse)
            a.update(kw)
            sync()
            try:
                lau(a["q"], a["kv"], a["indptr"], a["indices"], out=a["out"], lse=a["lse"])
                raised = "no error"
            except L.LauncherArgumentError as err:
                raised = str(err)
            sync()
            untouched = bool((out == 7).all()) and bool((lse == 7).all())
            res[case] = {"error": raised, "untouched": untouched,
                         "ok": raised != "no error" and untouched}
            log(case, res[case])
        RESULTS["checks"]["misuse"] = res

    misuse()

    @section("CUDA graph: 61 decode calls captured once, replayed with new data")
    def graph61():
        name = "b8_h16_split"
        cfg, lau = cfgs[name], launchers[name]
        layers = 61
        _, _, indptr, indices = random_batch(torch, rng, cfg, dev)
        qs = [torch.randn(8, 16, 576, device=dev).to(torch.bfloat16) for _ in range(layers)]
        kvs = [torch.randn(cfg.pool_rows, 576, device=dev).to(torch.bfloat16)
               for _ in range(layers)]
        outs = [torch.empty(8, 16, 512, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
        lses = [torch.empty(8, 16, device=dev) for _ in range(layers)]
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(layers):
                lau(qs[i], kvs[i], indptr, indices, out=outs[i], lse=lses[i])
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(layers):
                lau(qs[i], kvs[i], indptr, indices, out=outs[i], lse=lses[i])
        res, prev = [], None
        for step in range(2):
            _, _, new_indptr, new_indices = random_batch(torch, rng, cfg, dev,
                                                         empty_first=step == 0)
            indptr.copy_(new_indptr)
            indices.copy_(new_indices)
            for i in range(layers):
                qs[i].copy_(torch.randn(8, 16, 576, device=dev).to(torch.bfloat16))
            g.replay()
            sync()
            got = [(o.clone(), l.clone()) for o, l in zip(outs, lses)]
            ref = [lau(qs[i], kvs[i], indptr, indices) for i in range(layers)]
            jref = jax_decode(cfg, qs[0], kvs[0], indptr, indices)
            sync()
            equal = all(same_bits(torch, a[0], b[0]) and same_bits(torch, a[1], b[1])
                        for a, b in zip(got, ref))
            changed = prev is None or not all(same_bits(torch, a[0], b[0])
                                              for a, b in zip(got, prev))
            res.append({"replay_equals_uncaptured": equal, "changed_since_last_step": changed,
                        "layer0_equals_jax_path_max_ulp": max_ulp(torch, got[0][0], jref[0])})
            log(step, res[-1])
            prev = got
        t_replay = host_times_us(g.replay, 200, sync, warmup=5)
        RESULTS["timings_us"]["graph_replay_61"] = t_replay
        RESULTS["checks"]["graph61"] = res
        log("graph_replay_61 host us", t_replay)

    graph61()

    @section("host time per call")
    def timings():
        n = args.calls
        T = RESULTS["timings_us"]
        a = torch.randn(128, device=dev)
        bb = torch.randn(128, device=dev)
        T["torch_add_128"] = host_times_us(lambda: torch.add(a, bb), n, sync)
        ja, jb = jnp.ones(128), jnp.ones(128)
        jadd = jax.jit(lambda x, y: x + y)
        jadd(ja, jb).block_until_ready()
        T["jax_jit_add_128"] = host_times_us(lambda: jadd(ja, jb), n,
                                             lambda: jadd(ja, jb).block_until_ready())
        for name in ("b8_h16_split", "b8_h16_s1"):
            cfg, lau = cfgs[name], launchers[name]
            q, kv, indptr, indices = random_batch(torch, rng, cfg, dev)
            out = torch.empty(cfg.num_seqs, cfg.num_heads, 512, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(cfg.num_seqs, cfg.num_heads, device=dev)
            T[f"launcher_decode[{name}]"] = host_times_us(
                lambda: lau(q, kv, indptr, indices, out=out, lse=lse), n, sync)
            T[f"launcher_decode_alloc[{name}]"] = host_times_us(
                lambda: lau(q, kv, indptr, indices), n, sync)
            kv_lens = (indptr[1:] - indptr[:-1]).contiguous()
            T[f"launcher_decode_kvlens[{name}]"] = host_times_us(
                lambda: lau(q, kv, indptr, indices, kv_lens=kv_lens, out=out, lse=lse), n, sync)

            def checks_only():
                lau.q_spec.pointer(q), lau.kv_spec.pointer(kv)
                lau.indptr_spec.pointer(indptr), lau.indices_spec.pointer(indices)
                lau.out_spec.pointer(out), lau.lse_spec.pointer(lse)

            T[f"launcher_checks_only[{name}]"] = host_times_us(checks_only, n, sync)
            stream = torch.cuda.current_stream().cuda_stream
            lau(q, kv, indptr, indices, out=out, lse=lse)
            T[f"launch_only[{name}]"] = host_times_us(lambda: lau.decode.launch(stream), n, sync)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                lau(q, kv, indptr, indices, out=out, lse=lse)
            T[f"graph_replay_1[{name}]"] = host_times_us(g.replay, n, sync)
            jq, jkv = jax.dlpack.from_dlpack(q), jax.dlpack.from_dlpack(kv)
            jip, jix = jax.dlpack.from_dlpack(indptr), jax.dlpack.from_dlpack(indices)

            def jax_call():
                return mla_decode(jq, jkv, kv_indptr=jip, kv_indices=jix, sm_scale=cfg.sm_scale,
                                  num_splits=cfg.num_splits, max_kv_len=cfg.resolved_max_kv_len)

            jax_call()[0].block_until_ready()
            T[f"jax_jit_decode[{name}]"] = host_times_us(
                jax_call, n, lambda: jax_call()[0].block_until_ready())
            T[f"dlpack_jit_decode[{name}]"] = host_times_us(
                lambda: jax_decode(cfg, q, kv, indptr, indices), max(n // 10, 200), sync)
            # GPU time per call (events), launcher vs graph of the same call
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(200):
                lau(q, kv, indptr, indices, out=out, lse=lse)
            e1.record()
            sync()
            T[f"gpu_us_per_launcher_call[{name}]"] = e0.elapsed_time(e1) * 1e3 / 200
            for k, v in T.items():
                if name in k:
                    log(f"{k:45s} {v:9.2f} us")
        log(f"{'torch_add_128':45s} {T['torch_add_128']:9.2f} us")
        log(f"{'jax_jit_add_128':45s} {T['jax_jit_add_128']:9.2f} us")

    timings()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "launcher.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    try:
        from bench.timing import print_table

        base = RESULTS["timings_us"].get("torch_add_128")
        rows = [[k, v, (v / base) if base else float("nan")]
                for k, v in RESULTS["timings_us"].items()]
        print_table("host time per call (median, us)", ["path", "us", "x torch_add_128"], rows)
    except Exception as err:  # noqa: BLE001
        log("table:", err)
    log("errors:", json.dumps(RESULTS["errors"], indent=1))
    log("wrote", path)
    return 0 if not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
