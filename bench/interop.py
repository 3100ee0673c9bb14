"""DLPack conversion cost vs a copy (1 MB .. 4 GB), and the per-step metadata hand-off cost.

    python -m bench.interop [--out out/] [--max-mb 4096] [--device auto|cpu|cuda] [--quick]

Part 1, conversion (float32 tensors of 1 MB .. --max-mb): host time of `to_jax` (torch -> JAX)
and `to_torch` (JAX -> torch), both zero-copy, against a device copy of the same tensor
(`torch.clone` and `jnp.array(copy=True)`, timed to completion). Medians; ratio copy / DLPack.

Part 2, the decode-step metadata hand-off (host time, medians), batch 1 .. 1024 with 4096-token
requests, for the packed buffer of `funcmla.interop.sglang_backend`:
  per_field_export   6 separate `to_torch` calls, one per field (the naive baseline)
  eager_handoff      1 `to_torch` of the packed buffer + the torch views + ForwardMetadata
  graph_handoff      1 `to_torch` + 1 `copy_` into the static CUDA-graph buffer (views premade)
  input_import       torch.cat of the step inputs + 1 `to_jax`
  build_dispatch     the jitted funcmla build call (returns before the device finishes)
  build_ready        the same, waited for (includes device time)
  host_lens          max / sum of the host seq_lens (NumPy)
  init_metadata      the whole `init_forward_metadata` (eager) / replay (graph), incl. the build
The issue's target is a hand-off of at most 30 us whatever the batch.
Writes out/interop.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .timing import environment, print_table, write_json
from funcmla.interop.dlpack import data_ptr, to_jax, to_torch
from funcmla.interop.sglang_backend import (
    ForwardBatch,
    ForwardMode,
    FuncMLAAttnBackend,
    MLATokenToKVPool,
    _build_step,
    _eager_forward_metadata,
    _HostLens,
    _layout,
)

HANDOFF_TARGET_US = 30.0


def host_us(fn, *, reps, sync=None, warmup=3) -> float:
    """Median host time of fn() in microseconds; `sync` (untimed) runs every 50 calls."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for i in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
        if sync and i % 50 == 49:
            sync()
    if sync:
        sync()
    return statistics.median(times) / 1e3


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


