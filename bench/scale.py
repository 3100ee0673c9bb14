"""Decode attention across devices: tokens per second at TP 1 vs 2 and DP 1 vs 2, the
per-step metadata cost of each DP rank, and a scaling plot.

    python -m bench.scale [--out docs/results] [--quick] [--reps N]

With 2 or more GPUs (JAX CUDA) it measures the target shapes with the Pallas decode kernel:
TP over heads at H = 128 (batch 64, context 8k), DP attention at H = 16, batch 256, context
16k (128 requests per rank at DP 2; target >= 1.9x); every request is at the full context,
laid out over shuffled 64-token pages. A step's time is the wall time of the whole sharded
call, `block_until_ready` on every device (median of `--reps`); DP steps are timed without
and with the gather of the outputs to the global request order. Metadata per rank is
`rank_step` (decode metadata + the rank's work plan on its own SM count) on the rank's device.
Writes scale_<devices>.json and .png.

Without GPUs it runs the same code on 4 virtual CPU devices at small shapes with the float32
reference: a functional run (the layouts, the equality of TP 2 / DP 2 to TP 1 / DP 1), not a
scaling figure, and labelled so (scale_cpu_functional.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax

jax.config.update("jax_num_cpu_devices", 4)  # CPU only; must precede the first backend use

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from .report import card_tag  # noqa: E402
from .timing import environment, median_time_s, print_table, write_json  # noqa: E402
from funcmla.config import H200, custom_device, deepseek_v3_sm_scale  # noqa: E402
from funcmla.metadata import BufferPlan, decode_metadata  # noqa: E402
from funcmla.parallel import (  # noqa: E402
    DPLayout,
    DPRank,
    build_dp_step,
    dp_attention,
    gather_global,
    make_mesh,
    rank_rows,
    rank_step,
    split_batch,
    stack_pools,
    stack_rows,
    tp_attention_reference,
    tp_mla_decode,
)
from funcmla.parallel.placement import place, place_tree  # noqa: E402
from funcmla.planners import DecodePlanConfig  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

D = 576
PAGE = 64
SCALE = deepseek_v3_sm_scale()


@dataclasses.dataclass(frozen=True)
class Shapes:
    tp_heads: int
    tp_batch: int
    tp_ctx: int
    dp_heads: int
    dp_batch: int
    dp_ctx: int
    impl: str  # "pallas" on GPU, "reference" on CPU


GPU_SHAPES = Shapes(128, 64, 8192, 16, 256, 16384, "pallas")
CPU_SHAPES = Shapes(128, 4, 64, 16, 16, 64, "reference")


def layout_requests(batch: int, ctx: int, seed: int) -> tuple[np.ndarray, int]:
    """req_to_token [batch + 1, ctx] (row 0 unused): each request at the full context over
    shuffled pages of PAGE tokens; slot rows from 1 (page 0 reserved). Returns (table, slots)."""
    pages_per = -(-ctx // PAGE)
    rng = np.random.default_rng(seed)
    perm = rng.permutation(batch * pages_per).reshape(batch, pages_per) + 1
    t = np.arange(ctx)
    table = np.zeros((batch + 1, ctx), np.int32)
    table[1:] = perm[:, t // PAGE] * PAGE + t % PAGE
    return table, (batch * pages_per + 1) * PAGE


def random_rows(shape, dtype, device, seed):
    key = jax.device_put(jax.random.key(seed), device)
    return jax.jit(lambda k: jax.random.normal(k, shape, dtype), out_shardings=None)(key)


@jax.jit
def _request_rows(base, table, global_ids):
    """Pool content as a function of (global request, position) only, so that every DP
    degree attends over the same KV: row of (g, t) = base[(7919 g + 31 t) mod 4096]."""
    t = jnp.arange(table.shape[1])
    key = (global_ids[:, None] * 7919 + t[None, :] * 31) % base.shape[0]
    return base[key.reshape(-1)], table.reshape(-1)


def rank_pool(table, global_ids, slots, dtype, device):
    """A rank's own pool [slots, D]: its requests' rows, zero elsewhere."""
    base = random_rows((4096, D), dtype, device, 99)
    rows, where = _request_rows(base, jax.device_put(jnp.asarray(table[1:]), device),
                                jax.device_put(jnp.asarray(global_ids, jnp.int32), device))
    pool = jax.jit(lambda r, w: jnp.zeros((slots, D), dtype).at[w].set(r))(rows, where)
    return jax.block_until_ready(pool)


def time_call(fn, reps):
    return median_time_s(lambda: jax.block_until_ready(fn()), reps=reps, warmup=2)


def bench_tp(sh: Shapes, on_gpu: bool, reps: int, devices) -> list[dict]:
    """TP 1 vs 2 over heads: the pool replicated on each device, q split by heads."""
    table, slots = layout_requests(sh.tp_batch, sh.tp_ctx, seed=1)
    md = decode_metadata(table, np.arange(1, sh.tp_batch + 1, dtype=np.int32),
                         np.full(sh.tp_batch, sh.tp_ctx, np.int32),
                         capacity=sh.tp_batch * sh.tp_ctx)
    dtype = jnp.bfloat16 if sh.impl == "pallas" else jnp.float32
    q = np.asarray(random_rows((sh.tp_batch, sh.tp_heads, D), dtype, devices[0], 2))
    pool = np.asarray(random_rows((slots, D), dtype, devices[0], 3))
    rows, outs = [], {}
    for tp in (1, 2):
        if tp > len(devices):
            rows.append(dict(kind="tp", degree=tp, heads=sh.tp_heads, batch=sh.tp_batch,
                             ctx=sh.tp_ctx, note=f"not run: {len(devices)} device(s)"))
            continue
        mesh = make_mesh(tp=tp, devices=devices)
        # laid out once, outside the timed call: q by heads, the rest replicated
        q_d = place(q, NamedSharding(mesh, P(None, "tp", None)))
        pool_d, qo, kv_indptr, kv_indices = place_tree(
            (pool, md.qo_indptr, md.kv_indptr, md.kv_indices), mesh)
        if sh.impl == "pallas":
            fn = lambda: tp_mla_decode(q_d, pool_d, mesh=mesh, kv_indptr=kv_indptr,
                                       kv_indices=kv_indices, sm_scale=SCALE,
                                       max_kv_len=sh.tp_ctx, interpret=not on_gpu)
        else:
            fn = lambda: tp_attention_reference(q_d, pool_d, qo, kv_indptr, kv_indices,
                                                mesh=mesh, sm_scale=SCALE, max_kv_len=sh.tp_ctx)
        outs[tp] = np.asarray(fn()[0], np.float32)
        t = time_call(fn, reps)
        rows.append(dict(kind="tp", degree=tp, heads=sh.tp_heads, batch=sh.tp_batch,
                         ctx=sh.tp_ctx, step_us=t * 1e6, tokens_per_s=sh.tp_batch / t))
        del q_d, pool_d
    if 2 in outs:
        rows[-1]["max_abs_diff_vs_degree_1"] = float(np.abs(outs[2] - outs[1]).max())
    return rows


def bench_dp(sh: Shapes, on_gpu: bool, reps: int, devices) -> tuple[list[dict], list[dict]]:
    """DP 1 vs 2: each rank its own requests, pool, metadata and plan."""
    dtype = jnp.bfloat16 if sh.impl == "pallas" else jnp.float32
    profile = H200 if on_gpu else custom_device(8, arch="sm90", name="cpu-virtual")
    q_global = np.asarray(random_rows((sh.dp_batch, sh.dp_heads, D), dtype, devices[0], 4))
    rows, meta_rows, outs = [], [], {}
    for dp in (1, 2):
        if dp > len(devices):
            rows.append(dict(kind="dp", degree=dp, heads=sh.dp_heads, batch=sh.dp_batch,
                             ctx=sh.dp_ctx, note=f"not run: {len(devices)} device(s)"))
            continue
        mesh = make_mesh(dp=dp, devices=devices)
        split = split_batch(sh.dp_batch, dp, policy="round_robin")
        per_rank = sh.dp_batch // dp
        ranks = tuple(DPRank(BufferPlan(max_bs=per_rank, max_context_len=sh.dp_ctx), profile)
                      for _ in range(dp))
        layout = DPLayout(ranks, DecodePlanConfig(device=profile, num_heads=sh.dp_heads))
        inputs, pools = [], []
        for r in range(dp):
            table, slots = layout_requests(per_rank, sh.dp_ctx, seed=10 + r)
            inputs.append((table, np.arange(1, per_rank + 1, dtype=np.int32),
                           np.full(per_rank, sh.dp_ctx, np.int32)))
            pools.append(rank_pool(table, split.requests[r], slots, dtype, mesh.devices[r, 0]))
        step = build_dp_step(layout, mesh, inputs)
        q = stack_rows(rank_rows(q_global, split, layout), mesh)
        pool = stack_pools(pools, mesh)
        del pools
        kw = dict(sm_scale=SCALE, interpret=not on_gpu) if sh.impl == "pallas" else \
            dict(sm_scale=SCALE)
        attn = lambda: dp_attention(q, pool, step, mesh=mesh, layout=layout, impl=sh.impl, **kw)
        full = lambda: gather_global(*attn(), split, mesh=mesh)
        out = full()
        outs[dp] = (np.asarray(out[0], np.float32), split)
        t_attn, t_full = time_call(attn, reps), time_call(full, reps)
        rows.append(dict(kind="dp", degree=dp, heads=sh.dp_heads, batch=sh.dp_batch,
                         ctx=sh.dp_ctx, step_us=t_attn * 1e6, step_with_gather_us=t_full * 1e6,
                         tokens_per_s=sh.dp_batch / t_attn,
                         tokens_per_s_with_gather=sh.dp_batch / t_full))
        for r in range(dp):
            dev = mesh.devices[r, 0]
            args = jax.device_put(tuple(jnp.asarray(x) for x in inputs[r]), dev)
            build = lambda: rank_step(*args, rank=layout.ranks[r],
                                      plan_config=layout.plan_config(r))
            t = time_call(build, reps)
            meta_rows.append(dict(degree=dp, rank=r, requests=per_rank, ctx=sh.dp_ctx,
                                  num_cu=profile.num_cu, metadata_and_plan_us=t * 1e6))
        del q, pool, step
    if 2 in outs:
        rows[-1]["max_abs_diff_vs_degree_1"] = float(np.abs(outs[2][0] - outs[1][0]).max())
    return rows, meta_rows


def plot(path: str, rows: list[dict], meta: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, kind in zip(axes[:2], ("tp", "dp")):
        pts = [r for r in rows if r["kind"] == kind and "tokens_per_s" in r]
        x = [f"{kind.upper()} {r['degree']}" for r in pts]
        y = [r["tokens_per_s"] for r in pts]
        ax.bar(x, y, color=["#888", "#3a7"][: len(y)])
        for i, r in enumerate(pts):
            ratio = r["tokens_per_s"] / pts[0]["tokens_per_s"]
            ax.text(i, r["tokens_per_s"], f"{r['tokens_per_s']:.3g}/s\n{ratio:.2f}x",
                    ha="center", va="bottom", fontsize=8)
        if pts:
            ax.set_title(f"{kind.upper()}: H={pts[0]['heads']} B={pts[0]['batch']} "
                         f"ctx={pts[0]['ctx']}", fontsize=9)
        ax.set_ylabel("decode tokens / s")
        ax.set_ylim(0, 1.3 * max(y, default=1))
    ax = axes[2]
    ax.bar([f"DP{m['degree']} r{m['rank']}" for m in meta],
           [m["metadata_and_plan_us"] for m in meta], color="#57a")
    ax.set_ylabel("metadata + plan per rank per step (us)")
    ax.set_title("per-rank metadata cost", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join("docs", "results"))
    ap.add_argument("--quick", action="store_true", help="GPU: smaller DP context (4k)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--impl", choices=("auto", "pallas", "reference"), default="auto",
                    help="auto: the Pallas kernel on GPUs, the float32 reference on CPU "
                         "(pallas on CPU runs the kernel in interpret mode: a path check)")
    args = ap.parse_args(argv)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    on_gpu = bool(gpus)
    devices = gpus if on_gpu else jax.devices("cpu")[:4]
    sh = GPU_SHAPES if on_gpu else CPU_SHAPES
    if args.impl != "auto":
        sh = dataclasses.replace(sh, impl=args.impl)
    if on_gpu and args.quick:
        sh = dataclasses.replace(sh, dp_ctx=4096)
    reps = args.reps or (20 if on_gpu else 3)
    tag = f"{len(devices)}x{card_tag(devices[0].device_kind)}" if on_gpu else \
        f"cpu_functional{'_' + sh.impl if sh.impl != 'reference' else ''}"
    kind = ("scaling measurement" if on_gpu and len(devices) >= 2 else
            "single GPU: degree-2 points not run" if on_gpu else
            "FUNCTIONAL RUN on virtual CPU devices sharing the host's cores: not a scaling "
            "figure")
    rows = bench_tp(sh, on_gpu, reps, devices)
    dp_rows, meta = bench_dp(sh, on_gpu, reps, devices)
    rows += dp_rows
    for kind_ in ("tp", "dp"):
        pts = [r for r in rows if r["kind"] == kind_ and "tokens_per_s" in r]
        if len(pts) == 2:
            pts[1]["speedup"] = pts[1]["tokens_per_s"] / pts[0]["tokens_per_s"]
    print_table(f"decode across devices ({kind})",
                ["kind", "degree", "H", "B", "ctx", "step us", "tokens/s", "speedup", "diff"],
                [[r["kind"], r["degree"], r["heads"], r["batch"], r["ctx"],
                  r.get("step_us", r.get("note")), r.get("tokens_per_s", "-"),
                  r.get("speedup", "-"), r.get("max_abs_diff_vs_degree_1", "-")]
                 for r in rows])
    print_table("metadata + plan per rank per step", ["degree", "rank", "requests", "us"],
                [[m["degree"], m["rank"], m["requests"], m["metadata_and_plan_us"]]
                 for m in meta])
    payload = {"benchmark": "scale", "kind": kind, "env": environment(),
               "devices": [str(d) for d in devices], "impl": sh.impl,
               "timing": "wall time of the sharded call, block_until_ready, median",
               "reps": reps, "shapes": dataclasses.asdict(sh), "rows": rows,
               "metadata_per_rank": meta}
    if on_gpu:
        payload["dp_target_speedup"] = 1.9
    path = write_json(os.path.join(args.out, f"scale_{tag}.json"), payload)
    plot(os.path.join(args.out, f"scale_{tag}.png"), rows, meta, f"funcmla scale-out: {kind}")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
