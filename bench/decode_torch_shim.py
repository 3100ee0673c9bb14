"""The per-call host cost of the torch shim around the decode kernel (`--torch`): torch ->
jax.dlpack -> jitted `mla_decode` -> torch.from_dlpack, against the jitted call alone."""

from __future__ import annotations

import jax

from funcmla.attention.pallas import mla_decode

from .decode_data import D, SM_SCALE, make_case
from .report import log
from .timing import median_time_s

__all__ = ["torch_overhead"]


def torch_overhead(results: dict, reps: int = 200) -> None:
    """Per-call host cost of torch -> jax.dlpack -> kernel -> torch.from_dlpack."""
    log("== torch shim overhead")
    import torch

    b, h, ctx = 1, 16, 1024
    pools, qs, meta, _ = make_case(jax.random.PRNGKey(3), b, h, ctx, 64, 1, 1, 1)
    tq = torch.randn(b, h, D, device="cuda", dtype=torch.bfloat16)
    tpool = torch.from_dlpack(pools[0])
    g = jax.jit(lambda q, p, m: mla_decode(q, p, **m, sm_scale=SM_SCALE))
    f = lambda q, p: g(q, p, meta)  # noqa: E731

    def shim(q_t, pool_t):
        o, lse = f(jax.dlpack.from_dlpack(q_t), jax.dlpack.from_dlpack(pool_t))
        return torch.from_dlpack(o), torch.from_dlpack(lse)

    qj = jax.dlpack.from_dlpack(tq)
    for _ in range(20):
        shim(tq, tpool)
        jax.block_until_ready(f(qj, pools[0]))
    torch.cuda.synchronize()

    def per_call(fn, sync):
        return median_time_s(lambda: sync(fn()), reps=reps, warmup=0)

    t_jax = per_call(lambda: f(qj, pools[0]), jax.block_until_ready)
    t_shim = per_call(lambda: shim(tq, tpool), lambda r: torch.cuda.synchronize())
    t_jax_host = per_call(lambda: f(qj, pools[0]), lambda r: None)
    t_shim_host = per_call(lambda: shim(tq, tpool), lambda r: None)
    torch.cuda.synchronize()
    # pieces of the shim, host time each
    t_in_q = per_call(lambda: jax.dlpack.from_dlpack(tq), lambda r: None)
    t_in_pool = per_call(lambda: jax.dlpack.from_dlpack(tpool), lambda r: None)
    o_j, l_j = f(qj, pools[0])
    jax.block_until_ready(o_j)
    t_out = per_call(lambda: torch.from_dlpack(o_j), lambda r: None)
    torch.cuda.synchronize()
    d = dict(case=f"B={b} H={h} ctx={ctx} ps=64", jax_call_synced_us=t_jax * 1e6,
             shim_call_synced_us=t_shim * 1e6, jax_dispatch_us=t_jax_host * 1e6,
             shim_dispatch_us=t_shim_host * 1e6,
             shim_overhead_us=(t_shim - t_jax) * 1e6,
             from_dlpack_q_us=t_in_q * 1e6, from_dlpack_pool_us=t_in_pool * 1e6,
             torch_from_dlpack_out_us=t_out * 1e6)
    log("   " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in d.items()))
    results["torch_shim"] = d
