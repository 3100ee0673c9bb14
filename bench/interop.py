"""DLPack conversion cost vs a copy, and the SGLang backend's per-step metadata host time.

    python -m bench.interop [--out out/] [--max-mb 4096] [--device auto|cpu|cuda] [--quick]

Part 1, conversion (float32 tensors of 1 MB .. --max-mb): host time of `to_jax` (torch -> JAX)
and `to_torch` (JAX -> torch), both zero-copy, against a device copy of the same tensor
(`torch.clone` and `jnp.array(copy=True)`, timed to completion). Medians; ratio copy / DLPack.

Part 2, the decode step of `FuncMLAAttnBackend` (host time, medians), batch 1 .. 256 with
2k-4k-token requests, 16 heads, page 16, with the persistent work plan (SGLang's aiter layout):
  input_import     torch.cat of the step inputs (padded to the bucket) + 1 `to_jax`
  build_dispatch   the jitted metadata + plan program (returns before the device finishes)
  handoff          1 `to_torch` of the packed buffer + the views + ForwardMetadata
  checks           the host-mirror checks alone (funcmla.interop.sglang.host_checks)
  init_nocheck     `init_forward_metadata` with the checks replaced by the bare host lengths
                   (the step before the checks existed), measured in the same run
  init_metadata    the whole eager `init_forward_metadata` (checks + metadata + plan + hand-off)
  init_noplan      the same without the work plan
  graph_replay     `init_forward_metadata_replay_cuda_graph` into the static buffers
  check_cost       init_metadata - init_nocheck (the target: +2 us at most)
  checks_device_path / lens_only / check_cost_device_path: the checks with device tensors (meta
                   tensors stand in for GPU ones: only the host mirrors are read, as on a GPU)
                   against the bare host lengths the step read before the checks
Part 3, compiles: the first step at each of a few batch buckets (compile included, persistent
cache off) against the steady-state step of that bucket.
Part 4 (CUDA), the metadata on torch's stream (`metadata_launcher`, interop/sglang/step_launch)
against the JAX path in the same run, decode and target verify (n=4), batch 1 / 64 / 256,
16 heads, page 16, work plan on, int64 index tensors (SGLang's):
  eager_us / eager_jax_us    `init_forward_metadata` (checks + staging + program + views)
  replay_us / replay_jax_us  `init_forward_metadata_replay_cuda_graph` (max_bs 256)
  attn61_device_us           device time of 61 decode layers (pallas launcher, captured in one
                             CUDA graph, CUDA events around its replay), the step the metadata
                             feeds; step61_host_us: host time of a whole eager step (metadata +
                             61 layers' launches); sync_free: no host sync during the step
                             (checked with torch.cuda.set_sync_debug_mode("error")).
  layer_host_us              (step61_host_us - metadata_host_us) / 61: host time per layer
                             (61 layer objects, one pool layer each) through each layer's
                             resolved launch; `_mla_attention`: the same with every layer
                             through `mla_attention` (the general entry). Both steps and the
                             metadata are timed with the device synchronized after every call
                             (untimed), so no queued work stalls the host inside a step.
  `--launch-only` runs Part 4 alone. Target: eager and replay <= 60 us at batch 64, flat to 256.
The hand-off target is at most 30 us whatever the batch. Writes out/interop.json.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from . import timing
from .timing import environment, print_table, write_json
from funcmla.interop.dlpack import data_ptr, to_jax, to_torch
from funcmla.interop.sglang import backend as backend_mod
from funcmla.interop.sglang import host_checks
from funcmla.interop.sglang.step import build_step
from funcmla.interop.sglang_backend import (
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
)

HANDOFF_TARGET_US = 30.0


def host_us(fn, *, reps, sync=None, warmup=3, sync_every=50) -> float:
    """Median host time of fn() in microseconds; `sync` (untimed) runs every `sync_every`
    calls."""
    return timing.host_us(fn, reps, sync, warmup=warmup, sync_every=sync_every)


def conversion_rows(device: str, sizes_mb: list[int], reps: int) -> list[dict]:
    cuda = device == "cuda"
    jdev = jax.devices("gpu" if cuda else "cpu")[0]
    sync = torch.cuda.synchronize if cuda else None
    rows = []
    for mb in sizes_mb:
        n = mb * (1 << 20) // 4
        t = torch.ones(n, dtype=torch.float32, device=device)
        x = jax.device_put(jnp.ones((n,), jnp.float32), jdev)
        x.block_until_ready()
        assert data_ptr(to_jax(t)) == t.data_ptr() and to_torch(x).data_ptr() == data_ptr(x)
        r = max(5, reps // max(1, mb // 64))
        to_jax_us = host_us(lambda: to_jax(t), reps=r, sync=sync)
        to_torch_us = host_us(lambda: to_torch(x), reps=r, sync=sync)

        def torch_copy():
            t.clone()
            if cuda:
                torch.cuda.synchronize()

        torch_copy_us = host_us(torch_copy, reps=max(3, r // 4))
        jax_copy_us = host_us(lambda: jnp.array(x, copy=True).block_until_ready(),
                              reps=max(3, r // 4))
        rows.append(dict(device=device, mb=mb, to_jax_us=to_jax_us, to_torch_us=to_torch_us,
                         torch_copy_us=torch_copy_us, jax_copy_us=jax_copy_us,
                         copy_over_to_jax=torch_copy_us / to_jax_us,
                         copy_over_to_torch=jax_copy_us / to_torch_us))
        del t, x
        if cuda:
            torch.cuda.empty_cache()
    return rows


def _decode_step(device, bs, ctx, rng, **kw):
    pool_rows = bs + 1
    req_to_token = torch.tensor(rng.integers(16, 1 << 20, (pool_rows, ctx), dtype=np.int32),
                                device=device)  # torch-allocated: 64-byte aligned
    kv = MLATokenToKVPool(64, 16, torch.bfloat16, 1, device=device)  # unused by metadata
    backend = FuncMLAAttnBackend(req_to_token, kv, page_size=16, attention_backend="reference",
                                 **kw)
    seq = torch.from_numpy(rng.integers(ctx // 2, ctx + 1, bs).astype(np.int32))
    rpi = torch.from_numpy(rng.permutation(pool_rows)[:bs].astype(np.int32))
    fb = ForwardBatch(ForwardMode.DECODE, bs, rpi.to(device), seq.to(device), seq,
                      int(seq.sum()), None)
    return backend, fb, seq


def _no_checks(self, kind, batch, req_pool_indices, seq_lens, seq_lens_cpu, seq_lens_sum, n):
    """The step before the checks: only the host lengths it needs for its sizes."""
    arr = seq_lens_cpu[:batch].numpy()
    lens = host_checks.HostLens.__new__(host_checks.HostLens)
    lens.arr, lens.count = arr, batch
    lens.max, lens.sum = int(arr.max()), int(arr.sum(dtype=np.int64))  # max_kv_len, kv size
    return lens


def handoff_rows(device: str, batches: list[int], ctx: int, reps: int) -> list[dict]:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    rng = np.random.default_rng(0)
    rows = []
    for bs in batches:
        backend, fb, seq = _decode_step(device, bs, ctx, rng, num_heads=16)
        noplan, fb2, _ = _decode_step(device, bs, ctx, np.random.default_rng(bs), num_heads=None)
        backend.init_forward_metadata(fb)
        noplan.init_forward_metadata(fb2)
        total = int(seq.sum())
        bp = backend.buckets.batch(bs)
        cap = backend.buckets.kv_tokens(total)
        spec = backend._spec("decode", bp, cap, 0, 1)
        inputs = backend._step_inputs("decode", bs, bp, fb.req_pool_indices, fb.seq_lens)
        meta, packed = build_step(backend._req_to_token_jax, inputs, spec=spec)
        jax.block_until_ready((meta, packed))
        def handoff():  # exactly what init_forward_metadata does after the program
            return backend._eager_metadata(to_torch(packed), spec, "decode", bs, total, 1,
                                           int(seq.max()))

        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices,
                                                         fb.seq_lens, None, ForwardMode.DECODE,
                                                         None)

        def replay():
            backend.init_forward_metadata_replay_cuda_graph(bs, fb.req_pool_indices,
                                                            fb.seq_lens, total, None,
                                                            ForwardMode.DECODE, None, seq)

        def checks():
            backend._check_step("decode", bs, fb.req_pool_indices, fb.seq_lens, seq, total, 0)

        meta_rpi, meta_seq = fb.req_pool_indices.to("meta"), fb.seq_lens.to("meta")

        def checks_device_path():  # device tensors (as on a GPU): only host mirrors are read
            backend._check_step("decode", bs, meta_rpi, meta_seq, seq, total, 0)

        def lens_only():  # what the step read before the checks existed
            _no_checks(backend, "decode", bs, meta_rpi, meta_seq, seq, total, 0)

        def init_nocheck():
            real = backend_mod.FuncMLAAttnBackend._check_step
            backend_mod.FuncMLAAttnBackend._check_step = _no_checks
            try:
                backend.init_forward_metadata(fb)
            finally:
                backend_mod.FuncMLAAttnBackend._check_step = real

        backend.init_forward_metadata(fb)
        assert backend.forward_metadata.kv_indptr[-1].item() == total  # what is timed is right
        row = dict(device=device, batch=bs, bucket=bp, ctx=ctx, tokens=total, capacity=cap)
        for name, fn in (("input_import", lambda: backend._step_inputs(
                             "decode", bs, bp, fb.req_pool_indices, fb.seq_lens)),
                         ("build_dispatch", lambda: build_step(backend._req_to_token_jax, inputs,
                                                               spec=spec)),
                         ("handoff", handoff), ("checks", checks),
                         ("checks_device_path", checks_device_path), ("lens_only", lens_only),
                         ("init_nocheck", init_nocheck),
                         ("init_metadata", lambda: backend.init_forward_metadata(fb)),
                         ("init_noplan", lambda: noplan.init_forward_metadata(fb2)),
                         ("graph_replay", replay)):
            row[f"{name}_us"] = host_us(fn, reps=reps, sync=sync)
        row["check_cost_us"] = row["init_metadata_us"] - row["init_nocheck_us"]
        # on a GPU the value reads of CPU tensors are skipped: the checks' added host time there
        row["check_cost_device_path_us"] = row["checks_device_path_us"] - row["lens_only_us"]
        row["target_met"] = row["handoff_us"] <= HANDOFF_TARGET_US
        rows.append(row)
    return rows


def compile_rows(device: str, batches: list[int], ctx: int, reps: int,
                 cache: str | None = None) -> list[dict]:
    """First step at a new bucket (compile included) vs the steady state. With the persistent
    cache off (FUNCMLA_COMPILATION_CACHE=off before the first compile) this is the compile
    time; a second process with the cache on shows the cached first step."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    rng = np.random.default_rng(1)
    rows = []
    for bs in batches:
        # 32 heads: programs not compiled by handoff_rows (16 heads) in this process
        backend, fb, seq = _decode_step(device, bs, ctx, rng, num_heads=32,
                                        compilation_cache_dir=cache)
        t0 = time.perf_counter()
        backend.init_forward_metadata(fb)
        jax.block_until_ready(backend._jax_meta)
        first = time.perf_counter() - t0
        steady = host_us(lambda: backend.init_forward_metadata(fb), reps=reps, sync=sync)
        rows.append(dict(device=device, batch=bs, bucket=backend.buckets.batch(bs),
                         first_step_s=first, steady_us=steady))
    return rows