def handoff_rows(device: str, batches: list[int], ctx: int, reps: int) -> list[dict]:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    rng = np.random.default_rng(0)
    rows = []
    for bs in batches:
        pool_rows = bs + 1
        req_to_token = torch.tensor(rng.integers(16, 1 << 20, (pool_rows, ctx), dtype=np.int32),
                                    device=device)  # torch-allocated: 64-byte aligned
        kv = MLATokenToKVPool(64, 16, torch.bfloat16, 1, device=device)  # unused by metadata
        backend = FuncMLAAttnBackend(req_to_token, kv, page_size=16, attention_backend="reference")
        seq = torch.from_numpy(rng.integers(ctx // 2, ctx + 1, bs).astype(np.int32))
        rpi = torch.from_numpy(rng.permutation(pool_rows)[:bs].astype(np.int32))
        fb = ForwardBatch(ForwardMode.DECODE, bs, rpi.to(device), seq.to(device), seq,
                          int(seq.sum()), None)
        backend.init_forward_metadata(fb)
        total = int(seq.sum())
        cap = 1 << max(8, (total - 1).bit_length())
        layout = _layout(bs, cap)
        inputs = backend._step_inputs(bs, fb.req_pool_indices, fb.seq_lens)
        meta, packed = _build_step(backend._req_to_token_jax, inputs, mode="decode", batch=bs,
                                   capacity=cap, n=0, pad_to=bs)
        jax.block_until_ready((meta, packed))
        fields = [meta.kv_indptr, meta.kv_indices, meta.qo_indptr, meta.kv_last_page_len,
                  meta.max_q_len, meta.max_kv_len]

        def per_field():
            return [to_torch(f) for f in fields]

        def eager_handoff():  # exactly what init_forward_metadata does after the build
            return _eager_forward_metadata(to_torch(packed), layout, bs, total, 1,
                                           int(seq.max()), None)

        backend.init_cuda_graph_state(max_bs=bs, max_num_tokens=bs)
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, fb.req_pool_indices,
                                                         fb.seq_lens, None, ForwardMode.DECODE,
                                                         None)
        gcap = backend.buffer_plan.kv_indices_capacity
        _, gpacked = _build_step(backend._req_to_token_jax, inputs, mode="decode", batch=bs,
                                 capacity=gcap, n=0, pad_to=bs)
        gpacked.block_until_ready()
        static = backend._graph_buffer

        def graph_handoff():
            static.copy_(to_torch(gpacked))

        def input_import():
            return backend._step_inputs(bs, fb.req_pool_indices, fb.seq_lens)

        def replay():
            backend.init_forward_metadata_replay_cuda_graph(bs, fb.req_pool_indices,
                                                            fb.seq_lens, total, None,
                                                            ForwardMode.DECODE, None, seq)

        # correctness of what is timed
        fm = eager_handoff()
        assert fm.kv_indptr[-1].item() == total
        graph_handoff()
        if sync:
            sync()
        assert backend._graph_views["kv_indptr"][-1].item() == total
        def build_dispatch():  # the jitted build, not waited for
            return _build_step(backend._req_to_token_jax, inputs, mode="decode", batch=bs,
                               capacity=cap, n=0, pad_to=bs)

        def build_ready():
            jax.block_until_ready(build_dispatch())

        row = dict(device=device, batch=bs, ctx=ctx, tokens=total, capacity=cap)
        for name, fn in (("per_field_export", per_field), ("eager_handoff", eager_handoff),
                         ("graph_handoff", graph_handoff), ("input_import", input_import),
                         ("build_dispatch", build_dispatch), ("build_ready", build_ready),
                         ("host_lens", lambda: _HostLens.of(seq, bs)),
                         ("init_metadata", lambda: backend.init_forward_metadata(fb)),
                         ("graph_replay", replay)):
            row[f"{name}_us"] = host_us(fn, reps=reps, sync=sync)
        row["per_field_over_eager"] = row["per_field_export_us"] / row["eager_handoff_us"]
        row["target_met"] = min(row["eager_handoff_us"], row["graph_handoff_us"]) <= \
            HANDOFF_TARGET_US
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--max-mb", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="1-64 MB, batches 1 and 32")
    args = ap.parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if (torch.cuda.is_available() and
                            jax.devices()[0].platform == "gpu") else "cpu"
    max_mb = 64 if args.quick else args.max_mb
    sizes = [mb for mb in (1, 16, 256, 1024, 4096) if mb <= max_mb]
    batches = [1, 32] if args.quick else [1, 32, 256, 1024]
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
        f"decode-step metadata hand-off, host us (median, {device}; target <= "
        f"{HANDOFF_TARGET_US:.0f} us)",
        ["batch", "tokens", "6 exports", "eager", "graph", "import in", "build", "build+wait",
         "init (eager)", "replay", "6x/eager", "target"],
        [[r["batch"], r["tokens"], r["per_field_export_us"], r["eager_handoff_us"],
          r["graph_handoff_us"], r["input_import_us"], r["build_dispatch_us"],
          r["build_ready_us"], r["init_metadata_us"], r["graph_replay_us"],
          r["per_field_over_eager"], "met" if r["target_met"] else "MISSED"]
         for r in hand],
    )
    env = environment()
    env["torch"] = torch.__version__
    path = write_json(os.path.join(args.out, "interop.json"),
                      {"benchmark": "interop", "env": env, "device": device,
                       "conversion": conv, "handoff": hand,
                       "handoff_target_us": HANDOFF_TARGET_US})
    print(f"wrote {path}")
    return conv, hand


if __name__ == "__main__":
    main()