LAUNCH_TARGET_US = 60.0


def _verify_step(device, bs, ctx, rng, n, **kw):
    """A target-verify step (n draft tokens per request) on its own backend."""
    from funcmla.interop.sglang_backend import SpecInfo

    backend, fb, seq = _decode_step(device, bs, ctx, rng, num_draft_tokens=n, **kw)
    seq = seq - n  # the drafts' keys come on top: seq + n <= ctx
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, fb.req_pool_indices, seq.to(device), seq,
                      int(seq.sum()), torch.zeros(bs * n, dtype=torch.int64, device=device),
                      spec_info=SpecInfo(draft_token_num=n))
    return backend, fb, seq


def launch_rows(device: str, batches: list[int], ctx: int, reps: int, *,
                compare_jax: bool = True, out: str | None = None) -> list[dict]:
    """Part 4: metadata host time, launched (and the JAX path, with compare_jax), eager and
    CUDA-graph replay; one backend per (mode, route) for every batch (one program per bucket).
    out: a JSON file rewritten after each row (partial results survive a time limit)."""
    sync = torch.cuda.synchronize
    rows = []
    for mode, n in (("decode", 0), ("target_verify", 4)):
        for launch in (True, False) if compare_jax else (True,):
            tag = "" if launch else "_jax"
            kw = dict(num_heads=16, metadata_launcher=launch)
            backend = None
            for bs in batches:
                rng = np.random.default_rng(bs)
                fresh, fb, seq = (_decode_step(device, bs, ctx, rng, **kw) if n == 0
                                  else _verify_step(device, bs, ctx, rng, n, **kw))
                if backend is None:  # one backend for all batches; each step's own tensors
                    backend = fresh
                    backend.init_cuda_graph_state(max_bs=max(batches),
                                                  max_num_tokens=max(batches) * max(1, n))
                pool_rows = backend.req_to_token.shape[0]
                rpi = torch.from_numpy(rng.integers(0, pool_rows, bs)).to(device)  # int64
                fb.req_pool_indices, fb.seq_lens = rpi, fb.seq_lens.long()
                if mode == "decode":
                    fb.out_cache_loc = torch.zeros(bs, dtype=torch.int64, device=device)
                backend.init_forward_metadata(fb)
                sync()
                row = next((r for r in rows if (r["mode"], r["batch"]) == (mode, bs)), None)
                if row is None:
                    row = dict(mode=mode, batch=bs, ctx=ctx)
                    rows.append(row)
                if launch:
                    row["launcher_reason"] = backend.metadata_launcher_reason
                row[f"eager{tag}_us"] = host_us(lambda: backend.init_forward_metadata(fb),
                                                reps=reps, sync=sync)
                backend.init_forward_metadata_capture_cuda_graph(
                    bs, bs * max(1, n), fb.req_pool_indices, fb.seq_lens, None, fb.forward_mode,
                    fb.spec_info)

                def replay():
                    backend.init_forward_metadata_replay_cuda_graph(
                        bs, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_sum, None,
                        fb.forward_mode, fb.spec_info, fb.seq_lens_cpu)

                row[f"replay{tag}_us"] = host_us(replay, reps=reps, sync=sync)
                if launch:
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        backend.init_forward_metadata(fb)
                        replay()
                        row["sync_free"] = True
                    except RuntimeError as err:
                        row["sync_free"] = f"no: {err}"
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    row["eager_target_met"] = row["eager_us"] <= LAUNCH_TARGET_US
                    row["replay_target_met"] = row["replay_us"] <= LAUNCH_TARGET_US
                print(row, flush=True)
                if out:
                    write_json(out, {"benchmark": "interop_launch", "launch": rows})
            del backend
    return rows


def full_step_rows(device: str, batches: list[int], ctx: int, reps: int,
                   layers: int = 61) -> list[dict]:
    """Part 4: a whole decode step (metadata + 61 layers, pallas launcher) against the
    attention's device time."""
    from funcmla.config import deepseek_v3_sm_scale
    from funcmla.interop.sglang_backend import RadixAttention

    rows = []
    for bs in batches:
        rng = np.random.default_rng(bs)
        pool_rows = bs + 1
        req_to_token = torch.tensor(rng.integers(16, 1 << 16, (pool_rows, ctx), dtype=np.int32),
                                    device=device)
        kv = MLATokenToKVPool(1 << 16, 16, torch.bfloat16, layers, device=device)
        backend = FuncMLAAttnBackend(req_to_token, kv, page_size=16, num_heads=16,
                                     attention_backend="pallas")
        seq = torch.from_numpy(rng.integers(ctx // 2, ctx + 1, bs).astype(np.int64))
        rpi = torch.from_numpy(rng.permutation(pool_rows)[:bs].astype(np.int64))
        fb = ForwardBatch(ForwardMode.DECODE, bs, rpi.to(device), seq.to(device), seq,
                          int(seq.sum()), torch.zeros(bs, dtype=torch.int64, device=device))
        # one layer object and pool layer each, as a model has them
        stack = [RadixAttention(16, deepseek_v3_sm_scale(), layer_id=i) for i in range(layers)]
        q = torch.randn(bs, 16 * 576, device=device).to(torch.bfloat16)

        def step():
            backend.init_forward_metadata(fb)
            for layer in stack:
                backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)

        step()
        torch.cuda.synchronize()
        row = dict(batch=bs, ctx=ctx, layers=layers, via=backend.last_via,
                   launcher_reason=backend.metadata_launcher_reason)
        # the device synchronized after every step (and every metadata call), untimed: a step
        # queues 61+ kernels, so a sync every few steps would let the launch queue fill and
        # stall the host mid-step; these are host times alone
        row["step61_host_us"] = host_us(step, reps=max(5, reps // 10),
                                        sync=torch.cuda.synchronize, sync_every=1)
        row["metadata_host_us"] = host_us(lambda: backend.init_forward_metadata(fb),
                                          reps=reps, sync=torch.cuda.synchronize, sync_every=1)
        row["layer_host_us"] = (row["step61_host_us"] - row["metadata_host_us"]) / layers
        # the same step with every layer through mla_attention (the general entry: route,
        # fallback and launcher checks per call) instead of the step's cached launcher
        backend._launch_decode = lambda q3, layer: None
        row["step61_host_us_mla_attention"] = host_us(step, reps=max(5, reps // 10),
                                                      sync=torch.cuda.synchronize, sync_every=1)
        row["layer_host_us_mla_attention"] = (row["step61_host_us_mla_attention"]
                                              - row["metadata_host_us"]) / layers
        del backend._launch_decode
        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices,
                                                         fb.seq_lens, None, ForwardMode.DECODE,
                                                         None)
        graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for layer in stack:  # warm (the launcher's first call builds it)
                backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=side):
            for layer in stack:
                backend.forward_decode(q, None, None, layer, fb, save_kv_cache=False)
        times = []
        for _ in range(max(5, reps // 20)):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        row["attn61_device_us"] = float(np.median(times))
        row["step61_host_over_device"] = row["step61_host_us"] / row["attn61_device_us"]
        rows.append(row)
        del graph, backend
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-mb", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="1-64 MB, batches 1 and 32")
    ap.add_argument("--launch-only", action="store_true", help="Part 4 alone (CUDA)")
    ap.add_argument("--no-jax", action="store_true",
                    help="Part 4 without the JAX-path rows and the 61-layer step (shorter)")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if (torch.cuda.is_available() and
                            jax.devices()[0].platform == "gpu") else "cpu"
    launch = full = []
    if device == "cuda":
        launch = launch_rows(device, [1, 64, 256], 4096, args.reps, compare_jax=not args.no_jax,
                             out=os.path.join(args.out, "interop_launch.json"))
        print_table(
            f"metadata on torch's stream vs the JAX path, host us per step (median; target <= "
            f"{LAUNCH_TARGET_US:.0f} us)",
            ["mode", "batch", "eager", "eager JAX", "replay", "replay JAX", "sync-free"],
            [[r["mode"], r["batch"], r["eager_us"], r.get("eager_jax_us"), r["replay_us"],
              r.get("replay_jax_us"), r["sync_free"]] for r in launch])
        try:
            # 60: below its batch bucket (64), the layers' padded launch (q into the bucket's rows)
            full = [] if args.no_jax else full_step_rows(device, [1, 60, 64, 256], 4096,
                                                         args.reps)
        except Exception as err:  # noqa: BLE001 - recorded: the attention could not run here
            full = [dict(error=f"{type(err).__name__}: {err}"[:400])]
        print_table("decode step: metadata + 61 layers (host) vs the 61 layers' device time",
                    ["batch", "via", "step host us", "layer host us",
                     "layer host us (mla_attention)", "attn device us", "host/device"],
                    [[r.get("batch"), r.get("via"), r.get("step61_host_us"),
                      r.get("layer_host_us"), r.get("layer_host_us_mla_attention"),
                      r.get("attn61_device_us"), r.get("step61_host_over_device")]
                     for r in full])
    if args.launch_only:
        env = environment()
        env["torch"] = torch.__version__
        path = write_json(os.path.join(args.out, "interop_launch.json"),
                          {"benchmark": "interop_launch", "env": env, "device": device,
                           "launch": launch, "full_step": full,
                           "launch_target_us": LAUNCH_TARGET_US})
        print(f"wrote {path}")
        return launch, full
    max_mb = 64 if args.quick else args.max_mb
    sizes = [mb for mb in (1, 16, 256, 1024, 4096) if mb <= max_mb]
    batches = [1, 64] if args.quick else [1, 32, 64, 256]
    conv = conversion_rows(device, sizes, args.reps)
    print_table(
        f"DLPack conversion vs copy, host us (median, {device})",
        ["MB", "to_jax", "to_torch", "torch clone", "jax copy", "clone/to_jax",
         "copy/to_torch"],
        [[r["mb"], r["to_jax_us"], r["to_torch_us"], r["torch_copy_us"], r["jax_copy_us"],
          r["copy_over_to_jax"], r["copy_over_to_torch"]] for r in conv],
    )
    hand = handoff_rows(device, batches, 4096, args.reps)
    print_table(
        f"decode-step metadata, host us (median, {device}; hand-off target <= "
        f"{HANDOFF_TARGET_US:.0f} us)",
        ["batch", "bucket", "import", "build", "handoff", "checks", "chk dev", "chk dev cost",
         "init -chk", "init", "no plan", "replay"],
        [[r["batch"], r["bucket"], r["input_import_us"], r["build_dispatch_us"],
          r["handoff_us"], r["checks_us"], r["checks_device_path_us"],
          r["check_cost_device_path_us"], r["init_nocheck_us"], r["init_metadata_us"],
          r["init_noplan_us"], r["graph_replay_us"]] for r in hand],
    )
    comp = compile_rows(device, [1, 8, 64] if args.quick else [1, 8, 64, 256], 4096, args.reps)
    print_table(f"first step per batch bucket (compile included) vs steady state ({device})",
                ["batch", "bucket", "first step s", "steady us"],
                [[r["batch"], r["bucket"], r["first_step_s"], r["steady_us"]] for r in comp])
    env = environment()
    env["torch"] = torch.__version__
    path = write_json(os.path.join(args.out, "interop.json"),
                      {"benchmark": "interop", "env": env, "device": device,
                       "conversion": conv, "handoff": hand, "compile": comp,
                       "launch": launch, "full_step": full,
                       "handoff_target_us": HANDOFF_TARGET_US,
                       "launch_target_us": LAUNCH_TARGET_US})
    print(f"wrote {path}")
    return conv, hand, comp


if __name__ == "__main__":
    main()
